"""The line-rate bound of a testbed run: the least time the network needs per iteration.

Each bottleneck port is served at ``capacity_pps`` packets per second, whatever their size,
so a port that must carry N gradient packets per iteration needs at least
N / (capacity left to the gradients) seconds. The bound is the largest of these over the
bottleneck ports. No scheme can beat it, so it is the yardstick a measured communication
time is compared with ("how far from line rate").

Everything here is pure: a run's agent spec and a :class:`~dlcp.topologies.topos.TopologyDesc`
in, numbers out. The traffic follows the code that sends it: the agent's bucket plan
(:func:`dlcp.topologies.workload.worker_plan`), :class:`dlcp.hostagent.exchange.PSWorker` /
:class:`~dlcp.hostagent.exchange.PSServer` for the parameter server and
:class:`~dlcp.hostagent.exchange.RingAllreduce` for the ring. Only gradient data packets count:
control frames (META, STOP, ACKs) travel on TCP and are a few per message.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from dlcp.hostagent.packetizer import elems_per_packet
from dlcp.hostagent.policy import Policy, required_elements
from dlcp.topologies.topos import TopologyDesc
from dlcp.topologies.workload import worker_plan

Port = tuple[str, int]
"""(switch name, egress port)."""
Flow = tuple[str, str]
"""(source host name, destination host name)."""


def bucket_sizes(spec: Mapping) -> list[int]:
    """Elements of every message a worker sends per iteration, as :func:`dlcp.topologies.agent.run_worker`
    plans them (same sizes, priorities and fusion caps).

    Raises:
        ValueError: ``spec["model"]`` is not a synthetic profile (``digits`` trains a real model
            whose buckets DDP builds at run time).
    """
    return [b.total for b in worker_plan(spec)[2]]


def message_packets(elems: int, per_packet: int, loss_bound: float = 0.0) -> int:
    """Fewest data packets that complete a message of ``elems`` elements under bound ``p``.

    Completion counts elements (:func:`dlcp.hostagent.policy.is_complete`): ``required_elements``
    = ``total - floor(p * total)`` must arrive. Every packet holds ``per_packet`` elements but
    the last, so the fewest packets are full ones: ``ceil(required / per_packet)``, which is
    ``ceil((1 - p) * packets)`` up to the short last packet. ``p = 0`` gives every packet; an
    empty message (a ring chunk of a tiny tensor) none, as the packetizer sends none.
    """
    return -(-required_elements(int(elems), loss_bound) // per_packet)


def iteration_traffic(spec: Mapping, topo: TopologyDesc, bounded: bool = True) -> dict[Flow, float]:
    """Gradient data packets per iteration from host to host.

    Worker rank ``r`` is ``topo.role("worker")[r]``, the server ``topo.role("server")[0]``.

    * ``ps``: every worker pushes every bucket to the server, which sends the average of
      each bucket back to every worker (same size).
    * ``ring``: per bucket, as :meth:`RingAllreduce.allreduce_detailed`: rank ``r`` sends to
      ``r + 1 mod W``; the bucket is cut into W chunks at ``linspace(0, n, W + 1)``, each chunk
      is one message packetized on its own (so rounding is per chunk), and each of the
      ``2 (W - 1)`` steps sends one chunk: reduce-scatter chunk ``(r - s) mod W``, all-gather
      chunk ``(r + 1 - s) mod W``.

    ``bounded`` (default): each message counts only the packets it needs to complete
    (:func:`message_packets`) under the bound the code gives its direction: ``loss_bound_push``
    for pushes and reduce-scatter steps, ``loss_bound_pull`` for the server's replies and
    all-gather steps (0 in every testbed scheme: those stay reliable). Senders still emit
    every packet once; the bound says up to p of them may be dropped instead of served, so
    this is the least a bottleneck must carry. ``bounded=False`` counts every packet.
    """
    policy = Policy.from_dict(spec["policy"])
    push, pull = (policy.loss_bound_push, policy.loss_bound_pull) if bounded else (0.0, 0.0)
    per = elems_per_packet(spec["mtu"], np.dtype(spec.get("wire_dtype", "float32")))
    workers = [h.name for h in topo.role("worker")]
    if len(workers) != spec["workers"]:
        raise ValueError(f"spec has {spec['workers']} workers, topology {topo.name} has {len(workers)}")
    server = topo.role("server")[0].name if spec["pattern"] == "ps" else None
    return job_traffic(spec["pattern"], workers, server, bucket_sizes(spec), per, push, pull)


def job_traffic(pattern: str, workers: list[str], server: str | None, buckets: list[int], per_packet: int,
                push: float, pull: float) -> dict[Flow, float]:
    """Data packets per iteration between the hosts of one job (the rule of
    :func:`iteration_traffic`, which the simulator's many jobs share): ``buckets`` are the
    elements of each fused message, ``push``/``pull`` the bounds of pushes and reduce-scatter
    steps / replies and all-gather steps (0 counts every packet)."""
    traffic: dict[Flow, float] = defaultdict(float)
    if pattern == "ps":
        if server is None:
            raise ValueError("a parameter-server job needs a server")
        for w in workers:
            for n in buckets:
                traffic[(w, server)] += message_packets(n, per_packet, push)
                traffic[(server, w)] += message_packets(n, per_packet, pull)
    elif pattern == "ring":
        size = len(workers)
        for n in buckets:
            chunks = np.diff(np.linspace(0, n, size + 1).astype(np.int64))
            for r, w in enumerate(workers):
                right = workers[(r + 1) % size]
                for step in range(2 * (size - 1)):
                    gather = step >= size - 1
                    s = step - (size - 1) if gather else step
                    c_send = (r + 1 - s) % size if gather else (r - s) % size
                    traffic[(w, right)] += message_packets(chunks[c_send], per_packet, pull if gather else push)
    else:
        raise ValueError(f"pattern must be ps or ring, got {pattern!r}")
    return dict(traffic)


def path_fractions(topo: TopologyDesc, src_host: str, dst_host: str) -> dict[Port, float]:
    """Fraction of ``src_host -> dst_host`` traffic that leaves each (switch, port), the last
    switch's port to the destination host included.

    Routes are those of :meth:`TopologyDesc.network`: every shortest path, an ECMP group where
    a switch has several next hops. The traffic is split equally at every such hop: the best
    any load balancer can do (per-packet spraying gets it on average; per-flow hashing puts a
    flow on one path, which can only load some port more).
    """
    hosts = {h.name: h for h in topo.hosts}
    src, dst = hosts[src_host], hosts[dst_host]
    if src_host == dst_host:
        return {}
    dist = topo._distances(dst.switch)
    if src.switch not in dist:
        raise ValueError(f"no path from {src_host} to {dst_host}")
    out: dict[Port, float] = defaultdict(float)
    frontier = {src.switch: 1.0}
    for _ in range(dist[src.switch]):  # every hop is one closer to the destination's switch
        nxt: dict[str, float] = defaultdict(float)
        for sw, share in frontier.items():
            hops = [(port, nb) for port, nb, _ in topo.neighbours(sw) if dist.get(nb, 1 << 30) == dist[sw] - 1]
            for port, nb in hops:
                out[(sw, port)] += share / len(hops)
                nxt[nb] += share / len(hops)
        frontier = nxt
    out[(dst.switch, dst.port)] += 1.0
    return dict(out)


def port_loads(topo: TopologyDesc, traffic: Mapping[Flow, float]) -> dict[Port, float]:
    """Packets per iteration leaving every (switch, port) that ``traffic`` crosses (all ports:
    callers keep the bottlenecks)."""
    loads: dict[Port, float] = defaultdict(float)
    for (src, dst), packets in traffic.items():
        for port, frac in path_fractions(topo, src, dst).items():
            loads[port] += packets * frac
    return dict(loads)


def host_loads(traffic: Mapping[Flow, float]) -> dict[str, float]:
    """Packets per iteration each host sends through its own link (the testbed's paced DLCP
    hosts and the simulator's hosts both have one link out, whatever the paths beyond it)."""
    out: dict[str, float] = defaultdict(float)
    for (src, _), packets in traffic.items():
        out[src] += packets
    return dict(out)


def cross_traffic_load(topo: TopologyDesc, src_host: str, dst_host: str, rate_pps: float,
                       duty: float) -> dict[Port, float]:
    """Average packets per second a non-elastic (UDP, on/off) sender adds to each port:
    ``rate * duty * fraction``.

    The sender is one 5-tuple, so per-flow ECMP hashes it onto ONE path; which one the
    hash picks is not known here, so the result is the expectation over hash outcomes (the
    even split of :func:`path_fractions`). A particular run puts all of it on one path.
    """
    return {p: rate_pps * duty * f for p, f in path_fractions(topo, src_host, dst_host).items()}


@dataclass(frozen=True)
class LineRateBound:
    """The least network time per iteration and the port that sets it."""

    seconds: float
    """The bound: the largest packets / capacity left over the bottleneck ports (``inf`` when a
    port the gradients need has no capacity left; 0 when they cross no bottleneck)."""
    port: Port | None
    """The binding bottleneck port (None: the gradients cross no bottleneck)."""
    packets: float
    """Gradient packets per iteration on that port."""
    capacity_left_pps: float
    """Its capacity left to the gradients."""
    loads: dict[Port, float] = field(default_factory=dict)
    """Gradient packets per iteration on every bottleneck port."""


def line_rate_bound(topo: TopologyDesc, traffic: Mapping[Flow, float], capacity_pps: float,
                    cross_pps: Mapping[Port, float] | None = None, host_pps: float = 0.0) -> LineRateBound:
    """The line-rate bound of ``traffic`` (packets per iteration, :func:`iteration_traffic`).

    Capacity left on a port = ``capacity_pps`` minus the non-elastic cross traffic that shares
    the gradients' queue there (``cross_pps``, e.g. from :func:`cross_traffic_load`); pass 0 (or
    leave the port out) when the gradients have strict priority over it, and leave elastic
    (TCP) cross traffic out: it yields. Only ``topo.bottlenecks`` count. A port with no
    capacity left (<= 0) makes the bound infinite if the gradients need it at all; a port
    they do not cross never binds, whatever its cross traffic.

    ``host_pps`` > 0: every host sends at most that many packets per second, whatever its
    port (DLCP's hosts pace to the line rate they are configured for); each sending host then
    counts as a port ``(host, 0)`` of that capacity, so a parameter server answering four
    workers through one such link is bound by it where its switch port is not limited.
    """
    cross = cross_pps or {}
    all_loads = port_loads(topo, traffic)
    loads = {p: all_loads.get(p, 0.0) for p in sorted(topo.bottlenecks)}
    capacity = dict.fromkeys(loads, float(capacity_pps))
    if host_pps > 0:
        for host, packets in host_loads(traffic).items():
            loads[(host, 0)] = packets
            capacity[(host, 0)] = float(host_pps)
    best = LineRateBound(0.0, None, 0.0, float(capacity_pps), loads)
    for port, packets in loads.items():
        if packets <= 0:
            continue
        left = capacity[port] - cross.get(port, 0.0)
        seconds = packets / left if left > 0 else math.inf
        if best.port is None or seconds > best.seconds:
            best = LineRateBound(seconds, port, packets, left, loads)
    return best
