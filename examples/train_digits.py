"""Train an MLP on scikit-learn's bundled digits data, data-parallel through DLCP.

Runs anywhere: nothing is downloaded (the digits ship with scikit-learn).

    # under torchrun (one process per worker; the PS runs beside worker 0):
    torchrun --nproc-per-node 4 examples/train_digits.py --pattern ps
    # or let the script start the workers itself on this machine:
    python examples/train_digits.py --workers 4 --pattern ps
    # the demo: lossless vs bounded loss (vs error feedback), side by side
    python examples/train_digits.py --workers 4 --compare

The training loop, with its two DLCP lines marked ``# DLCP``, is in examples/dptrain.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples import dptrain  # noqa: E402
from examples.dptrain import Data, TrainConfig, Workload, free_ports, main  # noqa: E402

__all__ = ["WORKLOAD", "free_ports", "load_data", "make_model", "run_local"]


def load_data(seed: int = 0) -> Data:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return (x[perm[:cut]], y[perm[:cut]]), (x[perm[cut:]], y[perm[cut:]])


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


WORKLOAD = Workload("digits", "digits MLP", load_data, make_model, steps=300, batch=32, lr=0.05)


def run_local(args: argparse.Namespace | TrainConfig) -> list[dict]:
    """Start ``args.workers`` digits workers on this machine and collect their results."""
    cfg = args if isinstance(args, TrainConfig) else TrainConfig.from_namespace(args)
    return dptrain.run_local(cfg, WORKLOAD)


if __name__ == "__main__":
    main(WORKLOAD, __doc__)
