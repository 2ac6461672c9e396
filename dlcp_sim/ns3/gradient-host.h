// GradientHost: what a training job needs from a host's gradient transport, whichever it is.
//
// The jobs in main.cc (PsJob, RingJob) hand a host messages to send and learn when one arrived
// (onReceived) and when one of its own is done (onSent). DlcpHost (dlcp-host.h) is DLCP's
// transport and the reliable baseline over UDP; TcpGradHost (tcp-host.h) sends the same
// messages over TCP connections, the way gloo, NCCL's socket transport and BytePS do.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <numeric>
#include <ostream>
#include <vector>

#include "ns3/application.h"
#include "ns3/ipv4-address.h"

namespace ns3 {

//! The packets of one message: per-packet priority and drop class (from the Python side), and
//! how a sender ranks it and orders its packets, as the agent does (hostagent/native/tx.cc,
//! reorder_locked and send_order): the message by its own priority, its packets most urgent first.
struct MsgPlan {
  uint32_t npkts = 0;
  std::vector<uint8_t> priority, dropClass;
  uint8_t rank = 0;                 // the message's priority among a sender's messages (Order sets it)
  std::vector<uint32_t> sendOrder;  // its packets' sequence numbers as they leave (Order sets them)
  std::vector<uint32_t> position;   // each packet's place in sendOrder

  //! Rank the message by its most urgent packet (or `rank`, a ring's chunk: its bucket's most
  //! urgent, as RingAllreduce ranks it) and send its packets most urgent first, ties in sequence.
  void Order(int rankOverride = -1) {
    rank = rankOverride >= 0 ? uint8_t(rankOverride) : *std::max_element(priority.begin(), priority.end());
    sendOrder.resize(npkts);
    std::iota(sendOrder.begin(), sendOrder.end(), 0u);
    std::stable_sort(sendOrder.begin(), sendOrder.end(),
                     [this](uint32_t a, uint32_t b) { return priority[a] > priority[b]; });
    position.resize(npkts);
    for (uint32_t i = 0; i < npkts; ++i) position[sendOrder[i]] = i;
  }
};

//! One host's counters, printed on its `host` line (main.cc). A transport fills what it has.
struct HostStats {
  uint64_t dataSent = 0, retransmitted = 0, probes = 0, bitmaps = 0, stops = 0, feedbacks = 0, controlSent = 0,
           messagesSent = 0, messagesReceived = 0, missingAtCompletion = 0, packetsAtCompletion = 0;
  uint64_t duplicates = 0;  // data packets that arrived a second time while their message was incomplete
  uint64_t late = 0;        // data packets that arrived after their message had completed
  uint64_t reports = 0;     // FEEDBACK packets received on their own (not riding a STOP or BITMAP)
};

class GradientHost : public Application {
 public:
  uint16_t rank = 0;
  std::vector<Ipv4Address> peers;  // address of every rank
  HostStats stats;
  //! A message from `src` completed here.
  std::function<void(uint16_t src, uint32_t msg)> onReceived;
  //! A message this host sent to `dst` is done: its receiver has it.
  std::function<void(uint16_t dst, uint32_t msg)> onSent;
  //! Where completions are reported, one `done` line each (null: not reported).
  std::ostream* log = nullptr;

  //! Queue a message of `plan->npkts` packets for `dst`; at least (1 - lossBound) of them
  //! must arrive (a reliable transport ignores the bound). `chained`: the send was set up
  //! earlier and is released by a receive's completion inside the transport (a ring's next
  //! step), so it skips the host's software path (the agent releases held sends in its data
  //! path, gloo in its C++ loop).
  virtual void Send(uint16_t dst, uint32_t msg, const MsgPlan* plan, double lossBound, bool chained) = 0;
};

}  // namespace ns3
