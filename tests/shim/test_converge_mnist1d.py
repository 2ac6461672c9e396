"""MNIST-1D through DLCP for real: a tiny ``dlcp converge`` study on loopback, and resuming it."""

from __future__ import annotations

import importlib.util

import pytest

import dlcp_torch.workloads.mnist1d as m1d
from dlcp import cli
from dlcp.topologies.converge import read_rows

needs_mnist1d = pytest.mark.skipif(importlib.util.find_spec("mnist1d") is None,
                                   reason="needs mnist1d (pip install -e '.[mnist1d]')")


def test_missing_mnist1d_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(m1d.importlib.util, "find_spec", lambda name: None)
    check = m1d.WORKLOAD.prerequisite
    assert check is not None
    with pytest.raises(m1d.MissingDependency, match=r"pip install 'dlcp\[mnist1d\]'"):
        check()


@needs_mnist1d
def test_a_tiny_study_trains_writes_its_report_and_resumes(tmp_path, capsys):
    argv = ["converge", "--workers", "2", "--steps", "30", "--eval-every", "10", "--seeds", "1", "--bounds", "0.2",
            "--error-feedback", "on", "--patterns", "ps", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    (row,) = read_rows(tmp_path / "converge.csv")
    assert (row["bound"], row["loss"], row["error_feedback"], row["seed"]) == (0.2, 0.2, True, 0)
    assert 0 < row["lost_mean"] <= 0.2  # loss happened, within the bound
    assert [p[1] for p in row["trace"]] == [0, 10, 20, 30] and row["trace"][-1][2] == row["accuracy"]
    assert row["accuracy"] > 0.15  # 30 steps of 2 x 32 samples already beat chance (0.1)
    for name in ("converge.md", "accuracy-vs-bound.png", "accuracy-vs-time.png"):
        assert (tmp_path / name).exists()
    capsys.readouterr()
    assert cli.main(argv) == 0  # everything is in the CSV already: nothing runs again
    assert "1 of 1 runs already in" in capsys.readouterr().err
    assert len(read_rows(tmp_path / "converge.csv")) == 1
