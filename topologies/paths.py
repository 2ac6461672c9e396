"""Which path a flow takes through the testbed's switches, from its 5-tuple, as the P4 program
chooses it: a route to an ECMP group picks member ``crc16(src, dst, proto, sport, dport) mod
size`` (p4/include/control/spray.p4, for everything but sprayed DLCP data).

Why: per-flow ECMP makes a run's outcome depend on which flows share a link. With fixed source
ports (:func:`dlcp.topologies.runner.flow_port_base`) the paths of DLCP's data and of the cross
traffic are known before the run, so each run records them and a slow run can be told apart
from an unlucky draw. Pure functions over the ``network.json`` a run writes.
"""

from __future__ import annotations

import ipaddress
import struct

#: IP protocol numbers.
UDP, TCP = 17, 6


def _crc16_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0xA001 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc16_table()


def crc16(data: bytes) -> int:
    """BMv2's ``crc16`` (CRC-16/ARC: polynomial 0x8005 reflected, initial value 0, no final xor)."""
    crc = 0
    for b in data:
        crc = (crc >> 8) ^ _TABLE[(crc ^ b) & 0xFF]
    return crc


def ecmp_member(src: str, dst: str, proto: int, sport: int, dport: int, size: int) -> int:
    """The group member a flow hashes to: the fields packed in the P4 program's order (IPv4
    source and destination, protocol, L4 source and destination ports: 13 bytes)."""
    key = (ipaddress.IPv4Address(src).packed + ipaddress.IPv4Address(dst).packed
           + struct.pack("!BHH", proto, sport, dport))
    return crc16(key) % size


def _route(switch: dict, dst: str) -> dict:
    """The longest-prefix route of ``switch`` for ``dst``.

    Raises:
        ValueError: no route matches.
    """
    addr = ipaddress.IPv4Address(dst)
    best = None
    for r in switch["routes"]:
        net = ipaddress.IPv4Network(r["prefix"])
        if addr in net and (best is None or net.prefixlen > best[0]):
            best = (net.prefixlen, r)
    if best is None:
        raise ValueError(f"no route to {dst}")
    return best[1]


def hops(network: dict, src: str, dst: str, proto: int, sport: int, dport: int) -> list[tuple[str, int]]:
    """The (switch, egress port) pairs a flow's packets take from ``src``'s switch to ``dst``.

    Raises:
        ValueError: ``src`` is not a host of the network, a switch has no route, or the walk loops.
    """
    hosts = network["hosts"]
    first = next((h for h in hosts.values() if h["ip"] == src), None)
    if first is None:
        raise ValueError(f"{src} is not a host of this network")
    owner = {p["mac"]: name for name, sw in network["switches"].items() for p in sw["ports"].values()}
    out: list[tuple[str, int]] = []
    name = first["switch"]
    while len(out) <= len(network["switches"]):
        switch = network["switches"][name]
        r = _route(switch, dst)
        if "group" in r:
            members = {str(g): m for g, m in switch["groups"].items()}[str(r["group"])]  # JSON keys are text
            m = members[ecmp_member(src, dst, proto, sport, dport, len(members))]
            port, dmac = m["port"], m["dmac"]
        else:
            port, dmac = r["port"], r["dmac"]
        out.append((name, int(port)))
        if dmac not in owner:  # a host's MAC: delivered
            return out
        name = owner[dmac]
    raise ValueError(f"the route from {src} to {dst} loops")


__all__ = ["TCP", "UDP", "crc16", "ecmp_member", "hops"]
