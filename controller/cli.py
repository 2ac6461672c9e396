"""``dlcpctl``: install and inspect DLCP's switch configuration.

This is the operator's view of the policy: what every switch will be told. The commands that
talk to switches (apply, diff, show, stats, queue-rate, shell) come with the P4Runtime
controller.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from hostagent.cli import run_cli
from hostagent.policy import Policy, load_policy


def switch_view(policy: Policy) -> dict:
    """The policy facts a switch acts on, keyed as the switch tables name them."""
    return {
        "priority_map": {p: policy.priority_map[p] for p in range(policy.num_priorities)},
        "drop_thresholds": {cls + 1: t for cls, t in enumerate(policy.drop_thresholds)},
        "ecn_threshold": policy.ecn_threshold,
        "lb_mode": policy.lb_mode,
    }


def cmd_policy_show(args: argparse.Namespace) -> int:
    view = switch_view(load_policy(args.file) if args.file else Policy())
    if args.json:
        print(json.dumps(view, indent=2))
        return 0
    print("priority map (header priority -> switch queue):")
    print("  " + "  ".join(f"{p}->{q}" for p, q in view["priority_map"].items()))
    print("selective drop (drop class: dropped when queue depth > packets):")
    for cls, t in view["drop_thresholds"].items():
        print(f"  class {cls}: > {t}")
    print("  class 0: never (control packets and retransmissions too)")
    print(f"ECN: mark CE when queue depth > {view['ecn_threshold']}")
    print(f"load balancing of DLCP data packets: {view['lb_mode']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlcpctl", description="Install and inspect DLCP switch configuration.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    pol = sub.add_parser("policy", help="the policy as the switches see it").add_subparsers(dest="action", metavar="ACTION")
    p = pol.add_parser("show", help="print what a policy tells the switches (defaults without FILE)")
    p.add_argument("file", nargs="?")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_policy_show)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(build_parser(), argv, "dlcpctl")


if __name__ == "__main__":
    sys.exit(main())
