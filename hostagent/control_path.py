"""The control path of an :class:`~hostagent.transport.Endpoint`: the ``ctl`` thread.

It reads control frames from every peer, runs the timers (answers to the end of a pass, idle
completion, probes, deadlines, feedback) and flushes every peer's queued records: every
millisecond while a timer is close (a pass ended, a probe is to be answered, congestion is to
be reported), every BULK_TICK while messages are only in flight, every IDLE_TICK when idle.
The threads that make a timer close (a STOP queued, a pass ended, a first CE mark) wake it.
It never opens a connection and never blocks on one: a frame goes out directly when the
socket takes it, otherwise through that connection's own writer thread and a bounded queue
(:class:`~hostagent.control_conn.ControlConn`), so a dead or non-reading peer cannot stall it.

State this path owns: ``_conns`` / ``_all_conns``, ``_outbox``, the rate controllers' inputs,
``_answer`` timers and ``_srtt``.
"""

from __future__ import annotations

import logging
import selectors
import socket
import time

import numpy as np

from hostagent import auth, wire
from hostagent.control_conn import CTL_WRITE_LIMIT, ControlConn
from hostagent.messages import (InMessage, OutMessage, PeerFailed, PeerUnreachable, RateChange, TransportClosed, TransportError,
                                TransportTimeout)
from hostagent.policy import retransmission_set
from hostagent.ratecontrol import CUT_HOLD_ANSWERS, CUT_HOLD_MIN_REPORTS, AnswerTimer, Pacer, RateController

log = logging.getLogger("hostagent.transport")

_OUTBOX_LIMIT = 4096  # control records kept for a peer the control thread cannot reach yet
IDLE_TICK = 0.05  # control-loop period of an endpoint with no message in flight (s)
BULK_TICK = 0.005  # period while messages are in flight but no timer is close (s)
URGENT_TICK = 0.001  # period while a timer is close: an answer, a probe or congestion feedback (s)
_HELLO, _HELLO_REPLY = 1, 2  # message ids of the FEEDBACK that opens a control connection, and its answer
MAX_PENDING_HANDSHAKES = 64  # accepted connections still in their handshake; past it the oldest goes


#: An end of pass is answered after at most this much quiet, however slowly data arrived.
MAX_ANSWER_GRACE = 0.1


def answer_grace(floor: float, msg: InMessage) -> float:
    """How long no data of ``msg`` must have arrived before its end of pass (LAST or a PROBE)
    is answered: ``floor`` (``probe_grace``), or four of the message's own mean gaps between
    packets if that is longer (at most MAX_ANSWER_GRACE).

    Why: when a switch sprays a message over paths whose queues differ, its LAST overtakes
    packets still queued on another path. They arrive within a few packet times of that path,
    which at a slow bottleneck is milliseconds; a bitmap sent sooner lists them as missing and
    they are sent again (on the testbed's 700-pps leaf-spine a ring of DLCP messages resent
    about 100 packets per iteration against the baseline's 16). The mean gap measures the
    pace of this very message, whatever the link speed; once a bitmap went out, the gap of the
    first pass stands (the wait for retransmissions is not the message's pace).
    """
    gap = msg.pace if msg.pace is not None else packet_gap(msg)
    return floor if gap is None else max(floor, min(MAX_ANSWER_GRACE, 4 * gap))


def packet_gap(msg: InMessage) -> float | None:
    """Mean time between ``msg``'s packets so far (None before two arrived)."""
    n = msg.assembly.received_pkts
    if msg.first_arrival is None or n < 2:
        return None
    return (msg.last_arrival - msg.first_arrival) / (n - 1)


class _Rejected(Exception):
    """A control connection broke the rules; ``reason`` is the counter it goes under."""

    def __init__(self, reason: str, why: str) -> None:
        super().__init__(why)
        self.reason, self.why = reason, why


class ControlPath:
    """The ``ctl`` thread's methods and control-record plumbing, mixed into
    :class:`~hostagent.transport.Endpoint` (whose ``__init__`` creates the state they share)."""

    def connect(self, ranks: list[int] | None = None, timeout: float | None = None) -> None:
        """Open control connections to ``ranks`` (default: every peer), retrying until ``timeout``.

        Raises:
            PeerUnreachable: a peer did not accept within the timeout (names rank and address).
        """
        ranks = [p.rank for p in self.config.peers if p.rank != self.rank] if ranks is None else ranks
        deadline = time.monotonic() + (self.config.connect_timeout if timeout is None else timeout)
        for rank in ranks:
            self._conn_to(rank, deadline)

    def _conn_to(self, rank: int, deadline: float | None = None) -> ControlConn:
        """The authenticated control connection to ``rank``, opening one (and running the
        handshake of :mod:`hostagent.auth`) if there is none; application threads only.

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
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, self.policy.dscp[self.policy.top_priority] << 2)
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
                self._sel.register(s, selectors.EVENT_READ, conn)
            self._send_hello(conn, auth.STEP_HELLO, nonce=conn.nonce_i)
            self._wake()
            conn.settled.wait(max(0.0, deadline - time.monotonic()))
            with self._lock:
                if self._dialing.get(rank) is conn:
                    del self._dialing[rank]
            if conn.authenticated:
                # Tell the peer at once what we can drain, so its first data is no faster.
                self.stats.ctl_frames_sent += 1
                conn.send(wire.pack_frame(wire.Header(ptype=wire.PacketType.FEEDBACK, job_id=self.config.job_id,
                                                      message_id=_HELLO, sender_rank=self.rank),
                                          wire.FEEDBACK_BODY.pack(0, 0, 0, self._drain_share_kBps())))
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

    def _ctl_loop(self) -> None:
        next_timer = 0.0
        while self._running:
            # Why three periods: a tick takes the GIL and the endpoint lock from the rx and tx
            # threads, so ticking every millisecond through a bulk transfer costs a receiver
            # a tenth of its drain; idle agents must not spin a core on a 2-core testbed.
            tick = self._tick_period()
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
                        while self._wake_r.recv(4096):
                            pass
                    except OSError:  # drained
                        pass
                    # cleared after draining and before the timers run below: a wake that
                    # finds it still set is served by this very run
                    self._wake_pending = False
                    next_timer = 0.0  # new work: run the timers now, not at the end of an idle tick
                elif key.data is None:
                    self._accept()
                else:
                    self._read(key.data)
                    # a frame may have made a timer close (a BITMAP ends a retransmission's
                    # pass, a PROBE asks for an answer): look again within a millisecond
                    next_timer = min(next_timer, time.monotonic() + URGENT_TICK)
            for conn in [c for c in self._all_conns if c.error]:
                self._drop_conn(conn, conn.error)
            now = time.monotonic()
            for conn in [c for c in self._all_conns if not c.authenticated and not c.initiator
                         and now - c.opened_at > self.config.connect_timeout]:
                self._reject(conn, "handshake_timeout", "did not complete the handshake in time")
            if now >= next_timer:
                try:
                    self._timers(now)
                except Exception:  # the control thread must outlive any one bad state
                    log.exception("rank %d: control timers failed", self.rank)
                next_timer = now + self._tick_period()
            self._flush_all(connect=False)

    def _accept(self) -> None:
        try:
            s, addr = self._listener.accept()
        except OSError:
            return
        ip = addr[0] if addr else ""
        if not self._address_ok(None, ip):  # from no configured peer's address: not even a handshake
            self.stats.ctl_rejected["wrong_address"] += 1
            log.info("rank %d: control connection from %s refused: no configured peer has that address", self.rank, ip)
            s.close()
            return
        s.setblocking(True)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = ControlConn(s, None, self._wake, peer_ip=ip)
        with self._lock:
            pending = [c for c in self._all_conns if not c.initiator and not c.authenticated and not c.error]
            self._all_conns.append(conn)
        if len(pending) >= MAX_PENDING_HANDSHAKES:  # a flood of connections: the oldest go first
            pending[0].fail("too many connections awaiting a handshake")
            self.stats.ctl_rejected["too_many_pending"] += 1
        self._sel.register(s, selectors.EVENT_READ, conn)

    def _read(self, conn: ControlConn) -> None:
        try:
            chunk = conn.sock.recv(1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            self._drop_conn(conn, "closed the control connection")
            return
        conn.buf += chunk
        # Before the handshake, only a HELLO frame is possible: a stranger cannot make us hold more.
        largest = wire.MAX_FRAME if conn.authenticated else wire.HEADER_SIZE + wire.HELLO_BODY.size
        while len(conn.buf) >= wire.FRAME_PREFIX.size and not conn.error:
            (size,) = wire.FRAME_PREFIX.unpack_from(conn.buf)
            if not wire.HEADER_SIZE <= size <= largest:
                self._reject(conn, "malformed", f"sent a control frame of {size} bytes")
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
                self._reject(conn, "malformed", f"sent a malformed control frame ({exc})")
                return
            for header, body in records:
                self.stats.ctl_records_received[header.ptype.name] += 1
                if header.ptype == wire.PacketType.HELLO or not conn.authenticated:
                    # Nothing but the handshake before it completes: without the secret, a
                    # frame never reaches a message.
                    try:
                        self._on_hello(conn, header, body)
                    except _Rejected as rej:
                        self._reject(conn, rej.reason, rej.why)
                        return
                    continue
                try:
                    self._on_frame(header, body)
                except Exception:  # a bad frame must not kill the control thread
                    log.exception("rank %d: error handling %s from rank %d", self.rank, header.ptype.name,
                                  header.sender_rank)

    # ------------------------------------------------------------------ handshake
    def _on_hello(self, conn: ControlConn, h: wire.Header, body: bytes) -> None:
        """One step of the handshake of :mod:`hostagent.auth` on ``conn``.

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
                self._send_hello(conn, auth.STEP_CHALLENGE, nonce=conn.nonce_a,
                                 proof=auth.proof(cfg.secret, "accept", cfg.job_id, rank, self.rank, conn.nonce_i,
                                                  conn.nonce_a))
            elif step == auth.STEP_RESPONSE and conn.step == auth.STEP_CHALLENGE:
                if not auth.proof_ok(cfg.secret, proof, "initiate", cfg.job_id, rank, self.rank, conn.nonce_i,
                                     conn.nonce_a):
                    raise _Rejected("bad_proof", f"claimed rank {rank} without proving the job secret")
                conn.step = auth.STEP_KEY
                self._tx_keys[rank] = key
                with self._lock:
                    self._authed.add(rank)  # before the key leaves: data may follow it at once
                self._send_hello(conn, auth.STEP_KEY, key=self._rx_key(rank))
                self._authenticated(conn)  # after: no record of ours may overtake the key
            else:
                raise _Rejected("bad_handshake", f"sent handshake step {step} after step {conn.step}")
            return
        if step == auth.STEP_CHALLENGE and conn.step == auth.STEP_HELLO:
            if not auth.proof_ok(cfg.secret, proof, "accept", cfg.job_id, self.rank, rank, conn.nonce_i, nonce):
                conn.auth_failed = True
                raise _Rejected("bad_proof", "did not prove the job secret (is the secret the same on every rank?)")
            conn.nonce_a, conn.step = nonce, auth.STEP_RESPONSE
            self._send_hello(conn, auth.STEP_RESPONSE, key=self._rx_key(rank),
                             proof=auth.proof(cfg.secret, "initiate", cfg.job_id, self.rank, rank, conn.nonce_i,
                                              conn.nonce_a))
        elif step == auth.STEP_KEY and conn.step == auth.STEP_RESPONSE:
            self._tx_keys[rank] = key
            self._authenticated(conn)
        else:
            raise _Rejected("bad_handshake", f"sent handshake step {step} after step {conn.step}")

    def _send_hello(self, conn: ControlConn, step: int, nonce: bytes = b"", proof: bytes = b"",
                    key: bytes = b"") -> None:
        frame = wire.pack_frame(wire.Header(ptype=wire.PacketType.HELLO, job_id=self.config.job_id, message_id=0,
                                            sender_rank=self.rank, priority=self.policy.top_priority),
                                wire.HELLO_BODY.pack(step, nonce, proof, key))
        if conn.send(frame):
            self.stats.ctl_frames_sent += 1
            self.stats.ctl_bytes_sent += len(frame)

    def _authenticated(self, conn: ControlConn) -> None:
        """The handshake on ``conn`` succeeded: it may carry records; the first such for a rank
        is the one the endpoint uses (and whose loss fails the rank's messages)."""
        conn.authenticated = True
        with self._lock:
            self._conns.setdefault(conn.rank, conn)
            self._authed.add(conn.rank)
        conn.settled.set()
        log.debug("rank %d: control connection with rank %d authenticated", self.rank, conn.rank)

    def _rx_key(self, rank: int) -> bytes:
        """This endpoint's receive key for sender ``rank`` (drawn once, kept for its lifetime)."""
        key = self._rx_keys.get(rank)
        if key is None:
            key = self._rx_keys.setdefault(rank, auth.new_key())
        return key

    def _rx_token(self, src: int, message_id: int) -> int:
        """The token packets of message ``message_id`` from ``src`` must carry to be accepted."""
        return auth.message_token(self._rx_key(src), self.config.job_id, src, message_id)

    def _park_token(self, src: int, message_id: int) -> int | None:
        """For data of a message not announced yet: its token if ``src`` authenticated, else
        None (nothing of an unauthenticated sender is held)."""
        return self._rx_token(src, message_id) if src in self._authed and src != self.rank else None

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
                    allowed = {ai[4][0] for ai in socket.getaddrinfo(host, None, socket.AF_INET)}
                except OSError:
                    allowed = {host}
                self._allowed_ips[r] = allowed
            if ip in allowed or "0.0.0.0" in allowed:
                return True
        return False

    def _reject(self, conn: ControlConn, reason: str, why: str) -> None:
        """Count a refused connection under ``reason`` and drop it."""
        self.stats.ctl_rejected[reason] += 1
        who = f"rank {conn.rank}" if conn.rank is not None else "an unidentified peer"
        (log.info if conn.authenticated else log.debug)("rank %d: control connection from %s (%s) dropped: %s",
                                                        self.rank, who, conn.peer_ip, why)
        self._drop_conn(conn, why)

    def _drop_conn(self, conn: ControlConn, why: str) -> None:
        conn.fail(why)
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
        # Only the connection the endpoint uses for a rank speaks for it: another one (a stale
        # duplicate, or one that never authenticated) closing must not fail the peer's messages.
        if primary and self._running:
            self._peer_failed(conn.rank, why)
        elif conn.rank is not None and conn.authenticated:
            log.info("rank %d: a second control connection with rank %d %s", self.rank, conn.rank, why)

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
            # Another authenticated connection with the rank (the peer reconnected) takes over.
            spare = [c for c in self._all_conns if c.rank == rank and c.authenticated and not c.error]
            if spare:
                self._conns[rank] = spare[-1]
            else:
                self._authed.discard(rank)
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
                    self._note_rate(src, time.monotonic(), "loss")
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
                now = time.monotonic()
                rc.on_ceiling(share_kBps * 1000.0)
                self._note_rate(src, now, "ceiling")
                if received or lost:
                    rc.on_feedback(received, marked, lost, now, hold=self._cut_hold(src))
                    self._note_rate(src, now, "marks" if marked or lost else "increase")

    def _cut_hold(self, dest: int) -> float:
        """Longest a rate cut towards ``dest`` waits for its window to be reported
        (:meth:`RateController.on_feedback`): a few smoothed answer times (a round trip with
        its queue; ``probe_delay`` before any), at least a few feedback intervals. Only packets
        lost without a report make it matter."""
        timer = self._answer.get(dest)
        rtt = timer.srtt if timer is not None and timer.srtt is not None else self.config.probe_delay
        return max(CUT_HOLD_MIN_REPORTS * self.config.feedback_interval, CUT_HOLD_ANSWERS * rtt)

    def _note_rate(self, dest: int, now: float, cause: str) -> None:
        """Log the pacing rate towards ``dest`` if it changed (lock held)."""
        rate = self._rate[dest].effective_rate
        last = self._last_rate.get(dest)
        if rate != last:
            self._last_rate[dest] = rate
            self.rate_log.append(RateChange(now, dest, rate, cause))

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
                asm = self.reassembler.expect(src, h.message_id, total, dtype, per, out=out,
                                              token=self._rx_token(src, h.message_id))
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

    def _tick_period(self) -> float:
        """How long until the timers run again: see the module docstring."""
        if not (self._in or self._out or self._waiting):
            return IDLE_TICK
        return URGENT_TICK if self._urgent else BULK_TICK

    def _timers(self, now: float) -> None:
        """Probe answers, idle completion, probes and deadlines, feedback, parked-packet expiry.

        Everything it decides is queued as records; the control loop flushes them after. Sets
        ``_urgent`` when some timer may fire within a few milliseconds.
        """
        stops: list[InMessage] = []
        urgent = False
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
                urgent = urgent or msg.probe_pending
                if msg.probe_pending and idle >= answer_grace(self.config.probe_grace, msg) and not self._rx_backlog():
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
                            msg.pace = packet_gap(msg)  # the first pass's; recovery waits are not its pace
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
                urgent = True  # the pass is over: a probe is due within a round trip
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
                counts = self._fb[rank]
                urgent = urgent or bool(counts[1] or counts[2])  # congestion is reported every feedback_interval
                rec = self._take_feedback(rank, now, force=False)
                if rec is not None:
                    with self._ob_lock:
                        self._outbox[rank].append(rec)
            if self._parked:
                for key in [k for k, v in self._parked.items() if now - v[0][0] > self.config.message_deadline]:
                    self._parked_count[key[0]] -= len(self._parked.pop(key))
        self._urgent = urgent
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
