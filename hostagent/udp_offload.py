"""Linux UDP segmentation offload (GSO) on send and UDP GRO on receive, with clean fallback.

Why: a DLCP message is thousands of equal-size datagrams, and at ~1.5 KB each the cost of
moving them is the system calls, not the bytes. With GSO one ``sendmsg`` hands the kernel up
to :data:`MAX_SEGMENTS` datagrams; with GRO one ``recvmsg`` can return several back to back.

Send (``UDP_SEGMENT``): ``sock.sendmsg(iovecs, [(SOL_UDP, UDP_SEGMENT, pack("=H", seg))])``
sends the concatenation of ``iovecs`` as datagrams of ``seg`` bytes, the last possibly shorter.
Each segment is a complete UDP datagram, so each must start with its own DLCP header: we pass
``[hdr0, pay0, hdr1, pay1, ...]`` (scatter-gather, nothing copied in Python). The kernel cuts
the byte stream at multiples of ``seg`` whatever the iovec boundaries are, so a datagram
longer than ``seg`` inside a call would silently be split and glued to its neighbour:
:func:`plan_gso_calls` makes sure that never happens.

Receive (``UDP_GRO``): after :func:`enable_gro` a read may hold several datagrams back to back;
the ancillary data then carries ``(SOL_UDP, UDP_GRO, int gso_size)``: every datagram in the
read is ``gso_size`` bytes but the last, which may be shorter. Without that message the read
is one datagram. A socket without GRO never sees coalesced reads: the kernel segments for it.

Measured on Linux 6.18, IPv4 loopback (see ``tests/unit/test_udp_offload.py``):

* the kernel accepts up to 128 segments per call (129 gives ``EINVAL``); older kernels take 64,
  so :data:`MAX_SEGMENTS` is 64. A total over 65507 bytes gives ``EMSGSIZE``;
* a GSO send arrives at a GRO receiver as exactly one read (the whole call) with the cmsg, and
  at a receiver without GRO as one read per datagram, byte-exact;
* plain (non-GSO) sends are never coalesced on loopback, GRO or not;
* a socket with ``SO_NO_CHECK`` (no UDP checksum) rejects every GSO send with ``EINVAL`` while
  plain sends work, which is the same shape of failure as a device without checksum offload
  (``EIO``): :class:`DatagramSender` falls back to one ``sendmsg`` per datagram;
* on a GRO socket the ``SO_RXQ_OVFL`` drop count counts dropped *reads* (a whole coalesced
  skb of up to 64 datagrams counts 1), not datagrams;
* GSO without GRO at the receiver moves the per-datagram cost to the receiver: an unpaced
  sender then overruns a Python receive loop (about 100k datagrams/s) and most datagrams drop.

Pure helpers (:func:`plan_gso_calls`, :func:`split_segments`, :func:`gro_segment_size`) are
kept apart from the code that touches sockets so they can be tested without a network.
"""

from __future__ import annotations

import errno
import socket
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

#: Socket level of the UDP options (``IPPROTO_UDP``).
SOL_UDP: int = getattr(socket, "SOL_UDP", 17)
#: Send option / cmsg type: the segment size of a GSO send (Linux >= 4.18).
UDP_SEGMENT: int = getattr(socket, "UDP_SEGMENT", 103)
#: Receive option / cmsg type: coalesce datagrams, report the segment size (Linux >= 5.0).
UDP_GRO: int = getattr(socket, "UDP_GRO", 104)

#: Segments per GSO call. Linux's UDP_MAX_SEGMENTS is 64 up to 6.8 and 128 after; 64 works on all.
MAX_SEGMENTS = 64
#: Bytes per GSO call: the UDP payload of one IPv4 packet (65535 - 20 IP - 8 UDP).
MAX_GSO_BYTES = 65507

#: Buffer size for a GRO read: the largest coalesced read (64 KiB) plus room for
#: :func:`split_segments` to present the short last datagram as a padded row of the same view.
GRO_BUFSIZE = 2 * 65536

#: SO_TIMESTAMPNS (Linux): each read carries its arrival time, a ``struct timespec`` on the
#: real-time clock (:data:`TIMESPEC`).
SO_TIMESTAMPNS: int = getattr(socket, "SO_TIMESTAMPNS", 35)
TIMESPEC = struct.Struct("=qq")

#: ``ancbufsize`` for ``recvmsg``/``recvmsg_into`` on a GRO socket: the UDP_GRO cmsg plus IP_TOS
#: and SO_RXQ_OVFL (each ``CMSG_SPACE(4)`` bytes), one spare, and the arrival stamp. Too small
#: a buffer truncates cmsgs (``MSG_CTRUNC``) and a lost UDP_GRO cmsg makes a coalesced read look
#: like one datagram.
GRO_ANCBUF: int = socket.CMSG_SPACE(4) * 4 + socket.CMSG_SPACE(TIMESPEC.size)

#: Errors of a GSO ``sendmsg`` that mean "this socket/route cannot do GSO": the device lacks
#: checksum offload or the route uses xfrm (EIO), the socket has no UDP checksum or the segment
#: does not fit the path MTU (EINVAL), the kernel predates UDP_SEGMENT (ENOPROTOOPT, EOPNOTSUPP).
GSO_UNSUPPORTED_ERRNOS = frozenset({errno.EIO, errno.EINVAL, errno.ENOPROTOOPT, errno.EOPNOTSUPP})

_SEG_CMSG_CACHE: dict[int, list[tuple[int, int, bytes]]] = {}


def _seg_cmsg(seg: int) -> list[tuple[int, int, bytes]]:
    """The ancillary data for a GSO send of ``seg``-byte segments (cached: sizes repeat)."""
    cmsg = _SEG_CMSG_CACHE.get(seg)
    if cmsg is None:
        cmsg = [(SOL_UDP, UDP_SEGMENT, struct.pack("=H", seg))]
        _SEG_CMSG_CACHE[seg] = cmsg
    return cmsg


def gso_supported(sock: socket.socket) -> bool:
    """True if the kernel accepts UDP_SEGMENT on this socket (getsockopt probe, sends nothing).

    Why a probe and not a test send: it costs nothing and leaves no datagram behind. It cannot
    see a route whose device lacks checksum offload (that only shows as ``EIO`` on the first GSO
    send), which is why :class:`DatagramSender` also falls back on send errors.
    """
    try:
        sock.getsockopt(SOL_UDP, UDP_SEGMENT)
    except OSError:
        return False
    return sock.type == socket.SOCK_DGRAM


def plan_gso_calls(
    sizes: np.ndarray, max_segments: int = MAX_SEGMENTS, max_bytes: int = MAX_GSO_BYTES
) -> list[tuple[int, int, int]]:
    """Pure: split a run of datagram sizes (in send order) into sendmsg calls: (start, stop, seg_size).

    Within one call every datagram but the last has exactly ``seg_size`` bytes and the last is
    ``<= seg_size`` (that is all a GSO call can express: the kernel cuts the bytes every
    ``seg_size``); a datagram larger than the previous ones starts a new call; a call of one
    datagram (``stop - start == 1``) is just a plain send. Each call has at most
    ``max_segments`` datagrams and ``max_bytes`` bytes. An empty datagram, or one larger than
    ``max_bytes``, is a call of its own (the kernel then sends or rejects it as a plain send).

    The loop runs once per call, not per datagram: runs of equal sizes are found with numpy.

    Example: ``plan_gso_calls(np.array([1472] * 100 + [500])) ==
    [(0, 44, 1472), (44, 88, 1472), (88, 101, 1472)]``
    """
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
    n = sizes.size
    if max_segments < 1 or max_bytes < 1:
        raise ValueError(f"max_segments={max_segments} and max_bytes={max_bytes} must be >= 1")
    if n == 0:
        return []
    # run_end[i]: index one past the run of equal sizes that contains i.
    boundaries = np.flatnonzero(sizes[1:] != sizes[:-1]) + 1
    ends = np.append(boundaries, n)
    run_end = np.repeat(ends, np.diff(np.concatenate(([0], ends))))
    size_list = sizes.tolist()
    run_end_list = run_end.tolist()
    calls: list[tuple[int, int, int]] = []
    i = 0
    while i < n:
        seg = size_list[i]
        if seg <= 0 or seg > max_bytes:
            calls.append((i, i + 1, seg))
            i += 1
            continue
        room = min(max_segments, max_bytes // seg)
        stop = i + min(room, run_end_list[i] - i)
        # A shorter datagram may end the call (GSO's short last segment), even when the full
        # ones already took all the bytes a whole number of segments allows.
        if stop < n and stop - i < max_segments:
            nxt = size_list[stop]
            if 0 < nxt < seg and (stop - i) * seg + nxt <= max_bytes:
                stop += 1
        calls.append((i, stop, seg))
        i = stop
    return calls


def _nbytes(buf: Any) -> int:
    """Byte length of a buffer (memoryview, bytes, bytearray or numpy array)."""
    nbytes = getattr(buf, "nbytes", None)
    return len(buf) if nbytes is None else int(nbytes)


class DatagramSender:
    """Sends runs of datagrams given as (header, payload) buffer pairs on one connected UDP socket.

    By GSO where the kernel takes it, else one sendmsg per datagram. Counts syscalls and
    datagrams, and whether GSO is in use (attribute ``gso``), and why it was turned off
    (``gso_off_reason``). Why a class: the "GSO does not work here" verdict is per socket (it
    depends on the route's device) and must stick once learnt, so the sender does not pay a
    failing system call for every batch.

    Not thread-safe: use one sender per socket per thread. Meant for blocking sockets.
    """

    def __init__(self, sock: socket.socket, use_gso: bool = True) -> None:
        self.sock = sock
        self.max_segments = MAX_SEGMENTS
        self.max_bytes = MAX_GSO_BYTES
        self.gso: bool = False
        self.gso_off_reason: str | None = "turned off by the caller (use_gso=False)"
        if use_gso:
            if gso_supported(sock):
                self.gso, self.gso_off_reason = True, None
            else:
                self.gso_off_reason = "kernel refuses UDP_SEGMENT on this socket (getsockopt probe)"
        #: System calls made (failed ones included).
        self.syscalls = 0
        #: Datagrams and bytes the kernel accepted.
        self.datagrams = 0
        self.bytes = 0
        #: Datagrams not sent because their sendmsg failed (each counted once).
        self.errors = 0
        #: GSO calls that failed and were resent one datagram at a time.
        self.fallbacks = 0
        #: The most recent send error, for logs.
        self.last_error: OSError | None = None

    def send(
        self,
        buffers: Sequence[tuple[Any, Any]],
        sizes: np.ndarray | None = None,
    ) -> tuple[int, int]:
        """Send every datagram; returns (datagrams sent, bytes sent).

        Args:
            buffers: ``(header, payload)`` per datagram, in send order; any objects with the
                buffer protocol (memoryview, bytes, numpy arrays). Not copied.
            sizes: byte length of each datagram if the caller already has them (saves a Python
                pass over ``buffers``); must match the buffers.

        A failing datagram (e.g. ECONNREFUSED from an ICMP error of an earlier send) is skipped
        and counted in ``errors``, not raised, so one bad send does not kill the sender thread.
        When a GSO call fails, its datagrams are resent one by one (so each datagram gets its
        own chance, exactly as without GSO); if the error says GSO cannot work on this socket
        (:data:`GSO_UNSUPPORTED_ERRNOS`), GSO is turned off for good and the reason recorded.
        """
        n = len(buffers)
        if n == 0:
            return 0, 0
        if not self.gso:
            return self._send_each(buffers, 0, n)
        if sizes is None:
            sizes = np.fromiter(
                (_nbytes(h) + _nbytes(p) for h, p in buffers), dtype=np.int64, count=n
            )
        elif len(sizes) != n:
            raise ValueError(f"{len(sizes)} sizes for {n} datagrams")
        sent = nbytes = 0
        for start, stop, seg in plan_gso_calls(sizes, self.max_segments, self.max_bytes):
            if stop - start == 1 or not self.gso:
                d, b = self._send_each(buffers, start, stop)
                sent += d
                nbytes += b
                continue
            iov: list[Any] = []
            for h, p in buffers[start:stop]:
                iov.append(h)
                iov.append(p)
            gso_bytes = self._gso_call(iov, seg, stop - start)
            if gso_bytes is None:  # refused: resend this call's datagrams one by one
                d, b = self._send_each(buffers, start, stop)
            else:
                d, b = stop - start, gso_bytes
            sent += d
            nbytes += b
        return sent, nbytes

    def _gso_call(self, iov: list[Any], seg: int, count: int) -> int | None:
        """One GSO ``sendmsg`` of ``count`` datagrams; the bytes sent, or None when it failed
        (the caller resends one by one). An error that says GSO cannot work on this socket
        turns GSO off for good, with the reason."""
        self.syscalls += 1
        try:
            b = self.sock.sendmsg(iov, _seg_cmsg(seg))
        except OSError as exc:
            self.fallbacks += 1
            self.last_error = exc
            if exc.errno in GSO_UNSUPPORTED_ERRNOS:
                self.gso = False
                name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
                self.gso_off_reason = f"sendmsg with UDP_SEGMENT failed: {name} ({exc.strerror})"
            return None
        self.datagrams += count
        self.bytes += b
        return b

    def send_rows(self, rows: np.ndarray) -> tuple[int, int]:
        """Send each row of a contiguous 2-D ``uint8`` array as one datagram (all the same size).

        The fast path for full-size packets: the caller lays headers and payloads out as rows
        of a staging buffer (one numpy copy), and the whole run leaves in
        ``ceil(rows / max_segments)`` system calls with no per-datagram Python work; without
        GSO, one ``send`` per row. Returns (datagrams sent, bytes sent); failures are counted
        as in :meth:`send`.
        """
        if rows.ndim != 2 or rows.dtype != np.uint8 or not rows.flags.c_contiguous:
            raise ValueError("rows must be a C-contiguous 2-D uint8 array")
        n, seg = rows.shape
        if n == 0:
            return 0, 0
        per_call = max(1, min(self.max_segments, self.max_bytes // max(1, seg)))
        flat = rows.reshape(-1).data
        sent = nbytes = 0
        start = 0
        while start < n:
            stop = min(n, start + per_call)
            if self.gso and stop - start > 1:
                b = self._gso_call([flat[start * seg : stop * seg]], seg, stop - start)
                if b is not None:
                    sent += stop - start
                    nbytes += b
                    start = stop
                    continue
            for i in range(start, stop):  # one datagram per call
                self.syscalls += 1
                try:
                    b = self.sock.send(flat[i * seg : (i + 1) * seg])
                except OSError as exc:
                    self.errors += 1
                    self.last_error = exc
                    continue
                self.datagrams += 1
                self.bytes += b
                sent += 1
                nbytes += b
            start = stop
        return sent, nbytes

    def _send_each(self, buffers: Sequence[tuple[Any, Any]], start: int, stop: int) -> tuple[int, int]:
        """One sendmsg per datagram; failures are counted, not raised."""
        sock = self.sock
        sent = nbytes = 0
        for h, p in buffers[start:stop]:
            self.syscalls += 1
            try:
                b = sock.sendmsg([h, p])
            except OSError as exc:
                self.errors += 1
                self.last_error = exc
                continue
            sent += 1
            nbytes += b
        self.datagrams += sent
        self.bytes += nbytes
        return sent, nbytes

    def stats(self) -> dict[str, Any]:
        """Counters as a dict, for logs and the transport's stats."""
        return {
            "gso": self.gso, "gso_off_reason": self.gso_off_reason, "syscalls": self.syscalls,
            "datagrams": self.datagrams, "bytes": self.bytes, "errors": self.errors,
            "gso_fallbacks": self.fallbacks,
        }


def enable_gro(sock: socket.socket) -> bool:
    """Turn UDP_GRO on; False if the kernel refuses (then reads hold one datagram).

    Why optional: GRO only pays off when the sender or the NIC coalesces; a receiver must
    handle both kinds of read anyway (:func:`gro_segment_size` says which one it got).
    """
    try:
        sock.setsockopt(SOL_UDP, UDP_GRO, 1)
    except OSError:
        return False
    return True


def enable_arrival_stamps(sock: socket.socket) -> bool:
    """Have the kernel stamp each read with its arrival time (SO_TIMESTAMPNS); False if refused.

    Why: a receive thread that is behind still has datagrams queued in the socket. Their stamps
    say up to when everything that arrived has been read, so an end of pass is answered as soon
    as the message's grace has passed in arrival time, not only when the socket runs dry (a
    socket that other messages keep busy may never run dry).
    """
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


def gro_segment_size(ancdata: Iterable[tuple[int, int, bytes]]) -> int | None:
    """The gso_size from a recvmsg's ancillary data, or None when the read is one datagram.

    The kernel sends a native ``int`` (4 bytes, host byte order). Check ``MSG_CTRUNC`` in the
    recvmsg flags as well: if the cmsg buffer was too small this message may be missing.
    """
    for level, kind, data in ancdata:
        if level == SOL_UDP and kind == UDP_GRO and len(data) >= 4:
            seg = struct.unpack("=i", data[:4])[0]
            return seg if seg > 0 else None
    return None


def split_segments(buf: np.ndarray, nbytes: int, seg: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Pure: the datagrams of one read as ``(rows, lengths)``.

    ``rows`` is a 2-D ``uint8`` array with one datagram per row, ``rows[i, :lengths[i]]`` being
    datagram ``i``; ``lengths`` (int64) is the byte length of each. The rows are ``seg`` bytes
    wide. Why one matrix: the receive path processes datagrams as rows of a slot matrix, and a
    reshape of the read buffer is free.

    * ``seg`` None (no GRO cmsg) or ``nbytes <= seg``: one row of ``nbytes`` bytes.
    * Otherwise ``ceil(nbytes / seg)`` rows. If ``buf`` holds at least ``rows * seg`` bytes
      (always true with :data:`GRO_BUFSIZE`), ``rows`` is a zero-copy view of ``buf`` — the short
      last datagram is a padded row whose bytes past ``lengths[-1]`` are whatever ``buf`` held
      there (stale, not zeroed; nothing is written to ``buf``). If ``buf`` is too short for the
      padded row, ``rows`` is a copy with zero padding.

    A view aliases ``buf``: consume it before the next read into the same buffer.
    """
    if not isinstance(buf, np.ndarray) or buf.ndim != 1 or buf.dtype != np.uint8 or not buf.flags.c_contiguous:
        raise ValueError("buf must be a contiguous 1-D uint8 numpy array")
    if not 0 <= nbytes <= buf.size:
        raise ValueError(f"nbytes={nbytes} is outside the buffer's 0..{buf.size}")
    if seg is None or nbytes <= seg:
        return buf[:nbytes].reshape(1, nbytes), np.array([nbytes], dtype=np.int64)
    if seg <= 0:
        raise ValueError(f"segment size {seg} must be positive")
    rows_n = -(-nbytes // seg)
    lengths = np.full(rows_n, seg, dtype=np.int64)
    lengths[-1] = nbytes - (rows_n - 1) * seg
    if rows_n * seg <= buf.size:
        return buf[: rows_n * seg].reshape(rows_n, seg), lengths
    rows = np.zeros((rows_n, seg), dtype=np.uint8)
    rows.reshape(-1)[:nbytes] = buf[:nbytes]
    return rows, lengths
