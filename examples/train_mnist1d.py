"""Train a small 1-D CNN on MNIST-1D, data-parallel through DLCP.

Digits is too easy to show what a loss bound costs (96-98 % whatever we do, 360 test samples:
one sample is 0.28 points). MNIST-1D (Greydanus, 2020) is generated on this machine by the
``mnist1d`` package's ``make_dataset`` with its default arguments except the number of samples
(10,000 instead of 5,000, so the test set has 2,000 samples and one sample is 0.05 points);
nothing is downloaded. The data set is cached under ``~/.cache/dlcp`` (``DLCP_CACHE_DIR``)
after the first run. The CNN (22,858 parameters, 65 packets per gradient at MTU 1500) reaches
about 90.5 % in 1,000 steps of 4 x 32 samples with a cosine learning-rate schedule: room on
both sides (seeds spread it by about 1.3 points, standard deviation; README, Convergence).

Needs ``mnist1d``: ``pip install -e '.[mnist1d]'`` in the repository (or ``pip install mnist1d``).

    python examples/train_mnist1d.py --workers 4 --pattern ps
    python examples/train_mnist1d.py --workers 4 --loss 0.1 --bound 0.1 --eval-every 50
    python examples/train_mnist1d.py --workers 4 --compare --loss 0.2 --bound 0.2
    torchrun --nproc-per-node 4 examples/train_mnist1d.py --pattern ring
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.dptrain import Data, Workload, main  # noqa: E402

#: make_dataset's default is 5,000 (1,000 test samples, 0.1 points each); 10,000 gives 2,000.
NUM_SAMPLES = 10_000
INSTALL_HINT = "mnist1d is not installed; install it with: pip install -e '.[mnist1d]' (or pip install mnist1d)"


class MissingDependency(RuntimeError):
    """An optional package this workload needs is not installed."""


def require_mnist1d() -> str:
    """The installed mnist1d version, or :class:`MissingDependency` saying how to install it."""
    if importlib.util.find_spec("mnist1d") is None:
        raise MissingDependency(INSTALL_HINT)
    return version("mnist1d")


def cache_dir() -> Path:
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


if __name__ == "__main__":
    main(WORKLOAD, __doc__)
