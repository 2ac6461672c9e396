"""dlcp sim end to end: the C++ ns-3 components compiled and run on small leaf-spines.

Each test states a rule of DLCP's policy that the simulated switches or hosts must follow and
checks it in the simulator's own counters.
"""

from __future__ import annotations

import subprocess
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from dlcp_sim.build import simulator
from dlcp_sim.run import simulate
from dlcp_sim.scenario import SimOptions, background_flows, bucket_plans, scenario_text
from dlcp.hostagent.errors import UsageError
from dlcp.topologies.results import CORE_METRICS
from dlcp.topologies.schemes import policy_for

pytestmark = pytest.mark.ns3

SMALL = SimOptions(scale=0.002, iterations=2)


@pytest.fixture(scope="module")
def runs():
    """The baseline and DLCP on the default small leaf-spine (4 jobs' worth of incast)."""
    opts = SimOptions(scale=0.002, iterations=2, leaves=4, hosts_per_leaf=5, jobs=0)
    return opts, {s: simulate(opts, s) for s in ("baseline", "dlcp")}


def test_every_iteration_of_every_job_completes(runs):
    opts, results = runs
    for r in results.values():
        assert len(r.iterations) == 4 * opts.workers * opts.iterations
        assert all(i.end > i.computed >= i.start for i in r.iterations)
        assert r.events > 0 and r.simulated_s > 0


def test_the_baseline_is_reliable_and_never_drops_selectively(runs):
    _, results = runs
    r = results["baseline"]
    assert all(c.missing == 0 for c in r.completions)
    assert all(sum(p.selective_drops) == 0 for p in r.ports)
    assert sum(p.tail_drops for p in r.ports) > 0  # the incast did overflow: recovery was exercised


def test_dlcp_completes_within_its_bound_and_protects_class_0(runs):
    opts, results = runs
    r = results["dlcp"]
    for c in r.completions:
        assert c.missing <= np.floor(opts.loss_bound * c.packets + 1e-9)
    assert any(c.missing > 0 for c in r.completions)  # the bound was used, not only allowed
    drops = np.sum([p.selective_drops for p in r.ports], axis=0)
    assert drops[0] == 0 and drops[1:4].sum() > 0
    assert drops[3] >= drops[2] >= drops[1]  # the smallest gradients go first


def test_flow_hashing_keeps_flows_whole_and_spraying_splits_evenly():
    """One worker, one server. Spraying splits every seed's packets evenly over both spines.
    Flow hashing keeps each flow on one spine: the agent's data leave from a socket per
    priority (one flow each), so the baseline's buckets, whose layers span priorities, use both
    spines under some seeds, but unevenly (whole flows, not packets)."""
    def uplinks(scheme: str, seed: int) -> list[int]:
        opts = SimOptions(scale=0.002, iterations=1, workers=1, leaves=2, hosts_per_leaf=1, seed=seed)
        r = simulate(opts, scheme)
        up = [p.enqueued for p in r.ports if p.switch == "l1" and p.port > opts.hosts_per_leaf]
        assert len(up) == 2
        return up
    seeds = range(4)
    assert all(abs(a - b) <= 2 for a, b in (uplinks("lb", s) for s in seeds))
    flows = [uplinks("baseline", s) for s in seeds]
    assert any(min(up) > 0 for up in flows)
    assert any(abs(a - b) > 20 for a, b in flows)


@pytest.mark.parametrize("background", [0.0, 0.5])
def test_jumbo_frames_cross_the_fabric_whole(background):
    """--mtu 9000: a DLCP datagram of 8972 bytes, or a TCP segment of 8960, crosses every link
    as one packet (ns-3's devices default to 1500 and would cut them into six fragments). One
    worker on leaf 1 pushes to its server on leaf 2, so every packet it sends crosses one of
    leaf 1's uplinks exactly once (but for a last control packet or two still at the host when
    the simulation stops)."""
    opts = SimOptions(scale=0.01, iterations=1, workers=1, leaves=2, hosts_per_leaf=1, mtu=9000)
    r = simulate(opts, "dlcp")
    sent = r.hosts[0].data_sent + r.hosts[0].control_sent
    up = sum(p.enqueued for p in r.ports if p.switch == "l1" and p.port > opts.hosts_per_leaf)
    assert sent > 0 and sent - 2 <= up <= sent
    per = bucket_plans(opts, policy_for("dlcp", opts.buffer, opts.loss_bound))
    assert r.hosts[0].data_sent >= 0.95 * sum(len(b.priorities) for b in per)  # packets of 8972 bytes
    if background:  # TCP's segments follow the MTU: the same flows in a sixth of the packets
        bg: dict[str, Any] = dict(leaves=2, hosts_per_leaf=4, jobs=0, scale=0.002, iterations=1,
                                  background_load=background, background_ms=2)
        packets = {mtu: sum(p.enqueued for p in simulate(SimOptions(**bg, mtu=mtu), "baseline").ports)
                   for mtu in (1500, 9000)}
        assert packets[9000] < packets[1500] / 3, packets


def test_a_bad_scenario_is_refused_with_a_reason(tmp_path):
    exe = simulator()
    bad = tmp_path / "bad.scenario"
    bad.write_text(scenario_text(SMALL, "dlcp") + "no_such_key 1\n")
    done = subprocess.run([str(exe), str(bad)], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "unknown scenario key 'no_such_key'" in done.stderr
    bad.write_text(scenario_text(SMALL, "dlcp").replace("bucket ", "bucket 9", 1))
    done = subprocess.run([str(exe), str(bad)], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "bucket" in done.stderr


def test_repeats_are_seeds_with_intervals_and_a_paired_speedup(tmp_path):
    import json

    from dlcp_sim.run import run, summary

    results = run(SimOptions(scale=0.002, iterations=1), repeat=3, out=tmp_path)
    assert [len(v) for v in results.values()] == [3, 3]
    s = summary(results)
    assert s["dlcp"]["speedup_p50"]["n"] == 3 and s["dlcp"]["speedup_p50"]["verdict"]
    assert "speedup_p50" not in s["baseline"]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["schema"] == 2 and saved["source"] == "simulator" and saved["repeat"] == 3
    assert [(r["scheme"], r["seed"]) for r in saved["runs"]] == [(s, r) for r in range(3) for s in results]
    assert set(CORE_METRICS) <= set(saved["runs"][0]["metrics"])  # named as the testbed names them
    # different seeds draw different gradients: the drop classes, so the drops, differ
    drops = {sum(sum(p.selective_drops) for p in r.ports) for r in results["dlcp"]}
    assert len(drops) > 1


def test_ring_jobs_finish_every_step_and_only_the_reduce_scatter_loses():
    """Ring allreduce, a ring per bucket started as the backward pass fills it: every member
    finishes every iteration; DLCP's reduce-scatter steps complete within the push bound, its
    all-gather steps (pull bound 0) lose nothing."""
    opts = SimOptions(pattern="ring", scale=0.002, iterations=2, leaves=4, hosts_per_leaf=4, jobs=0, compute_ms=2)
    r = simulate(opts, "dlcp")
    assert len(r.iterations) == 4 * opts.workers * opts.iterations
    steps = 2 * (opts.workers - 1)
    buckets = len(bucket_plans(opts, policy_for("dlcp", opts.buffer, opts.loss_bound))) // opts.workers
    assert len(r.completions) == 4 * opts.workers * opts.iterations * steps * buckets
    gather = [c for c in r.completions if (c.message // buckets) % steps >= opts.workers - 1]
    scatter = [c for c in r.completions if (c.message // buckets) % steps < opts.workers - 1]
    assert gather and all(c.missing == 0 for c in gather)
    assert all(c.missing <= np.floor(opts.loss_bound * c.packets + 1e-9) for c in scatter)
    assert r.bound_s > 0 and all(i.end - i.start >= r.bound_s * 0.5 for i in r.iterations)


def test_host_delay_is_paid_at_a_rings_ends_not_per_step_and_full_size_control_packets_cost_a_slot():
    """The testbed's software path and its packet-slot ports, modelled. With a host delay the
    application's first send of a bucket starts later and every control packet (the last STOP
    too) leaves later, but a ring's later steps are released inside the transport by the
    receive before them, as the agent's data path releases its held sends: on a fast fabric the
    last bucket's ring takes two delays longer, not two per step. Control packets of a full
    datagram each take a packet's time on a slow uplink, so there the sync grows too."""
    base: dict[str, Any] = dict(pattern="ring", jobs_placement="packed", leaves=2, hosts_per_leaf=2, scale=0.002,
                                iterations=3, warmup=1, buffer=64, compute_ms=50)
    plain = np.median(simulate(SimOptions(**base), "baseline").sync_times())
    delayed = np.median(simulate(SimOptions(**base, host_delay_us=1000), "baseline").sync_times())
    assert 0.95 * 2e-3 <= delayed - plain <= 1.05 * 2e-3
    # one spine: on two, a message's probe (a flow of its own) may overtake its data queued on
    # the other spine, and the receiver's wait for that data would hide what is measured here
    slow: dict[str, Any] = dict(base, uplink_gbps=0.0084, compute_ms=500, spines=1)
    small = np.median(simulate(SimOptions(**slow), "baseline").sync_times())
    full = np.median(simulate(SimOptions(**slow, control_bytes=1472), "baseline").sync_times())
    assert full > small + 0.01  # STOPs and feedback now take a packet's slot each


def test_background_flows_all_complete_and_none_beats_its_link():
    """Web-search TCP flows at 50 % load beside the training jobs: every flow completes, none
    faster than its bytes at the host link's rate, and the report pairs schemes on the same flows."""
    # small port buffers, so some flows lose packets and TCP's timers are exercised
    opts = SimOptions(scale=0.002, iterations=1, leaves=2, hosts_per_leaf=5, jobs=0, background_load=0.5, buffer=16)
    flows = background_flows(opts)
    assert flows
    for scheme in ("baseline", "dlcp"):
        r = simulate(opts, scheme)
        assert sorted(f.id for f in r.flows) == [f.id for f in flows]
        assert all(f.fct >= f.size * 8 / (opts.link_gbps * 1e9) for f in r.flows)
        # and none stalls: a TCP timer at ns-3's default (200 ms delayed ACK, 3 s SYN, 6 s
        # persist) against a 5 ms RTO once held flows for seconds in this microsecond fabric
        assert max(f.fct for f in r.flows) < 0.1, max(r.flows, key=lambda f: f.fct)
        assert "background" in r.summary()


@pytest.mark.parametrize("pattern", ["ps", "ring"])
def test_gradients_over_tcp_arrive_whole_and_in_order(pattern):
    """The tcp scheme: one DCTCP connection per pair of hosts, each message written after the
    one before. Every message arrives whole (nothing missing, no DLCP control packets), no
    iteration beats the line-rate bound, and (PS, whose message ids grow in sending order on
    every connection) each pair's messages arrive in the order they were sent."""
    opts = SimOptions(pattern=pattern, scale=0.002, iterations=2, leaves=2, hosts_per_leaf=5, jobs=0,
                      compute_ms=1, schemes=("tcp",))
    r = simulate(opts, "tcp")
    assert len(r.iterations) == len(opts.placement()) * opts.workers * opts.iterations
    assert r.completions and all(c.missing == 0 for c in r.completions)
    assert all(h.probes == h.bitmaps == h.control_sent == 0 for h in r.hosts)
    assert sum(h.data_sent for h in r.hosts) > 0
    jobs = len(opts.placement())
    plans = len(bucket_plans(opts, policy_for("baseline", opts.buffer, opts.loss_bound)))
    if pattern == "ps":  # each worker's pushes and the pulls back to it
        assert len(r.completions) == jobs * opts.workers * opts.iterations * 2 * plans
        for pair in {(c.receiver, c.sender) for c in r.completions}:
            msgs = [c.message for c in sorted(r.completions, key=lambda c: c.time) if (c.receiver, c.sender) == pair]
            assert msgs == sorted(msgs), pair
    else:  # every member's 2(n-1) steps of every bucket (plans: buckets x members)
        assert len(r.completions) == jobs * opts.iterations * 2 * (opts.workers - 1) * plans
    assert r.bound_s > 0 and all(i.end - i.start >= r.bound_s * 0.95 for i in r.iterations)
    assert sum(p.marks for p in r.ports) > 0  # the incast builds queues; DCTCP sees CE


def test_the_gradients_tcp_is_chosen_apart_from_the_background():
    """--gradient-tcp sets the tcp scheme's congestion control on its own sockets: DCTCP
    negotiates ECN, so the incast's queues mark its segments; NewReno does not, so nothing is
    marked (only ECN-capable packets can be)."""
    base: dict[str, Any] = dict(scale=0.002, iterations=1, leaves=2, hosts_per_leaf=5, jobs=0, schemes=("tcp",))
    marks = {cc: sum(p.marks for p in simulate(SimOptions(**base, gradient_tcp=cc), "tcp").ports)
             for cc in ("dctcp", "newreno")}
    assert marks["dctcp"] > 0 and marks["newreno"] == 0, marks


def test_switches_mark_tcp_in_its_ip_header_and_dctcp_keeps_queues_short():
    """A switch port marks CE in the IP header of an ECN-capable TCP segment (the switches
    forward below IP, so the mark is written into the frame's bytes). DCTCP's senders hear it
    and keep the incast's queues below the 100-packet buffer; NewReno, not ECN-capable, fills
    the buffer and loses packets."""
    base: dict[str, Any] = dict(scale=0.01, iterations=1, leaves=2, hosts_per_leaf=5, jobs=0, schemes=("tcp",))
    ports = {cc: simulate(SimOptions(**base, gradient_tcp=cc), "tcp").ports for cc in ("dctcp", "newreno")}
    assert sum(p.marks for p in ports["dctcp"]) > 0
    assert max(p.max_depth for p in ports["dctcp"]) < 100 and sum(p.tail_drops for p in ports["dctcp"]) == 0
    assert max(p.max_depth for p in ports["newreno"]) == 100 and sum(p.tail_drops for p in ports["newreno"]) > 0


def test_tcp_gradients_recover_from_tail_drops():
    """With 8-packet port buffers the incast overflows them: TCP retransmits, and still every
    message arrives whole."""
    opts = SimOptions(scale=0.002, iterations=1, leaves=2, hosts_per_leaf=5, jobs=0, buffer=8, schemes=("tcp",))
    r = simulate(opts, "tcp")
    assert sum(p.tail_drops for p in r.ports) > 0
    assert sum(h.retransmitted for h in r.hosts) > 0
    assert all(c.missing == 0 for c in r.completions)


def test_a_linux_minimum_rto_stops_spurious_resends_behind_a_slow_bottleneck():
    """The testbed's uplinks (700 packets/s, 64-packet buffers) queue tens of milliseconds: TCP's
    data-centre 5 ms minimum RTO fires before the ACKs come and resends what was only queued
    (resends without a drop); Linux's 200 ms (``--tcp-min-rto-us``) waits for them."""
    base: dict[str, Any] = dict(pattern="ring", jobs_placement="packed", leaves=2, spines=2, hosts_per_leaf=2,
                                uplink_gbps=0.0084, buffer=64, scale=0.002, compute_ms=500, iterations=3, seed=1,
                                gradient_tcp="cubic", schemes=("tcp",))
    runs = {rto: simulate(SimOptions(**base, tcp_min_rto_us=rto), "tcp") for rto in (5000, 200_000)}
    fast, linux = runs[5000], runs[200_000]
    assert sum(p.tail_drops for p in fast.ports) == 0 and sum(h.retransmitted for h in fast.hosts) > 0
    assert sum(h.retransmitted for h in linux.hosts) == 0
    assert np.median(linux.sync_times()) < np.median(fast.sync_times())


def test_packet_slots_make_an_ack_cost_an_uplink_a_full_packet():
    """``packet_slots`` (the testbed's BMv2 ports serve packets, not bytes): the ACKs of a ring
    neighbour's TCP stream share the uplink with the other direction's data and each takes a
    full packet's time, so TCP's steps take much longer; the segments themselves are the same,
    and the receivers see no padding (every message arrives whole). (Seed 1 hashes the ACKs onto
    the spine of the other direction's data; seed 0 keeps them apart, and nothing changes.)"""
    base: dict[str, Any] = dict(pattern="ring", jobs_placement="packed", leaves=2, spines=2, hosts_per_leaf=2,
                                uplink_gbps=0.0084, buffer=64, scale=0.002, compute_ms=500, iterations=3, seed=1,
                                gradient_tcp="cubic", tcp_min_rto_us=200_000, schemes=("tcp",))
    bytes_, slots = (simulate(SimOptions(**base, packet_slots=on), "tcp") for on in (False, True))
    assert np.median(slots.sync_times()) > 1.3 * np.median(bytes_.sync_times())
    assert sum(h.data_sent for h in slots.hosts) == sum(h.data_sent for h in bytes_.hosts)
    assert all(c.missing == 0 for c in slots.completions) and slots.completions


def test_wire_framing_charges_an_uplink_what_an_ethernet_frame_costs():
    """``wire_framing`` (the testbed's ports with a capacity in bits/s charge each frame its bytes
    on the wire: 38 more than its IP packet, at least 84): the same ring over TCP takes longer,
    less than with packet slots (a full segment costs 2.4 % more, an ACK 84 bytes, not 1,500),
    and every message arrives whole. The two models of a port's charge do not go together."""
    base: dict[str, Any] = dict(pattern="ring", jobs_placement="packed", leaves=2, spines=2, hosts_per_leaf=2,
                                uplink_gbps=0.0084, buffer=64, scale=0.002, compute_ms=500, iterations=3, seed=1,
                                gradient_tcp="cubic", tcp_min_rto_us=200_000, schemes=("tcp",))
    extras: list[dict[str, Any]] = [{}, {"wire_framing": True}, {"packet_slots": True}]
    plain, framed, slots = (simulate(SimOptions(**base, **extra), "tcp") for extra in extras)
    t = {name: float(np.median(r.sync_times())) for name, r in (("plain", plain), ("framed", framed),
                                                                  ("slots", slots))}
    assert t["plain"] * 1.02 < t["framed"] < t["slots"], t
    assert sum(h.data_sent for h in framed.hosts) == sum(h.data_sent for h in plain.hosts)
    assert all(c.missing == 0 for c in framed.completions) and framed.completions
    with pytest.raises(UsageError, match="wire-framing and --packet-slots"):
        SimOptions(**base, wire_framing=True, packet_slots=True)


def test_ecn_on_the_port_backlog_marks_every_sender_of_an_incast():
    """Strict priority in a parameter-server incast: with ECN on the backlog ahead (the
    default) a packet on a high priority is not marked for the low-priority backlog behind it;
    on the port's whole backlog it is, so the senders slow down sooner and fewer packets are
    tail-dropped, in every seed. (Not that more packets are marked: senders that slow sooner
    build smaller queues to mark. Since the model sends a message's most urgent packets first,
    as the agent does, seed 0 has fewer marks under the port rule, seeds 1 and 2 more.)"""
    base: dict[str, Any] = dict(scale=0.01, iterations=1, leaves=4, hosts_per_leaf=5, jobs=0)
    for seed in range(3):
        ports = {b: simulate(SimOptions(**base, ecn_backlog=b, seed=seed), "prio").ports for b in ("ahead", "port")}
        marks = {b: sum(p.marks for p in ports[b]) for b in ports}
        drops = {b: sum(p.tail_drops for p in ports[b]) for b in ports}
        assert marks["port"] > 0 and drops["port"] < drops["ahead"], (seed, marks, drops)
    # the baseline has one queue, where the two rules are the same
    same = [simulate(SimOptions(**base, ecn_backlog=b), "baseline").ports for b in ("ahead", "port")]
    assert [(p.marks, p.tail_drops) for p in same[0]] == [(p.marks, p.tail_drops) for p in same[1]]


def test_incast_senders_share_the_servers_link_evenly():
    """Four workers push to one server over a fabric with room to spare: the server's link is
    the only bottleneck, and each sender's rate control must leave it an even share. (When a
    report-driven increase grew fast senders faster than slow ones, one worker per job fell
    milliseconds behind and spraying alone, which has nothing to balance here, was 13 % slower
    than the baseline.)"""
    opts = SimOptions(scale=0.05, iterations=1, leaves=4, hosts_per_leaf=8, spines=4, uplink_gbps=40, jobs=0)
    results = {s: simulate(opts, s) for s in ("baseline", "lb")}
    for r in results.values():
        for server, workers in opts.placement():
            last = sorted(max(c.time for c in r.completions if c.receiver == server and c.sender == w) for w in workers)
            assert last[-1] - last[-2] < 1e-3, (r.scheme, server, last)  # no worker left behind
    sync = {s: r.summary()["sync_p50_ms"] for s, r in results.items()}
    assert sync["lb"] < 1.03 * sync["baseline"], sync


#: The testbed's sync p50 (ms) in the validation setup (docs/results/sim-validation.md), 5 runs
#: each, hosts on Cubic, ports of one capacity at 8.4 Mbit/s counted in bits, hosts configured for
#: that rate (the PS: 10 iterations per run; the ring: 50 iterations per run; agents at fccc09c with
#: its reordering window; 10 iterations left a ring run's median to a few iterations): what
#: the simulator's testbed model (``--host-model agent --wire-framing --host-rate-gbps`` the testbed hosts' rate,
#: ``--tcp-min-rto-us 200000``, a host delay of 500 us) must stay within 15 % of. ``tcp`` is the
#: simulator's analogue of the testbed's ``gloo`` (stock DDP over TCP). Measured with the machine
#: busy 53-60 %: at 32803db, busy 32-39 %, every scheme ran faster, gloo too (69 / 48 / 45 ms;
#: sim-validation.md's first section), so these figures hold for that machine state only.
TESTBED_SYNC_MS = {("ps", "baseline"): 487, ("ps", "dlcp"): 487, ("ring", "baseline"): 64, ("ring", "dlcp"): 51,
                   ("ring", "tcp"): 82}
#: Where the model does not agree today, what was measured (the cases stay in the test, expected to
#: fail, so that agreeing again shows as an unexpected pass).
DISAGREES: dict[tuple[str, str], str] = {
    ("ring", "dlcp"): "the model's 59.1 ms is 16 % above the testbed's 51 [49, 67] at fccc09c, whose rings "
                      "stopped resending with nothing dropped (60 [48, 80] before); not yet explained "
                      "(docs/results/sim-validation.md, \"The ring after the reordering window's fix\")",
}
#: The rate the testbed's hosts are configured for: a link of the fabric's rate (683 full frames
#: per second at 8.4 Mbit/s counted in bits, ``topologies.runner.testbed_rate``), in Gb/s.
TESTBED_HOST_GBPS = 683 * 1500 * 8 / 1e9
#: The hosts' software path in the model: a STOP on the testbed takes 0.9-1.4 ms (p10) from the
#: receiver's decision to the sender's handling, a network crossing included (agents at 2e53290).
HOST_DELAY_US = 500


def _validation_options(pattern: str, scheme: str) -> SimOptions:
    """The validation setup (docs/results/sim-validation.md): the testbed's leaf-spine as the
    simulator's testbed model, 11 iterations (1 warm-up)."""
    place: dict[str, Any] = (dict(hosts_per_leaf=3) if pattern == "ps"
                             else dict(hosts_per_leaf=2, jobs_placement="packed"))
    return SimOptions(pattern=pattern, leaves=2, spines=2, link_gbps=10, uplink_gbps=0.0084, buffer=64, scale=0.002,
                      compute_ms=500, iterations=11, warmup=1, host_model="agent", control_bytes=1472,
                      host_delay_us=HOST_DELAY_US, wire_framing=True, host_rate_gbps=TESTBED_HOST_GBPS,
                      tcp_min_rto_us=200_000, gradient_tcp="cubic", tcp_ack_every=1, schemes=(scheme,), **place)


def _validation_sync_ms(pattern: str, scheme: str) -> float:
    """The simulator's median over 8 seeds of each seed's median sync in the validation setup."""
    opts = _validation_options(pattern, scheme)
    per_seed = [np.median(simulate(replace(opts, seed=s), scheme).sync_times()) for s in range(8)]
    return 1e3 * float(np.median(per_seed))


@pytest.mark.parametrize("pattern, scheme", [
    pytest.param(*case, marks=[pytest.mark.xfail(reason=DISAGREES[case], strict=True)] if case in DISAGREES else [])
    for case in TESTBED_SYNC_MS])
def test_the_testbed_model_agrees_with_the_testbed(pattern, scheme):
    """The validation, as a regression test: the testbed's leaf-spine at 8.4 Mbit/s per uplink,
    8 seeds, the agent's own rate loop, hosts configured for the fabric's rate, ports that charge
    each packet its Ethernet frame's bytes, Linux's TCP timers, TCP receivers that ACK every
    segment. Each scheme's median sync within 15 % of what the testbed measured (issue 43's
    target)."""
    measured = TESTBED_SYNC_MS[(pattern, scheme)]
    sync = _validation_sync_ms(pattern, scheme)
    assert abs(sync - measured) <= 0.15 * measured, (sync, measured)


@pytest.mark.parametrize("pattern", ["ring"])
def test_dlcp_is_faster_than_the_baseline_in_the_validation_setup(pattern):
    """The rank the testbed shows, in the simulator too: the ring's. (The PS's testbed schemes
    take the same time since fccc09c, both at the line-rate bound with nothing else queueing; the
    model puts DLCP's 8 % ahead.)"""
    assert _validation_sync_ms(pattern, "dlcp") < _validation_sync_ms(pattern, "baseline")


#: The share of its data packets a ring may send again in the validation setup with nothing
#: dropped: its packets are sprayed over both spines and a few arrive after their receiver answered
#: the pass's end (0.1 % in the model, whose reordering window does not widen with the reordering
#: it sees as the agent's does). It was 0.9 % while the model resent packets its first pass had not
#: yet sent, and the PS resent some too. The testbed's ring resent 0.47 % in this setup at 7420cbc,
#: its receivers' reordering window too narrow for the same-leaf hops' pauses, and 0.02 % since
#: fccc09c (sim-validation.md).
RING_RESEND_SHARE = 0.002


@pytest.mark.parametrize("pattern", ["ps", "ring"])
def test_the_model_resends_nothing_it_need_not_where_no_port_dropped(pattern):
    """The agent's send order, modelled (dlcp-host.h, as hostagent/native/tx.cc): a pass leaves
    by priority, LAST rides only its last priority level, and an answer that comes while the
    first pass is held behind a more urgent message asks only for what was sent. The PS resends
    nothing; the ring a few that its spraying reordered."""
    r = simulate(_validation_options(pattern, "dlcp"), "dlcp")
    s = r.summary()
    assert s["tail_drops"] == 0 and sum(s["selective_drops"]) == 0, s  # (the premise: nothing dropped)
    sent = sum(h.data_sent for h in r.hosts)
    limit = 0 if pattern == "ps" else RING_RESEND_SHARE * sent
    assert s["retransmitted"] <= limit, (s["retransmitted"], sent)


def test_the_agent_model_reports_rarely_to_a_sender_at_its_line_rate():
    """The agent's LINE_RATE notice, modelled: a ring of 2 on an uncongested 100 Mb/s link for
    over a second, the hosts' own rate loop. Each sender reaches its line rate within about a
    tenth of a second and says so; its receiver then reports a clean transfer every
    ``clean_feedback_interval`` instead of every ``bulk_feedback_interval`` (63 reports a host
    in this run without the notice, 7 with it)."""
    from dlcp.hostagent.transport_config import TransportConfig

    opts = SimOptions(pattern="ring", leaves=1, spines=1, hosts_per_leaf=2, workers=2, jobs_placement="packed",
                      link_gbps=0.1, host_model="agent", scale=0.15, iterations=1, schemes=("dlcp",), loss_bound=0.0)
    r = simulate(opts, "dlcp")
    assert r.simulated_s > 1.0  # (the premise: long enough for the intervals to tell)
    bulk_pace = r.simulated_s / TransportConfig.bulk_feedback_interval
    assert all(1 <= h.reports <= 0.25 * bulk_pace for h in r.hosts), [h.reports for h in r.hosts]
