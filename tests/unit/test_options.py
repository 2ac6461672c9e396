"""The testbed and the simulator speak one option vocabulary (dlcp.topologies.options): the same
fields, ranges, choices, flags and messages for what both take. Nothing here runs anything."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from dlcp import cli
from dlcp_sim.scenario import RANGES as SIM_RANGES
from dlcp_sim.scenario import SimOptions
from dlcp.hostagent.errors import UsageError
from dlcp.topologies.options import COMMON_RANGES, SYNTHETIC_WORKLOADS, WORKLOADS, check_options, option_name
from dlcp.topologies.runner import RANGES as RUN_RANGES
from dlcp.topologies.runner import RunOptions

SHARED = [name for name in COMMON_RANGES if name != "repeat"]  # repeat: a field of the testbed, seeds in the sim


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _actions(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: a for a in p._actions for flag in a.option_strings}


@pytest.mark.parametrize("name", SHARED)
def test_a_shared_option_is_one_field_with_one_range(name):
    assert name in {f.name for f in dataclasses.fields(RunOptions)}
    assert name in {f.name for f in dataclasses.fields(SimOptions)}
    assert RUN_RANGES[name] is COMMON_RANGES[name] and SIM_RANGES[name] is COMMON_RANGES[name]


@pytest.mark.parametrize("name, bad", [("buffer", 2), ("scale", 0.0), ("iterations", 0), ("loss_bound", 0.7),
                                       ("mtu", 100), ("compute_ms", -1.0), ("pattern", "tree"),
                                       ("ecn_backlog", "queue")])
def test_both_refuse_a_bad_shared_value_with_the_same_message(name, bad):
    with pytest.raises(UsageError) as on_testbed:
        RunOptions(**{name: bad}).validate()
    with pytest.raises(UsageError) as in_sim:
        SimOptions(**{name: bad})
    assert str(on_testbed.value) == str(in_sim.value)
    assert option_name(name) in str(in_sim.value)


def test_each_names_the_workloads_it_has():
    """The simulator sends synthetic gradients only; the testbed also trains real models."""
    with pytest.raises(UsageError) as in_sim:
        SimOptions(workload="digits")
    assert str(in_sim.value) == f"--workload 'digits': choose one of {list(SYNTHETIC_WORKLOADS)}"
    with pytest.raises(UsageError) as on_testbed:
        RunOptions(workload="alexnet").validate()
    assert str(on_testbed.value) == f"--workload 'alexnet': choose one of {list(WORKLOADS)}"
    assert set(SYNTHETIC_WORKLOADS) < set(WORKLOADS)


@pytest.mark.parametrize("flag", ["--workload", "--model", "--pattern", "--iterations", "--scale", "--compute-ms",
                                  "--buffer", "--loss-bound", "--ecn-backlog", "--repeat", "--sweep", "--param",
                                  "--values", "--scheme", "--out"])
def test_run_sweep_and_sim_take_the_same_flags(flag):
    for command in ("sweep", "sim"):
        assert flag in _actions(_subparser(command)), (command, flag)
    assert flag in _actions(_subparser("run")) or flag in ("--sweep", "--param", "--values")


def test_the_parsers_defaults_are_the_dataclasses():
    run, sim = _actions(_subparser("run")), _actions(_subparser("sim"))
    for flag, field in [("--workload", "workload"), ("--pattern", "pattern"), ("--iterations", "iterations"),
                        ("--scale", "scale"), ("--compute-ms", "compute_ms"), ("--buffer", "buffer")]:
        assert run[flag].default == getattr(RunOptions(), field), flag
        assert sim[flag].default == getattr(SimOptions(), field), flag
    assert sim["--workload"].choices == list(SYNTHETIC_WORKLOADS)
    assert run["--workload"].choices == list(WORKLOADS)
    # the testbed takes a policy file, so its bound and ECN rule default to the file's
    assert run["--loss-bound"].default is None and sim["--loss-bound"].default == SimOptions().loss_bound


def test_check_options_names_the_first_bad_field():
    @dataclasses.dataclass
    class Opts:
        capacity_pps: int = 5
        pattern: str = "ps"

    from dlcp.hostagent.ranges import Range

    with pytest.raises(UsageError, match=r"^--capacity: 5 is not >= 10$"):
        check_options(Opts(), {"capacity_pps": Range(10)}, {"pattern": ("ps", "ring")})
    check_options(Opts(capacity_pps=None), {"capacity_pps": Range(10)}, {})  # type: ignore[arg-type]
