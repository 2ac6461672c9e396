"""The declarative network file: switches, hosts, routes, ECMP groups, bottlenecks, policy.

Loaded by :func:`load_network` into frozen dataclasses and validated completely before
anything talks to a switch: every error names the file, the switch and the entry. Unknown
keys are errors (a typo must not be ignored).

Example (YAML)::

    policy: {drop_thresholds: [24, 16, 8], ecn_threshold: 12}   # or a path to a policy file
    dscp_queues: {46: 7}                  # non-DLCP traffic: DSCP -> queue (default 0)
    hosts:
      h1: {ip: 10.0.0.1, mac: "00:00:0a:00:00:01", switch: s1, port: 1}
    switches:
      s1:
        grpc: 127.0.0.1:50051
        device_id: 1
        thrift_port: 9090
        ports:
          1: {mac: "00:00:00:01:00:01"}
          3: {mac: "00:00:00:01:00:03", capacity_pps: 500, buffer: 64, interface: s1-eth3}   # a bottleneck
          4: {mac: "00:00:00:01:00:04", capacity_bps: 6000000, buffer: 64, interface: s1-eth4}  # in bits/s
        routes:
          - {prefix: 10.0.0.1/32, port: 1, dmac: "00:00:0a:00:00:01"}
          - {prefix: 10.0.1.0/24, group: 1}
        groups:
          1: [{port: 3, dmac: "00:00:00:02:00:01"}, {port: 4, dmac: "00:00:00:03:00:01"}]
        extra_entries:                     # raw entries, checked against the P4Info
          - {table: dscp_queue, match: {dscp: 10}, action: set_queue, params: {queue: 2}}
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import Any

import yaml

from dlcp.controller.scheduler import Charge, PortScheduler, charge
from dlcp.hostagent.errors import DlcpUserError
from dlcp.hostagent.policy import MAX_QUEUE_DEPTH, Policy, PolicyError, load_policy

_MAC = re.compile(r"^[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}$")
#: BMv2's port numbers are 9 bits; 511 is the drop port.
MAX_PORT = 510
#: Highest rate a bottleneck may be given (packets per second); BMv2 manages ~100 kpps.
MAX_CAPACITY_PPS = 1_000_000
#: ... or in bits per second.
MAX_CAPACITY_BPS = 100_000_000_000
_IFACE = re.compile(r"^[\w.\-]{1,15}$")


class NetworkError(DlcpUserError, ValueError):
    """An invalid network file; the message names the file, switch and entry."""


@dataclass(frozen=True)
class PortSpec:
    number: int
    mac: str
    capacity_pps: int = 0
    """0: not a bottleneck (BMv2 forwards as fast as it can). Otherwise the port sends this many
    frames per second, every frame one slot whatever its size, strictly by priority (the P4
    program's virtual queue decides, an HTB tree on ``interface`` schedules:
    :mod:`dlcp.controller.scheduler`)."""
    capacity_bps: int = 0
    """Instead of ``capacity_pps``: this many bits per second, each frame charged its bytes on an
    Ethernet wire (+24: FCS, preamble, gap), so a 66-byte ACK costs 90 bytes, not a slot."""
    buffer: int = 64
    """Slots (full-size frames) the bottleneck may hold: the virtual queue's capacity."""
    interface: str | None = None
    """The switch-side interface this port transmits on (in the switch's ``netns``): where the
    scheduler of a bottleneck goes. Required for a bottleneck."""
    mtu: int = 1500
    """The interface's MTU: a slot is a full-size frame, ``mtu`` + 38 bytes on the wire."""

    @property
    def is_bottleneck(self) -> bool:
        return self.capacity_pps > 0 or self.capacity_bps > 0

    @property
    def charge(self) -> Charge:
        return charge(self.capacity_bps > 0, self.mtu)

    @property
    def rate_bits(self) -> int:
        """The capacity as the scheduler's rate: bits per second of charged bytes."""
        return self.capacity_bps or self.capacity_pps * self.charge.slot * 8

    @property
    def slots_per_second(self) -> float:
        """The capacity in full-size frames per second (what buffers and thresholds count in)."""
        return self.rate_bits / 8 / self.charge.slot

    def scheduler(self) -> PortScheduler:
        if not self.is_bottleneck or self.interface is None:
            raise ValueError(f"port {self.number} is not a bottleneck with an interface")
        return PortScheduler(self.interface, self.rate_bits, self.charge, self.buffer)

    def capacity_text(self) -> str:
        return f"{self.capacity_bps:,} bit/s" if self.capacity_bps else f"{self.capacity_pps:,} pps"


@dataclass(frozen=True)
class NextHop:
    port: int
    dmac: str


@dataclass(frozen=True)
class Route:
    prefix: str
    """Canonical ``a.b.c.d/len``."""
    nexthop: NextHop | None = None
    group: int | None = None


@dataclass(frozen=True)
class RawEntry:
    table: str
    match: Mapping[str, Any]
    action: str
    params: Mapping[str, Any]
    default: bool = False


@dataclass(frozen=True)
class SwitchSpec:
    name: str
    grpc: str
    """P4Runtime address: ``host:port``, or ``unix:/path`` for a switch in its own namespace."""
    device_id: int = 1
    thrift_port: int = 9090
    netns: str | None = None
    """Network namespace the switch runs in (its Thrift port is reached from inside it)."""
    ports: Mapping[int, PortSpec] = field(default_factory=dict)
    routes: tuple[Route, ...] = ()
    groups: Mapping[int, tuple[NextHop, ...]] = field(default_factory=dict)
    extra_entries: tuple[RawEntry, ...] = ()

    @property
    def thrift_host(self) -> str:
        return "127.0.0.1" if self.grpc.startswith("unix:") else self.grpc.rsplit(":", 1)[0]


@dataclass(frozen=True)
class HostSpec:
    name: str
    ip: str
    mac: str
    switch: str
    port: int


@dataclass(frozen=True)
class Network:
    switches: Mapping[str, SwitchSpec]
    hosts: Mapping[str, HostSpec] = field(default_factory=dict)
    policy: Policy = field(default_factory=Policy)
    dscp_queues: Mapping[int, int] = field(default_factory=dict)
    source: str = "<network>"

    def switch(self, name: str) -> SwitchSpec:
        if name not in self.switches:
            import difflib

            close = difflib.get_close_matches(name, list(self.switches), n=1, cutoff=0.4)
            hint = f". Did you mean {close[0]!r}?" if close else ""
            raise NetworkError(f"{self.source}: no switch named {name!r}{hint}; switches: {sorted(self.switches)}")
        return self.switches[name]


def _keys(where: str, data: Any, allowed: AbstractSet[str], required: AbstractSet[str] = frozenset()) -> Mapping:
    if not isinstance(data, Mapping):
        raise NetworkError(f"{where}: expected a mapping, got {type(data).__name__}")
    unknown = set(data) - allowed
    if unknown:
        raise NetworkError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    missing = required - set(data)
    if missing:
        raise NetworkError(f"{where}: missing key(s) {sorted(missing)}")
    return data


def _int(where: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise NetworkError(f"{where}: {value!r} is not an integer in {lo}..{hi}")
    return value


def _mac(where: str, value: Any) -> str:
    if not isinstance(value, str) or not _MAC.match(value):
        raise NetworkError(f"{where}: {value!r} is not a MAC address like 00:11:22:33:44:55")
    return value.lower()


def _nexthop(where: str, data: Any, ports: Mapping[int, PortSpec]) -> NextHop:
    d = _keys(where, data, {"port", "dmac"}, {"port", "dmac"})
    port = _int(f"{where}.port", d["port"], 0, MAX_PORT)
    if port not in ports:
        raise NetworkError(f"{where}: port {port} is not declared under this switch's ports {sorted(ports)}")
    return NextHop(port, _mac(f"{where}.dmac", d["dmac"]))


def _switch(where: str, name: str, data: Any) -> SwitchSpec:
    d = _keys(where, data, {"grpc", "device_id", "thrift_port", "netns", "ports", "routes", "groups",
                            "extra_entries"}, {"grpc"})
    grpc = d["grpc"]
    if not isinstance(grpc, str) or not re.match(r"^([\w.\-]+:\d+|unix:/.+)$", grpc):
        raise NetworkError(f"{where}.grpc: {grpc!r} is neither host:port nor unix:/path")
    netns = d.get("netns")
    if netns is not None and (not isinstance(netns, str) or not re.match(r"^[\w.\-]+$", netns)):
        raise NetworkError(f"{where}.netns: {netns!r} is not a namespace name")
    ports: dict[int, PortSpec] = {}
    for num, pdata in (d.get("ports") or {}).items():
        pw = f"{where}.ports.{num}"
        n = _int(pw, num, 0, MAX_PORT)
        p = _keys(pw, pdata, {"mac", "capacity_pps", "capacity_bps", "buffer", "interface", "mtu"}, {"mac"})
        cap = _int(f"{pw}.capacity_pps", p.get("capacity_pps", 0), 0, MAX_CAPACITY_PPS)
        bps = _int(f"{pw}.capacity_bps", p.get("capacity_bps", 0), 0, MAX_CAPACITY_BPS)
        if cap and bps:
            raise NetworkError(f"{pw}: give capacity_pps or capacity_bps, not both")
        buf = _int(f"{pw}.buffer", p.get("buffer", 64), 1, MAX_QUEUE_DEPTH)
        mtu = _int(f"{pw}.mtu", p.get("mtu", 1500), 576, 9000)
        iface = p.get("interface")
        if iface is not None and (not isinstance(iface, str) or not _IFACE.match(iface)):
            raise NetworkError(f"{pw}.interface: {iface!r} is not an interface name (at most 15 letters, digits, "
                               "'.', '-', '_')")
        if (cap or bps) and iface is None:
            raise NetworkError(f"{pw}: a bottleneck needs `interface`, the switch-side interface the port transmits "
                               "on: its scheduler (one capacity, strict priority) is installed there")
        if bps and bps < 8 * charge(True, mtu).slot:
            raise NetworkError(f"{pw}.capacity_bps: {bps} is less than one full-size frame per second")
        ports[n] = PortSpec(n, _mac(f"{pw}.mac", p["mac"]), cap, bps, buf, iface, mtu)
    groups: dict[int, tuple[NextHop, ...]] = {}
    for gid, members in (d.get("groups") or {}).items():
        gw = f"{where}.groups.{gid}"
        g = _int(gw, gid, 0, 255)
        if not isinstance(members, list) or not members:
            raise NetworkError(f"{gw}: a group needs a non-empty list of members")
        groups[g] = tuple(_nexthop(f"{gw}[{i}]", m, ports) for i, m in enumerate(members))
    routes: list[Route] = []
    seen: dict[str, int] = {}
    for i, r in enumerate(d.get("routes") or []):
        rw = f"{where}.routes[{i}]"
        rd = _keys(rw, r, {"prefix", "port", "dmac", "group"}, {"prefix"})
        try:
            net = ipaddress.IPv4Network(str(rd["prefix"]), strict=True)
        except ValueError as exc:
            raise NetworkError(f"{rw}: prefix {rd['prefix']!r} is invalid ({exc})") from None
        prefix = str(net)
        if prefix in seen:
            raise NetworkError(f"{rw}: prefix {prefix} overlaps routes[{seen[prefix]}] (the same prefix twice)")
        seen[prefix] = i
        if "group" in rd:
            if "port" in rd or "dmac" in rd:
                raise NetworkError(f"{rw}: give either group or port+dmac, not both")
            g = _int(f"{rw}.group", rd["group"], 0, 255)
            if g not in groups:
                raise NetworkError(f"{rw}: group {g} is not declared under this switch's groups {sorted(groups)}")
            routes.append(Route(prefix, group=g))
        else:
            routes.append(Route(prefix, nexthop=_nexthop(rw, {k: rd.get(k) for k in ("port", "dmac")}, ports)))
    extras = []
    for i, e in enumerate(d.get("extra_entries") or []):
        ew = f"{where}.extra_entries[{i}]"
        ed = _keys(ew, e, {"table", "match", "action", "params", "default"}, {"table", "action"})
        extras.append(RawEntry(str(ed["table"]), dict(ed.get("match") or {}), str(ed["action"]),
                               dict(ed.get("params") or {}), bool(ed.get("default", False))))
    return SwitchSpec(name, grpc, _int(f"{where}.device_id", d.get("device_id", 1), 0, 2**32 - 1),
                      _int(f"{where}.thrift_port", d.get("thrift_port", 9090), 1, 65535), netns, ports,
                      tuple(routes), groups, tuple(extras))


def parse_network(data: Any, source: str = "<network>", base_dir: Path | None = None) -> Network:
    """Validate a network description (the parsed YAML) completely.

    Raises:
        NetworkError: names the file, the switch and the entry at fault.
    """
    d = _keys(source, data, {"switches", "hosts", "policy", "dscp_queues"}, {"switches"})
    pol_data = d.get("policy")
    try:
        if pol_data is None:
            policy = Policy()
        elif isinstance(pol_data, str):
            path = Path(pol_data)
            policy = load_policy(path if path.is_absolute() or base_dir is None else base_dir / path)
        else:
            policy = Policy.from_dict(pol_data)
    except (PolicyError, TypeError) as exc:
        raise NetworkError(f"{source}: policy: {exc}") from exc
    switches: dict[str, SwitchSpec] = {}
    for name, sd in (d["switches"] or {}).items():
        switches[str(name)] = _switch(f"{source}: switches.{name}", str(name), sd)
    if not switches:
        raise NetworkError(f"{source}: no switches")
    ids = [(s.grpc, s.device_id) for s in switches.values()]
    if len(set(ids)) != len(ids):
        raise NetworkError(f"{source}: two switches share a gRPC address and device id")
    hosts: dict[str, HostSpec] = {}
    for name, hd in (d.get("hosts") or {}).items():
        hw = f"{source}: hosts.{name}"
        h = _keys(hw, hd, {"ip", "mac", "switch", "port"}, {"ip", "mac", "switch", "port"})
        try:
            ip = str(ipaddress.IPv4Address(h["ip"]))
        except ValueError:
            raise NetworkError(f"{hw}.ip: {h['ip']!r} is not an IPv4 address") from None
        if h["switch"] not in switches:
            raise NetworkError(f"{hw}.switch: no switch named {h['switch']!r}")
        port = _int(f"{hw}.port", h["port"], 0, MAX_PORT)
        if port not in switches[h["switch"]].ports:
            raise NetworkError(f"{hw}: port {port} is not declared on switch {h['switch']}")
        hosts[str(name)] = HostSpec(str(name), ip, _mac(f"{hw}.mac", h["mac"]), h["switch"], port)
    dscp: dict[int, int] = {}
    for k, v in (d.get("dscp_queues") or {}).items():
        dscp[_int(f"{source}: dscp_queues key", k, 0, 63)] = _int(f"{source}: dscp_queues.{k}", v, 0, 7)
    net = Network(switches, hosts, policy, dscp, source)
    check_thresholds(net)
    return net


def check_thresholds(net: Network) -> None:
    """Thresholds at or above a bottleneck's buffer could never act: a configuration error."""
    pol = net.policy
    for sw in net.switches.values():
        for port in sw.ports.values():
            if not port.is_bottleneck:
                continue
            for cls, t in enumerate(pol.drop_thresholds, start=1):
                if t >= port.buffer:
                    raise NetworkError(f"{net.source}: policy.drop_thresholds class {cls} = {t} is out of range for "
                                       f"switch {sw.name} port {port.number}, whose buffer is {port.buffer} packets")
            if pol.ecn_threshold >= port.buffer:
                raise NetworkError(f"{net.source}: policy.ecn_threshold = {pol.ecn_threshold} is out of range for "
                                   f"switch {sw.name} port {port.number}, whose buffer is {port.buffer} packets")


def load_network(path: str | Path) -> Network:
    """Read and validate a network YAML file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise NetworkError(f"{path}: cannot read network file: {exc}") from exc
    return parse_network(data, str(path), path.parent)
