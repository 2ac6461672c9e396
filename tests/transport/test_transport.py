"""The bounded-loss transport over real UDP and TCP sockets on 127.0.0.1."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time

import numpy as np
import pytest

from dlcp.hostagent import wire
from dlcp.hostagent.loopback import _pick_range
from dlcp.hostagent.datapath.credits import CREDIT_QUIET, credit_window, max_datagram
from dlcp.hostagent.packetizer import elems_per_packet
from dlcp.hostagent.policy import Policy
from dlcp.hostagent.ratecontrol import RateConfig
from dlcp.hostagent.transport import (Endpoint, LossInjection, PeerFailed, PeerUnreachable, TransportConfig,
                                      TransportError, TransportTimeout)
from tests.conftest import loopback_peers

RNG = np.random.default_rng(7)
T = 20.0  # generous wait bound; every wait in these tests is bounded


def _grad(n: int) -> np.ndarray:
    return RNG.standard_normal(n).astype(np.float32)


def test_exact_without_loss_many_messages_many_peers(endpoints):
    eps = endpoints(3)
    sizes = [0, 1, 357, 358, 359, 100_000, 1_000_003]
    sends, expect = [], {}
    for src in (1, 2):
        for mid, n in enumerate(sizes):
            x = _grad(n)
            expect[(src, mid)] = x
            sends.append(eps[src].send(0, x, message_id=mid, priority=mid % 8, loss_bound=0.0))
    recvs = {k: eps[0].recv(*k) for k in expect}
    for k, h in recvs.items():
        res = h.wait(T)
        np.testing.assert_array_equal(res.data, expect[k])
        assert res.stats.lost_fraction == 0.0 and res.stats.how == "exact"
    for s in sends:
        assert s.wait(T).lost_fraction == 0.0
    assert eps[0].endpoint_stats()["reassembly"]["rejected_total"] == 0


def test_bounded_messages_on_loopback_stay_within_the_bound(endpoints):
    # Two senders into one receiver may overrun its socket buffer: real loss, which the
    # bound absorbs (and rate control answers); the result never loses more than p.
    eps = endpoints(3)
    xs = {src: _grad(2_000_000) for src in (1, 2)}
    for src, x in xs.items():
        eps[src].send(0, x, message_id=1, loss_bound=0.05)
    for src, x in xs.items():
        res = eps[0].recv(src, 1).wait(T)
        assert res.stats.lost_fraction <= 0.05
        present = res.data != 0
        np.testing.assert_array_equal(res.data[present], x[present])


def test_recv_into_out_array(endpoints):
    a, b = endpoints(2)
    x = _grad(5000)
    out = np.empty_like(x)
    h = b.recv(0, 3, out=out)
    a.send(1, x, message_id=3)
    assert h.wait(T).data is out
    np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize("p", [0.0, 0.05])
def test_loss_above_bound_is_recovered_to_the_bound(endpoints, p):
    # 30 % of every class dropped at the receiver: far above the bound.
    loss = LossInjection(drop_probabilities=(0.3, 0.3, 0.3, 0.3), seed=1)
    a, b = endpoints(2, per_rank={1: {"loss": loss}})
    x = _grad(400_000)
    s = a.send(1, x, message_id=1, loss_bound=p)
    res = b.recv(0, 1).wait(T)
    sent = s.wait(T)
    assert res.stats.lost_fraction <= p
    assert sent.retransmissions > 0 and res.stats.retransmissions > 0
    if p == 0:
        np.testing.assert_array_equal(res.data, x)
    else:
        got = res.data
        # what arrived is exact, what is missing is zero, and missing is within the bound
        present = got != 0
        np.testing.assert_array_equal(got[present], x[present])
        assert 1 - present.mean() <= p + 1e-6
    assert sum(b.endpoint_stats()["injected_drops_by_class"].values()) > 0


def test_loss_below_bound_completes_without_retransmission(endpoints):
    # only the smallest class is dropped, 20 % of it: about 5 % of the packets, under p = 0.1
    from dlcp.hostagent.ratecontrol import RateConfig

    loss = LossInjection(drop_probabilities=(0, 0, 0, 0.2), seed=2)
    paced = RateConfig(initial_rate=100e6, line_rate=100e6)  # no socket-buffer overrun: only injected loss
    a, b = endpoints(2, per_rank={0: {"rate": paced}, 1: {"loss": loss}})
    x = _grad(500_000)
    s = a.send(1, x, message_id=1, loss_bound=0.1)
    res = b.recv(0, 1).wait(T)
    assert 0 < res.stats.lost_fraction <= 0.1
    assert res.stats.how in ("bounded", "idle")
    assert b.endpoint_stats()["rx_socket_overflows"] == 0
    assert s.wait(T).retransmissions == 0 and res.stats.retransmissions == 0
    assert b.endpoint_stats()["injected_drops_by_class"].keys() == {3}
    # the dropped packets are exactly the zero-filled ones, and they were the smallest
    lost = res.data == 0
    assert np.abs(x[lost]).mean() < np.abs(x[~lost]).mean()


def test_a_stop_record_finds_the_pass_end_the_data_path_held_back(endpoints):
    """The data path holds a pass's end back until its probe is due (here half a second); a
    bounded message's STOP record comes sooner, and the control thread hands the core the held
    events before the record: the send has its pass's end and the answer time its sample."""
    from dlcp.hostagent.ratecontrol import RateConfig

    loss = LossInjection(drop_probabilities=(0, 0, 0, 0.2), seed=2)
    slow_probe = {"probe_delay": 0.5, "probe_delay_min": 0.5, "probe_delay_max": 0.5,
                  "rate": RateConfig(initial_rate=100e6, line_rate=100e6)}
    a, b = endpoints(2, per_rank={0: slow_probe, 1: {"loss": loss}})
    s = a.send(1, _grad(200_000), message_id=1, loss_bound=0.1)
    res = b.recv(0, 1).wait(T)
    st = s.wait(T)
    assert res.stats.how in ("bounded", "idle") and st.how == "stopped"
    assert st.first_pass_ended is not None
    assert a.core is not None and a.core.answer[1].srtt is not None and a.core.answer[1].srtt < 0.5


def test_exact_messages_are_stopped_by_the_receivers_data_path_not_by_control_records(endpoints):
    """A message that arrives whole is told to its sender by the receiver's data path (a STOP
    datagram): no STOP record crosses the control connection but as the answer to a PROBE (on a
    busy machine a sender may probe before the datagram is read; then the record may end the
    send first, and the datagram finds it ended, or the datagram may end it while the record is
    still on its way)."""
    a, b = endpoints(2)
    xs = [_grad(n) for n in (1, 5_000, 200_000)]
    sends = [a.send(1, x, message_id=mid, loss_bound=0.0) for mid, x in enumerate(xs)]
    for mid, x in enumerate(xs):
        np.testing.assert_array_equal(b.recv(0, mid).wait(T).data, x)
    for s in sends:
        assert s.wait(T).lost_fraction == 0.0
    got = a.endpoint_stats()  # (the sender's first: what it received cannot outgrow what was sent)
    sent = b.endpoint_stats()
    assert sent["stops_sent"] == len(xs)  # the receiver's data path answered every message
    records = sent["ctl_records_sent"].get("STOP", 0)
    # (a STOP record answering a PROBE may still be on its way when the datagram ended the send:
    # counted as sent by the receiver, not yet as received by the sender; the sender counts its
    # PROBE before sending it, so the receiver's answers never outnumber it)
    assert got["ctl_records_received"].get("STOP", 0) <= records <= got["ctl_records_sent"].get("PROBE", 0)
    assert got["stops_received"] + records >= len(xs)  # (a send a record ended ignores its datagram)


def test_a_stop_datagram_lost_on_the_way_is_answered_at_the_senders_probe(endpoints):
    """Every datagram of drop class 0 that reaches the sender is lost (its STOPs and credits): its
    message still ends, at the STOP record that answers its PROBE after the pass."""
    loss = LossInjection(drop_probabilities=(1.0,), seed=3)
    a, b = endpoints(2, per_rank={0: {"loss": loss}})
    x = _grad(20_000)  # (within the first window: no credit needed)
    s = a.send(1, x, message_id=1, loss_bound=0.0)
    np.testing.assert_array_equal(b.recv(0, 1).wait(T).data, x)
    assert s.wait(T).lost_fraction == 0.0
    # (the send may end before its sender's data path has read the datagram: wait for its loss)
    deadline = time.monotonic() + T
    while a.endpoint_stats()["injected_drops_by_class"].get(0, 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    sent, got = b.endpoint_stats(), a.endpoint_stats()
    assert sent["stops_sent"] == 1 and got["stops_received"] == 0
    assert got["injected_drops_by_class"].get(0, 0) >= 1
    # ended by the STOP records that answer its PROBEs (a busy machine may probe more than once)
    assert 1 <= got["ctl_records_received"].get("STOP", 0) <= got["ctl_records_sent"].get("PROBE", 0)


def test_delay_and_reorder_still_exact(endpoints):
    loss = LossInjection(delay=0.02, delay_probability=0.1, reorder=True, seed=3)
    a, b = endpoints(2, per_rank={1: {"loss": loss}})
    x = _grad(300_000)
    a.send(1, x, message_id=9, loss_bound=0.0)
    res = b.recv(0, 9).wait(T)
    np.testing.assert_array_equal(res.data, x)
    assert b.endpoint_stats()["injected_delays"] > 0


def test_priority_order_when_two_messages_compete(endpoints):
    from dlcp.hostagent.ratecontrol import RateConfig

    slow = RateConfig(initial_rate=20e6, line_rate=20e6, burst_bytes=16 * 1024)  # 20 MB/s
    a, b = endpoints(2, per_rank={0: {"rate": slow}})
    low, high = _grad(1_000_000), _grad(50_000)  # 4 MB and 0.2 MB
    done: dict[str, float] = {}

    def watch(name, h):
        h.wait(T)
        done[name] = time.monotonic()

    r_low, r_high = b.recv(0, 1), b.recv(0, 2)
    a.send(1, low, message_id=1, priority=0, loss_bound=0.0)
    time.sleep(0.02)  # the low-priority message is well under way
    a.send(1, high, message_id=2, priority=7, loss_bound=0.0)
    threads = [threading.Thread(target=watch, args=n) for n in (("low", r_low), ("high", r_high))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T)
    # the later high-priority message overtakes the 200 ms low-priority backlog
    assert done["high"] < done["low"] - 0.05


def test_unreachable_peer_is_named(datapath):
    peers = loopback_peers(2)
    ep = Endpoint(TransportConfig(datapath=datapath, rank=0, peers=peers, connect_timeout=0.3)).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerUnreachable, match=r"peer rank 1 at 127\.0\.0\.1:\d+"):
            ep.send(1, _grad(10), message_id=1)
        assert time.monotonic() - t0 < 2
    finally:
        ep.close()


def test_hard_deadline_names_the_message(endpoints):
    everything = LossInjection(drop_probabilities=(1.0, 1.0, 1.0, 1.0))
    a, b = endpoints(2, message_deadline=0.5, per_rank={1: {"loss": everything}})
    s = a.send(1, _grad(10_000), message_id=42, loss_bound=0.0)
    r = b.recv(0, 42)
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout, match="message 42 to rank 1"):
        s.wait(5)
    with pytest.raises(TransportTimeout, match="message 42 from rank 0"):
        r.wait(5)
    assert time.monotonic() - t0 < 3


def _slow_sender(peers, ready):
    from dlcp.hostagent.ratecontrol import RateConfig

    slow = RateConfig(initial_rate=5e6, line_rate=5e6, burst_bytes=16 * 1024)
    ep = Endpoint(TransportConfig(rank=1, peers=peers, rate=slow)).start()
    ep.send(0, np.ones(2_000_000, np.float32), message_id=5, loss_bound=0.0)  # 8 MB at 5 MB/s
    ready.set()
    time.sleep(60)


def test_peer_killed_mid_transfer_gives_a_clear_error(datapath):
    peers = loopback_peers(2)
    ep = Endpoint(TransportConfig(datapath=datapath, rank=0, peers=peers)).start()
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_slow_sender, args=(peers, ready), daemon=True)
    proc.start()
    try:
        h = ep.recv(1, 5)
        assert ready.wait(30)
        time.sleep(0.2)
        proc.kill()  # SIGKILL
        t0 = time.monotonic()
        with pytest.raises(PeerFailed, match=r"peer rank 1 \(127\.0\.0\.1:\d+\).*message 5"):
            h.wait(5)
        assert time.monotonic() - t0 < 2
    finally:
        proc.kill()
        proc.join(5)
        ep.close()


def test_malformed_packets_from_scapy_are_counted_and_harmless(endpoints):
    from scapy.packet import Raw

    from dlcp.hostagent.scapy_layer import DLCP

    a, b = endpoints(2)
    x = _grad(20_000)
    a.send(1, x, message_id=1)
    b.recv(0, 1).wait(T)
    bad = [
        bytes(DLCP(version=9, job_id=1, sender_rank=0, message_id=2)),  # bad version
        bytes(DLCP(job_id=77, sender_rank=0, message_id=2)),  # wrong job
        bytes(DLCP(job_id=1, sender_rank=0, message_id=1, seq=3, elem_offset=1 << 30, elem_count=4, total_pkts=56)
              / Raw(b"\0" * 16 + b"\1" * wire.TRAILER_SIZE)),  # a late straggler, its trailer guessed: bad_mac
        b"\x01\x01",  # truncated
        bytes(DLCP(job_id=1, sender_rank=0, message_id=999, dtype=1)) + b"junk",  # no room for a trailer: truncated
    ]
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for pkt in bad * 20:
        s.sendto(pkt, ("127.0.0.1", b.me.data_port))
    s.close()
    time.sleep(0.3)
    stats = b.endpoint_stats()
    rejected = stats["reassembly"]["rejected"]
    assert rejected.get("bad_version") == 20 and rejected.get("wrong_job") == 20 and rejected.get("truncated") == 40
    assert rejected.get("bad_mac") == 20
    # the later message is exact
    y = _grad(50_000)
    a.send(1, y, message_id=2, loss_bound=0.0)
    np.testing.assert_array_equal(b.recv(0, 2).wait(T).data, y)


def _open_files() -> set[str]:
    """What this process's descriptors point at (a socket by its inode): unlike a count or fd
    numbers, not fooled by an earlier test's leftovers closing meanwhile."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # closed while listing
    return out


def test_no_leaked_threads_or_sockets(datapath):
    fds_before = _open_files()
    threads_before = set(threading.enumerate())
    peers = loopback_peers(3)
    eps = [Endpoint(TransportConfig(datapath=datapath, rank=r, peers=peers)).start() for r in range(3)]
    for src in (1, 2):
        eps[src].send(0, _grad(10_000), message_id=src)
    for src in (1, 2):
        eps[0].recv(src, src).wait(T)
    for ep in eps:
        ep.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and set(threading.enumerate()) - threads_before:
        time.sleep(0.05)  # daemon writers end right after close() on a loaded machine
    assert not set(threading.enumerate()) - threads_before
    assert not {f for f in _open_files() - fds_before if f.startswith(("socket:", "anon_inode:"))}


def test_config_validation(datapath):
    peers = loopback_peers(2)
    with pytest.raises(ValueError, match="rank=5"):
        TransportConfig(datapath=datapath, rank=5, peers=peers)
    with pytest.raises(ValueError, match="drop_probabilities"):
        LossInjection(drop_probabilities=(2.0,))
    with pytest.raises(ValueError, match=r"datapath='numpy' must be one of \('native',\) \(the numpy data path is no "
                                         "longer part of the package"):
        TransportConfig(datapath="numpy", rank=0, peers=peers)
    ep = Endpoint(TransportConfig(datapath=datapath, rank=0, peers=peers))
    with pytest.raises(ValueError, match="unknown peer rank 7"):
        ep.send(7, _grad(3), message_id=1)
    ep.close()


def _slow_stream(endpoints, **config) -> tuple[list[Endpoint], int]:
    """Rank 1 sends rank 0 one reliable message of 400 full packets, paced at 2 MB/s (about
    1,400 packets a second, a few hundred microseconds apart: rank 0's receiver finds its socket
    dry after nearly every packet). Returns the endpoints and the packets sent."""
    rate = RateConfig(initial_rate=2e6, line_rate=2e6, min_rate=1e6, additive_increase=0.0)
    eps = endpoints(2, rate=rate, **config)
    x = _grad(400 * elems_per_packet(eps[1].config.mtu, np.float32))
    eps[1].send(0, x, message_id=1, loss_bound=0.0)
    res = eps[0].recv(1, 1).wait(T)
    np.testing.assert_array_equal(res.data, x)
    return eps, res.stats.packets


def test_a_slow_stream_is_credited_by_its_window_not_per_packet(endpoints):
    # The window here (64 MB socket) is thousands of packets: none of the 400 reaches its
    # quarter, so the stream earns credits only when it goes quiet (its end, or a stall of
    # the busy machine). A credit per dry socket gave about one per packet.
    eps, packets = _slow_stream(endpoints)
    time.sleep(4 * CREDIT_QUIET)  # the tail's credit
    rx, tx = eps[0].endpoint_stats(), eps[1].endpoint_stats()
    assert 1 <= rx["credits_sent"] <= packets // 10, rx["credits_sent"]
    assert tx["credit_timeouts"] == 0


def test_a_small_window_is_credited_every_quarter_and_never_times_out(endpoints):
    # A 64 KB socket: the window is credit_window's floor-or-so of packets, so the sender is
    # held by it again and again, and goes on only by the receiver's quarter credits.
    eps, packets = _slow_stream(endpoints, socket_buffer=64 * 1024)
    window = credit_window(2 * 64 * 1024, max_datagram(eps[0].config), 1)  # the kernel doubles the buffer
    rx, tx = eps[0].endpoint_stats(), eps[1].endpoint_stats()
    assert window < packets
    assert packets // window <= rx["credits_sent"] <= packets // max(1, window // 4) + 2
    assert tx["credits_received"] >= packets // window
    assert tx["credit_timeouts"] == 0


def test_a_window_filled_by_packets_lost_on_the_way_is_released_by_the_quiet_receiver(endpoints):
    # A small window (64 KB socket) and a fifth of the packets lost on the way (injected before
    # the receiver reads them, as a network loses them): a lost packet is never consumed, so the
    # sender's window fills with them and it stops mid-pass. The receiver, caught up and hearing
    # nothing for CREDIT_QUIET while the message is incomplete, releases it (release_due)
    # instead of leaving it to the 200 ms credit timeout, every few window's worth.
    loss = LossInjection(drop_probabilities=(0.2,) * 4, seed=3)
    eps, packets = _slow_stream(endpoints, socket_buffer=64 * 1024, per_rank={0: {"loss": loss}})
    window = credit_window(2 * 64 * 1024, max_datagram(eps[0].config), 1)
    rx, tx = eps[0].endpoint_stats(), eps[1].endpoint_stats()
    assert packets // 5 > 2 * window  # the losses alone fill the window more than twice
    assert rx["loss_releases_sent"] >= 2
    assert tx["credit_timeouts"] == 0


def test_ecn_marks_are_counted_and_echoed(endpoints):
    # A CE-marked datagram (as a switch above its ECN threshold would send) reaches the
    # receiver's counters; the sender's controller then cuts its rate.
    a, b = endpoints(2)
    x = _grad(3000)
    r = b.recv(0, 4)
    s = a.send(1, x, message_id=4, loss_bound=0.0)
    s.wait(T)
    r.wait(T)
    from dlcp.hostagent.packetizer import MessageMeta, elems_per_packet, packetize

    per = elems_per_packet(1500, np.float32)
    meta = MessageMeta(job_id=1, message_id=5, sender_rank=0, token=b.core.rx_token(0, 5, 0))
    batch = packetize(_grad(per * 4), meta, Policy())
    b.recv(0, 5)
    ce = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    ce.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, 0b11)
    rate_before = a.endpoint_stats()["rate_bytes_per_s"][1]
    a.announce(1, 5, per * 4, np.float32, 0.0)
    time.sleep(0.05)
    from dlcp.hostagent import sealing

    sealer = sealing.new_sealer(a.core.tx_keys[1], sealing.MAC)  # as rank 0 seals them, with numbers
    datagrams = list(batch)
    for _ in range(1000):  # past those rank 0 took (message 4's): a number taken already is a replay
        sealing.seal(sealer, datagrams[0])
    for d in datagrams:
        ce.sendto(sealing.seal(sealer, d), ("127.0.0.1", b.me.data_port))
    ce.close()
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and b.endpoint_stats()["ce_marked"] < 4:
        time.sleep(0.01)
    assert b.endpoint_stats()["ce_marked"] == 4
    while time.monotonic() < deadline and a.endpoint_stats()["rate_bytes_per_s"][1] >= rate_before:
        time.sleep(0.01)
    assert a.endpoint_stats()["rate_bytes_per_s"][1] < rate_before
    # the rate log says why: the destination's start, then a cut by marks, at the rate now paced
    with a._lock:  # one snapshot: a later FEEDBACK may still move the rate
        log = [c for c in a.rate_log if c.dest == 1]
        pacing = a.core.rate[1].effective_rate
    assert log[0].cause == "start" and any(c.cause == "marks" for c in log)
    assert log[-1].rate == pacing
    # the data sockets' ports, from which a report can tell a switch's flow hash
    socks = a.endpoint_stats()["data_sockets"]
    assert socks and all(d == 1 and 0 < port < 65536 for d, _, port in socks)
    assert len({port for *_, port in socks}) == len(socks)  # one socket (and port) per priority


def test_wakes_coalesce_and_never_block_while_the_control_loop_is_busy(endpoints):
    """The rx, tx and control threads wake the control loop per STOP, pass end or CE mark. While
    that loop is busy (here: held on the endpoint lock) a million wakes must neither block the
    caller on a full wake pipe (the control thread wakes itself too: that would hang it) nor
    pile up; once free, the loop serves them and the endpoint works on."""
    a, b = endpoints(2)
    done = threading.Event()

    def wake_a_lot():
        for _ in range(1_000_000):
            b._wake()
        done.set()

    with b._lock:  # the control loop blocks at its next timer run
        time.sleep(0.05)
        t = threading.Thread(target=wake_a_lot, daemon=True)
        t.start()
        assert done.wait(10), "a wake blocked while the control loop was busy"
    x = _grad(10_000)
    h = b.recv(0, 1)
    a.send(1, x, message_id=1)
    np.testing.assert_array_equal(h.wait(T).data, x)


def test_a_half_precision_message_done_before_its_sum_is_posted_adds_into_float32(endpoints):
    """A float16 push that completed before the server posted its float32 sum (a parameter
    server's race) is added into it, as one arriving later would be; before, the late recv
    failed with "has 700 float16, out is float32"."""
    eps = endpoints(2)
    x = _grad(700).astype(np.float16)
    eps[1].send(0, x, message_id=3, loss_bound=0.0).wait(T)  # the STOP: rank 0 has it all
    total = np.ones(700, np.float32)
    res = eps[0].recv(1, 3, out=total, accumulate=True).wait(T)
    assert res.data is total
    np.testing.assert_array_equal(total, np.float32(1) + x.astype(np.float32))


def _free_udp_range(n: int) -> int:
    """A base port with ``n`` consecutive UDP ports free on this host right now, below the span
    the endpoints' own ports are picked from (``loopback._pick_range``, itself below the
    ephemeral range): a base inside it took an endpoint's data port now and then (21008 against
    21000..21015, one run in a few hundred)."""
    span = _pick_range()
    top = span[0] if span is not None else 32768
    for base in range(10000, top - n, 64):
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                socks.append(s)
                s.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free range of UDP ports")


def test_data_leaves_from_the_fixed_source_ports_so_flow_hashing_repeats(endpoints):
    # With a source port base, rank r's data to rank d at priority q leaves from base + 8 d + q
    # (bound when the endpoint starts), on both data paths: a switch hashing the 5-tuple then
    # gives every run with this base the same paths.
    base = _free_udp_range(16)
    a, b = endpoints(2, source_port_base=base)
    x = _grad(20000)
    r = b.recv(0, 9)
    a.send(1, x, message_id=9, loss_bound=0.0).wait(T)
    assert np.array_equal(r.wait(T).data, x)
    top = a.config.policy.top_priority
    assert sorted(a.endpoint_stats()["data_sockets"]) == [(1, q, base + 8 + q) for q in range(top + 1)]
    assert sorted(b.endpoint_stats()["data_sockets"]) == [(0, q, base + q) for q in range(top + 1)]


def test_a_taken_source_port_stops_the_endpoint_at_start_naming_it(datapath):
    base = _free_udp_range(16)
    peers = loopback_peers(2)
    taken = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    taken.bind(("0.0.0.0", base + 8 + 3))  # rank 0's socket to rank 1 at priority 3
    try:
        with pytest.raises(TransportError, match=f"source port {base + 11}: .*in use"):
            Endpoint(TransportConfig(rank=0, peers=peers, source_port_base=base, datapath=datapath)).start()
    finally:
        taken.close()


def test_a_source_port_base_is_checked_against_the_port_range_and_the_own_ports():
    peers = loopback_peers(3)
    with pytest.raises(ValueError, match=r"source_port_base=65530: its ports 65530\.\.65553 must lie in 1024"):
        TransportConfig(rank=0, peers=peers, source_port_base=65530)
    own = peers[1].data_port
    with pytest.raises(ValueError, match="take this rank's data or control port"):
        TransportConfig(rank=1, peers=peers, source_port_base=own - 4)
    assert TransportConfig(rank=0, peers=peers, source_port_base=None).source_port_base is None


@pytest.mark.parametrize("thread", ["receive", "send"])
def test_a_data_path_thread_that_raises_fails_the_endpoint_not_the_process(endpoints, thread):
    """A ``std::bad_alloc`` (or any exception) in the compiled receive or send thread ended the
    training process (std::terminate); the numpy path's threads died silently. Now the thread
    reports it and stops: what waits fails with the reason, every later call raises it, the
    endpoint's statistics say it, and the endpoint closes; its peer goes on."""
    a, b = endpoints(2)
    waiting = b.recv(0, message_id=1)  # a message that never comes
    b.dp.fault_for_test(thread)
    with pytest.raises(TransportError, match=f"data path's {thread} thread failed"):
        waiting.wait(T)
    assert f"{thread} thread failed" in b.endpoint_stats()["datapath_failure"]
    with pytest.raises(TransportError, match=f"{thread} thread failed"):
        b.send(0, _grad(10), message_id=2)
    assert a.endpoint_stats()["datapath_failure"] is None
    b.close()


@pytest.mark.parametrize("dtype", sorted(wire.NUMPY_DTYPES.values(), key=str))
def test_every_dtype_arrives_at_an_mtu_whose_room_is_no_multiple_of_four(endpoints, dtype):
    """At MTU 9002 a packet has 8,906 bytes of room: 2,226 float32 elements (8,904 bytes) but
    4,453 half-precision ones (8,906). Every datagram the sender cuts must fit what the receiver
    accepts; a half-precision packet 2 bytes longer than a float32 one was dropped as too long
    and the message never completed (the backend on loopback's MTU hung in DDP's first broadcast)."""
    mtu = 9002
    assert elems_per_packet(mtu, np.float16) * 2 > elems_per_packet(mtu, np.float32) * 4
    a, b = endpoints(2, mtu=mtu)
    x = (np.arange(3 * elems_per_packet(mtu, dtype) + 5) % 251).astype(dtype)
    h = b.recv(0, 9)
    a.send(1, x, message_id=9)
    res = h.wait(T)
    np.testing.assert_array_equal(res.data, x)
    assert not b.endpoint_stats()["reassembly"]["rejected"]  # nothing refused as malformed
