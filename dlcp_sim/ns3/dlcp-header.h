// DlcpHeader: the fields of hostagent/wire.py that the simulated transport acts on.
//
// Not the byte layout of the real header (which main.cc pads to, so datagrams have the real
// size): the simulator needs the message, sequence and control fields, not the tensor id or
// offset, since no tensor is reassembled here.
#pragma once

#include "ns3/header.h"

namespace ns3 {

enum DlcpType : uint8_t { DATA = 0, PROBE = 1, BITMAP = 2, STOP = 3, FEEDBACK = 4 };
//! `flags` bits: LAST on the last data packets of a pass (wire.Flags.LAST); RIDING on a STOP or
//! BITMAP that carries a congestion report (seq: packets received, aux2: marked), as the agent's
//! report rides in the same control frame as the record it goes with. AT_LINE on a FEEDBACK of msg
//! LINE_RATE_MSG from a sender to its receiver: its rate is at its line rate (clear: below again),
//! as wire.Flags.AT_LINE_RATE on the agent's FEEDBACK of id LINE_RATE.
enum DlcpFlag : uint8_t { FLAG_LAST = 1, FLAG_RIDING = 2, FLAG_AT_LINE = 4 };
constexpr uint32_t LINE_RATE_MSG = 3;  // dlcp.hostagent.protocol.core.LINE_RATE

class DlcpHeader : public Header {
 public:
  uint8_t type = DATA;
  uint8_t priority = 0, dropClass = 0, flags = 0;
  uint16_t src = 0, dst = 0;
  uint32_t msg = 0, seq = 0, npkts = 0;
  uint32_t aux = 0;   // DATA/PROBE: loss bound in ppm; BITMAP: snapshot id; FEEDBACK: packets received
  uint32_t aux2 = 0;  // FEEDBACK (or RIDING): packets marked CE

  static constexpr uint32_t SIZE = 28;

  static TypeId GetTypeId() {
    static TypeId tid = TypeId("ns3::DlcpHeader").SetParent<Header>().AddConstructor<DlcpHeader>();
    return tid;
  }
  TypeId GetInstanceTypeId() const override { return GetTypeId(); }
  uint32_t GetSerializedSize() const override { return SIZE; }
  void Serialize(Buffer::Iterator i) const override {
    i.WriteU8(type);
    i.WriteU8(priority);
    i.WriteU8(dropClass);
    i.WriteU8(flags);
    i.WriteHtonU16(src);
    i.WriteHtonU16(dst);
    i.WriteHtonU32(msg);
    i.WriteHtonU32(seq);
    i.WriteHtonU32(npkts);
    i.WriteHtonU32(aux);
    i.WriteHtonU32(aux2);
  }
  uint32_t Deserialize(Buffer::Iterator i) override {
    type = i.ReadU8();
    priority = i.ReadU8();
    dropClass = i.ReadU8();
    flags = i.ReadU8();
    src = i.ReadNtohU16();
    dst = i.ReadNtohU16();
    msg = i.ReadNtohU32();
    seq = i.ReadNtohU32();
    npkts = i.ReadNtohU32();
    aux = i.ReadNtohU32();
    aux2 = i.ReadNtohU32();
    return SIZE;
  }
  void Print(std::ostream& os) const override {
    os << "type=" << int(type) << " msg=" << msg << " seq=" << seq << "/" << npkts;
  }
};

}  // namespace ns3
