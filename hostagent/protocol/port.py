"""What the protocol core asks of a data path, and what a data path tells it.

The core (:mod:`dlcp.hostagent.protocol.core`) decides; a data path moves packets. This module is the
whole contract between them: the specifications of a message to receive (:class:`RxSpec`) or to
send (:class:`TxSpec`), the :class:`DataPort` methods the core calls, and the events a data path
reports (:class:`Event`). The compiled data path implements it
(:mod:`dlcp.hostagent.datapath.native`), and so does the numpy reference model in the tests
(``tests/reference/numpy_path.py``); the core's tests use an in-memory one on a fake clock.

Every buffer in a spec belongs to the caller, who keeps it alive until the message is retired
(sender) or forgotten (receiver); a data path never frees one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

#: Why a data path rejected a datagram, by code (index); code 0 means accepted. The compiled data
#: path counts them under these names (``Datapath::rejected``, its ``enum Reason`` in the same
#: order: tests/unit/test_port_codes.py reads both from the C++ sources).
REASONS: tuple[str, ...] = (
    "ok",
    "truncated",  # shorter than a DLCP header
    "bad_version",  # header version is not wire.VERSION
    "not_data",  # a control packet type on the data path
    "wrong_job",  # job id differs from this receiver's
    "bad_token",  # a data token not the one its sender was given, or a credit from no peer we send to
    "unknown_message",  # (sender, message id) was never announced, or already finished
    "wrong_dtype",  # element type differs from the announced one
    "bad_seq",  # seq or total_pkts does not fit the announced message
    "bad_offset",  # elem_offset is not seq * elements-per-packet (or past the end)
    "count_mismatch",  # elem_count or payload length differs from what this seq must carry
    "stale",  # right token for its own iteration, but recorded earlier (native/rx.cc Datapath::stale)
    "bad_mac",  # the trailer's tag is wrong (a bit changed anywhere, or not sealed under its sender's key)
    "replay",  # authentic, but its packet number was taken already: a recorded copy sent again
)


class EventKind(enum.IntEnum):
    """What a data path reports (the compiled path's ``enum EventKind`` has the same values:
    tests/unit/test_port_codes.py)."""

    RX_DONE = 1  #: a received message completed in the data path (``a``: a key of :data:`DONE_HOW`)
    RX_LAST = 2  #: a packet that ends the sender's pass arrived: answer as to a PROBE
    RX_RETX = 3  #: ``a`` retransmitted packets of the message arrived
    CONGESTION = 4  #: the first CE mark or socket overrun from ``peer`` since its last feedback
    TX_PASS = 5  #: a sending pass of the message ended (``a``: its pass number)
    TX_ACTIVE = 6  #: a held message started sending (its trigger fired)
    FAILED = 7  #: a thread of the data path failed and stopped (``a``: 0 receive, 1 send); ``failure()`` says why
    #: the message's receiver took every packet and its data path said so in a STOP datagram
    #: (``a``: the elements it holds); the message ends as at a STOP record
    TX_STOP = 8


class Event(NamedTuple):
    kind: int
    peer: int
    message_id: int
    time: float
    a: int


#: How a data path completed a message (``Event.a`` of RX_DONE): 1 every packet, 2 bounded after
#: recovery, 4 every packet with the sender told already (the data path sent it a STOP datagram,
#: :data:`STOP_SENT`), so the protocol core sends no STOP record.
DONE_HOW = {1: "exact", 2: "bounded", 4: "exact"}
STOP_SENT = 4


class Progress(NamedTuple):
    """A received message's counters, as the data path holds them."""

    received_pkts: int
    received_elems: int
    duplicates: int
    retx_seen: int
    first_arrival: float  #: 0 before the first packet
    last_arrival: float
    state: int  #: 0 receiving, 1 exact, 2 bounded (completed by the data path), 3 completed by the core
    gaps: int = 0
    """First-pass packets skipped below the highest received of their priority level, filled by
    a resend since or not (``DataPort.holes`` lists those still missing): 0, nothing to look for."""


class TxInfo(NamedTuple):
    packets: int
    next_pos: int  #: first-pass packets sent so far
    retransmissions: int
    pass_no: int
    active: bool
    held: bool


@dataclass
class RxBuffers:
    """Where a received message lands: the destination and per-packet records."""

    out: np.ndarray
    """1-D destination: the wire's element type, or float32 when the message is added in."""
    received: np.ndarray
    """uint8 per packet: 1 once it arrived."""
    pkt_priority: np.ndarray
    """uint8 per packet: the priority it carried (the message's own until then)."""
    pkt_layer: np.ndarray
    """int64 per packet: the layer field it carried."""

    @staticmethod
    def allocate(out: np.ndarray, packets: int, priority: int) -> RxBuffers:
        return RxBuffers(out, np.zeros(packets, np.uint8), np.full(packets, priority, np.uint8),
                         np.zeros(packets, np.int64))


@dataclass(frozen=True)
class RxSpec:
    """A message to receive."""

    src: int
    message_id: int
    token: int
    dtype: int  #: wire dtype code
    total_elems: int
    elems_per_packet: int
    buffers: RxBuffers
    accumulate: bool = False
    """Add each payload into ``buffers.out`` (float32) instead of copying it: a reduction done as
    the packets arrive, exactly once per packet."""
    required_elems: int = 0
    """Elements that must arrive under the bound (the data path completes a message that
    reaches it during recovery)."""
    triggers: tuple[tuple[int, int], ...] = ()
    """Held sends, (destination, message id), to start when this message completes."""
    scale: float = 1.0
    """Accumulating: ``out`` is multiplied by this before each packet is added, and where no
    packet came at completion (:attr:`dlcp.hostagent.messages.Expect.scale`)."""
    iteration: int = 0
    """The iteration its packets carry (a packet of another is an earlier use of the id: stale);
    the data path keeps the newest per sender and the last per message id, so datagrams recorded
    earlier are stale (:func:`dlcp.hostagent.protocol.incoming.stale`)."""
    classify: bool = True
    """The ``triggers`` classify their packets by magnitude (:attr:`dlcp.hostagent.messages.Expect.classify`):
    the receive computes each placed packet's magnitude for them, from the bytes still in cache."""


@dataclass(frozen=True)
class TxSpec:
    """A message to send."""

    dest: int
    message_id: int
    payload: np.ndarray  #: 1-D, the wire's element type; read until the message is retired
    dtype: int
    elems_per_packet: int
    token: int
    iteration: int
    tensor_id: int
    layer: int
    priority: int
    pkt_priority: np.ndarray | None  #: uint8 per packet, or None: ``priority`` for all
    pkt_layer: np.ndarray | None  #: uint16 per packet, or None: ``layer`` for all
    drop_class: np.ndarray
    """uint8 per packet, filled by the data path when the message becomes ready to send."""
    snapshot: np.ndarray | None = None
    """If given, the payload is copied here when the message becomes ready and sent from the copy
    (a ring step's partial sum, whose chunk is overwritten later in the same allreduce)."""
    held: bool = False
    """Wait for a trigger (:attr:`RxSpec.triggers`) before sending."""
    order: int = 0  #: FIFO rank among equal priorities
    tags_given: bool = False
    """``drop_class`` already holds the classes (the caller computed them): none are computed."""


class DataPort(Protocol):
    """The data path as the protocol core sees it. Calls are quick and never block on the network."""

    def add_peer(self, rank: int, ipv4: str, port: int) -> None: ...
    def set_keys(self, rank: int, rx_key: bytes | None, tx_key: bytes | None) -> None:
        """Our key for ``rank``'s tokens and the key it gave us (None: not authenticated)."""

    # receive side
    def expect(self, spec: RxSpec) -> None: ...
    def progress(self, src: int, message_id: int) -> Progress | None: ...
    def progress_changed(self) -> dict[tuple[int, int], Progress]:
        """Progress of every received message that changed since the previous call returned it
        (one expected since included); a port may return more, never less."""
        ...
    def complete(self, src: int, message_id: int, fire: bool) -> bool:
        """Finish a received message now, under its bound (False: it was finished already). Like a
        message the data path finishes itself (its ``RX_DONE``), the buffer is then final: the
        elements of every missing packet read as zero (or, added into, as the scaled sum), before
        a triggered send reads it. The core never touches the buffer."""
    def forget(self, src: int, message_id: int, remember: bool) -> None: ...
    def expire_parked(self, older_than: float) -> None: ...
    def take_feedback(self, src: int) -> tuple[int, int, int]: ...
    def active_senders(self, now: float, window: float) -> int: ...
    def drain_rate(self, now: float) -> float: ...
    def rx_seen_until(self) -> float: ...
    def reorder_window(self, src: int) -> float: ...
    def holes(self, src: int, message_id: int) -> np.ndarray:
        """The message's holes, sorted: first-pass packets missing between the lowest and highest
        received of their priority level (a level leaves in sequence order; the short last
        packet, which leaves ahead of its run, is not counted as the highest). Empty when the
        message is unknown or finished."""

    # send side
    def submit(self, spec: TxSpec) -> None: ...
    def retransmit(self, dest: int, message_id: int, seqs: np.ndarray) -> int: ...
    def resend(self, dest: int, message_id: int, seqs: np.ndarray) -> int:
        """Resend the packets among ``seqs`` that this pass has sent and that are not queued to
        resend already, ahead of the rest of the pass and without starting a new pass (holes a
        receiver reported before the pass ended). Returns how many were queued."""
    def tx_info(self, dest: int, message_id: int) -> TxInfo | None: ...
    def retire(self, dest: int, message_id: int) -> None: ...
    def set_rate(self, dest: int, rate: float) -> None: ...
    def set_probe_delay(self, dest: int, seconds: float) -> None:
        """How long after a pass's end to ``dest`` its PROBE is due: the data path may hold the
        pass's end (TX_PASS) back from the control thread until then, so that it comes with the
        STOP that usually follows."""

    def sent_packets(self, dest: int) -> int: ...

    def failure(self) -> str | None:
        """Why a thread of the data path failed and stopped (None: none did)."""


@dataclass
class FeedbackCounts:
    """Data packets received from one sender since its last FEEDBACK, CE-marked ones, and
    packets the receiver counts as lost to its own socket overruns."""

    received: int = 0
    marked: int = 0
    lost: int = 0

    def add(self, counts: tuple[int, int, int]) -> None:
        self.received += counts[0]
        self.marked += counts[1]
        self.lost += counts[2]

    def __bool__(self) -> bool:
        return bool(self.received or self.lost)


__all__ = ["DONE_HOW", "STOP_SENT", "DataPort", "Event", "EventKind", "FeedbackCounts", "Progress", "RxBuffers",
           "RxSpec", "TxInfo", "TxSpec"]
