"""The bounded-loss gradient transport: one :class:`Endpoint` per process.

An endpoint has a UDP socket for DLCP data packets and a TCP control connection to each peer for
META, PROBE, BITMAP, STOP and FEEDBACK records; records bound for one peer at one moment travel
together in one frame (BATCH). Three parts, each in its own module:

* the **protocol core** (:mod:`dlcp.hostagent.protocol`): every message's state (deadlines, probes,
  bitmaps, feedback, rate decisions) as a state machine that takes the time and what arrived;
* the **data path** (:mod:`dlcp.hostagent.datapath`): everything per packet, compiled by default,
  with threads outside the interpreter lock: sending by priority and pace (GSO), receiving
  (GRO), validating every field and the token, placing payloads by offset, bitmaps, parking;
* the **control thread** (:mod:`dlcp.hostagent.control_path`): the handshake, control frames, the
  data path's events and the core's timers.

This module holds the public API and the lifecycle. The protocol for one message is described
in :mod:`dlcp.hostagent.protocol.core`. Every control connection opens with the handshake of
:mod:`dlcp.hostagent.auth`; every data packet carries its message's token, which the receiver checks
before anything else, so neither a frame nor a datagram from outside the job reaches a message.

Every finished message's figures, with monotonic times, stay in :attr:`Endpoint.message_log`
(the testbed's time breakdown reads them), and every change of a destination's sending rate in
:attr:`Endpoint.rate_log`. Every wait has a deadline; a peer whose control connection drops
fails every message to or from it with :class:`~dlcp.hostagent.messages.PeerFailed`, naming the peer
and the message.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import queue
import selectors
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import numpy as np

from dlcp.hostagent import wire
from dlcp.hostagent.control_conn import CTL_WRITE_LIMIT, ControlConn
from dlcp.hostagent.control_path import ControlPath
from dlcp.hostagent.datapath import open_datapath
from dlcp.hostagent.fusion import Layout
from dlcp.hostagent.messages import (Expect, MessageMismatch, MessageStats, PeerFailed, PeerUnreachable, RateChange,
                                     RecvHandle, RecvResult, SendHandle, TransportClosed, TransportError,
                                     TransportTimeout)
from dlcp.hostagent.protocol.core import IDLE_TICK, ProtocolCore
from dlcp.hostagent.protocol.port import REASONS
from dlcp.hostagent.transport_config import EndpointStats, LossInjection, Peer, TransportConfig, local_peers
from dlcp.hostagent.udp_offload import enable_arrival_stamps, enable_gro

log = logging.getLogger(__name__)

#: SO_RXQ_OVFL: a received datagram carries the socket's count of datagrams dropped for want of buffer.
SO_RXQ_OVFL = getattr(socket, "SO_RXQ_OVFL", 40)
#: SO_RCVBUFFORCE: a receive buffer above net.core.rmem_max, for a process with CAP_NET_ADMIN.
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)


class Endpoint(ControlPath):
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
        self._lock = threading.RLock()  # the core and the connection maps
        self._running = False
        self._closed = False
        self._failure: str | None = None
        self.core: ProtocolCore | None = None
        self.dp: Any = None
        self._conns: dict[int, ControlConn] = {}  # rank -> the authenticated connection used for it
        self._all_conns: list[ControlConn] = []
        self._dialing: dict[int, ControlConn] = {}  # rank -> connection an application thread is opening
        self._key_nonces: dict[int, bytes] = {}  # rank -> our key nonce for it (dlcp.hostagent.auth)
        self._allowed_ips: dict[int, set[str]] = {}  # rank -> addresses it may connect from
        self.ctl_stats: Counter = Counter()
        self.ctl_records_received: Counter = Counter()
        self.ctl_rejected: Counter = Counter()
        """Control connections refused or dropped, by reason (wrong_address, bad_proof, ...)."""
        self._deferring = threading.local()  # inside `with endpoint.batch()`
        self._threads: list[threading.Thread] = []
        self._udp: socket.socket | None = None
        self._listener: socket.socket | None = None
        self._sel: selectors.BaseSelector | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)  # a full wake pipe already holds a wake: never block on it
        self._wake_pending = False
        self._timers_at = float("inf")  # when the control loop runs its timers next (it sets this)
        self._close_lock = threading.Lock()
        self.unknown_probe_callbacks: list[Callable[[int, int, int], None]] = []
        """Called as ``fn(rank, message_id, iteration)`` on the control thread for each PROBE of a
        message not posted here (a peer ahead, or in a use this endpoint's user never makes):
        keep it short. The ``torch.distributed`` backend tells ranks in different collectives by it."""
        self.peer_lost_callbacks: list[Callable[[int, str], None]] = []
        """Called as ``fn(rank, why)`` on the control thread when no control connection with a
        peer remains (it closed or failed): keep it short. The ``torch.distributed`` backend
        fails its group at once, as gloo does when a peer's socket closes."""
        log.info("endpoint rank %d config: %s", self.rank, config)
        if not config.authenticate:
            log.warning("endpoint rank %d: authenticate=False: no datagram or control frame is checked; any host "
                        "that reaches this endpoint's ports can write into its messages (for measurements only)",
                        self.rank)
        elif config.secret is None:
            log.info("endpoint rank %d: no job secret: packets are authenticated against blind forgery only (their "
                     "keys come from handshake nonces anyone on the path can read; see docs/design/security.md)",
                     self.rank)

    # ------------------------------------------------------------------ lifecycle
    def start(self, bound: tuple[socket.socket, socket.socket] | None = None) -> Endpoint:
        """Bind the data and control sockets, start the data path and the control thread.

        ``bound``: a UDP and a TCP socket already bound to this rank's ports (see
        :func:`reserve_ports`), taken over as they are, so no other process can take the
        ports between announcing them to the peers and starting.

        Raises:
            TransportError: a port cannot be bound (names them), or the data path cannot start.
        """
        if self._running or self._closed:
            raise TransportError(f"endpoint rank {self.rank} already started or closed")
        udp, lst = bound if bound is not None else (socket.socket(socket.AF_INET, socket.SOCK_DGRAM),
                                                      socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        try:
            set_receive_buffer(udp, self.config.socket_buffer)
            udp.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
            udp.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)
            enable_arrival_stamps(udp)
            if bound is None:
                udp.bind((self.me.host, self.me.data_port))
                lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                lst.bind((self.me.host, self.me.control_port))
            elif (udp.getsockname()[1], lst.getsockname()[1]) != (self.me.data_port, self.me.control_port):
                raise OSError(f"the sockets handed over hold ports {udp.getsockname()[1]}/{lst.getsockname()[1]}")
            gro = self.config.offload and enable_gro(udp)
            self._control_socket(lst)
            lst.listen(64)
            udp.setblocking(False)
            lst.setblocking(False)
            self.dp = open_datapath(self.config, udp, gro)
            for p in self.config.peers:
                if p.rank != self.rank:
                    self.dp.add_peer(p.rank, _ipv4(p.host), p.data_port)
            if self.config.source_port_base is not None:  # bind every fixed source port now: a taken one fails here
                for p in self.config.peers:
                    for q in range(self.config.policy.top_priority + 1):
                        if p.rank != self.rank:
                            self.dp.set_sockopt(p.rank, q, socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                self.config.socket_buffer)
        except (OSError, RuntimeError, ValueError) as exc:
            udp.close()
            lst.close()
            self._wake_r.close()
            self._wake_w.close()
            self._closed = True
            raise TransportError(f"rank {self.rank} cannot start on {self.me.host} data port {self.me.data_port} / "
                                 f"control port {self.me.control_port}: {exc}") from exc
        self._udp, self._listener = udp, lst
        self.core = ProtocolCore(self.config, self.dp, startup_drain=self.dp.calibrate())
        self._sel = selectors.DefaultSelector()
        self._sel.register(lst, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._sel.register(self.dp.event_fd(), selectors.EVENT_READ, "datapath")
        deferred = getattr(self.dp, "deferred_event_fd", None)  # (the reference model in the tests has none)
        if deferred is not None:
            self._sel.register(deferred(), selectors.EVENT_READ, "datapath")
        self._running = True
        try:
            self.dp.start()
        except RuntimeError as exc:  # (a thread that cannot start)
            self.close()
            raise TransportError(f"rank {self.rank}: {exc}") from exc
        t = threading.Thread(target=self._ctl_loop, name=f"dlcp-ctl-{self.rank}", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def __enter__(self) -> Endpoint:
        return self.start() if not self._running else self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the threads, close every socket, fail whatever is still in flight. Safe from any
        thread but the endpoint's own, and twice at once: the second call returns when the first
        is done (a process must not exit while the data path's threads are being stopped)."""
        with self._close_lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._closed:
            return
        self._closed = True
        was_running = self._running
        self._running = False
        self._wake()
        for t in self._threads:
            t.join(timeout=5)
        if was_running:
            with self._lock:
                self._core.close(TransportClosed(f"endpoint rank {self.rank} closed"))
        for c in list(self._all_conns):
            c.finish(timeout=0.5)  # what is queued (last STOPs) still leaves
        if self.dp is not None:
            self.dp.stop()
        for s in [c.sock for c in self._all_conns]:
            s.close()
        for sock in (self._udp, self._listener, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        if self._sel is not None:
            self._sel.close()

    def _wake(self) -> None:
        """Make the control loop run its timers and flush now (from any thread, the control
        thread included). Wakes coalesce: while one is pending, another adds nothing, so
        threads may wake per message without a system call each, and never block."""
        if self._wake_pending:
            return
        self._wake_pending = True
        try:
            self._wake_w.send(b"x")
        except OSError:  # full (a wake is pending anyway) or closed
            pass

    def _wake_for_new_message(self) -> None:
        """Wake the control loop for a message just posted, unless its timers run within
        ``bulk_feedback_interval`` anyway, the pace they keep while a message is in flight.

        Why not always: every wake is a run of the control thread, which holds the interpreter
        lock through it; a ring's call posts a message per step, and those runs took a tenth of a
        small collective's time. What a new message needs of the timers comes no sooner than that
        pace (its first look for holes, its clean reports), or with an event that runs them (the
        end of its sender's pass, a probe). Why it is safe to skip: the loop publishes the time
        under the lock it holds while the timers run, and the message was added under that lock;
        a run that began after the message sees it, and one that ended before it published a time
        this reads."""
        if self._timers_at > time.monotonic() + self.config.bulk_feedback_interval:
            self._wake()

    def _check_running(self) -> None:
        if not self._running:
            raise TransportClosed(f"endpoint rank {self.rank} is not running")
        if self._failure is not None:
            raise TransportError(f"{self._failure}; close the endpoint")

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
                    self._core.release(pending)

    # ------------------------------------------------------------------ public API
    def send(self, dest: int, data: np.ndarray, message_id: int, priority: int | None = None,
             loss_bound: float | None = None, iteration: int = 0, tensor_id: int = 0, layer: int = 0,
             layout: Layout | None = None, announce: bool = True, held: bool = False,
             snapshot: np.ndarray | None = None, drop_classes: np.ndarray | None = None,
             classify: bool = True) -> SendHandle:
        """Send ``data`` to rank ``dest`` as message ``message_id``; returns at once.

        Args:
            priority: header priority (default: the policy's top, or the layout's most urgent).
            loss_bound: p for this message (default: the policy's push bound).
            iteration: carried in every header and bound into the message token; a receiver
                that posts ``expect=`` must name the same one.
            layout: for a fused message, which layer each element range belongs to; every packet
                then carries the priority and layer of the most urgent layer it holds, and the
                most urgent packets go first.
            announce: send a META first (default). ``False`` when the receiver posted the message's
                size with ``recv(..., expect=...)``: one control record less per message.
            held: do not send yet: the message starts when a received message that names it in
                ``Expect.then_send`` completes (its drop classes are taken from ``data`` then).
            snapshot: an array of ``data``'s size and type the data path copies ``data`` into
                when the message starts, and sends from (``data`` may change afterwards).
            drop_classes: each packet's drop class, computed by the caller by the policy's rule
                (a server sending one array to many workers computes them once).
            classify: ``False`` puts every packet in drop class 0, the one a switch drops last, and
                computes no magnitude: for data that is not a gradient, none of which matters
                less than the rest (the backend's collectives outside a backward pass).

        The array is not copied (unless ``snapshot``): it must not change until the handle resolves.

        Raises:
            ValueError: bad rank, priority or array; a message id already in flight to ``dest``.
            PeerUnreachable: ``dest`` does not accept a control connection.
        """
        self.config.peer(dest)
        self._check_running()
        if dest != self.rank:
            self._conn_to(dest)  # authenticated: we hold dest's key for our tokens
        defer = getattr(self._deferring, "depth", 0) > 0
        with self._lock:
            self._check_running()
            h = self._core.send(dest, data, message_id, time.monotonic(), priority, loss_bound, iteration, tensor_id,
                               layer, layout, announce, held, snapshot, defer=defer, drop_classes=drop_classes,
                               classify=classify)
        if defer:
            self._deferring.__dict__.setdefault("pending", []).append((dest, message_id))
        elif announce:
            self._flush(dest)  # the META leads the data
        self._wake_for_new_message()
        return h

    def announce(self, dest: int, message_id: int, total_elems: int, dtype: Any = np.float32,
                 loss_bound: float | None = None, priority: int | None = None, iteration: int = 0,
                 tensor_id: int = 0, layer: int = 0) -> None:
        """Send the META of a message ahead of its data, which follows with ``send(..., announce=False)``.

        Why: a worker knows its iteration's buckets before their gradients exist; announcing
        them together (inside :meth:`batch`) costs one control frame instead of one per bucket.
        """
        self._check_running()
        self.config.peer(dest)
        p = self.policy.loss_bound_push if loss_bound is None else loss_bound
        if not 0 <= p < 1:
            raise ValueError(f"loss_bound must be in [0, 1), got {p}")
        self._conn_to(dest)
        with self._lock:
            self._core.queue_meta(dest, message_id, total_elems, dtype, p,
                                 self.policy.top_priority if priority is None else priority, iteration, tensor_id,
                                 layer)
        if not getattr(self._deferring, "depth", 0):
            self._flush(dest)

    def recv(self, src: int, message_id: int, out: np.ndarray | None = None,
             expect: Expect | None = None, accumulate: bool = False) -> RecvHandle:
        """Ask for message ``message_id`` from rank ``src``; returns a handle at once.

        ``out``, if given, is the 1-D array the message is written into (it must match the
        announced size and element type, or the handle fails with a clear error); with
        ``accumulate`` (a float32 ``out``, or one of the message's own type) the message is added
        into it instead.
        ``expect`` gives the message's size, element type and bound, so the message is set up
        now and its sender needs no META (it sends with ``announce=False``).
        """
        self._check_running()
        with self._lock:
            self._check_running()
            h = self._core.recv(src, message_id, time.monotonic(), out, expect, accumulate)
        self._wake_for_new_message()
        return h

    def announcements(self) -> queue.Queue[tuple[int, int]]:
        """A queue of (src, message_id) for every message announced without a waiting recv.

        For servers that do not know in advance what will arrive (a parameter server behind
        a DDP hook, whose buckets change); call before peers start sending. Each entry is to
        be claimed with :meth:`recv`.
        """
        with self._lock:
            return self._core.announcements()

    @property
    def message_log(self) -> deque[MessageStats]:
        """The figures of the last messages finished, both directions (see ProtocolCore)."""
        return self.core.message_log if self.core is not None else deque()

    @property
    def rate_log(self) -> deque[RateChange]:
        """Every recent change of a destination's pacing rate, with its cause."""
        return self.core.rate_log if self.core is not None else deque()

    @property
    def mismatches(self) -> dict[int, str]:
        """Peers this endpoint found its messages to or from mismatched with (sizes or types
        that differ), with what was found: a copy."""
        return dict(self.core.mismatch_with) if self.core is not None else {}

    @property
    def probes_unknown(self) -> int:
        """PROBEs so far of messages not posted here: a peer sending in a collective (or to a
        receive) that this endpoint's user has not reached, or never will."""
        return self.core.stats.probes_unknown if self.core is not None else 0

    @property
    def datapath(self) -> str:
        """Which data path runs: ``native`` or ``numpy``."""
        return self.config.datapath

    def rejected(self) -> Counter:
        """Datagrams the data path rejected, by reason (:data:`~dlcp.hostagent.protocol.port.REASONS`)."""
        return Counter(self.dp.stats()["rejected"]) if self.dp is not None else Counter()

    @property
    def stats(self) -> EndpointStats:
        """Totals since the endpoint started (a snapshot)."""
        d = self.dp.stats() if self.dp is not None else {}
        c = self.core.stats if self.core is not None else EndpointStats()
        return EndpointStats(
            data_pkts_sent=d.get("data_pkts_sent", 0), data_bytes_sent=d.get("data_bytes_sent", 0),
            retransmitted_pkts=d.get("retransmitted_pkts", 0), data_pkts_received=d.get("data_pkts_received", 0),
            data_bytes_received=d.get("data_bytes_received", 0), ce_marked=d.get("ce_marked", 0),
            parked=d.get("parked", 0), late=d.get("late", 0), rx_overflows=d.get("rx_overflows", 0),
            rx_dropped_estimate=d.get("rx_dropped_estimate", 0),
            injected_drops=dict(d.get("injected_drops", {})), injected_delays=d.get("injected_delays", 0),
            send_errors=d.get("send_errors", 0), messages_sent=c.messages_sent,
            messages_received=c.messages_received, ctl_frames_sent=self.ctl_stats["frames_sent"],
            ctl_bytes_sent=self.ctl_stats["bytes_sent"], ctl_frames_received=self.ctl_stats["frames_received"],
            ctl_bytes_received=self.ctl_stats["bytes_received"], ctl_records_sent=Counter(c.ctl_records_sent),
            ctl_records_received=Counter(self.ctl_records_received), probes_unknown=c.probes_unknown,
            records_of_another_use=c.records_of_another_use, messages_refused=c.messages_refused,
            holes_reported=c.holes_reported, holes_resent=c.holes_resent, ctl_rejected=Counter(self.ctl_rejected),
            gso_calls=d.get("gso_calls", 0), gro_reads=d.get("gro_reads", 0))

    def endpoint_stats(self) -> dict[str, Any]:
        """Totals as a JSON-ready dict (the data path's rejections by reason included)."""
        s = self.stats
        d = self.dp.stats()
        with self._lock:
            rates = {r: c.rate for r, c in self._core.rate.items()}
            authed = sorted(self._core.authed)
        rejected = dict(d["rejected"])
        return {
            "rank": self.rank, "datapath": self.config.datapath,
            # why the data path failed and stopped (None: it did not); every call then raises it
            "datapath_failure": self._failure,
            "data_pkts_sent": s.data_pkts_sent, "data_bytes_sent": s.data_bytes_sent,
            "retransmitted_pkts": s.retransmitted_pkts,
            "data_pkts_received": s.data_pkts_received, "data_bytes_received": s.data_bytes_received,
            "ce_marked": s.ce_marked, "rx_socket_overflows": s.rx_overflows,
            "rx_dropped_estimate": s.rx_dropped_estimate, "rx_dropped_reads": d.get("rx_dropped_reads", 0),
            "parked_early": s.parked, "parked_now": d.get("parked_now", 0),
            "late_after_completion": s.late, "send_errors": s.send_errors,
            "messages_sent": s.messages_sent, "messages_received": s.messages_received,
            "duplicate_pkts": d.get("duplicates", 0),
            # receiver-driven credits (dlcp.hostagent.datapath.credits): granted (of them, releases after
            # an overrun of our socket, and releases of a sender whose packets were lost on the
            # way), received, and how often a full window held this endpoint's sending, and gave up
            # waiting for a credit
            "credits_sent": d.get("credits_sent", 0), "overrun_credits_sent": d.get("overrun_credits_sent", 0),
            "loss_releases_sent": d.get("loss_releases_sent", 0),
            "credits_received": d.get("credits_received", 0),
            "credit_waits": d.get("credit_waits", 0), "credit_timeouts": d.get("credit_timeouts", 0),
            # exact completions told to their senders by the data path (a STOP datagram), and
            # messages of ours stopped that way (the rest by a STOP record: ctl_records_*)
            "stops_sent": d.get("stops_sent", 0), "stops_received": d.get("stops_received", 0),
            "ctl_frames_sent": s.ctl_frames_sent, "ctl_bytes_sent": s.ctl_bytes_sent,
            "ctl_frames_received": s.ctl_frames_received, "ctl_bytes_received": s.ctl_bytes_received,
            "ctl_records_sent": dict(s.ctl_records_sent), "ctl_records_received": dict(s.ctl_records_received),
            "probes_unknown": s.probes_unknown, "messages_refused": s.messages_refused,
            # control records about another use of a message id than ours (ignored)
            "records_of_another_use": s.records_of_another_use,
            "ctl_rejected": dict(s.ctl_rejected),
            # reliable messages' holes reported before their pass ended (NACK), and resent for them
            "holes_reported": s.holes_reported, "holes_resent": s.holes_resent,
            "authenticated_peers": authed, "drain_bytes_per_s": self.dp.drain_rate(time.monotonic()),
            "gso_calls": s.gso_calls, "gro_reads": s.gro_reads, "gro": self.dp.gro,
            "gso_off": sorted(d.get("gso_off", [])) if self.config.offload else [],
            "injected_drops_by_class": dict(s.injected_drops), "injected_delays": s.injected_delays,
            "reassembly": {"accepted": d.get("accepted", 0), "duplicates": d.get("duplicates", 0),
                           "rejected": rejected, "rejected_total": sum(rejected.values())},
            "rate_bytes_per_s": rates,
            # (destination, priority, local UDP port) of every data socket: with the addresses,
            # the 5-tuple a switch hashes, so a report can tell which flows shared an ECMP path
            "data_sockets": [tuple(x) for x in d.get("data_sockets", [])],
        }


def set_receive_buffer(sock: socket.socket, size: int) -> int:
    """Ask for a ``size``-byte receive buffer; returns what the kernel gave (it reports double).

    Past ``net.core.rmem_max`` the kernel caps SO_RCVBUF silently; a process with CAP_NET_ADMIN
    (root, as on the testbed) may go past it with SO_RCVBUFFORCE, which is tried first.
    """
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, size)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)


def _ipv4(host: str) -> str:
    """The IPv4 address a peer's host name resolves to (the data path takes addresses only)."""
    try:
        socket.inet_aton(host)
        return host
    except OSError:
        return str(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0])


def reserve_ports(host: str) -> tuple[socket.socket, socket.socket]:
    """A UDP and a TCP socket bound to free ports of ``host``, to announce to the peers and then
    hand to :meth:`Endpoint.start` (``bound=``): the ports are held the whole time, so nobody
    else can take them in between.

    The UDP port is the first free one DLCP's switches recognise (:func:`wire.dlcp_ports`:
    17649, then the rest of its block of 16), so a rendezvous-started rank (the backend, the
    store launcher) gets priority queues, spraying and selective drops on a DLCP fabric; only
    where all 16 are taken on ``host`` does it take any free port, and then its data is plain UDP
    to the switches (:func:`data_port_note` says so). The control port is any free one."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        for port in [*wire.dlcp_ports(), 0]:
            try:
                udp.bind((host, port))
                break
            except OSError as exc:
                if port == 0 or exc.errno != errno.EADDRINUSE:
                    raise
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind((host, 0))
    except OSError:
        udp.close()
        tcp.close()
        raise
    return udp, tcp


def data_port_note(port: int) -> str | None:
    """What to tell a user whose data port DLCP's switches do not parse as DLCP (None: they do)."""
    if wire.is_dlcp_port(port):
        return None
    ports = wire.dlcp_ports()
    return (f"data port {port} is outside DLCP's ports {min(ports)}-{max(ports)} (all taken on this address): "
            "DLCP's switches treat this rank's packets as plain UDP (no priority, spraying or selective drop)")


__all__ = ["CTL_WRITE_LIMIT", "IDLE_TICK", "Endpoint", "EndpointStats", "Expect", "LossInjection", "MessageMismatch",
           "MessageStats", "Peer", "PeerFailed", "PeerUnreachable", "REASONS", "RecvHandle", "RecvResult", "SendHandle",
           "TransportClosed", "TransportConfig", "TransportError", "TransportTimeout", "data_port_note",
           "local_peers", "reserve_ports"]
