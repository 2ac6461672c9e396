"""The BPF DCTCP (:mod:`dlcp.topologies.bpf_dctcp`) on a real kernel: built, registered, chosen by
two host namespaces whose connection then asks for ECN by itself and sends ECN-capable data, and
unregistered again. Skipped with the reason where the kernel has DCTCP of its own or a
prerequisite (clang, bpftool, libbpf's headers, BTF, root) is missing."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from dlcp.topologies import bpf_dctcp, netns
from dlcp.topologies.netns import parse_tcp_counters

pytestmark = pytest.mark.netns

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 5599)); s.listen()
c, _ = s.accept()
while c.recv(1 << 16):
    pass
"""
CLIENT = """
import socket, sys
s = socket.create_connection((sys.argv[1], 5599), timeout=10)
print(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\\0").decode())
s.sendall(b"x" * 2_000_000)
s.close()
"""


@pytest.fixture
def pair():
    why = bpf_dctcp.why_unavailable()
    if why is not None:
        pytest.skip(why)
    names = ["dlcp-dca", "dlcp-dcb"]
    for n in names:
        netns.del_netns(n)
        netns.add_netns(n)
    netns.add_veth("dlcp-dca0", "dlcp-dcb0", names[0], names[1])
    for n, ip, dev in zip(names, ("10.78.0.1", "10.78.0.2"), ("dlcp-dca0", "dlcp-dcb0")):
        netns.ip("addr", "add", f"{ip}/24", "dev", dev, netns=n)
    try:
        yield names
    finally:
        for n in names:
            netns.del_netns(n)


def _in(ns: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", ns, *args], capture_output=True, text=True, **kw)


def test_two_hosts_run_gloo_dctcps_tcp_with_ecn_and_it_goes_away_after(pair):
    a, b = pair
    was_registered = bpf_dctcp.registered()
    ours = bpf_dctcp.register()
    before = netns.allow_congestion_control(bpf_dctcp.NAME)
    try:
        assert bpf_dctcp.registered() and ours == (not was_registered)
        for ns in pair:  # Linux's default: answers ECN, never asks for it
            assert _in(ns, "sysctl", "-qw", f"net.ipv4.tcp_congestion_control={bpf_dctcp.NAME}",
                       "net.ipv4.tcp_ecn=2").returncode == 0
        def ect(ns: str) -> int:  # ECN-capable packets the namespace received
            return parse_tcp_counters(_in(ns, "cat", "/proc/net/snmp", "/proc/net/netstat").stdout)["InECT0Pkts"]

        start = ect(b)
        server = subprocess.Popen(["ip", "netns", "exec", b, sys.executable, "-c", SERVER, "10.78.0.2"])
        time.sleep(0.5)
        client = _in(a, sys.executable, "-c", CLIENT, "10.78.0.2", timeout=60)
        server.wait(30)
        assert client.returncode == 0, client.stderr
        assert client.stdout.strip() == bpf_dctcp.NAME
        assert ect(b) - start > 1000  # DCTCP asked for ECN by itself: its data was ECT
    finally:
        netns.restore_allowed_congestion_controls(before)
        if ours:
            bpf_dctcp.unregister()
    assert bpf_dctcp.registered() == was_registered
