"""What a datagram's tag costs per byte on this CPU: AEGISMAC-128X4 in each build this CPU runs
(the MAC of every datagram by default, ``hostagent/native/aegis_mac.h``) and the whole seal of a
datagram through the compiled sealer, MAC and encrypted (AES-128-GCM), at three datagram sizes:
an Ethernet MTU's, a jumbo frame's, loopback's 64 KB.

Why: the tag is computed over every byte a collective sends and checked over every byte it
receives, so its rate bounds the data path's (a 4-rank 57 MB all_reduce tags 171 MB per rank
and call; docs/results/backend.md). One core, data hot in cache (the data path tags a datagram
just read or about to be sent); the best of ``--repeats`` timings of ``--bytes`` each.

Run: python bench/seal_rate.py [--bytes 200000000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dlcp.hostagent import _datapath, sealing, wire

SIZES = {"1,428 B (MTU 1500)": 1428, "8,972 B (MTU 9000)": 8972, "65,507 B (loopback)": 65_507}
BUILDS = ("vaes512", "vaes256", "aesni", "portable")


def mac_rate(build: str, size: int, total: int, repeats: int) -> float | None:
    """GB/s of AEGISMAC-128X4 over datagrams of ``size`` bytes, or None if this CPU cannot run ``build``."""
    data = np.random.default_rng(1).integers(0, 256, size, np.uint8)
    n = max(1, total // size) if build != "portable" else max(1, total // size // 200)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        try:
            _datapath.aegis_mac(bytes(16), bytes(16), data, build, n)
        except ValueError:
            return None
        best = min(best, time.perf_counter() - t0)
    return n * size / best / 1e9


def seal_rate(protection: int, size: int, total: int, repeats: int) -> float:
    """GB/s of payload sealed by the compiled sealer (header + payload of ``size`` bytes, 64 rows a call)."""
    rows_n = 64
    rows = np.zeros((rows_n, size + wire.TRAILER_SIZE), np.uint8)
    rows[:, :wire.HEADER_SIZE] = np.frombuffer(wire.pack_header(wire.Header(ptype=wire.PacketType.DATA, job_id=1,
                                                                                   message_id=1)), np.uint8)
    lengths = np.full(rows_n, size, np.int64)
    sealer = sealing.new_sealer(bytes(16), protection)
    calls = max(1, total // (size * rows_n))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            sealing.seal_rows(sealer, rows, lengths)
        best = min(best, time.perf_counter() - t0)
    return calls * rows_n * size / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=int, default=200_000_000, help="bytes per timing (default 200 MB)")
    ap.add_argument("--repeats", type=int, default=5, help="timings per figure; the best is kept (default 5)")
    args = ap.parse_args()
    print(f"AEGISMAC build this CPU runs: {_datapath.MAC_TARGET}; AES-GCM: {sealing.library()}")
    print(f"{'GB/s, one core':<34}" + "".join(f"{k:>22}" for k in SIZES))
    for build in BUILDS:
        rates = [mac_rate(build, s, args.bytes, args.repeats) for s in SIZES.values()]
        cells = "".join(f"{'(not on this CPU)' if r is None else f'{r:.1f}':>22}" for r in rates)
        print(f"{'AEGISMAC-128X4, ' + build:<34}{cells}")
    for name, prot in (("seal, MAC (default)", sealing.MAC), ("seal, encrypted (AES-128-GCM)", sealing.ENCRYPT)):
        cells = "".join(f"{seal_rate(prot, s, args.bytes, args.repeats):>22.1f}" for s in SIZES.values())
        print(f"{name:<34}{cells}")


if __name__ == "__main__":
    main()
