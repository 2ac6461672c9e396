"""What every sweep shares: the testbed's (``dlcp sweep``, :mod:`dlcp.topologies.sweep`) and the
simulator's (``dlcp sim --sweep``, :mod:`dlcp_sim.sweep`).

A sweep runs one experiment per value of one option and keeps, per value and scheme, a row of
medians with their 95 % intervals: written to ``sweep.csv`` after every value (a long sweep
that stops keeps what it has), then ``sweep.md`` and ``sweep.png``. What differs between the two
is only what an experiment is and which columns a row has; the loop, the CSV, the Markdown table
(:func:`markdown`, given each source's columns) and the figure's axes and error bars are here, once.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def put_estimate(row: dict, column: str, median: float | None, low: float | None, high: float | None) -> None:
    """``row[column]`` and its interval (``column_ci_low``, ``column_ci_high``); None where unknown."""
    row[column], row[f"{column}_ci_low"], row[f"{column}_ci_high"] = median, low, high


def write_csv(path: Path, rows: Sequence[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def sweep_csv(given: str) -> Path | None:
    """The CSV a command line names: the file itself (any ``*.csv`` name, as kept beside a
    results page), or a sweep's or a convergence study's in its directory; None when ``given``
    names none."""
    path = Path(given)
    if path.is_dir():
        path = next((path / n for n in ("sweep.csv", "converge.csv") if (path / n).is_file()), path / "sweep.csv")
    return path if path.suffix == ".csv" and path.is_file() else None


def read_csv(path: Path) -> list[dict]:
    """A sweep.csv's rows as :func:`write_csv` was given them: numbers as numbers, empty cells as
    None; the swept ``value`` stays text (it may be a choice such as ``ahead``).

    Raises:
        ValueError: the file is not a sweep's (no ``param``, ``value`` and ``scheme`` columns, or no rows).
    """
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"param", "value", "scheme"} <= set(rows[0]):
        raise ValueError("not a sweep's CSV (no param, value and scheme columns, or no rows)")
    return [{k: (v if k in ("param", "value", "scheme", "verdict", "run_dir") else _number(v)) for k, v in r.items()}
            for r in rows]


def _number(text: str) -> int | float | str | None:
    if text == "":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def cell(row: dict, key: str, fmt: str, interval: bool = True) -> str:
    """A Markdown cell: the median, with its interval when there is one and ``interval``."""
    if row.get(key) is None:
        return "-"
    lo, hi = row.get(key + "_ci_low"), row.get(key + "_ci_high")
    shown = f" [{fmt.format(lo)}, {fmt.format(hi)}]" if interval and lo is not None and hi is not None else ""
    return fmt.format(row[key]) + shown


@dataclass(frozen=True)
class SweepColumn:
    """A column of a sweep's Markdown table after the value and the scheme: its header, its cell
    for a row, and whether it is a number (right-aligned)."""

    header: str
    render: Callable[[dict], str]
    numeric: bool = False


def markdown(rows: Sequence[dict], param: str, columns: Sequence[SweepColumn]) -> str:
    """A sweep's rows as one Markdown table: the swept value, the scheme, then ``columns``; the
    testbed's and the simulator's tables differ only in their columns."""
    head = "| " + " | ".join([param, "scheme", *(c.header for c in columns)]) + " |"
    rule = "|---|---|" + "".join("---:|" if c.numeric else "---|" for c in columns)
    body = ["| " + " | ".join([str(r["value"]), str(r["scheme"]), *(c.render(r) for c in columns)]) + " |"
            for r in rows]
    return "\n".join([head, rule, *body]) + "\n"


def run_values(out: Path, values: Sequence[str], run_one: Callable[[str], list[dict]]) -> list[dict]:
    """``run_one(value)``'s rows for every value in turn, ``out/sweep.csv`` rewritten after each."""
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for value in values:
        rows += run_one(value)
        if rows:
            write_csv(out / "sweep.csv", rows)
    return rows


def value_axis(values: list[str]) -> tuple[dict[str, float], bool]:
    """Where each swept value goes on a figure's x axis, and whether the axis is numeric: the
    values themselves when all are numbers, else one slot per value in order (a choice such
    as a pattern)."""
    numeric = all(_is_number(v) for v in values)
    return {v: (float(v) if numeric else float(i)) for i, v in enumerate(values)}, numeric


def _is_number(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False


def errorbars(ax: Any, rows: Sequence[dict], xs: dict[str, float], key: str, **style: Any) -> Any:
    """Plot ``key`` of ``rows`` (one scheme's) against their values, with interval bars; returns
    the line (None when no row has the key)."""
    pts = [r for r in rows if r.get(key) is not None]
    if not pts:
        return None
    lo = [r[key] - r[f"{key}_ci_low"] if r.get(f"{key}_ci_low") is not None else 0 for r in pts]
    hi = [r[f"{key}_ci_high"] - r[key] if r.get(f"{key}_ci_high") is not None else 0 for r in pts]
    return ax.errorbar([xs[r["value"]] for r in pts], [r[key] for r in pts], yerr=[lo, hi], capsize=3, **style)


def finish_axes(axes: Sequence[Any], xlabel: str, values: list[str], numeric: bool) -> None:
    """The x label, one tick per value on a categorical axis, and a legend."""
    for ax in axes:
        ax.set_xlabel(xlabel)
        if not numeric:
            ax.set_xticks(range(len(values)), values)
        ax.legend(fontsize=8)


__all__ = ["SweepColumn", "cell", "errorbars", "finish_axes", "markdown", "put_estimate", "read_csv", "run_values",
           "sweep_csv", "value_axis", "write_csv"]
