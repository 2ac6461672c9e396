"""The host agent of a stock-DDP scheme: what users run, on the same hosts and fabric as DLCP's agents.

Started like DLCP's agent (``python -m dlcp.topologies.agent SPEC RANK OUT``, with ``spec["transport"]
== "torch"``): the workers join a ``torch.distributed`` process group whose store is on worker 0's
host, over ``spec["backend"]``, and exchange gradients as stock ``DistributedDataParallel`` does,
with PyTorch's own communication hook where the scheme names one (:data:`HOOKS`). There is no
parameter server: DDP's all-reduce is a ring.

* ``gloo`` (TCP): what users run instead of DLCP.
* ``dlcp`` (scheme ``dlcp-backend``): the same script with ``init_process_group("dlcp")``, as
  PyTorch users run DLCP: the backend's defaults (its MTU read from the host's interface, the
  loss bound on DDP's buckets, priorities from their order), with the run's policy given
  through :func:`dlcp_torch.backend.configure` as a user gives the policy file the switches
  run, and the line rate a NIC on a link of the fabric's rate would report (``line_rate``:
  the veth's own 10 Gb/s is an artefact of the emulation). Training workloads only (the
  backend knows gradients by the backward pass).
* A training workload (digits, MNIST-1D) trains the same model from the same seed, on the same
  shard and batches, with the same optimiser and evaluation points as DLCP's agent
  (:class:`dlcp.topologies.training.Training`); only the exchange differs.
* A synthetic workload (gloo only) exchanges the same buckets as DLCP's agent, with the same
  simulated backward pass: each bucket is all-reduced (asynchronously, as DDP's reducer does) as
  soon as it is full; ``fp16`` sends it as float16 (as ``fp16_compress_hook`` does). PowerSGD
  needs a real model's matrices and is refused there (:meth:`dlcp.topologies.runner.RunOptions.validate`).

The records are DLCP's agent's, with what means something for each: ``sync_time`` is from the
last gradient being ready (a hook on every parameter) to the step's end, as DLCP's is;
``breakdown`` has compute and transmission only (a TCP stream's first byte, recovery and
retransmissions happen in the kernel, not in messages this agent can see); ``retransmissions``
counts, over gloo, the TCP segments the host's network namespace resent (``RetransSegs``, on a
Mininet host gloo's own), over the dlcp backend the data packets its endpoint resent, whose
totals close the file as DLCP's agents' do (an ``endpoint`` record).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from dlcp.topologies.training import Training
from dlcp.topologies.workload import TRAINING_WORKLOADS, worker_plan

#: The DDP communication hook of each gloo scheme's ``hook`` (None: DDP's own all-reduce).
HOOKS = (None, "fp16", "powersgd")

#: PowerSGD's settings: those of the example in PyTorch's documentation of ``PowerSGDState``
#: (rank 1, vanilla all-reduce for the first 10 iterations, compress a tensor once that saves
#: anything). Its constructor's own defaults start compressing only at iteration 1,000, which
#: would make a 1,000-iteration run plain gloo.
POWERSGD = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 10, "min_compression_rate": 0.5}


def tcp_retransmissions() -> int:
    """TCP segments this network namespace has resent (``RetransSegs`` of /proc/net/snmp)."""
    lines = [line.split() for line in Path("/proc/net/snmp").read_text().splitlines() if line.startswith("Tcp:")]
    names, values = lines[0], lines[1]
    return int(values[names.index("RetransSegs")])


def interface_of(ip: str) -> str:
    """The interface holding address ``ip`` in this namespace, for ``GLOO_SOCKET_IFNAME``: gloo
    otherwise binds to what the machine's host name resolves to, which in a Mininet host is not
    an address the other hosts can reach."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        fields = line.split()
        if fields[3].split("/")[0] == ip:
            return fields[1]
    raise RuntimeError(f"no interface of this host has address {ip}")


#: The job's rendezvous store (worker 0 hosts it), kept past the process group for :func:`leave`.
_STORE: Any = None
#: How long :func:`leave` waits for the other workers to be done with the group.
LEAVE_TIMEOUT = timedelta(seconds=60)


def join(spec: dict, rank: int) -> None:
    """Join the job's process group over ``spec["backend"]`` (gloo if unset); the store is on
    worker 0's host."""
    import torch.distributed as dist

    global _STORE
    backend = spec.get("backend") or "gloo"
    if backend == "gloo":
        os.environ["GLOO_SOCKET_IFNAME"] = interface_of(spec["peer_ips"][rank])
    elif backend == "dlcp":
        from dlcp.hostagent.policy import Policy
        from dlcp_torch.backend import configure

        # (its address would be found on the route to MASTER_ADDR; the runner sets none)
        os.environ["DLCP_HOST"] = spec["peer_ips"][rank]
        # The backend's default line rate is the interface's speed: a NIC on a link of the
        # fabric's rate says that rate, and that is what DLCP's own agents are configured for
        # (spec["rate"]); a Mininet host's veth says 10 Gb/s, 1,350 times the testbed's links.
        configure(policy=Policy.from_dict(spec["policy"]), line_rate=float(spec["rate"]["line_rate"]))
    else:
        raise ValueError(f"unknown torch.distributed backend {backend!r}; gloo or dlcp")
    timeout = timedelta(seconds=spec["deadline"] + 60)
    _STORE = dist.TCPStore(spec["peer_ips"][0], spec["store_port"], spec["workers"], is_master=rank == 0,
                           timeout=timeout)
    dist.init_process_group(backend, store=_STORE, rank=rank, world_size=spec["workers"], timeout=timeout)


class _ExchangeFigures:
    """What an iteration's record says of the exchange: what was resent (the TCP segments the
    host's namespace resent over gloo, the data packets the dlcp group's endpoint resent), and
    over dlcp what DLCP's agents record of an iteration's messages (its breakdown, message and
    rate traces) and, last, the endpoint's totals."""

    def __init__(self, spec: dict) -> None:
        self.dlcp: Any = None
        if spec.get("backend") == "dlcp":  # (gloo's agents import nothing of DLCP's)
            import torch.distributed as dist

            from dlcp_torch.backend import implementation

            self.dlcp = implementation(dist.group.WORLD)
        self.last = self._total()

    def _total(self) -> int:
        if self.dlcp is None:
            return tcp_retransmissions()
        return int(self.dlcp.endpoint.stats.retransmitted_pkts)

    def resent(self) -> int:
        """What was resent since the last call (since construction, the first time): one read
        a record, its end the next one's start, so the records add up to the run's total (what
        came between two iterations counts in the next one, as DLCP's agents count it)."""
        now = self._total()
        delta, self.last = now - self.last, now
        return delta

    def dlcp_fields(self, t0: float, ready: float, end: float, mtu: int) -> dict[str, Any]:
        """The breakdown, message and rate traces DLCP's agents record, from the endpoint's logs
        (every message that started in the iteration: the backend numbers its collectives, not
        the training's iterations); none over gloo."""
        if self.dlcp is None:
            return {}
        from dlcp.topologies.breakdown import iteration_breakdown
        from dlcp.topologies.endpoint_logs import changed_at, finished_at, message_trace, rate_trace, recent

        ep = self.dlcp.endpoint
        log = [m for m in recent(ep.message_log, t0, finished_at) if m.started >= t0]
        received = [m for m in log if m.direction == "recv"]
        return {"breakdown": iteration_breakdown(t0, ready, end, received),
                "message_trace": message_trace(log, None, t0),
                "rate_trace": rate_trace(recent(ep.rate_log, t0, changed_at), mtu, t0, end),
                "lost_fraction": float(np.mean([m.lost_fraction for m in received] or [0.0]))}

    def endpoint_record(self, rank: int) -> str:
        """The endpoint's totals as DLCP's agents write them last (an empty string over gloo)."""
        if self.dlcp is None:
            return ""
        return json.dumps({"rank": rank, "kind": "endpoint", "stats": self.dlcp.endpoint.endpoint_stats()},
                          default=str) + "\n"


def _wait_count(key: str, n: int) -> None:
    """Until ``n`` workers have added to ``key`` in the store (or LEAVE_TIMEOUT passed)."""
    deadline = time.monotonic() + LEAVE_TIMEOUT.total_seconds()
    while _STORE.add(key, 0) < n and time.monotonic() < deadline:
        time.sleep(0.02)


def leave() -> None:
    """Leave the group together. Why more than a barrier: a worker that exits while another is
    still destroying its group resets that one's gloo connections, and the other aborts
    (``terminate called without an active exception``, 1 run in 5 with PowerSGD); and worker 0
    hosts the store. So every worker destroys its group, waits until all have, and worker 0,
    whose process holds the store, leaves last."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    _STORE.add("destroyed", 1)
    _wait_count("destroyed", world)
    _STORE.add("leaving", 1)
    if rank == 0:
        _wait_count("leaving", world)


def register_hook(ddp: Any, hook: str | None) -> None:
    """PyTorch's own hook for ``hook`` on ``ddp``: ``fp16_compress_hook`` or PowerSGD (:data:`POWERSGD`)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, **POWERSGD)  # type: ignore[arg-type]
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif hook is not None:
        raise ValueError(f"unknown hook {hook!r}; one of {HOOKS}")


def _record(rank: int, it: int, kind: str, t0: float, ready: float, end: float, retx: int, messages: int) -> dict:
    return {"iteration": it, "rank": rank, "kind": kind, "iteration_time": end - t0, "t_start": t0, "t_end": end,
            "sync_time": end - ready, "comm_span": end - ready, "compute_time": ready - t0,
            "breakdown": {"compute": ready - t0, "first_byte": 0.0, "transmission": end - ready, "recovery": 0.0},
            "lost_fraction": 0.0, "retransmissions": retx, "messages": messages}


def run_training(spec: dict, rank: int, out: Path) -> None:
    """Stock DDP over the spec's backend on a training workload (see the module docstring)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    train = Training.setup(spec, rank)
    join(spec, rank)
    figures = _ExchangeFigures(spec)
    ddp = DistributedDataParallel(train.model)
    register_hook(ddp, spec.get("hook"))
    opt, schedule = train.optimizer(ddp.parameters())
    ready = [0.0]

    def stamp(_p: torch.Tensor) -> None:
        ready[0] = time.monotonic()

    for p in ddp.parameters():
        p.register_post_accumulate_grad_hook(stamp)
    with open(out, "w") as f:
        for it, x, y in train.batches():
            t0 = time.monotonic()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()  # DDP waits for its all-reduces here
            opt.step()
            if schedule is not None:
                schedule.step()
            end = time.monotonic()
            record = _record(rank, it, "warmup" if it == 0 else "measured", t0, min(ready[0], end), end,
                             figures.resent(), 0)
            record.update(figures.dlcp_fields(t0, min(ready[0], end), end, spec["mtu"]))
            f.write(json.dumps(record) + "\n")
            train.evaluate(f, it)
        f.write(figures.endpoint_record(rank))
    leave()


def _all_reduce(hook: str | None) -> Callable[[np.ndarray], Callable[[], None]]:
    """Start averaging one bucket in place over the group; returns the wait for it."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()

    def start(flat: np.ndarray) -> Callable[[], None]:
        t = torch.from_numpy(flat)
        wire = t.to(torch.float16) if hook == "fp16" else t
        work = dist.all_reduce(wire, async_op=True)

        def wait() -> None:
            work.wait()
            if wire is not t:
                t.copy_(wire)
            t.div_(world)
        return wait
    return start


def run_worker(spec: dict, rank: int, out: Path) -> None:
    """Synthetic gradients of a model profile over gloo: the buckets and backward pass of DLCP's
    agent (:func:`dlcp.topologies.agent.run_worker`), each bucket all-reduced as it fills."""
    import torch

    from dlcp.hostagent.fusion import Bucketer

    if spec.get("hook") not in (None, "fp16"):
        raise ValueError(f"hook {spec.get('hook')!r} needs a training workload")
    if (spec.get("backend") or "gloo") != "gloo":
        raise ValueError(f"backend {spec['backend']!r} needs a training workload (its gradients travel in "
                         "DDP's backward pass)")
    torch.set_num_threads(1)
    join(spec, rank)
    sizes, _, buckets = worker_plan(spec)
    packer = Bucketer(buckets)
    rng = np.random.default_rng(rank)
    grads = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    per_tensor = [spec["compute_ms"] / 1e3 * n / sum(sizes) for n in sizes]
    start = _all_reduce(spec.get("hook"))
    first_calib = spec["iterations"] + 1
    with open(out, "w") as f:
        for it in range(spec["iterations"] + spec.get("calibration_iterations", 3) + 1):
            calib = it >= first_calib
            retx0 = tcp_retransmissions()
            packer.reset()
            t0 = due = time.monotonic()
            waits, ready_at = [], []
            for t in reversed(range(len(sizes))):  # backward: the output layer's gradient exists first
                if not calib and per_tensor[t] > 0:
                    due += per_tensor[t]
                    time.sleep(max(0.0, due - time.monotonic()))
                ready_at.append(time.monotonic())
                waits += [start(flat) for _, flat in packer.add(t, grads[t])]
            for wait in waits:
                wait()
            end = time.monotonic()
            kind = "calibration" if calib else ("warmup" if it == 0 else "measured")
            rec = _record(rank, it, kind, t0, ready_at[-1], end, tcp_retransmissions() - retx0, len(buckets))
            rec["comm_span"] = end - ready_at[0]
            if calib:
                rec["compute_time"] = 0.0
            f.write(json.dumps(rec) + "\n")
            f.flush()
    leave()


def main(spec: dict, rank: int, out: Path) -> None:
    """Run worker ``rank`` of a stock-DDP scheme (the runner starts no server for one)."""
    if spec["model"] in TRAINING_WORKLOADS:
        run_training(spec, rank, out)
    else:
        run_worker(spec, rank, out)
