"""Options are checked where they are typed: bad numbers fail at parse time with exit code 2 and
a message naming the option and its range; --help shows defaults; global flags go anywhere;
--policy and --loss-bound reach the run. Nothing here starts a switch, Mininet or ns-3."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from dlcp.controller import cli as ctl
from dlcp import cli
from dlcp.hostagent import clikit
from dlcp.hostagent.clikit import DefaultsHelpFormatter, package_version
from dlcp.hostagent.ranges import Range
from dlcp.topologies.commands import run_options
from dlcp.topologies.progress import Progress, eta
from dlcp.topologies.runner import agent_spec, flow_port_base, run_order, scheme_policy


def _usage_error(main, argv: list[str], capsys) -> str:
    """Run ``main(argv)``, expect exit code 2 (argparse's or a command's), return stderr."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("argv, words", [
    (["converge", "--bounds", "0.7"], "--bounds: 0.7 is outside 0..0.5"),
    (["converge", "--losses", "0.1,1.5"], "--losses: 1.5 is outside 0..1"),
    (["converge", "--workers", "0"], "--workers: 0 is outside 1..16"),
    (["run", "--buffer", "-1"], "--buffer: -1 is outside 4.."),
    (["run", "--capacity", "0"], "--capacity: 0 is not >= 10"),
    (["run", "--capacity", "lots"], "--capacity: 'lots' is not an integer"),
    (["run", "--workers", "9"], "--workers: 9 is outside 2..7"),
    (["run", "--loss-bound", "0.6"], "--loss-bound: 0.6 is outside 0..0.5"),
    (["run", "--scale", "0"], "--scale: 0 is not > 0"),
    (["sweep", "--param", "buffer", "--values", "8", "--cross-rate", "2"], "--cross-rate: 2 is outside 0..1"),
    (["calibrate", "--timeout", "-1"], "--timeout: -1 is not > 0"),
    (["demo", "--capacity", "-5"], "--capacity: -5 is not >= 1"),
    (["demo", "--capacity", "0"], "--capacity: 0 is not >= 1"),
    (["demo", "--load", "0"], "--load: 0 is not > 0"),
    (["sim", "--loss-bound", "0.7"], "--loss-bound: 0.7 is outside 0..0.5"),
    (["sim", "--leaves", "300"], "--leaves: 300 is outside 1..250"),
    (["sim", "--mtu", "100"], "--mtu: 100 is outside 576..9216"),
])
def test_dlcp_refuses_bad_numbers_at_parse_time(argv, words, capsys):
    err = _usage_error(cli.main, argv, capsys)
    assert words in err, err


@pytest.mark.parametrize("argv, words", [
    (["queue-rate", "net.yaml", "s1", "600", "10"], "port: 600 is outside 0..510"),
    (["queue-rate", "net.yaml", "s1", "2", "0"], "capacity '0': give packets per second"),
    (["queue-rate", "net.yaml", "s1", "2", "10", "8"], "PRIORITY: 8 is outside 0..7"),
    (["apply", "net.yaml", "--timeout", "0"], "--timeout: 0 is not > 0"),
    (["--timeout", "nan", "apply", "net.yaml"], "--timeout: nan is not > 0"),
])
def test_dlcpctl_refuses_bad_numbers_at_parse_time(argv, words, capsys):
    err = _usage_error(ctl.main, argv, capsys)
    assert words in err, err


def test_a_bad_sweep_value_fails_before_anything_starts(tmp_path, capsys):
    out = tmp_path / "runs"
    err = _usage_error(cli.main, ["sweep", "--param", "loss-bound", "--values", "0.1,2", "--out", str(out)], capsys)
    assert "--values: loss-bound 2 is outside 0..0.5" in err and err.count("\n") == 1
    assert not out.exists()  # no sweep directory left behind


def test_a_bad_policy_file_fails_at_parse_time(tmp_path, capsys):
    bad = tmp_path / "p.yaml"
    bad.write_text("loss_bound_push: 0.7\n")
    err = _usage_error(cli.main, ["run", "--policy", str(bad)], capsys)
    assert "--policy" in err and "loss_bound_push" in err


def test_user_error_in_a_subprocess_is_one_line_with_exit_2():
    """What a user at a terminal sees: the issue's 18-line traceback is now one usage line."""
    out = subprocess.run([sys.executable, "-m", "dlcp", "demo", "--capacity", "-5"],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == "dlcp demo: error: argument --capacity: -5 is not >= 1"


def test_an_unexpected_error_prints_one_line_and_logs_the_traceback(capsys):
    def boom(args: argparse.Namespace) -> int:
        raise RuntimeError("a bug")

    parser = argparse.ArgumentParser(prog="x")
    parser.add_argument("--debug", action="store_true")
    parser.set_defaults(func=boom)
    assert clikit.run_cli(parser, [], "x") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RuntimeError('a bug')" in err and "Traceback" not in err


def _every_parser(parser: argparse.ArgumentParser):
    yield "", parser
    for sub in clikit._subparsers(parser):
        yield sub.prog, sub


@pytest.mark.parametrize("build", [cli.build_parser, ctl.build_parser], ids=["dlcp", "dlcpctl"])
def test_every_help_shows_every_default(build):
    """Each option with a default names it in its help line (its value, or what it means)."""
    missing = []
    for prog, parser in _every_parser(build()):
        assert parser.formatter_class is DefaultsHelpFormatter
        formatter = DefaultsHelpFormatter(prog)
        parser.format_help()  # formats without error (a stray % would raise)
        for action in parser._actions:
            shown = action.default not in (None, argparse.SUPPRESS) and action.default is not False
            if action.option_strings and shown and action.help != argparse.SUPPRESS:
                text = formatter._get_help_string(action) or ""
                if "default" not in text.lower():
                    missing.append(f"{prog} {action.option_strings[0]}")
    assert missing == []


def test_run_help_shows_runoptions_defaults():
    commands = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = commands.choices["run"].format_help()
    assert "(default: 64)" in text and "(default: 0.002)" in text and "(default: star)" in text


@pytest.mark.parametrize("argv", [["--debug", "wire"], ["wire", "--debug"], ["policy", "show", "--debug"]])
def test_dlcp_global_flags_before_or_after_the_command(argv):
    assert cli.build_parser().parse_args(argv).debug is True
    assert cli.build_parser().parse_args(["wire"]).debug is False


def test_dlcpctl_global_flags_before_or_after_the_command():
    p = ctl.build_parser
    assert p().parse_args(["--timeout", "2", "apply", "n.yaml"]).timeout == 2.0
    after = p().parse_args(["apply", "n.yaml", "--timeout", "3", "--debug"])
    assert after.timeout == 3.0 and after.debug is True
    assert p().parse_args(["apply", "n.yaml"]).timeout == 5.0


@pytest.mark.parametrize("main, name", [(cli.main, "dlcp"), (ctl.main, "dlcpctl")])
def test_version(main, name, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"{name} {package_version()}"
    assert package_version()[0].isdigit()


def _policy_file(tmp_path, **fields) -> str:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(fields))
    return str(path)


def _spec(argv: list[str], scheme: str) -> dict:
    opts = run_options(cli.build_parser().parse_args(argv))
    return agent_spec(opts, scheme_policy(scheme, opts), ["10.0.0.1", "10.0.0.2"])


def test_policy_file_reaches_the_agents_spec(tmp_path):
    f = _policy_file(tmp_path, loss_bound_push=0.2, lb_mode="random", drop_thresholds=[40, 30, 20],
                     ecn_threshold=12, ecn_backlog="port")
    dlcp = _spec(["run", "--policy", f], "dlcp")["policy"]
    assert (dlcp["loss_bound_push"], dlcp["lb_mode"], dlcp["drop_thresholds"], dlcp["ecn_threshold"],
            dlcp["ecn_backlog"]) == (0.2, "random", [40, 30, 20], 12, "port")
    # what a scheme leaves off falls back to the baseline's behaviour, whatever the file says
    base = _spec(["run", "--policy", f], "baseline")["policy"]
    assert (base["loss_bound_push"], base["lb_mode"], base["num_drop_classes"], base["drop_thresholds"],
            set(base["priority_map"])) == (0.0, "flow", 1, [], {0})


def test_loss_bound_overrides_the_files_and_the_default(tmp_path):
    f = _policy_file(tmp_path, loss_bound_push=0.2)
    assert _spec(["run", "--policy", f, "--loss-bound", "0.3"], "dlcp")["policy"]["loss_bound_push"] == 0.3
    assert _spec(["run", "--loss-bound", "0.1"], "bounded")["policy"]["loss_bound_push"] == 0.1
    assert _spec(["run"], "dlcp")["policy"]["loss_bound_push"] == 0.05
    # --ecn-backlog given wins over the file's; not given, the file's stands
    g = _policy_file(tmp_path, ecn_backlog="port")
    assert _spec(["run", "--policy", g, "--ecn-backlog", "ahead"], "dlcp")["policy"]["ecn_backlog"] == "ahead"


def test_sweep_keeps_the_policy_at_every_value(tmp_path):
    from dlcp.topologies.sweep import check_values

    f = _policy_file(tmp_path, lb_mode="random")
    args = cli.build_parser().parse_args(["sweep", "--param", "buffer", "--values", "16,32", "--policy", f,
                                          "--loss-bound", "0.1"])
    runs = check_values(run_options(args), args.param, ["16", "32"])
    assert [r.buffer for r in runs] == [16, 32]
    assert {(scheme_policy("dlcp", r).lb_mode, scheme_policy("dlcp", r).loss_bound_push) for r in runs} == {
        ("random", 0.1)}


def test_range_messages():
    assert Range(0.0, 0.5).problem(0.7) == "0.7 is outside 0..0.5"
    assert Range(1).problem(0) == "0 is not >= 1"
    assert Range(0, lo_open=True).problem(0.0) == "0 is not > 0"
    assert str(Range(0, 1, hi_open=True)) == "[0, 1)"
    assert Range(0, 1).problem(float("nan")) is not None and Range(0, 1).problem(True) is not None
    assert Range(0.0, 0.5).problem(0.5) is None


def test_eta_from_the_pace_so_far():
    assert eta(90.0, 1, 3) == ", about 3 min left"
    assert eta(20.0, 2, 3) == ", about 10 s left"
    assert eta(20.0, 3, 3) == "" and eta(0.0, 0, 3) == ""


def test_progress_prints_a_line_per_unit_with_its_time_and_what_is_left():
    import io

    now = [100.0]
    out = io.StringIO()
    p = Progress(3, out, clock=lambda: now[0])
    now[0] = 160.0
    assert p.step("dlcp seed 0") == "[1/3] dlcp seed 0 (60 s; 60 s in all, about 2 min left)"
    now[0] = 400.0
    p.step("baseline seed 0")
    assert out.getvalue().splitlines()[1] == "[2/3] baseline seed 0 (4.0 min; 5.0 min in all, about 2 min left)"
    assert Progress(1, None, clock=lambda: 0.0).step("quiet") == "[1/1] quiet (0 s; 0 s in all)"


def test_sigterm_stops_a_command_as_ctrl_c_does_and_the_handlers_are_restored():
    import os
    import signal

    def terminate_me(args: argparse.Namespace) -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        return 0

    parser = argparse.ArgumentParser()
    parser.set_defaults(func=terminate_me)
    before = signal.getsignal(signal.SIGTERM)
    assert clikit.run_cli(parser, [], "dlcp") == 143
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_broken_pipe_that_is_not_stdout_is_an_error_like_any_other(capsys):
    """Only a reader that left standard output ends a command quietly; a subprocess's or a
    socket's broken pipe is reported (exit 1, the traceback in the log)."""
    parser = argparse.ArgumentParser(prog="t")

    def fails(_: argparse.Namespace) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    parser.set_defaults(func=fails)
    assert clikit.run_cli(parser, [], "t") == 1
    assert "t: unexpected error: BrokenPipeError" in capsys.readouterr().err


def test_first_repeat_numbers_a_runs_repetitions_its_seeds_and_paths_from_n():
    args = ["run", "--workload", "mnist1d", "--scheme", "gloo,dlcp:ring", "--repeat", "2"]
    later = run_options(cli.build_parser().parse_args([*args, "--first-repeat", "5"]))
    assert run_order(later) == [(5, "gloo"), (5, "dlcp:ring"), (6, "gloo"), (6, "dlcp:ring")]
    assert run_order(run_options(cli.build_parser().parse_args(args)))[0] == (0, "gloo")
    one = run_options(cli.build_parser().parse_args(["run", "--scheme", "dlcp"]))
    assert later.numbered and not one.numbered  # a run numbered from 5 names its repetitions, even one
    spec = agent_spec(later, scheme_policy("dlcp", later), ["10.0.0.1", "10.0.0.2"], repeat=5)
    assert (spec["seed"], spec["source_port_base"]) == (5, flow_port_base(5))
