"""The command line every workload shares (the examples and ``python -m dlcp_torch.workloads``).

One parser for all workloads, so ``dlcp converge`` can start any of them with the same options.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

from dlcp_torch.workloads.base import MissingDependency, Workload
from dlcp.hostagent.policy import PATTERNS
from dlcp_torch.workloads.loop import TrainConfig, compare, run_local, train


def parser(workload: Workload, doc: str | None) -> argparse.ArgumentParser:
    """The workloads' command line; step, batch and learning-rate defaults come from ``workload``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--pattern", choices=PATTERNS, default="ps")
    ap.add_argument("--mode", choices=["ddp", "optimizer"], default="ddp",
                    help="DDP with the DLCP comm hook, or DLCP's DistributedOptimizer without DDP")
    ap.add_argument("--steps", type=int, default=workload.steps)
    ap.add_argument("--batch", type=int, default=workload.batch)
    ap.add_argument("--lr", type=float, default=workload.lr)
    ap.add_argument("--loss", type=float, default=0.0, help="injected drop probability of drop classes 1-3")
    ap.add_argument("--bound", type=float, default=0.0, help="loss bound p of gradient pushes")
    ap.add_argument("--error-feedback", action="store_true")
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0, help="seeds the model, the batches and the injected loss")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="also record worker 0's test accuracy every N steps (a time-to-accuracy trace)")
    ap.add_argument("--compare", action="store_true", help="lossless vs bounded loss vs error feedback")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--out", type=Path, default=None, metavar="FILE",
                    help="--compare: also keep its table with the command and commit (dlcp report FILE prints it)")
    return ap


def main(workload: Workload, doc: str | None = None, argv: Sequence[str] | None = None) -> None:
    """Under torchrun: this process's worker; otherwise start the workers here (or ``--compare``)."""
    ap = parser(workload, doc)
    args = ap.parse_args(argv)
    if workload.prerequisite is not None:
        try:
            workload.prerequisite()
        except MissingDependency as exc:
            ap.exit(2, f"{ap.prog}: {exc}\n")
    if args.compare and args.loss == 0:
        args.loss, args.bound = 0.05, 0.1
    try:
        cfg = TrainConfig.from_namespace(args)
    except ValueError as exc:
        ap.error(str(exc))
    if args.compare:
        compare(cfg, workload, args.json, args.out, argv)
    elif "RANK" in os.environ:
        print(json.dumps(train(cfg, workload, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))))
    else:
        results = run_local(cfg, workload)
        for r in results:
            print(json.dumps({k: v for k, v in r.items() if k != "trace"}))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
