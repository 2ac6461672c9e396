"""The PriorityQueue control (p4/include/control/priority_queue.p4) and BMv2's real queues.

A bottleneck port (``capacity_pps > 0``) gets a ``vq_config`` entry, which turns on the
strict-priority virtual queue drained at the port's capacity, and the BMv2 queue settings
that go with it: every priority queue of the port rate-limited to the capacity (see the P4
file for why both are needed and what that design guarantees).

Every queue of every port is :data:`REAL_QUEUE_DEPTH` deep. The virtual queue alone decides
what a bottleneck admits, so depth there only absorbs scheduling lag; BMv2's default (64)
dropped bursts silently, without any counter, whenever the switch's egress thread fell
behind its ingress on a busy machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.entries import TableEntry
from controller.network import Network, SwitchSpec

TABLES = ("vq_config",)
#: Fixed-point fraction bits of the virtual queue (VQ_FRAC_BITS in defines.p4).
VQ_FRAC_BITS = 24
NUM_QUEUES = 8
#: Packets each real BMv2 queue may hold (BMv2's default is 64).
REAL_QUEUE_DEPTH = 1024


def rate_fixed_point(pps: int) -> int:
    """Drain rate in packets per microsecond, as the P4 program's 8.24 fixed point."""
    return round(pps * (1 << VQ_FRAC_BITS) / 1_000_000)


@dataclass(frozen=True)
class QueueSetting:
    """One BMv2 queue setting (thrift): rate in packets per second and depth in packets."""

    port: int
    priority: int
    rate_pps: int
    depth: int


def entries(sw: SwitchSpec, net: Network) -> list[TableEntry]:
    return [TableEntry("vq_config", {"port": p.number}, "set_vq",
                       {"rate_fp": rate_fixed_point(p.capacity_pps), "capacity": p.buffer})
            for p in sorted(sw.ports.values(), key=lambda p: p.number) if p.is_bottleneck]


def queue_settings(sw: SwitchSpec) -> list[QueueSetting]:
    """BMv2 queue rates (0: unlimited) and depths for every priority queue of every port."""
    return [QueueSetting(p.number, q, p.capacity_pps if p.is_bottleneck else 0, max(p.buffer, REAL_QUEUE_DEPTH))
            for p in sorted(sw.ports.values(), key=lambda p: p.number) for q in range(NUM_QUEUES)]
