"""The compiled data path's validation and placement of datagrams, without sockets or threads.

A :class:`Placement` takes datagrams already in receive rows (``uint8`` matrices, one datagram
per row) and does to them exactly what the receive thread does to a batch it read: check each
field against the message expected, place the payload by its offset, count duplicates and
rejections by reason. The foundation demo and the packetizer benchmark run it, and the endpoint
times it at start (:meth:`dlcp.hostagent.datapath.native.NativeDatapath.calibrate`).

Why not a Python reassembler: the rules of which packet is placed where are written once, in
``hostagent/native/`` (issue 44, item 7); a copy in Python would be a second definition that
the demo and the benchmark show while the transport runs the other. (The tests keep such a
copy as a reference model: ``tests/reference/reassembly.py``.)

Example::

    batch = packetize(grad, MessageMeta(job_id=1, message_id=1), Policy())
    place = Placement(job_id=1)
    rows, lengths = place.rows(batch)                # the datagrams as the wire carries them
    msg = place.expect(1, batch)                     # packets from rank place.sender (0)
    place.ingest(rows[kept], lengths[kept])          # any order, duplicates fine
    grad_received, lost = msg.out, msg.lost_fraction  # zero where packets are missing
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlcp.hostagent import _datapath, sealing, wire
from dlcp.hostagent.datapath.config import _raw, native_config
from dlcp.hostagent.packetizer import PacketBatch
from dlcp.hostagent.protocol.port import RxBuffers
from dlcp.hostagent.transport_config import TransportConfig, local_peers

#: The key a Placement and the rows it seals share (nothing secret: it never leaves the process).
_KEY = bytes(range(16))


@dataclass
class PlacedMessage:
    """One message a :class:`Placement` expects: its destination and its per-packet record."""

    out: np.ndarray
    """The message's elements as placed so far; zero where no packet arrived (``out`` starts zeroed)."""
    buffers: RxBuffers
    counts: np.ndarray
    """Elements in each packet (the last may hold fewer)."""

    @property
    def received(self) -> np.ndarray:
        """Per packet, whether it was placed."""
        return self.buffers.received[: self.counts.size].astype(bool)

    @property
    def lost_fraction(self) -> float:
        """The fraction of the message's elements no packet brought."""
        total = int(self.counts.sum())
        return 0.0 if total == 0 else float(self.counts[~self.received].sum()) / total


class Placement:
    """The receive thread's placement rule, driven by the caller (one thread at a time).

    ``protection`` is the trailer's (0 none, 1 a MAC, 2 encryption; ``TransportConfig.protection``):
    with 1 or 2 each datagram's tag is checked (and its payload decrypted) before it is placed,
    as an endpoint's are. ``config``: an endpoint's configuration to place as it does (its job,
    protection, batch and parking limits) instead of rank 1 of a 2-rank job. Packets come from
    rank :attr:`sender` (0, or 1 where ``config``'s own rank is 0).
    """

    def __init__(self, job_id: int = 1, protection: int = sealing.NONE, config: TransportConfig | None = None) -> None:
        cfg = config or TransportConfig(rank=1, peers=local_peers(2, 1), job_id=job_id,
                                        authenticate=protection >= sealing.MAC,
                                        encrypt=protection == sealing.ENCRYPT)
        self.config = cfg
        self.sender = 1 if cfg.rank == 0 else 0
        self._dp = _datapath.Datapath(native_config(cfg, -1, False))
        self._dp.set_rx_key(self.sender, _KEY)
        self._sealer = sealing.new_sealer(_KEY, cfg.protection)
        # every expected message's buffers, which the compiled path writes into: held here as
        # long as it may (a caller that drops what expect() returned must not free them)
        self._held: dict[int, PlacedMessage] = {}

    def rows(self, batch: PacketBatch) -> tuple[np.ndarray, np.ndarray]:
        """``batch``'s datagrams as the wire carries them (header, payload, trailer: sealed under
        this placement's key, so they pass its check), one per row, and their lengths."""
        slots, lengths = batch.to_slots(batch.datagram_bytes)
        return slots, sealing.seal_rows(self._sealer, slots, lengths)

    def expect(self, message_id: int, batch: PacketBatch, out: np.ndarray | None = None,
               token: int = 0) -> PlacedMessage:
        """Announce the message ``batch`` holds (from :attr:`sender`), to be placed in ``out``
        (default: a new zeroed array of its size and type).

        A message all of whose packets were placed may be expected again (its id used anew).

        Raises:
            ValueError: ``out`` is not a C-contiguous array of the message's size and type, or
                the message is expected already and not complete.
        """
        total, dtype = batch.payload.size, batch.payload.dtype
        if out is None:
            out = np.zeros(total, dtype)
        if out.shape != (total,) or out.dtype != dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous array of {total} {dtype}; got {out.shape} {out.dtype}")
        counts = batch.headers["elem_count"].astype(np.int64)
        buffers = RxBuffers.allocate(out, len(batch), 0)
        code = int(wire.dtype_code(dtype))
        self._dp.expect(self.sender, message_id, token, code, total, batch.elems_per_packet, _raw(buffers.out),
                        False, code, buffers.received, buffers.pkt_priority, buffers.pkt_layer, total, [])
        self._held[message_id] = PlacedMessage(out, buffers, counts)
        return self._held[message_id]

    def ingest(self, rows: np.ndarray, lengths: np.ndarray, now: float = 0.0) -> np.ndarray:
        """Validate and place datagram ``i`` (``rows[i, :lengths[i]]``) for every ``i``, in order.
        Returns per datagram 0 (placed or a duplicate) or the index of its reason in
        :data:`dlcp.hostagent.protocol.port.REASONS`. ``rows`` is not changed."""
        rows = np.ascontiguousarray(rows, np.uint8)
        lengths = np.ascontiguousarray(lengths, np.int64)
        return np.asarray(self._dp.ingest_for_test(rows, lengths, now), np.uint8)

    def rejected(self) -> dict[str, int]:
        """Datagrams rejected so far, by reason."""
        return dict(self._dp.rejected())


__all__ = ["PlacedMessage", "Placement"]
