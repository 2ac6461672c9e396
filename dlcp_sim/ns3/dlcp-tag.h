// DlcpTag: what a DLCP data or control packet tells the switches.
//
// On the testbed the P4 program parses these fields from the DLCP header (hostagent/wire.py);
// here they ride as an ns-3 packet tag so a port's queue can read them without parsing the
// payload. A packet without the tag (TCP, background UDP) is priority 0 and drop class 0:
// served last under strict priority, never dropped selectively, tail-dropped when full.
#pragma once

#include "ns3/tag.h"

namespace ns3 {

class DlcpTag : public Tag {
 public:
  uint8_t priority = 0;   // 0..7, higher is served first (BMv2's order)
  uint8_t dropClass = 0;  // 0 is never dropped selectively; higher goes first
  uint8_t ce = 0;         // set by a switch above the ECN threshold

  static TypeId GetTypeId() {
    static TypeId tid = TypeId("ns3::DlcpTag").SetParent<Tag>().AddConstructor<DlcpTag>();
    return tid;
  }
  TypeId GetInstanceTypeId() const override { return GetTypeId(); }
  uint32_t GetSerializedSize() const override { return 3; }
  void Serialize(TagBuffer i) const override {
    i.WriteU8(priority);
    i.WriteU8(dropClass);
    i.WriteU8(ce);
  }
  void Deserialize(TagBuffer i) override {
    priority = i.ReadU8();
    dropClass = i.ReadU8();
    ce = i.ReadU8();
  }
  void Print(std::ostream& os) const override {
    os << "prio=" << int(priority) << " class=" << int(dropClass) << " ce=" << int(ce);
  }
};

}  // namespace ns3
