"""The command-line tools: real output, and one-line errors with the right exit codes."""

import json
import subprocess
import sys

import pytest

from dlcp.controller import cli as ctl
from dlcp import cli
from dlcp.hostagent import wire
from dlcp.topologies.commands import run_options


def test_wire_json_lists_every_field(capsys):
    assert cli.main(["wire", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [f["name"] for f in out["fields"]] == [f.name for f in wire.FIELDS]
    assert out["header_bytes"] == wire.HEADER_SIZE


def test_policy_check_reports_the_bad_field(tmp_path, capsys):
    bad = tmp_path / "p.yaml"
    bad.write_text("drop_thresholds: [10, 20, 5]\n")
    assert cli.main(["policy", "check", str(bad)]) == 2  # a usage error: the file is the user's input
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "drop_thresholds" in err and "Traceback" not in err


def test_policy_show_round_trips_through_json(tmp_path, capsys):
    good = tmp_path / "p.json"
    good.write_text(json.dumps({"loss_bound_push": 0.1, "lb_mode": "random"}))
    assert cli.main(["policy", "show", str(good), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["loss_bound_push"] == 0.1 and shown["lb_mode"] == "random"


def test_dlcpctl_policy_view(capsys):
    assert ctl.main(["policy", "show", "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["drop_thresholds"] == {"1": 48, "2": 32, "3": 16}


def test_usage_error_exit_code():
    assert cli.main([]) == 2
    with pytest.raises(SystemExit) as exc:
        cli.main(["no-such-command"])
    assert exc.value.code == 2


def test_demo_runs_and_selective_drop_spares_class_0():
    out = subprocess.run([sys.executable, "-m", "dlcp", "demo"], capture_output=True, text=True, check=True).stdout
    dlcp_row = next(line for line in out.splitlines() if line.startswith("DLCP selective drop"))
    per_class = dlcp_row.split()[-1].split("/")
    assert per_class[0] == "0"  # class 0 is never dropped selectively
    assert "gradient error" in out


def test_a_testbed_agent_for_synthetic_gradients_does_not_load_torch():
    """Nine agents start per scheme on two cores: importing torch (about 2.5 s of CPU each) only
    where real training needs it keeps the start of every run short."""
    code = "import sys, dlcp.topologies.agent, dlcp_torch.state; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_run_passes_the_ecn_rule_to_every_schemes_policy():
    from dlcp.topologies.runner import scheme_policy

    args = cli.build_parser().parse_args(["run", "--ecn-backlog", "port", "--scheme", "baseline,dlcp"])
    opts = run_options(args)
    assert {scheme_policy(s, opts).ecn_backlog for s in opts.schemes} == {"port"}
    default = run_options(cli.build_parser().parse_args(["run"]))
    assert scheme_policy("dlcp", default).ecn_backlog == "ahead"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["run", "--ecn-backlog", "queue"])
