"""``dlcp run`` on a real Mininet network of BMv2 switches (root, BMv2 and Mininet needed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dlcp.topologies import netns
from dlcp.topologies.results import CORE_METRICS
from dlcp.topologies.topos import leafspine, star

pytestmark = [pytest.mark.root, pytest.mark.bmv2]
SMALL = ["--iterations", "2", "--scale", "0.0005", "--compute-ms", "20", "--quiet"]


def dlcp(*args, **kw):
    return subprocess.run([sys.executable, "-m", "dlcp", *map(str, args)], capture_output=True, text=True,
                          **kw)


def _ours_left() -> dict:
    bmv2 = subprocess.run(["pgrep", "-f", "simple_switch_grpc.*dlcp(s|l|sp)[0-9]"], capture_output=True, text=True)
    names = {s.name for t in (star(2), leafspine(4)) for s in t.switches} | {h.name for t in (star(2), leafspine(4))
                                                                           for h in t.hosts}
    return {"bmv2": bmv2.stdout.split(), "netns": [n for n in netns.list_netns() if n in names],
            "links": [link for link in netns.list_links() if link.split("-")[0] in names]}


def test_star_ps_run_writes_every_field(tmp_path):
    res = dlcp("run", "--topology", "star", "--workers", 2, "--scheme", "dlcp", "--pattern", "ps", "--out", tmp_path,
               *SMALL, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "dlcp" in res.stdout and "speedup" in res.stdout
    run_dir = next(tmp_path.iterdir())
    results = json.loads((run_dir / "results.json").read_text())
    assert results["topology"] == "star" and results["options"]["workers"] == 2
    assert results["schema"] == 2 and results["source"] == "testbed" and set(results["summary"]) == {"dlcp"}
    scheme = results["runs"][0]
    # its fixed source ports, and the path each hashed flow took from them (dlcp's data is sprayed)
    assert scheme["flow_port_base"] == 20000 and set(scheme["paths"]) == {"cross udp", "cross tcp"}
    assert scheme["paths"]["cross udp"].startswith("s1:")
    kinds = [r["kind"] for r in scheme["iterations"]]
    assert kinds.count("measured") == 2 * 2 and kinds.count("calibration") == 2 * 3
    for r in scheme["iterations"]:
        assert {"iteration", "rank", "iteration_time", "sync_time", "lost_fraction", "retransmissions"} <= set(r)
    # every agent's totals, the server's (rank 2) included, with the ports its data left from
    assert set(scheme["endpoints"]) == {"0", "1", "2"}
    assert all(e["data_sockets"] for e in scheme["endpoints"].values())
    server = json.loads(next(run_dir.glob("*/server.jsonl")).read_text())
    assert server["rate_trace"] and {row[3] for row in server["rate_trace"]} <= {"start", "marks", "loss", "ceiling",
                                                                                   "increase"}
    assert set(CORE_METRICS) | {"ordering_efficiency", "straggler_spread"} <= set(scheme["metrics"])
    # validity from real samples: CPU of every process the run started, bottleneck service
    v = scheme["validity"]
    assert {"valid", "reasons", "machine_busy_p50", "processes", "bottlenecks"} <= set(v)
    assert {"switch:s1", "server", "worker0", "worker1", "cross-udp", "cross-tcp"} <= set(v["processes"])
    assert {b["port"] for b in v["bottlenecks"]} == {1, 2, 3, 4, 5}
    # the server's own link: its answers (reliable) outweigh the pushes (bounded) into its port
    assert scheme["bound"]["seconds"] > 0 and scheme["bound"]["port"] == ["h3", 0]
    cross = scheme["cross"]
    assert cross["udp"]["sent_pkts"] > 0 and cross["udp"]["delivered_pkts"] > 0 and cross["tcp"]["delivered_bytes"] > 0
    sw = scheme["switches"]["s1"]
    assert {"ports", "drop_reasons", "selective_drops_by_class"} <= set(sw)
    assert sum(r["forwarded_pkts"] for r in sw["ports"]) > 0
    for png in ("sync_cdf.png", "iteration_time.png", "drops_per_class.png"):
        assert (run_dir / png).stat().st_size > 1000
    assert _ours_left() == {"bmv2": [], "netns": [], "links": []}


def test_sweep_writes_a_csv_row_per_value_and_scheme_and_a_figure(tmp_path):
    res = dlcp("sweep", "--param", "cross-rate", "--values", "0,0.5", "--topology", "star", "--workers", 2,
               "--scheme", "baseline,dlcp", "--out", tmp_path, *SMALL, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    out = next(tmp_path.iterdir())
    import csv

    rows = list(csv.DictReader(open(out / "sweep.csv")))
    assert [(r["value"], r["scheme"]) for r in rows] == [("0", "baseline"), ("0", "dlcp"), ("0.5", "baseline"),
                                                          ("0.5", "dlcp")]
    assert all(float(r["speedup"]) > 0 for r in rows)
    assert (out / "sweep.png").stat().st_size > 5000
    runs = sorted(d for d in out.iterdir() if d.is_dir())
    assert len(runs) == 2
    first = json.loads((runs[0] / "results.json").read_text())
    assert first["options"]["cross_traffic"] is False and all(s["cross"] is None for s in first["runs"])
    assert "cross-rate=0.5" in res.stdout and _ours_left() == {"bmv2": [], "netns": [], "links": []}


def test_leafspine_sprays_dlcp_data_over_both_spines(tmp_path):
    res = dlcp("run", "--topology", "leafspine", "--workers", 4, "--scheme", "dlcp", "--cross-traffic", "off",
               "--out", tmp_path, *SMALL, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    results = json.loads(next(tmp_path.iterdir()).joinpath("results.json").read_text())
    switches = results["runs"][0]["switches"]
    for spine in ("sp1", "sp2"):
        # queues 1..6 carry only DLCP data here (control uses 7, other traffic 0)
        data = sum(r["forwarded_pkts"] for r in switches[spine]["ports"] if 1 <= r["queue"] <= 6)
        assert data > 50, (spine, switches[spine])
    assert _ours_left() == {"bmv2": [], "netns": [], "links": []}


def test_capped_host_ports_are_metered_bottlenecks(tmp_path):
    """``--host-ports capped`` on the dumbbell: the workers' and the server's switch ports get
    the fabric's scheduler, and their service is measured like the link's."""
    res = dlcp("run", "--topology", "dumbbell", "--workers", 2, "--scheme", "dlcp", "--host-ports", "capped",
               "--cross-traffic", "off", "--out", tmp_path, *SMALL, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    results = json.loads(next(tmp_path.iterdir()).joinpath("results.json").read_text())
    assert results["options"]["host_ports"] == "capped"
    run = results["runs"][0]
    metered = {(b["switch"], b["port"]) for b in run["validity"]["bottlenecks"]}
    assert metered == {("s1", 1), ("s1", 2), ("s1", 4), ("s2", 1), ("s2", 3)}, metered  # + the link's two ends
    assert {b["capacity_pps"] for b in run["validity"]["bottlenecks"]} == {results["options"]["capacity_pps"]}


def test_killed_run_is_cleaned_up(tmp_path):
    allowed = netns.ALLOWED_CC.read_text()
    env = dict(os.environ, DLCP_RUN_REGISTRY=str(tmp_path / "registry"))
    proc = subprocess.Popen([sys.executable, "-m", "dlcp", "run", "--topology", "star", "--workers", "2",
                             "--iterations", "50", "--out", str(tmp_path), "--quiet"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not _ours_left()["bmv2"]:
            time.sleep(0.5)
        time.sleep(5)  # agents running
        assert _ours_left()["bmv2"], "the run never started its switches"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert _ours_left()["netns"] or _ours_left()["links"]  # a crash leaves things behind ...
    res = subprocess.run([sys.executable, "-m", "dlcp", "clean"], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and "removed" in res.stdout
    time.sleep(1)
    assert _ours_left() == {"bmv2": [], "netns": [], "links": []}  # ... and clean removes all of it
    assert netns.ALLOWED_CC.read_text() == allowed  # and puts back the kernel's setting


def test_a_terminated_run_tears_its_network_down(tmp_path):
    """SIGTERM (a job scheduler, ``kill``) stops a run as Ctrl-C does: exit 143, nothing left."""
    proc = subprocess.Popen([sys.executable, "-m", "dlcp", "run", "--topology", "star", "--workers", "2",
                             "--iterations", "50", "--out", str(tmp_path), "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not _ours_left()["bmv2"]:
            time.sleep(0.5)
        time.sleep(3)
        assert _ours_left()["bmv2"], "the run never started its switches"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.stderr is not None and "dlcp: terminated" in proc.stderr.read()
    time.sleep(1)
    assert _ours_left() == {"bmv2": [], "netns": [], "links": []}


def test_gloo_beside_dlcps_ring_in_one_run(tmp_path):
    """What users run (DDP over gloo, on the baseline's fabric) and DLCP's ring, in float32 and
    float16, interleaved in one run; speedups and the accuracy target are against gloo. Every host
    runs Linux's default Cubic, also where the machine's default is another and host namespaces
    may not take Cubic until the run allows it (and puts the kernel's list back afterwards)."""
    allowed = netns.ALLOWED_CC.read_text()
    res = dlcp("run", "--topology", "star", "--workers", 2, "--scheme", "gloo,dlcp:ring,dlcp-fp16:ring",
               "--workload", "digits",
               "--iterations", 4, "--eval-every", 2, "--capacity", 5000, "--quiet", "--out", tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    run_dir = next(tmp_path.iterdir())
    results = json.loads((run_dir / "results.json").read_text())
    assert results["reference"] == "gloo"
    gloo, ring, half = results["runs"]
    assert (gloo["scheme"], gloo["base_scheme"], gloo["pattern"]) == ("gloo", "gloo", "ring")
    assert (ring["scheme"], ring["base_scheme"], ring["pattern"]) == ("dlcp:ring", "dlcp", "ring")
    assert gloo["policy"]["lb_mode"] == "flow" and gloo["policy"]["num_drop_classes"] == 1
    assert not (run_dir / "gloo" / "server.log").exists() and (run_dir / "dlcp-ring").is_dir()
    assert (half["base_scheme"], half["policy"]) == ("dlcp-fp16", ring["policy"])

    def data_bytes(s: dict) -> int:
        return sum(e["data_bytes_sent"] for e in s["endpoints"].values())

    assert 0 < data_bytes(half) < 0.6 * data_bytes(ring)  # the gradients went as halves
    for s in (gloo, ring, half):
        assert [r["kind"] for r in s["iterations"]].count("measured") == 2 * 4
        assert len(s["metrics"]["accuracy_trace"]) == 3 and 0 < s["metrics"]["accuracy"] <= 1
    # gloo's TCP crossed the switch: the server-less star still forwarded its bytes
    assert sum(r["forwarded_pkts"] for r in gloo["switches"]["s1"]["ports"]) > 100
    # from the repetition's fixed ports (read back during the run), its paths recorded
    assert gloo["gloo_ports_fixed"] is True and len(gloo["gloo_connections"]) == 2
    assert {"gloo worker0>worker1", "gloo worker1>worker0"} <= set(gloo["paths"])
    assert "gloo_ports_fixed" not in ring
    for s in (gloo, ring):
        assert set(s["host_congestion_control"].values()) == {"cubic"}, s["host_congestion_control"]
    assert netns.ALLOWED_CC.read_text() == allowed
    assert "speedup = gloo's iteration p50" in res.stdout and "(gloo final - 0.5 points)" in res.stdout
    assert _ours_left() == {"bmv2": [], "netns": [], "links": []}


def test_a_run_from_another_registry_leaves_a_live_testbeds_namespaces_alone(tmp_path):
    """A second run that does not share the first one's lock (another ``DLCP_RUN_REGISTRY``, or a
    container on the same kernel) is refused before it creates anything, and the namespace it
    found is still there: such a run used to fail half-way and delete the live run's namespaces."""
    name = star(2).switches[0].name
    assert not netns.netns_exists(name), "a testbed run is going on this machine"
    netns.add_netns(name)  # what a live run in another container holds
    try:
        res = dlcp("run", "--topology", "star", "--workers", 2, "--scheme", "dlcp", "--out", tmp_path / "out", *SMALL,
                   env={**os.environ, "DLCP_RUN_REGISTRY": str(tmp_path / "registry")}, timeout=120)
        assert res.returncode != 0
        assert f"network namespace {name} exists already: another dlcp run is using the testbed" in res.stderr
        assert netns.netns_exists(name) and not (tmp_path / "out").exists()
    finally:
        netns.del_netns(name)
