"""dlcp sim --sweep: parsing, typed values, rows and table from a summary (pure), and one small
sweep end to end (needs ns-3)."""

from __future__ import annotations

import csv

import pytest

from dlcp_sim.scenario import SimOptions
from dlcp_sim.sweep import markdown, options_at, parse_sweep, rows_of, sweep
from dlcp.hostagent.errors import DlcpUserError


def test_a_sweep_names_an_option_and_its_values():
    assert parse_sweep("background_load=0.2, 0.5,0.8") == ("background_load", ["0.2", "0.5", "0.8"])
    assert parse_sweep("--hosts-per-leaf=2,4") == ("hosts_per_leaf", ["2", "4"])
    for bad in ("background_load", "background_load=", "nonsense=1,2", "seed=1,2"):
        with pytest.raises(DlcpUserError):
            parse_sweep(bad)


def test_values_take_the_options_type_and_are_validated():
    base = SimOptions()
    assert options_at(base, "leaves", "4").leaves == 4
    assert options_at(base, "background_load", "0.5").background_load == 0.5
    assert options_at(base, "pattern", "ring").pattern == "ring"
    for bad in ("many", "4.5"):
        with pytest.raises(DlcpUserError):
            options_at(base, "leaves", bad)
    with pytest.raises(DlcpUserError):
        options_at(base, "background_load", "1.5")  # SimOptions refuses it, by name


def test_rows_and_table_carry_medians_intervals_and_the_fct_ratio():
    est = lambda m, lo, hi: {"median": m, "ci_low": lo, "ci_high": hi, "n": 3}  # noqa: E731
    summary = {
        "baseline": {"seeds": 3, "sync_p50_ms": est(40.0, 38.0, 45.0), "sync_p99_ms": est(70.0, 60.0, 80.0),
                     "fct_avg_ms": est(4.0, 3.5, 4.5)},
        "dlcp": {"seeds": 3, "sync_p50_ms": est(25.0, 24.0, 27.0), "sync_p99_ms": est(30.0, 29.0, 35.0),
                 "speedup_p50": {**est(1.6, 1.4, 1.7), "verdict": "faster"}, "speedup_p99": est(2.3, 2.0, 2.5),
                 "fct_avg_ms": est(5.0, 4.6, 5.5), "fct_avg_ms_ratio": est(1.25, 1.1, 1.3)},
    }
    rows = rows_of("background_load", "0.5", summary)
    assert [r["scheme"] for r in rows] == ["baseline", "dlcp"]
    assert rows[1]["speedup_p50"] == 1.6 and rows[1]["speedup_p50_ci_low"] == 1.4
    assert rows[0]["speedup_p50"] is None and rows[1]["fct_avg_ratio"] == 1.25
    table = markdown(rows, "background_load")
    assert "| 0.5 | dlcp | 25.0 [24.0, 27.0] | 30.0 [29.0, 35.0] | 1.60 [1.40, 1.70] |" in table
    assert "FCT avg / baseline" in table and "1.25 [1.10, 1.30]" in table


@pytest.mark.ns3
def test_a_small_sweep_writes_its_csv_table_and_figure(tmp_path):
    base = SimOptions(scale=0.002, iterations=2, leaves=2, hosts_per_leaf=3)
    rows = sweep(base, "buffer", ["20", "100"], 1, tmp_path)
    assert {(r["value"], r["scheme"]) for r in rows} == {(v, s) for v in ("20", "100") for s in ("baseline", "dlcp")}
    with open(tmp_path / "sweep.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    assert (tmp_path / "buffer=20" / "results.json").exists()
    assert "| 100 | dlcp |" in (tmp_path / "sweep.md").read_text()


def test_a_sweep_over_a_choice_plots_one_slot_per_value(tmp_path):
    """Values that are not numbers (a pattern, a placement) still make a figure."""
    from dlcp_sim.sweep import plot

    est = {"median": 1.5, "ci_low": 1.2, "ci_high": 1.7, "n": 3}
    summary = {"baseline": {"seeds": 3, "sync_p50_ms": est, "sync_p99_ms": est},
               "dlcp": {"seeds": 3, "sync_p50_ms": est, "sync_p99_ms": est, "speedup_p50": est, "speedup_p99": est}}
    rows = rows_of("pattern", "ps", summary) + rows_of("pattern", "ring", summary)
    plot(tmp_path / "sweep.png", rows, "pattern", "title")
    assert (tmp_path / "sweep.png").stat().st_size > 5_000
