"""The ``torch.distributed`` backend as users run it: ``init_process_group("dlcp")`` against
``init_process_group("gloo")``, same script, same run, on loopback.

Every participant is a spawned process that runs the same script with only the backend's name
changed, the backend's defaults in force (``DLCP_*`` variables unset: the loss bound, MTU and
line rate a user gets; rank 0's start-up line says them), ``torch.set_num_threads(1)`` (this
machine has 2 cores for up to 4 processes):

* ``all_reduce``: one tensor of 57 MB (14.25 M float32, or as many bfloat16), ``dist.all_reduce``
  after a ``dist.barrier`` (untimed); the slowest rank's time per call.
* ``DDP step``: stock ``DistributedDataParallel`` (no hook) over a 4-layer MLP, batch 32: forward,
  backward (DDP's bucketed all_reduce overlapping it), SGD step; the slowest rank's time.
  ``12M``: 1024-2048-2048-2048-1024 (12.6 M parameters); ``1M``: 512 x 4 (1.05 M).
* ``all_reduce x5`` (only when ``--cases`` names it): the same 57 MB all_reduce five times back to
  back, timed together. Why: a barrier before each call lines the ranks up, so a call's set-up
  and its ring's tail are its own; in a loop of collectives (DDP's buckets, an optimizer's) each
  rank starts the next call while the slowest ends the last, as here.

Schemes run interleaved (gloo, dlcp, gloo, dlcp, ...) for ``--rounds`` rounds; a figure is the
median over rounds of each round's median; ``x gloo`` the median of the per-round ratios, with
their range. ``load`` is the 1-minute load average before a row, ``idle`` the machine's idle CPU
while it ran, ``c2c`` the one-way core-to-core latency just before it (the vCPUs' placement, see
``bench/transport.py``; medians over rounds).

Targets (issue 45): 4 and 2 processes, DDP step of the 12M MLP <= 1.1x gloo, all_reduce of 57 MB
float32 <= 1.0x gloo.

Second, named settings run interleaved on the float32 rows (``SETTINGS``): ``untagged``, the
backend with ``DLCP_AUTHENTICATE=0`` (every packet's tag neither made nor checked: what the tag
costs); ``encrypted``, with ``DLCP_ENCRYPT=1`` (payloads encrypted too, issue 44's option for
shared networks); and ``mtu 9000``, with ``DLCP_MTU=9000`` (a jumbo frame, a real network's
largest, where the default on loopback is 65,535: what the per-packet work costs).

Targets (issue 44, the lossless ring of 57 MB with 4 processes, which a 57 MB all_reduce outside
a backward pass is): with the tag <= 0.8x gloo, encrypted <= 1.0x gloo.

``--paired``: the same rows with every scheme in the same processes: the default group is
``init_process_group("dlcp")``, gloo's ``dist.new_group(backend="gloo")``, each named setting a
``dlcp`` group made with its environment, and each turn times one call of every scheme (the
first of a turn rotating), a gloo barrier before each. Why: this machine's two vCPUs change
speed for tens of seconds at a time (gloo's 57 MB all_reduce takes ~76 or ~110 ms, DLCP's about
the same in both; the ``c2c`` reading does not tell which), so runs in turn, 20 s apart, can
meet different machines; calls 0.1 s apart meet the same one. ``x gloo``
is then the median of every turn's ratio, with the quartiles. (Every process then also holds
the other groups' idle threads, 2-8 % of a DDP step.) Fair for the 57 MB all_reduce only (each
backend's time alone and paired within 1-4 %): gloo's DDP step is ~12 % faster paired than alone
(DLCP's the same; cause not established), and a small DLCP collective is 1.3-2x slower paired
(its threads asleep after gloo's call), so for those rows the unpaired figures are the fair
ones (docs/results/backend.md). With ``--small``, the small collectives' rows.

``--small``: instead, the latency of small collectives: ``all_reduce`` of float32 tensors of
1 KB to 1 MB (a ``dist.barrier`` before each, untimed) and ``dist.barrier`` itself, 200 calls
per run: where a collective's time is its round trips, not its bytes (the backend gathers sums
of up to ``DIRECT_SUM_BYTES`` in one round instead of the ring's steps).

``--idle``: instead, what holding groups costs while nothing is communicated (a forward pass, the
data loader): the CPU per second of a process holding 1 and 4 groups of each backend, idle.

Run: python bench/backend.py [--rounds 3] [--steps 20] [--world 4 2] [--cases WHAT:DTYPE ...] [--quick]
[--paired] [--small] [--idle] [--out FILE]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dlcp.hostagent.loopback import free_tcp_ports  # noqa: E402  (after the path above)
from dlcp.hostagent.tables import Column, Record, Table  # noqa: E402
from bench.transport import LOAD_COLUMNS, Load, load_cells  # noqa: E402

WARMUP = 3
ALLREDUCE_BYTES = 57_000_000
SMALL_BYTES = [1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]
MODELS = {"12M": [1024, 2048, 2048, 2048, 1024], "1M": [512, 512, 512, 512, 512]}
BATCH = 32
#: The rows (what, dtype) of a run without ``--small``, in order.
CASES = [("all_reduce", "float32"), ("all_reduce", "bfloat16"), ("12M", "float32"), ("12M", "bfloat16"),
         ("1M", "float32")]
#: Rows run only when ``--cases`` names them: ``all_reduce x5``, the 57 MB all_reduce five times
#: back to back per timed step (no barrier between them).
EXTRA_CASES = [("all_reduce x5", "float32")]
BACK_TO_BACK = 5
#: Second settings, each a named row beside the defaults on the float32 cases: its environment.
SETTINGS = {"untagged": {"DLCP_AUTHENTICATE": "0"}, "encrypted": {"DLCP_ENCRYPT": "1"},
            "mtu 9000": {"DLCP_MTU": "9000"}}


def _step(case: str, dtype_name: str, rank: int, group: Any = None) -> Callable[[], None]:
    """One timed call of ``case`` on ``group`` (None: the default group): an ``all_reduce`` of
    its tensor, or a DDP step of its model. Built once per group, before the first call."""
    import torch
    import torch.distributed as dist

    dtype = getattr(torch, dtype_name)
    if case == "barrier":
        return lambda: dist.barrier(group=group)
    if case == "all_reduce x5":  # back to back: each rank starts the next call when its last ends
        y = torch.randn(ALLREDUCE_BYTES // 4).to(dtype)

        def calls() -> None:
            for _ in range(BACK_TO_BACK):
                dist.all_reduce(y, group=group)
        return calls
    if case.startswith("all_reduce"):  # "all_reduce" (57 MB) or "all_reduce:<bytes>"
        x = torch.randn(int(case.partition(":")[2] or ALLREDUCE_BYTES) // 4).to(dtype)
        return lambda: dist.all_reduce(x, group=group)
    widths = MODELS[case]
    torch.manual_seed(0)
    layers: list[Any] = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1]).to(dtype)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, widths[0], generator=g).to(dtype)

    def step() -> None:
        opt.zero_grad()
        ddp(x).float().pow(2).mean().backward()
        opt.step()
    return step


def _user_env(port: int, rank: int, world: int) -> None:
    """The environment a user's spawned rank has: the rendezvous, no ``DLCP_*`` (the defaults)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    for var in [v for v in os.environ if v.startswith("DLCP_")]:
        del os.environ[var]


def _worker(rank: int, world: int, port: int, backend: str, case: str, dtype_name: str, iters: int, q: Any) -> None:
    _user_env(port, rank, world)
    if backend in SETTINGS:
        os.environ.update(SETTINGS[backend])
        backend = "dlcp"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(backend)
    step = _step(case, dtype_name, rank)
    times = []
    cpu = 0.0  # this process's CPU seconds (every thread) over the timed calls, barriers included
    for i in range(iters + WARMUP):
        if i == WARMUP:
            cpu = -time.process_time()
        if case != "barrier":
            dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    cpu += time.process_time()
    q.put((rank, times[WARMUP:], cpu / iters))
    dist.destroy_process_group()


def _paired_worker(rank: int, world: int, port: int, schemes: list[str], case: str, dtype_name: str, iters: int,
                   q: Any) -> None:
    """``--paired``: one process per rank holds a group of every scheme (the default group is
    ``init_process_group("dlcp")``, gloo's is ``dist.new_group(backend="gloo")``, a named setting's
    a ``dlcp`` group made with its environment) and times one call of each in turn, the first of
    each turn rotating; a gloo barrier (untimed) before every call."""
    _user_env(port, rank, world)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("dlcp")
    fence = dist.new_group(backend="gloo")
    groups: dict[str, Any] = {}
    for name in schemes:
        if name == "dlcp":
            groups[name] = None
        elif name == "gloo":
            groups[name] = fence
        else:
            os.environ.update(SETTINGS[name])
            groups[name] = dist.new_group(backend="dlcp")
            for var in SETTINGS[name]:
                del os.environ[var]
    steps = {name: _step(case, dtype_name, rank, groups[name]) for name in schemes}
    times: dict[str, list[float]] = {name: [] for name in schemes}
    cpu = dict.fromkeys(schemes, 0.0)  # this process's CPU seconds (every thread) in each scheme's calls
    for i in range(iters + WARMUP):
        for k in range(len(schemes)):
            name = schemes[(i + k) % len(schemes)]
            dist.barrier(group=fence)
            c0, t0 = time.process_time(), time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
            if i >= WARMUP:
                cpu[name] += time.process_time() - c0
    q.put((rank, {n: t[WARMUP:] for n, t in times.items()}, {n: c / iters for n, c in cpu.items()}))
    dist.barrier(group=fence)
    dist.destroy_process_group()


def _spawn(target: Callable[..., None], world: int, *args: Any) -> list[tuple]:
    """Run ``target(rank, world, port, *args, queue)`` in ``world`` spawned processes; what each put
    on the queue, by rank."""
    (port,) = free_tcp_ports(1)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return sorted(q.get(timeout=900) for _ in range(world))
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def run(backend: str, case: str, dtype: str, world: int, iters: int) -> dict:
    """One row's run: the slowest rank's median ms per call or step, and the CPU ms all ranks
    spent per call (every thread of every process: on this machine's 2 cores a call cannot take
    less than half of it)."""
    rows = _spawn(_worker, world, backend, case, dtype, iters)
    per = [max(times[i] for _, times, _ in rows) for i in range(iters)]
    return {"ms": statistics.median(per) * 1e3, "cpu_ms": sum(cpu for _, _, cpu in rows) * 1e3}


def run_paired(schemes: list[str], case: str, dtype: str, world: int, iters: int) -> dict[str, dict]:
    """One run of ``--paired``: per scheme, the slowest rank's ms of each turn (a list), their
    median, and the CPU ms all ranks spent per call."""
    rows = _spawn(_paired_worker, world, schemes, case, dtype, iters)
    out = {}
    for name in schemes:
        per = [max(times[name][i] for _, times, _ in rows) * 1e3 for i in range(iters)]
        out[name] = {"per_call": per, "ms": statistics.median(per), "cpu_ms": sum(c[name] for _, _, c in rows) * 1e3}
    return out


def _quartiles(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"{q[0]:.2f}-{q[2]:.2f}"


def _cases(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """The rows (what, dtype, processes) a run measures."""
    if args.small:
        return [(c, "float32", w) for w in args.world for c in [*(f"all_reduce:{b}" for b in SMALL_BYTES), "barrier"]]
    return [(c, d, w) for w in args.world for c, d in CASES + EXTRA_CASES
            if (args.cases is None and (c, d) in CASES) or (args.cases is not None and f"{c}:{d}" in args.cases)]


def paired_table(args: argparse.Namespace) -> Table:
    title = (f"backend, paired: init_process_group(\"dlcp\") and a gloo group in the same processes, one call "
             f"of each in turn, defaults, loopback, {args.rounds} rounds of {args.steps} turns")
    print(title, flush=True)
    cases = _cases(args)
    settings = [] if args.small else list(SETTINGS)
    res: dict[tuple, list[dict[str, dict]]] = {k: [] for k in cases}
    for r in range(args.rounds):
        for case in cases:
            schemes = ["gloo", "dlcp", *(settings if case[1] == "float32" else ())]
            with Load() as load:
                out = run_paired(schemes, *case[:2], case[2], args.steps)
            for x in out.values():
                x["load"], x["idle"], x["c2c"] = load.load, load.idle, load.c2c
            res[case].append(out)
            print(f"   round {r + 1}/{args.rounds} {case[0]:>10} {case[1]:<8} x{case[2]} "
                  + "  ".join(f"{n} {x['ms']:.3g} ms (cpu {x['cpu_ms']:.3g})" for n, x in out.items())
                  + f"  {load}", flush=True)
    ms = "{:.3f}" if args.small else "{:.1f}"
    t = Table(title, [Column("what"), Column("dtype"), Column("procs"), Column("gloo ms", ms),
                      Column("dlcp ms", ms), Column("x gloo", "{:.2f}"), Column("quartiles"),
                      Column("rounds"), Column("gloo cpu ms", "{:.0f}"), Column("dlcp cpu ms", "{:.0f}"),
                      *(c for n in settings for c in (Column(f"{n} ms"), Column(f"{n} x gloo"))), *LOAD_COLUMNS],
              notes=["all_reduce: one 57 MB tensor (or of the size named); 12M / 1M: a stock DDP step of a "
                     "4-layer MLP, batch 32; barrier: dist.barrier(); all_reduce x5: the 57 MB one five times back to "
                     "back (ms for the five)",
                     "x gloo: median over every turn of every round of (dlcp's call / gloo's call of the same "
                     "turn), each the slowest rank's; quartiles: of those ratios; rounds: the range of the "
                     "rounds' median ratios",
                     "cpu ms: CPU time of every thread of every rank per call (medians over rounds), the other "
                     "groups' idle threads included; 2 cores give at most 2 CPU ms per ms",
                     *(["second settings, float32 rows only, each a dlcp group of its own in the same processes: "
                        "untagged, DLCP_AUTHENTICATE=0; encrypted, DLCP_ENCRYPT=1; mtu 9000, DLCP_MTU=9000"]
                       if settings else [])])
    def ratios(runs: list[dict[str, dict]], name: str) -> list[float]:
        return [x / g for run in runs for x, g in zip(run[name]["per_call"], run["gloo"]["per_call"])]

    def median_of(runs: list[dict[str, dict]], name: str, key: str) -> float:
        return statistics.median(run[name][key] for run in runs)

    for (case, dtype, world), runs in res.items():
        per_round = [statistics.median(x / g for x, g in zip(run["dlcp"]["per_call"], run["gloo"]["per_call"]))
                     for run in runs]
        seconds = []
        for n in settings:
            there = n in runs[0]
            seconds.append(f"{median_of(runs, n, 'ms'):.1f}" if there else "-")
            seconds.append(f"{statistics.median(ratios(runs, n)):.2f}" if there else "-")
        t.add(_label(case), dtype, world, median_of(runs, "gloo", "ms"), median_of(runs, "dlcp", "ms"),
              statistics.median(ratios(runs, "dlcp")), _quartiles(ratios(runs, "dlcp")),
              f"{min(per_round):.2f}-{max(per_round):.2f}", median_of(runs, "gloo", "cpu_ms"),
              median_of(runs, "dlcp", "cpu_ms"),
              *seconds, *load_cells([run["gloo"] for run in runs]))
    return t


def table(args: argparse.Namespace) -> Table:
    title = (f"backend: init_process_group(\"dlcp\") against \"gloo\", defaults, loopback, {args.rounds} "
             f"interleaved rounds, {args.steps} timed calls per run")
    print(title, flush=True)
    cases = _cases(args)
    settings = [] if args.small else list(SETTINGS)  # (float32 rows only: below)
    res: dict[tuple, dict[str, list[dict]]] = {k: {"gloo": [], "dlcp": [], **{n: [] for n in settings}} for k in cases}
    for r in range(args.rounds):
        for case in cases:
            for backend in ("gloo", "dlcp", *(settings if case[1] == "float32" else ())):
                with Load() as load:
                    out = run(backend, *case[:2], case[2], args.steps)
                out["load"], out["idle"], out["c2c"] = load.load, load.idle, load.c2c
                res[case][backend].append(out)
                print(f"   round {r + 1}/{args.rounds} {case[0]:>10} {case[1]:<8} x{case[2]} {backend:<8} "
                      f"{out['ms']:8.1f} ms  cpu {out['cpu_ms']:7.1f} ms  {load}", flush=True)
    t = Table(title, [Column("what"), Column("dtype"), Column("procs"), Column("gloo ms", "{:.1f}"),
                      Column("dlcp ms", "{:.1f}"), Column("x gloo", "{:.2f}"), Column("range"),
                      Column("gloo cpu ms", "{:.0f}"), Column("dlcp cpu ms", "{:.0f}"),
                      *(c for n in settings for c in (Column(f"{n} ms"), Column(f"{n} x gloo"))), *LOAD_COLUMNS],
              notes=["all_reduce: one 57 MB tensor (or of the size named); 12M / 1M: a stock DDP step of a "
                     "4-layer MLP, batch 32; barrier: dist.barrier(); all_reduce x5: the 57 MB one five times back to "
                     "back (ms for the five)",
                     "x gloo: median of the per-round ratios, range: their min-max over rounds",
                     "cpu ms: CPU time of every thread of every rank per call (medians over rounds); "
                     "2 cores give at most 2 CPU ms per ms",
                     *(["second settings, float32 rows only: untagged, DLCP_AUTHENTICATE=0 (no packet tag); "
                        "encrypted, DLCP_ENCRYPT=1; mtu 9000, DLCP_MTU=9000 (the default on loopback is 65535)"]
                       if settings else [])])
    for (case, dtype, world), by in res.items():
        ratios = [d["ms"] / g["ms"] for d, g in zip(by["dlcp"], by["gloo"])]
        gms = statistics.median(x["ms"] for x in by["gloo"])
        dms = statistics.median(x["ms"] for x in by["dlcp"])
        gcpu = statistics.median(x["cpu_ms"] for x in by["gloo"])
        dcpu = statistics.median(x["cpu_ms"] for x in by["dlcp"])
        seconds = []
        for n in settings:
            un = by[n]
            seconds.append(f"{statistics.median(x['ms'] for x in un):.1f}" if un else "-")
            seconds.append(f"{statistics.median(u['ms'] / g['ms'] for u, g in zip(un, by['gloo'])):.2f}" if un else "-")
        t.add(_label(case), dtype, world, gms, dms,
              statistics.median(ratios), f"{min(ratios):.2f}-{max(ratios):.2f}", gcpu, dcpu, *seconds,
              *load_cells(by["gloo"] + by["dlcp"] + [x for n in settings for x in by[n]]))
    return t


def _label(case: str) -> str:
    """A row's name: "all_reduce", "all_reduce 64 KB", "barrier", "DDP step 12M"."""
    if case.startswith("all_reduce:"):
        size = int(case.partition(":")[2])
        return f"all_reduce {size >> 20} MB" if size >= 1 << 20 else f"all_reduce {size >> 10} KB"
    return case if case in ("all_reduce", "all_reduce x5", "barrier") else f"DDP step {case}"


IDLE_SECONDS = 10.0


def _idle_worker(rank: int, world: int, port: int, backend: str, groups: int, q: Any) -> None:
    """``--idle``: a rank that holds ``groups`` groups of ``backend`` (the default one among them),
    has run one small collective on each, and then does nothing for IDLE_SECONDS: its CPU."""
    _user_env(port, rank, world)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(backend)
    more = [dist.new_group(backend=backend) for _ in range(groups - 1)]
    x = torch.ones(256)
    for g in [None, *more]:
        dist.all_reduce(x, group=g)
    dist.barrier()
    time.sleep(1.0)  # (the last call's reports and timers settle)
    c0 = time.process_time()
    time.sleep(IDLE_SECONDS)
    q.put((rank, (time.process_time() - c0) / IDLE_SECONDS))
    dist.barrier()
    dist.destroy_process_group()


def idle_table(args: argparse.Namespace) -> Table:
    """What a group costs while nothing is communicated (a forward pass, the data loader): the CPU
    a rank's process spends per second holding 1 and 4 groups, gloo's and DLCP's."""
    title = (f"backend, idle: CPU of a process holding process groups and doing nothing for {IDLE_SECONDS:g} s, "
             f"{args.world[0]} processes, {args.rounds} interleaved rounds")
    print(title, flush=True)
    world = args.world[0]
    res: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for groups in (1, 4):
            for backend in ("gloo", "dlcp"):
                rows = _spawn(_idle_worker, world, backend, groups)
                per = statistics.median(c for _, c in rows) * 1e3
                res.setdefault((backend, groups), []).append(per)
                print(f"   round {r + 1}/{args.rounds} {backend:<5} {groups} groups: {per:.2f} CPU ms/s per process",
                      flush=True)
    t = Table(title, [Column("groups"), Column("gloo cpu ms/s", "{:.2f}"), Column("dlcp cpu ms/s", "{:.2f}")],
              notes=["cpu ms/s: CPU time (every thread) of a rank's process per second of doing nothing, the "
                     "median rank's, medians over rounds; 1,000 would be a whole core"])
    for groups in (1, 4):
        t.add(groups, statistics.median(res[("gloo", groups)]), statistics.median(res[("dlcp", groups)]))
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed calls or DDP steps per run (default 20; 200 with --small)")
    ap.add_argument("--world", type=int, nargs="+", default=[4, 2], help="process counts (default 4 2)")
    ap.add_argument("--cases", nargs="+", default=None, metavar="WHAT:DTYPE",
                    choices=[f"{c}:{d}" for c, d in CASES + EXTRA_CASES],
                    help="only these rows (default: all but 'all_reduce x5'; e.g. all_reduce:float32 12M:float32)")
    ap.add_argument("--quick", action="store_true", help="1 round, 5 steps: a smoke run")
    ap.add_argument("--paired", action="store_true",
                    help="each scheme a group in the same processes, one call of each in turn (see above)")
    ap.add_argument("--small", action="store_true",
                    help="small collectives instead (all_reduce of 1 KB to 1 MB, barrier)")
    ap.add_argument("--idle", action="store_true",
                    help="instead, the CPU a process spends per second holding 1 and 4 groups and doing nothing "
                         "(the first --world only)")
    ap.add_argument("--out", type=Path, default=None, metavar="FILE",
                    help="also keep the table with the command and commit as JSON (dlcp report FILE prints it)")
    args = ap.parse_args()
    if args.steps is None:
        args.steps = 200 if args.small else 20
    if args.quick:
        args.rounds, args.steps = 1, 5
    record = Record.start("python bench/backend.py")
    print(record.header())
    done = [idle_table(args) if args.idle else paired_table(args) if args.paired else table(args)]
    print(done[0].text())
    record.keep(args.out, done)


if __name__ == "__main__":
    main()
