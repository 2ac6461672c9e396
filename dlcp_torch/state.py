"""What the DLCP hook and optimizer keep between calls: one state object.

Follows PyTorch's convention for stateful communication hooks (``PowerSGDState``): the hook
function keeps nothing; the endpoint, the exchange pattern, priorities, error-feedback
buffers and counters live here. The state validates its arguments, logs its configuration
once, and survives pickling (checkpoints) without its endpoint, which cannot be pickled:
call :meth:`DLCPState.attach` after loading.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from dlcp.hostagent import wire
from dlcp.hostagent.exchange import Missing, PSServer, PSWorker, RingAllreduce, lost_elements, message_id
from dlcp.hostagent.fusion import Layout
from dlcp.hostagent.packetizer import elems_per_packet
from dlcp.hostagent.policy import PATTERNS, Policy, layer_priorities
from dlcp.hostagent.transport import Endpoint

if TYPE_CHECKING:  # torch is imported where it is used: a testbed agent exchanging numpy arrays never loads it
    import torch

log = logging.getLogger(__name__)

#: Element types gradients may travel in (``DLCPState(wire_dtype=...)``).
WIRE_DTYPES: dict[str, np.dtype] = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
                                     "bfloat16": wire.NUMPY_DTYPES[wire.Dtype.BFLOAT16]}
#: Message step used for parameter broadcasts (exchanges use steps 0..2(N-1)).
BROADCAST_STEP = 63


@dataclass
class SyncStats:
    """Figures of the exchanges of one worker, for reports."""

    sync_times: list[float] = field(default_factory=list)
    """Per exchanged tensor (bucket or parameter): seconds from hand-off to averaged result."""
    lost_fractions: list[float] = field(default_factory=list)
    """Per exchanged tensor: fraction of this worker's pushed elements that never arrived."""


class DLCPState:
    """State of DLCP gradient exchange for one worker.

    Args:
        endpoint: this worker's started :class:`~dlcp.hostagent.transport.Endpoint`.
        pattern: ``"ps"`` (push to ``server_rank``, pull the average) or ``"ring"``
            (ring allreduce over ``workers``).
        workers: transport ranks of all workers, in ring order; the same list everywhere.
        server_rank: the parameter server's transport rank (``pattern="ps"``).
        model: the model, so priorities follow the order in which its modules run forward
            (recorded during the first forward pass); without it, registration order.
        policy: defaults to the endpoint's; its ``loss_bound_push`` is the bound p.
        error_feedback: add what this worker lost in an exchange to its next gradient for the
            same tensor (off by default: DLCP itself drops gradients without compensation). With
            a parameter server that is its own gradient where the server missed it; in a ring,
            the partial sums its reduce-scatter sends lost.
        max_inflight: exchanges run concurrently in this many threads.
        timeout: seconds an exchange may take before it fails (default: the endpoint's
            message deadline).
        wire_dtype: ``"float32"`` (default), ``"float16"`` or ``"bfloat16"``: gradients travel
            in that type, half the bytes, as PyTorch's ``fp16_compress_hook`` (``bf16_compress_hook``)
            sends them (a ring sums in that type, a parameter server in float32); the average
            comes back as float32.

    Raises:
        ValueError: an inconsistent combination, said plainly.
    """

    def __init__(self, endpoint: Endpoint, pattern: str = "ps", workers: Sequence[int] | None = None,
                 server_rank: int | None = None, model: torch.nn.Module | None = None, policy: Policy | None = None,
                 error_feedback: bool = False, max_inflight: int = 8, timeout: float | None = None,
                 wire_dtype: str = "float32") -> None:
        if pattern not in PATTERNS:
            raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
        workers = list(workers) if workers is not None else [p.rank for p in endpoint.config.peers
                                                             if p.rank != server_rank]
        if endpoint.rank not in workers:
            raise ValueError(f"this endpoint's rank {endpoint.rank} is not among the workers {workers}")
        if pattern == "ps" and (server_rank is None or server_rank in workers):
            raise ValueError("pattern 'ps' needs a server_rank that is not one of the workers")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {sorted(WIRE_DTYPES)}, got {wire_dtype!r}")
        self.wire_dtype = wire_dtype
        self._wire = WIRE_DTYPES[wire_dtype]
        self.pattern = pattern
        self.workers = workers
        self.server_rank = server_rank
        self.policy = policy or endpoint.policy
        self.error_feedback = error_feedback
        self.max_inflight = max_inflight
        self.timeout = timeout
        self.stats = SyncStats()
        self._errors: dict[int, np.ndarray] = {}
        self._calls: dict[int, int] = {}
        self._layer_of: dict[int, int] = {}
        self._layer_sizes: list[int] = []
        self._order_hooks: list = []
        self._lock = threading.Lock()
        self.endpoint: Endpoint | None = None
        self.attach(endpoint)
        if model is not None:
            self._record_forward_order(model)
        log.info("DLCPState: pattern=%s workers=%s server=%s p=%.3f error_feedback=%s max_inflight=%d",
                 pattern, workers, server_rank, self.policy.loss_bound_push, error_feedback, max_inflight)

    # --- endpoint and exchange ----------------------------------------------------------------
    def attach(self, endpoint: Endpoint) -> None:
        """(Re)connect the state to a started endpoint (after unpickling, for instance)."""
        self.endpoint = endpoint
        timeout = self.timeout
        self._exchanger: PSWorker | RingAllreduce
        if self.pattern == "ps":
            assert self.server_rank is not None  # __init__ checks it
            self._exchanger = PSWorker(endpoint, self.server_rank, self.policy, timeout)
        else:
            self._exchanger = RingAllreduce(endpoint, self.workers, self.policy, timeout)
        self._pool = ThreadPoolExecutor(self.max_inflight, thread_name_prefix=f"dlcp-x{endpoint.rank}")
        self._per_packet = elems_per_packet(endpoint.config.mtu, self._wire)

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("endpoint", "_exchanger", "_pool", "_lock", "_order_hooks")}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.update(endpoint=None, _lock=threading.Lock(), _order_hooks=[])
        log.warning("DLCPState restored without its endpoint: call attach(endpoint) before training")

    def close(self) -> None:
        """Wait for running exchanges and stop the worker threads (the endpoint stays open)."""
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)

    # --- priorities -----------------------------------------------------------------------------
    def _record_forward_order(self, model: torch.nn.Module) -> None:
        """Note the order leaf modules run in during the first forward pass."""
        order: list[torch.nn.Module] = []
        leaves = [m for m in model.modules() if not list(m.children()) and list(m.parameters(recurse=False))]

        def pre_hook(module, _inputs):
            if module not in order:
                order.append(module)
            if len(order) == len(leaves):
                self._set_layers([[p for p in m.parameters(recurse=False)] for m in order])
                for h in self._order_hooks:
                    h.remove()
                self._order_hooks.clear()

        self._order_hooks = [m.register_forward_pre_hook(pre_hook) for m in leaves]
        # until a forward pass has run, registration order stands in
        self._set_layers([[p for p in m.parameters(recurse=False)] for m in leaves])

    def _set_layers(self, layers: list[list[torch.nn.Parameter]]) -> None:
        self._layer_of = {id(p): i for i, ps in enumerate(layers) for p in ps}
        self._layer_sizes = [sum(p.numel() for p in ps) for ps in layers]
        self._prio = layer_priorities(self._layer_sizes, self.policy) if layers else np.zeros(0, np.uint8)

    def layout_of(self, params: Sequence[torch.Tensor]) -> Layout:
        """Where each parameter's gradient sits in a flat buffer of ``params`` laid end to end,
        with the priority and layer of each: what a fused bucket's packets are tagged from."""
        tags = [self.priority_of([p]) for p in params]
        return Layout.of_sizes([p.numel() for p in params], [t[0] for t in tags], [t[1] for t in tags])

    def priority_of(self, params: Sequence[torch.Tensor]) -> tuple[int, int]:
        """(priority, first layer) of a set of parameters: the most urgent of their layers."""
        layers = [self._layer_of[id(p)] for p in params if id(p) in self._layer_of]
        if not layers:
            return self.policy.top_priority, 0
        first = min(layers)
        return int(self._prio[first]), first

    # --- exchange -------------------------------------------------------------------------------
    def next_iteration(self, key: int) -> int:
        """How many times tensor ``key`` was exchanged before: its iteration number.

        Every worker exchanges each bucket (or parameter) once per step, in the same layout,
        so a per-key count agrees across workers without any step signal.
        """
        with self._lock:
            it = self._calls.get(key, 0)
            self._calls[key] = it + 1
            return it

    def announce(self, iteration: int, keys: Sequence[int], layouts: Sequence[Layout]) -> None:
        """Tell the parameter server now what this iteration will push (one control frame for all
        buckets); each is then started with ``exchange_async(..., announced=True)``. A ring needs
        no announcement (every member knows every chunk's size), so this does nothing there."""
        if isinstance(self._exchanger, PSWorker):
            self._exchanger.announce(iteration, [lay.total for lay in layouts], list(keys), list(layouts), self._wire)

    def exchange_async(self, key: int, grad: np.ndarray, priority: int, iteration: int | None = None,
                       layout: Layout | None = None, announced: bool = False) -> Future:
        """Start averaging ``grad`` (flat float32) over the workers; a Future of the average.

        A ring averages ``grad`` in place (as DDP's allreduce hook averages its bucket) unless
        error feedback is on; keep a copy if the original values are still needed.

        ``layout`` (a fused bucket's) tags each packet with the priority of the layer it carries;
        ``announced``: :meth:`announce` already announced it for ``iteration``.
        """
        if self.endpoint is None:
            raise RuntimeError("DLCPState has no endpoint: call attach(endpoint) first")
        it = self.next_iteration(key) if iteration is None else iteration
        if self.error_feedback:
            err = self._errors.get(key)
            if err is not None and err.shape == grad.shape:
                grad = grad + err
            else:
                grad = grad.copy()  # the buffer must stay ours while in flight
        return self._pool.submit(self._exchange, it, key, grad, priority, layout, announced)

    def _exchange(self, iteration: int, key: int, grad: np.ndarray, priority: int,
                  layout: Layout | None = None, announced: bool = False) -> np.ndarray:
        t0 = time.monotonic()
        if isinstance(self._exchanger, PSWorker):
            (avg, sent), = self._exchanger.exchange_detailed(iteration, [grad.astype(self._wire, copy=False)], [key],
                                                             [priority], [layout], announced=announced)
            avg = avg.astype(np.float32, copy=False)
            idx = lost_elements(sent.lost_packets, self._per_packet, grad.size)
            vals = grad[idx]  # the worker's own gradient there
        elif self._wire != np.float32:  # compressed as fp16_compress_hook does, summed in its type
            half = grad.astype(self._wire)
            (idx, vals), = self._exchanger.allreduce_inplace(iteration, [half], [key], [priority], [layout],
                                                             lost_values=self.error_feedback)
            if grad.dtype == np.float32 and grad.flags.writeable:
                np.copyto(grad, half.reshape(grad.shape))  # in place, as the float32 ring averages
                avg = grad
            else:
                avg = half.astype(np.float32)
        elif grad.dtype == np.float32 and grad.ndim == 1 and grad.flags.c_contiguous and grad.flags.writeable:
            # in place, as DDP's own allreduce hook averages its bucket: no copy of the gradient
            (idx, vals), = self._exchanger.allreduce_inplace(iteration, [grad], [key], [priority], [layout],
                                                             lost_values=self.error_feedback)
            avg = grad
        else:
            (avg, idx, vals), = self._exchanger.allreduce_detailed(iteration, [grad], [key], [priority], [layout],
                                                                    lost_values=self.error_feedback)
        if self.error_feedback:
            err = np.zeros_like(grad)
            np.add.at(err, idx, vals)
            self._errors[key] = err
        with self._lock:
            self.stats.sync_times.append(time.monotonic() - t0)
            self.stats.lost_fractions.append(len(np.unique(idx)) / max(1, grad.size))
        return avg

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Make every worker's ``tensors`` equal to the first worker's (reliable, p = 0)."""
        ep = self.endpoint
        if ep is None:
            raise RuntimeError("DLCPState has no endpoint: call attach(endpoint) first")
        import torch

        from dlcp_torch.tensors import as_numpy, from_numpy

        root = self.workers[0]
        deadline = ep.config.message_deadline
        if ep.rank == root:
            handles = [ep.send(w, as_numpy(t.detach().reshape(-1).contiguous()), message_id(0, i, BROADCAST_STEP),
                               loss_bound=0.0) for w in self.workers if w != root for i, t in enumerate(tensors)]
            for h in handles:
                h.wait(deadline)
        else:
            for i, t in enumerate(tensors):
                data = ep.recv(root, message_id(0, i, BROADCAST_STEP)).wait(deadline).data
                with torch.no_grad():
                    t.copy_(from_numpy(data).reshape(t.shape))


def start_server(endpoint: Endpoint, workers: Sequence[int], policy: Policy | None = None,
                 missing: Missing = "zero") -> tuple[threading.Thread, threading.Event]:
    """Run a parameter server on ``endpoint`` in a thread (beside a worker, or alone).

    Returns the thread and the event that stops it. The server serves whatever the workers
    push (DDP buckets, single parameters), each tensor once every worker has pushed it.
    """
    server = PSServer(endpoint, list(workers), policy, missing=missing)
    endpoint.announcements()  # start collecting before any worker pushes
    stop = threading.Event()

    def run() -> None:
        try:
            server.serve_forever(stop)
        except Exception:  # reported to the workers through their own deadlines
            log.exception("parameter server on rank %d stopped", endpoint.rank)

    thread = threading.Thread(target=run, name=f"dlcp-ps-{endpoint.rank}", daemon=True)
    thread.start()
    return thread, stop
