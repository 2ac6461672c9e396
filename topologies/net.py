"""Realise a :class:`~dlcp.topologies.topos.TopologyDesc` with Mininet and BMv2 switches.

``DlcpSwitch`` is a Mininet ``Switch`` in a network namespace of its own (so BMv2's Thrift
server, which binds every address, stays inside it). The namespace is given a name with
``ip netns attach`` so the controller can reach Thrift from inside it; P4Runtime listens on a
Unix socket in the run directory. Mininet runs with ``controller=None`` and static ARP: the
P4 program routes by IP and rewrites MACs, so hosts may address frames to each other's MAC.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

from mininet.net import Mininet
from mininet.node import Host, Switch

from dlcp.topologies import netns
from dlcp.topologies.bmv2 import Bmv2Options, Bmv2Switch
from dlcp.hostagent.errors import DlcpUserError
from dlcp.topologies.gloo_ports import NO_TIME_WAIT
from dlcp.topologies.topos import TopologyDesc

log = logging.getLogger(__name__)


class DlcpSwitch(Switch):
    """A BMv2 ``simple_switch_grpc --priority-queues 8`` as a Mininet switch."""

    def __init__(self, name: str, run_dir: str = "/tmp", device_id: int = 1, sock_dir: str | None = None,
                 **params) -> None:
        params["inNamespace"] = True
        super().__init__(name, **params)
        self.run_dir = Path(run_dir)
        self.sock_dir = Path(sock_dir or run_dir)
        self.device_id = device_id
        self.bmv2: Bmv2Switch | None = None

    def start(self, controllers) -> None:
        subprocess.run(["ip", "netns", "attach", self.name, str(self.pid)], check=True, capture_output=True)
        self.cmd("ip link set lo up")
        ports = {self.ports[intf]: intf.name for intf in self.intfList() if intf.name != "lo"}
        opts = Bmv2Options(name=self.name, device_id=self.device_id, ports=ports,
                           grpc=f"unix:{self.sock_dir}/{self.name}.grpc", thrift_port=9090,
                           log_dir=self.run_dir, netns=self.name)
        self.bmv2 = Bmv2Switch(opts).start()

    def port_rx_frames(self) -> dict[int, int]:
        """Per BMv2 port: frames its interface received (the kernel's count). Set beside the
        pipeline's ``received`` counter, the difference is what BMv2 lost before its pipeline."""
        if self.bmv2 is None:
            return {}
        names = {iface: port for port, iface in self.bmv2.options.ports.items()}
        return {names[i]: n for i, n in netns.rx_frames(list(names), self.name).items()}

    def stop(self, deleteIntfs: bool = True) -> None:  # noqa: N803 - Mininet's signature
        if self.bmv2 is not None:
            self.bmv2.stop()
            self.bmv2 = None
        subprocess.run(["ip", "netns", "delete", self.name], capture_output=True)
        super().stop(deleteIntfs)


def build(topo: TopologyDesc, run_dir: Path, sock_dir: Path | None = None) -> Mininet:
    """Create (not start) the Mininet network of ``topo``, with explicit port numbers.

    ``sock_dir`` holds the switches' P4Runtime Unix sockets (default ``run_dir``): a socket's
    path may not exceed 107 bytes, which a deep run directory does."""
    net = Mininet(topo=None, controller=None, build=False, autoSetMacs=False, autoStaticArp=False)
    for sw in topo.switches:
        net.addSwitch(sw.name, cls=DlcpSwitch, run_dir=str(run_dir), device_id=sw.device_id,
                      sock_dir=str(sock_dir or run_dir))
    for h in topo.hosts:
        net.addHost(h.name, cls=Host, ip=f"{h.ip}/8", mac=h.mac)
    for h in topo.hosts:
        net.addLink(h.name, h.switch, port1=0, port2=h.port)
    for link in topo.links:
        net.addLink(link.a, link.b, port1=link.a_port, port2=link.b_port)
    return net


def congestion_control(host) -> str:
    """The TCP congestion control a Mininet host's namespace gives new connections."""
    return host.cmd("sysctl -n net.ipv4.tcp_congestion_control").strip()


def start(net: Mininet, host_tcp: str = "cubic") -> None:
    """Start switches (each waits for its gRPC), configure hosts: static ARP, no IPv6 chatter,
    ``host_tcp`` as every host's TCP congestion control (checked: it must be allowed in host
    namespaces first, :func:`dlcp.topologies.netns.allow_congestion_control`), no TIME_WAIT
    (:mod:`dlcp.topologies.gloo_ports`). Raises :class:`DlcpUserError` when a host refuses ``host_tcp``."""
    net.build()
    net.start()
    net.staticArp()
    for h in net.hosts:
        h.cmd("sysctl -qw net.ipv6.conf.all.disable_ipv6=1")
        h.cmd(f"sysctl -qw net.ipv4.tcp_congestion_control={host_tcp}")
        got = congestion_control(h)
        if got != host_tcp:  # a namespace may take only the allowed ones (allow_congestion_control)
            raise DlcpUserError(f"host {h.name} runs TCP congestion control {got!r}, not {host_tcp!r}: "
                                f"the kernel refused it (allowed in host namespaces: "
                                f"{netns.ALLOWED_CC.read_text().strip()})")
        h.cmd("sysctl -qw {}={}".format(*NO_TIME_WAIT))  # gloo reconnects on fixed ports (gloo_ports)
        h.cmd("ip link set lo up")
        for intf in h.intfList():
            # veth leaves TCP/UDP checksums to "hardware"; BMv2 forwards them unfinished and
            # the receiver drops them. Have the kernel compute them.
            h.cmd(f"ethtool -K {intf.name} tx off rx off >/dev/null 2>&1")
