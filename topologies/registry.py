"""What a testbed run started, on disk, so ``dlcp clean`` can undo a run that crashed.

Runs register process ids and switch namespaces in ``REGISTRY`` (``/tmp/dlcp-runs``, or
``$DLCP_RUN_REGISTRY``); a run removes its file when it has torn everything down.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

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
