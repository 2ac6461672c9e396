"""UDP GSO send and GRO receive (dlcp.hostagent.udp_offload), on real loopback sockets.

Every socket test sends a few hundred datagrams over 127.0.0.1 and checks each one byte for
byte, so a planning mistake (a datagram cut at the wrong place by the kernel) cannot pass.
"""

from __future__ import annotations

import socket
import sys
import threading
import time

import numpy as np
import pytest

from dlcp.hostagent import wire
from dlcp.hostagent.udp_offload import (GRO_ANCBUF, GRO_BUFSIZE, MAX_GSO_BYTES, MAX_SEGMENTS, SOL_UDP, UDP_GRO,
                                        UDP_SEGMENT, DatagramSender, enable_gro, gro_segment_size, gso_supported,
                                        plan_gso_calls, split_segments)

FULL = 1472  # 44-byte DLCP header + 357 float32 = a 1500-byte IP packet
SO_NO_CHECK = getattr(socket, "SO_NO_CHECK", 11)


# ---------------------------------------------------------------- pure helpers
def _check_plan(sizes, calls, max_segments=MAX_SEGMENTS, max_bytes=MAX_GSO_BYTES):
    """Invariants every plan must keep, whatever the input."""
    sizes = np.asarray(sizes)
    pos = 0
    for start, stop, seg in calls:
        assert start == pos and stop > start
        run = sizes[start:stop]
        assert run[0] == seg and (run[:-1] == seg).all() and run[-1] <= seg
        if stop - start > 1:
            assert stop - start <= max_segments and run.sum() <= max_bytes and run[-1] > 0
        pos = stop
    assert pos == len(sizes)


def test_plan_equal_sizes_fill_calls_to_the_byte_limit():
    sizes = np.full(100, 1000)
    calls = plan_gso_calls(sizes)
    assert calls == [(0, 64, 1000), (64, 100, 1000)]  # 64 * 1000 <= 65507: segment limit binds
    sizes = np.full(100, FULL)
    calls = plan_gso_calls(sizes)
    per = MAX_GSO_BYTES // FULL  # 44: byte limit binds
    assert calls == [(0, per, FULL), (per, 2 * per, FULL), (2 * per, 100, FULL)]
    _check_plan(sizes, calls)


def test_plan_short_last_joins_the_call():
    sizes = np.array([FULL] * 10 + [500])
    assert plan_gso_calls(sizes) == [(0, 11, FULL)]
    # ... but not when the call is already full
    sizes = np.array([1000] * 64 + [500])
    assert plan_gso_calls(sizes) == [(0, 64, 1000), (64, 65, 500)]


def test_plan_more_than_64_and_more_than_65507_bytes():
    sizes = np.full(200, 100)
    calls = plan_gso_calls(sizes)
    assert [c[1] - c[0] for c in calls] == [64, 64, 64, 8]
    sizes = np.full(3, 40000)  # two would exceed 65507 bytes: one per call
    assert plan_gso_calls(sizes) == [(0, 1, 40000), (1, 2, 40000), (2, 3, 40000)]
    assert plan_gso_calls(np.array([30000, 30000, 5000])) == [(0, 3, 30000)]  # 65000 bytes
    assert plan_gso_calls(np.array([32000, 32000, 1508])) == [(0, 2, 32000), (2, 3, 1508)]  # 65508
    assert plan_gso_calls(np.array([32000, 32000, 1507])) == [(0, 3, 32000)]  # exactly 65507
    assert plan_gso_calls(np.array([40000, 30000])) == [(0, 1, 40000), (1, 2, 30000)]  # 70000 > 65507
    sizes = np.full(45, FULL)  # 44 x 1472 = 64768; 45 would be 66240
    assert plan_gso_calls(sizes) == [(0, 44, FULL), (44, 45, FULL)]
    assert plan_gso_calls(np.full(10, 100), max_segments=4) == [(0, 4, 100), (4, 8, 100), (8, 10, 100)]


def test_plan_mixed_sizes_and_edge_cases():
    sizes = np.array([100, 100, 200, 200, 200, 50, 50, 300, 0, 100, 70000, 100])
    calls = plan_gso_calls(sizes)
    assert calls == [(0, 2, 100), (2, 6, 200), (6, 7, 50), (7, 8, 300), (8, 9, 0), (9, 10, 100),
                     (10, 11, 70000), (11, 12, 100)]
    _check_plan(sizes, calls)
    assert plan_gso_calls(np.array([], dtype=np.int64)) == []
    assert plan_gso_calls(np.array([7])) == [(0, 1, 7)]
    rng = np.random.default_rng(1)
    for _ in range(20):
        sizes = rng.choice([40, 500, FULL, 1472, 9000], size=rng.integers(1, 400))
        _check_plan(sizes, plan_gso_calls(sizes))


def test_split_segments():
    buf = np.arange(256, dtype=np.uint8)
    rows, lengths = split_segments(buf, 40, 10)  # equal segments
    assert rows.shape == (4, 10) and lengths.tolist() == [10] * 4
    assert np.shares_memory(rows, buf) and rows[2].tolist() == list(range(20, 30))
    rows, lengths = split_segments(buf, 45, 10)  # short last: padded row of the same view
    assert rows.shape == (5, 10) and lengths.tolist() == [10, 10, 10, 10, 5]
    assert np.shares_memory(rows, buf) and rows[4, :5].tolist() == [40, 41, 42, 43, 44]
    rows, lengths = split_segments(buf, 33, None)  # no GRO cmsg: one datagram
    assert rows.shape == (1, 33) and lengths.tolist() == [33]
    rows, lengths = split_segments(buf, 10, 10)  # exactly one segment
    assert rows.shape == (1, 10) and lengths.tolist() == [10]
    rows, lengths = split_segments(buf, 250, 100)  # padded row would overrun buf: a copy
    assert rows.shape == (3, 100) and lengths.tolist() == [100, 100, 50]
    assert not np.shares_memory(rows, buf) and rows[2, :50].tolist() == list(range(200, 250))
    assert not rows[2, 50:].any()
    with pytest.raises(ValueError):
        split_segments(buf, 300, 10)
    with pytest.raises(ValueError):
        split_segments(buf.astype(np.int16), 10, None)


def test_gro_segment_size_parses_native_int():
    anc = [(socket.IPPROTO_IP, socket.IP_TOS, b"\x02"), (SOL_UDP, UDP_GRO, (1472).to_bytes(4, "little"))]
    assert gro_segment_size(anc) == 1472
    assert gro_segment_size([(socket.IPPROTO_IP, socket.IP_TOS, b"\x02")]) is None
    assert gro_segment_size([]) is None


# ---------------------------------------------------------------- loopback sockets
def _datagrams(n: int, last: int = 1000, payload: int = FULL - wire.HEADER_SIZE, seed: int = 0):
    """n (header, payload) pairs: a distinct seq in each header, random payload, short last."""
    rng = np.random.default_rng(seed)
    headers = np.zeros((n, wire.HEADER_SIZE), dtype=np.uint8)
    headers[:, 0] = wire.VERSION
    headers[:, 28:32] = np.arange(n, dtype=">u4").view(np.uint8).reshape(n, 4)
    payloads = rng.integers(0, 256, size=(n, payload), dtype=np.uint8)
    pairs = [(memoryview(headers[i]), memoryview(payloads[i])) for i in range(n)]
    if n and last is not None:
        pairs[-1] = (pairs[-1][0], pairs[-1][1][: last - wire.HEADER_SIZE])
    expected = [bytes(h) + bytes(p) for h, p in pairs]
    return pairs, expected


def _receiver(gro: bool) -> socket.socket:
    r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    r.bind(("127.0.0.1", 0))
    if gro and not enable_gro(r):
        r.close()
        pytest.skip("kernel refuses UDP_GRO")
    return r


def _sender(receiver: socket.socket) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect(receiver.getsockname())
    return s


class _Drain(threading.Thread):
    """Reads until ``count`` datagrams arrived or the socket is quiet for ``quiet`` seconds."""

    def __init__(self, sock: socket.socket, count: int, quiet: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.sock, self.count, self.quiet = sock, count, quiet
        self.datagrams: list[bytes] = []
        self.reads: list[tuple[int, int | None, int]] = []  # (nbytes, gso_size, msg flags)

    def run(self) -> None:
        buf = np.zeros(GRO_BUFSIZE, dtype=np.uint8)
        view = buf.data
        self.sock.settimeout(self.quiet)
        while len(self.datagrams) < self.count:
            try:
                nbytes, anc, flags, _ = self.sock.recvmsg_into([view], GRO_ANCBUF)
            except OSError:  # includes the timeout
                return
            seg = gro_segment_size(anc)
            self.reads.append((nbytes, seg, flags))
            rows, lengths = split_segments(buf, nbytes, seg)
            self.datagrams.extend(bytes(rows[i, : lengths[i]]) for i in range(len(lengths)))

    def result(self) -> list[bytes]:
        self.join(timeout=5)
        # nothing beyond what was expected
        self.sock.settimeout(0.05)
        with pytest.raises((TimeoutError, BlockingIOError)):
            self.sock.recv(65535)
        return self.datagrams


@pytest.fixture
def gso_socket_ok():
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        if not gso_supported(probe):
            pytest.skip("kernel does not support UDP_SEGMENT (GSO)")
    finally:
        probe.close()


def _run(pairs, expected, gro: bool, use_gso: bool = True, sock_setup=None):
    r = _receiver(gro)
    s = _sender(r)
    if sock_setup is not None:
        sock_setup(s)
    try:
        drain = _Drain(r, len(expected))
        drain.start()
        sender = DatagramSender(s, use_gso=use_gso)
        sent, nbytes = sender.send(pairs)
        got = drain.result()
        return sender, sent, nbytes, got, drain.reads
    finally:
        s.close()
        r.close()


def test_gso_send_to_receiver_without_gro(gso_socket_ok):
    pairs, expected = _datagrams(200)
    sender, sent, nbytes, got, reads = _run(pairs, expected, gro=False)
    assert sender.gso and sender.gso_off_reason is None
    assert got == expected  # byte for byte, in order
    assert all(seg is None for _, seg, _ in reads) and len(reads) == 200  # one datagram per read
    assert (sent, nbytes) == (200, sum(map(len, expected)))
    assert sender.datagrams == 200 and sender.errors == 0
    # 200 x 1472 bytes at <= 65507 bytes per call: 5 calls instead of 200
    sizes = np.array([len(d) for d in expected])
    assert sender.syscalls == len(plan_gso_calls(sizes)) <= -(-200 // MAX_SEGMENTS) + 2


def test_gso_send_to_receiver_with_gro_coalesces(gso_socket_ok):
    pairs, expected = _datagrams(200, seed=1)
    sender, sent, _, got, reads = _run(pairs, expected, gro=True)
    assert sender.gso and sent == 200
    assert got == expected
    coalesced = [r for r in reads if r[1] is not None]
    assert coalesced and all(seg == FULL for _, seg, _ in coalesced)
    assert len(reads) < 20  # one read per GSO call on loopback, not one per datagram
    assert not any(flags & socket.MSG_CTRUNC for _, _, flags in reads)


def test_mixed_sizes_survive_gso_and_gro(gso_socket_ok):
    """Runs of different sizes: a wrong plan would make the kernel cut datagrams apart."""
    rng = np.random.default_rng(3)
    pairs, expected = [], []
    for k, size in enumerate([FULL] * 50 + [300] + [FULL] * 3 + [100, 100, 900] + [FULL] * 70 + [64]):
        h = np.zeros(wire.HEADER_SIZE, np.uint8)
        h[28:32] = np.frombuffer(int(k).to_bytes(4, "big"), np.uint8)
        p = rng.integers(0, 256, size - wire.HEADER_SIZE, dtype=np.uint8)
        pairs.append((h.tobytes(), p.data))
        expected.append(h.tobytes() + p.tobytes())
    for gro in (False, True):
        sender, sent, _, got, _ = _run(pairs, expected, gro=gro)
        assert got == expected and sent == len(expected)
        assert sender.syscalls < len(expected) // 4


def test_without_gso_one_syscall_per_datagram():
    pairs, expected = _datagrams(200, seed=2)
    sender, sent, nbytes, got, _ = _run(pairs, expected, gro=False, use_gso=False)
    assert not sender.gso and "use_gso=False" in (sender.gso_off_reason or "")
    assert got == expected and sent == 200 and nbytes == sum(map(len, expected))
    assert sender.syscalls == 200


def _gso_fails_without_checksum() -> bool:
    """Does a raw GSO sendmsg fail on an SO_NO_CHECK socket here? (Throwaway sockets.)"""
    r = _receiver(gro=False)
    s = _sender(r)
    try:
        s.setsockopt(socket.SOL_SOCKET, SO_NO_CHECK, 1)
        s.sendmsg([bytes(300)], [(SOL_UDP, UDP_SEGMENT, (100).to_bytes(2, sys.byteorder))])
    except OSError:
        return True
    finally:
        s.close()
        r.close()
    return False


def test_real_gso_failure_falls_back(gso_socket_ok):
    """SO_NO_CHECK (no UDP checksum) makes the kernel refuse GSO with EINVAL, a real failure of
    the same kind as a device without checksum offload (EIO), while plain sends still work."""
    pairs, expected = _datagrams(150, seed=4)
    extra, extra_expected = _datagrams(10, seed=5)
    r = _receiver(gro=False)
    s = _sender(r)
    s.setsockopt(socket.SOL_SOCKET, SO_NO_CHECK, 1)
    try:
        assert gso_supported(s)  # the probe cannot see this: only a send can
        drain = _Drain(r, len(expected) + len(extra))
        drain.start()
        if not _gso_fails_without_checksum():
            pytest.skip("this kernel accepts GSO without UDP checksums; no real GSO failure to provoke")
        sender = DatagramSender(s)
        sent, _ = sender.send(pairs)
        assert not sender.gso and sent == 150 and sender.errors == 0
        assert sender.gso_off_reason is not None and "EINVAL" in sender.gso_off_reason
        assert sender.fallbacks == 1 and sender.syscalls == 1 + 150
        # learnt once: the next batch goes one by one without trying GSO again
        assert sender.send(extra) == (10, sum(map(len, extra_expected)))
        assert sender.fallbacks == 1 and sender.syscalls == 1 + 150 + 10
        assert drain.result() == expected + extra_expected
    finally:
        s.close()
        r.close()


def test_send_to_closed_port_does_not_raise():
    r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    r.bind(("127.0.0.1", 0))
    s = _sender(r)
    r.close()  # nothing listens: ICMP port unreachable comes back
    try:
        for use_gso in (True, False):
            sender = DatagramSender(s, use_gso=use_gso)
            pairs, _ = _datagrams(100, seed=6)
            total = 0
            for _ in range(4):
                total += sender.send(pairs)[0]
                time.sleep(0.01)
            assert sender.errors >= 1 and sender.last_error is not None
            assert total == sender.datagrams and sender.datagrams + sender.errors == 400
            assert sender.gso == (use_gso and gso_supported(s))  # ECONNREFUSED does not disable GSO
    finally:
        s.close()


def test_gro_ancbuf_holds_tos_and_gro_cmsgs(gso_socket_ok):
    """The transport also asks for IP_TOS (and SO_RXQ_OVFL): the GRO cmsg must still fit."""
    r = _receiver(gro=True)
    r.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
    r.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RXQ_OVFL", 40), 1)
    s = _sender(r)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, (10 << 2) | 0b10)
    try:
        pairs, expected = _datagrams(5, seed=7)
        DatagramSender(s).send(pairs)
        buf = np.zeros(GRO_BUFSIZE, np.uint8)
        r.settimeout(1.0)
        nbytes, anc, flags, _ = r.recvmsg_into([buf.data], GRO_ANCBUF)
        assert not flags & socket.MSG_CTRUNC
        assert any(level == socket.IPPROTO_IP and value[0] == (10 << 2) | 0b10 for level, _, value in anc)
        rows, lengths = split_segments(buf, nbytes, gro_segment_size(anc))
        assert [bytes(rows[i, : lengths[i]]) for i in range(len(lengths))] == expected
    finally:
        s.close()
        r.close()
