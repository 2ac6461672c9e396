"""Turn a run's records into results.json, a summary table and PNG plots.

Metrics per scheme, over the measured iterations (the warm-up iteration and the final
communication-only calibration iteration are left out, the latter used only for E):

* sync time: from the last gradient becoming ready to the last average arriving, p50/p99;
* iteration time p50, and speedup = baseline's iteration p50 / this scheme's;
* lost fraction and retransmitted packets;
* ordering efficiency E = (cost_max - U) / (cost_max - cost_min) (SysML'18, TicTac): with
  comm = the calibration iteration's communication time and comp = the compute time,
  cost_max = comm + comp, cost_min = max(comm, comp), U = measured iteration time;
* straggler spread (TicTac): per iteration, (max - min) / mean of the workers' iteration
  times, averaged;
* messages and control frames (sent and received) per worker per iteration, medians: what
  fusion and the batched control path cost.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def scheme_metrics(s: dict) -> dict:
    recs = [r for r in s["iterations"] if r.get("kind") == "measured"]
    calib = [r for r in s["iterations"] if r.get("kind") == "calibration"]
    if not recs:
        return {}
    sync = np.array([r["sync_time"] for r in recs])
    iters = np.array([r["iteration_time"] for r in recs])
    comp = float(np.mean([r["compute_time"] for r in recs]))
    comm = float(np.mean([r["comm_span"] for r in calib])) if calib else float("nan")
    u = float(np.mean(iters))
    cost_max, cost_min = comm + comp, max(comm, comp)
    eff = (cost_max - u) / (cost_max - cost_min) if cost_max > cost_min else float("nan")
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
    extra = {"accuracy": float(np.mean(final))} if final else {}
    if all("control_frames" in r for r in recs):
        extra["messages_per_iteration"] = float(np.median([r["messages"] for r in recs]))
        extra["control_frames_per_iteration"] = float(np.median([r["control_frames"] for r in recs]))
    return {**extra, "sync_p50_ms": 1e3 * float(np.percentile(sync, 50)), "sync_p99_ms": 1e3 * float(np.percentile(sync, 99)),
            "iteration_p50_ms": 1e3 * float(np.percentile(iters, 50)),
            "lost_fraction_mean": float(np.mean([r["lost_fraction"] for r in recs])),
            "retransmissions": int(sum(r["retransmissions"] for r in recs)),
            "ordering_efficiency": eff, "straggler_spread": spread,
            "switch_selective_drops_by_class": drops_by_class, "switch_tail_drops": tail}


def summary(results: dict) -> str:
    rows = [(s["scheme"], s["metrics"]) for s in results["schemes"] if s.get("metrics")]
    base = next((m["iteration_p50_ms"] for name, m in rows if name == "baseline"), None)
    acc = any("accuracy" in m for _, m in rows)
    head = (f"{'scheme':<10}{'sync p50':>10}{'sync p99':>10}{'iter p50':>10}{'speedup':>9}{'lost':>8}"
            f"{'retx':>7}{'E':>7}{'stragg.':>9}{'sel.drops':>11}{'tail':>6}{'msgs':>6}{'ctl':>6}"
            + (f"{'acc':>8}" if acc else ""))
    lines = [head, "-" * len(head)]
    for name, m in rows:
        speed = f"{base / m['iteration_p50_ms']:.2f}x" if base else "-"
        sel = sum(m["switch_selective_drops_by_class"].values())
        lines.append(f"{name:<10}{m['sync_p50_ms']:>8.0f}ms{m['sync_p99_ms']:>8.0f}ms{m['iteration_p50_ms']:>8.0f}ms"
                     f"{speed:>9}{m['lost_fraction_mean']:>8.2%}{m['retransmissions']:>7}"
                     f"{m['ordering_efficiency']:>7.2f}{m['straggler_spread']:>9.2f}{sel:>11}{m['switch_tail_drops']:>6}"
                     f"{m.get('messages_per_iteration', float('nan')):>6.0f}"
                     f"{m.get('control_frames_per_iteration', float('nan')):>6.0f}"
                     + (f"{m.get('accuracy', float('nan')):>8.4f}" if acc else ""))
    lines.append("msgs, ctl: messages and control frames per worker per iteration (medians)")
    return "\n".join(lines)


def plots(run_dir: Path, results: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in results["schemes"]:
        sync = np.sort([1e3 * r["sync_time"] for r in s["iterations"] if r.get("kind") == "measured"])
        if len(sync):
            ax.step(sync, np.arange(1, len(sync) + 1) / len(sync), where="post", label=s["scheme"])
    ax.set_xlabel("sync time (ms)")
    ax.set_ylabel("CDF")
    ax.set_title("Sync time per scheme")
    ax.legend()
    fig.tight_layout()
    made.append(run_dir / "sync_cdf.png")
    fig.savefig(made[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in results["schemes"]:
        by_it: dict[int, list[float]] = {}
        for r in s["iterations"]:
            if r.get("kind") == "measured":
                by_it.setdefault(r["iteration"], []).append(1e3 * r["iteration_time"])
        its = sorted(by_it)
        ax.plot(its, [max(by_it[i]) for i in its], marker="o", label=s["scheme"])
    ax.set_xlabel("iteration")
    ax.set_ylabel("iteration time, slowest worker (ms)")
    ax.set_title("Time per iteration")
    ax.legend()
    fig.tight_layout()
    made.append(run_dir / "iteration_time.png")
    fig.savefig(made[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    names = [s["scheme"] for s in results["schemes"]]
    width = 0.8 / max(1, len(names))
    for i, s in enumerate(results["schemes"]):
        counts = s.get("metrics", {}).get("switch_selective_drops_by_class", {})
        ax.bar([c + i * width for c in range(4)], [counts.get(str(c), 0) for c in range(4)], width, label=s["scheme"])
    ax.set_xticks([c + width * (len(names) - 1) / 2 for c in range(4)], [f"class {c}" for c in range(4)])
    ax.set_ylabel("packets dropped selectively (all switches)")
    ax.set_title("Switch drops per drop class")
    ax.legend()
    fig.tight_layout()
    made.append(run_dir / "drops_per_class.png")
    fig.savefig(made[-1])
    plt.close(fig)
    return made


def finish(run_dir: Path, results: dict) -> str:
    for s in results["schemes"]:
        s["metrics"] = scheme_metrics(s)
    (run_dir / "results.json").write_text(json.dumps(results, indent=2))
    plots(run_dir, results)
    text = summary(results)
    (run_dir / "summary.txt").write_text(text + "\n")
    return text
