"""Controller logic that needs no switch: entry encoding, the network file, reconciling."""

import dataclasses
import os
from pathlib import Path

import pytest
import yaml
from google.protobuf import text_format

from dlcp.controller import desired, pipeline
from dlcp.controller.entries import EntryError, TableEntry, encode_value
from dlcp.controller.network import NetworkError, load_network, parse_network
from dlcp.controller.p4info import P4Schema, SchemaError
from dlcp.controller.priority_queue import queue_settings, rate_fixed_point
from dlcp.controller.reconcile import diff

GOLDEN = Path(__file__).parent / "golden"
SCHEMA = P4Schema.load(pipeline.P4INFO)

NET = {
    "policy": {"drop_thresholds": [24, 16, 8], "ecn_threshold": 12, "lb_mode": "random"},
    "dscp_queues": {46: 7},
    "hosts": {"h1": {"ip": "10.0.0.1", "mac": "00:00:0a:00:00:01", "switch": "s1", "port": 1}},
    "switches": {"s1": {
        "grpc": "127.0.0.1:50051", "device_id": 1, "thrift_port": 9090,
        "ports": {1: {"mac": "00:aa:00:00:00:01"}, 2: {"mac": "00:aa:00:00:00:02", "capacity_pps": 500, "buffer": 32,
                                                            "interface": "s1-eth2"},
                  3: {"mac": "00:aa:00:00:00:03"}},
        "routes": [{"prefix": "10.0.0.1/32", "port": 1, "dmac": "00:00:0a:00:00:01"},
                   {"prefix": "10.0.1.0/24", "group": 1}],
        "groups": {1: [{"port": 2, "dmac": "00:bb:00:00:00:01"}, {"port": 3, "dmac": "00:cc:00:00:00:01"}]},
    }},
}


def _net(**changes):
    data = yaml.safe_load(yaml.safe_dump(NET))
    sw = data["switches"]["s1"]
    for k, v in changes.items():
        if k in ("policy", "dscp_queues", "hosts"):
            data[k] = v
        else:
            sw[k] = v
    return parse_network(data, "test.yaml")


def test_desired_entries_match_golden():
    """Every entry the sample network yields, encoded against the committed P4Info."""
    net = _net()
    msgs = [e.encode(SCHEMA) for e in desired.desired_entries(net.switches["s1"], net)]
    text = "\n".join(text_format.MessageToString(m, as_one_line=True) for m in msgs) + "\n"
    path = GOLDEN / "s1_entries.txt"
    if os.environ.get("DLCP_REGEN_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), "entry encoding changed; if intended, regenerate with DLCP_REGEN_GOLDEN=1"


def test_entry_encoding_by_hand():
    e = TableEntry("ipv4_lpm", {"dst_addr": ("10.0.1.77", 24)}, "set_ecmp_group", {"group_id": 1})
    m = e.encode(SCHEMA)
    assert m.match[0].lpm.value == bytes([10, 0, 1, 0]) and m.match[0].lpm.prefix_len == 24  # host bits cleared
    assert m.action.action.params[0].value == b"\x01"  # minimal bytes
    assert encode_value(0, 9) == b"\x00" and encode_value(256, 9) == b"\x01\x00"
    back = e.canonical(SCHEMA)
    assert back.table == "DlcpIngress.forwarding.ipv4_lpm" and back.match["dst_addr"] == (167772416, 24)
    assert back.canonical(SCHEMA) == back


@pytest.mark.parametrize("entry,match", [
    (TableEntry("ipv4_lpn", {}, "x"), "no table named 'ipv4_lpn'. Did you mean .*ipv4_lpm"),
    (TableEntry("ipv4_lpm", {"dst_addr": ("10.0.0.0", 8)}, "set_nexthp", {}), "no action named 'set_nexthp'"),
    (TableEntry("ipv4_lpm", {"dst_addr": ("10.0.0.0", 8)}, "set_queue", {"queue": 1}), "not an action of table"),
    (TableEntry("dlcp_priority", {"priority": 1}, "set_queue", {"queue": 8}), "parameter queue=8.*3 bits"),
    (TableEntry("dlcp_priority", {"prio": 1}, "set_queue", {"queue": 1}), "no match field 'prio'"),
    (TableEntry("dlcp_priority", {}, "set_queue", {"queue": 1}), r"match fields \['priority'\] are required"),
    (TableEntry("ipv4_lpm", {"dst_addr": ("10.0.0.0", 33)}, "drop_no_route", {}), "prefix length 33"),
    (TableEntry("ecmp_member", {"group_id": 1, "member": 0}, "set_member", {"port": 1}), "parameters"),
])
def test_encoding_errors_name_table_and_field(entry, match):
    with pytest.raises((EntryError, SchemaError), match=match):
        entry.encode(SCHEMA)


def test_schema_suffix_and_ambiguity():
    assert SCHEMA.table("forwarding.ipv4_lpm").name == "DlcpIngress.forwarding.ipv4_lpm"
    assert SCHEMA.table("ipv4_lpm") is SCHEMA.table("DlcpIngress.forwarding.ipv4_lpm")
    with pytest.raises(SchemaError, match="ambiguous"):
        P4Schema._resolve("action", "x", {"a.x": 1, "b.x": 2})


@pytest.mark.parametrize("changes,match", [
    ({"routes": [{"prefix": "10.0.0.0/24", "port": 1, "dmac": "00:00:00:00:00:01"},
                 {"prefix": "10.0.0.0/24", "port": 3, "dmac": "00:00:00:00:00:02"}]},
     r"routes\[1\].*overlaps routes\[0\]"),
    ({"routes": [{"prefix": "10.0.0.1/24", "port": 1, "dmac": "00:00:00:00:00:01"}]}, r"routes\[0\].*host bits"),
    ({"routes": [{"prefix": "10.0.0.0/24", "port": 9, "dmac": "00:00:00:00:00:01"}]},
     r"routes\[0\].*port 9 is not declared"),
    ({"routes": [{"prefix": "10.0.0.0/24", "group": 7}]}, r"routes\[0\].*group 7"),
    ({"policy": {"drop_thresholds": [40, 16, 8]}},
     r"drop_thresholds class 1 = 40 is out of range for switch s1 port 2"),
    ({"policy": {"ecn_threshold": 32, "drop_thresholds": [24, 16, 8]}}, "ecn_threshold = 32 is out of range"),
    ({"policy": {"loss_bound_push": 0.9}}, "loss_bound_push"),
    ({"ports": {1: {"mac": "zz"}}}, r"ports\.1\.mac"),
    ({"grpc": "nowhere"}, "neither host:port nor unix"),
    ({"colour": "blue"}, r"unknown key\(s\) \['colour'\]"),
])
def test_network_validation_names_the_entry(changes, match):
    with pytest.raises(NetworkError, match=match):
        _net(**changes)


def test_network_file_with_policy_path(tmp_path):
    (tmp_path / "pol.yaml").write_text("ecn_threshold: 7\ndrop_thresholds: [20, 10, 5]\n")
    data = yaml.safe_load(yaml.safe_dump(NET))
    data["policy"] = "pol.yaml"
    (tmp_path / "net.yaml").write_text(yaml.safe_dump(data))
    net = load_network(tmp_path / "net.yaml")
    assert net.policy.ecn_threshold == 7
    with pytest.raises(NetworkError, match="no switch named 's2'. Did you mean 's1'"):
        net.switch("s2")


def test_bottleneck_settings():
    net = _net()
    sw = net.switches["s1"]
    vq = [e for e in desired.desired_entries(sw, net) if e.table == "vq_config"]
    assert len(vq) == 1 and vq[0].match == {"port": 2}
    assert vq[0].params == {"rate_fp": rate_fixed_point(500), "capacity": 32, "overhead_bytes": 0,
                            "mpu_bytes": 1538, "unit_fp": -(-(1 << 32) // 1538)}
    assert rate_fixed_point(1_000_000) == 1 << 24  # one slot per microsecond
    qs = queue_settings(sw)
    assert {(q.port, q.priority) for q in qs} == {(p, q) for p in sw.ports for q in range(8)}
    # no BMv2 queue is rate-limited (a bottleneck's rate is its scheduler's, one for the port);
    # every queue is deep enough to absorb scheduling lag
    assert {q.rate_pps for q in qs} == {0}
    assert all(q.depth >= 1024 for q in qs)
    sched = sw.ports[2].scheduler()
    assert (sched.interface, sched.rate_bits, sched.buffer) == ("s1-eth2", 500 * 1538 * 8, 32)


def test_policy_drives_switch_entries():
    net = _net()
    entries = desired.desired_entries(net.switches["s1"], net)
    thresholds = {e.match["drop_class"]: e.params["depth"] for e in entries if e.table == "drop_threshold"}
    assert thresholds == {1: 24, 2: 16, 3: 8}  # class 0 gets none: never dropped selectively
    groups = [e for e in entries if e.table == "ecmp_group"]
    assert groups[0].params == {"size": 2, "mode": 1}  # random
    ecn = [e for e in entries if e.table == "ecn_threshold"]
    assert ecn[0].default and ecn[0].params == {"depth": 12}
    assert ecn[0].action == "mark_on_backlog_ahead"  # the default ecn_backlog
    port = dataclasses.replace(net, policy=dataclasses.replace(net.policy, ecn_backlog="port"))
    ecn = [e for e in desired.desired_entries(port.switches["s1"], port) if e.table == "ecn_threshold"]
    assert ecn[0].action == "mark_on_port_backlog" and ecn[0].params == {"depth": 12}
    # both actions are in the compiled program, with the parameter the controller writes
    for action in ("mark_on_port_backlog", "mark_on_backlog_ahead"):
        TableEntry("ecn_threshold", action=action, params={"depth": 1}, default=True).canonical(SCHEMA)


def test_reconcile_diff_and_idempotence():
    net = _net()
    want = [e.canonical(SCHEMA) for e in desired.desired_entries(net.switches["s1"], net)]
    order = [SCHEMA.table(t).name for t in desired.owned_tables()]
    first = diff(want, [], order)
    assert {c.kind for c in first} == {"insert", "modify"}  # the default entry is modified
    assert diff(want, want, order) == []
    stale = TableEntry("ipv4_lpm", {"dst_addr": ("10.9.0.0", 16)}, "drop_no_route").canonical(SCHEMA)
    changed = [e if e.table != "DlcpIngress.selective_drop.drop_threshold" or e.match["drop_class"] != 1 else
               TableEntry(e.table, e.match, e.action, {"depth": 99}) for e in want]
    changes = diff(want, changed + [stale], order)
    assert [c.kind for c in changes] == ["delete", "modify"]
    # groups go in before the routes that point at them
    kinds = [c.entry.table.rsplit(".", 1)[-1] for c in first]
    assert kinds.index("ecmp_member") < kinds.index("ipv4_lpm")
