// A port's admission rule, as the P4 program applies it (p4/include/control/*.p4): one pure
// function, used by every port's queue (DlcpPortQueue in dlcp-switch.h: switch ports and
// hosts' NICs).
//
// A packet's fate is decided against the backlog *ahead of it*, the packets at its band and
// above, exactly as the P4 virtual queue computes depth_ahead:
//   - ahead >= buffer: tail drop, whatever the class;
//   - class c >= 1 and ahead > drop_thresholds[c-1]: selective drop;
//   - marked CE when the backlog the policy's ecn_backlog names exceeds ecn_threshold: the
//     backlog ahead (the default, as EcnMark's mark_on_backlog_ahead), or the port's whole
//     backlog, every band (ecnOnPort, mark_on_port_backlog).
// Strict priority over up to 8 bands: band = policy.priority_map[priority], the higher band
// first (BMv2's order); a baseline whose map is all zeros is one FIFO.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

namespace ns3 {

struct DlcpPortPolicy {
  std::array<uint8_t, 8> priorityMap{0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<uint32_t> dropThresholds;  // one per droppable class (1, 2, ...)
  uint32_t ecnThreshold = UINT32_MAX;
  bool ecnOnPort = false;  // ECN on the port's whole backlog, not only the backlog ahead
  uint32_t buffer = 1000;  // packets ahead at which everything is dropped
};

struct DlcpPortStats {
  uint64_t enqueued = 0, tailDrops = 0, marks = 0, maxDepth = 0;
  std::array<uint64_t, 8> selectiveDrops{};  // by drop class
  std::array<uint64_t, 8> enqueuedByBand{};
};

enum class Admission { ENQUEUE, TAIL_DROP, SELECTIVE_DROP };

struct PortDecision {
  Admission admission;
  uint8_t band;
  bool mark;  // mark CE (only meaningful with ENQUEUE)
};

//! What a port does with a packet of `priority` and `dropClass` (0..7; untagged traffic is 0
//! and 0), given how many packets wait in each band.
inline PortDecision DecideAdmission(const DlcpPortPolicy& policy, const std::array<uint32_t, 8>& bandPackets,
                                    uint8_t priority, uint8_t dropClass) {
  uint8_t band = policy.priorityMap[priority & 7];
  uint32_t ahead = 0, port = 0;
  for (int b = 7; b >= 0; --b) {
    port += bandPackets[b];
    if (b == band) ahead = port;
  }
  if (ahead >= policy.buffer) return {Admission::TAIL_DROP, band, false};
  if (dropClass >= 1 && dropClass <= policy.dropThresholds.size() && ahead > policy.dropThresholds[dropClass - 1])
    return {Admission::SELECTIVE_DROP, band, false};
  return {Admission::ENQUEUE, band, (policy.ecnOnPort ? port : ahead) > policy.ecnThreshold};
}

}  // namespace ns3
