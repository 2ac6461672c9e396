"""The README's PyTorch snippet runs as written, under torchrun, on this machine."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def readme_snippet(section: str = "## Use from PyTorch") -> str:
    """The first fenced python block after ``section`` in README.md."""
    text = (ROOT / "README.md").read_text()
    start = text.index(section)
    m = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert m, f"no python block after {section!r}"
    return m.group(1)


def test_the_readme_pytorch_snippet_runs_under_torchrun(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this Python")
    script = tmp_path / "train.py"
    script.write_text(readme_snippet())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DLCP_STORE_PORT", None)
    run = subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                          "--master_port", str(port), str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
