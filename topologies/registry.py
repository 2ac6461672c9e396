"""What a testbed run started, on disk, so ``dlcp clean`` can undo a run that crashed.

Runs register process ids and switch namespaces in ``REGISTRY`` (``/tmp/dlcp-runs``, or
``$DLCP_RUN_REGISTRY``); a run removes its file when it has torn everything down.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from dlcp.hostagent.errors import DlcpUserError

REGISTRY = Path(os.environ.get("DLCP_RUN_REGISTRY", "/tmp/dlcp-runs"))


@dataclass
class Registry:
    """One run's record: what to kill, which namespaces to delete, which kernel setting to put back."""

    path: Path
    pids: list[int] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)
    allowed_cc: str | None = None
    """The kernel's list of congestion controls host namespaces may take, as it was before the
    run added its own (:func:`dlcp.topologies.netns.allow_congestion_control`); None: unchanged."""
    bpf_cc: bool = False
    """The run registered the BPF DCTCP (:mod:`dlcp.topologies.bpf_dctcp`), to be unregistered."""

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"pids": self.pids, "netns": self.netns, "allowed_cc": self.allowed_cc,
                                         "bpf_cc": self.bpf_cc}))

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


#: The testbeds this process holds (registry directory -> depth): a sweep or a calibration holds
#: it across all its runs, each of which takes it again.
_HELD: dict[Path, int] = {}


@contextmanager
def hold_testbed(registry: Path | None = None) -> Iterator[None]:
    """Hold the testbed for one run (or a sweep's runs: re-entrant within a process), or raise
    at once naming the run that holds it.

    Why: every run names its switch namespaces the same (``dlcpl1``, ...), so a second run
    started beside a live one failed half-way with an unexpected error, and its teardown deleted
    the live run's namespaces, failing that run too. The lock is an ``flock`` on a file beside
    the registry: the kernel drops it when the holder exits, crashed or not, so a dead run never
    keeps the testbed (``dlcp clean`` still removes what it left)."""
    registry = (registry or REGISTRY).resolve()
    if _HELD.get(registry):  # this process holds it already: a sweep's or calibration's runs
        _HELD[registry] += 1
        try:
            yield
        finally:
            _HELD[registry] -= 1
        return
    registry.mkdir(parents=True, exist_ok=True)
    f = open(registry / "testbed.lock", "a+")
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise DlcpUserError(f"another dlcp run (pid {holder}) is using the testbed; wait for it to finish, "
                                "or stop it and run `dlcp clean`") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        _HELD[registry] = 1
        yield
    finally:
        _HELD.pop(registry, None)
        f.close()  # releases the lock
