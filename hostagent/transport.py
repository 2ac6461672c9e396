"""The bounded-loss gradient transport: one :class:`Endpoint` per process.

Each endpoint has a UDP socket for DLCP data packets and a TCP control connection to each
peer for META, PROBE, BITMAP, STOP and FEEDBACK records; records bound for one peer at one
moment travel together in one frame (BATCH). Three threads do the I/O:

* **tx** sends data packets: of all messages with packets left, the one whose next packet has
  the highest priority goes first (retransmissions above everything), paced per destination
  by a token bucket whose rate a DCTCP-like controller sets from the receiver's feedback,
  never above the receiver's drain ceiling, and by a host pacer across destinations. Runs of
  full-size packets leave by UDP GSO from a staging buffer where the kernel takes it.
* **rx** receives datagrams in batches into preallocated rows (GRO reads land in them
  directly), applies the configured loss injection, hands the batch to the
  :class:`~hostagent.reassembly.Reassembler`, and measures what it can drain while behind.
* **ctl** reads control frames from every peer, runs the timers (answers to the end of a
  pass, idle completion, probes, deadlines, feedback) and flushes every peer's queued records
  about once a millisecond while messages are in flight (every 50 ms when idle; send and recv
  wake it). It never opens a connection and never blocks on one: a frame goes out directly
  when the socket takes it, otherwise through that connection's own writer thread and a
  bounded queue, so a dead or non-reading peer cannot stall it.

Every finished message's figures, with monotonic times, stay in :attr:`Endpoint.message_log`
(the testbed's time breakdown reads them).

The protocol for one message, sender S to receiver R:

1. S announces the message with a META (size, element type, loss bound p), alone, with other
   records, or ahead of time (:meth:`Endpoint.announce`); or R already posted its size
   (``recv(..., expect=...)``) and there is no META. The data packets go over UDP; data that
   comes before R knows the message is parked briefly, not lost.
2. R completes the message when every packet arrived (*exact*), or when at least (1-p) arrived
   and S has finished its pass or nothing new came for an idle timeout (*bounded*). It
   zero-fills the rest and sends STOP, so S stops spending bandwidth on the message.
3. The last packet of each pass carries ``Flags.LAST``: R answers it (once its socket is
   drained and nothing came for ``probe_grace``) with STOP, or with a BITMAP of what is missing
   when below the bound; S resends just enough of the missing packets, most important first,
   at the top priority and in drop class 0, ending that pass with LAST again, until STOP. A
   PROBE from S is only the fallback, when no answer came within the measured answer time.

Every wait has a deadline; a peer whose control connection drops fails every message to or
from it with :class:`~hostagent.messages.PeerFailed`, naming the peer and the message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import itertools
import logging
import queue
import select
import selectors
import socket
import struct
import termios
import threading
import time
from collections import OrderedDict, defaultdict, deque
from typing import Any, Callable

import numpy as np

from hostagent import wire
from hostagent.fusion import Layout
from hostagent.lossmodel import drop_by_class
from hostagent.messages import (Expect, InMessage, MessageStats, OutMessage, PeerFailed, PeerUnreachable, RecvHandle,
                                RecvResult, SendHandle, TransportClosed, TransportError, TransportTimeout)
from hostagent.packetizer import MessageMeta, elems_per_packet, packetize
from hostagent.policy import retransmission_set
from hostagent.ratecontrol import AnswerTimer, DrainMeter, Pacer, RateController, drain_share
from hostagent.reassembly import REASONS, Reassembler
from hostagent.transport_config import EndpointStats, LossInjection, Peer, TransportConfig, local_peers
from hostagent.udp_offload import (GRO_ANCBUF, GRO_BUFSIZE, DatagramSender, enable_gro, gro_segment_size,
                                   split_segments)

log = logging.getLogger(__name__)

_ECT0 = 0b10  # ECN-capable transport codepoint in the IP TOS byte
_CE = 0b11  # congestion experienced
_OUTBOX_LIMIT = 4096  # control records kept for a peer the control thread cannot reach yet
CTL_WRITE_LIMIT = 4 << 20  # bytes queued on a control connection before its peer counts as not reading
MESSAGE_LOG = 4096  # finished messages whose figures an endpoint keeps (message_log)
IDLE_TICK = 0.05  # control-loop period of an endpoint with no message in flight (s)
_HELLO, _HELLO_REPLY = 1, 2  # message ids of the FEEDBACK that opens a control connection, and its answer
# Linux: with SO_RXQ_OVFL set, a datagram carries the socket's count of datagrams the kernel
# dropped for want of buffer space (a receiver overrun the senders must hear about).
SO_RXQ_OVFL = getattr(socket, "SO_RXQ_OVFL", 40)


class _Conn:
    """One control connection: a socket, a read buffer, and a bounded queue of the frames the
    socket did not take at once, which its own writer thread sends.

    Why a writer per connection: a peer that stops reading fills its TCP window, and a blocking
    send would then stall whoever sends, the control loop included, and with it every message
    of the endpoint. Here only this connection's writer waits; :meth:`send` never blocks, and
    refuses once more than ``CTL_WRITE_LIMIT`` bytes wait, so a dead or hostile peer costs only
    its own messages. A send error is recorded in :attr:`error`; the control loop drops the
    connection (it owns the selector).
    """

    def __init__(self, sock: socket.socket, rank: int | None, wake: Callable[[], None]) -> None:
        self.sock = sock
        self.rank = rank
        self.wlock = threading.Lock()  # serialises take-records-then-send in Endpoint._flush
        self.buf = bytearray()
        self.error: str | None = None
        self._wake = wake
        self._frames: deque[bytes] = deque()
        self._pending = 0
        self._writing = False  # the writer is sending a frame outside the lock
        self._closing = False
        self._cv = threading.Condition()
        self._writer = threading.Thread(target=self._write_loop, name=f"ctl-writer-{rank}", daemon=True)
        self._writer.start()

    def send(self, frame: bytes) -> bool:
        """Send ``frame``, or queue what the socket does not take at once; False when the peer
        has more than CTL_WRITE_LIMIT bytes unread (or the connection failed): it is not reading.

        With nothing queued the caller writes directly (non-blocking), so the common case costs
        no hand-over to the writer thread; order is kept because the writer is idle then."""
        with self._cv:
            if self._closing or self.error or self._pending + len(frame) > CTL_WRITE_LIMIT:
                return False
            if not self._frames and not self._writing:
                try:
                    sent = self.sock.send(frame, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError as exc:
                    self.error = f"control send failed: {exc}"
                    self._wake()
                    return False
                if sent == len(frame):
                    return True
                frame = frame[sent:]
            self._frames.append(frame)
            self._pending += len(frame)
            self._cv.notify()
        return True

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._frames and not self._closing:
                    self._cv.wait()
                if not self._frames:
                    return
                frame = self._frames.popleft()
                self._writing = True
            try:
                self.sock.sendall(frame)
            except OSError as exc:
                self.error = f"control send failed: {exc}"
                self._wake()
                return
            finally:
                with self._cv:
                    self._pending -= len(frame)
                    self._writing = False
                    self._cv.notify_all()

    def finish(self, timeout: float) -> None:
        """Let the writer send what is queued (for up to ``timeout`` s), then stop it."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._writer.join(timeout)


class Endpoint:
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
        self.reassembler = Reassembler(config.job_id)
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
        self._conns: dict[int, _Conn] = {}
        self._all_conns: list[_Conn] = []
        self._rate: dict[int, RateController] = {}
        self._pacer: dict[int, Pacer] = {}
        self._srtt: dict[int, float] = {}
        self._fb: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])  # received, CE, overflowed
        self._fb_sent_at: dict[int, float] = {}  # last feedback to each sender
        self._outbox: dict[int, list[bytes]] = defaultdict(list)  # control records waiting, per peer
        self._ob_lock = threading.Lock()
        self._deferring = threading.local()  # inside `with endpoint.batch()`
        self._host_pacer = Pacer(config.rate.burst_bytes)  # the host's own link, across destinations
        self._answer: dict[int, AnswerTimer] = {}  # sender side: how fast each destination answers a pass
        self._drain = DrainMeter()  # receiver side: what this endpoint drains while behind
        self._startup_drain = 0.0  # estimate before any measurement (set in start())
        self._drain_sent: dict[int, int] = {}  # last drain share (KB/s) told to each sender
        self._senders_seen: dict[int, float] = {}  # sender rank -> last data arrival
        self._delayed: list[tuple[float, bytes]] = []
        self.message_log: deque[MessageStats] = deque(maxlen=MESSAGE_LOG)
        """The figures of the last MESSAGE_LOG messages finished, both directions, with their
        monotonic times: what a report needs to say where an iteration's time went."""
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
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    # ------------------------------------------------------------------ connections
    def connect(self, ranks: list[int] | None = None, timeout: float | None = None) -> None:
        """Open control connections to ``ranks`` (default: every peer), retrying until ``timeout``.

        Raises:
            PeerUnreachable: a peer did not accept within the timeout (names rank and address).
        """
        ranks = [p.rank for p in self.config.peers if p.rank != self.rank] if ranks is None else ranks
        deadline = time.monotonic() + (self.config.connect_timeout if timeout is None else timeout)
        for rank in ranks:
            self._conn_to(rank, deadline)

    def _conn_to(self, rank: int, deadline: float | None = None) -> _Conn:
        with self._lock:
            conn = self._conns.get(rank)
        if conn is not None:
            return conn
        peer = self.config.peer(rank)
        deadline = time.monotonic() + self.config.connect_timeout if deadline is None else deadline
        last: OSError | None = None
        while time.monotonic() < deadline:
            if not self._running:
                raise TransportClosed(f"endpoint rank {self.rank} closed")
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, self.policy.dscp[self.policy.top_priority] << 2)
            s.settimeout(max(0.05, min(1.0, deadline - time.monotonic())))
            try:
                s.connect((peer.host, peer.control_port))
            except OSError as exc:
                s.close()
                last = exc
                time.sleep(0.05)
                continue
            s.settimeout(None)
            conn = _Conn(s, rank, self._wake)
            self.stats.ctl_frames_sent += 1
            hello = wire.pack_frame(wire.Header(ptype=wire.PacketType.FEEDBACK, job_id=self.config.job_id,
                                                message_id=_HELLO, sender_rank=self.rank),
                                    wire.FEEDBACK_BODY.pack(0, 0, 0, self._drain_share_kBps()))
            conn.send(hello)
            with self._lock:
                existing = self._conns.get(rank)
                if existing is None:
                    self._conns[rank] = conn
                self._all_conns.append(conn)
                self._sel.register(s, selectors.EVENT_READ, conn)
            self._wake()
            return existing or conn
        raise PeerUnreachable(f"rank {self.rank}: peer rank {rank} at {peer.host}:{peer.control_port} did not "
                              f"accept a control connection within the timeout ({last})")

    def _queue_ctl(self, rank: int, ptype: wire.PacketType, message_id: int, body: bytes = b"",
                   flags: wire.Flags = wire.Flags.NONE, **fields: int) -> None:
        """Queue a control record for ``rank``; it leaves with the next flush of that peer.

        Why queue: records of one moment (the STOPs of buckets that completed together, an
        iteration's METAs, a piggybacked FEEDBACK) then share one frame and one system call.
        The control thread flushes every peer at each tick (about 1 ms).
        """
        fields.setdefault("priority", self.policy.top_priority)
        record = wire.pack_record(wire.Header(ptype=ptype, job_id=self.config.job_id, message_id=message_id,
                                              sender_rank=self.rank, flags=flags, **fields), body)
        with self._ob_lock:
            self._outbox[rank].append(record)
        self.stats.ctl_records_sent[ptype.name] += 1

    def _flush(self, rank: int, connect: bool = True) -> None:
        """Send everything queued for ``rank`` as one frame (with a piggybacked FEEDBACK).

        Only application threads (``connect=True``) open a connection; the control thread uses
        the ones that exist, so a dead or slow peer never stalls it in ``connect``. Records for a
        peer without a connection wait (feedback is dropped, and at most ``_OUTBOX_LIMIT``
        others are kept).
        """
        with self._ob_lock:
            if not self._outbox.get(rank):
                return
            if not connect and rank not in self._conns:
                queued = [r for r in self._outbox[rank] if r[1] != wire.PacketType.FEEDBACK]
                self._outbox[rank] = queued[-_OUTBOX_LIMIT:]
                return
        try:
            conn = self._conn_to(rank)
        except TransportClosed:
            return  # closing: in-flight handles are failed by close()
        except TransportError as exc:
            with self._ob_lock:
                self._outbox.pop(rank, None)
            self._peer_failed(rank, str(exc))
            return
        with conn.wlock:
            with self._lock:
                fb = self._take_feedback(rank, time.monotonic(), force=True)
            with self._ob_lock:
                records = self._outbox.pop(rank, [])
            if fb is not None:
                records.append(fb)
            if not records:
                return
            frame = wire.pack_records(records, self.config.job_id, self.rank)
            sent = conn.send(frame)
            if sent:
                self.stats.ctl_frames_sent += 1
                self.stats.ctl_bytes_sent += len(frame)
        if not sent:
            why = conn.error or f"did not read its control connection ({CTL_WRITE_LIMIT >> 20} MB queued for it)"
            conn.error = conn.error or why  # the control loop closes it, which also ends its writer
            self._wake()
            self._peer_failed(rank, why)

    def _flush_all(self, connect: bool = True) -> None:
        with self._ob_lock:
            ranks = [r for r, recs in self._outbox.items() if recs]
        for rank in ranks:
            self._flush(rank, connect)

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
        meta = MessageMeta(job_id=self.config.job_id, message_id=message_id, sender_rank=self.rank,
                           iteration=iteration, tensor_id=tensor_id, layer=layer, priority=priority)
        tags: tuple[np.ndarray | None, np.ndarray | None] = (None, None)
        if layout is not None:
            if layout.total != np.asarray(data).size:
                raise ValueError(f"layout covers {layout.total} elements; the message has {np.asarray(data).size}")
            tags = layout.packet_tags(elems_per_packet(self.config.mtu, np.asarray(data).dtype))
        batch = packetize(data, meta, self.policy, self.config.mtu, packet_priorities=tags[0],
                          packet_layers=None if tags[1] is None else tags[1] % 65536)
        self._conn_to(dest)
        msg = OutMessage(dest, batch, priority, p, time.monotonic() + self.config.message_deadline, next(self._order),
                         announce)
        key = (dest, message_id)
        with self._lock:
            if not self._running:
                raise TransportClosed(f"endpoint rank {self.rank} is not running")
            if key in self._out:
                raise ValueError(f"message {message_id} to rank {dest} is already in flight")
            self._out[key] = msg  # before META: an empty message's STOP may come back at once
            self._rate.setdefault(dest, RateController(self.config.rate))
            self._pacer.setdefault(dest, Pacer(self.config.rate.burst_bytes))
        self._wake()  # the control loop ticks fast from now on
        if announce:
            self._queue_meta(dest, message_id, batch.payload.size, data.dtype, p, priority, iteration, tensor_id, layer)
        if len(batch) == 0:
            msg.pass_done_at = time.monotonic()  # nothing to send: the probe timer takes it from here
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
            asm = self.reassembler.expect(src, message_id, expect.total_elems, dtype, per, out=out)
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

    def _replay(self, datagrams: list[bytes]) -> None:
        """Ingest datagrams that were parked before their message was known."""
        slots = np.zeros((len(datagrams), max(len(d) for d in datagrams)), dtype=np.uint8)
        for i, d in enumerate(datagrams):
            slots[i, : len(d)] = np.frombuffer(d, np.uint8)
        self._ingest(slots, np.array([len(d) for d in datagrams]), np.zeros(len(datagrams), dtype=bool))

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
            "ce_marked": s.ce_marked, "rx_socket_overflows": s.rx_overflows, "rx_dropped_estimate": s.rx_dropped_estimate, "parked_early": s.parked, "late_after_completion": s.late, "send_errors": s.send_errors,
            "messages_sent": s.messages_sent, "messages_received": s.messages_received,
            "duplicate_pkts": self.reassembler.stats.duplicates,
            "ctl_frames_sent": s.ctl_frames_sent, "ctl_bytes_sent": s.ctl_bytes_sent,
            "ctl_frames_received": s.ctl_frames_received, "ctl_bytes_received": s.ctl_bytes_received,
            "ctl_records_sent": dict(s.ctl_records_sent), "ctl_records_received": dict(s.ctl_records_received),
            "probes_unknown": s.probes_unknown, "drain_bytes_per_s": self._drain.rate,
            "gso_calls": s.gso_calls, "gro_reads": s.gro_reads, "gro": self._gro,
            "gso_off": sorted({x.gso_off_reason for x in self._senders.values() if x.gso_off_reason} if self.config.offload else set()),
            "injected_drops_by_class": dict(s.injected_drops), "injected_delays": s.injected_delays,
            "reassembly": self.reassembler.stats.as_dict(),
            "rate_bytes_per_s": rates,
        }

    # ------------------------------------------------------------------ tx
    def _tx_sock(self, dest: int, priority: int) -> socket.socket:
        key = (dest, priority)
        sock = self._tx_socks.get(key)
        if sock is None:
            peer = self.config.peer(dest)
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.config.socket_buffer)
            dscp = self.policy.dscp[min(priority, self.policy.top_priority)]
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, (dscp << 2) | _ECT0)
            sock.connect((peer.host, peer.data_port))
            self._tx_socks[key] = sock
            self._senders[key] = DatagramSender(sock, use_gso=self.config.offload)
        return sock

    def _activate(self, msg: OutMessage) -> None:
        """(Re)queue a message for sending, keeping ``_active`` best first (lock held)."""
        if msg not in self._active:
            self._active.append(msg)
        self._reorder()
        self._tx_cv.notify()

    def _reorder(self) -> None:
        """Best first: the highest priority of a message's *next* packet (a fused message's
        priority falls as its urgent layers leave; retransmissions jump the line), then the
        oldest. Called only when some message's sending priority changed (lock held)."""
        self._active.sort(key=lambda m: (-m.sending_priority, m.order))

    def _pick(self, now: float) -> tuple[OutMessage | None, float]:
        """Best message whose destination may send now, else how long until one may (lock held)."""
        self._active = [m for m in self._active if m.has_packets()]
        wait = 1.0
        blocked: dict[int, float] = {}
        for m in self._active:
            if m.dest not in blocked:
                pkt_bytes = wire.HEADER_SIZE + m.batch.elems_per_packet * m.batch.payload.itemsize
                blocked[m.dest] = max(self._pacer[m.dest].wait_time(pkt_bytes, self._dest_rate(m.dest), now),
                                      self._host_pacer.wait_time(pkt_bytes, self.config.rate.line_rate, now))
            if blocked[m.dest] > 0:
                wait = min(wait, blocked[m.dest])
                continue
            return m, wait
        return None, wait

    def _dest_rate(self, dest: int) -> float:
        """Pacing rate towards ``dest``: its controller's, never above what the receiver said it can drain."""
        return self._rate[dest].effective_rate

    def _tx_loop(self) -> None:
        while True:
            with self._lock:
                while True:
                    if not self._running:
                        return
                    msg, wait = self._pick(time.monotonic())
                    if msg is not None:
                        break
                    self._tx_cv.wait(timeout=wait)
                dest = msg.dest
                rate = self._dest_rate(dest)
                pacer = self._pacer[dest]
                retx = msg.retx_pos < len(msg.retx)
                chunk = self._chunk(msg)
                before = msg.sending_priority
                if retx:
                    seqs = msg.retx[msg.retx_pos : msg.retx_pos + chunk]
                    msg.retx_pos += len(seqs)
                else:
                    seqs = msg.next_run(chunk)
                finished_pass = not msg.has_packets()
                if not finished_pass and msg.sending_priority != before:
                    self._reorder()
            if msg.announce and msg.next_seq == len(seqs) and not retx:
                self._flush(dest)  # its META may still be queued: let it lead the data
            sent = self._send_packets(msg, seqs, retx, pacer, rate, last=finished_pass)
            with self._lock:
                self.stats.data_pkts_sent += sent[0]
                self.stats.data_bytes_sent += sent[1]
                if retx:
                    msg.retransmissions += sent[0]
                    self.stats.retransmitted_pkts += sent[0]
                if finished_pass and not msg.stopped and not msg.awaiting_reply:
                    msg.pass_done_at = time.monotonic()  # the control timers probe after an RTT

    def _chunk(self, msg: OutMessage) -> int:
        """Packets sent per pick: the preemption granularity between priorities. With GSO a pick
        is one system call of up to 64 KB (a few tens of microseconds of a 10 Gb/s link);
        without it, 8 packets."""
        if not self.config.offload:
            return 8
        size = wire.HEADER_SIZE + msg.batch.elems_per_packet * msg.batch.payload.itemsize
        return max(8, min(64, 65507 // size))

    def _send_packets(self, msg: OutMessage, seqs: np.ndarray, retx: bool, pacer: Pacer, rate: float,
                      last: bool = False) -> tuple[int, int]:
        """Send ``seqs`` of ``msg`` (all of one priority; ascending unless ``retx``) in one paced burst.

        Full-size packets are laid out as rows of a staging buffer (headers and payload: one
        copy, no per-packet Python work) and leave by GSO, up to 64 KB per system call; the
        short last packet of a message, and everything where GSO is off, one by one. ``last``:
        this burst ends a pass, so its final packet carries ``Flags.LAST`` and the receiver
        answers at once, without waiting for a PROBE.
        """
        batch = msg.batch
        per = batch.elems_per_packet
        itemsize = batch.payload.itemsize
        width = wire.HEADER_SIZE + per * itemsize
        k = len(seqs)
        short_seq = len(batch) - 1 if batch.payload.size % per else -1
        if retx:
            hdr = batch.headers[seqs].copy()
            hdr["priority"] = self.policy.top_priority
            hdr["drop_class"] = 0
            hdr["flags"] = (hdr["flags"] & ~np.uint8(wire.Flags.LAST)) | int(wire.Flags.RETX)
            if last and k:
                hdr["flags"][-1] |= int(wire.Flags.LAST)
            hrows, hidx = hdr.view(np.uint8).reshape(k, wire.HEADER_SIZE), np.arange(k)
            priority = self.policy.top_priority
            contiguous = False
        else:
            hrows, hidx = msg.header_rows, seqs
            if last and k:
                batch.headers["flags"][seqs[-1]] |= int(wire.Flags.LAST)
                if short_seq >= 0 and int(seqs[-1]) != short_seq and (seqs == short_seq).any():
                    batch.headers["flags"][short_seq] |= int(wire.Flags.LAST)  # it leaves after the GSO run
            priority = int(batch.headers["priority"][seqs[0]]) if k else msg.priority
            contiguous = k > 0 and int(seqs[-1]) - int(seqs[0]) + 1 == k
        short_pos = -1
        if short_seq >= 0:
            if contiguous:
                short_pos = k - 1 if int(seqs[-1]) == short_seq else -1
            else:
                hits = np.flatnonzero(seqs == short_seq)
                short_pos = int(hits[0]) if len(hits) else -1
        n_full = k - (1 if short_pos >= 0 else 0)
        short_bytes = wire.HEADER_SIZE + (batch.payload.size % per) * itemsize if short_pos >= 0 else 0
        total = n_full * width + short_bytes
        self._tx_sock(msg.dest, priority)
        sender = self._senders[(msg.dest, priority)]
        now = time.monotonic()
        w = max(pacer.wait_time(total, rate, now), self._host_pacer.wait_time(total, self.config.rate.line_rate, now))
        if w > 0:
            time.sleep(w)
        calls0, errors0 = sender.syscalls, sender.errors
        n = nbytes = 0
        rest: list[int] = list(range(k)) if not (sender.gso and n_full > 1) else ([short_pos] if short_pos >= 0 else [])
        if sender.gso and n_full > 1:
            if self._stage is None or self._stage.shape[0] < n_full or self._stage.shape[1] != width:
                self._stage = np.empty((max(n_full, 64), width), dtype=np.uint8)
            stage = self._stage[:n_full]
            if contiguous:
                first = int(seqs[0])
                stage[:, : wire.HEADER_SIZE] = hrows[first : first + n_full]
                stage[:, wire.HEADER_SIZE :] = msg.payload_rows[first : first + n_full]
            else:
                keep = np.ones(k, dtype=bool)
                if short_pos >= 0:
                    keep[short_pos] = False
                stage[:, : wire.HEADER_SIZE] = hrows[hidx[keep]]
                stage[:, wire.HEADER_SIZE :] = msg.payload_rows[seqs[keep]]
            n, nbytes = sender.send_rows(stage)
        if rest:
            buffers = [(memoryview(hrows[int(hidx[i])]), batch.payload_of(int(seqs[i]))) for i in rest]
            sizes = np.array([wire.HEADER_SIZE + len(p) for _, p in buffers], dtype=np.int64)
            n2, b2 = sender.send(buffers, sizes)
            n, nbytes = n + n2, nbytes + b2
        self.stats.gso_calls += sender.syscalls - calls0 if sender.gso else 0
        if sender.errors != errors0:  # e.g. ICMP unreachable from a dead peer; its TCP loss tells
            self.stats.send_errors += sender.errors - errors0
            log.debug("data send to rank %d failed: %s", msg.dest, sender.last_error)
        pacer.consume(nbytes)
        self._host_pacer.consume(nbytes)
        return n, nbytes

    # ------------------------------------------------------------------ rx
    def _rx_loop(self) -> None:
        """Receive datagrams into the rows of a slot matrix and hand them over in batches.

        A row is exactly one full-size datagram wide, so a GRO read (many datagrams of that
        size back to back) lands in consecutive rows with no copy; a batch then holds up to
        ``rx_batch`` datagrams whatever mix of GRO and single reads brought them, and the
        per-batch cost of reassembly is shared by all of them.
        """
        cfg = self.config
        width = wire.HEADER_SIZE + elems_per_packet(cfg.mtu, np.float32) * 4  # a full datagram
        spare = -(-GRO_BUFSIZE // width) if self._gro else 1  # room for one whole GRO read
        slots = np.zeros((cfg.rx_batch + spare, width), dtype=np.uint8)
        flat = memoryview(slots.reshape(-1))
        lengths = np.zeros(cfg.rx_batch + spare, dtype=np.int64)
        ce = np.zeros(cfg.rx_batch + spare, dtype=bool)
        overflows = 0
        sock = self._udp
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        while self._running:
            # short polls only while injected-delay packets wait; otherwise an idle receiver
            # wakes 20 times a second (to see close()), not 200
            if not poller.poll(5 if self._delayed else 50):
                self._release_delayed()
                continue
            t_batch = time.monotonic()
            k = 0
            nbytes_batch = 0
            emptied = False  # the socket ran dry: this receiver keeps up
            per_read = 1.0  # datagrams per read in this batch (GRO reads hold many)
            while k < cfg.rx_batch:
                try:
                    nbytes, ancdata, _flags, _addr = sock.recvmsg_into([flat[k * width :]], GRO_ANCBUF)
                except (BlockingIOError, InterruptedError):
                    emptied = True
                    break
                except OSError as exc:
                    if self._running:
                        log.warning("rank %d: data socket error: %s", self.rank, exc)
                    break
                tos = 0
                for level, kind, value in ancdata:
                    if level == socket.IPPROTO_IP:
                        tos = value[0]
                    elif kind == SO_RXQ_OVFL and len(value) >= 4:
                        overflows = int.from_bytes(value[:4], "little")
                seg = gro_segment_size(ancdata) if self._gro else None
                if seg is None or nbytes <= seg:
                    lengths[k] = nbytes  # one datagram (longer than a row: rejected as truncated)
                    m = 1
                elif seg == width:  # GRO read of full-size datagrams: already in their rows
                    m = -(-nbytes // seg)
                    lengths[k : k + m] = seg
                    lengths[k + m - 1] = nbytes - (m - 1) * seg
                    self.stats.gro_reads += 1
                else:  # GRO of another size (another MTU): copy the datagrams into rows
                    rows, row_lengths = split_segments(slots.reshape(-1)[k * width : k * width + nbytes].copy(),
                                                       nbytes, seg)
                    m = min(len(row_lengths), len(lengths) - k)
                    cut = min(rows.shape[1], width)
                    slots[k : k + m] = 0
                    slots[k : k + m, :cut] = rows[:m, :cut]
                    lengths[k : k + m] = np.where(row_lengths[:m] > width, width + 1, row_lengths[:m])
                    self.stats.gro_reads += 1
                ce[k : k + m] = (tos & 0b11) == _CE
                per_read = max(per_read, float(m))
                k += m
                nbytes_batch += nbytes
            if overflows != self.stats.rx_overflows:
                # SO_RXQ_OVFL counts dropped socket-buffer entries; with GRO one entry holds a
                # whole read's worth of datagrams, so scale by what a read held in this batch.
                dropped = round((overflows - self.stats.rx_overflows) * per_read)
                self._on_overflow(dropped, slots[:k], lengths[:k])
                self.stats.rx_overflows = overflows
                self.stats.rx_dropped_estimate += dropped
            if k:
                self._on_datagrams(slots[:k], lengths[:k], ce[:k])
            self._drain.batch(t_batch, nbytes_batch, emptied, time.monotonic())
            self._release_delayed()

    def _on_overflow(self, dropped: int, slots: np.ndarray, lengths: np.ndarray) -> None:
        """The kernel dropped datagrams: blame the senders of this batch in proportion."""
        ok = lengths >= wire.HEADER_SIZE
        senders = slots[ok, 6:8].view(">u2").reshape(-1)  # sender_rank sits at byte 6
        if not senders.size:
            return
        ranks, counts = np.unique(senders, return_counts=True)
        known = {p.rank for p in self.config.peers} - {self.rank}  # never a rank that does not exist, nor self
        with self._lock:
            for rank, c in zip(ranks.tolist(), counts.tolist()):
                if rank in known:
                    self._fb[rank][2] += max(1, round(dropped * c / senders.size))

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
        self._ingest(slots, np.array([len(d) for d in due]), np.zeros(len(due), dtype=bool))

    def _on_datagrams(self, slots: np.ndarray, lengths: np.ndarray, ce: np.ndarray) -> None:
        loss = self.config.loss
        if loss.enabled:
            n = len(lengths)
            ok_len = lengths >= wire.HEADER_SIZE
            hdr = slots[:, : wire.HEADER_SIZE].view(wire.HEADER_DTYPE).reshape(n)
            keep = np.ones(n, dtype=bool)
            if any(loss.drop_probabilities):
                keep = drop_by_class(hdr["drop_class"], loss.drop_probabilities, self._rng) | ~ok_len
                for cls in hdr["drop_class"][~keep].tolist():
                    self.stats.injected_drops[cls] += 1
            if loss.delay > 0 and loss.delay_probability > 0:
                delay = keep & (self._rng.random(n) < loss.delay_probability)
                release = time.monotonic() + loss.delay
                for i in np.flatnonzero(delay).tolist():
                    self._delayed.append((release, slots[i, : lengths[i]].tobytes()))
                self.stats.injected_delays += int(delay.sum())
                keep &= ~delay
            idx = np.flatnonzero(keep)
            if loss.reorder:
                idx = self._rng.permutation(idx)
            if len(idx) < n or loss.reorder:
                slots, lengths, ce = slots[idx], lengths[idx], ce[idx]
        if len(lengths):
            self._ingest(slots, lengths, ce)

    def _ingest(self, slots: np.ndarray, lengths: np.ndarray, ce: np.ndarray) -> None:
        now = time.monotonic()
        n = len(lengths)
        hdr = slots[:, : wire.HEADER_SIZE].view(wire.HEADER_DTYPE).reshape(n) if slots.shape[1] >= wire.HEADER_SIZE else None
        finished: list[tuple[InMessage, str]] = []
        with self._lock:
            late_before = self.stats.late
            res = self.reassembler.ingest_batch(slots, lengths, park=lambda rows: self._park(slots, lengths, hdr, rows, now))
            self.stats.data_pkts_received += n
            self.stats.data_bytes_received += int(lengths.sum())
            self.stats.ce_marked += int(ce.sum())
            self.stats.parked += res.parked - (self.stats.late - late_before)
            if hdr is not None:
                good = res.reasons == 0
                senders = hdr["sender_rank"][good]
                marks = ce[good]
                for rank in np.unique(senders).tolist():
                    self._senders_seen[rank] = now
                    sel = senders == rank
                    fb = self._fb[rank]
                    fb[0] += int(sel.sum())
                    fb[1] += int(marks[sel].sum())
                if res.touched:
                    retx_by_key: dict[tuple[int, int], int] = {}
                    lmask = good & ((hdr["flags"] & int(wire.Flags.LAST)) != 0)
                    last_keys = set(zip(hdr["sender_rank"][lmask].tolist(), hdr["message_id"][lmask].tolist()))
                    rmask = good & ((hdr["flags"] & int(wire.Flags.RETX)) != 0)
                    if rmask.any():
                        for s_, m_ in zip(hdr["sender_rank"][rmask].tolist(), hdr["message_id"][rmask].tolist()):
                            retx_by_key[(s_, m_)] = retx_by_key.get((s_, m_), 0) + 1
                    for asm in res.touched:
                        msg = self._in.get(asm.key)
                        if msg is None:
                            continue
                        n_retx = retx_by_key.get(asm.key, 0)
                        msg.last_arrival = now
                        if msg.first_arrival is None:
                            msg.first_arrival = now
                        if asm.key in last_keys:  # the sender's pass ended: answer as to a PROBE
                            msg.probe_pending = True
                        if n_retx and msg.bitmap_sent_at is not None:
                            sample = now - msg.bitmap_sent_at
                            old = self._srtt.get(msg.src)
                            self._srtt[msg.src] = sample if old is None else 0.875 * old + 0.125 * sample
                            msg.bitmap_sent_at = None
                        msg.retx_seen += n_retx
                        if asm.is_exact():
                            finished.append((msg, "exact"))
                        elif msg.retx_seen and asm.is_complete(msg.loss_bound):
                            finished.append((msg, "bounded"))  # recovery reached the bound: stop now
            for msg, how in finished:
                self._complete_locked(msg, how)
        for msg, _ in finished:
            self._send_stop(msg)

    def _park(self, slots: np.ndarray, lengths: np.ndarray, hdr: np.ndarray, rows: np.ndarray, now: float) -> np.ndarray:
        """Keep early data of known peers until its META arrives (at most ``park_limit`` per
        sender, so one sender's junk cannot crowd out another's real early packets)."""
        kept = np.zeros(len(rows), dtype=bool)
        known = {p.rank for p in self.config.peers}
        for i, r in enumerate(rows.tolist()):
            key = (int(hdr["sender_rank"][r]), int(hdr["message_id"][r]))
            if key in self._recent_done:  # a straggler of a finished message: not malformed
                self.stats.late += 1
                kept[i] = True
                continue
            if key[0] not in known or key[0] == self.rank or self._parked_count[key[0]] >= self.config.park_limit:
                continue
            self._parked.setdefault(key, []).append((now, slots[r, : lengths[r]].tobytes()))
            self._parked_count[key[0]] += 1
            kept[i] = True
        return kept

    # ------------------------------------------------------------------ completion
    def _complete_locked(self, msg: InMessage, how: str) -> None:
        """Finish a received message (lock held): resolve or store its result, forget the assembly."""
        key = (msg.src, msg.message_id)
        if self._in.get(key) is not msg:
            return
        del self._in[key]
        self.reassembler.forget(*key)
        result = msg.finish(how)
        self.stats.messages_received += 1
        self.message_log.append(result.stats)
        self._remember_done(key, msg.assembly.received_elems)
        h = msg.handle
        if h is not None:
            if h.out is not None and h.out is not result.data:
                if h.out.shape == result.data.shape and h.out.dtype == result.data.dtype:
                    h.out[:] = result.data
                    result = dataclasses.replace(result, data=h.out)
                else:
                    h._fail(ValueError(f"message {msg.message_id} from rank {msg.src} has {result.data.size} "
                                       f"{result.data.dtype}; out is {h.out.shape} {h.out.dtype}"))
                    return
            h._resolve(result)
        else:
            self._done_in[key] = result
        log.debug("rank %d: message %d from %d complete (%s), lost %.4f", self.rank, msg.message_id, msg.src, how,
                  result.stats.lost_fraction)

    def _remember_done(self, key: tuple[int, int], held: int) -> None:
        """Remember finished messages for a while: late packets of one must not be parked as
        if it were still to come, and a repeated PROBE is answered with what was held."""
        self._recent_done[key] = held
        while len(self._recent_done) > 4096:
            self._recent_done.popitem(last=False)
        self._parked_count[key[0]] -= len(self._parked.pop(key, []))

    def _send_stop(self, msg: InMessage) -> None:
        """Queue the STOP of a finished message; it leaves with the next control tick (STOPs of
        messages finishing together share a frame)."""
        asm = msg.assembly
        body = wire.STOP_BODY.pack(asm.received_elems) + (b"" if asm.is_exact() else asm.missing_bitmap())
        self._queue_ctl(msg.src, wire.PacketType.STOP, msg.message_id, body)

    # ------------------------------------------------------------------ control
    def _ctl_loop(self) -> None:
        next_timer = 0.0
        while self._running:
            # timers tick every millisecond while messages are in flight; an idle endpoint ticks
            # every IDLE_TICK (deadlines, parked packets, clean reports), and send() / recv()
            # wake it, so idle agents do not spin a core on a 2-core testbed
            tick = 0.001 if (self._in or self._out or self._waiting) else IDLE_TICK
            next_timer = min(next_timer, time.monotonic() + tick)  # idle -> busy: tick fast at once
            timeout = max(0.0, next_timer - time.monotonic())
            try:
                events = self._sel.select(timeout)
            except (OSError, ValueError):
                if not self._running:
                    return
                raise
            for key, _ in events:
                if key.data == "wake":
                    try:
                        self._wake_r.recv(4096)
                    except OSError:
                        pass
                    next_timer = 0.0  # new work: run the timers now, not at the end of an idle tick
                elif key.data is None:
                    self._accept()
                else:
                    self._read(key.data)
            for conn in [c for c in self._all_conns if c.error]:
                self._drop_conn(conn, conn.error)
            now = time.monotonic()
            if now >= next_timer:
                try:
                    self._timers(now)
                except Exception:  # the control thread must outlive any one bad state
                    log.exception("rank %d: control timers failed", self.rank)
                next_timer = now + (0.001 if (self._in or self._out or self._waiting) else IDLE_TICK)
            self._flush_all(connect=False)

    def _accept(self) -> None:
        try:
            s, _ = self._listener.accept()
        except OSError:
            return
        s.setblocking(True)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(s, None, self._wake)
        with self._lock:
            self._all_conns.append(conn)
        self._sel.register(s, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            self._drop_conn(conn, "closed the control connection")
            return
        conn.buf += chunk
        while len(conn.buf) >= wire.FRAME_PREFIX.size:
            (size,) = wire.FRAME_PREFIX.unpack_from(conn.buf)
            if not wire.HEADER_SIZE <= size <= wire.MAX_FRAME:
                self._drop_conn(conn, f"sent a control frame of {size} bytes")
                return
            if len(conn.buf) < wire.FRAME_PREFIX.size + size:
                break
            frame = bytes(conn.buf[wire.FRAME_PREFIX.size : wire.FRAME_PREFIX.size + size])
            del conn.buf[: wire.FRAME_PREFIX.size + size]
            self.stats.ctl_frames_received += 1
            self.stats.ctl_bytes_received += wire.FRAME_PREFIX.size + size
            try:
                records = [wire.split_frame(frame)]
                if records[0][0].ptype == wire.PacketType.BATCH:
                    records = [wire.split_frame(r) for r in wire.split_batch(records[0][1])]
                for header, _ in records:
                    if header.ptype == wire.PacketType.BATCH:
                        raise wire.MalformedHeader("bad_batch", "a BATCH inside a BATCH")
                    if header.job_id != self.config.job_id:
                        raise wire.MalformedHeader("wrong_job", f"job {header.job_id}")
                    self.config.peer(header.sender_rank)
                    if header.sender_rank != records[0][0].sender_rank or (
                            conn.rank is not None and header.sender_rank != conn.rank):
                        raise wire.MalformedHeader("wrong_sender", f"rank {header.sender_rank} on the connection "
                                                   f"of rank {conn.rank}")
            except ValueError as exc:
                self._drop_conn(conn, f"sent a malformed control frame ({exc})")
                return
            if conn.rank is None:
                conn.rank = records[0][0].sender_rank
                with self._lock:
                    self._conns.setdefault(conn.rank, conn)
            for header, body in records:
                self.stats.ctl_records_received[header.ptype.name] += 1
                try:
                    self._on_frame(header, body)
                except Exception:  # a bad frame must not kill the control thread
                    log.exception("rank %d: error handling %s from rank %d", self.rank, header.ptype.name,
                                  header.sender_rank)

    def _drop_conn(self, conn: _Conn, why: str) -> None:
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.finish(timeout=0)  # its writer stops; the close below ends a send in progress
        conn.sock.close()
        with self._lock:
            if conn in self._all_conns:
                self._all_conns.remove(conn)
            primary = conn.rank is not None and self._conns.get(conn.rank) is conn
            if primary:
                del self._conns[conn.rank]
        # Only the connection the endpoint uses for a rank speaks for it: another one that
        # merely claimed the rank (a stale duplicate, or a stranger's) closing must not fail
        # the real peer's messages. (Authenticating connections is the full answer.)
        if primary and self._running:
            self._peer_failed(conn.rank, why)
        elif conn.rank is not None:
            log.info("rank %d: a second control connection claiming rank %d %s", self.rank, conn.rank, why)

    def _peer_failed(self, rank: int, why: str) -> None:
        peer = self.config.peer(rank)
        with self._lock:
            in_flight = any(k[0] == rank for k in [*self._out, *self._in, *self._waiting])
            for key in [k for k in self._out if k[0] == rank]:
                m = self._out.pop(key)
                m.handle._fail(PeerFailed(f"rank {self.rank}: peer rank {rank} ({peer.host}:{peer.control_port}) "
                                          f"{why} while sending message {key[1]}"))
            for key in [k for k in self._in if k[0] == rank]:
                m = self._in.pop(key)
                self.reassembler.forget(*key)
                if m.handle:
                    m.handle._fail(PeerFailed(f"rank {self.rank}: peer rank {rank} ({peer.host}:{peer.control_port}) "
                                              f"{why} while receiving message {key[1]}"))
            for key in [k for k in self._waiting if k[0] == rank]:
                self._waiting.pop(key)._fail(PeerFailed(
                    f"rank {self.rank}: peer rank {rank} ({peer.host}:{peer.control_port}) {why} before "
                    f"announcing message {key[1]}"))
            self._conns.pop(rank, None)
        (log.warning if in_flight else log.info)("rank %d: peer rank %d %s", self.rank, rank, why)

    def _on_frame(self, h: wire.Header, body: bytes) -> None:
        t = h.ptype
        src = h.sender_rank
        if t == wire.PacketType.META:
            self._on_meta(h, body)
        elif t == wire.PacketType.PROBE:
            with self._lock:
                msg = self._in.get((src, h.message_id))
                if msg is not None:
                    msg.probe_pending = True
                    msg.probes += 1
                    return
                held = self._recent_done.get((src, h.message_id))
            if held is None:
                # Not known (yet): a receiver that posts its recv later (expect=) will know it;
                # the sender probes again after its timeout, and its deadline bounds the wait.
                self.stats.probes_unknown += 1
                return
            self._queue_ctl(src, wire.PacketType.STOP, h.message_id, wire.STOP_BODY.pack(held))
        elif t == wire.PacketType.STOP:
            (held,) = wire.STOP_BODY.unpack_from(body)
            with self._lock:
                msg = self._out.pop((src, h.message_id), None)
                if msg is None:
                    return
                msg.stopped = True
                self._rtt_sample(src, msg, time.monotonic())
                total = msg.batch.payload.size
                lost = 0.0 if total == 0 else 1.0 - held / total
                self.stats.messages_sent += 1
            stats = msg.stats("stopped", lost)
            self.message_log.append(stats)
            if len(body) > wire.STOP_BODY.size:
                bits = np.unpackbits(np.frombuffer(body, np.uint8, offset=wire.STOP_BODY.size))[: len(msg.batch)]
                stats.lost_packets = np.flatnonzero(bits)
            msg.handle._resolve(stats)
        elif t == wire.PacketType.BITMAP:
            (held,) = wire.BITMAP_PREFIX.unpack_from(body)
            bits = np.unpackbits(np.frombuffer(body, np.uint8, offset=wire.BITMAP_PREFIX.size))
            with self._lock:
                msg = self._out.get((src, h.message_id))
                if msg is None:
                    return
                self._rtt_sample(src, msg, time.monotonic())
                n = len(msg.batch)
                missing = np.flatnonzero(bits[:n])
                hdrs = msg.batch.headers
                seqs = retransmission_set(missing, hdrs["drop_class"], hdrs["elem_count"], held,
                                          msg.batch.payload.size, msg.loss_bound)
                new_lost = max(0, len(missing) - msg.reported_missing)
                msg.reported_missing = len(missing)
                if new_lost:
                    self._rate[src].on_feedback(n - len(missing), 0, new_lost)
                msg.retx = seqs.astype(np.int64)
                msg.retx_pos = 0
                if len(seqs) and msg.first_retx_at is None:
                    msg.first_retx_at = time.monotonic()
                msg.awaiting_reply = False
                msg.probe_sent_at = None
                if len(seqs):
                    msg.pass_done_at = None
                    self._activate(msg)
                else:  # nothing needed (the receiver's count moved on): probe again right away
                    msg.pass_done_at = 0.0
        elif t == wire.PacketType.FEEDBACK:
            received, marked, lost, share_kBps = wire.FEEDBACK_BODY.unpack_from(body)
            if h.message_id == _HELLO:
                # A peer that just connected: tell it at once what we can drain, so its first
                # data already goes no faster than that.
                self._queue_ctl(src, wire.PacketType.FEEDBACK, _HELLO_REPLY,
                                wire.FEEDBACK_BODY.pack(0, 0, 0, self._drain_share_kBps(new_sender=True)))
            with self._lock:
                rc = self._rate.setdefault(src, RateController(self.config.rate))
                self._pacer.setdefault(src, Pacer(self.config.rate.burst_bytes))
                rc.on_ceiling(share_kBps * 1000.0)
                if received or lost:
                    rc.on_feedback(received, marked, lost, time.monotonic())

    def _on_meta(self, h: wire.Header, body: bytes) -> None:
        total, per, p = wire.META_BODY.unpack_from(body)
        src, key = h.sender_rank, (h.sender_rank, h.message_id)
        replay: list[bytes] = []
        with self._lock:
            if key in self._in:
                log.warning("rank %d: duplicate META for message %d from rank %d ignored", self.rank, h.message_id, src)
                return
            handle = self._waiting.pop(key, None)
            out = handle.out if handle is not None else None
            dtype = wire.NUMPY_DTYPES[h.dtype].newbyteorder("=")
            if out is not None and (out.shape != (total,) or out.dtype != dtype):
                handle._fail(ValueError(f"message {h.message_id} from rank {src} has {total} {dtype}; "
                                        f"out is {out.shape} {out.dtype}"))
                handle, out = None, None
            try:
                asm = self.reassembler.expect(src, h.message_id, total, dtype, per, out=out)
            except ValueError as exc:
                if handle:
                    handle._fail(exc)
                log.warning("rank %d: bad META from rank %d: %s", self.rank, src, exc)
                return
            asm.pkt_priority[:] = h.priority
            msg = InMessage(src, asm, p, time.monotonic() + self.config.message_deadline, handle, h.priority)
            self._in[key] = msg
            if handle is None and self._announcements is not None:
                self._announcements.put(key)
            self._recent_done.pop(key, None)
            for _, d in self._parked.pop(key, []):
                replay.append(d)
            self._parked_count[src] -= len(replay)
            if total == 0:
                self._complete_locked(msg, "exact")
        if total == 0:
            self._send_stop(msg)
            return
        if replay:
            self._replay(replay)

    def _timers(self, now: float) -> None:
        """Probe answers, idle completion, probes and deadlines, feedback, parked-packet expiry.

        Everything it decides is queued as records; the control loop flushes them after.
        """
        stops: list[InMessage] = []
        with self._lock:
            for msg in list(self._in.values()):
                asm = msg.assembly
                idle = now - msg.last_arrival
                if now > msg.deadline:
                    del self._in[(msg.src, msg.message_id)]
                    self.reassembler.forget(msg.src, msg.message_id)
                    if msg.handle:
                        msg.handle._fail(TransportTimeout(
                            f"rank {self.rank}: message {msg.message_id} from rank {msg.src} missed its "
                            f"{self.config.message_deadline:g} s deadline with {asm.received_fraction:.1%} received"))
                    continue
                if msg.probe_pending and idle >= self.config.probe_grace and not self._rx_backlog():
                    msg.probe_pending = False
                    if asm.is_complete(msg.loss_bound):
                        self._complete_locked(msg, "exact" if asm.is_exact() else "bounded")
                        stops.append(msg)
                    else:
                        self._queue_ctl(msg.src, wire.PacketType.BITMAP, msg.message_id,
                                        wire.BITMAP_PREFIX.pack(asm.received_elems) + asm.missing_bitmap())
                        msg.bitmap_sent_at = now
                        if msg.first_bitmap_at is None:
                            msg.first_bitmap_at = now
                elif idle >= max(self.config.idle_timeout, 8 * self._srtt.get(msg.src, 0.0)) and \
                        asm.received_pkts and asm.is_complete(msg.loss_bound):
                    self._complete_locked(msg, "idle")
                    stops.append(msg)
            for key, m in list(self._out.items()):
                if now > m.deadline:
                    del self._out[key]
                    peer = self.config.peer(m.dest)
                    m.handle._fail(TransportTimeout(
                        f"rank {self.rank}: message {m.message_id} to rank {m.dest} ({peer.host}:{peer.data_port}) "
                        f"missed its {self.config.message_deadline:g} s deadline ({m.next_seq}/{len(m.batch)} "
                        f"packets sent, {m.probes} probes, {m.retransmissions} retransmitted)"))
                    continue
                if m.stopped or m.has_packets():
                    continue
                if not m.awaiting_reply:
                    # The pass is over; a STOP usually arrives within a round trip, so a PROBE
                    # before then would be a wasted record.
                    if m.pass_done_at is not None and now >= m.pass_done_at + self._answer_timer(m.dest).probe_delay():
                        m.awaiting_reply = True
                        m.probe_sent_at = now
                        m.probes += 1
                        self._queue_ctl(m.dest, wire.PacketType.PROBE, m.message_id)
                elif m.probe_sent_at is not None and now >= m.probe_sent_at + self._answer_timer(m.dest).reprobe_timeout():
                    # no answer (the receiver did not know the message yet): ask again
                    m.probe_sent_at = now
                    m.probes += 1
                    self._queue_ctl(m.dest, wire.PacketType.PROBE, m.message_id)
            for rank in list(self._fb):
                rec = self._take_feedback(rank, now, force=False)
                if rec is not None:
                    with self._ob_lock:
                        self._outbox[rank].append(rec)
            if self._parked:
                for key in [k for k, v in self._parked.items() if now - v[0][0] > self.config.message_deadline]:
                    self._parked_count[key[0]] -= len(self._parked.pop(key))
        for msg in stops:
            self._send_stop(msg)

    # ------------------------------------------------------------------ timing and feedback
    def _rtt_sample(self, dest: int, msg: OutMessage, now: float) -> None:
        """Sender side: time from the end of a pass (or from a probe) to the receiver's answer
        (lock held). It includes the receiver's scheduling and control tick, which is what a
        probe has to wait for."""
        since = msg.probe_sent_at if msg.probe_sent_at is not None else msg.pass_done_at
        if since is None or since <= 0:
            return
        self._answer_timer(dest).sample(now - since)

    def _answer_timer(self, dest: int) -> AnswerTimer:
        timer = self._answer.get(dest)
        if timer is None:
            cfg = self.config
            timer = self._answer[dest] = AnswerTimer(cfg.probe_delay, cfg.probe_delay_min, cfg.probe_delay_max)
        return timer

    def _rx_backlog(self) -> bool:
        """Datagrams still wait in the data socket: the receiver is behind, so a bitmap now would
        list packets that have arrived but are not read yet."""
        try:
            return struct.unpack("i", fcntl.ioctl(self._udp, termios.FIONREAD, b"\0\0\0\0"))[0] > 0
        except (OSError, ValueError):
            return False

    def _take_feedback(self, rank: int, now: float, force: bool) -> bytes | None:
        """A FEEDBACK record for sender ``rank`` if one is due (lock held), resetting its counters.

        Congestion (CE marks, socket overruns) is reported every ``feedback_interval``; a clean
        report waits ``bulk_feedback_interval`` once ``bulk_feedback_packets`` arrived (a long
        transfer, whose sender grows its rate on these reports), else
        ``clean_feedback_interval``, unless ``force`` (another record is leaving for that peer
        anyway, so it rides along for free).
        """
        counts = self._fb.get(rank)
        if counts is None or not (counts[0] or counts[2]):
            return None
        rcv, marked, lost = counts
        since = now - self._fb_sent_at.get(rank, 0.0)
        share = self._drain_share_kBps(now)
        last = self._drain_sent.get(rank, 0)
        # a new or much lower drain share is as urgent as congestion: the sender must slow down
        congested = marked or lost or (share and (not last or share < 0.8 * last))
        if congested:
            due = self.config.feedback_interval
        elif rcv >= self.config.bulk_feedback_packets:  # a bulk transfer: the sender's increase needs the reports
            due = self.config.bulk_feedback_interval
        else:
            due = self.config.clean_feedback_interval
        if not force and since < due:
            return None
        del self._fb[rank]
        self._fb_sent_at[rank] = now
        self._drain_sent[rank] = share
        self.stats.ctl_records_sent["FEEDBACK"] += 1
        flags = wire.Flags.ECN_ECHO if marked else wire.Flags.NONE
        return wire.pack_record(wire.Header(ptype=wire.PacketType.FEEDBACK, job_id=self.config.job_id, message_id=0,
                                            sender_rank=self.rank, flags=flags, priority=self.policy.top_priority),
                                wire.FEEDBACK_BODY.pack(rcv, marked, lost, share))

    def _drain_share_kBps(self, now: float | None = None, new_sender: bool = False) -> int:
        """The drain ceiling for each current sender, KB/s, as FEEDBACK carries it (0 = none):
        the measured drain shared among the senders seen in the last 50 ms; for a
        ``new_sender`` before anything was measured, the start-up estimate shared among every
        peer connected so far (peers of a collective connect together, then all send at once)."""
        now = time.monotonic() if now is None else now
        active = sum(1 for t in list(self._senders_seen.values()) if now - t < 0.05)
        if new_sender:
            active = max(active, len(self._conns) - 1)  # the new one is counted by drain_share
        share = drain_share(self._drain.current(now), self._startup_drain, active, new_sender)
        return 0 if share <= 0 else max(1, min(wire.FIELD_MAX["job_id"], int(share / 1000)))

    def _calibrate_drain(self) -> float:
        """Bytes/s this host's reassembly takes, timed on a synthetic batch at start (about a
        millisecond): a start-up ceiling for senders, until the drain is measured under load.
        Half of it is offered, as the system calls and other threads cost the rest."""
        from hostagent.packetizer import MessageMeta

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


__all__ = ["Endpoint", "EndpointStats", "LossInjection", "MessageStats", "Peer", "PeerFailed", "PeerUnreachable",
           "RecvHandle", "RecvResult", "SendHandle", "TransportClosed", "TransportConfig", "TransportError",
           "TransportTimeout", "local_peers", "reserve_ports", "REASONS"]
