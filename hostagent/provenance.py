"""What made a set of results: the command line, the source commit and the start time.

One definition for the testbed's runs and the simulator's, so every results page can say
which command at which commit made its figures.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

#: :func:`cpu_probe_ms`'s loop: iterations of one multiply-add in the interpreter.
PROBE_ITERATIONS = 200_000


def provenance(stamp: str, program: str = "dlcp", args: Sequence[str] | None = None) -> dict:
    """What made a run, for its results page: the command line (``program`` and ``args``, by
    default this process's arguments), the source commit (``-dirty`` with uncommitted changes;
    None outside a git checkout) and the start time."""
    repo = Path(__file__).resolve().parents[1]
    commit = None
    if (repo / ".git").exists():
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True).stdout.strip()
        commit = git("rev-parse", "--short", "HEAD") or None
        if commit and git("status", "--porcelain", "--untracked-files=no"):
            commit += "-dirty"
    return {"command": " ".join([program, *(sys.argv[1:] if args is None else args)]), "commit": commit,
            "started": stamp}


def cpu_probe_ms(repeats: int = 5) -> float:
    """Milliseconds one core takes for a fixed loop of Python (:data:`PROBE_ITERATIONS`), the
    best of ``repeats``: how fast the machine ran when it was called. Why: this machine's vCPUs
    run at different speeds for minutes to hours at a time, and the testbed's figures follow
    them (the simulator's validation setup ran 12-25 % faster one evening than that morning,
    gloo's unchanged path too, the machine busy 32-39 % against 53-60 %: sim-validation.md);
    a run records the speed each scheme's run met, so runs compared across time say whether
    they met the same machine."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        acc = 0
        for i in range(PROBE_ITERATIONS):
            acc += i * i
        best = min(best, time.perf_counter() - t0)
    return round(1e3 * best, 3)


def provenance_lines(results: dict, source: str = "") -> list[str]:
    """A results-page section's lines on what made it: the command and commit (when the results
    record them) and the results file the tables come from."""
    prov = results.get("provenance") or {}
    lines = []
    if prov:
        lines += [f"Command: `{prov.get('command', '?')}` at commit {prov.get('commit', '?')}, "
                  f"started {prov.get('started', '?')}.", ""]
    if source:
        lines += [f"Results file: `{source}`.", ""]
    return lines


def results_file(given: str) -> Path:
    """The results.json a command line names: the file itself, or the one in a run directory."""
    path = Path(given)
    return path / "results.json" if path.is_dir() else path


def write_slim(directory: str, path: Path, slim: dict) -> str:
    """Keep ``slim`` (results without per-iteration records) as ``directory/<run>.json``, named for
    the run directory of ``path``; returns where it went."""
    import json

    out = Path(directory) / f"{path.parent.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(slim, indent=1) + "\n")
    return str(out)

