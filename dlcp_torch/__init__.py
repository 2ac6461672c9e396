"""PyTorch training through DLCP: a DDP communication hook and a distributed optimizer.

Two lines in a training script (after ``torch.distributed.init_process_group("gloo")``, which
DDP needs for its broadcasts)::

    session = dlcp_torch.init("ps", model=model)   # under torchrun, or peers=[...]
    ddp = session.ddp(model)                       # DDP with dlcp_hook; or DistributedOptimizer

The names below load on first use (PEP 562), so ``dlcp_torch.state``, which exchanges numpy
arrays, can be used without importing torch (2.5 s of CPU per process on the testbed's agents).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names below are, for type checkers (no import of torch at run time)
    from dlcp_torch.hooks import dlcp_hook
    from dlcp_torch.launch import DLCPSession, init
    from dlcp_torch.optimizer import DistributedOptimizer
    from dlcp_torch.state import DLCPState, start_server

_EXPORTS = {"dlcp_hook": "dlcp_torch.hooks", "DLCPSession": "dlcp_torch.launch", "init": "dlcp_torch.launch",
            "DistributedOptimizer": "dlcp_torch.optimizer", "DLCPState": "dlcp_torch.state",
            "start_server": "dlcp_torch.state"}

__all__ = ["DLCPSession", "DLCPState", "DistributedOptimizer", "dlcp_hook", "init", "start_server"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dlcp_torch' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return __all__
