"""Training workloads: a model and its data, trained data-parallel through DLCP.

The examples (``examples/train_*.py``), ``dlcp converge`` and the testbed's training agents all
train these, so they live in the installed package rather than in the source tree. This module
is the registry only and imports no torch, so naming a workload stays cheap; a workload's module
is imported when it is asked for.

    python -m dlcp_torch.workloads mnist1d --workers 4 --compare
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dlcp_torch.workloads.base import Workload

#: Workload name -> the module that defines its ``WORKLOAD``.
WORKLOAD_MODULES = {"digits": "dlcp_torch.workloads.digits", "mnist1d": "dlcp_torch.workloads.mnist1d"}

__all__ = ["WORKLOAD_MODULES", "get_workload"]


def get_workload(name: str) -> Workload:
    """The :class:`~dlcp_torch.workloads.base.Workload` called ``name`` (imports its module only now).

    Raises:
        ValueError: no workload has that name.
    """
    if name not in WORKLOAD_MODULES:
        raise ValueError(f"unknown training workload {name!r}; one of {sorted(WORKLOAD_MODULES)}")
    return importlib.import_module(WORKLOAD_MODULES[name]).WORKLOAD
