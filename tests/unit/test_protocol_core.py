"""The protocol core on a fake clock: every rule, deterministic, no sockets, no threads, no sleeps.

An in-memory data port records what the core asks of it and lets a test deliver exactly the
packets it wants at exactly the time it wants; the clock is a number each call takes.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import numpy as np
import pytest

from dlcp.hostagent import auth, wire
from dlcp.hostagent.messages import Expect, MessageMismatch, PeerFailed, TransportTimeout
from dlcp.hostagent.policy import Policy, required_elements
from dlcp.hostagent.protocol.core import IDLE_SLEEP, IDLE_TICK, LINE_RATE, URGENT_TICK, ProtocolCore
from dlcp.hostagent.protocol.incoming import MAX_ANSWER_GRACE, MAX_BUSY_DEFER, Incoming, answer_due, answer_grace
from dlcp.hostagent.protocol.port import STOP_SENT, EventKind, Progress, RxBuffers, RxSpec, TxInfo, TxSpec
from dlcp.hostagent.ratecontrol import RateConfig
from dlcp.hostagent.transport_config import TransportConfig, local_peers

PER = 351  # elements per packet at MTU 1500 (float32; the trailer takes 24 bytes)
KEY = b"k" * 16  # this endpoint's receive key for every sender
TX_KEY = b"t" * 16  # the peer's key for our tokens


class FakePort:
    """An in-memory data path: records calls, holds what it was given, delivers on request."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.rx: dict[tuple[int, int], RxSpec] = {}
        self.prog: dict[tuple[int, int], Progress] = {}
        self.tx: dict[tuple[int, int], TxSpec] = {}
        self.feedback: dict[int, tuple[int, int, int]] = {}
        self.seen_until = float("inf")  # the receive thread has read all that arrived (set lower: behind)
        self.reorder = 0.002  # every sender's reordering window (the grace's floor)
        self.sent: dict[int, int] = defaultdict(int)
        self.rates: dict[int, float] = {}
        self.probe_delays: dict[int, float] = {}
        self.keys: dict[int, bytes | None] = {}

    # DataPort
    def add_peer(self, rank, ipv4, port): pass
    def set_keys(self, rank, rx_key, tx_key): self.keys[rank] = rx_key
    def expect(self, spec):
        self.rx[(spec.src, spec.message_id)] = spec
        self.prog[(spec.src, spec.message_id)] = Progress(0, 0, 0, 0, 0.0, 0.0, 0)
    def progress(self, src, mid): return self.prog.get((src, mid))
    def progress_changed(self): return dict(self.prog)  # all: more than changed is allowed
    def complete(self, src, mid, fire):
        p = self.prog.get((src, mid))
        if p is None or p.state:
            return False
        self.prog[(src, mid)] = p._replace(state=3)
        self.calls.append(("complete", src, mid, fire))
        spec = self.rx[(src, mid)]
        if not spec.accumulate:  # the port's contract: missing packets read as zero
            for seq in np.flatnonzero(spec.buffers.received == 0):
                spec.buffers.out[seq * PER : (seq + 1) * PER] = 0
        return True
    def forget(self, src, mid, remember):
        self.calls.append(("forget", src, mid, remember))
        self.prog.pop((src, mid), None)
        self.rx.pop((src, mid), None)
    def expire_parked(self, older_than): pass
    def take_feedback(self, src): return self.feedback.pop(src, (0, 0, 0))
    def active_senders(self, now, window): return 0
    def drain_rate(self, now): return 0.0
    def rx_seen_until(self): return self.seen_until
    def reorder_window(self, src): return self.reorder
    def holes(self, src, mid):  # one priority level: missing below the highest received
        self.calls.append(("holes", src, mid))
        spec = self.rx.get((src, mid))
        if spec is None or self.prog[(src, mid)].state:
            return np.zeros(0, np.int64)
        got = np.flatnonzero(spec.buffers.received)
        return np.flatnonzero(spec.buffers.received[: got[-1]] == 0) if len(got) else np.zeros(0, np.int64)
    def submit(self, spec):
        self.tx[(spec.dest, spec.message_id)] = spec
        spec.drop_class[:] = np.arange(len(spec.drop_class)) % 4  # classes 0 1 2 3 0 1 ...
    def retransmit(self, dest, mid, seqs):
        self.calls.append(("retransmit", dest, mid, [int(s) for s in seqs]))
        return 0
    def resend(self, dest, mid, seqs):
        self.calls.append(("resend", dest, mid, [int(s) for s in seqs]))
        return len(seqs)
    def tx_info(self, dest, mid):
        spec = self.tx.get((dest, mid))
        return None if spec is None else TxInfo(len(spec.drop_class), len(spec.drop_class), 0, 0, False, False)
    def retire(self, dest, mid):
        self.calls.append(("retire", dest, mid))
        self.tx.pop((dest, mid), None)
    def set_rate(self, dest, rate): self.rates[dest] = rate
    def set_probe_delay(self, dest, seconds): self.probe_delays[dest] = seconds
    def sent_packets(self, dest): return self.sent[dest]
    def failure(self): return None

    # delivering data
    def deliver(self, src: int, mid: int, seqs, now: float, retx: int = 0) -> None:
        """Packets ``seqs`` of a message arrive at ``now`` (their payload: the seq number)."""
        spec = self.rx[(src, mid)]
        p = self.prog[(src, mid)]
        new = [s for s in seqs if not spec.buffers.received[s]]
        before = np.flatnonzero(spec.buffers.received)
        top = int(before[-1]) if len(before) else -1
        for s in new:
            spec.buffers.received[s] = 1
            spec.buffers.out[s * PER : (s + 1) * PER] = s
        elems = sum(min(PER, spec.total_elems - s * PER) for s in new)
        # skipped, counted as the data paths count them: each packet passed over by a later one
        # of the first pass (filled or not since)
        above = [s for s in new if s > top]
        gaps = p.gaps + (max(above) - top - len(above) if above and not retx else 0)
        self.prog[(src, mid)] = p._replace(received_pkts=p.received_pkts + len(new),
                                           received_elems=p.received_elems + elems, retx_seen=p.retx_seen + retx,
                                           first_arrival=p.first_arrival or now, last_arrival=now,
                                           gaps=gaps)


def make_core(port: FakePort | None = None, **config) -> tuple[ProtocolCore, FakePort]:
    port = port or FakePort()
    cfg = TransportConfig(rank=0, peers=local_peers(3, 50000), **config)
    core = ProtocolCore(cfg, port, new_key=lambda: KEY)
    for rank in (1, 2):
        core.peer_authenticated(rank, TX_KEY)
    return core, port


def records(core: ProtocolCore, rank: int) -> list[tuple[wire.Header, bytes]]:
    """The control records queued for ``rank`` (taken out of the outbox)."""
    return [wire.split_frame(r) for r in core.outbox.pop(rank, [])]


def kinds(core: ProtocolCore, rank: int) -> list[str]:
    return [h.ptype.name for h, _ in records(core, rank)]


# ---------------------------------------------------------------- sender side


def test_a_pass_end_is_followed_by_a_probe_only_after_the_answer_time():
    core, port = make_core()
    h = core.send(1, np.zeros(PER * 10, np.float32), 7, now=0.0, iteration=3)
    spec = port.tx[(1, 7)]
    assert spec.token == auth.DATA_TOKEN and spec.iteration == 3  # (the trailer's tag binds the iteration)
    assert kinds(core, 1) == ["META"]
    core.on_events([(EventKind.TX_PASS, 1, 7, 0.010, 0)], now=0.010)
    delay = core.answer_timer(1).probe_delay()
    core.handle_timer(0.010 + delay / 2)
    assert "PROBE" not in kinds(core, 1)  # a STOP usually comes within a round trip
    core.handle_timer(0.010 + delay + 1e-6)
    assert kinds(core, 1) == ["PROBE"]
    stop = wire.Header(ptype=wire.PacketType.STOP, job_id=1, message_id=7, sender_rank=1, iteration=3)
    core.on_record(stop, wire.STOP_BODY.pack(PER * 10), now=0.020)
    assert h.done() and h.wait(0).how == "stopped" and h.wait(0).lost_fraction == 0.0
    assert ("retire", 1, 7) in port.calls
    assert h.wait(0).started == 0.0 and h.wait(0).activated == 0.0 and h.wait(0).first_pass_ended == 0.010
    # the data path holds a pass's end to rank 1 back until its probe would be due: the delay
    # as the answers measured it, told after each (and the initial one before any)
    assert port.probe_delays[1] == core.answer_timer(1).probe_delay() != delay


def test_a_bitmap_resends_just_enough_most_important_first_and_a_stale_pass_end_is_ignored():
    core, port = make_core()
    n = 20
    core.send(1, np.zeros(PER * n, np.float32), 7, now=0.0, loss_bound=0.2)
    core.on_events([(EventKind.TX_PASS, 1, 7, 0.01, 0)], now=0.01)
    missing = [1, 2, 4, 5, 8, 9]  # classes 1 2 0 1 0 1 (FakePort: seq % 4)
    bits = np.zeros(n, np.uint8)
    bits[missing] = 1
    held = (n - len(missing)) * PER
    bitmap = wire.Header(ptype=wire.PacketType.BITMAP, job_id=1, message_id=7, sender_rank=1)
    core.on_record(bitmap, wire.BITMAP_PREFIX.pack(held) + np.packbits(bits).tobytes(), now=0.02)
    # needs required_elements - held = 16 - 14 = 2 packets: class 0 first (seqs 4, 8)
    assert required_elements(PER * n, 0.2) - held == 2 * PER
    assert port.calls[-1] == ("retransmit", 1, 7, [4, 8])
    assert port.rates[1] < core.config.rate.initial_rate  # a loss cuts the rate
    # the end of the first pass reported late must not look like the end of the resend pass
    core.on_events([(EventKind.TX_PASS, 1, 7, 0.021, 0)], now=0.021)
    core.handle_timer(1.0)
    assert "PROBE" not in kinds(core, 1)
    core.on_events([(EventKind.TX_PASS, 1, 7, 1.0, 1)], now=1.0)
    core.handle_timer(2.0)
    assert kinds(core, 1) == ["PROBE"]


def test_a_held_send_has_no_pass_and_no_probe_until_its_trigger_fires():
    core, port = make_core()
    h = core.send(1, np.zeros(PER, np.float32), 7, now=0.0, announce=False, held=True)
    assert port.tx[(1, 7)].held
    core.handle_timer(10.0)
    assert kinds(core, 1) == [] and not h.done()
    core.on_events([(EventKind.TX_ACTIVE, 1, 7, 10.0, 0), (EventKind.TX_PASS, 1, 7, 10.001, 0)], now=10.001)
    core.handle_timer(11.0)
    assert kinds(core, 1) == ["PROBE"]
    stop = wire.Header(ptype=wire.PacketType.STOP, job_id=1, message_id=7, sender_rank=1)
    core.on_record(stop, wire.STOP_BODY.pack(PER), now=11.6)
    st = h.wait(0)  # submitted at 0, released by its trigger at 10, its pass out at 10.001
    assert (st.started, st.activated, st.first_pass_ended) == (0.0, 10.0, 10.001)


def test_a_send_past_its_deadline_fails_naming_the_message_and_is_retired():
    core, port = make_core(message_deadline=1.0)
    h = core.send(1, np.zeros(PER * 3, np.float32), 7, now=0.0)
    core.handle_timer(1.5)
    with pytest.raises(TransportTimeout, match="message 7 to rank 1"):
        h.wait(0)
    assert ("retire", 1, 7) in port.calls


# ---------------------------------------------------------------- receiver side


def _expect(core: ProtocolCore, packets: int, p: float, iteration: int = 0, out=None):
    return core.recv(1, 9, now=0.0, out=out, expect=Expect(PER * packets, np.float32, p, iteration=iteration))


def _nacked(core: ProtocolCore) -> list[list[int]]:
    """The holes of each NACK queued for rank 1."""
    return [np.flatnonzero(np.unpackbits(np.frombuffer(b, np.uint8, offset=wire.BITMAP_PREFIX.size))).tolist()
            for h, b in records(core, 1) if h.ptype == wire.PacketType.NACK]


def test_a_reliable_messages_holes_are_reported_once_they_stayed_open_for_a_reordering_window():
    """p = 0, first pass: a hole (a later packet of its level came) seen at two looks, the
    reader having read all that arrived for a reordering window after the first, goes out in a
    NACK, once; a hole a late packet filled in between never does; a reader that is behind
    holds the report. Nothing is looked at while no packet was skipped."""
    from dlcp.hostagent.protocol.incoming import HOLE_CHECK_INTERVAL

    core, port = make_core()
    port.reorder = 0.001
    _expect(core, 20, 0.0)
    port.deliver(1, 9, range(5), now=0.001)
    assert core.handle_timer(0.001) > HOLE_CHECK_INTERVAL and not _nacked(core)  # no gap: no look
    port.deliver(1, 9, [6, 7, 9, 10], now=0.002)  # 5 and 8 skipped
    assert core.handle_timer(0.002) == pytest.approx(HOLE_CHECK_INTERVAL)  # first look: 5, 8
    assert not _nacked(core)
    port.deliver(1, 9, [8], now=0.003)  # 8 was only late
    port.deliver(1, 9, [11, 13], now=0.003)
    port.seen_until = 0.0025  # the reader is behind: not all that came until 0.003 was read
    assert core.handle_timer(0.004) == pytest.approx(URGENT_TICK)
    assert not _nacked(core)
    port.seen_until = float("inf")
    core.handle_timer(0.0045)
    assert _nacked(core) == [[5]]  # 12 opened since the first look: next time
    core.handle_timer(0.0066)
    assert _nacked(core) == [[12]]
    core.handle_timer(0.0090)
    assert _nacked(core) == []  # each hole once
    assert core.stats.holes_reported == 2 and core.stats.ctl_records_sent["NACK"] == 2


def test_holes_are_not_looked_for_again_once_a_look_found_none_until_a_packet_is_skipped():
    """Every hole filled (late packets): the next look finds none, and the data path is not
    asked again until a new packet is skipped."""
    core, port = make_core()
    port.reorder = 0.001
    _expect(core, 20, 0.0)
    port.deliver(1, 9, [0, 1, 3], now=0.001)  # 2 skipped
    core.handle_timer(0.001)
    port.deliver(1, 9, [2, 4], now=0.0015)  # 2 was late
    looks = lambda: sum(1 for c in port.calls if c[0] == "holes")  # noqa: E731
    core.handle_timer(0.0035)
    assert looks() == 2 and not _nacked(core)
    for t in (0.006, 0.009, 0.012):
        core.handle_timer(t)
    assert looks() == 2  # none open, nothing skipped since
    port.deliver(1, 9, [6], now=0.013)  # 5 skipped
    core.handle_timer(0.013)
    core.handle_timer(0.016)
    assert looks() == 4 and _nacked(core) == [[5]]


def test_no_holes_are_reported_for_a_bounded_message_or_after_the_end_of_the_pass():
    """A message with a loss bound needs no early resend (its bound covers the holes); once the
    pass ended (LAST) the answer to it lists what is missing, and NACKs stop."""
    for p, last in ((0.1, False), (0.0, True)):
        core, port = make_core()
        _expect(core, 20, p)
        port.deliver(1, 9, [0, 1, 3, 4], now=0.001)
        if last:
            core.on_events([(EventKind.RX_LAST, 1, 9, 0.001, 0)], now=0.001)
        for t in (0.001, 0.004, 0.008):
            core.handle_timer(t)
        assert not any(h.ptype == wire.PacketType.NACK for h, _ in records(core, 1))


def test_a_nack_resends_its_holes_at_once_and_counts_them_as_losses_once_the_pass_is_answered():
    """Sender: the holes of a NACK go to the data path's resend (which keeps only what the
    pass has sent); the rate reacts to them once, with the answer to the pass's end (here a
    STOP: every hole came in time), not at each NACK."""
    core, port = make_core()
    core.send(1, np.zeros(PER * 20, np.float32), 7, now=0.0)
    bits = np.zeros(20, np.uint8)
    bits[[2, 5]] = 1
    nack = wire.Header(ptype=wire.PacketType.NACK, job_id=1, message_id=7, sender_rank=1)
    core.on_record(nack, wire.BITMAP_PREFIX.pack(PER * 12) + np.packbits(bits).tobytes(), now=0.01)
    assert ("resend", 1, 7, [2, 5]) in port.calls
    assert core.stats.holes_resent == 2
    assert port.rates.get(1, core.config.rate.initial_rate) == core.config.rate.initial_rate
    unknown = dataclasses.replace(nack, message_id=8)
    core.on_record(unknown, wire.BITMAP_PREFIX.pack(0) + b"\xff", now=0.02)  # no such message: ignored
    assert core.stats.holes_resent == 2
    stop = wire.Header(ptype=wire.PacketType.STOP, job_id=1, message_id=7, sender_rank=1)
    core.on_record(stop, wire.STOP_BODY.pack(PER * 20), now=0.03)
    assert port.rates[1] < core.config.rate.initial_rate and core.rate_log[-1].cause == "loss"
    assert len([r for r in core.rate_log if r.cause == "loss"]) == 1


def test_an_expected_message_is_set_up_with_its_iteration():
    """Its packets must carry the iteration (a data path counts another as stale: the replay of
    1,024 iterations ago has a right tag, and the wrong iteration)."""
    core, port = make_core()
    _expect(core, 4, 0.0, iteration=1030)
    spec = port.rx[(1, 9)]
    assert spec.token == auth.DATA_TOKEN and spec.iteration == 1030


def test_the_end_of_a_pass_is_answered_once_the_message_is_quiet_for_its_grace():
    core, port = make_core(probe_grace=0.002)
    h = _expect(core, 20, 0.1)
    port.deliver(1, 9, range(19), now=0.010)
    core.on_events([(EventKind.RX_LAST, 1, 9, 0.010, 0)], now=0.010)
    assert core.handle_timer(0.010) == pytest.approx(0.002)  # it wants to run when the grace is over
    core.handle_timer(0.011)
    assert not h.done() and kinds(core, 1) == []  # 1 ms quiet: not yet
    core.handle_timer(0.013)
    assert h.done() and port.calls[-2][:3] == ("complete", 1, 9)
    (stop, body), = records(core, 1)
    assert stop.ptype == wire.PacketType.STOP and wire.STOP_BODY.unpack_from(body)[0] == 19 * PER
    missing = np.unpackbits(np.frombuffer(body, np.uint8, offset=wire.STOP_BODY.size))[:20]
    assert missing.nonzero()[0].tolist() == [19]
    res = h.wait(0)
    assert res.stats.how == "bounded" and not res.data[19 * PER :].any()  # the missing packet reads as zero
    assert res.data[PER] == 1  # what arrived stays


def test_below_the_bound_the_answer_is_a_bitmap_and_the_pace_of_the_first_pass_is_kept():
    core, port = make_core(probe_grace=0.002)
    h = _expect(core, 20, 0.0)
    port.deliver(1, 9, range(0, 20, 2), now=0.020)  # every other packet
    core.on_events([(EventKind.RX_LAST, 1, 9, 0.020, 0)], now=0.020)
    core.handle_timer(0.030)
    (bm, body), = records(core, 1)
    assert bm.ptype == wire.PacketType.BITMAP and not h.done()
    missing = np.unpackbits(np.frombuffer(body, np.uint8, offset=wire.BITMAP_PREFIX.size))[:20]
    assert missing.nonzero()[0].tolist() == list(range(1, 20, 2))
    # the resends arrive: the data path completes it (exact) and says so
    port.deliver(1, 9, range(1, 20, 2), now=0.050, retx=10)
    core.on_events([(EventKind.RX_RETX, 1, 9, 0.050, 10)], now=0.050)
    assert core.srtt[1] == pytest.approx(0.020)  # bitmap to first resend
    port.prog[(1, 9)] = port.prog[(1, 9)]._replace(state=1)
    core.on_events([(EventKind.RX_DONE, 1, 9, 0.050, 1)], now=0.050)
    assert h.wait(0).stats.how == "exact" and kinds(core, 1) == ["STOP"]
    st = h.wait(0).stats  # the round: its bitmap at 30 ms, its first resend in at 50 ms
    assert st.recovery_started == pytest.approx(0.030) and st.first_resend_at == pytest.approx(0.050)


def test_a_reader_behind_delays_an_answer_but_not_past_its_bound():
    """A receive thread that has not yet read what arrived until the grace's end holds the
    answer, or the bitmap would list packets already here; but one that stays behind (a flood
    of junk) must not hold it for ever: the answer goes MAX_BUSY_DEFER past its grace."""
    core, port = make_core(probe_grace=0.002)
    h = _expect(core, 20, 0.0)
    port.deliver(1, 9, range(10), now=1.0)
    core.on_events([(EventKind.RX_LAST, 1, 9, 1.0, 0)], now=1.0)
    port.seen_until = 1.001  # read up to a millisecond after the last packet: inside the grace
    core.handle_timer(1.0 + 0.002 + MAX_BUSY_DEFER / 2)
    assert kinds(core, 1) == []
    core.handle_timer(1.0 + 0.002 + MAX_BUSY_DEFER + 1e-6)
    assert kinds(core, 1) == ["BITMAP"] and not h.done()


def test_a_reader_that_keeps_up_answers_at_the_grace_however_busy_the_socket():
    """Other messages keep the socket from running dry, but the reader has read everything that
    arrived until the grace's end: the answer goes out then, not when the socket empties (which
    held every answer of a ring's all-gather back by tens of milliseconds under loss)."""
    core, port = make_core(probe_grace=0.002)
    _expect(core, 20, 0.0)
    port.deliver(1, 9, range(10), now=1.0)
    core.on_events([(EventKind.RX_LAST, 1, 9, 1.0, 0)], now=1.0)
    port.seen_until = 1.0019
    core.handle_timer(1.0021)
    assert kinds(core, 1) == []  # packets that arrived in the grace's last 0.1 ms may be unread
    port.seen_until = 1.0020
    core.handle_timer(1.0021)
    assert kinds(core, 1) == ["BITMAP"]


class ReaderRacingPort(FakePort):
    """A receive thread that takes the packets still in the socket just as the core asks how far
    it has read (the moment in between two reads of the core)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_socket: list[tuple] = []
        self.mark_reads = 0

    def rx_seen_until(self):
        self.mark_reads += 1
        for args in self.in_socket:
            self.deliver(*args)
        self.in_socket.clear()
        return self.seen_until


def test_the_reader_mark_is_read_only_when_an_answer_hangs_on_it_and_before_the_progress_it_judges():
    """Timer runs that judge no answer leave the receive thread's lock alone; the one that does
    reads the message's progress after the mark, so packets the reader took in between are not
    listed as missing (a bitmap listing packets already here sends them again)."""
    port = ReaderRacingPort()
    core, _ = make_core(probe_grace=0.002, port=port)
    h = _expect(core, 20, 0.0)
    port.deliver(1, 9, range(10), now=1.0)
    core.on_events([(EventKind.RX_LAST, 1, 9, 1.0, 0)], now=1.0)
    core.handle_timer(1.001)  # inside the grace: nothing judged
    assert port.mark_reads == 0
    port.in_socket.append((1, 9, range(10, 20), 1.0))  # arrived by 1.0, not yet read
    core.handle_timer(1.003)
    assert port.mark_reads == 1
    assert kinds(core, 1) == ["STOP"] and h.wait(0).stats.how == "exact"


def test_a_message_quiet_for_the_idle_timeout_completes_under_its_bound_without_a_pass_end():
    core, port = make_core(idle_timeout=0.05)
    h = _expect(core, 20, 0.1)
    port.deliver(1, 9, range(18), now=0.0)
    core.handle_timer(0.04)
    assert not h.done()
    core.handle_timer(0.051)
    assert h.wait(0).stats.how == "idle"


def test_a_receive_past_its_deadline_fails_and_is_forgotten():
    core, port = make_core(message_deadline=2.0)
    h = _expect(core, 20, 0.0)
    port.deliver(1, 9, range(5), now=0.5)
    core.handle_timer(2.5)
    with pytest.raises(TransportTimeout, match="message 9 from rank 1 .* 25.0% received"):
        h.wait(0)
    assert ("forget", 1, 9, False) in port.calls


def test_a_probe_for_a_finished_message_is_answered_with_what_was_held():
    core, port = make_core()
    _expect(core, 2, 0.0)
    port.deliver(1, 9, [0, 1], now=0.0)
    port.prog[(1, 9)] = port.prog[(1, 9)]._replace(state=1)
    core.on_events([(EventKind.RX_DONE, 1, 9, 0.0, 1)], now=0.0)
    records(core, 1)
    probe = wire.Header(ptype=wire.PacketType.PROBE, job_id=1, message_id=9, sender_rank=1)
    core.on_record(probe, b"", now=0.1)
    (stop, body), = records(core, 1)
    assert stop.ptype == wire.PacketType.STOP and wire.STOP_BODY.unpack_from(body)[0] == 2 * PER
    core.on_record(wire.Header(ptype=wire.PacketType.PROBE, job_id=1, message_id=123, sender_rank=1), b"", now=0.1)
    assert core.stats.probes_unknown == 1 and kinds(core, 1) == []


def test_a_probe_of_the_ids_next_use_is_not_answered_from_the_use_that_finished():
    """Message ids repeat every 1,024 calls; a sender ahead probes the id's next use before this
    rank has set it up. That PROBE is not known yet (the sender probes again), not answered with
    the finished use's STOP, which ended a send whose data had not come."""
    core, port = make_core()
    _expect(core, 2, 0.0, iteration=5)
    port.deliver(1, 9, [0, 1], now=0.0)
    port.prog[(1, 9)] = port.prog[(1, 9)]._replace(state=1)
    core.on_events([(EventKind.RX_DONE, 1, 9, 0.0, 1)], now=0.0)
    (stop, _), = records(core, 1)
    assert stop.ptype == wire.PacketType.STOP and stop.iteration == 5
    probe = wire.Header(ptype=wire.PacketType.PROBE, job_id=1, message_id=9, sender_rank=1, iteration=5 + 1024)
    core.on_record(probe, b"", now=0.1)
    assert kinds(core, 1) == [] and core.stats.probes_unknown == 1
    core.on_record(dataclasses.replace(probe, iteration=5), b"", now=0.2)  # the finished use's own
    (stop, body), = records(core, 1)
    assert stop.iteration == 5 and wire.STOP_BODY.unpack_from(body)[0] == 2 * PER


def test_a_probe_carries_its_messages_iteration():
    core, port = make_core()
    core.send(1, np.zeros(PER * 2, np.float32), 7, now=0.0, iteration=1030, announce=False)
    core.on_events([(EventKind.TX_PASS, 1, 7, 0.01, 0)], now=0.01)
    core.handle_timer(1.0)
    (probe, _), = records(core, 1)
    assert probe.ptype == wire.PacketType.PROBE and probe.iteration == 1030


@pytest.mark.parametrize("kind", ["STOP", "BITMAP", "NACK", "MISMATCH"])
def test_a_senders_record_of_another_use_of_the_id_does_not_act_on_this_send(kind):
    """Ids repeat every 1,024 calls: a STOP, BITMAP, NACK or refusal that names the id's previous
    use (an answer to a probe delayed past the wrap) must neither end, resend nor fail this one."""
    core, port = make_core()
    h = core.send(1, np.zeros(PER * 4, np.float32), 7, now=0.0, iteration=1030, announce=False)
    core.on_events([(EventKind.TX_PASS, 1, 7, 0.01, 0)], now=0.01)
    bits = np.packbits(np.array([0, 1, 1, 0], np.uint8)).tobytes()
    ptype, flags, body = {
        "STOP": (wire.PacketType.STOP, wire.Flags.NONE, wire.STOP_BODY.pack(PER * 4)),
        "BITMAP": (wire.PacketType.BITMAP, wire.Flags.NONE, wire.BITMAP_PREFIX.pack(PER * 2) + bits),
        "NACK": (wire.PacketType.NACK, wire.Flags.NONE, wire.BITMAP_PREFIX.pack(PER * 2) + bits),
        "MISMATCH": (wire.PacketType.STOP, wire.Flags.MISMATCH, wire.STOP_BODY.pack(0)),
    }[kind]
    fields: dict[str, Any] = {}
    if kind == "MISMATCH":  # (a refusal states the receiver's shape)
        fields = dict(wire.shape_fields(wire.dtype_code(np.float16), PER * 4, PER))
    rec = wire.Header(ptype=ptype, job_id=1, message_id=7, sender_rank=1, flags=flags, iteration=6, **fields)
    core.on_record(rec, body, now=0.02)
    assert not h.done() and core.stats.records_of_another_use == 1
    assert not [c for c in port.calls if c[0] in ("retransmit", "resend", "retire")]
    core.on_record(dataclasses.replace(rec, iteration=1030), body, now=0.03)  # this use's own: acts
    assert core.stats.records_of_another_use == 1
    if kind in ("STOP", "MISMATCH"):
        assert h.done() and ("retire", 1, 7) in port.calls
    else:
        assert [c for c in port.calls if c[0] in ("retransmit", "resend")]


def test_a_probe_of_another_use_of_the_id_asks_nothing_of_the_receive_in_progress():
    core, port = make_core()
    _expect(core, 4, 0.0, iteration=1030)
    port.deliver(1, 9, [0, 1], now=0.0)
    fields: dict[str, Any] = dict(wire.shape_fields(wire.dtype_code(np.float32), 4 * PER, PER))
    probe = wire.Header(ptype=wire.PacketType.PROBE, job_id=1, message_id=9, sender_rank=1, iteration=6, **fields)
    core.on_record(probe, b"", now=0.1)
    core.handle_timer(0.5)
    assert kinds(core, 1) == [] and core.stats.records_of_another_use == 1
    core.on_record(dataclasses.replace(probe, iteration=1030), b"", now=0.6)
    core.handle_timer(1.0)
    (bitmap, _), = records(core, 1)
    assert bitmap.ptype == wire.PacketType.BITMAP and bitmap.iteration == 1030


def test_holes_reported_in_a_nack_name_the_messages_use():
    core, port = make_core()
    _expect(core, 6, 0.0, iteration=1030)
    port.deliver(1, 9, [0, 3], now=0.0)
    for t in (0.1, 0.2, 0.3):
        core.handle_timer(t)
    nack = [hd for hd, _ in records(core, 1) if hd.ptype == wire.PacketType.NACK]
    assert nack and all(hd.iteration == 1030 for hd in nack)


@pytest.mark.parametrize("how, record", [(1, True), (STOP_SENT, False)], ids=["record", "datagram sent"])
def test_a_message_done_in_the_data_path_gets_a_stop_record_unless_the_data_path_sent_its_stop(how, record):
    core, port = make_core()
    h = _expect(core, 2, 0.0)
    port.deliver(1, 9, [0, 1], now=0.0)
    port.prog[(1, 9)] = port.prog[(1, 9)]._replace(state=1)
    core.on_events([(EventKind.RX_DONE, 1, 9, 0.01, how)], now=0.01)
    assert h.wait(0).stats.how == "exact" and h.wait(0).stats.lost_fraction == 0.0
    assert kinds(core, 1) == (["STOP"] if record else [])


def test_a_stop_datagram_ends_a_send_as_a_stop_record_does():
    """TX_STOP (the receiver's data path took every packet): the send ends "stopped", retired, with
    nothing lost, and is never probed."""
    core, port = make_core()
    h = core.send(1, np.zeros(PER * 10, np.float32), 7, now=0.0, announce=False)
    events = [(EventKind.TX_PASS, 1, 7, 0.010, 0), (EventKind.TX_STOP, 1, 7, 0.011, PER * 10)]
    core.on_events(events, now=0.011)
    assert h.done() and h.wait(0).how == "stopped" and h.wait(0).lost_fraction == 0.0
    assert ("retire", 1, 7) in port.calls and kinds(core, 1) == []
    core.handle_timer(5.0)
    assert kinds(core, 1) == []  # no probe for a stopped message


def test_a_meta_sets_the_message_up_for_a_recv_posted_before_it():
    core, port = make_core()
    h = core.recv(1, 9, now=0.0)
    meta = wire.Header(ptype=wire.PacketType.META, job_id=1, message_id=9, sender_rank=1, iteration=77, priority=3)
    core.on_record(meta, wire.META_BODY.pack(PER * 2, PER, 0.0), now=0.0)
    spec = port.rx[(1, 9)]
    assert spec.token == auth.DATA_TOKEN and spec.iteration == 77 and spec.total_elems == 2 * PER
    assert spec.buffers.pkt_priority.tolist() == [3, 3]
    core.on_record(meta, wire.META_BODY.pack(5, PER, 0.0), now=0.0)  # a duplicate changes nothing
    assert port.rx[(1, 9)] is spec
    port.deliver(1, 9, [0, 1], now=0.01)
    port.prog[(1, 9)] = port.prog[(1, 9)]._replace(state=1)
    core.on_events([(EventKind.RX_DONE, 1, 9, 0.01, 1)], now=0.01)
    assert h.wait(0).stats.iteration == 77


@pytest.mark.parametrize("done_first", [False, True], ids=["in progress", "complete"])
def test_a_half_precision_message_announced_before_its_recv_is_added_into_a_float32_sum(done_first):
    """A PS server posts a push's recv (a float32 sum) only once the worker's META has set the
    message up in a buffer of its own type: at the end it is added into the sum all the same, as
    it would have been placed there, whether it was still arriving or already complete."""
    core, port = make_core()
    per = 2 * PER  # float16 packs twice as many per packet
    meta = wire.Header(ptype=wire.PacketType.META, job_id=1, message_id=9, sender_rank=1, iteration=1,
                       dtype=wire.Dtype.FLOAT16)
    core.on_record(meta, wire.META_BODY.pack(per, per, 0.0), now=0.0)
    spec = port.rx[(1, 9)]
    assert spec.buffers.out.dtype == np.float16
    spec.buffers.out[:] = np.arange(per) % 7  # what arrived
    spec.buffers.received[:] = 1
    port.prog[(1, 9)] = Progress(1, per, 0, 0, 0.0, 0.01, 0)
    total = np.ones(per, np.float32)
    if done_first:
        port.prog[(1, 9)] = port.prog[(1, 9)]._replace(state=1)
        core.on_events([(EventKind.RX_DONE, 1, 9, 0.01, 1)], now=0.01)
    h = core.recv(1, 9, now=0.01, out=total, accumulate=True)
    if not done_first:
        port.prog[(1, 9)] = port.prog[(1, 9)]._replace(state=1)
        core.on_events([(EventKind.RX_DONE, 1, 9, 0.01, 1)], now=0.01)
    res = h.wait(0)
    assert res.data is total
    np.testing.assert_array_equal(total, 1 + np.arange(per) % 7)
    # a type it cannot go into still fails, naming the message
    core.on_record(dataclasses.replace(meta, message_id=10), wire.META_BODY.pack(per, per, 0.0), now=0.0)
    port.prog[(1, 10)] = Progress(1, per, 0, 0, 0.0, 0.01, 0)
    bad = core.recv(1, 10, now=0.01, out=np.zeros(per, np.float64), accumulate=True)
    port.prog[(1, 10)] = port.prog[(1, 10)]._replace(state=1)
    core.on_events([(EventKind.RX_DONE, 1, 10, 0.01, 1)], now=0.01)
    with pytest.raises(ValueError, match="message 10 from rank 1 has .* float16; out is .* float64"):
        bad.wait(0)


def test_a_failed_peer_fails_exactly_its_own_messages():
    core, port = make_core()
    to1 = core.send(1, np.zeros(PER, np.float32), 1, now=0.0)
    to2 = core.send(2, np.zeros(PER, np.float32), 2, now=0.0)
    from1 = _expect(core, 2, 0.0)
    waiting = core.recv(1, 50, now=0.0)
    assert core.peer_failed(1, "closed the control connection")
    for h in (to1, from1, waiting):
        with pytest.raises(PeerFailed, match="peer rank 1"):
            h.wait(0)
    assert not to2.done() and ("retire", 1, 1) in port.calls and ("forget", 1, 9, False) in port.calls


def test_a_peer_that_refused_a_message_and_then_closed_fails_the_others_naming_the_mismatch():
    """The peer refuses our message (it expects another shape), raises and closes: the receive
    from it still in flight fails for the closing, and its error names the mismatch (the caller
    may wait on that receive first)."""
    core, _ = make_core()
    sent = core.send(1, np.zeros(500, np.float32), 1, now=0.0)
    incoming = _expect(core, 1, 0.0)
    shape = wire.shape_fields(wire.Dtype.FLOAT32, 200, PER)
    refusal = wire.Header(ptype=wire.PacketType.STOP, job_id=1, message_id=1, sender_rank=1, flags=wire.Flags.MISMATCH,
                          dtype=wire.Dtype(shape["dtype"]), total_pkts=shape["total_pkts"],
                          elem_offset=shape["elem_offset"], elem_count=shape["elem_count"])
    core.on_record(refusal, wire.STOP_BODY.pack(0), now=0.01)
    with pytest.raises(MessageMismatch, match="rank 1 expects 200 float32 elements"):
        sent.wait(0)
    core.peer_failed(1, "closed the control connection")
    with pytest.raises(PeerFailed, match="closed the control connection .after a mismatch: .*tensors differ"):
        incoming.wait(0)
    # and what the endpoint tells its callbacks (the backend fails its group with it) says so too
    assert "after a mismatch" in core.loss_reason(1, "closed") and core.loss_reason(2, "closed") == "closed"


# ---------------------------------------------------------------- feedback and rates


def test_congestion_is_reported_every_feedback_interval_and_a_clean_transfer_rarely():
    core, port = make_core(feedback_interval=0.002, clean_feedback_interval=0.2)
    port.feedback[1] = (100, 0, 0)
    core.handle_timer(0.0)
    assert kinds(core, 1) == ["FEEDBACK"]  # the first report: nothing sent before
    port.feedback[1] = (10, 0, 0)
    core.handle_timer(0.1)
    assert kinds(core, 1) == []  # clean: it waits for the clean interval
    port.feedback[1] = (10, 3, 0)
    core.handle_timer(0.103)
    (fb, body), = records(core, 1)
    assert fb.flags & wire.Flags.ECN_ECHO and wire.FEEDBACK_BODY.unpack_from(body)[:3] == (20, 3, 0)


def _line_rate_notices(core: ProtocolCore, rank: int) -> list[bool]:
    """The LINE_RATE notices queued for ``rank``: whether each says "at the line rate"."""
    return [bool(h.flags & wire.Flags.AT_LINE_RATE) for h, _ in records(core, rank)
            if h.ptype == wire.PacketType.FEEDBACK and h.message_id == LINE_RATE]


def test_a_sender_tells_its_receiver_once_when_its_rate_reaches_the_line_rate_and_when_it_falls_below():
    """Clean reports grow the rate to the line rate: the sender says so once (a FEEDBACK of id
    LINE_RATE, flag AT_LINE_RATE); a cut takes it below: it says so once (flag clear); a new
    connection with the receiver (a restarted peer) is told again where the rate stands."""
    core, port = make_core(rate=RateConfig.for_link(1e9))
    core.send(1, np.zeros(PER, np.float32), 1, now=0.0)
    assert core.rate[1].rate < core.config.rate.line_rate and _line_rate_notices(core, 1) == []
    fb = wire.Header(ptype=wire.PacketType.FEEDBACK, job_id=1, message_id=0, sender_rank=1)
    t = 0.0
    while port.rates[1] < core.config.rate.line_rate:
        t += 0.05
        core.on_record(fb, wire.FEEDBACK_BODY.pack(100, 0, 0, 0), now=t)
    assert _line_rate_notices(core, 1) == [True]
    core.on_record(fb, wire.FEEDBACK_BODY.pack(100, 0, 0, 0), now=t + 0.05)  # still there: nothing more
    assert _line_rate_notices(core, 1) == []
    port.sent[1] = 10_000
    core.on_record(fb, wire.FEEDBACK_BODY.pack(100, 50, 0, 0), now=t + 0.1)  # marks: a cut
    assert port.rates[1] < core.config.rate.line_rate and _line_rate_notices(core, 1) == [False]
    while port.rates[1] < core.config.rate.line_rate:
        t += 0.05
        core.on_record(fb, wire.FEEDBACK_BODY.pack(100, 0, 0, 0), now=t + 0.1)
    assert _line_rate_notices(core, 1) == [True]
    core.peer_authenticated(1, TX_KEY)  # a new connection: its receiver knows nothing yet
    assert _line_rate_notices(core, 1) == [True]
    core.peer_authenticated(2, TX_KEY)  # nothing sent to rank 2: nothing to tell
    assert _line_rate_notices(core, 2) == []


def test_a_receiver_reports_a_clean_transfer_from_a_sender_at_its_line_rate_only_every_clean_interval():
    """A long clean transfer is reported every bulk interval (its sender grows on the reports),
    unless the sender said it is at its line rate: then every clean interval, and the timers
    do not wake for it; congestion still goes out every feedback interval; once the sender says
    it is below again (a cut), every bulk interval again. A notice is no report: it changes
    none of our own rates towards that peer."""
    core, port = make_core(bulk_feedback_interval=0.02, clean_feedback_interval=0.2, feedback_interval=0.002)
    _expect(core, 1000, 0.0)  # rank 1's message 9 is coming

    def reports(now: float, received: int = 100, marked: int = 0) -> list[tuple[int, ...]]:
        port.feedback[1] = (received, marked, 0)
        core.handle_timer(now)
        return [wire.FEEDBACK_BODY.unpack_from(b)[:3] for h, b in records(core, 1)
                if h.ptype == wire.PacketType.FEEDBACK]

    def notice(at_line: bool, now: float) -> None:
        h = wire.Header(ptype=wire.PacketType.FEEDBACK, job_id=1, message_id=LINE_RATE, sender_rank=1,
                        flags=wire.Flags.AT_LINE_RATE if at_line else wire.Flags.NONE)
        assert not core.on_record(h, wire.FEEDBACK_BODY.pack(0, 0, 0, 0), now=now)

    assert reports(0.0) == [(100, 0, 0)]
    assert reports(0.021) == [(100, 0, 0)]  # bulk: every 20 ms
    rates = dict(port.rates)
    notice(True, 0.022)
    assert port.rates == rates and 1 not in core.rate  # (no report on what we send rank 1)
    assert reports(0.042) == [] and reports(0.1) == []
    assert core.handle_timer(0.1) == pytest.approx(IDLE_TICK)  # (its longest sleep), not the bulk interval
    assert reports(0.103, marked=5) == [(300, 5, 0)]  # congestion: at once
    assert reports(0.110) == [] and reports(0.304) == [(200, 0, 0)]  # clean again: every 200 ms
    notice(False, 0.31)
    assert reports(0.325) == [(100, 0, 0)]  # below its line rate: every bulk interval again
    notice(True, 0.33)
    core.peer_authenticated(1, TX_KEY)  # a new connection: its sender starts below its line rate
    assert reports(0.346) == [(100, 0, 0)]


def test_a_report_rides_along_with_any_record_leaving_for_that_peer():
    core, port = make_core()
    core.handle_timer(0.0)
    port.feedback[1] = (5, 0, 0)
    core.queue(1, wire.PacketType.STOP, 3, wire.STOP_BODY.pack(0))
    out = [wire.split_frame(r)[0].ptype.name for r in core.take_records(1, now=0.001)]
    assert out == ["STOP", "FEEDBACK"]


def test_marks_cut_the_rate_once_per_window_and_the_data_path_paces_at_it():
    core, port = make_core()
    core.send(1, np.zeros(PER, np.float32), 1, now=0.0)
    start = port.rates[1]
    fb = wire.Header(ptype=wire.PacketType.FEEDBACK, job_id=1, message_id=0, sender_rank=1)
    port.sent[1] = 100
    core.on_record(fb, wire.FEEDBACK_BODY.pack(50, 50, 0, 0), now=0.01)
    cut = port.rates[1]
    assert cut < start and core.rate_log[-1].cause == "marks"
    core.on_record(fb, wire.FEEDBACK_BODY.pack(40, 40, 0, 0), now=0.012)  # the same window: no second cut
    assert port.rates[1] == cut
    core.on_record(fb, wire.FEEDBACK_BODY.pack(20, 20, 0, 0), now=0.014)  # the window (100 sent) reported
    assert port.rates[1] < cut


def test_marks_after_a_bitmaps_loss_cut_wait_for_its_window():
    """A BITMAP's losses cut the rate at once; the marked reports that follow, for packets sent
    before that cut, do not cut again until its window is reported."""
    core, port = make_core()
    n = 20
    core.send(1, np.zeros(PER * n, np.float32), 7, now=0.0)
    core.on_events([(EventKind.TX_PASS, 1, 7, 0.01, 0)], now=0.01)
    port.sent[1] = 100
    bits = np.zeros(n, np.uint8)
    bits[[3, 4]] = 1
    bitmap = wire.Header(ptype=wire.PacketType.BITMAP, job_id=1, message_id=7, sender_rank=1)
    core.on_record(bitmap, wire.BITMAP_PREFIX.pack((n - 2) * PER) + np.packbits(bits).tobytes(), now=0.02)
    cut = port.rates[1]
    assert cut < core.config.rate.initial_rate and core.rate_log[-1].cause == "loss"
    fb = wire.Header(ptype=wire.PacketType.FEEDBACK, job_id=1, message_id=0, sender_rank=1)
    core.on_record(fb, wire.FEEDBACK_BODY.pack(30, 30, 0, 0), now=0.022)  # the same window
    assert port.rates[1] == cut
    core.on_record(fb, wire.FEEDBACK_BODY.pack(70, 30, 0, 0), now=0.024)  # 100 reported: it is over
    assert port.rates[1] < cut


def test_the_timers_sleep_until_their_next_deadline():
    """Idle: IDLE_SLEEP; data streaming in: the next clean report; a pass ended: the probe; an
    answer due: the end of its grace; a reader behind when an answer is due: a millisecond. (The
    control thread sleeps this long, so a bulk transfer costs the application nothing, and the
    end of a pass is still answered when its grace is over.)"""
    core, port = make_core(bulk_feedback_interval=0.02)
    assert core.handle_timer(0.0) == IDLE_SLEEP
    _expect(core, 20, 0.0)
    port.deliver(1, 9, range(5), now=0.0)
    assert core.handle_timer(0.001) == pytest.approx(0.02)
    core.send(2, np.zeros(PER, np.float32), 3, now=0.001)
    core.on_events([(EventKind.TX_PASS, 2, 3, 0.002, 0)], now=0.002)
    assert core.handle_timer(0.002) == pytest.approx(core.answer_timer(2).probe_delay())
    core.on_events([(EventKind.RX_LAST, 1, 9, 0.003, 0)], now=0.003)
    assert core.handle_timer(0.003) == pytest.approx(core.config.probe_grace)
    port.seen_until = 0.003  # the reader is behind
    assert core.handle_timer(0.003 + core.config.probe_grace) == pytest.approx(URGENT_TICK)


def test_with_nothing_in_flight_the_timers_sleep_long_and_a_message_brings_back_the_tick():
    """No message in flight and nothing to report: IDLE_SLEEP, not IDLE_TICK (an idle group's
    control thread ran its timers 20 times a second, 4-5 ms of CPU a second per process). Data
    arriving with no message set up (early packets) is reported at its pace; a message in
    flight caps the sleep at IDLE_TICK again, and once it is done the sleep is long again."""
    core, port = make_core(bulk_feedback_interval=0.02)
    assert IDLE_SLEEP > IDLE_TICK
    assert core.handle_timer(0.0) == IDLE_SLEEP
    port.feedback[1] = (100, 0, 0)  # rank 1's packets, parked before their receive
    assert core.handle_timer(0.5) == IDLE_SLEEP  # (reported at once: nothing more owed)
    assert [h.ptype for h, _ in records(core, 1)] == [wire.PacketType.FEEDBACK]
    port.feedback[1] = (100, 0, 0)
    assert core.handle_timer(0.505) == pytest.approx(0.015)  # the next report, a bulk interval on
    h = core.send(2, np.zeros(PER, np.float32), 3, now=0.51)
    assert core.handle_timer(0.52) <= IDLE_TICK + 1e-9
    core.on_events([(EventKind.TX_STOP, 2, 3, 0.53, PER)], now=0.53)
    assert h.done()
    assert core.handle_timer(0.54) == IDLE_SLEEP


def test_the_timers_run_after_events_only_for_messages_still_going_on():
    """The control thread runs the timers after a batch of events, or a frame of records, only
    if the core says so: a pass that ended (its probe), a LAST (its answer), congestion, a
    probe, for a message still going on. Not for completions (RX_DONE, TX_STOP, a STOP record),
    a LAST or a pass end whose message ended in the same batch, a held send that started (its
    pass's end will come), nor a FEEDBACK (rates only): those set no deadline, or end one (the
    next run, at once, sets none earlier than the last one did)."""
    core, port = make_core(bulk_feedback_interval=0.02)
    _expect(core, 20, 0.0)  # rank 1's message 9, reliable
    h = core.recv(2, 4, now=0.0, expect=Expect(PER * 2, np.float32, 0.0))
    port.deliver(1, 9, range(5), now=0.0)
    core.send(2, np.zeros(PER, np.float32), 3, now=0.0)
    assert core.on_events([(EventKind.TX_PASS, 2, 3, 0.001, 0)], now=0.001)  # its probe is due later
    set_at = 0.001 + core.handle_timer(0.001)
    port.deliver(2, 4, [0, 1], now=0.002)
    port.prog[(2, 4)] = port.prog[(2, 4)]._replace(state=1)
    ending = [(EventKind.RX_LAST, 2, 4, 0.002, 0), (EventKind.RX_DONE, 2, 4, 0.002, 1),
              (EventKind.TX_STOP, 2, 3, 0.002, PER)]
    assert not core.on_events(ending, now=0.002) and h.done()
    assert 0.002 + core.handle_timer(0.002) >= set_at
    assert not core.on_events([(EventKind.TX_PASS, 2, 3, 0.003, 1)], now=0.003)  # (ended: a stale one)
    for kind in (EventKind.RX_LAST, EventKind.RX_RETX):  # rank 1's message 9 is still coming
        assert core.on_events([(kind, 1, 9, 0.004, 0)], now=0.004), kind
    assert core.on_events([(EventKind.CONGESTION, 1, 0, 0.005, 0)], now=0.005)
    held = core.send(1, np.zeros(PER, np.float32), 7, now=0.005, announce=False, held=True)
    assert not core.on_events([(EventKind.TX_ACTIVE, 1, 7, 0.006, 0)], now=0.006)  # sending
    assert core.on_events([(EventKind.TX_PASS, 1, 7, 0.007, 0)], now=0.007)  # its probe is due
    fb = wire.Header(ptype=wire.PacketType.FEEDBACK, job_id=1, message_id=0, sender_rank=1)
    assert not core.on_record(fb, wire.FEEDBACK_BODY.pack(1, 0, 0, 0), now=0.008)
    probe = wire.Header(ptype=wire.PacketType.PROBE, job_id=1, message_id=9, sender_rank=1,
                        dtype=wire.Dtype.FLOAT32, total_pkts=20, elem_offset=PER * 20, elem_count=PER)
    assert core.on_record(probe, b"", now=0.009)  # rank 1's message 9: to be answered
    stop = wire.Header(ptype=wire.PacketType.STOP, job_id=1, message_id=7, sender_rank=1)
    assert not core.on_record(stop, wire.STOP_BODY.pack(PER), now=0.010) and held.done()


# ---------------------------------------------------------------- the answer grace


def _incoming(packets: int, span: float) -> Incoming:
    buffers = RxBuffers.allocate(np.zeros(PER * 20, np.float32), 20, 0)
    m = Incoming(1, 7, PER * 20, PER, 0, 0.0, 10.0, None, 0, buffers, False, 0, 100.0)
    m.received_pkts = packets
    m.first_arrival = 100.0
    m.last_arrival = 100.0 + span
    return m


def test_an_end_of_pass_waits_a_few_of_the_messages_own_packet_gaps():
    """The configured floor for a fast message, four mean packet gaps for a slow one (a sprayed
    LAST overtakes packets queued on the other path by a few packet times), capped; before two
    packets arrived there is no gap to go by."""
    assert answer_grace(0.002, _incoming(0, 0.0)) == 0.002
    assert answer_grace(0.002, _incoming(1, 0.0)) == 0.002
    assert answer_grace(0.002, _incoming(11, 0.001)) == 0.002  # 0.1 ms apart: the floor
    assert answer_grace(0.002, _incoming(11, 0.0143)) == pytest.approx(4 * 0.00143)
    assert answer_grace(0.002, _incoming(3, 10.0)) == MAX_ANSWER_GRACE
    # after a bitmap the first pass's pace stands: a wait for the resends does not stretch it
    m = _incoming(11, 0.0143)
    m.pace = 0.00143
    m.last_arrival += 0.06
    m.received_pkts = 12
    assert answer_grace(0.002, m) == pytest.approx(4 * 0.00143)


def test_an_end_of_pass_is_answered_when_quiet_and_read_or_after_the_fallback():
    """Quiet for its grace and the reader caught up with the grace's end: answered. A reader
    behind holds it back until MAX_BUSY_DEFER past the grace, counted from the later of the
    PROBE and the last data. The rule is the receive thread's (endpass.h), called from here."""
    m = _incoming(11, 0.0143)
    m.probe_pending = True
    m.probe_since = m.last_arrival + 0.05  # the PROBE came 50 ms after the last data
    g, last = answer_grace(0.002, m), m.last_arrival
    assert not answer_due(m, last + g / 2, 0.002, last + g)  # not quiet yet
    assert answer_due(m, last + g, 0.002, last + g)  # quiet, and everything until then read
    assert not answer_due(m, last + g + MAX_BUSY_DEFER, 0.002, last)  # the reader behind: wait
    assert answer_due(m, m.probe_since + g + MAX_BUSY_DEFER, 0.002, last)  # ... this long at most
    m.probe_pending = False
    assert not answer_due(m, last + 10, 0.002, last + 10)  # nothing to answer


def test_last_goes_on_the_final_packets_of_the_passs_last_priority_level():
    """``last_marks`` (hostagent/native/endpass.h): of a send call's k packets, those within the
    pass's final LAST_PACKETS carry LAST, none while a lower priority is still to go."""
    from dlcp.hostagent import _datapath as rules

    assert rules.last_marks(8, 0, wire.LAST_PACKETS, False) == 3  # the pass's final call: its last 3
    assert rules.last_marks(2, 1, wire.LAST_PACKETS, False) == 2  # 2 here, the third still to go
    assert rules.last_marks(8, 3, wire.LAST_PACKETS, False) == 0  # 3 still to go: none here
    assert rules.last_marks(1, 0, wire.LAST_PACKETS, False) == 1  # a last level of one packet
    assert rules.last_marks(2, 1, wire.LAST_PACKETS, True) == 0  # the one still to go is of a lower priority


def test_the_answer_rule_says_when_to_look_again():
    """``answer_check`` (hostagent/native/endpass.h) gives the time a pending answer can next
    become due: the quiet time's end, then the busy fallback's."""
    from dlcp.hostagent import _datapath as rules

    assert rules.answer_check(1.0, 0.9, 0.25, 0.0, 0.9, 0.2) == (False, pytest.approx(1.15))  # quiet at 1.15
    assert rules.answer_check(1.2, 0.9, 0.25, 1.15, 0.9, 0.2) == (True, 0.0)
    assert rules.answer_check(1.2, 0.9, 0.25, 1.0, 1.0, 0.2) == (False, pytest.approx(1.45))  # since + grace + defer
    assert rules.answer_check(1.45, 0.9, 0.25, 1.0, 1.0, 0.2)[0]
    assert rules.answer_grace(0.002, -1.0, 0.1, 4) == 0.002  # no pace known: the floor
    assert rules.answer_grace(0.002, 1.0, 0.1, 4) == 0.1  # capped


def test_the_default_policy_is_what_the_core_reads():
    core, _ = make_core(policy=Policy(loss_bound_push=0.1))
    core.send(1, np.zeros(PER, np.float32), 1, now=0.0)
    assert core.out[(1, 1)].loss_bound == 0.1


def test_shapes_agree_when_type_count_and_cut_match_or_one_packet_holds_it_all():
    from dlcp.hostagent.protocol.core import shapes_agree

    assert shapes_agree((0, 1000, 357), (0, 1000, 357))
    assert shapes_agree((0, 10, 357), (0, 10, 2232))  # one packet on both sides: MTUs may differ
    assert not shapes_agree((0, 1000, 357), (0, 1000, 2232))  # cut otherwise: every packet refused
    assert not shapes_agree((0, 1000, 357), (0, 400, 357))
    assert not shapes_agree((0, 100, 357), (1, 100, 357))
