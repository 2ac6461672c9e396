"""One results schema for testbed and simulator (:mod:`dlcp.topologies.results`): files of either
source, old or new, read as schema 2 with the metrics named alike; what is not a results file
is refused with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlcp.cli import main
from dlcp.topologies.results import (CORE_METRICS, SCHEMA, ResultsError, by_scheme, document, load, merge,
                                     repetitions, schemes, slim, upgrade)

DATA = Path(__file__).resolve().parents[2] / "docs" / "results" / "data"


def _testbed_v1() -> dict:
    """A testbed results file as written before schema 2: config, schemes, aggregate, old names."""
    metrics = {"sync_p50_ms": 10.0, "sync_p99_ms": 20.0, "iteration_p50_ms": 30.0, "sync_over_bound": 1.5,
               "retransmissions": 4, "switch_tail_drops": 2, "switch_selective_drops_by_class": {"1": 3},
               "lost_fraction_mean": 0.01, "ordering_efficiency": 0.5}
    return {"config": {"workers": 2, "target_accuracy": None}, "topology": "star", "reference": "gloo",
            "provenance": {"commit": "abc"}, "aggregate": {"dlcp": {"runs": 2}},
            "schemes": [{"scheme": s, "repeat": r, "metrics": dict(metrics), "validity": {"valid": True}}
                        for r in range(2) for s in ("gloo", "dlcp")]}


def _simulator_v1() -> dict:
    """A simulator results file as written before schema 2: runs by scheme, flat per-seed records."""
    def rec(p50: float) -> dict:
        return {"scheme": "x", "sync_p50_ms": p50, "sync_p99_ms": p50, "iteration_p50_ms": p50, "sync_over_bound": 1,
                "retransmitted": 0, "tail_drops": 0, "selective_drops": [0, 5, 0, 0, 0, 0, 0, 0],
                "missing_fraction": 0.0, "iterations_detail": [{"i": 1}], "ports": [{"p": 1}]}

    return {"options": {"seed": 7, "schemes": ["baseline", "dlcp"]}, "repeat": 2, "provenance": None,
            "summary": {"dlcp": {"seeds": 2}},
            "runs": {"baseline": [rec(2.0), rec(2.2)], "dlcp": [rec(1.0), rec(1.1)]}}


def test_a_testbed_file_of_schema_1_reads_with_the_shared_names():
    r = upgrade(_testbed_v1())
    assert (r["schema"], r["source"], r["reference"], r["topology"]) == (SCHEMA, "testbed", "gloo", "star")
    assert r["options"]["workers"] == 2 and r["summary"] == {"dlcp": {"runs": 2}}
    assert "config" not in r and "schemes" not in r and "aggregate" not in r
    m = r["runs"][1]["metrics"]
    assert set(CORE_METRICS) <= set(m) and m["retransmitted"] == 4 and m["selective_drops"] == {"1": 3}
    assert m["missing_fraction"] == 0.01 and "lost_fraction_mean" not in m and m["ordering_efficiency"] == 0.5
    assert schemes(r) == ["gloo", "dlcp"] and repetitions(r) == 2
    assert [x["repeat"] for x in by_scheme(r)["dlcp"]] == [0, 1]
    assert upgrade(r) is r  # schema 2 reads as it is


def test_a_simulator_file_of_schema_1_reads_as_one_list_of_runs_in_the_order_they_ran():
    r = upgrade(_simulator_v1())
    assert (r["source"], r["reference"], r["repeat"]) == ("simulator", "baseline", 2)
    assert [(x["scheme"], x["repeat"], x["seed"]) for x in r["runs"]] == [
        ("baseline", 0, 7), ("dlcp", 0, 7), ("baseline", 1, 8), ("dlcp", 1, 8)]
    first = r["runs"][0]
    assert first["metrics"]["selective_drops"] == {str(c): 5 if c == 1 else 0 for c in range(8)}
    assert "iterations_detail" not in first["metrics"] and first["ports"] == [{"p": 1}]
    assert all("ports" not in x and "iterations_detail" not in x for x in slim(r, keep=())["runs"])
    assert by_scheme(r)["dlcp"][1]["metrics"]["sync_p50_ms"] == 1.1


def test_every_kept_results_file_reads_in_schema_2_with_the_core_metrics():
    kept = [p for p in sorted(DATA.glob("*.json")) if "schemes" in (raw := json.loads(p.read_text()))
            or ("options" in raw and "runs" in raw)]
    assert kept, "no kept run results under docs/results/data"
    for path in kept:
        r = load(path)
        assert r["source"] in ("testbed", "simulator") and r["runs"], path.name
        for run in r["runs"]:
            if run.get("metrics"):
                assert set(CORE_METRICS) <= set(run["metrics"]), (path.name, run["scheme"])
                assert isinstance(run["metrics"]["selective_drops"], dict), path.name


@pytest.mark.parametrize("text, reason", [
    ("[1, 2]", "not a JSON object"),
    ('{"schema": 3, "source": "testbed", "runs": []}', "results schema 3; this version of dlcp reads 2 and 1"),
    ('{"schema": 2, "source": "lab", "runs": []}', "without a known source"),
    ('{"hello": 1}', "neither schemes nor runs"),
    ("{not json", "not JSON"),
])
def test_what_is_not_a_results_file_is_refused_with_its_reason(tmp_path, capsys, text, reason):
    path = tmp_path / "results.json"
    path.write_text(text)
    with pytest.raises(ResultsError, match=reason.split(";")[0]):
        load(path)
    if text.startswith("{") and "not json" not in text:
        assert main(["report", str(path)]) == 2
        assert reason in capsys.readouterr().err


def test_a_document_needs_a_known_source_and_runs_with_scheme_and_repeat():
    with pytest.raises(ValueError, match="unknown results source 'lab'"):
        document("lab", {}, [], provenance=None, reference="baseline")
    with pytest.raises(ValueError, match="needs a scheme and a repeat"):
        document("testbed", {}, [{"scheme": "dlcp"}], provenance=None, reference="baseline")


def _split(path: Path, cut: int) -> tuple[dict, dict]:
    """A kept run as two runs of the same experiment: repetitions below ``cut``, and the rest as
    ``dlcp run --first-repeat cut`` would have made them (another command, another commit)."""
    whole = load(path)
    early = {**whole, "runs": [r for r in whole["runs"] if r["repeat"] < cut],
             "options": {**whole["options"], "repeat": cut}}
    late = {**whole, "runs": [r for r in whole["runs"] if r["repeat"] >= cut],
            "options": {**whole["options"], "repeat": 5 - cut, "first_repeat": cut, "out": "/elsewhere"},
            "provenance": {"command": "dlcp run --first-repeat 3", "commit": "f00d", "started": "later"}}
    return early, late


def test_runs_of_one_experiment_merge_into_the_tables_one_run_would_have_given(tmp_path, capsys):
    path = DATA / "20261129-112318-leafspine.json"
    early, late = _split(path, 3)
    merged = merge([("early", early), ("late", late)])
    assert repetitions(merged) == 5 and (merged["options"]["repeat"], merged["options"]["first_repeat"]) == (5, 0)
    assert [r["repeat"] for r in merged["runs"]] == sorted(r["repeat"] for r in load(path)["runs"])
    assert merged["provenance"]["commit"] == "187bd2d; f00d" and merged["merged_from"] == ["early", "late"]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(early))
    b.write_text(json.dumps(late))
    assert main(["report", str(a), str(b), "--merge"]) == 0
    joined = capsys.readouterr().out
    assert main(["report", str(path)]) == 0
    alone = capsys.readouterr().out

    def table(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith(("|", "`"))]

    assert table(joined) == table(alone) and "3.27 [2.82, 4.02]x" in joined
    assert "f00d" in joined and "dlcp run --first-repeat 3" in joined
    assert "5 run(s) per scheme" in alone
    assert main(["report", str(b)]) == 0  # the later repetitions alone: 2 per scheme, ranges, no verdict
    assert "2 run(s) per scheme" in capsys.readouterr().out


def test_a_run_stopped_part_way_keeps_its_finished_repetitions_and_a_later_run_continues_it(tmp_path, capsys):
    """results.json is rewritten after each repetition: what a run stopped part-way finished reads
    as a run of those repetitions, saying so, and merges with the run that does the rest."""
    from dlcp.topologies.report import keep_partial

    whole = load(DATA / "20261129-112318-leafspine.json")
    early, late = _split(DATA / "20261129-112318-leafspine.json", 2)
    running = {**whole, "runs": [dict(r) for r in early["runs"]]}  # as the runner holds it: all 5 asked for
    keep_partial(tmp_path, running, 2, 5)
    written = load(tmp_path / "results.json")
    assert written["options"]["repeat"] == 2 and written["partial"] == {"repetitions": 2, "of": 5}
    assert not (tmp_path / "results.json.partial").exists()
    assert main(["report", str(tmp_path)]) == 0
    assert "2 run(s) per scheme (written after 2 of 5 repetitions" in capsys.readouterr().out
    b = tmp_path / "late.json"
    b.write_text(json.dumps(late))
    merged = merge([("early", written), ("late", late)])
    assert repetitions(merged) == 5 and "partial" not in merged
    assert main(["report", str(tmp_path), str(b), "--merge"]) == 0
    assert "5 run(s) per scheme" in capsys.readouterr().out


def test_runs_that_are_not_one_experiment_do_not_merge():
    early, late = _split(DATA / "20261129-112318-leafspine.json", 3)
    with pytest.raises(ResultsError, match="at least two"):
        merge([("early", early)])
    with pytest.raises(ResultsError, match=r"late: dlcp-fp16:ring's repetition 3 is in early too"):
        merge([("early", early), ("late", {**late, "runs": early["runs"][-1:] + late["runs"]})])
    other = {**late, "options": {**late["options"], "capacity_bps": 7_400_000}}
    with pytest.raises(ResultsError, match="option capacity_bps is 7400000, in early 5500000"):
        merge([("early", early), ("late", other)])
    with pytest.raises(ResultsError, match="joins testbed runs"):
        merge([("early", early), ("sim", {**late, "source": "simulator"})])
