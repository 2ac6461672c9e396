"""DLCP as a ``torch.distributed`` backend: ``init_process_group("dlcp")`` and an unchanged
DDP (or FSDP2, DTensor, DeviceMesh) script trains through DLCP. The user's guide is
``docs/backend.md``: options, environment, failure behaviour, limits.

Which collectives may lose what: a collective issued **during a backward pass** (DDP's
gradient buckets, FSDP's gradient reduce-scatter) carries gradients, and a float32 sum of
them runs under the gradient policy (the push bound ``Policy.loss_bound_push``, 0.05 by
default: at least 95 % of each chunk arrives, the rest counts as zero; rank 0 says so at
start-up). Every other call (parameter broadcasts, metrics, barriers, point-to-point, float64
and integer tensors) is reliable.
Why the backward pass decides: it is the one thing every gradient exchange has in common and
nothing else does, and PyTorch says it without help from the script
(``torch._C._current_graph_task_id()``).

Priorities: the gradient collectives of one backward pass arrive last layer first (DDP's
buckets, FSDP's reduce-scatters), so the k-th of a pass carries layers nearer the output than
the (k+1)-th, and the next forward pass needs it later. :mod:`dlcp_torch.bucket_order` turns
that order into the policy's priorities, from the count the previous pass had.

Each call is numbered in the order it is issued (the same on every rank, as
``torch.distributed`` requires) and runs in a small pool of threads, so DDP's buckets overlap
with each other and with the backward pass. Sums of float32, float16 and bfloat16 run on
DLCP's ring (reduce-scatter then all-gather, chained in the compiled data path), each in its
own type, as gloo sums them. Other dtypes and reduce ops are gathered whole and reduced
locally, which is exact for every dtype but moves n times the bytes: meant for the small
tensors such calls carry. CUDA tensors go through pinned host memory (:mod:`dlcp_torch.staging`;
not yet run on a GPU).

Failures (as gloo's): a call's bad arguments raise at the call; a collective that fails raises
from ``wait()`` and from its future (DDP's backward raises it); a peer whose connections close
fails every collective of the group at once, and a peer that stops answering fails them at the
process group's ``timeout``. A failed group refuses further calls and can be destroyed.

Options (before ``init_process_group``): :func:`configure`, or the environment:
``DLCP_LOSS_BOUND`` (the push bound), ``DLCP_MTU``, ``DLCP_LINE_RATE`` (Gb/s), ``DLCP_HOST``
(this process's address), ``DLCP_SECRET`` (the job secret; by default rank 0 draws one and
shares it through the process group's store).

Example::

    import torch.distributed as dist
    dist.init_process_group("dlcp")           # under torchrun; `import dlcp_torch` not needed
    model = torch.nn.parallel.DistributedDataParallel(model)
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import sys
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dlcp_torch import c10d_backend, collective_checks as checks
from dlcp_torch.bucket_order import BackwardOrder
from dlcp_torch.staging import HostCopies, Staging
from dlcp_torch.tensors import as_numpy, torch_dtype
from dlcp_torch.uncompiled import keep_out_of_compile
from dlcp_torch.work import DLCPWork
from dlcp.hostagent import sealing
from dlcp.hostagent.auth import parse_secret
from dlcp.hostagent.exchange import (MAX_STEPS, RING_DTYPES as WIRE_RING_DTYPES, RingAllreduce, message_id,
                                     step_of, tensor_of)
from dlcp.hostagent.messages import Expect, MessageMismatch, PeerFailed, TransportError, TransportTimeout, wait_all
from dlcp.hostagent.netif import interface_for
from dlcp.hostagent.policy import Policy
from dlcp.hostagent.ratecontrol import RateConfig
from dlcp.hostagent.transport import Endpoint, TransportConfig, data_port_note
from dlcp.hostagent.transport_config import link_timers

log = logging.getLogger(__name__)

BACKEND_NAME = "dlcp"
#: Point-to-point messages use the last step number, which no collective reaches.
P2P_STEP = MAX_STEPS - 1
#: Most ranks in one group: its ring's 2 (n - 1) steps take the message id's step field below
#: :data:`P2P_STEP` (``exchange.message_id``: 6 bits).
MAX_GROUP_SIZE = P2P_STEP // 2 + 1
#: Sums of these take the ring, each in its own type on the wire (:data:`dlcp.hostagent.exchange.RING_DTYPES`,
#: as torch types); float64 and integers are gathered and reduced exactly.
RING_DTYPES = tuple(torch_dtype(d) for d in WIRE_RING_DTYPES)
#: A sum of at most this many bytes is gathered in one round (each rank sends its tensor to every
#: other and adds them all in rank order, so every rank gets the same bits) instead of taking the
#: ring's 2 (n - 1) steps one after another: that small, a collective's time is its steps' round
#: trips and control records, not its bytes (``bench/backend.py --small`` measures the two).
DIRECT_SUM_BYTES = 64 * 1024
#: Most sends of one-round collectives a group keeps unsettled (see
#: :meth:`DLCPProcessGroup._settle_later`); past it a call waits for the oldest.
MAX_UNSETTLED_SENDS = 64
#: The largest data packet the backend cuts by default (IP bytes): the interface's MTU up to
#: this, the largest IPv4 packet. A NIC's MTU (1500, a 9000 jumbo frame) is below it; loopback's
#: (65,536) is above, and there the packets are as large as gloo's TCP segments on loopback
#: (64 KB). With 9000-byte packets a 4-rank DDP step of a 12M-parameter MLP took 1.22x gloo's
#: time against 1.04x (18 % more CPU: per-packet work, headers, tags, placement), a lone 57 MB
#: all_reduce 1.06x the time (median of 10 interleaved rounds; docs/results/backend.md).
MAX_DEFAULT_MTU = 65535
#: The line rate assumed where the interface reports no speed (loopback, veth, most virtual
#: NICs), in bytes/s: 100 Gb/s. On loopback no link limits the rate and gloo paces nothing:
#: this leaves the rate to the hosts' CPUs, as gloo's is.
UNKNOWN_LINK_RATE = 100e9 / 8
#: Longest a rank waits, when its group shuts down, for the others to shut down too (s).
LEAVE_WAIT = 60.0
#: How often a leaving rank looks for the others' words in the store (s).
LEAVE_POLL = 0.02


#: Each collective's kind, in the top bits of its messages' tensor field (``message_id``'s 16), so
#: that ranks calling different collectives at the same point of their programs (a bug: rank 0
#: in all_reduce #6, rank 1 in broadcast #6) never take each other's messages: before, a
#: one-round all_reduce's part was received as the broadcast's data, and one rank returned.
#: (A rank probed for another kind under a number it issued now fails the group:
#: :meth:`DLCPProcessGroup._on_unknown_probe`.)
COLLECTIVE_KINDS = {"all_reduce": 1, "broadcast": 2, "all_gather": 3, "reduce_scatter": 4, "reduce": 5,
                    "gather": 6, "scatter": 7, "all_to_all": 8, "all_to_all_single": 8, "barrier": 9}
KIND_SHIFT = 12
KIND_NAMES = {kind: name for name, kind in reversed(COLLECTIVE_KINDS.items())}  # (all_to_all's name first)
#: How many of the last collectives' kinds a group keeps, to tell a peer in another one (the
#: message ids' own span: their number wraps at 1,024).
KINDS_KEPT = 1024
#: Most tensors one collective's messages name by index (the rest of the tensor field): the
#: tensors of an all_reduce, broadcast or reduce, the inputs of an all_gather, the outputs of a
#: reduce_scatter.
MAX_TENSORS_PER_CALL = 1 << KIND_SHIFT


class _Call(int):
    """A collective's number on this group (every rank counts alike; its messages' iteration),
    with its kind: :meth:`mid` names its messages."""

    kind: int

    def __new__(cls, number: int, kind: int) -> _Call:
        call = super().__new__(cls, number)
        call.kind = kind
        return call

    def field(self, index: int) -> int:
        """The tensor field of the ``index``-th tensor's messages (the ring's tensor id)."""
        return (self.kind << KIND_SHIFT) | index

    def mid(self, index: int, step: int = 0) -> int:
        """The message id of the ``index``-th tensor's ``step``."""
        return message_id(self, self.field(index), step)


class _LeaveAtOnce(Exception):
    """A leaving rank cannot expect every rank's word: a peer still sends to it in a collective
    it never joined, or a peer's connection closed before that peer said it was leaving."""


@dataclass(frozen=True)
class BackendOptions:
    """What a ``dlcp`` process group is started with (see :func:`configure`)."""

    policy: Policy = field(default_factory=Policy)
    """The gradient policy: loss bounds, priorities, drop classes."""

    mtu: int | None = None
    """IP packet size of data packets; None: the MTU of the interface that carries this
    process's address, at most :data:`MAX_DEFAULT_MTU`. Where the ranks' differ, every rank
    uses the smallest (agreed through the store at start-up)."""

    line_rate: float | None = None
    """The host's link rate in bytes/s, which the sender paces to and starts at half of; None:
    the interface's speed, or :data:`UNKNOWN_LINK_RATE` where it reports none."""

    threads: int = 4
    """Collectives that may run at once (DDP's buckets overlap up to this many)."""

    message_deadline: float | None = None
    """Seconds a collective may take before it fails; None: the process group's ``timeout``
    (``init_process_group(timeout=...)``, 30 minutes by default, as gloo's)."""

    copies: HostCopies | None = None
    """How a device tensor is copied to host memory and back (:mod:`dlcp_torch.staging`):
    CUDA's pinned, side-stream copies when CUDA is available."""

    encrypt: bool = False
    """Encrypt every packet's payload (``TransportConfig.encrypt``), for jobs on networks others
    can read. Every packet is authenticated either way (a 128-bit tag over header and payload)."""

    authenticate: bool = True
    """Check every packet's tag (``TransportConfig.authenticate``). False only where nothing but
    the job can reach the ranks' ports, to save what the tag costs (docs/results/benchmarks.md):
    any process that can reach a data port could then write into a collective."""

    def __post_init__(self) -> None:
        if self.mtu is not None and not 576 <= self.mtu <= 65535:
            raise ValueError(f"BackendOptions.mtu={self.mtu} must be in 576..65535")
        if self.line_rate is not None and self.line_rate <= 0:
            raise ValueError(f"BackendOptions.line_rate={self.line_rate} must be > 0 (bytes/s)")
        if self.threads < 1:
            raise ValueError(f"BackendOptions.threads={self.threads} must be >= 1")
        if self.message_deadline is not None and self.message_deadline <= 0:
            raise ValueError(f"BackendOptions.message_deadline={self.message_deadline} must be > 0")
        if self.encrypt and not self.authenticate:
            raise ValueError("BackendOptions: encrypt=True needs authenticate=True")

    @staticmethod
    def from_env() -> BackendOptions:
        """Defaults, with ``DLCP_LOSS_BOUND``, ``DLCP_MTU``, ``DLCP_LINE_RATE`` (Gb/s),
        ``DLCP_ENCRYPT`` and ``DLCP_AUTHENTICATE`` (1 or 0) applied."""
        opts = BackendOptions()

        def flag(name: str) -> bool | None:
            text = os.environ.get(name)
            if text is None:
                return None
            if text not in ("0", "1"):
                raise ValueError(f"{name}={text!r} must be 0 or 1")
            return text == "1"

        def number(name: str, kind: Callable[[str], Any]) -> Any:
            text = os.environ.get(name)
            if text is None:
                return None
            try:
                return kind(text)
            except ValueError:
                raise ValueError(f"{name}={text!r} is not a number") from None

        bound = number("DLCP_LOSS_BOUND", float)
        if bound is not None:
            try:
                opts = replace(opts, policy=replace(opts.policy, loss_bound_push=bound))
            except ValueError as exc:
                raise ValueError(f"DLCP_LOSS_BOUND={bound!r}: {exc}") from None
        mtu = number("DLCP_MTU", int)
        if mtu is not None:
            opts = replace(opts, mtu=mtu)
        gbps = number("DLCP_LINE_RATE", float)
        if gbps is not None:
            opts = replace(opts, line_rate=gbps * 1e9 / 8)
        encrypt, authenticate = flag("DLCP_ENCRYPT"), flag("DLCP_AUTHENTICATE")
        if encrypt is not None:
            opts = replace(opts, encrypt=encrypt)
        if authenticate is not None:
            opts = replace(opts, authenticate=authenticate)
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


def _bytes_as_wire(t: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """A contiguous tensor's bytes as float16 elements (the wire's 2-byte type carries any
    bit pattern unchanged), padded to an even length; and the tensor they are the bytes of."""
    c = t.detach().contiguous()
    raw = c.view(-1).view(torch.uint8).numpy() if c.numel() else np.zeros(0, np.uint8)
    if raw.size % 2:
        raw = np.concatenate([raw, np.zeros(1, np.uint8)])
    return raw.view(np.float16), c


def _wire_elems(t: torch.Tensor) -> int:
    """How many 2-byte wire elements :func:`_bytes_as_wire` makes of ``t``."""
    return (t.numel() * t.element_size() + 1) // 2


def _store_bytes(t: torch.Tensor, data: np.ndarray) -> None:
    """Write wire bytes back into ``t`` (any dtype, any layout)."""
    raw = np.ascontiguousarray(data).view(np.uint8)[: t.numel() * t.element_size()]
    src = torch.from_numpy(raw.copy()).view(t.dtype).view(t.shape) if t.numel() else t
    with torch.no_grad():
        t.copy_(src)


def _reduce(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduce op named ``op`` over ``tensors`` (same shape and dtype), as torch.distributed
    defines it."""
    stacked = torch.stack(tensors)
    if stacked.dtype == torch.bool and op in ("SUM", "PRODUCT"):
        return stacked.any(0) if op == "SUM" else stacked.all(0)  # (gloo's: a bool sum saturates at True)
    if op == "SUM":
        return stacked.sum(0, dtype=tensors[0].dtype)
    if op == "AVG":  # (floating point or complex: checks.reduce_op refuses integers)
        return stacked.sum(0) / len(tensors)
    if op == "PRODUCT":
        return stacked.prod(0, dtype=tensors[0].dtype)
    if op == "MIN":
        return stacked.min(0).values
    if op == "MAX":
        return stacked.max(0).values
    out = tensors[0].clone()
    for x in tensors[1:]:
        if op == "BAND":
            out &= x
        elif op == "BOR":
            out |= x
        elif op == "BXOR":
            out ^= x
        else:
            raise checks.InvalidCall(f"dlcp backend: reduce op {op} is not supported")
    return out


def _split_rows(t: torch.Tensor, sizes: Sequence[int], world: int, what: str) -> list[torch.Tensor]:
    """``t`` cut along its first dimension into ``sizes`` rows each (equal parts if empty)."""
    if t.dim() == 0:
        raise checks.InvalidCall(f"dlcp backend: {what}: a 0-dimensional tensor has no first dimension to split")
    if not sizes:
        if t.shape[0] % world:
            raise checks.InvalidCall(f"dlcp backend: {what}: a tensor of shape {tuple(t.shape)} does not split into "
                             f"{world} equal parts along its first dimension")
        sizes = [t.shape[0] // world] * world
    if len(sizes) != world or sum(sizes) != t.shape[0]:
        raise checks.InvalidCall(f"dlcp backend: {what}: split sizes {list(sizes)} must be {world} sizes adding up to "
                         f"{t.shape[0]}")
    return list(torch.split(t, list(sizes), dim=0))


class DLCPProcessGroup(dist.ProcessGroup):
    """A process group whose collectives travel on one DLCP endpoint per process."""

    def __init__(self, endpoint: Endpoint, rank: int, world_size: int, options: BackendOptions,
                 timeout: float, store: dist.Store | None = None) -> None:
        super().__init__(rank, world_size)  # type: ignore[call-arg]  # stubs: store-taking form only
        self._rank, self._world = rank, world_size
        self.endpoint = endpoint
        self.options = options
        self.timeout = timeout
        """Seconds any collective may take (the process group's ``timeout``, or the options')."""
        ranks = list(range(world_size))
        reliable = replace(options.policy, loss_bound_push=0.0, loss_bound_pull=0.0)
        self._ring_gradients = RingAllreduce(endpoint, ranks, policy=options.policy, timeout=timeout)
        # (not gradients: no packet of theirs is less important than another, none is dropped first)
        self._ring_reliable = RingAllreduce(endpoint, ranks, policy=reliable, timeout=timeout, classify=False)
        self._order = BackwardOrder(options.policy)
        self._calls = itertools.count(1)  # numbered as issued: the same order on every rank
        self._p2p: dict[tuple[str, int, int], int] = {}
        self._p2p_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=options.threads, thread_name_prefix="dlcp-pg")
        self._staging = Staging(options.copies)
        self._closed = False
        self._broken: str | None = None  # why the group failed (then every call is refused)
        self._lost_leaving: list[int] = []  # members whose connection closed while this rank left
        self._lost_after_mismatch = False  # the group failed on a peer lost after a mismatch with it
        self._in_flight = 0  # collectives submitted and not yet finished
        self._in_flight_cv = threading.Condition()
        self._closer: threading.Thread | None = None
        self._store = store
        self._group_name = ""
        self._group_desc = ""
        self.counts: Counter = Counter()
        """Collectives issued, by name; and ``failed`` (see :meth:`stats`)."""
        self._unsettled: list[tuple[Any, np.ndarray]] = []  # (send handle, the copy it sends from)
        self._unsettled_lock = threading.Lock()
        self._kind_of_call: OrderedDict[int, int] = OrderedDict()  # the last calls issued: number -> kind
        self._kinds_probed: dict[int, tuple[int, int]] = {}  # calls a peer probed, not issued here yet
        self._kinds_lock = threading.Lock()
        endpoint.peer_lost_callbacks.append(self._on_peer_lost)
        endpoint.unknown_probe_callbacks.append(self._on_unknown_probe)

    # ------------------------------------------------------------------ process group facts
    def size(self) -> int:
        return self._world

    def rank(self) -> int:
        return self._rank

    def getBackendName(self) -> str:  # noqa: N802 (torch's names, called by its C++ side)
        return BACKEND_NAME

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def __repr__(self) -> str:
        return f"DLCPProcessGroup(rank={self._rank}, world_size={self._world}, name={self._group_name!r})"

    def stats(self) -> dict[str, Any]:
        """This group's figures: collectives issued by name, the endpoint's totals (packets,
        bytes, retransmissions, drops) and whether the group failed, and why."""
        return {"collectives": dict(self.counts), "broken": self._broken,
                "endpoint": self.endpoint.endpoint_stats() if not self._closed else None,
                "loss_bound_push": self.options.policy.loss_bound_push}

    # ------------------------------------------------------------------ collectives
    # (type: ignore[override] on these: the dispatcher calls them as (tensors, opts); torch's
    # stubs give ProcessGroup's C++ overloads instead)
    def allreduce(self, tensor_list: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        op = checks.op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        tensors = list(tensor_list)
        checks.reduce_op(op, [t.dtype for t in tensors], "all_reduce")
        self._check(tensors, "all_reduce")
        call, gradients = self._issue("all_reduce", len(tensors)), in_backward()
        priority = self._order.priority(torch._C._current_graph_task_id()) if gradients else None

        def run() -> list[torch.Tensor]:
            for i, t in enumerate(tensors):
                if t.is_complex():  # (a SUM or AVG: of the real and imaginary parts, a view in place)
                    t = torch.view_as_real(t)
                if t.dtype in RING_DTYPES and op in ("SUM", "AVG") and t.numel() * t.element_size() > DIRECT_SUM_BYTES:
                    self._ring_sum(call, i, t, gradients, priority)
                    if op == "AVG":
                        with torch.no_grad():
                            t.div_(self._world)
                else:
                    parts = self._gather_all(call, i, t)
                    with torch.no_grad():
                        t.copy_(_reduce(parts, op))
            return tensors

        return self._submit(f"all_reduce #{call}", run, tensors)

    def allreduce_coalesced(self, tensor_list: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensor_list, opts)

    def broadcast(self, tensor_list: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        root = opts.rootRank if opts is not None else 0
        tensors = list(tensor_list)
        checks.root(root, self._world, "broadcast")
        self._check(tensors, "broadcast")
        call = self._issue("broadcast", len(tensors))

        def run() -> list[torch.Tensor]:
            for i, t in enumerate(tensors):
                mid = call.mid(i)
                if self._rank == root:
                    data, _ = _bytes_as_wire(t)
                    self._wait([self._send(r, data, mid, call) for r in self._others()])
                else:
                    _store_bytes(t, self._wait([self._recv(root, _wire_elems(t), mid, call)])[0].data)
            return tensors

        return self._submit(f"broadcast #{call}", run, tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                  input_tensor: list[torch.Tensor], opts: Any = None) -> Any:
        checks.gather_lists(output_tensors, list(input_tensor), self._world, "all_gather")
        self._check([*input_tensor, *(t for outs in output_tensors for t in outs)], "all_gather")
        call = self._issue("all_gather", len(input_tensor))

        def run() -> list[list[torch.Tensor]]:
            for i, (outs, t) in enumerate(zip(output_tensors, input_tensor)):
                for r, part in enumerate(self._gather_all(call, i, t)):
                    with torch.no_grad():
                        outs[r].copy_(part.view(outs[r].shape))
            return output_tensors

        return self._submit(f"all_gather #{call}", run, *output_tensors, input_tensor)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        """``all_gather_into_tensor``: rank r's input lands in the r-th slice of ``output``."""
        checks.same_numel(output.numel(), input.numel() * self._world, "all_gather_into_tensor",
                          "output", f"{self._world} x input")
        return self.allgather([list(output.view(self._world, -1).unbind(0))], [input.reshape(-1)], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> Any:
        for o, i in zip(outputs, inputs):
            checks.same_numel(o.numel(), i.numel() * self._world, "all_gather_into_tensor_coalesced",
                              "output", f"{self._world} x input")
        return self.allgather([list(o.view(self._world, -1).unbind(0)) for o in outputs],
                              [i.reshape(-1) for i in inputs], opts)

    def reduce_scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Any:
        op = checks.op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        checks.reduce_op(op, [t.dtype for t in output_tensors], "reduce_scatter")
        checks.gather_lists(input_tensors, output_tensors, self._world, "reduce_scatter")
        self._check([*output_tensors, *(t for parts in input_tensors for t in parts)], "reduce_scatter")
        call, gradients = self._issue("reduce_scatter", len(output_tensors)), in_backward()
        priority = self._order.priority(torch._C._current_graph_task_id()) if gradients else None

        def run() -> list[torch.Tensor]:
            for i, (out, parts) in enumerate(zip(output_tensors, input_tensors)):
                got = self._scatter_parts(call, i, parts, gradients and out.dtype == torch.float32
                                          and op in ("SUM", "AVG"), priority)
                with torch.no_grad():
                    out.copy_(_reduce(got, op).view(out.shape))
            return output_tensors

        return self._submit(f"reduce_scatter #{call}", run, output_tensors, *input_tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        """``reduce_scatter_tensor``: the r-th slice of ``input``, summed over ranks, lands on rank r."""
        checks.same_numel(input.numel(), output.numel() * self._world, "reduce_scatter_tensor",
                          "input", f"{self._world} x output")
        return self.reduce_scatter([output], [list(input.view(self._world, -1).unbind(0))], opts)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]  # the same call under its older name

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        for o, i in zip(outputs, inputs):
            checks.same_numel(i.numel(), o.numel() * self._world, "reduce_scatter_tensor_coalesced",
                              "input", f"{self._world} x output")
        return self.reduce_scatter(outputs, [list(i.view(self._world, -1).unbind(0)) for i in inputs], opts)

    def reduce(self, tensor_list: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        """Every rank's tensor reduced into the root's (the others' are left as they are, as gloo does)."""
        op = checks.op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        root = opts.rootRank if opts is not None else 0
        tensors = list(tensor_list)
        checks.reduce_op(op, [t.dtype for t in tensors], "reduce")
        checks.root(root, self._world, "reduce")
        self._check(tensors, "reduce")
        call = self._issue("reduce", len(tensors))

        def run() -> list[torch.Tensor]:
            for i, t in enumerate(tensors):
                mid = call.mid(i)
                if self._rank != root:
                    self._wait([self._send(root, _bytes_as_wire(t)[0], mid, call)])
                    continue
                got = self._wait([self._recv(r, _wire_elems(t), mid, call) for r in self._others()])
                parts = iter(got)
                values = []
                for r in range(self._world):
                    if r == root:
                        values.append(t.detach().contiguous().clone())
                    else:
                        part = torch.empty_like(t.contiguous())
                        _store_bytes(part, next(parts).data)
                        values.append(part)
                with torch.no_grad():
                    t.copy_(_reduce(values, op))
            return tensors

        return self._submit(f"reduce #{call}", run, tensors)

    def gather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
               input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        """Every rank's input into the root's ``output_tensors[0][r]`` (the others pass an empty list)."""
        root = opts.rootRank if opts is not None else 0
        checks.root(root, self._world, "gather")
        checks.one_tensor(input_tensors, "gather", "input")
        if self._rank == root:
            checks.gather_lists(output_tensors, input_tensors, self._world, "gather")
        elif output_tensors and any(output_tensors):
            raise checks.InvalidCall(f"dlcp backend: gather: only the root (rank {root}) passes output tensors")
        outs = output_tensors[0] if self._rank == root else []
        self._check([*input_tensors, *outs], "gather")
        call = self._issue("gather")

        def run() -> list[list[torch.Tensor]]:
            t = input_tensors[0]
            mid = call.mid(0)
            if self._rank != root:
                self._wait([self._send(root, _bytes_as_wire(t)[0], mid, call)])
                return output_tensors
            got = iter(self._wait([self._recv(r, _wire_elems(t), mid, call) for r in self._others()]))
            for r in range(self._world):
                if r == root:
                    with torch.no_grad():
                        outs[r].copy_(t.view(outs[r].shape))
                else:
                    _store_bytes(outs[r], next(got).data)
            return output_tensors

        return self._submit(f"gather #{call}", run, input_tensors, outs)

    def scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Any:
        """The root's ``input_tensors[0][r]`` into rank r's output (the others pass an empty list)."""
        root = opts.rootRank if opts is not None else 0
        checks.root(root, self._world, "scatter")
        checks.one_tensor(output_tensors, "scatter", "output")
        if self._rank == root:
            checks.gather_lists(input_tensors, output_tensors, self._world, "scatter")
        elif input_tensors and any(input_tensors):
            raise checks.InvalidCall(f"dlcp backend: scatter: only the root (rank {root}) passes input tensors")
        ins = input_tensors[0] if self._rank == root else []
        self._check([*output_tensors, *ins], "scatter")
        call = self._issue("scatter")

        def run() -> list[torch.Tensor]:
            out = output_tensors[0]
            mid = call.mid(0)
            if self._rank != root:
                _store_bytes(out, self._wait([self._recv(root, _wire_elems(out), mid, call)])[0].data)
                return output_tensors
            self._wait([self._send(r, _bytes_as_wire(ins[r])[0], mid, call) for r in self._others()])
            with torch.no_grad():
                out.copy_(ins[root].view(out.shape))
            return output_tensors

        return self._submit(f"scatter #{call}", run, output_tensors, ins)

    def alltoall(self, output_tensors: list[torch.Tensor],
                 input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        """``all_to_all``: this rank's ``input_tensors[r]`` into rank r's ``output_tensors[this rank]``."""
        for what, ts in (("output", output_tensors), ("input", input_tensors)):
            if len(ts) != self._world:
                raise checks.InvalidCall(f"dlcp backend: all_to_all: {len(ts)} {what} tensors "
                                         f"for a group of {self._world}")
        self._check([*output_tensors, *input_tensors], "all_to_all")
        call = self._issue("all_to_all")
        outs, ins = list(output_tensors), list(input_tensors)

        def run() -> list[torch.Tensor]:
            self._exchange_parts(call, outs, ins)
            return outs

        return self._submit(f"all_to_all #{call}", run, outs, ins)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002 (torch's names)
                          output_split_sizes: list[int], input_split_sizes: list[int], opts: Any = None) -> Any:
        """``all_to_all_single``: ``input`` cut along its first dimension by ``input_split_sizes``
        (equal parts if empty), part r to rank r; what rank r sent lands in ``output``'s r-th part."""
        if output.dtype != input.dtype:
            raise checks.InvalidCall(f"dlcp backend: all_to_all_single: output is {output.dtype}, input {input.dtype}")
        outs = _split_rows(output, output_split_sizes, self._world, "all_to_all_single output")
        ins = _split_rows(input, input_split_sizes, self._world, "all_to_all_single input")
        self._check([output, input], "all_to_all_single")
        call = self._issue("all_to_all_single")
        holders = [output]

        def run() -> list[torch.Tensor]:
            # the parts are views of ``output``: a staged output is cut again from its host copy
            parts = outs if holders[0] is output else _split_rows(holders[0], [o.shape[0] for o in outs],
                                                                    self._world, "all_to_all_single output")
            self._exchange_parts(call, parts, ins)
            return holders

        return self._submit(f"all_to_all_single #{call}", run, holders, [input])

    alltoall_base = all_to_all_single  # type: ignore[assignment]  # the same call under its older name

    def barrier(self, opts: Any = None) -> Any:
        """Every rank has called barrier: a one-byte gather from every rank to every rank (a
        ring would cut one byte into empty chunks; this is a round of tiny messages)."""
        self._check([], "barrier")
        call = self._issue("barrier")
        token = torch.zeros(1, dtype=torch.uint8)

        def run() -> list[torch.Tensor]:
            self._gather_all(call, 0, token)
            return []

        return self._submit(f"barrier #{call}", run)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        self._check(tensors, "send")
        seq = self._p2p_next("send", dst, tag)

        def run() -> list[torch.Tensor]:
            for i, t in enumerate(tensors):
                data, _ = _bytes_as_wire(t)
                self._wait([self._send(dst, data, message_id(seq, (tag + i) & 0xFFFF, P2P_STEP), seq)])
            return tensors

        return self._submit(f"send #{seq} to rank {dst} (tag {tag})", run, tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        self._check(tensors, "recv")
        seq = self._p2p_next("recv", src, tag)

        def run() -> list[torch.Tensor]:
            for i, t in enumerate(tensors):
                h = self._recv(src, _wire_elems(t), message_id(seq, (tag + i) & 0xFFFF, P2P_STEP), seq)
                _store_bytes(t, self._wait([h])[0].data)
            return tensors

        return self._submit(f"recv #{seq} from rank {src} (tag {tag})", run, tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        raise NotImplementedError("dlcp backend: recv from any source is not supported; name the source rank")

    # ------------------------------------------------------------------ building blocks
    def _issue(self, name: str, indexed: int = 1) -> _Call:
        """The next collective's number, of kind ``name``, whose messages name ``indexed``
        tensors each by its index (refused past :data:`MAX_TENSORS_PER_CALL`, before it counts)."""
        if indexed > MAX_TENSORS_PER_CALL:
            raise checks.InvalidCall(f"dlcp backend: {name} of {indexed} tensors; at most "
                                     f"{MAX_TENSORS_PER_CALL} in one call")
        self.counts[name] += 1
        call = _Call(next(self._calls), COLLECTIVE_KINDS[name])
        with self._kinds_lock:
            self._kind_of_call[int(call)] = call.kind
            while len(self._kind_of_call) > KINDS_KEPT:
                self._kind_of_call.popitem(last=False)
            probed = self._kinds_probed.pop(int(call), None)
        if probed is not None and probed[1] != call.kind:  # a peer is in another collective of this number
            self._in_different_collectives(probed[0], int(call), probed[1], call.kind)
        return call

    def _on_unknown_probe(self, src: int, mid: int, iteration: int) -> None:
        """A peer probed a message this rank has not posted (the control thread calls this). Its
        id names the collective's kind (:class:`_Call`) and its iteration the collective's
        number: a peer in another kind of collective under a number this rank issued (or issues
        later) means the ranks' programs differ, and no message of either will ever come. Both
        would wait for the group's timeout (gloo's do; torch's default is 30 minutes); this rank
        fails the group now, saying which collectives, and the peer learns it from the
        connection closing."""
        if step_of(mid) == P2P_STEP:
            return
        kind = tensor_of(mid) >> KIND_SHIFT  # (the inverse of _Call.field)
        if kind not in KIND_NAMES:
            return
        with self._kinds_lock:
            mine = self._kind_of_call.get(iteration)
            if mine is None:
                latest = next(reversed(self._kind_of_call), 0)
                if iteration > latest and len(self._kinds_probed) < KINDS_KEPT:  # a peer ahead: seen when
                    self._kinds_probed.setdefault(iteration, (src, kind))  # this rank gets there
                return
        if mine != kind:
            self._in_different_collectives(src, iteration, kind, mine)

    def _in_different_collectives(self, src: int, number: int, theirs: int, mine: int) -> None:
        if self._closed or self._broken is not None:
            return
        self._fail_group(f"rank {src} called {KIND_NAMES[theirs]} as collective #{number} where rank "
                         f"{self._rank} called {KIND_NAMES[mine]}: every rank must call the same collectives "
                         "in the same order")
        log.error("dlcp: %s", self._broken)

    def _fail_group(self, why: str) -> None:
        """The group cannot go on: every later call is refused with ``why``, and the endpoint
        closes in the background, which fails every collective in flight now and tells the peers
        (their connections to this rank close)."""
        self._break(why)
        self._closer = threading.Thread(target=self.endpoint.close, name="dlcp-pg-fail", daemon=True)
        self._closer.start()

    def _others(self) -> list[int]:
        return [r for r in range(self._world) if r != self._rank]

    def _send(self, dest: int, data: np.ndarray, mid: int, call: int) -> Any:
        """A reliable send of wire elements (``call`` goes in every header, bound by the token)."""
        return self.endpoint.send(dest, data, mid, loss_bound=0.0, iteration=call, announce=False, classify=False)

    def _recv(self, src: int, elems: int, mid: int, call: int) -> Any:
        """A reliable receive of ``elems`` wire elements."""
        return self.endpoint.recv(src, mid, expect=Expect(elems, np.float16, 0.0, iteration=call))

    def _wait(self, handles: list[Any]) -> list[Any]:
        """Every handle's result, by the group's timeout from now (one wake-up: ``wait_all``)."""
        return wait_all(handles, time.monotonic() + self.timeout)

    def _submit(self, what: str, run: Callable[[], Any], *groups: list[torch.Tensor]) -> DLCPWork:
        """A :class:`DLCPWork` running ``run`` in the pool, with the device tensors of ``groups``
        (the lists ``run`` reads and writes) staged through host memory (:mod:`dlcp_torch.staging`)."""
        work = DLCPWork(what)
        staged = [g for g in groups if any(self._staging.copies.needs_staging(t) for t in g)]
        mark = self._staging.issued(staged) if staged else None  # here, in the issuing thread

        def task() -> None:
            try:
                if self._broken is not None:
                    raise dist.DistBackendError(f"dlcp: {what} not run: the process group failed ({self._broken})")
                if staged:
                    result: list[Any] = []
                    self._staging.run(staged, mark, lambda: result.append(run()))
                    value = result[0]
                else:
                    value = run()
            except BaseException as exc:  # handed to whoever waits on the work
                self.counts["failed"] += 1
                work.finish(error=self._failure(what, exc, [t for g in groups for t in g]))
            else:
                work.finish(value=value)
            finally:
                with self._in_flight_cv:
                    self._in_flight -= 1
                    self._in_flight_cv.notify_all()

        with self._in_flight_cv:
            self._in_flight += 1  # (shutdown lets every collective issued finish first, as gloo's)
        try:
            self._pool.submit(task)
        except BaseException:
            with self._in_flight_cv:
                self._in_flight -= 1
            raise
        return work

    def _failure(self, what: str, exc: BaseException, tensors: Sequence[torch.Tensor] = ()) -> BaseException:
        """The error a failed collective raises: a transport failure as ``DistBackendError``
        (what gloo raises), which also fails the group; anything else as it is. ``tensors``: the
        call's, named when the ranks' messages differ (:class:`MessageMismatch`: the transport
        counts the wire's elements, 2-byte ones for every collective that carries bytes)."""
        if isinstance(exc, dist.DistBackendError):
            return exc
        if isinstance(exc, TransportError):
            cause = self._broken or str(exc)
            self._break(str(exc))
            if isinstance(exc, TransportTimeout) and cause == str(exc):
                cause = f"timed out (the process group's timeout is {self.timeout:g} s): {exc}"
            # the ranks' tensors differ: this collective found it, or the peer that found it
            # first left (which reaches this rank first, and whether as this collective's error
            # or as the group's, is a race)
            if tensors and ((isinstance(exc, MessageMismatch) and cause == str(exc))
                            or (isinstance(exc, PeerFailed) and cause == str(exc) and self.endpoint.mismatches)
                            or (cause == self._broken and self._lost_after_mismatch)):
                mine = ", ".join(f"{t.numel():,} {str(t.dtype).removeprefix('torch.')} "
                                 f"({t.numel() * t.element_size():,} bytes)" for t in tensors)
                cause += (f"; this rank's tensors: {mine} (the counts above are of the wire's elements: "
                          "2 bytes each but in the ring's sums)")
            err = dist.DistBackendError(f"dlcp: {what} failed on rank {self._rank}: {cause}")
            err.__cause__ = exc
            log.error("%s", err)
            return err
        log.error("dlcp: %s failed on rank %d: %r", what, self._rank, exc)
        return exc

    def _break(self, why: str) -> None:
        if self._broken is None:
            self._broken = why

    def _on_peer_lost(self, rank: int, why: str) -> None:
        """A member's control connection closed (the control thread calls this): the group cannot
        finish a collective any more, so every collective in flight fails now, as gloo's do when
        a peer's socket closes, rather than at the timeout."""
        if self._closed:
            self._lost_leaving.append(rank)  # (the leave's waits look at it)
            return
        if self._broken is not None:
            return
        self._lost_after_mismatch = rank in self.endpoint.mismatches
        self._fail_group(f"lost rank {rank}: {why}")

    def _check(self, tensors: list[torch.Tensor], what: str) -> None:
        if self._closed:
            raise dist.DistBackendError(f"dlcp: {what}: the process group is shut down")
        if self._broken is not None:
            raise dist.DistBackendError(f"dlcp: {what}: the process group failed ({self._broken}); "
                                        "destroy it and start a new one")
        checks.tensors(tensors, what)

    def _ring_sum(self, call: _Call, index: int, t: torch.Tensor, gradients: bool, priority: int | None) -> None:
        """Sum ``t`` over the group in place on DLCP's ring (under the gradient policy if
        ``gradients``, else reliably)."""
        ring = self._ring_gradients if gradients else self._ring_reliable
        flat = t.detach().view(-1) if t.is_contiguous() else t.detach().contiguous().view(-1)
        ring.sum_inplace(call, [as_numpy(flat)], [call.field(index)], None if priority is None else [priority])
        if flat.data_ptr() != t.data_ptr() or not t.is_contiguous():
            with torch.no_grad():
                t.copy_(flat.view(t.shape))

    def _gather_all(self, call: _Call, index: int, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (reliable), in rank order. A small ``t`` (at most
        :data:`DIRECT_SUM_BYTES`: one-round sums, small all_gathers, barriers) is sent from a
        copy, and the call returns once every other rank's part is here, without waiting for its
        own sends' answers (:meth:`_settle_later`)."""
        data, c = _bytes_as_wire(t)
        later = data.nbytes <= DIRECT_SUM_BYTES
        if later:
            data = data.copy()  # the caller may change t as soon as this returns
        mid = call.mid(index)
        sends = [self._send(r, data, mid, call) for r in self._others()]
        got = iter(self._wait([self._recv(r, data.size, mid, call) for r in self._others()]))
        out = []
        for r in range(self._world):
            if r == self._rank:
                out.append(c.clone())
                continue
            part = torch.empty_like(c)
            _store_bytes(part, next(got).data)
            out.append(part)
        if later:
            self._settle_later([(h, data) for h in sends])
        else:
            self._wait(sends)
        return out

    def _settle_later(self, sends: list[tuple[Any, np.ndarray]]) -> None:
        """Keep ``sends`` (handle, the array it sends from) until their receivers answer, without
        waiting here.

        Why: a one-round collective is done on this rank once every other rank's part has come;
        the answers (STOPs) to its own sends come a control round trip later, about as long as a
        small collective takes. gloo's send is done once TCP has the bytes. A send that fails
        afterwards fails the group, so the next call raises it (as gloo's next call raises a lost
        peer); at most :data:`MAX_UNSETTLED_SENDS` wait so, the oldest are waited for past that,
        and :meth:`shutdown` waits for them before the group leaves."""
        for h, _ in sends:
            h.add_done_callback(self._on_settled)
        with self._unsettled_lock:
            self._unsettled = [x for x in self._unsettled if not x[0].done()] + sends
            excess = self._unsettled[:-MAX_UNSETTLED_SENDS]
        self._wait([h for h, _ in excess])

    def _settle_all(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s in all) until every send :meth:`_settle_later` kept is
        answered or failed (a failure fails the group through :meth:`_on_settled`)."""
        with self._unsettled_lock:
            unsettled, self._unsettled = self._unsettled, []
        deadline = time.monotonic() + timeout
        for h, _ in unsettled:
            with contextlib.suppress(Exception):
                h.wait(max(0.0, deadline - time.monotonic()))

    def _on_settled(self, handle: Any) -> None:
        """A send :meth:`_settle_later` kept resolved or failed (on the transport's thread)."""
        try:
            handle.wait(0)
        except Exception as exc:  # noqa: BLE001 - any failure of it fails the group
            if not self._closed:
                self._break(f"a send to rank {handle.peer} failed after its collective returned: {exc}")

    def _exchange_parts(self, call: _Call, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> None:
        """``ins[r]`` to rank r, and what rank r sent into ``outs[r]`` (reliable)."""
        mid = call.mid(0)
        sends = [self._send(r, _bytes_as_wire(ins[r])[0], mid, call) for r in self._others()]
        recvs = {r: self._recv(r, _wire_elems(outs[r]), mid, call) for r in self._others()}
        for r, res in zip(recvs, self._wait(list(recvs.values()))):
            _store_bytes(outs[r], res.data)
        with torch.no_grad():
            outs[self._rank].copy_(ins[self._rank].reshape(outs[self._rank].shape))
        self._wait(sends)

    def _scatter_parts(self, call: _Call, index: int, parts: list[torch.Tensor], gradients: bool,
                       priority: int | None) -> list[torch.Tensor]:
        """Send ``parts[r]`` to each rank r and return what every rank sent this one, in rank
        order (float32 gradients under the push bound, missing elements zero; else reliable)."""
        mid = call.mid(index)
        bound = self.options.policy.loss_bound_push if gradients else 0.0
        sends, recvs = [], {}
        for r in self._others():
            if gradients:
                data = parts[r].detach().contiguous().view(-1).numpy()
                sends.append(self.endpoint.send(r, data, mid, loss_bound=bound, iteration=call, announce=False,
                                                priority=priority))
                recvs[r] = self.endpoint.recv(r, mid, expect=Expect(data.size, np.float32, bound, iteration=call))
            else:
                sends.append(self._send(r, _bytes_as_wire(parts[r])[0], mid, call))
                recvs[r] = self._recv(r, _wire_elems(parts[r]), mid, call)
        got = iter(self._wait(list(recvs.values())))
        out = []
        mine = parts[self._rank]
        for r in range(self._world):
            if r == self._rank:
                out.append(mine.detach().clone())
                continue
            res = next(got)
            if gradients:
                out.append(torch.from_numpy(np.array(res.data, copy=True)).view(mine.shape))
            else:
                part = torch.empty_like(mine.contiguous())
                _store_bytes(part, res.data)
                out.append(part)
        self._wait(sends)
        return out

    def _p2p_next(self, kind: str, peer: int, tag: int) -> int:
        if not 0 <= peer < self._world or peer == self._rank:
            raise checks.InvalidCall(f"dlcp backend: rank {peer} is not another member of this group of {self._world}")
        with self._p2p_lock:
            key = (kind, peer, tag)
            self._p2p[key] = self._p2p.get(key, 0) + 1
            return self._p2p[key]

    def shutdown(self) -> None:
        """Stop the endpoint and the pool (``destroy_process_group`` calls it, and the
        interpreter's exit). A healthy group leaves together: each rank says so in the store and
        waits (at most :data:`LEAVE_WAIT` s) for the others before its endpoint closes, rank 0
        last (its process may host the store); the others return after its last word
        (``dlcp/bye``), which it says once closed, so a re-init at once on the same port meets
        rank 0's new store, and rank 0 keeps the store up until each has answered it. Why: a rank
        that is done with the last collective may still be needed by a slower one's (its STOPs,
        a resend), and a control connection that closes fails the group at once (see
        :meth:`_on_peer_lost`). A failed group closes at once; the endpoint closes before the
        pool, so a collective still waiting fails now instead of holding the pool."""
        if self._closed:
            return
        self._closed = True
        if self._broken is None and self._store is not None:
            words = self._store
            try:
                self._finish_in_flight(time.monotonic() + self.timeout)
                self._settle_all(min(self.timeout, LEAVE_WAIT))  # what the last collectives sent arrives first
                deadline, probed = time.monotonic() + min(self.timeout, LEAVE_WAIT), self.endpoint.probes_unknown
                words.set(f"dlcp/leaving/{self._rank}", "1")
                self._leave_wait(words, [f"dlcp/leaving/{r}" for r in range(self._world)], deadline, probed, True)
                # Rank 0 leaves last: under MASTER_ADDR its process hosts the store, and a rank
                # whose wait was still on its way when rank 0's process ended found the store
                # gone (torch prints a warning with a stack trace for it).
                if self._rank == 0:
                    self._leave_wait(words, [f"dlcp/left/{r}" for r in range(1, self._world)], deadline, probed, True)
                else:
                    words.set(f"dlcp/left/{self._rank}", "1")
                    # ... and the others return only once rank 0 is done: a rank that
                    # re-initialises at once (init, destroy, init on one MASTER_PORT) otherwise
                    # reached rank 0's old store, still up, and the new group never formed
                    # (4 ranks: 3 of 3 re-inits failed after the timeout; gloo's passed)
                    self._leave_wait(words, ["dlcp/bye"], deadline, probed, False)  # (rank 0 closes first)
                    words.set(f"dlcp/gone/{self._rank}", "1")  # (rank 0 keeps its store up till then)
            except _LeaveAtOnce as exc:
                self._break(str(exc))  # (so rank 0 says no last word: nobody waits for it)
                log.warning("dlcp: %s", exc)
            except Exception as exc:  # noqa: BLE001 - a peer gone, or the store's host gone first: leave anyway
                log.info("dlcp: rank %d leaves without every rank's word: %s", self._rank, exc)
        self.endpoint.close()  # (waits for a close that _on_peer_lost began)
        self._pool.shutdown(wait=True)
        with contextlib.suppress(ValueError):  # no cycle left for the collector: the endpoint goes now
            self.endpoint.peer_lost_callbacks.remove(self._on_peer_lost)
        with contextlib.suppress(ValueError):
            self.endpoint.unknown_probe_callbacks.remove(self._on_unknown_probe)
        store, self._store = self._store, None  # (rank 0: nothing of ours keeps its store up)
        if store is not None and self._rank == 0 and self._broken is None:
            # the last word, and the others' answer to it: the store goes with rank 0's group,
            # and no rank's wait may be on its way to it then (torch prints a stack trace)
            with contextlib.suppress(Exception):
                store.set("dlcp/bye", "1")
                store.wait([f"dlcp/gone/{r}" for r in range(1, self._world)],
                           timedelta(seconds=min(self.timeout, LEAVE_WAIT)))

    abort = shutdown

    def _finish_in_flight(self, deadline: float) -> None:
        """Wait until every collective issued has ended (works not waited for: ``async_op=True``),
        by ``deadline``: gloo's group finishes its queue before it goes, and leaving first failed
        them (the endpoint closed under them: 12 of 24 all_reduces issued just before
        ``destroy_process_group()``). Raise :class:`_LeaveAtOnce` if a peer's connection closes
        meanwhile (they cannot end well then; closing ends them at once)."""
        with self._in_flight_cv:
            while self._in_flight:
                if self._lost_leaving:
                    raise _LeaveAtOnce(f"rank {self._rank} leaves the group at once: rank {self._lost_leaving[0]} "
                                       f"closed its connection while {self._in_flight} collectives were in flight")
                if time.monotonic() >= deadline:
                    raise _LeaveAtOnce(f"rank {self._rank} leaves the group at once: {self._in_flight} collectives "
                                       f"still in flight after the group's timeout ({self.timeout:g} s)")
                self._in_flight_cv.wait(LEAVE_POLL)

    def _leave_wait(self, store: dist.Store, keys: list[str], deadline: float, probed: int,
                    peers_stay: bool) -> None:
        """Wait until ``keys`` are all in ``store`` (the leave's words), by ``deadline``; raise
        :class:`_LeaveAtOnce` as soon as a peer probes a message this rank has not posted, or
        (``peers_stay``) a peer's connection closes. Why: a rank leaves after its last
        collective, so such a peer is in a collective this rank never joined and will not (its
        script raised, or ended early): waiting for its word waited the whole
        :data:`LEAVE_WAIT` while it waited for this rank's data, and the survivors raised after
        60 s where gloo's raise at once (the closing connection tells them). A peer whose
        connection closed before its word will not say it either (its group failed)."""
        while not store.check(keys):
            if self.endpoint.probes_unknown > probed:
                raise _LeaveAtOnce(f"rank {self._rank} leaves the group at once: a peer is sending to it "
                                   "in a collective it has not joined")
            if peers_stay and self._lost_leaving:
                raise _LeaveAtOnce(f"rank {self._rank} leaves the group at once: rank {self._lost_leaving[0]} "
                                   "closed its connection before it said it was leaving")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no word from every rank within {LEAVE_WAIT:g} s ({', '.join(keys)})")
            time.sleep(LEAVE_POLL)

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter shutdown: nothing left to report to
            pass


#: What torch calls on the group: the methods ``dlcp_torch/csrc/forwarding_backend.cc`` forwards
#: (torch's own Python calls the same where no c10d backend could be compiled). None of them is
#: traced by ``torch.compile`` (:mod:`dlcp_torch.uncompiled` says why).
ENTRY_POINTS = ("abort", "all_gather_single", "all_gather_single_coalesced", "all_to_all_single", "allgather",
                "allreduce", "allreduce_coalesced", "alltoall", "barrier", "broadcast", "gather", "recv",
                "recv_anysource", "reduce", "reduce_scatter", "reduce_scatter_single",
                "reduce_scatter_single_coalesced", "scatter", "send", "shutdown")
keep_out_of_compile(DLCPProcessGroup, ENTRY_POINTS)


def _link_knobs(rate: float, mtu: int) -> dict[str, Any]:
    """The endpoint's MTU and what follows the link's rate and MTU: its rate, burst and report
    interval (as the testbed configures its hosts: ``link_rates``, ``link_timers``)."""
    return {"mtu": mtu, "rate": RateConfig.for_link(rate, mtu),
            "feedback_interval": link_timers(rate, mtu)["feedback_interval"]}


def _transport_config(rank: int, peers: Any, options: BackendOptions, host: str, timeout: float,
                      secret: bytes) -> tuple[TransportConfig, str]:
    """The endpoint's configuration from the options and this host's interface; and a line
    that says where the MTU and rate came from."""
    iface = interface_for(host)
    mtu, mtu_from = options.mtu, "configured"
    if mtu is None:
        mtu = min(MAX_DEFAULT_MTU, iface.mtu) if iface is not None and iface.mtu else 1500
        mtu_from = ("default" if iface is None or not iface.mtu else f"{iface.name}'s" if iface.mtu <= MAX_DEFAULT_MTU
                    else f"{iface.name}'s {iface.mtu}, at most an IP packet's")
    rate, rate_from = options.line_rate, "configured"
    if rate is None:
        if iface is not None and iface.speed_bps:
            rate, rate_from = iface.speed_bps / 8, f"{iface.name}'s speed"
        else:
            rate, rate_from = UNKNOWN_LINK_RATE, f"{iface.name if iface else 'the interface'} reports no speed"
    cfg = TransportConfig(rank=rank, peers=peers, policy=options.policy, **_link_knobs(rate, mtu),
                          message_deadline=timeout, connect_timeout=max(10.0, min(timeout, 300.0)), secret=secret,
                          encrypt=options.encrypt, authenticate=options.authenticate)
    protection = ("packets encrypted and authenticated" if options.encrypt else
                  "packets authenticated (DLCP_ENCRYPT=1 to encrypt)" if options.authenticate else
                  "packets NOT authenticated (DLCP_AUTHENTICATE=0)")
    if options.encrypt:
        protection += f", AES-GCM by {sealing.library()}"
    elif options.authenticate:
        protection += f", AEGISMAC-128X4 ({sealing.mac_build()} build)"
    return cfg, f"MTU {mtu} ({mtu_from}), line rate {rate * 8 / 1e9:g} Gb/s ({rate_from}); {protection}"


def _agree_on_mtu(store: dist.Store, rank: int, world_size: int, cfg: TransportConfig,
                  link: str) -> tuple[TransportConfig, str]:
    """Every rank's MTU through the store; all use the smallest. Ranks cut a message into packets
    by their MTU, and a receiver refuses packets cut otherwise: where the interfaces differ (a
    jumbo-frame host beside a 1500-byte one) the group would fail at its first collective. The
    smallest is the one every rank's interface carries. The start-up line says when it was lowered."""
    store.set(f"dlcp/mtu/{rank}", str(cfg.mtu))
    mtus = [int(store.get(f"dlcp/mtu/{r}")) for r in range(world_size)]
    if len(set(mtus)) == 1:
        return cfg, link
    low = min(mtus)
    by_rank = ", ".join(f"rank {r} {m}" for r, m in enumerate(mtus))
    return (replace(cfg, **_link_knobs(cfg.rate.line_rate, low)),
            f"{link}; every rank uses MTU {low}, the smallest of theirs ({by_rank})")


def _this_groups_keys(store: dist.Store, world_size: int) -> dist.Store:
    """``store`` under a prefix of this group's own: the n-th group made on one store (every rank
    adds one to ``dlcp/formed``) keeps its keys under ``dlcp/n/``. Why: torch names a group's keys
    by the group's name, and a default group made again after ``destroy_process_group`` has the
    same name; a store that outlives the group (torchrun's agent store, or ``store=`` passed to
    ``init_process_group``) still holds the last group's addresses, secret and leave keys, and a
    rank that came later than the others was read at its old address (the group failed; gloo's
    fails there too). On a store of its own (``MASTER_ADDR``, rank 0 hosting it) this is group 0.
    The count holds while every rank of a group gets this far, as a group that forms does; so
    that a worker torchrun restarted after one died before counting itself in is not out of step
    for ever, each restart (``TORCHELASTIC_RESTART_COUNT``, the same on every worker) counts apart."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    formed = store.add(f"dlcp/{attempt}/formed", 1)  # 1..world for the first group, world+1..2 world for the next
    return dist.PrefixStore(f"dlcp/{attempt}/{(formed - 1) // world_size}/", store)


def create_process_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> Any:
    """The backend's constructor (``Backend.register_backend`` calls it): DLCP addresses and the
    job secret go through the process group's own store. Returns the group's collectives as a
    c10d ``Backend`` torch registers on a ProcessGroup of its own (:mod:`dlcp_torch.c10d_backend`),
    or, where that cannot be compiled, the :class:`DLCPProcessGroup` itself."""
    from dlcp_torch.launch import _local_address, exchange_addresses

    if world_size > MAX_GROUP_SIZE:  # (before any rank reserves a port or waits for another)
        raise checks.InvalidCall(f"dlcp backend: a group of {world_size} ranks; at most {MAX_GROUP_SIZE} (a "
                                 "ring's 2 (n - 1) steps fit the message id's 6-bit step field): use gloo, or "
                                 "DLCP's groups of at most that many (dist.new_group)")
    options = _configured or BackendOptions.from_env()
    store = _this_groups_keys(store, world_size)
    c10d_backend.load()  # before the endpoint: the first use compiles it (every rank waits for one)
    seconds = options.message_deadline or timeout.total_seconds()
    host = _local_address(os.environ.get("MASTER_ADDR", "127.0.0.1"))
    secret = parse_secret(os.environ.get("DLCP_SECRET"))
    peers, held, secret = exchange_addresses(store, rank, world_size, host, secret=secret)
    if (note := data_port_note(held[rank][0].getsockname()[1])) is not None:
        print(f"dlcp: rank {rank}: {note}", file=sys.stderr, flush=True)
    cfg, link = _transport_config(rank, peers, options, host, seconds, secret)
    cfg, link = _agree_on_mtu(store, rank, world_size, cfg, link)
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
    if rank == 0:
        p = options.policy.loss_bound_push
        bound = (f"gradients (collectives in a backward pass) may lose up to {p:.0%} of each chunk (p = {p:g}; "
                 "DLCP_LOSS_BOUND=0 for lossless)" if p > 0 else "lossless (loss bound 0)")
        why = c10d_backend.why_not()
        kind = "a c10d backend" if why is None else f"a Python ProcessGroup, no c10d backend ({why})"
        print(f"dlcp: process group of {world_size} ranks: {bound}; {link}; timeout {seconds:g} s; {kind}",
              file=sys.stderr, flush=True)
    pg = DLCPProcessGroup(ep, rank, world_size, options, seconds, store)
    ref = weakref.ref(pg)
    atexit.register(lambda: (lambda g: g.shutdown() if g is not None else None)(ref()))
    return c10d_backend.wrap(pg, rank, world_size)


def implementation(group: Any) -> DLCPProcessGroup | None:
    """The DLCPProcessGroup behind ``group`` (a torch ProcessGroup whose CPU backend is dlcp's
    c10d Backend, or a DLCPProcessGroup itself); None if it has none."""
    if isinstance(group, DLCPProcessGroup):
        return group
    try:
        backend = group._get_backend(torch.device("cpu"))
    except Exception:  # noqa: BLE001 - not a group with a CPU backend
        return None
    impl = getattr(backend, "impl", None)
    return impl if isinstance(impl, DLCPProcessGroup) else None


def group_stats(group: Any = None) -> dict[str, Any]:
    """The figures of a ``dlcp`` process group (the default group if None): see
    :meth:`DLCPProcessGroup.stats`."""
    pg = group if group is not None else dist.group.WORLD
    impl = implementation(pg)
    if impl is None:
        raise ValueError(f"not a dlcp process group: {pg!r}")
    return impl.stats()


def register() -> None:
    """Make ``"dlcp"`` a ``torch.distributed`` backend name (CPU tensors, and CUDA tensors staged
    through host memory); idempotent. One process group serves both devices (torch registers a
    single backend when every device maps to the same name)."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, create_process_group, devices=["cpu", "cuda"])


register()
