"""A scapy dissector for the DLCP header, derived from :data:`dlcp.hostagent.wire.FIELDS`.

For tests, captures and debugging only: scapy builds a Python object per packet and is
far too slow for the data path (the packetizer and reassembler use numpy).

Example::

    from scapy.all import Ether, IP, UDP
    from dlcp.hostagent.scapy_layer import DLCP
    pkt = Ether(raw_bytes)          # a captured frame
    pkt[DLCP].seq, pkt[DLCP].drop_class
"""

from __future__ import annotations

from scapy.fields import ByteEnumField, ByteField, FlagsField, IntField, ShortField
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_layers

from dlcp.hostagent import wire

_BY_WIDTH = {8: ByteField, 16: ShortField, 32: IntField}


def _field(f: wire.Field):
    default = wire.VERSION if f.name == "version" else 0
    if f.name == "ptype":
        return ByteEnumField("ptype", int(wire.PacketType.DATA), {t.value: t.name for t in wire.PacketType})
    if f.name == "dtype":
        return ByteEnumField("dtype", 0, {t.value: t.name for t in wire.Dtype})
    if f.name == "flags":
        return FlagsField("flags", 0, 8, [str(fl.name) for fl in sorted(wire.Flags, key=int) if fl.value][:8])
    return _BY_WIDTH[f.bits](f.name, default)


class DLCP(Packet):
    """The DLCP header; the payload (gradient elements) follows as Raw."""

    name = "DLCP"
    fields_desc = [_field(f) for f in wire.FIELDS]


for _port in wire.dlcp_ports():  # every port of the block DLCP's switches parse
    bind_layers(UDP, DLCP, dport=_port)
