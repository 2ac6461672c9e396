"""Endpoints on loopback for the transport tests, on the compiled data path (skipped, saying why,
where it is not built). The numpy reference model (tests/reference/numpy_path.py) is compared
with it below the protocol, in test_datapath.py and test_sealing.py, not end to end."""

from __future__ import annotations

import pytest

from dlcp.hostagent.datapath import native_available
from dlcp.hostagent.transport import Endpoint, TransportConfig
from tests.conftest import loopback_peers


@pytest.fixture
def datapath() -> str:
    """``native``, the compiled path (the test skips, saying why, when it is not built)."""
    why = native_available()
    if why:
        pytest.skip(why)
    return "native"


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
