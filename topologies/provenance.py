"""What made a set of results: the command line, the source commit and the start time.

One definition for the testbed's runs and the simulator's, so every results page can say
which command at which commit made its figures.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def provenance(stamp: str) -> dict:
    """What made a run, for its results page: the command line, the source commit (``-dirty``
    with uncommitted changes; None outside a git checkout) and the start time."""
    repo = Path(__file__).resolve().parents[1]
    commit = None
    if (repo / ".git").exists():
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True).stdout.strip()
        commit = git("rev-parse", "--short", "HEAD") or None
        if commit and git("status", "--porcelain", "--untracked-files=no"):
            commit += "-dirty"
    return {"command": " ".join(["dlcp", *sys.argv[1:]]), "commit": commit, "started": stamp}
