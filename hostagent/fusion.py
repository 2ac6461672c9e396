"""Tensor fusion: pack an iteration's gradients into a few buckets, keeping each packet's layer priority.

Why: one message per tensor makes an iteration hundreds of messages, most smaller than one
packet (ResNet-50 has 161 tensors, 107 of them biases and norms), and every message costs
control frames and scheduling. Real training fuses gradients into buckets (PyTorch DDP: 25 MB,
the first 1 MB so communication starts early; Horovod and BytePS fuse likewise). Fusion alone
would throw away DLCP's per-layer priority, so a fused message carries a :class:`Layout`
(where each tensor starts and its layer's priority) and every packet is tagged with the most
urgent layer it holds (:func:`dlcp.hostagent.policy.packet_tags`).

Pure planning (:func:`plan_buckets`) is separate from the run-time packing (:class:`Bucketer`),
which copies each gradient into its bucket as it becomes ready and says when a bucket is full.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence

import numpy as np

from dlcp.hostagent.policy import packet_tags

#: PyTorch DDP's defaults (``bucket_cap_mb=25``; the first bucket is 1 MB).
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024


@dataclass(frozen=True)
class FusionConfig:
    """How gradients are packed into messages.

    A bucket closes once it holds at least its cap (DDP's rule: the tensor that crosses the cap
    stays in, so a tensor larger than the cap is a bucket of its own).
    """

    enabled: bool = True
    """False: one message per tensor (the ablation without fusion)."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Cap of every bucket after the first."""
    first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES
    """Cap of the first bucket (the last layers' gradients, ready first), small so sending starts early."""

    def __post_init__(self) -> None:
        if self.bucket_bytes <= 0 or self.first_bucket_bytes <= 0:
            raise ValueError(f"FusionConfig caps must be positive, got bucket_bytes={self.bucket_bytes}, "
                             f"first_bucket_bytes={self.first_bucket_bytes}")

    def scaled(self, scale: float, min_bytes: int = 0) -> FusionConfig:
        """The caps multiplied by ``scale`` (as a workload scaled by ``scale``), at least ``min_bytes``.

        The testbed shrinks models by ``--scale``; scaling the caps the same way keeps the
        number of buckets of the real model, and the floor keeps a bucket from being smaller
        than a few packets.
        """
        if scale <= 0:
            raise ValueError(f"scale must be positive, got {scale}")
        return FusionConfig(self.enabled, max(min_bytes, round(self.bucket_bytes * scale)),
                            max(min_bytes, round(self.first_bucket_bytes * scale)))


@dataclass(frozen=True)
class Layout:
    """Which layer each element range of a fused message belongs to.

    Segment ``i`` covers ``[starts[i], starts[i+1])`` (the last up to ``total``) and has the
    priority and layer index of its tensor.
    """

    starts: np.ndarray
    priorities: np.ndarray
    layers: np.ndarray
    total: int
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """Slices and packet tags already computed: a bucket's layout serves every iteration, and a
    ring slices it into the same chunks and cuts them into the same packets each time."""

    @staticmethod
    def single(total: int, priority: int, layer: int = 0) -> Layout:
        """One segment: an unfused message."""
        return Layout(np.zeros(1, np.int64), np.array([priority], np.int64), np.array([layer], np.int64), total)

    @staticmethod
    def of_sizes(sizes: Sequence[int], priorities: Sequence[int], layers: Sequence[int]) -> Layout:
        """Segments of the given sizes laid end to end."""
        sizes_a = np.asarray(sizes, np.int64)
        starts = (np.concatenate([[0], np.cumsum(sizes_a)[:-1]]).astype(np.int64) if sizes_a.size
                  else np.zeros(1, np.int64))
        pr = np.asarray(priorities, np.int64) if sizes_a.size else np.zeros(1, np.int64)
        ly = np.asarray(layers, np.int64) if sizes_a.size else np.zeros(1, np.int64)
        return Layout(starts, pr, ly, int(sizes_a.sum()))

    @property
    def top_priority(self) -> int:
        """The most urgent priority in the message (what it is scheduled by among messages).
        Kept in the cache: a ring asks it of every chunk it sends, each call (a numpy
        reduction each time was a tenth of a 1 MB all_reduce's Python on its thread)."""
        top = self._cache.get("top_priority")
        if top is None:
            top = self._cache["top_priority"] = int(self.priorities.max()) if self.priorities.size else 0
        return top

    @property
    def first_layer(self) -> int:
        first = self._cache.get("first_layer")
        if first is None:
            first = self._cache["first_layer"] = int(self.layers.min()) if self.layers.size else 0
        return first

    def uniform(self, priority: int, layer: int) -> bool:
        """Whether every packet takes ``priority`` and ``layer`` (one segment of those): then a
        message's own priority and layer tag every packet, with no per-packet arrays to make
        (a ring chunk of one tensor, on every step of every call)."""
        return (self.starts.size == 1 and int(self.priorities[0]) == priority
                and int(self.layers[0]) % 65536 == layer % 65536)

    def slice(self, lo: int, hi: int) -> Layout:
        """The layout of elements ``[lo, hi)`` (a ring chunk), rebased to start at 0."""
        if not 0 <= lo <= hi <= self.total:
            raise ValueError(f"slice [{lo}, {hi}) outside the message's {self.total} elements")
        key = ("slice", lo, hi)
        out = self._cache.get(key)
        if out is None:
            first = int(np.searchsorted(self.starts, lo, side="right")) - 1
            last = int(np.searchsorted(self.starts, hi, side="left"))
            starts = np.maximum(self.starts[first:last], lo) - lo
            out = self._cache[key] = Layout(starts, self.priorities[first:last], self.layers[first:last], hi - lo)
        return out

    def packet_tags(self, elems_per_packet: int) -> tuple[np.ndarray, np.ndarray]:
        """(priority, layer) of every packet when the message is cut every ``elems_per_packet``
        (read-only arrays: computed once per layout and cut)."""
        key = ("tags", elems_per_packet)
        out = self._cache.get(key)
        if out is None:
            prio, layers = packet_tags(self.starts, self.priorities, self.layers, self.total, elems_per_packet)
            prio.flags.writeable = False
            layers.flags.writeable = False
            out = self._cache[key] = (prio, layers)
        return out


@dataclass(frozen=True)
class Bucket:
    """One fused message of an iteration: which tensors, where each sits, and their layout."""

    index: int
    tensors: tuple[int, ...]
    """Tensor indices (the caller's numbering, forward order), in the order they are packed."""
    offsets: tuple[int, ...]
    """Element offset of each tensor in the bucket."""
    sizes: tuple[int, ...]
    layout: Layout = field(repr=False)

    @property
    def total(self) -> int:
        return self.layout.total


def plan_buckets(sizes: Sequence[int], priorities: Sequence[int], ready_order: Sequence[int] | None = None,
                 config: FusionConfig = FusionConfig(), itemsize: int = 4,
                 layers: Sequence[int] | None = None) -> list[Bucket]:
    """Assign tensors to buckets, in the order they become ready.

    Args:
        sizes: elements of each tensor, indexed by tensor (forward order: 0 nearest the input).
        priorities: priority of each tensor's layer.
        ready_order: tensor indices in the order backward produces them (default: from the last
            tensor to the first, as backward does).
        config: caps; with ``enabled=False`` every tensor is a bucket of its own.
        itemsize: bytes per element.
        layers: layer index of each tensor (default: the tensor index).

    Returns:
        Buckets in the order they fill; every tensor is in exactly one.

    Example: ``plan_buckets([4, 4, 4], [2, 1, 0], config=FusionConfig(bucket_bytes=32, first_bucket_bytes=16))``
    -> two buckets, tensors (2, 1) and (0,)
    """
    n = len(sizes)
    if len(priorities) != n or (layers is not None and len(layers) != n):
        raise ValueError(f"{n} tensor sizes need as many priorities and layers")
    order = list(range(n - 1, -1, -1)) if ready_order is None else [int(t) for t in ready_order]
    if sorted(order) != list(range(n)):
        raise ValueError(f"ready_order must list every tensor 0..{n - 1} once")
    layers = list(range(n)) if layers is None else [int(x) for x in layers]
    groups: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for t in order:
        current.append(t)
        filled += int(sizes[t]) * itemsize
        cap = config.first_bucket_bytes if not groups else config.bucket_bytes
        if not config.enabled or filled >= cap:
            groups.append(current)
            current, filled = [], 0
    if current:
        groups.append(current)
    buckets = []
    for i, members in enumerate(groups):
        msizes = [int(sizes[t]) for t in members]
        offsets = np.concatenate([[0], np.cumsum(msizes)[:-1]]).astype(int).tolist()
        layout = Layout.of_sizes(msizes, [int(priorities[t]) for t in members], [layers[t] for t in members])
        buckets.append(Bucket(i, tuple(members), tuple(offsets), tuple(msizes), layout))
    return buckets


class Bucketer:
    """Run-time packing: copy each ready gradient into its bucket; report buckets that filled.

    One copy per gradient (into a buffer that is reused every iteration), as DDP's reducer
    does; the fused buffer is then sent without further copies.

    Example::

        b = Bucketer(plan_buckets(sizes, prio))
        for t in ready_order:
            for bucket, flat in b.add(t, grads[t]):
                start_exchange(bucket, flat)
    """

    def __init__(self, buckets: Sequence[Bucket], dtype: np.dtype | type = np.float32) -> None:
        self.buckets = list(buckets)
        self._where: dict[int, tuple[int, int, int]] = {}
        for b in self.buckets:
            for t, off, size in zip(b.tensors, b.offsets, b.sizes):
                self._where[t] = (b.index, off, size)
        self._buffers = [np.zeros(b.total, dtype=dtype) for b in self.buckets]
        self._missing = [len(b.tensors) for b in self.buckets]
        self._seen: set[int] = set()

    def reset(self) -> None:
        """Start a new iteration (the buffers are reused: results handed out earlier are overwritten)."""
        self._missing = [len(b.tensors) for b in self.buckets]
        self._seen.clear()

    def add(self, tensor: int, grad: np.ndarray) -> list[tuple[Bucket, np.ndarray]]:
        """Pack ``grad`` (any shape, ``size`` elements as planned); returns the buckets it completed.

        Raises:
            ValueError: an unknown tensor, a wrong size, or the same tensor twice in one iteration.
        """
        if tensor not in self._where:
            raise ValueError(f"tensor {tensor} is in no bucket (planned tensors: 0..{len(self._where) - 1})")
        if tensor in self._seen:
            raise ValueError(f"tensor {tensor} was added twice in one iteration; call reset() between iterations")
        b, off, size = self._where[tensor]
        flat = np.asarray(grad).reshape(-1)
        if flat.size != size:
            raise ValueError(f"tensor {tensor} has {flat.size} elements; its bucket planned {size}")
        self._buffers[b][off : off + size] = flat
        self._seen.add(tensor)
        self._missing[b] -= 1
        return [(self.buckets[b], self._buffers[b])] if self._missing[b] == 0 else []

    def unpack(self, bucket: Bucket, flat: np.ndarray) -> dict[int, np.ndarray]:
        """The tensors of ``bucket`` as views of ``flat`` (a bucket-sized result)."""
        if flat.size != bucket.total:
            raise ValueError(f"bucket {bucket.index} has {bucket.total} elements, got {flat.size}")
        return {t: flat[off : off + size] for t, off, size in zip(bucket.tensors, bucket.offsets, bucket.sizes)}
