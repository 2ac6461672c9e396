"""A real BMv2 switch in a namespace of its own, four veth ports, host ends in this namespace.

The switch's P4Runtime server listens on a Unix socket (reachable from here without any IP
address), its Thrift port inside its namespace. Host-side interfaces carry no addresses:
tests send and capture raw frames on them with scapy. Everything is removed afterwards,
also when a test fails.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dlcp.controller import pipeline
from dlcp.controller.network import Network, parse_network
from dlcp.controller.p4info import P4Schema
from dlcp.controller.p4rt import Pipeline
from dlcp.controller.switch import Switch
from dlcp.topologies import netns
from dlcp.topologies.bmv2 import Bmv2Options, Bmv2Switch

PORTS = (1, 2, 3, 4)
_counter = itertools.count()


def host_mac(port: int) -> str:
    return f"00:00:0a:00:0{port}:01"


def switch_mac(port: int) -> str:
    return f"00:aa:00:00:00:0{port}"


@dataclass
class Rig:
    tag: str
    ns: str
    grpc: str
    log_dir: Path
    host_ifaces: dict[int, str]
    switch: Bmv2Switch
    extra: dict = field(default_factory=dict)

    def network(self, ports: dict | None = None, routes: list | None = None, groups: dict | None = None,
                policy: dict | None = None, **extra) -> Network:
        """A network file for this one switch: host p at 10.0.p.1 behind port p by default; a
        bottleneck port's scheduler goes on its switch-side interface."""
        port_specs = {p: {"mac": switch_mac(p)} for p in PORTS}
        for p, spec in (ports or {}).items():
            port_specs[p] = {**port_specs[p], **spec}
            if "capacity_pps" in spec or "capacity_bps" in spec:
                port_specs[p].setdefault("interface", self.switch_iface(p))
        routes = routes if routes is not None else [
            {"prefix": f"10.0.{p}.0/24", "port": p, "dmac": host_mac(p)} for p in PORTS]
        data = {"switches": {"s1": {"grpc": self.grpc, "device_id": 1, "thrift_port": 9090, "netns": self.ns,
                                    "ports": port_specs, "routes": routes, "groups": groups or {}, **extra}}}
        if policy is not None:
            data["policy"] = policy
        return parse_network(data, "<test network>")

    def switch_iface(self, port: int) -> str:
        """The switch-side interface of ``port`` (in the switch's namespace)."""
        return f"{self.tag}p{port}"

    def controller(self, net: Network) -> Switch:
        schema = P4Schema.load(pipeline.P4INFO)
        return Switch(net.switches["s1"], schema, Pipeline.load(pipeline.P4INFO, pipeline.BMV2_JSON))

    def restart(self) -> None:
        self.switch.stop()
        self.switch = Bmv2Switch(self.switch.options).start()


@pytest.fixture
def rig(tmp_path):
    tag = f"dlcpt{os.getpid() % 1000}{next(_counter)}"
    ns = f"{tag}s"
    netns.add_netns(ns)
    hosts = {p: f"{tag}h{p}" for p in PORTS}
    sw = None
    try:
        for p in PORTS:
            netns.add_veth(hosts[p], f"{tag}p{p}", None, ns)
        opts = Bmv2Options(name="s1", device_id=1, ports={p: f"{tag}p{p}" for p in PORTS},
                           grpc=f"unix:{tmp_path}/s1.grpc", thrift_port=9090, log_dir=tmp_path, netns=ns)
        sw = Bmv2Switch(opts).start()
        r = Rig(tag, ns, opts.grpc, tmp_path, hosts, sw)
        yield r
        sw = r.switch
    finally:
        if sw is not None:
            sw.stop()
        for iface in hosts.values():
            netns.del_link(iface)
        netns.del_netns(ns)


class Capture:
    """Packets seen on an interface from now on; ``.stop()`` ends the capture and gives them.

    Returns only once the sniffer really listens (its start can take a while on a loaded
    machine), and keeps what it has seen so far in ``packets`` (with the time of the last)."""

    def __init__(self, iface: str) -> None:
        from scapy.sendrecv import AsyncSniffer

        self.packets: list = []
        self.last = time.monotonic()
        started = threading.Event()
        self._sniffer = AsyncSniffer(iface=iface, store=False, prn=self._add, started_callback=started.set)
        self._sniffer.start()
        if not started.wait(10):
            raise RuntimeError(f"the packet capture on {iface} did not start within 10 s")
        time.sleep(0.05)

    def _add(self, pkt) -> None:
        self.packets.append(pkt)
        self.last = time.monotonic()

    def stop(self) -> list:
        self._sniffer.stop()
        return self.packets


def capture(iface: str) -> Capture:
    """Start capturing on ``iface``."""
    return Capture(iface)


def wire_times(iface: str, expect: int, timeout: float = 30.0) -> Callable[[], list[tuple[float, bytes]]]:
    """Start receiving on ``iface`` (a host end, in this namespace) with the kernel's receive
    timestamps (wall clock, as :func:`send_fast` returns), so a busy machine that reads late does
    not bend the rates. Returns ``collect()``, which waits for ``expect`` frames (or ``timeout``),
    closes the socket and gives (time, frame) in arrival order."""
    import socket
    import struct

    rx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
    rx.bind((iface, 0))
    rx.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE
    rx.setsockopt(socket.SOL_SOCKET, 35, 1)  # SO_TIMESTAMPNS

    def collect() -> list[tuple[float, bytes]]:
        got: list[tuple[float, bytes]] = []
        deadline = time.monotonic() + timeout
        with rx:
            while len(got) < expect and time.monotonic() < deadline:
                rx.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    data, anc, _, _ = rx.recvmsg(16384, 64)
                except TimeoutError:
                    break
                sec, nsec = struct.unpack("qq", anc[0][2][:16])
                got.append((sec + nsec * 1e-9, data))
        return got

    return collect


def send_fast(iface: str, packets: list) -> float:
    """Send ``packets`` on ``iface`` as fast as the kernel takes them, and give the wall-clock
    time after the last one left (comparable with captured packets' ``.time``).

    The frames are built before the first is sent, and go through one raw socket: scapy's
    ``sendp`` builds each frame as it goes, which on a loaded machine spreads a burst meant
    to arrive at once over a good part of a second."""
    import socket

    frames = [bytes(p) for p in packets]
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
        s.bind((iface, 0))
        for f in frames:
            s.send(f)
    return time.time()
