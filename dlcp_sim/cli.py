"""``dlcp sim``: the same schemes as ``dlcp run``, on an ns-3 leaf-spine instead of BMv2."""

from __future__ import annotations

import argparse
import time
from dataclasses import fields
from pathlib import Path
from collections.abc import Callable
from typing import Any

from dlcp_sim.scenario import HOST_MODELS, JOB_PLACEMENTS, RANGES, TCP_VARIANTS, SimOptions
from dlcp.hostagent.errors import UsageError
from dlcp.hostagent.provenance import provenance
from dlcp.topologies.progress import Progress
from dlcp.topologies.options import SYNTHETIC_WORKLOADS, add_shared_arguments, checked


def _checked(field: str, kind: type = int) -> Callable[[str], Any]:
    """The parse-time check of a :class:`SimOptions` field's option, from its one range."""
    return checked(RANGES, field, kind)


def add_sim_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add sim to ``dlcp``'s sub-commands; the simulator registers its own, so nothing below imports it."""
    p = sub.add_parser("sim", help="the same schemes on an ns-3 leaf-spine at data-centre scale "
                       "(needs pip install -e '.[sim]')")
    add_sim_arguments(p)
    p.set_defaults(func=cmd_sim)


def add_sim_arguments(p: argparse.ArgumentParser) -> None:
    """``dlcp sim``'s options: defaults are :class:`SimOptions`', numbers checked against its RANGES as parsed."""
    d = SimOptions()
    p.add_argument("--leaves", type=_checked("leaves", int), default=d.leaves)
    p.add_argument("--spines", type=_checked("spines", int), default=d.spines)
    p.add_argument("--hosts-per-leaf", type=_checked("hosts_per_leaf", int), default=d.hosts_per_leaf)
    p.add_argument("--link-gbps", type=_checked("link_gbps", float), default=d.link_gbps, help="host links' rate")
    p.add_argument("--uplink-gbps", type=_checked("uplink_gbps", float), default=d.uplink_gbps,
                   help="leaf-spine links' rate (default: 0, as --link-gbps)")
    p.add_argument("--link-delay-us", type=_checked("link_delay_us", float), default=d.link_delay_us,
                   help="every link's delay")
    add_shared_arguments(p, d, RANGES, SYNTHETIC_WORKLOADS, policy_file=False)
    p.add_argument("--workers", type=_checked("workers", int), default=d.workers, help="workers per job")
    p.add_argument("--jobs", type=_checked("jobs", int), default=d.jobs, help="jobs at once; 0 fills the hosts")
    p.add_argument("--jobs-placement", choices=JOB_PLACEMENTS, default=d.jobs_placement,
                   help="jobs take hosts over the leaves in turn (spread) or leaf by leaf (packed)")
    p.add_argument("--warmup", type=_checked("warmup", int), default=d.warmup,
                   help="first iterations left out of the statistics")
    p.add_argument("--mtu", type=_checked("mtu", int), default=d.mtu)
    p.add_argument("--host-model", choices=HOST_MODELS, default=d.host_model,
                   help="hosts' rate-control loop: dctcp (reports every 16 packets, default) or agent (the host "
                        "agent's report timers, cuts and timed increase: what the testbed runs)")
    p.add_argument("--background-load", type=_checked("background_load", float), default=d.background_load,
                   help="background TCP flows (web-search sizes) offered per host, fraction of its link")
    p.add_argument("--background-tcp", choices=TCP_VARIANTS, default=d.background_tcp,
                   help="the background flows' TCP")
    p.add_argument("--gradient-tcp", choices=TCP_VARIANTS, default=d.gradient_tcp,
                   help="the tcp scheme's congestion control for gradients (default dctcp, with ECN)")
    p.add_argument("--background-ms", type=_checked("background_ms", float), default=d.background_ms,
                   help="flows start during this many ms (default: about as long as training lasts)")
    p.add_argument("--control-bytes", type=_checked("control_bytes", int), default=d.control_bytes,
                   help="wire size of control packets (default: 0, meaning 60 bytes); the datagram size models "
                        "the testbed's BMv2 ports, which serve packets, not bytes")
    p.add_argument("--host-delay-us", type=_checked("host_delay_us", float), default=d.host_delay_us,
                   help="hosts' software path: sends start and control packets leave this much later (default 0; the "
                        "testbed's agents: see the README's validation)")
    p.add_argument("--tcp-min-rto-us", type=_checked("tcp_min_rto_us", float), default=d.tcp_min_rto_us,
                   help="TCP's minimum retransmission timeout, us (its delayed ACK: a fifth); Linux hosts, as on "
                        "the testbed: 200000")
    p.add_argument("--tcp-ack-every", type=_checked("tcp_ack_every", int), default=d.tcp_ack_every,
                   help="TCP receivers ACK every this many segments (default 2, delayed ACKs; nearest gloo's "
                        "receivers on the testbed: 1)")
    p.add_argument("--host-rate-gbps", type=float, default=d.host_rate_gbps, metavar="GBPS",
                   help="the link rate DLCP's hosts are configured for (their line rate); 0: their own link's "
                        "(the testbed configures its hosts for the fabric's rate)")
    p.add_argument("--wire-framing", action="store_true",
                   help="every packet on an uplink costs its Ethernet frame on the wire (header, FCS, preamble, "
                        "gap: 38 bytes more, at least 84), as on the testbed's ports with a capacity in bits/s")
    p.add_argument("--packet-slots", action="store_true",
                   help="every packet on an uplink costs a full packet's time (an ACK too), as on the testbed's "
                        "BMv2 ports, limited in packets per second")
    p.add_argument("--scheme", default="baseline,dlcp",
                   help="comma-separated, as for dlcp run, and tcp: the baseline's messages over TCP connections "
                   "(with --gradient-tcp; tcp-dctcp, tcp-cubic, tcp-newreno name the variant)")
    p.add_argument("--seed", type=_checked("seed", int), default=d.seed, help="first seed")
    p.add_argument("--out", default=None, help="directory for results.json")
    p.add_argument("--sweep", default=None, metavar="OPTION=V1,V2,...",
                   help="run once per value of one option (e.g. background_load=0.2,0.5,0.8 or leaves=1,4,9) and "
                        "write sweep.csv, sweep.md and sweep.png in --out")
    p.add_argument("--param", default=None, metavar="OPTION", help="the same as --sweep, as dlcp sweep takes it: "
                   "the option to vary (with --values)")
    p.add_argument("--values", default=None, metavar="V1,V2,...", help="the values of --param")


def cmd_sim(args: argparse.Namespace) -> int:
    from dlcp_sim.run import run, table

    given = {f.name: getattr(args, f.name) for f in fields(SimOptions) if f.name != "schemes"}
    opts = SimOptions(**given, schemes=tuple(s.strip() for s in args.scheme.split(",") if s.strip()))
    t0 = time.monotonic()
    if args.sweep or args.param or args.values:
        from dlcp_sim.sweep import parse_sweep, sweep
        from dlcp.topologies.sweep import sweep_request

        param, vals = sweep_request(args.param, args.values, args.sweep)
        name, values = parse_sweep(f"{param}={','.join(vals)}")
        if not args.out:
            raise UsageError("--sweep writes sweep.csv, sweep.md and sweep.png: give --out DIR")
        rows = sweep(opts, name, values, args.repeat, Path(args.out),
                     Progress(len(values) * args.repeat * len(opts.schemes)),
                     provenance(time.strftime("%Y-%m-%d %H:%M:%S %Z")))
        print((Path(args.out) / "sweep.md").read_text(), end="")
        print(f"{len(rows)} rows in {args.out}/sweep.csv, figure {args.out}/sweep.png ({time.monotonic() - t0:.1f} s)")
        return 0
    results = run(opts, args.repeat, Path(args.out) if args.out else None,
                  provenance(time.strftime("%Y-%m-%d %H:%M:%S %Z")), Progress(args.repeat * len(opts.schemes)))
    print(f"{opts.hosts} hosts ({opts.leaves} leaves x {opts.hosts_per_leaf}, {opts.spines} spines), "
          f"{len(opts.placement())} {opts.pattern} job(s) of {opts.workers} workers, {opts.workload} x {opts.scale:g}, "
          f"{opts.iterations} iterations, {opts.link_gbps:g}/{opts.uplink_rate_gbps:g} Gb/s host/uplinks, "
          f"buffer {opts.buffer}, background load {opts.background_load:g} ({opts.background_tcp}), "
          f"{args.repeat} seed(s)")
    print(table(results))
    print(f"({time.monotonic() - t0:.1f} s)")
    return 0
