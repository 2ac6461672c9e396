"""The compiled data path's per-packet rules where they run, on a clock the test gives and without
a socket read (the ``*_for_test`` seams and the bound ``Pacer``): when a credit goes and what it
says, when it releases, who is blamed for a socket overrun, what the drain meter learns, how the
pacer spends its tokens. These tables were the Python copies' (datapath/credits.py,
ratecontrol.DrainMeter and Pacer); the rules are written once now, in hostagent/native/ (rx.cc,
pacer.h), and the copies that remain are the numpy reference model's (tests/reference/)."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from dlcp.hostagent import auth, sealing, wire
from dlcp.hostagent.datapath import native_available
from dlcp.hostagent.datapath.credits import CREDIT_QUIET, CREDIT_SHARE, MIN_WINDOW
from dlcp.hostagent.protocol.port import STOP_SENT, EventKind, TxSpec
from dlcp.hostagent.transport_config import TransportConfig, local_peers
from tests.transport.test_datapath import KEY1, PER, WIDTH, _datagrams, _expect, _one

pytestmark = pytest.mark.skipif(native_available() is not None, reason=str(native_available()))

WINDOW = 40
MEMORY = CREDIT_SHARE * WIDTH * WINDOW  # a socket whose credit window is WINDOW packets for one sender


def _receiver(peer_port: int = 41002):
    """Rank 0's compiled data path, threads not started, rank 1 an authenticated sender (KEY1
    both ways) whose data port is ``peer_port``, and 20 packets of message 5 from rank 1 expected.
    Returns (data path, socket, the 20 datagrams)."""
    from dlcp.hostagent.datapath.native import NativeDatapath

    cfg = TransportConfig(rank=0, peers=local_peers(3, 41000))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dp = NativeDatapath(cfg, sock, False)
    dp.set_keys(1, KEY1, KEY1)
    dp.add_peer(1, "127.0.0.1", peer_port)
    x = np.arange(PER * 20, dtype=np.float32)
    _expect(dp, 1, 5, x.size)
    return dp, sock, _datagrams(x, 5)


@pytest.fixture
def receiver():
    """:func:`_receiver`'s data path and datagrams."""
    dp, sock, dgs = _receiver()
    yield dp, dgs
    dp.stop()
    sock.close()


def _said(grant) -> tuple[int, int, int, bool]:
    """What a credit says on the wire, opened under the key of its direction: (credit number,
    window, consumed, RELEASE)."""
    opened = sealing.open_datagram(sealing.new_sealer(KEY1, sealing.MAC), grant.datagram)
    assert opened is not None, "a credit that does not open under its direction's key"
    h = wire.unpack_header(opened)
    assert h.ptype == wire.PacketType.CREDIT and h.sender_rank == 0
    return h.iteration, h.elem_count, (h.total_pkts << 32) | h.elem_offset, bool(h.flags & wire.Flags.RELEASE)


def test_a_credit_goes_at_a_quarter_of_the_window_or_when_the_sender_goes_quiet(receiver):
    dp, dgs = receiver
    for d in dgs[:9]:
        _one(dp, d, now=1.0)
    wake, got = dp.credits_for_test(1.0, 1.0, MEMORY)
    assert got == [] and wake == pytest.approx(1.0 + CREDIT_QUIET)  # 9 < 40 / 4, and not quiet yet
    _one(dp, dgs[9], now=1.0)
    _, got = dp.credits_for_test(1.0, 1.0, MEMORY)
    assert [(c.rank, c.window, c.consumed, c.release) for c in got] == [(1, WINDOW, 10, False)]
    assert _said(got[0]) == (1, WINDOW, 10, False)
    # three more, then silence: credited once quiet for CREDIT_QUIET, not before (the reader has
    # read only up to 1.002, so the silence is not yet a loss)
    for d in dgs[10:13]:
        _one(dp, d, now=1.001)
    wake, got = dp.credits_for_test(1.004, 1.002)
    assert got == [] and wake == pytest.approx(1.001 + CREDIT_QUIET)
    _, got = dp.credits_for_test(1.0061, 1.002)
    assert [(c.consumed, c.release) for c in got] == [(13, False)] and _said(got[0])[0] == 2
    assert dp.stats()["credits_sent"] == 2


def test_a_sender_silent_while_its_message_is_incomplete_is_released_once(receiver):
    """release_due: all that reached the host is read (``seen_until``), nothing of the sender came
    for CREDIT_QUIET before that, and a message of its is incomplete: its credit says RELEASE,
    once per silence."""
    dp, dgs = receiver
    for d in dgs[:13]:
        _one(dp, d, now=1.0)
    _, got = dp.credits_for_test(1.0, 1.0, MEMORY)
    assert [(c.consumed, c.release) for c in got] == [(13, False)]  # the quarter
    _, got = dp.credits_for_test(1.0049, 1.0049)
    assert got == []
    _, got = dp.credits_for_test(1.0051, 1.0051)
    assert [(c.consumed, c.release) for c in got] == [(13, True)] and _said(got[0])[3]
    assert dp.credits_for_test(2.0, 2.0)[1] == []  # released already, nothing new
    assert dp.stats()["loss_releases_sent"] == 1
    _one(dp, dgs[13], now=2.0)  # a packet ends the silence: the next one may release again
    _, got = dp.credits_for_test(2.0051, 2.0051)
    assert [(c.consumed, c.release) for c in got] == [(14, True)]
    assert dp.stats()["loss_releases_sent"] == 2


def test_a_complete_message_leaves_nothing_to_release(receiver):
    dp, dgs = receiver
    for d in dgs:
        _one(dp, d, now=1.0)
    _, got = dp.credits_for_test(1.0, 1.0, MEMORY)
    assert [(c.consumed, c.release) for c in got] == [(20, False)]
    assert dp.credits_for_test(5.0, 5.0)[1] == []


def test_the_window_is_the_socket_memory_shared_by_the_authenticated_senders(receiver):
    dp, dgs = receiver
    dp.set_keys(2, bytes(range(16, 32)), bytes(range(16, 32)))  # a second sender: each gets half
    for d in dgs[:5]:
        _one(dp, d, now=1.0)
    _, got = dp.credits_for_test(1.0, 1.0, MEMORY)
    assert [c.window for c in got] == [WINDOW // 2]
    _, got = dp.credits_for_test(1.0, 1.0, CREDIT_SHARE * WIDTH * 3)  # never below MIN_WINDOW
    assert got == []  # nothing consumed since the last
    for d in dgs[5:7]:  # a quarter of MIN_WINDOW
        _one(dp, d, now=1.0)
    _, got = dp.credits_for_test(1.0, 1.0, CREDIT_SHARE * WIDTH * 3)
    assert [c.window for c in got] == [MIN_WINDOW]


def test_an_overrun_is_blamed_on_the_holes_of_the_senders_that_filled_the_socket(receiver):
    """A dropped socket-buffer entry is a draw of the reads since the last drops: a sender is
    blamed for its share of them, at most the holes its messages show; its next credit
    releases what it sent. Drops among junk alone blame nobody."""
    dp, dgs = receiver
    for i in [0, 1, 2, 3, 4, 7, 8, 9, 10, 11, 12]:  # 5 and 6 missing: two holes
        _one(dp, dgs[i], now=1.0)
    dp.account_reads_for_test(11, 0, now=1.0)  # the drop counter's first reading: nothing dropped
    assert dp.stats()["rx_dropped_estimate"] == 0
    dp.account_reads_for_test(0, 4, now=1.001)  # 4 entries dropped: its share is all 4, its holes 2
    s = dp.stats()
    assert (s["rx_dropped_estimate"], s["rx_dropped_reads"]) == (2, 4)
    assert dp.take_feedback(1) == (11, 0, 2)
    assert any(e[0] == EventKind.CONGESTION and e[1] == 1 for e in dp.take_events())
    _, got = dp.credits_for_test(1.001, 1.0, MEMORY)  # a quarter consumed, and the overrun: RELEASE
    assert [(c.consumed, c.release) for c in got] == [(11, True)]
    assert dp.stats()["overrun_credits_sent"] == 1
    dp.account_reads_for_test(100, 12, now=1.1)  # 100 reads of junk, 8 dropped: no sender's share
    assert dp.stats()["rx_dropped_estimate"] == 2 and dp.stats()["rx_dropped_reads"] == 12
    assert dp.take_feedback(1)[2] == 0


def _stop_datagram(mid: int, iteration: int, held: int, sender: int = 1) -> bytes:
    """A STOP datagram as a receiver's data path sends it (unsealed): the message, its
    iteration, the elements held in (total_pkts, elem_offset)."""
    return wire.pack_header(wire.Header(ptype=wire.PacketType.STOP, job_id=1, message_id=mid, sender_rank=sender,
                                        iteration=iteration, total_pkts=held >> 32, elem_offset=held & 0xFFFFFFFF,
                                        priority=7))


def test_a_message_complete_here_is_answered_at_once_with_a_stop_datagram():
    """Every packet placed: the data path tells the sender itself (a STOP datagram sealed under
    the direction's key, naming the message, its iteration and the elements held) and reports
    the completion as STOP_SENT, so the protocol core sends no STOP record. A message completed
    with packets missing gets no datagram (its STOP lists them, from the core)."""
    peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    peer.bind(("127.0.0.1", 0))
    dp, sock, dgs = _receiver(peer.getsockname()[1])
    stops = sealing.new_sealer(KEY1, sealing.MAC)  # rank 1's opener of what rank 0 sends it

    def stops_read(wait: float) -> list[wire.Header]:
        """The STOP datagrams rank 1's data port got within ``wait`` (credits skipped: the
        started receive thread grants them on its own clock)."""
        got, end = [], time.monotonic() + wait
        while (left := end - time.monotonic()) > 0:
            peer.settimeout(left)
            try:
                opened = sealing.open_datagram(stops, peer.recv(4096))
            except TimeoutError:
                break
            assert opened is not None, "a datagram that does not open under its direction's key"
            h = wire.unpack_header(opened)
            if h.ptype == wire.PacketType.STOP:
                got.append(h)
        return got

    try:
        dp.start()  # (the datagrams leave from the socket the started threads hold)
        for d in dgs:
            _one(dp, d, now=1.0)
        done = [e for e in dp.take_events() if e[0] == EventKind.RX_DONE]
        assert [(e[1], e[2], e[4]) for e in done] == [(1, 5, STOP_SENT)]
        [h] = stops_read(1.0)
        assert (h.message_id, h.sender_rank, h.iteration) == (5, 0, 0)
        assert (h.total_pkts << 32 | h.elem_offset) == PER * 20
        assert dp.stats()["stops_sent"] == 1
        # a bounded completion (the core completes it with 3 packets missing): no datagram
        x = np.arange(PER * 10, dtype=np.float32)
        _expect(dp, 1, 6, x.size)
        for d in _datagrams(x, 6)[:7]:
            _one(dp, d, now=1.1)
        assert dp.complete(1, 6, True)
        assert stops_read(0.3) == [] and dp.stats()["stops_sent"] == 1
    finally:
        dp.stop()
        sock.close()
        peer.close()


def test_a_stop_datagram_ends_only_the_use_of_the_message_it_names(receiver):
    """The sender's side: a STOP datagram from the receiver ends the message it names (TX_STOP,
    the elements held) and nothing is sent of it any more; one of another iteration (an earlier
    use of the id, late) is ignored, one holding fewer elements than the message is refused, and
    a changed or replayed one is refused before it is read."""
    dp, _ = receiver
    x = np.arange(PER * 4, dtype=np.float32)
    dp.submit(TxSpec(1, 7, x, int(wire.dtype_code(np.float32)), PER, auth.DATA_TOKEN, 3, 0, 0, 6, None, None,
                     np.zeros(4, np.uint8)))
    dp.take_events()
    sealer = sealing.new_sealer(KEY1, sealing.MAC)  # rank 1's, to rank 0

    def feed(d: bytes) -> list:
        row = np.zeros((1, WIDTH), np.uint8)
        row[0, : len(d)] = np.frombuffer(d, np.uint8)
        dp.ingest_for_test(row, np.array([len(d)]), 2.0)
        return [e for e in dp.take_events() if e[0] == EventKind.TX_STOP]

    assert feed(sealing.seal(sealer, _stop_datagram(7, 2, x.size))) == []  # another use of the id
    assert feed(sealing.seal(sealer, _stop_datagram(7, 3, x.size - 1))) == []  # not all of it
    assert dp.stats()["rejected"]["count_mismatch"] == 1
    good = sealing.seal(sealer, _stop_datagram(7, 3, x.size))
    flipped = bytearray(good)
    flipped[wire.HEADER_SIZE - 1] ^= 1
    assert feed(bytes(flipped)) == []
    assert dp.stats()["rejected"]["bad_mac"] == 1
    assert [(e[1], e[2], e[4]) for e in feed(good)] == [(1, 7, x.size)]
    assert feed(good) == [] and dp.stats()["rejected"]["replay"] == 1
    assert dp.stats()["stops_received"] == 1
    assert not dp.tx_info(1, 7).active  # nothing of it leaves any more


def test_the_drain_meter_samples_only_stretches_of_full_batches(receiver):
    dp, _ = receiver
    dp.drain_batch_for_test(0.0, 10_000, False, now=0.001)  # kept up: nothing to learn
    assert dp.drain_rate(0.001) == 0
    dp.drain_batch_for_test(1.000, 100_000, True, now=1.002)  # full batches, more queued
    dp.drain_batch_for_test(1.002, 100_000, True, now=1.004)
    dp.drain_batch_for_test(1.004, 100_000, False, now=1.006)  # drained 300 kB in 6 ms
    assert dp.drain_rate(1.006) == pytest.approx(50e6)
    assert dp.drain_rate(1.2) == pytest.approx(50e6) and dp.drain_rate(2.0) == 0  # stale: no ceiling


def test_the_drain_meter_learns_nothing_from_a_receiver_that_keeps_up_with_a_paced_sender(receiver):
    """A receiver a little behind a paced sender (its batches end with the socket empty) is not
    overloaded: what it took is the sender's pace, not its own limit, and advertising that as a
    ceiling would hold the sender there for good (the first design did, at 440-750 MB/s for a
    receiver able to take 1 GB/s)."""
    dp, _ = receiver
    t = 0.0
    for _ in range(1000):  # 1 s of 260 KB batches every 0.5 ms, each one slowed by its thread's preemption
        dp.drain_batch_for_test(t, 260_000, False, now=t + 0.00045)
        t += 0.0005
    assert dp.drain_rate(t) == 0


def test_the_drain_meter_counts_short_fast_stretches_as_well_as_long_slow_ones(receiver):
    """No minimum length: a sample from a quick catch-up weighs as much as one from a stretch in
    which the thread was descheduled, so the estimate is not biased low."""
    dp, _ = receiver
    dp.drain_batch_for_test(0.0, 1_000_000, True, now=0.0005)
    dp.drain_batch_for_test(0.0005, 1_000, False, now=0.001)  # 1 MB in 1 ms
    assert dp.drain_rate(0.001) == pytest.approx(1.001e9)
    dp.drain_batch_for_test(1.0, 1_000_000, True, now=1.004)
    dp.drain_batch_for_test(1.004, 0, False, now=1.004)  # 1 MB in 4 ms
    assert dp.drain_rate(1.004) == pytest.approx(0.7 * 1.001e9 + 0.3 * 250e6)


# ----------------------------------------------------------------------------- the send side

def _pacer(burst_bytes: float, slack: float = 0.0):
    """The send thread's token bucket (hostagent/native/pacer.h)."""
    from dlcp.hostagent import _datapath

    return _datapath.Pacer(burst_bytes, slack)


def test_pacer_token_bucket():
    p = _pacer(burst_bytes=1000)
    assert p.wait_time(1000, rate=100.0, now=0.0) == 0.0
    p.consume(1000)
    assert p.wait_time(500, rate=100.0, now=0.0) == pytest.approx(5.0)
    assert p.wait_time(500, rate=100.0, now=5.0) == 0.0  # refilled 500 bytes in 5 s
    p.consume(500)
    assert p.wait_time(1, rate=100.0, now=100.0) == 0.0
    assert p.tokens == 1000.0  # capped at the burst


def test_a_pacer_with_slack_lets_a_short_deficit_leave_on_credit_and_keeps_the_mean_rate():
    rate, slack = 1000.0, 0.5  # bytes/s, s: up to 500 bytes of debt are no wait
    p = _pacer(burst_bytes=1000, slack=slack)
    assert p.wait_time(1400, rate, now=0.0) == 0.0  # 400 short: on credit
    p.consume(1400)
    assert p.wait_time(100, rate, now=0.0) == 0.0  # 500 short: still on credit
    p.consume(100)
    assert p.wait_time(100, rate, now=0.0) == pytest.approx(0.6)  # 600 short: all of it waited
    # a sender that sends 128 bytes whenever allowed, sleeping whatever it is told (binary
    # fractions, so the fake clock adds up exactly): fewer sleeps than without slack, never
    # ahead of burst + slack x rate, the same mean rate
    rate = 1024.0
    for sl, expect_sleeps in ((0.0, 800), (slack, 160)):
        p, now, sent, sleeps = _pacer(burst_bytes=1024, slack=sl), 0.0, 0, 0
        while now < 100.0:
            w = p.wait_time(128, rate, now)
            if w > 0:
                now, sleeps = now + w, sleeps + 1
                continue
            p.consume(128)
            sent += 128
            assert sent <= 1024 + rate * now + rate * sl + 128
        assert sent == pytest.approx(1024 + rate * now, abs=rate * sl + 128)
        assert sleeps == expect_sleeps


def test_pacer_allowance_is_what_may_leave_within_a_horizon():
    """What a sender's pick may take (tokens now plus what the horizon refills), never more;
    a debt from an earlier send is subtracted, so a pick after an overdraft is small."""
    p = _pacer(burst_bytes=1000)
    assert p.allowance(rate=100.0, now=0.0, horizon=0.5) == pytest.approx(1050.0)
    p.consume(1400)  # sent past the bucket: 400 bytes of debt
    assert p.allowance(rate=100.0, now=0.0, horizon=0.5) == pytest.approx(-350.0)
    assert p.allowance(rate=100.0, now=6.0, horizon=0.5) == pytest.approx(250.0)


def test_a_pass_end_wakes_the_control_thread_when_its_probe_is_due_and_a_stop_at_once():
    """An event that only sets a later deadline makes the deferred fd readable when that deadline
    is due, not the event fd: a pass's end when its PROBE is (``set_probe_delay``), a held send
    that started ``probe_delay_min`` after it; any other event (a STOP datagram's end of a send)
    makes the event fd readable at once, and one take_events hands over both in order and
    disarms the deferred fd. (Why: the control thread woke once for a pass's end and again for
    the STOP that usually follows within a round trip.)"""
    import select

    from dlcp.hostagent.datapath.native import NativeDatapath

    cfg = TransportConfig(rank=0, peers=local_peers(2, 41100), probe_delay_min=0.5)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dp = NativeDatapath(cfg, sock, False)
    raw = dp._dp
    try:
        def ready(timeout: float) -> set[str]:
            fds = {dp.event_fd(): "now", dp.deferred_event_fd(): "deferred"}
            r, _, _ = select.select(list(fds), [], [], timeout)
            return {fds[f] for f in r}

        def woken() -> float:
            """Seconds until the deferred fd is readable (at most 10)."""
            t0 = time.monotonic()
            assert ready(10.0) == {"deferred"}
            return time.monotonic() - t0

        t = time.monotonic()
        raw.emit_for_test(int(EventKind.TX_ACTIVE), 1, 8, t, 0)
        raw.emit_for_test(int(EventKind.TX_PASS), 1, 7, t, 0)
        assert ready(0.0) == set()  # held back ...
        assert 0.5 - 0.1 <= time.monotonic() - t + woken()  # ... until probe_delay_min after them
        assert [e[:3] for e in dp.take_events()] == [(EventKind.TX_ACTIVE, 1, 8), (EventKind.TX_PASS, 1, 7)]
        assert ready(0.0) == set()

        dp.set_probe_delay(1, 1.5)  # a pass's end to rank 1: when its probe is due
        t = time.monotonic()
        raw.emit_for_test(int(EventKind.TX_PASS), 1, 9, t, 0)
        assert ready(0.7) == set()
        assert 1.5 - 0.1 <= time.monotonic() - t + woken()
        dp.take_events()
        dp.set_probe_delay(1, 0.0)  # (never sooner than probe_delay_min)
        t = time.monotonic()
        raw.emit_for_test(int(EventKind.TX_PASS), 1, 9, t, 0)
        assert 0.5 - 0.1 <= time.monotonic() - t + woken()
        dp.take_events()

        raw.emit_for_test(int(EventKind.TX_PASS), 1, 9, time.monotonic(), 0)
        raw.emit_for_test(int(EventKind.TX_STOP), 1, 9, time.monotonic(), PER)
        assert ready(0.0) == {"now"}  # the STOP wakes it at once, and takes the pass's end along
        assert [e[:3] for e in dp.take_events()] == [(EventKind.TX_PASS, 1, 9), (EventKind.TX_STOP, 1, 9)]
        assert ready(0.7) == set()  # the deferred fd was disarmed: no empty wake later

        raw.emit_for_test(int(EventKind.RX_DONE), 1, 10, time.monotonic(), 1)
        raw.emit_for_test(int(EventKind.TX_PASS), 1, 11, time.monotonic(), 0)  # after one not taken: no timer
        assert ready(0.0) == {"now"}
        assert len(dp.take_events()) == 2 and ready(0.7) == set()
    finally:
        dp.stop()
        sock.close()
