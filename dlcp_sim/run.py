"""Run simulated experiments (``dlcp sim``): one simulator process per scheme, its report parsed.

I/O lives here (files, processes); what a scenario is lives in :mod:`dlcp_sim.scenario`.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from dlcp_sim.build import simulator
from dlcp_sim.scenario import (
    SimOptions,
    background_flows,
    line_rate_bound,
    scenario_text,
)
from dlcp.hostagent.errors import DlcpUserError
from dlcp.topologies.progress import Progress
from dlcp.topologies.results import document
from dlcp.topologies.stats import Estimate, median_ci, paired_ratios, verdict


@dataclass(frozen=True)
class Iteration:
    job: int
    worker: int
    iteration: int
    start: float
    computed: float
    end: float

    @property
    def sync(self) -> float:
        """Seconds from the end of compute to the last parameter received."""
        return self.end - self.computed


@dataclass(frozen=True)
class Completion:
    """One message completed at its receiver."""

    receiver: int
    sender: int
    message: int
    time: float
    packets: int
    missing: int


@dataclass(frozen=True)
class FlowRecord:
    """One background flow that completed."""

    id: int
    src: int
    dst: int
    size: int
    start: float
    end: float

    @property
    def fct(self) -> float:
        return self.end - self.start


#: Background flows up to this size count as small (pFabric's (0, 100 KB] bin).
SMALL_FLOW_BYTES = 100_000


def fct_stats(flows: list[FlowRecord], before: float = float("inf")) -> dict:
    """Flow completion times (ms) of the flows that started before ``before``: all of them
    (average, p99) and the small ones (average, p99)."""
    chosen = [f for f in flows if f.start < before]
    fct = np.array([f.fct for f in chosen]) * 1e3
    small = np.array([f.fct for f in chosen if f.size <= SMALL_FLOW_BYTES]) * 1e3

    def pick(a: np.ndarray, q: float | None) -> float | None:
        if not a.size:
            return None
        return float(a.mean() if q is None else np.percentile(a, q))

    return {"flows": len(chosen), "fct_avg_ms": pick(fct, None), "fct_p99_ms": pick(fct, 99),
            "small_flows": int(small.size), "small_fct_avg_ms": pick(small, None), "small_fct_p99_ms": pick(small, 99)}


@dataclass(frozen=True)
class PortStats:
    switch: str
    port: int
    enqueued: int
    tail_drops: int
    marks: int
    max_depth: int
    selective_drops: tuple[int, ...]


@dataclass(frozen=True)
class HostStats:
    rank: int
    data_sent: int
    retransmitted: int
    duplicates: int
    probes: int
    bitmaps: int
    control_sent: int
    messages_received: int
    packets_at_completion: int
    missing_at_completion: int
    late: int = 0
    """Data packets that arrived after their message had completed (the sender had not yet
    heard STOP); ``duplicates`` are those that arrived twice before it did."""
    reports: int = 0
    """FEEDBACK packets this host received as a sender on their own, not riding a STOP or BITMAP."""


@dataclass
class SchemeResult:
    scheme: str
    iterations: list[Iteration] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    ports: list[PortStats] = field(default_factory=list)
    hosts: list[HostStats] = field(default_factory=list)
    flows: list[FlowRecord] = field(default_factory=list)
    unfinished: list[tuple[int, int, int, int]] = field(default_factory=list)
    """Background flows that never completed: (id, bytes, queued by the sender, received)."""
    simulated_s: float = 0.0
    events: int = 0
    wall_s: float = 0.0
    bound_s: float = 0.0
    warmup: int = 0
    """First iterations left out of the sync statistics."""

    def training_end(self) -> float:
        """When the last worker finished its last iteration (simulated seconds)."""
        return max((i.end for i in self.iterations), default=0.0)

    def measured(self) -> list[Iteration]:
        return [i for i in self.iterations if i.iteration >= self.warmup]

    def sync_times(self) -> np.ndarray:
        return np.array([i.sync for i in self.measured()])

    def summary(self) -> dict:
        sync = self.sync_times()
        it = np.array([i.end - i.start for i in self.measured()])
        packets = sum(h.packets_at_completion for h in self.hosts)
        return {
            "scheme": self.scheme, "iterations": len(self.iterations),
            "sync_p50_ms": float(np.median(sync) * 1e3), "sync_p99_ms": float(np.percentile(sync, 99) * 1e3),
            "iteration_p50_ms": float(np.median(it) * 1e3), "bound_ms": self.bound_s * 1e3,
            "sync_over_bound": float(np.median(sync) / self.bound_s) if self.bound_s else None,
            "tail_drops": sum(p.tail_drops for p in self.ports),
            "selective_drops": [sum(p.selective_drops[c] for p in self.ports) for c in range(8)],
            "marks": sum(p.marks for p in self.ports),
            "retransmitted": sum(h.retransmitted for h in self.hosts),
            "duplicates": sum(h.duplicates for h in self.hosts), "late": sum(h.late for h in self.hosts),
            "missing_fraction": sum(h.missing_at_completion for h in self.hosts) / packets if packets else 0.0,
            **({"background": fct_stats(self.flows, self.training_end())} if self.flows else {}),
            "events": self.events, "wall_s": self.wall_s,
            "events_per_s": self.events / self.wall_s if self.wall_s else None,
        }


def parse_report(scheme: str, text: str) -> SchemeResult:
    """The simulator's line report (dlcp_sim/ns3/main.cc) as a :class:`SchemeResult`."""
    r = SchemeResult(scheme)
    for line in text.splitlines():
        kind, *f = line.split()
        if kind == "iter":
            r.iterations.append(Iteration(int(f[0]), int(f[1]), int(f[2]), float(f[3]), float(f[4]), float(f[5])))
        elif kind == "done":
            r.completions.append(Completion(int(f[0]), int(f[1]), int(f[2]), float(f[3]), int(f[4]), int(f[5])))
        elif kind == "port":
            r.ports.append(PortStats(f[0], int(f[1]), int(f[2]), int(f[3]), int(f[4]), int(f[5]),
                                     tuple(map(int, f[6:14]))))
        elif kind == "host":
            r.hosts.append(HostStats(*map(int, f[:12])))
        elif kind == "flow":
            r.flows.append(FlowRecord(int(f[0]), int(f[1]), int(f[2]), int(f[3]), float(f[4]), float(f[5])))
        elif kind == "unfinished":
            r.unfinished.append((int(f[0]), int(f[1]), int(f[2]), int(f[3])))
        elif kind == "sim":
            r.simulated_s, r.events, r.wall_s = float(f[0]), int(f[1]), float(f[2])
    return r


def simulate(opts: SimOptions, scheme: str, timeout: float = 3600.0) -> SchemeResult:
    """Run one scheme's scenario in the simulator and parse its report."""
    exe = simulator()
    with tempfile.NamedTemporaryFile("w", suffix=".scenario", delete=False) as f:
        f.write(scenario_text(opts, scheme))
        path = f.name
    try:
        done = subprocess.run([str(exe), path], capture_output=True, text=True, timeout=timeout, check=False)
    finally:
        Path(path).unlink(missing_ok=True)
    if done.returncode != 0:
        hint = ""
        if "From OPEN->DISORDER" in done.stderr:  # tcp-socket-base.cc's DupAck
            hint = (" (an assertion inside ns-3's TCP: duplicate ACKs counted while an ECN sender "
                    "was in CA_CWR were not reset when it left CA_CWR with SACK news. DCTCP "
                    "sockets here run without SACK for this reason; was SACK turned on?)")
        raise DlcpUserError(f"the simulator failed on scheme {scheme} (exit {done.returncode}): "
                            f"{done.stderr[-2000:]}{hint}")
    result = parse_report(scheme, done.stdout)
    expected = len(opts.placement()) * opts.workers * opts.iterations
    if len(result.iterations) != expected:
        raise DlcpUserError(f"scheme {scheme}: {len(result.iterations)} of {expected} worker iterations finished "
                            f"in {result.simulated_s:.3f} simulated s; a message never completed")
    flows = len(background_flows(opts))
    if len(result.flows) != flows:
        stuck = ", ".join(f"flow {i}: {sent}/{size} B queued, {got} received"
                          for i, size, sent, got in result.unfinished[:5])
        raise DlcpUserError(f"scheme {scheme}: {len(result.flows)} of {flows} background flows completed in "
                            f"{result.simulated_s:.3f} simulated s ({stuck})")
    result.bound_s = line_rate_bound(opts, scheme)
    result.warmup = opts.warmup
    return result


def run(opts: SimOptions, repeat: int = 1, out: Path | None = None,
        provenance: dict | None = None, progress: Progress | None = None) -> dict[str, list[SchemeResult]]:
    """Every scheme of ``opts`` at seeds ``opts.seed .. opts.seed + repeat - 1`` (the seed draws
    the gradients and the flow hashes: which flows collide); with ``out``, writes
    ``results.json`` there (with ``provenance``: what made it, :mod:`dlcp.hostagent.provenance`).
    ``progress`` counts each simulated scheme and seed (a line with an ETA)."""
    if repeat < 1:
        raise DlcpUserError("--repeat must be at least 1")
    results: dict[str, list[SchemeResult]] = {s: [] for s in opts.schemes}
    for r in range(repeat):
        for scheme in opts.schemes:
            results[scheme].append(simulate(replace(opts, seed=opts.seed + r), scheme))
            if progress is not None:
                progress.step(f"{scheme}, seed {opts.seed + r}: sync p50 "
                              f"{results[scheme][-1].summary()['sync_p50_ms']:.1f} ms")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results_document(opts, repeat, results, provenance), indent=1))
    return results


def results_document(opts: SimOptions, repeat: int, results: dict[str, list[SchemeResult]],
                     provenance: dict | None) -> dict:
    """The run as a results file (:mod:`dlcp.topologies.results`, the testbed's shape): one record
    per scheme and seed, in the order they ran, its metrics named as the testbed's."""
    runs = []
    for r in range(repeat):
        for scheme, done in results.items():
            metrics = {k: v for k, v in done[r].summary().items() if k != "scheme"}
            metrics["selective_drops"] = {str(c): n for c, n in enumerate(metrics["selective_drops"])}
            runs.append({"scheme": scheme, "repeat": r, "seed": opts.seed + r, "metrics": metrics,
                         "iterations_detail": [asdict(i) for i in done[r].iterations],
                         "ports": [asdict(p) for p in done[r].ports]})
    reference = "baseline" if "baseline" in results else next(iter(results))
    return document("simulator", opts.to_dict(), runs, provenance=provenance, reference=reference,
                    summary=summary(results), repeat=repeat)


def summary(results: dict[str, list[SchemeResult]]) -> dict[str, dict]:
    """Per scheme: medians over seeds with 95 % intervals of sync p50 and p99, and the speedup
    over the baseline paired by seed (the testbed's statistics, :mod:`dlcp.topologies.stats`).

    With background flows, also their completion times (average, p99, small flows' p99) over
    the flows that started while every scheme of that seed was still training (so the schemes
    are compared on the same flows, all of which met training traffic), and the ratio to the
    baseline's, paired by seed (below 1: DLCP's flows finish sooner)."""
    base = results.get("baseline")
    seeds = min(len(runs) for runs in results.values())
    windows = [min(runs[i].training_end() for runs in results.values()) for i in range(seeds)]
    background = any(r.flows for runs in results.values() for r in runs)

    def fct(runs: list[SchemeResult], key: str) -> list[float]:
        return [fct_stats(runs[i].flows, windows[i])[key] for i in range(seeds)]

    out = {}
    for scheme, runs in results.items():
        p50 = [r.summary()["sync_p50_ms"] for r in runs]
        p99 = [r.summary()["sync_p99_ms"] for r in runs]
        row = {"sync_p50_ms": median_ci(p50).as_dict(), "sync_p99_ms": median_ci(p99).as_dict(), "seeds": len(runs)}
        if base is not None and scheme != "baseline":
            for key, mine in (("p50", p50), ("p99", p99)):
                ref = [r.summary()[f"sync_{key}_ms"] for r in base]
                est = median_ci(paired_ratios(ref, mine))
                row[f"speedup_{key}"] = {**est.as_dict(), "verdict": verdict(est)}
        if background:
            for key in ("fct_avg_ms", "fct_p99_ms", "small_fct_p99_ms"):
                mine = fct(runs, key)
                if any(v is None for v in mine):
                    continue
                row[key] = median_ci(mine).as_dict()
                if base is not None and scheme != "baseline":
                    ref = fct(base, key)
                    if all(v is not None for v in ref):
                        row[f"{key}_ratio"] = median_ci(paired_ratios(mine, ref)).as_dict()  # mine / baseline's
            row["background_flows"] = [fct_stats(runs[i].flows, windows[i])["flows"] for i in range(seeds)]
        out[scheme] = row
    return out


def table(results: dict[str, list[SchemeResult]]) -> str:
    """A plain-text comparison: medians over seeds [95 % interval], and per-seed means of the rest."""
    stats = summary(results)
    header = (f"{'scheme':<9} {'sync p50 ms':>24} {'sync p99 ms':>24} {'p50/bound':>9} {'speedup p50':>20} "
              f"{'speedup p99':>20} {'tail drops':>10} {'selective':>9} {'retx':>7} {'dups':>6} {'late':>7} "
              f"{'missing %':>9} {'events/s':>9}")
    rows = [header]
    for scheme, runs in results.items():
        sums = [r.summary() for r in runs]
        mean = {k: float(np.mean([x[k] for x in sums])) for k in ("sync_over_bound", "tail_drops", "retransmitted",
                                                                   "duplicates", "late", "missing_fraction",
                                                                   "events_per_s")}
        sel = float(np.mean([sum(x["selective_drops"]) for x in sums]))
        st = stats[scheme]

        def est(d: dict, fmt: str) -> str:
            return Estimate(d["median"], d["ci_low"], d["ci_high"], d["n"]).text(fmt)

        sp = {k: est(st[f"speedup_{k}"], "{:.2f}") if f"speedup_{k}" in st else "-" for k in ("p50", "p99")}
        rows.append(f"{scheme:<9} {est(st['sync_p50_ms'], '{:.2f}'):>24} {est(st['sync_p99_ms'], '{:.2f}'):>24} "
                    f"{mean['sync_over_bound']:>9.2f} {sp['p50']:>20} {sp['p99']:>20} {mean['tail_drops']:>10.0f} "
                    f"{sel:>9.0f} {mean['retransmitted']:>7.0f} {mean['duplicates']:>6.0f} {mean['late']:>7.0f} "
                    f"{100 * mean['missing_fraction']:>9.2f} {mean['events_per_s']:>9.0f}")
    if any("fct_avg_ms" in st for st in stats.values()):
        rows += ["", ("background flows that started while every scheme trained (FCT ms; ratio = scheme / "
                      "baseline, paired by seed)"),
                 (f"{'scheme':<9} {'flows':>12} {'FCT avg':>24} {'FCT p99':>24} {'small-flow FCT p99':>24} "
                  f"{'avg ratio':>20} {'p99 ratio':>20} {'small p99 ratio':>20}")]
        for scheme, st in stats.items():
            if "fct_avg_ms" not in st:
                continue
            cell = {k: Estimate(d["median"], d["ci_low"], d["ci_high"], d["n"]).text("{:.2f}")
                    for k, d in st.items() if k.startswith(("fct_", "small_fct_"))}
            rows.append(f"{scheme:<9} {'/'.join(map(str, st['background_flows'])):>12} "
                        + " ".join(f"{cell.get(k, '-'):>24}" for k in ("fct_avg_ms", "fct_p99_ms", "small_fct_p99_ms"))
                        + " " + " ".join(f"{cell.get(k + '_ratio', '-'):>20}"
                                         for k in ("fct_avg_ms", "fct_p99_ms", "small_fct_p99_ms")))
    return "\n".join(rows)
