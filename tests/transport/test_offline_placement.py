"""Placement of datagrams in memory by the compiled data path's own code
(:class:`dlcp.hostagent.datapath.offline.Placement`: the demo's and the packetizer benchmark's)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from dlcp.hostagent import wire
from dlcp.hostagent.datapath.offline import Placement
from dlcp.hostagent.packetizer import MessageMeta, packetize
from dlcp.hostagent.policy import Policy


def _batch(n: int, dtype, message_id: int = 1, sender: int = 0):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32).astype(dtype)
    return x, packetize(x, MessageMeta(job_id=1, message_id=message_id, sender_rank=sender), Policy())


@pytest.mark.parametrize("protection", [0, 1, 2], ids=["none", "mac", "encrypt"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16"])
def test_shuffled_datagrams_with_some_lost_are_placed_by_offset_the_rest_zero(protection, dtype):
    if dtype == "bfloat16":
        dtype = wire.NUMPY_DTYPES[wire.Dtype.BFLOAT16]
    x, batch = _batch(50_001, dtype)
    place = Placement(job_id=1, protection=protection)
    rows, lengths = place.rows(batch)
    msg = place.expect(1, batch)
    kept = np.arange(len(batch)) % 7 != 2
    order = np.random.default_rng(0).permutation(np.flatnonzero(kept))
    assert not place.ingest(rows[order], lengths[order]).any()
    per = batch.elems_per_packet
    expected = np.where(np.repeat(kept, per)[: x.size], x, np.zeros_like(x))
    np.testing.assert_array_equal(msg.out.view(np.uint16 if x.itemsize == 2 else np.uint32),
                                  expected.view(np.uint16 if x.itemsize == 2 else np.uint32))
    assert (msg.received == kept).all()
    lost_elems = int(batch.headers["elem_count"][~kept].astype(np.int64).sum())
    assert msg.lost_fraction == pytest.approx(lost_elems / x.size)
    assert rows.flags.c_contiguous and (rows[0, : wire.HEADER_SIZE] == batch.headers[:1].view(np.uint8)).all()


def test_a_duplicate_is_ignored_and_a_forgery_rejected_by_reason():
    _, batch = _batch(10_000, np.float32)
    place = Placement(job_id=1, protection=1)
    rows, lengths = place.rows(batch)
    msg = place.expect(1, batch)
    assert not place.ingest(rows[:3], lengths[:3]).any()
    forged = rows[3:4].copy()
    forged[0, wire.HEADER_SIZE] ^= 1  # one payload bit
    replay = place.ingest(rows[:1], lengths[:1])
    bad = place.ingest(forged, lengths[3:4])
    assert replay[0] and bad[0] and place.rejected() == {"replay": 1, "bad_mac": 1}
    assert msg.received.sum() == 3


def test_the_buffers_outlive_what_expect_returned_and_a_message_is_expected_once():
    """The compiled path writes into the message's buffers: dropping what expect() returned
    must not free them (this crashed the first version of calibrate())."""
    x, batch = _batch(20_000, np.float32)
    place = Placement(job_id=1)
    rows, lengths = place.rows(batch)
    place.expect(1, batch)
    gc.collect()
    assert not place.ingest(rows[:-1], lengths[:-1]).any()
    with pytest.raises(ValueError, match="already expected"):  # (not complete: one packet to come)
        place.expect(1, batch)
    assert not place.ingest(rows[-1:], lengths[-1:]).any()
    again = place.expect(1, batch)  # complete: the id may be used anew
    assert not again.received.any()
    with pytest.raises(ValueError, match="C-contiguous array of 20000 float32"):
        place.expect(2, batch, out=np.zeros(10, np.float32))
