"""Where the committed, compiled P4 program lives, so nothing needs p4c at run time.

In a source checkout it is ``p4/build``; an installed copy carries the same two files in
``dlcp/controller/p4_build`` (the wheel's build installs them there). ``DLCP_P4_BUILD`` overrides both.
"""

from __future__ import annotations

import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def build_dir() -> Path:
    """The directory of ``dlcp.json`` and ``dlcp.p4info.txt``: ``DLCP_P4_BUILD``, else the
    checkout's ``p4/build``, else the installed copy's ``dlcp/controller/p4_build``."""
    if os.environ.get("DLCP_P4_BUILD"):
        return Path(os.environ["DLCP_P4_BUILD"])
    checkout = _HERE.parent / "p4" / "build"
    return checkout if (checkout / "dlcp.json").exists() else _HERE / "p4_build"


BUILD_DIR = build_dir()
P4INFO = BUILD_DIR / "dlcp.p4info.txt"
BMV2_JSON = BUILD_DIR / "dlcp.json"
