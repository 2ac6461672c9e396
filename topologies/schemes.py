"""The schemes an experiment compares, and the policy each one means: one definition, read by
the testbed (:mod:`topologies.runner`) and the simulator (:mod:`dlcp_sim`).

``baseline`` is one FIFO queue, per-flow ECMP, a reliable transport and no selective drops;
``dlcp`` turns on all of DLCP's mechanisms; the others turn on one each (ablations).
"""

from __future__ import annotations

import argparse

from hostagent.errors import DlcpUserError
from hostagent.policy import ECN_BACKLOGS, Policy

#: Which mechanisms each scheme turns on.
SCHEMES: dict[str, dict[str, bool]] = {
    "baseline": {"prio": False, "lb": False, "drop": False, "bounded": False},
    "dlcp": {"prio": True, "lb": True, "drop": True, "bounded": True},
    "lb": {"prio": False, "lb": True, "drop": False, "bounded": False},
    "prio": {"prio": True, "lb": False, "drop": False, "bounded": False},
    "drop": {"prio": False, "lb": False, "drop": True, "bounded": False},
    "bounded": {"prio": False, "lb": False, "drop": False, "bounded": True},
}


def check_schemes(schemes: tuple[str, ...], extra: tuple[str, ...] = ()) -> None:
    """Raises DlcpUserError naming what is unknown, or that none was given; ``extra``: names a
    caller knows besides :data:`SCHEMES` (the simulator's ``tcp``)."""
    known = [*SCHEMES, *extra]
    bad = [s for s in schemes if s not in known]
    if bad or not schemes:
        raise DlcpUserError(f"unknown scheme(s) {bad}; choose from {known}")


def policy_for(scheme: str, buffer: int, loss_bound: float, ecn_backlog: str = Policy.ecn_backlog) -> Policy:
    """The policy of one scheme at a port buffer of ``buffer`` packets: what is off falls back
    to the baseline's behaviour (one queue, flow hashing, no drop classes, p = 0). Every scheme
    marks ECN at a quarter of the buffer, on ``ecn_backlog`` (:attr:`Policy.ecn_backlog`; with
    one queue, as the baseline has, both rules are the same)."""
    on = SCHEMES[scheme]
    return Policy(
        priority_map=(0, 1, 2, 3, 4, 5, 6, 7) if on["prio"] else (0,) * 8,
        lb_mode="round_robin" if on["lb"] else "flow",
        num_drop_classes=4 if on["drop"] else 1,
        drop_thresholds=(buffer * 3 // 4, buffer // 2, buffer // 4) if on["drop"] else (),
        ecn_threshold=max(1, buffer // 4),
        ecn_backlog=ecn_backlog,
        loss_bound_push=loss_bound if on["bounded"] else 0.0,
    )


def add_ecn_backlog_argument(p: argparse.ArgumentParser) -> None:
    """``--ecn-backlog`` for every scheme's policy, as ``dlcp run`` and ``dlcp sim`` both take it."""
    p.add_argument("--ecn-backlog", choices=ECN_BACKLOGS, default=Policy.ecn_backlog,
                   help="what ECN marks on: the backlog ahead of a packet, its priority and above "
                        "(ahead, the default) or the port's whole backlog (port)")
