"""Entries of the Spray control (p4/include/control/spray.p4): ECMP groups and members.

The group's mode comes from ``Policy.lb_mode``: DLCP data packets go round-robin or at
random over the members; other traffic always hashes its 5-tuple.
"""

from __future__ import annotations

from dlcp.controller.entries import TableEntry
from dlcp.controller.network import Network, SwitchSpec

TABLES = ("ecmp_group", "ecmp_member")
#: Policy.lb_mode -> the P4 program's LB_* constant.
LB_MODES = {"round_robin": 0, "random": 1, "flow": 2}


def entries(sw: SwitchSpec, net: Network) -> list[TableEntry]:
    mode = LB_MODES[net.policy.lb_mode]
    out = []
    for gid, members in sorted(sw.groups.items()):
        out.append(TableEntry("ecmp_group", {"group_id": gid}, "set_group", {"size": len(members), "mode": mode}))
        for i, m in enumerate(members):
            out.append(TableEntry("ecmp_member", {"group_id": gid, "member": i}, "set_member",
                                  {"port": m.port, "smac": sw.ports[m.port].mac, "dmac": m.dmac}))
    return out
