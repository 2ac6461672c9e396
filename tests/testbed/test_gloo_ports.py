"""gloo's connections on fixed ports (:mod:`dlcp.topologies.gloo_ports`), on real namespaces: two
hosts joined by a veth pair, each running the testbed's gloo agent code (its store, its
process group, an all_reduce). The ports are the ones the testbed predicts, again when the
group is formed a second time right after the first (no TIME_WAIT in the way), and the
namespaces get their own ranges back afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlcp.topologies import netns
from dlcp.topologies.gloo_ports import (NO_TIME_WAIT, GlooPorts, expected_connections, fixed_ports,
                                        namespace_settings, parse_connections)
from dlcp.topologies.netns import parse_tcp_counters
from dlcp.topologies.schemes import GLOO_TCP

pytestmark = pytest.mark.netns

IPS = ["10.77.0.1", "10.77.0.2"]
STORE_PORT = 29511
CHILD = """
import json, sys, time, torch, torch.distributed as dist
from pathlib import Path
from dlcp.topologies import ddp_agent
spec, rank, go = json.loads(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
ddp_agent.join(spec, rank)
t = torch.full((4,), float(rank + 1))
dist.all_reduce(t)
assert t.tolist() == [3.0] * 4, t
Path(str(go) + f".up{rank}").touch()
while not go.exists():
    time.sleep(0.05)
ddp_agent.leave()
"""


class NsHost:
    """A named namespace with Mininet's ``cmd``: a shell command run in it, its output."""

    def __init__(self, name: str) -> None:
        self.name = name

    def cmd(self, command: str) -> str:
        return subprocess.run(["ip", "netns", "exec", self.name, "sh", "-c", command], capture_output=True,
                              text=True).stdout


@pytest.fixture
def hosts():
    names = ["dlcp-gpa", "dlcp-gpb"]
    for n in names:
        netns.del_netns(n)
        netns.add_netns(n)
    try:
        netns.add_veth("dlcp-gpa0", "dlcp-gpb0", names[0], names[1])
        for n, ip, dev in zip(names, IPS, ("dlcp-gpa0", "dlcp-gpb0")):
            netns.ip("addr", "add", f"{ip}/24", "dev", dev, netns=n)
        out = [NsHost(n) for n in names]
        for h in out:  # as the testbed's network starts its hosts
            h.cmd("sysctl -qw {}={}".format(*NO_TIME_WAIT))
        yield out
    finally:
        for n in names:
            netns.del_netns(n)


def _form_group(hosts: list[NsHost], tmp: Path, round_: int) -> list:
    """Start the two ranks, read both namespaces' connections while the group is up, let them leave."""
    spec = {"peer_ips": IPS, "store_port": STORE_PORT, "workers": 2, "deadline": 30}
    go = tmp / f"go{round_}"
    procs = [subprocess.Popen(["ip", "netns", "exec", h.name, sys.executable, "-c", CHILD, json.dumps(spec), str(r),
                               str(go)]) for r, h in enumerate(hosts)]
    try:
        deadline = time.monotonic() + 120
        while not all(Path(f"{go}.up{r}").exists() for r in range(2)):
            assert all(p.poll() is None for p in procs), "a rank exited before its group was up"
            assert time.monotonic() < deadline, "the group did not form within 120 s"
            time.sleep(0.1)
        seen = [c for h in hosts for c in parse_connections(h.cmd("ss -tnH state established"))
                if STORE_PORT not in (c.sport, c.dport)]
        go.touch()
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
        return seen
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_gloo_connects_from_the_fixed_ports_every_time(hosts, tmp_path):
    before = [h.cmd("sysctl -n net.ipv4.ip_local_port_range").split() for h in hosts]
    ports = GlooPorts(40100)
    key = lambda c: (c.src, c.dst)  # noqa: E731
    with fixed_ports(hosts, ports):
        for round_ in range(2):  # the second group reuses the first one's 4-tuples
            seen = _form_group(hosts, tmp_path, round_)
            assert sorted(seen, key=key) == sorted(expected_connections(IPS, ports), key=key), f"round {round_}"
    assert [h.cmd("sysctl -n net.ipv4.ip_local_port_range").split() for h in hosts] == before


def test_gloo_ecns_hosts_negotiate_ecn_and_get_their_own_tcp_back(hosts, tmp_path):
    """``gloo-ecn``'s setting reaches gloo's own sockets (each connection negotiated ECN, which
    stock Linux TCP does not ask for), and each namespace reads as before afterwards; a setting
    the kernel refuses raises before anything runs, with what was set put back."""
    before = [h.cmd("sysctl -n net.ipv4.tcp_ecn").strip() for h in hosts]
    assert "1" not in before  # Linux's default (2) answers ECN but never asks for it

    def ect() -> list[int]:  # ECN-capable packets each namespace received
        return [parse_tcp_counters(h.cmd("cat /proc/net/snmp /proc/net/netstat"))["InECT0Pkts"] for h in hosts]

    start = ect()
    with fixed_ports(hosts, GlooPorts(40300)):  # stock gloo: no ECN-capable packet either way
        _form_group(hosts, tmp_path, 0)
    assert ect() == start
    with fixed_ports(hosts, GlooPorts(40200)), namespace_settings(hosts, GLOO_TCP["gloo-ecn"], "gloo-ecn"):
        _form_group(hosts, tmp_path, 1)
    assert all(n > s for n, s in zip(ect(), start)), (start, ect())  # both ends sent ECT(0): negotiated
    assert [h.cmd("sysctl -n net.ipv4.tcp_ecn").strip() for h in hosts] == before
    with pytest.raises(RuntimeError, match="could not set net.ipv4.tcp_no_such_key"):
        with namespace_settings(hosts, {"net.ipv4.tcp_ecn": "1", "net.ipv4.tcp_no_such_key": "1"}, "a test"):
            pass
    assert [h.cmd("sysctl -n net.ipv4.tcp_ecn").strip() for h in hosts] == before
