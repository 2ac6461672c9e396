"""The DLCP header, defined once.

Every DLCP packet is ``Ethernet | IPv4 | UDP(dport in DLCP's port block) | DLCP header | payload``.
The header is the single source of truth for the host agent, the P4 parser
(``p4/include/headers.p4`` must declare the same fields, widths and order; a test
checks the compiled BMv2 JSON against :data:`FIELDS`), the scapy dissector used by
tests and debugging, and the documentation in ``p4/README.md``.

Why these fields: the receiver places a payload by ``elem_offset`` alone, so
packets of one message may arrive in any order over any path (per-packet
spraying); ``priority`` and ``drop_class`` are what the switch queues and drops on;
``total_pkts``/``seq`` let the receiver keep a per-packet bitmap for bounded-loss
completion and selective retransmission. What a receiver checks before a payload touches a
tensor is not in the header: every datagram of the data path ends in a trailer
(:data:`TRAILER_SIZE`), a packet number and a 128-bit tag (AEGISMAC-128X4) over the header and payload
under the sender's direction key (:mod:`dlcp.hostagent.auth`), so no field and no bit of the payload
can be forged or changed. ``token`` is left from version 2 (0 on data; a credit's keyed hash).

Layout rules: fixed size, network byte order (big-endian), every field a whole
number of bytes so BMv2 (which needs headers whose width is a multiple of 8 bits)
and numpy structured dtypes see exactly the same bytes.

Two ways in and out:

* the fast path, :func:`encode_headers`/:func:`decode_headers`, packs or unpacks the
  headers of a whole message at once through :data:`HEADER_DTYPE` (one numpy
  operation per field, not per packet);
* :func:`pack_header`/:func:`unpack_header` build or read one header as a
  :class:`Header` dataclass, for control packets and tests.
"""

from __future__ import annotations

import enum
import operator
import struct
from dataclasses import dataclass
from typing import Any, TypedDict

import ml_dtypes
import numpy as np

#: UDP destination port that marks a datagram as DLCP (the P4 parser selects on it): every
#: receiver's default data port.
DLCP_UDP_PORT = 17649
#: The P4 parser takes every destination port of the aligned block of 16 holding it as DLCP
#: (``port & DLCP_UDP_PORT_MASK == DLCP_UDP_PORT_BLOCK``: 17648-17663), so up to 16 ranks that
#: share one address (GPUs of one host, processes on loopback) each receive on a port of their
#: own that DLCP's switches still recognise (:func:`dlcp_ports`). A rank on any other port is
#: plain UDP to them: no priority queue, no spraying, no selective drop.
DLCP_UDP_PORT_MASK = 0xFFF0
DLCP_UDP_PORT_BLOCK = DLCP_UDP_PORT & DLCP_UDP_PORT_MASK


def is_dlcp_port(port: int) -> bool:
    """Whether DLCP's switches parse a datagram to UDP ``port`` as DLCP."""
    return port & DLCP_UDP_PORT_MASK == DLCP_UDP_PORT_BLOCK


def dlcp_ports() -> list[int]:
    """The data ports DLCP's switches recognise, the default first: the order a rank tries them in."""
    block = range(DLCP_UDP_PORT_BLOCK, DLCP_UDP_PORT_BLOCK + (~DLCP_UDP_PORT_MASK & 0xFFFF) + 1)
    return [DLCP_UDP_PORT, *(p for p in block if p != DLCP_UDP_PORT)]

#: Header version carried in every packet; a receiver rejects any other value.
#: 2: the ``token`` field (version 1 had none). 3: every data-path datagram ends in a trailer
#: (:data:`TRAILER_SIZE`). 4: keys renewed by epoch of packet numbers (``hostagent/native/seal.h``);
#: a credit's ``token`` is 0 (its trailer's tag authenticates it). 5: a MAC trailer's tag is
#: AEGISMAC-128X4 (``hostagent/native/aegis_mac.h``), where 4's was AES-GMAC: a peer of version 4
#: would find every datagram forged, so the versions refuse each other.
VERSION = 5


class PacketType(enum.IntEnum):
    """What a DLCP packet carries. Only DATA is ever dropped selectively by a switch."""

    DATA = 1  #: a slice of a gradient or parameter message
    PROBE = 2  #: sender asks "what are you missing?" after it has sent everything
    BITMAP = 3  #: receiver answers a probe with the bitmap of missing packets
    STOP = 4  #: receiver has enough (>= 1-p arrived): sender stops this message
    META = 5  #: sender announces a message (size, element type, loss bound) before its data
    FEEDBACK = 6  #: receiver reports packets received and CE-marked, for rate control
    BATCH = 7  #: several control records in one frame (control path only; never on the data path)
    HELLO = 8  #: a step of the handshake that opens a control connection (control path only)
    CREDIT = 9  #: receiver grants a sender a window: data packets it may have unconsumed (data path only)
    #: receiver lists holes before the pass ends: first-pass packets missing while later ones of
    #: their priority level came (control path only; body as BITMAP's, the holes' bitmap)
    NACK = 10


class Flags(enum.IntFlag):
    """Bits of the ``flags`` field."""

    NONE = 0
    RETX = 0x01  #: a retransmission (always priority top, drop class 0)
    ECN_ECHO = 0x02  #: receiver saw CE marks (rate control reacts)
    LAST = 0x04  #: the end of a sending pass (its LAST_PACKETS final packets): the receiver may answer as to a PROBE
    #: on a CREDIT: the sender's packets stopped coming while a message of its is incomplete, after
    #: the receiver's socket overran or with the receiver caught up (lost on the way): whatever
    #: the sender sent and the receiver did not consume was lost (the rule: ``datapath.credits``)
    RELEASE = 0x08
    #: on a STOP: the receiver refuses the message, whose shape (element type, count, elements
    #: per packet) differs from what it expects; the header carries its expectation, as a PROBE's
    MISMATCH = 0x10
    #: on a FEEDBACK of id ``LINE_RATE`` (dlcp.hostagent.protocol.core), from a sender to its
    #: receiver: set, its rate towards it is at its line rate, so reports without congestion
    #: would grow nothing; clear, it is below again (a cut), so they matter again
    AT_LINE_RATE = 0x20


#: How many of a sending pass's final packets carry LAST (fewer when its last priority level has
#: fewer). Why more than one: a receiver whose one LAST was lost waits for the sender's PROBE,
#: which comes only after the measured answer time (srtt + 4 deviations, tens of milliseconds on
#: a loaded ring); at 2 % loss that was every 50th pass, a stall several times a ring iteration.
#: The send paths put them in one send call, back to back, so they arrive within the path's
#: reordering window of each other and a receiver answers the pass once.
LAST_PACKETS = 3


class Dtype(enum.IntEnum):
    """Element type of the payload. The code is on the wire; the numpy dtype is local."""

    FLOAT32 = 0
    FLOAT16 = 1
    BFLOAT16 = 2


#: Payload element types by wire code. The header is in network byte order, but the payload
#: is little-endian IEEE floats: every training host is little-endian, the switch never reads
#: the payload, and swapping would cost a full copy of every gradient on both ends.
#: bfloat16 is ml_dtypes' numpy type (the JAX project's; torch's ``bfloat16`` has the same bits and
#: rounds alike, to nearest even).
NUMPY_DTYPES: dict[Dtype, np.dtype] = {
    Dtype.FLOAT32: np.dtype("<f4"),
    Dtype.FLOAT16: np.dtype("<f2"),
    Dtype.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
}
#: Wire code by native-order numpy type: every message looks its type up (a dict, not a scan).
_CODE_OF: dict[np.dtype, Dtype] = {d.newbyteorder("="): c for c, d in NUMPY_DTYPES.items()}


def destination_dtypes(wire_dtype: np.dtype, accumulate: bool) -> tuple[np.dtype, ...]:
    """Element types a received message may be written into, the default first.

    Placed, a payload keeps its wire type. Added into a sum (``accumulate``), it goes into
    float32 by default, or into its own type: a float16 (bfloat16) sum kept in float16
    (bfloat16), each addition rounded to it, as a float16 allreduce (gloo's, or PyTorch's
    ``fp16_compress_hook``) sums.
    """
    own = np.dtype(wire_dtype).newbyteorder("=")
    if not accumulate:
        return (own,)
    f32 = np.dtype(np.float32)
    return (f32,) if own == f32 else (f32, own)


def dtype_code(dtype: np.dtype | str | type) -> Dtype:
    """Wire code of a numpy element type (byte order ignored).

    Raises:
        ValueError: the type is not one DLCP carries.

    Example: ``dtype_code(np.float32) == Dtype.FLOAT32``
    """
    kind = np.dtype(dtype).newbyteorder("=")
    code = _CODE_OF.get(kind)
    if code is not None:
        return code
    raise ValueError(
        f"dtype {np.dtype(dtype)} is not supported on the wire; use one of "
        f"{[str(d.newbyteorder('=')) for d in NUMPY_DTYPES.values()]}"
    )


@dataclass(frozen=True)
class Field:
    """One header field: its name (shared with the P4 header), width in bits, meaning."""

    name: str
    bits: int
    doc: str


#: The header, in wire order. Widths are whole bytes. Change this and the P4 header together.
FIELDS: tuple[Field, ...] = (
    Field("version", 8, "header version, VERSION"),
    Field("ptype", 8, "PacketType"),
    Field("flags", 8, "Flags bits"),
    Field("priority", 8, "queue priority, higher is served first; 0..num_priorities-1"),
    Field("drop_class", 8, "0 = never dropped selectively; higher = dropped earlier"),
    Field("dtype", 8, "Dtype code of the payload elements"),
    Field("sender_rank", 16, "rank of the sending worker"),
    Field("job_id", 32, "training job; packets of other jobs are rejected"),
    Field("message_id", 32, "message, unique per sender and job"),
    Field("token", 32, "0 on data (the trailer's tag authenticates it); a credit's keyed hash of its header"),
    Field("iteration", 32, "training iteration the message belongs to"),
    Field("tensor_id", 32, "tensor or bucket id"),
    Field("layer", 16, "layer index (0 = nearest the input)"),
    Field("elem_count", 16, "elements in this packet's payload"),
    Field("seq", 32, "packet sequence number within the message, 0..total_pkts-1"),
    Field("total_pkts", 32, "packets in the whole message"),
    Field("elem_offset", 32, "index of the payload's first element in the message"),
)

_NP_TYPES = {8: ">u1", 16: ">u2", 32: ">u4", 64: ">u8"}
_STRUCT_CODES = {8: "B", 16: "H", 32: "I", 64: "Q"}

#: numpy structured dtype of the header, big-endian, packed (no padding).
HEADER_DTYPE = np.dtype([(f.name, _NP_TYPES[f.bits]) for f in FIELDS])
#: Header size in bytes.
HEADER_SIZE = HEADER_DTYPE.itemsize
_STRUCT = struct.Struct("!" + "".join(_STRUCT_CODES[f.bits] for f in FIELDS))
assert _STRUCT.size == HEADER_SIZE, "struct and numpy layouts disagree"
#: The header as a ``struct.Struct``: ``HEADER_STRUCT.unpack(buf)`` gives the fields in
#: :data:`FIELDS` order (no checks), the cheapest way to read one header on a hot path (a
#: numpy structured element costs microseconds per field).
HEADER_STRUCT = _STRUCT
#: Position of each field in a ``HEADER_STRUCT.unpack`` tuple.
FIELD_INDEX: dict[str, int] = {f.name: i for i, f in enumerate(FIELDS)}
#: Byte offset of each field in the header (for hot paths that read one field of many rows).
FIELD_OFFSET: dict[str, int] = {name: spec[1] for name, spec in (HEADER_DTYPE.fields or {}).items()}
#: Numpy type of each field (its ``itemsize`` is the field's width in bytes).
FIELD_DTYPE: dict[str, np.dtype] = {name: spec[0] for name, spec in (HEADER_DTYPE.fields or {}).items()}

#: Largest value each field can hold.
FIELD_MAX: dict[str, int] = {f.name: (1 << f.bits) - 1 for f in FIELDS}
#: The fields' names in wire order.
_NAMES = tuple(f.name for f in FIELDS)

#: IPv4 (no options) + UDP headers in front of the DLCP header.
IP_UDP_OVERHEAD = 20 + 8

#: Bytes after the payload of every datagram on the data path (DATA and CREDIT): an 8-byte
#: packet number and a 16-byte tag over the header and the payload (AEGISMAC-128X4; AES-GCM's
#: when the payload is encrypted too), under the key of
#: the sender's direction (:mod:`dlcp.hostagent.auth`, ``hostagent/native/seal.h``). A trailer, not
#: a header field, as QUIC and other AEAD protocols put it: the switch parses the header only,
#: so the P4 header is unchanged; and the tag is computed after every header field is final.
TRAILER_SIZE = 8 + 16


@dataclass(frozen=True)
class Header:
    """One decoded DLCP header; used for control packets and in tests."""

    ptype: PacketType
    job_id: int
    message_id: int
    version: int = VERSION
    token: int = 0
    flags: Flags = Flags.NONE
    priority: int = 0
    drop_class: int = 0
    dtype: Dtype = Dtype.FLOAT32
    sender_rank: int = 0
    iteration: int = 0
    tensor_id: int = 0
    layer: int = 0
    elem_count: int = 0
    seq: int = 0
    total_pkts: int = 0
    elem_offset: int = 0

    def __post_init__(self) -> None:
        for f, value, top in zip(FIELDS, _FIELD_VALUES(self), _MAXES):
            if not 0 <= value <= top:
                raise ValueError(
                    f"header field {f.name}={int(value)} does not fit in {f.bits} bits (0..{top})"
                )

    def as_dict(self) -> dict[str, int]:
        """Field values as plain ints, in wire order."""
        return {f.name: int(v) for f, v in zip(FIELDS, _FIELD_VALUES(self))}


#: A header's field values in wire order, in one C call (the control thread packs and reads a
#: header per control record: packing with a loop of ``getattr`` took 2.3 us, this 0.5).
_FIELD_VALUES = operator.attrgetter(*_NAMES)
_MAXES = tuple(FIELD_MAX[name] for name in _NAMES)


def pack_header(header: Header) -> bytes:
    """Encode one header to its ``HEADER_SIZE`` wire bytes.

    Example: ``pack_header(Header(PacketType.STOP, job_id=1, message_id=7))``
    """
    return _STRUCT.pack(*_FIELD_VALUES(header))


class MalformedHeader(ValueError):
    """A buffer that is not a DLCP header this endpoint can read; ``reason`` is a short code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def unpack_header(buf: bytes | bytearray | memoryview) -> Header:
    """Decode the header at the start of ``buf``.

    Raises:
        MalformedHeader: ``truncated`` (shorter than a header), ``bad_version``,
            ``bad_ptype`` or ``bad_dtype``.
    """
    if len(buf) < HEADER_SIZE:
        raise MalformedHeader("truncated", f"{len(buf)} bytes, header needs {HEADER_SIZE}")
    values = dict(zip(_NAMES, _STRUCT.unpack_from(buf)))
    if values["version"] != VERSION:
        raise MalformedHeader("bad_version", f"version {values['version']}, expected {VERSION}")
    try:
        values["ptype"] = PacketType(values["ptype"])
    except ValueError:
        raise MalformedHeader("bad_ptype", f"unknown packet type {values['ptype']}") from None
    try:
        values["dtype"] = Dtype(values["dtype"])
    except ValueError:
        raise MalformedHeader("bad_dtype", f"unknown dtype code {values['dtype']}") from None
    values["flags"] = Flags(values["flags"])
    # Every field came out of its own width, so it fits: the range checks of __post_init__
    # cannot fail here and are skipped (a frozen dataclass without slots keeps its fields in
    # __dict__).
    header = object.__new__(Header)
    header.__dict__.update(values)
    return header


def encode_headers(n: int, **fields: Any) -> np.ndarray:
    """Build ``n`` headers at once; each field is a scalar (broadcast) or a length-``n`` array.

    Fields not given are zero, except ``version`` which defaults to :data:`VERSION`.

    Raises:
        ValueError: an unknown field name, or a value that does not fit its width.

    Example: ``encode_headers(3, ptype=1, seq=np.arange(3)).tobytes()``
    """
    unknown = set(fields) - set(FIELD_INDEX)
    if unknown:
        raise ValueError(f"unknown header fields {sorted(unknown)}; known: {list(FIELD_INDEX)}")
    out = np.zeros(n, dtype=HEADER_DTYPE)
    out["version"] = VERSION
    for name, value in fields.items():
        arr = np.asarray(value)
        if arr.size and (arr.min() < 0 or arr.max() > FIELD_MAX[name]):
            raise ValueError(
                f"header field {name} has values outside 0..{FIELD_MAX[name]} "
                f"(min {arr.min()}, max {arr.max()})"
            )
        out[name] = arr
    return out


def decode_headers(buf: bytes | bytearray | memoryview | np.ndarray, count: int | None = None) -> np.ndarray:
    """View ``count`` back-to-back headers in ``buf`` as a :data:`HEADER_DTYPE` array (no copy)."""
    return np.frombuffer(buf, dtype=HEADER_DTYPE, count=-1 if count is None else count)


# --- credits ---------------------------------------------------------------------------
# A CREDIT is a bare header on the data path (no payload), from a receiver R to a sender S:
# ``sender_rank`` R, ``iteration`` a sequence number that grows with every credit R sends S,
# ``total_pkts``/``elem_offset`` the high and low 32 bits of the data packets of S that R has
# taken from its socket so far, ``elem_count`` the window: how many packets S may have sent
# beyond that. ``token`` is 0 (since version 4); the trailer seals the credit under the key of the
# direction R -> S. S keeps the highest count of the highest sequence, so a late credit grants
# nothing (and a replayed one is refused by the trailer's replay window).

#: Most packets a credit can grant (``elem_count``'s width).
MAX_CREDIT_WINDOW = FIELD_MAX["elem_count"]


def header_fields_for_p4() -> list[tuple[str, int]]:
    """(name, bits) in wire order, the form BMv2 JSON ``header_types`` uses."""
    return [(f.name, f.bits) for f in FIELDS]



# --- control frames -------------------------------------------------------------------
# Control packets (META, PROBE, BITMAP, NACK, STOP, FEEDBACK) travel on a TCP connection per peer,
# each as one frame: a 4-byte big-endian length of what follows, a DLCP header, then a body.

# A PROBE (and a refusing STOP, flag MISMATCH) says the message's shape in its header: ``dtype``,
# ``total_pkts``, ``elem_offset`` the message's total elements and ``elem_count`` its elements
# per packet, so a receiver whose posted receive expects another shape refuses it at once.


class ShapeFields(TypedDict):
    """The header fields that state a message's shape (see above)."""

    dtype: int
    total_pkts: int
    elem_offset: int
    elem_count: int


def shape_fields(dtype_code: int, total_elems: int, elems_per_packet: int) -> ShapeFields:
    """The header fields that state a message's shape (see above)."""
    packets = -(-total_elems // elems_per_packet) if elems_per_packet else 0
    return ShapeFields(dtype=dtype_code, total_pkts=packets, elem_offset=total_elems, elem_count=elems_per_packet)


def describe_shape(dtype_code: int, total_elems: int, elems_per_packet: int) -> str:
    """``"1000 float32 elements (2236 per packet)"``: a shape as an error message says it."""
    known = {int(code): dt.name for code, dt in NUMPY_DTYPES.items()}
    kind = known.get(dtype_code, f"dtype code {dtype_code}")
    return f"{total_elems} {kind} elements ({elems_per_packet} per packet)"


#: Frame length prefix.
FRAME_PREFIX = struct.Struct("!I")
#: Largest frame accepted from a peer (a bitmap of 2^24 packets fits): a bound against
#: a hostile or corrupt length prefix.
MAX_FRAME = HEADER_SIZE + (1 << 21)

#: META body: total elements, elements per packet, loss bound p (the header names the rest).
META_BODY = struct.Struct("!IHd")
#: STOP body: elements the receiver holds (so the sender knows the final lost fraction),
#: followed, when something is missing, by the missing-packet bitmap (as BITMAP's), so the
#: sender knows exactly what was lost (error feedback uses it).
STOP_BODY = struct.Struct("!I")
#: BITMAP body: elements the receiver holds, then the missing-packet bitmap (bit ``seq``
#: set, MSB first, when ``seq`` is missing). A NACK's body is the same, its bitmap the holes.
BITMAP_PREFIX = struct.Struct("!I")
#: FEEDBACK body: data packets received and CE-marked since the previous feedback, packets
#: the receiver counted as lost (its socket-buffer overruns), and the rate in KB/s this sender
#: may send at so the receiver can drain it (its measured drain capacity shared among its
#: current senders; 0 = not measured yet).
FEEDBACK_BODY = struct.Struct("!IIII")
#: HELLO body: handshake step (1-4), the sender's nonce (steps 1, 2), its proof that it holds
#: the job secret (steps 2, 3; zeros without a secret) and its receive key for the peer (steps
#: 3, 4). See :mod:`dlcp.hostagent.auth` for the exchange.
HELLO_BODY = struct.Struct("!B16s32s16s")
#: BATCH body: records back to back, each a 4-byte length and a record (header + body), so a
#: peer's META, PROBE, STOP, BITMAP and FEEDBACK records of one moment cost one frame.
RECORD_PREFIX = struct.Struct("!I")


def pack_frame(header: Header, body: bytes = b"") -> bytes:
    """One control frame: length prefix, header, body."""
    return FRAME_PREFIX.pack(HEADER_SIZE + len(body)) + pack_header(header) + body


def pack_record(header: Header, body: bytes = b"") -> bytes:
    """One control record: header and body, without a frame prefix."""
    return pack_header(header) + body


def pack_records(records: list[bytes], job_id: int, sender_rank: int) -> bytes:
    """One frame for ``records``: the record itself when there is one, else a BATCH of them."""
    if len(records) == 1:
        return FRAME_PREFIX.pack(len(records[0])) + records[0]
    body = b"".join(RECORD_PREFIX.pack(len(r)) + r for r in records)
    return pack_frame(Header(ptype=PacketType.BATCH, job_id=job_id, message_id=len(records),
                             sender_rank=sender_rank), body)


def split_batch(body: bytes) -> list[bytes]:
    """The records of a BATCH body.

    Raises:
        MalformedHeader: ``bad_batch`` when a length runs past the body or a record is shorter
            than a header.
    """
    out, pos = [], 0
    while pos < len(body):
        if pos + RECORD_PREFIX.size > len(body):
            raise MalformedHeader("bad_batch", f"record length prefix cut at byte {pos}")
        (size,) = RECORD_PREFIX.unpack_from(body, pos)
        pos += RECORD_PREFIX.size
        if size < HEADER_SIZE or pos + size > len(body):
            raise MalformedHeader("bad_batch", f"record of {size} bytes at byte {pos} of a {len(body)}-byte batch")
        out.append(body[pos : pos + size])
        pos += size
    return out


def split_frame(frame: bytes | bytearray | memoryview) -> tuple[Header, bytes]:
    """Header and body of a frame *without* its length prefix.

    Raises:
        MalformedHeader: the header is unreadable.
    """
    return unpack_header(frame), bytes(frame[HEADER_SIZE:])
