"""The victim of the hostile-traffic benchmarks (``bench/hostile.py``, ``bench/forgeries.py``): two
endpoints on loopback that share a fresh job secret, and a stream of exact messages between them
whose every tensor is checked."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from dlcp.hostagent import auth
from dlcp.hostagent.loopback import free_port_pairs
from dlcp.hostagent.policy import Policy
from dlcp.hostagent.transport import Endpoint, Peer, TransportConfig

EXACT = Policy(loss_bound_push=0.0)


def exact_pair() -> tuple[Endpoint, Endpoint]:
    """Ranks 0 and 1 on loopback, started, with one fresh job secret and exact messages (bound 0);
    the caller closes them."""
    secret = auth.parse_secret(auth.new_secret())
    peers = tuple(Peer(r, "127.0.0.1", d, c) for r, (d, c) in enumerate(free_port_pairs(2)))
    a, b = (Endpoint(TransportConfig(rank=r, peers=peers, policy=EXACT, secret=secret)).start() for r in range(2))
    return a, b


def run_messages(a: Endpoint, b: Endpoint, ids: range, size: int,
                 until: Callable[[], bool] | None = None) -> tuple[list[float], int]:
    """Send messages ``ids`` of ``size`` float32 from a (rank 0) to b (rank 1), one after another:
    all of them, or (``until``) at least 10 and while ``until()`` holds. Returns their completion
    times (s) and how many arrived not exactly as sent."""
    times, wrong = [], 0
    for mid in ids:
        x = np.random.default_rng(mid).standard_normal(size).astype(np.float32)
        t0 = time.monotonic()
        h = b.recv(0, mid)
        a.send(1, x, mid)
        got = h.wait(60).data
        times.append(time.monotonic() - t0)
        wrong += int(not np.array_equal(got, x))
        if until is not None and not until() and len(times) >= 10:
            break
    return times, wrong
