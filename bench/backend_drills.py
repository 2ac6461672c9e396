"""Failure drills for the ``dlcp`` backend, repeated: what a survivor sees when a rank dies or
stops mid-DDP, whether barriers ever hang, whether bad calls raise at the call.

Each drill spawns ``--world`` processes running stock DDP through ``init_process_group("dlcp",
timeout=--timeout)``; at step 3 one rank (not rank 0) sends itself SIGKILL or SIGSTOP, saying
when (the processes share the machine's monotonic clock). A drill passes when every survivor
raised (``DistBackendError`` or ``RuntimeError``) within the group's timeout + 5 s of the
signal, destroyed its group and exited 0 (no crash); its time is the slowest survivor's, from
the signal. ``barriers``: ``--barriers``
back-to-back ``dist.barrier()`` calls (every other one ``async_op``) finish; ``bad calls``:
a SUM of uint16, a broadcast from rank 5, a mismatched all_gather list and size each raise at
the call; ``mismatch``: every rank all_reduces a tensor of its own size (rank r: 1000 + r
elements), which no rank can see at the call: every rank must raise within 5 s (gloo fails at
once), not at the timeout.

Targets (issue 45): 20 of 20 for each drill with 4 processes.

Run: python bench/backend_drills.py [--repeat 20] [--world 4] [--timeout 20]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dlcp.hostagent.loopback import free_tcp_ports  # noqa: E402  (after the path above)


def _entry(drill: str, rank: int, world: int, port: int, timeout_s: float, barriers: int, q: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("dlcp", timeout=datetime.timedelta(seconds=timeout_s))
    t0 = time.monotonic()
    outcome = "finished"
    try:
        if drill in ("kill", "stop"):
            model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
            ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.5)
            for step in range(200):
                if step == 3 and rank == world - 1:
                    q.put((rank, "signalled", time.monotonic()))
                    q.close()
                    q.join_thread()  # (written before the signal: the queue's feeder thread would die with it)
                    os.kill(os.getpid(), signal.SIGKILL if drill == "kill" else signal.SIGSTOP)
                ddp(torch.randn(16, 256)).sum().backward()
        elif drill == "barriers":
            for i in range(barriers):
                if i % 2:
                    dist.barrier(async_op=True).wait()
                else:
                    dist.barrier()
        elif drill == "bad calls":
            refused = 0
            for call in (lambda: dist.all_reduce(torch.ones(4, dtype=torch.uint16)),
                         lambda: dist.broadcast(torch.ones(4), src=5),
                         lambda: dist.all_gather([torch.zeros(3)], torch.zeros(3)),
                         lambda: dist.all_gather([torch.zeros(3)] * (world - 1) + [torch.zeros(4)], torch.zeros(3))):
                try:
                    call()
                except (ValueError, RuntimeError):
                    refused += 1
            outcome = "finished" if refused == 4 else f"accepted {4 - refused} bad calls"
        elif drill == "mismatch":
            dist.all_reduce(torch.ones(1000 + rank))
    except Exception as exc:  # noqa: BLE001 - what the survivor saw is the result
        outcome = type(exc).__name__
    q.put((rank, outcome, time.monotonic() - t0, time.monotonic()))
    dist.destroy_process_group()


def drill_once(drill: str, world: int, timeout_s: float, barriers: int) -> tuple[bool, float, str]:
    """(passed, the slowest survivor's seconds, what went wrong)."""
    (port,) = free_tcp_ports(1)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(drill, r, world, port, timeout_s, barriers, q)) for r in range(world)]
    for p in procs:
        p.start()
    victim = world - 1 if drill in ("kill", "stop") else None
    survivors = [r for r in range(world) if r != victim]
    got: dict[int, tuple[str, float]] = {}
    raised_at: dict[int, float] = {}
    signalled: float | None = None
    why = ""
    try:
        while len(got) < len(survivors) or (victim is not None and signalled is None):
            item = q.get(timeout=timeout_s + 60)
            if item[1] == "signalled":
                signalled = item[2]
                continue
            rank, outcome, after, at = item
            got[rank], raised_at[rank] = (outcome, after), at
        if signalled is not None:  # a survivor's time is from the signal
            got = {r: (o, raised_at[r] - signalled) for r, (o, _) in got.items()}
        for r in survivors:
            procs[r].join(30)
    except Exception:  # queue.Empty: a survivor never answered
        silent = sorted(set(survivors) - set(got))
        why = (f"ranks {silent} gave no answer within {timeout_s + 60:g} s (a hang)" if silent else
               f"rank {victim} never reached its signal (it failed before step 3)")
    finally:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.join(10)
    if not why:
        raises = victim is not None or drill == "mismatch"
        want = ("DistBackendError", "RuntimeError") if raises else ("finished",)
        bad = {r: o for r, (o, _) in got.items() if o not in want}
        limit = 5.0 if drill == "mismatch" else timeout_s + 5
        late = {r: round(a, 1) for r, (_, a) in got.items() if a > limit}
        crashed = {r: procs[r].exitcode for r in survivors if procs[r].exitcode != 0}
        why = "; ".join(f"{k}: {v}" for k, v in (("outcomes", bad), ("late", late), ("exit codes", crashed)) if v)
    slowest = max((a for _, a in got.values()), default=float("nan"))
    return not why, slowest, why


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=20.0, help="the process group's timeout, s (default 20)")
    # (issue 45 asks for 1,000; message ids repeat after 1,024 calls, which 1,000 stopped short
    # of while the 1,026th barrier hung: the drill runs past the wrap)
    ap.add_argument("--barriers", type=int, default=2000)
    ap.add_argument("--drills", nargs="+", default=["kill", "stop", "barriers", "bad calls", "mismatch"])
    args = ap.parse_args()
    print(f"backend drills: {args.world} processes, timeout {args.timeout:g} s, {args.repeat} each", flush=True)
    for drill in args.drills:
        results = []
        for i in range(args.repeat):
            ok, slowest, why = drill_once(drill, args.world, args.timeout, args.barriers)
            results.append((ok, slowest))
            print(f"   {drill:<9} {i + 1:>2}/{args.repeat} {'ok  ' if ok else 'FAIL'} slowest survivor "
                  f"{slowest:6.1f} s {why}", flush=True)
        times = [s for _, s in results]
        print(f"{drill:<9} {sum(ok for ok, _ in results)}/{args.repeat} passed; slowest survivor median "
              f"{statistics.median(times):.1f} s, max {max(times):.1f} s", flush=True)


if __name__ == "__main__":
    main()
