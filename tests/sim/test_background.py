"""Background traffic for dlcp sim: the published distribution, the load definition, and the
flow completion times read from the simulator's report (no ns-3 needed)."""

from __future__ import annotations

import numpy as np
import pytest

from dlcp_sim.background import WEB_SEARCH, generate, mean_size, sample_sizes
from dlcp_sim.run import FlowRecord, fct_stats, parse_report
from dlcp_sim.scenario import SimOptions, background_flows, scenario_text


def test_web_search_sizes_follow_the_distribution():
    # the DCTCP paper's web-search workload: mean about 1.7 MB, 15 % under 10 KB, 97 % under 10 MB
    assert mean_size(WEB_SEARCH) == pytest.approx(1_711_250)
    sizes = sample_sizes(WEB_SEARCH, 200_000, np.random.default_rng(1))
    assert np.mean(sizes <= 10_000) == pytest.approx(0.15, abs=0.01)
    assert np.mean(sizes <= 10_000_000) == pytest.approx(0.97, abs=0.005)
    assert sizes.mean() == pytest.approx(mean_size(WEB_SEARCH), rel=0.03)
    assert sizes.max() <= 30_000_000 and sizes.min() >= 64


def test_load_is_the_fraction_of_each_hosts_link_its_flows_offer():
    hosts, load, rate, horizon = 16, 0.4, 10e9, 0.5
    flows = generate(hosts, load, rate, horizon, seed=3)
    offered = sum(f.size for f in flows) * 8 / (hosts * rate * horizon)
    assert offered == pytest.approx(load, rel=0.15)  # heavy-tailed sizes: a loose tolerance
    assert all(f.src != f.dst and 0 <= f.dst < hosts for f in flows)
    assert [f.start for f in flows] == sorted(f.start for f in flows) and flows[-1].start < horizon
    assert [f.id for f in flows] == list(range(len(flows)))
    assert generate(hosts, load, rate, horizon, seed=3) == flows  # a seed gives every scheme the same flows
    assert generate(hosts, 0.0, rate, horizon, seed=3) == []


def test_the_scenario_lists_the_flows_and_the_tcp():
    opts = SimOptions(scale=0.002, iterations=1, background_load=0.3, background_tcp="cubic")
    text = scenario_text(opts, "dlcp")
    lines = [line.split() for line in text.splitlines() if line.startswith("flow ")]
    assert len(lines) == len(background_flows(opts)) > 0
    assert ["tcp", "cubic"] in [line.split() for line in text.splitlines()]
    assert scenario_text(opts, "baseline").count("\nflow ") == len(lines)  # same flows for every scheme


def test_flow_completion_times_count_only_flows_started_in_the_window():
    r = parse_report("dlcp", "flow 0 1 2 50000 0.001 0.003\nflow 1 2 3 20000000 0.002 0.022\n"
                             "flow 2 3 1 1000 0.050 0.0501\nunfinished 3 5000 4000 2000\n")
    assert r.unfinished == [(3, 5000, 4000, 2000)]
    assert [f.id for f in r.flows] == [0, 1, 2] and r.flows[1].fct == pytest.approx(0.020)
    st = fct_stats(r.flows, before=0.01)
    assert st["flows"] == 2 and st["fct_avg_ms"] == pytest.approx(11.0)
    assert st["small_flows"] == 1 and st["small_fct_p99_ms"] == pytest.approx(2.0)
    assert fct_stats([FlowRecord(0, 0, 1, 10, 1.0, 2.0)], before=0.5)["fct_avg_ms"] is None
