"""DLCP's tagging and completion policy: one config object and pure functions on it.

The :class:`Policy` is read by everyone who needs a policy fact: the host agent (which
priority and drop class a packet gets, when a message is complete), the controller (the
switch's priority map, drop and ECN thresholds, load-balancing mode) and the reports.
It is loaded from YAML or JSON by :func:`load_policy` and nowhere else.

Everything here is pure: numpy arrays and a ``Policy`` in, arrays or numbers out; no
sockets, clocks or global random state, so every rule can be tested on hand-checked
examples.

Conventions (shared with the P4 program):

* **priority**: ``0..num_priorities-1``, *higher is served first* (BMv2's order). Layers
  nearest the input get the highest priority, because the next forward pass needs their
  parameters first (TicTac, P3, ByteScheduler).
* **drop class**: ``0..num_drop_classes-1``; class 0 is never dropped selectively and also
  carries control packets and retransmissions; the highest class holds the smallest
  gradients and is dropped first.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import yaml

from dlcp.hostagent.errors import DlcpUserError
from dlcp.hostagent.ranges import Range

#: v1model's ``standard_metadata.priority`` is 3 bits: at most 8 queues.
MAX_PRIORITIES = 8
#: Drop classes the switch distinguishes (one threshold register slot each).
MAX_DROP_CLASSES = 8
#: BMv2's ``enq_qdepth`` is 19 bits wide: the largest queue depth a threshold can name.
MAX_QUEUE_DEPTH = (1 << 19) - 1
#: Drop class of control packets and retransmissions: never dropped selectively.
PROTECTED_CLASS = 0
#: A loss bound p (push or pull): at most half a message may be missing.
LOSS_BOUND_MAX = 0.5
LOSS_BOUND = Range(0.0, LOSS_BOUND_MAX)

BandStrategy = Callable[[np.ndarray, int], np.ndarray]
"""Maps per-layer sizes (in input-to-output order) and a band count to a band per layer
(0 = the band needed first)."""


class PolicyError(DlcpUserError, ValueError):
    """An invalid policy value; the message names the field, the value and what is allowed."""

    exit_code = 2  # the user's input (a file, an option) is wrong: a usage error


def _equal_layers(layer_sizes: np.ndarray, bands: int) -> np.ndarray:
    """Same number of layers in each band (the first layers take the first band)."""
    n = len(layer_sizes)
    return (np.arange(n) * bands) // max(n, 1)


def _equal_bytes(layer_sizes: np.ndarray, bands: int) -> np.ndarray:
    """About the same number of bytes in each band: a layer's band is where it starts."""
    sizes = np.asarray(layer_sizes, dtype=np.float64)
    total = sizes.sum()
    if total <= 0:
        return np.zeros(len(sizes), dtype=np.int64)
    start = np.concatenate(([0.0], np.cumsum(sizes)[:-1]))
    return np.minimum((start * bands / total).astype(np.int64), bands - 1)


#: Band strategies by name; :func:`register_band_strategy` adds more.
BAND_STRATEGIES: dict[str, BandStrategy] = {
    "equal_layers": _equal_layers,
    "equal_bytes": _equal_bytes,
}

#: Per-packet magnitude measures by name. L2 is the default because dropping a packet
#: loses exactly its L2 norm from the gradient.
MAGNITUDES = ("l2", "maxabs")
#: How a switch spreads DLCP data packets over an ECMP group.
LB_MODES = ("round_robin", "random", "flow")
#: Which backlog a port compares with ``ecn_threshold``: the packets queued at the packet's own
#: priority and above, or the whole port's.
ECN_BACKLOGS = ("ahead", "port")

#: The exchange patterns a job's gradients take: a parameter server
#: (:class:`dlcp.hostagent.exchange.PSServer`) or ring allreduce (:class:`dlcp.hostagent.exchange.RingAllreduce`).
#: Defined here, in a light module, for the shim, the testbed, the simulator and their flags.
PATTERNS = ("ps", "ring")


def register_band_strategy(name: str, fn: BandStrategy) -> None:
    """Make ``fn`` selectable as ``Policy(band_strategy=name)``.

    Example: ``register_band_strategy("first_only", lambda s, b: np.zeros(len(s), int))``
    """
    if not name or not callable(fn):
        raise ValueError("a band strategy needs a non-empty name and a callable")
    BAND_STRATEGIES[name] = fn


def _check_range(name: str, value: Any, lo: float, hi: float, kind: type = int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise PolicyError(f"policy.{name}: expected {kind.__name__}, got {value!r}")
    if not lo <= value <= hi:
        raise PolicyError(f"policy.{name}={value!r} is out of range [{lo}, {hi}]")


@dataclass(frozen=True)
class Policy:
    """How DLCP tags, queues, drops and completes gradient messages.

    Frozen: make a changed copy with :func:`dataclasses.replace`, never mutate.
    """

    num_priorities: int = 8
    """Priority levels hosts use (1..8). Header priorities are ``0..num_priorities-1``."""

    band_strategy: str = "equal_layers"
    """How layers are grouped into priority bands: a name in :data:`BAND_STRATEGIES`."""

    num_drop_classes: int = 4
    """Drop classes per message (1..8). 1 means nothing is droppable."""

    drop_class_shares: tuple[float, ...] | None = None
    """Share of a message's packets in each class, class 0 first; sums to 1. ``None`` means
    equal shares (per-message quantiles of packet magnitude)."""

    magnitude: str = "l2"
    """Per-packet magnitude used for drop classes: ``l2`` (norm) or ``maxabs``."""

    drop_thresholds: tuple[int, ...] = (48, 32, 16)
    """Queue depth (packets, as BMv2's ``enq_qdepth``) above which a packet of class 1, 2, ...
    is dropped; one per droppable class (``num_drop_classes - 1`` values), non-increasing so
    less important classes go first. Class 0 has none: it is never dropped selectively."""

    ecn_threshold: int = 20
    """Queue depth above which ECN-capable packets are marked CE."""

    ecn_backlog: str = "ahead"
    """What ``ecn_threshold`` is compared with: ``ahead``, the backlog at the packet's priority
    and above, or ``port``, the port's whole backlog (every priority). Strict priority decides
    the order of service and the drops either way; this only decides whom ECN slows down.

    The trade-off: with ``ahead`` a sender whose packets ride the high priorities sees few marks
    in an incast and keeps its rate while the low priorities behind it fill the buffer; with
    ``port`` every sender backs off for any backlog, including other tenants' lower-priority
    traffic, so gradients give up some of the share strict priority gives them (figures:
    docs/results/ecn-rule.md). ``ahead`` is the
    default, the rule the testbed's figures ran under; ``dlcp run`` and ``dlcp sim`` take
    ``--ecn-backlog`` to compare both."""

    loss_bound_push: float = 0.05
    """p for gradient push: a message completes once >= (1-p) of its elements arrived."""

    loss_bound_pull: float = 0.0
    """p for parameter pull; 0 makes the pull fully reliable."""

    priority_map: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 7)
    """Switch queue (v1model priority 0..7) for each header priority; ``num_priorities`` values."""

    dscp: tuple[int, ...] = (0, 8, 16, 24, 32, 40, 48, 56)
    """DSCP written into the IP header per priority, so commodity switches can queue by it."""

    lb_mode: str = "round_robin"
    """How switches spread DLCP data packets over an ECMP group: ``round_robin`` or ``random`` per
    packet, or ``flow`` (5-tuple hash, no spraying: the baseline)."""

    def __post_init__(self) -> None:
        # YAML and JSON give lists; store tuples so the policy stays hashable and frozen.
        for name in ("drop_class_shares", "drop_thresholds", "priority_map", "dscp"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        self._validate()

    def _validate(self) -> None:
        _check_range("num_priorities", self.num_priorities, 1, MAX_PRIORITIES)
        if self.band_strategy not in BAND_STRATEGIES:
            raise PolicyError(
                f"policy.band_strategy={self.band_strategy!r} is unknown; one of {sorted(BAND_STRATEGIES)}"
            )
        _check_range("num_drop_classes", self.num_drop_classes, 1, MAX_DROP_CLASSES)
        if self.drop_class_shares is not None:
            shares = self.drop_class_shares
            if not isinstance(shares, tuple) or len(shares) != self.num_drop_classes:
                raise PolicyError(
                    f"policy.drop_class_shares={shares!r} must have num_drop_classes="
                    f"{self.num_drop_classes} values"
                )
            for i, s in enumerate(shares):
                _check_range(f"drop_class_shares[{i}]", s, 0.0, 1.0, float)
            if not math.isclose(sum(shares), 1.0, abs_tol=1e-6):
                raise PolicyError(f"policy.drop_class_shares={shares!r} sums to {sum(shares)}, not 1")
        if self.magnitude not in MAGNITUDES:
            raise PolicyError(f"policy.magnitude={self.magnitude!r} is unknown; one of {list(MAGNITUDES)}")
        if not isinstance(self.drop_thresholds, tuple) or len(self.drop_thresholds) != self.num_drop_classes - 1:
            raise PolicyError(
                f"policy.drop_thresholds={self.drop_thresholds!r} must have num_drop_classes-1="
                f"{self.num_drop_classes - 1} values (class 0 is never dropped)"
            )
        for i, t in enumerate(self.drop_thresholds):
            _check_range(f"drop_thresholds[{i}] (class {i + 1})", t, 1, MAX_QUEUE_DEPTH)
        for i in range(1, len(self.drop_thresholds)):
            if self.drop_thresholds[i] > self.drop_thresholds[i - 1]:
                raise PolicyError(
                    f"policy.drop_thresholds={self.drop_thresholds!r}: class {i + 1}'s threshold "
                    f"{self.drop_thresholds[i]} is above class {i}'s {self.drop_thresholds[i - 1]}; "
                    "less important classes must be dropped first (non-increasing)"
                )
        _check_range("ecn_threshold", self.ecn_threshold, 1, MAX_QUEUE_DEPTH)
        if self.ecn_backlog not in ECN_BACKLOGS:
            raise PolicyError(f"policy.ecn_backlog={self.ecn_backlog!r} is unknown; one of {list(ECN_BACKLOGS)}")
        for name in ("loss_bound_push", "loss_bound_pull"):
            _check_range(name, getattr(self, name), 0.0, LOSS_BOUND_MAX, float)
        for name, lo, hi in (("priority_map", 0, MAX_PRIORITIES - 1), ("dscp", 0, 63)):
            values = getattr(self, name)
            if not isinstance(values, tuple) or len(values) < self.num_priorities:
                raise PolicyError(
                    f"policy.{name}={values!r} needs a value for each of the {self.num_priorities} priorities"
                )
            for i, v in enumerate(values):
                _check_range(f"{name}[{i}]", v, lo, hi)
        if self.lb_mode not in LB_MODES:
            raise PolicyError(f"policy.lb_mode={self.lb_mode!r} is unknown; one of {list(LB_MODES)}")

    @property
    def top_priority(self) -> int:
        """Priority of control packets and retransmissions."""
        return self.num_priorities - 1

    def shares(self) -> tuple[float, ...]:
        """Drop-class shares, class 0 first (equal when not configured)."""
        if self.drop_class_shares is not None:
            return self.drop_class_shares
        return tuple([1.0 / self.num_drop_classes] * self.num_drop_classes)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (lists, not tuples) for YAML/JSON and reports."""
        out = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Policy:
        """Build from a mapping; unknown keys are errors (a typo must not be ignored)."""
        if not isinstance(data, Mapping):
            raise PolicyError(f"a policy must be a mapping of fields, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PolicyError(f"unknown policy field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**dict(data))


def load_policy(path: str | Path) -> Policy:
    """Read a policy from a YAML or JSON file (a ``policy:`` key at top level is accepted too).

    Raises:
        PolicyError: the file does not parse or holds an invalid policy (names the file).
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise PolicyError(f"{path}: cannot read policy: {exc}") from exc
    if isinstance(data, Mapping) and set(data) == {"policy"}:
        data = data["policy"]
    try:
        return Policy.from_dict(data or {})
    except (PolicyError, TypeError) as exc:
        raise PolicyError(f"{path}: {exc}") from exc


def save_policy(policy: Policy, path: str | Path) -> None:
    """Write ``policy`` as JSON (``.json``) or YAML (anything else)."""
    path = Path(path)
    data = policy.to_dict()
    text = json.dumps(data, indent=2) + "\n" if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
    path.write_text(text)


# --- priority --------------------------------------------------------------------------


def layer_priorities(layer_sizes: Sequence[int] | np.ndarray, policy: Policy) -> np.ndarray:
    """Priority of each layer, layers given in forward order (index 0 nearest the input).

    Args:
        layer_sizes: elements (or bytes) per layer; only ``equal_bytes`` uses the values.
        policy: gives the number of priorities and the band strategy.

    Returns:
        int array, ``policy.num_priorities - 1`` for the first band down to 0.

    Example: ``layer_priorities([10] * 4, Policy(num_priorities=2))`` -> ``[1, 1, 0, 0]``
    """
    sizes = np.asarray(layer_sizes)
    if sizes.ndim != 1:
        raise ValueError(f"layer_sizes must be one-dimensional, got shape {sizes.shape}")
    if sizes.size and sizes.min() < 0:
        raise ValueError("layer_sizes must not be negative")
    bands = np.asarray(BAND_STRATEGIES[policy.band_strategy](sizes, policy.num_priorities), dtype=np.int64)
    if bands.shape != sizes.shape or (bands.size and (bands.min() < 0 or bands.max() >= policy.num_priorities)):
        raise ValueError(f"band strategy {policy.band_strategy!r} returned bands outside "
                         f"0..{policy.num_priorities - 1}")
    return (policy.num_priorities - 1 - bands).astype(np.uint8)


def packet_tags(segment_starts: Sequence[int] | np.ndarray, segment_priorities: Sequence[int] | np.ndarray,
                segment_layers: Sequence[int] | np.ndarray, total_elems: int,
                elems_per_packet: int) -> tuple[np.ndarray, np.ndarray]:
    """Priority and layer of every packet of a message that holds several layers (a fused bucket).

    A fused message is a run of segments, one per tensor: segment ``i`` starts at element
    ``segment_starts[i]`` (ascending, the first at 0) and belongs to a layer with priority
    ``segment_priorities[i]``. Each packet takes the *most urgent* segment it overlaps: the
    highest priority, and the layer nearest the input (the lowest index). So a packet that
    carries even a few elements of an early layer is queued as that layer, because the next
    forward pass cannot start without them.

    Vectorised: the segment covering each packet's first element comes from one
    ``searchsorted``; every other segment that starts inside a packet is folded in with one
    ``maximum.at`` / ``minimum.at``.

    Returns:
        ``(priorities uint8, layers int64)``, one per packet (``ceil(total / per)``).

    Raises:
        ValueError: the segments are not ascending from 0 within the message, or the arrays differ in length.

    Example: ``packet_tags([0, 5], [7, 2], [0, 1], 10, 4)`` -> ``([7, 7, 2], [0, 0, 1])``
    """
    starts = np.asarray(segment_starts, dtype=np.int64).reshape(-1)
    prios = np.asarray(segment_priorities, dtype=np.int64).reshape(-1)
    layers = np.asarray(segment_layers, dtype=np.int64).reshape(-1)
    if not (starts.size == prios.size == layers.size):
        raise ValueError(f"segment arrays differ in length: {starts.size} starts, {prios.size} priorities, "
                         f"{layers.size} layers")
    if elems_per_packet <= 0 or total_elems < 0:
        raise ValueError(f"need elems_per_packet > 0 and total_elems >= 0, got {elems_per_packet}, {total_elems}")
    n = -(-total_elems // elems_per_packet)
    if n == 0:
        return np.zeros(0, np.uint8), np.zeros(0, np.int64)
    if starts.size == 0 or starts[0] != 0 or (np.diff(starts) < 0).any() or starts[-1] > total_elems:
        raise ValueError(f"segment starts must ascend from 0 within the message's {total_elems} elements, "
                         f"got {starts[:8].tolist()}...")
    first = np.arange(n, dtype=np.int64) * elems_per_packet
    covering = np.searchsorted(starts, first, side="right") - 1
    out_p = prios[covering].copy()
    out_l = layers[covering].copy()
    sizes = np.diff(np.append(starts, total_elems))
    inside = (starts < total_elems) & (sizes > 0)  # an empty segment carries nothing
    pkt_of_start = starts[inside] // elems_per_packet
    np.maximum.at(out_p, pkt_of_start, prios[inside])
    np.minimum.at(out_l, pkt_of_start, layers[inside])
    return out_p.astype(np.uint8), out_l


def dscp_for_priority(priority: int, policy: Policy) -> int:
    """DSCP code point hosts write for packets of ``priority``."""
    if not 0 <= priority < policy.num_priorities:
        raise ValueError(f"priority {priority} outside 0..{policy.num_priorities - 1}")
    return policy.dscp[priority]


# --- drop class ------------------------------------------------------------------------


def packet_magnitudes(data: np.ndarray, elems_per_packet: int, kind: str = "l2") -> np.ndarray:
    """Magnitude of each packet's payload when ``data`` is cut into ``elems_per_packet`` slices.

    Computed in float32 whatever the input type (float16 squares overflow), one numpy
    reduction over a 2-D view of the full packets plus one for the tail: no per-packet loop.

    Returns:
        float32 array, one value per packet (``ceil(len(data) / elems_per_packet)``).
    """
    if kind not in MAGNITUDES:
        raise ValueError(f"unknown magnitude {kind!r}; one of {list(MAGNITUDES)}")
    if elems_per_packet <= 0:
        raise ValueError(f"elems_per_packet must be positive, got {elems_per_packet}")
    flat = np.asarray(data).reshape(-1)
    n_full, tail = divmod(flat.size, elems_per_packet)
    full = flat[: n_full * elems_per_packet].reshape(n_full, elems_per_packet)
    out = np.empty(n_full + (1 if tail else 0), dtype=np.float32)
    parts = [(full, out[:n_full])]
    if tail:
        parts.append((flat[n_full * elems_per_packet :].reshape(1, tail), out[n_full:]))
    if full.size >= PARALLEL_MAGNITUDE_ELEMS and magnitude_threads() > 1:
        # rows are independent: split them, same results (numpy drops the GIL in the reduction)
        k = magnitude_threads()
        cuts = [n_full * i // k for i in range(k + 1)]
        parts = [(full[a:b], out[a:b]) for a, b in zip(cuts, cuts[1:])] + parts[1:]
        futures = [_pool().submit(_magnitudes_into, block, dest, kind) for block, dest in parts[1:]]
        _magnitudes_into(*parts[0], kind)
        for f in futures:
            f.result()
        return out
    for block, dest in parts:
        _magnitudes_into(block, dest, kind)
    return out


#: Messages with at least this many elements have their packet magnitudes computed by several
#: threads. Why: the reduction reads the whole message (one core reads about 10 GB/s here), and
#: it runs before the message's first packet may leave: 9 ms of a 100 MB message's 100. (The
#: compiled path skips that pass for messages of SAMPLED_CLASSES_PACKETS packets or more.)
PARALLEL_MAGNITUDE_ELEMS = 4_000_000
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()  # senders on several threads may packetize at once


def magnitude_threads() -> int:
    """Threads that share the magnitudes of a message of PARALLEL_MAGNITUDE_ELEMS or more (both
    data paths): they must all be known before its first packet leaves, so on a large message
    this pass is the send's latency."""
    return max(1, min(4, os.cpu_count() or 1))


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=magnitude_threads() - 1, thread_name_prefix="dlcp-magnitudes")
        return _POOL


def _forget_pool() -> None:
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()  # a forked child has none of the parent's threads


os.register_at_fork(after_in_child=_forget_pool)


def _magnitudes_into(block: np.ndarray, dest: np.ndarray, kind: str) -> None:
    if kind == "l2":
        if block.dtype == np.float32:
            np.sqrt(np.einsum("ij,ij->i", block, block), out=dest)
        else:
            b32 = block.astype(np.float32)
            np.sqrt(np.einsum("ij,ij->i", b32, b32), out=dest)
    else:
        dest[:] = np.abs(block).max(axis=1) if block.size else 0.0


#: A message of at least this many packets takes its drop-class boundaries from a sample of
#: its packets (:func:`class_sample_stride`), not from all of them. Why: exact quantiles need
#: every packet's magnitude before the first packet may leave, a pass over the whole message
#: (8 ms of a 100 MB message's 44 on this machine, a fifth of its time); with boundaries from a
#: sample, the compiled send path computes each packet's magnitude as it sends it, from memory
#: its copy into the socket reads next.
SAMPLED_CLASSES_PACKETS = 4096
#: About this many packets make the sample (one of every ``n // CLASS_SAMPLE``,
#: :func:`class_sample`): each class's share is then within about 1.5 % of the policy's (one
#: standard error).
CLASS_SAMPLE = 1024


def class_sample_stride(n_packets: int) -> int:
    """Of how many packets one goes into the sample that sets a message's class boundaries
    (1: every packet, the exact rule)."""
    return 1 if n_packets < SAMPLED_CLASSES_PACKETS else n_packets // CLASS_SAMPLE


def class_sample(n_packets: int) -> np.ndarray:
    """The packets whose magnitudes set a large message's class boundaries: one from each run
    of ``stride`` packets (``n // stride`` runs), at an offset a multiplicative hash of the run's
    number gives. Why not every stride-th packet: a fused message repeats its layers' shapes,
    and a fixed stride can fall in step with them (every 20th packet zero, say: a stride of 68
    took a fifth of its sample from those)."""
    stride = class_sample_stride(n_packets)
    runs = np.arange(n_packets // stride, dtype=np.uint64)
    offsets = ((runs * np.uint64(2654435761)) & np.uint64(0xFFFFFFFF)) % np.uint64(stride)
    return (runs * np.uint64(stride) + offsets).astype(np.int64)


def drop_classes(magnitudes: np.ndarray, policy: Policy) -> np.ndarray:
    """Drop class of each packet from its magnitude, by per-message quantiles.

    The largest ``shares()[0]`` of the packets get class 0 (never dropped), the next
    ``shares()[1]`` class 1, and so on; the smallest gradients land in the highest class and
    are dropped first. Below SAMPLED_CLASSES_PACKETS packets ranks, not values, decide, so the
    shares are exact and ties are broken by packet order. From SAMPLED_CLASSES_PACKETS on, the
    same rule applied to a sample (about CLASS_SAMPLE packets, :func:`class_sample`) gives each
    boundary's value, and a packet is within a boundary's top when its magnitude is at least
    that value (:func:`class_boundaries`, :func:`classes_from_boundaries`): the shares hold to
    the sample's precision, ties go together.

    Example: ``drop_classes(np.array([4., 1., 3., 2.]), Policy(num_drop_classes=2,
    drop_thresholds=(10,)))`` -> ``[0, 1, 0, 1]``
    """
    mags = np.asarray(magnitudes).reshape(-1)
    if mags.dtype not in (np.float32, np.float64):  # float32 stays: the order is the same, the partition faster
        mags = mags.astype(np.float64)
    n = mags.size
    if policy.num_drop_classes == 1 or n == 0:
        return np.zeros(n, dtype=np.uint8)
    if class_sample_stride(n) > 1:
        return classes_from_boundaries(mags, class_boundaries(mags[class_sample(n)], policy), policy)
    return _exact_classes(mags, policy)


def payload_drop_classes(data: np.ndarray, elems_per_packet: int, policy: Policy) -> np.ndarray:
    """Drop class of each packet of ``data`` cut into ``elems_per_packet`` slices: the
    magnitudes' pass (a read of the whole payload) only when there is more than one class.

    Example: ``payload_drop_classes(np.ones(10, np.float32), 4, Policy(num_drop_classes=1, drop_thresholds=()))``
    -> ``[0, 0, 0]``
    """
    if policy.num_drop_classes == 1:
        if elems_per_packet <= 0:
            raise ValueError(f"elems_per_packet must be positive, got {elems_per_packet}")
        return np.zeros(-(-np.asarray(data).size // elems_per_packet), dtype=np.uint8)
    return drop_classes(packet_magnitudes(data, elems_per_packet, policy.magnitude), policy)


#: A boundary every packet is outside of (its top holds none), or within (its top holds all).
NONE_WITHIN, ALL_WITHIN = float("inf"), float("-inf")


def class_boundaries(sample: np.ndarray, policy: Policy) -> list[float]:
    """Each class boundary's value from a sample of a message's packet magnitudes: the
    b-th largest of the sample, b = round(cumsum(shares) * len(sample)) as the exact rule
    counts; NONE_WITHIN or ALL_WITHIN where b is 0 or the whole sample. NaN ranks last."""
    s = np.asarray(sample, dtype=np.float64).reshape(-1)
    k = s.size
    s = np.where(np.isnan(s), -np.inf, s)
    out = []
    for b in np.round(np.cumsum(policy.shares()) * k).astype(np.int64)[:-1].tolist():
        if b <= 0:
            out.append(NONE_WITHIN)
        elif b >= k:
            out.append(ALL_WITHIN)
        else:
            out.append(float(np.partition(s, k - b)[k - b]))
    return out


def classes_from_boundaries(mags: np.ndarray, boundaries: list[float], policy: Policy) -> np.ndarray:
    """A packet's class: the number of boundaries it is not within (magnitude below the
    boundary's value; NaN below every one)."""
    m = np.asarray(mags, dtype=np.float64).reshape(-1)
    m = np.where(np.isnan(m), -np.inf, m)
    out = np.zeros(m.size, dtype=np.uint8)
    for t in boundaries:
        if t == ALL_WITHIN:
            continue
        out += (m < t) if t != NONE_WITHIN else np.uint8(1)
    return np.minimum(out, policy.num_drop_classes - 1).astype(np.uint8)


def _exact_classes(mags: np.ndarray, policy: Policy) -> np.ndarray:
    n = mags.size
    # Without a sort (a 100 MB message has 70,000 packets and this runs before its first one
    # leaves): a packet's class is the number of class boundaries b it is not within the top
    # b of. One partition finds the value at each boundary; packets tied with it are taken in
    # packet order, as a stable sort would take them. NaN ranks last, as a sort puts it.
    if np.isnan(mags).any():
        mags = np.where(np.isnan(mags), -np.inf, mags)
    bounds = np.round(np.cumsum(policy.shares()) * n).astype(np.int64)[:-1]  # the last is n
    inner = sorted({int(b) for b in bounds if 0 < b < n})
    values = np.partition(mags, [n - b for b in inner]) if inner else mags
    out = np.zeros(n, dtype=np.uint8)
    for b in bounds.tolist():
        if b >= n:
            continue  # every packet is within the top b
        if b <= 0:
            out += 1
            continue
        t = values[n - b]  # the b-th largest
        top = mags > t
        tie = mags == t
        need = b - np.count_nonzero(top)
        top |= tie if need >= np.count_nonzero(tie) else tie & (np.cumsum(tie) <= need)
        out += ~top
    return np.minimum(out, policy.num_drop_classes - 1).astype(np.uint8)


# --- completion ------------------------------------------------------------------------


def allowed_missing(total: int, loss_bound: float) -> int:
    """Most elements of a ``total``-element message that may stay missing under bound p.

    ``floor(p * total)``, with a tolerance so ``0.05 * 100`` is 5 despite binary rounding.
    """
    if total < 0 or not 0.0 <= loss_bound < 1.0:
        raise ValueError(f"need total >= 0 and 0 <= p < 1, got total={total}, p={loss_bound}")
    return int(math.floor(loss_bound * total + 1e-9))


def required_elements(total: int, loss_bound: float) -> int:
    """Elements that must arrive before a message may complete: ``ceil((1-p) * total)``."""
    return total - allowed_missing(total, loss_bound)


def is_complete(received: int, total: int, loss_bound: float) -> bool:
    """Completion rule (b) of the transport: at least (1-p) of the elements arrived."""
    return received >= required_elements(total, loss_bound)


def retransmission_set(missing: np.ndarray, drop_class: np.ndarray, elem_count: np.ndarray,
                       received_elems: int, total_elems: int, loss_bound: float) -> np.ndarray:
    """Which missing packets to resend so the message meets its bound, most important first.

    Only loss beyond the bound is recovered: packets are taken in order of drop class (class 0,
    the largest gradients, first; then by sequence number) until the elements received plus
    those resent reach ``required_elements(total_elems, loss_bound)``. With ``loss_bound = 0``
    that is every missing packet.

    Args:
        missing: sequence numbers the receiver reported missing.
        drop_class: drop class of every packet of the message (indexed by seq).
        elem_count: elements of every packet of the message (indexed by seq).
        received_elems: elements the receiver has.

    Returns:
        Sequence numbers to resend (possibly empty), in sending order.
    """
    missing = np.asarray(missing, dtype=np.int64)
    need = required_elements(total_elems, loss_bound) - received_elems
    if need <= 0 or missing.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((missing, np.asarray(drop_class)[missing]))
    ranked = missing[order]
    cum = np.cumsum(np.asarray(elem_count, dtype=np.int64)[ranked])
    take = int(np.searchsorted(cum, need, side="left")) + 1
    return ranked[:take]
