"""Exchange ResNet-50-sized gradients through DLCP: the per-tensor sizes of a real model.

The "model" holds one parameter per ResNet-50 tensor (161 of them, 25.6 M elements at
``--scale 1``); each step's backward produces random gradients of those shapes, which
DLCP's DistributedOptimizer sends as soon as each exists, highest priority first
(dlcp_torch/workloads/synthetic.py).

    python examples/synthetic_resnet50.py --workers 4 --scale 0.1 --steps 5
    torchrun --nproc-per-node 4 examples/synthetic_resnet50.py
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from dlcp.hostagent.policy import PATTERNS
from dlcp.hostagent.model_profiles import PROFILES
from dlcp_torch.workloads.synthetic import SyntheticConfig, run, run_local


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--model", default="resnet50", choices=sorted(PROFILES))
    ap.add_argument("--scale", type=float, default=0.1, help="multiply every tensor's size (1 = the real model)")
    ap.add_argument("--pattern", choices=PATTERNS, default="ps")
    ap.add_argument("--bound", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--mtu", type=int, default=9000)
    args = ap.parse_args()
    cfg = SyntheticConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SyntheticConfig)})
    if "RANK" in os.environ:
        print(run(cfg, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])))
        return
    for r in run_local(cfg):
        print(r)


if __name__ == "__main__":
    main()
