"""The DLCP header: one field table, numpy and struct views agree, scapy dissects it."""

import numpy as np
import pytest

from dlcp.hostagent import wire


def test_header_is_byte_aligned_and_fixed_size():
    assert all(f.bits % 8 == 0 for f in wire.FIELDS)
    assert wire.HEADER_SIZE == sum(f.bits for f in wire.FIELDS) // 8
    assert len({f.name for f in wire.FIELDS}) == len(wire.FIELDS)


def test_single_header_round_trip():
    h = wire.Header(ptype=wire.PacketType.BITMAP, job_id=0xDEADBEEF, message_id=123456,
                    flags=wire.Flags.RETX | wire.Flags.ECN_ECHO,
                    priority=7, drop_class=3, dtype=wire.Dtype.FLOAT16, sender_rank=65535, iteration=9,
                    tensor_id=77, layer=12, elem_count=358, seq=5, total_pkts=6, elem_offset=1790)
    raw = wire.pack_header(h)
    assert len(raw) == wire.HEADER_SIZE
    assert wire.unpack_header(raw) == h


def test_network_byte_order():
    raw = wire.pack_header(wire.Header(ptype=wire.PacketType.DATA, job_id=0x01020304, message_id=0))
    off = sum(f.bits for f in wire.FIELDS[: [f.name for f in wire.FIELDS].index("job_id")]) // 8
    assert raw[off : off + 4] == b"\x01\x02\x03\x04"


def test_batch_encode_matches_single_pack():
    n = 5
    arr = wire.encode_headers(n, ptype=wire.PacketType.DATA, job_id=9, message_id=4, seq=np.arange(n),
                              elem_offset=np.arange(n) * 10, elem_count=10, total_pkts=n)
    for i in range(n):
        single = wire.pack_header(wire.Header(ptype=wire.PacketType.DATA, job_id=9, message_id=4, seq=i,
                                              elem_offset=i * 10, elem_count=10, total_pkts=n))
        assert arr[i].tobytes() == single
    back = wire.decode_headers(arr.tobytes())
    assert back["seq"].tolist() == list(range(n))


@pytest.mark.parametrize("field,value", [("priority", 256), ("sender_rank", 1 << 16), ("seq", -1)])
def test_out_of_range_fields_are_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        wire.encode_headers(1, **{field: value})
    with pytest.raises(ValueError, match=field):
        wire.Header(ptype=wire.PacketType.DATA, job_id=1, message_id=1, **{field: value})


def test_unknown_field_is_rejected():
    with pytest.raises(ValueError, match="unknown header fields"):
        wire.encode_headers(1, prio=1)


@pytest.mark.parametrize("mutate,reason", [
    (lambda b: b[:10], "truncated"),
    (lambda b: bytes([9]) + b[1:], "bad_version"),
    (lambda b: b[:1] + bytes([99]) + b[2:], "bad_ptype"),
    (lambda b: b[:5] + bytes([42]) + b[6:], "bad_dtype"),
])
def test_unpack_rejects_malformed(mutate, reason):
    raw = wire.pack_header(wire.Header(ptype=wire.PacketType.STOP, job_id=1, message_id=1))
    with pytest.raises(wire.MalformedHeader) as exc:
        wire.unpack_header(mutate(raw))
    assert exc.value.reason == reason


def test_dtype_codes():
    assert wire.dtype_code(np.float32) is wire.Dtype.FLOAT32
    assert wire.dtype_code(np.dtype(">f2")) is wire.Dtype.FLOAT16
    with pytest.raises(ValueError, match="not supported"):
        wire.dtype_code(np.float64)


def test_scapy_dissects_an_encoded_packet():
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether
    from scapy.packet import Raw

    from dlcp.hostagent.packetizer import MessageMeta, packetize
    from dlcp.hostagent.policy import Policy
    from dlcp.hostagent.scapy_layer import DLCP

    data = np.arange(400, dtype=np.float32)
    batch = packetize(data, MessageMeta(job_id=3, message_id=11, sender_rank=2, layer=4, priority=6, tensor_id=8),
                      Policy())
    frame = bytes(Ether() / IP(dst="10.0.0.2") / UDP(sport=5000, dport=wire.DLCP_UDP_PORT) / Raw(batch.datagram(1)))
    pkt = Ether(frame)
    assert DLCP in pkt
    d = pkt[DLCP]
    fields = (d.version, d.job_id, d.message_id, d.sender_rank, d.layer, d.priority, d.tensor_id)
    assert fields == (wire.VERSION, 3, 11, 2, 4, 6, 8)
    assert d.ptype == wire.PacketType.DATA and d.seq == 1 and d.total_pkts == 2
    assert d.elem_offset == batch.elems_per_packet and d.elem_count == 400 - batch.elems_per_packet
    payload = np.frombuffer(bytes(d.payload), dtype="<f4")
    np.testing.assert_array_equal(payload, data[batch.elems_per_packet:])
    # and scapy builds the same bytes back from the named fields
    assert bytes(DLCP(**{f.name: getattr(d, f.name) for f in wire.FIELDS})) == batch.datagram(1)[: wire.HEADER_SIZE]
