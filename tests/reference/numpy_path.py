"""The data path in Python and numpy: the reference model the compiled path is tested against.

Not part of the package (it was ``dlcp.hostagent.datapath.numpy_path`` and a user's choice,
``TransportConfig(datapath="numpy")``, until it moved here): it needs the compiled module to seal
and open datagrams, so it was never the fallback it was said to be; nothing defaulted to it; and
it doubled every loopback test. It stays as a second, independent reading of the receive rules
(validation, placement, parking, freshness, duplicates, holes, credits) and of the send pass's
wire order: ``tests/transport/test_datapath.py`` and ``test_sealing.py`` feed it and the
compiled path the same datagrams and compare what they keep, count and send.

Where it is *not* a model of the compiled path (and no test compares them): it times a batch,
not each datagram; it has no end-of-pass completion (the protocol core completes its messages);
it sizes GSO runs differently and draws injected losses from another generator.

Its behaviour, as it was: two Python threads, ``rx`` receives datagrams in batches into
preallocated rows, applies the loss injection, and hands each batch to the vectorised
:class:`~tests.reference.reassembly.Reassembler`, which validates every field before a byte is
written; ``tx`` sends the message whose next packet has the highest priority, paced per
destination and for the host, runs of full-size packets by UDP GSO from a staging buffer.
"""

from __future__ import annotations

import logging
import math
import os
import select
import socket
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dlcp.hostagent import _datapath, sealing, wire
from dlcp.hostagent.datapath.credits import CREDIT_QUIET, CREDIT_TIMEOUT, credit_window, initial_window, max_datagram
from dlcp.hostagent.lossmodel import drop_by_class
from dlcp.hostagent.packetizer import MessageMeta, PacketBatch, elems_per_packet, packetize
from dlcp.hostagent.protocol.incoming import FRESH_KEPT
from dlcp.hostagent.protocol.port import EventKind, Progress, RxSpec, TxInfo, TxSpec
from dlcp.hostagent.ratecontrol import BEHIND_BACKLOG
from dlcp.hostagent.protocol.port import REASONS
from tests.reference.reassembly import Assembly, Reassembler
from dlcp.hostagent.transport_config import PORTS_PER_DEST, TransportConfig
from dlcp.hostagent.udp_offload import (GRO_ANCBUF, GRO_BUFSIZE, SO_TIMESTAMPNS, TIMESPEC, DatagramSender,
                                        gro_segment_size, split_segments)
from tests.reference.rules import (DrainMeter, Pacer, acked_after_credit, credit_due, iteration_before, narrow_reorder,
                                   release_due, stale, widen_reorder)

log = logging.getLogger("dlcp.hostagent.transport")

_CE = 0b11  # congestion experienced
_ECT0 = 0b10  # ECN-capable transport
_LAST = int(wire.Flags.LAST)
_CREDIT = int(wire.PacketType.CREDIT)
_RETX = int(wire.Flags.RETX)
_UNKNOWN, _STALE = REASONS.index("unknown_message"), REASONS.index("stale")
_DATA = int(wire.PacketType.DATA)
# Linux: with SO_RXQ_OVFL set, a datagram carries the socket's count of dropped datagrams.
SO_RXQ_OVFL = getattr(socket, "SO_RXQ_OVFL", 40)
# Linux: SO_MEMINFO reads a socket's memory counters (SK_MEMINFO_*, 9 x u32); the first two are
# the bytes its receive queue holds and its receive buffer, both in the kernel's accounting.
SO_MEMINFO = getattr(socket, "SO_MEMINFO", 55)
_MEMINFO = struct.Struct("9I")
_ITERATION, _ITERATION_AT = struct.Struct("!I"), wire.FIELD_OFFSET["iteration"]
DONE_KEPT = 4096  # finished messages remembered: their late packets are not malformed
MAX_INLINE_WAIT = 0.0005  # longest the send thread sleeps for one run's pacing


def socket_empty(sock: socket.socket) -> bool:
    """Whether no datagram waits in the UDP socket ``sock``. Not FIONREAD (SIOCINQ): for UDP it
    is the length of the *first* queued datagram, so an empty datagram ahead of others reads 0.
    A non-blocking peek fails with EAGAIN only when the queue is empty (an empty datagram peeks
    as ``b""``); any other error says nothing, so it is not "empty"."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False
    return False


def receive_backlog(sock: socket.socket) -> float | None:
    """The fraction of ``sock``'s receive buffer its queued datagrams fill (0 to about 1), or
    None where the kernel has no SO_MEMINFO."""
    try:
        queued, size = _MEMINFO.unpack(sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, _MEMINFO.size))[:2]
    except (OSError, struct.error):
        return None
    return queued / size if size else None


@dataclass
class _Rx:
    spec: RxSpec
    asm: Assembly
    retx_seen: int = 0
    first_arrival: float = 0.0
    last_arrival: float = 0.0
    state: int = 0
    # evidence of loss: first-pass packets leave by priority level and, within a level, in sequence
    # order, and a level is one run of sequence numbers (layers are contiguous): so per level,
    # missing packets between the lowest and highest received are holes (the short last packet,
    # which leaves ahead of its run, does not count)
    levels: dict[int, list[int]] = field(default_factory=dict)  # priority -> [min seq, max seq, count]
    holes_blamed: int = 0
    last_at: float = 0.0  # when the first LAST came (0: none yet)
    late: bool = False  # a first-pass packet came after a LAST: the path reorders
    reported: Progress | None = None  # what progress_changed() last returned for it

    def gaps(self) -> int:
        return sum(hi - lo + 1 - n for lo, hi, n in self.levels.values())

    def holes(self) -> int:
        return self.gaps() - self.holes_blamed


@dataclass
class _Sender:
    """What the receive side keeps per sender: its key and its feedback counters."""

    key: bytes | None = None
    tx_key: bytes | None = None  # the key of our direction to it: signs the credits we grant it
    # the receive thread's sealers (dlcp.hostagent.sealing): the sender's key opens what it sends
    # us, ours seals the credits we grant it (kept while the key stays: their packet numbers)
    opener: Any = None
    credit_sealer: Any = None
    consumed: int = 0  # its packets taken from the socket, and as of the last credit
    credited: int = 0
    credit_seq: int = 0
    last_credit: float = -1.0  # when we last credited it
    overrun: bool = False  # our socket dropped datagrams since its last credit
    received: int = 0
    ce: int = 0
    lost: int = 0
    last_seen: float = -1.0
    last_arrival: float = -1.0  # the arrival stamp of its latest packet
    released: bool = False  # a RELEASE credit went since its latest packet (release_due)
    wake_sent: bool = False
    parked: int = 0
    good_since: float = 0.0  # accepted datagrams since the last overrun was accounted
    reorder: float = 0.0  # the reordering window measured on its path (s; starts at probe_grace)
    clean_passes: int = 0  # passes in a row that ended with nothing after (narrow_reorder)
    newest: int | None = None  # the newest iteration of its messages set up here (freshness)


@dataclass
class _Tx:
    spec: TxSpec
    batch: PacketBatch | None = None
    send_order: np.ndarray | None = None
    position: np.ndarray | None = None  #: of each packet in send_order (made by the first resend)
    prio_in_order: np.ndarray | None = None
    header_rows: np.ndarray | None = None
    payload_rows: np.ndarray | None = None
    next_pos: int = 0
    retx: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    retx_pos: int = 0
    retransmissions: int = 0
    pass_no: int = 0
    held: bool = False
    stopped: bool = False
    busy: bool = False
    queued: bool = False

    @property
    def packets(self) -> int:
        per = self.spec.elems_per_packet
        return -(-self.spec.payload.size // per)

    def has_packets(self) -> bool:
        return not self.stopped and not self.held and (self.next_pos < self.packets or self.retx_pos < len(self.retx))

    def sending_priority(self) -> int:
        if self.retx_pos < len(self.retx):
            return 255
        if self.prio_in_order is not None and self.next_pos < len(self.prio_in_order):
            return int(self.prio_in_order[self.next_pos])
        return self.spec.priority

    def queue_priority(self) -> int:
        """Its place among messages (``_reorder``): the top while resends wait, else its own priority."""
        return 255 if self.retx_pos < len(self.retx) else self.spec.priority

    def lowest_priority(self) -> int:
        """The priority of the first pass's last packet (the send order is by priority)."""
        return self.spec.priority if self.prio_in_order is None else int(self.prio_in_order[-1])


@dataclass
class _Dest:
    rank: int
    addr: tuple[str, int]
    rate: float
    pacer: Pacer
    socks: dict[int, tuple[socket.socket, DatagramSender]] = field(default_factory=dict)
    sent: int = 0
    acked: int = 0  # the window this destination grants us: packets sent beyond ``acked``
    window: int = 256
    credit_seq: int = 0
    held_since: float = -1.0  # when the window last filled


class NumpyDatapath:
    """One endpoint's data path in Python: a receive and a send thread."""

    name = "numpy"

    def __init__(self, config: TransportConfig, udp: socket.socket, gro: bool) -> None:
        self.config = config
        self.gro = gro
        self.policy = config.policy
        self._udp = udp
        self._running = False
        self._threads: list[threading.Thread] = []
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._ev_lock = threading.Lock()
        self._events: list[tuple] = []
        self._failure: str | None = None  # why a thread failed (failure())
        self._fault: str | None = None  # fault_for_test
        # receive side
        self._lock = threading.Lock()
        # (unannounced data goes to _park unchecked: its tag was checked in _open, and _park
        # keeps only an authenticated sender's)
        self.reassembler = Reassembler(config.job_id)
        self._rx: dict[tuple[int, int], _Rx] = {}
        self._done: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._parked: dict[tuple[int, int], list[tuple[float, bytes]]] = {}
        # freshness: the iteration each of the last FRESH_KEPT message ids was set up with
        self._used: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._senders: dict[int, _Sender] = {}
        self._rng = np.random.default_rng(config.loss.seed)
        self._delayed: list[tuple[float, bytes]] = []
        self._drain = DrainMeter()
        self._seen_until = 0.0  # every datagram that arrived before this (monotonic s) is read and placed
        self._reading = threading.Lock()  # held by the receive thread from a batch's reads until it is placed
        self._reads_since = 0.0  # reads (socket-buffer entries) since the last overrun was accounted
        self.counters: dict[str, int] = dict.fromkeys(
            ("data_pkts_received", "data_bytes_received", "ce_marked", "parked", "late", "rx_overflows",
             "rx_dropped_estimate", "rx_dropped_reads", "gro_reads", "rx_reads", "injected_delays", "data_pkts_sent",
             "data_bytes_sent", "retransmitted_pkts", "send_errors", "gso_calls", "credits_sent", "credits_received",
             "overrun_credits_sent", "loss_releases_sent", "credit_waits", "credit_timeouts"), 0)
        self._credit_sock: socket.socket | None = None
        self._rcvbuf = udp.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        self._max_datagram = max_datagram(config)
        self.injected_drops: dict[int, int] = {}
        # send side
        self._tx_cv = threading.Condition()
        self._dests: dict[int, _Dest] = {}
        self._tx: dict[tuple[int, int], _Tx] = {}
        self._active: list[_Tx] = []
        self._fired: set[tuple[int, int]] = set()
        self._host_pacer = Pacer(config.rate.burst_bytes, config.rate.pacing_slack)
        self._stage: np.ndarray | None = None
        self._tx_sealers: dict[int, tuple[bytes, Any]] = {}  # destination -> (key, the send thread's sealer) (_tx_cv)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._credit_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._credit_sock.setblocking(False)
        self._credit_sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, self.policy.dscp[self.policy.top_priority] << 2)
        self._running = True
        for name, target in (("rx", self._rx_main), ("tx", self._tx_main)):
            t = threading.Thread(target=target, name=f"dlcp-{name}-{self.config.rank}", daemon=True)
            t.start()
            self._threads.append(t)

    def _rx_main(self) -> None:
        try:
            self._rx_loop()
        except BaseException as exc:  # noqa: BLE001 - reported as the endpoint's failure, never lost
            self._fail("receive", exc)

    def _tx_main(self) -> None:
        try:
            self._tx_loop()
        except BaseException as exc:  # noqa: BLE001 - reported as the endpoint's failure, never lost
            self._fail("send", exc)
        with self._tx_cv:  # nothing is being sent any more: a retire() waiting for one returns
            for m in self._tx.values():
                m.busy = False
            self._tx_cv.notify_all()

    def _fail(self, thread: str, exc: BaseException) -> None:
        """A thread raised: record why (the first reason stays), tell the protocol, stop it."""
        log.error("rank %d: the data path's %s thread failed", self.config.rank, thread, exc_info=exc)
        with self._ev_lock:
            if self._failure is not None:
                return
            self._failure = f"the data path's {thread} thread failed: {type(exc).__name__}: {exc}"
        self._emit(EventKind.FAILED, 0, 0, time.monotonic(), 1 if thread == "send" else 0)

    def failure(self) -> str | None:
        """Why a thread of the data path failed and stopped (None: none did)."""
        with self._ev_lock:
            return self._failure

    def fault_for_test(self, thread: str) -> None:
        """Make the ``"receive"`` or ``"send"`` thread raise MemoryError at its next turn."""
        self._fault = thread
        with self._tx_cv:
            self._tx_cv.notify_all()

    def stop(self) -> None:
        self._running = False
        with self._tx_cv:
            self._tx_cv.notify_all()
        for t in self._threads:
            t.join(timeout=5)
        for d in self._dests.values():
            for sock, _ in d.socks.values():
                sock.close()
            d.socks.clear()
        if self._credit_sock is not None:
            self._credit_sock.close()
        try:
            os.close(self._efd)
        except OSError:
            pass

    def event_fd(self) -> int:
        return self._efd

    def take_events(self) -> list[tuple]:
        try:
            os.eventfd_read(self._efd)
        except (BlockingIOError, OSError):
            pass
        with self._ev_lock:
            events, self._events = self._events, []
        return events

    def _emit(self, kind: EventKind, peer: int, mid: int, t: float, a: int = 0) -> None:
        with self._ev_lock:
            empty = not self._events
            self._events.append((int(kind), peer, mid, t, a))
        if empty:
            try:
                os.eventfd_write(self._efd, 1)
            except OSError:
                pass

    def calibrate(self) -> float:
        """Bytes/s this host's reassembly takes, timed on a synthetic batch at start (about a
        millisecond): a start-up ceiling for senders, until the drain is measured under load.
        Half of it is offered, as the system calls and other threads cost the rest."""
        per = elems_per_packet(self.config.mtu, np.float32)
        n = min(self.config.rx_batch, 512)
        data = np.zeros(n * per, np.float32)
        batch = packetize(data, MessageMeta(job_id=self.config.job_id, message_id=1), self.policy, self.config.mtu)
        slots, lengths = batch.to_slots()
        best = 0.0
        for _ in range(3):
            r = Reassembler(self.config.job_id)
            r.expect(0, 1, data.size, np.float32, per)
            t0 = time.perf_counter()
            r.ingest_batch(slots, lengths)
            best = max(best, float(lengths.sum()) / max(1e-6, time.perf_counter() - t0))
        return best / 2

    # ------------------------------------------------------------------ DataPort: receive side
    def add_peer(self, rank: int, ipv4: str, port: int) -> None:
        with self._tx_cv:
            if rank not in self._dests:
                rate = self.config.rate
                self._dests[rank] = _Dest(rank, (ipv4, port), min(rate.line_rate, 0.5e9),
                                          Pacer(rate.burst_bytes, rate.pacing_slack),
                                          window=initial_window(self.config))

    def set_keys(self, rank: int, rx_key: bytes | None, tx_key: bytes | None) -> None:
        with self._lock:
            s = self._senders.setdefault(rank, _Sender(reorder=self.config.probe_grace))
            if rx_key is None or rx_key != s.key:  # closed, or a new key: its parked data waits for nothing
                for key in [k for k in self._parked if k[0] == rank]:
                    del self._parked[key]
                s.parked = 0
            # the same key again (a second connection) keeps its sealer and its packet numbers
            protection = self.config.protection
            if rx_key is None or rx_key != s.key or s.opener is None:
                s.opener = None if rx_key is None else sealing.new_sealer(rx_key, protection)
            if tx_key is None or tx_key != s.tx_key or s.credit_sealer is None:
                s.credit_sealer = None if tx_key is None else sealing.new_sealer(tx_key, protection)
            s.key, s.tx_key = rx_key, tx_key
        with self._tx_cv:
            if tx_key is None:
                self._tx_sealers.pop(rank, None)
            elif self._tx_sealers.get(rank, (None, None))[0] != tx_key:
                self._tx_sealers[rank] = (tx_key, sealing.new_sealer(tx_key, protection))

    def expect(self, spec: RxSpec) -> None:
        key = (spec.src, spec.message_id)
        dtype = wire.NUMPY_DTYPES[wire.Dtype(spec.dtype)].newbyteorder("=")
        b = spec.buffers
        now = time.monotonic()
        with self._lock:
            old = self._rx.get(key)
            if old is not None:
                if old.state == 0:
                    raise ValueError(f"message {spec.message_id} from rank {spec.src} is already expected")
                del self._rx[key]
            asm = self.reassembler.expect(spec.src, spec.message_id, spec.total_elems, dtype, spec.elems_per_packet,
                                          out=b.out, token=spec.token, accumulate=spec.accumulate,
                                          iteration=spec.iteration,
                                          received=b.received, pkt_priority=b.pkt_priority, pkt_layer=b.pkt_layer,
                                          scale=spec.scale)
            rx = self._rx[key] = _Rx(spec, asm)
            self._done.pop(key, None)
            # freshness: this id's latest use, and the sender's newest iteration
            self._used[key] = spec.iteration
            self._used.move_to_end(key)
            while len(self._used) > FRESH_KEPT:
                self._used.popitem(last=False)
            snd = self._sender(spec.src)
            if snd.newest is None or iteration_before(snd.newest, spec.iteration):
                snd.newest = spec.iteration
            if asm.total_pkts == 0:
                self._finish(rx, 1, True, now)
                return
            parked = [d for _, d in self._parked.pop(key, [])]
            snd.parked -= len(parked)
            # another use of the id (its token was right for its own iteration): stale
            replay = [d for d in parked if _ITERATION.unpack_from(d, _ITERATION_AT)[0] == spec.iteration]
            self.reassembler.stats.rejected["stale"] += len(parked) - len(replay)
        if replay:
            slots = np.zeros((len(replay), max(len(d) for d in replay)), dtype=np.uint8)
            for i, d in enumerate(replay):
                slots[i, : len(d)] = np.frombuffer(d, np.uint8)
            self._ingest(slots, np.array([len(d) for d in replay]), np.zeros(len(replay), dtype=bool), now,
                         opened=True)

    def progress(self, src: int, message_id: int) -> Progress | None:
        with self._lock:
            rx = self._rx.get((src, message_id))
            if rx is None:
                return None
            a = rx.asm
            return Progress(a.received_pkts, a.received_elems, a.duplicates, rx.retx_seen, rx.first_arrival,
                            rx.last_arrival, rx.state, rx.gaps())

    def progress_changed(self) -> dict[tuple[int, int], Progress]:
        out = {}
        with self._lock:
            for k, rx in self._rx.items():
                p = Progress(rx.asm.received_pkts, rx.asm.received_elems, rx.asm.duplicates, rx.retx_seen,
                             rx.first_arrival, rx.last_arrival, rx.state, rx.gaps())
                if p != rx.reported:
                    rx.reported = out[k] = p
        return out

    def complete(self, src: int, message_id: int, fire: bool) -> bool:
        with self._lock:
            rx = self._rx.get((src, message_id))
            if rx is None or rx.state:
                return False
            self._finish(rx, 3, fire, time.monotonic())
            return True

    def forget(self, src: int, message_id: int, remember: bool) -> None:
        key = (src, message_id)
        with self._lock:
            self._rx.pop(key, None)
            self.reassembler.forget(*key)
            if remember:
                self._remember(key)
            else:
                self._done.pop(key, None)
            self._sender(src).parked -= len(self._parked.pop(key, []))

    def expire_parked(self, older_than: float) -> None:
        with self._lock:
            for key in [k for k, v in self._parked.items() if v and v[0][0] < older_than]:
                self._sender(key[0]).parked -= len(self._parked.pop(key))

    def take_feedback(self, src: int) -> tuple[int, int, int]:
        with self._lock:
            s = self._sender(src)
            out = (s.received, s.ce, s.lost)
            s.received = s.ce = s.lost = 0
            s.wake_sent = False
            return out

    def active_senders(self, now: float, window: float) -> int:
        with self._lock:
            return sum(1 for s in self._senders.values() if s.last_seen >= 0 and now - s.last_seen < window)

    def drain_rate(self, now: float) -> float:
        return self._drain.current(now)

    def rx_seen_until(self) -> float:
        """Every datagram that reached the host before this time has been read and placed (the
        kernel's arrival stamps, when the receive thread last found the socket empty, or now if
        it is empty and no batch is being placed): a bitmap for a message quiet since before it
        lists no packet that has arrived."""
        now = time.monotonic()
        with self._reading:
            return now if socket_empty(self._udp) else self._seen_until

    def reorder_window(self, src: int) -> float:
        """The grace's floor for messages from ``src``: its path's reordering window."""
        with self._lock:
            s = self._senders.get(src)
            return self.config.probe_grace if s is None else s.reorder

    def holes(self, src: int, message_id: int) -> np.ndarray:
        with self._lock:
            rx = self._rx.get((src, message_id))
            if rx is None or rx.state or not rx.levels:
                return np.zeros(0, np.int64)
            received = rx.spec.buffers.received
            found = [lo + np.flatnonzero(received[lo : hi + 1] == 0) for lo, hi, n in rx.levels.values()
                     if hi - lo + 1 > n]
        return np.unique(np.concatenate(found)) if found else np.zeros(0, np.int64)

    def _widen(self, src: int, late: float) -> None:
        """A first-pass packet of ``src`` came ``late`` s after its message's LAST (lock held)."""
        s = self._sender(src)
        s.reorder = widen_reorder(s.reorder, late)
        s.clean_passes = 0

    def _sender(self, rank: int) -> _Sender:
        s = self._senders.get(rank)
        if s is None:
            s = self._senders[rank] = _Sender(reorder=self.config.probe_grace)
        return s

    def _remember(self, key: tuple[int, int]) -> None:
        self._done[key] = None
        self._done.move_to_end(key)
        while len(self._done) > DONE_KEPT:
            self._done.popitem(last=False)

    def _finish(self, rx: _Rx, how: int, fire: bool, now: float) -> None:
        """Complete ``rx`` here (lock held): nothing more is placed, missing elements read as zero,
        its held sends start."""
        rx.state = how
        key = rx.asm.key
        recovered = rx.retx_seen > 0 or rx.asm.received_pkts < rx.asm.total_pkts
        if _datapath.narrows_window(bool(rx.last_at), rx.late, recovered):  # (endpass.h)
            s = self._sender(key[0])
            s.reorder, s.clean_passes = narrow_reorder(s.reorder, s.clean_passes)
        # The sender's transmissions this message will never bring (packets that never came, the
        # first sending of each that came as a resend) count as read for its credits, or its
        # window would shrink by every loss.
        self._sender(key[0]).consumed += (rx.asm.total_pkts - rx.asm.received_pkts) + rx.retx_seen
        self.reassembler.forget(*key)
        self._remember(key)
        if rx.asm.received_pkts < rx.asm.total_pkts:
            rx.asm.zero_missing()
        if fire and rx.spec.triggers:
            self._fire(rx.spec.triggers, now)
        if how != 3:
            self._emit(EventKind.RX_DONE, key[0], key[1], now, how)

    # ------------------------------------------------------------------ the receive thread
    def _rx_loop(self) -> None:
        """Receive datagrams into the rows of a slot matrix and hand them over in batches.

        A row is exactly one full-size datagram wide, so a GRO read (many datagrams of that
        size back to back) lands in consecutive rows with no copy; a batch holds up to
        ``rx_batch`` datagrams whatever mix of GRO and single reads brought them. A batch also
        ends after a quarter of the socket buffer's bytes. The drain meter samples a batch only
        when it ended by either limit, rather than because the socket ran dry, *and* the socket
        still holds at least BEHIND_BACKLOG of its buffer: a real backlog, close to an overrun.
        """
        cfg = self.config
        width = self._max_datagram  # a full datagram, its trailer included
        spare = -(-GRO_BUFSIZE // width) if self.gro else 1  # room for one whole GRO read
        slots = np.zeros((cfg.rx_batch + spare, width), dtype=np.uint8)
        flat = slots.reshape(-1).data
        lengths = np.zeros(cfg.rx_batch + spare, dtype=np.int64)
        ce = np.zeros(cfg.rx_batch + spare, dtype=bool)
        overflows = 0
        sock = self._udp
        batch_bytes = max(width, sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 8)
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        credit_due_at = 0.0  # when a quiet sender's credit falls due (0: none waits)
        while self._running:
            if self._fault == "receive":
                raise MemoryError("fault_for_test")
            wait_ms = 5 if self._delayed else 50
            if credit_due_at:
                wait_ms = min(wait_ms, max(0, math.ceil((credit_due_at - time.monotonic()) * 1000)))
            if not poller.poll(wait_ms):
                self._seen_until = time.monotonic()  # nothing unread when poll gave up
                self._release_delayed()
                credit_due_at = self._send_credits(time.monotonic(), self._seen_until)
                continue
            self._reading.acquire()
            try:
                t_batch = time.monotonic()
                real_off = time.time() - t_batch  # the kernel stamps arrivals on the real-time clock
                arrived = 0.0  # the latest arrival stamp read in this batch (0: none)
                empty_at = 0.0  # when a read found the socket empty (0: it never did)
                k = reads = 0
                nbytes_batch = 0
                dry = False
                while k < cfg.rx_batch and nbytes_batch < batch_bytes:
                    before = time.monotonic()
                    try:
                        nbytes, ancdata, _flags, _addr = sock.recvmsg_into([flat[k * width :]], GRO_ANCBUF)
                    except (BlockingIOError, InterruptedError):
                        dry = True
                        empty_at = before  # all that came before this read is read
                        break
                    except OSError as exc:
                        if self._running:
                            log.warning("rank %d: data socket error: %s", cfg.rank, exc)
                        dry = True
                        break
                    reads += 1
                    tos = 0
                    for level, kind, value in ancdata:
                        if level == socket.IPPROTO_IP:
                            tos = value[0]
                        elif kind == SO_RXQ_OVFL and len(value) >= 4:
                            overflows = int.from_bytes(value[:4], "little")
                        elif kind == SO_TIMESTAMPNS and len(value) >= 16:
                            sec, nsec = TIMESPEC.unpack_from(value)
                            arrived = max(arrived, sec + nsec * 1e-9 - real_off)
                    seg = gro_segment_size(ancdata) if self.gro else None
                    if seg is None or nbytes <= seg:
                        lengths[k] = nbytes  # one datagram (longer than a row: rejected as truncated)
                        m = 1
                    elif seg == width:  # GRO read of full-size datagrams: already in their rows
                        m = -(-nbytes // seg)
                        lengths[k : k + m] = seg
                        lengths[k + m - 1] = nbytes - (m - 1) * seg
                        self.counters["gro_reads"] += 1
                    else:  # GRO of another size (another MTU): copy the datagrams into rows
                        rows, row_lengths = split_segments(slots.reshape(-1)[k * width : k * width + nbytes].copy(),
                                                           nbytes, seg)
                        m = min(len(row_lengths), len(lengths) - k)
                        cut = min(rows.shape[1], width)
                        slots[k : k + m] = 0
                        slots[k : k + m, :cut] = rows[:m, :cut]
                        lengths[k : k + m] = np.where(row_lengths[:m] > width, width + 1, row_lengths[:m])
                        self.counters["gro_reads"] += 1
                    ce[k : k + m] = (tos & 0b11) == _CE
                    k += m
                    nbytes_batch += nbytes
                self.counters["rx_reads"] += reads
                if k:
                    # the batch's arrival time (its latest stamp) dates what it brings: a reader
                    # that is behind must not stretch a message's grace
                    now = time.monotonic()
                    self._on_datagrams(slots[:k], lengths[:k], ce[:k], min(arrived, now) if arrived else now)
                # the socket is a queue: what arrived before the last datagram read is placed now
                self._seen_until = max(self._seen_until, empty_at, min(arrived, time.monotonic()))
            finally:
                self._reading.release()
            credit_due_at = self._send_credits(time.monotonic(), self._seen_until)
            self._reads_since += reads
            if overflows != self.counters["rx_overflows"]:
                self._on_overflow((overflows - self.counters["rx_overflows"]) & 0xFFFFFFFF)
                self.counters["rx_overflows"] = overflows
            elif self._reads_since > 8192:  # a long quiet stretch: older reads weigh less
                self._reads_since /= 2
                for snd in self._senders.values():
                    snd.good_since /= 2
            behind = not dry and (k >= cfg.rx_batch or nbytes_batch >= batch_bytes)  # ended full, not dry
            if behind:
                backlog = receive_backlog(sock)
                behind = backlog is None or backlog >= BEHIND_BACKLOG
            self._drain.batch(t_batch, nbytes_batch, behind, time.monotonic())
            self._release_delayed()

    def _on_overflow(self, dropped: int) -> None:
        """The kernel dropped ``dropped`` socket-buffer entries (a GRO read is one entry of many
        datagrams; a junk datagram one of none of ours). Each is taken as a random draw of the
        entries that arrived meanwhile, so a sender is blamed for its accepted datagrams over all
        reads since the last drops were accounted: junk dilutes the blame instead of multiplying
        it, and nobody is blamed for drops among junk alone."""
        self.counters["rx_dropped_reads"] += dropped
        with self._lock:
            reads, self._reads_since = self._reads_since, 0.0
            for rank, s in self._senders.items():
                s.overrun = True  # its next credit may release what it lost (credits.credit_due)
                n, s.good_since = s.good_since, 0.0
                if n <= 0 or s.key is None or rank == self.config.rank:
                    continue
                # That share overstates a flood's effect (a flood fills every gap in the buffer,
                # paced senders meet it less often), so a sender is blamed for no more than the
                # holes its own messages show (_Rx.holes). Junk cannot make those.
                share = round(dropped * n / max(1.0, reads))
                blame = 0
                for rx in self._rx.values():
                    if rx.spec.src != rank or rx.state:
                        continue
                    take = min(max(0, rx.holes()), share - blame)
                    if take > 0:
                        rx.holes_blamed += take
                        blame += take
                if blame == 0:
                    continue
                s.lost += blame
                self.counters["rx_dropped_estimate"] += blame
                if not s.wake_sent:
                    s.wake_sent = True
                    self._emit(EventKind.CONGESTION, rank, 0, time.monotonic())

    def _release_delayed(self) -> None:
        if not self._delayed:
            return
        now = time.monotonic()
        due = [d for t, d in self._delayed if t <= now]
        if not due:
            return
        self._delayed = [(t, d) for t, d in self._delayed if t > now]
        slots = np.zeros((len(due), max(len(d) for d in due)), dtype=np.uint8)
        for i, d in enumerate(due):
            slots[i, : len(d)] = np.frombuffer(d, np.uint8)
        self._ingest(slots, np.array([len(d) for d in due]), np.zeros(len(due), dtype=bool), now)

    def _on_datagrams(self, slots: np.ndarray, lengths: np.ndarray, ce: np.ndarray, at: float) -> dict[int, int]:
        """Loss injection, then reassembly (``at``: when the batch reached the host); returns
        accepted datagrams per sender."""
        loss = self.config.loss
        if loss.enabled:
            n = len(lengths)
            ok_len = lengths >= wire.HEADER_SIZE
            hdr = slots[:, : wire.HEADER_SIZE].view(wire.HEADER_DTYPE).reshape(n)
            keep = np.ones(n, dtype=bool)
            if any(loss.drop_probabilities):
                keep = drop_by_class(hdr["drop_class"], loss.drop_probabilities, self._rng) | ~ok_len
                for cls in hdr["drop_class"][~keep].tolist():
                    self.injected_drops[cls] = self.injected_drops.get(cls, 0) + 1
            if loss.delay > 0 and loss.delay_probability > 0:
                delay = keep & (self._rng.random(n) < loss.delay_probability)
                release = time.monotonic() + loss.delay
                for i in np.flatnonzero(delay).tolist():
                    self._delayed.append((release, slots[i, : lengths[i]].tobytes()))
                self.counters["injected_delays"] += int(delay.sum())
                keep &= ~delay
            idx = np.flatnonzero(keep)
            if loss.reorder:
                idx = self._rng.permutation(idx)
            if len(idx) < n or loss.reorder:
                slots, lengths, ce = slots[idx], lengths[idx], ce[idx]
        if len(lengths):
            return self._ingest(slots, lengths, ce, at)
        return {}

    def _open(self, slots: np.ndarray, lengths: np.ndarray, ce: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Check every datagram's trailer under its sender's key (decrypting in place), as the
        compiled path's ingest_sealed does: what the header alone rejects goes on unopened (the
        checks after reject and count it, and junk costs no AES); a datagram without room for a
        trailer is ``truncated``, one whose tag fails ``bad_mac`` (counted, nothing of it used).
        Returns the rest, authentic, without their trailers."""
        n = len(lengths)
        if n == 0 or slots.shape[1] < wire.HEADER_SIZE:
            return slots, lengths, ce
        cfg = self.config
        hdr = slots[:, : wire.HEADER_SIZE].view(wire.HEADER_DTYPE).reshape(n)
        ptype = hdr["ptype"]
        sealed = ((lengths >= wire.HEADER_SIZE) & (lengths <= min(slots.shape[1], self._max_datagram))
                  & (hdr["version"] == wire.VERSION) & ((ptype == _DATA) | (ptype == _CREDIT))
                  & (hdr["job_id"] == cfg.job_id))
        bad = sealed & (lengths < wire.HEADER_SIZE + wire.TRAILER_SIZE)
        truncated = int(np.count_nonzero(bad))
        replayed = 0
        if cfg.protection != sealing.NONE:
            check = sealed & ~bad
            senders = hdr["sender_rank"]
            for rank in np.unique(senders[check]).tolist():
                rows = np.flatnonzero(check & (senders == rank))
                with self._lock:
                    s = self._senders.get(rank)
                    opener = s.opener if s is not None else None
                    if opener is not None:
                        found = sealing.open_rows(opener, slots, lengths, rows)
                if opener is None:
                    found = np.full(len(rows), sealing.FORGED, np.uint8)
                bad[rows[found != sealing.OPENED]] = True
                replayed += int(np.count_nonzero(found == sealing.REPLAYED))
        if not bad.any():
            return slots, np.where(sealed, lengths - wire.TRAILER_SIZE, lengths), ce
        with self._lock:
            c = self.counters
            c["data_pkts_received"] += int(np.count_nonzero(bad))
            c["data_bytes_received"] += int(lengths[bad].sum())
            c["ce_marked"] += int(np.count_nonzero(ce[bad]))
            rejected = self.reassembler.stats.rejected
            rejected["truncated"] += truncated
            rejected["bad_mac"] += int(np.count_nonzero(bad)) - truncated - replayed
            rejected["replay"] += replayed
        keep = ~bad
        return slots[keep], np.where(sealed, lengths - wire.TRAILER_SIZE, lengths)[keep], ce[keep]

    def _ingest(self, slots: np.ndarray, lengths: np.ndarray, ce: np.ndarray, now: float,
                opened: bool = False) -> dict[int, int]:
        """Validate and place a batch (``opened``: their trailers already checked and removed,
        as parked datagrams' are); events for what it changed. Returns accepted datagrams per sender."""
        if not opened:
            slots, lengths, ce = self._open(slots, lengths, ce)
        n = len(lengths)
        hdr = slots[:, : wire.HEADER_SIZE].view(wire.HEADER_DTYPE).reshape(n) if slots.shape[1] >= wire.HEADER_SIZE \
            else None
        good_by: dict[int, int] = {}
        if hdr is not None:
            credit = ((lengths >= wire.HEADER_SIZE) & (lengths <= slots.shape[1]) & (hdr["version"] == wire.VERSION)
                      & (hdr["ptype"] == _CREDIT))
            if credit.any():  # credits are not data: judged here, the rest goes on to reassembly
                self._on_credits(hdr[credit], lengths[credit], now)
                # (counted as received datagrams and bytes, as the compiled path counts them)
                self.counters["data_pkts_received"] += int(np.count_nonzero(credit))
                self.counters["data_bytes_received"] += int(lengths[credit].sum())
                keep = ~credit
                slots, lengths, ce, hdr = slots[keep], lengths[keep], ce[keep], hdr[keep]
                n = len(lengths)
                if n == 0:
                    return good_by
        with self._lock:
            c = self.counters
            late_before = c["late"]
            res = self.reassembler.ingest_batch(slots, lengths, park=lambda rows: self._park(slots, lengths, hdr, rows,
                                                                                              now))
            c["data_pkts_received"] += n
            c["data_bytes_received"] += int(lengths.sum())
            c["ce_marked"] += int(np.count_nonzero(ce))
            c["parked"] += res.parked - (c["late"] - late_before)
            if hdr is None:
                return good_by
            good = res.reasons == 0
            senders = hdr["sender_rank"][good]
            marks = ce[good]
            for rank in np.unique(senders).tolist():
                s = self._sender(rank)
                sel = senders == rank
                cnt = int(np.count_nonzero(sel))
                good_by[rank] = cnt
                s.received += cnt
                s.consumed += cnt
                s.good_since += cnt
                s.last_seen = now
                s.last_arrival, s.released = max(s.last_arrival, now), False
                n_marks = int(np.count_nonzero(marks[sel]))
                s.ce += n_marks
                if n_marks and not s.wake_sent:
                    s.wake_sent = True
                    self._emit(EventKind.CONGESTION, rank, 0, now)
            if not res.touched:
                return good_by
            if res.run:
                keys = [res.touched[0].key]
                last = {keys[0]} if np.count_nonzero(slots[:, wire.FIELD_OFFSET["flags"]] & _LAST) else set()
                retx: dict[tuple[int, int], int] = {}
            else:
                lmask = good & ((hdr["flags"] & _LAST) != 0)
                last = set(zip(hdr["sender_rank"][lmask].tolist(), hdr["message_id"][lmask].tolist()))
                # resends that brought a packet (_finish counts the first sending of each as
                # never coming; a duplicate resend was consumed as it was read, and counts no more)
                rmask = good & ((hdr["flags"] & _RETX) != 0) & (res.placed if res.placed is not None else True)
                retx = {}
                for k in zip(hdr["sender_rank"][rmask].tolist(), hdr["message_id"][rmask].tolist()):
                    retx[k] = retx.get(k, 0) + 1
            firsts: set[tuple[int, int]] = set()  # messages with first-pass packets not marked LAST in this batch
            last_firsts: set[tuple[int, int]] = set()  # ... with first-pass packets marked LAST
            if res.run:
                rx = self._rx.get(keys[0])
                if rx is not None:
                    self._note_first_pass(rx, hdr["priority"], hdr["seq"])
                if np.count_nonzero(good & ((hdr["flags"] & (_RETX | _LAST)) == 0)):
                    firsts.add(keys[0])
                if np.count_nonzero(good & ((hdr["flags"] & (_RETX | _LAST)) == _LAST)):
                    last_firsts.add(keys[0])
            else:
                first = good & ((hdr["flags"] & _RETX) == 0)
                for mask, into in ((first & ((hdr["flags"] & _LAST) == 0), firsts),
                                   (first & ((hdr["flags"] & _LAST) != 0), last_firsts)):
                    if mask.any():
                        mkeys = (hdr["sender_rank"][mask].astype(np.int64) << 32) | hdr["message_id"][mask]
                        into.update((k >> 32, k & 0xFFFFFFFF) for k in np.unique(mkeys).tolist())
                # the levels count packets placed now (not a duplicate's copy, nor parked data),
                # as the compiled path counts them
                placed = first & res.placed if res.placed is not None else first
                if placed.any():
                    fkeys = (hdr["sender_rank"][placed].astype(np.int64) << 32) | hdr["message_id"][placed]
                    for k in np.unique(fkeys).tolist():
                        rx = self._rx.get((k >> 32, k & 0xFFFFFFFF))
                        if rx is not None:
                            sel = fkeys == k
                            self._note_first_pass(rx, hdr["priority"][placed][sel], hdr["seq"][placed][sel])
            for asm in res.touched:
                rx = self._rx.get(asm.key)
                if rx is None or rx.state:
                    continue
                quiet_since, rx.last_arrival = rx.last_arrival, now
                if not rx.first_arrival:
                    rx.first_arrival = now
                n_retx = retx.get(asm.key, 0)
                rx.retx_seen += n_retx
                # a first-pass packet after the pass's first LAST (read in a later batch):
                # reordered past the end of its pass (endpass.h, reorder_lateness)
                window, late = self._sender(asm.key[0]).reorder, 0.0
                for flag, keyed in ((False, firsts), (True, last_firsts)):
                    if asm.key in keyed:
                        late = max(late, _datapath.reorder_lateness(flag, now, rx.last_at, quiet_since, window))
                if late > 0:
                    self._widen(asm.key[0], late)
                    rx.late = True
                if asm.key in last:
                    rx.last_at = rx.last_at or now
                    self._emit(EventKind.RX_LAST, asm.key[0], asm.key[1], now)
                if n_retx:
                    self._emit(EventKind.RX_RETX, asm.key[0], asm.key[1], now, n_retx)
                if asm.received_pkts == asm.total_pkts:
                    self._finish(rx, 1, True, now)
                elif rx.retx_seen and asm.received_elems >= rx.spec.required_elems:
                    self._finish(rx, 2, True, now)  # recovery reached the bound: stop now
        return good_by

    # ------------------------------------------------------------------ credits
    def _on_credits(self, hdr: np.ndarray, lengths: np.ndarray, now: float) -> None:
        """Credits from receivers we send to: the windows they grant us; bad ones are counted
        under the same reasons as the compiled path counts them."""
        rejected = self.reassembler.stats.rejected
        for h, length in zip(hdr, lengths.tolist()):
            granter, seq = int(h["sender_rank"]), int(h["iteration"])
            consumed = (int(h["total_pkts"]) << 32) | int(h["elem_offset"])
            release = bool(int(h["flags"]) & wire.Flags.RELEASE)
            with self._lock:
                s = self._senders.get(granter)
                key = s.key if s is not None else None
            if int(h["job_id"]) != self.config.job_id:
                rejected["wrong_job"] += 1
            elif length != wire.HEADER_SIZE:
                rejected["count_mismatch"] += 1
            elif key is None or granter == self.config.rank:  # (not a peer we send to; its tag was checked)
                rejected["bad_token"] += 1
            else:
                self.counters["credits_received"] += 1
                with self._tx_cv:
                    d = self._dests.get(granter)
                    if d is not None and seq > d.credit_seq:  # a replay or a late one grants nothing
                        d.credit_seq, d.acked = seq, acked_after_credit(d.acked, d.sent, consumed, release)
                        d.window, d.held_since = max(1, int(h["elem_count"])), -1.0
                        self._tx_cv.notify_all()

    def _send_credits(self, now: float, seen_until: float) -> float:
        """Grant every sender whose packets we took from the socket a window, by the rules of
        :mod:`dlcp.hostagent.datapath.credits` (a quarter of its window used, or its packets quiet; or
        our socket overran while a message of its is incomplete; or, with everything that arrived
        up to ``seen_until`` read, its packets stopped coming while a message of its is
        incomplete). Returns when a quiet sender's credit falls due (0: none waits)."""
        sock = self._credit_sock
        if sock is None:
            return 0.0
        wake = 0.0
        with self._lock:
            senders = sum(1 for r, s in self._senders.items() if s.key is not None and r != self.config.rank)
            grant = credit_window(self._rcvbuf, self._max_datagram, senders)
            waiting = {rx.spec.src for rx in self._rx.values() if not rx.state}
            out = []
            for rank, s in self._senders.items():
                if s.key is None or s.tx_key is None or s.credit_sealer is None or rank == self.config.rank:
                    continue
                pending = s.consumed - s.credited
                quiet_for = now - max(s.last_seen, s.last_credit)
                incomplete = rank in waiting
                overrun = s.overrun and incomplete
                lost = release_due(incomplete, s.released, s.last_arrival, seen_until)
                if not (lost or credit_due(pending, grant, quiet_for, overrun)):
                    # when a quiet credit, or a release, may fall due
                    watch = incomplete and not s.released and s.last_arrival >= 0
                    for due, needed in ((max(s.last_seen, s.last_credit) + CREDIT_QUIET, pending or overrun),
                                        (s.last_arrival + CREDIT_QUIET, watch)):
                        if needed:
                            wake = due if wake == 0 else min(wake, due)
                    continue
                d = self._dests.get(rank)
                if d is None:
                    continue
                release = overrun or lost
                s.credit_seq += 1
                h = wire.Header(ptype=wire.PacketType.CREDIT, job_id=self.config.job_id, message_id=0,
                                sender_rank=self.config.rank, priority=self.policy.top_priority, iteration=s.credit_seq,
                                flags=wire.Flags.RELEASE if release else wire.Flags.NONE,
                                elem_count=grant, total_pkts=s.consumed >> 32, elem_offset=s.consumed & 0xFFFFFFFF)
                out.append((s, s.consumed, overrun, lost, sealing.seal(s.credit_sealer, wire.pack_header(h)), d.addr))
        for s, consumed, overrun, lost, datagram, addr in out:
            try:
                sock.sendto(datagram, addr)
            except OSError:
                continue
            s.credited, s.last_credit = consumed, now
            if overrun:
                s.overrun = False
                self.counters["overrun_credits_sent"] += 1
            elif lost:
                self.counters["loss_releases_sent"] += 1
            if overrun or lost:
                s.released = True
            self.counters["credits_sent"] += 1
        return wake

    def _window_full(self, d: _Dest, now: float) -> float:
        """0 when ``d`` may take more of our packets, else how long until the credit timeout
        (tx lock held); a destination that grants nothing for that long lost them."""
        if d.sent - d.acked < d.window:
            d.held_since = -1.0
            return 0.0
        if d.held_since < 0:
            d.held_since = now
            self.counters["credit_waits"] += 1
        if now - d.held_since >= CREDIT_TIMEOUT:
            d.acked, d.held_since = d.sent, -1.0
            self.counters["credit_timeouts"] += 1
            return 0.0
        return d.held_since + CREDIT_TIMEOUT - now

    @staticmethod
    def _note_first_pass(rx: _Rx, priorities: np.ndarray, seqs: np.ndarray) -> None:
        """Count newly placed first-pass packets per priority level, with each level's lowest and
        highest sequence number (the short last packet aside)."""
        asm = rx.asm
        if asm.tail:
            keep = seqs != asm.n_full
            priorities, seqs = priorities[keep], seqs[keep]
        for prio in np.unique(priorities).tolist():
            s = seqs[priorities == prio]
            lv = rx.levels.get(prio)
            if lv is None:
                rx.levels[prio] = [int(s.min()), int(s.max()), len(s)]
            else:
                lv[0], lv[1], lv[2] = min(lv[0], int(s.min())), max(lv[1], int(s.max())), lv[2] + len(s)

    def _park(self, slots: np.ndarray, lengths: np.ndarray, hdr: np.ndarray | None, rows: np.ndarray,
              now: float) -> np.ndarray:
        """Keep early data of authenticated peers until its message is set up (at most
        ``park_limit`` per sender); count stragglers of finished messages as late. Returns per
        row a code of REASONS (0: kept). The reassembler has checked the rows' tokens against
        their own iterations: nothing forged or from an unauthenticated rank gets here; what was
        recorded earlier is stale (:func:`~dlcp.hostagent.protocol.incoming.stale`)."""
        verdict = np.full(len(rows), _UNKNOWN, np.uint8)
        if hdr is None:  # slots narrower than a header: nothing passed the token check
            return verdict
        for i, r in enumerate(rows.tolist()):
            key = (int(hdr["sender_rank"][r]), int(hdr["message_id"][r]))
            if stale(int(hdr["iteration"][r]), self._used.get(key), self._sender(key[0]).newest):
                verdict[i] = _STALE  # it neither parks, widens a window nor counts
                continue
            if key in self._done and self._used.get(key) == int(hdr["iteration"][r]):
                # a straggler of a finished message (not early data of its id's next use): not malformed
                self.counters["late"] += 1
                verdict[i] = 0
                rx = self._rx.get(key)
                if rx is not None and rx.last_at and not int(hdr["flags"][r]) & _RETX:
                    # a first-pass packet after its message completed at the end of its pass:
                    # the window was too narrow (a bitmap listed it, or a bound left it out)
                    self._widen(key[0], now - rx.last_at)
                continue
            s = self._sender(key[0])
            if s.key is None or key[0] == self.config.rank or s.parked >= self.config.park_limit:
                continue
            self._parked.setdefault(key, []).append((now, slots[r, : lengths[r]].tobytes()))
            s.parked += 1
            verdict[i] = 0
        return verdict

    # ------------------------------------------------------------------ DataPort: send side
    def submit(self, spec: TxSpec) -> None:
        key = (spec.dest, spec.message_id)
        with self._tx_cv:
            if spec.dest not in self._dests:
                raise ValueError(f"unknown destination rank {spec.dest}")
            if key in self._tx:
                raise ValueError(f"message {spec.message_id} to rank {spec.dest} is already in flight")
            m = self._tx[key] = _Tx(spec, held=spec.held)
            if m.held and key in self._fired:
                self._fired.discard(key)
                m.held = False
                self._emit(EventKind.TX_ACTIVE, spec.dest, spec.message_id, time.monotonic())
            if not m.held:
                self._activate(m)

    def _fire(self, triggers: tuple[tuple[int, int], ...], now: float) -> None:
        with self._tx_cv:
            for key in triggers:
                m = self._tx.get(key)
                if m is None:
                    self._fired.add(key)  # submitted later: it starts at once then
                    continue
                if m.held:
                    m.held = False
                    # ACTIVE before anything the activation emits (an empty message's PASS)
                    self._emit(EventKind.TX_ACTIVE, key[0], key[1], now)
                    self._activate(m)

    def _activate(self, m: _Tx) -> None:
        """Queue ``m`` for sending (tx lock held)."""
        if m.packets == 0:  # nothing to send: the pass is over at once
            self._emit(EventKind.TX_PASS, m.spec.dest, m.spec.message_id, time.monotonic(), m.pass_no)
            return
        if not m.queued:
            self._active.append(m)
            m.queued = True
        self._reorder()
        self._tx_cv.notify_all()

    def _reorder(self) -> None:
        """Resends first, then by the message's priority, ties in order (the compiled
        ``reorder_locked``, where the reasons are)."""
        self._active.sort(key=lambda m: (-m.queue_priority(), m.spec.order))

    def _find_tx(self, dest: int, message_id: int, seqs: np.ndarray, caller: str) -> _Tx | None:
        """The message sent to ``dest`` as ``message_id`` (None: none), after checking that
        every one of ``seqs`` is one of its packets (tx lock held)."""
        m = self._tx.get((dest, message_id))
        if m is not None and len(seqs) and (seqs.min() < 0 or seqs.max() >= m.packets):
            raise ValueError(f"{caller}: sequence number beyond the message")
        return m

    def retransmit(self, dest: int, message_id: int, seqs: np.ndarray) -> int:
        seqs = np.asarray(seqs, dtype=np.int64)
        with self._tx_cv:
            m = self._find_tx(dest, message_id, seqs, "retransmit")
            if m is None:
                return 0
            m.retx = seqs
            m.retx_pos = 0
            m.pass_no += 1
            if len(m.retx) and not m.stopped:
                self._activate(m)
            return m.pass_no

    def resend(self, dest: int, message_id: int, seqs: np.ndarray) -> int:
        seqs = np.unique(np.asarray(seqs, dtype=np.int64))
        with self._tx_cv:
            m = self._find_tx(dest, message_id, seqs, "resend")
            if m is None:
                return 0
            if m.stopped or m.send_order is None or m.next_pos >= m.packets:
                return 0  # (a first pass that is over: the answer to its end lists what is missing)
            if m.position is None:
                m.position = np.empty(m.packets, np.int64)
                m.position[m.send_order] = np.arange(m.packets)
            pending = m.retx[m.retx_pos :]
            new = np.setdiff1d(seqs[m.position[seqs] < m.next_pos], pending)
            if not len(new):
                return 0
            m.retx = np.concatenate([pending, new])
            m.retx_pos = 0
            self._activate(m)
            return len(new)

    def tx_info(self, dest: int, message_id: int) -> TxInfo | None:
        with self._tx_cv:
            m = self._tx.get((dest, message_id))
            if m is None:
                return None
            return TxInfo(m.packets, m.next_pos, m.retransmissions, m.pass_no, m.has_packets(), m.held)

    def retire(self, dest: int, message_id: int) -> None:
        key = (dest, message_id)
        with self._tx_cv:
            self._fired.discard(key)
            m = self._tx.get(key)
            if m is None:
                return
            m.stopped = True
            while m.busy:  # the send thread reads its buffers no more
                self._tx_cv.wait(0.05)
            del self._tx[key]
            if m in self._active:
                self._active.remove(m)
            d = self._dests.get(dest)
            if d is not None and not any(k[0] == dest for k in self._tx):
                d.acked, d.held_since = d.sent, -1.0  # nothing in flight to it: what was never credited was lost

    def set_probe_delay(self, dest: int, seconds: float) -> None:
        pass  # (this model wakes the control thread for every event at once)

    def set_rate(self, dest: int, rate: float) -> None:
        with self._tx_cv:
            self._dests[dest].rate = max(1.0, rate)
            self._tx_cv.notify_all()

    def sent_packets(self, dest: int) -> int:
        d = self._dests.get(dest)
        return d.sent if d is not None else 0

    def ingest_for_test(self, slots: np.ndarray, lengths: np.ndarray, now: float) -> None:
        """Validate and place a batch of datagrams (rows of ``slots``) as the receive thread
        would, without a socket: for tests."""
        lengths = np.asarray(lengths, np.int64)
        self._ingest(np.ascontiguousarray(slots, np.uint8), lengths, np.zeros(len(lengths), dtype=bool), now)

    def set_sockopt(self, dest: int, priority: int, level: int, name: int, value: int) -> None:
        """Set an option on the data socket to ``dest`` for ``priority`` (made now if need be)."""
        with self._tx_cv:
            d = self._dests[dest]
            self._sender_for(d, priority)
            d.socks[min(priority, self.policy.top_priority)][0].setsockopt(level, name, value)

    # ------------------------------------------------------------------ the send thread
    def _prepare(self, m: _Tx) -> None:
        """Headers and drop classes, from the payload as it is now (outside the lock)."""
        s = m.spec
        data = s.payload
        if s.snapshot is not None:
            s.snapshot[: data.size] = data
            data = s.snapshot[: data.size]
        meta = MessageMeta(job_id=self.config.job_id, message_id=s.message_id, sender_rank=self.config.rank,
                           iteration=s.iteration, tensor_id=s.tensor_id, layer=s.layer, priority=s.priority,
                           token=s.token)
        batch = packetize(data, meta, self.policy, self.config.mtu, packet_priorities=s.pkt_priority,
                          packet_layers=s.pkt_layer)
        if s.tags_given:
            batch.headers["drop_class"] = s.drop_class
        else:
            s.drop_class[:] = batch.headers["drop_class"]
        prio = batch.headers["priority"]
        if len(prio) and prio.min() != prio.max():
            m.send_order = np.argsort(-prio.astype(np.int16), kind="stable")
            m.prio_in_order = prio[m.send_order]
        else:
            m.send_order = np.arange(len(batch), dtype=np.int64)
        m.header_rows = batch.headers.view(np.uint8).reshape(len(batch), wire.HEADER_SIZE)
        per, itemsize = batch.elems_per_packet, batch.payload.itemsize
        m.payload_rows = batch.payload[: (batch.payload.size // per) * per].view(np.uint8).reshape(
            batch.payload.size // per, per * itemsize)
        m.batch = batch

    def _pick(self, now: float) -> tuple[_Tx | None, float]:
        """Best message whose destination may send now, else how long until one may (lock held)."""
        keep = []
        for m in self._active:
            if m.has_packets() or m.batch is None:
                keep.append(m)
            else:
                m.queued = False
        self._active = keep
        wait = 1.0
        blocked: dict[int, float] = {}
        for m in self._active:
            if m.batch is None:
                return m, 0.0
            d = self._dests[m.spec.dest]
            if d.rank not in blocked:
                pkt = m.batch.datagram_bytes
                blocked[d.rank] = self._window_full(d, now) or max(
                    d.pacer.wait_time(pkt, d.rate, now),
                    self._host_pacer.wait_time(pkt, self.config.rate.line_rate, now))
            if blocked[d.rank] > 0:
                wait = min(wait, blocked[d.rank])
                continue
            return m, wait
        return None, wait

    def _tx_loop(self) -> None:
        cfg = self.config
        while True:
            with self._tx_cv:
                while True:
                    if not self._running:
                        return
                    if self._fault == "send":
                        raise MemoryError("fault_for_test")
                    m, wait = self._pick(time.monotonic())
                    if m is not None:
                        break
                    self._tx_cv.wait(timeout=min(wait, 0.05))
                m.busy = True
                if m.batch is None:
                    prepare = True
                else:
                    prepare = False
                    assert m.send_order is not None  # prepared with the batch
                    d = self._dests[m.spec.dest]
                    retx = m.retx_pos < len(m.retx)
                    pkt = m.batch.datagram_bytes
                    chunk = max(8, min(64, 65507 // pkt)) if cfg.offload else 8
                    now = time.monotonic()
                    allowed = min(d.pacer.allowance(d.rate, now, MAX_INLINE_WAIT),
                                  self._host_pacer.allowance(cfg.rate.line_rate, now, MAX_INLINE_WAIT))
                    chunk = max(1, min(chunk, int(allowed // pkt), d.window - (d.sent - d.acked)))
                    before = m.queue_priority()
                    # A pass's LAST packets leave in one call: a call that would leave fewer than
                    # LAST_PACKETS behind takes them too (within the credit window). A pass is the
                    # first pass with any holes resent during it (resend), or a retransmission.
                    room = max(chunk, d.window - (d.sent - d.acked))
                    if retx:
                        rest = m.packets - m.next_pos  # of the first pass, behind its resent holes
                        stop = min(m.retx_pos + chunk, len(m.retx))
                        if len(m.retx) - stop + rest < wire.LAST_PACKETS and len(m.retx) - m.retx_pos <= room:
                            stop = len(m.retx)
                        seqs = m.retx[m.retx_pos : stop]
                        m.retx_pos = stop
                        after = len(m.retx) - stop + rest
                        lower_after = rest > 0 and m.lowest_priority() < self.policy.top_priority
                    else:
                        stop = min(m.next_pos + chunk, m.packets)
                        if m.packets - stop < wire.LAST_PACKETS and m.packets - m.next_pos <= room:
                            stop = m.packets
                        if m.prio_in_order is not None and stop > m.next_pos:
                            same = m.prio_in_order[m.next_pos : stop] == m.prio_in_order[m.next_pos]
                            if not same.all():
                                stop = m.next_pos + int(np.argmin(same))
                        lower_after = stop < m.packets and m.lowest_priority() < m.sending_priority()
                        seqs = m.send_order[m.next_pos : stop]
                        m.next_pos = stop
                        after = m.packets - stop
                    finished = not m.has_packets()
                    if not finished and m.queue_priority() != before:
                        self._reorder()
                    pass_no = m.pass_no
            if prepare:
                try:
                    self._prepare(m)
                finally:
                    with self._tx_cv:
                        m.busy = False
                        self._reorder()
                        self._tx_cv.notify_all()
                continue
            try:
                marks = _datapath.last_marks(len(seqs), after, wire.LAST_PACKETS, lower_after)
                sent, nbytes = self._send_packets(m, d, seqs, retx, marks)
            finally:
                with self._tx_cv:
                    m.busy = False
                    self._tx_cv.notify_all()
            with self._tx_cv:
                d.pacer.consume(nbytes)
                self._host_pacer.consume(nbytes)
                d.sent += sent
                self.counters["data_pkts_sent"] += sent
                self.counters["data_bytes_sent"] += nbytes
                if retx:
                    m.retransmissions += sent
                    self.counters["retransmitted_pkts"] += sent
                if finished and not m.stopped:
                    self._emit(EventKind.TX_PASS, m.spec.dest, m.spec.message_id, time.monotonic(), pass_no)

    def _sender_for(self, d: _Dest, priority: int) -> DatagramSender:
        q = min(priority, self.policy.top_priority)  # one socket per queue
        entry = d.socks.get(q)
        if entry is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.config.socket_buffer)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, (self.policy.dscp[q] << 2) | _ECT0)
            if self.config.source_port_base is not None:  # the same path for every run with this base
                port = self.config.source_port_base + PORTS_PER_DEST * d.rank + q
                try:
                    sock.bind(("0.0.0.0", port))
                except OSError as exc:
                    sock.close()
                    raise OSError(exc.errno, f"bind data socket to rank {d.rank} to source port {port}: "
                                  f"{exc.strerror}") from None
            sock.connect(d.addr)
            entry = d.socks[q] = (sock, DatagramSender(sock, use_gso=self.config.offload))
        return entry[1]

    def _send_packets(self, m: _Tx, d: _Dest, seqs: np.ndarray, retx: bool, marked: int) -> tuple[int, int]:
        """Send ``seqs`` of ``m`` (all of one priority) in one paced burst: full-size packets as
        rows of a staging buffer by GSO, the short last packet (and everything without GSO) one
        by one. The final ``marked`` of them to leave carry LAST (the compiled rule
        ``last_marks``: the pass's final ``wire.LAST_PACKETS``, of its last priority level)."""
        batch = m.batch
        assert batch is not None and m.payload_rows is not None  # prepared before any packet is sent
        per = batch.elems_per_packet
        width = batch.datagram_bytes
        k = len(seqs)
        short_seq = len(batch) - 1 if batch.payload.size % per else -1
        if retx:
            hdr = batch.headers[seqs].copy()
            hdr["priority"] = self.policy.top_priority
            hdr["drop_class"] = 0
            hdr["flags"] = (hdr["flags"] & ~np.uint8(_LAST)) | _RETX
            hrows, hidx = hdr.view(np.uint8).reshape(k, wire.HEADER_SIZE), np.arange(k)
            priority = self.policy.top_priority
        else:
            hrows, hidx = m.header_rows, seqs
            priority = int(batch.headers["priority"][seqs[0]]) if k else m.spec.priority
        hits = np.flatnonzero(seqs == short_seq) if short_seq >= 0 else np.zeros(0, np.int64)
        short_pos = int(hits[0]) if len(hits) else -1
        n_full = k - (1 if short_pos >= 0 else 0)
        total = n_full * width + (wire.HEADER_SIZE + (batch.payload.size % per) * batch.payload.itemsize
                                  + wire.TRAILER_SIZE if short_pos >= 0 else 0)
        with self._tx_cv:
            keyed = self._tx_sealers.get(d.rank)
        try:
            if keyed is None:  # no key (the peer was lost): its control path tells
                raise OSError(f"no key for rank {d.rank}")
            sender = self._sender_for(d, priority)
        except OSError:
            self.counters["send_errors"] += k
            return 0, 0
        sealer = keyed[1]
        now = time.monotonic()
        with self._tx_cv:
            w = max(d.pacer.wait_time(total, d.rate, now),
                    self._host_pacer.wait_time(total, self.config.rate.line_rate, now))
        if w > 0:
            time.sleep(w)
        use_gso = sender.gso and n_full > 1
        if marked:
            # LAST goes on the packets that really leave last: with a GSO run, the short packet
            # leaves first and the run's final rows last.
            departure = ([short_pos] + [i for i in range(k) if i != short_pos]) if use_gso and short_pos >= 0 \
                else list(range(k))
            pos = np.array(departure[k - marked :], np.int64)
            if retx:
                hdr["flags"][pos] |= _LAST
            else:
                batch.headers["flags"][seqs[pos]] |= _LAST
        calls0, errors0 = sender.syscalls, sender.errors
        n = nbytes = 0
        order = [short_pos] if short_pos >= 0 else []
        if use_gso:
            if order:
                n, nbytes = self._one_by_one(sender, sealer, batch, hrows, hidx, seqs, order)
            if self._stage is None or self._stage.shape[0] < n_full or self._stage.shape[1] != width:
                self._stage = np.empty((max(n_full, 64), width), dtype=np.uint8)
            stage = self._stage[:n_full]
            keep = np.ones(k, dtype=bool)
            if short_pos >= 0:
                keep[short_pos] = False
            stage[:, : wire.HEADER_SIZE] = hrows[hidx[keep]]
            stage[:, wire.HEADER_SIZE : width - wire.TRAILER_SIZE] = m.payload_rows[seqs[keep]]
            sealing.seal_rows(sealer, stage, np.full(n_full, width - wire.TRAILER_SIZE, np.int64))
            n2, b2 = sender.send_rows(stage)
            n, nbytes = n + n2, nbytes + b2
        else:
            n, nbytes = self._one_by_one(sender, sealer, batch, hrows, hidx, seqs, list(range(k)))
        self.counters["gso_calls"] += sender.syscalls - calls0 if sender.gso else 0
        if sender.errors != errors0:  # e.g. ICMP unreachable from a dead peer; its TCP loss tells
            self.counters["send_errors"] += sender.errors - errors0
        return n, nbytes

    @staticmethod
    def _one_by_one(sender: DatagramSender, sealer: Any, batch: PacketBatch, hrows: np.ndarray, hidx: np.ndarray,
                    seqs: np.ndarray, positions: list[int]) -> tuple[int, int]:
        """Datagrams one by one (each sealed in a row of its own: an encrypted payload cannot
        leave from the tensor)."""
        payloads = [batch.payload_of(int(seqs[i])) for i in positions]
        lengths = np.array([wire.HEADER_SIZE + len(p) for p in payloads], dtype=np.int64)
        rows = np.zeros((len(positions), batch.datagram_bytes), np.uint8)
        for j, (i, p) in enumerate(zip(positions, payloads)):
            rows[j, : wire.HEADER_SIZE] = hrows[int(hidx[i])]
            rows[j, wire.HEADER_SIZE : lengths[j]] = np.frombuffer(p, np.uint8)
        sizes = sealing.seal_rows(sealer, rows, lengths)
        buffers = [(rows[j, : wire.HEADER_SIZE].data, rows[j, wire.HEADER_SIZE : sizes[j]].data)
                   for j in range(len(positions))]
        return sender.send(buffers, sizes)

    # ------------------------------------------------------------------ figures
    def stats(self) -> dict[str, Any]:
        with self._lock:
            s: dict[str, Any] = dict(self.counters)
            r = self.reassembler.stats
            s["accepted"], s["duplicates"] = r.accepted, r.duplicates
            s["rejected"] = {k: v for k, v in r.rejected.items() if v}
            s["parked_now"] = sum(len(v) for v in self._parked.values())
            s["injected_drops"] = dict(self.injected_drops)
        with self._tx_cv:
            socks = []
            for d in self._dests.values():
                for prio, (sock, _) in d.socks.items():
                    try:
                        socks.append((d.rank, prio, sock.getsockname()[1]))
                    except OSError:
                        pass
            s["data_sockets"] = sorted(socks)
            s["gso_off"] = sorted({snd.gso_off_reason for d in self._dests.values() for _, snd in d.socks.values()
                                   if snd.gso_off_reason})
        return s


__all__ = ["REASONS", "NumpyDatapath", "receive_backlog"]
