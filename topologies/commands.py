"""The testbed's sub-commands of ``dlcp``: run, sweep, calibrate, converge and clean.

Each layer registers its own commands, so the program (:mod:`dlcp.cli`) sits above them all and
this package needs nothing from the simulator above it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dlcp.hostagent.clikit import number
from dlcp.hostagent.errors import DlcpUserError
from dlcp.hostagent.policy import Policy, PolicyError, load_policy
from dlcp.topologies.options import WORKLOADS, add_shared_arguments, checked
from dlcp.topologies.topos import HOST_PORTS

if TYPE_CHECKING:
    from dlcp.topologies.runner import RunOptions


def run_options(args: argparse.Namespace) -> RunOptions:
    """The run the options describe; the policy file is read here, its loss bound and ECN rule
    overridden by ``--loss-bound`` and ``--ecn-backlog`` when they are given."""
    from dlcp.topologies.runner import RunOptions

    policy = args.policy
    loss_bound = args.loss_bound if args.loss_bound is not None else (
        policy.loss_bound_push if policy else RunOptions.loss_bound)
    ecn_backlog = args.ecn_backlog or (policy.ecn_backlog if policy else RunOptions.ecn_backlog)
    return RunOptions(topology=args.topology, workers=args.workers,
                      schemes=tuple(s.strip() for s in args.scheme.split(",") if s.strip()),
                      iterations=args.iterations, workload=args.workload, pattern=args.pattern, scale=args.scale,
                      compute_ms=args.compute_ms, **_capacity_options(args.capacity, RunOptions.mtu),
                      buffer=args.buffer, ecn_backlog=ecn_backlog, loss_bound=loss_bound, policy=policy,
                      cross_traffic=args.cross_traffic == "on", cross_rate=args.cross_rate,
                      cross_priority=args.cross_priority, fusion=args.fusion == "on", repeat=args.repeat,
                      first_repeat=args.first_repeat,
                      calibration_iterations=args.calibration_iterations, strict=args.strict, out=args.out,
                      quiet=args.quiet, target_accuracy=args.target_accuracy, eval_every=args.eval_every,
                      timeout=args.timeout, reference=args.reference,
                      host_ports=args.host_ports, host_tcp=args.host_tcp)


def cmd_run(args: argparse.Namespace) -> int:
    from dlcp.topologies.report import summary
    from dlcp.topologies.runner import run

    opts = run_options(args)
    if args.capacity == "auto":
        opts = replace(opts, capacity_pps=_calibrated(opts))
    run_dir, results = run(opts)
    print(summary(results))
    print(f"run directory: {run_dir} (results.json, summary.txt, *.png, logs)")
    invalid = [s["scheme"] for s in results["runs"] if not (s.get("validity") or {}).get("valid", True)]
    if invalid and opts.strict:
        print(f"dlcp: error: invalid run(s) of {', '.join(sorted(set(invalid)))} (--strict); see the reasons above",
              file=sys.stderr)
        return 3
    return 0


def _calibrated(opts: RunOptions) -> int:
    """The largest capacity at which runs stay valid, its trials reported on stderr."""
    from dlcp.topologies.sweep import calibrate

    cap, trials = calibrate(opts)
    for t in trials:
        verdict = "valid" if t["valid"] else "invalid: " + "; ".join(t["reasons"])
        print(f"capacity {t['capacity_pps']:>5} pps: {verdict}", file=sys.stderr)
    if cap is None:
        raise DlcpUserError("no capacity tried gives valid runs on this machine (see the reasons above); "
                            "try fewer workers or --cross-traffic off")
    print(f"calibrated: {opts.topology} stays valid up to {cap} pps per bottleneck on this machine", file=sys.stderr)
    return cap


def cmd_calibrate(args: argparse.Namespace) -> int:
    _calibrated(run_options(args))
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from dlcp.topologies.sweep import check_values, sweep, sweep_request

    opts = run_options(args)
    param, values = sweep_request(args.param, args.values, args.sweep)
    param = param.replace("_", "-")  # the testbed's parameters are named as its options
    check_values(opts, param, values)  # every value, before calibration starts switches
    if args.capacity == "auto":
        opts = replace(opts, capacity_pps=_calibrated(opts))
    out, rows = sweep(opts, param, values)
    width = max(len(r["value"]) for r in rows)
    for r in rows:
        ci = (f" [{r['speedup_ci_low']:.2f}, {r['speedup_ci_high']:.2f}]" if r.get("speedup_ci_low") is not None
              else "")
        sp = f"{r['speedup']:.2f}x{ci}" if r.get("speedup") is not None else "-"
        print(f"{param}={r['value']:<{width}}  {r['scheme']:<9} valid {r['valid_runs']}/{r['runs']}  "
              f"speedup {sp}  sync p50 {r['sync_p50_ms']:.0f} ms  p99 {r['sync_p99_ms']:.0f} ms  {r['verdict']}")
    print(f"sweep directory: {out} (sweep.csv, sweep.png, one run directory per value)")
    invalid = any(r["valid_runs"] < r["runs"] for r in rows)
    return 3 if invalid and opts.strict else 0


def cmd_clean(args: argparse.Namespace) -> int:
    from dlcp.topologies.clean import clean

    removed = clean()
    print(f"removed {removed['processes']} processes, {removed['schedulers']} port schedulers, "
          f"{removed['namespaces']} namespaces, {removed['links']} links")
    return 0


def _capacity_options(text: str, mtu: int) -> dict:
    """``capacity_pps`` and ``capacity_bps`` of a ``--capacity``: ``600`` (packets per second),
    ``7.4mbit`` (bits per second on the wire; ``capacity_pps`` is then the full-size frames per
    second it carries), or ``auto`` (calibrated later; 2000 until then)."""
    from dlcp.controller.scheduler import charge, parse_capacity

    if text == "auto":
        return {"capacity_pps": 2000, "capacity_bps": 0}
    pps, bps = parse_capacity(text)
    if bps:
        return {"capacity_pps": max(1, round(bps / 8 / charge(True, mtu).slot)), "capacity_bps": bps}
    return {"capacity_pps": pps, "capacity_bps": 0}


def _capacity(text: str) -> str:
    """``--capacity``: packets per second in the run's range, bits per second (``7.4mbit``) that
    carry as many full-size frames, or ``auto``."""
    from dlcp.topologies.runner import RANGES

    if text == "auto":
        return text
    if not text.strip().lower().endswith("bit"):
        number(RANGES["capacity_pps"])(text.strip().lower().removesuffix("pps"))
        return text
    try:
        pps = _capacity_options(text, 1500)["capacity_pps"]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if pps not in RANGES["capacity_pps"]:
        raise argparse.ArgumentTypeError(f"{text} carries {pps} full-size frames per second; the testbed takes "
                                         f"{RANGES['capacity_pps']}")
    return text


def _policy_file(path: str) -> Policy:
    """``--policy``: the file read and checked as it is parsed, so a bad one fails before anything starts."""
    try:
        return load_policy(path)
    except PolicyError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _checked(field: str, kind: type = int) -> Callable[[str], Any]:
    """The parse-time check of a :class:`RunOptions` field's option, from its one range."""
    from dlcp.topologies.runner import RANGES

    return checked(RANGES, field, kind)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The options of one testbed experiment (shared by run, sweep and calibrate); defaults are
    :class:`RunOptions`' and every number is checked against its :data:`RANGES` as it is parsed."""
    from dlcp.topologies.runner import RANGES, RunOptions

    d = RunOptions()
    p.add_argument("--topology", choices=["star", "dumbbell", "leafspine"], default=d.topology)
    p.add_argument("--workers", type=_checked("workers"), default=d.workers)
    p.add_argument("--scheme", default=",".join(d.schemes),
                   help="comma-separated: baseline, dlcp, lb, prio, drop, bounded (DLCP's transport), gloo, "
                        "gloo-fp16, powersgd (stock DDP over gloo, with PyTorch's fp16 or PowerSGD hook, on "
                        "baseline's fabric), gloo-ecn, gloo-dctcp (gloo over TCP with ECN: the host's congestion "
                        "control, or DCTCP); dlcp-backend (the same stock-DDP script over "
                        "init_process_group(\"dlcp\"), its defaults, on dlcp's fabric; training workloads); "
                        "SCHEME-fp16 (dlcp-fp16) sends a DLCP scheme's gradients as float16; "
                        "SCHEME:ps or SCHEME:ring names its pattern (stock DDP: always ring)")
    p.add_argument("--reference", default=d.reference, metavar="SCHEME",
                   help="the scheme speedups and the default accuracy target are against (default: gloo when "
                        "it runs, else baseline)")
    add_shared_arguments(p, d, RANGES, WORKLOADS, policy_file=True)
    p.add_argument("--capacity", type=_capacity, default=str(d.capacity_pps),
                   help="bottleneck capacity: packets per second (600: every frame one slot), bits per second on "
                        "the wire (7.4mbit: every frame its bytes, so an ACK costs an ACK), or auto: the largest valid "
                        "on this machine, in packets (dlcp calibrate)")
    p.add_argument("--policy", type=_policy_file, default=None, metavar="FILE",
                   help="a policy file (YAML or JSON, as dlcp policy check reads): each scheme keeps what of it "
                        "that scheme turns on (default: DLCP's defaults, thresholds from --buffer)")
    p.add_argument("--cross-traffic", choices=["on", "off"], default="on" if d.cross_traffic else "off")
    p.add_argument("--cross-rate", type=_checked("cross_rate", float), default=d.cross_rate,
                   help="UDP cross traffic while on, as a fraction of the bottleneck capacity")
    p.add_argument("--cross-priority", type=_checked("cross_priority"), default=d.cross_priority, metavar="QUEUE",
                   help="switch queue of the cross traffic under priority queueing (default: best effort, 0)")
    p.add_argument("--calibration-iterations", type=_checked("calibration_iterations"),
                   default=d.calibration_iterations,
                   help="communication-only iterations for the ordering efficiency E")
    p.add_argument("--host-ports", choices=list(HOST_PORTS), default=d.host_ports,
                   help="the workers' and the server's own switch ports: free (only the topology's bottlenecks "
                        "are limited) or capped (bottlenecks of --capacity too: every job host gets a link of the "
                        f"rate DLCP's hosts are configured for, and a server's incast queues; default: {d.host_ports})")
    p.add_argument("--host-tcp", default=d.host_tcp, metavar="CC",
                   help="TCP congestion control of every host: gloo's connections, the TCP cross traffic, "
                        f"DLCP's control connections (default: {d.host_tcp}, Linux's default)")
    p.add_argument("--first-repeat", type=_checked("first_repeat"), default=d.first_repeat, metavar="N",
                   help="number the repetitions from N (their seeds and source ports): a later run adds "
                        "repetitions N, N+1, ... to an earlier one's 0..N-1, and dlcp report --merge pairs them "
                        f"all (default: {d.first_repeat})")
    p.add_argument("--strict", action="store_true",
                   help="exit with code 3 when a run is invalid (machine saturated, bottleneck below capacity)")
    p.add_argument("--fusion", choices=["on", "off"], default="on" if d.fusion else "off",
                   help="pack tensors into DDP-style buckets scaled by --scale (off: one message per tensor)")
    p.add_argument("--target-accuracy", type=_checked("target_accuracy", float), default=d.target_accuracy,
                   help="training workloads: the accuracy whose time-to-accuracy is reported (default: the "
                        "reference scheme's final accuracy in the same repetition minus 0.5 points; "
                        "repetitions train from seeds 0, 1, ...)")
    p.add_argument("--eval-every", type=_checked("eval_every"), default=d.eval_every,
                   help="training workloads: evaluate the test set every this many iterations "
                        "(default: iterations / 20)")
    p.add_argument("--timeout", type=_checked("timeout", float), default=d.timeout,
                   help="seconds one scheme's run may take before it is stopped as failed "
                        "(real training at a low capacity needs more)")
    p.add_argument("--out", default=d.out, help="parent of the run directory")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def add_experiment_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add run, sweep, calibrate and converge to ``dlcp``'s sub-commands."""
    p = sub.add_parser("run", help="run an experiment on a Mininet testbed of BMv2 switches (root)")
    add_run_arguments(p)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("sweep", help="vary one parameter across schemes: sweep.csv and a speedup figure (root)")
    from dlcp.topologies.sweep import PARAMS

    p.add_argument("--param", choices=sorted(PARAMS), help="the parameter to vary")
    p.add_argument("--values",
                   help="comma-separated values, e.g. 0,0.25,0.5; each is checked before anything starts")
    p.add_argument("--sweep", metavar="PARAM=V1,V2,...",
                   help="the same in one option, as dlcp sim takes it (e.g. cross-rate=0,0.25,0.5)")
    add_run_arguments(p)
    p.set_defaults(func=cmd_sweep)
    p = sub.add_parser("calibrate", help="the largest bottleneck capacity at which runs stay valid here (root)")
    add_run_arguments(p)
    p.set_defaults(func=cmd_calibrate)
    p = sub.add_parser("converge", help="final accuracy and time-to-accuracy under bounded loss, over seeds, "
                       "on loopback (real training; no root)")
    from dlcp.topologies.converge_run import add_converge_arguments, cmd_converge

    add_converge_arguments(p)
    p.set_defaults(func=cmd_converge)


def add_clean_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add clean to ``dlcp``'s sub-commands (listed last in ``--help``, after the simulator's)."""
    p = sub.add_parser("clean", help="remove leftovers of a crashed run (processes, namespaces, links)")
    p.set_defaults(func=cmd_clean)
