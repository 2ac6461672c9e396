"""A P4Runtime client for one switch: arbitration, pipeline, batched writes, reads.

All gRPC lives here, and gRPC errors are translated once, at this boundary: a failed write
lists every failed update as ``At index i: CODE, 'message'``; an unreachable switch names
itself and its address. Callers see :class:`P4RuntimeError` (a user-facing error) or
:class:`SwitchUnreachable`, never a raw ``grpc.RpcError``.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable, Iterator, Sequence

import grpc
from google.rpc import code_pb2, status_pb2
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2, p4runtime_pb2_grpc

from dlcp.hostagent.errors import DlcpUserError

log = logging.getLogger(__name__)

#: Updates per Write request.
WRITE_BATCH = 256


class P4RuntimeError(DlcpUserError):
    """A P4Runtime call the switch refused; the message says which updates and why."""


class SwitchUnreachable(P4RuntimeError):
    """No P4Runtime server answers at the switch's address."""


@dataclass(frozen=True)
class Pipeline:
    """A compiled program: P4Info, BMv2 JSON, and the cookie that identifies the pair."""

    p4info: p4info_pb2.P4Info
    device_config: bytes
    cookie: int

    @classmethod
    def load(cls, p4info_path: str | Path, json_path: str | Path) -> Pipeline:
        from google.protobuf import text_format

        info = p4info_pb2.P4Info()
        try:
            text = Path(p4info_path).read_text()
            text_format.Parse(text, info)
            device = Path(json_path).read_bytes()
        except (OSError, text_format.ParseError) as exc:
            raise DlcpUserError(f"cannot load the compiled pipeline: {exc}") from exc
        cookie = int.from_bytes(hashlib.sha256(text.encode() + device).digest()[:8], "big") >> 1
        return cls(info, device, cookie)


def _code_name(code: int) -> str:
    return code_pb2.Code.Name(code) if code in code_pb2.Code.values() else str(code)


def _translate(exc: grpc.RpcError, what: str) -> P4RuntimeError:
    """Turn a gRPC error into one that lists each failed update."""
    details = []
    for key, value in (exc.trailing_metadata() or ()):
        if key == "grpc-status-details-bin":
            status = status_pb2.Status()
            status.ParseFromString(value)
            for i, any_msg in enumerate(status.details):
                err = p4runtime_pb2.Error()
                if any_msg.Unpack(err) and err.canonical_code != code_pb2.OK:
                    details.append(f"At index {i}: {_code_name(err.canonical_code)}, {err.message!r}")
    code = exc.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and not details:
        return SwitchUnreachable(f"{what}: {code.name}: {exc.details()}")
    head = f"{what} failed: {code.name}: {exc.details()}"
    return P4RuntimeError(head + ("\n  " + "\n  ".join(details) if details else ""))


class SwitchConnection:
    """An open P4Runtime session with one device, as its primary controller."""

    def __init__(self, name: str, address: str, device_id: int, election_id: tuple[int, int] = (0, 1),
                 timeout: float = 5.0) -> None:
        self.name = name
        self.address = address
        self.device_id = device_id
        self.election_id = p4runtime_pb2.Uint128(high=election_id[0], low=election_id[1])
        self.timeout = timeout
        self._channel: grpc.Channel | None = None
        self._stub: p4runtime_pb2_grpc.P4RuntimeStub | None = None
        self._requests: queue.Queue = queue.Queue()
        self._responses: queue.Queue = queue.Queue()
        self._reader: threading.Thread | None = None

    def __enter__(self) -> SwitchConnection:
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        """Connect and win arbitration as primary.

        Raises:
            SwitchUnreachable: nothing answers within the timeout.
            P4RuntimeError: another controller is primary.
        """
        where = f"switch {self.name} ({self.address}, device {self.device_id})"
        self._channel = grpc.insecure_channel(self.address)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=self.timeout)
        except grpc.FutureTimeoutError:
            self.close()
            raise SwitchUnreachable(f"{where}: no P4Runtime server answers within {self.timeout:g} s "
                                    "(is simple_switch_grpc running there?)") from None
        self._stub = p4runtime_pb2_grpc.P4RuntimeStub(self._channel)
        stream = self._stub.StreamChannel(iter(self._requests.get, None))
        self._reader = threading.Thread(target=self._read_stream, args=(stream,), daemon=True,
                                        name=f"p4rt-stream-{self.name}")
        self._reader.start()
        self._requests.put(p4runtime_pb2.StreamMessageRequest(arbitration=p4runtime_pb2.MasterArbitrationUpdate(
            device_id=self.device_id, election_id=self.election_id)))
        try:
            msg = self._responses.get(timeout=self.timeout)
        except queue.Empty:
            self.close()
            raise SwitchUnreachable(f"{where}: no arbitration answer within {self.timeout:g} s") from None
        if isinstance(msg, Exception):
            self.close()
            raise _translate(msg, f"{where}: arbitration") if isinstance(msg, grpc.RpcError) else msg
        status = msg.arbitration.status.code
        if status != code_pb2.OK:
            self.close()
            raise P4RuntimeError(f"{where}: not primary ({_code_name(status)}: {msg.arbitration.status.message}); "
                                 "another controller with a higher election id is connected")
        log.info("connected to %s as primary", where)

    def _read_stream(self, stream: Iterator) -> None:
        try:
            for msg in stream:
                if msg.HasField("arbitration"):
                    self._responses.put(msg)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self._responses.put(exc)

    def close(self) -> None:
        self._requests.put(None)
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._reader is not None:
            self._reader.join(timeout=2)
            self._reader = None

    @property
    def _rpc(self) -> p4runtime_pb2_grpc.P4RuntimeStub:
        """The P4Runtime stub of the open connection."""
        if self._stub is None:
            raise P4RuntimeError(f"switch {self.name} ({self.address}): not connected")
        return self._stub

    # --- pipeline ---------------------------------------------------------------------
    def pipeline_cookie(self) -> int | None:
        """Cookie of the installed pipeline, or None when the device has none."""
        req = p4runtime_pb2.GetForwardingPipelineConfigRequest(
            device_id=self.device_id,
            response_type=p4runtime_pb2.GetForwardingPipelineConfigRequest.COOKIE_ONLY)
        try:
            resp = self._rpc.GetForwardingPipelineConfig(req, timeout=self.timeout)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                return None
            raise _translate(exc, f"switch {self.name}: reading the pipeline") from None
        if not resp.config.HasField("cookie"):
            return None
        return resp.config.cookie.cookie

    def set_pipeline(self, pipeline: Pipeline) -> None:
        req = p4runtime_pb2.SetForwardingPipelineConfigRequest(
            device_id=self.device_id, election_id=self.election_id,
            action=p4runtime_pb2.SetForwardingPipelineConfigRequest.VERIFY_AND_COMMIT,
            config=p4runtime_pb2.ForwardingPipelineConfig(
                p4info=pipeline.p4info, p4_device_config=pipeline.device_config,
                cookie=p4runtime_pb2.ForwardingPipelineConfig.Cookie(cookie=pipeline.cookie)))
        try:
            self._rpc.SetForwardingPipelineConfig(req, timeout=max(self.timeout, 30))
        except grpc.RpcError as exc:
            raise _translate(exc, f"switch {self.name}: pushing the pipeline") from None

    # --- entities ----------------------------------------------------------------------
    def write(self, updates: Sequence[p4runtime_pb2.Update]) -> None:
        """Write ``updates`` in batches of :data:`WRITE_BATCH`."""
        for start in range(0, len(updates), WRITE_BATCH):
            req = p4runtime_pb2.WriteRequest(device_id=self.device_id, election_id=self.election_id,
                                             updates=updates[start : start + WRITE_BATCH])
            try:
                self._rpc.Write(req, timeout=max(self.timeout, 30))
            except grpc.RpcError as exc:
                raise _translate(exc, f"switch {self.name}: write of updates {start}.."
                                      f"{min(len(updates), start + WRITE_BATCH) - 1}") from None

    def read(self, entities: Iterable[p4runtime_pb2.Entity]) -> list[p4runtime_pb2.Entity]:
        req = p4runtime_pb2.ReadRequest(device_id=self.device_id, entities=list(entities))
        out: list[p4runtime_pb2.Entity] = []
        try:
            for resp in self._rpc.Read(req, timeout=max(self.timeout, 30)):
                out.extend(resp.entities)
        except grpc.RpcError as exc:
            raise _translate(exc, f"switch {self.name}: read") from None
        return out

    def read_table_entries(self, table_ids: Iterable[int],
                           defaults: Iterable[int] = ()) -> list[p4runtime_pb2.TableEntry]:
        """Entries of the given tables, and the default entries of ``defaults``."""
        ents = [p4runtime_pb2.Entity(table_entry=p4runtime_pb2.TableEntry(table_id=t)) for t in table_ids]
        ents += [p4runtime_pb2.Entity(table_entry=p4runtime_pb2.TableEntry(table_id=t, is_default_action=True))
                 for t in defaults]
        return [e.table_entry for e in self.read(ents)]

    def read_counter(self, counter_id: int) -> dict[int, tuple[int, int]]:
        """index -> (packets, bytes) for every index of an indirect counter."""
        ents = self.read([p4runtime_pb2.Entity(counter_entry=p4runtime_pb2.CounterEntry(counter_id=counter_id))])
        return {e.counter_entry.index.index: (e.counter_entry.data.packet_count, e.counter_entry.data.byte_count)
                for e in ents}
