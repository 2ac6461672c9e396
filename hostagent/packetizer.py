"""Cut a gradient array into tagged DLCP packets, all tags computed at once.

The payload is never copied: a :class:`PacketBatch` holds the headers of every packet (one
numpy structured array) and a flat view of the caller's array; packet ``i`` is
``headers[i]`` followed by ``payload[offset_i : offset_i + count_i]``. A sender hands those
two buffers to ``socket.sendmsg`` (scatter-gather), so a tensor goes from the model to the
kernel without an intermediate copy. :meth:`PacketBatch.to_slots` materialises whole
datagrams for tests, benchmarks and tools that need them.

Every tag is vectorised: sequence numbers and offsets are ``arange``s, drop classes come
from one reduction over a 2-D view of the payload (:func:`dlcp.hostagent.policy.packet_magnitudes`)
and one argsort (:func:`dlcp.hostagent.policy.drop_classes`). No Python loop runs per element or
per packet.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterator

import numpy as np

from dlcp.hostagent import wire
from dlcp.hostagent.policy import Policy, payload_drop_classes

#: Default IP packet size: a standard Ethernet MTU.
DEFAULT_MTU = 1500


@dataclass(frozen=True)
class MessageMeta:
    """What identifies a message and how it is tagged, apart from its payload."""

    job_id: int
    message_id: int
    sender_rank: int = 0
    iteration: int = 0
    tensor_id: int = 0
    layer: int = 0
    priority: int = 0
    token: int = 0
    """The message token the receiver checks (see :func:`dlcp.hostagent.auth.message_token`)."""

    def __post_init__(self) -> None:
        for name in ("job_id", "message_id", "sender_rank", "iteration", "tensor_id", "layer", "priority", "token"):
            value = getattr(self, name)
            limit = wire.FIELD_MAX[name]
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= limit:
                raise ValueError(f"MessageMeta.{name}={value!r} must be an integer in 0..{limit}")


def elems_per_packet(mtu: int, dtype: np.dtype | type | str) -> int:
    """How many elements of ``dtype`` fit in one IP packet of ``mtu`` bytes after the headers.

    Raises:
        ValueError: the MTU leaves no room for one element, or more than ``elem_count`` can say.

    Example: ``elems_per_packet(1500, np.float32) == 357``
    """
    itemsize = np.dtype(dtype).itemsize
    room = mtu - wire.IP_UDP_OVERHEAD - wire.HEADER_SIZE
    per = room // itemsize
    if per < 1:
        raise ValueError(
            f"MTU {mtu} leaves {room} bytes after IP, UDP and DLCP headers: not one {itemsize}-byte element"
        )
    if per > wire.FIELD_MAX["elem_count"]:
        raise ValueError(f"MTU {mtu} would put {per} elements in a packet; elem_count holds at most "
                         f"{wire.FIELD_MAX['elem_count']}")
    return per


@dataclass(frozen=True)
class PacketBatch:
    """All packets of one message: headers plus a zero-copy view of the payload."""

    headers: np.ndarray
    """One :data:`dlcp.hostagent.wire.HEADER_DTYPE` record per packet, in sequence order."""

    payload: np.ndarray
    """The message elements, flat, in the caller's memory (little-endian)."""

    elems_per_packet: int
    """Elements in every packet but possibly the last."""

    def __len__(self) -> int:
        return len(self.headers)

    @property
    def datagram_bytes(self) -> int:
        """Bytes of one full-size datagram (DLCP header + a full payload): the unit of pacing."""
        return wire.HEADER_SIZE + self.elems_per_packet * self.payload.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of datagrams (DLCP header + payload) in the whole batch."""
        return len(self.headers) * wire.HEADER_SIZE + self.payload.nbytes

    def payload_of(self, i: int) -> memoryview:
        """Payload bytes of packet ``i`` (a view, no copy)."""
        start = i * self.elems_per_packet
        return self.payload[start : start + self.elems_per_packet].view(np.uint8).data

    def buffers(self, i: int) -> tuple[memoryview, memoryview]:
        """(header, payload) of packet ``i``, ready for ``socket.sendmsg``."""
        return self.headers[i : i + 1].view(np.uint8).data, self.payload_of(i)

    def datagram(self, i: int) -> bytes:
        """Packet ``i`` as one bytes object (header + payload)."""
        header, payload = self.buffers(i)
        return bytes(header) + bytes(payload)

    def __iter__(self) -> Iterator[bytes]:
        return (self.datagram(i) for i in range(len(self)))

    def to_slots(self, slot_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Every datagram in a row of a ``uint8`` matrix, as a receiver's buffers hold them.

        Returns:
            ``(slots, lengths)``: ``slots[i, :lengths[i]]`` is datagram ``i``.
        """
        itemsize = self.payload.dtype.itemsize
        width = wire.HEADER_SIZE + self.elems_per_packet * itemsize
        slot_size = width if slot_size is None else slot_size
        if slot_size < width:
            raise ValueError(f"slot_size {slot_size} is smaller than a datagram ({width} bytes)")
        n = len(self)
        slots = np.zeros((n, slot_size), dtype=np.uint8)
        if n == 0:
            return slots, np.zeros(0, dtype=np.int64)
        slots[:, : wire.HEADER_SIZE] = self.headers.view(np.uint8).reshape(n, wire.HEADER_SIZE)
        flat = self.payload.view(np.uint8)
        n_full, tail = divmod(self.payload.size, self.elems_per_packet)
        full_bytes = n_full * self.elems_per_packet * itemsize
        slots[:n_full, wire.HEADER_SIZE:width] = flat[:full_bytes].reshape(n_full, width - wire.HEADER_SIZE)
        if tail:
            slots[n_full, wire.HEADER_SIZE : wire.HEADER_SIZE + tail * itemsize] = flat[full_bytes:]
        lengths = wire.HEADER_SIZE + self.headers["elem_count"].astype(np.int64) * itemsize
        return slots, lengths


def packetize(data: np.ndarray, meta: MessageMeta, policy: Policy, mtu: int = DEFAULT_MTU,
              packet_priorities: np.ndarray | None = None, packet_layers: np.ndarray | None = None) -> PacketBatch:
    """Split ``data`` into DLCP data packets tagged by ``meta`` and ``policy``.

    Args:
        data: C-contiguous float32, float16 or bfloat16 array, any shape (a torch tensor through
            ``tensor.numpy()`` works without a copy). It is not copied, so it must not change
            until the packets are sent.
        meta: message identity and the message's priority.
        policy: how drop classes are assigned (magnitude kind, number and shares of classes).
        mtu: IP packet size the datagrams must fit in.
        packet_priorities: for a fused message (several layers in one buffer), the priority of
            each packet (:func:`dlcp.hostagent.policy.packet_tags` computes them from the layout);
            ``meta.priority`` otherwise.
        packet_layers: likewise the layer field of each packet; ``meta.layer`` otherwise.

    Returns:
        A :class:`PacketBatch`; an empty ``data`` gives zero packets.

    Raises:
        ValueError: unsupported dtype, big-endian or non-contiguous data, a priority the
            policy does not have, or a message too large for the 32-bit offset field.

    Example: ``packetize(np.ones(1000, np.float32), MessageMeta(job_id=1, message_id=2), Policy())``
    """
    if not isinstance(data, np.ndarray):
        raise ValueError(f"packetize needs a numpy array, got {type(data).__name__}")
    code = wire.dtype_code(data.dtype)
    if data.dtype.byteorder == ">":
        raise ValueError("payload must be little-endian (native on every supported host); got big-endian")
    if not data.flags.c_contiguous:
        raise ValueError("packetize needs a C-contiguous array (no hidden copy of a gradient); "
                         "call np.ascontiguousarray first")
    if not 0 <= meta.priority < policy.num_priorities:
        raise ValueError(f"priority {meta.priority} is outside the policy's 0..{policy.num_priorities - 1}")
    flat = data.reshape(-1)
    per = elems_per_packet(mtu, data.dtype)
    n = -(-flat.size // per)
    priority: int | np.ndarray = meta.priority
    layer: int | np.ndarray = meta.layer
    if packet_priorities is not None:
        priority = np.asarray(packet_priorities)
        if priority.shape != (n,):
            raise ValueError(f"packet_priorities has shape {priority.shape}; this message has {n} packets")
        if n and (priority.min() < 0 or priority.max() >= policy.num_priorities):
            raise ValueError(f"packet_priorities outside the policy's 0..{policy.num_priorities - 1}")
    if packet_layers is not None:
        layer = np.asarray(packet_layers)
        if layer.shape != (n,):
            raise ValueError(f"packet_layers has shape {layer.shape}; this message has {n} packets")
    if flat.size > wire.FIELD_MAX["elem_offset"]:
        raise ValueError(f"message of {flat.size} elements is too large; split it below "
                         f"{wire.FIELD_MAX['elem_offset']} elements")
    seq = np.arange(n, dtype=np.uint32)
    counts = np.full(n, per, dtype=np.uint16)
    if n and flat.size % per:
        counts[-1] = flat.size % per
    classes = payload_drop_classes(flat, per, policy)
    headers = wire.encode_headers(
        n,
        ptype=wire.PacketType.DATA,
        priority=priority,
        drop_class=classes,
        dtype=code,
        sender_rank=meta.sender_rank,
        job_id=meta.job_id,
        message_id=meta.message_id,
        token=meta.token,
        iteration=meta.iteration,
        tensor_id=meta.tensor_id,
        layer=layer,
        elem_count=counts,
        seq=seq,
        total_pkts=n,
        elem_offset=seq * np.uint32(per),
    )
    return PacketBatch(headers=headers, payload=flat, elems_per_packet=per)
