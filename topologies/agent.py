"""The host agent of a testbed run: one worker (or the parameter server) in a Mininet host.

Started by the runner inside a host's namespace as ``python -m dlcp.topologies.agent SPEC RANK``.
A worker exchanges synthetic gradients with the per-tensor sizes of a real model
(:mod:`dlcp.hostagent.model_profiles`), overlapping them with a simulated backward pass: tensors
become ready from the output layer back to the input, ``compute_ms`` in total, and are packed
into buckets as they do (:mod:`dlcp.hostagent.fusion`, DDP's caps scaled like the model, or one
message per tensor without fusion); each full bucket is handed to DLCP at once, every packet
tagged with the priority of the layer it carries.
Iteration 0 warms up (connections, rates); after the measured iterations come
``calibration_iterations`` (default 3) that run the communication alone, without compute, for
the ordering-efficiency metric. It writes one JSON line of results per iteration to its output
file, with monotonic start and end stamps (one clock for every process on the machine, so the
runner can line iterations up with its CPU and counter samples). The server serves until SIGTERM.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dlcp_torch.state import DLCPState, start_server
from dlcp.hostagent.exchange import iteration_of
from dlcp.hostagent.fusion import Bucketer, FusionConfig
from dlcp.hostagent.policy import Policy
from dlcp.hostagent.ratecontrol import RateConfig
from dlcp.hostagent.transport import Endpoint, LossInjection, Peer, TransportConfig
from dlcp.topologies.breakdown import iteration_breakdown
from dlcp.topologies.endpoint_logs import changed_at, finished_at, message_trace, rate_trace, recent
from dlcp.topologies.training import Training
from dlcp.topologies.workload import TRAINING_WORKLOADS, worker_plan


def _endpoint(spec: dict, rank: int) -> Endpoint:
    ports = spec.get("ports") or [(spec["data_port"], spec["control_port"])] * len(spec["peer_ips"])
    peers = tuple(Peer(r, ip, d, c) for r, (ip, (d, c)) in enumerate(zip(spec["peer_ips"], ports)))
    cfg = TransportConfig(rank=rank, peers=peers, job_id=1, policy=Policy.from_dict(spec["policy"]), mtu=spec["mtu"],
                          rate=RateConfig(**spec["rate"]), loss=LossInjection(), message_deadline=spec["deadline"],
                          connect_timeout=30.0, offload=spec.get("offload", False), secret=spec.get("secret"),
                          source_port_base=spec.get("source_port_base"),
                          **spec.get("timers", {}))
    return Endpoint(cfg).start()


def _received_in(ep: Endpoint, iteration: int | None, since: float) -> list:
    """The messages this endpoint received for ``iteration`` (None: any) that started after ``since``."""
    return [m for m in recent(ep.message_log, since, finished_at) if m.direction == "recv" and m.started >= since
            and (iteration is None or iteration_of(m.message_id) == iteration % 1024)]


def _traces(ep: Endpoint, iteration: int, t0: float, end: float, mtu: int) -> dict[str, list]:
    """An iteration's message and rate traces (:func:`message_trace`, :func:`rate_trace`),
    read from the tails of the endpoint's logs."""
    return {"message_trace": message_trace(recent(ep.message_log, t0, finished_at), iteration, t0),
            "rate_trace": rate_trace(recent(ep.rate_log, t0, changed_at), mtu, t0, end)}


@dataclass(frozen=True)
class _Tally:
    """The endpoint's totals whose change an iteration's record reports.

    Why one snapshot per iteration: each read of ``Endpoint.stats`` copies the data path's
    counters under its receive lock and builds the whole record; the loops read it five times
    an iteration before, CPU that gloo's workers do not spend on a machine whose validity rules
    count it. One read at each iteration's end serves as the next one's start, so the records'
    changes add up to the run's totals (what came between two iterations, an evaluation's time,
    counts in the next one)."""
    retransmitted: int
    ctl_frames: int
    ctl_bytes: int

    @classmethod
    def of(cls, ep: Endpoint) -> _Tally:
        s = ep.stats
        return cls(s.retransmitted_pkts, s.ctl_frames_sent + s.ctl_frames_received,
                   s.ctl_bytes_sent + s.ctl_bytes_received)

    def since(self, before: _Tally) -> dict[str, int]:
        """The record's fields: what changed from ``before`` to this snapshot."""
        return {"retransmissions": self.retransmitted - before.retransmitted,
                "control_frames": self.ctl_frames - before.ctl_frames,
                "control_bytes": self.ctl_bytes - before.ctl_bytes}


def run_worker(spec: dict, rank: int, out: Path) -> None:
    ep = _endpoint(spec, rank)
    workers = list(range(spec["workers"]))
    server = spec["workers"] if spec["pattern"] == "ps" else None
    ep.connect([server] if server is not None else [(rank + 1) % len(workers)])
    state = DLCPState(ep, spec["pattern"], workers=workers, server_rank=server, policy=ep.policy, max_inflight=64,
                      wire_dtype=spec.get("wire_dtype", "float32"))
    sizes, _, buckets = worker_plan(spec, ep.policy)
    packer = Bucketer(buckets)
    rng = np.random.default_rng(rank)
    grads = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    compute = spec["compute_ms"] / 1e3
    per_tensor = [compute * n / sum(sizes) for n in sizes]
    with open(out, "w") as f:
        first_calib = spec["iterations"] + 1
        last = spec["iterations"] + spec.get("calibration_iterations", 3)
        before = _Tally.of(ep)
        for it in range(last + 1):
            calib = it >= first_calib
            packer.reset()
            t0 = time.monotonic()
            state.announce(it, [b.index for b in buckets], [b.layout for b in buckets])  # one frame for all
            futures, ready_at = [], []
            due = t0
            for t in reversed(range(len(sizes))):  # backward: the output layer's gradient exists first
                if not calib and per_tensor[t] > 0:
                    # sleep to an absolute time: relative sleeps added each wake-up's lateness,
                    # 161 times per ResNet-50 pass (passes of 560-720 ms for 500, skewed by
                    # 60-80 ms between workers on a busy machine)
                    due += per_tensor[t]
                    time.sleep(max(0.0, due - time.monotonic()))
                ready_at.append(time.monotonic())
                for bucket, flat in packer.add(t, grads[t]):
                    futures.append(state.exchange_async(bucket.index, flat, bucket.layout.top_priority, iteration=it,
                                                        layout=bucket.layout, announced=True))
            first_send = ready_at[0]
            for fut in futures:
                fut.result(timeout=spec["deadline"] + 5)
            end = time.monotonic()
            after = _Tally.of(ep)
            lost = state.stats.lost_fractions[-len(buckets):]
            parts = iteration_breakdown(t0, ready_at[-1], end, _received_in(ep, it, t0))
            f.write(json.dumps({"iteration": it, "rank": rank, "breakdown": parts,
                                "kind": "calibration" if calib else
                                ("warmup" if it == 0 else "measured"), "iteration_time": end - t0,
                                "t_start": t0, "t_end": end,
                                "sync_time": end - ready_at[-1], "comm_span": end - first_send,
                                "compute_time": ready_at[-1] - t0 if not calib else 0.0,
                                "lost_fraction": float(np.mean(lost)) if lost else 0.0,
                                "messages": len(buckets), **after.since(before),
                                **(_traces(ep, it, t0, end, spec["mtu"]) if not calib
                                   else {"message_trace": [], "rate_trace": []})}) + "\n")
            f.flush()
            before = after
        f.write(json.dumps({"rank": rank, "kind": "endpoint", "stats": ep.endpoint_stats()}, default=str) + "\n")
    state.close()
    time.sleep(0.5)
    ep.close()


def run_training(spec: dict, rank: int, out: Path) -> None:
    """Real PyTorch training through dlcp_torch: the model, data and optimiser of the workload
    named ``spec["model"]`` (:mod:`dlcp_torch.workloads`: digits or mnist1d)."""
    import torch

    import dlcp_torch

    train = Training.setup(spec, rank)
    model = train.model
    ports = spec.get("ports") or [(spec["data_port"], spec["control_port"])] * len(spec["peer_ips"])
    peers = [f"{ip}:{d}:{c}" for ip, (d, c) in zip(spec["peer_ips"], ports)]
    session = dlcp_torch.init(spec["pattern"], rank=rank, world_size=spec["workers"], peers=peers, model=model,
                              policy=Policy.from_dict(spec["policy"]), colocated_server=False, mtu=spec["mtu"],
                              message_deadline=spec["deadline"], rate=RateConfig(**spec["rate"]),
                              offload=spec.get("offload", False), secret=spec.get("secret"),
                              timers=spec.get("timers", {}),
                              wire_dtype=spec.get("wire_dtype", "float32"))
    inner, schedule = train.optimizer(model.parameters())
    opt = dlcp_torch.DistributedOptimizer(inner, model, session.state,
                                          fusion=FusionConfig(enabled=spec.get("fusion", True)))

    with open(out, "w") as f:
        before = _Tally.of(session.endpoint)
        for it, x, y in train.batches():
            n_lost = len(session.state.stats.lost_fractions)
            t0 = time.monotonic()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            t1 = time.monotonic()
            opt.step()
            if schedule is not None:
                schedule.step()
            end = time.monotonic()
            after = _Tally.of(session.endpoint)
            lost = session.state.stats.lost_fractions[n_lost:]
            parts = iteration_breakdown(t0, t1, end, _received_in(session.endpoint, None, t0))
            f.write(json.dumps({"iteration": it, "rank": rank, "breakdown": parts,
                                "kind": "warmup" if it == 0 else "measured",
                                "iteration_time": end - t0, "t_start": t0, "t_end": end,
                                "sync_time": end - t1, "comm_span": end - t1,
                                "compute_time": t1 - t0, "lost_fraction": float(np.mean(lost)) if lost else 0.0,
                                "messages": max(1, len(opt.buckets)), **after.since(before),
                                **_traces(session.endpoint, it, t0, end, spec["mtu"])})
                    + "\n")
            train.evaluate(f, it)
            before = after
        f.write(json.dumps({"rank": rank, "kind": "endpoint", "stats": session.endpoint.endpoint_stats()},
                           default=str) + "\n")
    time.sleep(0.5)
    session.close()


def run_server(spec: dict, rank: int, out: Path | None = None) -> None:
    """Serve until SIGTERM; then write the server's endpoint totals and its whole rate log
    (monotonic times, as the workers' ``t_start``) to ``out``, if given."""
    ep = _endpoint(spec, rank)
    t0 = time.monotonic()
    thread, stop = start_server(ep, list(range(spec["workers"])), ep.policy)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.is_set():
        stop.wait(0.2)
    if out is not None:  # before the join: the runner kills the server 3 s after SIGTERM
        out.write_text(json.dumps({"rank": rank, "kind": "endpoint", "stats": ep.endpoint_stats(), "t0": t0,
                                   "rate_trace": rate_trace(list(ep.rate_log), spec["mtu"], t0)}, default=str) + "\n")
    thread.join(5)
    ep.close()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    if spec.get("transport") == "torch":  # stock DDP, as users run it (dlcp.topologies.ddp_agent)
        from dlcp.topologies import ddp_agent

        ddp_agent.main(spec, rank, Path(sys.argv[3]))
    elif rank == spec["workers"] and spec["pattern"] == "ps":
        run_server(spec, rank, Path(sys.argv[3]) if len(sys.argv) > 3 else None)
    elif spec["model"] in TRAINING_WORKLOADS:
        run_training(spec, rank, Path(sys.argv[3]))
    else:
        run_worker(spec, rank, Path(sys.argv[3]))


if __name__ == "__main__":
    threading.current_thread().name = "agent"
    main()
