"""A small 1-D CNN on MNIST-1D: a workload hard enough to show what a loss bound costs.

Digits is too easy for that (every configuration ends near the top; 360 test samples: one
sample is 0.28 points). MNIST-1D (Greydanus, 2020) is generated on this machine by the
``mnist1d`` package's ``make_dataset`` with its default arguments except the number of samples
(10,000 instead of 5,000, so the test set has 2,000 samples and one sample is 0.05 points);
nothing is downloaded.
The data set is cached under ``~/.cache/dlcp`` (``DLCP_CACHE_DIR``) after the first run. The CNN
has 22,858 parameters (65 packets per gradient at MTU 1500) and trains with a cosine
learning-rate schedule, so it has room on both sides of its accuracy (README, Convergence).

Needs the ``mnist1d`` extra: ``pip install 'dlcp[mnist1d]'`` (``pip install -e '.[mnist1d]'``
in a source checkout).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

from dlcp_torch.workloads.base import Data, MissingDependency, Workload, install_hint

__all__ = ["NUM_SAMPLES", "WORKLOAD", "MissingDependency", "cache_dir", "dataset_path", "load_data", "make_model",
           "require_mnist1d"]

#: make_dataset's default is 5,000 (1,000 test samples, 0.1 points each); 10,000 gives 2,000.
NUM_SAMPLES = 10_000
INSTALL_HINT = install_hint("mnist1d", "mnist1d")


def require_mnist1d() -> str:
    """The installed mnist1d version, or :class:`MissingDependency` saying how to install it."""
    if importlib.util.find_spec("mnist1d") is None:
        raise MissingDependency(INSTALL_HINT)
    return version("mnist1d")


def cache_dir() -> Path:
    """Where generated data sets are kept between runs (``DLCP_CACHE_DIR`` or ``~/.cache/dlcp``)."""
    return Path(os.environ.get("DLCP_CACHE_DIR") or Path.home() / ".cache" / "dlcp")


def _generate(path: Path) -> None:
    """MNIST-1D from ``make_dataset`` (never its download path), saved to ``path`` atomically."""
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = NUM_SAMPLES
    d = make_dataset(args)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, x=d["x"], y=d["y"], x_test=d["x_test"], y_test=d["y_test"])
    os.replace(tmp, path)


def dataset_path() -> Path:
    """Where the generated data set is cached: named by the generator's version (which fixes
    make_dataset's default arguments) and the sample count, so another mnist1d version never
    reads a stale file."""
    return cache_dir() / f"mnist1d-{require_mnist1d()}-n{NUM_SAMPLES}.npz"


def load_data() -> Data:
    """Train (8,000) and test (2,000) signals as (N, 1, 40) float32, with their labels.

    Generating takes several CPU seconds, so the first caller generates under a file lock and
    every other (worker processes starting together) waits and reads the cached file.
    """
    path = dataset_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():
                _generate(path)
    with np.load(path) as d:
        def xs(a: np.ndarray) -> torch.Tensor:
            return torch.tensor(a, dtype=torch.float32).unsqueeze(1)

        return ((xs(d["x"]), torch.tensor(d["y"], dtype=torch.long)),
                (xs(d["x_test"]), torch.tensor(d["y_test"], dtype=torch.long)))


def make_model(seed: int = 0) -> torch.nn.Module:
    """Two strided convolutions and a two-layer head: 22,858 parameters."""
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(nn.Conv1d(1, 16, 5, stride=2, padding=2), nn.ReLU(),
                         nn.Conv1d(16, 32, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(320, 64), nn.ReLU(), nn.Linear(64, 10))


WORKLOAD = Workload("mnist1d", "MNIST-1D CNN", load_data, make_model, steps=1000, batch=32, lr=0.1, cosine=True,
                    prerequisite=require_mnist1d)
