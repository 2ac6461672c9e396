"""``DistributedOptimizer``: DLCP without DDP, BytePS/Horovod style.

Each parameter's gradient is sent the moment autograd finishes accumulating it (a
post-accumulate-grad hook), so the layers nearest the output start exchanging while
backward still runs on the layers nearest the input, and each carries its layer's priority.
``step()`` waits for every exchange (each completes under the bounded-loss rule), writes the
averages into ``.grad`` and steps the wrapped optimizer.

Example::

    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, state)
    loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from dlcp_torch.state import DLCPState


class DistributedOptimizer:
    """Wraps ``optimizer``; one backward per ``step()`` (no gradient accumulation)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, state: DLCPState,
                 broadcast_initial: bool = True) -> None:
        self.optimizer = optimizer
        self.model = model
        self.state = state
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._key = {id(p): i for i, p in enumerate(self._params)}
        self._pending: dict[int, tuple[torch.nn.Parameter, Future]] = {}
        self._step = 0
        if broadcast_initial:
            state.broadcast([p.data for p in self._params])
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        key = self._key[id(p)]
        if key in self._pending:
            raise RuntimeError("DistributedOptimizer: a second backward before step(); gradient accumulation "
                               "is not supported")
        priority, _ = self.state.priority_of([p])
        grad = p.grad.detach().reshape(-1).contiguous().numpy()
        self._pending[key] = (p, self.state.exchange_async(key, grad, priority, iteration=self._step))

    def synchronize(self) -> None:
        """Wait for every exchange of this step and put the averages into ``.grad``."""
        timeout = self.state.endpoint.config.message_deadline
        try:
            for p, fut in self._pending.values():
                avg = fut.result(timeout=timeout)
                with torch.no_grad():
                    p.grad.copy_(torch.from_numpy(avg).reshape(p.grad.shape))
        finally:
            self._pending.clear()

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
