"""Per-destination sending rate: DCTCP-like control and a token-bucket pacer.

Pure state machines: the caller passes the time and the receiver's feedback in, and reads
the rate and the wait out, so every rule is testable without sockets or clocks.

Why DCTCP-like: a switch that marks CE above a queue threshold gives an early, graded
signal. The sender keeps ``alpha``, a moving average of the fraction of its packets that were
marked *or lost*, and on any congestion cuts its rate by ``alpha / 2``: gently when few packets
are marked, by half when all are. Without congestion the rate grows additively. It never
exceeds the configured line rate and never falls below a floor, so a message always drains.
"""

from __future__ import annotations

from dataclasses import dataclass


#: :meth:`RateConfig.for_link`'s burst: at most this long at the link's rate ...
BURST_SECONDS = 0.0002
#: ... and at least this many full datagrams (as the testbed's and the simulator's hosts burst).
MIN_BURST_PACKETS = 16


@dataclass(frozen=True)
class RateConfig:
    """Rate control knobs; rates in bytes of datagrams per second."""

    initial_rate: float = 0.5e9
    """Rate a new destination starts at (below the line rate: a fresh receiver's socket
    buffer is the first thing a full-speed start overruns)."""

    line_rate: float = 1.25e9
    """Never send faster than this (the host's link; 10 Gb/s by default)."""

    min_rate: float = 1e6
    """Floor, so a message under heavy congestion still makes progress."""

    additive_increase: float = 12.5e6
    """Added per ``increase_interval`` of sending without congestion: 1 % of the default line
    rate, as :func:`link_rates` and :meth:`for_link` set it for theirs (from half the line
    rate back to all of it in about a tenth of a second, the time a 100 MB message takes at
    10 Gb/s). Feedback without congestion is sent rarely (it rides on other control frames), so
    the increase is scaled by the time it covers."""

    increase_interval: float = 0.002
    """The time ``additive_increase`` is granted for."""

    max_increase_span: float = 0.05
    """Longest stretch one clean report may grant increase for (after an idle gap the rate
    must not jump)."""

    gain: float = 1.0 / 16
    """DCTCP's g: weight of the newest congestion fraction in ``alpha``."""

    burst_bytes: int = 256 * 1024
    """Token bucket depth: how much may leave back to back before pacing bites."""

    pacing_slack: float = 0.0002
    """A pacing wait shorter than this is not slept: the bytes leave now, on credit, and the
    sender sleeps once its debt reaches this many seconds of its rate (then all of it). Why: a
    send thread faster than its rate otherwise sleeps before every system call's worth (64 KB,
    26 us at 2.5 GB/s), and each sleep costs two context switches and the kernel's 50 us timer
    slack; the mean rate is the same, a burst grows by ``rate x pacing_slack`` (as Linux lets
    TCP send about a millisecond's worth per skb at high rates). Hosts configured for a
    emulated link (:func:`link_rates`: the testbed, the simulator) pace exactly: 0."""

    @classmethod
    def for_link(cls, line_rate: float, mtu: int = 1500, **overrides: float) -> RateConfig:
        """A host on a link of ``line_rate`` bytes/s (datagrams of at most ``mtu`` bytes): it
        starts at half of it and grows by 1 % of it per increase interval, as the defaults do for
        10 Gb/s; its floor is at most 1 % of it; a burst is at most :data:`BURST_SECONDS` of the
        link (the default 256 KB is that at 10 Gb/s, and stays the cap above) and at least
        :data:`MIN_BURST_PACKETS` full datagrams. Why: setting ``line_rate`` alone keeps the
        10 Gb/s increase, and a faster host then takes several times longer to reach its link
        rate; and 256 KB back to back is 2 ms of a 1 Gb/s link, a quarter of a second of the
        testbed's 7.4 Mbit/s ones.

        Example: ``RateConfig.for_link(25e9 / 8)``
        """
        burst = max(MIN_BURST_PACKETS * mtu, min(cls.burst_bytes, int(line_rate * BURST_SECONDS)))
        knobs = {"line_rate": line_rate, "initial_rate": line_rate * 0.5, "additive_increase": line_rate * 0.01,
                 "min_rate": min(cls.min_rate, line_rate * 0.01),  # (the default floor is 8 Mb/s)
                 "burst_bytes": burst}
        knobs.update(overrides)
        return cls(**knobs)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if not 0 < self.min_rate <= self.initial_rate <= self.line_rate:
            raise ValueError(f"need 0 < min_rate <= initial_rate <= line_rate, got {self.min_rate}, "
                             f"{self.initial_rate}, {self.line_rate}")
        if not 0 < self.gain <= 1:
            raise ValueError(f"gain must be in (0, 1], got {self.gain}")
        if self.additive_increase < 0 or self.burst_bytes <= 0:
            raise ValueError("additive_increase must be >= 0 and burst_bytes > 0")
        if not 0 <= self.pacing_slack <= 0.01:
            raise ValueError(f"pacing_slack must be in [0, 0.01] s, got {self.pacing_slack}")
        if self.increase_interval <= 0 or self.max_increase_span <= 0:
            raise ValueError("increase_interval and max_increase_span must be > 0")


def link_rates(link: float, mtu: int) -> dict:
    """:class:`RateConfig` knobs for a host on a link of ``link`` bytes/s, as a user sets them
    with :meth:`RateConfig.for_link`: start at half of it, never above it, grow by 1 % of it per
    increase interval. The testbed (``dlcp.topologies.runner.testbed_rate``) and the simulator
    (``dlcp_sim.scenario``) give their hosts links of the fabric's rate and configure them this
    way: nothing about where the bottleneck is or what else crosses it. Two knobs differ from
    ``for_link``, for the emulation, not for speed: exact pacing (no ``pacing_slack``: the
    simulator's hosts model bursts of ``burst_bytes`` only) and a burst of 16 full packets
    whatever the link (``for_link``'s, on the testbed's slow links; on the simulator's fast
    ones, where ``for_link`` allows 0.2 ms, the burst the simulator was validated with).

    Until 2026-11-28 the hosts were told the bottleneck's rate and allowed twice it (a host
    link taken as faster than the fabric), which let one DLCP flow spray 2x its link's rate over
    two spines where gloo's TCP flow, pinned to one path, got 1x (issue 43)."""
    user = RateConfig.for_link(link, mtu)
    return {"initial_rate": user.initial_rate, "line_rate": user.line_rate, "min_rate": user.min_rate,
            "additive_increase": user.additive_increase, "burst_bytes": MIN_BURST_PACKETS * mtu, "pacing_slack": 0.0}


#: A rate cut's hold (:meth:`RateController.on_feedback`) is this many smoothed answer times
#: (:class:`AnswerTimer`: a round trip with its queue) ...
CUT_HOLD_ANSWERS = 4
#: ... and at least this many congestion-report intervals (``TransportConfig.feedback_interval``).
CUT_HOLD_MIN_REPORTS = 10

#: ``alpha`` before any report: as Linux DCTCP, assume the worst until measured, so the first
#: cut halves the rate (the simulator's hosts start from the same value).
INITIAL_ALPHA = 1.0


class RateController:
    """The sending rate towards one destination."""

    def __init__(self, config: RateConfig) -> None:
        self.config = config
        self.rate = config.initial_rate
        self.alpha = INITIAL_ALPHA
        self.decreases = 0
        self.ceiling = 0.0  # what the receiver says it can drain from us (0 = not said yet)
        self.last_report: float | None = None
        self.last_cut: float | None = None  # when congestion last cut the rate (reports with a time)
        self.sent = 0  # data packets sent to this destination (on_sent)
        self.reported = 0  # of them, reported received or lost by its FEEDBACK (reports with a time)
        self.window_end = 0  # packets sent before the last cut: its window ends once all are reported

    @property
    def effective_rate(self) -> float:
        """The pacing rate: the controller's, capped by the receiver's drain ceiling when it gave one."""
        if self.ceiling > 0:
            return max(self.config.min_rate, min(self.rate, self.ceiling))
        return self.rate

    def on_ceiling(self, ceiling: float) -> None:
        """The receiver's drain share for us, bytes/s (0 = none: it keeps up). The rate drops to
        the ceiling at once, so a receiver that cannot keep up is not overrun; from there it
        probes upward by additive increase, and the receiver lifts the ceiling once it keeps up."""
        self.ceiling = max(0.0, ceiling)
        if ceiling > 0 and self.rate > ceiling:
            self.rate = max(self.config.min_rate, ceiling)

    def on_sent(self, packets: int) -> None:
        """Count data packets sent to this destination (the window a cut waits out)."""
        self.sent += packets

    def on_feedback(self, received: int, marked: int, lost: int, now: float | None = None,
                    hold: float = 0.0, timed: bool = True) -> float:
        """Update from one receiver report; returns the new rate.

        Args:
            received: data packets that arrived since the last report.
            marked: of those, how many carried CE.
            lost: packets newly known lost (socket overruns, bitmaps) since the last report.
            now: the time of the report; a clean report grants ``additive_increase`` per
                ``increase_interval`` since the previous one (at most ``max_increase_span``).
                Without it, one ``increase_interval``.
            hold: the longest a cut waits for its window (below); needs ``now``.
            timed: False for a BITMAP's losses: they cut at once, window or not, and do not
                count towards a window (the packets a BITMAP covers were reported already);
                with ``now`` the cut still starts a window, so marks that follow for packets sent
                before it do not cut again.

        Once per window, as DCTCP: after a cut, congestion updates ``alpha`` but cuts no further
        until the receiver has reported every packet sent before the cut (:meth:`on_sent`
        counts them), since those were sent at the old rate and say nothing of the new one; or
        until ``hold`` passed, for packets that will never be reported (dropped on the way).
        Why: reports leave every few milliseconds, and behind a slow bottleneck the packets
        queued before a cut keep arriving marked for a whole queue's drain after it; cut on
        every report, a sender halves its rate down to the floor within one drain.
        """
        span = self.config.increase_interval
        if now is not None and timed:
            if self.last_report is not None:
                span = min(self.config.max_increase_span, max(0.0, now - self.last_report))
            self.last_report = now
        total = received + lost
        if total <= 0:
            return self.rate
        if now is not None and timed:
            self.reported += total
        fraction = min(1.0, (marked + lost) / total)
        g = self.config.gain
        self.alpha = (1 - g) * self.alpha + g * fraction
        if fraction > 0:
            held = (timed and now is not None and self.last_cut is not None and self.reported < self.window_end
                    and now - self.last_cut < hold)
            if not held:
                self.rate *= 1 - self.alpha / 2
                self.decreases += 1
                self.last_cut, self.window_end = now, self.sent
        else:
            self.rate += self.config.additive_increase * span / self.config.increase_interval
            if self.ceiling > 0:  # probe above the receiver's ceiling, but not far (see CEILING_HEADROOM)
                self.rate = min(self.rate, CEILING_HEADROOM * self.ceiling)
        self.rate = min(self.config.line_rate, max(self.config.min_rate, self.rate))
        return self.rate


class AnswerTimer:
    """Sender side: how long a receiver takes to answer the end of a pass (STOP or BITMAP).

    Samples run from the end of a pass (or from a PROBE) to the answer, so they hold the
    network round trip, the receiver's scheduling and its control tick: what a PROBE must wait
    for before it is not a wasted record. Smoothed as RFC 6298 smooths a TCP RTT; the probe
    delay is ``srtt + 4 * rttvar`` within ``[floor, ceiling]``, ``initial`` before any sample.
    """

    def __init__(self, initial: float, floor: float, ceiling: float) -> None:
        if not 0 < floor <= ceiling or initial <= 0:
            raise ValueError(f"need 0 < floor <= ceiling and initial > 0, got {floor}, {ceiling}, {initial}")
        self.initial, self.floor, self.ceiling = initial, floor, ceiling
        self.srtt: float | None = None
        self.rttvar = 0.0

    def sample(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        if self.srtt is None:
            self.srtt, self.rttvar = seconds, seconds / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - seconds)
            self.srtt = 0.875 * self.srtt + 0.125 * seconds

    def probe_delay(self) -> float:
        if self.srtt is None:
            return self.initial
        return min(self.ceiling, max(self.floor, self.srtt + 4 * self.rttvar))

    def reprobe_timeout(self) -> float:
        """How long to wait for an answer to a PROBE before asking again."""
        return max(4 * self.probe_delay(), 0.05)


#: While a receiver's drain ceiling caps a sender, additive increase may take the controller's
#: own rate at most this far above the ceiling. Why a bound: a ceiling lapses when the receiver
#: stops falling behind; a rate that grew unbounded underneath it (a parameter server's incast:
#: 300 MB/s capped, 600 MB/s underneath) then jumped at once and overran the receiver again.
CEILING_HEADROOM = 1.25

#: A receive batch that ended full counts as behind only if the socket still holds at least this
#: fraction of its buffer: then an overrun is near, and the receiver's drain is the limit.
BEHIND_BACKLOG = 0.5


#: The drain meter: what this receiver can drain, measured only while it is overloaded. The rule
#: is the compiled data path's (``Datapath::drain_batch`` in hostagent/native/rx.cc; its tests,
#: tests/transport/test_core_rules.py, drive it on a fake clock). The receive thread is
#: *behind* when a batch ends full (``rx_batch`` datagrams, or a quarter of the socket buffer's
#: bytes) and the socket still holds BEHIND_BACKLOG of its buffer. A stretch of consecutive such
#: batches, closed by the first batch that empties the socket or after DRAIN_STRETCH seconds,
#: gives one sample: its bytes over its wall time, every cost of the process (CPU scheduling
#: too) included. It counts when it carried DRAIN_MIN_BYTES. Samples are smoothed (0.7 old, 0.3
#: new); an estimate older than DRAIN_FRESH is dropped, so a receiver that keeps up advertises no
#: ceiling and its senders probe upward again.
#:
#: Why only when overloaded: a receiver slightly behind a paced sender measures the sender's
#: pace, and a thread descheduled mid-stretch looks slow (busy time per byte has the same
#: flaw), so a meter that samples any backlog pulls the ceiling ever lower. A full batch means
#: a real backlog, and then the wall-clock rate is what the receiver really drains.
DRAIN_STRETCH = 0.005
#: (see DRAIN_STRETCH) the fewest bytes a sample of the drain meter counts with
DRAIN_MIN_BYTES = 256 * 1024
#: (see DRAIN_STRETCH) seconds a drain estimate stays in force
DRAIN_FRESH = 0.5


def drain_share(drain: float, startup: float, active_senders: int, new_sender: bool) -> float:
    """Bytes/s each sender may send so that ``drain`` is shared among them (0 = no ceiling).

    A ``new_sender`` with nothing measured yet is given the ``startup`` estimate, so its
    first burst is already bounded; it counts as one more sender.
    """
    senders = max(1, active_senders + (1 if new_sender else 0))
    rate = drain if drain > 0 else (startup if new_sender else 0.0)
    return rate / senders if rate > 0 else 0.0
