"""A simulator run's ``results.json`` as a results-page section (``dlcp report``).

The testbed's runs have their own (:func:`dlcp.topologies.results_table.markdown`); this is the same
idea for ``dlcp sim --out``: what ran, with which command at which commit, and one table per
run, computed from the per-seed results in the file, so no results page types a figure by hand.
Both read the one results schema (:mod:`dlcp.topologies.results`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dlcp_sim.run import SMALL_FLOW_BYTES
from dlcp.hostagent.provenance import provenance_lines
from dlcp.topologies.results import by_scheme
from dlcp.topologies.results import slim as slim_results
from dlcp.topologies.stats import Estimate, median_ci, paired_ratios, verdict


#: How the TCP variants are written in prose.
TCP_NAMES = {"dctcp": "DCTCP", "cubic": "Cubic", "newreno": "NewReno"}


def is_sim_results(results: Any) -> bool:
    """Whether ``results`` (in schema 2, :func:`dlcp.topologies.results.upgrade`) came from ``dlcp sim``."""
    return isinstance(results, dict) and results.get("source") == "simulator"


def slim(results: dict) -> dict:
    """The results without per-iteration records and per-port counters: small enough to keep
    beside a results page, and all its tables need."""
    return slim_results(results, keep=())


def describe(results: dict) -> str:
    """One line: the fabric, the jobs, the workload and what else shaped the run."""
    o = results["options"]
    hosts = o["leaves"] * o["hosts_per_leaf"]
    uplink = o["uplink_gbps"] or o["link_gbps"]
    extra = [f"host model {o['host_model']}"]
    if "tcp" in by_scheme(results):
        extra.append(f"`tcp` over {TCP_NAMES.get(o['gradient_tcp'], o['gradient_tcp'])}")
    if o.get("background_load"):
        extra.append(f"background load {o['background_load']:g} ({o['background_tcp']})")
    if o.get("host_delay_us"):
        extra.append(f"host delay {o['host_delay_us']:g} us")
    if o.get("packet_slots"):
        extra.append("packet-slot ports")
    if o.get("wire_framing"):
        extra.append("uplinks charge Ethernet frames")
    jobs = o["jobs"] or "every host in"
    workload = o.get("workload", o.get("model"))  # results written before the field was renamed say model
    return (f"{hosts} hosts ({o['leaves']} leaves x {o['hosts_per_leaf']}, {o['spines']} spines), "
            f"{o['link_gbps']:g}/{uplink:g} Gb/s host/uplinks, buffer {o['buffer']}; {jobs} {o['pattern']} job(s) "
            f"of {o['workers']} workers, {workload} x {o['scale']:g}, {o['iterations']} iteration(s) "
            f"({o['warmup']} warm-up); {results.get('repeat', '?')} seed(s); " + ", ".join(extra))


def _ms(values: list[float]) -> str:
    """Milliseconds to three significant figures or so, with the interval."""
    est = median_ci([v for v in values if v is not None])
    m = abs(est.median) if est.median == est.median else 0.0
    return est.text("{:.0f}" if m >= 100 else "{:.1f}" if m >= 10 else "{:.2f}")


def scheme_table(results: dict, against: str | None = None) -> tuple[str, list[str]]:
    """The Markdown table and the verdict lines, speedups paired by seed with ``against``
    (default: ``baseline`` when it ran, else the first scheme)."""
    runs = {s: [r["metrics"] for r in rs] for s, rs in by_scheme(results).items()}
    ref = against or results.get("reference") or next(iter(runs))
    if ref not in runs:
        raise ValueError(f"no scheme {ref!r} in this run (it has {', '.join(runs)})")
    head = ["scheme", "seeds", "sync p50 ms", "sync p99 ms", "p50 / bound", f"x {ref} (p50)", f"x {ref} (p99)",
            "tail drops", "selective drops", "retransmitted", "late or duplicate", "missing %"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    calls = []
    for scheme, rs in runs.items():
        cells = [f"`{scheme}`", str(len(rs)), _ms([r["sync_p50_ms"] for r in rs]), _ms([r["sync_p99_ms"] for r in rs]),
                 f"{np.median([r['sync_over_bound'] for r in rs]):.2f}" if all(r.get("sync_over_bound")
                                                                              for r in rs) else "-"]
        for key in ("p50", "p99"):
            if scheme == ref:
                cells.append("1")
                continue
            est = median_ci(paired_ratios([r[f"sync_{key}_ms"] for r in runs[ref]], [r[f"sync_{key}_ms"] for r in rs]))
            cells.append(est.text("{:.2f}") + "x")
            if key == "p50":
                calls.append(f"`{scheme}` against `{ref}` (sync p50): {verdict(est)}, {est.text('{:.2f}')}x.")
        cells += [f"{np.mean([r['tail_drops'] for r in rs]):,.0f}",
                  f"{np.mean([sum(r['selective_drops'].values()) for r in rs]):,.0f}",
                  f"{np.mean([r['retransmitted'] for r in rs]):,.0f}",
                  f"{np.mean([r['late'] + r['duplicates'] for r in rs]):,.0f}",
                  f"{100 * np.mean([r['missing_fraction'] for r in rs]):.2f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows), calls


def background_table(results: dict) -> str:
    """The background flows' completion times per scheme, over the flows that started while
    every scheme of a seed still trained, with each scheme's ratio to the baseline's paired by
    seed (below 1: its neighbours' flows finish sooner); empty without background traffic."""
    rows = {s: r for s, r in (results.get("summary") or {}).items() if "fct_avg_ms" in r}
    if not rows:
        return ""

    def cell(d: dict | None) -> str:
        if not d:
            return "-"
        return Estimate(d["median"], d["ci_low"], d["ci_high"], d["n"]).text("{:.2f}")

    head = ["scheme", "flows per seed", "FCT avg ms", "FCT p99 ms", "small-flow FCT p99 ms", "avg / baseline",
            "p99 / baseline", "small p99 / baseline"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for scheme, r in rows.items():
        out.append("| " + " | ".join([f"`{scheme}`", ", ".join(map(str, r.get("background_flows", []))),
                                      cell(r.get("fct_avg_ms")), cell(r.get("fct_p99_ms")),
                                      cell(r.get("small_fct_p99_ms")), cell(r.get("fct_avg_ms_ratio")),
                                      cell(r.get("fct_p99_ms_ratio")), cell(r.get("small_fct_p99_ms_ratio"))]) + " |")
    return "\n".join(out)


def markdown(results: dict, source: str = "", against: str | None = None) -> str:
    """The run as a results-page section: what ran, provenance, the table and its verdicts."""
    lines = [f"**Simulated**: {describe(results)}.", "", *provenance_lines(results, source)]
    table, calls = scheme_table(results, against)
    lines += [table, "", *calls, ""]
    background = background_table(results)
    if background:
        lines += ["Background flows that started while every scheme of a seed still trained "
                  f"(small: <= {SMALL_FLOW_BYTES // 1000} KB):",
                  "", background, ""]
    lines += [
              "Medians over seeds, 95 % bootstrap intervals in brackets from 5 seeds or more, the range (min..max) "
              "in parentheses with fewer, and then no verdict; speedups paired by seed (the seed draws "
              "the gradients and which flows collide); drops, retransmissions and late packets are means of "
              "per-seed totals; missing: the share of pushed packets zero-filled; the bound is the busiest "
              "link's share of the iteration's packets at line rate."]
    return "\n".join(lines) + "\n"


__all__ = ["background_table", "describe", "is_sim_results", "markdown", "scheme_table", "slim"]
