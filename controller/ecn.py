"""The EcnMark control's rule and threshold (p4/include/control/ecn.p4), from
``Policy.ecn_backlog`` and ``Policy.ecn_threshold``."""

from __future__ import annotations

from dlcp.controller.entries import TableEntry
from dlcp.controller.network import Network, SwitchSpec

TABLES = ("ecn_threshold",)
#: The P4 action for each ``Policy.ecn_backlog``.
ACTIONS = {"ahead": "mark_on_backlog_ahead", "port": "mark_on_port_backlog"}


def entries(sw: SwitchSpec, net: Network) -> list[TableEntry]:
    pol = net.policy
    return [TableEntry("ecn_threshold", action=ACTIONS[pol.ecn_backlog], params={"depth": pol.ecn_threshold},
                       default=True)]
