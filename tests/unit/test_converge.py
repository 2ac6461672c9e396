"""``dlcp converge`` without training: the grid, the CSV rows, the statistics, the report."""

from __future__ import annotations

import pytest
from scipy import stats as sps

from dlcp.cli import build_parser
from dlcp.hostagent.errors import DlcpUserError
from dlcp.topologies.converge import (Config, Grid, Settings, append_row, key_of, markdown_table, mean_ci, mean_trace,
                                      parse_floats, parse_switches, read_rows, row_of, rows_for, run_key, summarise,
                                      target_verdict, time_to_accuracy)
from dlcp.topologies.converge_run import max_jobs, report

SETTINGS = Settings(workload="mnist1d", workers=2, steps=100, eval_every=50)


def test_paired_grid_skips_error_feedback_where_nothing_is_lost():
    grid = Grid(seeds=(0,), bounds=(0.0, 0.1, 0.2), patterns=("ps",))
    assert grid.configs() == [Config("ps", 0.0, 0.0, False), Config("ps", 0.1, 0.1, False),
                              Config("ps", 0.1, 0.1, True), Config("ps", 0.2, 0.2, False),
                              Config("ps", 0.2, 0.2, True)]


def test_reliable_baselines_sit_before_the_bound_with_their_loss():
    grid = Grid(seeds=(0,), bounds=(0.0, 0.2), error_feedback=(False,), patterns=("ps",), reliable=True)
    assert grid.configs() == [Config("ps", 0.0, 0.0, False), Config("ps", 0.0, 0.2, False),
                              Config("ps", 0.2, 0.2, False)]
    with pytest.raises(DlcpUserError, match="--reliable"):
        Grid(losses=(0.1,), reliable=True)


def test_crossed_losses_and_seed_major_order():
    grid = Grid(seeds=(3, 4), bounds=(0.0, 0.1), losses=(0.0, 0.1), error_feedback=(False,), patterns=("ps", "ring"))
    configs = grid.configs()
    assert len(configs) == 2 * 2 * 2 and Config("ring", 0.0, 0.1, False) in configs
    assert Config("ps", 0.0, 0.1, False).label == "ps, p = 0, 10% loss (reliable)"
    runs = grid.runs()
    assert [s for _, s in runs] == [3] * 8 + [4] * 8  # every configuration of a seed before the next seed
    assert [c for c, _ in runs[:8]] == configs


@pytest.mark.parametrize("kw, words", [(dict(bounds=(0.1, 0.7)), "--bounds: 0.7 is outside 0..0.5"),
                                       (dict(losses=(1.5,)), "--losses: 1.5 is outside 0..1"),
                                       (dict(patterns=("tree",)), "tree"), (dict(seeds=()), "--seeds"),
                                       (dict(bounds=(0.1, 0.1)), "repeats"), (dict(seeds=(-1,)), ">= 0")])
def test_bad_grids_are_refused_with_the_reason(kw, words):
    with pytest.raises(DlcpUserError, match=words.replace("[", r"\[").replace(")", r"\)")):
        Grid(**kw)


def test_bad_settings_and_option_values():
    with pytest.raises(DlcpUserError, match="--eval-every"):
        Settings(steps=10, eval_every=20)
    with pytest.raises(DlcpUserError, match="'x'"):
        parse_floats("0,x", "--bounds")
    with pytest.raises(DlcpUserError, match="'yes'"):
        parse_switches("off,yes", "--error-feedback")
    assert parse_floats("0, 0.1", "--bounds") == (0.0, 0.1) and parse_switches("on", "-") == (True,)
    assert max_jobs(4, cpus=2) == 1 and max_jobs(4, cpus=16) == 4


def test_mean_ci_is_the_student_t_interval():
    ci = mean_ci([0.90, 0.91, 0.92, 0.905, 0.915])
    half = sps.t.ppf(0.975, 4) * sps.tstd([0.90, 0.91, 0.92, 0.905, 0.915]) / 5 ** 0.5
    assert ci.low is not None and ci.high is not None
    assert ci.mean == pytest.approx(0.91) and ci.high - ci.mean == pytest.approx(half)
    assert ci.text() == f"91.00 [{100 * ci.low:.2f}, {100 * ci.high:.2f}]"
    assert mean_ci([0.5]).low is None and mean_ci([]).text() == "-"
    assert mean_ci([-0.001, 0.002]).text(sign=True).startswith("+0.05")


def test_time_to_accuracy_and_verdicts():
    trace = [(0.0, 0, 0.1), (2.0, 50, 0.8), (4.0, 100, 0.9)]
    assert time_to_accuracy(trace, 0.8) == 2.0 and time_to_accuracy(trace, 0.95) is None
    assert target_verdict(mean_ci([-0.001, -0.002, 0.0])) == "yes"
    assert target_verdict(mean_ci([-0.004, -0.012, 0.004])) == "mean only"
    assert target_verdict(mean_ci([-0.01, -0.012, -0.008])) == "no"
    assert mean_trace([trace, [(0.0, 0, 0.3), (4.0, 50, 0.6)]]) == [(0.0, 0, 0.2), (3.0, 50, 0.7)]


def _results(acc: float, lost: float = 0.0) -> list[dict]:
    trace = [[0.0, 0, 0.1], [1.0, 50, acc - 0.02], [2.0, 100, acc]]
    return [{"rank": r, "accuracy": acc, "wall": 3.0, "train_s": 2.0, "sync_ms_p50": 1.0, "sync_ms_p99": 2.0,
             "lost_mean": lost, **({"trace": trace} if r == 0 else {})} for r in range(2)]


def _study(tmp_path, reliable: bool = False):
    """A written CSV: lossless at 90 % +- seed, bounded 0.2 points lower, EF 1 point lower."""
    grid = Grid(seeds=(0, 1, 2), bounds=(0.0, 0.2), patterns=("ps",), reliable=reliable)
    path = tmp_path / "converge.csv"
    for c, s in grid.runs():
        acc = 0.90 + 0.01 * s - (0.002 if c.bound and not c.error_feedback else 0.01 if c.error_feedback else 0)
        append_row(path, row_of(SETTINGS, c, s, _results(acc, lost=c.loss * 0.75)))
    return grid, path


def test_rows_round_trip_through_the_csv_and_identify_their_run(tmp_path):
    grid, path = _study(tmp_path)
    rows = read_rows(path)
    assert len(rows) == 9 and rows[1]["bound"] == 0.2 and rows[2]["error_feedback"] is True
    assert rows[0]["trace"][2] == [2.0, 100, 0.9] and rows[0]["accuracy_spread"] == 0.0
    assert run_key(rows[4]) == key_of(SETTINGS, Config("ps", 0.2, 0.2, False), 1)
    # rows of other settings or duplicates do not count
    other = Settings(workload="mnist1d", workers=2, steps=200, eval_every=50)
    append_row(path, row_of(other, Config("ps", 0.0, 0.0, False), 0, _results(0.5)))
    append_row(path, row_of(SETTINGS, Config("ps", 0.0, 0.0, False), 0, _results(0.5)))
    assert len(rows_for(read_rows(path), SETTINGS, grid)) == 9


def test_summary_pairs_seeds_against_lossless(tmp_path):
    grid, path = _study(tmp_path)
    lossless, bounded, ef = summarise(read_rows(path), SETTINGS, grid)
    assert lossless.config.lossless and lossless.accuracy.mean == pytest.approx(0.91)
    assert bounded.delta.mean == pytest.approx(-0.002) and bounded.delta.low == pytest.approx(-0.002)  # paired
    assert target_verdict(bounded.delta) == "yes" and target_verdict(ef.delta) == "no"
    assert bounded.lost == pytest.approx(0.15)
    assert lossless.target == pytest.approx(0.905)
    # target 0.905: seed 0 (90 %) never gets there; seeds 1 and 2 at their last evaluation
    assert lossless.times_to_target == (None, 2.0, 2.0) and lossless.median_time_to_target == 2.0
    table = markdown_table([lossless, bounded, ef])
    assert "| ps, p = 0.2, 20% loss | 3 | 90.80 [" in table and "| -0.20 [-0.20, -0.20] | yes |" in table


@pytest.mark.parametrize("reliable", [False, True])
def test_report_writes_table_and_plots(tmp_path, reliable):
    grid, _ = _study(tmp_path, reliable)
    report(tmp_path, SETTINGS, grid)
    table = (tmp_path / "converge.md").read_text()
    assert "ps, lossless" in table and ("(reliable)" in table) == reliable
    for name in ("accuracy-vs-bound.png", "accuracy-vs-time.png"):
        assert (tmp_path / name).stat().st_size > 5000


def test_a_csv_of_something_else_is_refused(tmp_path):
    (tmp_path / "converge.csv").write_text("a,b\n1,2\n")
    with pytest.raises(DlcpUserError, match="not a converge CSV"):
        read_rows(tmp_path / "converge.csv")


def test_converge_is_a_dlcp_command():
    args = build_parser().parse_args(["converge", "--seeds", "2", "--patterns", "ps"])
    assert args.func.__name__ == "cmd_converge" and args.seeds == 2 and args.losses == "same"


@pytest.mark.parametrize("reliable", [False, True])
def test_dlcp_report_prints_a_kept_converge_csv_as_the_study_wrote_it(tmp_path, reliable, capsys):
    """No command line says what the grid was: the report finds it in the rows, in grid order."""
    from dlcp.cli import main

    grid, _ = _study(tmp_path, reliable)
    report(tmp_path, SETTINGS, grid)
    assert main(["report", str(tmp_path / "converge.csv")]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "converge.md").read_text() in out
    assert "**Study**: mnist1d, 2 workers, 100 steps (ddp)" in out
    assert main(["report", str(tmp_path)]) == 0  # the study's directory names its CSV
    assert (tmp_path / "converge.md").read_text() in capsys.readouterr().out


def test_a_crossed_grids_csv_reports_in_its_grids_order(tmp_path, capsys):
    """With crossed losses p = 0 under loss is an ordinary bound-0 row (not a reliable baseline
    moved beside its bound), and patterns keep the grid's order."""
    from dlcp.cli import main

    grid = Grid(seeds=(0, 1), bounds=(0.0, 0.05, 0.1), losses=(0.0, 0.1), error_feedback=(False,),
                patterns=("ring", "ps"))
    for c, s in grid.runs():
        append_row(tmp_path / "converge.csv", row_of(SETTINGS, c, s, _results(0.9 - c.loss / 10 + 0.01 * s)))
    report(tmp_path, SETTINGS, grid)
    assert main(["report", str(tmp_path / "converge.csv")]) == 0
    assert (tmp_path / "converge.md").read_text() in capsys.readouterr().out
