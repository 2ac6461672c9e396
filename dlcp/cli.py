"""``dlcp``: the whole command line, gathered from the layers that own its sub-commands.

The host-side commands (demo, policy, wire) come from :mod:`dlcp.hostagent.cli`, the testbed's (run,
sweep, calibrate, converge, clean) from :mod:`dlcp.topologies.commands`, ``sim`` from
:mod:`dlcp_sim.cli` and ``report``, which reads what all of them write, from :mod:`dlcp.report`.
This module sits at the top of the package graph, so it adds the global options and the dispatch
and nothing else: a command's options stay with the code they drive.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dlcp.report import add_report_command
from dlcp_sim.cli import add_sim_command
from dlcp.hostagent.cli import add_host_commands
from dlcp.hostagent.clikit import GlobalOption, finish_parser, run_cli
from dlcp.topologies.commands import add_clean_command, add_experiment_commands

#: Accepted before or after the sub-command (``dlcp --debug run`` and ``dlcp run --debug``).
GLOBAL_OPTIONS: list[GlobalOption] = [
    (("--debug",), {"action": "store_true", "help": "show tracebacks and debug logs"}),
]


def build_parser() -> argparse.ArgumentParser:
    """Every sub-command, in the order ``--help`` lists them: host, testbed, simulator, report, clean."""
    parser = argparse.ArgumentParser(
        prog="dlcp", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="DLCP: demo, policy, wire format, and experiments on a Mininet testbed of BMv2 switches.",
        epilog="Training through DLCP needs no command: init_process_group(\"dlcp\") in an unchanged PyTorch "
               "script\n(options DLCP_LOSS_BOUND, DLCP_MTU, DLCP_LINE_RATE; failure behaviour and limits: "
               "docs/backend.md).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_host_commands(sub)
    add_experiment_commands(sub)
    add_sim_command(sub)
    add_report_command(sub)
    add_clean_command(sub)
    return finish_parser(parser, GLOBAL_OPTIONS)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run its command; exceptions become exit codes in :func:`run_cli`."""
    return run_cli(build_parser(), argv, "dlcp")


if __name__ == "__main__":
    sys.exit(main())
