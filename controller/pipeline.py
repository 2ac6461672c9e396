"""Where the committed, compiled P4 program lives (``p4/build``), so nothing needs p4c at run time."""

from __future__ import annotations

import os
from pathlib import Path

#: Override with DLCP_P4_BUILD=/path/to/build.
BUILD_DIR = Path(os.environ.get("DLCP_P4_BUILD", Path(__file__).resolve().parents[1] / "p4" / "build"))
P4INFO = BUILD_DIR / "dlcp.p4info.txt"
BMV2_JSON = BUILD_DIR / "dlcp.json"
