"""Shared fixtures: free loopback ports, and endpoints that are always closed."""

from __future__ import annotations

import socket

import pytest

from hostagent.transport import Endpoint, Peer, TransportConfig


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


def loopback_peers(n: int) -> tuple[Peer, ...]:
    return tuple(Peer(r, "127.0.0.1", d, c) for r, (d, c) in enumerate(free_port_pairs(n)))


@pytest.fixture
def endpoints():
    """Factory: ``endpoints(n, **config)`` -> started endpoints on loopback, closed after the test."""
    made: list[Endpoint] = []

    def make(n: int, per_rank: dict[int, dict] | None = None, **kw) -> list[Endpoint]:
        peers = loopback_peers(n)
        eps = []
        for r in range(n):
            cfg = dict(kw, **(per_rank or {}).get(r, {}))
            ep = Endpoint(TransportConfig(rank=r, peers=peers, **cfg)).start()
            made.append(ep)
            eps.append(ep)
        return eps

    yield make
    for ep in made:
        ep.close()
