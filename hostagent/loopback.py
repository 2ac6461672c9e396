"""Free ports on loopback, for peers started on one machine (tests, benchmarks, local runs).

It lives at the bottom layer so every package above, and the tests, can share one helper.
"""

from __future__ import annotations

import socket


def free_port_pairs(n: int) -> list[tuple[int, int]]:
    """``n`` (udp, tcp) port pairs free on 127.0.0.1 right now."""
    socks, pairs = [], []
    for _ in range(n):
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.bind(("127.0.0.1", 0))
        t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        t.bind(("127.0.0.1", 0))
        socks += [u, t]
        pairs.append((u.getsockname()[1], t.getsockname()[1]))
    for s in socks:
        s.close()
    return pairs


def free_tcp_ports(n: int) -> tuple[int, ...]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now (stores, rendezvous)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return tuple(s.getsockname()[1] for s in socks)
    finally:
        for s in socks:
            s.close()


def free_shared_port() -> int:
    """One port number free for both UDP and TCP on every address (a sink that binds both on
    0.0.0.0, as the testbed's cross-traffic sink does)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.bind(("0.0.0.0", 0))
            port = u.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
                try:
                    t.bind(("0.0.0.0", port))
                except OSError:
                    continue
                return port
    raise RuntimeError("no port number is free for both UDP and TCP")
