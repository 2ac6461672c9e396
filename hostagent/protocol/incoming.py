"""Receiver-side state of one message, and when its end of pass is answered.

The data path holds the message's packets and counters; this holds what the protocol decides
from them: whether a PROBE (or a LAST) is waiting for an answer, when the first bitmap went
out, the pace of the first pass, the deadline. Pure: no sockets, no clocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dlcp.hostagent.messages import MessageStats, RecvHandle, RecvResult
from dlcp.hostagent.policy import is_complete
from dlcp.hostagent.protocol.port import Progress, RxBuffers

#: An end of pass is answered after at most this much quiet, however slowly data arrived.
MAX_ANSWER_GRACE = 0.1
#: ... and after at least this many of the message's own mean gaps between packets.
ANSWER_GAPS = 4
#: The reordering window of a sender's path, the floor of the grace (the data path keeps it per
#: sender, ``Datapath::widen_window`` and ``narrow_window`` in hostagent/native/rx.cc, by the rules
#: ``reorder_lateness`` and ``narrows_window`` of hostagent/native/endpass.h, the way RACK (RFC
#: 8985) adapts its reordering window). It starts at ``probe_grace``.
#: A first-pass packet without LAST that comes ``late`` seconds after its message's first LAST
#: (the path reordered it past the end of the pass), or one of the pass's other LAST packets
#: that comes after the message was quiet for longer than the window (``late``: that gap),
#: widens it to REORDER_MARGIN x late at once; every REORDER_PERSIST recoveries in a row (passes
#: that ended with packets missing: resent, or left out by a bound) with nothing late narrow it
#: by REORDER_DECAY, down to REORDER_MIN. Why: a fixed floor long enough for a sprayed fabric
#: (2 ms on the testbed) was paid at every step of a ring on a path that never reorders; a
#: window too short costs a few packets resent (p = 0) or left out (p > 0), and widens on the
#: spot. Why narrowing waits for recoveries (RACK's reo_wnd_persist, also 16, counts loss
#: recoveries): a narrower window pays off only when packets are lost. Narrowed by every clean
#: pass, a ring's window fell from 2 ms to its floor within two iterations, and the testbed's
#: sprayed paths, which reorder by a packet time (2.2 ms at 5.5 Mbit/s) now and then, had 0.4-1
#: bitmaps an iteration listing packets still on the way; narrowed after 16 clean passes, it
#: still sat at its floor on the testbed's same-leaf hops, which pause for about a millisecond
#: between a pass's first LAST and its other two, and 0.8-1 % of those hops' packets were
#: resent with nothing lost (captured at both ends, 8.4 Mbit/s, no cross traffic; 0.02 % of a
#: run's data packets since: docs/results/sim-validation.md).
REORDER_MIN = 0.0002
REORDER_MARGIN = 1.25
REORDER_DECAY = 0.9
REORDER_PERSIST = 16


#: Freshness per sender (the data path keeps it: ``Datapath::stale`` in hostagent/native/rx.cc): a
#: datagram whose token is right for its own iteration but that belongs to no message being
#: received is *stale*, and neither parks, nor widens a reordering window, nor counts as received
#: or consumed, when it comes from an earlier use of its message id than the one set up here last,
#: or from that use when it is over and the sender's messages set up since have reached
#: FRESH_WINDOW iterations beyond it. Why: message ids repeat (an exchange's every 1,024
#: iterations), and packets recorded at iteration i carry a valid token for i; replayed 1,024
#: iterations later they filled the park (crowding out the real sender's early packets), widened
#: the window to its cap and were counted in feedback and credits. Why per message id and not one
#: mark per sender: a sender's iterations come from more than one counter (the torch backend
#: numbers collectives and point-to-point sends apart), so early data of a message id never set up
#: here still parks whatever its iteration. The last FRESH_KEPT message ids set up are remembered;
#: a replay of one set up before those parks as before (and is dropped, not placed, when its id is
#: set up again).
FRESH_WINDOW = 512
FRESH_KEPT = 1 << 16


#: An answer waits for the receive thread to catch up with its grace (to have read everything
#: that arrived until then) at most this long past the grace: a reader that a flood of junk
#: keeps behind must not hold every answer back until the deadline. Long, because a receiver
#: that is merely behind (descheduled on a loaded host) still has the message's packets queued
#: in its socket, and a bitmap sent then lists them: they would be resent, and their window
#: released twice.
MAX_BUSY_DEFER = 0.2


#: How often the holes of a reliable message (p = 0) still in its first pass are looked at (s;
#: at least the sender's reordering window). A hole seen at two looks, with the receive thread
#: having read all that arrived for a reordering window after the first, is reported at once
#: (NACK) and resent during the pass, instead of a whole round trip after its end. Why: a
#: ring's all-gather is reliable, and under loss every step waited for one recovery round
#: after its pass (bitmap, resend behind the receiver's backlog) before the next could start.
HOLE_CHECK_INTERVAL = 0.002


def overdue_holes(seen: np.ndarray, holes: np.ndarray, reported: np.ndarray | None) -> np.ndarray:
    """Holes to report now: missing at the previous look (``seen``) and still missing
    (``holes``), not reported before (``reported``: bool per packet, or None)."""
    both = np.intersect1d(seen, holes, assume_unique=True)
    return both if reported is None else both[~reported[both]]


class Incoming:
    """One message being received."""

    def __init__(self, src: int, message_id: int, total_elems: int, elems_per_packet: int, dtype_code: int,
                 loss_bound: float, deadline: float, handle: RecvHandle | None, priority: int,
                 buffers: RxBuffers, accumulate: bool, iteration: int, now: float) -> None:
        self.src = src
        self.message_id = message_id
        self.total_elems = total_elems
        self.elems_per_packet = elems_per_packet
        self.total_pkts = -(-total_elems // elems_per_packet) if elems_per_packet else 0
        self.dtype_code = dtype_code
        self.loss_bound = loss_bound
        self.deadline = deadline
        self.handle = handle
        self.priority = priority
        self.buffers = buffers
        self.accumulate = accumulate
        self.iteration = iteration
        self.started = now
        self.received_pkts = 0
        self.received_elems = 0
        self.duplicates = 0
        self.retx_seen = 0
        self.first_arrival: float | None = None
        self.last_arrival = now
        self.first_bitmap_at: float | None = None
        self.pace: float | None = None  # mean packet gap of the first pass, fixed at the first BITMAP
        self.probe_pending = False
        self.probe_since: float | None = None  # when the pending answer was first asked for
        self.bitmap_sent_at: float | None = None  # for the receiver's RTT estimate
        self.first_resend_at: float | None = None  # when its first resent packet arrived
        self.probes = 0
        self.gaps = 0  # first-pass packets skipped (Progress.gaps): 0, no hole to look for
        self.dp_state = 0  # Progress.state: nonzero once the data path completed it
        self.holes_seen = np.zeros(0, np.int64)  # the holes at the last look (p = 0, first pass)
        self.holes_looked_at: float | None = None
        self.gaps_at_look = 0  # ``gaps`` at the last look
        self.holes_reported: np.ndarray | None = None  # bool per packet: reported in a NACK

    @property
    def key(self) -> tuple[int, int]:
        return self.src, self.message_id

    @property
    def holes_to_look_for(self) -> bool:
        """A reliable message in its first pass with a packet skipped, unless the last look
        found no hole and nothing was skipped since (a hole once filled stays filled: only a
        new skip opens one)."""
        return (self.loss_bound == 0 and self.gaps > 0 and not self.probe_pending and self.first_bitmap_at is None
                and not (self.holes_looked_at is not None and not len(self.holes_seen)
                         and self.gaps == self.gaps_at_look))

    def update(self, p: Progress) -> None:
        """Take the data path's counters and state."""
        self.dp_state = p.state
        self.received_pkts, self.received_elems, self.duplicates = p.received_pkts, p.received_elems, p.duplicates
        self.gaps = p.gaps
        if p.first_arrival > 0:
            self.first_arrival = p.first_arrival
            self.last_arrival = max(self.last_arrival, p.last_arrival)

    def ask(self, now: float) -> None:
        """A PROBE or the end of the sender's pass: answer once the message is quiet."""
        if not self.probe_pending:
            self.probe_since = now
        self.probe_pending = True

    def is_exact(self) -> bool:
        return self.received_pkts == self.total_pkts

    def is_complete(self) -> bool:
        return is_complete(self.received_elems, self.total_elems, self.loss_bound)

    @property
    def lost_fraction(self) -> float:
        return 1.0 - self.received_elems / self.total_elems if self.total_elems else 0.0

    def missing_bitmap(self) -> bytes:
        """Bit ``seq`` set (MSB first) for every packet still missing: a BITMAP's and STOP's body."""
        return np.packbits(self.buffers.received[: self.total_pkts] == 0).tobytes()

    def result(self, how: str, now: float) -> RecvResult:
        """The finished message, as the data path left it when it finished it (missing elements
        read as zero there: :meth:`dlcp.hostagent.protocol.port.DataPort.complete`)."""
        b = self.buffers
        received = b.received[: self.total_pkts].astype(bool)
        exact = self.received_pkts == self.total_pkts
        stats = MessageStats(
            peer=self.src, message_id=self.message_id, direction="recv", elements=self.total_elems,
            packets=self.total_pkts, bytes=b.out.nbytes, loss_bound=self.loss_bound, priority=self.priority,
            lost_fraction=self.lost_fraction, retransmissions=self.retx_seen, duplicates=self.duplicates,
            probes=self.probes, completion_time=now - self.started, how=how, started=self.started,
            first_arrival=self.first_arrival, recovery_started=self.first_bitmap_at,
            first_resend_at=self.first_resend_at, finished_at=now,
            iteration=self.iteration,
        )
        return RecvResult(b.out, stats, None if exact else received, self.elems_per_packet, b.pkt_priority,
                          b.pkt_layer)


def packet_gap(msg: Incoming) -> float | None:
    """Mean time between ``msg``'s packets so far (None before two arrived): the receive
    thread's ``mean_gap`` (``hostagent/native/endpass.h``), written once."""
    if msg.first_arrival is None:
        return None
    gap = float(_rules().mean_gap(msg.received_pkts, msg.first_arrival, msg.last_arrival))
    return None if gap < 0 else gap


def answer_grace(floor: float, msg: Incoming) -> float:
    """How long no data of ``msg`` must have arrived before its end of pass (LAST or a PROBE)
    is answered: ``floor`` (the sender's reordering window, which starts at ``probe_grace``),
    or ANSWER_GAPS of the message's own mean gaps between packets if that is longer (at most
    MAX_ANSWER_GRACE).

    Why: when a switch sprays a message over paths whose queues differ, its LAST overtakes
    packets still queued on another path; they arrive within a few packet times of that path.
    A bitmap sent sooner lists them as missing and they are sent again. The mean gap measures
    the pace of this very message, whatever the link speed; once a bitmap went out, the gap of
    the first pass stands (the wait for retransmissions is not the message's pace).

    The rule is the compiled one (``hostagent/native/endpass.h``), which the receive thread
    completes a bounded message by: written once.
    """
    gap = msg.pace if msg.pace is not None else packet_gap(msg)
    return float(_rules().answer_grace(floor, -1.0 if gap is None else gap, MAX_ANSWER_GRACE, ANSWER_GAPS))


def answer_due(msg: Incoming, now: float, floor: float, seen_until: float) -> bool:
    """Whether a pending answer goes out now: the message has been quiet for its grace, and the
    receive thread has read everything that arrived until the grace's end (``seen_until``, from
    the kernel's arrival stamps: so a bitmap lists no packet already here), or it has stayed
    behind for MAX_BUSY_DEFER past the grace (a flood must not silence every answer).

    Why arrival time and not "the socket is empty": on a host receiving many messages at once
    the socket is rarely empty, though the reader keeps up; waiting for it to run dry held each
    answer back by tens of milliseconds (a ring's reliable all-gather, under loss, waited so at
    every step). The rule is ``hostagent/native/endpass.h``'s ``answer_check``."""
    if not msg.probe_pending:
        return False
    since = msg.probe_since if msg.probe_since is not None else now
    due, _ = _rules().answer_check(now, msg.last_arrival, answer_grace(floor, msg), seen_until, since, MAX_BUSY_DEFER)
    return bool(due)


def _rules() -> Any:
    """The compiled module that holds the per-packet rules (built by ``make setup``)."""
    from dlcp.hostagent import _datapath

    return _datapath
