"""What a testbed run (:class:`~dlcp.topologies.runner.RunOptions`) and a simulated one
(:class:`~dlcp_sim.scenario.SimOptions`) share, defined once: the names, meanings, allowed values
and command-line flags of the options both take, and the one check both apply.

Each side adds only what it alone has (the testbed's capacity and cross traffic, the
simulator's fabric and background flows) and reads the rest from here, so ``--buffer`` or
``--workload`` cannot mean, allow or be spelled one thing on the testbed and another in the
simulator. The fields have the same names on both dataclasses, which is what lets a sweep,
a report or a results file treat them alike.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from dlcp.hostagent.clikit import number
from dlcp.hostagent.errors import UsageError
from dlcp.hostagent.model_profiles import PROFILES
from dlcp.hostagent.policy import ECN_BACKLOGS, LOSS_BOUND, MAX_QUEUE_DEPTH, PATTERNS, Policy
from dlcp.hostagent.ranges import Range
from dlcp.topologies.schemes import MIN_BUFFER
from dlcp.topologies.workload import TRAINING_WORKLOADS

#: Synthetic gradients with a real model's tensor sizes (:mod:`dlcp.hostagent.model_profiles`): what
#: both the testbed and the simulator send.
SYNTHETIC_WORKLOADS: tuple[str, ...] = tuple(PROFILES)
#: Every workload the testbed runs: the synthetic ones and real PyTorch training.
WORKLOADS: tuple[str, ...] = SYNTHETIC_WORKLOADS + TRAINING_WORKLOADS

#: Allowed values of the numeric options both take; each side's ``RANGES`` starts from these.
COMMON_RANGES: dict[str, Range] = {
    "iterations": Range(1),
    "scale": Range(0, lo_open=True),
    "compute_ms": Range(0),
    "buffer": Range(MIN_BUFFER, MAX_QUEUE_DEPTH),
    "loss_bound": LOSS_BOUND,
    "mtu": Range(576, 9216),  # 1500 Ethernet, 9000 jumbo frames
    "repeat": Range(1, 100),
}

#: Fields whose flag is not ``--`` plus the field's name with dashes.
_FLAGS = {"capacity_pps": "--capacity"}


def option_name(field: str) -> str:
    """The command-line flag that sets an options field (``compute_ms`` -> ``--compute-ms``)."""
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


def check_choice(field: str, value: object, allowed: tuple[str, ...]) -> None:
    """Raises :class:`UsageError` naming the flag and the choices when ``value`` is not one."""
    if value not in allowed:
        raise UsageError(f"{option_name(field)} {value!r}: choose one of {list(allowed)}")


def check_options(opts: object, ranges: Mapping[str, Range], choices: Mapping[str, tuple[str, ...]]) -> None:
    """The check every options dataclass runs: each choice field among its choices, each
    numeric field in its range (a field set to None is not checked: "the default applies").

    Raises:
        UsageError: naming the first flag whose value is not allowed, and what is.
    """
    for name, allowed in choices.items():
        check_choice(name, getattr(opts, name), allowed)
    for name, rng in ranges.items():
        value = getattr(opts, name)
        if value is not None:
            rng.check(option_name(name), value)


def checked(ranges: Mapping[str, Range], field: str, kind: type = int) -> Callable[[str], Any]:
    """The parse-time check of ``field``'s flag, from its one range."""
    return number(ranges[field], kind)


def add_shared_arguments(p: argparse.ArgumentParser, defaults: Any, ranges: Mapping[str, Range],
                         workloads: tuple[str, ...], *, policy_file: bool) -> None:
    """The flags ``dlcp run`` (and sweep, calibrate) and ``dlcp sim`` both take, with one
    spelling and meaning: defaults from the options dataclass ``defaults``, numbers checked
    against ``ranges`` as they are parsed. ``policy_file``: the command also takes ``--policy
    FILE``, so ``--loss-bound`` and ``--ecn-backlog`` default to None (the file's, else the
    dataclass's)."""
    p.add_argument("--workload", "--model", dest="workload", choices=list(workloads), default=defaults.workload,
                   help="synthetic gradients with this model's per-tensor sizes"
                        + (", or real training on digits or MNIST-1D (needs pip install -e '.[mnist1d]')"
                           if set(TRAINING_WORKLOADS) & set(workloads) else ""))
    p.add_argument("--pattern", choices=list(PATTERNS), default=defaults.pattern,
                   help="parameter server or ring allreduce, for a scheme that does not name one")
    p.add_argument("--iterations", type=checked(ranges, "iterations"), default=defaults.iterations)
    p.add_argument("--scale", type=checked(ranges, "scale", float), default=defaults.scale,
                   help="multiply every tensor's size")
    p.add_argument("--compute-ms", type=checked(ranges, "compute_ms", float), default=defaults.compute_ms,
                   help="backward time per iteration of synthetic gradients; buckets leave (or their rings start) "
                        "as they fill during it (real training takes its own time)")
    p.add_argument("--buffer", type=checked(ranges, "buffer"), default=defaults.buffer,
                   help="switch port buffer, packets")
    given = "the --policy file's loss_bound_push, else " if policy_file else ""
    p.add_argument("--loss-bound", type=checked(ranges, "loss_bound", float),
                   default=None if policy_file else defaults.loss_bound,
                   metavar="P", help="p of the bounded schemes' pushes: a message completes once (1-p) of it "
                                     f"arrived (default: {given}{defaults.loss_bound:g})")
    add_ecn_backlog_argument(p, default=None if policy_file else defaults.ecn_backlog)
    p.add_argument("--repeat", type=number(COMMON_RANGES["repeat"]), default=getattr(defaults, "repeat", 1),
                   help="runs (seeds, in the simulator) per scheme, interleaved; >= 5 give 95%% intervals "
                        "(fewer: ranges, and no verdict)")


def add_ecn_backlog_argument(p: argparse.ArgumentParser, default: str | None = Policy.ecn_backlog) -> None:
    """``--ecn-backlog`` for every scheme's policy (``default=None``: the policy file's, where a
    command takes one)."""
    given = f"default: {default}" if default else f"default: the --policy file's, else {Policy.ecn_backlog}"
    p.add_argument("--ecn-backlog", choices=ECN_BACKLOGS, default=default,
                   help="what ECN marks on: the backlog ahead of a packet, its priority and above "
                        f"(ahead) or the port's whole backlog (port) ({given})")
