"""The EcnMark control's threshold (p4/include/control/ecn.p4), from ``Policy.ecn_threshold``."""

from __future__ import annotations

from controller.entries import TableEntry
from controller.network import Network, SwitchSpec

TABLES = ("ecn_threshold",)


def entries(sw: SwitchSpec, net: Network) -> list[TableEntry]:
    return [TableEntry("ecn_threshold", action="set_ecn_threshold", params={"depth": net.policy.ecn_threshold},
                       default=True)]
