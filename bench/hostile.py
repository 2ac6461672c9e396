"""Hostile-traffic benchmark on loopback: what 100,000 hostile datagrams and a crowd of hostile
control connections do to a job's messages.

Rank 0 sends rank 1 exact messages (bound 0), one after another, first with nobody else around,
then while an attacker process sends hostile datagrams of every kind (forged copies of the
messages in flight with guessed tokens and garbage payloads, data for unknown messages from a
real rank, from the receiver itself and from a rank that does not exist, random bytes,
truncated headers, other versions, other jobs) and opens hostile control connections (the right
protocol with a wrong secret, a record before the handshake, garbage, and a crowd that connects
and never speaks).

Prints, per phase: messages, any that differed from what was sent, completion time p50 / p99 /
max (ms); then the receiver's rejections by reason, kernel drops, control connections refused
by reason, packets parked at the end, and the receiver process's memory (RSS) before and after.
Targets (issue 11): every tensor exact; no message delayed by more than 1 s; every hostile
packet counted; memory bounded.

Run: python bench/hostile.py [--datagrams 100000] [--messages 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import sys
import threading
import time
from multiprocessing.synchronize import Event
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dlcp.hostagent import auth, wire  # noqa: E402
from dlcp.hostagent.packetizer import elems_per_packet  # noqa: E402
from bench import rogue  # noqa: E402
from bench.victim import exact_pair, run_messages  # noqa: E402
from dlcp.hostagent.tables import Column, Record, Table  # noqa: E402

PER = elems_per_packet(1500, np.float32)


def attacker(data_port: int, control_port: int, n: int, real_ids: range, started: Event) -> None:
    """The attacker's process: hostile control connections, then the datagrams, paced so they
    last about as long as the victim's messages."""
    datagrams = rogue.hostile_datagrams(n, 1, victim=1, real=[(0, mid) for mid in real_ids])
    crowd = []
    started.set()
    try:
        rogue.dial_as("127.0.0.1", control_port, rank=0, acceptor=1, secret=auth.parse_secret(auth.new_secret()))
    except (ConnectionError, OSError, AssertionError):
        pass
    for payload in (wire.pack_frame(wire.Header(ptype=wire.PacketType.STOP, job_id=1, message_id=1, sender_rank=0),
                                    wire.STOP_BODY.pack(0)), b"\xff" * 64):
        with socket.create_connection(("127.0.0.1", control_port)) as s:
            s.sendall(payload)
    crowd = [socket.create_connection(("127.0.0.1", control_port)) for _ in range(200)]
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for i in range(0, n, 500):
        for d in datagrams[i : i + 500]:
            s.sendto(d, ("127.0.0.1", data_port))
        time.sleep(0.002)
    s.close()
    for c in crowd:
        c.close()



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datagrams", type=int, default=100_000)
    ap.add_argument("--messages", type=int, default=200)
    ap.add_argument("--elems", type=int, default=PER * 100, help="elements per message")
    ap.add_argument("--out", type=Path, default=None, metavar="FILE",
                    help="also keep the tables with the command and commit as JSON (dlcp report FILE prints them)")
    args = ap.parse_args()
    record = Record.start("python bench/hostile.py")
    print(record.header())
    a, b = exact_pair()
    proc = psutil.Process()
    try:
        a.connect([1])
        quiet, wrong_q = run_messages(a, b, range(1, 1 + args.messages), args.elems)
        rss0, threads0 = proc.memory_info().rss, threading.active_count()
        attack_ids = range(10_000, 10_000 + args.messages)
        started = mp.get_context("spawn").Event()
        p = mp.get_context("spawn").Process(target=attacker, args=(b.me.data_port, b.me.control_port, args.datagrams,
                                                                   attack_ids, started))
        p.start()
        started.wait(60)
        loud, wrong_l = run_messages(a, b, attack_ids, args.elems)
        while p.is_alive():  # the messages ended first: keep the job busy until the attack does
            more, w = run_messages(a, b, range(attack_ids.stop + len(loud), attack_ids.stop + len(loud) + 10),
                                   args.elems)
            loud += more
            wrong_l += w
        p.join()
        time.sleep(0.5)
        st = b.endpoint_stats()
        rss1, threads1 = proc.memory_info().rss, threading.active_count()
    finally:
        a.close()
        b.close()

    phases = Table(f"hostile traffic: {args.datagrams} datagrams + 203 hostile control connections; "
                   f"messages of {args.elems} float32, bound 0",
                   [Column("phase"), Column("messages"), Column("not exact"), Column("p50 ms", "{:.1f}"),
                    Column("p99 ms", "{:.1f}"), Column("max ms", "{:.1f}")])
    for name, t, wrong in (("quiet", quiet, wrong_q), ("under attack", loud, wrong_l)):
        ms = sorted(1e3 * v for v in t)
        phases.add(name, len(t), wrong, statistics.median(ms), ms[min(len(ms) - 1, int(0.99 * len(ms)))], ms[-1])
    rej = st["reassembly"]["rejected"]
    accounted = sum(rej.values()) + st["rx_dropped_estimate"] >= args.datagrams
    ok = wrong_q == wrong_l == 0 and max(loud) - statistics.median(quiet) < 1.0
    receiver = Table("what the receiver did", [Column("what"), Column("count", left=True)])
    receiver.add(f"datagrams rejected ({sum(rej.values())})",
                 ", ".join(f"{k} {v}" for k, v in sorted(rej.items(), key=lambda kv: -kv[1])))
    receiver.add("kernel drops (socket buffer, any sender's)", st["rx_dropped_estimate"])
    receiver.add("every hostile datagram rejected or dropped", "yes" if accounted else "NO")
    receiver.add("control connections refused", ", ".join(f"{k} {v}" for k, v in sorted(st["ctl_rejected"].items())))
    receiver.add("parked at the end", st["parked_now"])
    receiver.add("threads", f"{threads0} -> {threads1}")
    receiver.add("RSS (MB)", f"{rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f}")
    receiver.add("targets: every tensor exact and no message delayed > 1 s", "met" if ok else "NOT met")
    print(phases.text())
    print(receiver.text())
    record.keep(args.out, [phases, receiver])


if __name__ == "__main__":
    main()
