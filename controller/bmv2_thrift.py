"""BMv2 over its Thrift port: rates and depths of priority queues, and register reads.

P4Runtime has no call for BMv2's traffic-manager knobs, and BMv2's P4Runtime server does not
read registers; ``simple_switch_CLI`` reaches both over Thrift. This is a minimal client for
the calls DLCP needs, written against the Thrift binary protocol and BMv2's ``simple_switch``
and ``standard`` services (``simple_switch.thrift``, ``standard.thrift``), so it needs neither
the ``thrift`` package nor BMv2's generated Python modules (which install for the system
Python only). Queue calls return BMv2's status code; non-zero raises.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from dlcp.hostagent.errors import DlcpUserError

_VERSION_1 = 0x80010000
_CALL, _REPLY, _EXCEPTION = 1, 2, 3
_T_STOP, _T_BOOL, _T_BYTE, _T_DOUBLE, _T_I16, _T_I32, _T_I64, _T_STRING, _T_STRUCT = 0, 2, 3, 4, 6, 8, 10, 11, 12
_T_MAP, _T_SET, _T_LIST = 13, 14, 15
_SERVICE = "simple_switch"
T = TypeVar("T")


class ThriftError(DlcpUserError):
    """The switch's Thrift server is unreachable or refused a call."""


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def take(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ThriftError("the switch closed the Thrift connection")
            buf += chunk
        return buf

    def i8(self) -> int:
        return struct.unpack("!b", self.take(1))[0]

    def i16(self) -> int:
        return struct.unpack("!h", self.take(2))[0]

    def i32(self) -> int:
        return struct.unpack("!i", self.take(4))[0]

    def string(self) -> bytes:
        return self.take(self.i32())

    def skip(self, ftype: int) -> None:
        sizes = {_T_BOOL: 1, _T_BYTE: 1, _T_DOUBLE: 8, _T_I16: 2, _T_I32: 4, _T_I64: 8}
        if ftype in sizes:
            self.take(sizes[ftype])
        elif ftype == _T_STRING:
            self.string()
        elif ftype == _T_STRUCT:
            self.struct()
        elif ftype in (_T_SET, _T_LIST):
            et, n = self.i8(), self.i32()
            for _ in range(n):
                self.skip(et)
        elif ftype == _T_MAP:
            kt, vt, n = self.i8(), self.i8(), self.i32()
            for _ in range(n):
                self.skip(kt)
                self.skip(vt)
        else:
            raise ThriftError(f"unexpected Thrift type {ftype} in a reply")

    def struct(self) -> dict[int, object]:
        fields: dict[int, object] = {}
        while True:
            ftype = self.i8()
            if ftype == _T_STOP:
                return fields
            fid = self.i16()
            if ftype == _T_I32:
                fields[fid] = self.i32()
            elif ftype == _T_LIST:
                et, n = self.i8(), self.i32()
                if et != _T_I64:
                    raise ThriftError(f"unexpected list of Thrift type {et} in a reply")
                fields[fid] = list(struct.unpack(f"!{n}q", self.take(8 * n)))
            elif ftype == _T_STRING:
                fields[fid] = self.string().decode(errors="replace")
            else:
                self.skip(ftype)
                fields[fid] = None


_CLONE_NEWNET = 0x40000000


def in_netns(netns: str | None, make: Callable[[], T]) -> T:
    """``make()`` run inside network namespace ``netns`` (None: here), e.g. to create a socket
    that belongs to that namespace. A short-lived thread enters the namespace (setns affects
    only the calling thread), calls ``make`` and hands its result back."""
    if netns is None:
        return make()
    result: dict[str, object] = {}

    def work() -> None:
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {netns} failed (root needed)")
            finally:
                os.close(fd)
            result["value"] = make()
        except OSError as exc:
            result["error"] = exc

    t = threading.Thread(target=work, name=f"netns-{netns}")
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["value"]  # type: ignore[return-value]


def connect_in_netns(netns: str | None, host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection made from inside network namespace ``netns`` (None: this one)."""
    return in_netns(netns, lambda: socket.create_connection((host, port), timeout=timeout))


class SimpleSwitchThrift:
    """Queue knobs of one BMv2 ``simple_switch``/``simple_switch_grpc`` over Thrift."""

    def __init__(self, host: str, port: int, timeout: float = 5.0, netns: str | None = None) -> None:
        self.host, self.port, self.timeout, self.netns = host, port, timeout, netns
        self._seq = 0

    def _call(self, method: str, args: Sequence[tuple[int, int, object]], service: str = _SERVICE):
        """Call ``method`` with (thrift type, field id, value) args; returns its result (an i32
        status, or a list of i64)."""
        self._seq += 1
        name = f"{service}:{method}".encode()
        msg = struct.pack("!I", _VERSION_1 | _CALL) + struct.pack("!i", len(name)) + name + struct.pack("!i", self._seq)
        for ftype, fid, value in args:
            msg += struct.pack("!bh", ftype, fid)
            if ftype == _T_STRING:
                raw = str(value).encode()
                msg += struct.pack("!i", len(raw)) + raw
            else:
                msg += struct.pack("!q" if ftype == _T_I64 else "!i", value)
        msg += struct.pack("!b", _T_STOP)
        where = f"BMv2 Thrift {self.host}:{self.port}" + (f" in netns {self.netns}" if self.netns else "")
        try:
            with connect_in_netns(self.netns, self.host, self.port, self.timeout) as sock:
                sock.sendall(msg)
                r = _Reader(sock)
                head = r.i32() & 0xFFFFFFFF
                if head & 0xFFFF0000 != _VERSION_1:
                    raise ThriftError(f"{where}: not a Thrift binary reply")
                mtype = head & 0xFF
                r.string()
                r.i32()
                body = r.struct()
        except OSError as exc:
            raise ThriftError(f"{where}: {method} failed: {exc} "
                             "(is the switch running with this thrift port?)") from exc
        if mtype == _EXCEPTION:
            raise ThriftError(f"{where}: {method} raised: {body.get(1)}")
        if mtype != _REPLY or 0 not in body:
            raise ThriftError(f"{where}: {method} failed: {body}" if body else f"{where}: {method} gave no result")
        return body[0]

    def register_read_all(self, name: str) -> list[int]:
        """Every cell of register array ``name`` (its name in the BMv2 JSON)."""
        return self._call("bm_register_read_all", [(_T_I32, 1, 0), (_T_STRING, 2, name)], service="standard")

    def _check(self, method: str, args: list[tuple[int, int, int]]) -> None:
        code = int(self._call(method, args))
        if code != 0:
            raise ThriftError(f"BMv2 Thrift {self.host}:{self.port}: {method}{tuple(a[2] for a in args)} "
                              f"returned error {code} (is the port or priority valid?)")

    def set_queue_rate(self, port: int, pps: int, priority: int | None = None) -> None:
        """Rate limit (packets per second) of one priority queue of ``port``, or of all of them."""
        if priority is None:
            self._check("set_egress_queue_rate", [(_T_I32, 1, port), (_T_I64, 2, pps)])
        else:
            self._check("set_egress_priority_queue_rate", [(_T_I32, 1, port), (_T_I32, 2, priority), (_T_I64, 3, pps)])

    def set_queue_depth(self, port: int, depth: int, priority: int | None = None) -> None:
        """Depth (packets) of one priority queue of ``port``, or of all of them."""
        if priority is None:
            self._check("set_egress_queue_depth", [(_T_I32, 1, port), (_T_I32, 2, depth)])
        else:
            self._check("set_egress_priority_queue_depth",
                        [(_T_I32, 1, port), (_T_I32, 2, priority), (_T_I32, 3, depth)])
