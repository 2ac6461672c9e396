"""Shared fixtures: free loopback ports, and endpoints that are always closed."""

from __future__ import annotations

import os as _os
import shutil as _shutil

import pytest


def _load_native_module(path: str) -> None:
    """Use the compiled data path at ``path`` instead of the installed one: ``make sanitize``
    runs the tests on builds with ThreadSanitizer and AddressSanitizer this way."""
    import importlib.machinery
    import importlib.util
    import sys

    import dlcp.hostagent

    name = "dlcp.hostagent._datapath"
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None or spec.loader is None:
        raise ImportError(f"DLCP_NATIVE_MODULE={path} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    dlcp.hostagent._datapath = module


if _os.environ.get("DLCP_NATIVE_MODULE"):
    _load_native_module(_os.environ["DLCP_NATIVE_MODULE"])

from dlcp.hostagent.loopback import free_port_pairs  # noqa: E402
from dlcp.hostagent.transport import Endpoint, Peer, TransportConfig  # noqa: E402


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


# --- markers: tests that need BMv2, p4c or root skip with a one-line reason --------------


def _missing(marker: str) -> str | None:
    if marker in ("bmv2", "root", "netns") and _os.geteuid() != 0:
        return "needs root (network namespaces and veth pairs)"
    if marker == "netns" and not _shutil.which("tc"):
        return "needs tc (iproute2) for the ports' schedulers"
    if marker == "bmv2" and not _shutil.which("simple_switch_grpc"):
        return "needs BMv2 simple_switch_grpc on PATH (install BMv2 from p4lang's packages)"
    if marker == "p4c" and not _shutil.which("p4c-bm2-ss"):
        return "needs p4c-bm2-ss on PATH (install p4c from p4lang's packages)"
    if marker == "root" and not _shutil.which("mnexec"):
        return "needs Mininet (mnexec on PATH)"
    if marker == "ns3":
        import importlib.util

        if importlib.util.find_spec("ns3") is None:
            return "needs ns-3 (pip install -e '.[sim]')"
        if not (_os.environ.get("CXX") or _shutil.which("g++")):
            return "needs a C++ compiler (g++) to build the simulator once"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker in ("bmv2", "p4c", "root", "netns", "ns3"):
            if item.get_closest_marker(marker):
                reason = _missing(marker)
                if reason:
                    item.add_marker(pytest.mark.skip(reason=reason))
                    break
