"""``dlcp report`` on a simulator run's results.json: the table computed from the per-seed
results in the file (no simulator needed: the results are written here)."""

from __future__ import annotations

import json

import pytest

from dlcp.cli import main
from dlcp_sim.report import is_sim_results, markdown, slim
from dlcp_sim.scenario import SimOptions
from dlcp.topologies.results import document


def _run(scheme: str, repeat: int, p50: float, **kw) -> dict:
    metrics = {"sync_p50_ms": p50, "sync_p99_ms": 2 * p50, "sync_over_bound": p50 / 10,
               "tail_drops": kw.get("tail", 0), "selective_drops": {"3": kw.get("sel", 0)},
               "retransmitted": 5, "late": 1, "duplicates": 1, "missing_fraction": 0.01}
    return {"scheme": scheme, "repeat": repeat, "seed": 1 + repeat, "metrics": metrics,
            "iterations_detail": [{"x": 1}], "ports": [{"y": 2}]}


def _results() -> dict:
    sync = {"baseline": (20.0, 22.0, 24.0), "dlcp": (10.0, 11.0, 12.0), "tcp": (40.0, 44.0, 48.0)}
    runs = [_run(s, r, sync[s][r], tail=9 if s == "baseline" else 0, sel=7 if s == "dlcp" else 0)
            for r in range(3) for s in sync]
    return document("simulator", SimOptions(schemes=("baseline", "dlcp", "tcp")).to_dict(), runs,
                    provenance={"command": "dlcp sim --repeat 3", "commit": "abc1234", "started": "2026-11-26"},
                    reference="baseline", repeat=3)


def test_the_table_pairs_speedups_by_seed_against_the_chosen_scheme():
    text = markdown(_results(), "data/x.json")
    # 3 seeds: ranges, and no verdict (an interval needs 5)
    assert "`dlcp` | 3 | 11.0 (range 10.0..12.0)" in text
    assert "2.00 (range 2.00..2.00)x" in text  # baseline / dlcp, seed by seed
    assert "`dlcp` against `baseline` (sync p50): range only (3 paired runs; an interval needs 5): no verdict" in text
    assert "commit abc1234" in text and "`tcp` over DCTCP" in text
    against_tcp = markdown(_results(), against="tcp")
    assert "x tcp (p50)" in against_tcp and "4.00 (range 4.00..4.00)x" in against_tcp
    with pytest.raises(ValueError, match="no scheme 'gloo'"):
        markdown(_results(), against="gloo")


def test_slim_keeps_what_the_tables_need(tmp_path):
    small = slim(_results())
    assert is_sim_results(small) and not is_sim_results({"schemes": []})
    assert all("ports" not in r and "iterations_detail" not in r for r in small["runs"])
    assert markdown(small) == markdown(_results())


def test_dlcp_report_reads_simulator_results_and_writes_them_slim(tmp_path, capsys):
    run = tmp_path / "sim-run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps(_results()))
    assert main(["report", str(run), "--slim", str(tmp_path / "slim"), "--against", "tcp"]) == 0
    out = capsys.readouterr().out
    assert "**Simulated**" in out and "x tcp (p50)" in out
    assert json.loads((tmp_path / "slim" / "sim-run.json").read_text())["runs"][1].keys().isdisjoint({"ports"})
    assert main(["report", str(run), "--against", "gloo"]) == 2  # a usage error, named
    assert "--against: no scheme 'gloo'" in capsys.readouterr().err


def test_background_flows_get_their_own_table_with_ratios_to_the_baseline():
    est = {"median": 5.0, "ci_low": 4.0, "ci_high": 6.0, "n": 5}
    ratio = {"median": 1.17, "ci_low": 1.11, "ci_high": 1.17, "n": 5}
    results = _results()
    results["summary"] = {"baseline": {"fct_avg_ms": est, "fct_p99_ms": est, "small_fct_p99_ms": est,
                                       "background_flows": [400, 410, 420]},
                          "dlcp": {"fct_avg_ms": est, "fct_p99_ms": est, "small_fct_p99_ms": est,
                                   "fct_avg_ms_ratio": ratio, "background_flows": [400, 410, 420]}}
    text = markdown(results)
    assert "small-flow FCT p99 ms" in text and "| `dlcp` | 400, 410, 420 | 5.00 [4.00, 6.00]" in text
    assert "1.17 [1.11, 1.17]" in text
    assert "FCT avg ms" not in markdown(_results())  # no background traffic, no table
