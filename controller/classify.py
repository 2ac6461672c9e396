"""Entries of the Classify control (p4/include/control/classify.p4): which queue.

DLCP header priority -> switch queue from ``Policy.priority_map``; DSCP -> queue for other
traffic from the network file's ``dscp_queues`` (unlisted: best effort, queue 0).
"""

from __future__ import annotations

from dlcp.controller.entries import TableEntry
from dlcp.controller.network import Network, SwitchSpec

TABLES = ("dlcp_priority", "dscp_queue")


def entries(sw: SwitchSpec, net: Network) -> list[TableEntry]:
    pol = net.policy
    out = [TableEntry("dlcp_priority", {"priority": p}, "set_queue", {"queue": pol.priority_map[p]})
           for p in range(pol.num_priorities)]
    out += [TableEntry("dscp_queue", {"dscp": d}, "set_queue", {"queue": q})
            for d, q in sorted(net.dscp_queues.items())]
    return out
