"""Fusion plans, layouts, run-time packing, and per-packet tags of fused messages."""

from __future__ import annotations

import numpy as np
import pytest

from dlcp.hostagent import wire
from dlcp.hostagent.fusion import Bucketer, FusionConfig, Layout, plan_buckets
from dlcp.hostagent.packetizer import MessageMeta, elems_per_packet, packetize
from dlcp.hostagent.policy import Policy, packet_tags


def _reference_tags(starts, prios, layers, total, per):
    """Per-element brute force: a packet takes the max priority and min layer of its elements."""
    starts = list(starts) + [total]
    elem_p = np.zeros(total, np.int64)
    elem_l = np.zeros(total, np.int64)
    for i in range(len(prios)):
        elem_p[starts[i] : starts[i + 1]] = prios[i]
        elem_l[starts[i] : starts[i + 1]] = layers[i]
    n = -(-total // per)
    return (np.array([elem_p[i * per : (i + 1) * per].max() for i in range(n)]),
            np.array([elem_l[i * per : (i + 1) * per].min() for i in range(n)]))


def test_packet_tags_by_hand():
    # segments [0,5) p7 L0 and [5,10) p2 L1, packets of 4: [0,4) [4,8) [8,10)
    p, layer = packet_tags([0, 5], [7, 2], [0, 1], 10, 4)
    assert p.tolist() == [7, 7, 2] and layer.tolist() == [0, 0, 1]
    # a packet that holds one element of an urgent layer takes that layer's priority
    p, _ = packet_tags([0, 7], [1, 6], [5, 4], 12, 4)
    assert p.tolist() == [1, 6, 6]


@pytest.mark.parametrize("seed", range(5))
def test_packet_tags_match_a_per_element_reference(seed):
    rng = np.random.default_rng(seed)
    total, per = int(rng.integers(1, 3000)), int(rng.integers(1, 400))
    cuts = np.sort(rng.integers(0, total, size=int(rng.integers(0, 30))))
    starts = np.concatenate([[0], cuts])  # repeats make empty segments, which must not count
    prios = rng.integers(0, 8, size=len(starts))
    layers = rng.integers(0, 200, size=len(starts))
    got_p, got_l = packet_tags(starts, prios, layers, total, per)
    sizes = np.diff(np.append(starts, total))
    ne = sizes > 0
    ref_p, ref_l = _reference_tags(starts[ne], prios[ne], layers[ne], total, per)
    np.testing.assert_array_equal(got_p, ref_p)
    np.testing.assert_array_equal(got_l, ref_l)


def test_packet_tags_reject_bad_segments():
    with pytest.raises(ValueError, match="ascend from 0"):
        packet_tags([1, 5], [1, 1], [0, 0], 10, 4)
    with pytest.raises(ValueError, match="ascend from 0"):
        packet_tags([0, 6, 5], [1, 1, 1], [0, 0, 0], 10, 4)
    with pytest.raises(ValueError, match="differ in length"):
        packet_tags([0, 5], [1], [0, 0], 10, 4)


def test_plan_follows_ddp_caps_in_ready_order():
    # 4-byte elements; first cap 16 B, then 40 B. Ready order is backward: 5, 4, 3, 2, 1, 0.
    sizes = [1, 2, 3, 20, 2, 2]
    cfg = FusionConfig(bucket_bytes=40, first_bucket_bytes=16)
    plan = plan_buckets(sizes, [7, 6, 5, 4, 3, 2], config=cfg)
    assert [b.tensors for b in plan] == [(5, 4), (3,), (2, 1, 0)]  # a tensor above the cap is alone
    assert plan[0].offsets == (0, 2) and plan[0].total == 4
    assert [b.layout.top_priority for b in plan] == [3, 4, 7]
    assert sorted(t for b in plan for t in b.tensors) == list(range(len(sizes)))


def test_plan_without_fusion_is_one_message_per_tensor_and_custom_order():
    plan = plan_buckets([3, 3, 3], [2, 1, 0], config=FusionConfig(enabled=False))
    assert [b.tensors for b in plan] == [(2,), (1,), (0,)]
    plan = plan_buckets([3, 3, 3], [2, 1, 0], ready_order=[0, 2, 1], config=FusionConfig(enabled=False))
    assert [b.tensors for b in plan] == [(0,), (2,), (1,)]
    with pytest.raises(ValueError, match="every tensor"):
        plan_buckets([3, 3], [1, 0], ready_order=[0, 0])


def test_scaled_caps_have_a_floor():
    cfg = FusionConfig().scaled(0.002, min_bytes=8 * 1432)
    assert cfg.first_bucket_bytes == 8 * 1432  # 1 MB * 0.002 is below the floor
    assert cfg.bucket_bytes == round(25 * 1024 * 1024 * 0.002)
    with pytest.raises(ValueError):
        FusionConfig(bucket_bytes=0)


def test_layout_slice_tags_equal_the_whole_messages_tags_on_the_same_elements():
    lay = Layout.of_sizes([10, 3, 50, 7], [7, 5, 2, 0], [0, 1, 2, 3])
    per = 5
    whole_p, _ = lay.packet_tags(per)
    part = lay.slice(10, 60)  # starts on a packet boundary of the whole
    part_p, part_l = part.packet_tags(per)
    np.testing.assert_array_equal(part_p, whole_p[2:12])
    assert part.total == 50 and part_l[0] == 1
    assert lay.slice(20, 20).total == 0
    with pytest.raises(ValueError):
        lay.slice(5, 100)


def test_a_layouts_slices_and_tags_are_computed_once_and_cannot_be_changed_by_a_caller():
    lay = Layout.of_sizes([10, 30, 20], [7, 3, 5], [0, 1, 2])
    chunk = lay.slice(5, 45)
    assert lay.slice(5, 45) is chunk  # the ring asks for the same chunks every iteration
    prio, layers = chunk.packet_tags(8)
    assert chunk.packet_tags(8)[0] is prio
    np.testing.assert_array_equal(prio, _reference_tags(chunk.starts, chunk.priorities, chunk.layers, 40, 8)[0])
    with pytest.raises(ValueError, match="read-only"):
        prio[0] = 0
    assert chunk.packet_tags(16)[0].size == 3  # another cut is another entry


def test_bucketer_packs_completes_and_unpacks():
    sizes = [2, 3, 4]
    plan = plan_buckets(sizes, [2, 1, 0], config=FusionConfig(bucket_bytes=1 << 20, first_bucket_bytes=4 * 3))
    b = Bucketer(plan)
    grads = [np.arange(n, dtype=np.float32) + 10 * t for t, n in enumerate(sizes)]
    assert [x.tensors for x in plan] == [(2,), (1, 0)]
    done = b.add(2, grads[2])
    assert len(done) == 1 and done[0][0].index == 0
    assert b.add(0, grads[0]) == []  # its bucket still waits for tensor 1
    (bucket, flat), = b.add(1, grads[1].reshape(3, 1))
    parts = b.unpack(bucket, flat)
    np.testing.assert_array_equal(parts[0], grads[0])
    np.testing.assert_array_equal(parts[1], grads[1])
    with pytest.raises(ValueError, match="twice"):
        b.add(1, grads[1])
    b.reset()
    with pytest.raises(ValueError, match="elements"):
        b.add(1, np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="no bucket"):
        b.add(9, grads[0])


def test_packetize_tags_each_packet_and_out_message_sends_urgent_packets_first():
    per = elems_per_packet(1500, np.float32)
    data = np.arange(per * 5, dtype=np.float32)
    lay = Layout.of_sizes([per * 3 + 10, per * 2 - 10], [1, 6], [4, 2])  # tensor 1 is more urgent
    prio, layers = lay.packet_tags(per)
    batch = packetize(data, MessageMeta(job_id=1, message_id=2, priority=6), Policy(), packet_priorities=prio,
                      packet_layers=layers)
    assert batch.headers["priority"].tolist() == [1, 1, 1, 6, 6]
    assert batch.headers["layer"].tolist() == [4, 4, 4, 2, 2]
    with pytest.raises(ValueError, match="shape"):
        packetize(data, MessageMeta(job_id=1, message_id=2), Policy(), packet_priorities=prio[:3])
    with pytest.raises(ValueError, match="outside"):
        packetize(data, MessageMeta(job_id=1, message_id=2), Policy(num_priorities=4, priority_map=(0, 1, 2, 3)),
                  packet_priorities=prio)


def test_control_records_batch_and_reject_malformed_batches():
    recs = [wire.pack_record(wire.Header(wire.PacketType.STOP, job_id=1, message_id=i), b"\0\0\0\1") for i in range(3)]
    frame = wire.pack_records(recs, job_id=1, sender_rank=2)
    header, body = wire.split_frame(frame[wire.FRAME_PREFIX.size :])
    assert header.ptype == wire.PacketType.BATCH
    assert [wire.split_frame(r)[0].message_id for r in wire.split_batch(body)] == [0, 1, 2]
    single = wire.pack_records(recs[:1], job_id=1, sender_rank=2)
    assert wire.split_frame(single[wire.FRAME_PREFIX.size :])[0].ptype == wire.PacketType.STOP
    with pytest.raises(wire.MalformedHeader, match="bad_batch"):
        wire.split_batch(body[:-3])
    with pytest.raises(wire.MalformedHeader, match="bad_batch"):
        wire.split_batch(wire.RECORD_PREFIX.pack(5) + b"12345")


def test_a_layout_is_uniform_only_when_one_segment_carries_the_messages_own_tags():
    """A uniform layout needs no per-packet arrays: the message's priority and layer tag every
    packet. Anything else (two segments, another priority or layer) keeps the arrays."""
    one = Layout.single(1000, 5, 3)
    assert one.uniform(5, 3) and one.uniform(5, 3 + 65536)  # (the header's layer is 16 bits)
    assert not one.uniform(4, 3) and not one.uniform(5, 2)
    two = Layout.of_sizes([500, 500], [5, 5], [3, 3])
    assert not two.uniform(5, 3)
    assert two.slice(0, 400).uniform(5, 3)  # a chunk inside one segment
