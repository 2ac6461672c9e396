"""Statistics of repeated runs: medians with bootstrap confidence intervals, and when to call a
difference.

The unit of replication is one run of one scheme (its own agents, connections, cross traffic);
iterations inside a run are not independent of each other, so intervals are taken over runs.
``--repeat N`` interleaves the schemes (A B A B ...), so run r of every scheme saw the same
drift of the machine, and the speedup is paired: baseline's run r against the scheme's run r.
Intervals are percentile bootstrap intervals of the median (scipy.stats.bootstrap), seeded so
a report regenerates identically, from at least :data:`MIN_INTERVAL_RUNS` runs. With fewer
there is no interval and no claim, only the range: a percentile bootstrap of the median of 3
runs can return nothing but their minimum and maximum, which cover the true median only about
75 % of the time (5 runs: 94 %), so calling that a 95 % interval would overstate it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 9999
#: Runs (or paired runs) an interval, and a faster/slower verdict, needs; fewer give a range.
MIN_INTERVAL_RUNS = 5


@dataclass(frozen=True)
class Estimate:
    """A median over runs with its confidence interval; with fewer than :data:`MIN_INTERVAL_RUNS`
    runs ``low`` and ``high`` are the range (minimum and maximum), not an interval, and with
    fewer than 2 there are none."""

    median: float
    low: float | None
    high: float | None
    n: int

    @property
    def is_interval(self) -> bool:
        """``low`` and ``high`` are a confidence interval (enough runs), not just the range."""
        return self.low is not None and self.high is not None and self.n >= MIN_INTERVAL_RUNS

    def excludes(self, value: float) -> bool:
        """The interval lies entirely on one side of ``value``: a difference we may call (never
        from a range)."""
        return self.is_interval and (self.low > value or self.high < value)  # type: ignore[operator]

    def as_dict(self) -> dict:
        return {"median": self.median, "ci_low": self.low, "ci_high": self.high, "n": self.n}

    def text(self, fmt: str = "{:.0f}") -> str:
        """``median [low, high]`` with an interval, ``median (range low..high)`` with only a
        range, or the median alone."""
        if math.isnan(self.median):
            return "-"
        if self.low is None:
            return fmt.format(self.median)
        if not self.is_interval:
            return f"{fmt.format(self.median)} (range {fmt.format(self.low)}..{fmt.format(self.high)})"
        return f"{fmt.format(self.median)} [{fmt.format(self.low)}, {fmt.format(self.high)}]"


def median_ci(values: Sequence[float], confidence: float = CONFIDENCE, seed: int = 0) -> Estimate:
    """The median of ``values`` and its percentile bootstrap interval (NaNs left out); from fewer
    than :data:`MIN_INTERVAL_RUNS` values, their range instead (none from one)."""
    x = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=float)
    if len(x) == 0:
        return Estimate(float("nan"), None, None, 0)
    med = float(np.median(x))
    if len(x) < 2:
        return Estimate(med, None, None, len(x))
    if len(x) < MIN_INTERVAL_RUNS:
        return Estimate(med, float(x.min()), float(x.max()), len(x))
    if np.all(x == x[0]):
        return Estimate(med, med, med, len(x))
    from scipy.stats import bootstrap

    res = bootstrap((x,), np.median, confidence_level=confidence, n_resamples=RESAMPLES, method="percentile",
                    rng=np.random.default_rng(seed), vectorized=True, axis=-1)
    return Estimate(med, float(res.confidence_interval.low), float(res.confidence_interval.high), len(x))


def paired_ratios(reference: Sequence[float], other: Sequence[float]) -> list[float]:
    """reference[r] / other[r] for every run r both have (the speedup of ``other``)."""
    return [a / b for a, b in zip(reference, other) if b and not math.isnan(a) and not math.isnan(b)]


def verdict(speedup: Estimate) -> str:
    """What a speedup interval allows us to say (nothing from a range)."""
    if speedup.low is None:
        return f"too few (valid) runs for an interval (use --repeat >= {MIN_INTERVAL_RUNS})"
    if not speedup.is_interval:
        return f"range only ({speedup.n} paired runs; an interval needs {MIN_INTERVAL_RUNS}): no verdict"
    if speedup.low > 1.0:
        return "faster"
    if speedup.high is not None and speedup.high < 1.0:
        return "slower"
    return "no significant difference"


def versus(speedup: Estimate, reference: str) -> str:
    """:func:`verdict` as a phrase about ``reference``: "faster than gloo", "slower than gloo",
    "not significantly different from gloo"."""
    said = verdict(speedup)
    if said in ("faster", "slower"):
        return f"{said} than {reference}"
    if said == "no significant difference":
        return f"not significantly different from {reference}"
    return said
