// HostRouting: a host's IP routing in the leaf-spine. A host has one link, to its leaf, so
// everything it sends leaves through it, and it delivers locally what is addressed to it (the
// switches, dlcp-switch.h, forward below IP and never hand a host a packet for another).
#pragma once

#include <unordered_map>

#include "ns3/ipv4-routing-helper.h"
#include "ns3/ipv4-routing-protocol.h"
#include "ns3/ipv4.h"

namespace ns3 {

class HostRouting : public Ipv4RoutingProtocol {
 public:
  static TypeId GetTypeId() {
    static TypeId tid = TypeId("ns3::DlcpHostRouting").SetParent<Ipv4RoutingProtocol>();
    return tid;
  }

  Ptr<Ipv4Route> RouteOutput(Ptr<Packet>, const Ipv4Header& header, Ptr<NetDevice>,
                             Socket::SocketErrno& err) override {
    err = Socket::ERROR_NOTERROR;
    Ipv4Address dst = header.GetDestination();
    Ptr<Ipv4Route>& r = m_routes[dst.Get()];  // IP reads a route and never changes it: one per peer
    if (!r) {
      // The link is interface 1 (0 is loopback); host 10.l.j.2's leaf side is 10.l.j.1.
      Ipv4Address self = m_ipv4->GetAddress(1, 0).GetLocal();
      r = Create<Ipv4Route>();
      r->SetDestination(dst);
      r->SetSource(self);
      r->SetGateway(Ipv4Address(self.Get() - 1));
      r->SetOutputDevice(m_ipv4->GetNetDevice(1));
    }
    return r;
  }

  bool RouteInput(Ptr<const Packet> p, const Ipv4Header& header, Ptr<const NetDevice> idev,
                  const UnicastForwardCallback&, const MulticastForwardCallback&, const LocalDeliverCallback& lcb,
                  const ErrorCallback& ecb) override {
    int32_t iface = m_ipv4->GetInterfaceForDevice(idev);
    if (m_ipv4->IsDestinationAddress(header.GetDestination(), iface)) {
      lcb(p, header, iface);
      return true;
    }
    ecb(p, header, Socket::ERROR_NOROUTETOHOST);
    return true;
  }

  void NotifyInterfaceUp(uint32_t) override {}
  void NotifyInterfaceDown(uint32_t) override {}
  void NotifyAddAddress(uint32_t, Ipv4InterfaceAddress) override {}
  void NotifyRemoveAddress(uint32_t, Ipv4InterfaceAddress) override {}
  void SetIpv4(Ptr<Ipv4> ipv4) override { m_ipv4 = ipv4; }
  void PrintRoutingTable(Ptr<OutputStreamWrapper>, Time::Unit) const override {}

 private:
  Ptr<Ipv4> m_ipv4;
  std::unordered_map<uint32_t, Ptr<Ipv4Route>> m_routes;  // by destination address
};

class HostRoutingHelper : public Ipv4RoutingHelper {
 public:
  HostRoutingHelper* Copy() const override { return new HostRoutingHelper(*this); }
  Ptr<Ipv4RoutingProtocol> Create(Ptr<Node>) const override { return CreateObject<HostRouting>(); }
};

}  // namespace ns3
