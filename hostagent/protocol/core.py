"""The bounded-loss protocol of one endpoint, as a state machine without I/O.

:class:`ProtocolCore` holds every message's protocol state (deadlines, probes, bitmaps,
feedback, rate decisions). It never touches a socket, a thread or a clock: each call takes the
time ``now`` and what arrived (a control record, the data path's events), drives the data path
through the narrow :class:`~dlcp.hostagent.protocol.port.DataPort`, and leaves the control records to
send in an outbox; :meth:`ProtocolCore.handle_timer` says when it wants to be called again. The
endpoint's threads (:mod:`dlcp.hostagent.transport`, :mod:`dlcp.hostagent.control_path`) are thin drivers
around it, and tests drive it with a fake clock and an in-memory data path.

The protocol, sender S to receiver R, for one message:

1. S announces the message with a META (size, element type, loss bound p), or R already posted
   its size (``recv(..., expect=...)``) and there is no META. Data that comes before R knows the
   message is parked by the data path, not lost.
2. R's data path completes the message when every packet arrived (*exact*). The core completes
   it when at least (1-p) arrived and the sender's pass is over (an end of pass, LAST or PROBE,
   answered once the message is quiet) or nothing new came for the idle timeout (*bounded*).
   Missing elements read as zero; R sends STOP, with the bitmap of what is missing.
3. An end of pass below the bound is answered with a BITMAP; S resends just enough of the
   missing packets, most important first, at the top priority and in drop class 0, until STOP.
   A PROBE from S is only the fallback, when no answer came within the measured answer time.
4. R reports CE marks and its socket overruns in FEEDBACK every few milliseconds, with the rate
   it can drain; S's :class:`~dlcp.hostagent.ratecontrol.RateController` sets the pacing rate.
"""

from __future__ import annotations

import logging
from queue import Queue
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable
from typing import Any

import numpy as np

from dlcp.hostagent import auth, wire
from dlcp.hostagent.fusion import Layout
from dlcp.hostagent.messages import (Expect, MessageMismatch, MessageStats, PeerFailed, RateChange, RecvHandle,
                                     RecvResult, SendHandle, TransportClosed, TransportError, TransportTimeout)
from dlcp.hostagent.packetizer import MessageMeta, elems_per_packet
from dlcp.hostagent.policy import required_elements, retransmission_set
from dlcp.hostagent.protocol.incoming import (HOLE_CHECK_INTERVAL, Incoming, answer_due, answer_grace, overdue_holes,
                                              packet_gap)
from dlcp.hostagent.protocol.outgoing import Outgoing
from dlcp.hostagent.protocol.port import (DONE_HOW, STOP_SENT, DataPort, Event, EventKind, FeedbackCounts, RxBuffers,
                                          RxSpec, TxSpec)
from dlcp.hostagent.ratecontrol import CUT_HOLD_ANSWERS, CUT_HOLD_MIN_REPORTS, AnswerTimer, RateController, drain_share
from dlcp.hostagent.transport_config import EndpointStats, TransportConfig

log = logging.getLogger("dlcp.hostagent.transport")

MESSAGE_LOG = 4096  # finished messages whose figures an endpoint keeps (message_log)
RATE_LOG = 16384  # sending-rate changes an endpoint keeps (rate_log)
RECENT_DONE = 4096  # finished messages remembered, to answer a repeated PROBE
IDLE_TICK = 0.05  # the longest the timers wait between runs while a message is in flight (s)
#: The longest they wait with no message in flight and nothing to report (s). Why not IDLE_TICK:
#: each run costs the process ~0.2 ms of CPU (every peer's feedback asked of the data path),
#: 4-5 ms a second per idle group, taken from the training it shares the cores with; and
#: whatever needs the timers sooner wakes them: a message posted (Endpoint._wake_for_new_message),
#: a control record, a data-path event. (Early packets of a message not posted yet are reported
#: at the next run, within IDLE_SLEEP, or sooner when the message is posted.)
IDLE_SLEEP = 1.0
URGENT_TICK = 0.001  # how soon an answer held for a reader that is behind is looked at again (s)
HELLO, HELLO_REPLY = 1, 2  # message ids of the FEEDBACK that opens a control connection, and its answer
#: Message id of the FEEDBACK a sender sends its receiver when its rate towards it reaches its line
#: rate (flag AT_LINE_RATE) or leaves it (flag clear): see :meth:`ProtocolCore._feedback_interval`.
LINE_RATE = 3
ACTIVE_WINDOW = 0.05  # a sender counts as active for the drain share this long after its last packet


#: Data path events that only end messages: they move no deadline earlier (see
#: :meth:`ProtocolCore.on_events`).
ENDING_EVENTS = frozenset({EventKind.RX_DONE, EventKind.TX_STOP})
#: Events about one received (RX_*) or sent (TX_*) message, which matter to the timers only while
#: that message is still going on (a sent one: and not in a pass, whose end comes as TX_PASS).
RX_EVENTS = frozenset({EventKind.RX_DONE, EventKind.RX_LAST, EventKind.RX_RETX})
TX_EVENTS = frozenset({EventKind.TX_PASS, EventKind.TX_ACTIVE, EventKind.TX_STOP})
#: Control records that set no deadline: a FEEDBACK changes rates, a STOP ends a send (see
#: :meth:`ProtocolCore.on_record`).
RECORDS_WITHOUT_DEADLINES = frozenset({wire.PacketType.FEEDBACK, wire.PacketType.STOP})


class ReaderMark:
    """How far the receive thread has read (``rx_seen_until``), taken at most once per timer run
    and only when an answer or a hole report hangs on it.

    Why lazy: the timer runs at every data-path event, and the read takes the receive thread's
    lock and a system call, while most runs judge no answer. Why the progress is read again
    after it: everything that arrived before the mark is then in the message's progress. Read
    the other way round, the receive thread could take packets from the socket in between, and
    an answer judged on the later mark listed them as missing from the earlier progress
    (captured at a testbed receiver: a bitmap sent 0.75 ms after both packets it listed had
    arrived, both then resent)."""

    def __init__(self, port: DataPort) -> None:
        self.port = port
        self.mark: float | None = None
        self.refreshed: set[tuple[int, int]] = set()

    def seen_until(self, msg: Incoming) -> float:
        """The mark, with ``msg``'s progress read after it."""
        if self.mark is None:
            self.mark = self.port.rx_seen_until()
        if msg.key not in self.refreshed:
            self.refreshed.add(msg.key)
            p = self.port.progress(msg.src, msg.message_id)
            if p is not None:
                msg.update(p)
        return self.mark


class ProtocolCore:
    """Every message of one endpoint, both directions. Not thread-safe: the driver serialises calls.

    Args:
        config: the endpoint's configuration.
        port: the data path.
        new_key: draws this endpoint's receive key for a sender (random; tests pass their own).
        startup_drain: bytes/s a new sender is offered before the drain was measured.
    """

    def __init__(self, config: TransportConfig, port: DataPort, new_key: Callable[[], bytes] = auth.new_key,
                 startup_drain: float = 0.0) -> None:
        self.config = config
        self.rank = config.rank
        self.policy = config.policy
        self.port = port
        self.new_key = new_key
        self.startup_drain = startup_drain
        self.stats = EndpointStats()
        self.out: dict[tuple[int, int], Outgoing] = {}
        self.inc: dict[tuple[int, int], Incoming] = {}
        self.waiting: dict[tuple[int, int], RecvHandle] = {}
        self.done_in: dict[tuple[int, int], RecvResult] = {}
        # key -> (elements held, the use's iteration): a PROBE of the same use is answered from it
        self.recent_done: OrderedDict[tuple[int, int], tuple[int, int]] = OrderedDict()
        self.announced: Queue | None = None
        self.rx_keys: dict[int, bytes] = {}  # sender rank -> our key for its tokens
        self.tx_keys: dict[int, bytes] = {}  # destination rank -> its key for our tokens
        self.authed: set[int] = set()
        self.rate: dict[int, RateController] = {}
        self.answer: dict[int, AnswerTimer] = {}  # sender side: how fast each destination answers a pass
        self.srtt: dict[int, float] = {}  # receiver side: bitmap to first retransmission, per sender
        self.fb: dict[int, FeedbackCounts] = defaultdict(FeedbackCounts)
        self.fb_sent_at: dict[int, float] = {}
        self.drain_sent: dict[int, int] = {}
        # receiver side: the senders that said their rate towards us is at their line rate;
        # sender side: the destinations we told so (LINE_RATE)
        self.sender_at_line: set[int] = set()
        self.told_at_line: set[int] = set()
        self.outbox: dict[int, list[bytes]] = defaultdict(list)
        # peer rank -> the last mismatch between us (either side refused): a peer that refused a
        # message usually fails and closes next, and the other messages with it then fail for
        # that closing; their errors name the mismatch, whichever frame the caller waits on first
        self.mismatch_with: dict[int, str] = {}
        self._order = 0
        self._deferred: dict[tuple[int, int], TxSpec] = {}
        self._last_rate: dict[int, float] = {}
        self.message_log: deque[MessageStats] = deque(maxlen=MESSAGE_LOG)
        """The figures of the last MESSAGE_LOG messages finished, both directions, with their
        monotonic times: what a report needs to say where an iteration's time went."""
        self.rate_log: deque[RateChange] = deque(maxlen=RATE_LOG)
        """The last RATE_LOG changes of a destination's pacing rate, with their cause."""

    # ------------------------------------------------------------------ keys
    def rx_key(self, rank: int) -> bytes:
        """This endpoint's receive key for sender ``rank`` (drawn once, kept for its lifetime)."""
        key = self.rx_keys.get(rank)
        if key is None:
            key = self.rx_keys[rank] = self.new_key()
        return key

    def peer_authenticated(self, rank: int, tx_key: bytes, rx_key: bytes | None = None) -> None:
        """The handshake with ``rank`` completed: the keys of both directions (derived by the
        handshake, :func:`dlcp.hostagent.auth.direction_key`; ``rx_key`` None: drawn here, as tests
        do), and it may send to us."""
        if rx_key is not None:
            self.rx_keys[rank] = rx_key
        self.tx_keys[rank] = tx_key
        self.authed.add(rank)
        self.port.set_keys(rank, self.rx_key(rank), tx_key)
        # a new connection (a peer that restarted knows nothing of what we told its predecessor)
        self.sender_at_line.discard(rank)
        self.told_at_line.discard(rank)
        if rank in self.rate:
            self._tell_line_rate(rank)

    def rx_token(self, src: int, message_id: int, iteration: int) -> int:
        """The ``token`` field a data packet of this message carries: :data:`dlcp.hostagent.auth.DATA_TOKEN`
        since the trailer's tag authenticates every packet (wire version 3)."""
        return auth.DATA_TOKEN

    # ------------------------------------------------------------------ records
    def queue(self, rank: int, ptype: wire.PacketType, message_id: int, body: bytes = b"",
              flags: wire.Flags = wire.Flags.NONE, **fields: Any) -> None:
        """Queue a control record for ``rank``; the driver sends a peer's records together."""
        fields.setdefault("priority", self.policy.top_priority)
        self.outbox[rank].append(wire.pack_record(wire.Header(
            ptype=ptype, job_id=self.config.job_id, message_id=message_id, sender_rank=self.rank, flags=flags,
            **fields), body))
        self.stats.ctl_records_sent[ptype.name] += 1

    def take_records(self, rank: int, now: float) -> list[bytes]:
        """Everything queued for ``rank``, with a FEEDBACK riding along when it has something to say."""
        records = self.outbox.pop(rank, [])
        if records:
            fb = self.feedback_record(rank, now, force=True)
            if fb is not None:
                records.append(fb)
        return records

    def ranks_with_records(self) -> list[int]:
        return [r for r, recs in self.outbox.items() if recs]

    # ------------------------------------------------------------------ sending
    def send(self, dest: int, data: np.ndarray, message_id: int, now: float, priority: int | None = None,
             loss_bound: float | None = None, iteration: int = 0, tensor_id: int = 0, layer: int = 0,
             layout: Layout | None = None, announce: bool = True, held: bool = False,
             snapshot: np.ndarray | None = None, defer: bool = False,
             drop_classes: np.ndarray | None = None, classify: bool = True) -> SendHandle:
        """Start sending ``data`` (see :meth:`dlcp.hostagent.transport.Endpoint.send`); with ``defer``
        the data path gets it only at :meth:`release`, once its META has left."""
        if dest == self.rank:
            raise ValueError("an endpoint does not send to itself")
        self.config.peer(dest)
        if priority is None:
            priority = layout.top_priority if layout is not None else self.policy.top_priority
        p = self.policy.loss_bound_push if loss_bound is None else loss_bound
        if not 0 <= p < 1:
            raise ValueError(f"loss_bound must be in [0, 1), got {p}")
        data = _wire_array(data)
        flat = data.reshape(-1)
        code = wire.dtype_code(data.dtype)
        if not 0 <= priority < self.policy.num_priorities:
            raise ValueError(f"priority {priority} is outside the policy's 0..{self.policy.num_priorities - 1}")
        MessageMeta(job_id=self.config.job_id, message_id=message_id, sender_rank=self.rank, iteration=iteration,
                    tensor_id=tensor_id, layer=layer, priority=priority)  # checks every field's range
        if flat.size > wire.FIELD_MAX["elem_offset"]:
            raise ValueError(f"message of {flat.size} elements is too large; split it below "
                             f"{wire.FIELD_MAX['elem_offset']} elements")
        per = elems_per_packet(self.config.mtu, data.dtype)
        n = -(-flat.size // per)
        pkt_prio = pkt_layer = None
        if layout is not None and layout.total != flat.size:
            raise ValueError(f"layout covers {layout.total} elements; the message has {flat.size}")
        if layout is not None and not layout.uniform(priority, layer):
            prio, layers = layout.packet_tags(per)
            if n and (prio.min() < 0 or prio.max() >= self.policy.num_priorities):
                raise ValueError(f"packet priorities outside the policy's 0..{self.policy.num_priorities - 1}")
            pkt_prio = np.array(prio, dtype=np.uint8)  # (the layout's own copy is read-only)
            pkt_layer = np.ascontiguousarray(layers % 65536, dtype=np.uint16)
        if snapshot is not None and (snapshot.dtype != flat.dtype or snapshot.size < flat.size
                                     or not snapshot.flags.c_contiguous):
            raise ValueError("snapshot must be a contiguous array of the message's type and size")
        if drop_classes is not None:
            drop_classes = np.asarray(drop_classes)
            if drop_classes.shape != (n,) or (n and (drop_classes.min() < 0
                                                    or drop_classes.max() >= self.policy.num_drop_classes)):
                raise ValueError(f"drop_classes must give each of the {n} packets a class in "
                                 f"0..{self.policy.num_drop_classes - 1}")
        key = (dest, message_id)
        if key in self.out:
            raise ValueError(f"message {message_id} to rank {dest} is already in flight")
        tx_key = self.tx_keys.get(dest)
        if tx_key is None:
            raise PeerFailed(f"rank {self.rank}: no authenticated control connection to rank {dest}")
        token = auth.DATA_TOKEN  # (the trailer's tag authenticates each packet)
        self._order += 1
        classes = np.zeros(n, np.uint8) if drop_classes is None else drop_classes.astype(np.uint8)
        msg = Outgoing(dest, message_id, flat.size, per, flat.itemsize, p, priority,
                       now + self.config.message_deadline, self._order, classes, held, now, snapshot, iteration,
                       int(code))
        self.out[key] = msg
        self._rate_for(dest, now)
        if announce:
            self.queue_meta(dest, message_id, flat.size, data.dtype, p, priority, iteration, tensor_id, layer)
        spec = TxSpec(dest, message_id, flat, int(code), per, token, iteration, tensor_id, layer % 65536, priority,
                      pkt_prio, pkt_layer, msg.drop_class, snapshot, held, self._order,
                      drop_classes is not None or not classify)  # (given: class 0 unless the caller's)
        if defer and not held:
            self._deferred[key] = spec  # submitted when the batch's METAs have left
        else:
            self.port.submit(spec)
        return msg.handle

    def queue_meta(self, dest: int, message_id: int, total_elems: int, dtype: Any, loss_bound: float,
                   priority: int, iteration: int, tensor_id: int, layer: int) -> None:
        per = elems_per_packet(self.config.mtu, dtype)
        self.queue(dest, wire.PacketType.META, message_id, wire.META_BODY.pack(total_elems, per, loss_bound),
                   priority=priority, iteration=iteration, tensor_id=tensor_id, layer=layer % 65536,
                   dtype=wire.dtype_code(dtype), total_pkts=-(-total_elems // per))

    def release(self, keys: list[tuple[int, int]]) -> None:
        """Hand the deferred sends ``keys`` to the data path (the driver flushed their METAs)."""
        for key in keys:
            spec = self._deferred.pop(key, None)
            if spec is not None and key in self.out:
                self.port.submit(spec)

    def _rate_for(self, dest: int, now: float) -> RateController:
        rc = self.rate.get(dest)
        if rc is None:
            rc = self.rate[dest] = RateController(self.config.rate)
            self._note_rate(dest, now, "start")
        return rc

    # ------------------------------------------------------------------ receiving
    def recv(self, src: int, message_id: int, now: float, out: np.ndarray | None = None,
             expect: Expect | None = None, accumulate: bool = False) -> RecvHandle:
        """Ask for a message (see :meth:`dlcp.hostagent.transport.Endpoint.recv`)."""
        self.config.peer(src)
        key = (src, message_id)
        if expect is not None:
            return self._recv_expected(src, message_id, out, expect, now)
        if key in self.done_in:
            h = RecvHandle(src, message_id, out)
            res = self.done_in.pop(key)
            if out is not None:
                try:
                    res = _deliver_into(out, accumulate, res, src, message_id)
                except ValueError as exc:
                    h._fail(exc)
                    return h
            h._resolve(res)
            return h
        if key in self.waiting or (key in self.inc and self.inc[key].handle is not None):
            raise ValueError(f"message {message_id} from rank {src} is already being received")
        h = RecvHandle(src, message_id, out, accumulate)
        if key in self.inc:
            self.inc[key].handle = h  # announced already: ``out`` is filled at the end
        else:
            self.waiting[key] = h
        return h

    def _recv_expected(self, src: int, message_id: int, out: np.ndarray | None, expect: Expect,
                       now: float) -> RecvHandle:
        key = (src, message_id)
        if key in self.waiting or key in self.inc or key in self.done_in:
            raise ValueError(f"message {message_id} from rank {src} is already being received")
        dtype = np.dtype(expect.dtype).newbyteorder("=")
        code = wire.dtype_code(dtype)
        per = elems_per_packet(self.config.mtu, dtype)
        h = RecvHandle(src, message_id, out, expect.accumulate)
        self._setup_in(src, message_id, expect.total_elems, int(code), per, expect.loss_bound,
                       self.policy.top_priority, expect.iteration, h, out, expect.accumulate, expect.then_send, now,
                       scale=expect.scale, classify=expect.classify)
        return h

    def _setup_in(self, src: int, message_id: int, total: int, code: int, per: int, loss_bound: float,
                  priority: int, iteration: int, handle: RecvHandle | None, out: np.ndarray | None,
                  accumulate: bool, triggers: tuple[tuple[int, int], ...], now: float,
                  scale: float = 1.0, classify: bool = True) -> Incoming:
        """Set a message up for receiving (from a META or an expect); raises ValueError for bad sizes."""
        if scale != 1.0 and (not accumulate or out is None or out.dtype != np.float32
                             or code != int(wire.Dtype.FLOAT32)):
            raise ValueError("a scaled receive needs a float32 message added into a float32 out")
        if not 0 <= total <= wire.FIELD_MAX["elem_offset"]:
            raise ValueError(f"total_elems={total} outside 0..{wire.FIELD_MAX['elem_offset']}")
        if not 1 <= per <= wire.FIELD_MAX["elem_count"]:
            raise ValueError(f"elems_per_packet={per} outside 1..{wire.FIELD_MAX['elem_count']}")
        wire_dtype = wire.NUMPY_DTYPES[wire.Dtype(code)].newbyteorder("=")
        dest = wire.destination_dtypes(wire_dtype, accumulate)
        if out is None:
            out = np.zeros(total, dtype=dest[0])
        elif out.shape != (total,) or out.dtype not in dest or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"out must be a writable contiguous 1-D {' or '.join(map(str, dest))} array of {total} "
                             f"elements, got shape {out.shape} dtype {out.dtype}")
        n = -(-total // per)
        buffers = RxBuffers.allocate(out, n, priority)
        msg = Incoming(src, message_id, total, per, code, loss_bound, now + self.config.message_deadline, handle,
                       priority, buffers, accumulate, iteration, now)
        key = (src, message_id)
        self.inc[key] = msg
        self.recent_done.pop(key, None)
        self.port.expect(RxSpec(src, message_id, self.rx_token(src, message_id, iteration), code, total, per,
                                buffers, accumulate, required_elements(total, loss_bound), tuple(triggers), scale,
                                iteration, classify))
        return msg

    def announcements(self) -> Queue[tuple[int, int]]:
        """(src, message id) of every message announced without a waiting recv."""
        if self.announced is None:
            self.announced = Queue()
            for key, msg in self.inc.items():
                if msg.handle is None:
                    self.announced.put(key)
            for key in self.done_in:
                self.announced.put(key)
        return self.announced

    def _finish(self, msg: Incoming, how: str, now: float, stop_sent: bool = False) -> None:
        """A received message is done (the data path places nothing more of it); its sender is
        told with a STOP record unless ``stop_sent`` (the data path sent it a STOP datagram)."""
        key = msg.key
        p = self.port.progress(*key)
        if p is not None:
            msg.update(p)
        del self.inc[key]
        self.port.forget(*key, remember=True)
        result = msg.result(how, now)
        self.stats.messages_received += 1
        self.message_log.append(result.stats)
        self.recent_done[key] = (msg.received_elems, msg.iteration)
        while len(self.recent_done) > RECENT_DONE:
            self.recent_done.popitem(last=False)
        if not stop_sent:
            body = wire.STOP_BODY.pack(msg.received_elems) + (b"" if msg.is_exact() else msg.missing_bitmap())
            self.queue(msg.src, wire.PacketType.STOP, msg.message_id, body, iteration=msg.iteration)
        h = msg.handle
        if h is None:
            self.done_in[key] = result
            return
        if h.out is not None and h.out is not result.data:
            # announced before its recv was posted: received into a buffer of its own, now
            # copied or added into ``out``
            try:
                result = _deliver_into(h.out, h.accumulate, result, msg.src, msg.message_id)
            except ValueError as exc:
                h._fail(exc)
                return
        h._resolve(result)

    def _complete(self, msg: Incoming, how: str, now: float) -> None:
        """Complete a message under its bound (the data path stops placing it, starts its triggers)."""
        if self.port.complete(msg.src, msg.message_id, True):
            self._finish(msg, how, now)
        # else the data path completed it first: its RX_DONE event finishes it

    # ------------------------------------------------------------------ inputs: records
    def on_record(self, h: wire.Header, body: bytes, now: float) -> bool:
        """A control record from an authenticated peer (META, PROBE, STOP, BITMAP, NACK or
        FEEDBACK). Returns whether the timers should run now: not for a record that sets no
        deadline (:data:`RECORDS_WITHOUT_DEADLINES`; see :meth:`on_events` for why)."""
        self._apply_record(h, body, now)
        return h.ptype not in RECORDS_WITHOUT_DEADLINES

    def _apply_record(self, h: wire.Header, body: bytes, now: float) -> None:
        t, src = h.ptype, h.sender_rank
        key = (src, h.message_id)
        if t == wire.PacketType.META:
            self._on_meta(h, body, now)
            return
        if t == wire.PacketType.FEEDBACK:
            self._on_feedback(h, body, now)
            return
        # The rest name one use of a message: ids repeat every 1,024 calls, so a record of
        # another use (a late answer, a probe of a sender ahead) must not act on this one.
        if t == wire.PacketType.PROBE:
            msg = self.inc.get(key)
            if msg is not None and msg.iteration != h.iteration:
                self.stats.records_of_another_use += 1
                msg = None  # a use not set up here: as a PROBE of an unknown message
            if msg is not None:
                theirs = (int(h.dtype), h.elem_offset, h.elem_count)
                if not shapes_agree(theirs, (msg.dtype_code, msg.total_elems, msg.elems_per_packet)):
                    self._refuse(msg, theirs)
                    return
                msg.ask(now)
                msg.probes += 1
                return
            done = self.recent_done.get(key)
            if done is None or done[1] != h.iteration:
                # Not known (yet): a receiver that posts its recv later (expect=) will know it;
                # the sender probes again after its timeout, and its deadline bounds the wait.
                # (A use of the id that finished is not this one: ids repeat every 1,024 calls,
                # and a sender ahead probes the next use before it is set up here. Answered from
                # the finished use, its STOP ended a send whose data never came.)
                self.stats.probes_unknown += 1
                return
            self.queue(src, wire.PacketType.STOP, h.message_id, wire.STOP_BODY.pack(done[0]), iteration=h.iteration)
            return
        sending = self.out.get(key)
        if sending is not None and sending.iteration != h.iteration:
            self.stats.records_of_another_use += 1
            return
        if t == wire.PacketType.STOP and h.flags & wire.Flags.MISMATCH:
            self._on_refusal(h)
        elif t == wire.PacketType.STOP:
            (held,) = wire.STOP_BODY.unpack_from(body)
            self._on_stop(src, h.message_id, held, body[wire.STOP_BODY.size:], now)
        elif t == wire.PacketType.BITMAP:
            self._on_bitmap(src, h.message_id, body, now)
        elif t == wire.PacketType.NACK:
            self._on_nack(src, h.message_id, body, now)

    def _on_meta(self, h: wire.Header, body: bytes, now: float) -> None:
        total, per, p = wire.META_BODY.unpack_from(body)
        src, key = h.sender_rank, (h.sender_rank, h.message_id)
        if key in self.inc:
            log.warning("rank %d: duplicate META for message %d from rank %d ignored", self.rank, h.message_id, src)
            return
        handle = self.waiting.pop(key, None)
        out = handle.out if handle is not None else None
        accumulate = handle.accumulate if handle is not None else False
        if not 0 <= p < 1:
            if handle:
                handle._fail(ValueError(f"message {h.message_id} from rank {src} announced loss bound {p}"))
            log.warning("rank %d: META from rank %d with loss bound %r ignored", self.rank, src, p)
            return
        dtype = wire.NUMPY_DTYPES[h.dtype].newbyteorder("=")
        want = wire.destination_dtypes(dtype, accumulate)
        if handle is not None and out is not None and (out.shape != (total,) or out.dtype not in want):
            handle._fail(ValueError(f"message {h.message_id} from rank {src} has {total} {dtype}; "
                                    f"out is {out.shape} {out.dtype}"))
            handle, out, accumulate = None, None, False
        try:
            self._setup_in(src, h.message_id, total, int(h.dtype), per, p, h.priority, h.iteration, handle, out,
                           accumulate, (), now)
        except ValueError as exc:
            if handle:
                handle._fail(exc)
            log.warning("rank %d: bad META from rank %d: %s", self.rank, src, exc)
            return
        if handle is None and self.announced is not None:
            self.announced.put(key)

    def _refuse(self, msg: Incoming, theirs: tuple[int, int, int]) -> None:
        """The sender's PROBE states another shape than this receive expects: every packet of
        it was being rejected (wrong type, count or offsets) and would be until the deadline.
        Fail the receive now and tell the sender, whose send fails alike (:meth:`_on_refusal`)."""
        mine = (msg.dtype_code, msg.total_elems, msg.elems_per_packet)
        del self.inc[msg.key]
        self.port.forget(*msg.key, remember=False)
        self.stats.messages_refused += 1
        what = (f"message {msg.message_id} from rank {msg.src}: rank {msg.src} sends "
                f"{wire.describe_shape(*theirs)}, this rank expects {wire.describe_shape(*mine)}"
                f"{_mismatch_hint(theirs, mine)}")
        self.mismatch_with[msg.src] = what
        if msg.handle:
            msg.handle._fail(MessageMismatch(f"rank {self.rank}: {what}"))
        self.queue(msg.src, wire.PacketType.STOP, msg.message_id, wire.STOP_BODY.pack(0), flags=wire.Flags.MISMATCH,
                   iteration=msg.iteration, **wire.shape_fields(*mine))

    def _on_refusal(self, h: wire.Header) -> None:
        """The receiver refused a message of ours: it expects another shape (:meth:`_refuse`)."""
        m = self.out.pop((h.sender_rank, h.message_id), None)
        if m is None:
            return
        self.port.retire(h.sender_rank, h.message_id)
        theirs = (int(h.dtype), h.elem_offset, h.elem_count)
        mine = (m.dtype_code, m.total_elems, m.elems_per_packet)
        what = (f"message {m.message_id} to rank {m.dest}: rank {m.dest} expects "
                f"{wire.describe_shape(*theirs)}, this rank sends {wire.describe_shape(*mine)}"
                f"{_mismatch_hint(mine, theirs)}")
        self.mismatch_with[m.dest] = what
        m.handle._fail(MessageMismatch(f"rank {self.rank}: {what}"))

    def _on_stop(self, src: int, message_id: int, held: int, missing: bytes, now: float) -> None:
        """The receiver of a message of ours has enough of it (``held`` elements; ``missing``:
        the bitmap of packets it went without, empty if none), by a STOP record or datagram."""
        m = self.out.pop((src, message_id), None)
        if m is None:
            return
        m.stopped = True
        self._rtt_sample(src, m, now)
        self._pass_losses(src, m, m.packets, 0, now)  # holes a NACK reported, all resent in time
        info = self.port.tx_info(src, message_id)
        self.port.retire(src, message_id)
        lost = 0.0 if m.total_elems == 0 else 1.0 - held / m.total_elems
        self.stats.messages_sent += 1
        stats = m.stats("stopped", lost, info.retransmissions if info else 0, now)
        self.message_log.append(stats)
        if missing:
            bits = np.unpackbits(np.frombuffer(missing, np.uint8))[: m.packets]
            stats.lost_packets = np.flatnonzero(bits)
        m.handle._resolve(stats)

    def _on_bitmap(self, src: int, message_id: int, body: bytes, now: float) -> None:
        (held,) = wire.BITMAP_PREFIX.unpack_from(body)
        bits = np.unpackbits(np.frombuffer(body, np.uint8, offset=wire.BITMAP_PREFIX.size))
        m = self.out.get((src, message_id))
        if m is None:
            return
        self._rtt_sample(src, m, now)
        n = m.packets
        missing = np.flatnonzero(bits[:n])
        seqs = retransmission_set(missing, m.drop_class, m.elem_counts(), held, m.total_elems, m.loss_bound)
        new_lost = max(0, len(missing) - m.reported_missing)
        m.reported_missing = len(missing)
        self._pass_losses(src, m, n - len(missing), new_lost, now)
        m.awaiting_reply = False
        m.probe_sent_at = None
        if len(seqs):
            if m.first_retx_at is None:
                m.first_retx_at = now
            m.begin_pass()
            self.port.retransmit(src, message_id, seqs.astype(np.int64))
        else:  # nothing needed (the receiver's count moved on): probe again right away
            m.pass_done_at = 0.0

    def _on_nack(self, src: int, message_id: int, body: bytes, now: float) -> None:
        """Holes the receiver found before the pass ended: resent at once, ahead of the rest of
        the pass (the data path resends only what the pass has sent); losses for the rate at
        the answer to the pass's end (:meth:`_pass_losses`)."""
        m = self.out.get((src, message_id))
        if m is None or m.stopped:
            return
        bits = np.unpackbits(np.frombuffer(body, np.uint8, offset=wire.BITMAP_PREFIX.size))[: m.packets]
        holes = np.flatnonzero(bits)
        n = self.port.resend(src, message_id, holes)
        self.stats.holes_resent += n
        m.holes_lost += n
        if n and m.first_retx_at is None:
            m.first_retx_at = now

    def _pass_losses(self, src: int, m: Outgoing, received: int, lost: int, now: float) -> None:
        """A pass's losses (the answer to its end, with the holes NACKs reported during it) cut
        the rate once, as one BITMAP's did before there were NACKs: a cut per NACK would halve a
        sender's rate several times a pass under random loss."""
        lost += m.holes_lost
        m.holes_lost = 0
        if lost:
            rc = self._rate_for(src, now)
            rc.sent = self.port.sent_packets(src)
            rc.on_feedback(received, 0, lost, now, timed=False)
            self._note_rate(src, now, "loss")

    def _on_feedback(self, h: wire.Header, body: bytes, now: float) -> None:
        received, marked, lost, share_kBps = wire.FEEDBACK_BODY.unpack_from(body)
        src = h.sender_rank
        if h.message_id == LINE_RATE:  # from a sender of ours: no report on what we sent it
            if h.flags & wire.Flags.AT_LINE_RATE:
                self.sender_at_line.add(src)
            else:
                self.sender_at_line.discard(src)
            return
        if h.message_id == HELLO:
            # A peer that just connected: tell it at once what we can drain, so its first data
            # already goes no faster than that.
            self.queue(src, wire.PacketType.FEEDBACK, HELLO_REPLY,
                       wire.FEEDBACK_BODY.pack(0, 0, 0, self.drain_share_kBps(now, new_sender=True)))
        rc = self._rate_for(src, now)
        rc.on_ceiling(share_kBps * 1000.0)
        self._note_rate(src, now, "ceiling")
        if received or lost:
            rc.sent = self.port.sent_packets(src)
            rc.on_feedback(received, marked, lost, now, hold=self._cut_hold(src))
            self._note_rate(src, now, "marks" if marked or lost else "increase")

    # ------------------------------------------------------------------ inputs: data path events
    def on_events(self, events: list[Event] | list[tuple], now: float) -> bool:
        """What the data path reported since the last call. Returns whether the timers should run
        now (:meth:`handle_timer`): not if every event ended its message, concerns one that has
        ended since (a pass's LAST that completed its message, a pass end whose STOP came with
        it), or started a held send's pass (whose end comes as an event of its own). An ended
        message takes its deadlines with it, the records its ending queues leave with the next
        flush, and the reports and expiries keep the times the last run set. Why it matters: the
        control thread holds the interpreter lock through a run, so the thread a completion woke
        waited for a pass over every message and peer (a tenth of a 1 MB all_reduce on 2 ranks)
        before it could return."""
        self._apply_events(events, now)
        for kind, peer, mid, _, _ in events:
            if kind in ENDING_EVENTS:
                continue
            if kind in RX_EVENTS:
                if (peer, mid) in self.inc:
                    return True
            elif kind in TX_EVENTS:
                m = self.out.get((peer, mid))
                if m is not None and not m.sending:  # (a held send that started: its pass's end will tell)
                    return True
            else:
                return True  # the peer's or the data path's news
        return False

    def _apply_events(self, events: list[Event] | list[tuple], now: float) -> None:
        for ev in events:
            kind, peer, mid, t, a = ev
            key = (peer, mid)
            if kind == EventKind.RX_DONE:
                msg = self.inc.get(key)
                if msg is not None:
                    self._finish(msg, DONE_HOW.get(a, "exact"), t, stop_sent=a == STOP_SENT)
            elif kind == EventKind.RX_LAST:
                msg = self.inc.get(key)
                if msg is not None:
                    msg.last_arrival = max(msg.last_arrival, t)
                    msg.ask(t)
            elif kind == EventKind.RX_RETX:
                msg = self.inc.get(key)
                if msg is not None:
                    if msg.bitmap_sent_at is not None:
                        sample = t - msg.bitmap_sent_at
                        old = self.srtt.get(peer)
                        self.srtt[peer] = sample if old is None else 0.875 * old + 0.125 * sample
                        msg.bitmap_sent_at = None
                    if msg.first_resend_at is None:
                        msg.first_resend_at = t
                    msg.retx_seen += a
            elif kind == EventKind.TX_PASS:
                m = self.out.get(key)
                if m is not None:
                    m.on_pass_done(a, t)
            elif kind == EventKind.TX_STOP:
                self._on_stop(peer, mid, a, b"", t)
            elif kind == EventKind.TX_ACTIVE:
                m = self.out.get(key)
                if m is not None:
                    m.held = False
                    # (a pass that already ended, an empty message's, stays ended: the
                    # message then waits for its STOP or probes, never for a pass)
                    m.sending = m.first_pass_ended_at is None
                    if m.activated_at is None:
                        m.activated_at = t

    # ------------------------------------------------------------------ inputs: time
    def handle_timer(self, now: float) -> float:
        """Answers to ends of pass, idle completion, probes, deadlines, feedback, parked data.

        Returns how long until it wants to run again: until its earliest deadline (an answer's
        grace, a probe, an idle timeout, a report, a message's deadline), at most IDLE_TICK while
        a message is in flight, IDLE_SLEEP while none is and no report is due. The data path's
        events and every control record call for a run at once besides.
        """
        wake = now + (IDLE_TICK if self.inc or self.out else IDLE_SLEEP)
        if self.inc:  # what moved since the last run (a run per event: most messages did not)
            for key, p in self.port.progress_changed().items():
                msg = self.inc.get(key)
                if msg is not None:
                    msg.update(p)
        reader = ReaderMark(self.port)
        for msg in list(self.inc.values()):
            if msg.dp_state:
                continue  # completed by the data path: its RX_DONE event finishes it
            if now > msg.deadline:
                del self.inc[msg.key]
                self.port.forget(msg.src, msg.message_id, remember=False)
                if msg.handle:
                    msg.handle._fail(TransportTimeout(
                        f"rank {self.rank}: message {msg.message_id} from rank {msg.src} missed its "
                        f"{self.config.message_deadline:g} s deadline with "
                        f"{msg.received_elems / max(1, msg.total_elems):.1%} received"))
                continue
            wake = min(wake, msg.deadline)
            if msg.holes_to_look_for:
                wake = min(wake, self._look_for_holes(msg, now, reader))
            if msg.probe_pending:
                floor = self.port.reorder_window(msg.src)
                due = msg.last_arrival + answer_grace(floor, msg)
                if now < due:
                    wake = min(wake, due)
                    continue
                seen_until = reader.seen_until(msg)  # (may move last_arrival: due again)
                if msg.dp_state:
                    continue
                due = msg.last_arrival + answer_grace(floor, msg)
                if now < due:
                    wake = min(wake, due)
                    continue
                if not answer_due(msg, now, floor, seen_until):
                    wake = min(wake, now + URGENT_TICK)  # the reader is behind: look again shortly
                    continue
                msg.probe_pending = False
                msg.probe_since = None
                if msg.is_complete():
                    self._complete(msg, "exact" if msg.is_exact() else "bounded", now)
                else:
                    self.queue(msg.src, wire.PacketType.BITMAP, msg.message_id,
                               wire.BITMAP_PREFIX.pack(msg.received_elems) + msg.missing_bitmap(),
                               iteration=msg.iteration)
                    msg.bitmap_sent_at = now
                    if msg.first_bitmap_at is None:
                        msg.first_bitmap_at = now
                        msg.pace = packet_gap(msg)  # the first pass's; recovery waits are not its pace
                continue
            if msg.loss_bound > 0 and msg.received_pkts:  # (a bound of 0 completes only exact, in the data path)
                due = msg.last_arrival + max(self.config.idle_timeout, 8 * self.srtt.get(msg.src, 0.0))
                if now >= due and msg.is_complete():
                    self._complete(msg, "idle", now)
                else:
                    wake = min(wake, due if due > now else now + self.config.idle_timeout)
        for key, m in list(self.out.items()):
            if now > m.deadline:
                del self.out[key]
                info = self.port.tx_info(*key)
                self.port.retire(*key)
                peer = self.config.peer(m.dest)
                sent = f"{info.next_pos}/{info.packets}" if info else f"?/{m.packets}"
                m.handle._fail(TransportTimeout(
                    f"rank {self.rank}: message {m.message_id} to rank {m.dest} ({peer.host}:{peer.data_port}) "
                    f"missed its {self.config.message_deadline:g} s deadline ({sent} packets sent, {m.probes} "
                    f"probes, {info.retransmissions if info else 0} retransmitted)"))
                continue
            wake = min(wake, m.deadline)
            if m.stopped or m.held or m.sending:
                continue
            timer = self.answer_timer(m.dest)
            if not m.awaiting_reply:
                # A STOP usually arrives within a round trip, so a PROBE before then would be wasted.
                if m.pass_done_at is None:
                    continue
                due = m.pass_done_at + timer.probe_delay()
                if now < due:
                    wake = min(wake, due)
                    continue
                m.awaiting_reply = True
            elif m.probe_sent_at is not None and now < m.probe_sent_at + timer.reprobe_timeout():
                wake = min(wake, m.probe_sent_at + timer.reprobe_timeout())
                continue
            # the first probe, or no answer to the last one (the receiver did not know the message yet)
            m.probe_sent_at = now
            m.probes += 1
            self.queue(m.dest, wire.PacketType.PROBE, m.message_id, iteration=m.iteration,
                       **wire.shape_fields(m.dtype_code, m.total_elems, m.elems_per_packet))
            wake = min(wake, now + timer.reprobe_timeout())
        for rank in sorted(self.authed):
            if rank == self.rank:
                continue
            rec, report_due = self._feedback(rank, now, force=False)
            if rec is not None:
                self.outbox[rank].append(rec)
            if report_due is not None:
                wake = min(wake, report_due)
        if any(src not in self.sender_at_line for src, _ in self.inc):
            # data streams in without events: its clean reports are due every bulk interval
            wake = min(wake, now + self.config.bulk_feedback_interval)
        self.port.expire_parked(now - self.config.message_deadline)
        return max(0.0, wake - now)

    def _look_for_holes(self, msg: Incoming, now: float, reader: ReaderMark) -> float:
        """A reliable message in its first pass: report the holes that stayed open for a
        reordering window (HOLE_CHECK_INTERVAL, :func:`overdue_holes`) in a NACK. Returns when
        to look again."""
        window = self.port.reorder_window(msg.src)
        every = max(window, HOLE_CHECK_INTERVAL)
        if msg.holes_looked_at is not None:
            if now < msg.holes_looked_at + every:
                return msg.holes_looked_at + every
            if reader.seen_until(msg) < msg.holes_looked_at + window:  # the reader is behind: look again shortly
                return now + URGENT_TICK
        holes = self.port.holes(msg.src, msg.message_id)
        if msg.holes_looked_at is not None:
            report = overdue_holes(msg.holes_seen, holes, msg.holes_reported)
            if len(report):
                if msg.holes_reported is None:
                    msg.holes_reported = np.zeros(msg.total_pkts, bool)
                msg.holes_reported[report] = True
                bits = np.zeros(msg.total_pkts, np.uint8)
                bits[report] = 1
                self.queue(msg.src, wire.PacketType.NACK, msg.message_id,
                           wire.BITMAP_PREFIX.pack(msg.received_elems) + np.packbits(bits).tobytes(),
                           iteration=msg.iteration)
                self.stats.holes_reported += len(report)
        msg.holes_seen, msg.holes_looked_at, msg.gaps_at_look = holes, now, msg.gaps
        return now + every

    # ------------------------------------------------------------------ inputs: peers
    def loss_reason(self, rank: int, why: str) -> str:
        """Why ``rank`` is lost, as every error about it says: ``why`` (its connection closed),
        and the mismatch between us that most likely made it leave, if one came first."""
        if rank in self.mismatch_with:
            return f"{why} (after a mismatch: {self.mismatch_with[rank]})"
        return why

    def peer_failed(self, rank: int, why: str) -> bool:
        """``rank``'s control connection is gone: fail every message to or from it. Returns
        whether any was in flight."""
        peer = self.config.peer(rank)
        where = f"peer rank {rank} ({peer.host}:{peer.control_port})"
        why = self.loss_reason(rank, why)
        in_flight = any(k[0] == rank for k in [*self.out, *self.inc, *self.waiting])
        for key in [k for k in self.out if k[0] == rank]:
            m = self.out.pop(key)
            self.port.retire(*key)
            m.handle._fail(PeerFailed(f"rank {self.rank}: {where} {why} while sending message {key[1]}"))
        for key in [k for k in self.inc if k[0] == rank]:
            inc = self.inc.pop(key)
            self.port.forget(*key, remember=False)
            if inc.handle:
                inc.handle._fail(PeerFailed(f"rank {self.rank}: {where} {why} while receiving message {key[1]}"))
        for key in [k for k in self.waiting if k[0] == rank]:
            self.waiting.pop(key)._fail(PeerFailed(f"rank {self.rank}: {where} {why} before announcing message "
                                                   f"{key[1]}"))
        self.outbox.pop(rank, None)
        return in_flight

    def peer_lost(self, rank: int) -> None:
        """No authenticated connection with ``rank`` remains: nothing more of it is parked."""
        self.authed.discard(rank)
        self.port.set_keys(rank, None, None)

    def close(self, error: TransportError) -> None:
        """Fail everything still in flight and retire it from the data path."""
        for key, m in list(self.out.items()):
            self.port.retire(*key)
            m.handle._fail(error)
        for key, inc in list(self.inc.items()):
            self.port.forget(*key, remember=False)
            if inc.handle:
                inc.handle._fail(error)
        for h in self.waiting.values():
            h._fail(error)
        self.out.clear()
        self.inc.clear()
        self.waiting.clear()

    # ------------------------------------------------------------------ rates, timing, feedback
    def answer_timer(self, dest: int) -> AnswerTimer:
        timer = self.answer.get(dest)
        if timer is None:
            cfg = self.config
            timer = self.answer[dest] = AnswerTimer(cfg.probe_delay, cfg.probe_delay_min, cfg.probe_delay_max)
            self.port.set_probe_delay(dest, timer.probe_delay())
        return timer

    def _rtt_sample(self, dest: int, m: Outgoing, now: float) -> None:
        """Sender side: time from the end of a pass (or from a probe) to the receiver's answer."""
        since = m.probe_sent_at if m.probe_sent_at is not None else m.pass_done_at
        if since is None or since <= 0:
            return
        timer = self.answer_timer(dest)
        timer.sample(now - since)
        self.port.set_probe_delay(dest, timer.probe_delay())  # (a pass's end is held back until then)

    def _cut_hold(self, dest: int) -> float:
        """Longest a rate cut towards ``dest`` waits for its window to be reported
        (:meth:`RateController.on_feedback`): a few smoothed answer times (a round trip with its
        queue; ``probe_delay`` before any), at least a few feedback intervals."""
        timer = self.answer.get(dest)
        rtt = timer.srtt if timer is not None and timer.srtt is not None else self.config.probe_delay
        return max(CUT_HOLD_MIN_REPORTS * self.config.feedback_interval, CUT_HOLD_ANSWERS * rtt)

    def _note_rate(self, dest: int, now: float, cause: str) -> None:
        """Hand the pacing rate towards ``dest`` to the data path, and log it, if it changed."""
        rate = self.rate[dest].effective_rate
        if rate != self._last_rate.get(dest):
            self._last_rate[dest] = rate
            self.rate_log.append(RateChange(now, dest, rate, cause))
            self.port.set_rate(dest, rate)
            self._tell_line_rate(dest)

    def _tell_line_rate(self, dest: int) -> None:
        """Tell ``dest`` (a LINE_RATE FEEDBACK) when our rate towards it reached the line rate or
        fell below it, once per change: a receiver sends a sender at its line rate no reports
        without congestion every ``bulk_feedback_interval`` (see :meth:`_feedback_interval`)."""
        at_line = self.rate[dest].effective_rate >= self.config.rate.line_rate
        if at_line != (dest in self.told_at_line) and dest in self.authed:
            (self.told_at_line.add if at_line else self.told_at_line.discard)(dest)
            self.queue(dest, wire.PacketType.FEEDBACK, LINE_RATE, wire.FEEDBACK_BODY.pack(0, 0, 0, 0),
                       flags=wire.Flags.AT_LINE_RATE if at_line else wire.Flags.NONE)

    def drain_share_kBps(self, now: float, new_sender: bool = False) -> int:
        """The drain ceiling for each current sender, KB/s, as FEEDBACK carries it (0 = none):
        the measured drain shared among the senders seen in the last ACTIVE_WINDOW; for a
        ``new_sender`` before anything was measured, the start-up estimate shared among every
        authenticated peer (peers of a collective connect together, then all send at once)."""
        active = self.port.active_senders(now, ACTIVE_WINDOW)
        if new_sender:
            active = max(active, len(self.authed) - 1)  # the new one is counted by drain_share
        share = drain_share(self.port.drain_rate(now), self.startup_drain, active, new_sender)
        return 0 if share <= 0 else max(1, min(wire.FIELD_MAX["job_id"], int(share / 1000)))

    def _feedback_interval(self, counts: FeedbackCounts, rank: int, now: float) -> tuple[float, int]:
        """How long a report to ``rank`` may wait after the previous one, and the drain share it
        carries: congestion (CE marks, socket overruns, a new or much lower drain share, which
        the sender must heed) every ``feedback_interval``; a clean report every
        ``bulk_feedback_interval`` once ``bulk_feedback_packets`` arrived (a long transfer, whose
        sender grows its rate on these reports), else every ``clean_feedback_interval``; and that
        too for a sender that said it is at its line rate (LINE_RATE), which clean reports cannot
        grow. Why: on loopback every sender is at its line rate (a 57 MB all_reduce was 6 report
        frames per call and rank, each a wake-up and a frame at both ends) and a backend's
        collective is paced by its receivers' credits, not by rates."""
        share = self.drain_share_kBps(now)
        last = self.drain_sent.get(rank, 0)
        if counts.marked or counts.lost or (share and (not last or share < 0.8 * last)):
            return self.config.feedback_interval, share
        if counts.received >= self.config.bulk_feedback_packets and rank not in self.sender_at_line:
            return self.config.bulk_feedback_interval, share
        return self.config.clean_feedback_interval, share

    def feedback_record(self, rank: int, now: float, force: bool) -> bytes | None:
        """A FEEDBACK record for sender ``rank`` if one is due (see :meth:`_feedback_interval`),
        resetting its counters; with ``force`` at once (another record is leaving for that peer
        anyway, so it rides along for free)."""
        return self._feedback(rank, now, force)[0]

    def _feedback(self, rank: int, now: float, force: bool) -> tuple[bytes | None, float | None]:
        """:meth:`feedback_record`, and when the next report to ``rank`` is due if none leaves now
        (None: nothing to report). One pass for both: the interval asks the data path for the
        drain share (two calls into it, each a hand-over of the interpreter lock), and the
        timers run this for every peer on every run."""
        if rank in self.authed:
            self.fb[rank].add(self.port.take_feedback(rank))
        counts = self.fb.get(rank)
        if not counts:
            return None, None
        sent_at = self.fb_sent_at.get(rank)
        interval, share = self._feedback_interval(counts, rank, now)
        if not force and sent_at is not None and now - sent_at < interval:
            return None, sent_at + interval
        del self.fb[rank]
        self.fb_sent_at[rank] = now
        self.drain_sent[rank] = share
        self.stats.ctl_records_sent["FEEDBACK"] += 1
        flags = wire.Flags.ECN_ECHO if counts.marked else wire.Flags.NONE
        return wire.pack_record(wire.Header(ptype=wire.PacketType.FEEDBACK, job_id=self.config.job_id, message_id=0,
                                            sender_rank=self.rank, flags=flags, priority=self.policy.top_priority),
                                wire.FEEDBACK_BODY.pack(*(min(c, 0xFFFFFFFF) for c in
                                                          (counts.received, counts.marked, counts.lost)), share)), None

    def hello_feedback(self, now: float) -> bytes:
        """The FEEDBACK that opens a connection: what we can drain, before any data."""
        self.stats.ctl_records_sent["FEEDBACK"] += 1
        return wire.pack_record(wire.Header(ptype=wire.PacketType.FEEDBACK, job_id=self.config.job_id, message_id=HELLO,
                                            sender_rank=self.rank, priority=self.policy.top_priority),
                                wire.FEEDBACK_BODY.pack(0, 0, 0, self.drain_share_kBps(now)))


def _wire_array(data: Any) -> np.ndarray:
    """``data`` as an array the wire can carry as it is (no hidden copy of a gradient)."""
    if not isinstance(data, np.ndarray):
        raise ValueError(f"send needs a numpy array, got {type(data).__name__}")
    wire.dtype_code(data.dtype)
    if data.dtype.byteorder == ">":
        raise ValueError("payload must be little-endian (native on every supported host); got big-endian")
    if not data.flags.c_contiguous:
        raise ValueError("send needs a C-contiguous array (no hidden copy of a gradient); "
                         "call np.ascontiguousarray first")
    return data


def _deliver_into(out: np.ndarray, accumulate: bool, res: RecvResult, src: int, message_id: int) -> RecvResult:
    """A message received into a buffer of its own, copied (or with ``accumulate`` added) into
    the ``out`` its recv gave, under the rule of a message placed there as it arrives: a sum
    may go into float32 or the message's own type (:func:`dlcp.hostagent.wire.destination_dtypes`).

    Raises:
        ValueError: ``out`` has another size, or a type the message cannot go into.
    """
    fits = wire.destination_dtypes(res.data.dtype, accumulate)
    if out.shape != res.data.shape or out.dtype not in fits:
        raise ValueError(f"message {message_id} from rank {src} has {res.data.size} {res.data.dtype}; "
                         f"out is {out.shape} {out.dtype}")
    if accumulate:
        out += res.data
    else:
        out[:] = res.data
    return RecvResult(out, *_rest(res))


def _rest(result: RecvResult) -> tuple:
    return (result.stats, result.received, result.elems_per_packet, result.packet_priorities, result.packet_layers)



def shapes_agree(sent: tuple[int, int, int], expected: tuple[int, int, int]) -> bool:
    """Whether a message of shape ``sent`` (dtype code, elements, elements per packet) fits a
    receive that expects ``expected``: the same type and count, cut alike, or in one packet on
    both sides (then the cut does not matter: ranks with other MTUs still agree on it).

    Example: ``shapes_agree((0, 10, 357), (0, 10, 2232))`` -> True; ``(0, 1000, 357)`` against
    ``(0, 1000, 2232)`` -> False.
    """
    (d1, n1, per1), (d2, n2, per2) = sent, expected
    return d1 == d2 and n1 == n2 and (per1 == per2 or n1 <= min(per1, per2))


def _mismatch_hint(sent: tuple[int, int, int], expected: tuple[int, int, int]) -> str:
    """What most likely differs, for the error: the data, or the ranks' MTUs."""
    if sent[:2] == expected[:2]:
        return " (the same data cut into other packets: the ranks' MTUs differ)"
    return " (the ranks' tensors differ in size or type)"

__all__ = ["HELLO", "HELLO_REPLY", "IDLE_SLEEP", "IDLE_TICK", "ProtocolCore", "TransportClosed", "URGENT_TICK",
           "shapes_agree"]
