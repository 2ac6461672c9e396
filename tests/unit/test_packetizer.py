"""Packetize then reassemble: round trips under shuffle, duplication and loss."""

import numpy as np
import pytest

from dlcp.hostagent import wire
from dlcp.hostagent.packetizer import MessageMeta, elems_per_packet, packetize
from dlcp.hostagent.policy import Policy
from tests.reference.reassembly import Reassembler

POLICY = Policy()
SIZES = [0, 1, 357, 358, 359, 1000, 4096 + 3, (1 << 20) + 17]


def _meta(msg=7, **kw):
    return MessageMeta(job_id=5, message_id=msg, sender_rank=kw.pop("rank", 1), **kw)


def _receive(batch, data, order, job=5, rank=1, msg=7):
    r = Reassembler(job)
    asm = r.expect(rank, msg, data.size, data.dtype, batch.elems_per_packet)
    slots, lengths = batch.to_slots()
    for chunk in np.array_split(order, max(1, len(order) // 300)):
        r.ingest_batch(slots[chunk], lengths[chunk])
    return r, asm


def test_elems_per_packet():
    assert elems_per_packet(1500, np.float32) == (1500 - 28 - wire.HEADER_SIZE - wire.TRAILER_SIZE) // 4 == 351
    assert elems_per_packet(1500, np.float16) == (1500 - 28 - wire.HEADER_SIZE - wire.TRAILER_SIZE) // 2
    with pytest.raises(ValueError, match="not one"):
        elems_per_packet(60, np.float32)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_round_trip_shuffled_exact(size, dtype):
    rng = np.random.default_rng(size)
    data = rng.standard_normal(size).astype(dtype)
    batch = packetize(data, _meta(), POLICY)
    assert len(batch) == -(-size // batch.elems_per_packet)
    r, asm = _receive(batch, data, rng.permutation(len(batch)))
    assert asm.is_exact() and asm.lost_fraction == 0.0
    np.testing.assert_array_equal(asm.result(), data)
    assert r.stats.accepted == len(batch) and not r.stats.rejected


@pytest.mark.parametrize("size", [1, 1000, (1 << 20) + 17])
def test_duplicates_are_harmless_and_counted(size):
    rng = np.random.default_rng(0)
    data = rng.standard_normal(size).astype(np.float32)
    batch = packetize(data, _meta(), POLICY)
    order = np.concatenate([np.arange(len(batch)), rng.integers(0, len(batch), len(batch) // 3 + 1)])
    rng.shuffle(order)
    r, asm = _receive(batch, data, order)
    np.testing.assert_array_equal(asm.result(), data)
    assert asm.duplicates == r.stats.duplicates == len(order) - len(batch)
    assert r.stats.accepted == len(batch)


def test_duplicates_inside_one_batch():
    data = np.arange(2000, dtype=np.float32)
    batch = packetize(data, _meta(), POLICY)
    slots, lengths = batch.to_slots()
    r = Reassembler(5)
    asm = r.expect(1, 7, data.size, np.float32, batch.elems_per_packet)
    idx = np.array([0, 3, 0, 3, 5, 5, 1, 2, 4])
    res = r.ingest_batch(slots[idx], lengths[idx])
    assert (res.accepted, res.duplicates) == (6, 3)
    np.testing.assert_array_equal(asm.result(), data)


@pytest.mark.parametrize("size", [1000, 359, (1 << 20) + 17])
def test_loss_zero_fills_and_reports(size):
    rng = np.random.default_rng(42)
    data = (rng.standard_normal(size) + 10).astype(np.float32)  # no zeros in the data
    batch = packetize(data, _meta(), POLICY)
    keep = rng.random(len(batch)) > 0.1
    keep[0] = True
    lost = np.flatnonzero(~keep)
    _, asm = _receive(batch, data, rng.permutation(np.flatnonzero(keep)))
    out = asm.result()
    assert asm.missing_seqs().tolist() == lost.tolist()
    per = batch.elems_per_packet
    expect = data.copy()
    for s in lost:
        expect[s * per : (s + 1) * per] = 0
    np.testing.assert_array_equal(out, expect)
    assert asm.lost_fraction == pytest.approx(np.count_nonzero(expect == 0) / size)
    bitmap = np.unpackbits(np.frombuffer(asm.missing_bitmap(), np.uint8))[: len(batch)]
    assert np.flatnonzero(bitmap).tolist() == lost.tolist()


def test_losing_the_short_last_packet():
    data = np.ones(1000, dtype=np.float32)
    batch = packetize(data, _meta(), POLICY)
    _, asm = _receive(batch, data, np.arange(len(batch) - 1))
    out = asm.result()
    assert out[: (len(batch) - 1) * batch.elems_per_packet].all()
    assert not out[(len(batch) - 1) * batch.elems_per_packet :].any()
    assert asm.received_elems == (len(batch) - 1) * batch.elems_per_packet


def test_headers_carry_meta_and_classes():
    rng = np.random.default_rng(3)
    data = rng.standard_normal(50_000).astype(np.float32)
    meta = _meta(iteration=12, tensor_id=4, layer=9, priority=5, rank=3)
    h = packetize(data, meta, POLICY).headers
    n = len(h)
    assert (h["priority"] == 5).all() and (h["layer"] == 9).all() and (h["sender_rank"] == 3).all()
    assert (h["iteration"] == 12).all() and (h["tensor_id"] == 4).all() and (h["total_pkts"] == n).all()
    assert h["seq"].tolist() == list(range(n))
    assert (np.diff(h["elem_offset"].astype(np.int64)) == h["elem_count"][:-1]).all()
    assert int(h["elem_count"].astype(np.int64).sum()) == data.size
    counts = np.bincount(h["drop_class"], minlength=4)
    assert abs(counts - n / 4).max() <= 1  # equal quantiles
    # class 0 holds the largest packets: every class-0 norm >= every class-3 norm
    per = packetize(data, meta, POLICY).elems_per_packet
    norms = np.array([np.linalg.norm(data[i * per:(i + 1) * per]) for i in range(n)])
    assert norms[h["drop_class"] == 0].min() >= norms[h["drop_class"] == 3].max()


def test_zero_copy_of_a_torch_tensor():
    torch = pytest.importorskip("torch")
    t = torch.randn(3000)
    arr = t.numpy()
    batch = packetize(arr, _meta(), POLICY)
    assert np.shares_memory(batch.payload, arr)
    assert bytes(batch.payload_of(0)) == arr[: batch.elems_per_packet].tobytes()


@pytest.mark.parametrize("bad,match", [
    (np.ones(10, dtype=np.float64), "not supported"),
    (np.ones(10, dtype=">f4"), "little-endian"),
    (np.ones((10, 10), dtype=np.float32)[:, ::2], "C-contiguous"),
    ([1.0, 2.0], "numpy array"),
])
def test_packetize_rejects_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        packetize(bad, _meta(), POLICY)


def test_packetize_rejects_priority_outside_policy():
    with pytest.raises(ValueError, match="priority 5"):
        packetize(np.ones(3, np.float32), _meta(priority=5), Policy(num_priorities=4, priority_map=(0, 1, 2, 3)))
    with pytest.raises(ValueError, match="MessageMeta.layer"):
        MessageMeta(job_id=1, message_id=1, layer=1 << 16)
