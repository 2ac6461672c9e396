// Background TCP flows (dlcp_sim/background.py draws them): each flow is one ns-3 TCP
// connection (NewReno, Cubic or DCTCP, one variant per scenario) that sends its bytes and
// closes; the destination's sink counts bytes per connection and reports the flow's completion.
//
// The packets carry no DlcpTag, so switches serve them as the P4 program serves non-DLCP
// traffic: priority 0 (behind every gradient queue under DLCP's strict priority, in the same
// FIFO under the baseline), never dropped selectively, marked CE above the ECN threshold
// (which DCTCP reacts to).
#pragma once

#include <functional>
#include <map>
#include <vector>

#include "ns3/application.h"
#include "ns3/inet-socket-address.h"
#include "ns3/ipv4-address.h"
#include "ns3/node.h"
#include "ns3/simulator.h"
#include "ns3/socket.h"
#include "ns3/tcp-socket-factory.h"

namespace ns3 {

struct BgFlow {
  uint32_t id = 0, src = 0, dst = 0;
  uint64_t bytes = 0;
  double start = 0, end = -1;
  uint64_t sent = 0;
  Ptr<Socket> sock;
};

//! Every background flow of a scenario: starts them, and receives them at every host.
class BackgroundTraffic {
 public:
  static constexpr uint16_t PORT = 5001;
  std::vector<BgFlow> flows;
  std::vector<Ptr<Node>> hosts;      // by rank
  std::vector<Ipv4Address> addrs;    // by rank
  std::function<void(const BgFlow&)> onDone;

  //! Listen on every host and schedule every flow's start.
  void Install() {
    for (uint32_t h = 0; h < hosts.size(); ++h) {
      m_byAddr[addrs[h].Get()] = h;
      Ptr<Socket> l = Socket::CreateSocket(hosts[h], TcpSocketFactory::GetTypeId());
      l->Bind(InetSocketAddress(Ipv4Address::GetAny(), PORT));
      l->Listen();
      l->SetAcceptCallback(MakeNullCallback<bool, Ptr<Socket>, const Address&>(),
                           MakeCallback(&BackgroundTraffic::Accept, this));
      m_listeners.push_back(l);
    }
    for (auto& f : flows) Simulator::Schedule(Seconds(f.start), &BackgroundTraffic::Start, this, f.id);
    m_left = flows.size();
  }

  //! Flows not yet completed at their destination.
  uint32_t Left() const { return m_left; }

  //! One line per flow that did not complete: how far its sender and its receiver got
  //! (received -1: the destination never accepted its connection).
  void ReportUnfinished(std::ostream& out) const {
    std::map<uint32_t, int64_t> got;
    for (auto& [sock, st] : m_rx) got[st.first] = int64_t(st.second);
    for (auto& f : flows)
      if (f.end < 0)
        out << "unfinished " << f.id << " " << f.bytes << " " << f.sent << " "
            << (got.count(f.id) ? got.at(f.id) : -1) << "\n";
  }

 private:
  std::map<uint32_t, uint32_t> m_byAddr;                      // IPv4 -> rank
  std::map<uint64_t, uint32_t> m_byEndpoint;                  // (src rank, src port) -> flow id
  std::map<Ptr<Socket>, uint32_t> m_tx;                       // sending socket -> flow id
  std::map<Ptr<Socket>, std::pair<uint32_t, uint64_t>> m_rx;  // accepted socket -> (flow id, bytes)
  std::vector<Ptr<Socket>> m_listeners;
  uint32_t m_left = 0;

  void Start(uint32_t id) {
    BgFlow& f = flows[id];
    f.sock = Socket::CreateSocket(hosts[f.src], TcpSocketFactory::GetTypeId());
    f.sock->Bind();
    Address local;
    f.sock->GetSockName(local);
    m_byEndpoint[(uint64_t(f.src) << 16) | InetSocketAddress::ConvertFrom(local).GetPort()] = id;
    m_tx[f.sock] = id;
    f.sock->SetConnectCallback(MakeCallback(&BackgroundTraffic::Connected, this),
                               MakeCallback(&BackgroundTraffic::Failed, this));
    f.sock->SetSendCallback(MakeCallback(&BackgroundTraffic::Fill, this));
    f.sock->Connect(InetSocketAddress(addrs[f.dst], PORT));
  }

  BgFlow* Of(Ptr<Socket> s) {
    auto it = m_tx.find(s);
    return it == m_tx.end() ? nullptr : &flows[it->second];
  }

  void Connected(Ptr<Socket> s) { Fill(s, s->GetTxAvailable()); }
  void Failed(Ptr<Socket> s) {
    if (BgFlow* f = Of(s)) std::cerr << "dlcp-sim: background flow " << f->id << " failed to connect\n";
  }

  void Fill(Ptr<Socket> s, uint32_t) {
    BgFlow* f = Of(s);
    if (!f) return;
    while (f->sent < f->bytes) {
      uint32_t room = s->GetTxAvailable();
      if (room == 0) return;
      uint32_t n = uint32_t(std::min<uint64_t>(room, f->bytes - f->sent));
      int took = s->Send(Create<Packet>(n));
      if (took <= 0) return;
      f->sent += uint64_t(took);
    }
    s->Close();
    m_tx.erase(s);
    f->sock = nullptr;
  }

  void Accept(Ptr<Socket> s, const Address& from) {
    InetSocketAddress a = InetSocketAddress::ConvertFrom(from);
    auto src = m_byAddr.find(a.GetIpv4().Get());
    if (src == m_byAddr.end()) return;
    auto id = m_byEndpoint.find((uint64_t(src->second) << 16) | a.GetPort());
    if (id == m_byEndpoint.end()) return;
    m_rx[s] = {id->second, 0};
    s->SetRecvCallback(MakeCallback(&BackgroundTraffic::Recv, this));
  }

  void Recv(Ptr<Socket> s) {
    auto it = m_rx.find(s);
    if (it == m_rx.end()) return;
    while (Ptr<Packet> p = s->Recv()) {
      it->second.second += p->GetSize();
      BgFlow& f = flows[it->second.first];
      if (f.end < 0 && it->second.second >= f.bytes) {
        f.end = Simulator::Now().GetSeconds();
        --m_left;
        if (onDone) onDone(f);
      }
    }
    if (flows[it->second.first].end >= 0) {
      s->Close();
      m_rx.erase(it);
    }
  }
};

}  // namespace ns3
