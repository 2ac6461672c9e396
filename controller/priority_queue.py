"""The PriorityQueue control (p4/include/control/priority_queue.p4) and BMv2's real queues.

A bottleneck port gets a ``vq_config`` entry, which turns on the strict-priority virtual
queue drained at the port's capacity and charging each packet what the port's scheduler
charges (:mod:`dlcp.controller.scheduler`, which installs that scheduler on the port's interface).

BMv2's own queues are never rate-limited: BMv2 limits each priority queue on its own, so
rates there would give a port one capacity per priority (see the P4 file). Every queue of
every port is :data:`REAL_QUEUE_DEPTH` deep: it only absorbs the switch's scheduling lag;
BMv2's default (64) dropped bursts silently, without any counter, whenever the switch's
egress thread fell behind its ingress on a busy machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlcp.controller.entries import TableEntry
from dlcp.controller.network import Network, PortSpec, SwitchSpec

TABLES = ("vq_config",)
#: Fixed-point fraction bits of the virtual queue (VQ_FRAC_BITS in defines.p4).
VQ_FRAC_BITS = 24
NUM_QUEUES = 8
#: Packets each real BMv2 queue may hold (BMv2's default is 64).
REAL_QUEUE_DEPTH = 1024


#: A packet's cost in slots is ``max(len + overhead, mpu) * unit_fp >> VQ_UNIT_SHIFT`` (defines.p4).
VQ_UNIT_SHIFT = 8


def rate_fixed_point(slots_per_second: float) -> int:
    """Drain rate in slots (full-size frames) per microsecond, as the P4 program's 8.24 fixed point."""
    return round(slots_per_second * (1 << VQ_FRAC_BITS) / 1_000_000)


def unit_fixed_point(slot: int) -> int:
    """``2^(VQ_FRAC_BITS + VQ_UNIT_SHIFT) / slot``, rounded up: a byte's share of a slot, so a
    full slot's charge is never below one slot (thresholds compare whole slots)."""
    return -(-(1 << (VQ_FRAC_BITS + VQ_UNIT_SHIFT)) // slot)


def vq_params(port: PortSpec) -> dict[str, int]:
    """The ``set_vq`` action's parameters of a bottleneck port."""
    c = port.charge
    return {"rate_fp": rate_fixed_point(port.slots_per_second), "capacity": port.buffer,
            "overhead_bytes": c.overhead, "mpu_bytes": c.mpu, "unit_fp": unit_fixed_point(c.slot)}


@dataclass(frozen=True)
class QueueSetting:
    """One BMv2 queue setting (thrift): rate in packets per second and depth in packets."""

    port: int
    priority: int
    rate_pps: int
    depth: int


def entries(sw: SwitchSpec, net: Network) -> list[TableEntry]:
    return [TableEntry("vq_config", {"port": p.number}, "set_vq", vq_params(p))
            for p in sorted(sw.ports.values(), key=lambda p: p.number) if p.is_bottleneck]


def queue_settings(sw: SwitchSpec) -> list[QueueSetting]:
    """BMv2 queue rates (0: unlimited, always: a bottleneck's rate is its scheduler's) and depths
    for every priority queue of every port."""
    return [QueueSetting(p.number, q, 0, max(p.buffer, REAL_QUEUE_DEPTH))
            for p in sorted(sw.ports.values(), key=lambda p: p.number) for q in range(NUM_QUEUES)]
