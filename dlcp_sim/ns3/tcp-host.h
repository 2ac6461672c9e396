// TcpGradHost: the gradient transport of the `tcp` scheme, the way gloo, NCCL's socket transport
// and BytePS move tensors: one TCP connection per ordered pair of hosts, opened before training
// and kept, each message written into it after the one before.
//
//   - The connection's congestion control is the scenario's `gradient_tcp` (DCTCP by default,
//     with ECN; the switches mark CE above their ECN threshold), whatever the background flows
//     use. Every segment is priority 0 and drop class 0: the switches
//     serve it as any non-DLCP traffic, and the scheme runs over the baseline's FIFO ports and
//     per-flow ECMP.
//   - A message's bytes are its packets' gradient bytes (what DLCP carries: npkts times the
//     datagram less the DLCP header) plus a 16-byte frame header (its id and length).
//   - TCP is reliable and in order: a message is received once its last byte arrived; there is
//     no loss bound.
//
// Modelling shortcuts, both at most half a round trip: the receiver learns where a message ends
// from a table the sender appends to (TcpFrames) rather than by parsing the frame header from the
// stream, and the sender's onSent fires when the receiver has the whole message, not when the
// ACK of its last byte comes back.
#pragma once

#include <algorithm>
#include <deque>
#include <map>
#include <memory>

#include "gradient-host.h"
#include "ns3/inet-socket-address.h"
#include "ns3/simulator.h"
#include "ns3/socket.h"
#include "ns3/tcp-header.h"
#include "ns3/tcp-socket-base.h"
#include "ns3/tcp-socket-factory.h"
#include "ns3/tcp-cubic.h"
#include "ns3/tcp-dctcp.h"
#include "ns3/boolean.h"
#include "ns3/tcp-l4-protocol.h"

namespace ns3 {

class TcpGradHost;

//! Where each message ends in the stream of every ordered pair of hosts, and every host by rank.
struct TcpFrames {
  struct Frame {
    uint32_t msg = 0, npkts = 0;
    uint64_t end = 0;  // stream offset just past the message's last byte
  };
  std::map<uint32_t, std::deque<Frame>> streams;  // (src << 16 | dst) -> frames not yet received
  std::vector<TcpGradHost*> hosts;
  static uint32_t Key(uint16_t src, uint16_t dst) { return (uint32_t(src) << 16) | dst; }
};

class TcpGradHost : public GradientHost {
 public:
  static TypeId GetTypeId() {
    static TypeId tid = TypeId("ns3::TcpGradHost").SetParent<Application>();
    return tid;
  }
  static constexpr uint16_t PORT = 9001;
  static constexpr uint32_t FRAME_HEADER = 16;

  uint32_t payload = 1448;  // gradient bytes per DLCP packet of the same message
  TypeId congestionControl = TcpDctcp::GetTypeId();
  bool ecn = true;          // the sender negotiates ECN (DCTCP needs it)
  Time hostDelay;           // the host's software path: a send starts this much later
  std::shared_ptr<TcpFrames> frames;

  //! Open the connection to `dst` now (before training: the handshake is not an iteration's).
  void Prepare(uint16_t dst) {
    if (!m_tx[dst].sock) Open(dst);
  }

  void Send(uint16_t dst, uint32_t msg, const MsgPlan* plan, double, bool chained) override {
    if (hostDelay.IsStrictlyPositive() && !chained)
      Simulator::Schedule(hostDelay, &TcpGradHost::Start, this, dst, msg, plan->npkts);
    else
      Start(dst, msg, plan->npkts);
  }

  //! The receiver `dst` has all of `msg` (called by the receiving host).
  void Delivered(uint16_t dst, uint32_t msg) {
    if (onSent) onSent(dst, msg);
  }

 private:
  struct Tx {
    Ptr<Socket> sock;
    uint64_t queued = 0, written = 0;  // bytes of every message handed over / accepted by the socket
  };
  std::map<uint16_t, Tx> m_tx;                    // by destination rank
  std::map<Ptr<Socket>, uint16_t> m_dstOf;        // sending socket -> destination rank
  std::map<const TcpSocketBase*, SequenceNumber32> m_high;  // highest byte sent per socket
  std::map<Ptr<Socket>, std::pair<uint16_t, uint64_t>> m_rx;  // accepted socket -> (source rank, bytes)
  std::map<uint32_t, uint16_t> m_rankOf;          // IPv4 -> rank
  Ptr<Socket> m_listen;

  void StartApplication() override {
    for (uint16_t r = 0; r < peers.size(); ++r) m_rankOf[peers[r].Get()] = r;
    // The receiving side's sockets fork from the listener: its congestion control decides how
    // they mark and echo ECN (DCTCP sets ECT even on ACKs), so it is the gradients' too.
    m_listen = NewSocket();
    m_listen->Bind(InetSocketAddress(Ipv4Address::GetAny(), PORT));
    m_listen->Listen();
    m_listen->SetAcceptCallback(MakeNullCallback<bool, Ptr<Socket>, const Address&>(),
                                MakeCallback(&TcpGradHost::Accept, this));
  }
  void StopApplication() override {
    for (auto& [dst, t] : m_tx)
      if (t.sock) t.sock->Close();
    if (m_listen) m_listen->Close();
  }

  //! A TCP socket of the gradients' congestion control (not the node's default, the background's).
  //! With ECN, without SACK: ns-3 3.44 counts duplicate ACKs in CA_CWR (the state an ECN echo
  //! puts a sender in) and leaves it for CA_OPEN without resetting the count when the ACK that
  //! ends it also carries SACK news, and then aborts on NS_ASSERT in DupAck (seen with DCTCP
  //! under tail drops). Without SACK only a cumulative ACK ends CA_CWR, and it resets the count.
  Ptr<Socket> NewSocket() {
    Ptr<Socket> s = GetNode()->GetObject<TcpL4Protocol>()->CreateSocket(congestionControl);
    auto tcp = DynamicCast<TcpSocketBase>(s);
    tcp->SetUseEcn(ecn ? TcpSocketState::On : TcpSocketState::Off);
    if (ecn) tcp->SetAttribute("Sack", BooleanValue(false));
    return s;
  }

  void Open(uint16_t dst) {
    Tx& t = m_tx[dst];
    t.sock = NewSocket();
    t.sock->Bind();
    m_dstOf[t.sock] = dst;
    t.sock->TraceConnectWithoutContext("Tx", MakeCallback(&TcpGradHost::OnSegment, this));
    t.sock->SetConnectCallback(MakeCallback(&TcpGradHost::Connected, this),
                               MakeCallback(&TcpGradHost::Failed, this));
    t.sock->SetSendCallback(MakeCallback(&TcpGradHost::Fill, this));
    t.sock->Connect(InetSocketAddress(peers[dst], PORT));
  }

  void Start(uint16_t dst, uint32_t msg, uint32_t npkts) {
    Tx& t = m_tx[dst];
    t.queued += uint64_t(npkts) * payload + FRAME_HEADER;
    frames->streams[TcpFrames::Key(rank, dst)].push_back({msg, npkts, t.queued});
    stats.messagesSent++;
    if (!t.sock)
      Open(dst);
    else
      Fill(t.sock, 0);
  }

  void Connected(Ptr<Socket> s) { Fill(s, 0); }
  void Failed(Ptr<Socket> s) {
    std::cerr << "dlcp-sim: host " << rank << " could not connect to " << m_dstOf[s] << "\n";
  }

  //! Write what the socket's send buffer takes (called again as ACKs free it).
  void Fill(Ptr<Socket> s, uint32_t) {
    auto d = m_dstOf.find(s);
    if (d == m_dstOf.end()) return;
    Tx& t = m_tx[d->second];
    while (t.written < t.queued) {
      uint32_t room = s->GetTxAvailable();
      if (room == 0) return;
      uint32_t n = uint32_t(std::min<uint64_t>(room, t.queued - t.written));
      int took = s->Send(Create<Packet>(n));
      if (took <= 0) return;  // not connected yet: Connected() fills
      t.written += uint64_t(took);
    }
  }

  //! Every segment a sending socket puts on the wire: data segments and retransmissions.
  void OnSegment(Ptr<const Packet> p, const TcpHeader& h, Ptr<const TcpSocketBase> s) {
    if (p->GetSize() == 0) return;
    stats.dataSent++;
    SequenceNumber32 end = h.GetSequenceNumber() + p->GetSize();
    auto [it, fresh] = m_high.try_emplace(PeekPointer(s), end);
    if (fresh) return;
    if (end <= it->second)
      stats.retransmitted++;
    else
      it->second = end;
  }

  void Accept(Ptr<Socket> s, const Address& from) {
    auto r = m_rankOf.find(InetSocketAddress::ConvertFrom(from).GetIpv4().Get());
    if (r == m_rankOf.end()) return;
    m_rx[s] = {r->second, 0};
    s->SetRecvCallback(MakeCallback(&TcpGradHost::Receive, this));
  }

  void Receive(Ptr<Socket> s) {
    auto it = m_rx.find(s);
    if (it == m_rx.end()) return;
    auto& [src, got] = it->second;
    std::deque<TcpFrames::Frame>& q = frames->streams[TcpFrames::Key(src, rank)];
    while (Ptr<Packet> p = s->Recv()) {
      got += p->GetSize();
      while (!q.empty() && q.front().end <= got) {
        TcpFrames::Frame f = q.front();
        q.pop_front();
        stats.messagesReceived++;
        stats.packetsAtCompletion += f.npkts;
        if (log)
          *log << "done " << rank << " " << src << " " << f.msg << " " << Simulator::Now().GetSeconds() << " "
               << f.npkts << " 0\n";
        if (onReceived) onReceived(src, f.msg);
        frames->hosts[src]->Delivered(rank, f.msg);
      }
    }
  }
};

}  // namespace ns3
