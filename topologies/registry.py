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
    """One run's record: what to kill and which namespaces to delete."""

    path: Path
    pids: list[int] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"pids": self.pids, "netns": self.netns}))

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
