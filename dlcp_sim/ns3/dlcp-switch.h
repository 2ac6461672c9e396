// The switches, below IP: a port queue with DLCP's admission rule and a leaf-spine forwarder.
//
// Why below IP: a switch here only picks an output port and queues; modelling it as an ns-3
// IP router (a full Ipv4L3Protocol, a routing lookup, TTL rewrite and a traffic-control queue
// disc feeding a one-packet device queue through a scheduled wake-up per packet) cost most of
// the simulator's time per packet. Hosts keep ns-3's whole IP, UDP and TCP stack; switches
// receive a frame from a point-to-point device, read the IPv4 header's addresses (and the
// transport ports, for flow hashing) from the bytes and hand the packet to the output
// device, whose queue is a DlcpPortQueue.
//
// DlcpPortQueue is the device's own transmit queue, so the port serves exactly the packets
// waiting in it, strictly by band, at the link's rate. (BMv2 models a port of capacity R with
// a virtual queue in registers beside rate-limited real queues; here the port is the link.)
#pragma once

#include <algorithm>
#include <array>
#include <memory>
#include <vector>

#include "dlcp-port.h"
#include "dlcp-tag.h"
#include "ns3/abort.h"
#include "ns3/ipv4-header.h"
#include "ns3/ipv4-l3-protocol.h"
#include "ns3/net-device.h"
#include "ns3/node.h"
#include "ns3/ppp-header.h"
#include "ns3/queue.h"
#include "ns3/random-variable-stream.h"

namespace ns3 {

//! A port's transmit queue: DLCP's admission rule (dlcp-port.h), strict priority by band. One
//! list ordered by band, highest first, FIFO within a band, so the device always takes the
//! front; m_last[b] is the last packet of band b while band b holds any.
class DlcpPortQueue : public Queue<Packet> {
 public:
  static TypeId GetTypeId() {
    static TypeId tid = TypeId("ns3::DlcpPortQueue").SetParent<Queue<Packet>>().AddConstructor<DlcpPortQueue>();
    return tid;
  }

  DlcpPortPolicy policy;
  DlcpPortStats stats;

  bool Enqueue(Ptr<Packet> p) override {
    DlcpTag tag;
    bool dlcp = p->PeekPacketTag(tag);
    PortDecision d = DecideAdmission(policy, m_count, tag.priority, tag.dropClass);
    if (d.admission != Admission::ENQUEUE) {
      if (d.admission == Admission::TAIL_DROP)
        stats.tailDrops++;
      else
        stats.selectiveDrops[tag.dropClass & 7]++;
      DropBeforeEnqueue(p);
      return false;
    }
    if (d.mark && (dlcp ? MarkTag(p, tag) : MarkIp(p))) stats.marks++;
    // Insert after the last packet of the nearest band at or above this one (or at the front).
    ConstIterator pos = GetContainer().begin();
    for (int b = d.band; b <= 7; ++b)
      if (m_count[b] > 0) {
        pos = std::next(m_last[b]);
        break;
      }
    Iterator at;
    if (!DoEnqueue(pos, p, at)) return false;  // MaxSize is set far above any buffer
    m_last[d.band] = at;
    m_count[d.band]++;
    stats.enqueued++;
    stats.enqueuedByBand[d.band]++;
    if (GetNPackets() > stats.maxDepth) stats.maxDepth = GetNPackets();
    return true;
  }

  Ptr<Packet> Dequeue() override { return Take(false); }
  Ptr<Packet> Remove() override { return Take(true); }  // ns-3's Remove drops (counted as such)
  Ptr<const Packet> Peek() const override { return DoPeek(GetContainer().begin()); }

 private:
  std::array<uint32_t, 8> m_count{};
  std::array<Iterator, 8> m_last{};  // valid while m_count of its band is above 0

  Ptr<Packet> Take(bool drop) {
    if (GetContainer().empty()) return nullptr;
    // The front belongs to the highest band that holds packets.
    int b = 7;
    while (m_count[b] == 0) --b;
    m_count[b]--;
    Ptr<Packet> p = drop ? DoRemove(GetContainer().begin()) : DoDequeue(GetContainer().begin());
    DlcpTag tag;
    p->PeekPacketTag(tag);  // the invariant, checked on every packet: the front is of band b
    NS_ABORT_MSG_IF(policy.priorityMap[tag.priority & 7] != b, "DlcpPortQueue: a packet left out of band order");
    return p;
  }

  static bool MarkTag(Ptr<Packet> p, DlcpTag tag) {
    tag.ce = 1;
    p->ReplacePacketTag(tag);
    return true;
  }

  //! Marks CE in the IPv4 header of an ECN-capable packet (ECT(0) or ECT(1)), as
  //! Ipv4QueueDiscItem::Mark does; the frame carries the point-to-point header in front of it.
  static bool MarkIp(Ptr<Packet> p) {
    PppHeader ppp;
    Ipv4Header ip;
    p->RemoveHeader(ppp);
    p->RemoveHeader(ip);
    bool capable = ip.GetEcn() == Ipv4Header::ECN_ECT0 || ip.GetEcn() == Ipv4Header::ECN_ECT1;
    if (capable) ip.SetEcn(Ipv4Header::ECN_CE);
    p->AddHeader(ip);
    p->AddHeader(ppp);
    return capable;
  }
};

struct SwitchRole {
  enum Kind { LEAF, SPINE } kind = LEAF;
  uint32_t index = 0;  // the leaf's or the spine's number
};

enum class LbMode { FLOW, ROUND_ROBIN, RANDOM };

//! Forwarding in a two-tier leaf-spine by address arithmetic. Host j of leaf l is 10.l.j.2
//! (main.cc numbers them). A leaf sends a packet for 10.L.J.2 down to host J when L is itself
//! and otherwise up to a spine; a spine sends it down to leaf L. The one choice is the spine,
//! and it is the policy's load balancing (Policy.lb_mode, as p4/include/control/spray.p4):
//!   - "flow": a hash of the 5-tuple (per-flow ECMP, the baseline);
//!   - "round_robin" / "random": per packet, for DLCP packets (the DlcpTag); others by flow.
class LeafSpineSwitch : public SimpleRefCount<LeafSpineSwitch> {
 public:
  //! `down`: a leaf's ports to its hosts (by place) or a spine's ports to the leaves (by
  //! number); `up`: a leaf's ports to the spines (by number), none on a spine.
  //! `padTo`: pad every packet a leaf sends up to this many bytes (0: never), so a 40-byte ACK
  //! costs an uplink as much as a full packet, as on BMv2 ports limited in packets per second;
  //! the receiving host's IP layer trims the padding. `padBy`, `padMin`: pad it by so many bytes,
  //! to at least so many (an Ethernet frame's cost on the wire, on ports with a rate in bits).
  LeafSpineSwitch(Ptr<Node> node, SwitchRole role, std::vector<Ptr<NetDevice>> down,
                  std::vector<Ptr<NetDevice>> up, LbMode lb, uint32_t salt, uint32_t padTo = 0,
                  uint32_t padBy = 0, uint32_t padMin = 0)
      : m_role(role), m_down(std::move(down)), m_up(std::move(up)), m_lb(lb), m_salt(salt),
        m_rr(m_up.empty() ? 0 : salt % m_up.size()), m_padTo(padTo), m_padBy(padBy), m_padMin(padMin) {
    m_rand = CreateObject<UniformRandomVariable>();
    node->RegisterProtocolHandler(MakeCallback(&LeafSpineSwitch::Receive, this), Ipv4L3Protocol::PROT_NUMBER,
                                  nullptr);
  }

  uint64_t unroutable = 0;  // packets for an address that is no host's (never expected)

 private:
  SwitchRole m_role;
  std::vector<Ptr<NetDevice>> m_down, m_up;
  LbMode m_lb;
  uint32_t m_salt, m_rr, m_padTo, m_padBy, m_padMin;
  Ptr<UniformRandomVariable> m_rand;

  void Receive(Ptr<NetDevice>, Ptr<const Packet> frame, uint16_t protocol, const Address&, const Address&,
               NetDevice::PacketType) {
    uint8_t h[24];  // the IPv4 header (20 bytes: ns-3 sets no options) and the transport ports
    uint32_t got = frame->CopyData(h, sizeof h);
    if (got < 20 || h[16] != 10 || h[19] != 2) {  // not an IPv4 packet for a host 10.l.j.2
      unroutable++;
      return;
    }
    uint32_t L = h[17], J = h[18];
    Ptr<NetDevice> out;
    bool up = false;
    if (m_role.kind == SwitchRole::SPINE)
      out = L < m_down.size() ? m_down[L] : nullptr;
    else if (L == m_role.index)
      out = J < m_down.size() ? m_down[J] : nullptr;
    else
      out = m_up[PickSpine(frame, h, got)], up = true;
    if (!out) {
      unroutable++;
      return;
    }
    Ptr<Packet> copy = frame->Copy();
    if (up) {
      uint32_t size = copy->GetSize();
      uint32_t want = std::max(std::max(size + m_padBy, m_padMin), m_padTo);
      if (want > size) copy->AddPaddingAtEnd(want - size);
    }
    out->Send(copy, out->GetBroadcast(), protocol);
  }

  uint32_t PickSpine(Ptr<const Packet> p, const uint8_t* h, uint32_t got) {
    uint32_t spines = m_up.size();
    if (m_lb != LbMode::FLOW) {
      DlcpTag tag;
      if (p->PeekPacketTag(tag)) {
        if (m_lb == LbMode::ROUND_ROBIN) return m_rr = (m_rr + 1) % spines;
        return m_rand->GetInteger(0, spines - 1);
      }
    }
    auto be32 = [](const uint8_t* b) { return uint32_t(b[0]) << 24 | uint32_t(b[1]) << 16 | uint32_t(b[2]) << 8 | b[3]; };
    uint64_t ports = got >= 24 ? be32(h + 20) : 0;
    uint64_t k = (uint64_t(be32(h + 12)) << 32) ^ be32(h + 16);
    k ^= ports * 0x9E3779B97F4A7C15ull;
    k ^= uint64_t(h[9]) << 40 ^ m_salt;
    // splitmix64's finalizer: every key bit moves every result bit. (A single multiply here
    // put two flows that differ in one address bit on one spine a third of the time, not
    // half, and in the validation setup never collided a server's two pulls in 8 seeds.)
    k ^= k >> 30;
    k *= 0xbf58476d1ce4e5b9ull;
    k ^= k >> 27;
    k *= 0x94d049bb133111ebull;
    k ^= k >> 31;
    return uint32_t(k % spines);
  }
};

}  // namespace ns3
