"""What every training agent of a testbed run shares, DLCP's (:mod:`dlcp.topologies.agent`) and
stock DDP's (:mod:`dlcp.topologies.ddp_agent`, over gloo or the dlcp backend): the model, its
data, this worker's batches, the optimiser and the evaluations, so schemes differ only in how
gradients are exchanged."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


def seed_of(spec: dict) -> int:
    """The run's training seed: its repetition (0 for specs written before runs had one)."""
    return int(spec.get("seed", 0))


def batch_seed(seed: int, rank: int) -> int:
    """The seed of worker ``rank``'s batch generator: distinct per worker and per training seed
    (seed 0 keeps the generators runs used before seeds varied, ``100 + rank``)."""
    return 100 + rank + 10_000 * seed


@dataclass
class Training:
    """What every training agent (DLCP's or gloo's) shares for one worker, so the schemes train
    the same model from the same seed on the same shard, batch by batch, and evaluate it at the
    same iterations: only the exchange differs.

    The seed (``spec["seed"]``, the run's repetition) draws the initial model and every worker's
    batches. Schemes of one repetition share it, so a comparison paired by repetition compares
    the exchanges on one training trajectory's start; repetitions differ in it, so an interval
    over them covers how a trajectory varies, not only timing. With one seed for every
    repetition two schemes whose sums round differently (a ring adds in another order than
    gloo's) part within a few hundred steps and stay apart in every repetition alike: their
    time-to-accuracy ratio is then one draw, repeated."""

    spec: dict
    rank: int
    workload: Any
    model: Any
    data: Any

    @classmethod
    def setup(cls, spec: dict, rank: int) -> Training:
        import torch

        from dlcp_torch.workloads import get_workload

        torch.set_num_threads(1)
        workload = get_workload(spec["model"])
        data = workload.load_data()
        return cls(spec, rank, workload, workload.make_model(seed_of(spec)), data)

    def batches(self) -> Iterator[tuple[int, Any, Any]]:
        """(iteration, inputs, labels) for the warm-up iteration 0 and every measured one: this
        worker's shard (every ``workers``-th sample from ``rank``), drawn by its own generator."""
        import torch

        (xtr, ytr), _ = self.data
        shard = torch.arange(self.rank, len(ytr), self.spec["workers"])
        g = torch.Generator().manual_seed(batch_seed(seed_of(self.spec), self.rank))
        for it in range(self.spec["iterations"] + 1):
            idx = shard[torch.randint(0, len(shard), (self.workload.batch,), generator=g)]
            yield it, xtr[idx], ytr[idx]

    def optimizer(self, params) -> tuple[Any, Any]:
        """The workload's optimiser and schedule, annealed over the run's iterations."""
        return self.workload.make_optimizer(params, self.workload.lr, self.spec["iterations"] + 1)

    def evaluate(self, f, it: int) -> None:
        """Every worker evaluates at the same iterations, outside the timed part, so none waits
        for another's evaluation (:mod:`dlcp.topologies.tta`); the last one is also the final."""
        from dlcp_torch.workloads.base import accuracy

        (_, _), (xte, yte) = self.data
        every, last = self.spec.get("eval_every", 0), self.spec["iterations"]
        if every and (it % every == 0 or it == last):
            f.write(json.dumps({"iteration": it, "rank": self.rank, "kind": "eval",
                                "accuracy": accuracy(self.model, xte, yte)}) + "\n")
        if it == last:
            f.write(json.dumps({"iteration": last + 1, "rank": self.rank, "kind": "final",
                                "accuracy": accuracy(self.model, xte, yte)}) + "\n")
        f.flush()
