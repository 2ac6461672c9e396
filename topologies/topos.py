"""Topologies as data: switches, hosts, links, bottlenecks; and the network file they imply.

A :class:`TopologyDesc` is pure description (names, addresses, ports, roles), derived from a
few integers the way p4-utils derives addresses: host ``i`` is ``10.0.0.i`` with MAC
``00:00:0a:00:00:<i>``; switch ``k``'s port ``p`` has MAC ``00:aa:00:00:<k>:<p>``. Mininet
realises it (:mod:`dlcp.topologies.net`); :meth:`TopologyDesc.network` computes the controller's
network file: a /32 route per host on every switch, over every shortest path (an ECMP
group where there are several), and the bottleneck ports with their capacity.

Names carry the ``dlcp`` prefix (interfaces are ``<node>-eth<port>``), so ``dlcp clean`` can
find exactly our leftovers; reports drop it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from dlcp.topologies.netns import PREFIX


@dataclass(frozen=True)
class HostDesc:
    name: str
    ip: str
    mac: str
    switch: str
    port: int
    role: str  # worker | server | cross


@dataclass(frozen=True)
class SwitchDesc:
    name: str
    device_id: int
    ports: tuple[int, ...]

    def mac(self, port: int) -> str:
        return f"00:aa:00:00:{self.device_id:02x}:{port:02x}"


@dataclass(frozen=True)
class LinkDesc:
    a: str
    a_port: int
    b: str
    b_port: int


@dataclass(frozen=True)
class TopologyDesc:
    name: str
    switches: tuple[SwitchDesc, ...]
    hosts: tuple[HostDesc, ...]
    links: tuple[LinkDesc, ...]
    bottlenecks: frozenset[tuple[str, int]] = field(default_factory=frozenset)
    """(switch, port) pairs served at ``capacity_pps`` with strict priority."""

    def switch(self, name: str) -> SwitchDesc:
        return next(s for s in self.switches if s.name == name)

    def role(self, role: str) -> list[HostDesc]:
        return [h for h in self.hosts if h.role == role]

    def neighbours(self, sw: str) -> list[tuple[int, str, int]]:
        """(local port, neighbour switch, its port) for every switch-to-switch link of ``sw``."""
        out = []
        for link in self.links:
            if link.a == sw:
                out.append((link.a_port, link.b, link.b_port))
            elif link.b == sw:
                out.append((link.b_port, link.a, link.a_port))
        return out

    def _distances(self, target: str) -> dict[str, int]:
        dist = {target: 0}
        todo = deque([target])
        while todo:
            cur = todo.popleft()
            for _, nb, _ in self.neighbours(cur):
                if nb not in dist:
                    dist[nb] = dist[cur] + 1
                    todo.append(nb)
        return dist

    def network(self, grpc_dir: str, capacity_pps: int, buffer: int, policy: dict | None = None,
                dscp_queues: dict[int, int] | None = None, capacity_bps: int = 0) -> dict:
        """The controller's network file (as a dict) for this topology: bottleneck ports at
        ``capacity_bps`` bits per second when given, else at ``capacity_pps`` packets, each with
        its switch-side interface (Mininet's ``<switch>-eth<port>``), where its scheduler goes."""
        switches: dict = {}
        for sw in self.switches:
            groups: dict[tuple, int] = {}
            routes = []
            for h in self.hosts:
                if h.switch == sw.name:
                    routes.append({"prefix": f"{h.ip}/32", "port": h.port, "dmac": h.mac})
                    continue
                dist = self._distances(h.switch)
                hops = sorted((port, self.switch(nb).mac(nb_port)) for port, nb, nb_port in self.neighbours(sw.name)
                              if dist.get(nb, 1 << 30) == dist[sw.name] - 1)
                if len(hops) == 1:
                    routes.append({"prefix": f"{h.ip}/32", "port": hops[0][0], "dmac": hops[0][1]})
                else:
                    gid = groups.setdefault(tuple(hops), len(groups) + 1)
                    routes.append({"prefix": f"{h.ip}/32", "group": gid})
            ports = {}
            for p in sw.ports:
                spec: dict[str, object] = {"mac": sw.mac(p)}
                if (sw.name, p) in self.bottlenecks:
                    spec.update({"capacity_bps": capacity_bps} if capacity_bps else {"capacity_pps": capacity_pps},
                                buffer=buffer, interface=f"{sw.name}-eth{p}")
                ports[p] = spec
            switches[sw.name] = {
                "grpc": f"unix:{grpc_dir}/{sw.name}.grpc", "device_id": sw.device_id, "thrift_port": 9090,
                "netns": sw.name, "ports": ports, "routes": routes,
                "groups": {gid: [{"port": p, "dmac": m} for p, m in hops] for hops, gid in groups.items()},
            }
        hosts = {h.name: {"ip": h.ip, "mac": h.mac, "switch": h.switch, "port": h.port} for h in self.hosts}
        out = {"switches": switches, "hosts": hosts}
        if dscp_queues:
            out["dscp_queues"] = dict(dscp_queues)
        if policy is not None:
            out["policy"] = policy
        return out


def _host(i: int, switch: str, port: int, role: str, letter: str = "h") -> HostDesc:
    return HostDesc(f"{PREFIX}{letter}{i}", f"10.0.0.{i}", f"00:00:0a:00:00:{i:02x}", switch, port, role)


def star(workers: int = 4) -> TopologyDesc:
    """One switch; workers, a parameter server and two cross-traffic hosts on it. Every host
    port is a bottleneck (incast at the server, cross traffic competing for it)."""
    s = f"{PREFIX}s1"
    hosts = [_host(i, s, i, "worker") for i in range(1, workers + 1)]
    hosts.append(_host(workers + 1, s, workers + 1, "server"))
    hosts += [_host(workers + 2, s, workers + 2, "cross", "x"), _host(workers + 3, s, workers + 3, "cross", "x")]
    ports = tuple(h.port for h in hosts)
    return TopologyDesc("star", (SwitchDesc(s, 1, ports),), tuple(hosts), (), frozenset((s, p) for p in ports))


def dumbbell(workers: int = 4) -> TopologyDesc:
    """Two switches joined by one bottleneck link: workers and a cross sender on the left,
    the parameter server and the cross receiver on the right."""
    left, right = f"{PREFIX}s1", f"{PREFIX}s2"
    hosts = [_host(i, left, i, "worker") for i in range(1, workers + 1)]
    hosts.append(_host(workers + 1, left, workers + 1, "cross", "x"))
    hosts.append(_host(workers + 2, right, 1, "server"))
    hosts.append(_host(workers + 3, right, 2, "cross", "x"))
    up = workers + 2
    sw = (SwitchDesc(left, 1, tuple(range(1, workers + 2)) + (up,)), SwitchDesc(right, 2, (1, 2, 3)))
    return TopologyDesc("dumbbell", sw, tuple(hosts), (LinkDesc(left, up, right, 3),),
                        frozenset({(left, up), (right, 3)}))


def leafspine(workers: int = 4) -> TopologyDesc:
    """2 leaves x 2 spines: workers spread over both leaves (2-4 each), the server and one
    cross host on leaf 2, one cross host on leaf 1. Leaf uplinks and spine downlinks are the
    bottlenecks; between leaves there are two equal-cost paths."""
    if not 2 <= workers <= 7:
        raise ValueError("leafspine takes 2..7 workers (2-4 hosts per leaf with the server and cross hosts)")
    l1, l2, sp1, sp2 = (f"{PREFIX}l1", f"{PREFIX}l2", f"{PREFIX}sp1", f"{PREFIX}sp2")
    left_n = (workers + 1) // 2
    hosts, i = [], 1
    for w in range(workers):
        leaf = l1 if w < left_n else l2
        port = w + 1 if leaf == l1 else w - left_n + 1
        hosts.append(_host(i, leaf, port, "worker"))
        i += 1
    n1, n2 = left_n, workers - left_n
    hosts.append(_host(i, l2, n2 + 1, "server"))
    hosts.append(_host(i + 1, l1, n1 + 1, "cross", "x"))
    hosts.append(_host(i + 2, l2, n2 + 2, "cross", "x"))
    up1, up2 = 8, 9  # leaf uplinks to spine 1 and 2
    sws = (SwitchDesc(l1, 1, tuple(range(1, n1 + 2)) + (up1, up2)),
           SwitchDesc(l2, 2, tuple(range(1, n2 + 3)) + (up1, up2)),
           SwitchDesc(sp1, 3, (1, 2)), SwitchDesc(sp2, 4, (1, 2)))
    links = (LinkDesc(l1, up1, sp1, 1), LinkDesc(l1, up2, sp2, 1), LinkDesc(l2, up1, sp1, 2), LinkDesc(l2, up2, sp2, 2))
    bottlenecks = frozenset({(l1, up1), (l1, up2), (l2, up1), (l2, up2), (sp1, 1), (sp1, 2), (sp2, 1), (sp2, 2)})
    return TopologyDesc("leafspine", sws, tuple(hosts), links, bottlenecks)


TOPOLOGIES = {"star": star, "dumbbell": dumbbell, "leafspine": leafspine}

#: What a job host's switch port is: ``free`` (as fast as BMv2 forwards, the topology's own
#: bottlenecks only) or ``capped`` (a bottleneck of the fabric's capacity as well).
HOST_PORTS = ("free", "capped")


def with_host_ports(topo: TopologyDesc, host_ports: str) -> TopologyDesc:
    """``topo`` with its job hosts' switch ports (workers' and the server's) made bottlenecks of
    the fabric's capacity when ``host_ports`` is ``capped``; unchanged when ``free``.

    Why: DLCP's hosts are configured for a link of the fabric's rate
    (:func:`dlcp.hostagent.ratecontrol.link_rates`), but on ``dumbbell`` and ``leafspine`` their
    own ports are not limited: a server's replies then leave at one link's rate while its
    workers' pushes into it meet no queue at all (no incast), and gloo's hosts are held to no
    such rate. Capped, every job host has a link of the rate it is configured for, for every
    scheme alike, and the server's incast queues where the switch's priorities and drops act.
    The cross-traffic hosts stay free: they stand for other tenants' aggregate."""
    if host_ports not in HOST_PORTS:
        raise ValueError(f"host_ports must be one of {HOST_PORTS}, got {host_ports!r}")
    if host_ports == "free":
        return topo
    job = {(h.switch, h.port) for h in topo.hosts if h.role in ("worker", "server")}
    return replace(topo, bottlenecks=topo.bottlenecks | frozenset(job))


def short(name: str) -> str:
    """A node's name without the ``dlcp`` prefix, for reports."""
    return name[len(PREFIX):] if name.startswith(PREFIX) else name
