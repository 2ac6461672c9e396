"""The codes the compiled data path and the protocol core share are defined once in Python
(:mod:`dlcp.hostagent.protocol.port`) and mirrored in C++ (``hostagent/native``): this reads the
C++ sources, so a reason or an event added or reordered on one side only fails here, without a
build (as the P4 header is checked against the compiled JSON)."""

from __future__ import annotations

import re
from pathlib import Path

from dlcp.hostagent.protocol.port import DONE_HOW, REASONS, STOP_SENT, EventKind

NATIVE = Path(__file__).resolve().parents[2] / "hostagent" / "native"


def _enum(source: str, name: str) -> list[str]:
    """The enumerators of C++ ``enum name : type { ... }``, comments stripped, in order."""
    body = re.search(r"enum\s+" + name + r"\s*:\s*\w+\s*\{(.*?)\};", source, re.S)
    assert body, f"enum {name} not found in the C++ sources"
    text = re.sub(r"//[^\n]*", "", body.group(1))
    return [e.strip() for e in text.split(",") if e.strip()]


def test_rejection_reasons_agree_in_name_and_order_with_the_compiled_path():
    header = (NATIVE / "datapath.h").read_text()
    codes = _enum(header, "Reason")
    assert codes[-1] == "N_REASONS" and codes[0] == "OK = 0"
    assert [c.lower() for c in codes[1:-1]] == list(REASONS[1:])
    # the names Datapath::rejected() reports, by code
    names = re.search(r"names\[N_REASONS\]\s*=\s*\{(.*?)\};", (NATIVE / "tx.cc").read_text(), re.S)
    assert names, "Datapath::rejected's names not found"
    assert tuple(re.findall(r'"(\w+)"', names.group(1))) == REASONS


def test_event_kinds_agree_in_value_with_the_compiled_path():
    kinds = _enum((NATIVE / "datapath.h").read_text(), "EventKind")
    cxx = {}
    for k in kinds:
        name, value = (x.strip() for x in k.split("="))
        cxx[name.removeprefix("EV_")] = int(value)
    assert cxx == {k.name: k.value for k in EventKind}


def test_completion_codes_agree_with_the_compiled_path():
    """EV_RX_DONE's ``a``: the compiled path's ``enum DoneHow`` against DONE_HOW and STOP_SENT
    (RX_BY_CORE is never reported: the core completed the message itself)."""
    cxx = {}
    for k in _enum((NATIVE / "datapath.h").read_text(), "DoneHow"):
        name, value = (x.strip() for x in k.split("="))
        cxx[name] = int(value)
    assert {cxx["RX_EXACT"]: "exact", cxx["RX_BOUNDED"]: "bounded", cxx["RX_EXACT_STOPPED"]: "exact"} == DONE_HOW
    assert cxx["RX_EXACT_STOPPED"] == STOP_SENT and cxx["RX_BY_CORE"] not in DONE_HOW
