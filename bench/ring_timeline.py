"""Where a ring allreduce's time goes: iteration times, protocol counters, and one iteration's
per-message timeline (a diagnostic beside bench/transport.py's part 2, same workload).

Four processes on loopback reduce the 57 MB of ``bench/transport.py``'s collective profile
(12 tensors fused into DDP's buckets) with ``RingAllreduce``, under injected loss or not, and
print:

* the slowest process's time per timed iteration and its median;
* per rank, over the timed iterations: its CPU time per iteration, control records sent
  (BITMAP, NACK, PROBE, ...), holes reported and resent, packets retransmitted, credit waits
  and loss releases, the rate's minimum and median and why it changed;
* with ``--timeline``, rank 0's receives in the last iteration (first packet, first answer,
  completion, how, resent packets, PROBEs) beside the sends of rank 3, which feeds it (when the
  send could begin, when its first pass was out, its first answer, its completion), and when
  rank 3 itself completed the step before, which it forwards; in ms from rank 0's iteration
  start (the processes share one monotonic clock).

Why: the lossy ring's distance to gloo is spread over many messages; its counters and one
iteration's timeline say whether a change moves the part it aims at.

Run: python bench/ring_timeline.py [--loss 0.02] [--p 0.05] [--iterations 10] [--timeline]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import transport as bt  # noqa: E402  (the same buckets and ports as part 2)
from dlcp.hostagent.exchange import RingAllreduce, step_of, tensor_of  # noqa: E402
from dlcp.hostagent.policy import Policy  # noqa: E402
from dlcp.hostagent.ratecontrol import RateConfig  # noqa: E402
from dlcp.hostagent.transport import Endpoint, LossInjection, TransportConfig  # noqa: E402

WARMUP = 2  # iterations before the counters start: the first meet cold buffers and rates


def _cpu() -> float:
    """CPU seconds this process spent (all its threads, user and system)."""
    t = os.times()
    return t.user + t.system


def _rank(rank: int, peers, args: argparse.Namespace, q) -> None:
    loss = LossInjection(drop_probabilities=(args.loss,) * 4, seed=rank) if args.loss else LossInjection()
    ep = Endpoint(TransportConfig(rank=rank, peers=peers, policy=Policy(loss_bound_push=args.p), mtu=args.mtu,
                                  loss=loss, rate=RateConfig.for_link(args.line_rate * 1e9 / 8))).start()
    ep.connect()
    plan = bt._buckets()
    bufs = [np.random.default_rng(rank).standard_normal(b.total).astype(np.float32) for b in plan]
    ring = RingAllreduce(ep, list(range(4)))
    times, t0, cpu0 = [], 0.0, 0.0
    before: dict = {}
    counted_from = 0.0
    for it in range(args.iterations):
        ep.message_log.clear()
        t0 = time.monotonic()
        if it == WARMUP:
            before, counted_from, cpu0 = ep.endpoint_stats(), t0, _cpu()
        ring.allreduce_inplace(it, bufs, [b.index for b in plan], [b.layout.top_priority for b in plan],
                               [b.layout for b in plan], lost_values=False)
        times.append(time.monotonic() - t0)
    after, cpu = ep.endpoint_stats(), _cpu() - cpu0

    def grew(key: str) -> int:
        return after.get(key, 0) - before.get(key, 0)

    rates = [r for r in ep.rate_log if r.time >= counted_from]
    counters = {
        "CPU ms per iteration": round(cpu * 1e3 / (args.iterations - WARMUP), 1),
        "records": dict(Counter(after["ctl_records_sent"]) - Counter(before["ctl_records_sent"])),
        "holes reported": grew("holes_reported"), "holes resent": grew("holes_resent"),
        "retransmitted": grew("retransmitted_pkts"), "sent": grew("data_pkts_sent"),
        "credit waits": grew("credit_waits"), "loss releases": grew("loss_releases_sent"),
        "rate MB/s min, median": (round(min(r.rate for r in rates) / 1e6),
                                  round(statistics.median(r.rate for r in rates) / 1e6)) if rates else None,
        "rate changes": dict(Counter(r.cause for r in rates)),
    }

    # absolute monotonic times (one clock for all processes): main() puts them on rank 0's axis
    recvs = [(tensor_of(s.message_id), step_of(s.message_id), s.packets, s.first_arrival, s.recovery_started,
              s.finished_at, s.how, s.retransmissions, s.probes) for s in ep.message_log if s.direction == "recv"]
    sends = {(tensor_of(s.message_id), step_of(s.message_id)): (s.activated, s.first_pass_ended, s.recovery_started,
                                                                 s.finished_at, s.retransmissions, s.probes)
             for s in ep.message_log if s.direction == "send"}
    q.put((rank, times, counters, recvs, sends, t0))
    time.sleep(0.3)
    ep.close()


def _ms(x: float | None) -> str:
    return "      -" if x is None else f"{x:7.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loss", type=float, default=0.02, help="injected loss at every receiver (default 0.02)")
    ap.add_argument("--p", type=float, default=0.05, help="loss bound of the reduce-scatter (default 0.05)")
    ap.add_argument("--iterations", type=int, default=10, help=f"iterations, the first {WARMUP} untimed (default 10)")
    ap.add_argument("--mtu", type=int, default=9000)
    ap.add_argument("--line-rate", type=float, default=25, metavar="GBPS", help="hosts' line rate (default 25)")
    ap.add_argument("--timeline", action="store_true", help="print rank 0's last iteration, message by message")
    args = ap.parse_args()
    if args.iterations <= WARMUP:
        ap.error(f"--iterations must be more than {WARMUP}")
    peers = bt._peers(4)
    q: mp.Queue = mp.Queue()
    procs = [mp.Process(target=_rank, args=(r, peers, args, q)) for r in range(4)]
    for p in procs:
        p.start()
    res = sorted(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    slowest = [max(r[1][i] for r in res) * 1e3 for i in range(WARMUP, args.iterations)]
    print(f"ring, 4 processes, loss {args.loss}, p {args.p}, MTU {args.mtu}, {args.line_rate:g} Gb/s hosts")
    print("slowest process, ms per timed iteration:", [round(x, 1) for x in slowest],
          "median", round(statistics.median(slowest), 1))
    for rank, _, counters, _, _, _ in res:
        print(f"rank {rank}:", counters)
    if args.timeline:
        t0 = res[0][5]

        def ms(t: float | None) -> float | None:
            return None if t is None else (t - t0) * 1e3

        recvs, feeder = res[0][3], res[3][4]
        feeder_done = {(t, step): done for t, step, _, _, _, done, *_ in res[3][3]}
        print("rank 0's receives | rank 3's send of the same message | rank 3 completed the step it forwards"
              " (ms from rank 0's iteration start)")
        print("tensor step pkts   first  answer    done how      resent probes |"
              "    can go  pass out  answer    done resent probes | before")
        for t, step, pkts, first, ans, done, how, retx, probes in sorted(recvs, key=lambda r: r[5] or 0):
            snd = feeder.get((t, step))
            right = "" if snd is None else (f" | {_ms(ms(snd[0]))}   {_ms(ms(snd[1]))} {_ms(ms(snd[2]))} "
                                            f"{_ms(ms(snd[3]))} {snd[4]:6d} {snd[5]:6d}")
            before = feeder_done.get((t, step - 1)) if step else None
            print(f"{t:6d} {step:4d} {pkts:4d} {_ms(ms(first))} {_ms(ms(ans))} {_ms(ms(done))} {how:8s} {retx:6d} "
                  f"{probes:6d}" + right + (f" | {_ms(ms(before))}" if before is not None else ""))


if __name__ == "__main__":
    main()
