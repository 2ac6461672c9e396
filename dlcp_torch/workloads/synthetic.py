"""Gradients of a real model's tensor sizes through DLCP, without the model: the exchange alone.

The "model" holds one parameter per tensor of a profile from :mod:`dlcp.hostagent.model_profiles`
(ResNet-50's 161 tensors by default); each step's backward produces random gradients of those
shapes, which DLCP's DistributedOptimizer sends as soon as each exists, highest priority first.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch

import dlcp_torch
from dlcp.hostagent.loopback import free_tcp_ports
from dlcp.hostagent.model_profiles import layer_sizes
from dlcp.hostagent.policy import Policy


@dataclass(frozen=True)
class SyntheticConfig:
    """One synthetic exchange run (every worker reads the same one)."""

    workers: int = 4
    model: str = "resnet50"
    scale: float = 0.1
    """Multiplies every tensor's size (1 = the real model)."""
    pattern: str = "ps"
    bound: float = 0.0
    steps: int = 5
    mtu: int = 9000


def run(cfg: SyntheticConfig, rank: int, world: int, out=None) -> dict:
    """One worker's steps; returns (and puts on ``out``, if given) its step times."""
    torch.set_num_threads(1)
    sizes = layer_sizes(cfg.model, cfg.scale)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for n in sizes])
    session = dlcp_torch.init(cfg.pattern, rank=rank, world_size=world, policy=Policy(loss_bound_push=cfg.bound),
                              mtu=cfg.mtu, message_deadline=120)
    opt = dlcp_torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, session.state)
    g = torch.Generator().manual_seed(rank)
    coeffs = [torch.randn(n, generator=g) for n in sizes]
    times = []
    for _ in range(cfg.steps):
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


def _worker(rank: int, cfg: SyntheticConfig, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run(cfg, rank, cfg.workers, out)


def run_local(cfg: SyntheticConfig, timeout: float = 600.0) -> list[dict]:
    """Start ``cfg.workers`` worker processes on this machine and collect their results."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    (port,) = free_tcp_ports(1)
    procs = [ctx.Process(target=_worker, args=(r, cfg, port, out)) for r in range(cfg.workers)]
    for p in procs:
        p.start()
    results = sorted((out.get(timeout=timeout) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(30)
    return results
