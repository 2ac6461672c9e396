"""``dlcp sweep`` and ``dlcp calibrate``: experiments made of several ``dlcp run``s.

A sweep varies one parameter of :class:`~dlcp.topologies.runner.RunOptions` across values, runs
every scheme (with ``--repeat``) at each value, and writes ``sweep.csv`` (one row per value and
scheme: medians with their 95 % intervals, the verdict, validity), ``sweep.md`` (the same as a
Markdown table) and ``sweep.png`` (speedup over the reference scheme with interval bars against the
parameter). Each value keeps its own run
directory, with its own results.json and summary, under the sweep's directory. The loop, the
CSV, the cells and the error bars are the simulator's too (:mod:`dlcp.topologies.sweepkit`).

Calibration answers "at which bottleneck capacity does this machine still emulate the network
faithfully?": it runs short experiments from the highest candidate capacity down and stops at
the first at which every run is valid (:mod:`dlcp.topologies.validity`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from dlcp.hostagent.errors import DlcpUserError, UsageError
from dlcp.topologies.report import aggregate, reference
from dlcp.topologies.runner import RANGES, RunOptions, reference_scheme, run, testbed_ready
from dlcp.topologies.stats import verdict
from dlcp.topologies.progress import Progress
from dlcp.topologies.registry import hold_testbed
from dlcp.topologies.sweepkit import SweepColumn, cell, errorbars, finish_axes, put_estimate, run_values, value_axis
from dlcp.topologies.sweepkit import markdown as sweep_table


@dataclass(frozen=True)
class SweepParam:
    """A parameter a sweep can vary: the RunOptions field and how to read a value."""

    field: str
    parse: Callable[[str], object]
    unit: str


def _on_off(v: str) -> bool:
    if v not in ("on", "off"):
        raise ValueError("on or off")
    return v == "on"


PARAMS: dict[str, SweepParam] = {
    "cross-rate": SweepParam("cross_rate", float, "UDP cross traffic, fraction of capacity (0: no cross traffic)"),
    "loss-bound": SweepParam("loss_bound", float, "loss bound p"),
    "buffer": SweepParam("buffer", int, "bottleneck buffer (packets)"),
    "workers": SweepParam("workers", int, "workers"),
    "pattern": SweepParam("pattern", str, "pattern"),
    "capacity": SweepParam("capacity_pps", int, "bottleneck capacity (packets/s)"),
    "fusion": SweepParam("fusion", _on_off, "tensor fusion"),
    "ecn-backlog": SweepParam("ecn_backlog", str, "backlog ECN marks on"),
}

CSV_METRICS = ("speedup", "sync_p50_ms", "sync_p99_ms", "iteration_p50_ms", "sync_over_bound", "comm_over_bound",
               "missing_fraction")


def options_at(base: RunOptions, param: str, value: str) -> RunOptions:
    """``base`` with ``param`` set to ``value`` (a cross rate of 0 turns the cross traffic off);
    raises :class:`UsageError` naming ``--values`` and the parameter's range when it is bad."""
    spec = PARAMS[param]
    try:
        parsed = spec.parse(value)
    except ValueError as exc:
        raise UsageError(f"--values: {value!r} is not a valid {param} ({exc})") from None
    rng = RANGES.get(spec.field)
    if rng is not None and parsed not in rng:
        raise UsageError(f"--values: {param} {rng.problem(parsed)}")
    change: dict[str, Any] = {spec.field: parsed}  # of the field's type, which spec.parse reads
    opts = replace(base, **change)
    if param == "cross-rate" and parsed == 0:
        opts = replace(opts, cross_traffic=False)
    try:
        opts.validate()
    except DlcpUserError as exc:
        raise UsageError(f"--values: {param}={value}: {exc}") from None
    return opts


def sweep_request(param: str | None, values: str | None, sweep: str | None) -> tuple[str, list[str]]:
    """The parameter and values of a sweep, from ``--param P --values V1,V2`` or ``--sweep P=V1,V2``
    (either form, on ``dlcp sweep`` and ``dlcp sim`` alike); raises :class:`UsageError` for
    neither, both, or half of the pair."""
    if sweep is not None:
        if param is not None or values is not None:
            raise UsageError("give --sweep PARAM=V1,V2 or --param P --values V1,V2, not both")
        param, sep, values = sweep.partition("=")
        if not sep:
            raise UsageError(f"--sweep {sweep!r}: give PARAM=V1,V2,... (e.g. cross-rate=0,0.25,0.5)")
    if not param or not values:
        raise UsageError("name what to vary: --param P --values V1,V2,... (or --sweep P=V1,V2,...)")
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not vals:
        raise UsageError(f"--values {values!r}: no value")
    return param.strip().lstrip("-"), vals


def check_values(base: RunOptions, param: str, values: list[str]) -> list[RunOptions]:
    """The run of every value, all checked, so a bad one fails before any switch starts or directory is made."""
    if param not in PARAMS:
        raise UsageError(f"unknown sweep parameter {param!r}; one of {sorted(PARAMS)}")
    if not values:
        raise UsageError("--values needs at least one value")
    return [options_at(base, param, v) for v in values]


def rows_of(param: str, value: str, results: dict, run_dir: Path) -> list[dict]:
    """One CSV row per scheme of one run (pure: results in, rows out)."""
    rows = []
    for scheme, agg in aggregate(results).items():
        row = {"param": param, "value": value, "scheme": scheme, "runs": agg["runs"], "valid_runs": agg["valid_runs"]}
        for key in CSV_METRICS:
            est = agg.get(key)
            put_estimate(row, key, *((est.median, est.low, est.high) if est else (None, None, None)))
        row["verdict"] = verdict(agg["speedup"]) if "speedup" in agg and scheme != reference(results) else ""
        row["run_dir"] = str(run_dir)
        rows.append(row)
    return rows


#: The testbed sweep's Markdown columns after the value and the scheme (medians [95 % interval]).
COLUMNS = (
    SweepColumn("valid", lambda r: f"{r['valid_runs']}/{r['runs']}"),
    SweepColumn("speedup", lambda r: cell(r, "speedup", "{:.2f}")),
    SweepColumn("sync p50 (ms)", lambda r: cell(r, "sync_p50_ms", "{:.0f}")),
    SweepColumn("sync p99 (ms)", lambda r: cell(r, "sync_p99_ms", "{:.0f}")),
    SweepColumn("comm / bound", lambda r: cell(r, "comm_over_bound", "{:.1f}")),
    SweepColumn("verdict", lambda r: str(r["verdict"] or "")),
)


def markdown(rows: list[dict], param: str) -> str:
    """The sweep as a Markdown table (medians [95 % interval]), for papers and READMEs."""
    return sweep_table(rows, param, COLUMNS)


def plot(path: Path, rows: list[dict], param: str, base: RunOptions) -> None:
    """Speedup over the reference scheme (with interval bars) and DLCP-relevant sync p99 against the parameter;
    hollow markers are values where a scheme had invalid runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = list(dict.fromkeys(r["value"] for r in rows))
    xs, numeric = value_axis(values)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for scheme in dict.fromkeys(r["scheme"] for r in rows):
        pts = [r for r in rows if r["scheme"] == scheme]
        for ax, key in ((ax1, "speedup"), (ax2, "sync_p99_ms")):
            line = errorbars(ax, pts, xs, key, marker="o", label=scheme)
            bad = [(xs[r["value"]], r[key]) for r in pts if r.get(key) is not None and r["valid_runs"] < r["runs"]]
            if line is not None and bad:
                ax.scatter(*zip(*bad), s=90, facecolors="none", edgecolors=line[0].get_color())
    ax1.axhline(1.0, color="grey", lw=0.8, ls="--")
    ref = reference_scheme(base)
    ax1.set_ylabel(f"iteration speedup over {ref} (x)" if ref else "iteration p50 ratio (x)")
    ax2.set_ylabel("sync time p99 (ms)")
    finish_axes((ax1, ax2), PARAMS[param].unit, values, numeric)
    runs = rows[0]["runs"]
    fig.suptitle(f"{base.topology}, {base.workers} workers, {base.pattern}, {base.workload}, "
                 f"{base.capacity_pps} pps bottlenecks: {runs} run(s) per point"
                 + (", bars: 95 % bootstrap interval" if runs >= 5 else ", bars: range" if runs >= 2 else "")
                 + "; hollow: invalid runs", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def sweep(base: RunOptions, param: str, values: list[str]) -> tuple[Path, list[dict]]:
    """Run ``base`` at every value of ``param``; returns the sweep directory and the CSV rows."""
    all_opts = check_values(base, param, values)  # every value checked before the first run
    testbed_ready()  # root, BMv2, Mininet: before a directory is made or the testbed taken
    out = Path(base.out).resolve() / f"{time.strftime('%Y%m%d-%H%M%S')}-sweep-{param}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"param": param, "values": values, "base": asdict(base)}, indent=2))
    by_value = dict(zip(values, all_opts))
    progress = Progress(len(values), stream=None if base.quiet else sys.stderr)

    def run_one(value: str) -> list[dict]:
        run_dir, results = run(replace(by_value[value], out=str(out)))
        progress.step(f"{param} = {value}")
        return rows_of(param, value, results, run_dir)

    with hold_testbed():  # all the values' runs: no other run slips in between two of them
        rows = run_values(out, values, run_one)
    plot(out / "sweep.png", rows, param, base)
    (out / "sweep.md").write_text(markdown(rows, param))
    return out, rows


CALIBRATION_CAPACITIES = (500, 700, 1000, 1500, 2000, 3000, 4000, 6000)


def calibrate(base: RunOptions, capacities: tuple[int, ...] = CALIBRATION_CAPACITIES,
              iterations: int = 5) -> tuple[int | None, list[dict]]:
    """The largest of ``capacities`` (packets/s) at which every scheme's short run is valid.

    Starts at the candidate nearest ``base.capacity_pps`` and walks up while runs stay valid,
    or down until they become valid, so it usually needs two or three runs. Returns None when
    none is valid, and the trials (capacity, valid, reasons, run directory)."""
    caps = sorted(capacities)
    i = min(range(len(caps)), key=lambda k: abs(caps[k] - base.capacity_pps))
    trials: list[dict] = []
    verdicts: dict[int, bool] = {}
    testbed_ready()
    with hold_testbed():  # every trial: no other run slips in between two of them
        while 0 <= i < len(caps) and caps[i] not in verdicts:
            opts = replace(base, capacity_pps=caps[i], iterations=iterations, repeat=1)
            opts.validate()
            run_dir, results = run(opts)
            reasons = [f"{s['scheme']}: {r}" for s in results["runs"]
                       for r in (s.get("validity") or {}).get("reasons", [])]
            trials.append({"capacity_pps": caps[i], "valid": not reasons, "reasons": reasons,
                           "run_dir": str(run_dir)})
            verdicts[caps[i]] = not reasons
            i += 1 if not reasons else -1
    valid = [c for c, ok in verdicts.items() if ok]
    return (max(valid) if valid else None), trials
