// DlcpQueueDisc: a switch port as the P4 program builds it (p4/include/control/*.p4).
//
// Strict priority over up to 8 bands (band = policy.priority_map[priority]; a baseline whose
// map is all zeros is one FIFO). A packet's fate is decided against the backlog *ahead of it*,
// the packets at its band and above, exactly as the P4 virtual queue computes depth_ahead:
//   - ahead >= buffer: tail drop, whatever the class;
//   - class c >= 1 and ahead > drop_thresholds[c-1]: selective drop;
//   - ahead > ecn_threshold: mark CE (DlcpTag.ce for DLCP packets, the IP ECN field otherwise).
// One difference from the testbed: BMv2 models a port of capacity R with a virtual queue in
// registers beside rate-limited real queues; here the port is the link itself, so the wire
// never carries more than R.
#pragma once

#include <array>
#include <vector>

#include "dlcp-tag.h"
#include "ns3/drop-tail-queue.h"
#include "ns3/queue-disc.h"

namespace ns3 {

struct DlcpPortPolicy {
  std::array<uint8_t, 8> priorityMap{0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<uint32_t> dropThresholds;  // one per droppable class (1, 2, ...)
  uint32_t ecnThreshold = UINT32_MAX;
  uint32_t buffer = 1000;  // packets ahead at which everything is dropped
};

struct DlcpPortStats {
  uint64_t enqueued = 0, tailDrops = 0, marks = 0, maxDepth = 0;
  std::array<uint64_t, 8> selectiveDrops{};  // by drop class
  std::array<uint64_t, 8> enqueuedByBand{};
};

class DlcpQueueDisc : public QueueDisc {
 public:
  static TypeId GetTypeId() {
    static TypeId tid = TypeId("ns3::DlcpQueueDisc").SetParent<QueueDisc>().AddConstructor<DlcpQueueDisc>();
    return tid;
  }
  DlcpQueueDisc() : QueueDisc(QueueDiscSizePolicy::NO_LIMITS) {}

  DlcpPortPolicy policy;
  DlcpPortStats stats;

  uint32_t Depth() const { return GetNPackets(); }

 private:
  // One internal FIFO per band, so QueueDisc's own counters stay right. Plain pointers to them
  // (the QueueDisc owns them), because GetInternalQueue copies a smart pointer per call and
  // every packet asks up to eight bands at every port.
  std::array<InternalQueue*, 8> m_band{};
  uint32_t BandSize(int b) const { return m_band[b]->GetNPackets(); }

  bool DoEnqueue(Ptr<QueueDiscItem> item) override {
    DlcpTag tag;
    Ptr<Packet> p = item->GetPacket();
    bool dlcp = p->PeekPacketTag(tag);
    uint8_t band = policy.priorityMap[tag.priority & 7];
    uint32_t ahead = 0;
    for (int b = 7; b >= band; --b) ahead += BandSize(b);
    if (ahead >= policy.buffer) {
      stats.tailDrops++;
      DropBeforeEnqueue(item, "buffer full");
      return false;
    }
    if (tag.dropClass >= 1 && tag.dropClass <= policy.dropThresholds.size() &&
        ahead > policy.dropThresholds[tag.dropClass - 1]) {
      stats.selectiveDrops[tag.dropClass & 7]++;
      DropBeforeEnqueue(item, "selective drop");
      return false;
    }
    if (ahead > policy.ecnThreshold) {
      if (dlcp) {
        tag.ce = 1;
        p->ReplacePacketTag(tag);
        stats.marks++;
      } else if (item->Mark()) {
        stats.marks++;
      }
    }
    if (!m_band[band]->Enqueue(item)) return false;  // counted by the base class
    stats.enqueued++;
    stats.enqueuedByBand[band]++;
    if (GetNPackets() > stats.maxDepth) stats.maxDepth = GetNPackets();
    return true;
  }

  Ptr<QueueDiscItem> DoDequeue() override {
    for (int b = 7; b >= 0; --b)
      if (BandSize(b) > 0) return m_band[b]->Dequeue();
    return nullptr;
  }

  Ptr<const QueueDiscItem> DoPeek() override {
    for (int b = 7; b >= 0; --b)
      if (BandSize(b) > 0) return m_band[b]->Peek();
    return nullptr;
  }

  bool CheckConfig() override {
    if (GetNQueueDiscClasses() > 0 || GetNPacketFilters() > 0) return false;
    // The bands never refuse a packet themselves: admission is decided above, by depth ahead.
    while (GetNInternalQueues() < 8)
      AddInternalQueue(CreateObjectWithAttributes<DropTailQueue<QueueDiscItem>>(
          "MaxSize", QueueSizeValue(QueueSize(QueueSizeUnit::PACKETS, 1u << 24))));
    for (int b = 0; b < 8; ++b) m_band[b] = PeekPointer(GetInternalQueue(b));
    return true;
  }
  void InitializeParams() override {}
};

}  // namespace ns3
