"""The Python copies of rules that run once in the compiled data path (credits, the drain meter,
the pacer, the reordering window, freshness), for the numpy reference model
(tests/reference/numpy_path.py) to follow. Not part of the package: the compiled rules are
tested directly, on a fake clock (tests/transport/test_core_rules.py), and against this model
(tests/transport/test_datapath.py)."""

from __future__ import annotations

from dlcp.hostagent.datapath.credits import CREDIT_QUIET
from dlcp.hostagent.protocol.incoming import (FRESH_WINDOW, MAX_ANSWER_GRACE, REORDER_DECAY, REORDER_MARGIN,
                                              REORDER_MIN, REORDER_PERSIST)
from dlcp.hostagent.ratecontrol import DRAIN_FRESH, DRAIN_MIN_BYTES, DRAIN_STRETCH


def credit_due(pending: int, window: int, quiet_for: float, overrun: bool = False) -> bool:
    """Whether a sender gets a credit now: ``pending`` of its packets were consumed since its last
    credit, and either a quarter of its ``window`` was used or nothing of it came for
    CREDIT_QUIET (``quiet_for`` seconds since its last packet). Also, with nothing consumed,
    when the receiver's socket overran since the sender's last credit (``overrun``: the kernel
    dropped datagrams, and a message from this sender is incomplete) and the sender went quiet:
    that credit carries :data:`dlcp.hostagent.wire.Flags.RELEASE`, and the sender counts what it sent
    and was not consumed as lost (acked_after_credit); release_due says when a
    quiet sender's packets were lost on the way instead.

    Why not a credit whenever the socket runs dry (the rule before): a receiver reading a slow
    stream finds its socket dry after nearly every packet, and sent a credit per data packet.
    On the testbed, where a switch port serves packets, not bytes, those credits took half the
    reverse path's capacity; with the tail drops they caused, the control connection's
    segments were lost and waited out TCP's 200 ms retransmission timer.
    """
    if overrun and quiet_for >= CREDIT_QUIET:
        return True
    return pending > 0 and (pending >= max(1, window // 4) or quiet_for >= CREDIT_QUIET)


def release_due(incomplete: bool, released: bool, last_arrival: float, seen_until: float) -> bool:
    """Whether a sender's next credit releases all it sent (:data:`dlcp.hostagent.wire.Flags.RELEASE`)
    because its packets stopped coming while a message of its is incomplete: nothing of it
    arrived for CREDIT_QUIET up to ``seen_until``, the time up to which the receive thread has
    read everything that reached the host (arrival stamps, so a reader that was descheduled does
    not take its own delay for the sender's silence), and no release went since its last packet.

    Why: a sender counts each packet it sent as unconsumed until a credit says otherwise, and a
    packet lost on the way is never consumed. The loss of a few percent of several long passes
    in flight to one receiver fills its window, the sender stops, its passes cannot end, and
    only CREDIT_TIMEOUT (200 ms) let it go on: the parameter server's replies under 2 % loss
    stalled so once or twice an iteration. A receiver that has read everything and heard nothing
    for CREDIT_QUIET knows those packets are not coming (or are still on the way: at most a
    window, which its drained socket has room for, as after an overrun).
    """
    return incomplete and not released and last_arrival >= 0 and seen_until - last_arrival >= CREDIT_QUIET


def acked_after_credit(acked: int, sent: int, consumed: int, release: bool) -> int:
    """A sender's count of its packets a receiver has done with, after a credit saying it
    ``consumed`` that many (counts only grow: a late credit takes nothing back).

    A RELEASE credit also releases everything sent before it: the receiver's socket dropped
    datagrams (an overrun) or this sender's packets stopped coming while a message of its is
    incomplete (release_due), so what was not consumed was lost (or is still in the
    network, at most a window, which a drained socket has room for). Why: without it a sender
    whose whole window the kernel dropped, or the network lost, waits out CREDIT_TIMEOUT.
    """
    return max(acked, sent if release else consumed)


class DrainMeter:
    """Receiver side: what this receiver can drain, measured only while it is overloaded.

    The receive thread is *behind* when a batch ends full (``rx_batch`` datagrams, or a quarter
    of the socket buffer's bytes) and the socket still holds at least half its buffer (the data
    path's receive loop decides). A stretch of consecutive such batches, closed by the first
    batch that empties the socket or after ``stretch`` seconds, gives one sample: its bytes over
    its wall time, every cost of the process (CPU scheduling too) included. It counts when it
    carried ``min_bytes``. Samples are smoothed; an estimate older than ``fresh`` is dropped, so
    a receiver that keeps up advertises no ceiling and its senders probe upward again.

    Why only when overloaded: a receiver slightly behind a paced sender measures the sender's
    pace, and a thread descheduled mid-stretch looks slow (busy time per byte has the same
    flaw), so a meter that samples any backlog pulls the ceiling ever lower. A full batch means
    a real backlog, and then the wall-clock rate is what the receiver really drains.
    """

    def __init__(self, stretch: float = DRAIN_STRETCH, min_bytes: int = DRAIN_MIN_BYTES,
                 fresh: float = DRAIN_FRESH) -> None:
        if stretch <= 0 or min_bytes < 0 or fresh <= 0:
            raise ValueError(f"bad DrainMeter settings: stretch={stretch}, min_bytes={min_bytes}, fresh={fresh}")
        self.stretch, self.min_bytes, self.fresh = stretch, min_bytes, fresh
        self.rate = 0.0
        self.measured_at = 0.0
        self._since: float | None = None
        self._bytes = 0

    def batch(self, started: float, nbytes: int, behind: bool, now: float) -> None:
        """One receive batch that began at ``started``, took ``nbytes`` and ended at ``now``;
        ``behind``: it ended full, with datagrams still queued."""
        if self._since is None:
            if not behind:
                return
            self._since, self._bytes = started, 0
        self._bytes += nbytes
        span = now - self._since
        if not behind or span >= self.stretch:
            if span > 0 and self._bytes >= self.min_bytes:
                sample = self._bytes / span
                self.rate = sample if self.rate <= 0 else 0.7 * self.rate + 0.3 * sample
                self.measured_at = now
            self._since = now if behind else None
            self._bytes = 0

    def current(self, now: float) -> float:
        """The measured drain rate if it is fresh, else 0 (no ceiling: this receiver keeps up)."""
        return self.rate if self.rate > 0 and now - self.measured_at <= self.fresh else 0.0


class Pacer:
    """Token bucket: how long to wait before the next ``nbytes`` may leave at ``rate``.

    ``slack`` (seconds, :attr:`RateConfig.pacing_slack`): a deficit up to ``rate x slack`` is
    no wait (the bytes leave on credit); a larger one is waited for whole.
    """

    def __init__(self, burst_bytes: int, slack: float = 0.0) -> None:
        self.burst = float(burst_bytes)
        self.tokens = float(burst_bytes)
        self.slack = slack
        self.last: float | None = None

    def _refill(self, rate: float, now: float) -> None:
        if self.last is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.last) * rate)
        self.last = now

    def wait_time(self, nbytes: int, rate: float, now: float) -> float:
        """Seconds until ``nbytes`` may be sent (0 when they may go now)."""
        self._refill(rate, now)
        deficit = nbytes - self.tokens
        return 0.0 if deficit <= rate * self.slack else deficit / rate

    def allowance(self, rate: float, now: float, horizon: float) -> float:
        """Bytes that may leave within ``horizon`` seconds from ``now`` at ``rate``."""
        self._refill(rate, now)
        return self.tokens + rate * horizon

    def consume(self, nbytes: int) -> None:
        """Account for ``nbytes`` sent (tokens may go negative by one packet's worth)."""
        self.tokens -= nbytes


def widen_reorder(window: float, late: float) -> float:
    """The window after a first-pass packet came ``late`` seconds after its message's LAST."""
    return min(MAX_ANSWER_GRACE, max(window, REORDER_MARGIN * late))


def narrow_reorder(window: float, clean: int) -> tuple[float, int]:
    """The window and the count of clean passes in a row after a message whose pass ended
    without a packet coming after its LAST (``clean``: the count before it): narrowed once
    every REORDER_PERSIST of them."""
    clean += 1
    if clean < REORDER_PERSIST:
        return window, clean
    return max(REORDER_MIN, window * REORDER_DECAY), 0


def iteration_before(a: int, b: int) -> bool:
    """``a`` comes before ``b`` among 32-bit iterations (serial number arithmetic, RFC 1982)."""
    return (a - b) & 0xFFFFFFFF >= 0x80000000


def stale(iteration: int, last_use: int | None, newest: int | None) -> bool:
    """Whether a token-valid datagram of ``iteration`` that belongs to no message being received
    was recorded earlier: ``last_use`` is the iteration its message id was last set up with here
    (None: not among the last FRESH_KEPT), ``newest`` the newest iteration set up from its sender."""
    if last_use is None:
        return False  # early data of a message not set up yet
    if iteration != last_use:
        return iteration_before(iteration, last_use)  # an earlier use (a later one: early data)
    return newest is not None and not iteration_before(newest, iteration) and \
        (newest - iteration) & 0xFFFFFFFF >= FRESH_WINDOW
