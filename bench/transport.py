"""Transport benchmark on loopback, DLCP against what users run (gloo), in the same run.

Prints, with the command, the commit and the machine's load beside every row:

  1. **one sender -> one receiver**: 100 MB messages between two processes at MTU 1500 with a
     25 Gb/s line-rate configuration: a bare UDP GSO sender into a GRO receiver in C++
     (``bench/bare_pair.cc``, compiled here with g++: this machine's limit for one sender), the
     same pair paced at the configured line rate (the configuration's limit), DLCP's compiled
     path and gloo's send/recv; goodput and the CPU both processes spent per 100 MB.
  2. **collectives**: 4 processes averaging 57 MB in 12 tensors (fused into DDP's buckets) per
     iteration: gloo's all_reduce (with DDP's division), DLCP's ring and parameter server, lossless
     and with p = 0.05 under 2 % injected loss, and the lossless ring with the trailer's tag off and
     encrypted (issue 44); sync time per iteration (the slowest process).
     DLCP's processes are configured as hosts on 25 Gb/s links (``LINE_RATE``), as in part 1.
  3. **DDP training steps**: 4 workers, stock DDP over gloo against DDP with ``dlcp_hook`` (ring
     and parameter server, the default policy): the digits MLP, and the MNIST-1D CNN when
     ``mnist1d`` is installed.
  4. the testbed's workload on loopback (4 workers + PS as ``dlcp.topologies.agent`` processes).
  5. **protection** (issue 44): one sender -> one receiver on the compiled path with the trailer's tag
     off, a MAC (the default) and encryption, interleaved; goodput, its ratio to "off", CPU.

Parts 1-3 and 5 run their schemes interleaved (A B C, A B C, ...) for ``--rounds`` rounds; a figure is
the median over rounds of each round's median, with the range over rounds. Ratios are taken
within a round, then their median. Every participant is its own (spawned) process on this
machine: with 2 cores, 4 processes share them, so parts 2-3 measure the hosts' software, CPU
included; ``load`` is the 1-minute load average before the row, ``idle`` the machine's idle
CPU while it ran and ``c2c`` the one-way core-to-core latency just before it (``bench/core_to_core.cc``:
where the host placed the virtual machine's two vCPUs, which it changes within seconds; tens of ns
when they share a cache, 100-300 when not; read before a run, it did not predict gloo's two speeds
on the AMD machine, docs/results/backend.md).

Targets (issue 26, which calls part 2's profile 25 MB): ring lossless <= 1.0x gloo; ring at
p = 0.05 with 2 % loss <= 1.0x gloo lossless; PS <= 1.5x gloo, at most 1 % of packets resent after
the first iteration; one sender >= 2 GB/s and >= 85 % of the bare pair (and, while the numpy data
path existed, at most half its CPU per 100 MB: met, 0.33x, docs/results/benchmarks.md); DDP step
through ``dlcp_hook`` <= 1.2x gloo (digits MLP). Issue 44: with the MAC, one sender >= 90 % of its
throughput with the tag off.

Run: python bench/transport.py [--part goodput|collective|ddp|testbed|protection] [--rounds 3] [--quick]
[--line-rate GBPS] [--goodput-mtu BYTES]
[--out FILE]
(--out keeps the tables as JSON; `dlcp report FILE` prints them as Markdown for a results page)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dlcp.hostagent.loopback import free_port_pairs  # noqa: E402  (after the path above)
from dlcp.hostagent.tables import Column, Record, Table  # noqa: E402

# 57 MB (14.25 M float32) in 12 tensors of uneven size (a scaled CNN-like profile, first layers
# small). Earlier versions of this file called it 25 MB; the sizes are the same.
TENSOR_ELEMS = [9_408, 36_864, 147_456, 294_912, 589_824, 1_179_648, 2_359_296, 2_359_296,
                4_718_592, 2_048_000, 131_072, 375_632]
GOODPUT_ELEMS = 25_000_000  # 100 MB per message
#: Every DLCP process here is configured as a host on a 25 Gb/s link (``RateConfig.for_link``).
#: Loopback has no link, and gloo paces nothing: at RateConfig's 10 Gb/s default the parameter
#: server's 228 MB of replies per iteration alone would take 182 ms of pacing, a network
#: bottleneck that is not there (parts 1 and 2; part 3 runs ``dlcp_torch.init``'s defaults).
LINE_RATE = 25e9 / 8
WARMUP = 2  # iterations or messages before timing starts: the first ones meet cold buffers and rates


# ----------------------------------------------------------------------------- plumbing

def _peers(n: int):
    from dlcp.hostagent.transport import Peer

    return tuple(Peer(r, "127.0.0.1", d, c) for r, (d, c) in enumerate(free_port_pairs(n)))


def _cpu() -> float:
    """CPU seconds (user + system, every thread) this process has used."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _run(target: Callable, args_of: Callable[[int], tuple], n: int, timeout: float = 600) -> list:
    """Start ``n`` spawned processes ``target(*args_of(rank), queue)``; their results by rank."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_of(r), q)) for r in range(n)]
    for p in procs:
        p.start()
    try:
        rows = [q.get(timeout=timeout) for _ in range(n)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return [r for _, r in sorted(rows, key=lambda x: x[0])]


def core_to_core_ns() -> float:
    """One-way latency of a cache line between CPUs 0 and 1 now (``bench/core_to_core.cc``): which
    placement the host gave this virtual machine's two vCPUs (tens of ns when they share a cache,
    100-300 when not; it changes within seconds here). NaN where it cannot be measured."""
    try:
        out = subprocess.run([str(_compiled("core_to_core")), "20000"], capture_output=True, text=True, timeout=30)
        return float(out.stdout) if out.returncode == 0 else float("nan")
    except (OSError, ValueError, subprocess.SubprocessError):
        return float("nan")


class Load:
    """The load average before a row, the cores' placement (:func:`core_to_core_ns`) just before it
    and the machine's idle CPU while it ran."""

    def __enter__(self) -> Load:
        self.load = os.getloadavg()[0]
        self.c2c = core_to_core_ns()
        psutil.cpu_times_percent(None)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.idle = psutil.cpu_times_percent(None).idle

    def __str__(self) -> str:
        return f"load {self.load:4.2f} idle {self.idle:3.0f}% c2c {self.c2c:3.0f} ns"


def interleaved(schemes: dict[str, Callable[[], dict]], rounds: int, key: str) -> dict[str, list[dict]]:
    """Run every scheme once per round, in turn; each scheme's results per round (with the load
    before it and the idle CPU while it ran)."""
    out: dict[str, list[dict]] = {name: [] for name in schemes}
    for r in range(rounds):
        for name, fn in schemes.items():
            with Load() as load:
                res = fn()
            res["load"], res["idle"], res["c2c"] = load.load, load.idle, load.c2c
            out[name].append(res)
            print(f"   round {r + 1}/{rounds} {name:<28} {res[key]:9.1f}  {load}", flush=True)
    return out


#: The machine beside every row: the 1-minute load average before a round's run, the idle CPU
#: while it ran and the one-way core-to-core latency just before it (the vCPUs' placement),
#: medians over rounds.
LOAD_COLUMNS = [Column("load", "{:.2f}"), Column("idle %", "{:.0f}"), Column("c2c ns", "{:.0f}")]


def load_cells(rounds: list[dict]) -> tuple[float, float, float]:
    return (statistics.median(r["load"] for r in rounds), statistics.median(r["idle"] for r in rounds),
            statistics.median(r.get("c2c", float("nan")) for r in rounds))


def summary(results: dict[str, list[dict]], key: str, base: str) -> dict[str, tuple[float, float, float, float]]:
    """Per scheme: median, min, max over rounds of ``key``, and the median per-round ratio to ``base``."""
    out = {}
    for name, rs in results.items():
        vals = [r[key] for r in rs]
        ratios = [r[key] / b[key] for r, b in zip(rs, results[base])]
        out[name] = (statistics.median(vals), min(vals), max(vals), statistics.median(ratios))
    return out


# ----------------------------------------------------------------------------- part 1: one sender

BENCH_BIN = Path(__file__).resolve().parents[1] / "build" / "bench"


def _compiled(name: str) -> Path:
    """bench/NAME.cc compiled with the system's g++ into build/bench/NAME (again when the source is newer)."""
    src, exe = Path(__file__).with_name(f"{name}.cc"), BENCH_BIN / name
    if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
        exe.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["g++", "-O2", "-std=c++17", "-pthread", "-o", str(exe), str(src)], check=True)
    return exe


def _bare_pair(mtu: int, messages: int, rate: float = 0) -> tuple[list[tuple[int, float, float]], list[float]]:
    """Run the C++ bare pair: per message the receiver's (bytes, seconds, cpu) and the sender's cpu.
    ``rate`` (bytes/s) paces its sender as DLCP's hosts are paced (0: unpaced)."""
    exe, port = str(_compiled("bare_pair")), free_port_pairs(1)[0][0]
    n, total, seg = messages + WARMUP, str(GOODPUT_ELEMS * 4), str(mtu - 28)
    rx = subprocess.Popen([exe, "recv", str(port), seg, str(n), total], stdout=subprocess.PIPE, text=True)
    tx = subprocess.run([exe, "send", str(port), seg, str(n), total, f"{rate:.0f}"], capture_output=True, text=True,
                        check=True)
    out, _ = rx.communicate(timeout=120)
    got = [(int(b), float(t), float(c)) for b, t, c in (line.split() for line in out.splitlines())]
    return got[WARMUP:], [float(c) for c in tx.stdout.split()][WARMUP:]


#: What every datagram's trailer does, by the name part 5 gives it: TransportConfig's
#: (authenticate, encrypt).
PROTECTIONS = {"mac": (True, False), "off": (False, False), "encrypt": (True, True)}


def _dlcp_goodput_proc(rank: int, peers, mtu: int, messages: int, datapath: str, line_rate: float, protection: str,
                       q) -> None:
    from dlcp.hostagent.ratecontrol import RateConfig
    from dlcp.hostagent.transport import Endpoint, TransportConfig

    # a host on a link of ``line_rate`` (RateConfig's defaults are a 10 Gb/s host's, whose rate
    # increase would take half a second to climb to 25 Gb/s, inside the timed messages)
    rate = RateConfig.for_link(line_rate)
    authenticate, encrypt = PROTECTIONS[protection]
    ep = Endpoint(TransportConfig(rank=rank, peers=peers, mtu=mtu, datapath=datapath, rate=rate,
                                  authenticate=authenticate, encrypt=encrypt)).start()
    ep.connect()
    x = np.random.default_rng(0).standard_normal(GOODPUT_ELEMS).astype(np.float32)
    out = np.empty_like(x)  # a posted receive buffer, as MPI and NCCL receives take one
    times = []
    for i in range(messages + WARMUP):
        c0, t0 = _cpu(), time.perf_counter()
        if rank == 0:
            ep.send(1, x, message_id=i, loss_bound=0.0).wait(60)
            stream = 0.0
        else:
            res = ep.recv(0, i, out=out).wait(60)
            assert np.array_equal(res.data[::4099], x[::4099])
            # the bare pair's measure: from the first packet's arrival to the last's (here: to
            # completion, the last packet placed)
            stream = res.stats.finished_at - (res.stats.first_arrival or res.stats.started)
        times.append((time.perf_counter() - t0, _cpu() - c0, stream))
    st = ep.endpoint_stats()
    q.put((rank, (times[WARMUP:], st)))
    time.sleep(0.3)
    ep.close()


def _gloo_p2p_proc(rank: int, port: int, messages: int, q) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.randn(GOODPUT_ELEMS)
    times = []
    for _ in range(messages + WARMUP):
        dist.barrier()
        c0, t0 = _cpu(), time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
        else:
            dist.recv(x, 0)
        times.append((time.perf_counter() - t0, _cpu() - c0))
    q.put((rank, times[WARMUP:]))
    dist.destroy_process_group()


def goodput_row(kind: str, messages: int, mtu: int = 1500, line_rate: float = LINE_RATE,
                protection: str = "mac") -> dict:
    """MB/s of one 100 MB message (median) and CPU ms both processes spent per 100 MB."""
    mb = GOODPUT_ELEMS * 4 / 1e6
    if kind in ("bare", "bare-paced"):
        rx, tx = _bare_pair(mtu, messages, line_rate if kind == "bare-paced" else 0)
        rates = [b / 1e6 / t for b, t, _ in rx]  # what arrived (a bare pair resends nothing)
        cpu = statistics.median(c for _, _, c in rx) + statistics.median(tx)
        lost = sum(GOODPUT_ELEMS * 4 - b for b, _, _ in rx) // (mtu - 28)
        return {"MB/s": statistics.median(rates), "stream": statistics.median(rates), "cpu": cpu * 1e3 / mb * 100,
                "retx": 0, "overruns": lost}
    if kind == "gloo":
        port = free_port_pairs(1)[0][1]
        tx, rx = _run(_gloo_p2p_proc, lambda r: (r, port, messages), 2)
        rates = [mb / t for t, _ in rx]
        cpu = statistics.median(c for _, c in tx) + statistics.median(c for _, c in rx)
        return {"MB/s": statistics.median(rates), "stream": None, "cpu": cpu * 1e3 / mb * 100, "retx": 0,
                "overruns": 0}
    peers = _peers(2)
    (tx, stx), (rx, srx) = _run(_dlcp_goodput_proc, lambda r: (r, peers, mtu, messages, kind, line_rate, protection),
                                2)
    rates = [mb / t for t, _, _ in tx]
    cpu = statistics.median(c for _, c, _ in tx) + statistics.median(c for _, c, _ in rx)
    return {"MB/s": statistics.median(rates), "stream": statistics.median(mb / t for _, _, t in rx),
            "cpu": cpu * 1e3 / mb * 100, "retx": stx["retransmitted_pkts"],
            "overruns": srx["rx_socket_overflows"], "sent": stx["data_pkts_sent"]}


def goodput_table(args) -> Table:
    title = (f"1. one sender -> one receiver, 100 MB messages, MTU 1500, {args.line_rate:g} Gb/s configured, "
             "separate processes")
    print(title)
    kinds = {"bare GSO -> GRO pair": "bare", "bare pair, paced": "bare-paced", "DLCP native": "native",
             "gloo send/recv": "gloo"}
    res = interleaved({k: partial(goodput_row, v, args.messages, line_rate=args.line_rate * 1e9 / 8)
                       for k, v in kinds.items()}, args.rounds, "MB/s")
    s = summary(res, "MB/s", "bare GSO -> GRO pair")
    cpu = summary(res, "cpu", "gloo send/recv")
    table = Table(title, [Column(""), Column("MB/s", "{:.0f}"), Column("range"), Column("of bare", "{:.2f}"),
                          Column("stream MB/s", "{:.0f}"), Column("of bare", "{:.2f}"), Column("of paced", "{:.2f}"),
                          Column("cpu ms/100MB", "{:.0f}"), Column("of gloo", "{:.2f}"), Column("retx"),
                          Column("overruns"), *LOAD_COLUMNS],
                  notes=["MB/s: a message's size over the time from send() to its completion (gloo: the receive's "
                         "call to its return); stream: from its first packet's arrival at the receiver to its "
                         "completion there, the bare pair's own measure. of bare / of gloo: the median over rounds "
                         "of the ratio within a round; of paced: the stream's ratio to the paced pair's. cpu: user + "
                         "system of both processes per 100 MB. The bare pair (bench/bare_pair.cc, C++) has no "
                         "protocol: no headers, checks or recovery; unpaced it is this machine's limit for one "
                         "sender, paced (a 256 KB token bucket at the configured line rate, as DLCP's hosts are) "
                         "the configuration's; its rate counts what arrived, its overruns column the segments "
                         "lost."])
    bare, paced = res["bare GSO -> GRO pair"], res["bare pair, paced"]
    for name in kinds:
        med, lo, hi, ratio = s[name]
        streams = [r["stream"] for r in res[name]]
        stream = (statistics.median(streams), statistics.median(a / b["stream"] for a, b in zip(streams, bare)),
                  statistics.median(a / b["stream"] for a, b in zip(streams, paced))) \
            if None not in streams else (None, None, None)
        table.add(name, med, f"{lo:.0f}-{hi:.0f}", ratio, *stream, cpu[name][0], cpu[name][3],
                  sum(r["retx"] for r in res[name]), sum(r["overruns"] for r in res[name]), *load_cells(res[name]))
    return table


def protection_table(args) -> Table:
    """Part 5: what authenticating (and encrypting) every datagram costs one sender."""
    title = (f"5. one sender -> one receiver, DLCP's compiled path, 100 MB messages, MTU {args.goodput_mtu}, "
             f"{args.line_rate:g} Gb/s configured: the trailer's tag off, a MAC (the default), encrypted")
    print(title)
    kinds = {"tag off (authenticate=False)": "off", "MAC, AES-128-GMAC (default)": "mac",
             "AES-128-GCM encrypted": "encrypt"}
    res = interleaved({k: partial(goodput_row, "native", args.messages, mtu=args.goodput_mtu,
                                  line_rate=args.line_rate * 1e9 / 8, protection=v)
                       for k, v in kinds.items()}, args.rounds, "MB/s")
    base = "tag off (authenticate=False)"
    s = summary(res, "MB/s", base)
    cpu = summary(res, "cpu", base)
    table = Table(title, [Column(""), Column("MB/s", "{:.0f}"), Column("range"), Column("of off", "{:.2f}"),
                          Column("stream MB/s", "{:.0f}"), Column("cpu ms/100MB", "{:.0f}"),
                          Column("cpu of off", "{:.2f}"), Column("retx"), Column("overruns"), *LOAD_COLUMNS],
                  notes=["MB/s as in part 1 (send() to completion); of off: the median over rounds of the ratio to "
                         "the tag-off row within a round (target, issue 44: MAC >= 0.90). Every row sends the same "
                         "bytes (the trailer goes out zero when off), so the difference is the AES-GCM work: a "
                         "GMAC over header and payload per datagram on each side, or the payload encrypted and "
                         "decrypted too. cpu: user + system of both processes per 100 MB."])
    for name in kinds:
        med, lo, hi, ratio = s[name]
        table.add(name, med, f"{lo:.0f}-{hi:.0f}", ratio, statistics.median(r["stream"] for r in res[name]),
                  cpu[name][0], cpu[name][3], sum(r["retx"] for r in res[name]),
                  sum(r["overruns"] for r in res[name]), *load_cells(res[name]))
    return table


# ----------------------------------------------------------------------------- part 2: collectives

def _buckets() -> list:
    from dlcp.hostagent.fusion import plan_buckets

    return plan_buckets(TENSOR_ELEMS, [0] * len(TENSOR_ELEMS))


def _gloo_collective_proc(rank: int, port: int, iterations: int, start, q) -> None:
    """gloo's side of part 2, timed as DLCP's rows are: every process starts an iteration at the
    same ``start`` barrier (a multiprocessing one, outside both transports), and the clock runs
    over the exchange alone. DDP's default hook divides each bucket before its all_reduce, but
    DDP folds that into its copy of the gradients into the bucket, and DLCP's rows time no such
    pass: it is not timed here either."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    bufs = [torch.from_numpy(np.random.default_rng(rank).standard_normal(b.total).astype(np.float32))
            for b in _buckets()]
    times = []
    for _ in range(iterations + WARMUP):
        start.wait()
        t0 = time.perf_counter()
        works = []
        for b in bufs:  # every bucket in flight, as DDP issues them
            works.append(dist.all_reduce(b, async_op=True))
        for w in works:
            w.wait()
        times.append(time.perf_counter() - t0)
    q.put((rank, {"times": times[WARMUP:]}))
    dist.destroy_process_group()


def _dlcp_collective_proc(rank: int, peers, pattern: str, p: float, loss: float, iterations: int, mtu: int,
                          datapath: str, line_rate: float, protection: str, start, q) -> None:
    from dlcp.hostagent.exchange import PSServer, PSWorker, RingAllreduce
    from dlcp.hostagent.policy import Policy
    from dlcp.hostagent.ratecontrol import RateConfig
    from dlcp.hostagent.transport import Endpoint, LossInjection, TransportConfig

    n = 4
    policy = Policy(loss_bound_push=p)
    inj = LossInjection(drop_probabilities=(loss,) * 4, seed=rank) if loss else LossInjection()
    authenticate, encrypt = PROTECTIONS[protection]
    ep = Endpoint(TransportConfig(rank=rank, peers=peers, policy=policy, mtu=mtu, loss=inj, datapath=datapath,
                                  rate=RateConfig.for_link(line_rate), authenticate=authenticate,
                                  encrypt=encrypt)).start()
    ep.connect()
    plan = _buckets()
    bufs = [np.random.default_rng(rank).standard_normal(b.total).astype(np.float32) for b in plan]
    times, sent, resent = [], [], []
    if pattern == "ps" and rank == n:
        PSServer(ep, list(range(n))).serve(iterations + WARMUP, len(plan))
    else:
        # "ring": the all-gather forwarded around the ring (the default); "ring-direct": sent by each owner
        ex = PSWorker(ep, n) if pattern == "ps" else RingAllreduce(
            ep, list(range(n)), gather="direct" if pattern == "ring-direct" else "ring")
        pulls = [np.empty_like(b) for b in bufs]  # the averages land here, every iteration (gloo's are in place)
        for it in range(iterations + WARMUP):
            s0 = ep.stats
            start.wait()  # the workers start each iteration together, as gloo's processes do
            t0 = time.perf_counter()
            if isinstance(ex, PSWorker):
                ex.exchange_detailed(it, bufs, [b.index for b in plan], [b.layout.top_priority for b in plan],
                                     [b.layout for b in plan], out=pulls)
            else:
                # as the DDP hook without error feedback
                ex.allreduce_inplace(it, bufs, [b.index for b in plan], [b.layout.top_priority for b in plan],
                                     [b.layout for b in plan], lost_values=False)
            times.append(time.perf_counter() - t0)
            s1 = ep.stats
            sent.append(s1.data_pkts_sent - s0.data_pkts_sent)
            resent.append(s1.retransmitted_pkts - s0.retransmitted_pkts)
    q.put((rank, {"times": times[WARMUP:], "sent": sum(sent[1:]), "resent": sum(resent[1:]),
                  "overruns": ep.endpoint_stats()["rx_socket_overflows"]}))
    time.sleep(0.5)
    ep.close()


def collective_row(scheme: str, iterations: int, mtu: int, line_rate: float = LINE_RATE) -> dict:
    """Sync ms per iteration (the slowest process's, median over iterations); every scheme's four
    workers start each iteration at one barrier, outside the clock."""
    start = mp.get_context("spawn").Barrier(4)
    if scheme == "gloo":
        port = free_port_pairs(1)[0][1]
        rows = _run(_gloo_collective_proc, lambda r: (r, port, iterations, start), 4)
    else:
        # datapath:pattern:p:loss[:protection] (PROTECTIONS; the MAC by default)
        datapath, pattern, p, loss, *rest = scheme.split(":")
        protection = rest[0] if rest else "mac"
        n = 5 if pattern == "ps" else 4  # the server is a fifth process
        peers = _peers(n)
        rows = _run(_dlcp_collective_proc, lambda r: (r, peers, pattern, float(p), float(loss), iterations, mtu,
                                                       datapath, line_rate, protection, start), n)
        rows = [r for r in rows if r.get("times")]
    per_it = [max(r["times"][i] for r in rows) for i in range(iterations)]
    sent = sum(r.get("sent", 0) for r in rows)
    resent = sum(r.get("resent", 0) for r in rows)
    return {"ms": statistics.median(per_it) * 1e3, "resent %": 100 * resent / max(1, sent),
            "overruns": sum(r.get("overruns", 0) for r in rows)}


def collective_table(args) -> Table:
    title = (f"2. collectives: 4 processes, {sum(TENSOR_ELEMS) * 4 / 1e6:.0f} MB in {len(TENSOR_ELEMS)} tensors "
             f"fused into DDP's buckets, MTU {args.mtu}, DLCP's hosts {args.line_rate:g} Gb/s, "
             f"{args.iterations} timed iterations per round")
    print(title)
    schemes = {
        "gloo all_reduce": "gloo",
        "DLCP ring, lossless": "native:ring:0:0",
        "DLCP ring, lossless, tag off": "native:ring:0:0:off",
        "DLCP ring, lossless, encrypted": "native:ring:0:0:encrypt",
        "DLCP ring, p=.05, 2% loss": "native:ring:0.05:0.02",
        "DLCP ring, p=.05, 2% loss, direct all-gather": "native:ring-direct:0.05:0.02",
        "DLCP PS, lossless": "native:ps:0:0",
        "DLCP PS, p=.05, 2% loss": "native:ps:0.05:0.02",
    }
    res = interleaved({k: partial(collective_row, v, args.iterations, args.mtu, args.line_rate * 1e9 / 8)
                       for k, v in schemes.items()}, args.rounds, "ms")
    s = summary(res, "ms", "gloo all_reduce")
    table = Table(title, [Column(""), Column("sync ms", "{:.1f}"), Column("range"), Column("x gloo", "{:.2f}"),
                          Column("resent %", "{:.2f}"), Column("overruns"), *LOAD_COLUMNS],
                  notes=["sync ms: per iteration, the slowest process; resent %: of data packets sent, after the first "
                         "timed iteration; x gloo: the median over rounds of the ratio within a round."])
    for name in schemes:
        med, lo, hi, ratio = s[name]
        table.add(name.strip(), med, f"{lo:.0f}-{hi:.0f}", ratio, statistics.median(r["resent %"] for r in res[name]),
                  sum(r["overruns"] for r in res[name]), *load_cells(res[name]))
    return table


# ----------------------------------------------------------------------------- part 3: DDP steps

def _ddp_proc(rank: int, port: int, store_port: int, workload: str, scheme: str, steps: int, q) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DLCP_STORE_PORT=str(store_port),
                      RANK=str(rank), WORLD_SIZE="4")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    from dlcp_torch.workloads import get_workload

    wl = get_workload(workload)
    (x, y), _ = wl.load_data()
    model = wl.make_model(0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    session = None
    if scheme != "gloo":
        import dlcp_torch

        session = dlcp_torch.init(scheme, model=model)
        ddp.register_comm_hook(session.state, dlcp_torch.dlcp_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=wl.lr, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps + 5):
        idx = torch.randint(0, len(x), (wl.batch,), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x[idx]), y[idx])
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    dist.barrier()
    if session is not None:
        session.close()
    q.put((rank, {"times": times[5:]}))
    dist.destroy_process_group()


def ddp_row(workload: str, scheme: str, steps: int) -> dict:
    (port, _), (store, _) = free_port_pairs(2)
    rows = _run(_ddp_proc, lambda r: (r, port, store, workload, scheme, steps), 4)
    per_step = [max(r["times"][i] for r in rows) for i in range(steps)]
    return {"ms": statistics.median(per_step) * 1e3}


def ddp_table(args) -> Table:
    import importlib.util

    workloads = ["digits"] + (["mnist1d"] if importlib.util.find_spec("mnist1d") else [])
    title = (f"3. DDP training steps, 4 workers on loopback, {args.steps} timed steps per round "
             f"({', '.join(workloads)}{'' if 'mnist1d' in workloads else '; MNIST-1D skipped: pip install mnist1d'})")
    print(title)
    table = Table(title, [Column(""), Column("step ms", "{:.2f}"), Column("range"), Column("x gloo", "{:.2f}"),
                          *LOAD_COLUMNS],
                  notes=["step ms: forward, backward (with the exchange) and optimiser step, the slowest worker's "
                         "median; x gloo: the median over rounds of the ratio within a round."])
    for wl in workloads:
        schemes = {f"{wl}: stock DDP over gloo": "gloo", f"{wl}: DDP + dlcp_hook, ring": "ring",
                   f"{wl}: DDP + dlcp_hook, PS": "ps"}
        res = interleaved({k: partial(ddp_row, wl, v, args.steps) for k, v in schemes.items()},
                          args.rounds, "ms")
        s = summary(res, "ms", f"{wl}: stock DDP over gloo")
        for name in schemes:
            med, lo, hi, ratio = s[name]
            table.add(name, med, f"{lo:.1f}-{hi:.1f}", ratio, *load_cells(res[name]))
    return table


# ----------------------------------------------------------------------------- part 4: the testbed workload

def testbed_workload(fusion: bool, iterations: int) -> dict:
    """The testbed's workload on loopback: 4 workers + PS as separate ``dlcp.topologies.agent``
    processes with the testbed's spec (ResNet-50 profile at scale 0.002, the rate configuration
    of 2000-pps bottlenecks), no switch and no compute, so an iteration is all communication."""
    import json
    import tempfile

    from dlcp.hostagent.policy import Policy
    from dlcp.topologies.runner import RunOptions, agent_spec

    opts = RunOptions(workers=4, iterations=iterations, compute_ms=0.0, fusion=fusion)
    ports = free_port_pairs(5)
    spec = agent_spec(opts, Policy(), ["127.0.0.1"] * 5, ports)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "agent.json"
        path.write_text(json.dumps(spec))
        server = subprocess.Popen([sys.executable, "-m", "dlcp.topologies.agent", str(path), "4"])
        outs = [Path(tmp) / f"w{r}.jsonl" for r in range(4)]
        workers = [subprocess.Popen([sys.executable, "-m", "dlcp.topologies.agent", str(path), str(r), str(outs[r])])
                   for r in range(4)]
        try:
            for w in workers:
                w.wait(timeout=600)
        finally:
            server.terminate()
            server.wait(timeout=30)
        rows = [json.loads(line) for o in outs for line in o.read_text().splitlines()]
    measured = [r for r in rows if r["kind"] == "measured"]
    rate = spec["rate"]["line_rate"]
    sizes = layer_sizes_bytes(spec)
    bound = 4 * sizes / rate  # the busiest link is the server's: every worker's push
    return {"sync_p50": statistics.median(r["sync_time"] for r in measured) * 1e3,
            "sync_p99": float(np.percentile([r["sync_time"] for r in measured], 99)) * 1e3,
            "bound": bound * 1e3, "messages": measured[0]["messages"],
            "ctl": statistics.median(r["control_frames"] for r in measured),
            "ctl_bytes": statistics.median(r["control_bytes"] for r in measured),
            "retx": sum(r["retransmissions"] for r in measured)}


def layer_sizes_bytes(spec: dict) -> int:
    """Bytes of datagrams (DLCP header + payload) one worker pushes per iteration."""
    from dlcp.hostagent.fusion import plan_buckets
    from dlcp.hostagent.model_profiles import layer_sizes
    from dlcp.hostagent.packetizer import elems_per_packet
    from dlcp.hostagent.wire import HEADER_SIZE
    from dlcp.topologies.workload import fusion_for

    sizes = layer_sizes(spec["model"], spec["scale"])
    per = elems_per_packet(spec["mtu"], np.float32)
    buckets = plan_buckets(sizes, [0] * len(sizes), config=fusion_for(spec))
    return sum(b.total * 4 + -(-b.total // per) * HEADER_SIZE for b in buckets)


def testbed_table(args) -> Table:
    title = ("4. the testbed's workload on loopback: 4 workers + PS, ResNet-50 profile at scale 0.002, "
             "2000-pps rate configuration, no compute")
    print(title)
    table = Table(title, [Column("fusion"), Column("msgs/it"), Column("sync p50 ms", "{:.1f}"),
                          Column("sync p99 ms", "{:.1f}"), Column("bound ms", "{:.1f}"), Column("p50/bound", "{:.2f}"),
                          Column("ctl frames/it", "{:.0f}"), Column("ctl bytes/it", "{:.0f}"), Column("retx"),
                          *LOAD_COLUMNS],
                  notes=["bound = bytes the server's link carries in one direction per iteration (4 pushes) / the "
                         "hosts' line rate; ctl frames/bytes = control frames a worker sent and received per "
                         "iteration (medians)"])
    for fusion in (True, False):
        with Load() as load:
            r = testbed_workload(fusion, max(3, args.iterations * 2))
        table.add("on" if fusion else "off", r["messages"], r["sync_p50"], r["sync_p99"], r["bound"],
                  r["sync_p50"] / r["bound"], r["ctl"], r["ctl_bytes"], r["retx"], load.load, load.idle, load.c2c)
    return table


# ----------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every scheme (default 3)")
    ap.add_argument("--iterations", type=int, default=5, help="timed iterations per collective row (default 5)")
    ap.add_argument("--messages", type=int, default=5, help="timed 100 MB messages per goodput row (default 5)")
    ap.add_argument("--steps", type=int, default=50, help="timed DDP steps per row (default 50)")
    ap.add_argument("--mtu", type=int, default=9000, help="MTU of the collectives (default 9000)")
    ap.add_argument("--line-rate", type=float, default=LINE_RATE * 8 / 1e9, metavar="GBPS",
                    help="the link DLCP's hosts are configured for in parts 1-2 (default 25; RateConfig's own is 10)")
    ap.add_argument("--quick", action="store_true", help="1 round and fewer iterations: a smoke run")
    ap.add_argument("--part", choices=("all", "goodput", "collective", "ddp", "testbed", "protection"), default="all")
    ap.add_argument("--goodput-mtu", type=int, default=1500, help="MTU of part 5 (default 1500, as part 1)")
    ap.add_argument("--out", type=Path, default=None, metavar="FILE",
                    help="also keep the tables with the command and commit as JSON (dlcp report FILE prints them)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.iterations, args.messages, args.steps = 1, 2, 2, 10
    record = Record.start("python bench/transport.py")
    print(record.header())
    parts = {"goodput": goodput_table, "collective": collective_table, "ddp": ddp_table, "testbed": testbed_table,
             "protection": protection_table}
    done = []
    for part, make in parts.items():
        if args.part in ("all", part):
            done.append(make(args))
            print(done[-1].text())
            record.keep(args.out, done)


if __name__ == "__main__":
    main()
