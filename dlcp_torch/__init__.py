"""PyTorch training through DLCP: a DDP communication hook and a distributed optimizer.

Two lines in a training script::

    session = dlcp_torch.init("ps", model=model)                   # under torchrun, or peers=[...]
    ddp.register_comm_hook(session.state, dlcp_torch.dlcp_hook)    # or DistributedOptimizer
"""

from dlcp_torch.hooks import dlcp_hook
from dlcp_torch.launch import DLCPSession, init
from dlcp_torch.optimizer import DistributedOptimizer
from dlcp_torch.state import DLCPState, start_server

__all__ = ["DLCPSession", "DLCPState", "DistributedOptimizer", "dlcp_hook", "init", "start_server"]
