"""Registers the ``dlcp`` name with ``torch.distributed`` and nothing else, so PyTorch can call
it while ``import torch`` runs (entry point group ``torch.backends``): the backend itself
(:mod:`dlcp_torch.backend`) loads only when a ``dlcp`` process group is created."""

from __future__ import annotations

from typing import Any

BACKEND_NAME = "dlcp"


def _create(store: Any, rank: int, world_size: int, timeout: Any) -> Any:
    from dlcp_torch.backend import create_process_group

    return create_process_group(store, rank, world_size, timeout)


def register() -> None:
    """Make ``"dlcp"`` a ``torch.distributed`` backend name (CPU tensors, and CUDA tensors staged
    through host memory); idempotent, and it never raises: a failure here would break
    ``import torch`` for everyone in the environment (then ``import dlcp_torch.backend``
    registers it, with the error)."""
    try:
        import torch.distributed as dist

        if not dist.is_available() or BACKEND_NAME in dist.Backend.backend_list:
            return
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
    except Exception:  # noqa: BLE001 - see the docstring
        pass
