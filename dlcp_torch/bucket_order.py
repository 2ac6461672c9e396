"""Priorities for the gradient collectives of a backward pass, from their order in the pass.

Why order is enough: DDP issues its buckets as their gradients are ready, which is roughly
last layer first, and FSDP reduce-scatters its units the same way; the next forward pass needs
the first layers first. So the k-th gradient collective of a pass of K holds layers at about
position K-1-k from the input, and gets the priority :func:`dlcp.hostagent.policy.layer_priorities`
gives that position among K. K is the count of the pass before (a pass is one autograd graph
task); the first pass, whose K is not known yet, sends everything at the top priority.
"""

from __future__ import annotations

import threading

from dlcp.hostagent.policy import Policy, layer_priorities


def bucket_priority(k: int, count: int | None, policy: Policy) -> int:
    """The priority of the ``k``-th (from 0) gradient collective of a backward pass that had
    ``count`` of them last time (None: not known yet).

    Example: ``bucket_priority(0, 4, Policy(num_priorities=2))`` -> 0 (the last layers: lowest)
    """
    if count is None or count <= 0:
        return policy.top_priority
    position = max(0, count - 1 - k)  # from the input; a pass longer than the last: the first layers
    return int(layer_priorities([1] * count, policy)[position])


class BackwardOrder:
    """Counts the gradient collectives of each backward pass (thread-safe: DDP's hooks may run
    on several autograd threads)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        self._task: int | None = None
        self._k = 0
        self.last_count: int | None = None
        """How many gradient collectives the last finished pass issued."""

    def priority(self, graph_task: int) -> int:
        """The priority of the next gradient collective of the pass ``graph_task``."""
        with self._lock:
            if graph_task != self._task:
                if self._task is not None:
                    self.last_count = self._k
                self._task, self._k = graph_task, 0
            k = self._k
            self._k += 1
            count = self.last_count
        return bucket_priority(k, count, self.policy)
