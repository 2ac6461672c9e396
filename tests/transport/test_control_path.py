"""The cheaper control path, per-packet priorities end to end, GSO/GRO and the safe start,
on real loopback endpoints."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from dlcp.hostagent.fusion import Layout
from dlcp.hostagent.messages import Expect, MessageMismatch
from dlcp.hostagent.policy import Policy
from dlcp.hostagent.packetizer import elems_per_packet
from dlcp.hostagent.udp_offload import gso_supported

PER = elems_per_packet(1500, np.float32)  # elements per packet at the default MTU


def _grad(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_fused_message_keeps_each_layers_priority_per_packet(endpoints):
    a, b = endpoints(2, policy=Policy(loss_bound_push=0.0))
    lay = Layout.of_sizes([PER * 4 + 100, PER * 6], [2, 7], [9, 3])
    x = _grad(lay.total)
    h = b.recv(0, 5)
    a.send(1, x, 5, layout=lay)
    got = h.wait(10)
    np.testing.assert_array_equal(got.data, x)
    expected_p, expected_l = lay.packet_tags(PER)
    np.testing.assert_array_equal(got.packet_priorities, expected_p)
    np.testing.assert_array_equal(got.packet_layers, expected_l)
    assert got.packet_priorities[4] == 7  # the packet that straddles the boundary takes the urgent layer


def test_expected_messages_need_no_meta_and_announcements_share_one_frame(endpoints):
    a, b = endpoints(2, policy=Policy(loss_bound_push=0.0))
    xs = [_grad(5000, s) for s in range(4)]
    # 1. the receiver knows the size: no META at all
    handles = [b.recv(0, 10 + i, expect=Expect(x.size, np.float32, 0.0)) for i, x in enumerate(xs)]
    sends = [a.send(1, x, 10 + i, announce=False) for i, x in enumerate(xs)]
    for h, x in zip(handles, xs):
        np.testing.assert_array_equal(h.wait(10).data, x)
    for s in sends:
        s.wait(10)
    assert a.endpoint_stats()["ctl_records_sent"].get("META", 0) == 0
    # 2. announced ahead inside batch(): four METAs, one frame
    frames0 = a.stats.ctl_frames_sent
    with a.batch():
        for i, x in enumerate(xs):
            a.announce(1, 20 + i, x.size, np.float32, 0.0)
    assert a.stats.ctl_frames_sent == frames0 + 1
    assert a.stats.ctl_records_sent["META"] == 4
    handles = [b.recv(0, 20 + i) for i in range(4)]
    for i, x in enumerate(xs):
        a.send(1, x, 20 + i, announce=False)
    for h, x in zip(handles, xs):
        np.testing.assert_array_equal(h.wait(10).data, x)


def test_a_peer_that_refused_and_closed_is_reported_lost_naming_the_mismatch(endpoints):
    """The peer refuses a message (its tensor differs), raises and closes: the peer-lost
    callback (the backend fails its group with what it says) names the mismatch, not only the
    closing, whichever the caller waits on first."""
    a, b = endpoints(2, policy=Policy(loss_bound_push=0.0), message_deadline=30.0)
    lost: list[str] = []
    a.peer_lost_callbacks.append(lambda rank, why: lost.append(why))
    r = b.recv(0, 9, expect=Expect(400, np.float32, 0.0))
    s = a.send(1, _grad(1000), 9, announce=False)
    with pytest.raises(MessageMismatch):
        r.wait(10)
    with pytest.raises(MessageMismatch):
        s.wait(10)
    b.close()
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lost and "after a mismatch" in lost[0] and "tensors differ" in lost[0], lost


def test_data_before_the_receiver_expects_it_is_parked_then_placed(endpoints):
    a, b = endpoints(2, policy=Policy(loss_bound_push=0.0))
    x = _grad(20_000)
    s = a.send(1, x, 3, announce=False)
    time.sleep(0.2)  # every packet arrives before the receiver knows the message
    got = b.recv(0, 3, expect=Expect(x.size, np.float32, 0.0)).wait(10)
    np.testing.assert_array_equal(got.data, x)
    s.wait(10)


def _until(condition, seconds: float = 2.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert condition()


def test_a_posted_message_wakes_the_control_loop_only_when_its_timers_are_far(endpoints):
    """Posting a message wakes the control thread (a pass of its timers, holding the interpreter
    lock) only if its next pass is more than ``bulk_feedback_interval`` away: idle, it sleeps
    IDLE_SLEEP and is woken; once a message is in, it runs at IDLE_TICK or faster anyway and a second
    message posted then wakes nothing. Both messages still arrive."""
    a, b = endpoints(2, policy=Policy(loss_bound_push=0.0))
    pace = b.config.bulk_feedback_interval
    wakes: list[float] = []
    wake = b._wake

    def counted() -> None:
        wakes.append(time.monotonic())
        wake()

    b._wake = counted
    _until(lambda: b._timers_at > time.monotonic() + pace)  # idle: its next pass is far
    first = b.recv(0, 5, expect=Expect(PER, np.float32, 0.0))
    assert len(wakes) == 1
    _until(lambda: b._timers_at <= time.monotonic() + pace)  # the pass the wake asked for ran
    second = b.recv(0, 6, expect=Expect(PER, np.float32, 0.0))
    assert len(wakes) == 1
    x, y = _grad(PER, 1), _grad(PER, 2)
    a.send(1, x, 5, announce=False)
    a.send(1, y, 6, announce=False)
    np.testing.assert_array_equal(first.wait(10).data, x)
    np.testing.assert_array_equal(second.wait(10).data, y)


@pytest.mark.parametrize("case", ["size", "dtype", "mtu"])
def test_a_message_of_another_shape_fails_both_ends_at_once(endpoints, case):
    """What the receive expects and what the sender sends differ (a collective's tensors that
    differ across ranks, or ranks with other MTUs): every packet would be rejected until the
    deadline; the sender's PROBE states the shape, and both ends raise at once, saying what differs."""
    mtus = {"mtu": {1: {"mtu": 9000}}}.get(case)
    a, b = endpoints(2, per_rank=mtus, policy=Policy(loss_bound_push=0.0), message_deadline=30.0)
    x = _grad(1000)
    want = {"size": Expect(400, np.float32, 0.0), "dtype": Expect(500, np.float16, 0.0),
            "mtu": Expect(1000, np.float32, 0.0)}[case]
    t0 = time.monotonic()
    r = b.recv(0, 9, expect=want)
    s = a.send(1, x, 9, announce=False)
    hint = "MTUs differ" if case == "mtu" else "tensors differ"
    with pytest.raises(MessageMismatch, match=f"message 9 from rank 0: rank 0 sends 1000 float32 .*{hint}"):
        r.wait(10)
    with pytest.raises(MessageMismatch, match=f"message 9 to rank 1: rank 1 expects .*{hint}"):
        s.wait(10)
    assert time.monotonic() - t0 < 5  # a probe's time, not the 30 s deadline
    assert b.endpoint_stats()["messages_refused"] == 1
    if case == "mtu":
        return
    # the pair goes on: the next message of the right shape passes
    r = b.recv(0, 10, expect=Expect(x.size, np.float32, 0.0))
    a.send(1, x, 10, announce=False).wait(10)
    np.testing.assert_array_equal(r.wait(10).data, x)


def test_a_clean_exchange_sends_no_probe_and_few_frames(endpoints):
    a, b = endpoints(2, policy=Policy(loss_bound_push=0.0))
    x = _grad(50_000)
    for i in range(5):  # warm up: the sender learns how long a STOP takes
        h = b.recv(0, i)
        a.send(1, x, i).wait(10)
        h.wait(10)
    probes0, frames0 = a.stats.ctl_records_sent["PROBE"], a.stats.ctl_frames_sent
    rframes0 = b.stats.ctl_frames_sent
    t0 = time.monotonic()
    for i in range(5, 25):
        h = b.recv(0, i)
        a.send(1, x, i).wait(10)
        h.wait(10)
    # a clean report that found no record to ride along leaves on its own every
    # clean_feedback_interval: a few on a loaded machine, where 20 messages take longer
    lone_feedback = int((time.monotonic() - t0) / b.config.clean_feedback_interval) + 1
    sent = a.stats.ctl_frames_sent - frames0
    answered = b.stats.ctl_frames_sent - rframes0
    probes = a.stats.ctl_records_sent["PROBE"] - probes0
    # The META of each message, and a probe only where a STOP came later than the sender's
    # measured answer time allows: none on an idle machine, a few on a loaded one, never one
    # per message.
    assert sent <= 20 + probes + 1
    assert probes < 10
    # one STOP frame each (feedback rides along), and the answer to each probe
    assert answered <= 20 + probes + 3 + lone_feedback


@pytest.mark.parametrize("offload", [True, False])
def test_gso_and_gro_carry_messages_exactly(endpoints, offload):
    a, b = endpoints(2, policy=Policy(loss_bound_push=0.0), offload=offload)
    x = _grad(2_000_000)
    h = b.recv(0, 1)
    a.send(1, x, 1).wait(30)
    np.testing.assert_array_equal(h.wait(30).data, x)
    sa, sb = a.endpoint_stats(), b.endpoint_stats()
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    supported = gso_supported(probe)
    probe.close()
    if offload and supported:
        assert sa["gso_calls"] > 0 and sa["gso_calls"] < sa["data_pkts_sent"] / 8
        assert sb["gro"] and sb["gro_reads"] > 0
    else:
        assert sa["gso_calls"] == 0 and sb["gro_reads"] == 0


def test_a_socket_that_refuses_gso_falls_back_and_still_delivers(endpoints):
    """SO_NO_CHECK makes the kernel refuse every GSO send (a real fault, no mock): the sender
    turns GSO off for that socket, resends that run one datagram at a time, and says why."""
    a, b = endpoints(2, policy=Policy(loss_bound_push=0.0))
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if not gso_supported(probe):
        pytest.skip("this kernel has no UDP GSO")
    probe.close()
    top = a.policy.top_priority
    a.connect([1])
    a.dp.set_sockopt(1, top, socket.SOL_SOCKET, getattr(socket, "SO_NO_CHECK", 11), 1)
    x = _grad(500_000)
    h = b.recv(0, 1)
    a.send(1, x, 1, priority=top).wait(30)
    np.testing.assert_array_equal(h.wait(30).data, x)
    stats = a.endpoint_stats()
    assert stats["gso_off"] and "UDP_SEGMENT" in stats["gso_off"][0]
    assert stats["retransmitted_pkts"] == 0


def test_receive_backlog_reads_how_full_the_socket_is():
    import socket

    from tests.reference.numpy_path import receive_backlog

    rx, tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * 1024)
        rx.bind(("127.0.0.1", 0))
        assert receive_backlog(rx) == 0.0
        for _ in range(40):
            tx.sendto(b"x" * 1400, rx.getsockname())
        some = receive_backlog(rx)
        assert some is not None and 0 < some < 0.5
        for _ in range(400):  # more than the buffer holds: the kernel drops the rest
            tx.sendto(b"x" * 1400, rx.getsockname())
        full = receive_backlog(rx)
        assert full is not None and full > 0.8
    finally:
        rx.close()
        tx.close()


def test_recovery_is_answered_at_the_end_of_a_pass_without_probes(endpoints):
    """The last packets of each pass carry Flags.LAST, so a receiver missing packets sends its
    bitmap at once: loss is recovered without the sender's PROBE (its timer is the fallback)."""
    from dlcp.hostagent.transport import LossInjection

    a, b = endpoints(2, policy=Policy(loss_bound_push=0.0),
                     per_rank={1: {"loss": LossInjection(drop_probabilities=(0, 0.1, 0.1, 0.1), seed=3)}})
    for i in range(10):
        x = _grad(40_000, i)
        h = b.recv(0, i)
        st = a.send(1, x, i).wait(20)
        np.testing.assert_array_equal(h.wait(20).data, x)
        assert st.how == "stopped"
    bitmaps = b.stats.ctl_records_sent["BITMAP"]
    assert bitmaps >= 10  # every message lost something and asked for it
    # A PROBE is needed only when all of a pass's LAST packets are lost (wire.LAST_PACKETS of
    # them: 1 pass in 1,000 here, loss injection being random) or the answer is later than the
    # sender's measured answer time (a loaded machine), never once per pass: each message's first
    # pass and each retransmission round a bitmap asked for.
    passes = 10 + bitmaps
    assert a.stats.ctl_records_sent["PROBE"] < passes / 2


def test_a_reliable_messages_holes_are_resent_during_its_pass(endpoints):
    """A reliable message (p = 0) whose pass lasts over a hundred milliseconds (5 MB/s, long
    enough for a loaded machine's control threads to look at it several times): the receiver
    reports holes as they stay open (NACK) and the sender resends them during the pass, so the
    answer to the pass's end has little left to ask for; every element exact."""
    from dlcp.hostagent.ratecontrol import RateConfig
    from dlcp.hostagent.transport import LossInjection

    slow = RateConfig(initial_rate=5e6, line_rate=5e6, burst_bytes=16 * 1024)
    a, b = endpoints(2, policy=Policy(loss_bound_push=0.0), rate=slow,
                     per_rank={1: {"loss": LossInjection(drop_probabilities=(0.05,) * 4, seed=5)}})
    x = _grad(PER * 400, 1)  # 400 packets: about 120 ms at 5 MB/s
    h = b.recv(0, 1)
    a.send(1, x, 1).wait(20)
    np.testing.assert_array_equal(h.wait(20).data, x)
    assert b.stats.holes_reported > 0 and a.stats.holes_resent > 0
    assert a.stats.holes_resent <= b.stats.holes_reported


def test_one_senders_early_junk_does_not_crowd_out_anothers_early_data(endpoints):
    """Packets for messages not known yet are parked per sender: rank 2 filling its budget with
    junk leaves rank 0's early packets their room, so rank 0's message needs no resend."""
    from dlcp.hostagent.packetizer import MessageMeta, packetize

    from dlcp.hostagent import sealing

    eps = endpoints(3, policy=Policy(loss_bound_push=0.0), park_limit=64)
    eps[2].connect([1])
    junk = packetize(_grad(PER * 200), MessageMeta(job_id=1, message_id=999, sender_rank=2), Policy())
    # sealed under rank 2's key (as rank 2 itself would seal it): an authenticated sender's junk
    sealer = sealing.new_sealer(eps[2].core.tx_keys[1], sealing.MAC)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for d in junk:
        sock.sendto(sealing.seal(sealer, d), ("127.0.0.1", eps[1].me.data_port))
    sock.close()
    time.sleep(0.1)  # all of it parked or rejected before the real data comes
    x = _grad(PER * 40)
    s = eps[0].send(1, x, 7, announce=False)  # 40 packets before the receiver knows the message
    time.sleep(0.2)
    got = eps[1].recv(0, 7, expect=Expect(x.size, np.float32, 0.0)).wait(10)
    np.testing.assert_array_equal(got.data, x)
    assert s.wait(10).retransmissions == 0
    assert eps[1].endpoint_stats()["reassembly"]["rejected"].get("unknown_message", 0) >= 200 - 64


def test_a_peer_that_stops_reading_costs_only_its_own_messages(datapath):
    """Rank 2 accepts the control connection and never reads it. Rank 0 floods it with
    announcements (more than its TCP window and the write limit). Sending never blocks rank 0:
    the flood returns, rank 2 is declared failed (its connection is not read: the message in
    flight to it fails with that reason), and rank 0's messages to rank 1 complete as usual
    meanwhile."""
    import threading

    from dlcp.hostagent.messages import PeerFailed, PeerUnreachable
    from dlcp.hostagent.transport import Endpoint, TransportConfig
    from tests.conftest import loopback_peers
    from bench import rogue

    peers = loopback_peers(3)
    mute = socket.socket()
    mute.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    mute.bind((peers[2].host, peers[2].control_port))
    mute.listen(4)
    held = []
    # completes the handshake (an authenticated peer), then never reads again
    threading.Thread(target=lambda: held.append(rogue.accept_as(mute, 2)), daemon=True).start()
    a, b = (Endpoint(TransportConfig(datapath=datapath, rank=r, peers=peers,
                                     policy=Policy(loss_bound_push=0.0))).start()
            for r in (0, 1))
    try:
        flooded = threading.Event()

        def flood() -> None:
            # Until rank 2 counts as not reading: the kernel takes several MB first (the send
            # buffer grows to net.ipv4.tcp_wmem's maximum), so a fixed amount may never get past
            # CTL_WRITE_LIMIT; the deadline only ends a flood that never trips it.
            deadline, i = time.monotonic() + 30, 0
            try:
                while time.monotonic() < deadline:
                    a.announce(2, (100_000 + i) % (1 << 22), 1_000_000, np.float32, 0.0)
                    i += 1
            except (PeerFailed, PeerUnreachable):
                pass  # also fine (failed, then no handshake on a new connection): what matters is that it returns
            flooded.set()

        doomed = a.send(2, _grad(1000), 9)  # in flight to rank 2 when it turns out not to read
        threading.Thread(target=flood, daemon=True).start()
        t0 = time.monotonic()
        for i in range(5):  # meanwhile, rank 0 and rank 1 go on
            x = _grad(100_000, i)
            h = b.recv(0, i)
            a.send(1, x, i).wait(10)
            np.testing.assert_array_equal(h.wait(10).data, x)
        assert time.monotonic() - t0 < 10
        assert flooded.wait(40), "announcing to a peer that does not read blocked the caller"
        with pytest.raises(PeerFailed, match="not read"):
            doomed.wait(10)
    finally:
        a.close()
        b.close()
        mute.close()
        for conn, *_ in held:
            conn.close()


def test_a_stranger_claiming_a_ranks_connection_cannot_fail_its_messages(endpoints):
    """One well-formed frame on a new connection that claims to be rank 0, then a close: the
    real rank 0's message in flight still completes (before, every in-flight message from rank
    0 failed with PeerFailed)."""
    from dlcp.hostagent import wire

    a, b = endpoints(2, policy=Policy(loss_bound_push=0.0))
    a.connect([1])
    deadline = time.monotonic() + 5
    while 0 not in b._conns and time.monotonic() < deadline:  # b has heard rank 0's hello
        time.sleep(0.01)
    h = b.recv(0, 1)
    peer = b.config.peer(1)
    with socket.create_connection((peer.host, peer.control_port)) as fake:
        fake.sendall(wire.pack_frame(wire.Header(ptype=wire.PacketType.FEEDBACK, job_id=b.config.job_id,
                                                 message_id=999, sender_rank=0), wire.FEEDBACK_BODY.pack(0, 0, 0, 0)))
        time.sleep(0.2)
    time.sleep(0.2)  # b has seen the close
    x = _grad(20_000)
    a.send(1, x, 1).wait(10)
    np.testing.assert_array_equal(h.wait(10).data, x)


def test_a_slowly_paced_destination_does_not_hold_up_the_others(endpoints):
    """One sender, two receivers; the path to one is congested (its controller holds it at
    100 KB/s: a fault loopback cannot cause). The sender must not sleep out that pacing with its
    one thread: the other receiver's message goes at full speed meanwhile. (It used to send a
    whole GSO call per pick and sleep 0.4 s before each one to the slow receiver, and the fast
    receiver's message waited as long.)"""
    from dlcp.hostagent.ratecontrol import RateController

    class Congested(RateController):
        @property
        def effective_rate(self) -> float:
            return 100e3

    a, b, c = endpoints(3, policy=Policy(loss_bound_push=0.0))
    a.connect([1, 2])
    with a._lock:  # the core hands the data path this rate, and every later one it decides
        a.core.rate[1] = Congested(a.config.rate)
        a.core._note_rate(1, time.monotonic(), "test")
    slow_x, fast_x = _grad(250_000, 1), _grad(250_000, 2)  # 1 MB each
    _slow_rx, fast_rx = b.recv(0, 1), c.recv(0, 2)  # the slow one is received too, never waited on
    t0 = time.monotonic()
    slow = a.send(1, slow_x, 1)
    time.sleep(0.05)  # the slow message is under way
    fast = a.send(2, fast_x, 2)
    np.testing.assert_array_equal(fast_rx.wait(10).data, fast_x)
    fast.wait(10)
    took = time.monotonic() - t0
    assert not slow.done()  # 1 MB at 100 KB/s takes 10 s
    assert took < 1.0, f"the fast receiver's 1 MB took {took:.2f} s behind the slow one"


def test_both_ends_of_a_control_connection_send_in_the_top_priority_queue(endpoints):
    """The accepting end's records (a ring's completions go back on it) once left at DSCP 0,
    behind best-effort cross traffic; both ends and the listener carry the top DSCP now."""
    policy = Policy(loss_bound_push=0.0)
    a, b = endpoints(2, policy=policy)
    a.connect([1])
    deadline = time.monotonic() + 10
    while 0 not in b._conns and time.monotonic() < deadline:
        time.sleep(0.01)
    tos = policy.dscp[policy.top_priority] << 2
    assert tos != 0
    for sock in (a._conns[1].sock, b._conns[0].sock, b._listener):
        assert sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == tos
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
