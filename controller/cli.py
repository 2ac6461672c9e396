"""``dlcpctl``: install and inspect DLCP's switch configuration.

    dlcpctl apply NETWORK.yaml [--switch S] [--dry-run]   converge switches on the file
    dlcpctl diff NETWORK.yaml [--switch S]                 what apply would change
    dlcpctl show NETWORK.yaml SWITCH [TABLE]               installed entries
    dlcpctl stats NETWORK.yaml SWITCH [--json]             counters per port x queue, drops
    dlcpctl policy show [POLICY]                           the policy as switches see it
    dlcpctl policy set NETWORK.yaml KEY=VALUE ... [--save] change thresholds / priority map live
    dlcpctl queue-rate NETWORK.yaml SWITCH PORT CAPACITY [PRIORITY]
    dlcpctl shell NETWORK.yaml SWITCH                      p4runtime-shell on that switch

Exit codes: 0 success, 1 runtime error (switch unreachable, refused write), 2 usage error.
A user's mistake prints one line, never a traceback (``--debug`` shows it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import yaml
from p4.v1 import p4runtime_pb2

from dlcp.controller import desired
from dlcp.controller.apply import apply_network, load_program
from dlcp.controller.entries import TableEntry
from dlcp.controller.network import MAX_PORT, NetworkError, check_thresholds, load_network
from dlcp.controller import scheduler
from dlcp.controller.priority_queue import vq_params
from dlcp.controller.scheduler import parse_capacity
from dlcp.controller.switch import PORT_QUEUE_COUNTERS, ApplyReport, Switch
from dlcp.hostagent.clikit import GlobalOption, finish_parser, number, run_cli
from dlcp.hostagent.errors import UsageError
from dlcp.hostagent.policy import MAX_PRIORITIES, Policy, PolicyError, load_policy, save_policy
from dlcp.hostagent.ranges import Range

#: Seconds to wait for a switch: any positive time.
TIMEOUT = Range(0, lo_open=True)

#: Accepted before or after the sub-command (``dlcpctl --timeout 1 apply`` and ``dlcpctl apply --timeout 1``).
GLOBAL_OPTIONS: list[GlobalOption] = [
    (("--debug",), {"action": "store_true", "help": "show tracebacks and debug logs"}),
    (("--timeout",), {"type": number(TIMEOUT, float), "default": 5.0, "help": "seconds to wait for a switch"}),
]


def _print_reports(reports: list[ApplyReport], as_json: bool, verbose: bool) -> None:
    if as_json:
        print(json.dumps([r.as_dict() for r in reports], indent=2))
        return
    for r in reports:
        c = r.counts()
        verb = "would write" if r.dry_run else "wrote"
        pushed = "" if not r.pipeline_pushed else (" (pipeline would be pushed)" if r.dry_run else " (pipeline pushed)")
        print(f"{r.switch}: {verb} {r.writes} entries: {c['insert']} inserted, {c['modify']} modified, "
              f"{c['delete']} deleted{pushed}; {r.queue_settings} queue settings, {r.schedulers} port scheduler(s)")
        if verbose or r.dry_run:
            for ch in r.changes:
                print(f"  {ch.describe()}")


def cmd_apply(args: argparse.Namespace) -> int:
    net = load_network(args.network)
    _print_reports(apply_network(net, args.switch, dry_run=args.dry_run, timeout=args.timeout), args.json,
                   args.verbose)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    net = load_network(args.network)
    reports = apply_network(net, args.switch, dry_run=True, timeout=args.timeout)
    if args.json:
        print(json.dumps([r.as_dict() for r in reports], indent=2))
    else:
        for r in reports:
            head = " (pipeline differs: apply pushes it, then writes everything)" if r.pipeline_pushed else ""
            print(f"{r.switch}: {r.writes} change(s){head}")
            for ch in r.changes:
                print(f"  {ch.describe()}")
    return 0 if not any(r.writes or r.pipeline_pushed for r in reports) or not args.exit_code else 3


def cmd_show(args: argparse.Namespace) -> int:
    net = load_network(args.network)
    spec = net.switch(args.switch_name)
    schema, pipe = load_program()
    tables = [schema.table(args.table).name] if args.table else [t.name for t in schema.tables.values()]
    with Switch(spec, schema, pipe, timeout=args.timeout) as sw:
        entries = sw.read_entries(tables, with_defaults=[schema.table("ecn_threshold").name]
                                  if not args.table or schema.table(args.table).name.endswith("ecn_threshold") else [])
    if args.json:
        print(json.dumps([dataclasses.asdict(e) for e in entries], indent=2, default=str))
        return 0
    by_table: dict[str, list] = {}
    for e in entries:
        by_table.setdefault(e.table, []).append(e)
    for t in tables:
        rows = by_table.get(t, [])
        print(f"{t} ({len(rows)} entries)")
        for e in sorted(rows, key=lambda e: str(e.match)):
            print(f"  {e.describe()}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    net = load_network(args.network)
    spec = net.switch(args.switch_name)
    schema, pipe = load_program()
    with Switch(spec, schema, pipe, timeout=args.timeout) as sw:
        stats = sw.counters()
        stats["schedulers"] = {port: dataclasses.asdict(st) for port, st in sorted(sw.scheduler_stats().items())}
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print(f"switch {spec.name}: packets (bytes) per egress port and queue")
    head = "".join(f"{n.replace('_', ' '):>24}" for n in PORT_QUEUE_COUNTERS)
    print(f"{'port':>5}{'queue':>6}{head}")
    for row in stats["ports"]:
        cells = "".join(f"{row[n + '_pkts']:>12,} ({row[n + '_bytes']:>9,})" for n in PORT_QUEUE_COUNTERS)
        print(f"{row['port']:>5}{row['queue']:>6}{cells}")
    if not stats["ports"]:
        print("  (no traffic yet)")
    drops = ", ".join(f"{k}: {v:,}" for k, v in stats["drop_reasons"].items()) or "none"
    print(f"drops by reason: {drops}")
    received = ", ".join(f"{p}: {n:,}" for p, n in stats["received"].items()) or "none"
    print(f"frames received per ingress port: {received}")
    for port, st in stats["schedulers"].items():
        print(f"port {port}'s scheduler: sent {st['packets']:,} frames ({st['bytes']:,} bytes), "
              f"dropped {st['drops']:,}, queued now {st['qlen']:,}")
    return 0


def cmd_policy_show(args: argparse.Namespace) -> int:
    pol = load_policy(args.file) if args.file else Policy()
    view: dict[str, Any] = {
        "priority_map": {p: pol.priority_map[p] for p in range(pol.num_priorities)},
        "drop_thresholds": {cls: t for cls, t in enumerate(pol.drop_thresholds, start=1)},
        "ecn_threshold": pol.ecn_threshold,
        "ecn_backlog": pol.ecn_backlog,
        "lb_mode": pol.lb_mode,
    }
    if args.json:
        print(json.dumps(view, indent=2))
        return 0
    print("priority map (header priority -> switch queue):")
    print("  " + "  ".join(f"{p}->{q}" for p, q in view["priority_map"].items()))
    print("selective drop (drop class: dropped when the depth ahead exceeds, packets):")
    for cls, t in view["drop_thresholds"].items():
        print(f"  class {cls}: > {t}")
    print("  class 0: never (control packets and retransmissions too)")
    backlog = "the port's backlog (every priority)" if view["ecn_backlog"] == "port" else "the depth ahead"
    print(f"ECN: mark CE when {backlog} exceeds {view['ecn_threshold']}")
    print(f"load balancing of DLCP data packets: {view['lb_mode']}")
    return 0


def _parse_assignment(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise UsageError(f"expected KEY=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw)


def cmd_policy_set(args: argparse.Namespace) -> int:
    net = load_network(args.network)
    changes = dict(_parse_assignment(a) for a in args.assignments)
    try:
        policy = Policy.from_dict({**net.policy.to_dict(), **changes})
    except (PolicyError, TypeError) as exc:
        raise PolicyError(f"policy set: {exc}") from None
    new_net = dataclasses.replace(net, policy=policy)
    check_thresholds(new_net)
    reports = apply_network(new_net, args.switch, tables=desired.POLICY_TABLES, timeout=args.timeout)
    _print_reports(reports, args.json, verbose=True)
    if args.save:
        _save_policy(args.network, policy)
    return 0


def _save_policy(network_path: str, policy: Policy) -> None:
    with open(network_path) as f:
        data = yaml.safe_load(f)
    ref = data.get("policy")
    if isinstance(ref, str):
        path = ref if os.path.isabs(ref) else os.path.join(os.path.dirname(network_path), ref)
        save_policy(policy, path)
        print(f"saved the policy to {path}")
    else:
        data["policy"] = policy.to_dict()
        with open(network_path, "w") as f:
            yaml.safe_dump(data, f, sort_keys=False)
        print(f"saved the policy into {network_path}")


def cmd_queue_rate(args: argparse.Namespace) -> int:
    net = load_network(args.network)
    spec = net.switch(args.switch_name)
    if spec.ports and args.port not in spec.ports:
        raise NetworkError(f"switch {spec.name} has no port {args.port} in {args.network}; ports: {sorted(spec.ports)}")
    pps, bps = args.capacity
    schema, pipe = load_program()
    with Switch(spec, schema, pipe, timeout=args.timeout) as sw:
        if args.priority is None:
            # The port's capacity: its virtual queue and its scheduler follow it.
            port = spec.ports.get(args.port)
            if port is None or port.interface is None:
                raise NetworkError(f"switch {spec.name} port {args.port}: give it an `interface` in {args.network} "
                                   "(the scheduler of a bottleneck goes there)")
            port = dataclasses.replace(port, capacity_pps=pps, capacity_bps=bps)
            entry = TableEntry("vq_config", {"port": args.port}, "set_vq", vq_params(port))
            have = {e.key(): e for e in sw.read_entries([schema.table("vq_config").name])}
            kind = p4runtime_pb2.Update.MODIFY if entry.canonical(schema).key() in have else p4runtime_pb2.Update.INSERT
            sw.conn.write([p4runtime_pb2.Update(type=kind, entity=p4runtime_pb2.Entity(
                table_entry=entry.encode(schema)))])
            scheduler.install([port.scheduler()], spec.netns)
            print(f"{spec.name} port {args.port}: capacity {port.capacity_text()} (virtual queue and scheduler on "
                  f"{port.interface})")
        else:
            if bps:
                raise UsageError("a BMv2 priority queue's rate is in packets per second")
            sw.thrift.set_queue_rate(args.port, pps, args.priority)
            print(f"{spec.name} port {args.port} priority {args.priority}: BMv2 queue rate {pps} pps "
                  "(that queue only, on top of the port's scheduler; the virtual queue is unchanged)")
    return 0


def _capacity(text: str) -> tuple[int, int]:
    try:
        return parse_capacity(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_shell(args: argparse.Namespace) -> int:
    net = load_network(args.network)
    spec = net.switch(args.switch_name)
    cmd = [sys.executable, "-m", "p4runtime_sh", "--grpc-addr", spec.grpc, "--device-id", str(spec.device_id),
           "--election-id", "0,2"]
    return subprocess.call(cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlcpctl", description="Install and inspect DLCP switch configuration.",
                                     epilog="Exit codes: 0 ok, 1 runtime error, 2 usage error.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("apply", help="converge switches on a network file (idempotent)")
    p.add_argument("network")
    p.add_argument("--switch", action="append", help="only this switch (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="show what would change, write nothing")
    p.add_argument("--json", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true", help="list every change")
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser("diff", help="what apply would change")
    p.add_argument("network")
    p.add_argument("--switch", action="append")
    p.add_argument("--json", action="store_true")
    p.add_argument("--exit-code", action="store_true", help="exit 3 when there are differences")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("show", help="entries installed on a switch")
    p.add_argument("network")
    p.add_argument("switch_name", metavar="SWITCH")
    p.add_argument("table", nargs="?", metavar="TABLE")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("stats", help="counters per egress port x queue, and drops by reason")
    p.add_argument("network")
    p.add_argument("switch_name", metavar="SWITCH")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_stats)

    pol = sub.add_parser("policy", help="the policy as switches see it; change it live")
    psub = pol.add_subparsers(dest="action", metavar="ACTION")
    p = psub.add_parser("show", help="print what a policy tells the switches (defaults without FILE)")
    p.add_argument("file", nargs="?")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_policy_show)
    p = psub.add_parser("set", help="change policy fields on running switches, e.g. ecn_threshold=10 "
                                    "drop_thresholds=[30,20,10]")
    p.add_argument("network")
    p.add_argument("assignments", nargs="+", metavar="KEY=VALUE")
    p.add_argument("--switch", action="append")
    p.add_argument("--save", action="store_true", help="also write the new policy back to the file")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_policy_set)

    p = sub.add_parser("queue-rate", help="set a port's capacity (or one priority queue's BMv2 rate)")
    p.add_argument("network")
    p.add_argument("switch_name", metavar="SWITCH")
    p.add_argument("port", type=number(Range(0, MAX_PORT)), help=f"switch port, 0..{MAX_PORT}")
    p.add_argument("capacity", type=_capacity, metavar="CAPACITY",
                   help="packets per second (600) or bits per second on the wire (7.4mbit)")
    p.add_argument("priority", type=number(Range(0, MAX_PRIORITIES - 1)), nargs="?", metavar="PRIORITY",
                   help=f"one priority queue, 0..{MAX_PRIORITIES - 1} (default: the port's capacity: its virtual "
                        "queue and every priority queue)")
    p.set_defaults(func=cmd_queue_rate)

    p = sub.add_parser("shell", help="an interactive p4runtime-shell attached to a switch")
    p.add_argument("network")
    p.add_argument("switch_name", metavar="SWITCH")
    p.set_defaults(func=cmd_shell)
    return finish_parser(parser, GLOBAL_OPTIONS)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(build_parser(), argv, "dlcpctl")


if __name__ == "__main__":
    sys.exit(main())
