"""Train an MLP on scikit-learn's bundled digits data, data-parallel through DLCP.

Runs anywhere: nothing is downloaded (the digits ship with scikit-learn).

    # under torchrun (one process per worker; the PS runs beside worker 0):
    torchrun --nproc-per-node 4 examples/train_digits.py --pattern ps
    # or let the script start the workers itself on this machine:
    python examples/train_digits.py --workers 4 --pattern ps
    # the demo: lossless vs bounded loss (vs error feedback), side by side
    python examples/train_digits.py --workers 4 --compare

The two DLCP lines are marked ``# DLCP`` below.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dlcp_torch  # noqa: E402
from hostagent.policy import Policy  # noqa: E402
from hostagent.transport import LossInjection  # noqa: E402


def load_data(seed: int = 0):
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


def train(args: argparse.Namespace, rank: int, world: int) -> dict:
    (xtr, ytr), (xte, yte) = load_data()
    model = make_model()
    policy = Policy(loss_bound_push=args.bound)
    drop = (0.0,) + (args.loss,) * (policy.num_drop_classes - 1)  # droppable classes only
    server_loss = LossInjection(drop_probabilities=drop, seed=1) if args.loss > 0 else None
    worker_loss = LossInjection(drop_probabilities=drop, seed=2 + rank) if args.loss > 0 else None
    if args.mode == "ddp":
        dist.init_process_group("gloo", rank=rank, world_size=world)
        net = torch.nn.parallel.DistributedDataParallel(model)
    else:
        net = model
    session = dlcp_torch.init(args.pattern, rank=rank, world_size=world, model=model, policy=policy,  # DLCP
                              loss=worker_loss, server_loss=server_loss, error_feedback=args.error_feedback,
                              mtu=args.mtu)
    if args.mode == "ddp":
        net.register_comm_hook(session.state, dlcp_torch.dlcp_hook)  # DLCP
        opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    else:
        opt = dlcp_torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                              model, session.state)  # DLCP
    shard = torch.arange(rank, len(ytr), world)
    g = torch.Generator().manual_seed(100 + rank)
    t0 = time.monotonic()
    step_times = []
    try:
        for step in range(args.steps):
            idx = shard[torch.randint(0, len(shard), (args.batch,), generator=g)]
            ts = time.monotonic()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xtr[idx]), ytr[idx]).backward()
            opt.step()
            step_times.append(time.monotonic() - ts)
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item()
        stats = session.state.stats
        return {"rank": rank, "accuracy": acc, "wall": time.monotonic() - t0,
                "sync_ms_p50": 1e3 * statistics.median(stats.sync_times),
                "sync_ms_p99": 1e3 * float(np.percentile(stats.sync_times, 99)),
                "step_ms_p50": 1e3 * statistics.median(step_times),
                "lost_mean": float(np.mean(stats.lost_fractions)) if stats.lost_fractions else 0.0}
    finally:
        if args.mode == "ddp":
            dist.barrier()
        time.sleep(0.2)
        session.close()
        if args.mode == "ddp":
            dist.destroy_process_group()


def _worker(rank: int, world: int, args: argparse.Namespace, ports: tuple[int, int], out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]),
                      DLCP_STORE_PORT=str(ports[1]))
    torch.set_num_threads(1)
    try:
        out.put(train(args, rank, world))
    except BaseException as exc:
        out.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        raise


def free_ports(n: int = 2) -> tuple[int, ...]:
    """``n`` distinct free TCP ports on loopback (torch's store and DLCP's store)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = tuple(s.getsockname()[1] for s in socks)
    for s in socks:
        s.close()
    return ports


def run_local(args: argparse.Namespace) -> list[dict]:
    """Start ``args.workers`` worker processes on this machine and collect their results."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = free_ports(2)
    procs = [ctx.Process(target=_worker, args=(r, args.workers, args, ports, out)) for r in range(args.workers)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in procs:
            results.append(out.get(timeout=args.timeout))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    errors = [r for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"worker {errors[0]['rank']} failed: {errors[0]['error']}")
    return sorted(results, key=lambda r: r["rank"])


def compare(args: argparse.Namespace) -> None:
    configs = [("lossless, p = 0", dict(loss=0.0, bound=0.0, error_feedback=False)),
               (f"{args.loss:.0%} loss, p = 0 (reliable)", dict(loss=args.loss, bound=0.0, error_feedback=False)),
               (f"{args.loss:.0%} loss, p = {args.bound}", dict(loss=args.loss, bound=args.bound, error_feedback=False)),
               (f"{args.loss:.0%} loss, p = {args.bound}, EF", dict(loss=args.loss, bound=args.bound,
                                                                 error_feedback=True))]
    print(f"digits MLP, {args.workers} workers + parameter server on loopback ({args.pattern}, {args.mode}), "
          f"{args.steps} steps of {args.batch} per worker; loss injected on drop classes 1-3 at every receiver")
    print(f"{'configuration':<30}{'accuracy':>9}{'sync p50 ms':>13}{'sync p99 ms':>13}{'lost':>8}{'wall s':>8}")
    rows = []
    for name, cfg in configs:
        res = run_local(argparse.Namespace(**{**vars(args), **cfg}))
        r0 = res[0]
        lost = float(np.mean([r["lost_mean"] for r in res]))
        print(f"{name:<30}{r0['accuracy']:>9.4f}{r0['sync_ms_p50']:>13.1f}{r0['sync_ms_p99']:>13.1f}"
              f"{lost:>8.2%}{max(r['wall'] for r in res):>8.1f}", flush=True)
        rows.append({"config": name, **cfg, "results": res})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--pattern", choices=["ps", "ring"], default="ps")
    ap.add_argument("--mode", choices=["ddp", "optimizer"], default="ddp",
                    help="DDP with the DLCP comm hook, or DLCP's DistributedOptimizer without DDP")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--loss", type=float, default=0.0, help="injected drop probability of drop classes 1-3")
    ap.add_argument("--bound", type=float, default=0.0, help="loss bound p of gradient pushes")
    ap.add_argument("--error-feedback", action="store_true")
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--compare", action="store_true", help="lossless vs bounded loss vs error feedback")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.compare:
        if args.loss == 0:
            args.loss, args.bound = 0.05, 0.1
        compare(args)
    elif "RANK" in os.environ:
        res = train(args, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        print(json.dumps(res))
    else:
        for r in run_local(args):
            print(json.dumps(r))


if __name__ == "__main__":
    main()
