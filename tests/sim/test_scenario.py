"""dlcp sim's scenario and report, without ns-3: what the simulator is told and how its answer is read."""

from __future__ import annotations

import numpy as np
import pytest

from dlcp_sim.run import parse_report
from dlcp_sim.scenario import (
    SimOptions,
    bucket_plans,
    line_rate_bound,
    scenario_text,
    topology,
)
from dlcp.hostagent.errors import DlcpUserError
from dlcp.hostagent.model_profiles import layer_sizes
from dlcp.hostagent.packetizer import elems_per_packet
from dlcp.hostagent.policy import layer_priorities
from dlcp.topologies.bound import message_packets
from dlcp.topologies.schemes import policy_for
from dlcp.topologies.workload import worker_plan


def _lines(text: str, key: str) -> list[list[str]]:
    return [line.split()[1:] for line in text.splitlines() if line.split()[0] == key]


def test_the_scenario_carries_the_schemes_policy():
    opts = SimOptions(buffer=80, loss_bound=0.1)
    base, dlcp = scenario_text(opts, "baseline"), scenario_text(opts, "dlcp")
    assert _lines(base, "priority_map") == [["0"] * 8] and _lines(base, "lb") == [["flow"]]
    assert _lines(base, "drop_thresholds") == [[]]
    assert _lines(dlcp, "priority_map") == [[str(i) for i in range(8)]] and _lines(dlcp, "lb") == [["round_robin"]]
    assert _lines(dlcp, "drop_thresholds") == [["60", "40", "20"]]
    assert _lines(dlcp, "job")[0][:2] == ["ps", "0.1"] and _lines(base, "job")[0][:2] == ["ps", "0"]
    assert _lines(dlcp, "ecn_backlog") == [["ahead"]]
    assert _lines(scenario_text(SimOptions(ecn_backlog="port"), "dlcp"), "ecn_backlog") == [["port"]]


def test_the_tcp_scheme_sends_over_tcp_through_the_baselines_switches():
    opts = SimOptions(schemes=("baseline", "tcp"), background_tcp="cubic", gradient_tcp="newreno")
    base, tcp = scenario_text(opts, "baseline"), scenario_text(opts, "tcp")
    assert _lines(tcp, "transport") == [["tcp"]] and _lines(base, "transport") == [["dlcp"]]
    assert _lines(tcp, "tcp") == [["cubic"]] and _lines(tcp, "gradient_tcp") == [["newreno"]]
    # a variant named in the scheme: several in one run, on the same seeds
    named = scenario_text(SimOptions(schemes=("tcp-cubic", "tcp-dctcp"), gradient_tcp="newreno"), "tcp-dctcp")
    assert _lines(named, "transport") == [["tcp"]] and _lines(named, "gradient_tcp") == [["dctcp"]]
    drop = {"transport"}
    assert [line for line in tcp.splitlines() if line.split()[0] not in drop] == \
        [line for line in base.splitlines() if line.split()[0] not in drop]
    with pytest.raises(DlcpUserError, match="tcp"):
        SimOptions(schemes=("udp",))


def test_buckets_leave_as_the_backward_pass_fills_them():
    from dlcp_sim.scenario import bucket_ready

    opts = SimOptions(scale=0.002, compute_ms=500)
    policy = policy_for("dlcp", opts.buffer, opts.loss_bound)
    ready = bucket_ready(opts, policy)
    assert len(ready) == len(bucket_plans(opts, policy)) and ready[-1] == 1.0  # the input layer's comes last
    assert ready == sorted(ready) and 0 < ready[0] < 1  # the output layers' bucket leaves early
    assert _lines(scenario_text(opts, "dlcp"), "ready") == [[f"{f:.6f}" for f in ready]]
    ring = SimOptions(pattern="ring", scale=0.002, compute_ms=500)
    assert _lines(scenario_text(ring, "dlcp"), "ready") == [[f"{f:.6f}" for f in bucket_ready(ring, policy)]]
    assert len(bucket_ready(ring, policy)) == len(bucket_plans(ring, policy)) // ring.workers  # per bucket


def test_the_agent_host_model_is_the_host_agents_rules():
    from dlcp.hostagent.ratecontrol import INITIAL_ALPHA, RateConfig

    agent = scenario_text(SimOptions(host_model="agent"), "dlcp")
    assert _lines(agent, "increase_interval_us") == [[f"{RateConfig().increase_interval * 1e6:g}"]]
    assert _lines(agent, "max_increase_span_us") == [[f"{RateConfig().max_increase_span * 1e6:g}"]]
    assert _lines(agent, "feedback_interval_us") == [["2000"]]  # TransportConfig.feedback_interval
    assert _lines(agent, "bulk_feedback_packets") == [["64"]]
    assert _lines(agent, "cut_interval_us") == [["0"]]  # a cut per congested report
    dctcp = scenario_text(SimOptions(), "dlcp")
    assert not _lines(dctcp, "feedback_interval_us") and float(_lines(dctcp, "cut_interval_us")[0][0]) > 0
    assert _lines(agent, "initial_alpha") == _lines(dctcp, "initial_alpha") == [[f"{INITIAL_ALPHA:g}"]]
    # the dctcp model: the increase per cut interval (as DCTCP's per round trip), slow start before
    assert _lines(dctcp, "increase_interval_us") == _lines(dctcp, "cut_interval_us")
    assert _lines(dctcp, "slow_start") == [["1"]] and not _lines(agent, "slow_start")


def test_buckets_carry_every_packet_with_its_layers_priority_and_a_drop_class():
    opts = SimOptions(scale=0.002)
    policy = policy_for("dlcp", opts.buffer, opts.loss_bound)
    plans = bucket_plans(opts, policy)
    sizes = layer_sizes(opts.workload, opts.scale)
    per = elems_per_packet(opts.mtu, np.float32)
    total_packets = sum(len(p.priorities) for p in plans)
    assert total_packets >= -(-sum(sizes) // per)  # at least the packets the elements need
    assert all(len(p.priorities) == len(p.drop_classes) for p in plans)
    # the earliest layers' priority appears (the top one), and only priorities the layers have
    prios = {int(x) for x in layer_priorities(sizes, policy)}
    seen = {int(x) for p in plans for x in p.priorities}
    assert seen <= prios and max(prios) in seen
    classes = np.concatenate([p.drop_classes for p in plans])
    assert set(np.unique(classes)) <= set(range(policy.num_drop_classes)) and (classes == 0).any()
    bucket = _lines(scenario_text(opts, "dlcp"), "bucket")
    assert [int(b[0]) for b in bucket] == [len(p.priorities) for p in plans]
    assert all(len(b[1]) == len(b[2]) == int(b[0]) for b in bucket)


def test_jobs_span_leaves_and_never_share_a_host():
    opts = SimOptions(leaves=3, hosts_per_leaf=4, workers=3, jobs=0)
    jobs = opts.placement()
    assert len(jobs) == 3
    hosts = [h for server, workers in jobs for h in [server, *workers]]
    assert len(hosts) == len(set(hosts))
    for server, workers in jobs:
        assert server is not None  # the parameter server's host (pattern ps)
        assert len({h // opts.hosts_per_leaf for h in [server, *workers]}) > 1


@pytest.mark.parametrize("bad", [{"schemes": ("nope",)}, {"workload": "digits"}, {"leaves": 0}, {"jobs": 9},
                                 {"loss_bound": 1.0}, {"hosts_per_leaf": 251}, {"workers": 8},
                                 {"pattern": "tree"}, {"pattern": "ring", "workers": 1},
                                 {"jobs_placement": "random"}, {"host_model": "cubic"}, {"gradient_tcp": "bbr"},
                                 {"warmup": 3}, {"control_bytes": 10}, {"control_bytes": 1473},
                                 {"host_delay_us": -1}, {"tcp_min_rto_us": 0}, {"tcp_ack_every": 0},
                                 {"mtu": 500}, {"mtu": 9217},
                                 {"ecn_backlog": "queue"}])
def test_invalid_options_are_refused_by_name(bad):
    with pytest.raises(DlcpUserError):
        SimOptions(**bad)


def test_ring_jobs_have_no_server_and_send_every_bucket_as_its_workers_chunks():
    opts = SimOptions(pattern="ring", leaves=2, hosts_per_leaf=4, workers=4, jobs=0, scale=0.002)
    assert opts.placement() == [(None, [0, 4, 1, 5]), (None, [2, 6, 3, 7])]  # alternating leaves
    packed = SimOptions(pattern="ring", leaves=2, hosts_per_leaf=2, jobs_placement="packed")
    assert packed.placement() == [(None, [0, 1, 2, 3])]  # the testbed's ring: two neighbours per leaf
    policy = policy_for("dlcp", opts.buffer, opts.loss_bound)
    ps = bucket_plans(SimOptions(scale=0.002), policy)
    chunks = bucket_plans(opts, policy)
    assert len(chunks) == 4 * len(ps)
    for b, whole in enumerate(ps):
        mine = chunks[4 * b: 4 * b + 4]
        # each chunk is packetized on its own: at least the bucket's packets, at most 3 more
        assert len(whole.priorities) <= sum(len(c.priorities) for c in mine) <= len(whole.priorities) + 3
        # the first chunk starts with the bucket's first layer; a later one never holds a more
        # urgent layer than the bucket's first packet
        assert mine[0].priorities[0] == whole.priorities[0]
        assert max(int(c.priorities.max()) for c in mine) == int(whole.priorities.max())
    jobs = _lines(scenario_text(opts, "dlcp"), "job")
    assert jobs == [["ring", "0.05", "0", "4", "0", "4", "1", "5"], ["ring", "0.05", "0", "4", "2", "6", "3", "7"]]


def test_the_line_rate_bound_counts_the_busiest_link_of_every_job():
    """Two one-worker jobs across 2 leaves: worker h0 -> server h2, h1 -> h3 (placement takes
    hosts leaf by leaf). With one spine both jobs' pushes share leaf 1's single uplink, so the
    bound is twice one job's traffic; with two spines, an even split, once."""
    def bound(spines: int, scheme: str = "baseline") -> tuple[SimOptions, float]:
        opts = SimOptions(leaves=2, hosts_per_leaf=2, spines=spines, workers=1, jobs=0, scale=0.002, link_gbps=1)
        return opts, line_rate_bound(opts, scheme)
    opts, one = bound(1)
    assert opts.placement() == [(2, [0]), (3, [1])]
    spec = {"model": opts.workload, "scale": opts.scale, "mtu": opts.mtu, "fusion": True}
    per = elems_per_packet(opts.mtu, np.float32)
    packets = sum(message_packets(b.total, per) for b in worker_plan(spec, policy_for("baseline", 100, 0.05))[2])
    packet_s = opts.mtu * 8 / 1e9
    assert one == pytest.approx(2 * packets * packet_s)
    assert bound(2)[1] == pytest.approx(packets * packet_s)
    # DLCP's pushes need only (1 - p) of their packets, but the pulls (reliable in every scheme)
    # load leaf 2's uplink as much as the pushes load leaf 1's: they bind
    assert bound(2, "dlcp")[1] == pytest.approx(bound(2)[1])
    topo = topology(opts)
    links = {(link.a, link.a_port, link.b, link.b_port) for link in topo.links}
    assert links == {("l1", 3, "sp1", 1), ("l2", 3, "sp1", 2)}


def test_the_report_is_read_line_by_line():
    text = "\n".join([
        "iter 0 1 2 0.5 0.6 0.75",
        "done 4 1 7 0.7 100 3",
        "port l1 5 10 1 2 9 0 4 3 2 0 0 0 0",
        "host 4 1 2 3 4 5 6 7 800 9 11",
        "sim 0.75 1234 0.5",
    ])
    r = parse_report("dlcp", text)
    assert r.iterations[0].sync == pytest.approx(0.15)
    assert r.completions[0].missing == 3 and r.completions[0].message == 7
    assert r.ports[0].selective_drops[:3] == (0, 4, 3) and r.ports[0].max_depth == 9
    assert r.hosts[0].packets_at_completion == 800 and (r.events, r.wall_s) == (1234, 0.5)
    assert r.hosts[0].duplicates == 3 and r.hosts[0].late == 11
