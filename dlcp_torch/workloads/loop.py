"""One data-parallel training loop through DLCP, and the launcher that runs it on this machine.

Every workload trains through this one loop, so a change to how DLCP is driven (or measured)
reaches the examples, ``dlcp converge`` and the testbed alike. A run is seeded by
:attr:`TrainConfig.seed`: model initialisation, every worker's batches and the injected loss;
seed 0 reproduces the examples' historical runs exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import dlcp_torch
from dlcp_torch.workloads.base import SEED_STRIDE, Workload, accuracy
from dlcp.hostagent.loopback import free_tcp_ports
from dlcp.hostagent.policy import PATTERNS, Policy
from dlcp.hostagent.tables import Column, Record, Table
from dlcp.hostagent.transport import LossInjection


@dataclass(frozen=True)
class TrainConfig:
    """One data-parallel training run on this machine (every worker reads the same one)."""

    workers: int = 4
    pattern: str = "ps"
    mode: str = "ddp"
    """``ddp``: DDP with the DLCP comm hook; ``optimizer``: DLCP's DistributedOptimizer."""
    steps: int = 300
    batch: int = 32
    lr: float = 0.05
    loss: float = 0.0
    """Injected drop probability of drop classes 1..n-1 at every receiver (class 0 never)."""
    bound: float = 0.0
    """Loss bound p of gradient pushes."""
    error_feedback: bool = False
    mtu: int = 1500
    timeout: float = 600.0
    seed: int = 0
    eval_every: int = 0
    """Evaluate on the test set every this many steps on worker 0 (0: only after the last)."""

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise ValueError(f"pattern must be one of {PATTERNS}, got {self.pattern!r}")
        if self.mode not in ("ddp", "optimizer"):
            raise ValueError(f"mode must be ddp or optimizer, got {self.mode!r}")
        if self.workers < 1 or self.steps < 1 or self.batch < 1:
            raise ValueError(f"workers, steps and batch must be >= 1, got {self.workers}, {self.steps}, {self.batch}")
        if not 0 <= self.loss <= 1 or not 0 <= self.bound < 1:
            raise ValueError(f"loss must be in [0, 1] and bound in [0, 1), got {self.loss} and {self.bound}")
        if self.seed < 0 or self.eval_every < 0:
            raise ValueError(f"seed and eval_every must be >= 0, got {self.seed} and {self.eval_every}")

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> TrainConfig:
        """The fields ``ns`` has (the rest keep their defaults); other attributes are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})


def train(cfg: TrainConfig, workload: Workload, rank: int, world: int) -> dict:
    """One worker's run; returns its figures (worker 0 also its accuracy-vs-time ``trace``).

    Time-to-accuracy needs the accuracy during training, but evaluating is not training: the
    trace's clock (``train_s``) leaves out worker 0's evaluations (the other workers wait for
    it at the next exchange, so the job's wall time grows by the same amount).
    """
    (xtr, ytr), (xte, yte) = workload.load_data()
    model = workload.make_model(cfg.seed)
    policy = Policy(loss_bound_push=cfg.bound)
    base = SEED_STRIDE * cfg.seed
    drop = (0.0,) + (cfg.loss,) * (policy.num_drop_classes - 1)  # droppable classes only
    server_loss = LossInjection(drop_probabilities=drop, seed=base + 1) if cfg.loss > 0 else None
    worker_loss = LossInjection(drop_probabilities=drop, seed=base + 2 + rank) if cfg.loss > 0 else None
    ddp: torch.nn.parallel.DistributedDataParallel | None = None
    if cfg.mode == "ddp":
        dist.init_process_group("gloo", rank=rank, world_size=world)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    net: torch.nn.Module = ddp if ddp is not None else model
    session = dlcp_torch.init(cfg.pattern, rank=rank, world_size=world, model=model, policy=policy,  # DLCP
                              loss=worker_loss, server_loss=server_loss, error_feedback=cfg.error_feedback,
                              mtu=cfg.mtu)
    inner, schedule = workload.make_optimizer(model.parameters(), cfg.lr, cfg.steps)
    opt: torch.optim.Optimizer | dlcp_torch.DistributedOptimizer
    if ddp is not None:
        ddp.register_comm_hook(session.state, dlcp_torch.dlcp_hook)  # DLCP
        opt = inner
    else:
        opt = dlcp_torch.DistributedOptimizer(inner, model, session.state)  # DLCP
    shard = torch.arange(rank, len(ytr), world)
    g = torch.Generator().manual_seed(base + 100 + rank)
    tracing = cfg.eval_every > 0 and rank == 0
    trace = [(0.0, 0, accuracy(model, xte, yte))] if tracing else []
    t0 = time.monotonic()
    evaluating = 0.0
    step_times = []
    try:
        for step in range(cfg.steps):
            idx = shard[torch.randint(0, len(shard), (cfg.batch,), generator=g)]
            ts = time.monotonic()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xtr[idx]), ytr[idx]).backward()
            opt.step()
            if schedule is not None:
                schedule.step()
            step_times.append(time.monotonic() - ts)
            if tracing and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                te = time.monotonic()
                trace.append((te - t0 - evaluating, step + 1, accuracy(model, xte, yte)))
                evaluating += time.monotonic() - te
        train_s = time.monotonic() - t0 - evaluating
        acc = accuracy(model, xte, yte)
        if tracing:
            trace.append((train_s, cfg.steps, acc))
        stats = session.state.stats
        res: dict[str, Any] = {"rank": rank, "accuracy": acc, "wall": time.monotonic() - t0, "train_s": train_s,
               "sync_ms_p50": 1e3 * statistics.median(stats.sync_times),
               "sync_ms_p99": 1e3 * float(np.percentile(stats.sync_times, 99)),
               "step_ms_p50": 1e3 * statistics.median(step_times),
               "lost_mean": float(np.mean(stats.lost_fractions)) if stats.lost_fractions else 0.0}
        if tracing:
            res["trace"] = [list(p) for p in trace]
        return res
    finally:
        if cfg.mode == "ddp":
            dist.barrier()
        time.sleep(0.2)
        session.close()
        if cfg.mode == "ddp":
            dist.destroy_process_group()


def _worker(rank: int, cfg: TrainConfig, workload: Workload, ports: tuple[int, int], out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(cfg.workers), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(ports[0]), DLCP_STORE_PORT=str(ports[1]))
    torch.set_num_threads(1)
    try:
        out.put(train(cfg, workload, rank, cfg.workers))
    except BaseException as exc:
        out.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        raise


def run_local(cfg: TrainConfig, workload: Workload) -> list[dict]:
    """Start ``cfg.workers`` worker processes on this machine and collect their results.

    The data is loaded once here first, so a workload that generates and caches its data
    does so once, not in every worker at the same time.
    """
    import torch.multiprocessing as mp

    workload.load_data()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = free_tcp_ports(2)  # torch's store and DLCP's
    procs = [ctx.Process(target=_worker, args=(r, cfg, workload, ports, out)) for r in range(cfg.workers)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in procs:
            results.append(out.get(timeout=cfg.timeout))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    errors = [r for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"worker {errors[0]['rank']} failed: {errors[0]['error']}")
    return sorted(results, key=lambda r: r["rank"])


def compare(cfg: TrainConfig, workload: Workload, json_path: str | None = None,
            out: Path | None = None, argv: Sequence[str] | None = None) -> list[dict]:
    """Lossless, loss with a reliable push (p = 0), bounded loss, and bounded loss with error
    feedback, one after the other, printed as a table: kept with the command and commit in
    ``out`` (``dlcp report`` prints it), the workers' whole results in ``json_path``; ``argv``:
    the command line's arguments when they are not this process's."""
    configs: list[tuple[str, dict[str, Any]]] = [("lossless, p = 0", dict(loss=0.0, bound=0.0, error_feedback=False)),
               (f"{cfg.loss:.0%} loss, p = 0 (reliable)", dict(loss=cfg.loss, bound=0.0, error_feedback=False)),
               (f"{cfg.loss:.0%} loss, p = {cfg.bound}", dict(loss=cfg.loss, bound=cfg.bound, error_feedback=False)),
               (f"{cfg.loss:.0%} loss, p = {cfg.bound}, EF", dict(loss=cfg.loss, bound=cfg.bound,
                                                               error_feedback=True))]
    server = " + parameter server" if cfg.pattern == "ps" else ""
    record = Record.start(f"python {sys.argv[0]}", argv)
    table = Table(f"{workload.title}, {cfg.workers} workers{server} on loopback ({cfg.pattern}, {cfg.mode}), "
                  f"{cfg.steps} steps of {cfg.batch} per worker; loss injected on drop classes 1-3 at every receiver",
                  [Column("configuration"), Column("accuracy", "{:.4f}"), Column("sync p50 ms", "{:.1f}"),
                   Column("sync p99 ms", "{:.1f}"), Column("lost", "{:.2%}"), Column("train s", "{:.1f}"),
                   Column("row s", "{:.1f}")],
                  notes=["sync: per bucket, from hand-off to the averaged result; lost: the mean fraction of a "
                         "worker's pushed gradient that never arrived (EF: error feedback); train s: the slowest "
                         "worker's training loop; row s: the wall time the row took (processes, data and "
                         "rendezvous included)."])
    print(table.title, flush=True)
    rows = []
    for name, change in configs:
        t_row = time.monotonic()
        res = run_local(dataclasses.replace(cfg, **change), workload)
        row_s = time.monotonic() - t_row  # processes, rendezvous and shutdown too: what the row took
        r0 = res[0]
        table.add(name, r0["accuracy"], r0["sync_ms_p50"], r0["sync_ms_p99"],
                  float(np.mean([r["lost_mean"] for r in res])), max(r["wall"] for r in res), row_s)
        print(f"   {name}: {row_s:.1f} s", flush=True)
        rows.append({"config": name, **change, "row_s": row_s, "results": res})
    print(table.text())
    record.keep(out, [table])
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2))
    return rows
