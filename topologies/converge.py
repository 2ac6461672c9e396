"""``dlcp converge``: what a loss bound costs in accuracy, over seeds, on loopback.

DLCP promises faster training *at equal accuracy*; one seed of one run cannot show whether a
bound of p = 0.1 costs 0.1 or 1 point. A study runs a grid (seeds x loss bounds x injected loss
x error feedback x pattern) of real training runs of a workload (:mod:`dlcp_torch.workloads`,
MNIST-1D by default) on this machine, no switches and no root, and writes into its directory:

* ``converge.csv``: one row per run (configuration, seed, final accuracy, training time, lost
  fraction, and worker 0's accuracy-vs-time trace inline as JSON). A study resumes: runs whose
  row is already there (same settings, configuration and seed) are skipped.
* ``converge.md``: per configuration the mean final accuracy with its 95 % interval, the
  difference from lossless training of the same pattern (paired by seed) with its interval,
  and the time to reach the lossless accuracy minus 0.5 points.
* ``accuracy-vs-bound.png`` and ``accuracy-vs-time.png`` (:mod:`dlcp.topologies.converge_plot`).

This module is the pure part (the grid, the CSV rows, the statistics, the table), tested
without training; :mod:`dlcp.topologies.converge_run` runs the runs and writes the report.
"""

from __future__ import annotations

import csv
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Iterable, Sequence

from dlcp.hostagent.errors import DlcpUserError, UsageError
from dlcp.hostagent.lossmodel import PROBABILITY
from dlcp.hostagent.policy import LOSS_BOUND, PATTERNS
from dlcp.hostagent.ranges import Range
from dlcp.topologies.stats import CONFIDENCE
from dlcp.topologies.tta import time_to_accuracy

#: A bounded configuration meets the issue's target when it is within this of lossless (0.5 points).
TOLERANCE = 0.005

# --- the grid ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One configuration of the grid; a run is a configuration and a seed."""

    pattern: str
    bound: float
    loss: float
    """Injected drop probability of drop classes 1-3 at every receiver."""
    error_feedback: bool

    @property
    def lossless(self) -> bool:
        return self.bound == 0 and self.loss == 0

    @property
    def label(self) -> str:
        if self.lossless:
            return f"{self.pattern}, lossless"
        return (f"{self.pattern}, p = {self.bound:g}, {self.loss:.0%} loss" + (" (reliable)" if self.bound == 0 else "")
                + (", EF" if self.error_feedback else ""))


#: The allowed values of ``dlcp converge``'s numeric options (one value of a list each): checked
#: by :class:`Settings` and :class:`Grid` and by the parser as the options are typed.
RANGES: dict[str, Range] = {
    "workers": Range(1, 16),
    "steps": Range(1),
    "eval_every": Range(1),
    "seeds": Range(1),
    "first_seed": Range(0),
    "bounds": LOSS_BOUND,  # each run's Policy must accept it
    "losses": PROBABILITY,
    "jobs": Range(1),
    "timeout": Range(0, lo_open=True),
}


@dataclass(frozen=True)
class Settings:
    """What every run of a study shares; rows of other settings in the same CSV are ignored."""

    workload: str = "mnist1d"
    workers: int = 4
    steps: int = 1000
    eval_every: int = 50
    """Steps between worker 0's test evaluations (the time-to-accuracy trace)."""
    mode: str = "ddp"

    def __post_init__(self) -> None:
        for name in ("workers", "steps", "eval_every"):
            RANGES[name].check(f"--{name.replace('_', '-')}", getattr(self, name))
        if self.eval_every > self.steps:
            raise UsageError(f"--eval-every must be 1..steps, got {self.eval_every} with --steps {self.steps}")
        if self.mode not in ("ddp", "optimizer"):
            raise UsageError(f"--mode must be ddp or optimizer, got {self.mode!r}")


@dataclass(frozen=True)
class Grid:
    """Seeds x bounds x injected losses x error feedback x patterns.

    ``losses=None`` pairs every bound with an injected loss equal to it (p = 0.1 with 10 % loss:
    the bound just covers the loss), which keeps the grid small; a tuple crosses the losses with
    the bounds. Error feedback is left out where nothing can be lost (bound or loss 0): it
    would repeat the run without it.

    ``reliable`` (with paired losses) adds, for every nonzero bound, the same loss recovered in
    full (p = 0): the baseline a bound has to beat in time, at equal loss.
    """

    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    bounds: tuple[float, ...] = (0.0, 0.1, 0.2)
    losses: tuple[float, ...] | None = None
    error_feedback: tuple[bool, ...] = (False, True)
    patterns: tuple[str, ...] = PATTERNS
    reliable: bool = False

    def __post_init__(self) -> None:
        for name, values in (("--seeds", self.seeds), ("--bounds", self.bounds), ("--error-feedback",
                                                                                  self.error_feedback),
                             ("--patterns", self.patterns), ("--losses", self.losses or (0.0,))):
            if not values:
                raise UsageError(f"{name} needs at least one value")
            if len(set(values)) != len(values):
                raise UsageError(f"{name} repeats a value: {list(values)}")
        for seed in self.seeds:
            RANGES["first_seed"].check("--first-seed", seed)
        for bound in self.bounds:
            RANGES["bounds"].check("--bounds", bound)
        for loss in self.losses or ():
            RANGES["losses"].check("--losses", loss)
        bad = [p for p in self.patterns if p not in PATTERNS]
        if bad:
            raise UsageError(f"unknown pattern(s) {bad}; choose from {list(PATTERNS)}")
        if self.reliable and self.losses is not None:
            raise UsageError("--reliable goes with --losses same; with crossed losses, put 0 in --bounds")

    def configs(self) -> list[Config]:
        """Every configuration, by pattern, then bound (a reliable baseline before the bound
        whose loss it has), loss and error feedback."""
        out = []
        for pattern in self.patterns:
            for bound in self.bounds:
                if self.reliable and bound > 0:
                    out.append(Config(pattern, 0.0, bound, False))
                for loss in (bound,) if self.losses is None else self.losses:
                    for ef in self.error_feedback:
                        if ef and (bound == 0 or loss == 0):
                            continue
                        out.append(Config(pattern, bound, loss, ef))
        return out

    def runs(self) -> list[tuple[Config, int]]:
        """Every run, seed by seed: each configuration once before the next seed, so a study cut
        short has the same seeds of every configuration, and drift of the machine over a long
        study falls on all configurations alike."""
        return [(c, s) for s in self.seeds for c in self.configs()]


def parse_floats(text: str, option: str) -> tuple[float, ...]:
    """``"0,0.1,0.2"`` -> (0.0, 0.1, 0.2); an error names the option and the bad value."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        try:
            out.append(float(part))
        except ValueError:
            raise UsageError(f"{option}: {part!r} is not a number (comma-separated numbers expected)") from None
    return tuple(out)


def parse_switches(text: str, option: str) -> tuple[bool, ...]:
    """``"off,on"`` -> (False, True)."""
    parts = [p.strip() for p in text.split(",")]
    bad = [p for p in parts if p not in ("on", "off")]
    if bad:
        raise UsageError(f"{option}: {bad[0]!r} is neither on nor off")
    return tuple(p == "on" for p in parts)


# --- rows of the CSV ----------------------------------------------------------------------------

SETTINGS_FIELDS = ("workload", "workers", "steps", "eval_every", "mode")
CONFIG_FIELDS = ("pattern", "bound", "loss", "error_feedback")
RESULT_FIELDS = ("accuracy", "accuracy_spread", "train_s", "wall_s", "lost_mean", "sync_ms_p50", "sync_ms_p99",
                 "finished", "trace")
FIELDS = SETTINGS_FIELDS + CONFIG_FIELDS + ("seed",) + RESULT_FIELDS
_TYPES: dict[str, Callable[[str], object]] = {
    "workers": int, "steps": int, "eval_every": int, "seed": int, "bound": float, "loss": float,
    "error_feedback": lambda s: s == "True", "accuracy": float, "accuracy_spread": float, "train_s": float,
    "wall_s": float, "lost_mean": float, "sync_ms_p50": float, "sync_ms_p99": float, "trace": json.loads}


def row_of(settings: Settings, config: Config, seed: int, results: Sequence[dict]) -> dict:
    """The CSV row of one run from its workers' results (worker 0 first, with the trace).

    ``accuracy`` is worker 0's; ``accuracy_spread`` (max - min over workers) shows where the
    workers' models diverged (only possible where losses are not made good for everyone alike).
    """
    r0 = results[0]
    accs = [r["accuracy"] for r in results]
    return {**{k: getattr(settings, k) for k in SETTINGS_FIELDS}, **{k: getattr(config, k) for k in CONFIG_FIELDS},
            "seed": seed, "accuracy": r0["accuracy"], "accuracy_spread": max(accs) - min(accs),
            "train_s": r0["train_s"], "wall_s": max(r["wall"] for r in results),
            "lost_mean": sum(r["lost_mean"] for r in results) / len(results),
            "sync_ms_p50": r0["sync_ms_p50"], "sync_ms_p99": r0["sync_ms_p99"],
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "trace": r0.get("trace", [])}


def run_key(row: dict) -> tuple:
    """What identifies a run: its settings, configuration and seed (floats compared rounded)."""
    return tuple(round(row[k], 9) if isinstance(row[k], float) else row[k]
                 for k in SETTINGS_FIELDS + CONFIG_FIELDS + ("seed",))


def key_of(settings: Settings, config: Config, seed: int) -> tuple:
    return run_key({**{k: getattr(settings, k) for k in SETTINGS_FIELDS},
                    **{k: getattr(config, k) for k in CONFIG_FIELDS}, "seed": seed})


def config_of(row: dict) -> Config:
    return Config(row["pattern"], row["bound"], row["loss"], row["error_feedback"])


def read_rows(path: Path) -> list[dict]:
    """The rows of a study's CSV with their types back (none when it does not exist yet)."""
    if not path.exists():
        return []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or set(FIELDS) - set(reader.fieldnames):
            raise DlcpUserError(f"{path} is not a converge CSV (its columns are {reader.fieldnames}); "
                                "choose another --out")
        return [{k: _TYPES.get(k, str)(v) for k, v in r.items() if k in FIELDS} for r in reader]


def append_row(path: Path, row: dict) -> None:
    """Add one run's row (the header first if the file is new): a study cut short keeps its runs."""
    new = not path.exists()
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            w.writeheader()
        w.writerow({**row, "trace": json.dumps(row["trace"])})


# --- statistics -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeanCI:
    """A mean over seeds with its Student-t confidence interval (none below 2 values).

    Not :func:`dlcp.topologies.stats.median_ci`: the target is about the *mean* final accuracy, and
    with five seeds a percentile bootstrap cannot produce an interval wider than the values
    themselves, so it would claim more than five runs can show.
    """

    mean: float
    low: float | None
    high: float | None
    n: int

    def text(self, scale: float = 100.0, fmt: str = "{:.2f}", sign: bool = False) -> str:
        """``mean [low, high]`` in points (``scale`` 100), ``-`` without values."""
        if self.n == 0:
            return "-"
        f = (lambda v: ("+" if v > 0 else "") + fmt.format(v * scale)) if sign else (lambda v: fmt.format(v * scale))
        return f(self.mean) if self.low is None else f"{f(self.mean)} [{f(self.low)}, {f(self.high)}]"


def mean_ci(values: Iterable[float], confidence: float = CONFIDENCE) -> MeanCI:
    x = [float(v) for v in values if v is not None and not math.isnan(v)]
    n = len(x)
    if n == 0:
        return MeanCI(float("nan"), None, None, 0)
    m = sum(x) / n
    if n < 2:
        return MeanCI(m, None, None, n)
    from scipy.stats import t

    sd = math.sqrt(sum((v - m) ** 2 for v in x) / (n - 1))
    half = float(t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return MeanCI(m, m - half, m + half, n)


def target_verdict(delta: MeanCI, tolerance: float = TOLERANCE) -> str:
    """Whether the accuracy difference from lossless is within ``tolerance``: shown by the whole
    interval, by the mean only, or not."""
    if delta.n == 0:
        return "-"
    if delta.low is not None and delta.low >= -tolerance:
        return "yes"
    return "mean only" if delta.mean >= -tolerance else "no"


@dataclass(frozen=True)
class Summary:
    """One configuration over its seeds."""

    config: Config
    accuracy: MeanCI
    delta: MeanCI
    """Accuracy minus lossless accuracy of the same pattern and seed (n = 0 without a baseline)."""
    lost: float
    train_s: MeanCI
    target: float | None
    """The lossless mean accuracy of the pattern minus :data:`TOLERANCE`."""
    times_to_target: tuple[float | None, ...] = field(default=())

    @property
    def reached(self) -> int:
        return sum(t is not None for t in self.times_to_target)

    @property
    def median_time_to_target(self) -> float | None:
        ts = sorted(t for t in self.times_to_target if t is not None)
        if not ts:
            return None
        mid = len(ts) // 2
        return ts[mid] if len(ts) % 2 else (ts[mid - 1] + ts[mid]) / 2


def rows_for(rows: Sequence[dict], settings: Settings, grid: Grid) -> list[dict]:
    """The rows of this study (its settings, configurations and seeds), the first of any duplicate."""
    wanted = {key_of(settings, c, s) for c, s in grid.runs()}
    seen: dict[tuple, dict] = {}
    for r in rows:
        k = run_key(r)
        if k in wanted and k not in seen:
            seen[k] = r
    return list(seen.values())


def summarise(rows: Sequence[dict], settings: Settings, grid: Grid) -> list[Summary]:
    """Per configuration of ``grid`` that has runs: accuracy, paired difference from lossless,
    mean lost fraction, training time and time to the lossless accuracy minus 0.5 points."""
    return _summaries(rows_for(rows, settings, grid), grid.configs())


def studies_in(rows: Sequence[dict]) -> list[tuple[Settings, list[Summary]]]:
    """Every study a converge.csv holds (one per settings), summarised over all the
    configurations and seeds it has: what ``dlcp report converge.csv`` prints, with no command
    line to say what the grid was. Configurations come in the order a paired or a crossed
    :class:`Grid` runs them, patterns in the order the CSV first has them; for the rows of one
    grid that is ``converge.md``'s table (a CSV that several grids wrote is summarised whole)."""
    out = []
    for key in dict.fromkeys(tuple(r[k] for k in SETTINGS_FIELDS) for r in rows):
        settings = Settings(**dict(zip(SETTINGS_FIELDS, key)))
        mine: dict[tuple, dict] = {}
        for r in rows:  # the first of any duplicate, as rows_for keeps
            if tuple(r[k] for k in SETTINGS_FIELDS) == key:
                mine.setdefault(run_key(r), r)
        configs = list(dict.fromkeys(config_of(r) for r in mine.values()))
        patterns = list(dict.fromkeys(c.pattern for c in configs))
        # crossed losses (a bound with a loss other than itself): p = 0 with loss is an ordinary
        # bound-0 configuration; paired: it is a reliable baseline, run just before its bound
        crossed = any(c.bound > 0 and c.loss != c.bound for c in configs)
        configs.sort(key=lambda c: _grid_order(c, patterns, crossed))
        out.append((settings, _summaries(list(mine.values()), configs)))
    return out


def _grid_order(c: Config, patterns: list[str], crossed: bool) -> tuple:
    """Where :meth:`Grid.configs` puts ``c``: by pattern, then bound (a paired grid's reliable
    baseline, p = 0 with loss, just before the bound whose loss it has), loss, error feedback."""
    reliable = not crossed and c.bound == 0 and c.loss > 0
    return (patterns.index(c.pattern), c.loss if reliable else c.bound, 0 if reliable else 1, c.loss,
            c.error_feedback)


def _summaries(mine: Sequence[dict], configs: Sequence[Config]) -> list[Summary]:
    by_config: dict[Config, dict[int, dict]] = {}
    for r in mine:
        by_config.setdefault(config_of(r), {})[r["seed"]] = r
    out = []
    for c in configs:
        runs = by_config.get(c)
        if not runs:
            continue
        base = by_config.get(Config(c.pattern, 0.0, 0.0, False), {})
        target = (sum(r["accuracy"] for r in base.values()) / len(base) - TOLERANCE) if base else None
        seeds = sorted(runs)
        out.append(Summary(
            config=c, accuracy=mean_ci(runs[s]["accuracy"] for s in seeds),
            delta=mean_ci(runs[s]["accuracy"] - base[s]["accuracy"] for s in seeds if s in base),
            lost=sum(runs[s]["lost_mean"] for s in seeds) / len(seeds),
            train_s=mean_ci(runs[s]["train_s"] for s in seeds), target=target,
            times_to_target=tuple(time_to_accuracy(runs[s]["trace"], target) if target is not None else None
                                  for s in seeds)))
    return out


def markdown_table(summaries: Sequence[Summary]) -> str:
    """The study as a Markdown table, accuracies in points (percent)."""
    head = ("| configuration | seeds | accuracy % [95 % CI] | vs lossless, points [95 % CI] | within 0.5? "
            "| lost | training s | to lossless - 0.5 s (reached) |\n|---|---:|---:|---:|:---:|---:|---:|---:|")
    body = []
    for s in summaries:
        tta = s.median_time_to_target
        body.append(f"| {s.config.label} | {s.accuracy.n} | {s.accuracy.text()} | "
                    f"{'-' if s.config.lossless else s.delta.text(sign=True)} | "
                    f"{'-' if s.config.lossless else target_verdict(s.delta)} | {s.lost:.1%} | "
                    f"{s.train_s.text(scale=1, fmt='{:.1f}')} | "
                    f"{'-' if tta is None else f'{tta:.1f}'} ({s.reached}/{len(s.times_to_target)}) |")
    return "\n".join([head, *body]) + "\n"


def mean_trace(traces: Sequence[Sequence[Sequence[float]]]) -> list[tuple[float, int, float]]:
    """(mean seconds, step, mean accuracy) at each evaluation the traces share (same steps)."""
    n, k = min((len(t) for t in traces), default=0), len(traces)
    return [(sum(t[i][0] for t in traces) / k, int(traces[0][i][1]), sum(t[i][2] for t in traces) / k)
            for i in range(n)]
