"""Sweep plumbing without a testbed: option parsing per value, CSV rows, the figure."""

from __future__ import annotations

import csv

import pytest

from dlcp.hostagent.errors import DlcpUserError
from dlcp.topologies.runner import RunOptions
from dlcp.topologies.sweep import options_at, plot, rows_of, sweep_request
from dlcp.topologies.sweepkit import write_csv
from tests.unit.test_report import _run, as_testbed_results


def test_options_at_sets_the_field_and_zero_cross_rate_means_none():
    base = RunOptions()
    assert options_at(base, "buffer", "32").buffer == 32
    assert options_at(base, "pattern", "ring").pattern == "ring"
    assert options_at(base, "fusion", "off").fusion is False
    assert options_at(base, "ecn-backlog", "port").ecn_backlog == "port"
    zero = options_at(base, "cross-rate", "0")
    assert zero.cross_rate == 0 and zero.cross_traffic is False


@pytest.mark.parametrize("param,value", [("buffer", "lots"), ("workers", "9"), ("pattern", "tree"),
                                         ("cross-rate", "2"), ("fusion", "maybe"), ("ecn-backlog", "queue")])
def test_bad_values_are_refused_before_anything_runs(param, value):
    with pytest.raises(DlcpUserError):
        options_at(RunOptions(), param, value)


def test_rows_csv_and_figure(tmp_path):
    rows = []
    for value, d in (("0.25", 0.8), ("0.5", 0.7)):
        results = as_testbed_results([_run("baseline", r, 1.0 + 0.05 * r) for r in range(5)]
                                  + [_run("dlcp", r, d + 0.01 * r) for r in range(5)])
        rows += rows_of("cross-rate", value, results, tmp_path / value)
    assert [(r["value"], r["scheme"]) for r in rows] == [("0.25", "baseline"), ("0.25", "dlcp"), ("0.5", "baseline"),
                                                         ("0.5", "dlcp")]
    dlcp = rows[1]
    assert dlcp["speedup_ci_low"] <= dlcp["speedup"] <= dlcp["speedup_ci_high"] and dlcp["verdict"] == "faster"
    write_csv(tmp_path / "s.csv", rows)
    back = list(csv.DictReader(open(tmp_path / "s.csv")))
    assert len(back) == 4 and float(back[3]["speedup"]) == pytest.approx(rows[3]["speedup"])
    plot(tmp_path / "s.png", rows, "cross-rate", RunOptions(topology="leafspine"))
    assert (tmp_path / "s.png").stat().st_size > 5000


def test_a_sweep_is_named_one_way_or_the_other_on_testbed_and_simulator_alike():
    assert sweep_request("cross-rate", "0, 0.5", None) == ("cross-rate", ["0", "0.5"])
    assert sweep_request(None, None, "cross-rate=0,0.5") == ("cross-rate", ["0", "0.5"])
    assert sweep_request(None, None, "--leaves=1,4") == ("leaves", ["1", "4"])
    for bad, why in [(("x", "1", "x=1"), "not both"), ((None, None, None), "name what to vary"),
                     (("x", None, None), "name what to vary"), ((None, None, "x"), "PARAM=V1"),
                     ((None, None, "x=,"), "no value")]:
        with pytest.raises(DlcpUserError, match=why):
            sweep_request(*bad)


def test_a_sweep_that_stops_keeps_the_rows_of_the_values_it_ran(tmp_path):
    from dlcp.topologies.sweepkit import run_values

    def run_one(value: str) -> list[dict]:
        if value == "b":
            raise RuntimeError("switch died")
        return [{"value": value, "scheme": "dlcp", "speedup": 1.5}]

    with pytest.raises(RuntimeError, match="switch died"):
        run_values(tmp_path, ["a", "b"], run_one)
    with open(tmp_path / "sweep.csv") as f:
        assert [r["value"] for r in csv.DictReader(f)] == ["a"]


def test_dlcp_report_prints_a_sweeps_table_from_its_csv_as_the_sweep_wrote_it(tmp_path, capsys):
    """Testbed and simulator sweeps alike: the table on a results page comes from the kept CSV."""
    from dlcp.cli import main
    from dlcp_sim.sweep import markdown as sim_markdown
    from dlcp_sim.sweep import rows_of as sim_rows_of
    from dlcp.topologies.sweep import markdown
    from dlcp.topologies.sweepkit import read_csv

    rows = []
    for value, d in (("0", 0.8), ("0.5", 0.7)):
        results = as_testbed_results([_run("baseline", r, 1.0 + 0.05 * r) for r in range(5)]
                                  + [_run("dlcp", r, d + 0.01 * r) for r in range(5)])
        rows += rows_of("cross-rate", value, results, tmp_path / value)
    (tmp_path / "testbed").mkdir()
    write_csv(tmp_path / "testbed" / "sweep.csv", rows)
    est = {"median": 24.6, "ci_low": 24.0, "ci_high": 25.1}
    sim_rows = [r for v in ("ahead", "port") for r in sim_rows_of("ecn_backlog", v, {
        "baseline": {"seeds": 3, "sync_p50_ms": est}, "dlcp": {"seeds": 3, "sync_p50_ms": est, "speedup_p50": est}})]
    write_csv(tmp_path / "sim.csv", sim_rows)

    assert main(["report", str(tmp_path / "testbed"), str(tmp_path / "sim.csv")]) == 0
    out = capsys.readouterr().out
    assert markdown(read_csv(tmp_path / "testbed" / "sweep.csv"), "cross-rate") == markdown(rows, "cross-rate")
    assert markdown(rows, "cross-rate") in out and sim_markdown(sim_rows, "ecn_backlog") in out
    assert "| ahead | dlcp | 24.6 [24.0, 25.1] |" in out  # a choice stays text, numbers come back as numbers

    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    assert main(["report", str(tmp_path / "other.csv")]) == 2
    assert "neither a sweep's CSV nor a convergence study's" in capsys.readouterr().err


def test_a_reader_that_leaves_early_ends_dlcp_quietly(tmp_path):
    """``dlcp report ... | head``: no 'unexpected error' when the pipe closes (the output here is
    far larger than a pipe holds, so dlcp is still writing when head leaves)."""
    import subprocess
    import sys

    write_csv(tmp_path / "sweep.csv", [{"param": "cross-rate", "value": "0", "scheme": "dlcp", "runs": 3,
                                        "valid_runs": 3, "verdict": ""}])
    dlcp = subprocess.Popen([sys.executable, "-m", "dlcp", "report", *[str(tmp_path / "sweep.csv")] * 2000],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = subprocess.Popen(["head", "-1"], stdin=dlcp.stdout, stdout=subprocess.PIPE)
    assert dlcp.stdout is not None
    dlcp.stdout.close()  # head alone reads it now
    first, _ = head.communicate(timeout=120)
    _, err = dlcp.communicate(timeout=120)
    assert first.count(b"\n") == 1 and err == b"" and dlcp.returncode == 141, err
