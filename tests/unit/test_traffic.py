"""Cross traffic: real sink and sender processes on loopback, stopped with SIGTERM like the
runner does, their JSON summaries, ``summarise`` over them, DSCP marking and the CLI's errors."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlcp.hostagent.loopback import free_shared_port
from dlcp.topologies import traffic
from dlcp.topologies.traffic import (build_parser, is_on, on_time, open_socket, read_summaries, summarise)

ROOT = Path(__file__).resolve().parents[2]
LO = "127.0.0.1"


def listening(port: int) -> bool:
    """Whether some socket listens on TCP ``port`` (read from /proc: probing by connecting
    would count as a connection at the sink, binding could race with it)."""
    local = f":{port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(local) and fields[3] == "0A":  # 0A: LISTEN
            return True
    return False


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dlcp.topologies.traffic", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def start_sink(port: int) -> subprocess.Popen:
    sink = start("sink", str(port))
    deadline = time.monotonic() + 5
    while not listening(port):
        assert sink.poll() is None, sink.communicate()[1]
        assert time.monotonic() < deadline, "sink did not start listening"
        time.sleep(0.02)
    return sink


def stop(proc: subprocess.Popen) -> tuple[dict, float]:
    """SIGTERM the process group as the runner does; its only stdout line, and how long it took."""
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=3)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    took = time.monotonic() - t0
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert len(lines) == 1, out
    return json.loads(lines[0]), took


@pytest.fixture
def procs():
    """Processes to kill if a test fails before stopping them."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def assert_ordered(*stamps: float) -> None:
    assert all(isinstance(s, float) for s in stamps), stamps
    assert list(stamps) == sorted(stamps), stamps


def test_udp_sender_and_sink_stopped_by_sigterm(procs):
    port = free_shared_port()
    sink = start_sink(port)
    procs.append(sink)
    sender = start("udp", LO, str(port), "1000", "0.3", "0.2", "30", "--dscp", "46")
    procs.append(sender)
    time.sleep(0.8)
    sent, took_sender = stop(sender)
    time.sleep(0.05)  # let the last datagrams be read
    got, took_sink = stop(sink)
    assert took_sender < 0.5 and took_sink < 0.5

    assert sent["role"] == "sender" and sent["proto"] == "udp" and sent["dst"] == LO and sent["src"] == LO
    assert sent["dscp"] == 46 and sent["rate_pps"] == 1000
    assert sent["sent_pkts"] > 0 and sent["sent_bytes"] == sent["sent_pkts"] * traffic.UDP_PAYLOAD
    assert_ordered(sent["start"], sent["end"])
    assert 0 < sent["active_s"] <= sent["end"] - sent["start"]
    assert 0 < sent["achieved_pps"] <= 1.25 * sent["rate_pps"]

    udp = got["udp"]
    assert got["role"] == "sink" and got["port"] == port
    assert 0 < udp["received_pkts"] <= sent["sent_pkts"]
    assert udp["received_bytes"] == udp["received_pkts"] * traffic.UDP_PAYLOAD
    assert udp["sources"][LO]["received_pkts"] == udp["received_pkts"]
    assert_ordered(got["start"], udp["first_arrival"], udp["last_arrival"], got["end"])
    assert_ordered(sent["start"], udp["first_arrival"])
    assert got["tcp"]["received_bytes"] == 0 and got["tcp"]["connections"] == 0

    s = summarise([sent], [got])
    assert set(s) == {"udp"}
    assert s["udp"]["matched_by_source"] is True
    assert s["udp"]["delivered_pkts"] == udp["received_pkts"]
    assert 0.0 <= s["udp"]["loss"] <= 1.0
    assert s["udp"]["delivered_pps"] > 0


def test_tcp_sender_and_sink_stopped_by_sigterm(procs):
    port = free_shared_port()
    sink = start_sink(port)
    procs.append(sink)
    sender = start("tcp", LO, str(port), "0.3", "0.2", "30")
    procs.append(sender)
    time.sleep(0.8)
    sent, took_sender = stop(sender)
    time.sleep(0.05)
    got, took_sink = stop(sink)
    assert took_sender < 0.5 and took_sink < 0.5

    assert sent["proto"] == "tcp" and "error" not in sent and sent["src"] == LO and sent["dscp"] == 0
    assert sent["sent_bytes"] > 0
    assert_ordered(sent["start"], sent["end"])
    assert 0 < sent["active_s"] <= sent["end"] - sent["start"]

    tcp = got["tcp"]
    assert 0 < tcp["received_bytes"] <= sent["sent_bytes"]
    assert tcp["connections"] == 1 and tcp["sources"][LO]["connections"] == 1
    assert_ordered(got["start"], tcp["first_arrival"], tcp["last_arrival"], got["end"])
    assert got["udp"]["received_pkts"] == 0

    s = summarise([sent], [got])["tcp"]
    assert s["delivered_bytes"] == tcp["received_bytes"] and s["connections"] == 1
    assert 0 < s["delivered_mbps"] <= s["goodput_mbps"]


def test_a_tcp_sender_from_a_fixed_source_port_can_run_again_at_once(procs):
    # The runner sends each repetition's cross traffic from fixed ports (the same path under
    # flow hashing for every scheme of it): the next scheme's sender connects from the same port
    # to the same sink seconds later, so the last one must leave no TIME_WAIT behind.
    port, sport = free_shared_port(), free_shared_port()
    sink = start_sink(port)
    procs.append(sink)
    for _ in range(2):
        sender = start("tcp", LO, str(port), "0.3", "0", "30", "--sport", str(sport))
        procs.append(sender)
        time.sleep(0.5)
        sent, _ = stop(sender)
        assert "error" not in sent and sent["sent_bytes"] > 0 and sent["sport"] == sport, sent
    got, _ = stop(sink)
    assert got["tcp"]["connections"] == 2


@pytest.mark.parametrize("proto", ["udp", "tcp"])
def test_open_socket_binds_the_source_port_it_is_given(proto):
    sport = free_shared_port()
    with open_socket(proto, 0, sport) as s:
        assert s.getsockname()[1] == sport
    with open_socket(proto) as s:
        assert s.getsockname()[1] == 0  # unbound: the kernel picks at the first send


def test_udp_sender_stops_by_itself_after_duration():
    proc = subprocess.run([sys.executable, "-m", "dlcp.topologies.traffic", "udp", LO, str(free_shared_port()), "200",
                           "0.1", "0", "0.3"], cwd=ROOT, capture_output=True, text=True, timeout=5, check=False)
    assert proc.returncode == 0, proc.stderr
    (sent,) = [json.loads(line) for line in proc.stdout.splitlines()]
    assert sent["sent_pkts"] > 0 and 0.29 <= sent["active_s"] <= 0.5


@pytest.mark.parametrize("proto", ["udp", "tcp"])
def test_open_socket_sets_the_tos_from_the_dscp(proto):
    for dscp in (0, 10, 46, 63):
        with open_socket(proto, dscp) as s:
            assert s.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == dscp << 2
    with pytest.raises(ValueError):
        open_socket(proto, 64)


@pytest.mark.parametrize("argv", [
    ["udp", LO, "5001", "0", "0.5", "0.5", "10"],             # rate 0
    ["udp", LO, "5001", "nan", "0.5", "0.5", "10"],           # rate not finite
    ["udp", LO, "5001", "100", "0.5", "0.5", "-1"],           # negative duration
    ["tcp", LO, "5001", "-0.5", "0.5", "10"],                 # negative on
    ["tcp", LO, "5001", "0.5", "0.5", "10", "--dscp", "64"],  # dscp out of range
    ["udp", LO, "5001", "10", "0.5", "0.5", "10", "--dscp", "-1"],
    ["sink", "0"], ["sink", "65536"], ["sink", "http"],       # bad ports
    ["tcp", LO, "5001"],                                      # missing arguments
    ["flood", LO],                                            # unknown role
])
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err


def test_bad_arguments_from_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "dlcp.topologies.traffic", "udp", LO, "5001", "100", "1", "1", "1",
                           "--dscp", "99"], cwd=ROOT, capture_output=True, text=True, timeout=5, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "--dscp" in proc.stderr and "0..63" in proc.stderr


def test_the_runners_positional_form_parses():
    a = build_parser().parse_args(["udp", "10.0.0.3", "5001", "1000.0", "0.5", "0.5", "600.0"])
    assert (a.role, a.dst, a.port, a.rate, a.on, a.off, a.duration, a.dscp) == \
        ("udp", "10.0.0.3", 5001, 1000.0, 0.5, 0.5, 600.0, 0)
    a = build_parser().parse_args(["tcp", "10.0.0.3", "5001", "0.5", "0.5", "600.0", "--dscp", "8"])
    assert (a.role, a.port, a.on, a.off, a.duration, a.dscp) == ("tcp", 5001, 0.5, 0.5, 600.0, 8)
    assert build_parser().parse_args(["sink", "5001"]).port == 5001


def test_on_off_pattern():
    assert is_on(0.1, 0.5, 0.5) and not is_on(0.7, 0.5, 0.5) and is_on(1.2, 0.5, 0.5)
    assert is_on(123.0, 0.5, 0)  # off 0: always on
    assert on_time(0.3, 0.5, 0.5) == pytest.approx(0.3)
    assert on_time(0.8, 0.5, 0.5) == pytest.approx(0.5)
    assert on_time(2.25, 0.5, 0.5) == pytest.approx(1.25)
    assert on_time(7.0, 0.5, 0) == 7.0


def _sender(proto, src, start, end, active, **kw):
    return {"role": "sender", "proto": proto, "src": src, "start": start, "end": end, "active_s": active, **kw}


def test_summarise_matches_sink_counts_by_source():
    sent = [_sender("udp", "10.0.0.5", 100.0, 110.0, 5.0, sent_pkts=1000, sent_bytes=1_000_000),
            _sender("tcp", "10.0.0.6", 101.0, 111.0, 4.0, sent_bytes=6_000_000, retrans_pkts=7)]
    sink = {"role": "sink",
            "udp": {"received_pkts": 950, "received_bytes": 950_000,
                    "sources": {"10.0.0.5": {"received_pkts": 900, "received_bytes": 900_000},
                                "10.0.0.9": {"received_pkts": 50, "received_bytes": 50_000}}},  # stray
            "tcp": {"received_bytes": 5_000_000, "connections": 1,
                    "sources": {"10.0.0.6": {"received_bytes": 5_000_000, "connections": 1}}}}
    s = summarise(sent, [sink])
    udp, tcp = s["udp"], s["tcp"]
    assert udp["matched_by_source"] and udp["delivered_pkts"] == 900 and udp["sent_pkts"] == 1000
    assert udp["loss"] == pytest.approx(0.1) and udp["window_s"] == pytest.approx(10.0)
    assert udp["delivered_pps"] == pytest.approx(90.0)
    assert tcp["delivered_bytes"] == 5_000_000 and tcp["connections"] == 1 and tcp["retrans_pkts"] == 7
    assert tcp["delivered_mbps"] == pytest.approx(4.0) and tcp["goodput_mbps"] == pytest.approx(10.0)


def test_summarise_without_source_addresses_uses_totals_and_clamps_loss():
    sent = [{"proto": "udp", "start": 0.0, "end": 2.0, "active_s": 1.0, "sent_pkts": 10, "sent_bytes": 10_000}]
    sink = {"udp": {"received_pkts": 12, "received_bytes": 12_000}}
    udp = summarise(sent, [sink])["udp"]
    assert udp["matched_by_source"] is False and udp["delivered_pkts"] == 12 and udp["loss"] == 0.0


def test_summarise_without_a_sink_reports_nothing_delivered_rather_than_full_loss():
    sent = [_sender("udp", "10.0.0.5", 0.0, 1.0, 1.0, sent_pkts=10, sent_bytes=10_000)]
    udp = summarise(sent, [])["udp"]
    assert udp["delivered_pkts"] is None and udp["loss"] is None and udp["delivered_pps"] is None
    assert summarise([], []) == {}


def test_read_summaries_skips_non_json_and_tolerates_missing_files(tmp_path):
    log = tmp_path / "cross-udp.log"
    log.write_text('{"proto": "udp", "sent_pkts": 3}\nTraceback (most recent call last):\n'
                   '  File "x", line 1\n[1, 2]\n\n{"role": "sink"}\n{"truncated": \n')
    assert read_summaries(log) == [{"proto": "udp", "sent_pkts": 3}, {"role": "sink"}]
    (tmp_path / "empty.log").write_text("")
    assert read_summaries(tmp_path / "empty.log") == []
    assert read_summaries(tmp_path / "missing.log") == []


def test_tcp_counters_are_read_from_the_kernels_tables():
    from dlcp.topologies.netns import parse_tcp_counters

    text = ("Ip: Forwarding DefaultTTL\nIp: 1 64\n"
            "Tcp: RtoAlgorithm RtoMin OutSegs RetransSegs\nTcp: 1 200 1910283 1205\n"
            "TcpExt: SyncookiesSent TCPLossProbes TCPTimeouts TCPDeliveredCE\nTcpExt: 0 570 36 12\n"
            "IpExt: InNoRoutes InECT0Pkts InCEPkts\nIpExt: 0 900 31\n")
    assert parse_tcp_counters(text) == {"OutSegs": 1910283, "RetransSegs": 1205, "TCPTimeouts": 36,
                                        "TCPLossProbes": 570, "TCPDeliveredCE": 12, "InCEPkts": 31, "InECT0Pkts": 900}
    assert parse_tcp_counters("") == {"OutSegs": 0, "RetransSegs": 0, "TCPTimeouts": 0, "TCPLossProbes": 0,
                                      "TCPDeliveredCE": 0, "InCEPkts": 0, "InECT0Pkts": 0}
