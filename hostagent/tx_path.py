"""The send path of an :class:`~hostagent.transport.Endpoint`: the ``tx`` thread.

Of all messages with packets left, the one whose next packet has the highest priority goes
first (retransmissions above everything), paced per destination by a token bucket whose rate
a DCTCP-like controller sets from the receiver's feedback, never above the receiver's drain
ceiling, and by a host pacer across destinations. Runs of full-size packets leave by UDP GSO
from a staging buffer where the kernel takes it.

State this thread owns: ``_active`` (with ``_lock``), ``_tx_socks``, ``_senders``, ``_stage``.
It reads the rate controllers and pacers the control path updates, under ``_lock``.
"""

from __future__ import annotations

import logging
import socket
import time

import numpy as np

from hostagent import wire
from hostagent.messages import OutMessage
from hostagent.ratecontrol import Pacer
from hostagent.udp_offload import DatagramSender

log = logging.getLogger("hostagent.transport")

_ECT0 = 0b10  # ECN-capable transport codepoint in the IP TOS byte

#: Most GSO system calls one pick may make (see :meth:`SendPath._chunk`).
PICK_GSO_CALLS = 2
#: Longest the sender thread sleeps for one pick's pacing (see :meth:`SendPath._fit_to_pacing`).
MAX_INLINE_WAIT = 0.0005


class SendPath:
    """The ``tx`` thread's methods, mixed into :class:`~hostagent.transport.Endpoint` (whose
    ``__init__`` creates the state they share)."""

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
                pkt_bytes = m.batch.datagram_bytes
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
                chunk = self._fit_to_pacing(msg, self._chunk(msg), rate, pacer, time.monotonic())
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
                self._rate[dest].on_sent(sent[0])
                self.stats.data_bytes_sent += sent[1]
                if retx:
                    msg.retransmissions += sent[0]
                    self.stats.retransmitted_pkts += sent[0]
                if finished_pass and not msg.stopped and not msg.awaiting_reply:
                    msg.pass_done_at = time.monotonic()  # the control timers probe after an RTT
                    self._wake()  # and tick fast until the answer comes

    def _chunk(self, msg: OutMessage) -> int:
        """Packets sent per pick: the preemption granularity between priorities.

        With GSO a pick is up to half a token-bucket burst (the pacer lets a whole burst leave
        back to back; the other half absorbs the lateness of the sleeps between picks, else
        every oversleep is lost rate), at most :data:`PICK_GSO_CALLS` system calls of up to
        64 KB each: about 100 microseconds of a 10 Gb/s link with the default 256 KB burst. Why more than one call:
        a pick costs tens of microseconds of Python (choosing, pacing, bookkeeping), as much as
        the system call itself, so one call per pick held a sender near 700 MB/s on loopback.
        A bucket smaller than two calls (the testbed's 16 packets) keeps one call per pick.
        Retransmissions and sends without GSO keep the small pick."""
        if not self.config.offload:
            return 8
        size = msg.batch.datagram_bytes
        per_call = max(8, min(64, 65507 // size))
        if msg.retx_pos < len(msg.retx):
            return per_call
        calls = max(1, min(PICK_GSO_CALLS, self.config.rate.burst_bytes // (2 * per_call * size)))
        return per_call * calls

    def _fit_to_pacing(self, msg: OutMessage, chunk: int, rate: float, pacer: Pacer, now: float) -> int:
        """At most the packets the destination's and the host's pacers let leave within
        :data:`MAX_INLINE_WAIT` (at least one: :meth:`_pick` chose ``msg`` because one may leave
        now). Why: the sender thread sleeps out a pick's pacing deficit before its system
        call, and while it sleeps no other destination is served. A whole GSO call (43
        packets) towards a destination paced at 300 KB/s was a 140 ms sleep, which on the
        testbed held a parameter server's pulls to every worker at about 33 packets/s."""
        pkt = msg.batch.datagram_bytes
        allowed = min(pacer.allowance(rate, now, MAX_INLINE_WAIT),
                      self._host_pacer.allowance(self.config.rate.line_rate, now, MAX_INLINE_WAIT))
        return max(1, min(chunk, int(allowed // pkt)))

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
        width = batch.datagram_bytes
        k = len(seqs)
        short_seq = len(batch) - 1 if batch.payload.size % per else -1
        if retx:
            hdr = batch.headers[seqs].copy()
            hdr["priority"] = self.policy.top_priority
            hdr["drop_class"] = 0
            hdr["flags"] = (hdr["flags"] & ~np.uint8(wire.Flags.LAST)) | int(wire.Flags.RETX)
            hrows, hidx = hdr.view(np.uint8).reshape(k, wire.HEADER_SIZE), np.arange(k)
            priority = self.policy.top_priority
            contiguous = False
        else:
            hrows, hidx = msg.header_rows, seqs
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
        use_gso = sender.gso and n_full > 1
        if last and k:
            # LAST goes on the packet that really leaves last: with a GSO run, the short packet
            # leaves first and the run's final row last (the receiver answers LAST once nothing
            # came for probe_grace, so a straggler after it could be reported missing).
            last_pos = k - 2 if use_gso and short_pos == k - 1 else k - 1
            if retx:
                hdr["flags"][last_pos] |= int(wire.Flags.LAST)
            else:
                batch.headers["flags"][seqs[last_pos]] |= int(wire.Flags.LAST)
        calls0, errors0 = sender.syscalls, sender.errors
        n = nbytes = 0
        rest: list[int] = list(range(k)) if not use_gso else ([short_pos] if short_pos >= 0 else [])
        if use_gso and rest:  # the short packet first, so the run's last row is the last packet
            n, nbytes = self._send_one_by_one(sender, batch, hrows, hidx, seqs, rest)
            rest = []
        if use_gso:
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
            n2, b2 = sender.send_rows(stage)
            n, nbytes = n + n2, nbytes + b2
        if rest:
            n2, b2 = self._send_one_by_one(sender, batch, hrows, hidx, seqs, rest)
            n, nbytes = n + n2, nbytes + b2
        self.stats.gso_calls += sender.syscalls - calls0 if sender.gso else 0
        if sender.errors != errors0:  # e.g. ICMP unreachable from a dead peer; its TCP loss tells
            self.stats.send_errors += sender.errors - errors0
            log.debug("data send to rank %d failed: %s", msg.dest, sender.last_error)
        pacer.consume(nbytes)
        self._host_pacer.consume(nbytes)
        return n, nbytes

    @staticmethod
    def _send_one_by_one(sender: DatagramSender, batch, hrows: np.ndarray, hidx: np.ndarray, seqs: np.ndarray,
                         positions: list[int]) -> tuple[int, int]:
        """Send the packets at ``positions`` of ``seqs`` as datagrams of their own (header + payload
        gathered by the kernel, no copy)."""
        buffers = [(memoryview(hrows[int(hidx[i])]), batch.payload_of(int(seqs[i]))) for i in positions]
        sizes = np.array([wire.HEADER_SIZE + len(p) for _, p in buffers], dtype=np.int64)
        return sender.send(buffers, sizes)
