"""The DDP communication hook: ``ddp.register_comm_hook(state, dlcp_hook)``.

Contract as PyTorch's own hooks (``allreduce_hook``): ``hook(state, bucket) -> Future[Tensor]``
whose value is the bucket's gradients averaged over the workers. The hook keeps nothing
itself; the :class:`~dlcp_torch.state.DLCPState` does. Bucket access goes through
:func:`bucket_buffer` and :func:`bucket_params` alone, because the GradBucket API changed
across releases.

Example::

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(state, dlcp_hook)
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.

import torch
import torch.distributed as dist

from dlcp_torch.state import DLCPState


def bucket_buffer(bucket: dist.GradBucket) -> torch.Tensor:
    """The bucket's flattened gradients (one contiguous tensor)."""
    return bucket.buffer()


def bucket_params(bucket: dist.GradBucket) -> list[torch.Tensor]:
    """The parameters whose gradients the bucket holds."""
    return list(bucket.parameters())


def dlcp_hook(state: DLCPState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the workers through DLCP's bounded-loss transport.

    Each packet of the bucket carries the priority of the layer its gradients belong to (a
    packet spanning layers takes the more urgent one), so the bucket's first-needed layers
    are queued first; its packets' drop classes come from their magnitudes. Up to p of the bucket
    (``Policy.loss_bound_push``) may arrive as zeros; with ``error_feedback`` the lost part
    is added to the bucket's next gradient.

    Bucket indices are rebuilt after the first iteration; each index is keyed separately, so
    exchanges stay matched across workers, and error buffers of a changed bucket restart.

    Example: ``ddp.register_comm_hook(DLCPState(endpoint, "ps", server_rank=4), dlcp_hook)``
    """
    buf = bucket_buffer(bucket)
    if buf.device.type != "cpu" or buf.dtype != torch.float32:
        raise TypeError(f"dlcp_hook handles CPU float32 buckets; got {buf.dtype} on {buf.device}")
    params = bucket_params(bucket)
    grad = buf.detach().numpy()
    full = state.layout_of(params)
    layout = full if full.total == grad.size else None  # a layout DDP did not promise: one priority
    priority, _ = state.priority_of(params)
    fut: torch.futures.Future = torch.futures.Future()
    inner = state.exchange_async(bucket.index(), grad, priority, layout=layout)

    def done(f) -> None:
        try:
            fut.set_result(torch.from_numpy(f.result()).reshape(buf.shape))
        except BaseException as exc:  # surfaces in DDP's backward / wait
            fut.set_exception(exc)

    inner.add_done_callback(done)
    return fut
