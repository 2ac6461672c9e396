"""bench/backend.py's rows: what a run measures by default and what ``--cases`` adds."""

from __future__ import annotations

import argparse

from bench.backend import CASES, EXTRA_CASES, _cases, _label


def _args(cases: list[str] | None, world: list[int] = [4]) -> argparse.Namespace:  # noqa: B006
    return argparse.Namespace(small=False, world=world, cases=cases)


def test_the_default_rows_leave_the_back_to_back_row_out():
    got = _cases(_args(None, [4, 2]))
    assert got == [(c, d, w) for w in (4, 2) for c, d in CASES]
    assert not any(c == "all_reduce x5" for c, _, _ in got)


def test_naming_a_row_runs_it_and_only_it():
    assert _cases(_args(["all_reduce x5:float32"])) == [("all_reduce x5", "float32", 4)]
    assert _cases(_args(["all_reduce:float32", "all_reduce x5:float32"])) == [
        ("all_reduce", "float32", 4), ("all_reduce x5", "float32", 4)]
    assert ("all_reduce x5", "float32") in EXTRA_CASES


def test_rows_are_labelled_for_the_table():
    assert _label("all_reduce x5") == "all_reduce x5"
    assert _label("all_reduce") == "all_reduce"
    assert _label("all_reduce:65536") == "all_reduce 64 KB"
    assert _label("12M") == "DDP step 12M"
