"""Exchange ResNet-50-sized gradients through DLCP: the per-tensor sizes of a real model.

The "model" holds one parameter per ResNet-50 tensor (161 of them, 25.6 M elements at
``--scale 1``); each step's backward produces random gradients of those shapes, which
DLCP's DistributedOptimizer sends as soon as each exists, highest priority first.

    python examples/synthetic_resnet50.py --workers 4 --scale 0.1 --steps 5
    torchrun --nproc-per-node 4 examples/synthetic_resnet50.py
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dlcp_torch  # noqa: E402
from hostagent.model_profiles import layer_sizes  # noqa: E402
from hostagent.policy import Policy  # noqa: E402


def run(args: argparse.Namespace, rank: int, world: int, out=None) -> dict:
    torch.set_num_threads(1)
    sizes = layer_sizes(args.model, args.scale)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for n in sizes])
    session = dlcp_torch.init(args.pattern, rank=rank, world_size=world, policy=Policy(loss_bound_push=args.bound),
                              mtu=args.mtu, message_deadline=120)
    opt = dlcp_torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, session.state)
    g = torch.Generator().manual_seed(rank)
    coeffs = [torch.randn(n, generator=g) for n in sizes]
    times = []
    for _ in range(args.steps):
        t0 = time.monotonic()
        opt.zero_grad()
        sum((p * c).sum() for p, c in zip(model, coeffs)).backward()
        opt.step()
        times.append(time.monotonic() - t0)
    session.close()
    res = {"rank": rank, "tensors": len(sizes), "mb_per_step": 4 * sum(sizes) / 1e6,
           "step_ms_p50": 1e3 * statistics.median(times), "step_ms_max": 1e3 * max(times)}
    if out is not None:
        out.put(res)
    return res


def _worker(rank, world, args, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run(args, rank, world, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--model", default="resnet50", choices=["resnet50", "vgg16", "transformer"])
    ap.add_argument("--scale", type=float, default=0.1, help="multiply every tensor's size (1 = the real model)")
    ap.add_argument("--pattern", choices=["ps", "ring"], default="ps")
    ap.add_argument("--bound", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--mtu", type=int, default=9000)
    args = ap.parse_args()
    if "RANK" in os.environ:
        print(run(args, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])))
        return
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    procs = [ctx.Process(target=_worker, args=(r, args.workers, args, port, out)) for r in range(args.workers)]
    for p in procs:
        p.start()
    results = sorted((out.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(30)
    for r in results:
        print(r)


if __name__ == "__main__":
    main()
