"""Packetization and reassembly throughput for a 100 MB float32 gradient, on one core.

Prints GB/s of gradient data (median of --runs runs). Target: >= 2 GB/s each.

What is timed:
  packetize          headers + drop classes for every packet; payload stays a zero-copy view
                     (what a scatter-gather sender needs)
  packetize+copy     the same, then every datagram materialised into a buffer matrix
  reassemble         shuffled datagrams, already in receive slots, validated and placed in
                     batches of --batch (the receive loop's unit) into a reused destination, by
                     the compiled data path's own code (dlcp.hostagent.datapath.offline), no
                     packet tag (its cost: bench/transport.py --part protection)
  reassemble (cold)  the same into a freshly allocated destination (page faults included)

The packetize rows time the package's Python packetizer (numpy headers, compiled drop classes),
which the demo, the tests and tools use; an endpoint's sender builds its headers in C++.

Run: python bench/packetizer.py [--mb 100] [--runs 5] [--batch 1024] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from dlcp.hostagent.datapath.offline import Placement
from dlcp.hostagent.packetizer import MessageMeta, packetize
from dlcp.hostagent.policy import Policy
from dlcp.hostagent.tables import Column, Record, Table


def _median_time(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=100.0, help="tensor size in MB (float32)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1024, help="datagrams per reassembly batch")
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--out", type=Path, default=None, metavar="FILE",
                    help="also keep the table with the command and commit as JSON (dlcp report FILE prints it)")
    args = ap.parse_args()
    record = Record.start("python bench/packetizer.py")
    print(record.header())
    if hasattr(os, "sched_setaffinity"):  # one core, as the target says
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

    n = int(args.mb * 1e6 / 4)
    data = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    meta = MessageMeta(job_id=1, message_id=1, priority=7)
    policy = Policy()
    batch = packetize(data, meta, policy, mtu=args.mtu)
    order = np.random.default_rng(1).permutation(len(batch))  # arrival order: shuffled, as over sprayed paths
    out = np.ones_like(data)  # a destination reused across iterations, as the transport does

    wire_rows, wire_lengths = Placement(job_id=1).rows(batch)  # as received: header, payload, trailer
    wire_rows, wire_lengths = wire_rows[order], wire_lengths[order]

    def reassemble(dest) -> float:
        place = Placement(job_id=1)
        msg = place.expect(1, batch, out=dest)
        t0 = time.perf_counter()
        for i in range(0, len(wire_lengths), args.batch):
            place.ingest(wire_rows[i : i + args.batch], wire_lengths[i : i + args.batch])
        elapsed = time.perf_counter() - t0
        assert msg.received.all()
        return elapsed

    rows = [
        ("packetize", _median_time(lambda: packetize(data, meta, policy, mtu=args.mtu), args.runs)),
        ("packetize+copy", _median_time(lambda: packetize(data, meta, policy, mtu=args.mtu).to_slots(), args.runs)),
        ("reassemble", statistics.median(reassemble(out) for _ in range(args.runs))),
        ("reassemble (cold)", statistics.median(reassemble(None) for _ in range(args.runs))),
    ]
    np.testing.assert_array_equal(out, data)
    table = Table(f"{data.nbytes / 1e6:.0f} MB float32, {len(batch):,} packets at MTU {args.mtu}, "
                  f"median of {args.runs} runs, one core",
                  [Column("stage"), Column("ms", "{:.1f}"), Column("GB/s", "{:.2f}")])
    for name, t in rows:
        table.add(name, t * 1e3, data.nbytes / t / 1e9)
    print(table.text())
    record.keep(args.out, [table])


if __name__ == "__main__":
    main()
