"""Markdown tables of a testbed run, generated from its ``results.json`` (``dlcp report``), so a
results page is regenerated from its results files, never typed by hand.

Pure functions: a results dict in, Markdown text out. The figures are the report's
(:func:`dlcp.topologies.report.aggregate`): medians over valid runs with 95 % bootstrap intervals
(ranges with fewer than 5 runs),
speedups paired by run against the reference scheme.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dlcp.hostagent.provenance import provenance_lines
from dlcp.topologies.report import aggregate, describe, port_bytes, reference, scheme_metrics, service_text, target_rule
from dlcp.topologies.results import slim as slim_results
from dlcp.topologies.stats import MIN_INTERVAL_RUNS, Estimate, versus


def _cell(est: Estimate | None, fmt: str, suffix: str = "") -> str:
    if est is None or math.isnan(est.median):
        return "-"
    return est.text(fmt) + suffix


def _cross(rows: list[dict]) -> str:
    """The cross traffic beside a scheme, medians over its runs: UDP loss, TCP resent and goodput."""
    udp = [c["udp"]["loss"] for c in rows if (c.get("udp") or {}).get("loss") is not None]
    retx = [c["tcp"]["retrans_pkts"] for c in rows if (c.get("tcp") or {}).get("retrans_pkts") is not None]
    good = [c["tcp"]["goodput_mbps"] for c in rows if (c.get("tcp") or {}).get("goodput_mbps") is not None]
    parts = []
    if udp:
        parts.append(f"UDP loss {100 * float(np.median(udp)):.1f} %")
    if retx:
        parts.append(f"TCP {float(np.median(retx)):.0f} resent")
    if good:
        parts.append(f"{float(np.median(good)):.2f} Mbit/s")
    return ", ".join(parts) or "-"


def scheme_table(results: dict) -> str:
    """One row per scheme: valid runs, sync and iteration p50, speedup against the reference,
    the service ratio of its bottleneck ports beside it (what they served while backlogged over
    their capacity, lowest-highest: a speedup on ports faster than claimed is not DLCP's), comm /
    bound (:mod:`dlcp.topologies.report`), time to accuracy and its speedup (training
    workloads), final accuracy, and the cross traffic's loss, retransmissions and goodput
    beside it."""
    agg = aggregate(results)
    ref = reference(results)
    training = any("tta_s" in r for r in agg.values())
    head = ["scheme", "valid runs", "sync p50 ms", "iteration p50 ms", f"x {ref} (iteration)",
            "port service / capacity", "comm / bound"]
    if training:
        head += ["time to accuracy s", f"x {ref} (time to accuracy)", "reached", "final accuracy %"]
    head += ["cross traffic beside it"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in agg.items():
        sp = r.get("speedup")
        cells: list[Any] = [f"`{name}`", f"{r['valid_runs']}/{r['runs']}", _cell(r["sync_p50_ms"], "{:.0f}"),
                            _cell(r["iteration_p50_ms"], "{:.0f}"),
                            "1" if name == ref else _cell(sp, "{:.2f}", "x"), service_text(r["service"]),
                            _cell(r["comm_over_bound"], "{:.1f}")]
        if training:
            tta = r.get("tta_s")
            ts = r.get("tta_speedup")
            acc = r["accuracy"]
            cells += [_cell(tta, "{:.1f}") if r.get("tta_reached") else "not reached",
                      "1" if name == ref else _cell(ts, "{:.2f}", "x"),
                      f"{r.get('tta_reached', 0)}/{r['runs']}",
                      "-" if math.isnan(acc.median) else Estimate(100 * acc.median,
                                                                  None if acc.low is None else 100 * acc.low,
                                                                  None if acc.high is None else 100 * acc.high,
                                                                  acc.n).text("{:.2f}")]
        cells.append(_cross(r["cross"]))
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def iteration_tail_table(results: dict) -> str:
    """Per scheme, medians over its valid runs of each run's iteration p50, mean, p90 and p99,
    and the mean over the p50. Why beside the p50: training to a target takes the sum of its
    iterations, so a scheme whose slow iterations are frequent (TCP waiting out a loss) is
    slower to the target than its median says; this table shows by how much. Empty for results
    recorded before runs kept these figures (2026-11-29)."""
    keys = ("iteration_p50_ms", "iteration_mean_ms", "iteration_p90_ms", "iteration_p99_ms")
    runs: dict[str, list[dict]] = {}
    for s in results["runs"]:
        m = s.get("metrics") or {}
        if all(k in m for k in keys) and (s.get("validity") or {}).get("valid", True):
            runs.setdefault(s["scheme"], []).append(m)
    if not runs:
        return ""
    lines = ["| scheme | valid runs | iteration p50 ms | mean ms | p90 ms | p99 ms | mean / p50 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, ms in runs.items():
        med = [float(np.median([m[k] for m in ms])) for k in keys]
        ratio = float(np.median([m["iteration_mean_ms"] / m["iteration_p50_ms"] for m in ms]))
        lines.append(f"| `{name}` | {len(ms)} | " + " | ".join(f"{v:.0f}" for v in med) + f" | {ratio:.2f} |")
    return "\n".join(lines) + "\n"


def resend_table(results: dict) -> str:
    """Per DLCP scheme, medians over its valid runs of what its endpoints sent again: the
    workers' resends over the measured iterations (the ``retx`` of ``summary.txt``), a parameter
    server's over the whole run, and the share of all data packets its endpoints sent again over
    the whole run (:func:`dlcp.topologies.report.resend_metrics`). Empty where no run recorded
    endpoint totals (gloo's runs; slim files written before 2026-11-29 evening)."""
    runs: dict[str, list[dict]] = {}
    for s in results["runs"]:
        m = s.get("metrics") or {}
        if "resent_share" in m and (s.get("validity") or {}).get("valid", True):
            runs.setdefault(s["scheme"], []).append(m)
    if not runs:
        return ""
    lines = ["| scheme | valid runs | workers' resends (measured iterations) | server's resends (whole run) | "
             "share of data packets sent again (whole run) |", "|---|---:|---:|---:|---:|"]
    for name, ms in runs.items():
        server = [m["server_retransmitted"] for m in ms if m.get("server_retransmitted") is not None]
        lines.append(f"| `{name}` | {len(ms)} | {float(np.median([m['retransmitted'] for m in ms])):.0f} | "
                     + (f"{float(np.median(server)):.0f}" if server else "- (no server)")
                     + f" | {100 * float(np.median([m['resent_share'] for m in ms])):.2f} % |")
    return "\n".join(lines) + "\n"


def host_tcp_table(results: dict) -> str:
    """Per scheme, medians over its runs of the TCP segments its hosts resent and the
    retransmission timeouts they waited out, the agents' hosts (gloo's connections, DLCP's
    control connections) apart from the cross traffic's (hosts named ``x``); in runs that
    recorded them, the segments the agents' hosts sent that arrived CE-marked (a TCP with ECN
    on, as ``gloo-ecn``'s, learns of a queue from them; without ECN they stay 0) and the
    congestion control every host ran; empty for runs recorded before hosts' counters were."""
    runs: dict[str, list[dict]] = {}
    for s in results["runs"]:
        counters = s.get("tcp_counters") or s.get("host_tcp")  # (host_tcp: as 12ac361 named it)
        if counters:
            runs.setdefault(s["scheme"], []).append(counters)
    if not runs:
        return ""

    def median(rows: list[dict], cross: bool, key: str) -> str:
        per_run = [sum(c.get(key, 0) for h, c in r.items() if h.startswith("x") == cross) for r in rows
                   if all(c is not None for h, c in r.items() if h.startswith("x") == cross)]  # every host read
        return f"{float(np.median(per_run)):.0f}" if per_run else "-"

    # ECN marks that reached TCP (runs since the gloo-ecn schemes record them) and the hosts'
    # congestion control (runs since 2026-11-29 record it; before, on a machine whose namespaces
    # could not take the one asked for, hosts ran the machine's default)
    marks = any("TCPDeliveredCE" in c for rows in runs.values() for r in rows for c in r.values() if c)
    ccs: dict[str, set[str]] = {}
    for s in results["runs"]:
        ccs.setdefault(s["scheme"], set()).update((s.get("host_congestion_control") or {}).values())
    with_cc = any(ccs.values())
    lines = ["| scheme | TCP resent, agents' hosts | RTO timeouts, agents' hosts | TCP resent, cross hosts | "
             "RTO timeouts, cross hosts |" + (" CE-marked segments, agents' hosts |" if marks else "")
             + (" hosts' congestion control |" if with_cc else ""),
             "|---|---:|---:|---:|---:|" + ("---:|" if marks else "") + ("---|" if with_cc else "")]
    for name, rows in runs.items():
        lines.append(f"| `{name}` | {median(rows, False, 'RetransSegs')} | {median(rows, False, 'TCPTimeouts')} | "
                     f"{median(rows, True, 'RetransSegs')} | {median(rows, True, 'TCPTimeouts')} |"
                     + (f" {median(rows, False, 'TCPDeliveredCE')} |" if marks else "")
                     + (f" {', '.join(sorted(ccs.get(name, ()))) or '-'} |" if with_cc else ""))
    return "\n".join(lines) + "\n"


def verdicts(results: dict) -> list[str]:
    """One sentence per scheme against the reference: the call its paired interval allows, or,
    from fewer than 5 paired runs, its range and no call."""
    agg = aggregate(results)
    ref = reference(results)
    out = []
    for name, r in agg.items():
        for key, what in (("speedup", "per iteration"), ("tta_speedup", "to the accuracy target")):
            est = r.get(key)
            if name == ref or est is None or est.low is None:
                continue
            if est.is_interval:
                out.append(f"`{name}` is {versus(est, f'`{ref}`')} {what}: {est.text('{:.2f}')}x.")
            else:
                out.append(f"`{name}` against `{ref}` {what}: {est.text('{:.2f}')}x over {est.n} paired runs, "
                           f"no verdict (an interval needs {MIN_INTERVAL_RUNS}).")
    return out


def refresh_metrics(results: dict) -> dict:
    """``results`` with each run's metrics computed again by this version's code where its
    per-iteration records are there (a run directory's results.json; a slim file keeps the
    metrics it was written with), so a metric added since shows for older runs too."""
    return {**results, "runs": [{**s, "metrics": scheme_metrics(s)} if s.get("iterations") else s
                                for s in results["runs"]]}


def slim(results: dict) -> dict:
    """``results`` without what only the run directory needs: each run's per-iteration records,
    CPU trace and switch counters go; its metrics (with its accuracy trace), validity, cross
    traffic, bound and hosts' TCP counters and congestion control stay, which is all :func:`markdown` reads, and the
    paths its hashed flows took from their fixed ports and the bytes each switch port forwarded
    (``dlcp report``'s cross-traffic lines)."""
    out = slim_results(results, keep=("base_scheme", "pattern", "policy", "validity", "cross", "bound",
                                      "tcp_counters", "host_tcp", "host_congestion_control", "flow_port_base",
                                      "paths", "gloo_connections", "gloo_ports_fixed", "cpu_probe_ms"))
    for full, small in zip(results["runs"], out["runs"]):  # the switch counters, as bytes per port
        carried = port_bytes(full)
        if carried:
            small["port_bytes"] = carried
    return out


def machine_speed_line(results: dict) -> str:
    """How fast the machine ran before each run (:func:`dlcp.hostagent.provenance.cpu_probe_ms`),
    per scheme: median and range over its runs; empty for runs recorded before 2026-11-30
    evening, which did not measure it (their machine busy share is the only tell)."""
    per: dict[str, list[float]] = {}
    for s in results["runs"]:
        if s.get("cpu_probe_ms") is not None:
            per.setdefault(s["scheme"], []).append(float(s["cpu_probe_ms"]))
    if not per:
        return ""
    parts = [f"`{name}` {float(np.median(v)):.1f} ({min(v):.1f}-{max(v):.1f})" for name, v in per.items()]
    return ("Machine speed before each run, a fixed loop of Python on one core in ms (lower is faster; "
            "median and range over runs): " + ", ".join(parts) + ".")


def markdown(results: dict, source: str = "") -> str:
    """The run as a results-page section: what ran, the table, the calls, provenance."""
    c = results["options"]
    targets = [r["tta_target"] for r in aggregate(results).values() if "tta_target" in r]
    target = ""
    if targets:
        rule = results.get("tta_rule") or target_rule(results)
        target = f", target accuracy {100 * targets[0]:.2f} %" + (f" ({rule})" if "repetition" in rule else "")
    lines = [f"**Run**: {describe(results)}; {c.get('iterations')} iterations{target}.", "",
             *provenance_lines(results, source)]
    lines.append(scheme_table(results))
    calls = verdicts(results)
    if calls:
        lines += ["", *calls]
    lines.append("")
    lines.append("Medians over valid runs, 95 % bootstrap intervals over runs in brackets from 5 runs or more, "
                 "the range (min..max) in parentheses with fewer, and then no verdict; speedups paired by run (run r "
                 "of each scheme, interleaved); port service / capacity: what the bottleneck ports served while "
                 "backlogged over their capacity, lowest-highest over ports and runs, each end read as the validity "
                 "rules read it: the lowest over intervals the port was backlogged throughout (≤ alone where no port "
                 "was so for 200 slots: bursts give no rate from below), the highest over every backlogged interval "
                 "(a valid run lies within [0.9, 1.03] so since issue 43; earlier runs were judged without the upper "
                 "rule, and runs before the strict reading show the loose one at both ends).")
    speed = machine_speed_line(results)
    if speed:
        lines += ["", speed]
    tail = iteration_tail_table(results)
    if tail:
        lines += ["", "Iteration times, medians over valid runs of each run's figure (time to a target is a sum "
                  "of iterations, so it follows the mean, not the median):", "", tail]
    resends = resend_table(results)
    if resends:
        lines += ["", "DLCP's resends, medians over valid runs (a server writes no per-iteration records, so its "
                  "resends are counted from its endpoint's totals):", "", resends]
    tcp = host_tcp_table(results)
    if tcp:
        lines += ["", "TCP on the hosts, medians over runs (all runs):", "", tcp]
    links = cross_link_table(results)
    if links:
        lines += ["", "Per run, the link each cross flow entered the fabric on (per-flow ECMP chose it from the "
                  "repetition's fixed ports) and what that link forwarded during the run, the cross flow's bytes "
                  "included: where a scheme's hashed flows met which cross flow.", "", links]
    return "\n".join(lines) + "\n"


def cross_link_table(results: dict) -> str:
    """Per run: its iteration p50, whether it was valid, and for each cross flow the first link of
    its path with the bytes that link forwarded (:func:`port_bytes`). On the leaf-spine each cross
    flow takes one of the source leaf's uplinks, so a scheme whose own flows are hashed (gloo's
    TCP) shares that uplink with the UDP or with the TCP cross traffic, by the draw; the bytes
    show which. Empty for runs that recorded no paths or no switch counters."""
    rows = []
    for s in results["runs"]:
        paths, carried = s.get("paths") or {}, port_bytes(s)
        firsts = [(paths[k].split() or [""])[0] if k in paths else "" for k in ("cross udp", "cross tcp")]
        if not carried or not any(firsts):
            continue
        cells = [f"{link} {carried[link] / 1e6:.0f} MB" if link in carried else "-" for link in firsts]
        valid = "yes" if (s.get("validity") or {}).get("valid", True) else "no"
        p50 = s["metrics"]["iteration_p50_ms"]
        rows.append(f"| `{s['scheme']}` | {s.get('repeat', 0) + 1} | {p50:.0f} | {valid} | " + " | ".join(cells) + " |")
    if not rows:
        return ""
    return "\n".join(["| scheme | run | iteration p50 ms | valid | UDP cross's first link | TCP cross's first link |",
                      "|---|---:|---:|---|---|---|", *rows])
