"""Report arithmetic: E with its flags, medians with intervals over repeated runs, paired
speedups and what the summary is allowed to claim."""

from __future__ import annotations

import math
from typing import Any

from dlcp.topologies.report import aggregate, ordering_efficiency, scheme_metrics, summary
from dlcp.topologies.results import document
from dlcp.topologies.stats import median_ci, paired_ratios, verdict, versus


def test_e_inside_0_1_is_a_value_with_its_inputs():
    e = ordering_efficiency(comm=0.4, comp=0.5, u=0.6)  # cost_max 0.9, cost_min 0.5
    assert math.isclose(e["value"], 0.75) and e["flag"] is None and e["comm_s"] == 0.4


def test_e_outside_0_1_is_flagged_with_the_reason_not_reported():
    above = ordering_efficiency(comm=0.4, comp=0.5, u=0.45)
    below = ordering_efficiency(comm=0.4, comp=0.5, u=1.2)
    assert above["value"] is None and "overstated" in above["flag"] and math.isclose(above["raw"], 1.125)
    assert below["value"] is None and "worse than no overlap" in below["flag"]
    assert "not measured" in ordering_efficiency(float("nan"), 0.5, 0.6)["flag"]
    assert "undefined" in ordering_efficiency(0.4, 0.0, 0.6)["flag"]


def test_median_ci_needs_five_runs_and_brackets_the_median():
    assert median_ci([2.0]).low is None
    est = median_ci([1.30, 1.35, 1.40, 1.32, 1.38])
    assert est.low is not None and est.high is not None and est.is_interval
    assert est.low <= est.median <= est.high and est.n == 5
    assert est.excludes(1.0) and not est.excludes(1.35)
    assert median_ci([1.2] * 5).text("{:.1f}") == "1.2 [1.2, 1.2]"
    assert median_ci([float("nan")]).text() == "-"


def test_fewer_than_five_runs_give_a_range_and_no_verdict():
    """A percentile bootstrap of the median of 3 runs is their minimum and maximum, which cover
    the median about 75 % of the time: it is printed as the range it is, and excludes nothing."""
    est = median_ci([1.5, 1.3, 1.4])
    assert (est.low, est.high, est.n) == (1.3, 1.5, 3) and not est.is_interval
    assert est.text("{:.2f}") == "1.40 (range 1.30..1.50)"
    assert not est.excludes(1.0)
    assert verdict(est) == "range only (3 paired runs; an interval needs 5): no verdict"
    assert "range only" in versus(median_ci([2.0, 2.1, 2.2, 2.3]), "gloo")


def test_verdict_calls_a_difference_only_when_the_interval_excludes_one():
    assert verdict(median_ci([1.3, 1.4, 1.5, 1.35, 1.45])) == "faster"
    assert verdict(median_ci([0.7, 0.8, 0.75, 0.72, 0.78])) == "slower"
    assert verdict(median_ci([0.9, 1.1, 1.0, 1.2, 0.8])) == "no significant difference"
    assert "too few" in verdict(median_ci([2.0]))


def test_paired_ratios_skip_missing_runs():
    assert paired_ratios([2.0, 3.0, float("nan")], [1.0, 0.0, 1.0]) == [2.0]


def as_testbed_results(runs: list[dict], options: dict | None = None, reference: str = "baseline",
                    provenance: dict | None = None) -> dict:
    """A testbed results file (schema 2, :mod:`dlcp.topologies.results`) around ``runs``."""
    return document("testbed", options if options is not None else {"target_accuracy": None}, runs,
                    provenance=provenance, reference=reference)


def _run(scheme: str, repeat: int, iter_s: float, valid: bool = True) -> dict:
    its = [{"kind": "measured", "iteration": i, "rank": r, "sync_time": iter_s / 2, "iteration_time": iter_s,
            "compute_time": 0.5, "comm_span": iter_s / 2, "lost_fraction": 0.0, "retransmissions": 1,
            "messages": 5, "control_frames": 10} for i in range(1, 6) for r in range(2)]
    its += [{"kind": "calibration", "iteration": 6, "rank": r, "comm_span": 0.3, "sync_time": 0.3,
             "iteration_time": 0.3, "compute_time": 0.0, "lost_fraction": 0.0, "retransmissions": 0} for r in range(2)]
    s = {"scheme": scheme, "repeat": repeat, "iterations": its, "switches": {}, "bound": {"seconds": 0.1},
         "validity": {"valid": valid, "reasons": [] if valid else ["machine saturated: median CPU 97 %"]}}
    s["metrics"] = scheme_metrics(s)
    return s


def test_aggregate_pairs_runs_and_summary_marks_invalid_runs():
    runs = []
    pairs = [(1.0, 0.7), (1.1, 0.8), (0.9, 0.7), (1.0, 0.75), (1.05, 0.72), (0.95, 0.7)]
    for r, (b, d) in enumerate(pairs):
        runs += [_run("baseline", r, b), _run("dlcp", r, d, valid=r != 2)]
    results = as_testbed_results(runs)
    agg = aggregate(results)
    sp = agg["dlcp"]["speedup"]
    # run 3 of dlcp was invalid: the speedup pairs the five valid runs only
    ratios = sorted(b / d for r, (b, d) in enumerate(pairs) if r != 2)
    assert sp.n == 5 and math.isclose(sp.median, ratios[2])
    assert agg["dlcp"]["valid_runs"] == 5 and agg["dlcp"]["runs"] == 6 and agg["baseline"]["valid_runs"] == 6
    assert agg["dlcp"]["basis"] == "valid runs"
    assert math.isclose(agg["baseline"]["sync_over_bound"].median, 5.0)  # sync 0.5 s / bound 0.1 s
    assert math.isclose(agg["baseline"]["comm_over_bound"].median, 3.0)  # calibration 0.3 s / bound 0.1 s
    text = summary(results)
    assert "INVALID dlcp r3: machine saturated" in text
    assert "dlcp: faster than baseline" in text
    assert text.splitlines()[2].startswith("baseline") and "INVALID" not in text.splitlines()[2]


def test_breakdown_parts_add_up_and_stragglers_come_from_the_slowest_worker():
    from dlcp.hostagent.messages import MessageStats
    from dlcp.topologies.breakdown import add_stragglers, iteration_breakdown

    def msg(first, rec, fin):
        return MessageStats(0, 1, "recv", 10, 1, 40, 0.0, first_arrival=first, recovery_started=rec, finished_at=fin,
                            started=0.0)

    parts = iteration_breakdown(0.0, 0.5, 1.0, [msg(0.2, None, 0.4), msg(0.6, 0.8, 0.95), msg(0.55, None, 0.7)])
    assert parts["compute"] == 0.5 and math.isclose(parts["first_byte"], 0.05)  # the 0.4 one finished before
    assert math.isclose(parts["recovery"], 0.15) and math.isclose(parts["transmission"], 0.3)
    assert math.isclose(sum(parts.values()), 1.0)
    assert iteration_breakdown(0.0, 0.5, 1.0, []) == {"compute": 0.5, "first_byte": 0.5, "transmission": 0.0,
                                                       "recovery": 0.0}
    recs: list[dict[str, Any]] = [{"iteration": 1, "t_end": 2.0, "breakdown": {}},
                                  {"iteration": 1, "t_end": 2.3, "breakdown": {}}]
    add_stragglers(recs)
    assert math.isclose(recs[0]["breakdown"]["straggler"], 0.3) and recs[1]["breakdown"]["straggler"] == 0.0


def _training_run(scheme: str, repeat: int, iter_s: float, accs: list[float]) -> dict:
    """Two workers, 10 measured iterations of ``iter_s``, evaluated every 2 iterations with
    accuracies ``accs`` (worker 1 a point below worker 0, so the trace must average)."""
    s = _run(scheme, repeat, iter_s)
    its = [{"kind": "measured", "iteration": i, "rank": r, "sync_time": iter_s / 2, "iteration_time": iter_s,
            "compute_time": 0.5, "comm_span": iter_s / 2, "lost_fraction": 0.0, "retransmissions": 0,
            "messages": 1, "control_frames": 2} for i in range(1, 11) for r in range(2)]
    its += [{"kind": "eval", "iteration": 2 * k, "rank": r, "accuracy": a - 0.01 * r}
            for k, a in enumerate(accs) for r in range(2)]
    its += [{"kind": "final", "iteration": 11, "rank": r, "accuracy": accs[-1] - 0.01 * r} for r in range(2)]
    s["iterations"] = its
    s["metrics"] = scheme_metrics(s)
    return s


def test_accuracy_trace_and_time_to_accuracy():
    from dlcp.topologies.tta import accuracy_trace, default_target, time_to_accuracy

    s = _training_run("baseline", 0, 0.5, [0.1, 0.5, 0.7, 0.8, 0.85, 0.9])
    trace = accuracy_trace(s["iterations"])
    # evaluation after iteration 0 (warm-up, off the clock), 2, 4, ...; accuracy averaged
    assert [t for t, _ in trace] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert math.isclose(trace[2][1], 0.695)
    assert time_to_accuracy(trace, 0.79) == 3.0 and time_to_accuracy(trace, 0.95) is None
    target = default_target([0.9, 0.8, 0.85])
    assert target is not None and math.isclose(target, 0.845) and default_target([]) is None


def test_time_to_accuracy_is_paired_by_run_against_the_baselines_target():
    runs = []
    for r in range(5):
        runs.append(_training_run("baseline", r, 1.0, [0.1, 0.5, 0.7, 0.8, 0.85, 0.90 + 0.001 * (r % 3)]))
        # dlcp: iterations 40 % faster, accuracy a little lower but above the target
        runs.append(_training_run("dlcp", r, 0.6, [0.1, 0.5, 0.7, 0.8, 0.89, 0.897]))
    results: dict[str, Any] = as_testbed_results(runs)
    agg = aggregate(results)
    target = agg["baseline"]["tta_target"]
    assert math.isclose(target, 0.901 - 0.01 / 2 - 0.005)  # baseline's median final (mean of workers) - 0.5
    assert agg["baseline"]["tta_s"].median == 10.0 and agg["baseline"]["tta_reached"] == 5
    # its mean accuracy crosses 0.891 only at the last evaluation: 10 x 0.6 s
    assert math.isclose(agg["dlcp"]["tta_s"].median, 6.0) and agg["dlcp"]["tta_reached"] == 5
    assert math.isclose(agg["dlcp"]["tta_speedup"].median, 10.0 / 6.0)
    text = summary(results)
    assert "time to accuracy 0.8910 (baseline final - 0.5 points)" in text
    assert "reached in 5/5 run(s)" in text and "faster" in text.split("time to accuracy")[1]
    # a target nobody reaches is said so, not averaged away
    results["options"]["target_accuracy"] = 0.99
    assert "not reached" in summary(results)


def test_with_a_seed_per_repetition_each_repetition_is_timed_to_its_own_references_final():
    """Seeds move the final accuracy by points: a target common to all of them would be out of
    reach of the lesser seeds, so each repetition's target is the reference's final in it."""
    from dlcp.topologies.report import against, tta_targets

    runs = []
    for r in range(5):
        top = 0.86 + 0.02 * r  # seed r's final: 0.86 .. 0.94 (worker mean 0.005 below)
        for scheme, iter_s in (("baseline", 1.0), ("dlcp", 0.6)):
            s = _training_run(scheme, r, iter_s, [0.1, 0.5, 0.7, 0.8, top - 0.004, top])
            s["seed"] = r
            runs.append(s)
    results: dict[str, Any] = as_testbed_results(runs)
    targets = tta_targets(results)
    assert all(math.isclose(targets[r], 0.86 + 0.02 * r - 0.005 - 0.005) for r in range(5))
    agg = aggregate(results)
    assert agg["dlcp"]["tta_reached"] == 5 and agg["baseline"]["tta_reached"] == 5
    assert math.isclose(agg["dlcp"]["tta_speedup"].median, 1 / 0.6)
    assert math.isclose(agg["dlcp"]["tta_target"], 0.90 - 0.01)  # the median target, for the page
    assert "(baseline's final in the same repetition (seed) - 0.5 points; median given)" in summary(results)
    # re-paired against DLCP, the targets stay the run's own
    assert tta_targets(against(results, "dlcp")) == targets
    # the same runs without seeds (one seed for all): one target, the median, that 2 seeds miss
    for s in runs:
        del s["seed"]
    assert set(tta_targets(results).values()) == {0.90 - 0.01}
    assert aggregate(results)["baseline"]["tta_reached"] == 3


def test_the_hosts_tcp_counters_are_tabled_agents_apart_from_cross_traffic():
    from dlcp.topologies.results_table import host_tcp_table

    def run(scheme: str, agents: int, cross: int) -> dict:
        counters = {"h1": {"RetransSegs": agents, "TCPTimeouts": agents // 10},
                    "h2": {"RetransSegs": 0, "TCPTimeouts": 0}, "x5": {"RetransSegs": cross, "TCPTimeouts": 1}}
        return {"scheme": scheme, "repeat": 0, "tcp_counters": counters}

    results = as_testbed_results([run("baseline", 30, 5), run("baseline", 50, 7), run("baseline", 40, 9),
                               run("gloo", 200, 0), {"scheme": "old", "repeat": 0}])
    table = host_tcp_table(results)
    assert "| `baseline` | 40 | 4 | 7 | 1 |" in table and "| `gloo` | 200 | 20 | 0 | 1 |" in table
    assert "old" not in table and host_tcp_table(as_testbed_results([{"scheme": "old", "repeat": 0}])) == ""
    unread = run("dlcp", 10, 3)
    unread["tcp_counters"]["h2"] = None  # a host whose counters could not be read: no figure, not a zero
    assert "| `dlcp` | - | - | 3 | 1 |" in host_tcp_table(as_testbed_results([unread]))
    # runs that recorded ECN marks get a column for them (agents' hosts); older ones keep their table
    marked = run("gloo-ecn", 20, 0)
    for h, c in marked["tcp_counters"].items():
        c["TCPDeliveredCE"] = {"h1": 300, "h2": 12}.get(h, 0)
    table = host_tcp_table(as_testbed_results([marked, run("gloo", 200, 0)]))
    assert "CE-marked segments, agents' hosts |" in table and "| `gloo-ecn` | 20 | 2 | 0 | 1 | 312 |" in table
    assert "| `gloo` | 200 | 20 | 0 | 1 | 0 |" in table
    assert "congestion control" not in table  # runs that did not record it: no column


def test_the_hosts_congestion_control_is_tabled_where_runs_record_it():
    from dlcp.topologies.results_table import host_tcp_table

    counters = {"h1": {"RetransSegs": 4, "TCPTimeouts": 0}}
    runs = [{"scheme": "gloo", "repeat": 0, "tcp_counters": counters,
             "host_congestion_control": {"h1": "cubic", "x5": "cubic"}},
            {"scheme": "dlcp", "repeat": 0, "tcp_counters": counters}]
    table = host_tcp_table(as_testbed_results(runs))
    assert "| `gloo` | 4 | 0 | 0 | 0 | cubic |" in table and "| `dlcp` | 4 | 0 | 0 | 0 | - |" in table
    from dlcp.topologies.results_table import slim

    assert host_tcp_table(slim(as_testbed_results(runs))) == table  # a kept results file shows it too


def test_a_runs_summary_says_which_data_flows_shared_the_cross_traffics_links():
    from dlcp.topologies.report import path_sharing, port_bytes

    paths = {"cross udp": "l1:9 sp2:2 l2:4", "cross tcp": "l1:8 sp1:2 l2:4", "worker0>server q0": "l1:9 sp2:2 l2:3",
             "worker1>server q0": "l1:8 sp1:2 l2:3", "server>worker0 q0": "l2:8 sp1:1 l1:1"}
    assert path_sharing(paths) == ("UDP via l1:9 sp2:2 with 1/3 hashed data flows, "
                                   "TCP via l1:8 sp1:2 with 1/3 hashed data flows")
    assert path_sharing({"cross udp": "s1:1 s2:3"}) == "UDP via s1:1"  # no hashed data flows (sprayed)
    assert path_sharing({}) == ""
    # with the bytes each port forwarded: where the scheme's own flows went shows beside the cross flows'
    switches = {"l1": {"ports": [{"port": 8, "queue": 0, "forwarded_bytes": 300_000_000},
                                 {"port": 8, "queue": 7, "forwarded_bytes": 48_000_000},
                                 {"port": 9, "queue": 0, "forwarded_bytes": 61_000_000}]}}
    carried = port_bytes({"switches": switches})
    assert carried == {"l1:8": 348_000_000, "l1:9": 61_000_000} and port_bytes({"port_bytes": carried}) == carried
    assert path_sharing(paths, carried) == ("UDP via l1:9 sp2:2 with 1/3 hashed data flows (l1:9 forwarded 61 MB), "
                                            "TCP via l1:8 sp1:2 with 1/3 hashed data flows (l1:8 forwarded 348 MB)")


def test_iteration_tails_are_tabled_for_valid_runs_that_recorded_them():
    from dlcp.topologies.results_table import iteration_tail_table, slim

    def run(scheme: str, p50: float, mean: float, valid: bool = True) -> dict:
        return {"scheme": scheme, "repeat": 0, "validity": {"valid": valid},
                "metrics": {"iteration_p50_ms": p50, "iteration_mean_ms": mean, "iteration_p90_ms": 2 * p50,
                            "iteration_p99_ms": 3 * p50}}

    runs = [run("gloo-fp16", 160, 250), run("gloo-fp16", 120, 240), run("gloo-fp16", 140, 200),
            run("gloo-fp16", 100, 900, valid=False), run("dlcp:ring", 170, 175),
            {"scheme": "old", "repeat": 0, "metrics": {"iteration_p50_ms": 1.0}}]
    table = iteration_tail_table(as_testbed_results(runs))
    assert "| `gloo-fp16` | 3 | 140 | 240 | 280 | 420 | 1.56 |" in table  # the invalid run left out; per-run ratios
    assert "| `dlcp:ring` | 1 | 170 | 175 | 340 | 510 | 1.03 |" in table and "old" not in table
    assert iteration_tail_table(slim(as_testbed_results(runs))) == table  # a kept results file shows it too
    assert iteration_tail_table(as_testbed_results(runs[-1:])) == ""


def test_a_parameter_servers_resends_are_counted_from_its_endpoint_totals():
    """A PS server writes no per-iteration records, so the workers' ``retransmitted`` never saw
    its resends (3,300 of 3,318 in one run of 20261129-133954); its endpoint's totals do."""
    from dlcp.topologies.results_table import resend_table, slim

    def ps_run(repeat: int, server_resent: int, valid: bool = True) -> dict:
        s = _run("dlcp:ps", repeat, 0.5, valid=valid)
        s["pattern"] = "ps"
        s["endpoints"] = {str(r): {"data_pkts_sent": 1000, "retransmitted_pkts": 5} for r in range(2)}
        s["endpoints"]["2"] = {"data_pkts_sent": 2000, "retransmitted_pkts": server_resent}  # the server
        s["metrics"] = scheme_metrics(s)
        return s

    one = ps_run(0, 300)
    assert one["metrics"]["server_retransmitted"] == 300 and one["metrics"]["retransmitted"] == 10  # workers' own
    assert math.isclose(one["metrics"]["resent_share"], 310 / 4000)
    ring = _run("dlcp:ring", 0, 0.5)
    ring["pattern"] = "ring"
    ring["endpoints"] = {str(r): {"data_pkts_sent": 500, "retransmitted_pkts": 1} for r in range(2)}
    ring["metrics"] = scheme_metrics(ring)
    assert ring["metrics"]["server_retransmitted"] is None and math.isclose(ring["metrics"]["resent_share"], 2 / 1000)
    assert "server_retransmitted" not in _run("gloo", 0, 0.5)["metrics"]  # no endpoints, no figure
    lost = ps_run(0, 300)
    del lost["endpoints"]["2"]  # a server that wrote no totals: no figure, not a worker's taken for it
    assert scheme_metrics(lost)["server_retransmitted"] is None

    results = as_testbed_results([one, ps_run(1, 500), ps_run(2, 100), ps_run(3, 9000, valid=False), ring])
    table = resend_table(results)
    assert "| `dlcp:ps` | 3 | 10 | 300 | 7.75 % |" in table  # medians over the valid runs
    assert "| `dlcp:ring` | 1 | 10 | - (no server) | 0.20 % |" in table
    assert resend_table(slim(results)) == table  # a kept results file shows it too
    assert "dlcp:ps: its server resent 300 data packets" in summary(results)


def test_port_service_is_tabled_as_the_validity_rules_read_it():
    """The lowest reading comes from intervals backlogged throughout (a port filled in bursts has
    no rate to read from below: its loose reading counts idle moments), the highest from every
    backlogged interval; runs recorded before the strict reading keep the loose one at both ends."""
    from dlcp.topologies.report import service_range, service_text

    def run(*ports: dict) -> dict:
        return {"validity": {"bottlenecks": list(ports)}}

    bursty = {"ratio": 0.62, "full_ratio": 0.80, "full_slots": 40}  # too few slots backlogged throughout
    steady = {"ratio": 0.97, "full_ratio": 0.995, "full_slots": 900}
    assert service_text(service_range([run(bursty)])) == "≤0.62x"
    assert service_range([run(bursty), run(steady)]) == (0.97, 0.995)  # in order
    assert service_text(service_range([run(bursty, steady), run({"ratio": 1.01, "full_ratio": 1.02,
                                                                 "full_slots": 300})])) == "0.99-1.01x"
    assert service_text(service_range([run({"ratio": 0.85}, {"ratio": 1.0})])) == "0.85-1.00x"  # before the rule
    assert service_range([run({"ratio": None, "full_slots": 0})]) is None


def test_a_runs_machine_speed_is_printed_per_scheme_and_kept_in_the_slim_file():
    """Each scheme's run records how fast the machine ran before it (a fixed loop's ms); the page
    prints the median and range per scheme, and says nothing for runs that recorded none."""
    from dlcp.hostagent.provenance import cpu_probe_ms
    from dlcp.topologies.results_table import machine_speed_line, markdown, slim

    assert cpu_probe_ms(repeats=1) > 0
    runs = [_run("gloo", r, 0.6) for r in range(3)] + [_run("dlcp", r, 0.5) for r in range(3)]
    old = as_testbed_results([dict(s) for s in runs], reference="gloo")
    assert machine_speed_line(old) == "" and "Machine speed" not in markdown(old)
    for s, ms in zip(runs, (10.0, 15.0, 10.5, 10.2, 14.0, 10.4)):
        s["cpu_probe_ms"] = ms
    new = as_testbed_results(runs, reference="gloo")
    line = machine_speed_line(new)
    assert line.endswith("`gloo` 10.5 (10.0-15.0), `dlcp` 10.4 (10.2-14.0).")
    assert line in markdown(new) and machine_speed_line(slim(new)) == line
