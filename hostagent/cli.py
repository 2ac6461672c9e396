"""``dlcp``: the host-side command line (demo, experiment runner, cleanup, policy, wire format).

Library code never prints or exits; this module is where results become text and
exceptions become exit codes: a :class:`~hostagent.errors.DlcpUserError` prints one line on
stderr (exit 2 for usage, 1 otherwise); anything else prints one line and the log path, with
the traceback under ``--debug``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from hostagent import wire
from hostagent.errors import DlcpUserError, UsageError
from hostagent.policy import Policy, load_policy

log = logging.getLogger("dlcp")


def _policy_from(path: str | None) -> Policy:
    return load_policy(path) if path else Policy()


def cmd_demo(args: argparse.Namespace) -> int:
    from hostagent import demo

    print(demo.run(load=args.load, capacity=args.capacity, seed=args.seed))
    return 0


def cmd_policy_show(args: argparse.Namespace) -> int:
    pol = _policy_from(args.file)
    if args.json:
        print(json.dumps(pol.to_dict(), indent=2))
    else:
        width = max(len(k) for k in pol.to_dict())
        for key, value in pol.to_dict().items():
            print(f"{key:<{width}}  {value}")
    return 0


def cmd_policy_check(args: argparse.Namespace) -> int:
    load_policy(args.file)
    print(f"{args.file}: valid policy")
    return 0


def cmd_wire(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps({"udp_port": wire.DLCP_UDP_PORT, "header_bytes": wire.HEADER_SIZE,
                          "fields": [{"name": f.name, "bits": f.bits, "doc": f.doc} for f in wire.FIELDS]}, indent=2))
        return 0
    print(f"DLCP header v{wire.VERSION}: {wire.HEADER_SIZE} bytes, network byte order, UDP port {wire.DLCP_UDP_PORT}")
    print(f"{'offset':>6}  {'bits':>4}  {'field':<12} meaning")
    offset = 0
    for f in wire.FIELDS:
        print(f"{offset:>6}  {f.bits:>4}  {f.name:<12} {f.doc}")
        offset += f.bits // 8
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from topologies.report import summary
    from topologies.runner import RunOptions, run

    opts = RunOptions(topology=args.topology, workers=args.workers,
                      schemes=tuple(s.strip() for s in args.scheme.split(",") if s.strip()),
                      iterations=args.iterations, workload=args.workload, pattern=args.pattern, scale=args.scale,
                      compute_ms=args.compute_ms, capacity_pps=args.capacity, buffer=args.buffer,
                      cross_traffic=args.cross_traffic == "on", fusion=args.fusion == "on", out=args.out,
                      quiet=args.quiet)
    run_dir, results = run(opts)
    print(summary(results))
    print(f"run directory: {run_dir} (results.json, summary.txt, *.png, logs)")
    return 0


def cmd_clean(args: argparse.Namespace) -> int:
    from topologies.clean import clean

    removed = clean()
    print(f"removed {removed['processes']} processes, {removed['namespaces']} namespaces, {removed['links']} links")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlcp", description="DLCP host tools: demo, policy, wire format.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("demo", help="packetize a real gradient, drop by class at a modelled congested port, reassemble")
    p.add_argument("--load", type=float, default=1.25, help="offered load as a multiple of the port's capacity")
    p.add_argument("--capacity", type=int, default=64, help="queue capacity in packets (BMv2's default is 64)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo)

    pol = sub.add_parser("policy", help="show or check a policy file").add_subparsers(dest="action", metavar="ACTION")
    p = pol.add_parser("show", help="print a policy (the defaults when no file is given)")
    p.add_argument("file", nargs="?")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_policy_show)
    p = pol.add_parser("check", help="validate a policy file")
    p.add_argument("file")
    p.set_defaults(func=cmd_policy_check)

    p = sub.add_parser("run", help="run an experiment on a Mininet testbed of BMv2 switches (root)")
    p.add_argument("--topology", choices=["star", "dumbbell", "leafspine"], default="star")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--scheme", default="baseline,dlcp",
                   help="comma-separated: baseline, dlcp, lb, prio, drop, bounded (default baseline,dlcp)")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--workload", choices=["resnet50", "vgg16", "transformer", "digits"], default="resnet50",
                   help="synthetic gradients with this model's per-tensor sizes, or real training on digits")
    p.add_argument("--pattern", choices=["ps", "ring"], default="ps")
    p.add_argument("--scale", type=float, default=0.002, help="multiply every tensor's size (default 0.002)")
    p.add_argument("--compute-ms", type=float, default=500.0, help="simulated backward time per iteration (synthetic workloads)")
    p.add_argument("--capacity", type=int, default=2000, help="bottleneck capacity, packets per second")
    p.add_argument("--buffer", type=int, default=64, help="bottleneck buffer, packets")
    p.add_argument("--cross-traffic", choices=["on", "off"], default="on")
    p.add_argument("--fusion", choices=["on", "off"], default="on",
                   help="pack tensors into DDP-style buckets scaled by --scale (off: one message per tensor)")
    p.add_argument("--out", default="runs", help="parent of the run directory (default ./runs)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("clean", help="remove leftovers of a crashed run (processes, namespaces, links)")
    p.set_defaults(func=cmd_clean)

    p = sub.add_parser("wire", help="print the DLCP header layout")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_wire)
    return parser


def run_cli(parser: argparse.ArgumentParser, argv: Sequence[str] | None, name: str) -> int:
    """Parse, dispatch and turn exceptions into exit codes; shared by ``dlcp`` and ``dlcpctl``."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return UsageError.exit_code
    try:
        return func(args)
    except DlcpUserError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: one line for the user, the traceback in the log
        if args.debug:
            raise
        log_path = Path(tempfile.gettempdir()) / f"{name}-error.log"
        logging.getLogger(name).addHandler(logging.FileHandler(log_path))
        logging.getLogger(name).exception("unexpected error")
        print(f"{name}: unexpected error: {exc!r} (traceback in {log_path}; rerun with --debug)", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(build_parser(), argv, "dlcp")


if __name__ == "__main__":
    sys.exit(main())
