"""The host-side commands of ``dlcp``: demo, policy, wire format.

They need nothing above ``hostagent``. The ``dlcp`` program itself (:mod:`dlcp.cli`)
gathers these with the testbed's and the simulator's commands, so every package's command
line depends only downward. Exceptions become exit codes in
:func:`dlcp.hostagent.clikit.run_cli`.
"""

from __future__ import annotations

import argparse
import json

from dlcp.hostagent import wire
from dlcp.hostagent.clikit import number
from dlcp.hostagent.lossmodel import CAPACITY, LOAD
from dlcp.hostagent.policy import Policy, load_policy
from dlcp.hostagent.ranges import Range

#: numpy's generators take any seed >= 0.
SEED = Range(0)


def _policy_from(path: str | None) -> Policy:
    return load_policy(path) if path else Policy()


def cmd_demo(args: argparse.Namespace) -> int:
    from dlcp.hostagent import demo

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
        ports = wire.dlcp_ports()
        print(json.dumps({"udp_port": wire.DLCP_UDP_PORT, "udp_ports": [min(ports), max(ports)],
                          "header_bytes": wire.HEADER_SIZE,
                          "trailer_bytes": wire.TRAILER_SIZE,
                          "fields": [{"name": f.name, "bits": f.bits, "doc": f.doc} for f in wire.FIELDS]}, indent=2))
        return 0
    ports = wire.dlcp_ports()
    print(f"DLCP header v{wire.VERSION}: {wire.HEADER_SIZE} bytes, network byte order, UDP port {wire.DLCP_UDP_PORT} "
          f"(switches take {min(ports)}-{max(ports)} as DLCP)")
    print(f"{'offset':>6}  {'bits':>4}  {'field':<12} meaning")
    offset = 0
    for f in wire.FIELDS:
        print(f"{offset:>6}  {f.bits:>4}  {f.name:<12} {f.doc}")
        offset += f.bits // 8
    print(f"then the payload, then a {wire.TRAILER_SIZE}-byte trailer: packet number (8) and tag (16: "
          "AEGISMAC-128X4, AES-GCM's when encrypted) over header and payload (docs/design/security.md)")
    return 0


def add_host_commands(sub: argparse._SubParsersAction) -> None:
    """Add demo, policy and wire to ``dlcp``'s sub-commands."""
    p = sub.add_parser("demo", help="packetize a real gradient, drop by class at a modelled congested port, reassemble")
    p.add_argument("--load", type=number(LOAD, float), default=1.25,
                   help="offered load as a multiple of the port's capacity")
    p.add_argument("--capacity", type=number(CAPACITY), default=64,
                   help="queue capacity in packets (BMv2's is 64)")
    p.add_argument("--seed", type=number(SEED), default=0)
    p.set_defaults(func=cmd_demo)

    pol = sub.add_parser("policy", help="show or check a policy file").add_subparsers(dest="action", metavar="ACTION")
    p = pol.add_parser("show", help="print a policy (the defaults when no file is given)")
    p.add_argument("file", nargs="?")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_policy_show)
    p = pol.add_parser("check", help="validate a policy file")
    p.add_argument("file")
    p.set_defaults(func=cmd_policy_check)

    p = sub.add_parser("wire", help="print the DLCP header layout")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_wire)


