"""The control path of an :class:`~dlcp.hostagent.transport.Endpoint`: the ``ctl`` thread.

A thin driver of the protocol core (:mod:`dlcp.hostagent.protocol.core`): it reads control frames
from every peer and hands their records to the core, hands it the data path's events (an
eventfd it selects on), runs its timers when it asks to be run, and sends every peer's queued
records as one frame. It runs the handshake of :mod:`dlcp.hostagent.auth` that opens each
connection. It never opens a connection and never blocks on one: a frame goes out directly when
the socket takes it, otherwise through that connection's own writer thread and a bounded queue
(:class:`~dlcp.hostagent.control_conn.ControlConn`), so a dead or non-reading peer cannot stall it.

State this path owns: ``_conns`` / ``_all_conns`` and the handshakes.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dlcp.hostagent import auth, sealing, wire
from dlcp.hostagent.control_conn import CTL_WRITE_LIMIT, ControlConn
from dlcp.hostagent.messages import PeerUnreachable, TransportClosed, TransportError
from dlcp.hostagent.protocol.core import IDLE_TICK
from dlcp.hostagent.protocol.port import EventKind

if TYPE_CHECKING:
    from dlcp.hostagent.policy import Policy
    from dlcp.hostagent.protocol.core import ProtocolCore
    from dlcp.hostagent.transport_config import Peer, TransportConfig

log = logging.getLogger("dlcp.hostagent.transport")

MAX_PENDING_HANDSHAKES = 64  # accepted connections still in their handshake; past it the oldest goes

__all__ = ["IDLE_TICK", "ControlPath"]


class _Rejected(Exception):
    """A control connection broke the rules; ``reason`` is the counter it goes under."""

    def __init__(self, reason: str, why: str) -> None:
        super().__init__(why)
        self.reason, self.why = reason, why


class ControlPath:
    """The ``ctl`` thread's methods and the connections, mixed into
    :class:`~dlcp.hostagent.transport.Endpoint` (whose ``__init__`` creates the state they share)."""

    # The state these methods share with Endpoint, which creates it (declared for type checkers).
    config: TransportConfig
    rank: int
    me: Peer
    policy: Policy
    core: ProtocolCore | None
    dp: Any
    _lock: threading.RLock
    _running: bool
    _failure: str | None  # why the data path failed (None: it did not)
    _conns: dict[int, ControlConn]
    _all_conns: list[ControlConn]
    _dialing: dict[int, ControlConn]
    _key_nonces: dict[int, bytes]  # rank -> our key nonce for it (dlcp.hostagent.auth)
    _allowed_ips: dict[int, set[str]]
    ctl_stats: Counter
    ctl_records_received: Counter
    ctl_rejected: Counter
    _listener: socket.socket | None
    _sel: selectors.BaseSelector | None
    _wake_r: socket.socket
    peer_lost_callbacks: list[Callable[[int, str], None]]
    unknown_probe_callbacks: list[Callable[[int, int, int], None]]

    def _wake(self) -> None:
        raise NotImplementedError  # Endpoint's

    @property
    def _core(self) -> ProtocolCore:
        """The protocol core; :meth:`Endpoint.start` creates it before any connection or the ctl thread."""
        if self.core is None:
            raise TransportError(f"endpoint rank {self.rank} is not started")
        return self.core

    @property
    def _selector(self) -> selectors.BaseSelector:
        """The ctl thread's selector, which :meth:`Endpoint.start` creates with the core."""
        if self._sel is None:
            raise TransportError(f"endpoint rank {self.rank} is not started")
        return self._sel

    def connect(self, ranks: list[int] | None = None, timeout: float | None = None) -> None:
        """Open control connections to ``ranks`` (default: every peer), retrying until ``timeout``.

        Raises:
            PeerUnreachable: a peer did not accept within the timeout (names rank and address).
        """
        ranks = [p.rank for p in self.config.peers if p.rank != self.rank] if ranks is None else ranks
        deadline = time.monotonic() + (self.config.connect_timeout if timeout is None else timeout)
        for rank in ranks:
            self._conn_to(rank, deadline)

    def _control_socket(self, s: socket.socket) -> None:
        """Make ``s`` a control connection's socket: no Nagle delay, and every segment (records,
        and the ACKs of the peer's records) in the top priority's queue. Both ends: the side
        that accepted once sent at DSCP 0, so in the testbed a ring's completions crossed the
        fabric behind the best-effort cross traffic (~75 ms per iteration for the worker that
        waited on them). Also set on the listener, so the SYN-ACK and what it accepts start so."""
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, self.policy.dscp[self.policy.top_priority] << 2)

    def _conn_to(self, rank: int, deadline: float | None = None) -> ControlConn:
        """The authenticated control connection to ``rank``, opening one (and running the
        handshake of :mod:`dlcp.hostagent.auth`) if there is none; application threads only.

        Raises:
            PeerUnreachable: no connection within the deadline, or the peer failed the handshake
                (a wrong secret is not retried: it will not fix itself).
        """
        with self._lock:
            conn = self._conns.get(rank)
            dialing = self._dialing.get(rank)
        if conn is not None:
            return conn
        peer = self.config.peer(rank)
        deadline = time.monotonic() + self.config.connect_timeout if deadline is None else deadline
        if dialing is not None:  # another thread is opening it: wait for its outcome
            dialing.settled.wait(max(0.0, deadline - time.monotonic()))
            if dialing.authenticated:
                return dialing
        last: str = "no attempt"
        while time.monotonic() < deadline:
            if not self._running:
                raise TransportClosed(f"endpoint rank {self.rank} closed")
            with self._lock:
                conn = self._conns.get(rank)
            if conn is not None:  # the peer opened one to us meanwhile
                return conn
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._control_socket(s)
            s.settimeout(max(0.05, min(1.0, deadline - time.monotonic())))
            try:
                if self.me.host not in ("", "0.0.0.0"):
                    s.bind((self.me.host, 0))  # leave from our configured address: the peer checks it
                s.connect((peer.host, peer.control_port))
            except OSError as exc:
                s.close()
                last = str(exc)
                time.sleep(0.05)
                continue
            s.settimeout(None)
            conn = ControlConn(s, rank, self._wake, initiator=True, peer_ip=peer.host)
            conn.nonce_i, conn.step = auth.new_nonce(), auth.STEP_HELLO
            with self._lock:
                self._dialing[rank] = conn
                self._all_conns.append(conn)
                self._selector.register(s, selectors.EVENT_READ, conn)
            self._send_hello(conn, auth.STEP_HELLO, nonce=conn.nonce_i)
            self._wake()
            conn.settled.wait(max(0.0, deadline - time.monotonic()))
            with self._lock:
                if self._dialing.get(rank) is conn:
                    del self._dialing[rank]
            if conn.authenticated:
                # Tell the peer at once what we can drain, so its first data is no faster.
                with self._lock:
                    record = self._core.hello_feedback(time.monotonic())
                self.ctl_stats["frames_sent"] += 1
                conn.send(wire.FRAME_PREFIX.pack(len(record)) + record)
                with self._lock:
                    return self._conns.get(rank, conn)
            conn.fail("handshake timed out")
            last = conn.error or "handshake failed"
            if conn.auth_failed:
                raise PeerUnreachable(f"rank {self.rank}: peer rank {rank} at {peer.host}:{peer.control_port} "
                                      f"{last}")
            time.sleep(0.05)
        raise PeerUnreachable(f"rank {self.rank}: peer rank {rank} at {peer.host}:{peer.control_port} did not "
                              f"complete a control connection within the timeout ({last})")

    # ------------------------------------------------------------------ sending records
    def _flush(self, rank: int, connect: bool = True) -> None:
        """Send everything the core queued for ``rank`` as one frame (with a FEEDBACK riding along).

        Only application threads (``connect=True``) open a connection; the control thread uses
        the ones that exist, so a dead or slow peer never stalls it in ``connect``. Records for a
        peer without a connection wait in the core's outbox.
        """
        with self._lock:
            if not self._core.outbox.get(rank):
                return
            has_conn = rank in self._conns
        if not connect and not has_conn:
            return
        try:
            conn = self._conn_to(rank)
        except TransportClosed:
            return  # closing: in-flight handles are failed by close()
        except TransportError as exc:
            with self._lock:
                self._core.outbox.pop(rank, None)
            self._peer_failed(rank, str(exc))
            return
        with conn.wlock:
            with self._lock:
                records = self._core.take_records(rank, time.monotonic())
            if not records:
                return
            frame = wire.pack_records(records, self.config.job_id, self.rank)
            sent = conn.send(frame)
            if sent:
                self.ctl_stats["frames_sent"] += 1
                self.ctl_stats["bytes_sent"] += len(frame)
        if not sent:
            why = conn.error or f"did not read its control connection ({CTL_WRITE_LIMIT >> 20} MB queued for it)"
            conn.error = conn.error or why  # the control loop closes it, which also ends its writer
            self._wake()
            self._peer_failed(rank, why)

    def _flush_all(self, connect: bool = True) -> None:
        with self._lock:
            ranks = self._core.ranks_with_records()
        for rank in ranks:
            self._flush(rank, connect)

    # ------------------------------------------------------------------ the control thread
    def _ctl_loop(self) -> None:
        """Wait for a frame, an event of the data path or a wake, or the core's next deadline;
        hand over what came; run the core's timers when something happened or a deadline
        passed; send what it queued. Between deadlines the thread sleeps: a bulk transfer costs
        the application (whose interpreter lock the thread takes) nothing."""
        next_timer = 0.0
        while self._running:
            timeout = max(0.0, next_timer - time.monotonic())
            try:
                events = self._selector.select(timeout)
            except (OSError, ValueError):
                if not self._running:
                    return
                raise
            timers_due = False
            for key, _ in events:
                if key.data == "wake":
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except OSError:  # drained
                        pass
                    # cleared after draining and before the timers run below: a wake that
                    # finds it still set is served by this very run
                    self._wake_pending = False
                    timers_due = True
                elif key.data == "datapath":
                    timers_due |= self._on_datapath_events()
                elif key.data is None:
                    self._accept()
                    timers_due = True
                else:
                    timers_due |= self._read(key.data)
            if timers_due:
                next_timer = 0.0  # something came: its answers and deadlines are worked out now
            for conn, error in [(c, c.error) for c in self._all_conns if c.error]:
                self._drop_conn(conn, error)
            now = time.monotonic()
            for conn in [c for c in self._all_conns if not c.authenticated and not c.initiator
                         and now - c.opened_at > self.config.connect_timeout]:
                self._reject(conn, "handshake_timeout", "did not complete the handshake in time")
            if now >= next_timer:
                try:
                    with self._lock:
                        delay = self._core.handle_timer(now)
                        self._timers_at = now + delay  # (under the lock: see Endpoint._wake_for_new_message)
                except Exception:  # the control thread must outlive any one bad state
                    log.exception("rank %d: control timers failed", self.rank)
                    delay = IDLE_TICK
                    self._timers_at = now + delay
                next_timer = now + delay
            self._flush_all(connect=False)

    def _on_datapath_events(self) -> bool:
        """Hand the data path's events to the core; whether they call for a run of the timers
        (:meth:`~dlcp.hostagent.protocol.core.ProtocolCore.on_events`)."""
        events = self.dp.take_events()
        if not events:
            return False
        with self._lock:
            timers = self._core.on_events(events, time.monotonic())
        if any(e[0] == EventKind.FAILED for e in events):
            self._datapath_failed()
        return timers

    def _datapath_failed(self) -> None:
        """A thread of the data path failed and stopped: everything in flight fails with its
        reason, and so does every later call (the endpoint is to be closed); the process goes on."""
        why = self.dp.failure() or "the data path failed"
        log.error("rank %d: %s; failing every message in flight", self.rank, why)
        with self._lock:
            self._failure = f"rank {self.rank}: {why}"
            self._core.close(TransportError(self._failure))

    def _accept(self) -> None:
        if self._listener is None:  # closed
            return
        try:
            s, addr = self._listener.accept()
        except OSError:
            return
        ip = addr[0] if addr else ""
        if not self._address_ok(None, ip):  # from no configured peer's address: not even a handshake
            self.ctl_rejected["wrong_address"] += 1
            log.info("rank %d: control connection from %s refused: no configured peer has that address", self.rank, ip)
            s.close()
            return
        s.setblocking(True)
        self._control_socket(s)
        conn = ControlConn(s, None, self._wake, peer_ip=ip)
        with self._lock:
            pending = [c for c in self._all_conns if not c.initiator and not c.authenticated and not c.error]
            self._all_conns.append(conn)
        if len(pending) >= MAX_PENDING_HANDSHAKES:  # a flood of connections: the oldest go first
            pending[0].fail("too many connections awaiting a handshake")
            self.ctl_rejected["too_many_pending"] += 1
        self._selector.register(s, selectors.EVENT_READ, conn)

    def _read(self, conn: ControlConn) -> bool:
        """Read what ``conn`` sent and hand its records over; whether they call for a run of the
        timers (a handshake or a connection gone always does; records, as
        :meth:`~dlcp.hostagent.protocol.core.ProtocolCore.on_record` says)."""
        try:
            chunk = conn.sock.recv(1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            self._drop_conn(conn, "closed the control connection")
            return True
        conn.buf += chunk
        timers = False
        # Before the handshake, only a HELLO frame is possible: a stranger cannot make us hold more.
        while len(conn.buf) >= wire.FRAME_PREFIX.size and not conn.error:
            # (a sealed frame carries a trailer; the handshake may complete within this loop)
            largest = wire.MAX_FRAME + wire.TRAILER_SIZE if conn.authenticated else wire.HEADER_SIZE + \
                wire.HELLO_BODY.size
            (size,) = wire.FRAME_PREFIX.unpack_from(conn.buf)
            if not wire.HEADER_SIZE <= size <= largest:
                self._reject(conn, "malformed", f"sent a control frame of {size} bytes")
                return True
            if len(conn.buf) < wire.FRAME_PREFIX.size + size:
                break
            whole = conn.open_frame(bytes(conn.buf[: wire.FRAME_PREFIX.size + size]))
            del conn.buf[: wire.FRAME_PREFIX.size + size]
            if whole is None:
                self._reject(conn, "bad_mac", "sent a control frame whose tag or index is wrong (changed, replayed, "
                             "dropped or inserted on the way)")
                return True
            frame = whole[wire.FRAME_PREFIX.size :]
            self.ctl_stats["frames_received"] += 1
            self.ctl_stats["bytes_received"] += wire.FRAME_PREFIX.size + size
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
                self._reject(conn, "malformed", f"sent a malformed control frame ({exc})")
                return True
            if conn.authenticated:
                # What the data path holds back (a pass's end, until its probe is due) happened
                # before this frame came: the core takes it first, so that a STOP or BITMAP
                # answering that pass finds its end (its answer time, the pass's figures)
                timers |= self._on_datapath_events()
            for header, body in records:
                self.ctl_records_received[header.ptype.name] += 1
                if header.ptype == wire.PacketType.HELLO or not conn.authenticated:
                    # Nothing but the handshake before it completes: without the secret, a
                    # frame never reaches a message.
                    timers = True
                    try:
                        self._on_hello(conn, header, body)
                    except _Rejected as rej:
                        self._reject(conn, rej.reason, rej.why)
                        return True
                    continue
                unknown = False
                try:
                    with self._lock:
                        before = self._core.stats.probes_unknown
                        timers |= self._core.on_record(header, body, time.monotonic())
                        unknown = self._core.stats.probes_unknown > before
                except Exception:  # a bad frame must not kill the control thread
                    timers = True
                    log.exception("rank %d: error handling %s from rank %d", self.rank, header.ptype.name,
                                  header.sender_rank)
                if unknown:  # a PROBE of a message not posted here (outside the lock: callbacks may send)
                    for callback in list(self.unknown_probe_callbacks):
                        try:
                            callback(header.sender_rank, header.message_id, header.iteration)
                        except Exception:  # a user's callback must not kill the control thread either
                            log.exception("rank %d: unknown-probe callback %r failed", self.rank, callback)
        return timers

    # ------------------------------------------------------------------ handshake
    def _on_hello(self, conn: ControlConn, h: wire.Header, body: bytes) -> None:
        """One step of the handshake of :mod:`dlcp.hostagent.auth` on ``conn``.

        Raises:
            _Rejected: anything out of order, from the wrong address, or with a wrong proof.
        """
        if h.ptype != wire.PacketType.HELLO:
            raise _Rejected("unauthenticated", f"sent {h.ptype.name} before completing the handshake")
        if conn.authenticated:
            raise _Rejected("bad_handshake", "sent a HELLO after the handshake")
        if len(body) != wire.HELLO_BODY.size:
            raise _Rejected("bad_handshake", f"sent a HELLO of {len(body)} bytes")
        step, nonce, proof, key = wire.HELLO_BODY.unpack(body)
        cfg, rank = self.config, h.sender_rank
        if not conn.initiator:
            if step == auth.STEP_HELLO and conn.step == 0:
                if rank == self.rank:
                    raise _Rejected("unknown_rank", f"claimed to be this endpoint's own rank {rank}")
                if not self._address_ok(rank, conn.peer_ip):
                    raise _Rejected("wrong_address", f"claimed rank {rank} from {conn.peer_ip}, not from "
                                    f"{cfg.peer(rank).host}")
                conn.rank, conn.nonce_i, conn.nonce_a, conn.step = rank, nonce, auth.new_nonce(), auth.STEP_CHALLENGE
                conn.key_nonce = self._key_nonce(rank)
                self._send_hello(conn, auth.STEP_CHALLENGE, nonce=conn.nonce_a, key=conn.key_nonce,
                                 proof=auth.proof(cfg.secret, "accept", cfg.job_id, rank, self.rank, conn.nonce_i,
                                                  conn.nonce_a, conn.key_nonce))
            elif step == auth.STEP_RESPONSE and conn.step == auth.STEP_CHALLENGE:
                if not auth.proof_ok(cfg.secret, proof, "initiate", cfg.job_id, rank, self.rank, conn.nonce_i,
                                     conn.nonce_a, key):
                    raise _Rejected("bad_proof", f"claimed rank {rank} without proving the job secret")
                conn.step = auth.STEP_KEY
                with self._lock:  # before our "done" leaves: the peer's data may follow it at once
                    self._keys_agreed(conn, rank, key)
                self._send_hello(conn, auth.STEP_KEY)
                self._authenticated(conn)  # after: no record of ours may overtake the "done"
            else:
                raise _Rejected("bad_handshake", f"sent handshake step {step} after step {conn.step}")
            return
        if step == auth.STEP_CHALLENGE and conn.step == auth.STEP_HELLO:
            if not auth.proof_ok(cfg.secret, proof, "accept", cfg.job_id, self.rank, rank, conn.nonce_i, nonce, key):
                conn.auth_failed = True
                raise _Rejected("bad_proof", "did not prove the job secret (is the secret the same on every rank?)")
            conn.nonce_a, conn.step, conn.peer_key_nonce = nonce, auth.STEP_RESPONSE, key
            conn.key_nonce = self._key_nonce(rank)
            self._send_hello(conn, auth.STEP_RESPONSE, key=conn.key_nonce,
                             proof=auth.proof(cfg.secret, "initiate", cfg.job_id, self.rank, rank, conn.nonce_i,
                                              conn.nonce_a, conn.key_nonce))
        elif step == auth.STEP_KEY and conn.step == auth.STEP_RESPONSE:
            with self._lock:
                self._keys_agreed(conn, rank, conn.peer_key_nonce)
            self._authenticated(conn)
        else:
            raise _Rejected("bad_handshake", f"sent handshake step {step} after step {conn.step}")

    def _key_nonce(self, rank: int) -> bytes:
        """Our key nonce for ``rank`` (:mod:`dlcp.hostagent.auth`): drawn once, the same on every
        connection with it, drawn anew once no connection with it is left."""
        with self._lock:
            kn = self._key_nonces.get(rank)
            if kn is None:
                kn = self._key_nonces[rank] = auth.new_nonce()
            return kn

    def _keys_agreed(self, conn: ControlConn, rank: int, peer_key_nonce: bytes) -> None:
        """Both proofs checked on ``conn``: derive both direction keys and hand them to the
        endpoint (self._lock held).

        Raises:
            _Rejected: our key nonce was withdrawn (the peer was lost) while this handshake ran:
                its keys would be an old pair's, whose packet numbers may have been used.
        """
        if self._key_nonces.get(rank) != conn.key_nonce:
            raise _Rejected("bad_handshake", f"rank {rank}'s keys were withdrawn during the handshake")
        cfg = self.config
        rx_key = auth.direction_key(cfg.secret, cfg.job_id, rank, self.rank, peer_key_nonce, conn.key_nonce)
        tx_key = auth.direction_key(cfg.secret, cfg.job_id, self.rank, rank, conn.key_nonce, peer_key_nonce)
        self._core.peer_authenticated(rank, tx_key, rx_key)
        if cfg.protection != sealing.NONE:  # this connection's frames from now on (_authenticated)
            conn.peer_key_nonce = peer_key_nonce
            ctl = (cfg.secret, cfg.job_id)
            conn.ctl_keys = (auth.control_key(*ctl, self.rank, rank, conn.nonce_i, conn.nonce_a, conn.key_nonce,
                                              peer_key_nonce),
                             auth.control_key(*ctl, rank, self.rank, conn.nonce_i, conn.nonce_a, peer_key_nonce,
                                              conn.key_nonce))

    def _send_hello(self, conn: ControlConn, step: int, nonce: bytes = b"", proof: bytes = b"",
                    key: bytes = b"") -> None:
        frame = wire.pack_frame(wire.Header(ptype=wire.PacketType.HELLO, job_id=self.config.job_id, message_id=0,
                                            sender_rank=self.rank, priority=self.policy.top_priority),
                                wire.HELLO_BODY.pack(step, nonce, proof, key))
        if conn.send(frame):
            self.ctl_stats["frames_sent"] += 1
            self.ctl_stats["bytes_sent"] += len(frame)

    def _authenticated(self, conn: ControlConn) -> None:
        """The handshake on ``conn`` succeeded: it may carry records; the first such for a rank
        is the one the endpoint uses (and whose loss fails the rank's messages)."""
        assert conn.rank is not None, "a connection authenticates after its hello names its rank"
        if conn.ctl_keys is not None:  # every frame after the last HELLO is sealed (dlcp.hostagent.auth)
            conn.tx_sealer = sealing.new_sealer(conn.ctl_keys[0], sealing.MAC)
            conn.rx_sealer = sealing.new_sealer(conn.ctl_keys[1], sealing.MAC)
        conn.authenticated = True
        with self._lock:
            self._conns.setdefault(conn.rank, conn)
        conn.settled.set()
        log.debug("rank %d: control connection with rank %d authenticated", self.rank, conn.rank)

    def _address_ok(self, rank: int | None, ip: str) -> bool:
        """Whether a connection from ``ip`` may speak for ``rank`` (for any peer when None):
        it must come from the address the rank is configured at (a host name may resolve to
        several; an unspecified address, 0.0.0.0, allows any)."""
        if not self.config.check_address:
            return True
        ranks = [p.rank for p in self.config.peers if p.rank != self.rank] if rank is None else [rank]
        for r in ranks:
            allowed = self._allowed_ips.get(r)
            if allowed is None:
                host = self.config.peer(r).host
                try:
                    allowed = {str(ai[4][0]) for ai in socket.getaddrinfo(host, None, socket.AF_INET)}
                except OSError:
                    allowed = {host}
                self._allowed_ips[r] = allowed
            if ip in allowed or "0.0.0.0" in allowed:
                return True
        return False

    def _reject(self, conn: ControlConn, reason: str, why: str) -> None:
        """Count a refused connection under ``reason`` and drop it."""
        self.ctl_rejected[reason] += 1
        who = f"rank {conn.rank}" if conn.rank is not None else "an unidentified peer"
        (log.info if conn.authenticated else log.debug)("rank %d: control connection from %s (%s) dropped: %s",
                                                        self.rank, who, conn.peer_ip, why)
        self._drop_conn(conn, why)

    def _drop_conn(self, conn: ControlConn, why: str) -> None:
        conn.fail(why)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.finish(timeout=0)  # its writer stops; the close below ends a send in progress
        conn.sock.close()
        with self._lock:
            if conn in self._all_conns:
                self._all_conns.remove(conn)
            rank = conn.rank
            primary = rank is not None and self._conns.get(rank) is conn
            if primary and rank is not None:
                del self._conns[rank]
        # Only the connection the endpoint uses for a rank speaks for it: another one (a stale
        # duplicate, or one that never authenticated) closing must not fail the peer's messages.
        if rank is None:
            return
        if primary and self._running:
            self._peer_failed(rank, why)
        elif conn.authenticated:
            log.info("rank %d: a second control connection with rank %d %s", self.rank, rank, why)

    def _peer_failed(self, rank: int, why: str) -> None:
        with self._lock:
            in_flight = self._core.peer_failed(rank, why)
            # the callbacks (the backend fails its group with it) and the log say what the
            # failed messages say: a mismatch that came first (a refused message) is the cause
            why = self._core.loss_reason(rank, why)
            self._conns.pop(rank, None)
            # Another authenticated connection with the rank (the peer reconnected) takes over.
            spare = [c for c in self._all_conns if c.rank == rank and c.authenticated and not c.error]
            lost = not spare
            if spare:
                self._conns[rank] = spare[-1]
            else:
                self._core.peer_lost(rank)
                self._key_nonces.pop(rank, None)  # the next connection derives new keys
        (log.warning if in_flight else log.info)("rank %d: peer rank %d %s", self.rank, rank, why)
        if lost:
            for callback in list(self.peer_lost_callbacks):
                callback(rank, why)
