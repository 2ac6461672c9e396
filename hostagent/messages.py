"""What the transport tracks per message, and what callers wait on.

A :class:`SendHandle` or :class:`RecvHandle` is a small future: ``wait(timeout)`` returns
the result or raises the transport's error for that message. Every wait has a deadline;
there is no way to wait forever.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from hostagent.packetizer import PacketBatch
from hostagent.reassembly import Assembly


class TransportError(RuntimeError):
    """A message could not be delivered; the message names the peer and the message."""


class PeerUnreachable(TransportError):
    """A peer never accepted a control connection."""


class PeerFailed(TransportError):
    """A peer's control connection closed while messages to or from it were in flight."""


class TransportTimeout(TransportError):
    """A message passed its deadline."""


class TransportClosed(TransportError):
    """The endpoint was closed while the message was in flight."""


@dataclass
class MessageStats:
    """Per-message figures, for logs and reports (``as_dict`` for JSON)."""

    peer: int
    message_id: int
    direction: str  # "send" or "recv"
    elements: int
    packets: int
    bytes: int
    loss_bound: float
    priority: int = 0
    lost_fraction: float = 0.0
    retransmissions: int = 0
    duplicates: int = 0
    probes: int = 0
    completion_time: float = 0.0
    how: str = ""  # exact | bounded | idle (receiver) ; stopped (sender)
    started: float = 0.0
    """Monotonic time the message began (send() called; receiver: announced or posted)."""
    first_arrival: float | None = None
    """Receiver: monotonic time of its first data packet."""
    recovery_started: float | None = None
    """Monotonic time of its first recovery round (receiver: first BITMAP; sender: first pass
    over with packets missing), None when nothing needed recovering."""
    finished_at: float = 0.0
    """Monotonic time it completed."""
    lost_packets: np.ndarray | None = field(default=None, repr=False, compare=False)
    """Sender side: sequence numbers the receiver never got (None when nothing was lost)."""

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("lost_packets", None)
        return out


@dataclass(frozen=True, slots=True)
class RateChange:
    """One change of the pacing rate towards a destination (:attr:`Endpoint.rate_log`)."""

    time: float  # monotonic seconds
    dest: int
    rate: float  # the pacing rate from now on, bytes/s (the controller's, capped by the ceiling)
    cause: str  # "start", "marks" (CE or loss in a FEEDBACK), "loss" (a BITMAP), "ceiling", "increase"


class _Handle:
    """A one-shot result slot with a deadline-bounded wait."""

    def __init__(self, peer: int, message_id: int, what: str) -> None:
        self.peer = peer
        self.message_id = message_id
        self._what = what
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def _resolve(self, result: Any) -> None:
        if not self._event.is_set():
            self._result = result
            self._event.set()

    def _fail(self, error: BaseException) -> None:
        if not self._event.is_set():
            self._error = error
            self._event.set()

    def wait(self, timeout: float) -> Any:
        """The result, or the message's error; :class:`TransportTimeout` after ``timeout`` s."""
        if not self._event.wait(timeout):
            raise TransportTimeout(f"{self._what} message {self.message_id} with rank {self.peer}: "
                                   f"no result within {timeout:g} s")
        if self._error is not None:
            raise self._error
        return self._result


class SendHandle(_Handle):
    """Resolves to the sender's :class:`MessageStats` once the receiver said STOP."""

    def __init__(self, peer: int, message_id: int) -> None:
        super().__init__(peer, message_id, "send")


@dataclass(frozen=True)
class Expect:
    """What a receiver already knows of a message it asks for, so the sender needs no META.

    In a collective the receiver knows every size in advance (a PS worker's pull has the size
    of its push; a ring step's chunk is fixed), and an announcement would only cost a control
    frame. The sender must then send with ``announce=False`` and the same element type; both
    ends use the job's MTU, so they cut packets alike.
    """

    total_elems: int
    dtype: Any
    loss_bound: float

    def __post_init__(self) -> None:
        if self.total_elems < 0 or not 0 <= self.loss_bound < 1:
            raise ValueError(f"Expect needs total_elems >= 0 and 0 <= loss_bound < 1, got {self.total_elems}, "
                             f"{self.loss_bound}")


@dataclass(frozen=True)
class RecvResult:
    """A received message: the data (missing elements zero) and its figures."""

    data: np.ndarray
    stats: MessageStats
    received: np.ndarray | None = None
    """Per packet: did it arrive (``None`` when every packet did)."""
    elems_per_packet: int = 1
    packet_priorities: np.ndarray | None = field(default=None, repr=False, compare=False)
    """Per packet: the priority it carried (the message's own for packets that never came or
    came as retransmissions), so a server can reply with the same per-layer tags."""
    packet_layers: np.ndarray | None = field(default=None, repr=False, compare=False)
    """Per packet: the layer field it carried."""

    def present_elements(self) -> np.ndarray:
        """1.0 for each element that arrived, 0.0 for each zero-filled one (float32)."""
        if self.received is None:
            return np.ones(self.data.size, dtype=np.float32)
        return np.repeat(self.received.astype(np.float32), self.elems_per_packet)[: self.data.size]


class RecvHandle(_Handle):
    """Resolves to a :class:`RecvResult` once the message completed under its bound."""

    def __init__(self, peer: int, message_id: int, out: np.ndarray | None) -> None:
        super().__init__(peer, message_id, "receive")
        self.out = out


class OutMessage:
    """Sender-side state of one message.

    Packets go out in order of their own priority (a fused message carries several layers:
    its most urgent packets leave first), ties in sequence order; retransmissions go before
    everything else.
    """

    def __init__(self, dest: int, batch: PacketBatch, priority: int, loss_bound: float,
                 deadline: float, order: int, announce: bool = True) -> None:
        self.dest = dest
        self.batch = batch
        self.message_id = int(batch.headers["message_id"][0]) if len(batch) else 0
        self.priority = priority
        self.loss_bound = loss_bound
        self.deadline = deadline
        self.order = order  # FIFO among equal priorities
        self.announce = announce
        self.handle = SendHandle(dest, self.message_id)
        self.started = time.monotonic()
        prio = batch.headers["priority"]
        if len(prio) and prio.min() != prio.max():
            self.send_order = np.argsort(-prio.astype(np.int16), kind="stable")
            self._prio_in_order = prio[self.send_order]
        else:
            self.send_order = np.arange(len(batch), dtype=np.int64)
            self._prio_in_order = None
        self.header_rows = batch.headers.view(np.uint8).reshape(len(batch), batch.headers.dtype.itemsize)
        """Each packet's header as a row of bytes (a view)."""
        per, itemsize = batch.elems_per_packet, batch.payload.itemsize
        self.payload_rows = batch.payload[: (batch.payload.size // per) * per].view(np.uint8).reshape(
            batch.payload.size // per, per * itemsize)
        """Each full packet's payload as a row of bytes (a view of the caller's array)."""
        self.next_seq = 0  # position in send_order of the first pass
        self.retx: np.ndarray = np.zeros(0, dtype=np.int64)  # queued retransmissions
        self.retx_pos = 0
        self.retransmissions = 0
        self.probes = 0
        self.awaiting_reply = False
        self.pass_done_at: float | None = None  # when the first pass (or a retransmission round) ended
        self.probe_sent_at: float | None = None
        self.reported_missing = 0
        self.stopped = False
        self.first_retx_at: float | None = None  # when the first retransmission was queued

    @property
    def sending_priority(self) -> int:
        """Retransmissions are queued at the top priority, so they jump the line; otherwise the
        priority of the next packet of the first pass."""
        if self.retx_pos < len(self.retx):
            return 255
        if self._prio_in_order is not None and self.next_seq < len(self._prio_in_order):
            return int(self._prio_in_order[self.next_seq])
        return self.priority

    def next_run(self, limit: int) -> np.ndarray:
        """Sequence numbers of the next up to ``limit`` first-pass packets, all of one priority."""
        stop = min(self.next_seq + limit, len(self.batch))
        if self._prio_in_order is not None and stop > self.next_seq:
            same = self._prio_in_order[self.next_seq : stop] == self._prio_in_order[self.next_seq]
            if not same.all():
                stop = self.next_seq + int(np.argmin(same))
        seqs = self.send_order[self.next_seq : stop]
        self.next_seq = stop
        return seqs

    def has_packets(self) -> bool:
        return not self.stopped and (self.next_seq < len(self.batch) or self.retx_pos < len(self.retx))

    def stats(self, how: str, lost_fraction: float) -> MessageStats:
        return MessageStats(
            peer=self.dest, message_id=self.message_id, direction="send", elements=self.batch.payload.size,
            packets=len(self.batch), bytes=self.batch.nbytes, loss_bound=self.loss_bound, priority=self.priority,
            retransmissions=self.retransmissions, probes=self.probes,
            completion_time=time.monotonic() - self.started, how=how, lost_fraction=lost_fraction,
            started=self.started, recovery_started=self.first_retx_at, finished_at=time.monotonic(),
        )


class InMessage:
    """Receiver-side state of one message."""

    def __init__(self, src: int, assembly: Assembly, loss_bound: float, deadline: float,
                 handle: RecvHandle | None, priority: int = 0) -> None:
        self.src = src
        self.priority = priority
        self.assembly = assembly
        self.message_id = assembly.key[1]
        self.loss_bound = loss_bound
        self.deadline = deadline
        self.handle = handle
        self.started = time.monotonic()
        self.last_arrival = self.started
        self.first_arrival: float | None = None
        self.first_bitmap_at: float | None = None
        self.pace: float | None = None  # mean packet gap of the first pass, fixed at the first BITMAP
        self.probe_pending = False
        self.bitmap_sent_at: float | None = None  # for the receiver's RTT estimate
        self.probes = 0
        self.retx_seen = 0
        self.result: RecvResult | None = None

    def finish(self, how: str) -> RecvResult:
        asm = self.assembly
        stats = MessageStats(
            peer=self.src, message_id=self.message_id, direction="recv", elements=asm.total_elems,
            packets=asm.total_pkts, bytes=asm.data.nbytes, loss_bound=self.loss_bound, priority=self.priority,
            lost_fraction=asm.lost_fraction, retransmissions=self.retx_seen, duplicates=asm.duplicates,
            probes=self.probes, completion_time=time.monotonic() - self.started, how=how,
            started=self.started, first_arrival=self.first_arrival, recovery_started=self.first_bitmap_at,
            finished_at=time.monotonic(),
        )
        received = None if asm.is_exact() else asm.received.copy()
        self.result = RecvResult(asm.result(), stats, received, asm.elems_per_packet, asm.pkt_priority, asm.pkt_layer)
        return self.result
