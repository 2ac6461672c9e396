"""Turn a run's records into results.json, a summary table and PNG plots.

Metrics per run of a scheme, over the measured iterations (the warm-up iteration and the
communication-only calibration iterations are left out, the latter used only for E):

* sync time: from the last gradient becoming ready to the last average arriving, p50/p99;
* iteration time p50, and speedup = the reference's iteration p50 / this scheme's, paired by
  repetition (run r of each, interleaved); the reference is what users run (``gloo``) when it
  ran, else ``baseline``, or ``--reference``;
* comm / bound: the calibration iterations' communication time (p50; nothing to hide it
  behind) over the line-rate bound (:mod:`dlcp.topologies.bound`), how far from what the
  bottlenecks allow (sync / bound is kept in the metrics, but sync is only what the backward
  pass left exposed, and may be far below the bound);
* lost fraction and retransmitted packets (the workers', over the measured iterations); for DLCP
  runs, from the endpoints' totals over the whole run, what a parameter server resent (its
  replies and the resends its BITMAPs asked for, which no worker's record counts) and the share
  of all data packets that were sent again (:func:`resend_metrics`);
* ordering efficiency E = (cost_max - U) / (cost_max - cost_min) (SysML'18, TicTac): with
  comm = the median communication time of the calibration iterations and comp = the compute
  time, cost_max = comm + comp, cost_min = max(comm, comp), U = mean iteration time. A value
  outside [0, 1] is not a result: it is flagged with its reason and its inputs;
* straggler spread (TicTac): per iteration, (max - min) / mean of the workers' iteration
  times, averaged;
* where the time goes (:mod:`dlcp.topologies.breakdown`): compute, first byte, transmission,
  recovery and straggler wait, means in ms, and a stacked-bar plot per scheme;
* messages and control frames (sent and received) per worker per iteration, medians: what
  fusion and the batched control path cost;
* validity (:mod:`dlcp.topologies.validity`) and the cross traffic's delivered rate and loss;
* training workloads: final accuracy, and time-to-accuracy (:mod:`dlcp.topologies.tta`): training
  seconds to a target accuracy (``--target-accuracy``, default the reference's final accuracy
  in the same repetition minus 0.5 points, :func:`tta_targets`), its speedup paired by run, and
  a plot of accuracy against training time.

With ``--repeat N`` the summary gives, per scheme, medians over its runs with 95 % bootstrap
intervals from 5 runs on (the range, and no call, from fewer: :mod:`dlcp.topologies.stats`) and
calls a speedup only when its interval excludes 1; beside the speedup, the service ratio of
the scheme's bottleneck ports (what they served while backlogged over their capacity).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from dlcp.topologies.breakdown import PARTS, add_stragglers
from dlcp.topologies.results import by_scheme, repetitions, schemes
from dlcp.topologies.stats import Estimate, median_ci, paired_ratios, verdict, versus
from dlcp.topologies.tta import TARGET_MARGIN, accuracy_trace, default_target, time_to_accuracy
from dlcp.topologies.validity import service_readings


def ordering_efficiency(comm: float, comp: float, u: float) -> dict:
    """E with its inputs, or a flag saying why there is no E (pure; seconds in, dict out)."""
    out: dict[str, Any] = {"comm_s": comm, "comp_s": comp, "iteration_s": u, "value": None, "flag": None}
    cost_max, cost_min = comm + comp, max(comm, comp)
    if math.isnan(comm):
        out["flag"] = "not measured: no communication-only iterations (real training has none)"
        return out
    if cost_max <= cost_min:
        out["flag"] = "undefined: needs both a communication and a compute time"
        return out
    e = (cost_max - u) / (cost_max - cost_min)
    out["raw"] = e
    if e > 1:
        out["flag"] = (f"E = {e:.2f} > 1: the iteration ({u * 1e3:.0f} ms) was shorter than max(comm, comp) "
                       f"= {cost_min * 1e3:.0f} ms, so the calibration overstated the communication time")
    elif e < 0:
        out["flag"] = (f"E = {e:.2f} < 0: the iteration ({u * 1e3:.0f} ms) was longer than comm + comp = "
                       f"{cost_max * 1e3:.0f} ms, i.e. worse than no overlap: contention or stragglers that "
                       "the communication-only calibration did not see")
    else:
        out["value"] = e
    return out


def scheme_metrics(s: dict) -> dict:
    """The metrics of one run of one scheme (see the module docstring)."""
    recs = [r for r in s["iterations"] if r.get("kind") == "measured"]
    calib = [r for r in s["iterations"] if r.get("kind") == "calibration"]
    if not recs:
        return {}
    sync = np.array([r["sync_time"] for r in recs])
    iters = np.array([r["iteration_time"] for r in recs])
    comp = float(np.mean([r["compute_time"] for r in recs]))
    comm = float(np.median([r["comm_span"] for r in calib])) if calib else float("nan")
    eff = ordering_efficiency(comm, comp, float(np.mean(iters)))
    by_it: dict[int, list[float]] = {}
    for r in recs:
        by_it.setdefault(r["iteration"], []).append(r["iteration_time"])
    spread = float(np.mean([(max(v) - min(v)) / np.mean(v) for v in by_it.values() if len(v) > 1] or [0.0]))
    drops_by_class: dict[str, int] = {}
    for sw in s["switches"].values():
        for c, n in sw["selective_drops_by_class"].items():
            drops_by_class[str(c)] = drops_by_class.get(str(c), 0) + n
    tail = sum(r.get("tail_dropped_pkts", 0) for sw in s["switches"].values() for r in sw["ports"])
    final = [r["accuracy"] for r in s["iterations"] if r.get("kind") == "final"]
    extra: dict[str, Any] = {"accuracy": float(np.mean(final))} if final else {}
    trace = accuracy_trace(s["iterations"])
    if trace:
        extra["accuracy_trace"] = trace
    if all("control_frames" in r for r in recs):
        extra["messages_per_iteration"] = float(np.median([r["messages"] for r in recs]))
        extra["control_frames_per_iteration"] = float(np.median([r["control_frames"] for r in recs]))
    parts = [r["breakdown"] for r in recs if "breakdown" in r]
    if parts:
        extra["breakdown_ms"] = {k: 1e3 * float(np.mean([b.get(k, 0.0) for b in parts])) for k in PARTS}
    sync_p50 = float(np.percentile(sync, 50))
    bound = (s.get("bound") or {}).get("seconds")
    extra["sync_over_bound"] = None
    if bound:
        # sync is only what the backward pass did not hide, so it may fall below the bound; the
        # calibration iterations (communication alone) say how close to line rate a scheme runs
        extra["sync_over_bound"] = sync_p50 / bound
        if not math.isnan(comm):
            extra["comm_over_bound"] = comm / bound
    return {**extra, "sync_p50_ms": 1e3 * sync_p50, "sync_p99_ms": 1e3 * float(np.percentile(sync, 99)),
            "iteration_p50_ms": 1e3 * float(np.percentile(iters, 50)),
            "iteration_mean_ms": 1e3 * float(np.mean(iters)), "iteration_p90_ms": 1e3 * float(np.percentile(iters, 90)),
            "iteration_p99_ms": 1e3 * float(np.percentile(iters, 99)),
            "missing_fraction": float(np.mean([r["lost_fraction"] for r in recs])),
            "retransmitted": int(sum(r["retransmissions"] for r in recs)),
            "ordering_efficiency": eff["value"], "ordering_efficiency_detail": eff, "straggler_spread": spread,
            "selective_drops": drops_by_class, "tail_drops": tail, **resend_metrics(s)}


def resend_metrics(s: dict) -> dict[str, Any]:
    """From a DLCP run's endpoint totals (every endpoint writes them as it stops, over the whole
    run: warm-up, measured and calibration iterations): ``server_retransmitted``, the data
    packets a parameter server sent again (None without one), and ``resent_share``, the data
    packets every endpoint sent again over all it sent. Why apart from ``retransmitted``: a
    server writes no per-iteration records, so the workers' records, where that comes from,
    never count its resends; in a PS run they are most of them (3,300 of 3,318 in one run of
    20261129-133954). Empty for runs without endpoint totals (gloo's, slim files' own metrics)."""
    eps = {int(rank): e for rank, e in (s.get("endpoints") or {}).items() if e}
    sent = sum(e.get("data_pkts_sent", 0) for e in eps.values())
    if not eps or not sent:
        return {}
    out: dict[str, Any] = {"resent_share": sum(e.get("retransmitted_pkts", 0) for e in eps.values()) / sent,
                           "server_retransmitted": None}
    if s.get("pattern") == "ps":  # the server is the rank after the workers (who write the records)
        server = 1 + max((r["rank"] for r in s.get("iterations", []) if "rank" in r), default=-1)
        if server in eps:
            out["server_retransmitted"] = int(eps[server].get("retransmitted_pkts", 0))
    return out


def _tta(metrics: dict, target: float) -> float:
    """A run's time to ``target`` in training seconds, NaN when it never got there."""
    t = time_to_accuracy(metrics.get("accuracy_trace", []), target)
    return math.nan if t is None else t


def _runs(results: dict, scheme: str) -> list[dict]:
    return [s for s in by_scheme(results).get(scheme, []) if s.get("metrics")]


def _valid(s: dict) -> bool:
    return bool((s.get("validity") or {}).get("valid", True))


def reference(results: dict) -> str:
    """The scheme speedups are against: the run's (``results["reference"]``); results written
    before runs had one compared with ``baseline``."""
    return results.get("reference") or "baseline"


def accuracy_target(results: dict) -> float | None:
    """The run's time-to-accuracy target as one figure: the one it was given, else the median
    of the repetitions' targets (:func:`tta_targets`), None without either."""
    targets = tta_targets(results)
    given = results["options"].get("target_accuracy")
    if given is not None:
        return float(given)
    return float(np.median(list(targets.values()))) if targets else None


def seeded(results: dict) -> bool:
    """Whether the run's repetitions trained from different seeds (runs since issue 43 record
    theirs; before, every repetition trained from seed 0 and records none)."""
    return len({s.get("seed") for s in results["runs"] if s.get("seed") is not None}) > 1


def tta_targets(results: dict) -> dict[int, float]:
    """Each repetition's time-to-accuracy target, ``{repeat: accuracy}``.

    Given (``--target-accuracy``): that, for every repetition. Otherwise the reference's final
    accuracy minus 0.5 points (:data:`dlcp.topologies.tta.TARGET_MARGIN`): where repetitions
    trained from different seeds (:func:`seeded`), the reference's final *in the same
    repetition*, since seeds alone move MNIST-1D's final accuracy by 4 points (88-92 %) and a
    target common to all of them would be out of reach of the lesser seeds; with one seed, the
    median over its valid runs (as runs before issue 43 were reported). A repetition whose
    reference did not finish takes the median. Empty without a target and without reference
    runs. A results document re-paired against another scheme (:func:`against`) carries its
    original targets."""
    repeats = sorted({s.get("repeat", 0) for s in results["runs"]})
    if "tta_targets" in results:
        return {int(k): float(v) for k, v in results["tta_targets"].items()}
    given = results["options"].get("target_accuracy")
    if given is not None:
        return {r: float(given) for r in repeats}
    base_runs = _runs(results, reference(results))
    base_ok = [s for s in base_runs if _valid(s)] or base_runs
    finals = {s.get("repeat", 0): s["metrics"].get("accuracy", math.nan) for s in base_ok}
    common = default_target(list(finals.values()))
    if common is None:
        return {}
    own = {r: a - TARGET_MARGIN for r, a in finals.items() if not math.isnan(a)} if seeded(results) else {}
    return {r: own.get(r, common) for r in repeats}


def target_rule(results: dict) -> str:
    """How the run's time-to-accuracy target was set, in words for a summary or a page."""
    ref = reference(results)
    if results["options"].get("target_accuracy") is not None:
        return "--target-accuracy"
    if seeded(results) or "tta_targets" in results:
        return f"{ref}'s final in the same repetition (seed) - 0.5 points; median given"
    return f"{ref} final - 0.5 points"


def against(results: dict, scheme: str) -> dict:
    """``results`` with speedups paired against ``scheme`` instead of the run's reference, and
    the accuracy targets kept at the run's own (so the times to accuracy stay comparable).

    Raises:
        ValueError: ``scheme`` did not run.
    """
    if not _runs(results, scheme):
        names = schemes(results)
        raise ValueError(f"{scheme!r} is not one of the run's schemes {names}")
    return {**results, "reference": scheme, "tta_targets": {str(r): t for r, t in tta_targets(results).items()},
            "tta_rule": target_rule(results)}


def aggregate(results: dict) -> dict[str, dict]:
    """Per scheme: medians over its runs with bootstrap intervals, the paired speedup against
    the reference (:func:`reference`, when it ran) and its verdict, and how many runs were valid.

    Only valid runs count when a scheme has any (``basis`` says which): an invalid run measured
    the machine, not the network. The speedup pairs run r of the scheme with the reference's
    run r, both valid; the same fallback applies."""
    names = schemes(results)
    base_runs = _runs(results, reference(results))
    base_ok = [s for s in base_runs if _valid(s)] or base_runs
    base = {s.get("repeat", 0): s["metrics"]["iteration_p50_ms"] for s in base_ok}
    target = accuracy_target(results)
    targets = tta_targets(results)
    base_tta = {s.get("repeat", 0): _tta(s["metrics"], targets[s.get("repeat", 0)])
                for s in base_ok} if targets else {}
    out = {}
    for name in names:
        every = _runs(results, name)
        if not every:
            continue
        runs = [r for r in every if _valid(r)] or every
        m = [r["metrics"] for r in runs]

        def est(key: str, m: list[dict] = m) -> Estimate:
            return median_ci([x.get(key, float("nan")) if x.get(key) is not None else float("nan") for x in m])

        row: dict[str, Any] = {k: est(k) for k in (
            "sync_p50_ms", "sync_p99_ms", "iteration_p50_ms", "sync_over_bound", "comm_over_bound",
            "missing_fraction", "ordering_efficiency", "messages_per_iteration", "control_frames_per_iteration",
            "accuracy", "straggler_spread")}
        if targets and any("accuracy_trace" in x for x in m):
            tta = {r.get("repeat", 0): _tta(r["metrics"], targets[r.get("repeat", 0)]) for r in runs}
            row["tta_s"] = median_ci(list(tta.values()))
            row["tta_reached"] = sum(not math.isnan(t) for t in tta.values())
            if base_tta:
                keys = [k for k in tta if k in base_tta]
                row["tta_speedup"] = median_ci(paired_ratios([base_tta[k] for k in keys], [tta[k] for k in keys]))
        row["retransmitted"] = median_ci([x["retransmitted"] for x in m])
        if any(x.get("server_retransmitted") is not None for x in m):
            row["server_retransmitted"] = est("server_retransmitted")
        row["selective_drops"] = median_ci([sum(x["selective_drops"].values()) for x in m])
        row["tail_drops"] = median_ci([x["tail_drops"] for x in m])
        if base:
            mine = [r["metrics"]["iteration_p50_ms"] for r in runs if r.get("repeat", 0) in base]
            ref = [base[r.get("repeat", 0)] for r in runs if r.get("repeat", 0) in base]
            row["speedup"] = median_ci(paired_ratios(ref, mine))
        row["service"] = service_range(runs)
        row["valid_runs"] = sum(_valid(r) for r in every)
        row["runs"] = len(every)
        row["basis"] = "valid runs" if any(_valid(r) for r in every) else "all runs (none valid)"
        flags = [r["metrics"]["ordering_efficiency_detail"]["flag"] for r in every]
        row["e_flags"] = [f for f in flags if f and not f.startswith("not measured")]
        row["cross"] = [r["cross"] for r in every if r.get("cross")]
        if "tta_s" in row:
            row["tta_target"] = target
        out[name] = row
    return out


def service_range(runs: list[dict]) -> tuple[float | None, float] | None:
    """The lowest and highest service ratio (a bottleneck port's rate while backlogged over its
    capacity) over the ports and ``runs``, each end read as the validity rules read it
    (:func:`dlcp.topologies.validity.service_readings`): the lowest from intervals the port was
    backlogged throughout (None where no port was so for enough slots: a port backlogged only in
    bursts has no rate to read from below), the highest from every backlogged interval. Runs
    recorded before the strict reading existed give the loose one at both ends. None where no
    port was backlogged long enough to tell. The two ends come in order (on steady ports the
    strict reading, slightly high, may pass the loose one)."""
    rows = [b for r in runs for b in (r.get("validity") or {}).get("bottlenecks", [])]
    highs = [b["ratio"] for b in rows if b.get("ratio") is not None]
    if not highs:
        return None
    if not any("full_slots" in b for b in rows):
        return min(highs), max(highs)
    lows = [low for low, _ in map(service_readings, rows) if low is not None]
    if not lows:
        return None, max(highs)
    ends = sorted((min(lows), max(highs)))  # (on steady ports the strict reading may pass the loose one)
    return ends[0], ends[1]


def service_text(service: tuple[float | None, float] | None) -> str:
    """``0.99-1.01x``, ``≤0.96x`` (no reading from below), or ``-``."""
    if service is None:
        return "-"
    lo, hi = service
    if lo is None:
        return f"≤{hi:.2f}x"
    return f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}x"


def _jsonable(agg: dict) -> dict:
    return {name: {k: v.as_dict() if isinstance(v, Estimate) else v for k, v in row.items()}
            for name, row in agg.items()}


def summary(results: dict) -> str:
    agg = aggregate(results)
    ref = reference(results)
    repeated = any(r["runs"] > 1 for r in agg.values())
    fmt_ms = "{:.0f}"
    lines = []
    cols = [("sync p50 ms", "sync_p50_ms", fmt_ms), ("sync p99 ms", "sync_p99_ms", fmt_ms),
            ("iter p50 ms", "iteration_p50_ms", fmt_ms), ("speedup", "speedup", "{:.2f}x"),
            ("comm/bound", "comm_over_bound", "{:.1f}")]
    width = 24 if repeated else 12
    head = f"{'scheme':<12}{'valid':>7}" + "".join(f"{c:>{width}}" for c, _, _ in cols)
    head += f"{'service':>12}{'lost':>8}{'retx':>7}{'E':>6}{'sel.drops':>10}{'tail':>6}{'msgs':>6}{'ctl':>5}"
    acc = any(not math.isnan(r["accuracy"].median) for r in agg.values())
    head += f"{'acc':>8}" if acc else ""
    lines += [head, "-" * len(head)]
    for name, r in agg.items():
        cells = "".join(f"{r[key].text(f) if key in r else '-':>{width}}" for _, key, f in cols)
        e = r["ordering_efficiency"]
        e_text = f"{e.median:.2f}" if not math.isnan(e.median) else ("flag" if r["e_flags"] else "-")
        flag = ("" if r["valid_runs"] == r["runs"] else "  INVALID: no valid run" if not r["valid_runs"]
                else f"  ({r['runs'] - r['valid_runs']} invalid run(s) left out)")
        line = (f"{name:<12}{r['valid_runs']:>4}/{r['runs']:<2}{cells}{service_text(r['service']):>12}"
                f"{r['missing_fraction'].median:>8.2%}"
                f"{r['retransmitted'].median:>7.0f}{e_text:>6}{r['selective_drops'].median:>10.0f}"
                f"{r['tail_drops'].median:>6.0f}{r['messages_per_iteration'].median:>6.0f}"
                f"{r['control_frames_per_iteration'].median:>5.0f}")
        if acc:
            line += f"{r['accuracy'].median:>8.4f}"
        lines.append(line + flag)
    lines.append("medians over valid runs" + (" [95 % bootstrap interval] from >= 5 runs, (range) from fewer"
                                              if repeated else "")
                 + f"; speedup = {ref}'s iteration p50 / the scheme's, paired by run; comm/bound = communication "
                 "alone (the calibration iterations' p50) / line-rate bound; service = what the bottleneck ports "
                 "served while backlogged / their capacity, lowest-highest over ports and runs as the validity "
                 "rules read them (lowest: intervals backlogged throughout, ≤ where none held enough slots); msgs, "
                 "ctl: messages and control frames per worker per iteration")
    for name, r in agg.items():
        if "server_retransmitted" in r:
            lines.append(f"{name}: its server resent {r['server_retransmitted'].median:.0f} data packets over the "
                         "whole run (not in retx, which counts the workers' measured iterations)")
    for name, r in agg.items():
        if "speedup" in r and name != ref and repeated:
            sp = r["speedup"]
            lines.append(f"{name}: {versus(sp, ref)} (speedup {sp.text('{:.2f}')})" if sp.is_interval
                         else f"{name}: speedup {sp.text('{:.2f}')}, {verdict(sp)}")
    lines += tta_lines(results, agg)
    for s in results["runs"]:
        v = s.get("validity") or {}
        tag = f"{s['scheme']}" + (f" r{s.get('repeat', 0) + 1}" if repeated else "")
        if v and not v.get("valid", True):
            lines.append(f"INVALID {tag}: " + "; ".join(v.get("reasons", [])))
        flag = (s.get("metrics") or {}).get("ordering_efficiency_detail", {}).get("flag")
        if flag and not flag.startswith("not measured"):
            lines.append(f"E of {tag}: {flag}")
    parts = breakdown_lines(results)
    if parts:
        lines += ["", "where the time goes, per iteration and worker (ms, means):", *parts]
    cross = cross_lines(results)
    if cross:
        lines += ["", "cross traffic (the cost to other tenants):", *cross]
    return "\n".join(lines)


def tta_lines(results: dict, agg: dict) -> list[str]:
    """Time-to-accuracy per scheme, with the target and how many runs reached it."""
    rows = {n: r for n, r in agg.items() if "tta_s" in r}
    if not rows:
        return []
    target = next(iter(rows.values()))["tta_target"]
    ref = reference(results)
    out = ["", f"time to accuracy {target:.4f} ({results.get('tta_rule') or target_rule(results)}),"
               " training seconds (evaluations left out):"]
    for name, r in rows.items():
        line = (f"  {name:<12}{r['tta_s'].text('{:.1f}') + ' s' if r['tta_reached'] else 'not reached':>24}"
                f"  reached in {r['tta_reached']}/{r['runs']} run(s); final accuracy {r['accuracy'].text('{:.4f}')}")
        sp = r.get("tta_speedup")
        if sp is not None and name != ref and sp.n:
            line += f"; speedup {sp.text('{:.2f}')}x" + (f", {verdict(sp)}" if sp.low is not None else "")
        out.append(line)
    return out


def breakdown_means(results: dict) -> dict[str, dict[str, float]]:
    """Per scheme: the mean of each part of the time breakdown (ms) over its runs."""
    means = {}
    for name, runs in by_scheme(results).items():
        rows = [s["metrics"]["breakdown_ms"] for s in runs if "breakdown_ms" in s.get("metrics", {})]
        if rows:
            means[name] = {k: float(np.mean([r[k] for r in rows])) for k in PARTS}
    return means


def breakdown_lines(results: dict) -> list[str]:
    return [f"  {name:<12}" + "  ".join(f"{k.replace('_', ' ')} {v:.0f}" for k, v in mean.items())
            for name, mean in breakdown_means(results).items()]


def cross_lines(results: dict) -> list[str]:
    """One line per run: what the cross traffic delivered (filled by the runner's ``cross``)."""
    out = []
    for s in results["runs"]:
        c = s.get("cross")
        if not c:
            continue
        tag = s["scheme"] + (f" r{s.get('repeat', 0) + 1}" if s.get("repeat") is not None else "")
        parts = []
        if c.get("udp"):
            u = c["udp"]
            rate, loss = u.get("delivered_pps"), u.get("loss")
            delivered = (f"{rate:.0f} pps delivered, loss {loss:.1%}" if rate is not None and loss is not None
                         else "no sink report")
            parts.append(f"UDP {u['sent_pkts']} sent, " + delivered)
        if c.get("tcp"):
            t = c["tcp"]
            good = t.get("goodput_mbps")
            parts.append(f"TCP {good:.2f} Mbit/s goodput" if good is not None else "TCP: no sink report")
            if t.get("retrans_pkts") is not None:
                parts[-1] += f", {t['retrans_pkts']} retransmitted"
        shared = path_sharing(s.get("paths") or {}, port_bytes(s))
        if shared:
            parts.append(shared)
        if s.get("gloo_ports_fixed") is False:  # its paths are then not the repetition's draw
            parts.append("gloo's connections not on their fixed ports")
        out.append(f"  {tag:<14}" + "; ".join(parts))
    return out


def path_sharing(paths: dict[str, str], carried: dict[str, int] | None = None) -> str:
    """How many of a run's hashed data flows shared a link with each cross flow (the links of
    its path but the last, into its sink), from the paths the run recorded: what per-flow ECMP
    dealt this run; with ``carried`` (:func:`port_bytes`), what the cross flow's first link
    forwarded in all, which shows where a scheme's flows did go. Empty without recorded paths."""
    data = {k: set(v.split()) for k, v in paths.items() if not k.startswith("cross")}
    parts = []
    for name in ("cross udp", "cross tcp"):
        if name in paths:
            links = paths[name].split()[:-1]
            n = sum(1 for hops in data.values() if hops & set(links))
            parts.append(f"{name.split()[1].upper()} via {' '.join(links)}"
                         + (f" with {n}/{len(data)} hashed data flows" if data else "")
                         + (f" ({links[0]} forwarded {carried[links[0]] / 1e6:.0f} MB)"
                            if carried and links and links[0] in carried else ""))
    return ", ".join(parts)


def port_bytes(run: dict) -> dict[str, int]:
    """Bytes each switch port forwarded during ``run``, all its queues together, as
    ``{"l1:8": n}``: from the run's switch counters, or what a slim file kept of them."""
    if "port_bytes" in run:
        return run["port_bytes"]
    out: dict[str, int] = {}
    for sw, counters in (run.get("switches") or {}).items():
        for row in counters.get("ports", []):
            key = f"{sw}:{row['port']}"
            out[key] = out.get(key, 0) + int(row.get("forwarded_bytes", 0))
    return out


def capacity_label(options: dict) -> str:
    """A run's bottleneck capacity as it was given: ``7.4 Mbit/s`` or ``600 pps``."""
    bps = options.get("capacity_bps") or 0
    return f"{bps / 1e6:g} Mbit/s" if bps else f"{options.get('capacity_pps', '?')} pps"


def describe(results: dict) -> str:
    """What was run, for plot titles."""
    c = results["options"]
    runs = repetitions(results)
    cross = f"cross traffic {c.get('cross_rate', 0):g}x" if c.get("cross_traffic") else "no cross traffic"
    ran = sorted({s["pattern"] for s in results["runs"] if s.get("pattern")})  # (as each scheme ran)
    pattern = " and ".join(ran) if ran else c.get("pattern", "")
    return (f"{results.get('topology', c.get('topology', ''))}, {c.get('workers', '?')} workers, "
            f"{pattern}, {c.get('workload', '')}, {capacity_label(c)}, {cross}; "
            f"{runs} run(s) per scheme{partial_note(results)}")


def partial_note(results: dict) -> str:
    """What a results file written part-way says of itself (:func:`keep_partial`)."""
    p = results.get("partial")
    if not p:
        return ""
    return (f" (written after {p['repetitions']} of {p['of']} repetitions: the run stopped there or was still "
            "going)")


def _save(fig, path: Path) -> Path:
    """Lay out, write and close ``fig``; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plots(run_dir: Path, results: dict) -> list[Path]:
    """Sync-time CDF (all runs of a scheme pooled), slowest worker's time per iteration (median
    over runs, bars min..max), selective drops per class (median over runs, bars min..max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title = describe(results)
    runs_of = by_scheme(results)
    names = list(runs_of)
    made = []
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for n in names:
        sync = np.sort([1e3 * r["sync_time"] for s in runs_of[n] for r in s["iterations"]
                        if r.get("kind") == "measured"])
        if len(sync):
            ax.step(sync, np.arange(1, len(sync) + 1) / len(sync), where="post", label=n)
    ax.set_xlabel("sync time (ms)")
    ax.set_ylabel("CDF (iterations x workers, runs pooled)")
    ax.set_title(f"Sync time: {title}", fontsize=8)
    ax.legend()
    made.append(_save(fig, run_dir / "sync_cdf.png"))

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for n in names:
        per_it: dict[int, list[float]] = {}
        for s in runs_of[n]:
            by_it: dict[int, list[float]] = {}
            for r in s["iterations"]:
                if r.get("kind") == "measured":
                    by_it.setdefault(r["iteration"], []).append(1e3 * r["iteration_time"])
            for i, v in by_it.items():
                per_it.setdefault(i, []).append(max(v))
        its = sorted(per_it)
        med = [float(np.median(per_it[i])) for i in its]
        err = [[m - min(per_it[i]) for m, i in zip(med, its)], [max(per_it[i]) - m for m, i in zip(med, its)]]
        ax.errorbar(its, med, yerr=err if len(runs_of[n]) > 1 else None, marker="o", capsize=3, label=n)
    ax.set_xlabel("iteration")
    ax.set_ylabel("iteration time, slowest worker (ms)")
    ax.set_title(f"Time per iteration: {title}", fontsize=8)
    ax.legend()
    made.append(_save(fig, run_dir / "iteration_time.png"))

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    width = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        counts = [[s.get("metrics", {}).get("selective_drops", {}).get(str(c), 0) for s in runs_of[n]]
                  for c in range(4)]
        med = [float(np.median(v)) for v in counts]
        err = [[m - min(v) for m, v in zip(med, counts)], [max(v) - m for m, v in zip(med, counts)]]
        ax.bar([c + i * width for c in range(4)], med, width, yerr=err if len(runs_of[n]) > 1 else None, capsize=3,
               label=n)
    ax.set_xticks([c + width * (len(names) - 1) / 2 for c in range(4)], [f"class {c}" for c in range(4)])
    ax.set_ylabel("packets dropped selectively per run (all switches)")
    ax.set_title(f"Switch drops per drop class: {title}", fontsize=8)
    ax.legend()
    made.append(_save(fig, run_dir / "drops_per_class.png"))

    if any("accuracy_trace" in s.get("metrics", {}) for s in results["runs"]):
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        colors: dict[str, Any] = {}  # scheme -> matplotlib colour
        for n in names:
            for s in runs_of[n]:
                trace = s.get("metrics", {}).get("accuracy_trace")
                if trace:
                    line, = ax.plot([t for t, _ in trace], [a for _, a in trace], color=colors.get(n), alpha=0.7,
                                    label=None if n in colors else n)
                    colors[n] = line.get_color()
        target = next((r.get("tta_target") for r in aggregate(results).values() if r.get("tta_target")), None)
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.4f}")
        ax.set_xlabel("training time (s, evaluations left out)")
        ax.set_ylabel("test accuracy (mean over workers)")
        ax.set_title(f"Time to accuracy: {title}", fontsize=8)
        ax.legend()
        made.append(_save(fig, run_dir / "accuracy_time.png"))
    return made


def breakdown_plot(path: Path, results: dict) -> Path | None:
    """One stacked bar per scheme: the mean iteration split into compute, first byte,
    transmission, recovery and the straggler wait (ms; over measured iterations, workers, runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    means = breakdown_means(results)
    if not means:
        return None
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(means), 4.2))
    bottom = np.zeros(len(means))
    for part in PARTS:
        vals = np.array([means[n][part] for n in means])
        ax.bar(list(means), vals, bottom=bottom, label=part.replace("_", " "))
        bottom += vals
    ax.set_ylabel("time per iteration and worker (ms, mean)")
    ax.set_title(f"Where the time goes: {describe(results)}", fontsize=8)
    ax.legend(fontsize=8)
    return _save(fig, path)


def keep_partial(run_dir: Path, results: dict, done: int, of: int) -> None:
    """Write results.json of the ``done`` repetitions (of ``of``) finished so far; :func:`finish`
    replaces it at the end.

    Why: a long run stopped part-way (a lost session, a killed runner, a switch that died) lost
    every finished repetition with it, though they are complete measurements. Written after each
    repetition, they read as a run of ``done`` repetitions (``dlcp report``), which a later
    ``dlcp run --first-repeat <done>`` continues and ``dlcp report --merge`` joins."""
    _add_metrics(results)
    _write_results(run_dir, {**results, "options": {**results["options"], "repeat": done},
                             "partial": {"repetitions": done, "of": of}})


def _add_metrics(results: dict) -> None:
    """Each finished run's stragglers and metrics, once (a run kept part-way has them already)."""
    for s in results["runs"]:
        if "metrics" not in s:
            add_stragglers([r for r in s["iterations"] if r.get("kind") == "measured"])
            s["metrics"] = scheme_metrics(s)


def _write_results(run_dir: Path, results: dict) -> None:
    """results.json, whole or not at all, whenever the run stops."""
    tmp = run_dir / "results.json.partial"
    tmp.write_text(json.dumps(results, indent=2))
    tmp.replace(run_dir / "results.json")


def finish(run_dir: Path, results: dict) -> str:
    _add_metrics(results)
    results["summary"] = _jsonable(aggregate(results))
    _write_results(run_dir, results)
    plots(run_dir, results)
    breakdown_plot(run_dir / "breakdown.png", results)
    text = summary(results)
    (run_dir / "summary.txt").write_text(text + "\n")
    return text
