"""Sender-side state of one message: its passes, probes and recovery. Pure, no I/O.

The data path sends the packets; this holds what the protocol knows of them: whether a pass
is under way (the data path reports its end), when to PROBE for an answer that did not come,
what the receiver reported missing, and the handle the caller waits on.
"""

from __future__ import annotations

import numpy as np

from dlcp.hostagent.messages import MessageStats, SendHandle


class Outgoing:
    """One message being sent."""

    def __init__(self, dest: int, message_id: int, total_elems: int, elems_per_packet: int, itemsize: int,
                 loss_bound: float, priority: int, deadline: float, order: int, drop_class: np.ndarray,
                 held: bool, now: float, snapshot: np.ndarray | None = None, iteration: int = 0,
                 dtype_code: int = 0) -> None:
        self.dest = dest
        self.message_id = message_id
        self.total_elems = total_elems
        self.elems_per_packet = elems_per_packet
        self.itemsize = itemsize
        self.dtype_code = dtype_code  # (its PROBEs state the shape: wire.shape_fields)
        self.packets = -(-total_elems // elems_per_packet) if elems_per_packet else 0
        self.loss_bound = loss_bound
        self.priority = priority
        self.deadline = deadline
        self.order = order
        self.drop_class = drop_class
        """Per packet, filled by the data path when the message became ready to send."""
        self.snapshot = snapshot
        self.iteration = iteration
        self.handle = SendHandle(dest, message_id)
        self.started = now
        self.held = held  # waits for a trigger: no pass, no probe, until it starts
        self.sending = not held  # a pass is under way (the data path reports its end)
        self.pass_no = 0  # the data path counts passes alike: a stale end of pass is ignored
        self.pass_done_at: float | None = None  # when the last pass ended
        self.probe_sent_at: float | None = None
        self.awaiting_reply = False
        self.probes = 0
        self.reported_missing = 0
        self.holes_lost = 0  # packets resent for a NACK, for the rate at the answer to the pass's end
        self.stopped = False
        self.first_retx_at: float | None = None
        self.activated_at: float | None = None if held else now
        self.first_pass_ended_at: float | None = None

    @property
    def key(self) -> tuple[int, int]:
        return self.dest, self.message_id

    @property
    def nbytes(self) -> int:
        """Bytes of datagrams (header + payload) of the whole message."""
        from dlcp.hostagent.wire import HEADER_SIZE

        return self.packets * HEADER_SIZE + self.total_elems * self.itemsize

    def elem_counts(self) -> np.ndarray:
        """Elements in each packet."""
        counts = np.full(self.packets, self.elems_per_packet, dtype=np.int64)
        if self.packets and self.total_elems % self.elems_per_packet:
            counts[-1] = self.total_elems % self.elems_per_packet
        return counts

    def on_pass_done(self, pass_no: int, now: float) -> bool:
        """The data path finished pass ``pass_no``; False for a stale report (a newer pass began)."""
        if pass_no != self.pass_no or self.stopped:
            return False
        self.sending = False
        if self.first_pass_ended_at is None:
            self.first_pass_ended_at = now
        if not self.awaiting_reply:
            self.pass_done_at = now  # the probe timer starts from here
        return True

    def begin_pass(self) -> None:
        """A retransmission pass is handed to the data path."""
        self.pass_no += 1
        self.sending = True
        self.pass_done_at = None

    def stats(self, how: str, lost_fraction: float, retransmissions: int, now: float) -> MessageStats:
        return MessageStats(
            peer=self.dest, message_id=self.message_id, direction="send", elements=self.total_elems,
            packets=self.packets, bytes=self.nbytes, loss_bound=self.loss_bound, priority=self.priority,
            retransmissions=retransmissions, probes=self.probes, completion_time=now - self.started, how=how,
            lost_fraction=lost_fraction, started=self.started, recovery_started=self.first_retx_at,
            activated=self.activated_at, first_pass_ended=self.first_pass_ended_at, finished_at=now,
            iteration=self.iteration,
        )
