"""Entries of the Forwarding control (p4/include/control/forwarding.p4): IPv4 LPM routes."""

from __future__ import annotations

from dlcp.controller.entries import TableEntry
from dlcp.controller.network import Network, SwitchSpec

TABLES = ("ipv4_lpm",)


def entries(sw: SwitchSpec, net: Network) -> list[TableEntry]:
    """One LPM entry per route: to a next hop (port, MACs) or to an ECMP group."""
    out = []
    for r in sw.routes:
        addr, plen = r.prefix.split("/")
        match = {"dst_addr": (addr, int(plen))}
        if r.group is not None:
            out.append(TableEntry("ipv4_lpm", match, "set_ecmp_group", {"group_id": r.group}))
        else:
            nh = r.nexthop
            assert nh is not None, "a route has a group or a next hop (load_network checks)"
            out.append(TableEntry("ipv4_lpm", match, "set_nexthop",
                                  {"port": nh.port, "smac": sw.ports[nh.port].mac, "dmac": nh.dmac}))
    return out
