"""``DistributedOptimizer``: DLCP without DDP, BytePS/Horovod style.

Each parameter's gradient is handed over the moment autograd finishes accumulating it (a
post-accumulate-grad hook) and packed into its bucket (:mod:`dlcp.hostagent.fusion`: DDP's caps by
default); a bucket is exchanged as soon as all its gradients are in, so the layers nearest the
output start exchanging while backward still runs on the layers nearest the input. Every
packet carries the priority of the layer it holds. ``step()`` waits for every exchange (each
completes under the bounded-loss rule), writes the averages into ``.grad`` and steps the
wrapped optimizer. ``fusion=FusionConfig(enabled=False)`` exchanges one message per parameter.

Example::

    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, state)
    loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import torch

from dlcp_torch.state import DLCPState
from dlcp_torch.tensors import as_numpy, from_numpy
from dlcp.hostagent.fusion import Bucket, Bucketer, FusionConfig, plan_buckets


class DistributedOptimizer:
    """Wraps ``optimizer``; one backward per ``step()`` (no gradient accumulation)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, state: DLCPState,
                 broadcast_initial: bool = True, fusion: FusionConfig = FusionConfig()) -> None:
        self.optimizer = optimizer
        self.model = model
        self.state = state
        self.fusion = fusion
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._key = {id(p): i for i, p in enumerate(self._params)}
        self._packer: Bucketer | None = None  # planned at the first gradient, once forward order is known
        self._pending: list[tuple[Bucket, Future]] = []
        self._seen: set[int] = set()
        self._step = 0
        if broadcast_initial:
            state.broadcast([p.data for p in self._params])
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]

    def _plan(self) -> Bucketer:
        """Buckets in backward order (the reverse of the parameters'), each tensor tagged with its
        layer's priority as recorded in the first forward pass."""
        tags = [self.state.priority_of([p]) for p in self._params]
        buckets = plan_buckets([p.numel() for p in self._params], [t[0] for t in tags], config=self.fusion,
                               layers=[t[1] for t in tags])
        return Bucketer(buckets)

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        key = self._key[id(p)]
        if key in self._seen:
            raise RuntimeError("DistributedOptimizer: a second backward before step(); gradient accumulation "
                               "is not supported")
        if self._packer is None:
            self._packer = self._plan()
        self._seen.add(key)
        assert p.grad is not None  # the hook runs once the gradient is accumulated
        for bucket, flat in self._packer.add(key, as_numpy(p.grad.detach().reshape(-1))):
            fut = self.state.exchange_async(bucket.index, flat, bucket.layout.top_priority, iteration=self._step,
                                            layout=bucket.layout)
            self._pending.append((bucket, fut))

    @property
    def buckets(self) -> list[Bucket]:
        """The buckets gradients travel in (empty before the first backward)."""
        return [] if self._packer is None else list(self._packer.buckets)

    def synchronize(self) -> None:
        """Wait for every exchange of this step and put the averages into ``.grad``."""
        ep = self.state.endpoint
        if ep is None:
            raise RuntimeError("DistributedOptimizer: its DLCPState has no endpoint (attach one first)")
        timeout = ep.config.message_deadline
        try:
            if self._packer is not None and len(self._seen) != len(self._params):
                missing = len(self._params) - len(self._seen)
                raise RuntimeError(f"DistributedOptimizer: {missing} parameter(s) got no gradient this step; "
                                   f"their buckets cannot be exchanged (every parameter must take part)")
            for bucket, fut in self._pending:
                assert self._packer is not None  # it planned the buckets pending
                avg = np.asarray(fut.result(timeout=timeout))
                with torch.no_grad():
                    for key, view in self._packer.unpack(bucket, avg).items():
                        g = self._params[key].grad
                        assert g is not None  # every parameter took part (checked above)
                        g.copy_(from_numpy(view).reshape(g.shape))
        finally:
            self._pending.clear()
            self._seen.clear()
            if self._packer is not None:
                self._packer.reset()

    def step(self, closure=None):
        self.synchronize()
        self._step += 1
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
