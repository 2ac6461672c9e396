"""Statistics of repeated runs: medians with bootstrap confidence intervals, and when to call a
difference.

The unit of replication is one run of one scheme (its own agents, connections, cross traffic);
iterations inside a run are not independent of each other, so intervals are taken over runs.
``--repeat N`` interleaves the schemes (A B A B ...), so run r of every scheme saw the same
drift of the machine, and the speedup is paired: baseline's run r against the scheme's run r.
Intervals are percentile bootstrap intervals of the median (scipy.stats.bootstrap), seeded so
a report regenerates identically; with fewer than 3 runs there is no interval and no claim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 9999


@dataclass(frozen=True)
class Estimate:
    """A median over runs with its confidence interval (None when there are too few runs)."""

    median: float
    low: float | None
    high: float | None
    n: int

    def excludes(self, value: float) -> bool:
        """The interval lies entirely on one side of ``value``: a difference we may call."""
        return self.low is not None and self.high is not None and (self.low > value or self.high < value)

    def as_dict(self) -> dict:
        return {"median": self.median, "ci_low": self.low, "ci_high": self.high, "n": self.n}

    def text(self, fmt: str = "{:.0f}") -> str:
        """``median [low, high]``, or the median alone without an interval."""
        if math.isnan(self.median):
            return "-"
        if self.low is None:
            return fmt.format(self.median)
        return f"{fmt.format(self.median)} [{fmt.format(self.low)}, {fmt.format(self.high)}]"


def median_ci(values: Sequence[float], confidence: float = CONFIDENCE, seed: int = 0) -> Estimate:
    """The median of ``values`` and its percentile bootstrap interval (NaNs left out)."""
    x = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=float)
    if len(x) == 0:
        return Estimate(float("nan"), None, None, 0)
    med = float(np.median(x))
    if len(x) < 3:
        return Estimate(med, None, None, len(x))
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
    """What a speedup interval allows us to say."""
    if speedup.low is None:
        return "too few (valid) runs for an interval (use --repeat >= 3)"
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
