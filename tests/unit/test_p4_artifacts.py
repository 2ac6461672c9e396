"""The committed P4 artifacts agree with the Python side: one wire format, one port, one set of names."""

import json
import subprocess
from pathlib import Path

import pytest

from dlcp.controller import desired, pipeline
from dlcp.controller.p4info import P4Schema
from dlcp.hostagent import wire

ROOT = Path(__file__).resolve().parents[2]


def _bmv2_json():
    return json.loads(pipeline.BMV2_JSON.read_text())


def test_dlcp_header_matches_wire_field_by_field():
    types = {h["name"]: h for h in _bmv2_json()["header_types"]}
    fields = [(name, width) for name, width, _signed in types["dlcp_t"]["fields"]]
    assert fields == wire.header_fields_for_p4()


def test_parser_selects_dlcp_on_the_wire_ports():
    """Every port of the block wire.dlcp_ports() lists (the default among them), and no other."""
    states = {s["name"]: s for s in _bmv2_json()["parsers"][0]["parse_states"]}
    to_dlcp = [t for t in states["parse_udp"]["transitions"] if t["next_state"] == "parse_dlcp"]
    assert len(to_dlcp) == 1
    value, mask = int(to_dlcp[0]["value"], 16), int(to_dlcp[0]["mask"], 16)
    assert (value, mask) == (wire.DLCP_UDP_PORT_BLOCK, wire.DLCP_UDP_PORT_MASK)
    parsed = [p for p in range(1 << 16) if p & mask == value]
    assert parsed == sorted(wire.dlcp_ports()) and wire.dlcp_ports()[0] == wire.DLCP_UDP_PORT
    assert all(wire.is_dlcp_port(p) for p in parsed) and not wire.is_dlcp_port(parsed[-1] + 1)


def test_every_table_the_controller_owns_exists():
    schema = P4Schema.load(pipeline.P4INFO)
    for t in desired.owned_tables():
        schema.table(t)  # raises if missing
    for c in ("forwarded", "selective_dropped", "tail_dropped", "ecn_marked", "drop_reason"):
        schema.counter(c)


def test_controller_constants_match_p4_defines():
    from dlcp.controller import priority_queue, spray

    defines = (ROOT / "p4/include/defines.p4").read_text()

    def define(name):
        for line in defines.splitlines():
            if line.startswith(f"#define {name} "):
                return int(line.split()[2], 0)
        raise AssertionError(name)

    assert define("VQ_FRAC_BITS") == priority_queue.VQ_FRAC_BITS
    assert define("NUM_QUEUES") == priority_queue.NUM_QUEUES
    assert define("DLCP_UDP_PORT") == wire.DLCP_UDP_PORT
    assert define("DLCP_VERSION") == wire.VERSION
    assert (define("DLCP_UDP_PORT_BLOCK"), define("DLCP_UDP_PORT_MASK")) == (wire.DLCP_UDP_PORT_BLOCK,
                                                                            wire.DLCP_UDP_PORT_MASK)
    assert {define("LB_ROUND_ROBIN"), define("LB_RANDOM"), define("LB_FLOW")} == set(spray.LB_MODES.values())
    assert define("LB_FLOW") == spray.LB_MODES["flow"]
    assert define("LB_RANDOM") == spray.LB_MODES["random"]


@pytest.mark.p4c
def test_committed_artifacts_are_fresh(tmp_path):
    """Recompiling p4/ gives exactly what p4/build holds (run `make p4` after editing P4)."""
    out_json, out_info = tmp_path / "dlcp.json", tmp_path / "dlcp.p4info.txt"
    subprocess.run(["p4c-bm2-ss", "--arch", "v1model", "--std", "p4-16", "-I", "p4/include",
                    "--p4runtime-files", str(out_info), "-o", str(out_json), "p4/dlcp.p4"],
                   cwd=ROOT, check=True, capture_output=True)
    assert out_info.read_text() == pipeline.P4INFO.read_text(), "p4/build/dlcp.p4info.txt is stale: run make p4"
    assert json.loads(out_json.read_text()) == _bmv2_json(), "p4/build/dlcp.json is stale: run make p4"


def test_the_p4_build_is_found_in_a_checkout_or_where_dlcp_p4_build_says(monkeypatch, tmp_path):
    monkeypatch.delenv("DLCP_P4_BUILD", raising=False)
    assert pipeline.build_dir() == Path(pipeline.__file__).resolve().parents[1] / "p4" / "build"
    monkeypatch.setenv("DLCP_P4_BUILD", str(tmp_path))
    assert pipeline.build_dir() == tmp_path
