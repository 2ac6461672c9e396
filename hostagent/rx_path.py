"""The receive path of an :class:`~hostagent.transport.Endpoint`: the ``rx`` thread, and the
completion of received messages.

Datagrams are received in batches into preallocated rows (GRO reads land in them directly),
the configured loss injection applies, and the batch goes to the
:class:`~hostagent.reassembly.Reassembler`, which validates every field (the message token
included) before a byte is written. Data that comes before its message is known is parked,
per sender and only when its token is right. Socket-buffer overruns are blamed only on
senders whose packets were accepted. While behind, the thread measures what it can drain;
that measure is the ceiling senders are told.

State this path owns: ``_in`` entries' progress, ``_parked``, ``_recent_done``, ``_fb``
counters, ``_drain``, ``_delayed`` (all under ``_lock`` except ``_delayed``, rx only).
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import select
import socket
import struct
import termios
import time

import numpy as np

from hostagent import wire
from hostagent.lossmodel import drop_by_class
from hostagent.messages import InMessage
from hostagent.packetizer import MessageMeta, elems_per_packet, packetize
from hostagent.ratecontrol import drain_share
from hostagent.reassembly import Reassembler
from hostagent.udp_offload import GRO_ANCBUF, GRO_BUFSIZE, gro_segment_size, split_segments

log = logging.getLogger("hostagent.transport")

_CE = 0b11  # congestion experienced
_LAST = int(wire.Flags.LAST)
_FLAGS_BYTE = wire.FIELD_OFFSET["flags"]
# Linux: with SO_RXQ_OVFL set, a datagram carries the socket's count of datagrams the kernel
# dropped for want of buffer space (a receiver overrun the senders must hear about).
SO_RXQ_OVFL = getattr(socket, "SO_RXQ_OVFL", 40)
# Linux: SO_MEMINFO reads a socket's memory counters (SK_MEMINFO_*, 9 x u32); the first two are
# the bytes its receive queue holds and its receive buffer, both in the kernel's accounting.
SO_MEMINFO = getattr(socket, "SO_MEMINFO", 55)
_MEMINFO = struct.Struct("9I")


def receive_backlog(sock: socket.socket) -> float | None:
    """The fraction of ``sock``'s receive buffer its queued datagrams fill (0 to about 1), or
    None where the kernel has no SO_MEMINFO."""
    try:
        queued, size = _MEMINFO.unpack(sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, _MEMINFO.size))[:2]
    except (OSError, struct.error):
        return None
    return queued / size if size else None


#: A batch that ended full counts as behind only if the socket still holds at least this
#: fraction of its buffer: then an overrun is near, and the receiver's drain is the limit.
BEHIND_BACKLOG = 0.5


class ReceivePath:
    """The ``rx`` thread's methods and message completion, mixed into
    :class:`~hostagent.transport.Endpoint` (whose ``__init__`` creates the state they share)."""

    def _rx_loop(self) -> None:
        """Receive datagrams into the rows of a slot matrix and hand them over in batches.

        A row is exactly one full-size datagram wide, so a GRO read (many datagrams of that
        size back to back) lands in consecutive rows with no copy; a batch then holds up to
        ``rx_batch`` datagrams whatever mix of GRO and single reads brought them, and the
        per-batch cost of reassembly is shared by all of them.

        A batch also ends after a quarter of the socket buffer's bytes (``rx_batch`` datagrams
        alone would never be reached at MTU 9000, where 2,048 datagrams are more than a 16 MB
        buffer holds). The drain meter samples a batch only when it ended by either limit,
        rather than because the socket ran dry, *and* the socket still holds at least
        :data:`BEHIND_BACKLOG` of its buffer: a real backlog, close to an overrun. Why not every
        full batch: a burst (a ring step's chunk) that meets a receiver descheduled for a moment
        fills a quarter of the buffer without any risk; sampling then advertised the rate of a
        receiver sharing its core with three others as its ceiling, and held a 4-member ring on
        2 cores about 20 % slower (bench part 2, MTU 9000).
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
        # SO_RCVBUF reads back doubled (the kernel counts its bookkeeping in it)
        batch_bytes = max(width, sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 8)
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        while self._running:
            # short polls only while injected-delay packets wait; otherwise an idle receiver
            # wakes 20 times a second (to see close()), not 200
            if not poller.poll(5 if self._delayed else 50):
                self._release_delayed()
                continue
            t_batch = time.monotonic()
            self._rx_holding = True
            k = 0
            nbytes_batch = 0
            per_read = 1.0  # datagrams per read in this batch (GRO reads hold many)
            while k < cfg.rx_batch and nbytes_batch < batch_bytes:
                try:
                    nbytes, ancdata, _flags, _addr = sock.recvmsg_into([flat[k * width :]], GRO_ANCBUF)
                except (BlockingIOError, InterruptedError):
                    break  # the socket ran dry
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
            senders = self._on_datagrams(slots[:k], lengths[:k], ce[:k]) if k else None
            self._rx_holding = False
            if overflows != self.stats.rx_overflows:
                # SO_RXQ_OVFL counts dropped socket-buffer entries; with GRO one entry holds a
                # whole read's worth of datagrams, so scale by what a read held in this batch.
                dropped = round((overflows - self.stats.rx_overflows) * per_read)
                if senders is not None:
                    self._on_overflow(dropped, senders)
                self.stats.rx_overflows = overflows
                self.stats.rx_dropped_estimate += dropped
            behind = k >= cfg.rx_batch or nbytes_batch >= batch_bytes  # ended full, not dry
            if behind:
                backlog = receive_backlog(sock)
                behind = backlog is None or backlog >= BEHIND_BACKLOG
            self._drain.batch(t_batch, nbytes_batch, behind, time.monotonic())
            self._release_delayed()

    def _on_overflow(self, dropped: int, senders: np.ndarray) -> None:
        """The kernel dropped datagrams: blame, in proportion, the senders whose packets in this
        batch were accepted (their tokens were right, so they authenticated); bytes a stranger
        wrote in a header blame nobody."""
        if not senders.size:
            return
        ranks, counts = np.unique(senders, return_counts=True)
        with self._lock:
            for rank, c in zip(ranks.tolist(), counts.tolist()):
                if rank in self._authed and rank != self.rank:
                    self._fb[rank][2] += max(1, round(dropped * c / senders.size))
        self._wake()  # congestion: the senders hear of it within a feedback interval

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

    def _on_datagrams(self, slots: np.ndarray, lengths: np.ndarray, ce: np.ndarray) -> np.ndarray:
        """Loss injection, then reassembly; returns the sender ranks of the datagrams accepted."""
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
            return self._ingest(slots, lengths, ce)
        return np.zeros(0, np.uint16)

    def _ingest(self, slots: np.ndarray, lengths: np.ndarray, ce: np.ndarray) -> np.ndarray:
        """Reassemble a batch; returns the sender ranks of the datagrams accepted."""
        now = time.monotonic()
        n = len(lengths)
        hdr = slots[:, : wire.HEADER_SIZE].view(wire.HEADER_DTYPE).reshape(n) if slots.shape[1] >= wire.HEADER_SIZE else None
        finished: list[tuple[InMessage, str]] = []
        senders = np.zeros(0, np.uint16)
        with self._lock:
            late_before = self.stats.late
            res = self.reassembler.ingest_batch(slots, lengths, park=lambda rows: self._park(slots, lengths, hdr, rows, now))
            self.stats.data_pkts_received += n
            self.stats.data_bytes_received += int(lengths.sum())
            n_ce = int(np.count_nonzero(ce))
            wake = False  # a timer became close: the control loop must tick fast
            self.stats.ce_marked += n_ce
            self.stats.parked += res.parked - (self.stats.late - late_before)
            if res.run:  # one in-order run of new packets of one message: no per-sender split
                msg = self._in.get(res.touched[0].key)
                rank = res.touched[0].key[0]
                self._senders_seen[rank] = now
                fb = self._fb[rank]
                fb[0] += n
                wake = n_ce > 0 and not fb[1]  # the first CE mark since the last report
                fb[1] += n_ce
                senders = np.full(n, rank, np.uint16)
                if msg is not None:
                    last = np.count_nonzero(slots[:, _FLAGS_BYTE] & _LAST) > 0
                    wake = wake or last
                    how = self._on_progress(msg, now, 0, last)
                    if how:
                        finished.append((msg, how))
            elif hdr is not None:
                good = res.reasons == 0
                senders = hdr["sender_rank"][good]
                marks = ce[good]
                for rank in np.unique(senders).tolist():
                    self._senders_seen[rank] = now
                    sel = senders == rank
                    fb = self._fb[rank]
                    fb[0] += int(sel.sum())
                    n_marks = int(marks[sel].sum())
                    wake = wake or (n_marks > 0 and not fb[1])
                    fb[1] += n_marks
                if res.touched:
                    retx_by_key: dict[tuple[int, int], int] = {}
                    lmask = good & ((hdr["flags"] & int(wire.Flags.LAST)) != 0)
                    last_keys = set(zip(hdr["sender_rank"][lmask].tolist(), hdr["message_id"][lmask].tolist()))
                    wake = wake or bool(last_keys)
                    rmask = good & ((hdr["flags"] & int(wire.Flags.RETX)) != 0)
                    if rmask.any():
                        for s_, m_ in zip(hdr["sender_rank"][rmask].tolist(), hdr["message_id"][rmask].tolist()):
                            retx_by_key[(s_, m_)] = retx_by_key.get((s_, m_), 0) + 1
                    for asm in res.touched:
                        msg = self._in.get(asm.key)
                        if msg is None:
                            continue
                        how = self._on_progress(msg, now, retx_by_key.get(asm.key, 0), asm.key in last_keys)
                        if how:
                            finished.append((msg, how))
            for msg, how in finished:
                self._complete_locked(msg, how)
        for msg, _ in finished:
            self._send_stop(msg)
        if wake:
            self._wake()
        return senders

    def _on_progress(self, msg: InMessage, now: float, n_retx: int, last: bool) -> str | None:
        """A batch brought ``msg`` new packets (``n_retx`` of them retransmitted; ``last``: one
        carried the end of the sender's pass). Returns how it completes now, or None (lock held)."""
        asm = msg.assembly
        msg.last_arrival = now
        if msg.first_arrival is None:
            msg.first_arrival = now
        if last:  # the sender's pass ended: answer as to a PROBE
            msg.probe_pending = True
        if n_retx and msg.bitmap_sent_at is not None:
            sample = now - msg.bitmap_sent_at
            old = self._srtt.get(msg.src)
            self._srtt[msg.src] = sample if old is None else 0.875 * old + 0.125 * sample
            msg.bitmap_sent_at = None
        msg.retx_seen += n_retx
        if asm.is_exact():
            return "exact"
        if msg.retx_seen and asm.is_complete(msg.loss_bound):
            return "bounded"  # recovery reached the bound: stop now
        return None

    def _park(self, slots: np.ndarray, lengths: np.ndarray, hdr: np.ndarray, rows: np.ndarray, now: float) -> np.ndarray:
        """Keep early data of authenticated peers until its META arrives (at most
        ``park_limit`` per sender, so one sender cannot crowd out another's early packets).
        The reassembler has checked the rows' tokens (``_park_token``): nothing forged or from
        an unauthenticated rank gets here."""
        kept = np.zeros(len(rows), dtype=bool)
        known = self._authed
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

    def _replay(self, datagrams: list[bytes]) -> None:
        """Ingest datagrams that were parked before their message was known."""
        slots = np.zeros((len(datagrams), max(len(d) for d in datagrams)), dtype=np.uint8)
        for i, d in enumerate(datagrams):
            slots[i, : len(d)] = np.frombuffer(d, np.uint8)
        self._ingest(slots, np.array([len(d) for d in datagrams]), np.zeros(len(datagrams), dtype=bool))

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
        """Queue the STOP of a finished message and wake the control loop, which sends it (STOPs of
        messages finishing together share a frame)."""
        asm = msg.assembly
        body = wire.STOP_BODY.pack(asm.received_elems) + (b"" if asm.is_exact() else asm.missing_bitmap())
        self._queue_ctl(msg.src, wire.PacketType.STOP, msg.message_id, body)
        self._wake()

    # ------------------------------------------------------------------ drain
    def _rx_backlog(self) -> bool:
        """Datagrams still wait in the data socket, or in the receive thread's batch that it has
        read but not yet placed: the receiver is behind, so a bitmap now would list packets
        that have arrived. (A slow batch, 1 MB at MTU 9000, once made a bitmap list 32 packets
        the receiver held, and they were resent.)"""
        if self._rx_holding:
            return True
        try:
            return struct.unpack("i", fcntl.ioctl(self._udp, termios.FIONREAD, b"\0\0\0\0"))[0] > 0
        except (OSError, ValueError):
            return False

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
