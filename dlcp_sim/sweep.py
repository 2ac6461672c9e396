"""``dlcp sim --sweep FIELD=V1,V2,...``: one simulated experiment per value of one option.

Each value runs every scheme over the same seeds (``--repeat``), as ``dlcp sim`` does, and
keeps its own ``results.json`` under ``<out>/<field>=<value>/``. The sweep writes
``sweep.csv`` (one row per value and scheme: medians with 95 % intervals, speedup paired by
seed and, with background traffic, the background flows' completion times and their ratio to
the baseline's), ``sweep.md`` (the same as a Markdown table) and ``sweep.png`` (speedup
against the value, and with background traffic the FCT ratios). Rows and table are pure
functions of the results; only :func:`sweep` runs anything. The loop, the CSV, the cells and
the error bars are the testbed's too (:mod:`dlcp.topologies.sweepkit`).
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from dlcp_sim.scenario import SimOptions
from dlcp.hostagent.errors import UsageError
from dlcp.topologies.progress import Progress
from dlcp.topologies.sweepkit import SweepColumn
from dlcp.topologies.sweepkit import cell as kit_cell
from dlcp.topologies.sweepkit import markdown as sweep_table
from dlcp.topologies.sweepkit import errorbars, finish_axes, put_estimate, run_values, value_axis

#: Options a sweep may vary (every numeric or choice field of SimOptions but the seed).
SWEEPABLE = tuple(f.name for f in fields(SimOptions) if f.name not in ("schemes", "seed"))

#: What each value's row holds: (column, the summary's key, its sub-key).
_COLUMNS = (
    ("sync_p50_ms", "sync_p50_ms"), ("sync_p99_ms", "sync_p99_ms"), ("speedup_p50", "speedup_p50"),
    ("speedup_p99", "speedup_p99"), ("fct_avg_ms", "fct_avg_ms"), ("fct_avg_ratio", "fct_avg_ms_ratio"),
    ("small_fct_p99_ms", "small_fct_p99_ms"), ("small_fct_p99_ratio", "small_fct_p99_ms_ratio"),
)


def parse_sweep(text: str) -> tuple[str, list[str]]:
    """``"background_load=0.2,0.5"`` -> ``("background_load", ["0.2", "0.5"])`` (dashes allowed)."""
    name, sep, values = text.partition("=")
    name = name.strip().lstrip("-").replace("-", "_")
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not vals:
        raise UsageError(f"--sweep {text!r}: give FIELD=V1,V2,... (e.g. background_load=0.2,0.5,0.8)")
    if name not in SWEEPABLE:
        raise UsageError(f"--sweep: {name!r} is not an option the simulator takes; one of {list(SWEEPABLE)}")
    return name, vals


def options_at(base: SimOptions, name: str, value: str) -> SimOptions:
    """``base`` with option ``name`` set to ``value``, read as that option's type."""
    kind = type(getattr(base, name))
    try:
        parsed = kind(value) if kind is not int else int(value)
    except ValueError:
        raise UsageError(f"--sweep {name}: {value!r} is not a {kind.__name__}") from None
    change: dict[str, Any] = {name: parsed}  # of the option's own type
    return replace(base, **change)


def rows_of(name: str, value: str, summary: dict[str, dict]) -> list[dict]:
    """One row per scheme from :func:`dlcp_sim.run.summary` of one value (pure)."""
    rows = []
    for scheme, st in summary.items():
        row: dict = {"param": name, "value": value, "scheme": scheme, "seeds": st["seeds"]}
        for column, key in _COLUMNS:
            est = st.get(key)
            put_estimate(row, column, *((est["median"], est["ci_low"], est["ci_high"]) if est else (None, None, None)))
        rows.append(row)
    return rows


def markdown(rows: list[dict], name: str) -> str:
    """The sweep as a Markdown table: medians [95 % interval] over seeds (with at least 3)."""
    def col(header: str, key: str, fmt: str) -> SweepColumn:
        return SweepColumn(header, lambda r: kit_cell(r, key, fmt, interval=r["seeds"] >= 3), numeric=True)

    columns = [col("sync p50 ms", "sync_p50_ms", "{:.1f}"), col("sync p99 ms", "sync_p99_ms", "{:.1f}"),
               col("speedup p50", "speedup_p50", "{:.2f}"), col("speedup p99", "speedup_p99", "{:.2f}")]
    if any(r.get("fct_avg_ms") is not None for r in rows):  # background traffic ran
        columns += [col("FCT avg ms", "fct_avg_ms", "{:.2f}"), col("FCT avg / baseline", "fct_avg_ratio", "{:.2f}"),
                    col("small-flow FCT p99 ms", "small_fct_p99_ms", "{:.2f}"),
                    col("small p99 / baseline", "small_fct_p99_ratio", "{:.2f}")]
    return sweep_table(rows, name, columns)


def plot(path: Path, rows: list[dict], name: str, title: str) -> None:
    """Speedup p50 and p99 over the baseline against the value (interval bars); with background
    traffic, a second panel of the background flows' FCT ratio to the baseline's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = list(dict.fromkeys(r["value"] for r in rows))
    xs, numeric = value_axis(values)
    schemes = [s for s in dict.fromkeys(r["scheme"] for r in rows) if s != "baseline"]
    background = any(r.get("fct_avg_ratio") is not None for r in rows)
    fig, axes = plt.subplots(1, 2 if background else 1, figsize=(11 if background else 6, 4.2), squeeze=False)

    def series(ax, scheme: str, key: str, label: str, marker: str) -> None:
        errorbars(ax, [r for r in rows if r["scheme"] == scheme], xs, key, marker=marker, label=label)

    for s in schemes:
        series(axes[0][0], s, "speedup_p50", f"{s}: sync p50", "o")
        series(axes[0][0], s, "speedup_p99", f"{s}: sync p99", "s")
        if background:
            series(axes[0][1], s, "fct_avg_ratio", f"{s}: average", "o")
            series(axes[0][1], s, "small_fct_p99_ratio", f"{s}: small flows' p99", "s")
    axes[0][0].set_ylabel("training sync speedup over baseline (x)")
    if background:
        axes[0][1].set_ylabel("background FCT / baseline's (x; > 1: slower)")
    for ax in axes[0]:
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    finish_axes(axes[0], name.replace("_", " "), values, numeric)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def sweep(base: SimOptions, name: str, values: list[str], repeat: int, out: Path,
          progress: Progress | None = None, provenance: dict | None = None) -> list[dict]:
    """Run ``base`` at every value of ``name``; write sweep.csv, sweep.md and sweep.png in ``out``.
    ``progress``: counts every simulated scheme and seed of every value; ``provenance`` (what
    made the sweep) goes into every value's results.json."""
    from dlcp_sim.run import run, summary

    per_value = dict(zip(values, [options_at(base, name, v) for v in values]))  # every value checked first

    def run_one(value: str) -> list[dict]:
        if progress is not None:
            progress.prefix = f"{name}={value}: "
        results = run(per_value[value], repeat, out / f"{name}={value}", provenance, progress)
        return rows_of(name, value, summary(results))

    rows = run_values(out, values, run_one)
    (out / "sweep.md").write_text(markdown(rows, name))
    title = (f"dlcp sim: {base.hosts} hosts ({base.leaves} leaves x {base.hosts_per_leaf}, {base.spines} spines), "
             f"{base.pattern} jobs of {base.workers}, {base.workload} x {base.scale:g}, {repeat} seed(s) per point"
             + (", bars: 95 % intervals" if repeat >= 3 else ""))
    plot(out / "sweep.png", rows, name, title)
    return rows
