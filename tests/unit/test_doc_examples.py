"""The Python examples in the design pages run as written (a page cannot show an API that
changed under it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design"
PAGES = ["wire-format.md"]


@pytest.mark.parametrize("page", PAGES)
def test_a_design_pages_python_examples_run(page):
    blocks = re.findall(r"```python\n(.*?)```", (DESIGN / page).read_text(), re.S)
    assert blocks, f"{page} has no Python example"
    for code in blocks:
        exec(compile(code, f"{page} example", "exec"), {})
