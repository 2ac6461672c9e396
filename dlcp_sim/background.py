"""Background traffic for ``dlcp sim``: flows drawn from a published data-centre flow-size
distribution at a chosen load.

Pure: a seed in, a list of flows out, so every scheme of one seed sees the same flows and
their completion times can be compared flow by flow.

The definition of load is the one of the generator that ships with HPCC (Li et al., SIGCOMM
2019), which DCQCN/HPCC/pFabric-style studies share: every host starts flows by a Poisson
process whose mean gap is ``mean_size / (load * link_rate)``, each to a destination drawn
uniformly among the other hosts, with a size drawn from the distribution (linear between its
points). So ``load`` is the fraction of each host's link its background flows offer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: The web-search flow-size distribution (Alizadeh et al., "Data Center TCP", SIGCOMM 2010), as
#: (bytes, cumulative fraction) points; the form HPCC's and pFabric's simulations use.
WEB_SEARCH: tuple[tuple[float, float], ...] = (
    (0, 0.0), (10_000, 0.15), (20_000, 0.20), (30_000, 0.30), (50_000, 0.40), (80_000, 0.53),
    (200_000, 0.60), (1_000_000, 0.70), (2_000_000, 0.80), (5_000_000, 0.90), (10_000_000, 0.97),
    (30_000_000, 1.0),
)

DISTRIBUTIONS = {"websearch": WEB_SEARCH}

#: Smallest flow: the generator's sizes start at 1 byte; a TCP flow here carries at least one
#: full segment's worth of header room.
MIN_FLOW_BYTES = 64


@dataclass(frozen=True)
class BackgroundFlow:
    """One background flow: ``size`` bytes from host ``src`` to host ``dst``, starting at ``start`` s."""

    id: int
    src: int
    dst: int
    size: int
    start: float


def mean_size(cdf: tuple[tuple[float, float], ...]) -> float:
    """Mean of the piecewise-linear distribution (uniform between consecutive points)."""
    xs = np.array([x for x, _ in cdf], float)
    ps = np.array([p for _, p in cdf], float)
    return float(np.sum(np.diff(ps) * (xs[1:] + xs[:-1]) / 2))


def sample_sizes(cdf: tuple[tuple[float, float], ...], n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` flow sizes in bytes (inverse transform of the piecewise-linear CDF)."""
    xs = np.array([x for x, _ in cdf], float)
    ps = np.array([p for _, p in cdf], float)
    if ps[0] != 0 or ps[-1] != 1 or np.any(np.diff(ps) < 0) or np.any(np.diff(xs) < 0):
        raise ValueError("a flow-size CDF rises from 0 to 1 over increasing sizes")
    sizes = np.interp(rng.random(n), ps, xs)
    return np.maximum(sizes.astype(np.int64), MIN_FLOW_BYTES)


def generate(hosts: int, load: float, link_bps: float, horizon_s: float, seed: int,
             distribution: str = "websearch") -> list[BackgroundFlow]:
    """Flows that start before ``horizon_s`` at ``load`` (fraction of each host's link), sorted by start."""
    if load <= 0 or horizon_s <= 0:
        return []
    if hosts < 2:
        raise ValueError("background traffic needs at least 2 hosts")
    cdf = DISTRIBUTIONS[distribution]
    rng = np.random.default_rng([seed, 0xB6])  # its own stream: the gradients' draws stay as they were
    gap = mean_size(cdf) * 8 / (load * link_bps)
    flows: list[tuple[float, int, int]] = []
    for src in range(hosts):
        t = rng.exponential(gap)
        while t < horizon_s:
            dst = int(rng.integers(hosts - 1))
            flows.append((t, src, dst + (dst >= src)))
            t += rng.exponential(gap)
    flows.sort()
    sizes = sample_sizes(cdf, len(flows), rng)
    return [BackgroundFlow(i, s, d, int(z), t) for i, ((t, s, d), z) in enumerate(zip(flows, sizes))]
