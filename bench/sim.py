"""How long `dlcp sim` takes for the issue's scale target, per scheme.

Target (issue 12): a 144-host leaf-spine (9 leaves x 16 hosts, 4 spines), 10 Gb/s host links,
one ResNet-50-profile iteration for every host plus background traffic at 50 % load, in at most
10 minutes on this machine. Prints, per scheme: simulated seconds, ns-3 events, wall seconds,
events per second, CPU seconds over wall seconds (CPU / wall well below 1 means the machine, not
the simulator, set the pace: the figure does not count) and the training result itself.

Defaults are the target's workload with jumbo frames (--mtu 9000) and port buffers of the same
bytes as 100 packets of 1500 (--buffer 17): the event count grows with packets, not bytes.
`--mtu 1500 --buffer 100` runs the same bytes in six times the packets.

Run: python bench/sim.py [--scale 1] [--mtu 9000] [--buffer 17] [--schemes dlcp,baseline] [--out FILE]
(needs `pip install -e '.[sim]'`; ns-3 is compiled against before anything is timed)
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

from dlcp_sim.build import simulator
from dlcp_sim.run import simulate
from dlcp_sim.scenario import SimOptions
from dlcp.hostagent.tables import Column, Record, Table
from dlcp.hostagent.policy import PATTERNS

TARGET_S = 600.0


def _cpu() -> float:
    """CPU seconds of this process (writing the scenario, reading the report) and its children
    (the simulator)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + ru.ru_utime + ru.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0,
                    help="ResNet-50's tensors times this (default 1: the whole model)")
    ap.add_argument("--mtu", type=int, default=9000)
    ap.add_argument("--buffer", type=int, default=17,
                    help="switch port buffer in packets (default 17: 153 KB at MTU 9000)")
    ap.add_argument("--background-load", type=float, default=0.5)
    ap.add_argument("--pattern", default="ps", choices=PATTERNS)
    ap.add_argument("--schemes", default="dlcp,baseline")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, metavar="FILE",
                    help="also keep the table with the command and commit as JSON (dlcp report FILE prints it)")
    args = ap.parse_args()

    schemes = tuple(s for s in args.schemes.split(",") if s)
    opts = SimOptions(leaves=9, hosts_per_leaf=16, spines=4, link_gbps=10, uplink_gbps=40, jobs=0,
                      scale=args.scale, iterations=1, background_load=args.background_load, mtu=args.mtu,
                      buffer=args.buffer, pattern=args.pattern, seed=args.seed, schemes=schemes)
    record = Record.start("python bench/sim.py")
    simulator()  # compile first, outside the timing
    title = (f"{opts.hosts} hosts, {len(opts.placement())} {opts.pattern} jobs, resnet50 x {opts.scale:g}, "
             f"MTU {opts.mtu}, buffer {opts.buffer} packets, background load {opts.background_load:g}, "
             f"seed {opts.seed}; target <= {TARGET_S:.0f} s per scheme")
    print(record.header() + title)
    table = Table(title, [Column("scheme"), Column("simulated s", "{:.3f}"), Column("events", "{:,}"),
                          Column("wall s", "{:.1f}"), Column("events/s", "{:.0f}"), Column("cpu/wall", "{:.2f}"),
                          Column("load", "{:.2f}"), Column("sync p50 ms", "{:.1f}"), Column("flows"),
                          Column("verdict", left=True)],
                  notes=["load: the 1-minute load average before the scheme ran; cpu/wall well below 1 means the "
                         "machine, not the simulator, set the pace (the row does not count)."])
    for scheme in schemes:
        load = os.getloadavg()[0]
        cpu0, t0 = _cpu(), time.monotonic()
        r = simulate(opts, scheme, timeout=6 * 3600)
        wall, cpu = time.monotonic() - t0, _cpu() - cpu0
        s = r.summary()
        verdict = "within target" if wall <= TARGET_S else f"over by {wall - TARGET_S:.0f} s"
        if cpu < 0.9 * wall:
            verdict += " (the machine was busy: does not count)"
        table.add(scheme, r.simulated_s, r.events, wall, r.events / r.wall_s, cpu / wall, load, s["sync_p50_ms"],
                  len(r.flows), verdict)
        print(f"   {scheme}: {wall:.1f} s, {verdict}", flush=True)
        record.keep(args.out, [table])
    print(table.text())


if __name__ == "__main__":
    main()
