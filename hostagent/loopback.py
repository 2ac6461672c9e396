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
