"""What a switch should hold: the entries of every mechanism, plus the network's extras.

Pure: a function of the network spec and the policy. Each mechanism module mirrors one P4
control and owns exactly its tables (``TABLES``); :data:`MECHANISMS` lists them in the order
the P4 program applies them.
"""

from __future__ import annotations

from dlcp.controller import classify, ecn, forwarding, priority_queue, selective_drop, spray
from dlcp.controller.entries import TableEntry
from dlcp.controller.network import Network, SwitchSpec

MECHANISMS = (forwarding, classify, spray, priority_queue, selective_drop, ecn)
#: Tables whose entries come from the policy alone (what ``dlcpctl policy set`` rewrites).
POLICY_TABLES = classify.TABLES[:1] + spray.TABLES[:1] + selective_drop.TABLES + ecn.TABLES


def desired_entries(sw: SwitchSpec, net: Network) -> list[TableEntry]:
    out: list[TableEntry] = []
    for mech in MECHANISMS:
        out += mech.entries(sw, net)
    out += [TableEntry(e.table, dict(e.match), e.action, dict(e.params), e.default) for e in sw.extra_entries]
    return out


#: Order in which changes are written: what a route points at (ECMP groups) before the route.
APPLY_ORDER = (spray, classify, priority_queue, selective_drop, ecn, forwarding)


def owned_tables() -> tuple[str, ...]:
    """Every table DLCP's controller owns, in :data:`APPLY_ORDER`."""
    return tuple(t for mech in APPLY_ORDER for t in mech.TABLES)
