"""Apply a network file to its switches: the library call behind ``dlcpctl apply`` and the testbed.

Kept out of the CLI module so callers above the controller (the testbed runner) depend on a
library function, not on a command line.
"""

from __future__ import annotations

from collections.abc import Sequence

from dlcp.controller import pipeline
from dlcp.controller.network import Network
from dlcp.controller.p4info import P4Schema
from dlcp.controller.p4rt import Pipeline
from dlcp.controller.switch import ApplyReport, Switch, plan_entries
from dlcp.hostagent.errors import DlcpUserError


def load_program() -> tuple[P4Schema, Pipeline]:
    if not pipeline.P4INFO.exists() or not pipeline.BMV2_JSON.exists():
        raise DlcpUserError(f"compiled P4 program not found in {pipeline.BUILD_DIR} (run `make p4` with p4c, or "
                            "set DLCP_P4_BUILD)")
    return P4Schema.load(pipeline.P4INFO), Pipeline.load(pipeline.P4INFO, pipeline.BMV2_JSON)


def selected(net: Network, names: Sequence[str] | None) -> list:
    return [net.switch(n) for n in names] if names else list(net.switches.values())


def apply_network(net: Network, names: Sequence[str] | None = None, dry_run: bool = False,
                  tables: Sequence[str] | None = None, timeout: float = 5.0) -> list[ApplyReport]:
    """Validate every selected switch's entries, then converge each in turn."""
    schema, pipe = load_program()
    specs = selected(net, names)
    for spec in specs:  # encode everything before the first write anywhere
        plan_entries(spec, net, schema, tables)
    reports = []
    for spec in specs:
        with Switch(spec, schema, pipe, timeout=timeout) as sw:
            reports.append(sw.apply(net, tables=tables, dry_run=dry_run, queues=tables is None))
    return reports
