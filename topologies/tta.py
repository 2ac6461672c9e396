"""Time-to-accuracy of a training run on the testbed (pure functions over its records).

DLCP's promise is faster training *at equal accuracy*, so the figure that matters is the wall
time a job needs to reach a target accuracy, not the time per iteration alone: bounded loss
can make iterations faster and each of them worth a little less.

The agents of a training workload (``dlcp.topologies.agent.run_training``) evaluate the test set
every ``eval_every`` iterations, all of them at the same iterations and outside the timed
part of an iteration, so no worker waits for another's evaluation. The run's clock is the
sum of the measured iterations' times (the warm-up iteration, which opens connections, is
left out), which is the job's wall time without its evaluations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

#: The default target: the lossless baseline's final accuracy minus this (0.5 points).
TARGET_MARGIN = 0.005


def accuracy_trace(records: list[dict]) -> list[tuple[float, float]]:
    """(training seconds, accuracy) at every evaluation of one run, in order.

    The time of an evaluation after iteration i is, per worker, the sum of its measured
    iteration times up to i; the trace takes the median over workers (they differ only by
    stragglers' waits). The accuracy is the mean over workers (replicas can differ slightly
    when bounded loss zero-fills different packets at different workers)."""
    clock: dict[int, list[tuple[int, float]]] = {}
    for r in sorted((r for r in records if r.get("kind") == "measured"), key=lambda r: r["iteration"]):
        elapsed = clock.setdefault(r["rank"], [])
        elapsed.append((r["iteration"], (elapsed[-1][1] if elapsed else 0.0) + r["iteration_time"]))
    evals: dict[int, list[tuple[int, float]]] = {}
    for r in records:
        if r.get("kind") == "eval":
            evals.setdefault(r["iteration"], []).append((r["rank"], r["accuracy"]))
    trace = []
    for it in sorted(evals):
        times = [max((t for i, t in clock.get(rank, []) if i <= it), default=0.0) for rank, _ in evals[it]]
        trace.append((float(np.median(times)), float(np.mean([a for _, a in evals[it]]))))
    return trace


def time_to_accuracy(trace: Sequence[Sequence[float]], target: float) -> float | None:
    """Training seconds at the first evaluation at or above ``target`` (None: never reached).

    ``trace`` holds points whose first element is the training seconds and last the accuracy:
    ``(seconds, accuracy)`` here, ``(seconds, step, accuracy)`` in ``dlcp converge``. Between
    evaluations the time is not known more finely than their spacing."""
    return next((p[0] for p in trace if p[-1] >= target), None)


def default_target(baseline_final: list[float]) -> float | None:
    """The baseline's median final accuracy minus :data:`TARGET_MARGIN`; None without baseline runs."""
    finals = [a for a in baseline_final if not math.isnan(a)]
    return float(np.median(finals)) - TARGET_MARGIN if finals else None
