"""Forgery benchmark on loopback (issue 44): ten million random forgeries at a receiver's data
port while a sender streams exact messages to it.

Rank 0 sends rank 1 exact messages (bound 0), one after another, first with nobody else around,
then while a forger process sends ``--forgeries`` datagrams as fast as it can, each drawn at
random: a data header of a message the sender is sending or will send (the right job, sender,
message id, a random sequence number, offset, flags and count), a CREDIT claiming to come from
the receiver's peer, or random bytes; each with a random payload (0-256 bytes) and a random
trailer (packet number and tag). Nothing but the tag tells them from the sender's datagrams.

Prints, per phase: messages, any that differed from what was sent, completion time p50 / max,
and the sender's rate toward the receiver (its rate controller's, sampled every 50 ms: the
lowest); then the forgeries sent, rejected by reason, dropped by the kernel (socket overruns,
any sender's), and accepted (the receiver's accepted datagrams beyond what the sender sent).
Targets (issue 44): none accepted; every tensor exact; the sender's rate within 10 % of its
rate before the attack.

Run: python bench/forgeries.py [--forgeries 10000000] [--elems N] [--out FILE]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.victim import exact_pair, run_messages  # noqa: E402
from dlcp.hostagent import wire  # noqa: E402
from dlcp.hostagent.packetizer import elems_per_packet  # noqa: E402
from dlcp.hostagent.tables import Column, Record, Table  # noqa: E402
from dlcp.hostagent.transport import Endpoint  # noqa: E402

PER = elems_per_packet(1500, np.float32)
CHUNK = 1 << 16  # forgeries drawn at once
MAX_PAYLOAD = 256
FIRST_ATTACK_ID = 10_000


def forgeries(rng: np.random.Generator, n: int, message_ids: range) -> tuple[np.ndarray, np.ndarray]:
    """``n`` random forgeries as rows of a byte array, and each one's length: half data headers
    of the sender's messages ``message_ids``, a quarter CREDITs from rank 0, a quarter random
    bytes; each with a random payload and a random trailer."""
    width = wire.HEADER_SIZE + MAX_PAYLOAD + wire.TRAILER_SIZE
    rows = rng.integers(0, 256, (n, width), dtype=np.uint8)  # random everywhere to begin with
    payload = rng.integers(0, MAX_PAYLOAD + 1, n)
    lengths = wire.HEADER_SIZE + payload + wire.TRAILER_SIZE
    kind = rng.integers(0, 4, n)  # 0, 1: data; 2: credit; 3: random bytes
    headed = np.flatnonzero(kind <= 2)
    h = np.zeros(headed.size, wire.HEADER_DTYPE)
    h["version"] = wire.VERSION
    h["ptype"] = np.where(kind[headed] == 2, int(wire.PacketType.CREDIT), int(wire.PacketType.DATA))
    h["job_id"], h["sender_rank"] = 1, 0
    h["message_id"] = rng.integers(message_ids.start, message_ids.stop, headed.size)
    h["seq"] = rng.integers(0, 1 << 16, headed.size)
    h["total_pkts"] = rng.integers(1, 1 << 16, headed.size)
    h["elem_offset"] = rng.integers(0, 1 << 24, headed.size)
    h["elem_count"] = payload[headed] // 4
    h["flags"] = rng.integers(0, 16, headed.size)
    h["priority"] = rng.integers(0, 8, headed.size)
    h["drop_class"] = rng.integers(0, 4, headed.size)
    # data of the sender's own iteration (0); a credit's number at random
    h["iteration"] = np.where(kind[headed] == 2, rng.integers(0, 1 << 32, headed.size), 0)
    rows[headed, : wire.HEADER_SIZE] = h.view(np.uint8).reshape(headed.size, wire.HEADER_SIZE)
    return rows, lengths


def forger(data_port: int, n: int, message_ids: range, started: Event, seed: int, q) -> None:
    """The forger's process: ``n`` forgeries to the receiver's data port, as fast as it can."""
    rng = np.random.default_rng(seed)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dest = ("127.0.0.1", data_port)
    sent = 0
    started.set()
    t0 = time.monotonic()
    while sent < n:
        rows, lengths = forgeries(rng, min(CHUNK, n - sent), message_ids)
        width = rows.shape[1]
        flat = memoryview(rows.tobytes())  # one copy per chunk; slices of it cost nothing
        for i, length in enumerate(lengths.tolist()):
            try:
                s.sendto(flat[i * width : i * width + length], dest)
            except BlockingIOError:
                pass
            sent += 1
    q.put((sent, time.monotonic() - t0))
    s.close()


class RateWatch:
    """Samples the sender's rate toward the receiver (its rate controller's) every 50 ms."""

    def __init__(self, ep: Endpoint, dest: int) -> None:
        self.ep, self.dest = ep, dest
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            rate = self.ep.endpoint_stats()["rate_bytes_per_s"].get(self.dest)
            if rate:
                self.samples.append(float(rate))

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        return self.samples



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forgeries", type=int, default=10_000_000)
    ap.add_argument("--messages", type=int, default=50, help="messages in the quiet phase")
    ap.add_argument("--elems", type=int, default=PER * 1000, help="elements per message")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, metavar="FILE",
                    help="also keep the tables with the command and commit as JSON (dlcp report FILE prints them)")
    args = ap.parse_args()
    record = Record.start("python bench/forgeries.py")
    print(record.header())
    a, b = exact_pair()
    ctx = mp.get_context("spawn")
    try:
        a.connect([1])
        watch = RateWatch(a, 1)
        quiet, wrong_q = run_messages(a, b, range(1, 1 + args.messages), args.elems)
        rates_quiet = watch.stop()
        before_a, before_b = a.endpoint_stats(), b.endpoint_stats()
        attack_ids = range(FIRST_ATTACK_ID, FIRST_ATTACK_ID + 1_000_000)
        started, q = ctx.Event(), ctx.Queue()
        p = ctx.Process(target=forger, args=(b.me.data_port, args.forgeries, attack_ids, started, args.seed, q))
        p.start()
        started.wait(60)
        watch = RateWatch(a, 1)
        loud, wrong_l = run_messages(a, b, attack_ids, args.elems, until=p.is_alive)
        rates_loud = watch.stop()
        sent, took = q.get(timeout=3600)
        p.join()
        time.sleep(0.5)
        after_a, after_b = a.endpoint_stats(), b.endpoint_stats()
    finally:
        a.close()
        b.close()

    def delta(after: dict, before: dict, key: str) -> int:
        return int(after[key]) - int(before[key])

    rej = {k: v - before_b["reassembly"]["rejected"].get(k, 0) for k, v in after_b["reassembly"]["rejected"].items()}
    rej = {k: v for k, v in rej.items() if v}
    accepted = after_b["reassembly"]["accepted"] - before_b["reassembly"]["accepted"]
    genuine = delta(after_a, before_a, "data_pkts_sent")  # the sender's packets, resent ones included
    overruns = delta(after_b, before_b, "rx_socket_overflows")
    forged_accepted = max(0, accepted - genuine)
    start_rate = statistics.median(rates_quiet[-10:]) if rates_quiet else float("nan")
    lowest = min(rates_loud) if rates_loud else float("nan")
    phases = Table(f"forgeries: {sent:,} random forgeries at the data port in {took:.1f} s "
                   f"({sent / took / 1e3:.0f} k/s), messages of {args.elems} float32, bound 0",
                   [Column("phase"), Column("messages"), Column("not exact"), Column("p50 ms", "{:.1f}"),
                    Column("max ms", "{:.1f}"), Column("sender rate MB/s (median)", "{:.0f}"),
                    Column("lowest", "{:.0f}")])
    for name, t, wrong, rates in (("quiet", quiet, wrong_q, rates_quiet), ("under forgeries", loud, wrong_l,
                                                                           rates_loud)):
        ms = sorted(1e3 * v for v in t)
        phases.add(name, len(t), wrong, statistics.median(ms), ms[-1],
                   statistics.median(rates) / 1e6 if rates else None, min(rates) / 1e6 if rates else None)
    receiver = Table("what the receiver did with them", [Column("what"), Column("count", left=True)])
    receiver.add(f"rejected ({sum(rej.values()):,})",
                 ", ".join(f"{k} {v:,}" for k, v in sorted(rej.items(), key=lambda kv: -kv[1])))
    receiver.add("dropped by the kernel (socket overruns, any sender's)", f"{overruns:,}")
    receiver.add("accepted beyond what the sender sent (forgeries accepted)", forged_accepted)
    receiver.add("the sender's packets, and resent", f"{genuine:,}, {delta(after_a, before_a, 'retransmitted_pkts'):,}")
    slowed = lowest / start_rate if rates_loud and rates_quiet else float("nan")
    receiver.add("sender's lowest rate under forgeries / its rate before", f"{slowed:.2f}")
    ok = forged_accepted == 0 and wrong_q == wrong_l == 0 and slowed >= 0.9
    receiver.add("targets: none accepted, every tensor exact, the sender's rate within 10 %",
                 "met" if ok else "NOT met")
    print(phases.text())
    print(receiver.text())
    record.keep(args.out, [phases, receiver])


if __name__ == "__main__":
    main()
