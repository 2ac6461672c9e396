"""Network namespaces and veth pairs, through iproute2 (``ip``).

Everything DLCP creates carries a name prefix so that cleanup can find exactly its own
leftovers (``dlcp clean``) and nothing else.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

#: Prefix of every namespace and root-namespace interface DLCP creates.
PREFIX = "dlcp"


class NetnsError(RuntimeError):
    """An ``ip`` command failed; the message has the command and its error."""


def ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", netns] if netns else []) + ["ip", *args]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {res.stderr.strip()}")
    return res


def rx_frames(ifaces: list[str], netns: str | None = None) -> dict[str, int]:
    """Frames the kernel delivered to each of ``ifaces`` (its ``rx_packets``), in one ``ip``
    call; an interface that is gone is left out."""
    import json

    res = ip("-j", "-s", "link", "show", netns=netns)
    want = set(ifaces)
    return {link["ifname"]: int(link["stats64"]["rx"]["packets"])
            for link in json.loads(res.stdout or "[]") if link.get("ifname") in want and "stats64" in link}


def sysctl(key: str, value: str, netns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", netns] if netns else []) + ["sysctl", "-qw", f"{key}={value}"]
    subprocess.run(cmd, capture_output=True)


#: Where the kernel lists the congestion controls a non-initial namespace may choose: a host
#: namespace asking for any other gets EPERM (``sysctl`` says so on stderr and nothing else does).
ALLOWED_CC = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")


def with_allowed(allowed: str, names: tuple[str, ...]) -> str | None:
    """The allowed list (``allowed`` as the kernel prints it) with ``names`` added; None when all
    are there already."""
    have = allowed.split()
    more = [n for n in dict.fromkeys(names) if n not in have]
    return " ".join([*have, *more]) if more else None


def allow_congestion_control(*names: str) -> str | None:
    """Let every namespace choose each of ``names`` (root, initial namespace). Returns the list as
    it was when this changed it (for :func:`restore_allowed_congestion_controls`), None when all
    were allowed already. Raises :class:`NetnsError` when the kernel refuses (not loaded, not root)."""
    before = ALLOWED_CC.read_text().strip()
    wanted = with_allowed(before, names)
    if wanted is None:
        return None
    try:
        ALLOWED_CC.write_text(wanted)
    except OSError as exc:
        raise NetnsError(f"cannot allow TCP congestion control {' '.join(names)} in host namespaces "
                         f"(writing {ALLOWED_CC}: {exc.strerror}); allowed: {before}") from None
    return before


def restore_allowed_congestion_controls(before: str | None) -> None:
    """Put back the allowed list :func:`allow_congestion_control` changed (None: it changed nothing)."""
    if before is not None:
        ALLOWED_CC.write_text(before)


def add_netns(name: str) -> None:
    """Create a namespace with its loopback up (gRPC on 127.0.0.1 needs it)."""
    ip("netns", "add", name)
    ip("link", "set", "lo", "up", netns=name)


def del_netns(name: str) -> None:
    ip("netns", "del", name, check=False)


def netns_exists(name: str) -> bool:
    return Path(f"/var/run/netns/{name}").exists()


def add_veth(a: str, b: str, netns_a: str | None = None, netns_b: str | None = None, mtu: int = 1500) -> None:
    """A veth pair a<->b, each end moved into its namespace (None: stays here), up, no IPv6 chatter."""
    ip("link", "add", a, "type", "veth", "peer", "name", b)
    for end, ns in ((a, netns_a), (b, netns_b)):
        if ns:
            ip("link", "set", end, "netns", ns)
        sysctl(f"net.ipv6.conf.{end}.disable_ipv6", "1", ns)
        ip("link", "set", end, "mtu", str(mtu), netns=ns)
        ip("link", "set", end, "up", netns=ns)


def del_link(name: str, netns: str | None = None) -> None:
    ip("link", "del", name, netns=netns, check=False)


def list_netns(prefix: str = PREFIX) -> list[str]:
    res = ip("netns", "list", check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.split() and line.split()[0].startswith(prefix)]


def list_links(prefix: str = PREFIX) -> list[str]:
    res = ip("-o", "link", "show", check=False)
    out = []
    for line in res.stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith(prefix):
                out.append(name)
    return out


#: The kernel's TCP counters a testbed run records per host (``/proc/net/snmp``'s Tcp line and
#: ``/proc/net/netstat``'s TcpExt and IpExt): segments sent and resent, and retransmission
#: timeouts, the events that cost a connection its minimum RTO (200 ms on Linux) on a lossy FIFO;
#: and ECN: ``TCPDeliveredCE``, segments this host sent that arrived marked (its receiver echoed
#: them), ``InCEPkts``, marked IP packets this host received, and ``InECT0Pkts``, packets it
#: received that their sender made ECN-capable (the sign a connection negotiated ECN: ``ss`` does
#: not print ``ecn`` for it on every machine). A TCP that did not ask for ECN sends packets no
#: switch may mark, so all three stay 0 for it.
TCP_COUNTERS = {"Tcp": ("OutSegs", "RetransSegs"), "TcpExt": ("TCPTimeouts", "TCPLossProbes", "TCPDeliveredCE"),
                "IpExt": ("InCEPkts", "InECT0Pkts")}


def parse_tcp_counters(text: str) -> dict[str, int]:
    """:data:`TCP_COUNTERS` from the text of ``/proc/net/snmp`` and ``/proc/net/netstat``
    (pairs of lines: ``Tcp: names...`` then ``Tcp: values...``); a counter missing is 0."""
    out = {name: 0 for names in TCP_COUNTERS.values() for name in names}
    lines = text.splitlines()
    for head, values in zip(lines, lines[1:]):
        kind, _, names = head.partition(":")
        if kind in TCP_COUNTERS and values.startswith(kind + ":") and not values.split()[1][0].isalpha():
            for name, value in zip(names.split(), values.partition(":")[2].split()):
                if name in TCP_COUNTERS[kind]:
                    out[name] = int(value)
    return out


def tcp_counters(pid: int) -> dict[str, int] | None:
    """:func:`parse_tcp_counters` in the network namespace of process ``pid`` (a Mininet host's
    shell); None when they cannot be read (not zeros, which would read as a clean run)."""
    res = subprocess.run(["mnexec", "-a", str(pid), "cat", "/proc/net/snmp", "/proc/net/netstat"],
                         capture_output=True, text=True)
    return parse_tcp_counters(res.stdout) if res.returncode == 0 and "Tcp:" in res.stdout else None
