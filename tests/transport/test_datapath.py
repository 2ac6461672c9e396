"""The two data paths against each other, below the protocol: the same datagrams must be
rejected for the same reasons and leave the same bytes; the wire order and the tags they send
must be the same; a reduction must add each packet exactly once."""

from __future__ import annotations

import select
import socket
import threading
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from bench import rogue
from dlcp.hostagent import auth, sealing, wire
from dlcp.hostagent.datapath.credits import max_datagram
from dlcp.hostagent.datapath import native_available
from dlcp.hostagent.packetizer import MessageMeta, elems_per_packet, packetize
from dlcp.hostagent.policy import CLASS_SAMPLE, SAMPLED_CLASSES_PACKETS, Policy, drop_classes, packet_magnitudes
from dlcp.hostagent.protocol.port import RxBuffers, RxSpec, TxSpec
from dlcp.hostagent.protocol.incoming import MAX_BUSY_DEFER
from dlcp.hostagent.protocol.port import REASONS
from dlcp.hostagent.transport_config import TransportConfig, local_peers

PER = elems_per_packet(1500, np.float32)
KEY1 = bytes(range(16))  # the key of sender 1's direction to the receiver (authenticated); sender 2 has none
WIDTH = max_datagram(TransportConfig(rank=0, peers=local_peers(3, 41000)))  # a receive row: a full datagram
POLICY = Policy(loss_bound_push=0.0)

pytestmark = pytest.mark.skipif(native_available() is not None, reason=str(native_available()))


def _paths(**config):
    """A native and a numpy data path for rank 0 of a 3-rank job, threads not started."""
    from dlcp.hostagent.datapath.native import NativeDatapath
    from tests.reference.numpy_path import NumpyDatapath

    cfg = TransportConfig(rank=0, peers=local_peers(3, 41000), **config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    paths: list[NativeDatapath | NumpyDatapath] = [NativeDatapath(cfg, sock, False), NumpyDatapath(cfg, sock, False)]
    for dp in paths:
        dp.set_keys(1, KEY1, KEY1)
    return paths, sock


def _expect(dp, src: int, mid: int, total: int, iteration: int = 0, accumulate: bool = False,
            dtype=np.float32, out_dtype=None) -> RxBuffers:
    code = int(wire.dtype_code(dtype))
    out = np.zeros(total, out_dtype or (np.float32 if accumulate else dtype))
    n = -(-total // elems_per_packet(1500, dtype))
    buffers = RxBuffers.allocate(out, n, 0)
    dp.expect(RxSpec(src, mid, auth.DATA_TOKEN, code, total,
                     elems_per_packet(1500, dtype), buffers, accumulate, total, iteration=iteration))
    return buffers


def _datagrams(x: np.ndarray, mid: int, sender: int = 1, iteration: int = 0, token: int | None = None,
               dtype=np.float32) -> list[bytes]:
    tok = auth.DATA_TOKEN if token is None else token
    meta = MessageMeta(job_id=1, message_id=mid, sender_rank=sender, iteration=iteration, token=tok)
    return list(packetize(x.astype(dtype), meta, POLICY))


def _with(d: bytes, **fields) -> bytes:
    h: dict[str, Any] = wire.unpack_header(d).as_dict()
    h.update(fields)
    return wire.pack_header(wire.Header(**{**h, "ptype": wire.PacketType(h["ptype"]), "dtype": wire.Dtype(h["dtype"]),
                                           "flags": wire.Flags(h["flags"])})) + d[wire.HEADER_SIZE:]


def _counts(dp) -> dict:
    s = dp.stats()
    return {"rejected": {k: v for k, v in s["rejected"].items() if v}, "accepted": s["accepted"],
            "duplicates": s["duplicates"], "parked": s["parked"], "late": s["late"]}


_SENDERS: dict[tuple[bytes, int], Any] = {}


def _seal(d: bytes, key: bytes | None = KEY1, protection: int = sealing.MAC) -> bytes:
    """``d`` as its sender puts it on the wire: sealed under ``key`` (None, or shorter than a
    header: as it is, as junk comes) by that key's one sender, so each datagram takes the next
    packet number (a copy sealed again is a resend, not a replay)."""
    if key is None or len(d) < wire.HEADER_SIZE:
        return d
    sender = _SENDERS.get((key, protection))
    if sender is None:
        sender = _SENDERS[(key, protection)] = sealing.new_sealer(key, protection)
    return sealing.seal(sender, d)


def _one(dp, d: bytes, now: float, key: bytes | None = KEY1) -> None:
    """One datagram as the receive thread sees it, sealed under ``key`` first (None: as it is):
    in a row one full datagram wide (a longer one keeps its length and is cut to the row, as a
    read into the row would cut it)."""
    d = _seal(d, key)
    width = WIDTH
    row = np.zeros((1, width), np.uint8)
    row[0, : min(len(d), width)] = np.frombuffer(d, np.uint8)[:width]
    dp.ingest_for_test(row, np.array([len(d)]), now)


def test_every_datagram_is_judged_alike_by_both_paths():
    """A corpus of every kind of datagram, one at a time: after each, both paths have counted
    the same reasons, accepted and parked the same, and at the end hold the same bytes."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal(PER * 20 + 100).astype(np.float32)
    y = rng.standard_normal(PER * 6).astype(np.float32)
    good = _datagrams(x, 9, iteration=1030)
    early = _datagrams(y, 11, iteration=3)  # before its message is set up: parked
    corpus: list[bytes] = []
    corpus += good[:10] + good[3:5]  # duplicates
    base = good[12]
    corpus += [base[: wire.HEADER_SIZE - 1], base + b"\0" * 8,  # truncated: too short, too long
               _with(base, version=wire.VERSION + 1), _with(base, ptype=wire.PacketType.PROBE),
               _with(base, job_id=2), _with(base, token=1234), _with(base, dtype=wire.Dtype.FLOAT16),
               _with(base, seq=10_000), _with(base, total_pkts=99), _with(base, elem_offset=5),
               _with(base, elem_count=3), base[:-4]]
    corpus += _datagrams(x, 9, iteration=1030 - 1024)  # a replay of 1,024 iterations ago: stale
    corpus += _datagrams(y[:PER], 7, iteration=1030)  # message 7 of iteration 1030, complete
    corpus += _datagrams(y[:PER], 7, iteration=6)  # its use 1,024 iterations earlier: stale
    corpus += early + _datagrams(y, 11, iteration=3, token=77)  # early data with a wrong token: parked
    corpus += _datagrams(y, 12, sender=2)  # an unauthenticated sender (no key to open it): bad_mac
    corpus += _datagrams(y, 13, sender=0)  # the receiver itself: bad_mac
    corpus += rogue.hostile_datagrams(300, 1, victim=0, real=[(1, 9)], seed=2)
    corpus += good[10:]
    paths, sock = _paths()
    bufs = [_expect(dp, 1, 9, x.size, iteration=1030) for dp in paths]
    for dp in paths:
        _expect(dp, 1, 7, PER, iteration=1030)
    for i, d in enumerate(corpus):
        for dp in paths:
            _one(dp, d, now=1.0 + i * 1e-4)
        native, numpy = (_counts(dp) for dp in paths)
        assert native == numpy, f"datagram {i}: {native} != {numpy}"
    for b in bufs:
        np.testing.assert_array_equal(b.out, x)
    # every reason was met but unknown_message (only a sender past its park limit meets it now:
    # one without a key fails its tag first) and replay (each datagram is sealed afresh here;
    # replays have their own test below)
    assert set(_counts(paths[0])["rejected"]) == set(REASONS[1:]) - {"unknown_message", "replay"}
    # (the copies with a wrong token park too: their tags are right, as from a sender holding
    # the key; set up, they are bad_token and the originals are placed)
    assert _counts(paths[0])["parked"] == 2 * len(early)
    bufs = [_expect(dp, 1, 11, y.size, iteration=3) for dp in paths]  # the parked data is placed now
    for b in bufs:
        np.testing.assert_array_equal(b.out, y)
    for dp in paths:
        dp.stop()
    sock.close()


def test_early_data_of_a_message_ids_next_use_parks_and_a_straggler_of_the_last_counts_late():
    """Message ids repeat every 1,024 iterations (``exchange.message_id``), and a sender that is
    ahead sends an id's next use before this rank has set it up. Its packets park and are placed
    once the use is set up; a packet of the use that finished counts as late. (The next use's
    packets were taken for stragglers and dropped: the use never completed, and back-to-back
    barriers hung at the 1,026th.) Both paths."""
    x = np.arange(PER * 3, dtype=np.float32)
    y = x + 1000
    paths, sock = _paths()
    try:
        for dp in paths:
            _expect(dp, 1, 5, x.size, iteration=2)
            for d in _datagrams(x, 5, iteration=2):
                _one(dp, d, now=1.0)
            assert _state(dp, 1, 5) == 1
            dp.forget(1, 5, remember=True)  # as the protocol core does when it finishes a message
            _one(dp, _datagrams(x, 5, iteration=2)[1], now=1.1)  # a straggler of that use
            for d in _datagrams(y, 5, iteration=1026):  # the id's next use, not set up yet
                _one(dp, d, now=1.2)
            assert (_counts(dp)["late"], _counts(dp)["parked"]) == (1, 3)
            b = _expect(dp, 1, 5, y.size, iteration=1026)
            assert _state(dp, 1, 5) == 1
            np.testing.assert_array_equal(b.out, y)
    finally:
        for dp in paths:
            dp.stop()
        sock.close()


def test_a_replayed_datagram_is_refused_alike_by_both_paths():
    """The same sealed bytes again (a recording sent back) are refused as ``replay`` on both
    paths, before the message sees them: no duplicate, nothing accepted twice; in the same
    batch as the original or in a later one."""
    x = np.arange(1, PER * 3 + 1, dtype=np.float32)
    dgs = _datagrams(x, 5)
    paths, sock = _paths()
    counts = []
    for dp in paths:
        _expect(dp, 1, 5, x.size)
        sealed = [_seal(d) for d in dgs]
        rows = np.zeros((3, WIDTH), np.uint8)
        for row, d in zip(rows, [sealed[0], sealed[0], sealed[1]]):
            row[: len(d)] = np.frombuffer(d, np.uint8)
        dp.ingest_for_test(rows, np.array([len(sealed[0]), len(sealed[0]), len(sealed[1])]), 1.0)
        _one(dp, sealed[1], now=1.01, key=None)  # (as it is: sealed already)
        _one(dp, sealed[2], now=1.02, key=None)
        counts.append(_counts(dp))
        dp.stop()
    sock.close()
    assert counts[0] == counts[1], counts
    assert counts[0]["rejected"] == {"replay": 2} and counts[0]["duplicates"] == 0 and counts[0]["accepted"] == 3


def test_a_resend_read_twice_in_one_batch_counts_once_on_both_paths():
    """Progress.retx_seen counts resends that brought a packet: a second resend read in the same
    batch as the first is a duplicate, consumed as it was read. (When a message finishes, the
    data paths count the first sending of each resent packet as never coming, from retx_seen: a
    duplicate counted there released one packet too many of the sender's window.) Each resend
    is sealed afresh (its own packet number), as a sender's are; the same bytes twice would be
    a replay, refused before it reaches the message."""
    x = np.arange(1, PER * 4 + 1, dtype=np.float32)
    dgs = _datagrams(x, 5)
    width = WIDTH
    paths, sock = _paths()
    seen = []
    for dp in paths:
        _expect(dp, 1, 5, x.size)
        for i in (0, 1, 3):
            _one(dp, dgs[i], now=1.0)
        resends = [_seal(_with(dgs[2], flags=wire.Flags.RETX)) for _ in range(2)]
        rows = np.zeros((2, width), np.uint8)
        for row, d in zip(rows, resends):
            row[: len(d)] = np.frombuffer(d, np.uint8)
        dp.ingest_for_test(rows, np.array([len(d) for d in resends]), 1.01)
        p = dp.progress(1, 5)
        seen.append((p.retx_seen, p.duplicates, p.state))
        dp.stop()
    sock.close()
    assert seen[0] == seen[1] == (1, 1, 1), seen


def test_progress_changed_returns_only_messages_that_moved_on_both_paths():
    """The core polls progress on every event; messages that did not move since its last poll
    are left out (a new one, a packet, a completion: each shows once)."""
    x = np.arange(1, PER * 3 + 1, dtype=np.float32)
    dgs = _datagrams(x, 5)
    paths, sock = _paths()
    for dp in paths:
        _expect(dp, 1, 5, x.size)
        _expect(dp, 1, 6, x.size)
        assert set(dp.progress_changed()) == {(1, 5), (1, 6)}  # new: both
        assert dp.progress_changed() == {}
        _one(dp, dgs[0], now=1.0)
        moved = dp.progress_changed()
        assert list(moved) == [(1, 5)] and moved[(1, 5)].received_pkts == 1
        assert dp.progress_changed() == {}
        for d in dgs[1:]:
            _one(dp, d, now=1.1)
        assert dp.progress_changed()[(1, 5)] == dp.progress(1, 5)  # completed: shown once more
        assert dp.progress(1, 5).state == 1 and dp.progress_changed() == {}
        dp.stop()
    sock.close()


def test_a_sum_adds_each_packet_once_whatever_repeats():
    """A reduction placed by the data path (Expect.accumulate): duplicates, resends and reorder
    never add a packet twice; a float16 payload adds into float32."""
    rng = np.random.default_rng(1)
    base = rng.standard_normal(PER * 8 + 5).astype(np.float32)
    for dtype in (np.float32, np.float16):
        x = rng.standard_normal(base.size).astype(dtype)
        dgs = _datagrams(x, 9, dtype=dtype)
        order = rng.permutation(len(dgs)).tolist() + [0, 3, 3, len(dgs) - 1]
        paths, sock = _paths()
        for dp in paths:
            b = _expect(dp, 1, 9, base.size, accumulate=True, dtype=dtype)
            b.out[:] = base
            for i in order:
                _one(dp, dgs[i], now=1.0)
            np.testing.assert_allclose(b.out, base + x.astype(np.float32), rtol=1e-6)
            dp.stop()
        sock.close()


def test_a_scaled_sum_gives_the_same_bits_on_both_paths_with_packets_missing():
    """Expect.scale (a ring's in-place 1/N): each packet adds as ``out * scale + payload`` and,
    once the message completes, where no packet came ``out * scale``; in order and out of
    order, the short last packet too, each float32 operation rounded alone on both paths."""
    rng = np.random.default_rng(3)
    base = rng.standard_normal(PER * 9 + 7).astype(np.float32)
    x = rng.standard_normal(base.size).astype(np.float32)
    scale = np.float32(1 / 3)
    dgs = _datagrams(x, 9)
    arrive = [0, 1, 2, 6, 4, 9, 9]  # a run in order, then out of order, the tail, a repeat; 3, 5, 7, 8 never come
    want = base * scale
    for seq in set(arrive):
        lo = seq * PER
        want[lo : lo + PER] = base[lo : lo + PER] * scale + x[lo : lo + PER]
    paths, sock = _paths()
    for dp in paths:
        out = base.copy()
        buffers = RxBuffers.allocate(out, len(dgs), 0)
        dp.expect(RxSpec(1, 9, auth.DATA_TOKEN, int(wire.dtype_code(np.float32)), base.size,
                         PER, buffers, True, 0, (), float(scale)))
        for i in arrive:
            _one(dp, dgs[i], now=1.0)
        assert dp.complete(1, 9, False)
        np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32), err_msg=type(dp).__name__)
        dp.stop()
    sock.close()


def _sums_on_both_paths(base: np.ndarray, x: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """``x`` sent as one message (packets shuffled, one repeated twice) and added into a copy of
    ``base`` of its own type, on each data path: what each path's sum came to."""
    dgs = _datagrams(x, 9, dtype=x.dtype)
    order = rng.permutation(len(dgs)).tolist() + [1, 1]
    paths, sock = _paths()
    sums = []
    for dp in paths:
        b = _expect(dp, 1, 9, x.size, accumulate=True, dtype=x.dtype, out_dtype=x.dtype)
        b.out[:] = base
        for i in order:
            _one(dp, dgs[i], now=1.0)
        sums.append(b.out.copy())
        dp.stop()
    sock.close()
    return sums


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_a_float16_sum_stays_float16_and_both_paths_round_alike():
    """A float16 message added into a float16 ``out`` (a float16 allreduce's sum): each addition
    rounded to half, bit for bit as numpy adds halves, on both paths; subnormals, ties and
    overflow to infinity included."""
    rng = np.random.default_rng(3)
    n = elems_per_packet(1500, np.float16) * 5 + 7
    base = (rng.standard_normal(n) * 3).astype(np.float16)
    x = (rng.standard_normal(n) * 3).astype(np.float16)
    base[:4] = [6e-8, 65504, 1.0, -2.0]  # a subnormal, the largest half, a tie to even
    x[:4] = [6e-8, 65504, 2 ** -11, 2 ** -10]
    want = base + x  # numpy: each pair added in float and rounded to half
    assert np.isinf(want[1])
    for got in _sums_on_both_paths(base, x, rng):
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_a_bfloat16_sum_stays_bfloat16_and_both_paths_round_alike():
    """A bfloat16 message added into a bfloat16 ``out``: each addition made in float32 and
    rounded to nearest even, as torch and ml_dtypes add bfloat16, bit for bit on both paths;
    ties, overflow to infinity and a NaN included."""
    bf16 = wire.NUMPY_DTYPES[wire.Dtype.BFLOAT16]
    rng = np.random.default_rng(5)
    n = elems_per_packet(1500, bf16) * 4 + 3
    base = (rng.standard_normal(n) * 3).astype(bf16)
    x = (rng.standard_normal(n) * 3).astype(bf16)
    big = float(ml_dtypes.finfo(bf16).max)
    base[:4] = np.array([1.0, big, -2.0, np.nan], np.float32).astype(bf16)
    x[:4] = np.array([2 ** -8, big, 2 ** -7, 1.0], np.float32).astype(bf16)  # a tie to even, an overflow
    # the same cases again in the second packet, in a group of sixteen with no NaN (the native
    # path sums those sixteen or eight at a time), ties both ways, both signs; a NaN at the start
    # of the third packet, and one in the fourth after whole groups (the rest of that packet goes
    # the narrower way)
    per = elems_per_packet(1500, bf16)
    base[per + 8:per + 14] = np.array([1.0, 1 + 2 ** -7, -1.0, big, -big, 3.0], np.float32).astype(bf16)
    x[per + 8:per + 14] = np.array([2 ** -8, 2 ** -8, -2 ** -8, big, -big, -3.0], np.float32).astype(bf16)
    base[2 * per + 13] = np.nan
    x[3 * per + 101] = np.nan
    want = base + x  # ml_dtypes: each pair added in float32 and rounded to bfloat16
    assert want[0] == 1.0 and np.isinf(want[1]) and np.isnan(want[3])
    assert want[per + 8] == 1.0 and want[per + 9] == 1 + 2 ** -6 and want[per + 10] == -1.0  # to even
    assert np.isinf(want[per + 11]) and np.isinf(want[per + 12]) and np.isnan(want[2 * per + 13])
    assert np.isnan(want[3 * per + 101]) and per > 140  # (whole groups of sixteen before it)
    for got in _sums_on_both_paths(base, x, rng):
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_an_out_of_another_type_is_refused_before_anything_is_placed():
    """Placing needs the wire's own type; a sum takes float32 or the wire's type. A float16
    ``out`` for a float32 message is refused by both paths, as a ValueError."""
    paths, sock = _paths()
    for dp in paths:
        with pytest.raises(ValueError, match="out"):
            _expect(dp, 1, 9, 100, accumulate=True, dtype=np.float32, out_dtype=np.float16)
        with pytest.raises(ValueError, match="out"):
            _expect(dp, 1, 10, 100, accumulate=False, dtype=np.float16, out_dtype=np.float32)
        dp.stop()
    sock.close()


def _state(dp, src: int, message_id: int) -> int:
    """The receive state of message ``message_id`` from ``src`` (it must be expected)."""
    p = dp.progress(src, message_id)
    assert p is not None
    return p.state


def wire_capture(which: str, spec: TxSpec, n: int, resend: list[int] | None = None, **config) -> list[bytes]:
    """Send ``spec`` from a started data path (``which``) of rank 0, keys KEY1 both ways, and
    return the first ``n`` datagrams, as they are on the wire, that a plain socket standing in
    for rank 1 receives, then (``resend``) those of a retransmission of these sequence numbers.
    ``config``: TransportConfig's fields besides (``encrypt=True``, say)."""
    from dlcp.hostagent.datapath.native import NativeDatapath
    from tests.reference.numpy_path import NumpyDatapath

    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    cfg = TransportConfig(rank=0, peers=local_peers(2, 42000), offload=False, **config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dp = (NativeDatapath if which == "native" else NumpyDatapath)(cfg, sock, False)
    dp.add_peer(1, "127.0.0.1", rx.getsockname()[1])
    dp.set_keys(1, KEY1, KEY1)
    dp.set_rate(1, 1e9)
    dp.start()
    try:
        dp.submit(spec)
        out: list[bytes] = []
        rx.settimeout(5)
        while len(out) < n:
            out.append(rx.recv(65536))
        if resend:
            dp.retransmit(spec.dest, spec.message_id, np.array(resend, np.int64))
            while len(out) < n + len(resend):
                out.append(rx.recv(65536))
        return out
    finally:
        dp.stop()
        sock.close()
        rx.close()


def _capture(which: str, spec: TxSpec, n: int, resend: list[int] | None = None) -> list[bytes]:
    """:func:`wire_capture`'s datagrams opened as rank 1 opens them (each sealed under the
    direction's key), without their trailers."""
    opener = sealing.new_sealer(KEY1, sealing.MAC)
    opened = [sealing.open_datagram(opener, d) for d in wire_capture(which, spec, n, resend)]
    assert all(d is not None for d in opened), f"{which}: a datagram that does not open under its key"
    return [d for d in opened if d is not None]


@pytest.mark.parametrize("which", ["native", "numpy"])
def test_a_fused_message_leaves_most_urgent_packets_first_with_the_policys_drop_classes(which):
    """Packets of a fused message go out by their own priority (ties in order), each with the
    drop class the policy gives its magnitude; a LAST flag ends the pass."""
    x = np.random.default_rng(3).standard_normal(PER * 5).astype(np.float32)
    prio = np.array([1, 1, 1, 6, 6], np.uint8)
    layers = np.array([4, 4, 4, 2, 2], np.uint16)
    classes = np.zeros(5, np.uint8)
    got = _capture(which, TxSpec(1, 7, x, 0, PER, 99, 2, 3, 0, 6, prio, layers, classes), 5)
    hdr = [wire.unpack_header(d) for d in got]
    assert [h.seq for h in hdr] == [3, 4, 0, 1, 2]
    assert [h.priority for h in hdr] == [6, 6, 1, 1, 1] and [h.layer for h in hdr] == [2, 2, 4, 4, 4]
    want = drop_classes(packet_magnitudes(x, PER, "l2"), Policy())
    assert [h.drop_class for h in sorted(hdr, key=lambda h: h.seq)] == want.tolist() == classes.tolist()
    assert [bool(h.flags & wire.Flags.LAST) for h in hdr] == [False] * 2 + [True] * 3  # the last level's 3
    assert all(h.token == 99 and h.iteration == 2 and h.tensor_id == 3 for h in hdr)
    for h, d in zip(hdr, got):
        np.testing.assert_array_equal(np.frombuffer(d[wire.HEADER_SIZE :], np.float32),
                                      x[h.elem_offset : h.elem_offset + h.elem_count])


@pytest.mark.parametrize("which", ["native", "numpy"])
def test_no_packet_carries_last_while_the_pass_still_has_a_lower_priority_to_send(which):
    """LAST goes on the final packets of the pass's last priority level only (``last_marks``,
    hostagent/native/endpass.h): fewer than three when that level has fewer. Here one packet of
    priority 1 follows four of priority 6; the final two of those used to carry LAST as well,
    and a receiver answered them while the priority-1 packet still waited behind other messages'
    higher priorities (at the sender and in the switches), so that packet was resent every time.
    A resend pass of packets all sent at the top priority ends as before, its last three LAST."""
    x = np.random.default_rng(5).standard_normal(PER * 5).astype(np.float32)
    prio = np.array([1, 6, 6, 6, 6], np.uint8)
    layers = np.array([4, 2, 2, 2, 2], np.uint16)
    got = _capture(which, TxSpec(1, 7, x, 0, PER, 99, 2, 3, 0, 6, prio, layers, np.zeros(5, np.uint8)), 5,
                   resend=[0, 2, 4, 3])
    hdr = [wire.unpack_header(d) for d in got]
    assert [h.seq for h in hdr[:5]] == [1, 2, 3, 4, 0]
    assert [bool(h.flags & wire.Flags.LAST) for h in hdr[:5]] == [False] * 4 + [True]
    assert [bool(h.flags & wire.Flags.LAST) for h in hdr[5:]] == [False, True, True, True]


@pytest.mark.parametrize("which", ["native", "numpy"])
def test_messages_leave_by_their_priority_and_a_messages_packets_by_theirs(which):
    """The send thread's order (``reorder_locked``): resends first, then messages by their own
    priority (their most urgent layer's), ties in order, whatever their destination; a message's
    packets by theirs. So a message's least urgent level leaves with it, before a less urgent
    message's packets of a higher level: ranked by its next packet, it waited behind every other
    message (a ring's chunk holding a bucket's last level held up the ring's chain). Ranks 1 and 2
    share one socket here, so the order on the wire is the order sent."""
    from dlcp.hostagent.datapath.native import NativeDatapath
    from tests.reference.numpy_path import NumpyDatapath

    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    cfg = TransportConfig(rank=0, peers=local_peers(3, 42000), offload=False)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dp = (NativeDatapath if which == "native" else NumpyDatapath)(cfg, sock, False)
    openers = {rank: sealing.new_sealer(KEY1, sealing.MAC) for rank in (1, 2)}  # (a counter per direction)
    for rank in (1, 2):
        dp.add_peer(rank, "127.0.0.1", rx.getsockname()[1])
        dp.set_keys(rank, KEY1, KEY1)
        dp.set_rate(rank, 1e9)
    x = np.arange(PER * 3, dtype=np.float32)

    def spec(dest: int, mid: int, priority: int, order: int, levels: list[int] | None = None) -> TxSpec:
        prio = None if levels is None else np.array(levels, np.uint8)
        return TxSpec(dest, mid, x, 0, PER, 99, 2, 3, 0, priority, prio, None, np.zeros(3, np.uint8), order=order)

    def arrivals(n: int) -> list[tuple[int, int]]:
        out = []
        for _ in range(n):
            d = rx.recv(65536)
            opened = sealing.open_datagram(openers[1 if wire.unpack_header(d).message_id < 20 else 2], d)
            assert opened is not None, "a datagram that does not open under its direction's key"
            h = wire.unpack_header(opened)
            out.append((h.message_id, h.seq))
        return out

    try:
        for s in (spec(1, 10, 6, 1, [1, 6, 6]), spec(1, 11, 4, 2), spec(2, 20, 7, 3)):
            dp.submit(s)
        dp.start()
        rx.settimeout(5)
        assert arrivals(9) == [(20, 0), (20, 1), (20, 2), (10, 1), (10, 2), (10, 0), (11, 0), (11, 1), (11, 2)]
    finally:
        dp.stop()
        sock.close()
        rx.close()


@pytest.mark.parametrize("which", ["native", "numpy"])
def test_a_pass_ends_with_its_last_three_packets_marked_last_whatever_the_send_calls(which):
    """wire.LAST_PACKETS: the final three packets of a pass carry LAST, so one lost packet does
    not leave the receiver waiting for a PROBE. Nine packets go out eight to a call without
    offload, which would leave the ninth alone: the call takes it too. A resend pass ends the
    same way, its packets RETX."""
    assert wire.LAST_PACKETS == 3
    x = np.random.default_rng(4).standard_normal(PER * 8 + 10).astype(np.float32)
    got = _capture(which, TxSpec(1, 7, x, 0, PER, 99, 2, 3, 0, 6, None, None, np.zeros(9, np.uint8)), 9,
                   resend=[5, 1, 7, 8])
    hdr = [wire.unpack_header(d) for d in got]
    assert sorted(h.seq for h in hdr[:9]) == list(range(9)) and sorted(h.seq for h in hdr[9:]) == [1, 5, 7, 8]
    last = [bool(h.flags & wire.Flags.LAST) for h in hdr]  # (in the order they left: a short packet first)
    assert last == [False] * 6 + [True] * 3 + [False] + [True] * 3
    assert [bool(h.flags & wire.Flags.RETX) for h in hdr] == [False] * 9 + [True] * 4


@pytest.mark.parametrize("which", ["native", "numpy"])
def test_holes_reported_during_a_pass_are_resent_ahead_of_its_rest_and_only_if_sent(which, monkeypatch):
    """DataPort.resend (a receiver's NACK): of the holes asked for, those the pass has sent go
    out again at once, RETX, ahead of the rest of the pass; one not sent yet is left to the pass;
    the pass still ends with LAST on its final three first-pass packets, not on a resend. The
    credit window (8 packets, no credits from this plain receiver) holds the pass after 8 until
    the credit timeout (1 s here), so the resend comes in the middle of the pass."""
    from dlcp.hostagent.datapath import config
    from tests.reference import numpy_path
    from dlcp.hostagent.datapath.native import NativeDatapath
    from tests.reference.numpy_path import NumpyDatapath

    monkeypatch.setattr(config, "CREDIT_TIMEOUT", 1.0)  # (what the extension is configured with)
    monkeypatch.setattr(numpy_path, "CREDIT_TIMEOUT", 1.0)
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    cfg = TransportConfig(rank=0, peers=local_peers(2, 42000), offload=False, socket_buffer=4096)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dp = (NativeDatapath if which == "native" else NumpyDatapath)(cfg, sock, False)
    dp.add_peer(1, "127.0.0.1", rx.getsockname()[1])
    dp.set_keys(1, KEY1, KEY1)
    dp.set_rate(1, 1e9)
    dp.start()
    x = np.arange(PER * 12, dtype=np.float32)
    try:
        dp.submit(TxSpec(1, 7, x, 0, PER, 99, 2, 3, 0, 6, None, None, np.zeros(12, np.uint8)))
        rx.settimeout(5)
        got = [wire.unpack_header(rx.recv(65536)) for _ in range(8)]  # the window's worth
        assert [h.seq for h in got] == list(range(8))
        assert dp.resend(1, 7, np.array([3, 0, 10])) == 2  # 10 is not sent yet
        assert dp.resend(1, 7, np.array([0])) == 0  # queued already
        with pytest.raises(ValueError, match="resend: sequence number beyond"):
            dp.resend(1, 7, np.array([12]))
        with pytest.raises(ValueError, match="retransmit: sequence number beyond"):  # and nothing changed
            dp.retransmit(1, 7, np.array([2, 12]))
        got += [wire.unpack_header(rx.recv(65536)) for _ in range(6)]
    finally:
        dp.stop()
        sock.close()
        rx.close()
    assert [h.seq for h in got[8:]] == [0, 3, 8, 9, 10, 11]
    assert [bool(h.flags & wire.Flags.RETX) for h in got[8:]] == [True, True] + [False] * 4
    assert [bool(h.flags & wire.Flags.LAST) for h in got] == [False] * 11 + [True] * 3


def test_both_paths_list_the_same_holes_per_priority_level():
    """DataPort.holes: per priority level, the first-pass packets missing between the lowest and
    highest received (a level is one run of sequence numbers, in order); not the short last
    packet's run ahead of it, not a hole a resend filled; Progress.gaps counts them all."""
    x = np.arange(1, PER * 12 + 10, dtype=np.float32)  # 13 packets, the last one short
    prio = [5] * 6 + [2] * 7  # two levels: 0-5 leave first, then 6-12
    paths, sock = _paths()
    for dp in paths:
        dgs = [_with(d, priority=prio[i]) for i, d in enumerate(_datagrams(x, 5))]
        _expect(dp, 1, 5, x.size)
        assert len(dp.holes(1, 5)) == 0 and dp.holes(1, 99).size == 0
        for i in [0, 2, 3, 5, 12, 6, 7, 10]:  # 12: the short last packet, ahead of its run
            _one(dp, dgs[i], now=1.0)
        assert dp.holes(1, 5).tolist() == [1, 4, 8, 9], type(dp).__name__
        assert dp.progress(1, 5).gaps == 4
        _one(dp, _with(dgs[8], flags=wire.Flags.RETX), now=1.1)  # a resend fills one
        assert dp.holes(1, 5).tolist() == [1, 4, 9]
        assert dp.progress(1, 5).gaps == 4  # (skipped in the first pass: still counted)
        dp.stop()
    sock.close()


@pytest.mark.parametrize("which", ["native", "numpy"])
def test_a_large_messages_magnitudes_shared_between_threads_give_the_policys_classes(which, monkeypatch):
    """A message of PARALLEL_MAGNITUDE_ELEMS or more has its magnitudes computed by several
    threads, each a run of whole packets (the last with the short tail): the classes it sends
    are those of one pass over the whole message. (The threshold is lowered here so that 38
    packets split three ways.)"""
    import dlcp.hostagent.datapath.config as native_mod  # the extension's configuration
    import dlcp.hostagent.policy as policy_mod

    x = np.random.default_rng(5).standard_normal(PER * 37 + 11).astype(np.float32)
    want = drop_classes(packet_magnitudes(x, PER, "l2"), Policy())  # one thread: below the real threshold
    for mod in (native_mod, policy_mod):
        monkeypatch.setattr(mod, "PARALLEL_MAGNITUDE_ELEMS", 1)
    monkeypatch.setattr(native_mod, "magnitude_threads", lambda: 3)
    monkeypatch.setattr(policy_mod, "magnitude_threads", lambda: 3)
    classes = np.full(38, 255, np.uint8)
    got = _capture(which, TxSpec(1, 7, x, 0, PER, 99, 2, 3, 0, 6, None, None, classes), 38)
    hdr = sorted((wire.unpack_header(d) for d in got), key=lambda h: h.seq)
    assert [h.drop_class for h in hdr] == want.tolist() == classes.tolist()
    assert len(set(want.tolist())) == 4  # every class present: a wrong split would show


@pytest.mark.parametrize("which", ["native", "numpy"])
def test_a_large_message_sends_the_policys_sampled_classes(which, monkeypatch):
    """A message of SAMPLED_CLASSES_PACKETS or more takes its class boundaries from a sample of
    its packets; the compiled path computes each packet's class as it sends it. Both paths
    send (and report in drop_class_out) exactly the policy's classes. (The thresholds are
    lowered here so that 38 packets are a large message, one of every 4 in the sample.)"""
    import dlcp.hostagent.datapath.config as native_mod  # the extension's configuration
    import dlcp.hostagent.policy as policy_mod

    x = np.random.default_rng(6).standard_normal(PER * 37 + 11).astype(np.float32)
    x[PER * 5: PER * 9] = 0  # four packets tied at zero
    for mod in (native_mod, policy_mod):
        monkeypatch.setattr(mod, "SAMPLED_CLASSES_PACKETS", 16)
        monkeypatch.setattr(mod, "CLASS_SAMPLE", 8)
    assert policy_mod.class_sample_stride(38) == 4
    mags = packet_magnitudes(x, PER, "l2")
    want = drop_classes(mags, Policy())
    sampled = policy_mod.class_boundaries(mags[policy_mod.class_sample(38)], Policy())
    assert want.tolist() == policy_mod.classes_from_boundaries(mags, sampled, Policy()).tolist()
    monkeypatch.setattr(policy_mod, "SAMPLED_CLASSES_PACKETS", 10**9)
    assert want.tolist() != drop_classes(mags, Policy()).tolist()  # the sample's rule is not the exact one here
    monkeypatch.setattr(policy_mod, "SAMPLED_CLASSES_PACKETS", 16)
    classes = np.full(38, 255, np.uint8)
    got = _capture(which, TxSpec(1, 7, x, 0, PER, 99, 2, 3, 0, 6, None, None, classes), 38)
    hdr = sorted((wire.unpack_header(d) for d in got), key=lambda h: h.seq)
    assert [h.drop_class for h in hdr] == want.tolist() == classes.tolist()
    assert {int(c) for c in want[5:9]} == {3}  # the tied zeros go together, to the last class


def test_the_compiled_tags_equal_the_policys():
    """Drop classes from the compiled path are the policy's for the same magnitudes (ties by
    packet order included), and its magnitudes equal numpy's to float32 rounding."""
    from dlcp.hostagent import _datapath

    rng = np.random.default_rng(0)
    for n, per, classes, kind in [(10_000, 357, 4, "l2"), (1, 7, 4, "l2"), (12_345, 100, 3, "maxabs"),
                                  (100_000, 2231, 8, "l2"), (5_000, 50, 1, "l2"),
                                  (500_000, 100, 4, "l2"), (80_000, 11, 8, "maxabs")]:  # sampled boundaries
        policy = Policy(num_drop_classes=classes, drop_thresholds=tuple(range(64, 64 - 8 * (classes - 1), -8)),
                        magnitude=kind)
        x = rng.standard_normal(n).astype(np.float32)
        x[::97] = 0
        mags = packet_magnitudes(x, per, kind)
        native = np.empty_like(mags)
        _datapath.packet_magnitudes(x.view(np.uint8), 0, per, kind, native)
        np.testing.assert_allclose(native, mags, rtol=1e-5)
        for m in (mags, np.round(mags).astype(np.float32)):  # rounded: many ties
            out = np.empty(len(m), np.uint8)
            _datapath.drop_classes(m, list(policy.shares()), SAMPLED_CLASSES_PACKETS, CLASS_SAMPLE, out)
            np.testing.assert_array_equal(out, drop_classes(m, policy))


def _eight_lane_l2(x: np.ndarray, per: int) -> np.ndarray:
    """Each ``per``-element packet's L2 magnitude by the compiled loops' rule (f32_loops.h):
    float32 squares summed in 8 lanes (lane k: elements k, k + 8, ...), the lanes added in
    double from lane 0, then the elements past the last whole 8, then the square root."""
    out = []
    for lo in range(0, x.size, per):
        p = x[lo:lo + per].astype(np.float32)
        whole = p.size // 8 * 8
        lanes = np.zeros(8, np.float32)
        for row in p[:whole].reshape(-1, 8):  # one float32 rounding per square and per sum
            lanes = lanes + row * row
        acc = 0.0
        for v in lanes:
            acc += float(v)
        for v in p[whole:]:
            acc += float(v) * float(v)
        out.append(np.float32(np.sqrt(acc)))
    return np.array(out, np.float32)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
def test_the_compiled_magnitudes_follow_the_eight_lane_rule_bit_for_bit(dtype):
    """Whichever build of the loops this CPU runs (AVX2 or the baseline's SSE; ``LOOPS_TARGET``),
    a packet's magnitude is the 8-lane rule's to the bit: the builds differ in vector width,
    never in result, so every host of a job tags the same packets alike."""
    from dlcp.hostagent import _datapath

    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():  # (the kernel's flags: what this CPU and kernel run)
        flags = cpuinfo.read_text().split()
        assert _datapath.LOOPS_TARGET == ("avx2" if "avx2" in flags else "baseline" if "sse2" in flags else "portable")
    assert _datapath.LOOPS_TARGET in ("avx2", "baseline", "portable")
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(2_000) * 10.0 ** rng.integers(-3, 4, 2_000)).astype(dtype)
    kind = 0 if dtype is np.float32 else 2  # (the compiled path's element kinds: float32 0, bfloat16 2)
    for per in (1, 7, 8, 9, 64, 357, 2_000):  # shorter than the lanes, whole 8s, tails
        native = np.empty((x.size + per - 1) // per, np.float32)
        _datapath.packet_magnitudes(x.view(np.uint8), kind, per, "l2", native)
        np.testing.assert_array_equal(native.view(np.uint32), _eight_lane_l2(x, per).view(np.uint32),
                                      err_msg=f"per={per}")


def _unaligned(n: int, dtype) -> np.ndarray:
    """``n`` elements of ``dtype`` one byte off their alignment (numpy allows such views)."""
    a = np.zeros(n * np.dtype(dtype).itemsize + 1, np.uint8)[1:].view(dtype)
    assert not a.flags.aligned
    return a


def test_the_bindings_refuse_arrays_that_do_not_fit_before_touching_them():
    """The extension trusts no size or alignment from its caller: ``packet_magnitudes`` wrote 9
    floats past a 1-element ``out``; ``submit`` read past a 10-element payload declared as 15
    elements (and sent elements 10-14); a snapshot was compared with the payload, not with the
    message; an unaligned ``out`` reached ``reinterpret_cast<float*>``. Each is a ValueError now."""
    from dlcp.hostagent import _datapath
    from dlcp.hostagent.datapath.native import NativeDatapath

    x = np.ones(PER * 10, np.float32)
    with pytest.raises(ValueError, match="out has 1 entries for 10 packets"):
        _datapath.packet_magnitudes(x.view(np.uint8), 0, PER, "l2", np.zeros(1, np.float32))
    with pytest.raises(ValueError, match="not aligned"):
        _datapath.packet_magnitudes(x.view(np.uint8), 0, PER, "l2", _unaligned(10, np.float32))
    with pytest.raises(ValueError, match="per must be > 0"):
        _datapath.packet_magnitudes(x.view(np.uint8), 0, 0, "l2", np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="unknown element kind"):
        _datapath.packet_magnitudes(x.view(np.uint8), 7, PER, "l2", np.zeros(10, np.float32))

    cfg = TransportConfig(rank=0, peers=local_peers(3, 41000))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dp = NativeDatapath(cfg, sock, False)
    dp.add_peer(1, "127.0.0.1", 41002)
    raw = dp._dp

    def submit(mid: int, payload: np.ndarray, total: int, snapshot: np.ndarray | None = None) -> None:
        raw.submit(1, mid, payload, 0, total, PER, 0, 0, 0, 0, 0, None, None, np.zeros(1, np.uint8), snapshot,
                   True, 0)

    with pytest.raises(ValueError, match="payload holds 40 bytes, the message 15 elements"):
        submit(1, np.ones(10, np.float32), 15)
    with pytest.raises(ValueError, match="snapshot holds 20 bytes"):
        submit(2, np.ones(10, np.float32), 10, snapshot=np.zeros(5, np.float32))
    submit(3, np.ones(20, np.float32), 10, snapshot=np.zeros(10, np.float32))  # fits the message: taken
    code = int(wire.dtype_code(np.float32))
    for out, accumulate in ((_unaligned(PER, np.float32), True), (_unaligned(PER, np.float16), True)):
        b = RxBuffers.allocate(out, 1, 0)
        with pytest.raises(ValueError, match="not aligned"):
            raw.expect(1, 5, 0, code if out.dtype == np.float32 else int(wire.dtype_code(np.float16)), PER, PER,
                       _raw_bits(out), accumulate, int(wire.dtype_code(out.dtype)), b.received, b.pkt_priority,
                       b.pkt_layer, PER, [])
    dp.stop()
    sock.close()


def _raw_bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a


def _credit(granter: int, seq: int, consumed: int, window: int, key: bytes = KEY1) -> bytes:
    h = wire.Header(ptype=wire.PacketType.CREDIT, job_id=1, message_id=0, sender_rank=granter, priority=7,
                    iteration=seq, elem_count=window, total_pkts=consumed >> 32, elem_offset=consumed & 0xFFFFFFFF)
    return wire.pack_header(h)


def test_a_credit_with_its_window_changed_is_refused_by_both_paths():
    """The trailer's tag covers every field of a credit: a copy of a real one with its window
    (``elem_count``) raised to 65535 or its count changed is refused (a 32-bit token that bound
    neither let the window through once, and a sender would have sent 65535 packets into a
    receiver that granted 64); the real one moves the window."""
    paths, sock = _paths()
    for dp in paths:
        real = _seal(_credit(1, seq=1, consumed=10, window=64))
        dp.add_peer(1, "127.0.0.1", 41002)
        _one(dp, _with(real, elem_count=wire.MAX_CREDIT_WINDOW), now=1.0, key=None)
        _one(dp, _with(real, elem_offset=10_000), now=1.0, key=None)
        s = dp.stats()
        assert (s["credits_received"], s["rejected"].get("bad_mac")) == (0, 2), type(dp).__name__
        _one(dp, real, now=1.0, key=None)
        assert dp.stats()["credits_received"] == 1
        dp.stop()
    sock.close()


def test_a_message_set_up_twice_is_refused_by_both_paths():
    paths, sock = _paths()
    for dp in paths:
        _expect(dp, 1, 9, PER)
        with pytest.raises(ValueError, match="already expected"):
            _expect(dp, 1, 9, PER)
        dp.stop()
    sock.close()
    time.sleep(0)


def test_a_message_the_core_completes_reads_zero_where_packets_are_missing():
    """The core finishes a message under its bound with ``complete()``; the buffer is final
    then (the core never writes it): a copy's missing packets read as zero, a sum's as what
    was there, scaled."""
    from dlcp.hostagent.datapath.native import NativeDatapath

    cfg = TransportConfig(rank=0, peers=local_peers(3, 41000))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dp = NativeDatapath(cfg, sock, False)
    dp.set_keys(1, KEY1, KEY1)
    x = np.arange(1, PER * 4 + 1, dtype=np.float32)
    outs = {}
    for mid, accumulate in ((5, False), (6, True)):
        out = outs[mid] = np.full(x.size, 2.0, np.float32)
        dp.expect(RxSpec(1, mid, auth.DATA_TOKEN, 0, x.size, PER, RxBuffers.allocate(out, 4, 0), accumulate,
                         x.size, scale=0.5 if accumulate else 1.0))
        for i in (0, 1, 3):
            _one(dp, _datagrams(x, mid)[i], now=1.0)
        assert dp.complete(1, mid, False) and not dp.complete(1, mid, False)  # once
    hole, rest = slice(2 * PER, 3 * PER), np.r_[0:2 * PER, 3 * PER:4 * PER]
    assert not outs[5][hole].any()
    np.testing.assert_array_equal(outs[5][rest], x[rest])
    np.testing.assert_array_equal(outs[6][hole], np.full(PER, 1.0, np.float32))  # 2.0 scaled, nothing added
    np.testing.assert_array_equal(outs[6][rest], 2.0 * 0.5 + x[rest])  # out scaled, then the packet added
    dp.stop()
    sock.close()


def test_a_bounded_message_completes_in_the_data_path_after_its_grace():
    """Past its bound with its LAST packet in, a message completes in the receive thread once
    no data of it came for the grace (answer_grace's rule) and the receive thread has read all
    that arrived until then (later if it is behind),
    so a ring's bounded step starts the next without Python. Without its LAST it waits (the
    protocol core probes then)."""
    from dlcp.hostagent.datapath.native import NativeDatapath

    cfg = TransportConfig(rank=0, peers=local_peers(3, 41000), probe_grace=0.002)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dp = NativeDatapath(cfg, sock, False)
    dp.set_keys(1, KEY1, KEY1)
    x = np.arange(1, PER * 10 + 1, dtype=np.float32)
    outs = {}
    for mid, keep in ((5, [i for i in range(10) if i != 4]), (6, list(range(9)))):  # 6 lacks its LAST
        dgs = _datagrams(x, mid)
        dgs[-1] = _with(dgs[-1], flags=wire.Flags.LAST)  # (the send path marks a pass's last packet)
        out = outs[mid] = np.full(x.size, -1.0, np.float32)
        b = RxBuffers.allocate(out, 10, 0)
        dp.expect(RxSpec(1, mid, auth.DATA_TOKEN, 0, x.size, PER, b, False, PER * 8))
        for i in keep:
            _one(dp, dgs[i], now=1.0 + i * 1e-5)
    t_last = 1.0 + 9e-5
    assert dp.end_passes_for_test(t_last + 0.001, t_last + 0.001) > 0  # within the grace: still waiting
    assert _state(dp, 1, 5) == 0
    assert dp.end_passes_for_test(t_last + 0.003, t_last + 0.001) > 0  # the reader is behind: wait longer
    assert _state(dp, 1, 5) == 0
    dp.end_passes_for_test(t_last + 0.003, t_last + 0.0021)  # it has read past the grace
    assert _state(dp, 1, 5) == 2  # bounded
    assert _state(dp, 1, 6) == 0  # no LAST: the data path does not guess the pass is over
    # a reader that stays behind holds a completion back MAX_BUSY_DEFER past the grace, no longer
    dgs = _datagrams(x, 7)
    dgs[-1] = _with(dgs[-1], flags=wire.Flags.LAST)
    b = RxBuffers.allocate(np.zeros(x.size, np.float32), 10, 0)
    dp.expect(RxSpec(1, 7, auth.DATA_TOKEN, 0, x.size, PER, b, False, PER * 8))
    for i in (0, 1, 2, 3, 5, 6, 7, 8, 9):
        _one(dp, dgs[i], now=2.0)
    wake = dp.end_passes_for_test(2.01, 2.0)  # quiet, but nothing read past the last packet
    assert 0.0002 <= wake - 2.0 - MAX_BUSY_DEFER <= 0.002  # the fallback: its grace (the window) + the defer
    dp.end_passes_for_test(wake - 1e-6, 2.0)
    assert _state(dp, 1, 7) == 0
    dp.end_passes_for_test(wake, 2.0)
    assert _state(dp, 1, 7) == 2
    hole = slice(4 * PER, 5 * PER)
    assert not outs[5][hole].any()  # the packet that never came reads as zero
    np.testing.assert_array_equal(np.delete(outs[5], np.r_[hole]), np.delete(x, np.r_[hole]))
    dp.stop()
    sock.close()


@pytest.mark.parametrize("which", ["native", "numpy"])
def test_the_receive_thread_says_up_to_when_it_has_read_what_arrived(which):
    """``rx_seen_until``: every datagram that reached the host before it has been read and placed
    (an answer to an end of pass waits for it, not for an empty socket). It moves with the
    kernel's arrival stamps while datagrams come, and to the time the socket was found empty,
    on the same clock as ``time.monotonic``; never past the present."""
    from dlcp.hostagent.datapath.native import NativeDatapath
    from tests.reference.numpy_path import NumpyDatapath
    from dlcp.hostagent.udp_offload import enable_arrival_stamps

    cfg = TransportConfig(rank=0, peers=local_peers(3, 41000))
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    assert enable_arrival_stamps(rx)
    rx.bind(("127.0.0.1", 0))
    rx.setblocking(False)
    dp = (NativeDatapath if which == "native" else NumpyDatapath)(cfg, rx, False)
    dp.start()
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _ in range(3):
            t0 = time.monotonic()
            for _ in range(200):  # junk: read, rejected, and still read
                tx.sendto(b"\0" * 600, rx.getsockname())
            give_up = time.monotonic() + 10
            while dp.rx_seen_until() < t0 and time.monotonic() < give_up:
                time.sleep(0.001)
            assert t0 <= dp.rx_seen_until() <= time.monotonic()
    finally:
        dp.stop()
        tx.close()
        rx.close()


@pytest.mark.parametrize("which", ["native", "numpy"])
def test_an_empty_datagram_ahead_of_others_is_not_an_empty_socket(which):
    """For UDP, FIONREAD (SIOCINQ) is the length of the first queued datagram: an empty one
    ahead of a 1,000-byte one read 0, and ``rx_seen_until`` said "all read up to now" with both
    unread (an answer then listed packets still waiting in the socket). Nothing is read here
    (the threads are not started), so it must stay where it was; an empty socket says now."""
    from dlcp.hostagent.datapath.native import NativeDatapath
    from tests.reference.numpy_path import NumpyDatapath

    cfg = TransportConfig(rank=0, peers=local_peers(3, 41000))
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.setblocking(False)
    dp = (NativeDatapath if which == "native" else NumpyDatapath)(cfg, rx, False)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        t0 = time.monotonic()
        assert dp.rx_seen_until() >= t0  # empty: everything that came is read
        tx.sendto(b"", rx.getsockname())
        tx.sendto(b"\0" * 1000, rx.getsockname())
        assert select.select([rx], [], [], 10)[0]
        assert dp.rx_seen_until() < t0
    finally:
        dp.stop()
        tx.close()
        rx.close()


def test_both_paths_learn_a_senders_reordering_window_alike():
    """The grace's floor per sender (RACK's reordering window): ``probe_grace`` until measured;
    a first-pass packet that comes after its message's LAST widens it to 1.25 x its lateness at
    once, also when the message was already complete; a resend (RETX) never does; every
    REORDER_PERSIST recoveries in a row (passes that ended with a packet missing, here resent)
    with nothing late narrow it by 0.9, down to REORDER_MIN (a late packet starts the count
    again); passes that lost nothing leave it as it is."""
    from dlcp.hostagent.protocol.incoming import REORDER_MIN, REORDER_PERSIST

    paths, sock = _paths(probe_grace=0.002)
    x = np.arange(1, PER * 10 + 1, dtype=np.float32)
    windows = []
    for dp in paths:
        seen = [dp.reorder_window(1)]
        dgs = _datagrams(x, 5)
        dgs[-1] = _with(dgs[-1], flags=wire.Flags.LAST)
        _expect(dp, 1, 5, x.size)
        for i in [0, 1, 2, 3, 5, 6, 7, 8, 9]:  # 4 overtaken by the LAST
            _one(dp, dgs[i], now=1.0)
        _one(dp, _with(dgs[4], flags=wire.Flags.RETX), now=1.001)  # a resend completes it: no reordering seen
        seen.append(dp.reorder_window(1))
        _one(dp, dgs[4], now=1.004)  # the original, 4 ms after the LAST, to a complete message
        seen.append(dp.reorder_window(1))
        for mid in range(6, 6 + REORDER_PERSIST * 35):  # each run of REORDER_PERSIST recoveries narrows it
            dgs = _datagrams(x, mid)
            dgs[-1] = _with(dgs[-1], flags=wire.Flags.LAST)
            _expect(dp, 1, mid, x.size)
            for d in dgs[:4] + dgs[5:]:  # packet 4 lost, then resent
                _one(dp, d, now=2.0 + mid)
            _one(dp, _with(dgs[4], flags=wire.Flags.RETX), now=2.001 + mid)
            seen.append(dp.reorder_window(1))
        for mid in range(6 + REORDER_PERSIST * 35, 6 + REORDER_PERSIST * 36):  # nothing lost: no change
            dgs = _datagrams(x, mid)
            dgs[-1] = _with(dgs[-1], flags=wire.Flags.LAST)
            _expect(dp, 1, mid, x.size)
            for d in dgs:
                _one(dp, d, now=2.0 + mid)
        seen.append(dp.reorder_window(1))
        windows.append(seen)
        dp.stop()
    sock.close()
    native, numpy_ = windows
    np.testing.assert_allclose(native, numpy_, rtol=1e-6)
    assert native[-3] == native[-2] == native[-1]  # at the floor: it stays there
    # the first message (its packet 4 overtaken, then resent) was a clean pass, one of a run
    assert native[0] == 0.002 and native[1] == 0.002
    assert native[2] == pytest.approx(1.25 * 0.004)  # the original came 4 ms after the LAST
    # the late original started the count again: REORDER_PERSIST more clean passes narrow it once
    assert native[3:2 + REORDER_PERSIST] == [native[2]] * (REORDER_PERSIST - 1)
    assert native[2 + REORDER_PERSIST] == pytest.approx(0.9 * 1.25 * 0.004)
    assert native[2 + 2 * REORDER_PERSIST] == pytest.approx(0.9 ** 2 * 1.25 * 0.004)
    assert native[-1] == REORDER_MIN


def test_a_passs_other_last_packets_widen_the_window_only_after_a_quiet_gap_longer_than_it():
    """The final LAST_PACKETS of a pass all carry LAST and arrive after the first of them by
    design: read one per batch within the window of each other, they do not widen it, and such
    passes, which lost nothing, do not narrow it either. One that comes after the message was
    quiet for longer than the window widens it to 1.25 x that quiet gap: the end of pass was due
    without it, and an answer listed it missing (captured on the testbed: a same-leaf path
    paused for a millisecond between a pass's first LAST and its other two, the window had
    narrowed to 0.2 ms, and the rings resent 0.5 % of their packets with nothing lost). A packet
    without LAST after them still widens it by its lateness after the first LAST."""
    from dlcp.hostagent.protocol.incoming import REORDER_PERSIST

    paths, sock = _paths(probe_grace=0.002)
    x = np.arange(1, PER * 10 + 1, dtype=np.float32)
    for dp in paths:
        name = type(dp).__name__
        for mid in range(5, 5 + REORDER_PERSIST):
            dgs = _datagrams(x, mid)
            for i in range(10 - wire.LAST_PACKETS, 10):
                dgs[i] = _with(dgs[i], flags=wire.Flags.LAST)
            _expect(dp, 1, mid, x.size)
            for i, d in enumerate(dgs):
                _one(dp, d, now=mid + i * 5e-4)
        assert dp.reorder_window(1) == 0.002, name
        paused = 5 + REORDER_PERSIST
        dgs = _datagrams(x, paused)
        for i in range(10 - wire.LAST_PACKETS, 10):
            dgs[i] = _with(dgs[i], flags=wire.Flags.LAST)
        _expect(dp, 1, paused, x.size)
        for i, d in enumerate(dgs):  # the first LAST (7), then 3 ms of quiet before 8 and 9
            _one(dp, d, now=paused + (0.003 if i >= 8 else 0.0))
        assert dp.reorder_window(1) == pytest.approx(1.25 * 0.003), name
        late = paused + 1
        dgs = _datagrams(x, late)
        dgs[-1] = _with(dgs[-1], flags=wire.Flags.LAST)
        _expect(dp, 1, late, x.size)
        for i in [0, 1, 2, 3, 4, 5, 6, 7, 9, 8]:  # 8 after the LAST, 5 ms late
            _one(dp, dgs[i], now=late + 0.005 if i == 8 else late)
        assert dp.reorder_window(1) == pytest.approx(1.25 * 0.005), name
        dp.stop()
    sock.close()


def test_only_an_authentic_datagram_moves_the_reordering_window_and_never_past_the_cap():
    """A forged late packet (its tag under another key) changes nothing; a genuine one replayed long after its
    message's LAST widens the window at most to MAX_ANSWER_GRACE (security design: what junk
    cannot move)."""
    from dlcp.hostagent.protocol.incoming import MAX_ANSWER_GRACE

    paths, sock = _paths(probe_grace=0.002)
    x = np.arange(1, PER * 10 + 1, dtype=np.float32)
    for dp in paths:
        dgs = _datagrams(x, 5)
        dgs[-1] = _with(dgs[-1], flags=wire.Flags.LAST)
        _expect(dp, 1, 5, x.size)
        for d in dgs:
            _one(dp, d, now=1.0)
        start = dp.reorder_window(1)
        _one(dp, dgs[3], now=1.05, key=bytes(16))  # forged: sealed under a key not the sender's
        assert dp.reorder_window(1) == start
        _one(dp, dgs[3], now=30.0)  # replayed half a minute later
        assert dp.reorder_window(1) == MAX_ANSWER_GRACE
        dp.stop()
    sock.close()


@pytest.mark.parametrize("call, lock", [("stats", 1), ("add_peer", 1), ("set_keys", 1), ("set_sockopt", 2)])
def test_calls_waiting_for_a_data_path_lock_let_python_run(call, lock):
    """``stats()``, ``add_peer``, ``set_*_key`` and ``set_sockopt`` waited for a lock the receive
    (or send) thread holds for a whole batch while holding the interpreter lock: every Python
    thread of the training process stood still meanwhile. Here a thread of the extension holds
    the lock; the call waits in another Python thread, and this one must still run to let go."""
    from dlcp.hostagent.datapath.native import NativeDatapath

    cfg = TransportConfig(rank=0, peers=local_peers(3, 41000))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dp = NativeDatapath(cfg, sock, False)
    dp.add_peer(1, "127.0.0.1", 41002)
    calls = {"stats": lambda: dp.stats(), "add_peer": lambda: dp.add_peer(2, "127.0.0.1", 41004),
             "set_keys": lambda: dp.set_keys(1, KEY1, KEY1),
             "set_sockopt": lambda: dp.set_sockopt(1, 0, socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)}
    dp._dp.hold_lock_for_test(lock, 10.0)  # (a failing call makes this test wait that long)
    calling = threading.Event()

    def run() -> None:
        calling.set()
        calls[call]()

    t = threading.Thread(target=run)
    t.start()
    assert calling.wait(10)
    time.sleep(0.02)  # (into the call: it waits for the lock)
    let_go = dp._dp.release_lock_for_test()
    t.join(10)
    assert let_go, f"{call} held the interpreter lock while it waited for the data path's lock"
    dp.stop()
    sock.close()


def _fresh_counts(dp) -> tuple:
    s = dp.stats()
    return (s["rejected"].get("stale", 0), s["late"], s["parked"], s["parked_now"], dp.reorder_window(1))


def test_packets_recorded_before_their_message_id_came_round_again_are_stale_on_both_paths():
    """Message ids repeat (an exchange's every 1,024 iterations) and a packet recorded at
    iteration i carries a valid token for i. Replayed 1,024 iterations later it was a late
    straggler (counted, and it widened its sender's window to the 100 ms cap) or, once its id
    was forgotten, parked (filling the park, counted as received in feedback and credits).
    Now it is stale: counted as such and nothing else. The real sender's early packets of the
    id's next use still park and are placed."""
    paths, sock = _paths(probe_grace=0.002)
    x = np.arange(1, PER * 6 + 1, dtype=np.float32)
    old = _datagrams(x, 9, iteration=6)
    old[-1] = _with(old[-1], flags=wire.Flags.LAST)
    new = _datagrams(-x, 9, iteration=1030)
    seen = []
    for dp in paths:
        _expect(dp, 1, 9, x.size, iteration=6)
        for d in old:
            _one(dp, d, now=1.0)
        assert _state(dp, 1, 9) == 1
        _expect(dp, 1, 10, PER, iteration=1030)  # the sender is 1,024 iterations on
        dp.take_feedback(1)
        before = _fresh_counts(dp)
        for d in old[:4]:  # replayed while its message is still held
            _one(dp, _with(d, flags=wire.Flags.NONE), now=30.0)
        assert _fresh_counts(dp) == (4, *before[1:]), type(dp).__name__
        dp.forget(1, 9, remember=False)
        for d in old[:4]:  # replayed once its id is forgotten: nothing parks
            _one(dp, d, now=31.0)
        assert _fresh_counts(dp) == (8, *before[1:]), type(dp).__name__
        assert dp.take_feedback(1)[0] == 0  # not counted as received
        for d in new[:3]:  # the real sender's next use of the id, before it is set up: parked
            _one(dp, d, now=32.0)
        assert _fresh_counts(dp)[2:4] == (before[2] + 3, 3)
        b = _expect(dp, 1, 9, x.size, iteration=1030)
        for d in new[3:]:
            _one(dp, d, now=32.1)
        np.testing.assert_array_equal(b.out, -x)
        seen.append(_fresh_counts(dp))
        dp.stop()
    sock.close()
    assert seen[0] == seen[1]


def test_early_data_of_a_message_id_never_set_up_parks_whatever_its_iteration():
    """A sender's iterations may come from more than one counter (the torch backend numbers its
    collectives and its point-to-point sends apart): early data of an id not set up here parks
    even far below the sender's newest iteration, and so does a later use of a known id."""
    paths, sock = _paths()
    x = np.arange(1, PER * 2 + 1, dtype=np.float32)
    for dp in paths:
        _expect(dp, 1, 10, PER, iteration=5000)
        for d in _datagrams(x, 11, iteration=3):
            _one(dp, d, now=1.0)
        assert _fresh_counts(dp)[0] == 0 and dp.stats()["parked_now"] == 2, type(dp).__name__
        b = _expect(dp, 1, 11, x.size, iteration=3)
        np.testing.assert_array_equal(b.out, x)
        dp.stop()
    sock.close()


def test_a_closed_senders_parked_datagrams_are_dropped_on_both_paths():
    """Parked data of a sender whose connection closed (its key withdrawn) or that handshook
    again (a new key) waits for nothing: 16,384 datagrams stayed parked for 60 s after their
    sender closed. They go at once now; another sender's stay."""
    paths, sock = _paths()
    key2 = bytes(16)
    for dp in paths:
        dp.set_keys(2, key2, key2)
        for d in _datagrams(np.ones(PER * 5, np.float32), 11):
            _one(dp, d, now=1.0)
        meta = MessageMeta(job_id=1, message_id=12, sender_rank=2, token=auth.DATA_TOKEN)
        for d in packetize(np.ones(PER * 2, np.float32), meta, POLICY):
            _one(dp, d, now=1.0, key=key2)
        assert dp.stats()["parked_now"] == 7
        dp.set_keys(1, None, None)
        assert dp.stats()["parked_now"] == 2, type(dp).__name__
        dp.set_keys(2, bytes(range(1, 17)), key2)  # a new key
        assert dp.stats()["parked_now"] == 0, type(dp).__name__
        dp.stop()
    sock.close()


def _progress_of(dp, src: int, mid: int) -> tuple | None:
    p = dp.progress(src, mid)
    return None if p is None else (p.received_pkts, p.received_elems, p.duplicates, p.retx_seen, p.state, p.gaps)


@pytest.mark.parametrize("seed", range(40))
def test_both_paths_agree_batch_by_batch_on_random_traffic(seed):
    """The same random batches (several datagrams per call, as the receive thread hands them
    over) into both paths: originals, duplicates, resends, reordering, truncated and junk
    datagrams, credits. Delivered bytes, counters, reasons and each message's progress must be
    the same after every batch. (The one-datagram parity test could not see that a batch with
    an original and a resend of one seq kept the first on one path and the last on the other.)"""
    rng = np.random.default_rng(seed)
    paths, sock = _paths()
    width = WIDTH
    x = rng.standard_normal(PER * 12 + 7).astype(np.float32)
    y = rng.standard_normal(PER * 5).astype(np.float32)
    pool: list[bytes] = []
    for mid, data in ((9, x), (11, y)):
        dgs = _datagrams(data, mid)
        pool += [_seal(d) for d in dgs]
        pool += [_seal(dgs[i]) for i in rng.integers(0, len(dgs), 4)]  # duplicates
        pool += [_seal(_with(dgs[i], flags=wire.Flags.RETX)) for i in rng.integers(0, len(dgs), 4)]  # resends
    pool += [d[: int(rng.integers(1, len(d)))] for d in rng.choice(np.array(pool, dtype=object), 4)]  # truncated
    # (at most a row wide: a longer one is cut by the read, and counted so only by a real read)
    pool += [d[:width] for d in rogue.hostile_datagrams(20, 1, victim=0, real=[(1, 9)], seed=seed)]
    pool.append(_seal(_credit(1, seq=1, consumed=3, window=64)))
    order = rng.permutation(len(pool))
    bufs = []
    for dp in paths:
        dp.add_peer(1, "127.0.0.1", 41002)
        bufs.append((_expect(dp, 1, 9, x.size), None))
    pos = 0
    step = 0
    while pos < len(order):
        k = int(rng.integers(1, 12))
        batch = [pool[i] for i in order[pos : pos + k]]
        pos += k
        rows = np.zeros((len(batch), width), np.uint8)
        for i, d in enumerate(batch):
            rows[i, : min(len(d), width)] = np.frombuffer(d, np.uint8)[:width]
        lengths = np.array([len(d) for d in batch])
        for dp in paths:
            dp.ingest_for_test(rows, lengths, 1.0 + step * 1e-3)
        step += 1
        if step == 3:  # message 11 is set up mid-way: its earlier packets were parked
            for dp in paths:
                _expect(dp, 1, 11, y.size)
        native, numpy_ = ((_counts(dp), dp.stats()["data_pkts_received"], dp.stats()["data_bytes_received"],
                           dp.stats()["credits_received"], _progress_of(dp, 1, 9), _progress_of(dp, 1, 11))
                          for dp in paths)
        assert native == numpy_, f"seed {seed}, batch {step}"
    np.testing.assert_array_equal(bufs[0][0].out, bufs[1][0].out)
    for dp in paths:
        dp.stop()
    sock.close()


@pytest.mark.parametrize("protection", [{"authenticate": False}, {}, {"encrypt": True}],
                         ids=["none", "mac", "encrypt"])
def test_the_start_up_ceiling_is_timed_on_packets_the_data_path_accepts(protection):
    """calibrate() times placement of a sealed batch (it raises if any packet of it is rejected):
    unsealed, every packet failed its tag and the ceiling was the speed of rejecting them."""
    from dlcp.hostagent.datapath.native import NativeDatapath

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        dp = NativeDatapath(TransportConfig(rank=0, peers=local_peers(2, 44000), **protection), sock, False)
        assert dp.calibrate() > 0
    finally:
        sock.close()


@pytest.mark.parametrize("mtu", [9000, 65535])
def test_large_payloads_are_placed_exactly_at_any_alignment(mtu):
    """Payloads of 4 KB and more are placed with streaming stores (rx.cc, place_payload): at
    jumbo and loopback MTUs, with slots at offsets of every alignment (an odd elements per packet
    and a message starting one element in), a short last packet, out of order, both paths place
    every element exactly."""
    cfg = TransportConfig(rank=0, peers=local_peers(3, 41000), mtu=mtu)
    from dlcp.hostagent.datapath.native import NativeDatapath
    from tests.reference.numpy_path import NumpyDatapath

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    width = max_datagram(cfg)
    per = elems_per_packet(mtu, np.float32)
    rng = np.random.default_rng(5)
    x = rng.standard_normal(per * 3 + 1001).astype(np.float32)
    meta = MessageMeta(job_id=1, message_id=4, sender_rank=1, token=auth.DATA_TOKEN)
    datagrams = [_seal(d) for d in packetize(x, meta, POLICY, mtu=mtu)]
    order = [2, 0, 3, 1]
    for dp in (NativeDatapath(cfg, sock, False), NumpyDatapath(cfg, sock, False)):
        dp.set_keys(1, KEY1, KEY1)
        whole = np.full(x.size + 1, np.nan, np.float32)
        out = whole[1:]  # a slot of every packet at an address 4 bytes past any larger alignment
        dp.expect(RxSpec(1, 4, auth.DATA_TOKEN, int(wire.Dtype.FLOAT32), x.size, per,
                         RxBuffers.allocate(out, len(datagrams), 0), False, x.size))
        for i in order:
            row = np.zeros((1, width), np.uint8)
            row[0, :len(datagrams[i])] = np.frombuffer(datagrams[i], np.uint8)
            dp.ingest_for_test(row, np.array([len(datagrams[i])]), 1.0)
        assert dp.stats()["accepted"] == len(datagrams), type(dp).__name__
        np.testing.assert_array_equal(out, x)
        assert np.isnan(whole[0])  # nothing written before the message
        dp.stop()
    sock.close()
