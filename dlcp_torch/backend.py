"""DLCP as a ``torch.distributed`` backend: ``init_process_group("dlcp")`` and an unchanged
DDP script trains through DLCP.

Which collectives may lose what: a collective issued **during a backward pass** (DDP's
gradient buckets, FSDP's gradient reduce-scatter) carries gradients, and a float32 sum of
them runs under the gradient policy (the push bound ``Policy.loss_bound_push``, 0.05 by
default: at least 95 % of each chunk arrives, the rest counts as zero). Every other call
(parameter broadcasts, metrics, barriers, point-to-point, float64 and integer tensors) is
reliable.
Why the backward pass decides: it is the one thing every gradient exchange has in common and
nothing else does, and PyTorch says it without help from the script
(``torch._C._current_graph_task_id()``).

Each call is numbered in the order it is issued (the same on every rank, as
``torch.distributed`` requires) and runs in a small pool of threads, so DDP's buckets overlap
with each other and with the backward pass. Sums of float32 run on DLCP's ring (reduce-scatter
then all-gather, chained in the compiled data path); float16 and bfloat16 travel as such and
are summed in their own type, as gloo sums them. Other dtypes
and reduce ops are gathered whole and reduced locally, which is exact for every dtype but moves
n times the bytes: meant for the small tensors such calls carry. CUDA tensors go through pinned
host memory (:mod:`dlcp_torch.staging`; not yet run on a GPU).

Options (before ``init_process_group``): :func:`configure`, or the environment:
``DLCP_LOSS_BOUND`` (the push bound), ``DLCP_MTU``, ``DLCP_HOST`` (this process's address),
``DLCP_SECRET`` (the job secret; by default rank 0 draws one and shares it through the
process group's store).

Example::

    import torch.distributed as dist
    dist.init_process_group("dlcp")           # under torchrun; `import dlcp_torch` not needed
    model = torch.nn.parallel.DistributedDataParallel(model)
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import timedelta
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dlcp_torch.staging import HostCopies, Staging
from dlcp_torch.tensors import as_numpy, torch_dtype
from hostagent.auth import parse_secret
from hostagent.exchange import MAX_STEPS, RING_DTYPES as WIRE_RING_DTYPES, RingAllreduce, message_id
from hostagent.messages import Expect
from hostagent.policy import Policy
from hostagent.transport import Endpoint, TransportConfig

log = logging.getLogger(__name__)

BACKEND_NAME = "dlcp"
#: Point-to-point messages use the last step number, which no collective reaches.
P2P_STEP = MAX_STEPS - 1
#: Sums of these take the ring, each in its own type on the wire (:data:`hostagent.exchange.RING_DTYPES`,
#: as torch types); float64 and integers are gathered and reduced exactly.
RING_DTYPES = tuple(torch_dtype(d) for d in WIRE_RING_DTYPES)


@dataclass(frozen=True)
class BackendOptions:
    """What a ``dlcp`` process group is started with (see :func:`configure`)."""

    policy: Policy = field(default_factory=Policy)
    """The gradient policy: loss bounds, priorities, drop classes."""

    mtu: int = 1500
    """IP packet size of data packets."""

    threads: int = 4
    """Collectives that may run at once (DDP's buckets overlap up to this many)."""

    message_deadline: float = 300.0
    """A message not complete by then fails its collective."""

    copies: HostCopies | None = None
    """How a device tensor is copied to host memory and back (:mod:`dlcp_torch.staging`):
    CUDA's pinned, side-stream copies when CUDA is available."""

    @staticmethod
    def from_env() -> BackendOptions:
        """Defaults, with ``DLCP_LOSS_BOUND`` and ``DLCP_MTU`` applied."""
        opts = BackendOptions()
        bound = os.environ.get("DLCP_LOSS_BOUND")
        if bound is not None:
            try:
                opts = replace(opts, policy=replace(opts.policy, loss_bound_push=float(bound)))
            except ValueError as exc:
                raise ValueError(f"DLCP_LOSS_BOUND={bound!r}: {exc}") from None
        mtu = os.environ.get("DLCP_MTU")
        if mtu is not None:
            opts = replace(opts, mtu=int(mtu))
        return opts


_configured: BackendOptions | None = None


def configure(options: BackendOptions | None = None, **changes: Any) -> BackendOptions:
    """Set the options of ``dlcp`` process groups created from now on (in this process).

    Example: ``configure(policy=Policy(loss_bound_push=0.02))``
    """
    global _configured
    base = options or _configured or BackendOptions.from_env()
    _configured = replace(base, **changes) if changes else base
    return _configured


def in_backward() -> bool:
    """Whether the calling thread runs a backward pass (so a collective carries gradients)."""
    return torch._C._current_graph_task_id() != -1


def _work(run: Callable[[], Any], pool: ThreadPoolExecutor) -> Any:
    """A ``Work`` that completes when ``run`` returns in ``pool`` (its value is the future's)."""
    fut: torch.futures.Future = torch.futures.Future()

    def task() -> None:
        try:
            fut.set_result(run())
        except BaseException as exc:  # handed to whoever waits on the work
            log.exception("dlcp collective failed")
            fut.set_exception(exc)

    pool.submit(task)
    return torch._C._distributed_c10d._create_work_from_future(fut)  # type: ignore[attr-defined]  # private


def _bytes_as_wire(t: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """A contiguous tensor's bytes as float16 elements (the wire's 2-byte type carries any
    bit pattern unchanged), padded to an even length; and the tensor they are the bytes of."""
    c = t.detach().contiguous()
    raw = c.view(-1).view(torch.uint8).numpy() if c.numel() else np.zeros(0, np.uint8)
    if raw.size % 2:
        raw = np.concatenate([raw, np.zeros(1, np.uint8)])
    return raw.view(np.float16), c


def _store_bytes(t: torch.Tensor, data: np.ndarray) -> None:
    """Write wire bytes back into ``t`` (any dtype, any layout)."""
    raw = np.ascontiguousarray(data).view(np.uint8)[: t.numel() * t.element_size()]
    src = torch.from_numpy(raw.copy()).view(t.dtype).view(t.shape) if t.numel() else t
    with torch.no_grad():
        t.copy_(src)


def _reduce(tensors: list[torch.Tensor], op: dist.ReduceOp | dist.ReduceOp.RedOpType) -> torch.Tensor:
    stacked = torch.stack(tensors)
    if op == dist.ReduceOp.SUM:
        return stacked.sum(0, dtype=tensors[0].dtype)
    if op == dist.ReduceOp.AVG:
        return stacked.sum(0) / len(tensors) if stacked.is_floating_point() else stacked.sum(0) // len(tensors)
    if op == dist.ReduceOp.PRODUCT:
        return stacked.prod(0, dtype=tensors[0].dtype)
    if op == dist.ReduceOp.MIN:
        return stacked.min(0).values
    if op == dist.ReduceOp.MAX:
        return stacked.max(0).values
    if op == dist.ReduceOp.BAND:
        out = tensors[0].clone()
        for x in tensors[1:]:
            out &= x
        return out
    if op == dist.ReduceOp.BOR:
        out = tensors[0].clone()
        for x in tensors[1:]:
            out |= x
        return out
    if op == dist.ReduceOp.BXOR:
        out = tensors[0].clone()
        for x in tensors[1:]:
            out ^= x
        return out
    raise ValueError(f"dlcp backend: reduce op {op} is not supported")


class DLCPProcessGroup(dist.ProcessGroup):
    """A process group whose collectives travel on one DLCP endpoint per process."""

    def __init__(self, endpoint: Endpoint, rank: int, world_size: int, options: BackendOptions) -> None:
        super().__init__(rank, world_size)  # type: ignore[call-arg]  # stubs: store-taking form only
        self._rank, self._world = rank, world_size
        self.endpoint = endpoint
        self.options = options
        ranks = list(range(world_size))
        reliable = replace(options.policy, loss_bound_push=0.0, loss_bound_pull=0.0)
        timeout = options.message_deadline
        self._ring_gradients = RingAllreduce(endpoint, ranks, policy=options.policy, timeout=timeout)
        self._ring_reliable = RingAllreduce(endpoint, ranks, policy=reliable, timeout=timeout)
        self._calls = itertools.count(1)  # numbered as issued: the same order on every rank
        self._p2p: dict[tuple[str, int, int], int] = {}
        self._p2p_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=options.threads, thread_name_prefix="dlcp-pg")
        self._staging = Staging(options.copies)
        self._closed = False

    # ------------------------------------------------------------------ process group facts
    def size(self) -> int:
        return self._world

    def rank(self) -> int:
        return self._rank

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"DLCPProcessGroup(rank={self._rank}, world_size={self._world})"

    # ------------------------------------------------------------------ collectives
    # (type: ignore[override] on these: the dispatcher calls them as (tensors, opts); torch's
    # stubs give ProcessGroup's C++ overloads instead)
    def allreduce(self, tensor_list: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        call, gradients = next(self._calls), in_backward()
        tensors = list(tensor_list)
        self._check(tensors)

        def run() -> list[torch.Tensor]:
            for i, t in enumerate(tensors):
                if t.dtype in RING_DTYPES and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                    self._ring_sum(call, i, t, gradients)
                    if op == dist.ReduceOp.AVG:
                        with torch.no_grad():
                            t.div_(self._world)
                else:
                    parts = self._gather_all(call, i, t)
                    with torch.no_grad():
                        t.copy_(_reduce(parts, op))
            return tensors

        return self._submit(run, tensors)

    def allreduce_coalesced(self, tensor_list: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensor_list, opts)

    def broadcast(self, tensor_list: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        root = opts.rootRank if opts is not None else 0
        call = next(self._calls)
        tensors = list(tensor_list)
        self._check(tensors)

        def run() -> list[torch.Tensor]:
            for i, t in enumerate(tensors):
                mid = message_id(call, i, 0)
                data, _ = _bytes_as_wire(t)
                if self._rank == root:
                    handles = [self.endpoint.send(r, data, mid, loss_bound=0.0, iteration=call, announce=False)
                               for r in range(self._world) if r != root]
                    for h in handles:
                        h.wait(self.options.message_deadline)
                else:
                    got = self.endpoint.recv(root, mid, expect=Expect(data.size, np.float16, 0.0, iteration=call))
                    _store_bytes(t, got.wait(self.options.message_deadline).data)
            return tensors

        return self._submit(run, tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                  input_tensor: list[torch.Tensor], opts: Any = None) -> Any:
        call = next(self._calls)
        self._check(list(input_tensor))

        def run() -> list[list[torch.Tensor]]:
            for i, (outs, t) in enumerate(zip(output_tensors, input_tensor)):
                if len(outs) != self._world:
                    raise ValueError(f"all_gather: {len(outs)} output tensors for a group of {self._world}")
                for r, part in enumerate(self._gather_all(call, i, t)):
                    with torch.no_grad():
                        outs[r].copy_(part.view(outs[r].shape))
            return output_tensors

        return self._submit(run, *output_tensors, input_tensor)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        """``all_gather_into_tensor``: rank r's input lands in the r-th slice of ``output``."""
        return self.allgather([list(output.view(self._world, -1).unbind(0))], [input.reshape(-1)], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> Any:
        return self.allgather([list(o.view(self._world, -1).unbind(0)) for o in outputs],
                              [i.reshape(-1) for i in inputs], opts)

    def reduce_scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        call, gradients = next(self._calls), in_backward()

        def run() -> list[torch.Tensor]:
            for i, (out, parts) in enumerate(zip(output_tensors, input_tensors)):
                if len(parts) != self._world:
                    raise ValueError(f"reduce_scatter: {len(parts)} input tensors for a group of {self._world}")
                got = self._scatter_parts(call, i, parts, gradients and out.dtype == torch.float32
                                          and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG))
                with torch.no_grad():
                    out.copy_(_reduce(got, op).view(out.shape))
            return output_tensors

        return self._submit(run, output_tensors, *input_tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        """``reduce_scatter_tensor``: the r-th slice of ``input``, summed over ranks, lands on rank r."""
        return self.reduce_scatter([output], [list(input.view(self._world, -1).unbind(0))], opts)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]  # the same call under its older name

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        return self.reduce_scatter(outputs, [list(i.view(self._world, -1).unbind(0)) for i in inputs], opts)

    def barrier(self, opts: Any = None) -> Any:
        return self.allreduce([torch.zeros(1)], None)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        self._check(tensors)
        seq = self._p2p_next("send", dst, tag)

        def run() -> list[torch.Tensor]:
            for i, t in enumerate(tensors):
                data, _ = _bytes_as_wire(t)
                self.endpoint.send(dst, data, message_id(seq, (tag + i) & 0xFFFF, P2P_STEP), loss_bound=0.0,
                                   iteration=seq, announce=False).wait(self.options.message_deadline)
            return tensors

        return self._submit(run, tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        self._check(tensors)
        seq = self._p2p_next("recv", src, tag)

        def run() -> list[torch.Tensor]:
            for i, t in enumerate(tensors):
                n = (t.numel() * t.element_size() + 1) // 2
                h = self.endpoint.recv(src, message_id(seq, (tag + i) & 0xFFFF, P2P_STEP),
                                       expect=Expect(n, np.float16, 0.0, iteration=seq))
                _store_bytes(t, h.wait(self.options.message_deadline).data)
            return tensors

        return self._submit(run, tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        raise NotImplementedError("dlcp backend: recv from any source is not supported; name the source rank")

    # ------------------------------------------------------------------ building blocks
    def _submit(self, run: Callable[[], Any], *groups: list[torch.Tensor]) -> Any:
        """A ``Work`` running ``run`` in the pool, with the device tensors of ``groups`` (the
        lists ``run`` reads and writes) staged through host memory (:mod:`dlcp_torch.staging`)."""
        staged = [g for g in groups if any(self._staging.copies.needs_staging(t) for t in g)]
        if not staged:
            return _work(run, self._pool)
        mark = self._staging.issued(staged)  # here, in the issuing thread: what the copies wait for

        def staged_run() -> Any:
            result: list[Any] = []
            self._staging.run(staged, mark, lambda: result.append(run()))
            return result[0]

        return _work(staged_run, self._pool)

    def _check(self, tensors: list[torch.Tensor]) -> None:
        if self._closed:
            raise RuntimeError("dlcp process group is shut down")
        for t in tensors:
            if t.is_sparse:
                raise ValueError("dlcp backend: sparse tensors are not supported")

    def _ring_sum(self, call: int, index: int, t: torch.Tensor, gradients: bool) -> None:
        """Sum ``t`` over the group in place on DLCP's ring (under the gradient policy if
        ``gradients``, else reliably)."""
        ring = self._ring_gradients if gradients else self._ring_reliable
        flat = t.detach().view(-1) if t.is_contiguous() else t.detach().contiguous().view(-1)
        ring.sum_inplace(call, [as_numpy(flat)], [index])
        if flat.data_ptr() != t.data_ptr() or not t.is_contiguous():
            with torch.no_grad():
                t.copy_(flat.view(t.shape))

    def _gather_all(self, call: int, index: int, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (reliable), in rank order."""
        data, c = _bytes_as_wire(t)
        mid = message_id(call, index, 0)
        sends = [self.endpoint.send(r, data, mid, loss_bound=0.0, iteration=call, announce=False)
                 for r in range(self._world) if r != self._rank]
        recvs = {r: self.endpoint.recv(r, mid, expect=Expect(data.size, np.float16, 0.0, iteration=call))
                 for r in range(self._world) if r != self._rank}
        out = []
        for r in range(self._world):
            if r == self._rank:
                out.append(c.clone())
                continue
            part = torch.empty_like(c)
            _store_bytes(part, recvs[r].wait(self.options.message_deadline).data)
            out.append(part)
        for h in sends:
            h.wait(self.options.message_deadline)
        return out

    def _scatter_parts(self, call: int, index: int, parts: list[torch.Tensor], gradients: bool) -> list[torch.Tensor]:
        """Send ``parts[r]`` to each rank r and return what every rank sent this one, in rank
        order (float32 gradients under the push bound, missing elements zero; else reliable)."""
        mid = message_id(call, index, 0)
        bound = self.options.policy.loss_bound_push if gradients else 0.0
        sends, recvs = [], {}
        for r in range(self._world):
            if r == self._rank:
                continue
            if gradients:
                data = parts[r].detach().contiguous().view(-1).numpy()
                sends.append(self.endpoint.send(r, data, mid, loss_bound=bound, iteration=call, announce=False))
                recvs[r] = self.endpoint.recv(r, mid, expect=Expect(data.size, np.float32, bound, iteration=call))
            else:
                data, _ = _bytes_as_wire(parts[r])
                sends.append(self.endpoint.send(r, data, mid, loss_bound=0.0, iteration=call, announce=False))
                recvs[r] = self.endpoint.recv(r, mid, expect=Expect(data.size, np.float16, 0.0, iteration=call))
        out = []
        for r in range(self._world):
            mine = parts[self._rank]
            if r == self._rank:
                out.append(mine.detach().clone())
                continue
            got = recvs[r].wait(self.options.message_deadline).data
            if gradients:
                out.append(torch.from_numpy(np.array(got, copy=True)).view(mine.shape))
            else:
                part = torch.empty_like(mine.contiguous())
                _store_bytes(part, got)
                out.append(part)
        for h in sends:
            h.wait(self.options.message_deadline)
        return out

    def _p2p_next(self, kind: str, peer: int, tag: int) -> int:
        if not 0 <= peer < self._world or peer == self._rank:
            raise ValueError(f"dlcp backend: rank {peer} is not another member of this group of {self._world}")
        with self._p2p_lock:
            key = (kind, peer, tag)
            self._p2p[key] = self._p2p.get(key, 0) + 1
            return self._p2p[key]

    def shutdown(self) -> None:
        """Stop the pool and the endpoint (``destroy_process_group`` calls it)."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self.endpoint.close()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter shutdown: nothing left to report to
            pass


def create_process_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> DLCPProcessGroup:
    """The backend's constructor (``Backend.register_backend`` calls it): DLCP addresses and the
    job secret go through the process group's own store."""
    from dlcp_torch.launch import _local_address, exchange_addresses

    options = _configured or BackendOptions.from_env()
    host = _local_address(os.environ.get("MASTER_ADDR", "127.0.0.1"))
    secret = parse_secret(os.environ.get("DLCP_SECRET"))
    peers, held, secret = exchange_addresses(store, rank, world_size, host, secret=secret)
    cfg = TransportConfig(rank=rank, peers=peers, policy=options.policy, mtu=options.mtu,
                          message_deadline=options.message_deadline,
                          connect_timeout=max(10.0, timeout.total_seconds()), secret=secret)
    ep = Endpoint(cfg).start(held.get(rank))
    try:
        ep.connect()
        # Nobody leaves the constructor before everyone is connected (as gloo's full mesh): a
        # fast rank that finished and closed could otherwise leave a slow one's connect waiting.
        store.set(f"dlcp/connected/{rank}", "1")
        store.wait([f"dlcp/connected/{r}" for r in range(world_size)], timeout)
    except BaseException:
        ep.close()
        raise
    return DLCPProcessGroup(ep, rank, world_size, options)


def register() -> None:
    """Make ``"dlcp"`` a ``torch.distributed`` backend name (CPU tensors, and CUDA tensors staged
    through host memory); idempotent. One process group serves both devices (torch registers a
    single backend when every device maps to the same name)."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, create_process_group, devices=["cpu", "cuda"])


register()
