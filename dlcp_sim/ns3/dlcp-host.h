// DlcpHost: DLCP's transport rules as an ns-3 application on one host (one UDP socket).
//
// The rules are those of hostagent/ (transport, tx_path, rx_path, ratecontrol, policy):
//   - every data packet carries its layer's priority and its drop class (DlcpTag);
//   - a receiver completes a message once (1-p) of its packets arrived (policy.is_complete),
//     tells the sender STOP, and the rest is zero-filled;
//   - after its last packet the sender PROBEs; the receiver answers once no data of that
//     message arrived for `answerIdle` (packets merely late are not reported missing) with a
//     BITMAP of what it has, and the sender resends only what the bound needs, most important
//     drop class first (policy.retransmission_set), as class 0 at the top priority; a lost
//     probe is re-sent after `probeTimeout`;
//   - a sender serves its messages as the agent's send thread does (native/tx.cc): resends
//     first, then by the message's own priority (MsgPlan::rank), ties to the earlier; a
//     message's packets most urgent first; LAST only on the pass's last priority level;
//   - DCTCP-like rate per destination (ratecontrol.RateController): alpha is a moving average of
//     the marked-or-lost fraction, the rate is cut by alpha/2 at most once per `cutInterval`
//     (or, as the agent, once per window: not again until every packet sent before the cut
//     was reported, or `cutHold` passed) and grows additively otherwise; the host's link
//     paces the sum, packet by packet or (as the agent) by token buckets of `burstBytes`.
// The baseline is the same transport with p = 0 over FIFO switches with per-flow ECMP, as on
// the testbed. Packets, not elements, are the unit of completion (all but a message's last
// packet are full, so the two agree to within one packet).
#pragma once

#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "dlcp-header.h"
#include "dlcp-tag.h"
#include "gradient-host.h"
#include "ns3/application.h"
#include "ns3/inet-socket-address.h"
#include "ns3/simulator.h"
#include "ns3/socket.h"
#include "ns3/udp-socket-factory.h"

namespace ns3 {

struct TransportParams {
  uint32_t datagram = 1472;      // UDP payload of a full data packet (MTU - IP - UDP)
  uint32_t controlBytes = 64;    // UDP payload of a control packet without a bitmap
  double lineRate = 1.25e9;      // bytes/s of the host link
  double initialRate = 1.25e9;   // bytes/s a new destination starts at
  double minRate = 1e6;
  double additiveIncrease = 0.0125e9;  // bytes/s per clean feedback
  double gain = 1.0 / 16;
  double initialAlpha = 1.0;     // alpha before any report (the agent's and Linux DCTCP's: the first cut halves)
  Time cutInterval = MicroSeconds(20);  // zero: a cut on every congested report
  // The agent's rule instead (RateController.on_feedback's hold): after a cut, no further cut
  // until the receiver reported every packet sent before it, or max(cutHoldMin, cutHoldAnswers
  // x the smoothed time from a pass's end to its answer; initialAnswer before any) passed.
  bool cutPerWindow = false;
  Time cutHoldMin, initialAnswer = MilliSeconds(5);
  double cutHoldAnswers = 4;
  uint32_t burstBytes = 0;       // token-bucket depth of the pacers (0: one packet at a time)
  Time answerIdle = MicroSeconds(20);
  Time probeTimeout = MicroSeconds(200);
  // The agent's end of pass instead (lastFlag; hostagent.protocol): the last lastPackets data
  // packets of a pass (wire.LAST_PACKETS) carry LAST and the receiver answers it as it would a
  // PROBE; the sender PROBEs only if
  // no answer came within its probe delay (ratecontrol.AnswerTimer: the smoothed answer time +
  // 4 deviations within [probeDelayMin, probeDelayMax], initialAnswer before any), and again
  // after max(4 x that, 50 ms). The receiver answers once the message was quiet for
  // max(answerIdle, answerGaps x its mean packet gap), at most answerGraceMax
  // (incoming.answer_grace; answerGaps 0: answerIdle alone).
  bool lastFlag = false;
  uint32_t lastPackets = 1;
  Time probeDelayMin = MilliSeconds(1), probeDelayMax = MilliSeconds(500);
  double answerGaps = 0;
  Time answerGraceMax = MilliSeconds(100);
  Time increaseInterval;                    // zero: additiveIncrease per clean report
  // With increaseInterval: until a destination's first cut, additiveIncrease per clean report
  // anyway (reports come with the packets, so the rate grows with itself, as TCP's slow start),
  // then per increaseInterval.
  bool slowStart = false;
  Time maxIncreaseSpan = MilliSeconds(50);  // the most one report may grant (after idle)
  uint32_t feedbackEvery = 16;   // data packets per FEEDBACK from a receiver to a sender
  // The host agent's report timers instead (when feedbackInterval is not zero; control_path's
  // _take_feedback): congestion is reported at most every feedbackInterval, a clean report
  // waits bulkFeedbackInterval once bulkFeedbackPackets arrived, else cleanFeedbackInterval
  // (that too for a sender that said it is at its line rate: a FEEDBACK of msg LINE_RATE_MSG,
  // FLAG_AT_LINE set or clear, as the agent's LINE_RATE), and rides along free whenever a STOP
  // or BITMAP leaves for that sender.
  Time feedbackInterval, bulkFeedbackInterval, cleanFeedbackInterval;
  uint32_t bulkFeedbackPackets = 64;
  uint8_t topPriority = 7;       // priority of control packets
  Time hostDelay;                // a host's software path: a send starts, and every control packet leaves, this much later
};

//! Receiver-side snapshots that BITMAP packets stand for: the wire carries the bitmap's bytes,
//! the simulator hands the sender the same bits from here.
struct BitmapStore {
  std::map<uint32_t, std::vector<bool>> bits;
  uint32_t next = 1;
};

class DlcpHost : public GradientHost {
 public:
  static TypeId GetTypeId() {
    static TypeId tid = TypeId("ns3::DlcpHost").SetParent<Application>();
    return tid;
  }

  TransportParams tp;
  std::shared_ptr<BitmapStore> bitmaps;

  //! Queue a message for `dst`; its packets leave as the rate and priorities allow. It is
  //! received once at least 1-p of it arrived, and sent once the receiver's STOP arrived.
  void Send(uint16_t dst, uint32_t msg, const MsgPlan* plan, double lossBound, bool chained) override {
    if (tp.hostDelay.IsStrictlyPositive() && !chained) {  // the agent's send path (packetize, META, tx thread)
      Simulator::Schedule(tp.hostDelay, &DlcpHost::Start, this, dst, msg, plan, lossBound);
      return;
    }
    Start(dst, msg, plan, lossBound);
  }

 private:
  void Start(uint16_t dst, uint32_t msg, const MsgPlan* plan, double lossBound) {
    auto m = std::make_shared<TxMsg>();
    m->dst = dst;
    m->id = msg;
    m->plan = plan;
    m->ppm = uint32_t(lossBound * 1e6 + 0.5);
    m->lowest = *std::min_element(plan->priority.begin(), plan->priority.end());
    m->order = m_submitted++;
    Flow& f = FlowTo(dst);
    f.active.push_back(m);
    stats.messagesSent++;
    Pump();
  }

  struct TxMsg {
    uint16_t dst = 0;
    uint32_t id = 0, ppm = 0, next = 0;  // next: position in plan->sendOrder of the first pass
    uint8_t lowest = 0;  // the message's least urgent priority: its probes travel there
    uint64_t order = 0;  // when it was handed over (ties between equal ranks go to the earlier)
    const MsgPlan* plan = nullptr;
    std::deque<uint32_t> retx;
    bool probing = false, done = false;
    Time passDone = Time::Max();  // when the last pass ended (its answer times the round trip)
    EventId probeTimer;
    bool HasPacket() const { return !done && (next < plan->npkts || !retx.empty()); }
    //! Resends first (as the agent's send thread takes them), then the first pass's next packet.
    uint32_t NextSeq() const { return !retx.empty() ? retx.front() : plan->sendOrder[next]; }
    //! Its rank among the host's messages (the agent's queue_priority): above every priority
    //! while resends wait, else the message's own (MsgPlan::rank).
    int Rank() const { return !retx.empty() ? 255 : plan->rank; }
  };
  struct Flow {
    double rate = 0, alpha = 0;
    Time nextSend, lastCut, lastReport;
    bool reported = false, cut = false;
    uint64_t sent = 0, reportedPkts = 0, windowEnd = 0;  // the window a cut waits out (cutPerWindow)
    double tokens = 0;                                   // the pacer's bucket (burstBytes)
    Time tokensAt;
    double answerS = -1, answerVar = 0;                  // smoothed answer time and deviation, s (-1: none yet)
    bool toldAtLine = false;                             // we told the receiver we are at our line rate
    std::vector<std::shared_ptr<TxMsg>> active;
  };
  struct RxMsg {
    uint32_t npkts = 0, required = 0, count = 0;
    std::vector<bool> got;
    bool complete = false;
    Time firstData, lastData, lastStop;
    double pace = -1;  // mean gap between packets, s, frozen when a bitmap went out (-1: not yet)
    EventId answer;
  };
  struct RxCounters {
    uint32_t received = 0, marked = 0;
    bool senderAtLine = false;  // the sender said it is at its line rate (LINE_RATE_MSG)
    Time lastSent;  // when the last report left for this sender
  };

  Ptr<Socket> m_sock;
  // Data leave from one socket per priority, each from its own port, as the agent's do
  // (tx_path._tx_sock: one socket per destination and priority, for its DSCP): under per-flow
  // ECMP a worker's traffic to one peer is up to eight flows, each hashed on its own.
  Ptr<Socket> m_data[8];
  std::map<uint16_t, Flow> m_flows;
  std::map<uint64_t, RxMsg> m_rx;
  std::map<uint16_t, RxCounters> m_fb;
  Time m_hostNext;
  uint64_t m_submitted = 0;  // messages handed over so far (TxMsg::order)
  double m_hostTokens = 0;  // the host pacer's bucket (burstBytes), full at the start
  Time m_hostTokensAt;
  EventId m_pump;

  static uint64_t Key(uint16_t src, uint32_t msg) { return (uint64_t(src) << 32) | msg; }

  Flow& FlowTo(uint16_t dst) {
    auto it = m_flows.find(dst);
    if (it == m_flows.end()) {
      Flow f;
      f.rate = tp.initialRate;
      f.alpha = tp.initialAlpha;
      f.tokens = tp.burstBytes;
      f.tokensAt = Simulator::Now();
      it = m_flows.emplace(dst, f).first;
    }
    return it->second;
  }

  void StartApplication() override {
    m_sock = Socket::CreateSocket(GetNode(), UdpSocketFactory::GetTypeId());
    m_sock->Bind(InetSocketAddress(Ipv4Address::GetAny(), 9000));
    m_sock->SetRecvCallback(MakeCallback(&DlcpHost::Receive, this));
    for (uint16_t q = 0; q < 8; ++q) {
      m_data[q] = Socket::CreateSocket(GetNode(), UdpSocketFactory::GetTypeId());
      m_data[q]->Bind(InetSocketAddress(Ipv4Address::GetAny(), 9001 + q));
    }
    m_hostTokens = tp.burstBytes;
    m_hostTokensAt = Simulator::Now();
  }
  void StopApplication() override {
    if (m_sock) m_sock->Close();
    for (auto& d : m_data)
      if (d) d->Close();
  }

  void Transmit(uint16_t dst, const DlcpHeader& h, uint32_t payload) {
    Ptr<Packet> p = Create<Packet>(payload > DlcpHeader::SIZE ? payload - DlcpHeader::SIZE : 0);
    p->AddHeader(h);
    DlcpTag tag;
    tag.priority = h.priority;
    tag.dropClass = h.dropClass;
    p->AddPacketTag(tag);
    Ptr<Socket> from = h.type == DATA && m_data[h.priority & 7] ? m_data[h.priority & 7] : m_sock;
    from->SendTo(p, 0, InetSocketAddress(peers[dst], 9000));
  }

  //! A control packet of controlBytes (plus `extraBytes`), or of exactly `bytes` when given.
  //! `riding`: a congestion report for `dst` rides along if one has anything to say (the
  //! agent's timers; feedbackInterval not zero).
  void Control(uint16_t dst, DlcpType type, uint32_t msg, uint32_t npkts, uint32_t aux, uint32_t aux2,
               uint32_t extraBytes = 0, uint8_t priority = 255, uint32_t bytes = 0, bool riding = false,
               uint8_t flags = 0) {
    DlcpHeader h;
    h.type = type;
    h.flags = flags;
    h.priority = priority == 255 ? tp.topPriority : priority;
    h.dropClass = 0;
    h.src = rank;
    h.dst = dst;
    h.msg = msg;
    h.npkts = npkts;
    h.aux = aux;
    h.aux2 = aux2;
    if (riding && !tp.feedbackInterval.IsZero()) {
      RxCounters& c = m_fb[dst];
      if (c.received > 0) {
        h.flags |= FLAG_RIDING;
        h.seq = c.received;
        h.aux2 = c.marked;
        c.received = c.marked = 0;
        c.lastSent = Simulator::Now();
      }
    }
    stats.controlSent++;
    uint32_t size = bytes ? bytes : tp.controlBytes + extraBytes;
    if (tp.hostDelay.IsStrictlyPositive())  // every control record goes through the agent's control path
      Simulator::Schedule(tp.hostDelay, &DlcpHost::Transmit, this, dst, h, size);
    else
      Transmit(dst, h, size);
  }

  // --- sending ---------------------------------------------------------------------------

  //! Send every packet that the pacing allows now, as the agent's send thread does: of the
  //! messages whose destination may send, the highest ranked (TxMsg::Rank, ties to the earlier
  //! handed over), its packets most urgent first; wake when more may go.
  void Pump() {
    Time now = Simulator::Now();
    while (true) {
      Flow* best = nullptr;
      TxMsg* bestMsg = nullptr;
      Time wake = Time::Max();
      for (auto& [dst, f] : m_flows) {
        for (auto& m : f.active) {
          if (!m->HasPacket()) continue;
          if (f.nextSend > now) {
            wake = std::min(wake, f.nextSend);
            break;
          }
          int rank = m->Rank(), bestRank = bestMsg ? bestMsg->Rank() : -1;
          if (!bestMsg || rank > bestRank || (rank == bestRank && m->order < bestMsg->order)) {
            best = &f;
            bestMsg = m.get();
          }
        }
      }
      if (!bestMsg) {
        if (wake != Time::Max()) Wake(wake);
        return;
      }
      if (m_hostNext > now) {
        Wake(m_hostNext);
        return;
      }
      SendOne(*best, *bestMsg);
    }
  }

  void Wake(Time at) {
    if (m_pump.IsPending() && m_pump.GetTs() <= uint64_t(at.GetTimeStep())) return;
    m_pump.Cancel();
    m_pump = Simulator::Schedule(at - Simulator::Now(), &DlcpHost::Pump, this);
  }

  void SendOne(Flow& f, TxMsg& m) {
    bool first = m.retx.empty();
    uint32_t seq = first ? m.plan->sendOrder[m.next++] : m.retx.front();
    if (!first) m.retx.pop_front();
    bool last = !m.HasPacket();  // the pass ends with this packet
    size_t rest = m.plan->npkts - m.next;   // of the first pass, still to go
    size_t left = m.retx.size() + rest;     // of the pass after this packet
    // LAST only on the pass's last priority level (the agent's last_marks, endpass.h): packets of
    // a lower priority still to go may wait behind more urgent ones, and a LAST ahead of them
    // has the receiver answer while they wait and list them as missing. Resends leave at the top
    // priority, as class 0 (protected), as the agent's do.
    uint8_t priority = first ? m.plan->priority[seq] : tp.topPriority;
    bool lowerAfter = rest > 0 && m.lowest < priority;
    DlcpHeader h;
    h.type = DATA;
    h.priority = priority;
    h.dropClass = first ? m.plan->dropClass[seq] : 0;  // retransmissions are protected
    h.src = rank;
    h.dst = m.dst;
    h.msg = m.id;
    h.seq = seq;
    h.npkts = m.plan->npkts;
    h.aux = m.ppm;
    h.flags = tp.lastFlag && !lowerAfter && left < tp.lastPackets ? FLAG_LAST : 0;
    Transmit(m.dst, h, tp.datagram);
    stats.dataSent++;
    if (!first) stats.retransmitted++;
    Time now = Simulator::Now();
    double bytes = tp.datagram + 28.0;
    f.sent++;
    if (tp.burstBytes) {  // the agent's token buckets (hostagent/native/pacer.h): bursts up to burstBytes
      f.nextSend = Paced(f.tokens, f.tokensAt, f.rate, bytes, now);
      m_hostNext = Paced(m_hostTokens, m_hostTokensAt, tp.lineRate, bytes, now);
    } else {
      f.nextSend = std::max(f.nextSend, now) + Seconds(bytes / f.rate);
      m_hostNext = std::max(m_hostNext, now) + Seconds(bytes / tp.lineRate);
    }
    if (last) {
      m.passDone = now;
      if (tp.lastFlag)
        ProbeLater(m, ProbeDelay(f));  // LAST asks for the answer; a PROBE only if none comes
      else
        Probe(m);
    }
  }

  //! How long after its pass a sender waits for an answer before it PROBEs (AnswerTimer.probe_delay).
  Time ProbeDelay(const Flow& f) const {
    if (f.answerS < 0) return tp.initialAnswer;
    return std::min(tp.probeDelayMax, std::max(tp.probeDelayMin, Seconds(f.answerS + 4 * f.answerVar)));
  }

  //! PROBE `m` after `delay` unless its pass was answered (or it was done) by then.
  void ProbeLater(TxMsg& m, Time delay) {
    m.probeTimer.Cancel();
    uint16_t dst = m.dst;
    uint32_t id = m.id;
    m.probeTimer = Simulator::Schedule(delay, [this, dst, id]() {
      if (TxMsg* mm = Find(dst, id); mm && !mm->done && !mm->HasPacket()) Probe(*mm);
    });
  }

  //! Take `bytes` from a token bucket refilled at `rate` up to burstBytes; returns when the
  //! next packet of that size may leave.
  Time Paced(double& tokens, Time& at, double rate, double bytes, Time now) {
    tokens = std::min<double>(tp.burstBytes, tokens + (now - at).GetSeconds() * rate) - bytes;
    at = now;
    return tokens >= bytes ? now : now + Seconds((bytes - tokens) / rate);
  }

  void Probe(TxMsg& m) {
    if (m.done) return;
    m.probing = true;
    stats.probes++;
    // Behind the message's own data in its least urgent queue, not ahead of it: a probe that
    // overtook queued data would make the receiver report packets that are only late.
    Control(m.dst, PROBE, m.id, m.plan->npkts, m.ppm, 0, 0, m.lowest);
    // AnswerTimer.reprobe_timeout with lastFlag
    ProbeLater(m, tp.lastFlag ? std::max(4 * ProbeDelay(FlowTo(m.dst)), MilliSeconds(50)) : tp.probeTimeout);
  }

  TxMsg* Find(uint16_t dst, uint32_t id) {
    auto it = m_flows.find(dst);
    if (it == m_flows.end()) return nullptr;
    for (auto& m : it->second.active)
      if (m->id == id) return m.get();
    return nullptr;
  }

  void Finish(uint16_t dst, uint32_t id) {
    auto it = m_flows.find(dst);
    if (it == m_flows.end()) return;
    auto& v = it->second.active;
    for (auto i = v.begin(); i != v.end(); ++i)
      if ((*i)->id == id) {
        (*i)->done = true;
        (*i)->probeTimer.Cancel();
        v.erase(i);
        if (onSent) onSent(dst, id);
        return;
      }
  }

  //! A report of `fraction` of `count` packets marked (or lost); `timed` false for a BITMAP's
  //! losses, which the agent neither counts towards a window nor holds back.
  void Congestion(uint16_t dst, double fraction, uint32_t count = 0, bool timed = true) {
    Flow& f = FlowTo(dst);
    f.alpha = (1 - tp.gain) * f.alpha + tp.gain * fraction;
    Time now = Simulator::Now();
    if (timed) f.reportedPkts += count;
    if (fraction > 0) {
      bool held;
      if (tp.cutPerWindow) {
        double answer = f.answerS < 0 ? tp.initialAnswer.GetSeconds() : f.answerS;
        Time hold = std::max(tp.cutHoldMin, Seconds(tp.cutHoldAnswers * answer));
        held = timed && f.cut && f.reportedPkts < f.windowEnd && now - f.lastCut < hold;
      } else {
        held = !tp.cutInterval.IsZero() && now - f.lastCut < tp.cutInterval;
      }
      if (!held) {
        f.rate = std::max(tp.minRate, f.rate * (1 - f.alpha / 2));
        f.lastCut = now;
        f.windowEnd = f.sent;
        f.cut = true;
      }
    } else if (tp.increaseInterval.IsZero() || (tp.slowStart && !f.cut)) {
      f.rate = std::min(tp.lineRate, f.rate + tp.additiveIncrease);  // per clean report
    } else {  // the host agent's rule: additiveIncrease per increaseInterval since the last report
      Time span = f.reported ? std::min(tp.maxIncreaseSpan, now - f.lastReport) : tp.increaseInterval;
      f.rate = std::min(tp.lineRate, f.rate + tp.additiveIncrease * (span / tp.increaseInterval).GetDouble());
    }
    f.lastReport = now;
    f.reported = true;
    TellLineRate(dst, f);
  }

  //! Tell `dst` when our rate towards it reached our line rate or left it, once per change (the
  //! agent's ProtocolCore._tell_line_rate): it then sends us reports without congestion only
  //! every cleanFeedbackInterval, since they cannot grow the rate.
  void TellLineRate(uint16_t dst, Flow& f) {
    bool atLine = f.rate >= tp.lineRate;
    if (tp.feedbackInterval.IsZero() || atLine == f.toldAtLine) return;
    f.toldAtLine = atLine;
    Control(dst, FEEDBACK, LINE_RATE_MSG, 0, 0, 0, 0, 255, 0, false, atLine ? FLAG_AT_LINE : 0);
  }

  //! The answer to a pass of `msg` (STOP or BITMAP) came: sample the answer time as the agent's
  //! AnswerTimer does (the smoothed round trip with its queue, which bounds a cut's hold).
  void Answered(uint16_t dst, uint32_t msg) {
    TxMsg* m = Find(dst, msg);
    if (!m || m->passDone == Time::Max()) return;
    double sample = (Simulator::Now() - m->passDone).GetSeconds();
    Flow& f = FlowTo(dst);
    if (f.answerS < 0) {  // as RFC 6298 smooths a round trip (AnswerTimer.sample)
      f.answerS = sample;
      f.answerVar = sample / 2;
    } else {
      f.answerVar = 0.75 * f.answerVar + 0.25 * std::abs(f.answerS - sample);
      f.answerS = 0.875 * f.answerS + 0.125 * sample;
    }
    m->passDone = Time::Max();
  }

  void OnBitmap(uint16_t dst, const DlcpHeader& h) {
    stats.bitmaps++;
    Answered(dst, h.msg);
    TxMsg* m = Find(dst, h.msg);
    auto snap = bitmaps->bits.find(h.aux);
    if (!m || m->done || snap == bitmaps->bits.end()) return;
    const std::vector<bool>& got = snap->second;
    // Missing are the packets sent and not arrived: one the first pass has still to send is on
    // its way (an answer can come mid-pass while a more urgent message holds the sender), and
    // the agent resends only what it sent (tx.cc, Datapath::resend).
    uint32_t n = m->plan->npkts, have = 0, unsent = 0;
    std::vector<uint32_t> missing;
    for (uint32_t s = 0; s < n; ++s) {
      if (got[s])
        have++;
      else if (m->plan->position[s] >= m->next)
        unsent++;
      else
        missing.push_back(s);
    }
    bitmaps->bits.erase(snap);
    Congestion(dst, double(missing.size()) / n, 0, false);
    uint32_t required = n - uint32_t(double(m->ppm) / 1e6 * n + 1e-9);
    if (have + unsent >= required) return;  // its STOP is on the way, or will be
    required -= unsent;
    // policy.retransmission_set: most important class first, then by sequence
    std::stable_sort(missing.begin(), missing.end(),
                     [m](uint32_t a, uint32_t b) { return m->plan->dropClass[a] < m->plan->dropClass[b]; });
    missing.resize(std::min<size_t>(missing.size(), required - have));
    m->retx.assign(missing.begin(), missing.end());
    m->probeTimer.Cancel();
    Pump();
  }

  // --- receiving -------------------------------------------------------------------------

  void Receive(Ptr<Socket> sock) {
    Ptr<Packet> p;
    while ((p = sock->Recv())) {
      DlcpHeader h;
      p->RemoveHeader(h);
      DlcpTag tag;
      p->PeekPacketTag(tag);
      switch (h.type) {
        case DATA: OnData(h, tag.ce); break;
        case PROBE: OnProbe(h); break;
        case BITMAP: Riding(h); OnBitmap(h.src, h); break;
        case STOP: Riding(h); stats.stops++; Answered(h.src, h.msg); Finish(h.src, h.msg); Pump(); break;
        case FEEDBACK:
          if (h.msg == LINE_RATE_MSG) {  // from a sender of ours
            m_fb[h.src].senderAtLine = h.flags & FLAG_AT_LINE;
            break;
          }
          stats.feedbacks++;
          stats.reports++;
          if (h.aux > 0) Congestion(h.src, double(h.aux2) / h.aux, h.aux);
          break;
      }
    }
  }

  //! The congestion report a STOP or BITMAP carries, taken before the record itself.
  void Riding(const DlcpHeader& h) {
    if (!(h.flags & FLAG_RIDING) || h.seq == 0) return;
    stats.feedbacks++;
    Congestion(h.src, double(h.aux2) / h.seq, h.seq);
  }

  RxMsg& RxFor(const DlcpHeader& h) {
    auto [it, fresh] = m_rx.try_emplace(Key(h.src, h.msg));
    RxMsg& r = it->second;
    if (fresh) {
      r.npkts = h.npkts;
      r.required = h.npkts - uint32_t(double(h.aux) / 1e6 * h.npkts + 1e-9);
      r.got.assign(h.npkts, false);
    }
    return r;
  }

  //! Report to `src` what arrived from it since the last report, if one is due (a report also
  //! rides on every STOP and BITMAP for `src`: Control's `riding`).
  void Feedback(uint16_t src) {
    RxCounters& c = m_fb[src];
    Time now = Simulator::Now();
    if (tp.feedbackInterval.IsZero()) {  // DCTCP-like: every feedbackEvery packets
      if (c.received < tp.feedbackEvery) return;
    } else {  // the host agent's timers
      if (c.received == 0) return;
      Time due = c.marked ? tp.feedbackInterval
                 : c.received >= tp.bulkFeedbackPackets && !c.senderAtLine ? tp.bulkFeedbackInterval
                                                                            : tp.cleanFeedbackInterval;
      if (now - c.lastSent < due) return;
    }
    Control(src, FEEDBACK, 0, 0, c.received, c.marked);
    c.received = c.marked = 0;
    c.lastSent = now;
  }

  void OnData(const DlcpHeader& h, bool ce) {
    RxCounters& c = m_fb[h.src];
    c.received++;
    c.marked += ce;
    Feedback(h.src);
    RxMsg& r = RxFor(h);
    Time now = Simulator::Now();
    if (r.complete || h.seq >= r.npkts || r.got[h.seq]) {
      (r.complete ? stats.late : stats.duplicates)++;
      if (r.complete && now - r.lastStop > tp.probeTimeout) {  // the sender missed our STOP
        r.lastStop = now;
        Control(h.src, STOP, h.msg, r.npkts, 0, 0);
      }
      return;
    }
    r.got[h.seq] = true;
    if (r.count++ == 0) r.firstData = now;
    r.lastData = now;
    if (r.count >= r.required)
      Complete(h.src, h.msg, r);
    else if (h.flags & FLAG_LAST)  // the end of a pass: answered as a PROBE is
      EndOfPass(h.src, h.msg, r);
  }

  void Complete(uint16_t src, uint32_t msg, RxMsg& r) {
    r.complete = true;
    r.answer.Cancel();
    r.lastStop = Simulator::Now();
    stats.messagesReceived++;
    stats.packetsAtCompletion += r.npkts;
    stats.missingAtCompletion += r.npkts - r.count;
    r.got.clear();
    r.got.shrink_to_fit();
    Control(src, STOP, msg, r.npkts, 0, 0, 0, 255, 0, true);
    if (log)
      *log << "done " << rank << " " << src << " " << msg << " " << Simulator::Now().GetSeconds() << " " << r.npkts
           << " " << r.npkts - r.count << "\n";
    if (onReceived) onReceived(src, msg);
  }

  void OnProbe(const DlcpHeader& h) {
    RxMsg& r = RxFor(h);
    if (r.complete) {
      r.lastStop = Simulator::Now();
      Control(h.src, STOP, h.msg, r.npkts, 0, 0);
      return;
    }
    EndOfPass(h.src, h.msg, r);
  }

  void EndOfPass(uint16_t src, uint32_t msg, RxMsg& r) {
    if (r.npkts > 0 && r.required == 0) {  // nothing required: complete on the probe
      Complete(src, msg, r);
      return;
    }
    if (!r.answer.IsPending()) Answer(src, msg);
  }

  //! How long the message must be quiet before an end of pass is answered (answer_grace).
  Time Grace(const RxMsg& r) const {
    double pace = r.pace >= 0 ? r.pace : r.count >= 2 ? (r.lastData - r.firstData).GetSeconds() / (r.count - 1) : -1;
    if (tp.answerGaps <= 0 || pace < 0) return tp.answerIdle;
    return std::max(tp.answerIdle, std::min(tp.answerGraceMax, Seconds(tp.answerGaps * pace)));
  }

  //! BITMAP once no data of the message arrived for answerIdle.
  void Answer(uint16_t src, uint32_t msg) {
    auto it = m_rx.find(Key(src, msg));
    if (it == m_rx.end() || it->second.complete) return;
    RxMsg& r = it->second;
    Time quiet = r.lastData + Grace(r);
    if (quiet > Simulator::Now()) {
      r.answer = Simulator::Schedule(quiet - Simulator::Now(), &DlcpHost::Answer, this, src, msg);
      return;
    }
    if (r.pace < 0 && r.count >= 2) r.pace = (r.lastData - r.firstData).GetSeconds() / (r.count - 1);
    uint32_t id = bitmaps->next++;
    bitmaps->bits[id] = r.got;
    Control(src, BITMAP, msg, r.npkts, id, 0, (r.npkts + 7) / 8, 255, 0, true);
  }
};

}  // namespace ns3
