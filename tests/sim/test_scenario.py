"""dlcp sim's scenario and report, without ns-3: what the simulator is told and how its answer is read."""

from __future__ import annotations

import numpy as np
import pytest

from dlcp_sim.run import parse_report
from dlcp_sim.scenario import SimOptions, bucket_plans, scenario_text
from hostagent.errors import DlcpUserError
from hostagent.model_profiles import layer_sizes
from hostagent.packetizer import elems_per_packet
from hostagent.policy import layer_priorities
from topologies.schemes import policy_for


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


def test_buckets_carry_every_packet_with_its_layers_priority_and_a_drop_class():
    opts = SimOptions(scale=0.002)
    policy = policy_for("dlcp", opts.buffer, opts.loss_bound)
    plans = bucket_plans(opts, policy)
    sizes = layer_sizes(opts.model, opts.scale)
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
        assert len({h // opts.hosts_per_leaf for h in [server, *workers]}) > 1


@pytest.mark.parametrize("bad", [{"schemes": ("nope",)}, {"model": "digits"}, {"leaves": 0}, {"jobs": 9},
                                 {"loss_bound": 1.0}, {"hosts_per_leaf": 251}, {"workers": 8}])
def test_invalid_options_are_refused_by_name(bad):
    with pytest.raises(DlcpUserError):
        SimOptions(**bad)


def test_the_report_is_read_line_by_line():
    text = "\n".join([
        "iter 0 1 2 0.5 0.6 0.75",
        "done 4 1 7 0.7 100 3",
        "port l1 5 10 1 2 9 0 4 3 2 0 0 0 0",
        "host 4 1 2 3 4 5 6 7 800 9",
        "sim 0.75 1234 0.5",
    ])
    r = parse_report("dlcp", text)
    assert r.iterations[0].sync == pytest.approx(0.15)
    assert r.completions[0].missing == 3 and r.completions[0].message == 7
    assert r.ports[0].selective_drops[:3] == (0, 4, 3) and r.ports[0].max_depth == 9
    assert r.hosts[0].packets_at_completion == 800 and (r.events, r.wall_s) == (1234, 0.5)
