"""Entries of the SelectiveDrop control (p4/include/control/selective_drop.p4).

One threshold per droppable class (1..K-1) from ``Policy.drop_thresholds``; class 0 never
gets one, so it is never dropped selectively.
"""

from __future__ import annotations

from dlcp.controller.entries import TableEntry
from dlcp.controller.network import Network, SwitchSpec

TABLES = ("drop_threshold",)


def entries(sw: SwitchSpec, net: Network) -> list[TableEntry]:
    return [TableEntry("drop_threshold", {"drop_class": cls}, "set_threshold", {"depth": t})
            for cls, t in enumerate(net.policy.drop_thresholds, start=1)]
