"""``dlcpctl`` against a real switch: real output, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.bmv2.conftest import PORTS, host_mac, switch_mac

pytestmark = pytest.mark.bmv2


def _write_network(rig, tmp_path, **policy):
    data = {"policy": {"drop_thresholds": [24, 16, 8], "ecn_threshold": 4, **policy},
            "switches": {"s1": {"grpc": rig.grpc, "device_id": 1, "thrift_port": 9090, "netns": rig.ns,
                                "ports": {p: {"mac": switch_mac(p)} for p in PORTS},
                                "routes": [{"prefix": f"10.0.{p}.0/24", "port": p, "dmac": host_mac(p)}
                                           for p in PORTS]}}}
    data["switches"]["s1"]["ports"][2].update(capacity_pps=50, buffer=32, interface=rig.switch_iface(2))
    path = tmp_path / "net.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def ctl(*args):
    return subprocess.run([sys.executable, "-m", "dlcp.controller.cli", *map(str, args)],
                          capture_output=True, text=True)


def test_apply_diff_show_stats(rig, tmp_path):
    net = _write_network(rig, tmp_path)
    dry = ctl("apply", net, "--dry-run")
    assert dry.returncode == 0 and "would write" in dry.stdout and "pipeline would be pushed" in dry.stdout
    assert "pipeline would be pushed" in ctl("apply", net, "--dry-run").stdout  # a dry run changed nothing
    first = ctl("apply", net)
    assert first.returncode == 0, first.stderr
    assert "pipeline pushed" in first.stdout and "16 inserted" in first.stdout
    second = ctl("apply", net, "--json")
    assert json.loads(second.stdout)[0]["insert"] == 0 and json.loads(second.stdout)[0]["modify"] == 0
    assert "s1: 0 change(s)" in ctl("diff", net).stdout
    shown = ctl("show", net, "s1", "ipv4_lpm")
    assert shown.returncode == 0 and "dst_addr=10.0.2.0/24 -> set_nexthop(port=2" in shown.stdout
    stats = json.loads(ctl("stats", net, "s1", "--json").stdout)
    assert stats["switch"] == "s1" and "ports" in stats and "received" in stats
    assert stats["schedulers"]["2"]["drops"] == 0  # port 2, the bottleneck
    table = ctl("stats", net, "s1").stdout
    assert "admitted" in table.splitlines()[1] and "frames received per ingress port:" in table
    assert "port 2's scheduler: sent" in table


def test_policy_set_changes_switch_live(rig, tmp_path):
    net = _write_network(rig, tmp_path)
    assert ctl("apply", net).returncode == 0
    out = ctl("policy", "set", net, "drop_thresholds=[20,12,6]", "ecn_threshold=3")
    assert out.returncode == 0, out.stderr
    assert "4 modified" in out.stdout
    shown = ctl("show", net, "s1", "drop_threshold").stdout
    assert "drop_class=1 -> set_threshold(depth=20)" in shown
    # the file still says the old policy, so a plain apply puts it back
    assert "4 modified" in ctl("apply", net).stdout
    bad = ctl("policy", "set", net, "drop_thresholds=[40,12,6]")
    assert bad.returncode == 1 and "out of range for switch s1 port 2" in bad.stderr
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def _root_rate(rig) -> int:
    """The rate of port 2's scheduler class, bits per second (tc 6.1 has no JSON for HTB classes)."""
    from dlcp.controller.scheduler import parse_capacity

    shown = subprocess.run(["tc", "-n", rig.ns, "class", "show", "dev", rig.switch_iface(2)],
                           capture_output=True, text=True, check=True)
    line = next(line for line in shown.stdout.splitlines() if line.startswith("class htb d1c9:1 "))
    return parse_capacity(line.split(" rate ")[1].split()[0])[1]


def test_apply_installs_the_scheduler_and_remove_takes_only_it(rig, tmp_path):
    from dlcp.controller import scheduler

    net = _write_network(rig, tmp_path)
    out = ctl("apply", net)
    assert out.returncode == 0 and "1 port scheduler(s)" in out.stdout
    assert _root_rate(rig) == 50 * 1538 * 8
    roots = scheduler.root_qdiscs(rig.ns)
    assert scheduler.ours(roots[rig.switch_iface(2)]) and not scheduler.ours(roots[rig.switch_iface(1)])
    assert ctl("apply", net).returncode == 0  # again: updated in place
    assert scheduler.remove(rig.ns) == [rig.switch_iface(2)]  # what `dlcp clean` does in each namespace
    assert not scheduler.ours(scheduler.root_qdiscs(rig.ns)[rig.switch_iface(2)])


def test_queue_rate(rig, tmp_path):
    net = _write_network(rig, tmp_path)
    assert ctl("apply", net).returncode == 0
    out = ctl("queue-rate", net, "s1", 2, 80)
    assert out.returncode == 0 and "capacity 80 pps" in out.stdout
    assert "rate_fp=1342" in ctl("show", net, "s1", "vq_config").stdout  # 80 * 2^24 / 10^6
    assert _root_rate(rig) == 80 * 1538 * 8
    bits = ctl("queue-rate", net, "s1", 2, "2mbit")
    assert bits.returncode == 0 and "capacity 2,000,000 bit/s" in bits.stdout
    assert _root_rate(rig) == 2_000_000
    assert "overhead_bytes=24" in ctl("show", net, "s1", "vq_config").stdout
    assert ctl("queue-rate", net, "s1", 3, 10, 5).returncode == 0


def test_user_errors_are_one_line(rig, tmp_path):
    net = _write_network(rig, tmp_path)
    unknown = ctl("show", net, "s9")
    assert unknown.returncode == 1 and "no switch named 's9'" in unknown.stderr
    assert unknown.stderr.count("\n") == 1
    bad_table = ctl("show", net, "s1", "ipv4_lmp")
    assert bad_table.returncode == 1 and "Did you mean" in bad_table.stderr
    assert ctl("apply").returncode == 2  # usage
    rig.switch.stop()
    down = ctl("--timeout", "1", "apply", net)
    assert down.returncode == 1 and "no P4Runtime server answers" in down.stderr
    assert "Traceback" not in down.stderr


def test_shell_attaches_p4runtime_shell(rig, tmp_path):
    net = _write_network(rig, tmp_path)
    assert ctl("apply", net).returncode == 0
    out = subprocess.run([sys.executable, "-m", "dlcp.controller.cli", "shell", str(net), "s1"], input="tables\nexit\n",
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "DlcpIngress.forwarding.ipv4_lpm" in out.stdout
