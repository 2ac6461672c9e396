// LeafSpineRouting: forwarding in a two-tier leaf-spine, by address arithmetic.
//
// Addresses encode position (set by main.cc): host j of leaf l is 10.l.j.2 (its leaf's side
// 10.l.j.1); the link between leaf l and spine s is 11.s.l.0/24 (leaf .1, spine .2). So a leaf
// sends a packet for 10.L.J.2 down to host J when L is itself and otherwise up to a spine,
// and a spine sends it down to leaf L. The one choice is the spine, and it is the policy's
// load balancing (Policy.lb_mode, as in p4/include/control/spray.p4):
//   - "flow": a hash of the 5-tuple (per-flow ECMP, the baseline);
//   - "round_robin" / "random": per packet, for DLCP packets (the DlcpTag); others by flow.
#pragma once

#include <map>
#include <memory>
#include <unordered_map>

#include "dlcp-tag.h"
#include "ns3/ipv4-routing-helper.h"
#include "ns3/ipv4-routing-protocol.h"
#include "ns3/ipv4.h"
#include "ns3/random-variable-stream.h"

namespace ns3 {

struct LeafSpineRole {
  enum Kind { HOST, LEAF, SPINE } kind = HOST;
  uint32_t leaf = 0, index = 0;  // host: its leaf and place on it; leaf: its number; spine: its number
};

enum class LbMode { FLOW, ROUND_ROBIN, RANDOM };

class LeafSpineRouting : public Ipv4RoutingProtocol {
 public:
  static TypeId GetTypeId() {
    static TypeId tid = TypeId("ns3::LeafSpineRouting").SetParent<Ipv4RoutingProtocol>();
    return tid;
  }
  LeafSpineRouting(LeafSpineRole role, uint32_t spines, LbMode lb, uint32_t salt)
      : m_role(role), m_spines(spines), m_lb(lb), m_salt(salt), m_rr(salt % spines) {
    m_rand = CreateObject<UniformRandomVariable>();
  }

  Ptr<Ipv4Route> RouteOutput(Ptr<Packet> p, const Ipv4Header& header, Ptr<NetDevice> oif,
                             Socket::SocketErrno& err) override {
    // Only hosts originate traffic: everything leaves through their one link.
    uint8_t b[4];
    Ipv4Address leafSide = Addr(10, b, m_role.leaf, m_role.index, 1);
    err = Socket::ERROR_NOTERROR;
    return Route(header.GetDestination(), leafSide);
  }

  bool RouteInput(Ptr<const Packet> p, const Ipv4Header& header, Ptr<const NetDevice> idev,
                  const UnicastForwardCallback& ucb, const MulticastForwardCallback& mcb,
                  const LocalDeliverCallback& lcb, const ErrorCallback& ecb) override {
    Ipv4Address dst = header.GetDestination();
    // Switches own no host address (10.l.j.2), so only a host asks whether it is the target.
    if (m_role.kind == LeafSpineRole::HOST) {
      int32_t iface = m_ipv4->GetInterfaceForDevice(idev);
      if (m_ipv4->IsDestinationAddress(dst, iface)) {
        lcb(p, header, iface);
        return true;
      }
    }
    uint8_t d[4];
    dst.Serialize(d);
    if (d[0] != 10 || d[3] != 2) {
      ecb(p, header, Socket::ERROR_NOROUTETOHOST);
      return true;
    }
    uint8_t b[4];
    uint32_t L = d[1], J = d[2];
    Ptr<Ipv4Route> r;
    if (m_role.kind == LeafSpineRole::LEAF && L == m_role.index) {
      r = Route(dst, dst);
    } else if (m_role.kind == LeafSpineRole::LEAF) {
      uint32_t s = PickSpine(p, header);
      r = Route(dst, Addr(11, b, s, m_role.index, 2));
    } else if (m_role.kind == LeafSpineRole::SPINE) {
      r = Route(dst, Addr(11, b, m_role.index, L, 1));
    } else {
      ecb(p, header, Socket::ERROR_NOROUTETOHOST);
      return true;
    }
    (void)J;
    if (!r) {
      ecb(p, header, Socket::ERROR_NOROUTETOHOST);
      return true;
    }
    ucb(r, p, header);
    return true;
  }

  void NotifyInterfaceUp(uint32_t) override {}
  void NotifyInterfaceDown(uint32_t) override {}
  void NotifyAddAddress(uint32_t, Ipv4InterfaceAddress) override {}
  void NotifyRemoveAddress(uint32_t, Ipv4InterfaceAddress) override {}
  void SetIpv4(Ptr<Ipv4> ipv4) override { m_ipv4 = ipv4; }
  void PrintRoutingTable(Ptr<OutputStreamWrapper>, Time::Unit) const override {}

 private:
  LeafSpineRole m_role;
  uint32_t m_spines;
  LbMode m_lb;
  uint32_t m_salt;
  uint32_t m_rr;
  Ptr<Ipv4> m_ipv4;
  Ptr<UniformRandomVariable> m_rand;
  std::map<uint32_t, int32_t> m_ifaceByGateway;  // gateway address -> interface reaching it
  // (destination, gateway) -> its route: IP reads a route and never changes it, so one object
  // per pair serves every packet (a leaf has at most hosts x spines of them).
  std::unordered_map<uint64_t, Ptr<Ipv4Route>> m_routes;

  static Ipv4Address Addr(uint8_t a, uint8_t* b, uint32_t x, uint32_t y, uint8_t z) {
    b[0] = a;
    b[1] = uint8_t(x);
    b[2] = uint8_t(y);
    b[3] = z;
    return Ipv4Address::Deserialize(b);
  }

  // The route to `dst` through the neighbour `gateway`: the interface on the gateway's subnet.
  Ptr<Ipv4Route> Route(Ipv4Address dst, Ipv4Address gateway) {
    uint64_t key = uint64_t(dst.Get()) << 32 | gateway.Get();
    auto known = m_routes.find(key);
    if (known != m_routes.end()) return known->second;
    auto it = m_ifaceByGateway.find(gateway.Get());
    int32_t iface = -1;
    if (it != m_ifaceByGateway.end()) {
      iface = it->second;
    } else {
      for (uint32_t i = 1; i < m_ipv4->GetNInterfaces() && iface < 0; ++i)
        for (uint32_t a = 0; a < m_ipv4->GetNAddresses(i); ++a) {
          Ipv4InterfaceAddress ia = m_ipv4->GetAddress(i, a);
          if (ia.GetLocal().CombineMask(ia.GetMask()) == gateway.CombineMask(ia.GetMask())) iface = int32_t(i);
        }
      m_ifaceByGateway[gateway.Get()] = iface;
    }
    if (iface < 0) return nullptr;
    Ptr<Ipv4Route> r = Create<Ipv4Route>();
    r->SetDestination(dst);
    r->SetGateway(gateway == dst ? dst : gateway);
    r->SetOutputDevice(m_ipv4->GetNetDevice(iface));
    r->SetSource(m_ipv4->GetAddress(iface, 0).GetLocal());
    m_routes[key] = r;
    return r;
  }

  uint32_t PickSpine(Ptr<const Packet> p, const Ipv4Header& h) {
    DlcpTag tag;
    bool dlcp = p->PeekPacketTag(tag);
    if (dlcp && m_lb == LbMode::ROUND_ROBIN) return m_rr = (m_rr + 1) % m_spines;
    if (dlcp && m_lb == LbMode::RANDOM) return m_rand->GetInteger(0, m_spines - 1);
    uint8_t ports[4] = {0, 0, 0, 0};
    p->CopyData(ports, 4);
    uint64_t k = (uint64_t(h.GetSource().Get()) << 32) ^ h.GetDestination().Get();
    k ^= (uint64_t(ports[0]) << 24 | uint64_t(ports[1]) << 16 | uint64_t(ports[2]) << 8 | ports[3]) * 0x9E3779B97F4A7C15ull;
    k ^= uint64_t(h.GetProtocol()) << 40 ^ m_salt;
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return uint32_t(k % m_spines);
  }
};

class LeafSpineRoutingHelper : public Ipv4RoutingHelper {
 public:
  LeafSpineRoutingHelper(std::shared_ptr<std::map<uint32_t, LeafSpineRole>> roles, uint32_t spines, LbMode lb,
                         uint32_t seed)
      : m_roles(roles), m_spines(spines), m_lb(lb), m_seed(seed) {}
  LeafSpineRoutingHelper* Copy() const override { return new LeafSpineRoutingHelper(*this); }
  Ptr<Ipv4RoutingProtocol> Create(Ptr<Node> node) const override {
    return CreateObject<LeafSpineRouting>(m_roles->at(node->GetId()), m_spines, m_lb,
                                          (node->GetId() + 1) * 2654435761u ^ (m_seed * 0x85ebca6bu));
  }

 private:
  std::shared_ptr<std::map<uint32_t, LeafSpineRole>> m_roles;
  uint32_t m_spines;
  LbMode m_lb;
  uint32_t m_seed;
};

}  // namespace ns3
