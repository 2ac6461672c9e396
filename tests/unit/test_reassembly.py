"""Malformed and hostile datagrams are counted by reason, ignored, and never write."""

import numpy as np
import pytest

from dlcp.hostagent import wire
from dlcp.hostagent.packetizer import MessageMeta, packetize
from dlcp.hostagent.policy import Policy
from dlcp.hostagent.protocol.port import REASONS
from tests.reference.reassembly import Reassembler

H = wire.HEADER_SIZE
DATA = np.arange(1, 1001, dtype=np.float32)  # 3 packets at MTU 1500: 357, 357, 286


@pytest.fixture
def setup():
    batch = packetize(DATA, MessageMeta(job_id=5, message_id=7, sender_rank=1), Policy())
    r = Reassembler(job_id=5)
    asm = r.expect(1, 7, DATA.size, np.float32, batch.elems_per_packet)
    return batch, r, asm


def _with(datagram: bytes, **fields) -> bytes:
    h = wire.decode_headers(datagram[:H]).copy()
    for k, v in fields.items():
        h[k] = v
    return h.tobytes() + datagram[H:]


CASES = {
    "truncated": lambda d: d[: H - 1],
    "bad_version": lambda d: _with(d, version=wire.VERSION - 1),
    "bad_token": lambda d: _with(d, token=12345),
    "not_data": lambda d: _with(d, ptype=wire.PacketType.PROBE),
    "wrong_job": lambda d: _with(d, job_id=6),
    "unknown_message": lambda d: _with(d, message_id=8),
    "wrong_dtype": lambda d: _with(d, dtype=wire.Dtype.FLOAT16),
    "bad_seq": lambda d: _with(d, seq=3),
    "bad_offset": lambda d: _with(d, elem_offset=10_000_000),  # far outside the message
    "count_mismatch": lambda d: d[:-4],  # payload one element short of elem_count
}


@pytest.mark.parametrize("reason", list(CASES))
def test_each_malformed_kind_is_rejected_and_counted(setup, reason):
    batch, r, asm = setup
    bad = CASES[reason](batch.datagram(1))
    assert r.ingest(bad) == reason
    assert r.stats.rejected == {reason: 1}
    assert asm.received_pkts == 0 and not asm.data.any()  # nothing written
    for i in range(len(batch)):  # the endpoint keeps working
        assert r.ingest(batch.datagram(i)) == "accepted"
    np.testing.assert_array_equal(asm.result(), DATA)


@pytest.mark.parametrize("fields", [
    {"elem_offset": 1},  # inside the message but not where seq 1 starts
    {"elem_count": 359},  # claims more than a packet holds
    {"total_pkts": 4},  # disagrees with the announced size
    {"seq": 0xFFFFFFFF},
])
def test_inconsistent_headers_never_write(setup, fields):
    batch, r, asm = setup
    assert r.ingest(_with(batch.datagram(1), **fields)) != "accepted"
    assert not asm.data.any() and asm.received_pkts == 0


def test_trailing_junk_is_a_count_mismatch(setup):
    batch, r, _ = setup
    assert r.ingest(batch.datagram(2) + b"\0\0\0\0") == "count_mismatch"


def test_last_packet_cannot_claim_a_full_payload(setup):
    batch, r, asm = setup
    # seq 2 is the short tail (284 elements): a full-sized payload would write past the end
    full = _with(batch.datagram(0), seq=2, elem_offset=2 * batch.elems_per_packet)
    assert r.ingest(full) == "count_mismatch"
    assert asm.received_pkts == 0


def test_a_finished_message_is_unknown(setup):
    batch, r, _ = setup
    r.forget(1, 7)
    assert r.ingest(batch.datagram(0)) == "unknown_message"


def test_mixed_batch_of_good_and_bad(setup):
    batch, r, asm = setup
    datagrams = [batch.datagram(0), CASES["wrong_job"](batch.datagram(1)), batch.datagram(1),
                 CASES["bad_offset"](batch.datagram(2)), batch.datagram(2), b"\x01"]
    slots = np.zeros((len(datagrams), 1600), np.uint8)
    for i, d in enumerate(datagrams):
        slots[i, : len(d)] = np.frombuffer(d, np.uint8)
    res = r.ingest_batch(slots, np.array([len(d) for d in datagrams]))
    assert res.accepted == 3 and res.rejected == 3
    assert [REASONS[c] for c in res.reasons] == ["ok", "wrong_job", "ok", "bad_offset", "ok", "truncated"]
    np.testing.assert_array_equal(asm.result(), DATA)


def test_many_messages_from_many_senders_in_one_batch():
    r = Reassembler(job_id=1)
    rng = np.random.default_rng(9)
    msgs = {}
    all_slots, all_lens = [], []
    for rank in range(3):
        for mid in range(4):
            data = rng.standard_normal(rng.integers(1, 5000)).astype(np.float32)
            b = packetize(data, MessageMeta(job_id=1, message_id=mid, sender_rank=rank), Policy())
            msgs[(rank, mid)] = (data, r.expect(rank, mid, data.size, np.float32, b.elems_per_packet))
            s, lens = b.to_slots(slot_size=1500)
            all_slots.append(s)
            all_lens.append(lens)
    slots, lens = np.concatenate(all_slots), np.concatenate(all_lens)
    order = rng.permutation(len(lens))
    res = r.ingest_batch(slots[order], lens[order])
    assert res.accepted == len(lens) and len(res.touched) == 12
    for data, asm in msgs.values():
        np.testing.assert_array_equal(asm.result(), data)


def test_random_garbage_never_raises_or_writes():
    rng = np.random.default_rng(1)
    r = Reassembler(job_id=5)
    asm = r.expect(1, 7, 1000, np.float32, 358)
    n = 5000
    slots = rng.integers(0, 256, size=(n, 1500), dtype=np.uint8)
    # make half of them look plausible so deeper checks run
    hdr = slots[: n // 2, :H].view(wire.HEADER_DTYPE).reshape(-1)
    hdr["version"], hdr["ptype"], hdr["job_id"], hdr["sender_rank"], hdr["message_id"] = wire.VERSION, 1, 5, 1, 7
    hdr["token"] = 0  # the expected message's token, so the deeper checks run
    hdr["dtype"] = 0
    res = r.ingest_batch(slots, rng.integers(0, 1500, size=n))
    assert res.accepted == 0 and res.rejected == n
    assert not asm.data.any()
    assert sum(r.stats.rejected.values()) == n


def test_expect_validates(setup):
    _, r, _ = setup
    with pytest.raises(ValueError, match="already expected"):
        r.expect(1, 7, 10, np.float32, 358)
    with pytest.raises(ValueError, match="out must be"):
        r.expect(1, 8, 10, np.float32, 358, out=np.zeros(9, np.float32))
    with pytest.raises(ValueError, match="caller|2-D"):
        r.ingest_batch(np.zeros(10, np.uint8), np.array([10]))


def test_completion_under_bound(setup):
    batch, r, asm = setup
    r.ingest(batch.datagram(0))
    r.ingest(batch.datagram(1))
    assert not asm.is_complete(0.05)  # 716 of 1000 elements
    assert asm.is_complete(0.3)
    r.ingest(batch.datagram(2))
    assert asm.is_complete(0.0) and asm.is_exact()


def test_unannounced_packets_reach_park_only_with_their_senders_token():
    """Data that overtakes its announcement is parked only when its token is the one its sender
    was given; a wrong token is counted as bad_token, and a sender without a key (one that never
    authenticated) gets nothing parked."""
    tokens = {1: 77}  # sender 1 authenticated; sender 2 did not
    r = Reassembler(job_id=5, token_of=lambda sender, message_id, iteration: tokens.get(sender))
    good = packetize(DATA, MessageMeta(job_id=5, message_id=9, sender_rank=1, token=77), Policy())
    forged = packetize(DATA, MessageMeta(job_id=5, message_id=10, sender_rank=1, token=78), Policy())
    stranger = packetize(DATA, MessageMeta(job_id=5, message_id=11, sender_rank=2, token=77), Policy())
    offered: list[int] = []

    def park(rows: np.ndarray) -> np.ndarray:
        offered.extend(rows.tolist())
        return np.ones(len(rows), dtype=bool)

    datagrams = [*good, *forged, *stranger]
    slots = np.zeros((len(datagrams), max(len(d) for d in datagrams)), np.uint8)
    for i, d in enumerate(datagrams):
        slots[i, : len(d)] = np.frombuffer(d, np.uint8)
    res = r.ingest_batch(slots, np.array([len(d) for d in datagrams]), park=park)
    assert offered == list(range(len(good)))
    assert res.parked == len(good)
    assert r.stats.rejected == {"bad_token": len(forged), "unknown_message": len(stranger)}


def _ingest_both_ways(batches, total, per):
    """Feed the same batches to a reassembler with its one-run fast path and to one without it;
    return what each ended with (data, received, counters, per-batch reasons)."""
    outcomes = []
    for fast in (True, False):
        r = Reassembler(job_id=5)
        asm = r.expect(1, 7, total, np.float32, per)
        if not fast:
            asm._ingest_run = lambda *a: False  # type: ignore[method-assign]  # the general path only: the oracle
        reasons, runs = [], 0
        for slots, lengths in batches:
            res = r.ingest_batch(slots.copy(), lengths.copy())
            reasons.append(res.reasons.tolist())
            runs += res.run
        outcomes.append((asm.data.copy(), asm.received.copy(), asm.pkt_priority.copy(), asm.pkt_layer.copy(),
                         asm.received_pkts, asm.received_elems, asm.duplicates, r.stats.as_dict(), reasons, runs))
    return outcomes


def test_fast_path_takes_clean_runs_and_agrees_with_the_general_path_on_everything_else():
    """The fast path must accept exactly the batches the general path accepts whole and change
    nothing else; every batch it declines (a gap, a repeat, a retransmission, a forged or
    inconsistent field in any row, the short last packet) goes the general way."""
    rng = np.random.default_rng(3)
    data = rng.standard_normal(357 * 40 + 100).astype(np.float32)
    batch = packetize(data, MessageMeta(job_id=5, message_id=7, sender_rank=1, layer=3), Policy())
    slots, lengths = batch.to_slots()
    n = len(lengths)
    mutations = {
        "gap": lambda s, ln: (np.delete(s, 2, axis=0), np.delete(ln, 2)),
        "repeat": lambda s, ln: (np.insert(s, 3, s[2], axis=0), np.insert(ln, 3, ln[2])),
        "reversed": lambda s, ln: (s[::-1], ln[::-1]),
        "retx": lambda s, ln: _set(s, ln, 1, "flags", int(wire.Flags.RETX)),
        "forged_token": lambda s, ln: _set(s, ln, 4, "token", 99),
        "other_iteration": lambda s, ln: _set(s, ln, 2, "iteration", 9),
        "bad_offset": lambda s, ln: _set(s, ln, 3, "elem_offset", 5),
        "short": lambda s, ln: (s, np.where(np.arange(len(ln)) == 1, ln - 4, ln)),
        "other_job": lambda s, ln: _set(s, ln, 0, "job_id", 6),
        "bad_seq": lambda s, ln: _set(s, ln, 5, "seq", 30),
        "other_total": lambda s, ln: _set(s, ln, 6, "total_pkts", 99),
        "other_message": lambda s, ln: _set(s, ln, 7, "message_id", 8),
        "other_sender": lambda s, ln: _set(s, ln, 3, "sender_rank", 2),
        "other_dtype": lambda s, ln: _set(s, ln, 2, "dtype", int(wire.Dtype.FLOAT16)),
    }
    for name, mutate in [("clean", lambda s, ln: (s, ln))] + list(mutations.items()):
        batches = []
        for start in range(0, n, 8):  # runs of 8 packets; the last holds the short tail packet
            s, ln = slots[start : start + 8], lengths[start : start + 8]
            batches.append(mutate(s.copy(), ln.copy()) if start == 8 else (s, ln))
        fast, general = _ingest_both_ways(batches, data.size, batch.elems_per_packet)
        for a, b in zip(fast[:-1], general[:-1]):
            if isinstance(a, np.ndarray):
                assert np.array_equal(a, b), name
            else:
                assert a == b, name
        # the last batch is the short tail packet alone, never a run; a mutated batch is not one either
        runs_expected = len(batches) - 1 - (name != "clean")
        assert fast[-1] == runs_expected, (name, fast[-1])
    assert np.array_equal(fast[0][: 357 * 8], data[: 357 * 8])


def _set(slots, lengths, row, field, value):
    h = slots[row, :H].view(wire.HEADER_DTYPE)
    h[field] = value
    return slots, lengths


def test_datagrams_wider_than_their_slots_are_truncated_not_a_crash():
    """A sender with a larger MTU announces more elements per packet than this receiver's slots
    hold; its datagrams claim lengths past the row. Rejected as truncated, never raised."""
    r = Reassembler(job_id=5)
    r.expect(1, 7, 400 * 4, np.float32, 400)  # 1,600-byte payloads
    batch = packetize(np.ones(1600, np.float32), MessageMeta(job_id=5, message_id=7, sender_rank=1), Policy(),
                      mtu=H + 28 + 1600 + wire.TRAILER_SIZE)
    wide, lengths = batch.to_slots()
    slots = np.ascontiguousarray(wide[:, :1472])  # this receiver's rows: MTU 1500
    res = r.ingest_batch(slots, lengths)
    assert not res.run and res.accepted == 0
    assert r.stats.rejected["truncated"] == len(lengths)
