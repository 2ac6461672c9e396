"""An MLP on scikit-learn's bundled digits data: a workload that trains in seconds anywhere.

Nothing is downloaded (the digits ship with scikit-learn, the ``digits`` extra), which is why
the demo and the shim's tests use it.
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import version

import torch

from dlcp_torch.workloads.base import Data, MissingDependency, Workload, install_hint

__all__ = ["WORKLOAD", "load_data", "make_model", "require_sklearn"]


def require_sklearn() -> str:
    """The installed scikit-learn version, or :class:`MissingDependency` saying how to install it."""
    if importlib.util.find_spec("sklearn") is None:
        raise MissingDependency(install_hint("scikit-learn", "digits"))
    return version("scikit-learn")


def load_data(seed: int = 0) -> Data:
    """An 80/20 split of the 1,797 digits (8 x 8 pixels scaled to [0, 1]), shuffled by ``seed``."""
    require_sklearn()
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return (x[perm[:cut]], y[perm[:cut]]), (x[perm[cut:]], y[perm[cut:]])


def make_model(seed: int = 0) -> torch.nn.Module:
    """Three linear layers with ReLU between them, initialised from ``seed``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


WORKLOAD = Workload("digits", "digits MLP", load_data, make_model, steps=300, batch=32, lr=0.05,
                    prerequisite=require_sklearn)
