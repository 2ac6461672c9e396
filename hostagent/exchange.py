"""Gradient exchange over the bounded-loss transport: parameter server and ring allreduce.

Both take a list of numpy gradients per iteration (one per tensor, in forward order, so
tensor 0 is nearest the input) and return the averaged gradients, same shapes, float32. All
tensors of an iteration are in flight at once; each tensor's priority comes from its
position (:func:`dlcp.hostagent.policy.layer_priorities`), so the tensors the next forward pass
needs first go first.

How missing elements count (the bound lets up to p of a message go missing):

* ``missing="zero"`` (default, both patterns): a missing element contributes 0 and the sum is
  divided by the number of workers N. The error of an element is at most the sum of the lost
  contributions divided by N; nothing else changes.
* ``missing="present"`` (parameter server only): each element is averaged over the workers
  whose packet for it arrived, so a lost contribution does not shrink the mean; an element no
  worker delivered is 0. A ring cannot do this, because a partial sum does not say how many
  workers it holds.

Message ids: both sides of a message compute its id from (iteration, tensor, step) with
:func:`message_id`, so no id needs to be exchanged; ids repeat every 1024 iterations.

Fusion: :meth:`PSWorker.exchange` and :meth:`RingAllreduce.allreduce` pack the tensors into
buckets (:mod:`dlcp.hostagent.fusion`, DDP's caps by default) and exchange one message per bucket,
each packet tagged with the priority of the layer it carries; ``FusionConfig(enabled=False)``
sends one message per tensor. The ``*_detailed`` methods exchange exactly the arrays they are
given (one message each), with an optional :class:`~dlcp.hostagent.fusion.Layout` per array.

Control frames: a receiver that knows what it will receive (a PS worker's pull, every ring
step) posts the size with its ``recv`` (``expect``), so the sender sends no META for it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from dlcp.hostagent import wire
from dlcp.hostagent.fusion import Bucket, FusionConfig, Layout, plan_buckets
from dlcp.hostagent.messages import (Expect, MessageStats, RecvHandle, RecvResult, SendHandle, TransportTimeout,
                                     wait_all)
from dlcp.hostagent.packetizer import elems_per_packet
from dlcp.hostagent.policy import Policy, layer_priorities, payload_drop_classes
from dlcp.hostagent.transport import Endpoint

log = logging.getLogger(__name__)

MAX_TENSORS = 1 << 16
MAX_STEPS = 1 << 6
ITERATION_WRAP = 1 << 10
Missing = Literal["zero", "present"]


def message_id(iteration: int, tensor: int, step: int) -> int:
    """The message id of ``tensor``'s ``step`` in ``iteration``.

    Layout (32 bits): iteration mod 1024 (10 bits) | step (6 bits) | tensor (16 bits).

    Raises:
        ValueError: tensor or step beyond its field.
    """
    if not 0 <= tensor < MAX_TENSORS:
        raise ValueError(f"tensor index {tensor} outside 0..{MAX_TENSORS - 1}")
    if not 0 <= step < MAX_STEPS:
        raise ValueError(f"step {step} outside 0..{MAX_STEPS - 1}")
    return ((iteration % ITERATION_WRAP) << 22) | (step << 16) | tensor


def iteration_of(mid: int) -> int:
    """The iteration (mod 1024) a :func:`message_id` belongs to."""
    return (mid >> 22) % ITERATION_WRAP


def step_of(mid: int) -> int:
    """The step of a :func:`message_id` (PS: 0 push, 1 pull; ring: its step)."""
    return (mid >> 16) & (MAX_STEPS - 1)


def tensor_of(mid: int) -> int:
    """The tensor (or bucket) index of a :func:`message_id`."""
    return mid & (MAX_TENSORS - 1)


#: Element types gradients travel and are summed in: float32, and float16 and bfloat16 summed in
#: their own type on the wire (half the bytes; each addition rounded to it, as gloo sums a
#: float16 or bfloat16 tensor and PyTorch's ``fp16_compress_hook`` has it sum halves). A
#: parameter server sums pushes of either 2-byte type in float32 and answers in their type.
RING_DTYPES = tuple(wire.NUMPY_DTYPES[c] for c in (wire.Dtype.FLOAT32, wire.Dtype.FLOAT16, wire.Dtype.BFLOAT16))


def _flat(g: np.ndarray) -> np.ndarray:
    g = np.asarray(g)
    if g.dtype not in RING_DTYPES:
        raise ValueError(f"gradients must be float32, float16 or bfloat16, got {g.dtype}")
    return np.ascontiguousarray(g).reshape(-1)


def aggregate(results: Sequence[RecvResult], n_workers: int, missing: Missing = "zero") -> np.ndarray:
    """Average what the workers delivered for one tensor (float32), by the ``missing`` rule."""
    total = np.zeros(results[0].data.size, dtype=np.float32)
    for r in results:
        total += r.data
    if missing == "zero":
        return total / np.float32(n_workers)
    if missing != "present":
        raise ValueError(f"missing must be 'zero' or 'present', got {missing!r}")
    count = np.zeros(total.size, dtype=np.float32)
    for r in results:
        count += r.present_elements()
    out = np.zeros_like(total)
    np.divide(total, count, out=out, where=count > 0)
    return out


@dataclass
class ExchangeStats:
    """Figures of one iteration's exchange, as seen by one participant."""

    iteration: int
    sync_time: float = 0.0
    bytes_sent: int = 0
    lost_fraction_max: float = 0.0
    lost_fraction_mean: float = 0.0
    retransmissions: int = 0
    per_message: list[MessageStats] = field(default_factory=list)
    """Each received message's figures (``as_dict()`` for JSON: made only when asked, as a
    small collective took a tenth of its time building dicts nobody read)."""


def lost_elements(packets: np.ndarray | None, per_packet: int, size: int) -> np.ndarray:
    """Element indices covered by lost packet sequence numbers (packets of ``per_packet``)."""
    if packets is None or len(packets) == 0:
        return np.zeros(0, dtype=np.int64)
    idx = (np.asarray(packets, np.int64)[:, None] * per_packet + np.arange(per_packet)).reshape(-1)
    return idx[idx < size]


def _put_on_done(q: queue.Queue | queue.SimpleQueue, item: object) -> Callable[[object], None]:
    """A done-callback that puts ``item`` on ``q``."""
    return lambda _handle: q.put(item)


def _check_lengths(n: int, ids: Sequence[int], priorities: Sequence[int] | np.ndarray) -> None:
    if len(ids) != n or len(priorities) != n:
        raise ValueError(f"{n} tensors need as many tensor ids and priorities; got {len(ids)} and {len(priorities)}")
    if len(set(ids)) != n:
        raise ValueError(f"tensor ids must be distinct within one call, got {list(ids)}")


def _check_pull_buffers(flats: Sequence[np.ndarray], out: Sequence[np.ndarray] | None) -> list[np.ndarray | None]:
    """``out`` checked against the pushes before anything is posted (a bad one would otherwise
    fail after the others' receives were set up)."""
    if out is None:
        return [None] * len(flats)
    if len(out) != len(flats):
        raise ValueError(f"{len(out)} pull buffers for {len(flats)} tensors")
    for i, (o, f) in enumerate(zip(out, flats)):
        if not isinstance(o, np.ndarray) or o.shape != (f.size,) or o.dtype != f.dtype \
                or not o.flags.c_contiguous or not o.flags.writeable:
            raise ValueError(f"pull buffer {i} must be a writable contiguous 1-D {f.dtype} array of {f.size} "
                             f"elements, got {getattr(o, 'dtype', type(o).__name__)} {getattr(o, 'shape', '')}")
        if any(np.shares_memory(o, g) for g in flats):
            raise ValueError(f"pull buffer {i} overlaps a pushed array: a push is read until the server "
                             "has it, while its average may already arrive")
    for i, o in enumerate(out):
        if any(np.shares_memory(o, other) for other in out[i + 1:]):
            raise ValueError(f"pull buffer {i} overlaps another pull buffer")
    return list(out)


def _check_inplace(buffers: Sequence[np.ndarray], what: str) -> None:
    for b in buffers:
        if not isinstance(b, np.ndarray) or b.dtype not in RING_DTYPES or b.ndim != 1 or not b.flags.c_contiguous:
            raise ValueError(f"{what} needs contiguous 1-D float32, float16 or bfloat16 arrays")


def _summarise(stats: ExchangeStats, recv_results: Sequence[RecvResult], sent: Sequence) -> ExchangeStats:
    lost = [r.stats.lost_fraction for r in recv_results]
    stats.lost_fraction_max = max(lost, default=0.0)
    stats.lost_fraction_mean = sum(lost) / len(lost) if lost else 0.0  # (not np.mean: 15 us for a few floats)
    stats.retransmissions = sum(s.retransmissions for s in sent)
    stats.bytes_sent = sum(s.bytes for s in sent)
    stats.per_message = [r.stats for r in recv_results]
    return stats


def _layouts(n: int, layouts: Sequence[Layout | None] | None) -> list[Layout | None]:
    if layouts is None:
        return [None] * n
    if len(layouts) != n:
        raise ValueError(f"{n} tensors need as many layouts, got {len(layouts)}")
    return list(layouts)


class _Planner:
    """Bucket plans by tensor sizes, computed once per distinct set of sizes."""

    def __init__(self, fusion: FusionConfig, policy: Policy) -> None:
        self.fusion = fusion
        self.policy = policy
        self._plans: dict[tuple[int, ...], list[Bucket]] = {}

    def plan(self, sizes: Sequence[int], priorities: Sequence[int] | None = None) -> list[Bucket]:
        key = tuple(int(s) for s in sizes) + (() if priorities is None else (-1, *map(int, priorities)))
        plan = self._plans.get(key)
        if plan is None:
            prio = layer_priorities(list(sizes), self.policy) if priorities is None else priorities
            plan = self._plans[key] = plan_buckets(list(sizes), list(prio), config=self.fusion)
        return plan


class _Chunking:
    """A ring's per-size figures, computed once per size and kept: its chunk bounds, the
    priorities of a call's buffers by their sizes, and an unfused buffer's layout (whose slices
    the layout keeps in turn). Why: a training loop sums the same sizes every step, and making
    them anew took a tenth of a 1 MB sum's time on its thread. At most ``KEPT`` of each."""

    KEPT = 1024

    def __init__(self, n: int, policy: Policy) -> None:
        self.n = n
        self.policy = policy
        self._bounds: dict[int, np.ndarray] = {}
        self._priorities: dict[tuple[int, ...], np.ndarray] = {}
        self._singles: dict[tuple[int, int, int], Layout] = {}

    def bounds(self, size: int) -> np.ndarray:
        """Where each of the ring's ``n`` chunks of a ``size``-element buffer starts, and its end."""
        out = self._bounds.get(size)
        if out is None:
            out = _kept(self._bounds, size, np.linspace(0, size, self.n + 1).astype(np.int64))
        return out

    def priorities(self, sizes: Sequence[int]) -> np.ndarray:
        """The policy's priorities for buffers of ``sizes`` (forward order)."""
        key = tuple(sizes)
        out = self._priorities.get(key)
        if out is None:
            out = _kept(self._priorities, key, layer_priorities(list(sizes), self.policy))
        return out

    def single(self, size: int, priority: int, layer: int) -> Layout:
        """An unfused buffer's layout."""
        key = (size, priority, layer)
        out = self._singles.get(key)
        if out is None:
            out = _kept(self._singles, key, Layout.single(size, priority, layer))
        return out


def _kept(table: dict, key: object, value: Any) -> Any:
    """``value``, kept in ``table`` under ``key`` (the table emptied once it holds
    :attr:`_Chunking.KEPT`); an array read-only, as every call shares it."""
    if isinstance(value, np.ndarray):
        value.flags.writeable = False
    if len(table) >= _Chunking.KEPT:
        table.clear()
    table[key] = value
    return value


def _fuse(flats: Sequence[np.ndarray], plan: Sequence[Bucket], scale: float = 1.0) -> list[np.ndarray]:
    """The tensors laid out in their buckets (float32), each times ``scale``, in one pass."""
    out = []
    for b in plan:
        buf = np.empty(b.total, dtype=np.float32)
        for t, off, size in zip(b.tensors, b.offsets, b.sizes):
            if scale == 1.0:
                buf[off : off + size] = flats[t]
            else:
                np.multiply(flats[t], np.float32(scale), out=buf[off : off + size], casting="unsafe")
        out.append(buf)
    return out


def _unfuse(results: Sequence[np.ndarray], plan: Sequence[Bucket], grads: Sequence[np.ndarray]) -> list[np.ndarray]:
    out: list[np.ndarray | None] = [None] * len(grads)
    for b, flat in zip(plan, results):
        for t, off, size in zip(b.tensors, b.offsets, b.sizes):
            out[t] = flat[off : off + size].reshape(np.shape(grads[t]))
    return out  # type: ignore[return-value]


class PSWorker:
    """A worker of a parameter-server job: push gradients, pull the average.

    Example: ``avg = PSWorker(ep, server_rank=4).exchange(it, grads)``
    """

    def __init__(self, endpoint: Endpoint, server_rank: int, policy: Policy | None = None,
                 timeout: float | None = None, fusion: FusionConfig = FusionConfig()) -> None:
        endpoint.config.peer(server_rank)
        self.ep = endpoint
        self.server = server_rank
        self.policy = policy or endpoint.policy
        self.timeout = endpoint.config.message_deadline if timeout is None else timeout
        self.last_stats: ExchangeStats | None = None
        self._planner = _Planner(fusion, self.policy)

    def plan(self, sizes: Sequence[int], priorities: Sequence[int] | None = None) -> list[Bucket]:
        """The buckets :meth:`exchange` sends for tensors of ``sizes`` (the server serves ``len`` of them)."""
        return self._planner.plan(sizes, priorities)

    def exchange(self, iteration: int, grads: Sequence[np.ndarray],
                 priorities: Sequence[int] | None = None) -> list[np.ndarray]:
        """Push ``grads`` (forward order) to the server and return the averages (float32, same shapes).

        The tensors travel fused into the buckets of :meth:`plan` (message ``b`` of the
        iteration is bucket ``b``), each packet with its layer's priority.

        Args:
            priorities: header priority per tensor instead of the policy's by position.

        Raises:
            TransportError: the server failed or a deadline passed (names peer and message).
        """
        flats = [_flat(g) for g in grads]
        plan = self.plan([f.size for f in flats], priorities)
        fused = _fuse(flats, plan)
        res = self.exchange_detailed(iteration, fused, [b.index for b in plan], [b.layout.top_priority for b in plan],
                                     [b.layout for b in plan])
        return _unfuse([avg for avg, _ in res], plan, grads)

    def announce(self, iteration: int, sizes: Sequence[int], tensor_ids: Sequence[int],
                 layouts: Sequence[Layout], dtype: np.dtype | type = np.float32) -> None:
        """Announce the pushes of an iteration to the server in one control frame, before their
        gradients exist; each is then exchanged with ``exchange_detailed(..., announced=True)``
        (arrays of ``dtype``)."""
        with self.ep.batch():
            for size, t, lay in zip(sizes, tensor_ids, layouts):
                self.ep.announce(self.server, message_id(iteration, t, 0), int(size), dtype,
                                 self.policy.loss_bound_push, lay.top_priority, iteration, t, lay.first_layer % 65536)

    def exchange_detailed(self, iteration: int, grads: Sequence[np.ndarray], tensor_ids: Sequence[int] | None = None,
                          priorities: Sequence[int] | None = None,
                          layouts: Sequence[Layout | None] | None = None,
                          announced: bool = False,
                          out: Sequence[np.ndarray] | None = None) -> list[tuple[np.ndarray, MessageStats]]:
        """Push each array as one message and pull its average, with each push's
        :class:`MessageStats` (which packets the server never got: ``lost_packets``). A float16
        (bfloat16) array travels as such both ways (the server sums in float32), half the bytes.

        ``layouts`` (one per array, or None) tags each packet with the priority of the layer it
        carries; ``announced``: :meth:`announce` already sent the pushes' METAs. Safe to call
        from several threads for different tensor ids.

        ``out`` (one per array): where the averages land, 1-D arrays of the pushes' sizes and
        element types, apart from the pushed arrays (a push may still be read while its average
        arrives). Reusing them from one iteration to the next spares fresh pages, whose
        first-touch faults cost a worker a fifth of its CPU; without ``out`` each average is a
        new array.
        """
        t0 = time.monotonic()
        flats = [_flat(g) for g in grads]
        ids = list(range(len(flats))) if tensor_ids is None else list(tensor_ids)
        prio = layer_priorities([f.size for f in flats], self.policy) if priorities is None else priorities
        _check_lengths(len(flats), ids, prio)
        outs = _check_pull_buffers(flats, out)
        lays = _layouts(len(flats), layouts)
        pulls = [self.ep.recv(self.server, message_id(iteration, t, 1), out=o,
                              expect=Expect(f.size, f.dtype, self.policy.loss_bound_pull, iteration=iteration))
                 for t, f, o in zip(ids, flats, outs)]
        pushes = [self.ep.send(self.server, f, message_id(iteration, t, 0), priority=int(pr),
                               loss_bound=self.policy.loss_bound_push, iteration=iteration, tensor_id=t,
                               layer=(lay.first_layer if lay is not None else t) % 65536, layout=lay,
                               announce=not announced)
                  for t, f, pr, lay in zip(ids, flats, prio, lays)]
        deadline = t0 + self.timeout
        done = wait_all([*pulls, *pushes], deadline)  # (one wake-up, as the ring's)
        results, sent = done[:len(pulls)], done[len(pulls):]
        self.last_stats = _summarise(ExchangeStats(iteration, time.monotonic() - t0), results, sent)
        return [(r.data.reshape(np.shape(g)), s) for r, g, s in zip(results, grads, sent)]


class PSServer:
    """The parameter server: average each tensor over the workers, send it back.

    It may run in its own process or beside a worker (its own :class:`Endpoint` and rank,
    in a thread of that worker's process).
    """

    def __init__(self, endpoint: Endpoint, workers: Sequence[int], policy: Policy | None = None,
                 missing: Missing = "zero", timeout: float | None = None) -> None:
        if missing not in ("zero", "present"):
            raise ValueError(f"missing must be 'zero' or 'present', got {missing!r}")
        for w in workers:
            endpoint.config.peer(w)
        self.ep = endpoint
        self.workers = list(workers)
        self.policy = policy or endpoint.policy
        self.missing: Missing = missing
        self.timeout = endpoint.config.message_deadline if timeout is None else timeout
        self.history: list[ExchangeStats] = []
        self._sizes: dict[int, int] = {}  # tensor -> elements, once seen
        self._dtypes: dict[int, np.dtype] = {}  # tensor -> the pushes' element type: the reply's
        self._banks: tuple[dict[int, np.ndarray], dict[int, np.ndarray]] = ({}, {})
        self._posted: dict[int, tuple] = {}  # iteration -> receives posted ahead (see serve_iteration)

    def serve_iteration(self, iteration: int, num_tensors: int, next_tensors: int | None = None) -> ExchangeStats:
        """Receive ``num_tensors`` messages from every worker, aggregate, reply.

        With fused workers a message is a bucket: pass ``len(worker.plan(sizes))``.

        A tensor is answered as soon as every worker's copy is complete; replies carry the
        tensor's priority (per packet, as the pushes carried it) and the pull bound, in the
        pushes' element type (float16 or bfloat16 pushes are summed in float32 and answered in their type). Once a
        tensor's size is known (after the first iteration) and missing elements count as zero,
        the workers' pushes are added into one buffer by the receive path as they arrive, so
        nothing is summed afterwards; the reply's drop classes are computed once for all workers.

        ``next_tensors``: the next iteration's receives are posted as soon as this one's pushes
        are in. A worker pushes again as soon as its reply arrives; a push that finds no receive
        posted is received into a fresh buffer and added afterwards, which costs the server.
        """
        t0 = time.monotonic()
        deadline = t0 + self.timeout
        n = len(self.workers)
        posted = self._posted.pop(iteration, None)
        if posted is not None and len(posted[0]) != num_tensors:
            raise ValueError(f"iteration {iteration} was posted for {len(posted[0])} tensors, not {num_tensors}")
        sums, pushes, done = posted if posted is not None else self._post(iteration, num_tensors)
        waiting = dict.fromkeys(range(num_tensors), n)
        replies: list[SendHandle] = []
        received: list[RecvResult] = []
        prio_of: dict[int, int] = {}
        keep: list[np.ndarray] = []  # replies converted to the pushes' type, alive until sent
        while waiting:
            try:
                t = done.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TransportTimeout(f"parameter server: iteration {iteration} not complete within "
                                       f"{self.timeout:g} s; waiting on tensors {sorted(waiting)[:8]}") from None
            waiting[t] -= 1
            if waiting[t]:
                continue
            del waiting[t]
            results = [pushes[(w, t)].wait(0) for w in self.workers]
            received.extend(results)
            if sums[t] is not None:  # added as it arrived: average in place
                agg = sums[t]
                agg *= np.float32(1.0 / n)
            else:
                agg = aggregate(results, n, self.missing)
                self._sizes[t] = agg.size
                self._dtypes[t] = results[0].data.dtype
            agg = _as_reply(agg, self._dtypes.get(t, agg.dtype), keep)
            priority = prio_of.setdefault(t, self._priority(results[0]))
            layout = _echo_layout(results)
            per = elems_per_packet(self.ep.config.mtu, agg.dtype)
            classes = payload_drop_classes(agg, per, self.policy)
            for w in self.workers:
                replies.append(self.ep.send(w, agg, message_id(iteration, t, 1), priority=priority,
                                            loss_bound=self.policy.loss_bound_pull, iteration=iteration, tensor_id=t,
                                            layer=layout.first_layer, layout=layout, announce=False,
                                            drop_classes=classes))
        if next_tensors is not None:  # (its bank's aggregates were sent in the previous iteration)
            self._posted[iteration + 1] = self._post(iteration + 1, next_tensors)
        sent = wait_all(replies, deadline)  # (the aggregates must outlive their sends: zero-copy)
        stats = _summarise(ExchangeStats(iteration, time.monotonic() - t0), received, sent)
        self.history.append(stats)
        return stats

    def _post(self, iteration: int, num_tensors: int
              ) -> tuple[list[np.ndarray | None], dict[tuple[int, int], RecvHandle], queue.SimpleQueue]:
        """Post the receives of every worker's push of ``iteration``: the sum buffers, the
        handles by (worker, tensor), and a queue that gets a tensor each time one completes."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        sums = self._sum_buffers(iteration, num_tensors)
        pushes: dict[tuple[int, int], RecvHandle] = {}
        for t in range(num_tensors):
            for w in self.workers:
                mid = message_id(iteration, t, 0)
                h = (self.ep.recv(w, mid, out=sums[t], accumulate=True) if sums[t] is not None
                     else self.ep.recv(w, mid))
                h.add_done_callback(_put_on_done(done, t))
                pushes[(w, t)] = h
        return sums, pushes, done

    def _sum_buffers(self, iteration: int, num_tensors: int) -> list[np.ndarray | None]:
        """A zeroed buffer per tensor whose size is known (None for the others, or for all when
        missing elements are averaged over the workers present): two sets, used in turn, so an
        iteration's aggregates stay untouched until their replies are done."""
        if self.missing != "zero":
            return [None] * num_tensors
        bank = self._banks[iteration % 2]
        out: list[np.ndarray | None] = []
        for t in range(num_tensors):
            size = self._sizes.get(t)
            if size is None:
                out.append(None)
                continue
            buf = bank.get(t)
            if buf is None or buf.size != size:
                buf = bank[t] = np.zeros(size, np.float32)
            else:
                buf.fill(0.0)
            out.append(buf)
        return out

    def serve(self, iterations: int, num_tensors: int, first_iteration: int = 0) -> list[ExchangeStats]:
        """Serve ``iterations`` consecutive iterations."""
        return [self.serve_iteration(first_iteration + i, num_tensors, num_tensors if i + 1 < iterations else None)
                for i in range(iterations)]

    def serve_forever(self, stop: threading.Event) -> None:
        """Serve whatever the workers push, until ``stop`` is set.

        For callers whose tensors are not known in advance (DDP buckets are rebuilt after the
        first iteration): a tensor is aggregated once every worker has pushed it under the
        same (iteration, tensor) id, and the average goes back to each of them.

        Raises:
            TransportError: a worker failed or a message passed its deadline.
        """
        arrivals = self.ep.announcements()
        pending: dict[int, dict[int, RecvHandle]] = {}
        keep: list[tuple[np.ndarray, list[SendHandle]]] = []
        while not stop.is_set():
            try:
                src, mid = arrivals.get(timeout=0.001)
            except queue.Empty:
                pass
            else:
                if step_of(mid) == 0 and src in self.workers:
                    pending.setdefault(mid, {})[src] = self.ep.recv(src, mid)
            for mid in [m for m, hs in pending.items() if len(hs) == len(self.workers)
                        and all(h.done() for h in hs.values())]:
                results = [h.wait(0) for h in pending.pop(mid).values()]
                agg = aggregate(results, len(self.workers), self.missing).astype(results[0].data.dtype, copy=False)
                reply = mid | (1 << 16)
                layout = _echo_layout(results)
                sends = [self.ep.send(w, agg, reply, priority=results[0].stats.priority,
                                      loss_bound=self.policy.loss_bound_pull, iteration=results[0].stats.iteration,
                                      tensor_id=tensor_of(mid), layer=layout.first_layer, layout=layout,
                                      announce=False) for w in self.workers]
                keep.append((agg, sends))
            keep = [(a, s) for a, s in keep if not all(h.done() for h in s)]  # replies still in flight

    @staticmethod
    def _priority(result: RecvResult) -> int:
        return result.stats.priority


def _as_reply(agg: np.ndarray, dtype: np.dtype, keep: list[np.ndarray]) -> np.ndarray:
    """``agg`` in the pushes' element type (a float32 sum of float16 pushes goes back as float16),
    kept in ``keep`` until its sends are done (they send from it without a copy)."""
    if agg.dtype == dtype:
        return agg
    out = agg.astype(dtype)
    keep.append(out)
    return out


def _echo_layout(results: Sequence[RecvResult]) -> Layout:
    """The per-packet layout of a reply: each packet keeps the priority and layer its pushes
    carried (the most urgent over the workers), so a fused average returns as it came."""
    per = results[0].elems_per_packet
    tagged = [(r.packet_priorities, r.packet_layers) for r in results
              if r.packet_priorities is not None and r.packet_layers is not None]
    if not tagged:  # no per-packet tags known: the message's own priority for every packet
        return Layout.single(results[0].data.size, results[0].stats.priority)
    prio, layers = tagged[0]
    for p, lay in tagged[1:]:
        prio = np.maximum(prio, p)
        layers = np.minimum(layers, lay)
    return Layout(np.arange(len(prio), dtype=np.int64) * per, prio.astype(np.int64), layers.astype(np.int64),
                  results[0].data.size)


GatherMode = Literal["direct", "ring"]


class RingAllreduce:
    """Ring allreduce over the transport: reduce-scatter around the ring, then all-gather, bound
    per chunk.

    ``ranks`` is the ring order, the same list on every member. Reduce-scatter steps use the
    push bound (missing elements of a partial sum count as zero); all-gather steps use the
    pull bound (0 by default, so every member ends with the same result).

    ``gather``: ``"ring"`` (default) forwards each reduced chunk around the ring in n-1 steps,
    as gloo and NCCL do and as the simulator models it; ``"direct"`` has each chunk's owner send
    it to every other member at once. Both move the same bytes in and out of every host, but a
    reliable all-gather recovers its losses: around the ring each step waits for the previous
    one's recovery (up to n-1 recovery rounds in a row), direct sends recover side by side.

    ``classify``: packets take their drop classes from the gradients' magnitudes (the policy's
    rule); ``False`` for data that is not a gradient: every packet in class 0, none computed.

    Example: ``avg = RingAllreduce(ep, ranks=[0, 1, 2, 3]).allreduce(it, grads)``
    """

    def __init__(self, endpoint: Endpoint, ranks: Sequence[int], policy: Policy | None = None,
                 timeout: float | None = None, fusion: FusionConfig = FusionConfig(),
                 gather: GatherMode = "ring", classify: bool = True) -> None:
        if gather not in ("direct", "ring"):
            raise ValueError(f"gather must be 'direct' or 'ring', not {gather!r}")
        ranks = list(ranks)
        if len(set(ranks)) != len(ranks) or endpoint.rank not in ranks:
            raise ValueError(f"ring {ranks} must list distinct ranks including this endpoint's ({endpoint.rank})")
        if 2 * (len(ranks) - 1) > MAX_STEPS:
            raise ValueError(f"a ring of {len(ranks)} needs {2 * (len(ranks) - 1)} steps; at most {MAX_STEPS}")
        for r in ranks:
            endpoint.config.peer(r)
        self.ep = endpoint
        self.ranks = ranks
        self.n = len(ranks)
        self.pos = ranks.index(endpoint.rank)
        self.right = ranks[(self.pos + 1) % self.n]
        self.left = ranks[(self.pos - 1) % self.n]
        self.policy = policy or endpoint.policy
        self.timeout = endpoint.config.message_deadline if timeout is None else timeout
        self.gather = gather
        self.classify = classify
        self.last_stats: ExchangeStats | None = None
        self._planner = _Planner(fusion, self.policy)
        self._chunking = _Chunking(self.n, self.policy)
        self._spare: dict[tuple[int, str], list[np.ndarray]] = {}  # snapshots by (size, dtype), reused
        self._spare_lock = threading.Lock()

    def plan(self, sizes: Sequence[int], priorities: Sequence[int] | None = None) -> list[Bucket]:
        """The buckets :meth:`allreduce` reduces for tensors of ``sizes``."""
        return self._planner.plan(sizes, priorities)

    def allreduce(self, iteration: int, grads: Sequence[np.ndarray],
                  priorities: Sequence[int] | None = None) -> list[np.ndarray]:
        """Average ``grads`` (forward order) over the ring; every member returns the same arrays (float32).

        The tensors travel fused into the buckets of :meth:`plan`, each packet with its
        layer's priority; ``priorities`` replaces the policy's priorities by position.
        """
        flats = [_flat(g) for g in grads]
        plan = self.plan([f.size for f in flats], priorities)
        bufs = _fuse(flats, plan, 1.0 / self.n)  # scaled as they are copied: no pass to divide at the end
        self._ring(iteration, bufs, [b.index for b in plan], [b.layout.top_priority for b in plan],
                   [b.layout for b in plan])
        return _unfuse(bufs, plan, grads)

    def allreduce_inplace(self, iteration: int, buffers: Sequence[np.ndarray], tensor_ids: Sequence[int] | None = None,
                          priorities: Sequence[int] | None = None, layouts: Sequence[Layout | None] | None = None,
                          lost_values: bool = True) -> list[tuple[np.ndarray, np.ndarray]]:
        """Average each of ``buffers`` (contiguous 1-D float32, a DDP bucket's, say) over the
        ring in place, as DDP's own allreduce hook does with its buckets; returns what each
        buffer's reduce-scatter sends lost, as :meth:`allreduce_detailed` does. A float16
        (bfloat16) buffer travels and is summed in its type (``fp16_compress_hook``'s arithmetic).

        ``lost_values=False``: the lost values come back as zeros (their indices stay right).
        Keeping them costs a copy of every partial sum sent, which only error feedback needs.

        Example: ``ring.allreduce_inplace(it, [bucket])``
        """
        _check_inplace(buffers, "allreduce_inplace")
        if self.n > 1 and all(b.dtype == np.float32 for b in buffers):
            # the division rides on the reduce-scatter: each receive multiplies the chunk it adds
            # into by 1/n as it adds (out * (1/n) + partial sum, the same float32 operations as
            # dividing first), and only the chunk sent first is divided beforehand: no pass of
            # its own over the other chunks
            return self._ring(iteration, list(buffers), tensor_ids, priorities, layouts, lost_values,
                              scale=float(np.float32(1.0 / self.n)))
        for b in buffers:  # (all checked first: a bad one changes none)
            if b.dtype != np.float32:
                b /= b.dtype.type(self.n)  # in its own type, as fp16_compress_hook divides its half bucket
            else:
                b *= np.float32(1.0 / self.n)
        return self._ring(iteration, list(buffers), tensor_ids, priorities, layouts, lost_values)

    def sum_inplace(self, iteration: int, buffers: Sequence[np.ndarray], tensor_ids: Sequence[int] | None = None,
                    priorities: Sequence[int] | None = None, layouts: Sequence[Layout | None] | None = None,
                    lost_values: bool = False) -> list[tuple[np.ndarray, np.ndarray]]:
        """Sum each of ``buffers`` (contiguous 1-D float32, float16 or bfloat16) over the ring in place, unscaled: a
        ``torch.distributed`` SUM. Returns what was lost, as :meth:`allreduce_inplace` does."""
        _check_inplace(buffers, "sum_inplace")
        return self._ring(iteration, list(buffers), tensor_ids, priorities, layouts, lost_values)

    def allreduce_detailed(self, iteration: int, grads: Sequence[np.ndarray], tensor_ids: Sequence[int] | None = None,
                           priorities: Sequence[int] | None = None, layouts: Sequence[Layout | None] | None = None,
                           lost_values: bool = True) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """As :meth:`allreduce`, with what this member's reduce-scatter sends lost, per tensor:
        (average, flat indices, the partial-sum values sent there). Error feedback re-injects
        those values, which keeps the ring's sum over iterations whole. The inputs are not changed."""
        bufs = [_flat(g).astype(np.float32) * np.float32(1.0 / self.n) for g in grads]  # scaled working copies
        lost = self._ring(iteration, bufs, tensor_ids, priorities, layouts, lost_values)
        return [(b.reshape(np.shape(g)), idx, vals) for b, g, (idx, vals) in zip(bufs, grads, lost)]

    def _ring(self, iteration: int, bufs: list[np.ndarray], tensor_ids: Sequence[int] | None,
              priorities: Sequence[int] | None, layouts: Sequence[Layout | None] | None,
              lost_values: bool = True, scale: float = 1.0) -> list[tuple[np.ndarray, np.ndarray]]:
        """Sum ``bufs`` (float32, float16 or bfloat16, each already divided by the ring's size) over the ring,
        in place; returns per buffer what its reduce-scatter sends lost: (flat indices, float32
        values in the inputs' units, zeros unless ``lost_values``). Each buffer travels in its
        own element type and is summed in it.

        How it runs: every step of every tensor is handed to the transport at once. Each step's
        send waits in the data path until the step before it has been received, and then starts
        from there, without a round trip through Python; reduce-scatter receives add each packet
        into the buffer as it arrives (exactly once), so a chunk is reduced while the next one is
        still on the wire. The last reduce-scatter receive starts the all-gather sends of the
        chunk it completed. Python only waits for the results.

        ``scale`` (float32 buffers, a data path that supports it): every element is multiplied by
        it before it is summed, as if the buffers had been scaled first: the chunk each member
        sends first is scaled here, the others by the reduce-scatter receives that add into them.
        """
        t0 = time.monotonic()
        deadline = t0 + self.timeout
        none = (np.zeros(0, np.int64), np.zeros(0, np.float32))
        if self.n == 1:
            return [none for _ in bufs]
        ids = list(range(len(bufs))) if tensor_ids is None else list(tensor_ids)
        prio = self._chunking.priorities([b.size for b in bufs]) if priorities is None else priorities
        _check_lengths(len(bufs), ids, prio)
        lays = [lay if lay is not None else self._chunking.single(b.size, int(pr), t)
                for t, (b, pr, lay) in enumerate(zip(bufs, prio, _layouts(len(bufs), layouts)))]
        bounds = [self._chunking.bounds(b.size) for b in bufs]
        # a partial sum's chunk is overwritten by the all-gather later: keep what was sent, for
        # the values a loss took (only a bounded push can lose any, and only error feedback asks)
        keep_sent = lost_values and self.policy.loss_bound_push > 0
        n, i = self.n, self.pos
        rs_steps = n - 1
        recvs: list[RecvHandle] = []
        sends: list[tuple[int, SendHandle, np.ndarray | None, int]] = []  # (tensor, handle, snapshot, chunk start)
        snaps: list[np.ndarray] = []
        push, pull = self.policy.loss_bound_push, self.policy.loss_bound_pull

        def chunk_of(t: int, c: int) -> tuple[int, int, Layout]:
            lo, hi = int(bounds[t][c]), int(bounds[t][c + 1])
            return lo, hi, lays[t].slice(lo, hi)

        def send(t: int, dest: int, c: int, step: int, gather: bool, held: bool) -> None:
            lo, hi, chunk = chunk_of(t, c)
            snap = self._take_spare(hi - lo, bufs[t].dtype) if keep_sent and not gather else None
            if snap is not None:
                snaps.append(snap)
            h = self.ep.send(dest, bufs[t][lo:hi], message_id(iteration, ids[t], step),
                             priority=lays[t].top_priority,  # (a chunk's rank among messages: its bucket's)
                             loss_bound=pull if gather else push, iteration=iteration, tensor_id=ids[t],
                             layer=chunk.first_layer % 65536, layout=chunk, announce=False, held=held,
                             snapshot=snap, classify=self.classify)
            sends.append((-1 if gather else t, h, snap, lo))

        def recv(t: int, src: int, c: int, step: int, gather: bool, then: tuple[tuple[int, int], ...]) -> None:
            lo, hi, _ = chunk_of(t, c)
            recvs.append(self.ep.recv(src, message_id(iteration, ids[t], step), out=bufs[t][lo:hi],
                                      expect=Expect(hi - lo, bufs[t].dtype, pull if gather else push,
                                                    iteration=iteration, accumulate=not gather, then_send=then,
                                                    scale=1.0 if gather else scale, classify=self.classify)))

        others = [self.ranks[(i + k) % n] for k in range(1, n)]  # from the right neighbour on

        def rs_recv(t: int, step: int) -> None:
            """Reduce-scatter step ``step``'s receive, which starts the send that forwards its chunk."""
            tid = ids[t]
            if step + 1 < rs_steps:
                then: tuple[tuple[int, int], ...] = ((self.right, message_id(iteration, tid, step + 1)),)
            elif self.gather == "direct":
                then = tuple((d, message_id(iteration, tid, rs_steps)) for d in others)
            else:
                then = ((self.right, message_id(iteration, tid, rs_steps)),)
            recv(t, self.left, (i - step - 1) % n, step, gather=False, then=then)

        for t in range(len(bufs)):
            tid = ids[t]
            if scale != 1.0:  # the chunk sent at step 0 (the receives scale the others)
                lo, hi, _ = chunk_of(t, i)
                bufs[t][lo:hi] *= np.float32(scale)
            # Reduce-scatter step s sends chunk (i - s) and receives chunk (i - s - 1), which it
            # adds to and forwards at step s + 1; after n - 1 steps chunk (i + 1) is whole here.
            # Every send but the first is held until the receive that names it completes (one
            # that completes before its send is handed over starts it at once).
            # The first receive before any send: the left neighbour's first chunk is on its way
            # as soon as that rank starts, and what comes before its receive is set up is parked
            # (copied aside, placed later): 5 % of a 4-rank 57 MB all_reduce's packets when the
            # receives followed the six sends.
            rs_recv(t, 0)
            for step in range(rs_steps):
                send(t, self.right, (i - step) % n, step, gather=False, held=step > 0)
            if self.gather == "direct":
                for dest in others:
                    send(t, dest, (i + 1) % n, rs_steps, gather=True, held=True)
            else:
                for s in range(n - 1):
                    send(t, self.right, (i + 1 - s) % n, rs_steps + s, gather=True, held=True)
            for step in range(1, rs_steps):
                rs_recv(t, step)
            if self.gather == "direct":
                for k, src in enumerate(others):  # the owner of chunk (pos + 1) sends it
                    recv(t, src, (i + k + 2) % n, rs_steps, gather=True, then=())
            else:
                for s in range(n - 1):
                    then = ((self.right, message_id(iteration, tid, rs_steps + s + 1)),) if s + 1 < n - 1 else ()
                    recv(t, self.left, (i - s) % n, rs_steps + s, gather=True, then=then)
        done = wait_all([*recvs, *(h for _, h, _, _ in sends)], deadline)  # (one wake-up: wait_all)
        received, sent_stats = done[:len(recvs)], done[len(recvs):]
        lost: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in bufs]
        for (t, _, snap, lo), st in zip(sends, sent_stats):
            if t >= 0 and st.lost_packets is not None:  # a partial sum went missing: what it held
                local = lost_elements(st.lost_packets, elems_per_packet(self.ep.config.mtu, bufs[t].dtype), st.elements)
                vals = (snap[local].astype(np.float32) * np.float32(n) if snap is not None
                        else np.zeros(len(local), np.float32))
                lost[t].append((local + lo, vals))
        self._give_spares(snaps)
        self.last_stats = _summarise(ExchangeStats(iteration, time.monotonic() - t0), received, sent_stats)
        return [(np.concatenate([x for x, _ in ls]), np.concatenate([v for _, v in ls])) if ls else none
                for ls in lost]

    def _take_spare(self, size: int, dtype: np.dtype) -> np.ndarray:
        """A buffer of ``size`` elements of ``dtype`` for a snapshot: a reused one (fresh pages
        cost their first-touch faults on every iteration)."""
        with self._spare_lock:
            free = self._spare.get((size, dtype.str))
            if free:
                return free.pop()
        return np.empty(size, dtype)

    def _give_spares(self, snaps: list[np.ndarray]) -> None:
        with self._spare_lock:
            for a in snaps:
                free = self._spare.setdefault((a.size, a.dtype.str), [])
                if len(free) < 4 * self.n:
                    free.append(a)
