"""Free ports on loopback, for peers started on one machine (tests, benchmarks, local runs).

It lives at the bottom layer so every package above, and the tests, can share one helper.
"""

from __future__ import annotations

import random
import socket


def free_port_pairs(n: int) -> list[tuple[int, int]]:
    """``n`` (udp, tcp) port pairs free on 127.0.0.1 right now (each number free for both)."""
    ports = _free_ports(2 * n)
    return [(ports[2 * i], ports[2 * i + 1]) for i in range(n)]


def free_tcp_ports(n: int) -> tuple[int, ...]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now (stores, rendezvous)."""
    return tuple(_free_ports(n))


def _pick_range() -> tuple[int, int] | None:
    """Where ports are picked: below the kernel's ephemeral range, from which every connect()
    and bind to port 0 draws. A port picked inside it can be taken by any process's outgoing
    connection between the pick and its user's bind (a test suite opens thousands of
    connections; a rank binds its store seconds later, after importing torch): seen as
    EADDRINUSE. None when the ephemeral range leaves no room below it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return (max(10000, low - 12000), low - 1) if low > 11000 else None


def _bindable(port: int, host: str) -> bool:
    """Whether ``port`` on ``host`` takes a UDP and a TCP bind now."""
    socks: list[socket.socket] = []
    try:
        for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
            socks.append(socket.socket(socket.AF_INET, kind))
            socks[-1].bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def _free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct port numbers free for both UDP and TCP on ``host``, picked at random below
    the ephemeral range (:func:`_pick_range`; inside it, as the kernel picks, where there is no
    room below)."""
    span = _pick_range()
    rng = random.SystemRandom()  # (pickers in parallel processes start apart)
    out: list[int] = []
    for _ in range(100 * n):
        if len(out) == n:
            break
        if span is None:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                u.bind((host, 0))
                port = u.getsockname()[1]
        else:
            port = rng.randint(*span)
        if port not in out and _bindable(port, host):
            out.append(port)
    if len(out) < n:
        raise RuntimeError(f"found {len(out)} of {n} ports free for both UDP and TCP on {host}")
    return out


def free_shared_port() -> int:
    """One port number free for both UDP and TCP on every address (a sink that binds both on
    0.0.0.0, as the testbed's cross-traffic sink does)."""
    return _free_ports(1, "0.0.0.0")[0]
