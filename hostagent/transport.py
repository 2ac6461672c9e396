"""The bounded-loss gradient transport: one :class:`Endpoint` per process.

Each endpoint has a UDP socket for DLCP data packets and a TCP control connection to each
peer for META, PROBE, BITMAP, STOP and FEEDBACK records; records bound for one peer at one
moment travel together in one frame (BATCH). Three threads do the I/O, each in its own module
(this one holds the public API and the lifecycle):

* **tx** (:mod:`hostagent.tx_path`) sends data packets: of all messages with packets left, the one whose next packet has
  the highest priority goes first (retransmissions above everything), paced per destination
  by a token bucket whose rate a DCTCP-like controller sets from the receiver's feedback,
  never above the receiver's drain ceiling, and by a host pacer across destinations. Runs of
  full-size packets leave by UDP GSO from a staging buffer where the kernel takes it.
* **rx** (:mod:`hostagent.rx_path`) receives datagrams in batches into preallocated rows (GRO reads land in them
  directly), applies the configured loss injection, hands the batch to the
  :class:`~hostagent.reassembly.Reassembler`, and measures what it can drain while behind.
* **ctl** (:mod:`hostagent.control_path`) reads control frames from every peer, runs the timers (answers to the end of a
  pass, idle completion, probes, deadlines, feedback) and flushes every peer's queued records
  about once a millisecond while messages are in flight (every 50 ms when idle; send and recv
  wake it). It never opens a connection and never blocks on one: a frame goes out directly
  when the socket takes it, otherwise through that connection's own writer thread and a
  bounded queue, so a dead or non-reading peer cannot stall it.

Every control connection opens with the handshake of :mod:`hostagent.auth` (a proof of the
job secret both ways, the peer's configured address, and each side's key for the other's
message tokens); every data packet carries its message's token, which the receiver checks
before anything else, so neither a frame nor a datagram from outside the job reaches a message.

Every finished message's figures, with monotonic times, stay in :attr:`Endpoint.message_log`
(the testbed's time breakdown reads them), and every change of a destination's sending rate in
:attr:`Endpoint.rate_log` (why a transfer ran below its bottleneck).

The protocol for one message, sender S to receiver R:

1. S announces the message with a META (size, element type, loss bound p), alone, with other
   records, or ahead of time (:meth:`Endpoint.announce`); or R already posted its size
   (``recv(..., expect=...)``) and there is no META. The data packets go over UDP; data that
   comes before R knows the message is parked briefly, not lost.
2. R completes the message when every packet arrived (*exact*), or when at least (1-p) arrived
   and S has finished its pass or nothing new came for an idle timeout (*bounded*). It
   zero-fills the rest and sends STOP, so S stops spending bandwidth on the message.
3. The last packet of each pass carries ``Flags.LAST``: R answers it (once its socket is
   drained and nothing came for ``probe_grace``, or for four of the message's packet gaps)
   with STOP, or with a BITMAP of what is missing when below the bound; S resends just enough
   of the missing packets, most important first, at the top priority and in drop class 0,
   ending that pass with LAST again, until STOP. A PROBE from S is only the fallback, when
   no answer came within the measured answer time.

Every wait has a deadline; a peer whose control connection drops fails every message to or
from it with :class:`~hostagent.messages.PeerFailed`, naming the peer and the message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import queue
import selectors
import socket
import threading
import time
from collections import OrderedDict, defaultdict, deque
from typing import Any

import numpy as np

from hostagent import auth, wire
from hostagent.control_conn import CTL_WRITE_LIMIT, ControlConn
from hostagent.control_path import IDLE_TICK, ControlPath
from hostagent.fusion import Layout
from hostagent.messages import (Expect, InMessage, MessageStats, OutMessage, PeerFailed, PeerUnreachable, RateChange,
                                RecvHandle, RecvResult, SendHandle, TransportClosed, TransportError, TransportTimeout)
from hostagent.packetizer import MessageMeta, elems_per_packet, packetize
from hostagent.ratecontrol import AnswerTimer, DrainMeter, Pacer, RateController
from hostagent.reassembly import REASONS, Reassembler
from hostagent.rx_path import SO_RXQ_OVFL, ReceivePath
from hostagent.transport_config import EndpointStats, LossInjection, Peer, TransportConfig, local_peers
from hostagent.tx_path import SendPath
from hostagent.udp_offload import DatagramSender, enable_gro

log = logging.getLogger(__name__)

MESSAGE_LOG = 4096  # finished messages whose figures an endpoint keeps (message_log)
RATE_LOG = 16384  # sending-rate changes an endpoint keeps (rate_log)


class Endpoint(SendPath, ReceivePath, ControlPath):
    """A DLCP transport endpoint: send and receive bounded-loss messages to and from peers.

    Example::

        ep = Endpoint(TransportConfig(rank=0, peers=(Peer(0, "127.0.0.1", 7000, 7001),
                                                     Peer(1, "127.0.0.1", 7002, 7003))))
        ep.start()
        h = ep.send(1, grad, message_id=7, priority=7)   # -> SendHandle
        r = ep.recv(1, message_id=9)                      # -> RecvHandle
        data = r.wait(10).data
        ep.close()
    """

    def __init__(self, config: TransportConfig) -> None:
        self.config = config
        self.rank = config.rank
        self.me = config.peer(config.rank)
        self.policy = config.policy
        self.stats = EndpointStats()
        self.reassembler = Reassembler(config.job_id, token_of=self._park_token)
        self._lock = threading.Lock()
        self._tx_cv = threading.Condition(self._lock)
        self._running = False
        self._closed = False
        self._order = itertools.count()
        self._out: dict[tuple[int, int], OutMessage] = {}
        self._in: dict[tuple[int, int], InMessage] = {}
        self._waiting: dict[tuple[int, int], RecvHandle] = {}
        self._done_in: dict[tuple[int, int], RecvResult] = {}
        self._parked: dict[tuple[int, int], list[tuple[float, bytes]]] = {}
        self._parked_count: dict[int, int] = defaultdict(int)  # early packets held, per sender
        self._conns: dict[int, ControlConn] = {}  # rank -> the authenticated connection used for it
        self._all_conns: list[ControlConn] = []
        self._dialing: dict[int, ControlConn] = {}  # rank -> connection an application thread is opening
        self._authed: set[int] = set()  # ranks that completed a handshake (whose data may be parked)
        self._rx_keys: dict[int, bytes] = {}  # sender rank -> our key for its tokens (auth.message_token)
        self._tx_keys: dict[int, bytes] = {}  # destination rank -> its key for our tokens
        self._allowed_ips: dict[int, set[str]] = {}  # rank -> addresses it may connect from
        self._rate: dict[int, RateController] = {}
        self._pacer: dict[int, Pacer] = {}
        self._srtt: dict[int, float] = {}
        self._fb: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])  # received, CE, overflowed
        self._urgent = False  # a control timer may fire within a few ms: tick every millisecond
        self._fb_sent_at: dict[int, float] = {}  # last feedback to each sender
        self._outbox: dict[int, list[bytes]] = defaultdict(list)  # control records waiting, per peer
        self._ob_lock = threading.Lock()
        self._deferring = threading.local()  # inside `with endpoint.batch()`
        self._host_pacer = Pacer(config.rate.burst_bytes)  # the host's own link, across destinations
        self._answer: dict[int, AnswerTimer] = {}  # sender side: how fast each destination answers a pass
        self._drain = DrainMeter()  # receiver side: what this endpoint drains while behind
        self._rx_holding = False  # the rx thread holds datagrams it read but has not yet placed
        self._startup_drain = 0.0  # estimate before any measurement (set in start())
        self._drain_sent: dict[int, int] = {}  # last drain share (KB/s) told to each sender
        self._senders_seen: dict[int, float] = {}  # sender rank -> last data arrival
        self._delayed: list[tuple[float, bytes]] = []
        self.message_log: deque[MessageStats] = deque(maxlen=MESSAGE_LOG)
        """The figures of the last MESSAGE_LOG messages finished, both directions, with their
        monotonic times: what a report needs to say where an iteration's time went."""
        self._last_rate: dict[int, float] = {}  # the rate last logged per destination
        self.rate_log: deque[RateChange] = deque(maxlen=RATE_LOG)
        """The last RATE_LOG changes of a destination's pacing rate, with monotonic times and
        their cause: whether a slow transfer was cut by marks, losses or the receiver's ceiling."""
        self._active: list[OutMessage] = []  # messages with packets to send, best first
        self._recent_done: OrderedDict[tuple[int, int], int] = OrderedDict()  # key -> elements held
        self._rng = np.random.default_rng(config.loss.seed)
        self._tx_socks: dict[tuple[int, int], socket.socket] = {}
        self._senders: dict[tuple[int, int], DatagramSender] = {}
        self._stage: np.ndarray | None = None  # tx thread's staging rows for GSO runs
        self._gro = False
        self._threads: list[threading.Thread] = []
        self._udp: socket.socket | None = None
        self._listener: socket.socket | None = None
        self._sel: selectors.BaseSelector | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)  # a full wake pipe already holds a wake: never block on it
        self._wake_pending = False
        self._announcements: queue.Queue | None = None
        log.info("endpoint rank %d config: %s", self.rank, config)

    # ------------------------------------------------------------------ lifecycle
    def start(self, bound: tuple[socket.socket, socket.socket] | None = None) -> "Endpoint":
        """Bind the data and control sockets and start the I/O threads.

        ``bound``: a UDP and a TCP socket already bound to this rank's ports (see
        :func:`reserve_ports`), taken over as they are, so no other process can take the
        ports between announcing them to the peers and starting.
        """
        if self._running or self._closed:
            raise TransportError(f"endpoint rank {self.rank} already started or closed")
        udp, lst = bound if bound is not None else (socket.socket(socket.AF_INET, socket.SOCK_DGRAM),
                                                      socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        try:
            udp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.config.socket_buffer)
            udp.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
            udp.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)
            if bound is None:
                udp.bind((self.me.host, self.me.data_port))
                lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                lst.bind((self.me.host, self.me.control_port))
            elif (udp.getsockname()[1], lst.getsockname()[1]) != (self.me.data_port, self.me.control_port):
                raise OSError(f"the sockets handed over hold ports {udp.getsockname()[1]}/{lst.getsockname()[1]}")
            self._gro = self.config.offload and enable_gro(udp)
            lst.listen(64)
        except OSError as exc:
            udp.close()
            lst.close()
            self._wake_r.close()
            self._wake_w.close()
            self._closed = True
            raise TransportError(f"rank {self.rank} cannot bind {self.me.host} data port {self.me.data_port} / "
                                 f"control port {self.me.control_port}: {exc}") from exc
        udp.setblocking(False)
        lst.setblocking(False)
        self._udp, self._listener = udp, lst
        self._startup_drain = self._calibrate_drain()
        self._sel = selectors.DefaultSelector()
        self._sel.register(lst, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._running = True
        for name, target in (("rx", self._rx_loop), ("tx", self._tx_loop), ("ctl", self._ctl_loop)):
            t = threading.Thread(target=target, name=f"dlcp-{name}-{self.rank}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __enter__(self) -> "Endpoint":
        return self.start() if not self._running else self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the threads, close every socket, fail whatever is still in flight."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._running = False
            self._tx_cv.notify_all()
        self._wake()
        for t in self._threads:
            t.join(timeout=5)
        err = TransportClosed(f"endpoint rank {self.rank} closed")
        with self._lock:
            for m in self._out.values():
                m.handle._fail(err)
            for m in self._in.values():
                if m.handle:
                    m.handle._fail(err)
            for h in self._waiting.values():
                h._fail(err)
            self._out.clear()
            self._in.clear()
            self._waiting.clear()
        for c in list(self._all_conns):
            c.finish(timeout=0.5)  # what is queued (last STOPs) still leaves
        for s in [*self._tx_socks.values(), *(c.sock for c in self._all_conns)]:
            s.close()
        for s in (self._udp, self._listener, self._wake_r, self._wake_w):
            if s is not None:
                s.close()
        if self._sel is not None:
            self._sel.close()

    def _wake(self) -> None:
        """Make the control loop run its timers and flush now (from any thread, the control
        thread included). Wakes coalesce: while one is pending, another adds nothing, so the
        rx and tx threads may wake per message without a system call each, and never block."""
        if self._wake_pending:
            return
        self._wake_pending = True
        try:
            self._wake_w.send(b"x")
        except OSError:  # full (a wake is pending anyway) or closed
            pass

    @contextlib.contextmanager
    def batch(self):
        """Hold the control records of the sends inside (their METAs) and send them together.

        Example: ``with ep.batch(): handles = [ep.send(dest, g, mid) for mid, g in ...]``
        """
        depth = getattr(self._deferring, "depth", 0)
        self._deferring.depth = depth + 1
        try:
            yield self
        finally:
            self._deferring.depth = depth
            if depth == 0:
                self._flush_all()
                pending, self._deferring.pending = getattr(self._deferring, "pending", []), []
                with self._lock:
                    for msg in pending:
                        if self._out.get((msg.dest, msg.message_id)) is msg:
                            self._activate(msg)

    # ------------------------------------------------------------------ public API
    def send(self, dest: int, data: np.ndarray, message_id: int, priority: int | None = None,
             loss_bound: float | None = None, iteration: int = 0, tensor_id: int = 0, layer: int = 0,
             layout: Layout | None = None, announce: bool = True) -> SendHandle:
        """Send ``data`` to rank ``dest`` as message ``message_id``; returns at once.

        Args:
            priority: header priority (default: the policy's top, or the layout's most urgent).
            loss_bound: p for this message (default: the policy's push bound).
            layout: for a fused message, which layer each element range belongs to; every packet
                then carries the priority and layer of the most urgent layer it holds, and the
                most urgent packets go first.
            announce: send a META first (default). ``False`` when the receiver posted the message's
                size with ``recv(..., expect=...)``: one control record less per message.

        The array is not copied: it must not change until the handle resolves.

        Raises:
            ValueError: bad rank, priority or array; a message id already in flight to ``dest``.
            PeerUnreachable: ``dest`` does not accept a control connection.
        """
        if dest == self.rank:
            raise ValueError("an endpoint does not send to itself")
        self.config.peer(dest)
        if priority is None:
            priority = layout.top_priority if layout is not None else self.policy.top_priority
        p = self.policy.loss_bound_push if loss_bound is None else loss_bound
        if not 0 <= p < 1:
            raise ValueError(f"loss_bound must be in [0, 1), got {p}")
        self._conn_to(dest)  # authenticated: we hold dest's key for our tokens
        token = auth.message_token(self._tx_keys[dest], self.config.job_id, self.rank, message_id)
        meta = MessageMeta(job_id=self.config.job_id, message_id=message_id, sender_rank=self.rank,
                           iteration=iteration, tensor_id=tensor_id, layer=layer, priority=priority, token=token)
        tags: tuple[np.ndarray | None, np.ndarray | None] = (None, None)
        if layout is not None:
            if layout.total != np.asarray(data).size:
                raise ValueError(f"layout covers {layout.total} elements; the message has {np.asarray(data).size}")
            tags = layout.packet_tags(elems_per_packet(self.config.mtu, np.asarray(data).dtype))
        batch = packetize(data, meta, self.policy, self.config.mtu, packet_priorities=tags[0],
                          packet_layers=None if tags[1] is None else tags[1] % 65536)
        msg = OutMessage(dest, batch, priority, p, time.monotonic() + self.config.message_deadline, next(self._order),
                         announce)
        key = (dest, message_id)
        with self._lock:
            if not self._running:
                raise TransportClosed(f"endpoint rank {self.rank} is not running")
            if key in self._out:
                raise ValueError(f"message {message_id} to rank {dest} is already in flight")
            self._out[key] = msg  # before META: an empty message's STOP may come back at once
            if dest not in self._rate:
                self._rate[dest] = RateController(self.config.rate)
                self._note_rate(dest, time.monotonic(), "start")
            self._pacer.setdefault(dest, Pacer(self.config.rate.burst_bytes))
        self._wake()  # the control loop ticks fast from now on
        if announce:
            self._queue_meta(dest, message_id, batch.payload.size, data.dtype, p, priority, iteration, tensor_id, layer)
        if len(batch) == 0:
            msg.pass_done_at = time.monotonic()  # nothing to send: the probe timer takes it from here
            self._wake()
        if getattr(self._deferring, "depth", 0):
            self._deferring.__dict__.setdefault("pending", []).append(msg)  # activated when the batch flushes
        else:
            with self._lock:
                if self._out.get(key) is msg:  # data only after its META is on the wire
                    self._activate(msg)
        return msg.handle

    def announce(self, dest: int, message_id: int, total_elems: int, dtype: Any = np.float32,
                 loss_bound: float | None = None, priority: int | None = None, iteration: int = 0,
                 tensor_id: int = 0, layer: int = 0) -> None:
        """Send the META of a message ahead of its data, which follows with ``send(..., announce=False)``.

        Why: a worker knows its iteration's buckets before their gradients exist; announcing
        them together (inside :meth:`batch`) costs one control frame instead of one per bucket.
        The receiver sets the message up as for any META; its data may come any time later.
        """
        self.config.peer(dest)
        p = self.policy.loss_bound_push if loss_bound is None else loss_bound
        if not 0 <= p < 1:
            raise ValueError(f"loss_bound must be in [0, 1), got {p}")
        self._conn_to(dest)
        self._queue_meta(dest, message_id, total_elems, dtype, p,
                         self.policy.top_priority if priority is None else priority, iteration, tensor_id, layer)

    def _queue_meta(self, dest: int, message_id: int, total_elems: int, dtype: Any, loss_bound: float,
                    priority: int, iteration: int, tensor_id: int, layer: int) -> None:
        """The META of a message (for :meth:`send` and :meth:`announce`); sent at once unless
        inside :meth:`batch`."""
        per = elems_per_packet(self.config.mtu, dtype)
        self._queue_ctl(dest, wire.PacketType.META, message_id, wire.META_BODY.pack(total_elems, per, loss_bound),
                        priority=priority, iteration=iteration, tensor_id=tensor_id, layer=layer,
                        dtype=wire.dtype_code(dtype), total_pkts=-(-total_elems // per))
        if not getattr(self._deferring, "depth", 0):
            self._flush(dest)

    def recv(self, src: int, message_id: int, out: np.ndarray | None = None,
             expect: Expect | None = None) -> RecvHandle:
        """Ask for message ``message_id`` from rank ``src``; returns a handle at once.

        ``out``, if given, is the 1-D array the message is written into (it must match the
        announced size and element type, or the handle fails with a clear error).
        ``expect`` gives the message's size, element type and bound, so the message is set up
        now and its sender needs no META (it sends with ``announce=False``).
        """
        self.config.peer(src)
        key = (src, message_id)
        if expect is not None:
            return self._recv_expected(src, message_id, out, expect)
        with self._lock:
            if key in self._done_in:
                h = RecvHandle(src, message_id, out)
                res = self._done_in.pop(key)
                if out is not None:
                    if out.shape != res.data.shape or out.dtype != res.data.dtype:
                        h._fail(ValueError(f"message {message_id} from rank {src} has {res.data.size} "
                                           f"{res.data.dtype}, out is {out.shape} {out.dtype}"))
                        return h
                    out[:] = res.data
                    res = dataclasses.replace(res, data=out)
                h._resolve(res)
                return h
            if key in self._waiting or (key in self._in and self._in[key].handle is not None):
                raise ValueError(f"message {message_id} from rank {src} is already being received")
            h = RecvHandle(src, message_id, out)
            if key in self._in:
                self._in[key].handle = h
                if out is not None:
                    log.debug("message %d from %d already announced: out= is copied into at the end", message_id, src)
            else:
                self._waiting[key] = h
        self._wake()  # the control loop ticks fast from now on
        return h

    def _recv_expected(self, src: int, message_id: int, out: np.ndarray | None, expect: Expect) -> RecvHandle:
        key = (src, message_id)
        dtype = np.dtype(expect.dtype).newbyteorder("=")
        per = elems_per_packet(self.config.mtu, dtype)
        replay: list[bytes] = []
        with self._lock:
            if not self._running:
                raise TransportClosed(f"endpoint rank {self.rank} is not running")
            if key in self._waiting or key in self._in or key in self._done_in:
                raise ValueError(f"message {message_id} from rank {src} is already being received")
            h = RecvHandle(src, message_id, out)
            asm = self.reassembler.expect(src, message_id, expect.total_elems, dtype, per, out=out,
                                          token=self._rx_token(src, message_id))
            msg = InMessage(src, asm, expect.loss_bound, time.monotonic() + self.config.message_deadline, h,
                            self.policy.top_priority)
            self._in[key] = msg
            self._recent_done.pop(key, None)
            self._wake()  # the control loop ticks fast from now on
            replay = [d for _, d in self._parked.pop(key, [])]
            self._parked_count[src] -= len(replay)
            if expect.total_elems == 0:
                self._complete_locked(msg, "exact")
        if expect.total_elems == 0:
            self._send_stop(msg)
        elif replay:
            self._replay(replay)
        return h

    def announcements(self) -> "queue.Queue[tuple[int, int]]":
        """A queue of (src, message_id) for every message announced without a waiting recv.

        For servers that do not know in advance what will arrive (a parameter server behind
        a DDP hook, whose buckets change); call before peers start sending. Each entry is to
        be claimed with :meth:`recv`.
        """
        with self._lock:
            if self._announcements is None:
                self._announcements = queue.Queue()
                # messages announced before anyone asked: unclaimed, in flight or complete
                for key, msg in self._in.items():
                    if msg.handle is None:
                        self._announcements.put(key)
                for key in self._done_in:
                    self._announcements.put(key)
            return self._announcements

    def endpoint_stats(self) -> dict[str, Any]:
        """Totals as a JSON-ready dict (reassembly's malformed counts included)."""
        s = self.stats
        with self._lock:
            rates = {r: c.rate for r, c in self._rate.items()}
        return {
            "rank": self.rank,
            "data_pkts_sent": s.data_pkts_sent, "data_bytes_sent": s.data_bytes_sent,
            "retransmitted_pkts": s.retransmitted_pkts,
            "data_pkts_received": s.data_pkts_received, "data_bytes_received": s.data_bytes_received,
            "ce_marked": s.ce_marked, "rx_socket_overflows": s.rx_overflows, "rx_dropped_estimate": s.rx_dropped_estimate, "parked_early": s.parked, "parked_now": sum(self._parked_count.values()), "late_after_completion": s.late, "send_errors": s.send_errors,
            "messages_sent": s.messages_sent, "messages_received": s.messages_received,
            "duplicate_pkts": self.reassembler.stats.duplicates,
            "ctl_frames_sent": s.ctl_frames_sent, "ctl_bytes_sent": s.ctl_bytes_sent,
            "ctl_frames_received": s.ctl_frames_received, "ctl_bytes_received": s.ctl_bytes_received,
            "ctl_records_sent": dict(s.ctl_records_sent), "ctl_records_received": dict(s.ctl_records_received),
            "probes_unknown": s.probes_unknown, "ctl_rejected": dict(s.ctl_rejected),
            "authenticated_peers": sorted(self._authed), "drain_bytes_per_s": self._drain.rate,
            "gso_calls": s.gso_calls, "gro_reads": s.gro_reads, "gro": self._gro,
            "gso_off": sorted({x.gso_off_reason for x in self._senders.values() if x.gso_off_reason} if self.config.offload else set()),
            "injected_drops_by_class": dict(s.injected_drops), "injected_delays": s.injected_delays,
            "reassembly": self.reassembler.stats.as_dict(),
            "rate_bytes_per_s": rates,
            # (destination, priority, local UDP port) of every data socket: with the addresses,
            # the 5-tuple a switch hashes, so a report can tell which flows shared an ECMP path
            "data_sockets": self._data_sockets(),
        }

    def _data_sockets(self) -> list[tuple[int, int, int]]:
        out = []
        for (dest, priority), sock in list(self._tx_socks.items()):
            try:
                out.append((dest, priority, sock.getsockname()[1]))
            except OSError:  # closed
                pass
        return sorted(out)


def reserve_ports(host: str) -> tuple[socket.socket, socket.socket]:
    """A UDP and a TCP socket bound to free ports of ``host``, to announce to the peers and then
    hand to :meth:`Endpoint.start` (``bound=``): the ports are held the whole time, so nobody
    else can take them in between."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        udp.bind((host, 0))
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind((host, 0))
    except OSError:
        udp.close()
        tcp.close()
        raise
    return udp, tcp


__all__ = ["CTL_WRITE_LIMIT", "IDLE_TICK", "Endpoint", "EndpointStats", "LossInjection", "MessageStats", "Peer", "PeerFailed", "PeerUnreachable",
           "RecvHandle", "RecvResult", "SendHandle", "TransportClosed", "TransportConfig", "TransportError",
           "TransportTimeout", "local_peers", "reserve_ports", "REASONS"]
