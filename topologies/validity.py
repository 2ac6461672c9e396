"""Was the network the bottleneck? The validity of one scheme's run on the testbed.

A testbed number means something only if the machine emulated the network faithfully: on
two cores, four BMv2 switches, nine Python agents and cross traffic can saturate the CPU, and
then a run measures scheduling, not congestion. So while a scheme runs, :class:`RunMonitor`
samples, every ``interval`` seconds,

* the machine's CPU time and that of every process the run started (switches, agents, cross
  traffic), with psutil;
* for every bottleneck port, what it served while backlogged and for how long, from its
  scheduler's counters (:class:`ServiceSampler`, every 10 ms: the HTB tree on the port's
  interface, :mod:`dlcp.controller.scheduler`; an interval counts when the scheduler held frames
  at both its ends), in slots (full-size frames).

The pure functions below turn those samples into a verdict over the measured iterations: the
run is *invalid* when the machine was saturated, when an agent was CPU-bound (its host stack,
not the network, set the pace), when a bottleneck, while backlogged, served below
``min_rate_ratio`` of its capacity (the switch could not keep its own line rate) or above
``max_rate_ratio`` of it (the port was faster than the capacity the run claims, as BMv2's
per-priority rates made DLCP's ports before the scheduler), or when a switch lost packets
where no drop counter sees them (more than ``max_silent_loss`` of a port's packets), which
the hosts would take for congestion:

* before its pipeline: the kernel delivered frames to BMv2's libpcap capture ring, which
  overflowed while the switch waited for CPU (the interface's ``rx_packets`` against the
  pipeline's ``received`` counter);
* in its buffer: the pipeline admitted packets that BMv2's real queue, full while the egress
  thread waited for CPU, then dropped (``admitted`` against ``forwarded``);
* in a port's scheduler: its FIFOs dropped frames the pipeline had admitted (they are sized
  never to, so the virtual queue and the real one disagreed).

A port that was hardly ever backlogged gives no rate verdict, and the report says so.

A process that lived through fewer than two samples (a short run, or a monitor thread starved
on a saturated machine) is judged by its mean CPU over its life instead: the monitor reads it
when it is added, and the runner has it read again after it exits and before it is reaped (a
zombie still has its CPU times). An agent read neither way makes the run invalid: nothing
then says that it did not set the pace.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

Port = tuple[str, int]


@dataclass(frozen=True)
class ValidityRules:
    """Thresholds of a valid run (docs/methodology.md says why each default is what it is)."""

    machine_busy_max: float = 90.0
    """Median machine CPU use over the measured window, % of all cores, above which it was saturated."""
    process_busy_max: float = 95.0
    """Median CPU use of one agent, % of one core, above which the agent itself set the pace."""
    min_rate_ratio: float = 0.9
    """A backlogged bottleneck must serve at least this share of its capacity."""
    max_rate_ratio: float = 1.03
    """... and at most this share: more, and the port was not the capacity the run claims."""
    min_busy_slots: float = 200
    """Fewer slots served while backlogged say nothing about the rate."""
    max_silent_loss: float = 0.001
    """Share of a switch port's packets BMv2 may lose uncounted (before its pipeline or in its buffer)."""
    outside_busy_max: float = 15.0
    """Median CPU use, % of all cores, that no process of the run accounts for, above which other
    work shared the machine. Quiet runs read 1-10 % (the kernel's share of forwarding, which no
    process is charged for); the DLCP ring run of 20261129-155049 that took 3x its repetitions'
    sync time read 22 %, with its switches' ports serving 72-86 % of their capacity while
    certainly backlogged (too few slots for the port rule)."""


@dataclass
class Sample:
    """One observation: monotonic time, machine CPU times, process CPU seconds, port departures."""

    t: float
    machine: tuple[float, float]
    """(busy seconds, total seconds) summed over all cores since boot."""
    procs: dict[str, float]
    """process label -> user + system CPU seconds (missing once the process has gone)."""
    ports: dict[Port, tuple[float, ...]]
    """bottleneck port -> :meth:`BacklogMeter.readings` (slots served while backlogged,
    microseconds backlogged; the same while certainly backlogged throughout), cumulative."""


@dataclass
class ProcessLife:
    """A process's first and latest CPU reading: its mean load when no two samples saw it."""

    t0: float
    cpu0: float
    t1: float
    cpu1: float

    def busy(self) -> float | None:
        """Mean CPU use between the two readings, % of one core (None when they coincide)."""
        return 100.0 * (self.cpu1 - self.cpu0) / (self.t1 - self.t0) if self.t1 > self.t0 else None


@dataclass
class Validity:
    """The verdict on one scheme's run, with the numbers behind it."""

    valid: bool
    reasons: list[str]
    machine_busy_p50: float
    machine_busy_p90: float
    processes: dict[str, float]
    """label -> median CPU use, % of one core (the mean over its life for a process that lived
    through fewer than two samples)."""
    bottlenecks: list[dict]
    """Per bottleneck port: backlogged windows, median rate while backlogged, capacity, ratio."""
    window_s: float
    samples: int
    silent_losses: list[dict] = field(default_factory=list)
    """Per switch port and place ("ingress", "buffer") with uncounted losses: packets, lost."""
    outside_busy_p50: float | None = None
    """Median over intervals of the machine's CPU use that the run's processes do not account
    for, % of all cores (:func:`outside_busy`); None in results judged before it was measured."""

    def as_dict(self) -> dict:
        return asdict(self)


# --- pure: samples -> numbers -> verdict ------------------------------------------------------

def _in_window(samples: list[Sample], t0: float, t1: float) -> list[Sample]:
    """Samples in [t0, t1], plus the one just before t0 so the first interval is complete."""
    inside = [s for s in samples if t0 <= s.t <= t1]
    before = [s for s in samples if s.t < t0]
    return ([before[-1]] if before else []) + inside


def machine_busy(samples: list[Sample]) -> np.ndarray:
    """Per interval between consecutive samples: % of all cores busy."""
    out = []
    for a, b in zip(samples, samples[1:]):
        total = b.machine[1] - a.machine[1]
        if total > 0:
            # clamped: Linux's iowait counter can step backwards, which puts a busy share of a
            # short interval a little outside 0..100 on a loaded machine
            out.append(min(100.0, max(0.0, 100.0 * (b.machine[0] - a.machine[0]) / total)))
    return np.array(out)


def process_busy(samples: list[Sample]) -> dict[str, np.ndarray]:
    """Per process label, per interval: % of one core."""
    out: dict[str, list[float]] = {}
    for a, b in zip(samples, samples[1:]):
        dt = b.t - a.t
        if dt <= 0:
            continue
        for label, cpu in b.procs.items():
            if label in a.procs:
                out.setdefault(label, []).append(100.0 * (cpu - a.procs[label]) / dt)
    return {k: np.array(v) for k, v in out.items()}


def outside_busy(samples: list[Sample]) -> np.ndarray:
    """Per interval between consecutive samples: % of all cores busy beyond what the sampled
    processes used (their CPU seconds over the machine's, which counts every core). What it
    holds: the kernel's work no process is charged for (softirqs forwarding the veth traffic),
    every process the run did not start, and on a virtual machine the time the hypervisor gave
    other guests (steal counts as busy in :func:`_machine_times`). Why measured: another job on a 2-core machine
    slows the switches and the agents alike, and a run can stay under every other threshold
    while its figures are not the code's."""
    out = []
    for a, b in zip(samples, samples[1:]):
        total = b.machine[1] - a.machine[1]
        if total <= 0:
            continue
        ours = sum(cpu - a.procs[label] for label, cpu in b.procs.items() if label in a.procs)
        out.append(min(100.0, max(0.0, 100.0 * (b.machine[0] - a.machine[0] - ours) / total)))
    return np.array(out)


def backlogged_service(samples: list[Sample], port: Port, full: bool = False) -> tuple[float, float]:
    """(slots served, seconds) of ``port`` while backlogged (``full``: certainly backlogged
    throughout, :class:`BacklogMeter`), between the first and the last sample that read it."""
    i = 2 if full else 0
    seen = [s.ports[port] for s in samples if port in s.ports and len(s.ports[port]) > i]
    if len(seen) < 2:
        return 0, 0.0
    return seen[-1][i] - seen[0][i], (seen[-1][i + 1] - seen[0][i + 1]) / 1e6


def losses(into: Mapping[Port, int], out_of: Mapping[Port, int]) -> dict[Port, tuple[int, int]]:
    """Per switch port: (packets that went into a stage, packets of those that never came out),
    from two counts' changes over the same quiet-to-quiet interval."""
    return {port: (n, max(0, n - out_of.get(port, 0))) for port, n in sorted(into.items())}


_WHERE = {"ingress": "frames before its pipeline (BMv2's capture ring overflowed)",
          "buffer": "admitted packets in BMv2's queue (full while its egress thread waited)",
          "scheduler": "admitted frames in the port's scheduler (its FIFO overflowed)"}


def service_readings(row: Mapping[str, Any],
                     rules: ValidityRules = ValidityRules()) -> tuple[float | None, float | None]:
    """A bottleneck port's service over its capacity as the port rules read it (``row``: one of
    :func:`judge`'s port rows): (the reading a slow port is judged on, the reading a fast one is),
    None where too few slots were served to tell.

    Why two: the loose measure (every interval the port was backlogged in at some sample) counts
    the idle moments of a port backlogged in bursts, so it can only read low (0.48-0.95x on
    ports a burst filled now and then); the strict one (intervals backlogged throughout) reads
    each interval on its measured length and so slightly high (up to 1.07x on a port of
    capacity R). A port is slow when even the strict one reads below ``min_rate_ratio``, fast
    when even the loose one reads above ``max_rate_ratio``."""
    low = row.get("full_ratio") if (row.get("full_slots") or 0) >= rules.min_busy_slots else None
    return low, row.get("ratio")


def judge(samples: list[Sample], t0: float, t1: float, capacity: Mapping[Port, float],
          agents: list[str], rules: ValidityRules = ValidityRules(),
          silent: Mapping[str, Mapping[Port, tuple[int, int]]] | None = None,
          lives: Mapping[str, ProcessLife] | None = None) -> Validity:
    """The verdict over the measured window [t0, t1] (monotonic seconds).

    ``capacity``: slots/s of each bottleneck port; ``agents``: the labels of the processes
    whose own CPU limit would invalidate the run (workers and the parameter server);
    ``silent``: per place (``"ingress"``, ``"buffer"``) and switch port, (packets, packets
    lost there uncounted) over the whole run (see :func:`losses`).
    """
    lost_rows: list[dict[str, Any]] = [{"switch": p[0], "port": p[1], "where": where, "packets": n, "lost": lost}
                 for where, by_port in sorted((silent or {}).items()) for p, (n, lost) in sorted(by_port.items())
                 if lost]
    lost_reasons = [f"switch {r['switch']} port {r['port']} lost {r['lost']} of {r['packets']} "
                    f"{_WHERE.get(r['where'], r['where'])}"
                    + (": the switch was starved of CPU" if r["where"] != "scheduler" else "")
                    for r in lost_rows if r["lost"] > rules.max_silent_loss * r["packets"]]
    win = _in_window(samples, t0, t1)
    reasons: list[str] = []
    if len(win) < 3:
        # too short to judge; still show what the whole run looked like
        reasons.append(f"the measured window ({t1 - t0:.1f} s) holds only {len(win)} samples: too short to judge "
                       "(run more iterations)")
        win = samples
        if len(win) < 2:
            return Validity(False, reasons + lost_reasons, float("nan"), float("nan"), {}, [], t1 - t0, len(win),
                            lost_rows)
    busy = machine_busy(win)
    if len(busy) == 0:
        return Validity(False, reasons + ["no CPU interval could be measured"] + lost_reasons, float("nan"),
                        float("nan"), {}, [], t1 - t0, len(win), lost_rows)
    p50, p90 = float(np.median(busy)), float(np.percentile(busy, 90))
    if p50 >= rules.machine_busy_max:
        reasons.append(f"machine saturated: median CPU {p50:.0f} % of all cores >= {rules.machine_busy_max:.0f} %")
    other = outside_busy(win)
    outside = float(np.median(other)) if len(other) else None
    if outside is not None and outside > rules.outside_busy_max:
        reasons.append(f"other work on the machine: a median {outside:.0f} % of all cores went to no process of the "
                       f"run (> {rules.outside_busy_max:.0f} %)")
    procs = {k: float(np.median(v)) for k, v in process_busy(win).items() if len(v)}
    for label, life in (lives or {}).items():
        mean = life.busy()
        if label not in procs and mean is not None:
            procs[label] = mean
    for label in agents:
        if label not in procs:
            reasons.append(f"{label}'s CPU use was never read: nothing says it did not set the pace")
        elif procs[label] >= rules.process_busy_max:
            reasons.append(f"{label} CPU-bound: median {procs[label]:.0f} % of a core")
    ports = []
    for port, cap in sorted(capacity.items()):
        n, busy_s = backlogged_service(win, port)
        judged = n >= rules.min_busy_slots and busy_s > 0
        row: dict[str, Any] = {"switch": port[0], "port": port[1], "capacity_pps": cap, "busy_slots": n,
               "busy_share": busy_s / (t1 - t0) if t1 > t0 else None,
               "rate_pps": n / busy_s if judged else None, "ratio": n / busy_s / cap if judged else None}
        # The slow-port check: the intervals backlogged throughout, and only where they hold
        # enough slots (the loose measure read ports that were rarely backlogged, in bursts,
        # 0.74-0.90x: no rate verdict from those). The fast-port check: the loose one, which can
        # only read low (the other, chosen on each interval's measured length, read 1.03-1.07x).
        nf, full_s = backlogged_service(win, port, full=True)
        row["full_slots"], row["full_ratio"] = nf, (nf / full_s / cap if full_s > 0 else None)
        ports.append(row)
        low, high = service_readings(row, rules)
        if low is not None and low < rules.min_rate_ratio:
            reasons.append(f"bottleneck {port[0]}:{port[1]} served {low * cap:.0f} pps while backlogged, "
                           f"{low:.0%} of its {cap:.0f} pps")
        elif high is not None and high > rules.max_rate_ratio:
            reasons.append(f"bottleneck {port[0]}:{port[1]} served {high:.2f}x its capacity while backlogged "
                           f"({row['rate_pps']:.0f} of {cap:.0f} pps): the port was faster than the run claims")
    reasons += lost_reasons
    return Validity(not reasons, reasons, p50, p90, procs, ports, t1 - t0, len(win), lost_rows, outside)


# --- I/O: sampling while a scheme runs ---------------------------------------------------------

def _machine_times() -> tuple[float, float]:
    import psutil

    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    # guest time is already part of user time on Linux: leave it out of the total
    total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
    return total - idle, total


@dataclass
class RunMonitor:
    """Samples CPU and bottleneck service in a thread until :meth:`stop`.

    ``processes``: label -> pid; ``read_ports``: a callable returning {port: (slots served while
    backlogged, microseconds backlogged, the same for the intervals certainly backlogged
    throughout)} for every bottleneck port (:meth:`ServiceSampler.totals`).
    A process that exits is simply no longer sampled; a failed switch read is logged and skipped, never fatal. Besides
    the samples, :attr:`lives` keeps each process's first and latest reading (when added, at
    every sample, when :meth:`read` is asked for it, at :meth:`stop`).
    """

    processes: dict[str, int]
    read_ports: Callable[[], dict[Port, tuple[float, ...]]]
    interval: float = 1.0
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="run-monitor", daemon=True)
        self._procs: dict[str, Any] = {}  # label -> psutil.Process
        self._lives_mu = threading.Lock()
        self.lives: dict[str, ProcessLife] = {}

    def add(self, label: str, pid: int) -> None:
        self.processes[label] = pid
        self.read(label)

    def read(self, label: str) -> None:
        """Read one process's CPU time now, into :attr:`lives` (call it for a process that has
        exited before it is reaped: its CPU time at exit is then the last reading)."""
        self._note(time.monotonic(), self._proc_times([label]))

    def _note(self, t: float, times: dict[str, float]) -> None:
        with self._lives_mu:
            for label, cpu in times.items():
                life = self.lives.get(label)
                if life is None:
                    self.lives[label] = ProcessLife(t, cpu, t, cpu)
                elif t >= life.t1:  # (the sampler and the runner's thread may note out of order)
                    self.lives[label] = ProcessLife(life.t0, life.cpu0, t, cpu)

    def start(self) -> RunMonitor:
        self._thread.start()
        return self

    def stop(self) -> list[Sample]:
        self._stop.set()
        self._thread.join(5)
        self._note(time.monotonic(), self._proc_times())
        return self.samples

    def _proc_times(self, labels: list[str] | None = None) -> dict[str, float]:
        import psutil

        out = {}
        for label in list(self.processes) if labels is None else labels:
            pid = self.processes[label]
            try:
                proc = self._procs.get(label)
                if proc is None or proc.pid != pid:
                    proc = self._procs[label] = psutil.Process(pid)
                t = proc.cpu_times()
                out[label] = t.user + t.system
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return out

    def sample(self) -> Sample:
        try:
            ports = self.read_ports()
        except Exception as exc:  # a switch that does not answer must not end the run
            log.warning("run monitor: reading bottleneck counters failed: %s", exc)
            ports = {}
        sample = Sample(time.monotonic(), _machine_times(), self._proc_times(), ports)
        self._note(sample.t, sample.procs)
        return sample

    def _loop(self) -> None:
        while True:
            self.samples.append(self.sample())
            if self._stop.wait(self.interval):
                self.samples.append(self.sample())
                return


# --- a bottleneck's service while backlogged, from its scheduler's counters ----------------------

@dataclass
class BacklogMeter:
    """Service while backlogged, from readings of a port's scheduler: cumulative slots sent, the
    frames queued at that moment and the slots they will cost. Two measures, per port:

    * ``totals``: intervals with frames queued at both ends. A port whose queue emptied and
      refilled in between still counts as busy the whole interval, which lowers its rate: the
      check for a port faster than its capacity cannot be fooled by it, but bursty traffic
      reads low (a leaf-spine run's lightly loaded uplinks read 0.84-0.90x their capacity under
      gloo-fp16's half-size bursts, at 43-67 % CPU);
    * ``full``: intervals no longer than ``horizon`` that began with at least ``horizon``'s
      service queued (the capacity times it, in slots) and ended with frames queued. What was
      queued at the start cannot leave sooner at the port's capacity or below, so such a port
      was backlogged throughout: the measure for the slow-port check. (Chosen first by the
      interval's own measured length, it read lightly loaded ports 1.03-1.07x: a short
      measured interval passed the test more easily and also read fast.)

    The readings come every 10 ms, a few frames apart at the testbed's rates (each read is one
    netlink dump per switch, about 0.1 ms of CPU). Pure: the caller gives the times."""

    capacity: dict[Port, float] = field(default_factory=dict)
    """port -> slots per second (ports not in it get no ``full`` measure)."""
    horizon: float = 0.02
    """Seconds: the longest interval ``full`` counts, and the service queued it needs."""
    last: dict[Port, tuple[float, float, int, float]] = field(default_factory=dict)
    """port -> (time, slots sent, frames queued, slots queued) of its latest reading."""
    totals: dict[Port, tuple[float, float]] = field(default_factory=dict)
    """port -> (slots served while backlogged, microseconds backlogged), cumulative."""
    full: dict[Port, tuple[float, float]] = field(default_factory=dict)
    """port -> (slots served, microseconds) in intervals certainly backlogged throughout."""

    def observe(self, t: float, port: Port, sent_slots: float, queued: int, queued_slots: float = 0.0) -> None:
        prev = self.last.get(port)
        slots, micros = self.totals.get(port, (0.0, 0.0))
        fslots, fmicros = self.full.get(port, (0.0, 0.0))
        if prev is not None and prev[2] > 0 and queued > 0 and t > prev[0]:
            served, dt = sent_slots - prev[1], t - prev[0]
            slots, micros = slots + served, micros + 1e6 * dt
            cap = self.capacity.get(port)
            if cap is not None and dt <= self.horizon and prev[3] >= cap * self.horizon:
                fslots, fmicros = fslots + served, fmicros + 1e6 * dt
        self.totals[port] = (slots, micros)
        self.full[port] = (fslots, fmicros)
        self.last[port] = (t, sent_slots, queued, queued_slots)

    def readings(self) -> dict[Port, tuple[float, ...]]:
        """port -> (``totals``' slots and microseconds, ``full``'s slots and microseconds)."""
        return {p: (*self.totals[p], *self.full.get(p, (0.0, 0.0))) for p in self.totals}


@dataclass(frozen=True)
class MeteredPort:
    """Where a bottleneck's scheduler is and how it charges (to count its service in slots)."""

    netns: str | None
    interface: str
    charge: Any
    """:class:`dlcp.controller.scheduler.Charge` of the port."""
    capacity: float | None = None
    """Slots per second (for the meter's ``full`` measure)."""


class ServiceSampler:
    """Reads every bottleneck's scheduler every ``interval`` seconds in a thread (one netlink
    dump per switch namespace) into a :class:`BacklogMeter`; :meth:`totals` is what
    :class:`RunMonitor` samples, :meth:`counts` the frames each scheduler sent and dropped."""

    def __init__(self, ports: dict[Port, MeteredPort], interval: float = 0.01) -> None:
        from dlcp.controller.scheduler import QdiscReader

        self.ports, self.interval = ports, interval
        self.meter = BacklogMeter({p: m.capacity for p, m in ports.items() if m.capacity is not None}, 2 * interval)
        self._mu = threading.Lock()
        self._counts: dict[Port, tuple[int, int]] = {}
        by_ns: dict[str | None, list[str]] = {}
        for p in ports.values():
            by_ns.setdefault(p.netns, []).append(p.interface)
        self.readers = {ns: QdiscReader(ns, ifaces) for ns, ifaces in by_ns.items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="service-sampler", daemon=True)

    def start(self) -> ServiceSampler:
        self.read()
        self._thread.start()
        return self

    def read(self) -> None:
        stats, stamps = {}, {}
        for ns, reader in self.readers.items():
            try:
                stats[ns] = reader.read()
                stamps[ns] = time.monotonic()  # each namespace's own time: a few 0.1 ms apart
            except OSError as exc:
                log.warning("service sampler: reading the schedulers in %s failed: %s", ns, exc)
        with self._mu:
            for port, where in self.ports.items():
                st = stats.get(where.netns, {}).get(where.interface)
                t = stamps.get(where.netns, 0.0)
                if st is None:
                    continue
                c = where.charge
                if c.mpu == c.slot:  # charged per packet
                    sent, queued = float(st.packets), float(st.qlen)
                else:  # per byte; small frames cost at least mpu, so ``queued`` may be low: safe
                    sent = (st.bytes + st.packets * c.overhead) / c.slot
                    queued = (st.backlog + st.qlen * c.overhead) / c.slot
                self.meter.observe(t, port, sent, st.qlen, queued)
                self._counts[port] = (st.packets, st.drops)

    def totals(self) -> dict[Port, tuple[float, ...]]:
        """:meth:`BacklogMeter.readings`."""
        with self._mu:
            return self.meter.readings()

    def counts(self) -> dict[Port, tuple[int, int]]:
        """Per port: (frames sent, frames dropped) by its scheduler, cumulative."""
        with self._mu:
            return dict(self._counts)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.read()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.read()
        for reader in self.readers.values():
            reader.close()
