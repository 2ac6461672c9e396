"""Fixed TCP ports for gloo's connections in the testbed, so that gloo's paths are paired by
repetition as DLCP's and the cross traffic's are.

Why: a switch hashes a TCP flow onto one of the equal-cost paths from its 5-tuple
(:mod:`dlcp.topologies.paths`). gloo chooses its own ports: its listener binds port 0 and its
connections leave from ephemeral ports, so each run of ``gloo`` drew its paths afresh and two
schemes of one repetition met the cross traffic on different links. gloo cannot be told a
port, but Linux takes both from the namespace's ``net.ipv4.ip_local_port_range``, and with a
range of exactly two ports, the first even, the choice is fixed: ``bind`` to port 0 takes the
odd port and ``connect`` the even one (Linux gives the two opposite parities; the namespace
test, tests/testbed/test_gloo_ports.py, checks it with gloo itself). gloo makes one
connection per pair of ranks, opened by the rank whose address is the higher
(``Device::isInitiator`` in gloo's TCP transport). So every connection's 5-tuple is known
before the run, the same for ``gloo``, ``gloo-fp16`` and ``powersgd`` in one repetition.

A closed connection would keep its 4-tuple in TIME_WAIT for a minute, and the next scheme's
identical connection could not be made (``connect`` fails, or ``bind`` skips the listener's
port). The testbed's hosts keep no TIME_WAIT sockets (:data:`NO_TIME_WAIT`, set when the network
starts, so that no connection closing late slips one in): that changes nothing while a
connection is open. The runner reads the connections back while gloo trains
(:func:`parse_connections`), so a run records the ports it had, not the ones intended.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol


#: The sysctl that keeps a namespace's closed TCP connections out of TIME_WAIT.
NO_TIME_WAIT = ("net.ipv4.tcp_max_tw_buckets", "0")


@dataclass(frozen=True)
class GlooPorts:
    """The two ports of a host's range: gloo's connections leave from ``connect``, its listener
    takes ``listen``."""

    connect: int

    def __post_init__(self) -> None:
        if self.connect % 2 or not 1024 <= self.connect < 65535:
            raise ValueError(f"GlooPorts.connect={self.connect}: needs an even port in 1024..65534 "
                             "(Linux gives connect the even port of a two-port range)")

    @property
    def listen(self) -> int:
        return self.connect + 1

    def sysctls(self) -> dict[str, str]:
        """What each gloo host's namespace is set to while gloo runs."""
        return {"net.ipv4.ip_local_port_range": f"{self.connect} {self.listen}"}


@dataclass(frozen=True)
class Connection:
    """One direction of a TCP connection, as a switch hashes it."""

    src: str
    dst: str
    sport: int
    dport: int


def initiates(local: str, remote: str) -> bool:
    """Whether gloo on ``local`` opens the connection to ``remote``: the higher address does."""
    a, b = ipaddress.ip_address(local), ipaddress.ip_address(remote)
    if a.version != b.version:
        raise ValueError(f"gloo ranks at {local} and {remote}: one address family for all ranks")
    if a == b:
        raise ValueError(f"gloo ranks on one address ({local}) share a range: their ports are not fixed")
    return a.packed > b.packed  # as gloo compares them: the address's bytes, in network order


def expected_connections(ips: list[str], ports: GlooPorts) -> list[Connection]:
    """Both directions of every connection between the ranks at ``ips`` when each host's range is
    ``ports``: the initiator's side is ``ports.connect``, the listener's ``ports.listen``."""
    out = []
    for a, src in enumerate(ips):
        for b, dst in enumerate(ips):
            if a != b:
                mine, theirs = (ports.connect, ports.listen) if initiates(src, dst) else (ports.listen, ports.connect)
                out.append(Connection(src, dst, mine, theirs))
    return out


def parse_connections(ss_output: str) -> list[Connection]:
    """The connections in ``ss -tnH state established`` output (columns: receive queue, send
    queue, local address:port, peer address:port), each as the direction the host sends."""
    out = []
    for line in ss_output.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        (src, sport), (dst, dport) = (f.rsplit(":", 1) for f in fields[2:4])
        out.append(Connection(src.strip("[]"), dst.strip("[]"), int(sport), int(dport)))
    return out


class Host(Protocol):
    """A Mininet host, or anything that runs a shell command in a namespace and returns its output."""

    def cmd(self, command: str) -> str: ...


@contextmanager
def fixed_ports(hosts: list[Host], ports: GlooPorts) -> Iterator[None]:
    """Set every host's namespace to ``ports`` (:meth:`GlooPorts.sysctls`) for the block, then put
    back what each had. A setting that does not take raises before gloo starts."""
    with namespace_settings(hosts, ports.sysctls(), "gloo's fixed ports"):
        yield


@contextmanager
def namespace_settings(hosts: list[Host], settings: dict[str, str], why: str) -> Iterator[None]:
    """Set the sysctls ``settings`` in every host's namespace for the block (``why``: whose they
    are, for the error), then put back what each had, in reverse order, whatever happens. A
    setting that does not take (an unknown key, a value the kernel refuses) raises before the
    block runs, with what was set so far put back."""
    saved: list[tuple[Host, str, str]] = []
    try:
        for h in hosts:
            for key, value in settings.items():
                before = h.cmd(f"sysctl -n {key}").strip()
                h.cmd(f"sysctl -qw {key}='{value}'")
                saved.append((h, key, before))
                now = " ".join(h.cmd(f"sysctl -n {key}").split())
                if now != value:
                    raise RuntimeError(f"{why}: could not set {key}={value!r} in a host's namespace "
                                       f"(it reads {now!r})")
        yield
    finally:
        for h, key, before in reversed(saved):
            if before:
                h.cmd(f"sysctl -qw {key}='{' '.join(before.split())}'")
