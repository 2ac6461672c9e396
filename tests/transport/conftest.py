"""Every transport test runs against both data paths and must give the same outcome."""

from __future__ import annotations

import pytest

from dlcp.hostagent.datapath import DATAPATHS, native_available
from dlcp.hostagent.transport import Endpoint, TransportConfig
from tests.conftest import loopback_peers


@pytest.fixture(params=DATAPATHS)
def datapath(request) -> str:
    """``native`` (the compiled path) or ``numpy``; native skips, saying why, when it is not built."""
    if request.param == "native":
        why = native_available()
        if why:
            pytest.skip(why)
    return request.param


@pytest.fixture
def endpoints(datapath):
    """Factory: ``endpoints(n, **config)`` -> started endpoints on loopback on this test's data
    path, closed after the test."""
    made: list[Endpoint] = []

    def make(n: int, per_rank: dict[int, dict] | None = None, **kw) -> list[Endpoint]:
        peers = loopback_peers(n)
        eps = []
        for r in range(n):
            cfg = dict(kw, **(per_rank or {}).get(r, {}))
            cfg.setdefault("datapath", datapath)
            ep = Endpoint(TransportConfig(rank=r, peers=peers, **cfg)).start()
            made.append(ep)
            eps.append(ep)
        return eps

    yield make
    for ep in made:
        ep.close()
