"""The bottleneck ports' scheduler (controller/scheduler.py): what it charges, the tc lines it
writes, the counters it reads; and, in a namespace of its own, that the tree it installs serves
one capacity strictly by priority."""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest

from dlcp.controller import scheduler
from dlcp.controller.network import NetworkError, parse_network
from dlcp.controller.priority_queue import VQ_FRAC_BITS, VQ_UNIT_SHIFT, unit_fixed_point, vq_params
from dlcp.controller.scheduler import Charge, PortScheduler, charge, parse_capacity, parse_qdisc_dump, tc_batch


@pytest.mark.parametrize("text,want", [("600", (600, 0)), ("600pps", (600, 0)), ("7.4mbit", (0, 7_400_000)),
                                       ("10Mbit", (0, 10_000_000)), ("500kbit", (0, 500_000)), ("1gbit", (0, 10**9))])
def test_capacity_in_packets_or_bits(text, want):
    assert parse_capacity(text) == want


@pytest.mark.parametrize("text", ["0", "1.5", "x", "mbit", "-3mbit", "10mbps"])
def test_a_bad_capacity_names_the_forms(text):
    with pytest.raises(ValueError, match="packets per second .* bits per second"):
        parse_capacity(text)


def test_charges_per_frame():
    pkt, bits = charge(False), charge(True)
    assert pkt == Charge(0, 1538, 1538) and bits == Charge(24, 84, 1538)
    # in packets every frame is one slot, whatever its size; in bits it costs its bytes on the wire
    assert pkt.cost(66) == pkt.cost(1514) == 1538
    assert bits.cost(66) == 90 and bits.cost(1514) == 1538 and bits.cost(42) == 84
    assert charge(False, 9000).slot == 9038


def test_virtual_queue_charges_what_the_scheduler_charges():
    # a full slot is never less than one slot in the P4 program's fixed point (thresholds
    # compare whole slots), and hardly more
    for slot in (1538, 9038, 84):
        per_slot = (slot * unit_fixed_point(slot)) >> VQ_UNIT_SHIFT
        assert 1 << VQ_FRAC_BITS <= per_slot <= (1 << VQ_FRAC_BITS) + slot // 256 + 1
    data = {"policy": {"drop_thresholds": [24, 16, 8], "ecn_threshold": 12},
            "switches": {"s1": {"grpc": "127.0.0.1:1", "ports": {
        2: {"mac": "00:aa:00:00:00:02", "capacity_pps": 600, "buffer": 32, "interface": "s1-eth2"},
        3: {"mac": "00:aa:00:00:00:03", "capacity_bps": 7_382_400, "buffer": 32, "interface": "s1-eth3"}}}}}
    ports = parse_network(data).switches["s1"].ports
    a, b = vq_params(ports[2]), vq_params(ports[3])
    assert a["rate_fp"] == b["rate_fp"] == round(600 * 2**24 / 1e6)  # 7,382,400 bit/s = 600 full frames/s
    assert (a["overhead_bytes"], a["mpu_bytes"]) == (0, 1538) and (b["overhead_bytes"], b["mpu_bytes"]) == (24, 84)
    assert ports[2].rate_bits == ports[3].rate_bits == 7_382_400


@pytest.mark.parametrize("port,match", [
    ({"capacity_pps": 600}, "a bottleneck needs `interface`"),
    ({"capacity_pps": 600, "capacity_bps": 10**6, "interface": "x"}, "not both"),
    ({"capacity_bps": 1000, "interface": "x"}, "less than one full-size frame"),
    ({"capacity_pps": 600, "interface": "a name far too long"}, "not an interface name"),
])
def test_network_file_bottleneck_errors(port, match):
    data = {"policy": {"drop_thresholds": [24, 16, 8], "ecn_threshold": 12},
            "switches": {"s1": {"grpc": "127.0.0.1:1", "ports": {2: {"mac": "00:aa:00:00:00:02", **port}}}}}
    with pytest.raises(NetworkError, match=match):
        parse_network(data)


def test_tc_lines_one_rate_eight_strict_leaves():
    port = PortScheduler("s1-eth2", 7_382_400, charge(False), 64)
    lines = tc_batch(port, with_root=True)
    assert lines[0] == "qdisc replace dev s1-eth2 root handle d1c9: htb default 10"
    assert "classid d1c9:1 htb rate 7382400bit ceil 7382400bit burst 769b cburst 769b mpu 1538 overhead 0" in lines[1]
    leaves = [line for line in lines if "parent d1c9:1 classid" in line]
    # queue 7 gets HTB's prio 0 (lent to first), queue 0 prio 7; all borrow up to the one rate
    assert [int(line.split(" prio ")[1].split()[0]) for line in leaves] == [7, 6, 5, 4, 3, 2, 1, 0]
    assert all("rate 8bit ceil 7382400bit" in line for line in leaves)
    filters = [line for line in lines if line.startswith("filter")]
    assert filters[7].endswith("u32 match u8 7 0x07 at -3 flowid d1c9:17")
    assert all(line.split()[0] != "qdisc" or "replace" in line for line in lines)
    assert not any(line.startswith("qdisc replace dev s1-eth2 root") for line in tc_batch(port, with_root=False))
    assert port.fifo_limit == 1024
    # in bits, the smallest frame costs 84 bytes: a 64-slot buffer may hold 1,172 of them
    assert PortScheduler("x", 10**7, charge(True), 64).fifo_limit == 2 * 1172


def _nlmsg(kind: int, ifindex: int, handle: int, parent: int, attrs: bytes) -> bytes:
    body = struct.pack("=BBHiIII", 0, 0, 0, ifindex, handle, parent, 0) + attrs
    return struct.pack("=IHHII", 16 + len(body), kind, 2, 1, 0) + body


def _attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def test_netlink_dump_parsed_for_dlcps_root_only():
    basic = _attr(1, struct.pack("=QI", 123_456, 789) + b"\0" * 4)
    stats = _attr(7, basic + _attr(3, struct.pack("=5I", 3, 4500, 2, 0, 9)))
    ours = _nlmsg(36, 5, 0xD1C90000, 0xFFFFFFFF, _attr(1, b"htb\0") + stats)
    leaf = _nlmsg(36, 5, 0x00200000, 0xD1C90010, _attr(1, b"pfifo\0") + stats)
    other = _nlmsg(36, 6, 0x00010000, 0xFFFFFFFF, _attr(1, b"htb\0") + stats)
    done = struct.pack("=IHHII", 20, 3, 2, 1, 0) + b"\0" * 4
    got = parse_qdisc_dump(ours + leaf + other + done)
    assert got == {5: scheduler.QdiscStats(bytes=123_456, packets=789, drops=2, qlen=3, backlog=4500)}


def test_tc_json_arrays_of_a_batch():
    assert scheduler._json_objects('[{"dev":"a"}]\n[{"dev":"b"},{"dev":"c"}]\n') == [
        {"dev": "a"}, {"dev": "b"}, {"dev": "c"}]


# --- in a namespace of its own: the tree on a veth, frames tagged as the P4 program tags them ----

@pytest.fixture
def veth_ns():
    from dlcp.topologies import netns

    ns = f"dlcpq{os.getpid() % 10000}"
    netns.add_netns(ns)
    try:
        netns.ip("link", "add", "q0", "type", "veth", "peer", "name", "q1", netns=ns)
        for end in ("q0", "q1"):
            netns.sysctl(f"net.ipv6.conf.{end}.disable_ipv6", "1", ns)
            netns.ip("link", "set", end, "up", netns=ns)
        yield ns
    finally:
        netns.del_netns(ns)


def _frame(queue: int, seq: int, size: int = 1000) -> bytes:
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, size - 14, seq, 0, 64, 17, 0, bytes([10, 0, 0, 1]), bytes([10, 0, 0, 2]))
    return (bytes.fromhex("020000000002") + bytes([0, 0xAA, 0, 0, 1, 0x08 | queue]) + b"\x08\x00" + ip
            + bytes([queue, seq & 0xFF]) + bytes(size - 36))


def _wire(ns: str, frames: list[bytes], expect: int, timeout: float = 30.0) -> list[tuple[float, int, int]]:
    """Send ``frames`` back to back into q0 (whose scheduler holds them), and give (kernel receive
    time, queue, seq) of what reaches q1; kernel timestamps, so a busy machine's late reads do
    not bend the rates."""
    from dlcp.controller.bmv2_thrift import in_netns

    def sockets() -> tuple[socket.socket, socket.socket]:
        tx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        tx.bind(("q0", 0))
        tx.setsockopt(socket.SOL_SOCKET, 32, 16 << 20)  # SO_SNDBUFFORCE: a burst must not block
        rx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
        rx.bind(("q1", 0))
        rx.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE
        rx.setsockopt(socket.SOL_SOCKET, 35, 1)  # SO_TIMESTAMPNS
        return tx, rx

    tx, rx = in_netns(ns, sockets)
    with tx, rx:
        for f in frames:
            tx.send(f)
        got: list[tuple[float, int, int]] = []
        rx.settimeout(timeout)
        while len(got) < expect:
            data, anc, _, _ = rx.recvmsg(4096, 64)
            sec, nsec = struct.unpack("qq", anc[0][2][:16])
            got.append((sec + nsec * 1e-9, data[34], data[35]))
    return got


@pytest.mark.netns
def test_one_capacity_strictly_by_priority_on_the_wire(veth_ns):
    """40 low then 10 high frames back to back into a 50-frame/s port: every high frame leaves
    before the lows still queued (at most the one low in service), and the port sends 50 frames
    per second in all (within 3 %), not 50 per priority."""
    r = 50
    port = PortScheduler("q0", r * 1538 * 8, charge(False), 64)
    assert scheduler.install([port], veth_ns) == 1
    assert scheduler.install([port], veth_ns) == 1  # again: updated in place, nothing else
    # every leaf may send one frame on its own tokens once a minute (module docstring): spend
    # the low leaf's before the measurement, so the order below is HTB's strict one
    _wire(veth_ns, [_frame(0, 255)], 1)
    time.sleep(2 / r)
    got = _wire(veth_ns, [_frame(0, i) for i in range(40)] + [_frame(7, i) for i in range(10)], 50)
    order = "".join("H" if q == 7 else "L" for _, q, _ in got)
    assert order == "L" + "H" * 10 + "L" * 39, order
    times = [t for t, _, _ in got]
    rate = (len(times) - 1) / (times[-1] - times[0])
    assert abs(rate / r - 1) <= 0.03, rate
    stats = scheduler.QdiscReader(veth_ns, ["q0"])
    try:
        st = stats.read()["q0"]
    finally:
        stats.close()
    assert st.packets == 51 and st.drops == 0 and st.qlen == 0
    assert scheduler.remove(veth_ns) == ["q0"] and scheduler.remove(veth_ns) == []


@pytest.mark.netns
def test_capacity_in_bits_charges_each_frame_its_bytes(veth_ns):
    """At 1 Mbit/s, 40 small frames (100 bytes: 124 on the wire) then 10 full ones take the time
    their bytes take, not 50 slots' (less the burst of half a slot the port may send at once
    after an idle spell)."""
    bps = 1_000_000
    scheduler.install([PortScheduler("q0", bps, charge(True), 64)], veth_ns)
    _wire(veth_ns, [_frame(0, 255, 100)], 1)
    time.sleep(0.05)
    got = _wire(veth_ns, [_frame(0, i, 100) for i in range(40)] + [_frame(0, 100 + i, 1514) for i in range(10)], 50)
    t = [x[0] for x in got]
    # HTB charges a frame as it leaves, so the last one leaves once every frame before it is
    # paid for, less the burst of credit the port had after its idle spell
    owed = 40 * 124 + 9 * 1538 - 769
    assert abs((t[-1] - t[0]) * bps / 8 / owed - 1) <= 0.03, (t[-1] - t[0]) * bps / 8 / owed


def test_dlcp_clean_removes_schedulers_in_this_namespace_and_every_one_it_deletes(monkeypatch, tmp_path):
    from dlcp.topologies import clean as clean_mod

    removed: list[str | None] = []

    def remove(ns: str | None) -> list[str]:
        removed.append(ns)
        return ["x-eth1"]

    monkeypatch.setattr(clean_mod.scheduler, "remove", remove)
    monkeypatch.setattr(clean_mod.netns, "list_netns", lambda: ["dlcpl1", "dlcpsp1"])
    monkeypatch.setattr(clean_mod.netns, "del_netns", lambda name: None)
    monkeypatch.setattr(clean_mod.netns, "list_links", list)
    monkeypatch.setattr(clean_mod.netns, "netns_exists", lambda name: True)
    (tmp_path / "run.json").write_text('{"pids": [], "netns": ["dlcpl2"]}')
    out = clean_mod.clean(tmp_path)
    assert removed == ["dlcpl2", None, "dlcpl1", "dlcpsp1"] and out["schedulers"] == 4
