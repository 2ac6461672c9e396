"""Order-free, duplicate-safe reassembly of DLCP messages, with a per-packet bitmap: in numpy,
the reference model's (:mod:`tests.reference.numpy_path`), not the package's.

It was ``dlcp.hostagent.reassembly`` until the demo and the packetizer benchmark placed
packets with the compiled path's own code (:class:`dlcp.hostagent.datapath.offline.Placement`):
the receive rules are written once, in ``hostagent/native/``; this is the independent second
reading the tests compare the compiled path with.

A receiver announces each message it expects (:meth:`Reassembler.expect`), which
preallocates the destination array. Arriving datagrams are placed by their element
offset, whatever order or path they took; a packet seen before is counted and skipped.
What is still missing is a bitmap, so the transport can decide completion under the loss
bound and ask for exactly the missing packets.

Every packet comes from the network and may be malformed or hostile. Each header field is
checked against the expected message before a byte is written: a bad packet is counted
under its reason (:data:`REASONS`) and ignored; it never writes out of range and never
raises into the receive loop.

The fast path is :meth:`Reassembler.ingest_batch`: a receive loop ``recv_into``s datagrams
into the rows of a preallocated ``uint8`` matrix, and the whole batch is validated with
numpy masks and scattered into the destination arrays with one fancy-indexed copy per
message. :meth:`Reassembler.ingest` takes a single datagram through the same code.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import numpy as np

from dlcp.hostagent import wire
from dlcp.hostagent.policy import is_complete
from dlcp.hostagent.protocol.port import REASONS

log = logging.getLogger(__name__)

_CODE = {name: i for i, name in enumerate(REASONS)}
_H = wire.HEADER_SIZE

#: Header fields that differ between the packets of one first pass of a message. Every other
#: header byte is the same in all of them, which is what lets a batch be checked as one run.
_PER_PACKET_FIELDS = ("flags", "priority", "drop_class", "layer", "seq", "elem_offset")
_RUN_CONSTANT_BYTES = np.concatenate([
    np.arange(off, off + wire.FIELD_DTYPE[name].itemsize) for name, off in wire.FIELD_OFFSET.items()
    if name not in _PER_PACKET_FIELDS])
_RETX = int(wire.Flags.RETX)
_DATA = int(wire.PacketType.DATA)
_nz = np.count_nonzero
# The same as a mask over the header's 32-bit words (the header is a whole number of them).
assert _H % 4 == 0, "the run check reads the header as 32-bit words"
_const = np.zeros(_H, dtype=np.uint8)
_const[_RUN_CONSTANT_BYTES] = 0xFF
_RUN_CONSTANT_MASK = _const.view(np.uint32)
del _const
_FLAGS_BYTE = wire.FIELD_OFFSET["flags"]
_SEQ_WORD = wire.FIELD_OFFSET["seq"] // 4
_OFFSET_WORD = wire.FIELD_OFFSET["elem_offset"] // 4
assert wire.FIELD_OFFSET["seq"] % 4 == 0 and wire.FIELD_OFFSET["elem_offset"] % 4 == 0
_I_SEQ, _I_TOKEN, _I_DTYPE, _I_TOTAL, _I_COUNT, _I_OFFSET = (
    wire.FIELD_INDEX[f] for f in ("seq", "token", "dtype", "total_pkts", "elem_count", "elem_offset"))
_I_VERSION, _I_PTYPE, _I_JOB, _I_SENDER, _I_MESSAGE, _I_ITERATION = (
    wire.FIELD_INDEX[f] for f in ("version", "ptype", "job_id", "sender_rank", "message_id", "iteration"))


class Assembly:
    """One message being received: its destination array and which packets arrived."""

    def __init__(
        self,
        sender_rank: int,
        message_id: int,
        total_elems: int,
        dtype: np.dtype | type | str,
        elems_per_packet: int,
        out: np.ndarray | None = None,
        token: int = 0,
        accumulate: bool = False,
        received: np.ndarray | None = None,
        pkt_priority: np.ndarray | None = None,
        pkt_layer: np.ndarray | None = None,
        scale: float = 1.0,
        iteration: int | None = None,
    ) -> None:
        """``accumulate``: add each payload into ``out`` (float32, or the wire's type: see
        :func:`dlcp.hostagent.wire.destination_dtypes`) instead of copying it; with ``scale`` (a
        float32 message into float32), ``out = out * scale + payload``, and where no packet came
        ``out * scale`` at completion (:meth:`zero_missing`), as the compiled path adds.
        ``received`` (uint8), ``pkt_priority`` (uint8) and ``pkt_layer`` (int64), one per packet,
        are adopted when given (a data path whose caller owns them), else allocated.
        ``iteration``: the iteration this use of the message id belongs to; a packet of another
        is ``stale`` (recorded at an earlier use: its tag is right, it belongs elsewhere). None:
        not checked."""
        if total_elems < 0 or total_elems > wire.FIELD_MAX["elem_offset"]:
            raise ValueError(f"total_elems={total_elems} outside 0..{wire.FIELD_MAX['elem_offset']}")
        if not 1 <= elems_per_packet <= wire.FIELD_MAX["elem_count"]:
            raise ValueError(f"elems_per_packet={elems_per_packet} outside 1..{wire.FIELD_MAX['elem_count']}")
        self.key = (sender_rank, message_id)
        self.token = token
        self.iteration = iteration
        self.dtype_code = wire.dtype_code(dtype)
        self.wire_dtype = wire.NUMPY_DTYPES[self.dtype_code]
        self.total_elems = total_elems
        self.elems_per_packet = elems_per_packet
        self.total_pkts = -(-total_elems // elems_per_packet)
        self.n_full, self.tail = divmod(total_elems, elems_per_packet)
        self.accumulate = accumulate
        self.scale = np.float32(scale)
        if scale != 1.0 and not (accumulate and self.wire_dtype == np.float32
                                 and (out is None or out.dtype == np.float32)):
            raise ValueError("a scale needs a float32 message added into float32")
        dest = wire.destination_dtypes(self.wire_dtype, accumulate)
        if out is None:
            out = np.zeros(total_elems, dtype=dest[0])
        elif out.shape != (total_elems,) or not out.flags.c_contiguous or out.dtype not in dest:
            raise ValueError(f"out must be a contiguous 1-D {' or '.join(map(str, dest))} array of {total_elems} "
                             f"elements, got shape {out.shape} dtype {out.dtype}")
        self.data = out
        self._rows = out[: self.n_full * elems_per_packet].reshape(self.n_full, elems_per_packet)
        self._received_u8 = np.zeros(self.total_pkts, np.uint8) if received is None else received[: self.total_pkts]
        self.received = self._received_u8.view(bool)
        self.pkt_priority = np.zeros(self.total_pkts, np.uint8) if pkt_priority is None else pkt_priority
        """Priority each packet carried (set by the transport to the message's for the rest)."""
        self.pkt_layer = np.zeros(self.total_pkts, np.int64) if pkt_layer is None else pkt_layer
        self._claim = np.zeros(self.total_pkts, dtype=np.int64)  # scratch for in-batch repeats
        self._seq_words: np.ndarray | None = None  # the run check's expected seq / elem_offset
        self._offset_words: np.ndarray | None = None
        self.received_pkts = 0
        self.received_elems = 0
        self.duplicates = 0

    # --- state ---------------------------------------------------------------------
    @property
    def received_fraction(self) -> float:
        """Fraction of the message's elements that arrived (1.0 for an empty message)."""
        return self.received_elems / self.total_elems if self.total_elems else 1.0

    @property
    def lost_fraction(self) -> float:
        """Fraction of elements still missing (they read as zero in :meth:`result`)."""
        return 1.0 - self.received_fraction

    def is_exact(self) -> bool:
        """Every packet arrived."""
        return self.received_pkts == self.total_pkts

    def is_complete(self, loss_bound: float) -> bool:
        """At least (1 - loss_bound) of the elements arrived."""
        return is_complete(self.received_elems, self.total_elems, loss_bound)

    def missing_seqs(self) -> np.ndarray:
        """Sequence numbers not yet received, ascending."""
        return np.flatnonzero(~self.received).astype(np.uint32)

    def missing_bitmap(self) -> bytes:
        """Bitmap of missing packets, bit ``seq`` set (MSB first) when ``seq`` is missing.

        This is the payload of a BITMAP control packet; ``ceil(total_pkts / 8)`` bytes.
        """
        return np.packbits(~self.received).tobytes()

    def zero_missing(self) -> None:
        """Set every element of a missing packet to zero (a sum added into stays as it is, but
        is scaled where scaled sums were to be added)."""
        if not self.accumulate:
            self.result()
        elif self.scale != 1:
            missing = self.missing_seqs()
            if missing.size:
                self._rows[missing[missing < self.n_full]] *= self.scale
                if self.tail and missing[-1] == self.n_full:
                    self.data[self.n_full * self.elems_per_packet :] *= self.scale

    def _add(self, dst: np.ndarray, values: np.ndarray) -> None:
        """``dst += values`` in place, ``dst`` scaled first when the sum is scaled (two float32
        operations, each rounded, as the compiled path does them)."""
        if self.scale != 1:
            dst *= self.scale
        dst += values

    def result(self) -> np.ndarray:
        """The message, with every element of a missing packet set to zero."""
        missing = self.missing_seqs()
        if missing.size:
            full = missing[missing < self.n_full]
            self._rows[full] = 0
            if self.tail and missing[-1] == self.n_full:
                self.data[self.n_full * self.elems_per_packet :] = 0
        return self.data

    # --- ingest --------------------------------------------------------------------
    def _ingest_run(self, slots: np.ndarray, lengths: np.ndarray, hdr: np.ndarray, h0: tuple) -> bool:
        """The common case in a dozen vector operations: the whole batch is one run of
        consecutive, full-size, first-time, non-retransmitted packets of this message, in order.
        ``h0`` is the first header as a ``wire.HEADER_STRUCT`` tuple.

        Returns False, having changed nothing, when any of that does not hold; the batch then
        takes the general path (:meth:`_ingest_rows`), which finds out why. Why it exists: a
        receive batch costs about a dozen numpy calls here against about a hundred there, and
        that fixed cost, not the copy, bounds what a receiver drains at MTU 1500. The header
        rows are compared as 32-bit words (every byte that must equal the first row's, then
        seq and elem_offset against their expected values), not field by field: a field of a
        structured array is a strided big-endian view, several times slower to test; and tests
        count with ``np.count_nonzero``, as ``ndarray.any`` costs a few microseconds of Python.
        """
        n = len(lengths)
        per = self.elems_per_packet
        s0 = h0[_I_SEQ]
        if (s0 + n > self.n_full or h0[_I_TOKEN] != self.token
                or (self.iteration is not None and h0[_I_ITERATION] != self.iteration)
                or h0[_I_DTYPE] != self.dtype_code or h0[_I_TOTAL] != self.total_pkts or h0[_I_COUNT] != per
                or h0[_I_OFFSET] != s0 * per):
            return False
        payload = per * self.wire_dtype.itemsize
        if _H + payload > slots.shape[1] or _nz(lengths != _H + payload):
            return False  # (datagrams wider than a slot are the general path's "truncated")
        if _nz(self.received[s0 : s0 + n]) or _nz(slots[:, _FLAGS_BYTE] & _RETX):
            return False
        if n > 1:
            words = slots[:, :_H].view(np.uint32)
            if _nz((words ^ words[0]) & _RUN_CONSTANT_MASK):
                return False
            # seq and elem_offset of every full packet, as on the wire
            if self._seq_words is None or self._offset_words is None:
                seqs = np.arange(self.n_full, dtype=np.uint64)
                self._seq_words = seqs.astype(">u4").view(np.uint32)
                self._offset_words = (seqs * per).astype(">u4").view(np.uint32)
            if (_nz(words[:, _SEQ_WORD] != self._seq_words[s0 : s0 + n])
                    or _nz(words[:, _OFFSET_WORD] != self._offset_words[s0 : s0 + n])):
                return False
        src = slots[:, _H : _H + payload].view(self.wire_dtype)
        if self.accumulate:
            self._add(self._rows[s0 : s0 + n], src)
        else:
            self._rows[s0 : s0 + n] = src
        self.received[s0 : s0 + n] = True
        self.pkt_priority[s0 : s0 + n] = hdr["priority"]
        self.pkt_layer[s0 : s0 + n] = hdr["layer"]
        self.received_pkts += n
        self.received_elems += n * per
        return True

    def _ingest_rows(self, slots: np.ndarray, lengths: np.ndarray, h: np.ndarray,
                     rows: np.ndarray, reason: np.ndarray, placed: np.ndarray | None = None) -> tuple[int, int]:
        """Validate rows already known to belong to this message; copy the good new ones.

        ``h`` holds the headers of ``rows``. Sets ``reason`` for bad rows and ``placed`` (if
        given) for the rows that placed a new packet. Returns ``(accepted, duplicates)``.
        """
        seq = h["seq"].astype(np.int64)
        in_range = seq < self.total_pkts
        safe_seq = np.where(in_range, seq, 0)
        per = self.elems_per_packet
        expected = np.full(len(rows), per, dtype=np.int64)
        if self.tail:
            expected[safe_seq == self.n_full] = self.tail
        itemsize = self.wire_dtype.itemsize
        local = np.zeros(len(rows), dtype=np.uint8)
        checks = (
            ("bad_token", h["token"] != self.token),  # first: a forged packet counts for nothing else
            ("stale", (h["iteration"] != self.iteration) if self.iteration is not None
             else np.zeros(len(rows), dtype=bool)),  # an earlier use of the message id
            ("wrong_dtype", h["dtype"] != self.dtype_code),
            ("bad_seq", (h["total_pkts"] != self.total_pkts) | ~in_range),
            ("bad_offset", h["elem_offset"].astype(np.int64) != safe_seq * per),
            ("count_mismatch", (h["elem_count"] != expected) | (lengths[rows] != _H + expected * itemsize)),
        )
        for name, bad in checks:
            local[(local == 0) & bad] = _CODE[name]
        reason[rows] = local
        good = local == 0
        if good.all():
            new_rows, new_seq = rows, safe_seq
        else:
            new_rows, new_seq = rows[good], safe_seq[good]
        arrived = len(new_seq)
        fresh = ~self.received[new_seq]
        if not fresh.all():
            new_rows, new_seq = new_rows[fresh], new_seq[fresh]
        if len(new_seq) > 1:
            # The same seq twice in one batch: keep the first read, as the compiled path (one
            # datagram after another) does; an original and its resend in one batch then
            # count alike on both. Each candidate claims its seq, in reverse order, so the
            # first one's claim is written last and survives: repeats found without sorting.
            pos = np.arange(len(new_seq), dtype=np.int64)
            self._claim[new_seq[::-1]] = pos[::-1]
            keep = self._claim[new_seq] == pos
            if not keep.all():
                new_rows, new_seq = new_rows[keep], new_seq[keep]
        duplicates = arrived - len(new_seq)
        self.duplicates += duplicates
        if not new_seq.size:
            return 0, duplicates
        if placed is not None:
            placed[new_rows] = True
        full = new_seq < self.n_full
        rows_f, seq_f = (new_rows, new_seq) if full.all() else (new_rows[full], new_seq[full])
        if rows_f.size:
            if rows_f[-1] - rows_f[0] + 1 == len(rows_f):
                # The usual case, a run of consecutive slots (rows ascend): scatter from a view.
                src = slots[rows_f[0] : rows_f[-1] + 1, _H : _H + per * itemsize]
            else:
                src = slots[rows_f, _H : _H + per * itemsize]
            k = len(seq_f)
            values = src.view(self.wire_dtype)
            if int(seq_f[-1]) - int(seq_f[0]) + 1 == k and (k < 3 or (np.diff(seq_f) == 1).all()):
                block = self._rows[int(seq_f[0]) : int(seq_f[0]) + k]  # in order: one block copy
                if self.accumulate:
                    self._add(block, values)
                else:
                    block[:] = values
            elif self.accumulate:  # seqs are unique here: each packet added once
                rows = self._rows[seq_f]  # (a copy: fancy indexing)
                self._add(rows, values)
                self._rows[seq_f] = rows
            else:
                self._rows[seq_f] = values
        if rows_f.size < new_seq.size:  # the short last packet
            row = new_rows[~full][0]
            tail = slots[row, _H : _H + self.tail * itemsize].view(self.wire_dtype)
            if self.accumulate:
                self._add(self.data[self.n_full * per :], tail)
            else:
                self.data[self.n_full * per :] = tail
        self.received[new_seq] = True
        # What each packet was tagged with; a retransmission's tags are the sender's top, not its layer's.
        first = slots[new_rows, :_H].view(wire.HEADER_DTYPE).reshape(-1)
        orig = (first["flags"] & int(wire.Flags.RETX)) == 0
        self.pkt_priority[new_seq[orig]] = first["priority"][orig]
        self.pkt_layer[new_seq[orig]] = first["layer"][orig]
        self.received_pkts += len(new_seq)
        self.received_elems += len(new_seq) * per - (0 if full.all() else per - self.tail)
        return len(new_seq), duplicates


@dataclass
class ReassemblyStats:
    """Totals of one reassembler since it was made."""

    accepted: int = 0
    duplicates: int = 0
    rejected: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {"accepted": self.accepted, "duplicates": self.duplicates,
                "rejected": dict(self.rejected), "rejected_total": sum(self.rejected.values())}


@dataclass(frozen=True)
class BatchResult:
    """What one :meth:`Reassembler.ingest_batch` call did."""

    accepted: int
    duplicates: int
    reasons: np.ndarray
    """Per datagram: index into :data:`REASONS` (0 = accepted or duplicate)."""
    touched: tuple[Assembly, ...]
    """Messages that received at least one new packet."""
    parked: int = 0
    """Packets of unannounced messages handed to the ``park`` callback and kept."""
    run: bool = False
    """The whole batch was one in-order run of new packets of ``touched[0]``: every datagram
    was accepted, none is a retransmission (the fast path)."""
    placed: np.ndarray | None = None
    """Per datagram: True where it placed a new packet (None for a run: every one did). A
    duplicate is accepted (reason 0) but places nothing."""

    @property
    def rejected(self) -> int:
        return int(np.count_nonzero(self.reasons))


class Reassembler:
    """Reassembles every message one endpoint expects, for one job.

    Example::

        r = Reassembler(job_id=1)
        asm = r.expect(sender_rank=0, message_id=7, total_elems=10_000,
                       dtype=np.float32, elems_per_packet=357)
        r.ingest(datagram)            # any order, duplicates fine
        if asm.is_complete(0.05): grad = asm.result()
    """

    def __init__(self, job_id: int, token_of: Callable[[int, int, int], int | None] | None = None) -> None:
        """``token_of(sender, message_id, iteration)``: the token a packet of a message not
        announced yet must carry to be handed to ``park`` (None: that sender has no key, so
        nothing of it is parked); without it, unannounced packets go to ``park`` unchecked."""
        if not 0 <= job_id <= wire.FIELD_MAX["job_id"]:
            raise ValueError(f"job_id={job_id} outside 0..{wire.FIELD_MAX['job_id']}")
        self.job_id = job_id
        self.token_of = token_of
        self.stats = ReassemblyStats()
        self._messages: dict[tuple[int, int], Assembly] = {}

    def expect(self, sender_rank: int, message_id: int, total_elems: int, dtype: np.dtype | type | str,
               elems_per_packet: int, out: np.ndarray | None = None, token: int = 0, **buffers: Any) -> Assembly:
        """Announce a message and preallocate (or adopt ``out`` as) its destination; its packets
        must carry ``token`` (:data:`dlcp.hostagent.auth.DATA_TOKEN` from an endpoint).

        Raises:
            ValueError: the message is already expected, or its parameters are invalid.
        """
        key = (sender_rank, message_id)
        if key in self._messages:
            raise ValueError(f"message {message_id} from rank {sender_rank} is already expected")
        asm = Assembly(sender_rank, message_id, total_elems, dtype, elems_per_packet, out, token, **buffers)
        self._messages[key] = asm
        return asm

    def get(self, sender_rank: int, message_id: int) -> Assembly | None:
        return self._messages.get((sender_rank, message_id))

    def forget(self, sender_rank: int, message_id: int) -> Assembly | None:
        """Stop accepting packets of a message (late ones then count as ``unknown_message``)."""
        return self._messages.pop((sender_rank, message_id), None)

    def __len__(self) -> int:
        return len(self._messages)

    def ingest(self, datagram: bytes | bytearray | memoryview) -> str:
        """Place one datagram. Returns ``"accepted"``, ``"duplicate"`` or a reason from :data:`REASONS`."""
        buf = np.frombuffer(datagram, dtype=np.uint8)
        slots = np.zeros((1, max(buf.size, _H)), dtype=np.uint8)
        slots[0, : buf.size] = buf
        res = self.ingest_batch(slots, np.array([buf.size]))
        if res.reasons[0]:
            return REASONS[res.reasons[0]]
        return "accepted" if res.accepted else "duplicate"

    def ingest_batch(self, slots: np.ndarray, lengths: np.ndarray,
                     park: Callable[[np.ndarray], np.ndarray] | None = None) -> BatchResult:
        """Validate and place a batch of datagrams; ``slots[i, :lengths[i]]`` is datagram ``i``.

        Args:
            park: called with the row indices of well-formed packets of messages not (yet)
                announced; returns a bool mask of the rows it kept for later (a transport whose
                data can overtake the announcement), or per row a code of :data:`REASONS` (0:
                kept). Kept rows are not counted as rejected; the others as unknown_message, or
                under the code it gave.

        Never raises for packet content; raises ``ValueError`` only for a caller error
        (``slots`` not a 2-D uint8 matrix matching ``lengths``).
        """
        lengths = np.asarray(lengths, dtype=np.int64)
        if slots.ndim != 2 or slots.dtype != np.uint8 or slots.shape[0] != lengths.shape[0]:
            raise ValueError("slots must be a 2-D uint8 array with one row per entry of lengths")
        n = len(lengths)
        reason = np.zeros(n, dtype=np.uint8)
        if n == 0:
            return self._finish(reason, 0, 0, ())
        if slots.strides[1] != 1:
            raise ValueError("each row of slots must be contiguous")
        if slots.shape[1] < _H:
            reason[:] = _CODE["truncated"]
            return self._finish(reason, 0, 0, ())
        hdr = slots[:, :_H].view(wire.HEADER_DTYPE).reshape(n)
        h0 = wire.HEADER_STRUCT.unpack(slots[0, :_H].tobytes())
        if h0[_I_VERSION] == wire.VERSION and h0[_I_PTYPE] == _DATA and h0[_I_JOB] == self.job_id:
            asm = self._messages.get((h0[_I_SENDER], h0[_I_MESSAGE]))
            if asm is not None and asm._ingest_run(slots, lengths, hdr, h0):
                self.stats.accepted += n
                return BatchResult(n, 0, reason, (asm,), run=True)
        for name, bad in (
            ("truncated", (lengths < _H) | (lengths > slots.shape[1])),
            ("bad_version", hdr["version"] != wire.VERSION),
            ("not_data", hdr["ptype"] != wire.PacketType.DATA),
            ("wrong_job", hdr["job_id"] != self.job_id),
        ):
            reason[(reason == 0) & bad] = _CODE[name]
        ok = np.flatnonzero(reason == 0)
        placed = np.zeros(n, dtype=bool)
        accepted = duplicates = parked = 0
        touched: list[Assembly] = []
        if ok.size:
            keys = (hdr["sender_rank"][ok].astype(np.uint64) << np.uint64(32)) | hdr["message_id"][ok]
            if keys[0] == keys[-1] and (keys == keys[0]).all():  # one message: skip the sort
                uniq, inverse = keys[:1], None
            else:
                uniq, inverse = np.unique(keys, return_inverse=True)
            for j, key in enumerate(uniq.tolist()):
                rows = ok if inverse is None else ok[inverse == j]
                asm = self._messages.get((key >> 32, key & 0xFFFFFFFF))
                if asm is None:
                    reason[rows] = _CODE["unknown_message"]
                    if self.token_of is not None:
                        its = hdr["iteration"][rows]
                        forged = np.zeros(len(rows), dtype=bool)
                        keyless = False
                        for it in np.unique(its).tolist():
                            token = self.token_of(key >> 32, key & 0xFFFFFFFF, it)
                            if token is None:
                                keyless = True
                                break
                            sel = its == it
                            forged[sel] = hdr["token"][rows][sel] != token
                        if keyless:
                            continue  # a sender without a key: nothing of it is kept
                        if forged.any():
                            reason[rows[forged]] = _CODE["bad_token"]
                            rows = rows[~forged]
                    if park is not None and rows.size:
                        verdict = np.asarray(park(rows))
                        if verdict.dtype == bool:
                            verdict = np.where(verdict, 0, _CODE["unknown_message"])
                        reason[rows] = verdict
                        parked += int(np.count_nonzero(verdict == 0))
                    continue
                a, d = asm._ingest_rows(slots, lengths, hdr if rows.size == n else hdr[rows], rows, reason, placed)
                accepted += a
                duplicates += d
                if a:
                    touched.append(asm)
        return self._finish(reason, accepted, duplicates, tuple(touched), parked, placed)

    def _finish(self, reason: np.ndarray, accepted: int, duplicates: int,
                touched: tuple[Assembly, ...], parked: int = 0, placed: np.ndarray | None = None) -> BatchResult:
        self.stats.accepted += accepted
        self.stats.duplicates += duplicates
        if reason.any():
            codes, counts = np.unique(reason[reason > 0], return_counts=True)
            for code, count in zip(codes.tolist(), counts.tolist()):
                self.stats.rejected[REASONS[code]] += count
                log.debug("rejected %d datagram(s): %s", count, REASONS[code])
        return BatchResult(accepted, duplicates, reason, touched, parked,
                           placed=placed if placed is not None else np.zeros(len(reason), dtype=bool))
