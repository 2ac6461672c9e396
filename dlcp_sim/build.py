"""Compile the simulator's C++ (``dlcp_sim/ns3/``) against the ns-3 that pip installed.

Why compiled, not called through ns-3's cppyy bindings: the switch and host rules run for every
packet (millions per scenario), and a program built once with ``-O2`` runs them at C++ speed
with no Python per packet, while importing the bindings alone takes about 15 s. The ``ns3``
wheel (``pip install 'dlcp[sim]'``) carries ns-3's headers and shared libraries; this module
finds them without importing the package, compiles once per (sources, ns-3, compiler) and
caches the program under ``~/.cache/dlcp/sim`` (``DLCP_SIM_CACHE`` to move it).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dlcp.hostagent.errors import DlcpUserError

SOURCES = Path(__file__).parent / "ns3"
#: ns-3 modules the program links (their static initialisers register TypeIds, so all of them
#: are linked even where no symbol is referenced).
MODULES = ("core", "network", "internet", "point-to-point", "traffic-control", "stats", "bridge", "mpi")


class SimUnavailable(DlcpUserError):
    """ns-3 or a C++ compiler is missing; the message says what to install."""


@dataclass(frozen=True)
class Ns3Install:
    include: Path
    lib: Path
    version: str

    def libraries(self) -> list[str]:
        found = []
        for module in MODULES:
            hits = sorted(self.lib.glob(f"libns3*-{module}.so"))
            if hits:
                found.append(hits[0].name[3:-3])
        return found


def find_ns3() -> Ns3Install:
    """The headers and libraries of the pip-installed ns-3, found without importing it."""
    spec = importlib.util.find_spec("ns3")
    if spec is None or not spec.submodule_search_locations:
        raise SimUnavailable("dlcp sim needs ns-3: pip install -e '.[sim]' (the ns3 package, about 520 MB)")
    root = Path(next(iter(spec.submodule_search_locations)))
    include = root / "include"
    lib = next((root / d for d in ("lib64", "lib")
                if (root / d / "").is_dir() and any((root / d).glob("libns3*-core.so"))), None)
    if not (include / "ns3" / "core-module.h").is_file() or lib is None:
        raise SimUnavailable(f"the ns3 package at {root} has no headers or libraries (include/ns3, lib64)")
    cores = sorted(lib.glob("libns3*-core.so"))
    version = cores[0].name[len("libns3"):-len("-core.so")].lstrip(".")
    return Ns3Install(include, lib, version)


def _digest(ns3: Ns3Install, compiler: str) -> str:
    h = hashlib.sha256()
    for f in sorted(SOURCES.iterdir()):
        if f.suffix in (".h", ".cc"):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(f"{ns3.version}|{ns3.lib}|{compiler}".encode())
    return h.hexdigest()[:16]


def simulator(verbose: bool = False) -> Path:
    """Path of the compiled simulator, building it first if the sources or ns-3 changed.

    Raises:
        SimUnavailable: ns-3 or g++ is missing, or the compiler failed (its errors are quoted).
    """
    ns3 = find_ns3()
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        raise SimUnavailable("dlcp sim compiles its ns-3 components once and needs a C++ compiler: apt-get install g++")
    cache = Path(os.environ.get("DLCP_SIM_CACHE", Path.home() / ".cache" / "dlcp" / "sim"))
    exe = cache / _digest(ns3, cxx) / "dlcp-sim"
    if exe.is_file():
        return exe
    exe.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=exe.parent) as tmp:
        out = Path(tmp) / "dlcp-sim"
        cmd = [cxx, "-O2", "-std=c++20", "-I", str(ns3.include), str(SOURCES / "main.cc"), "-o", str(out),
               "-L", str(ns3.lib), "-Wl,--no-as-needed", *(f"-l{lib}" for lib in ns3.libraries()),
               f"-Wl,-rpath,{ns3.lib}"]
        if verbose:
            print("compiling the simulator:", " ".join(cmd))
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SimUnavailable(f"compiling dlcp_sim/ns3/main.cc failed:\n{done.stderr[-4000:]}")
        os.replace(out, exe)  # atomic: a concurrent build never sees half a program
    for old in cache.iterdir():  # builds of older sources are never used again
        if old.is_dir() and old != exe.parent and (old / "dlcp-sim").is_file():
            shutil.rmtree(old, ignore_errors=True)
    return exe
