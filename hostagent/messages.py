"""What the transport tracks per message, and what callers wait on.

A :class:`SendHandle` or :class:`RecvHandle` is a small future: ``wait(timeout)`` returns
the result or raises the transport's error for that message. Every wait has a deadline;
there is no way to wait forever.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, fields
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np



class TransportError(RuntimeError):
    """A message could not be delivered; the message names the peer and the message."""


class PeerUnreachable(TransportError):
    """A peer never accepted a control connection."""


class PeerFailed(TransportError):
    """A peer's control connection closed while messages to or from it were in flight."""


class TransportTimeout(TransportError):
    """A message passed its deadline."""


class MessageMismatch(TransportError):
    """The two ends of a message disagree on its shape: the sender's element type, element count
    or elements per packet differ from what the receiver expects (a collective's tensors that
    differ across ranks, or an MTU that differs). The receiver finds it at the sender's first
    PROBE and refuses the message; both ends raise this at once, rather than at the deadline."""


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
    first_resend_at: float | None = None
    """Receiver: monotonic time its first resent packet reached the host (None: none came).
    With the sender's ``recovery_started`` (its first BITMAP in) it splits a recovery round into
    the answer's way, the resend's way and the rest."""
    activated: float | None = None
    """Sender: monotonic time its first pass could begin (``started``, or a held send's trigger)."""
    first_pass_ended: float | None = None
    """Sender: monotonic time the data path reported its first pass's last packet gone. With
    the receiver's first arrival and answer it says whether a slow pass was slow to leave."""
    finished_at: float = 0.0
    """Monotonic time it completed."""
    iteration: int = 0
    """The iteration its header carried (bound into its token)."""
    lost_packets: np.ndarray | None = field(default=None, repr=False, compare=False)
    """Sender side: sequence numbers the receiver never got (None when nothing was lost)."""

    def as_dict(self) -> dict[str, Any]:
        # (every field but lost_packets is a scalar: asdict's deep copy gave the same values at
        # many times the cost, and copied lost_packets before dropping it)
        return {name: getattr(self, name) for name in _STATS_FIELDS}


_STATS_FIELDS = tuple(f.name for f in fields(MessageStats) if f.name != "lost_packets")


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
        self._callbacks: list[Callable[[_Handle], None]] = []
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._event.is_set()

    def add_done_callback(self, fn: Callable[[_Handle], None]) -> None:
        """Call ``fn(handle)`` once the handle resolves or fails (at once if it has). It runs on
        the transport's thread: keep it short (put the handle on a queue, say)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _settle(self) -> None:
        with self._lock:
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def _resolve(self, result: Any) -> None:
        if not self._event.is_set():
            self._result = result
            self._settle()

    def _fail(self, error: BaseException) -> None:
        if not self._event.is_set():
            self._error = error
            self._settle()

    def wait(self, timeout: float) -> Any:
        """The result, or the message's error; :class:`TransportTimeout` after ``timeout`` s."""
        if not self._event.wait(timeout):
            raise TransportTimeout(f"{self._what} message {self.message_id} with rank {self.peer}: "
                                   f"no result within {timeout:g} s")
        if self._error is not None:
            raise self._error
        return self._result


def wait_all(handles: Sequence[_Handle], deadline: float) -> list[Any]:
    """Every handle's result, in order, by ``deadline`` (``time.monotonic()``); raises as
    waiting on each in turn would: the first error in order, or :class:`TransportTimeout` for
    the first handle still open at the deadline.

    Why not simply wait on each in turn: each handle whose wait had begun woke this thread as
    it resolved, and the thread went back to sleep on the next one; a 4-rank ring call's 12
    messages cost the control thread 12 wake-ups of another thread (a futex wake and, on a
    virtual machine, an interrupt to the other vCPU), a sixth of its Python time at 4 MB. Here
    one event wakes the waiter: the last handle to settle sets it, or the first to fail (a
    peer lost fails its messages at once while the others' stay open; the waiter then goes
    through the handles in turn, as before)."""
    open_ = [h for h in handles if not h.done()]
    if len(open_) > 1:
        settled = threading.Event()
        left = [len(open_)]
        count = threading.Lock()

        def one_settled(h: _Handle) -> None:  # (on the transport's thread)
            with count:
                left[0] -= 1
                last = left[0] == 0
            if last or h._error is not None:  # (a failure: the handles before it may be done)
                settled.set()
        for h in open_:
            h.add_done_callback(one_settled)
        settled.wait(max(0.0, deadline - time.monotonic()))
    return [h.wait(max(0.0, deadline - time.monotonic())) for h in handles]


class SendHandle(_Handle):
    """Resolves to the sender's :class:`MessageStats` once the receiver said STOP."""

    def __init__(self, peer: int, message_id: int) -> None:
        super().__init__(peer, message_id, "send")


@dataclass(frozen=True)
class Expect:
    """What a receiver already knows of a message it asks for, so the sender needs no META.

    In a collective the receiver knows every size in advance (a PS worker's pull has the size
    of its push; a ring step's chunk is fixed), and an announcement would only cost a control
    frame. The sender must then send with ``announce=False``, the same element type and the
    same ``iteration``; both ends use the job's MTU, so they cut packets alike.
    """

    total_elems: int
    dtype: Any
    loss_bound: float
    iteration: int = 0
    """The iteration the sender puts in the header: the message token binds it, so a packet
    recorded in an earlier use of the same message id is rejected."""
    accumulate: bool = False
    """Add the message into ``out`` as its packets arrive instead of copying it: a reduction done
    by the receive path, once per packet. Missing packets add nothing. ``out`` is float32, or for
    a float16 message float16 (a float16 sum, as :func:`dlcp.hostagent.wire.destination_dtypes` says)."""
    then_send: tuple[tuple[int, int], ...] = ()
    """Held sends, (destination, message id), that start the moment this message completes
    (see ``Endpoint.send(..., held=True)``): a ring's next step leaves without waiting for Python."""
    scale: float = 1.0
    """With ``accumulate`` into float32 from a float32 message: each element of ``out`` is
    multiplied by ``scale`` (in float32) before its packet is added, and the elements no packet
    came for are multiplied when the message completes: ``out = out * scale + message`` without
    a pass of its own over ``out``; the data path adds so, each operation rounded in float32."""
    classify: bool = True
    """Whether the held sends ``then_send`` starts take their drop classes from the magnitudes of
    what they forward, which this receive then computes as it places each packet. False where
    they were sent with ``classify=False`` (``Endpoint.send``): nothing to compute."""

    def __post_init__(self) -> None:
        if self.scale != 1.0 and not self.accumulate:
            raise ValueError("Expect.scale applies to accumulate receives only")
        if self.total_elems < 0 or not 0 <= self.loss_bound < 1:
            raise ValueError(f"Expect needs total_elems >= 0 and 0 <= loss_bound < 1, got {self.total_elems}, "
                             f"{self.loss_bound}")
        if not 0 <= self.iteration <= 0xFFFFFFFF:
            raise ValueError(f"Expect.iteration={self.iteration} outside 0..{0xFFFFFFFF}")
        object.__setattr__(self, "then_send", tuple((int(d), int(m)) for d, m in self.then_send))


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

    def __init__(self, peer: int, message_id: int, out: np.ndarray | None, accumulate: bool = False) -> None:
        super().__init__(peer, message_id, "receive")
        self.out = out
        self.accumulate = accumulate
