"""What a training workload is: a model and its data, with the optimiser settings that train it.

Shared by every workload, the training loop (:mod:`dlcp_torch.workloads.loop`) and the
testbed's training agent, so they all evaluate and build optimisers the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: (train inputs, train labels), (test inputs, test labels)
Data = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

#: Seeds of different runs are this far apart, so no two runs share a generator stream.
SEED_STRIDE = 1000


class MissingDependency(RuntimeError):
    """An optional package a workload needs is not installed (the message names the extra)."""


def install_hint(package: str, extra: str) -> str:
    """One line saying how to install ``package``, the optional dependency of ``extra``, both
    from the package index and in a source checkout."""
    return (f"{package} is not installed; install it with: pip install 'dlcp[{extra}]' "
            f"(in a source checkout: pip install -e '.[{extra}]')")


@dataclass(frozen=True)
class Workload:
    """A model and its data, with the optimiser settings that train it well."""

    name: str
    title: str
    """How reports name it, e.g. ``digits MLP``."""
    load_data: Callable[[], Data]
    make_model: Callable[[int], torch.nn.Module]
    """Builds the model with its parameters initialised from the given seed."""
    steps: int
    batch: int
    """Samples per worker per step."""
    lr: float
    cosine: bool = False
    """Anneal the learning rate to 0 over the run (cosine): the last steps settle, so the final
    accuracy is not read in the middle of the noise that a constant rate keeps up to the end."""
    prerequisite: Callable[[], object] | None = None
    """Raises :class:`MissingDependency` (one line, saying how to install it) when an optional
    package is missing."""

    def make_optimizer(self, params, lr: float, steps: int
                       ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler | None]:
        """SGD with momentum 0.9, and the schedule to step after every optimiser step (or None)."""
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
        return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps) if self.cosine else None


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy of ``model`` in eval mode (shared by the loop and the testbed agent)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train(was_training)
    return acc
