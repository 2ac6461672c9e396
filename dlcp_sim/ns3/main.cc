// dlcp-sim: one scenario of `dlcp sim` (dlcp_sim/scenario.py writes it, dlcp_sim/run.py reads
// what this prints). Builds a leaf-spine of ns-3 point-to-point links, with switches below IP
// (a LeafSpineSwitch on every leaf and spine, a DlcpPortQueue on every port, dlcp-switch.h)
// and hosts with ns-3's IP stack, a DlcpPortQueue on their NIC and a DlcpHost (a TcpGradHost
// with `transport tcp`), runs the jobs' iterations and prints one line per fact:
//   iter <job> <worker> <iteration> <start_s> <compute_end_s> <end_s>
//   port <switch> <port> <enqueued> <tail_drops> <marks> <max_depth> <selective drops by class 0..7>
//   host <rank> <data_sent> <retransmitted> <duplicates> <probes> <bitmaps> <control_sent>
//        <messages_received> <packets_at_completion> <missing_at_completion> <late> <reports>
//        (transport tcp: data segments and retransmitted segments; the rest 0)
//   done <receiver> <sender> <message> <time_s> <packets> <missing>   (a message completed)
//   flow <id> <src> <dst> <bytes> <start_s> <end_s>          (a background flow completed)
//   unfinished <id> <bytes> <queued_by_sender> <received>    (one that did not, at the end)
//   sim <simulated_s> <events> <wall_s>
// Message ids: ps: iteration * 2B + b for the push of bucket b, + B for its pull (B buckets);
// ring of n: (iteration * 2(n-1) + step) * B + b.
// The scenario file has one `key value...` line per setting (see scenario.py).
#include <chrono>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>

#include "background.h"
#include "dlcp-host.h"
#include "dlcp-switch.h"
#include "host-routing.h"
#include "tcp-host.h"
#include "ns3/core-module.h"
#include "ns3/internet-module.h"
#include "ns3/network-module.h"
#include "ns3/point-to-point-module.h"
#include "ns3/traffic-control-module.h"

using namespace ns3;

NS_OBJECT_ENSURE_REGISTERED(DlcpPortQueue);

namespace {

uint32_t g_workersLeft = 0;  // workers still iterating
BackgroundTraffic g_background;

//! The simulation ends once every worker finished its iterations and every background flow
//! completed (so each flow's completion time is known).
void MaybeStop() {
  if (g_workersLeft == 0 && g_background.Left() == 0) Simulator::Stop();
}

struct Scenario {
  uint32_t leaves = 2, spines = 2, hostsPerLeaf = 4;
  std::string linkRate = "10Gbps", uplinkRate = "10Gbps";
  double linkDelayUs = 1;
  uint32_t mtu = 1500;  // every link's; DLCP datagrams fill it, TCP segments are mtu - 40
  DlcpPortPolicy port;
  LbMode lb = LbMode::FLOW;
  TransportParams tp;
  bool tcpGradients = false;  // transport tcp: gradients over TCP connections (TcpGradHost)
  std::string gradientTcp = "dctcp";  // their congestion control
  uint32_t iterations = 1;
  double computeS = 0;
  double stopS = 60;
  uint32_t seed = 0;  // varies the flow hashes (which flows collide) and ns-3's random streams
  std::string tcp = "dctcp";  // the background flows' TCP: dctcp, cubic or newreno
  double tcpMinRtoUs = 5000;
  uint32_t tcpAckEvery = 2;  // a receiver ACKs every this many segments (ns-3's DelAckCount)
  uint32_t padToBytes = 0;  // packet_slots: a packet bound for an uplink is padded to this many bytes
  uint32_t padByBytes = 0, padMinBytes = 0;  // wire_framing: ... padded by this many, to at least that many
  std::vector<BgFlow> flows;
  std::vector<MsgPlan> buckets;
  std::vector<double> ready;  // ps: when each bucket is full, fraction of the compute time
  struct Job {
    bool ring = false;
    uint32_t server = 0;  // ps only
    std::vector<uint32_t> workers;
    double pushBound, pullBound;
  };
  std::vector<Job> jobs;
};

[[noreturn]] void Fail(const std::string& why) {
  std::cerr << "dlcp-sim: " << why << std::endl;
  std::exit(2);
}

std::vector<uint8_t> Digits(const std::string& s) {
  std::vector<uint8_t> v(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '7') Fail("a bucket's priorities and classes are digits 0-7");
    v[i] = uint8_t(s[i] - '0');
  }
  return v;
}

Scenario Parse(std::istream& in) {
  Scenario sc;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string key;
    if (!(ls >> key) || key[0] == '#') continue;
    if (key == "leaves") ls >> sc.leaves;
    else if (key == "spines") ls >> sc.spines;
    else if (key == "hosts_per_leaf") ls >> sc.hostsPerLeaf;
    else if (key == "link_rate") ls >> sc.linkRate;
    else if (key == "uplink_rate") ls >> sc.uplinkRate;
    else if (key == "link_delay_us") ls >> sc.linkDelayUs;
    else if (key == "mtu") ls >> sc.mtu;
    else if (key == "buffer") ls >> sc.port.buffer;
    else if (key == "ecn_threshold") ls >> sc.port.ecnThreshold;
    else if (key == "ecn_backlog") {
      std::string b;
      ls >> b;
      if (b != "port" && b != "ahead") Fail("ecn_backlog: port or ahead, got " + b);
      sc.port.ecnOnPort = b == "port";
    }
    else if (key == "priority_map") {
      for (auto& q : sc.port.priorityMap) {
        unsigned v = 0;
        ls >> v;
        q = uint8_t(v & 7);
      }
    } else if (key == "drop_thresholds") {
      uint32_t t;
      while (ls >> t) sc.port.dropThresholds.push_back(t);
      if (!ls.eof()) Fail("drop_thresholds: expected packet counts: " + line);
      ls.clear();
    } else if (key == "lb") {
      std::string m;
      ls >> m;
      sc.lb = m == "flow" ? LbMode::FLOW : m == "random" ? LbMode::RANDOM : LbMode::ROUND_ROBIN;
    } else if (key == "datagram") ls >> sc.tp.datagram;
    else if (key == "control_bytes") ls >> sc.tp.controlBytes;
    else if (key == "line_rate") ls >> sc.tp.lineRate;
    else if (key == "initial_rate") ls >> sc.tp.initialRate;
    else if (key == "min_rate") ls >> sc.tp.minRate;
    else if (key == "additive_increase") ls >> sc.tp.additiveIncrease;
    else if (key == "gain") ls >> sc.tp.gain;
    else if (key == "initial_alpha") ls >> sc.tp.initialAlpha;
    else if (key == "bulk_feedback_packets") ls >> sc.tp.bulkFeedbackPackets;
    else if (key == "feedback_interval_us" || key == "bulk_feedback_interval_us" ||
             key == "clean_feedback_interval_us") {
      double us;
      ls >> us;
      (key == "feedback_interval_us"        ? sc.tp.feedbackInterval
       : key == "bulk_feedback_interval_us" ? sc.tp.bulkFeedbackInterval
                                            : sc.tp.cleanFeedbackInterval) = MicroSeconds(us);
    }
    else if (key == "feedback_every") ls >> sc.tp.feedbackEvery;
    else if (key == "burst_bytes") ls >> sc.tp.burstBytes;
    else if (key == "cut_per_window") ls >> sc.tp.cutPerWindow;
    else if (key == "cut_hold_answers") ls >> sc.tp.cutHoldAnswers;
    else if (key == "cut_hold_min_us" || key == "initial_answer_us") {
      double us;
      ls >> us;
      (key == "cut_hold_min_us" ? sc.tp.cutHoldMin : sc.tp.initialAnswer) = MicroSeconds(us);
    }
    else if (key == "slow_start") ls >> sc.tp.slowStart;
    else if (key == "last_flag") ls >> sc.tp.lastFlag;
    else if (key == "last_packets") ls >> sc.tp.lastPackets;
    else if (key == "answer_gaps") ls >> sc.tp.answerGaps;
    else if (key == "answer_grace_max_us" || key == "probe_delay_min_us" || key == "probe_delay_max_us") {
      double us;
      ls >> us;
      (key == "answer_grace_max_us" ? sc.tp.answerGraceMax
       : key == "probe_delay_min_us" ? sc.tp.probeDelayMin
                                     : sc.tp.probeDelayMax) = MicroSeconds(us);
    }
    else if (key == "top_priority") {
      unsigned v;
      ls >> v;
      sc.tp.topPriority = uint8_t(v);
    } else if (key == "cut_interval_us" || key == "answer_idle_us" || key == "probe_timeout_us") {
      double us;
      ls >> us;
      (key == "cut_interval_us" ? sc.tp.cutInterval : key == "answer_idle_us" ? sc.tp.answerIdle : sc.tp.probeTimeout) =
          MicroSeconds(us);
    } else if (key == "pad_to_bytes") {
      ls >> sc.padToBytes;
    } else if (key == "pad_by_bytes") {
      ls >> sc.padByBytes;
    } else if (key == "pad_min_bytes") {
      ls >> sc.padMinBytes;
    } else if (key == "host_delay_us") {
      double us;
      ls >> us;
      sc.tp.hostDelay = MicroSeconds(us);
    } else if (key == "increase_interval_us" || key == "max_increase_span_us") {
      double us;
      ls >> us;
      (key == "increase_interval_us" ? sc.tp.increaseInterval : sc.tp.maxIncreaseSpan) = MicroSeconds(us);
    } else if (key == "transport") {
      std::string t;
      ls >> t;
      if (t != "dlcp" && t != "tcp") Fail("transport: dlcp or tcp");
      sc.tcpGradients = t == "tcp";
    } else if (key == "gradient_tcp") {
      ls >> sc.gradientTcp;
      if (sc.gradientTcp != "dctcp" && sc.gradientTcp != "cubic" && sc.gradientTcp != "newreno")
        Fail("gradient_tcp: dctcp, cubic or newreno");
    } else if (key == "iterations") ls >> sc.iterations;
    else if (key == "compute_s") ls >> sc.computeS;
    else if (key == "stop_s") ls >> sc.stopS;
    else if (key == "seed") ls >> sc.seed;
    else if (key == "tcp") {
      ls >> sc.tcp;
      if (sc.tcp != "dctcp" && sc.tcp != "cubic" && sc.tcp != "newreno") Fail("tcp: dctcp, cubic or newreno");
    } else if (key == "tcp_min_rto_us") ls >> sc.tcpMinRtoUs;
    else if (key == "tcp_ack_every") ls >> sc.tcpAckEvery;
    else if (key == "flow") {
      BgFlow fl;
      ls >> fl.id >> fl.src >> fl.dst >> fl.bytes >> fl.start;
      if (fl.id != sc.flows.size() || fl.bytes == 0 || fl.start < 0) Fail("flow: ids in order from 0, bytes > 0, start >= 0");
      sc.flows.push_back(fl);
    }
    else if (key == "ready") {
      double f;
      while (ls >> f) {
        if (f < 0 || f > 1) Fail("ready: fractions of the compute time, 0..1");
        sc.ready.push_back(f);
      }
      if (!ls.eof()) Fail("ready: expected fractions: " + line);
      ls.clear();
    } else if (key == "bucket") {
      MsgPlan b;
      std::string pr, cl;
      ls >> b.npkts >> pr >> cl;
      b.priority = Digits(pr);
      b.dropClass = Digits(cl);
      if (b.npkts == 0 || b.priority.size() != b.npkts || b.dropClass.size() != b.npkts)
        Fail("bucket: need npkts > 0 and one priority and one class digit per packet");
      b.Order();
      sc.buckets.push_back(std::move(b));
    } else if (key == "job") {
      Scenario::Job j;
      std::string pattern;
      size_t n;
      ls >> pattern >> j.pushBound >> j.pullBound;
      if (pattern == "ps")
        ls >> j.server;
      else if (pattern != "ring")
        Fail("job: the pattern is ps or ring, not '" + pattern + "'");
      j.ring = pattern == "ring";
      ls >> n;
      if (n == 0 || n > 4096) Fail("job: 1..4096 workers");
      j.workers.resize(n);
      for (auto& w : j.workers) ls >> w;
      sc.jobs.push_back(std::move(j));
    } else
      Fail("unknown scenario key '" + key + "'");
    if (ls.fail()) Fail("bad value on scenario line: " + line);
  }
  uint32_t hosts = sc.leaves * sc.hostsPerLeaf;
  if (sc.leaves == 0 || sc.spines == 0 || sc.hostsPerLeaf == 0 || sc.leaves > 250 || sc.hostsPerLeaf > 250 ||
      sc.spines > 250)
    Fail("leaves, spines and hosts_per_leaf must be 1..250");
  if (sc.buckets.empty() || sc.jobs.empty()) Fail("a scenario needs buckets and jobs");
  if (sc.mtu < 576 || sc.mtu > 65535 || sc.tp.datagram + 28 > sc.mtu)
    Fail("mtu: 576..65535 bytes, and a datagram (plus 28 bytes of IP and UDP) must fit it");
  for (auto& fl : sc.flows)
    if (fl.src >= hosts || fl.dst >= hosts || fl.src == fl.dst) Fail("flow: source and destination are two hosts");
  for (auto& j : sc.jobs) {
    if (!j.ring && j.server >= hosts) Fail("job: server beyond the hosts");
    for (auto w : j.workers)
      if (w >= hosts || (!j.ring && w == j.server)) Fail("job: a worker beyond the hosts or equal to the server");
    if (j.ring && (j.workers.size() < 2 || sc.buckets.size() % j.workers.size() != 0))
      Fail("job ring: at least 2 workers, and one bucket line per chunk (buckets x workers)");
    size_t fused = j.ring ? sc.buckets.size() / j.workers.size() : sc.buckets.size();
    if (!sc.ready.empty() && sc.ready.size() != fused) Fail("ready: one fraction per fused bucket");
  }
  return sc;
}

//! A parameter-server job: workers push every bucket, the server pulls each bucket back to all
//! workers once every worker's push of it completed; an iteration ends when all pulls did.
struct PsJob {
  uint32_t id;
  Scenario::Job spec;
  const Scenario* sc;
  std::vector<Ptr<GradientHost>> hosts;  // by rank
  std::map<uint64_t, uint32_t> pushes;
  std::vector<std::vector<uint32_t>> pulls;  // [worker][iteration]
  std::vector<double> start, computed;

  uint32_t B() const { return sc->buckets.size(); }
  uint32_t Msg(uint32_t it, bool pull, uint32_t b) const { return it * 2 * B() + (pull ? B() : 0) + b; }
  //! (sender, receiver) of every message the job sends.
  std::vector<std::pair<uint32_t, uint32_t>> Pairs() const {
    std::vector<std::pair<uint32_t, uint32_t>> out;
    for (auto w : spec.workers) out.insert(out.end(), {{w, spec.server}, {spec.server, w}});
    return out;
  }

  //! Backward takes computeS; bucket b leaves once it is full (sc->ready[b] of the way through,
  //! as the testbed agent sends it), all at the end without ready fractions.
  void Begin(uint32_t w, uint32_t it) {
    start[w] = Simulator::Now().GetSeconds();
    computed[w] = start[w] + sc->computeS;
    for (uint32_t b = 0; b < B(); ++b) {
      double at = sc->computeS * (sc->ready.empty() ? 1.0 : sc->ready[b]);
      Simulator::Schedule(Seconds(at), [this, w, it, b]() {
        hosts[spec.workers[w]]->Send(spec.server, Msg(it, false, b), &sc->buckets[b], spec.pushBound, false);
      });
    }
  }

  void Wire() {
    pulls.assign(spec.workers.size(), std::vector<uint32_t>(sc->iterations, 0));
    start.assign(spec.workers.size(), 0);
    computed.assign(spec.workers.size(), 0);
    hosts[spec.server]->onReceived = [this](uint16_t, uint32_t msg) {
      uint32_t it = msg / (2 * B()), b = msg % B();
      if (++pushes[uint64_t(it) * B() + b] == spec.workers.size())
        for (auto w : spec.workers) hosts[spec.server]->Send(w, Msg(it, true, b), &sc->buckets[b], spec.pullBound, false);
    };
    for (uint32_t w = 0; w < spec.workers.size(); ++w) {
      hosts[spec.workers[w]]->onReceived = [this, w](uint16_t, uint32_t msg) {
        uint32_t it = msg / (2 * B());
        if (++pulls[w][it] < B()) return;
        std::cout << "iter " << id << " " << w << " " << it << " " << start[w] << " " << computed[w] << " "
                  << Simulator::Now().GetSeconds() << "\n";
        if (it + 1 < sc->iterations)
          Begin(w, it + 1);
        else {
          --g_workersLeft;
          MaybeStop();
        }
      };
    }
  }
};

//! A ring-allreduce job as the testbed agent runs it: every bucket is reduced by its own ring
//! (dlcp_torch.DLCPState runs RingAllreduce per bucket, concurrently), started once the
//! backward pass has filled it (sc->ready). For a bucket, member i sends to member i+1 one
//! chunk per step, 2(n-1) steps (reduce-scatter at the push bound, then all-gather at the pull
//! bound). As hostagent.exchange.RingAllreduce does, a step's send is released by the
//! completion of the previous step's receive (the chunk it adds to, or forwards), inside the
//! transport (no host delay), without waiting for the previous send's answer; a member's
//! iteration ends when every receive and every send of every bucket completed. The
//! scenario's buckets are the chunks, bucket-major: chunk c of bucket b is sc->buckets[b * n + c].
struct RingJob {
  uint32_t id;
  Scenario::Job spec;
  const Scenario* sc;
  std::vector<Ptr<GradientHost>> hosts;  // by rank
  struct Member {
    uint32_t it = 0, finished = 0;      // buckets whose ring is done this iteration
    std::vector<bool> ready;            // per bucket: the backward pass filled it (step 0 went)
    std::vector<uint32_t> received, sent;  // per bucket: steps received, sends completed
    std::set<uint32_t> got;             // messages received not yet acted on (a neighbour may run ahead)
    double start = 0, computed = 0;
  };
  std::vector<Member> members;
  std::vector<MsgPlan> chunks;  // sc->buckets, each ranked by its bucket's most urgent packet (Rank)

  uint32_t N() const { return spec.workers.size(); }
  //! A chunk's rank among a sender's messages is its bucket's (RingAllreduce ranks every chunk
  //! by its bucket's top priority, its packets keeping their layers' tags: a chunk holding only a
  //! bucket's least urgent layers would otherwise sink behind every other bucket's steps, and the
  //! ring's next step waits for it).
  void Rank() {
    chunks = sc->buckets;
    for (uint32_t b = 0; b < B(); ++b) {
      uint8_t top = 0;
      for (uint32_t c = 0; c < N(); ++c) top = std::max(top, chunks[b * N() + c].rank);
      for (uint32_t c = 0; c < N(); ++c) chunks[b * N() + c].Order(top);
    }
  }
  uint32_t Steps() const { return 2 * (N() - 1); }
  uint32_t B() const { return sc->buckets.size() / N(); }
  uint32_t Msg(uint32_t it, uint32_t step, uint32_t b) const { return (it * Steps() + step) * B() + b; }
  std::vector<std::pair<uint32_t, uint32_t>> Pairs() const {
    std::vector<std::pair<uint32_t, uint32_t>> out;
    for (uint32_t i = 0; i < N(); ++i) out.push_back({spec.workers[i], spec.workers[(i + 1) % N()]});
    return out;
  }

  void Begin(uint32_t i, uint32_t it) {
    Member& m = members[i];
    m.it = it;
    m.finished = 0;
    m.ready.assign(B(), false);
    m.received.assign(B(), 0);
    m.sent.assign(B(), 0);
    m.start = Simulator::Now().GetSeconds();
    m.computed = m.start + sc->computeS;
    for (uint32_t b = 0; b < B(); ++b) {
      double at = sc->computeS * (sc->ready.empty() ? 1.0 : sc->ready[b]);
      Simulator::Schedule(Seconds(at), [this, i, b, it]() {
        Member& mm = members[i];
        if (mm.it != it) return;
        mm.ready[b] = true;
        // Handed to the transport by the application: the host's software path, for step 0 and
        // for the steps that receives which came before the bucket was ready release at once.
        Step(i, b, 0, false);
        for (uint32_t s = 0; s < Steps(); ++s) Take(i, b, s, false);
      });
    }
  }

  void Step(uint32_t i, uint32_t b, uint32_t s, bool chained) {
    Member& m = members[i];
    uint32_t n = N();
    bool gather = s >= n - 1;
    uint32_t c = gather ? (i + 1 + n - (s - (n - 1)) % n) % n : (i + n - s % n) % n;
    hosts[spec.workers[i]]->Send(spec.workers[(i + 1) % n], Msg(m.it, s, b), &chunks[b * n + c],
                                 gather ? spec.pullBound : spec.pushBound, chained);
  }

  //! Act on the receive of step `s` of bucket `b` if it came and the bucket is ready: it
  //! releases the send of step s + 1 (`chained`: inside the transport).
  void Take(uint32_t i, uint32_t b, uint32_t s, bool chained) {
    Member& m = members[i];
    if (!m.ready[b]) return;
    auto got = m.got.find(Msg(m.it, s, b));
    if (got == m.got.end()) return;
    m.got.erase(got);
    m.received[b]++;
    if (s + 1 < Steps()) Step(i, b, s + 1, chained);
    Done(i, b);
  }

  void Done(uint32_t i, uint32_t b) {
    Member& m = members[i];
    if (m.received[b] < Steps() || m.sent[b] < Steps()) return;
    if (++m.finished < B()) return;
    std::cout << "iter " << id << " " << i << " " << m.it << " " << m.start << " " << m.computed << " "
              << Simulator::Now().GetSeconds() << "\n";
    if (m.it + 1 < sc->iterations)
      Begin(i, m.it + 1);
    else {
      --g_workersLeft;
      MaybeStop();
    }
  }

  void Wire() {
    members.assign(N(), Member{});
    Rank();
    for (uint32_t i = 0; i < N(); ++i) {
      hosts[spec.workers[i]]->onReceived = [this, i](uint16_t, uint32_t msg) {
        members[i].got.insert(msg);
        uint32_t per = Steps() * B(), it = msg / per, s = (msg % per) / B();
        if (it == members[i].it) Take(i, msg % B(), s, true);
      };
      hosts[spec.workers[i]]->onSent = [this, i](uint16_t, uint32_t msg) {
        Member& m = members[i];
        uint32_t b = msg % B();
        if (msg / (Steps() * B()) == m.it && ++m.sent[b] == Steps()) Done(i, b);
      };
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) Fail("usage: dlcp-sim SCENARIO_FILE");
  std::ifstream f(argv[1]);
  if (!f) Fail(std::string("cannot read ") + argv[1]);
  Scenario sc = Parse(f);
  std::cout.precision(9);
  auto wall0 = std::chrono::steady_clock::now();

  // Every link carries the scenario's MTU (ns-3's default, 1500, would fragment jumbo datagrams).
  Config::SetDefault("ns3::PointToPointNetDevice::Mtu", UintegerValue(sc.mtu));
  // TCP (background flows, the tcp scheme): full-size segments (the MTU less the IP and TCP
  // headers), a data-centre minimum RTO (ns-3's default is 1 s), and no timestamp option: ns-3
  // builds an option object for it in every segment it sends and parses (15 % of the
  // simulator's instructions with background traffic); its RTT samples then come from segments
  // not retransmitted (Karn), and with a 5 ms minimum RTO in a fabric of microseconds the RTO
  // is the minimum either way.
  Config::SetDefault("ns3::TcpSocket::SegmentSize", UintegerValue(sc.mtu - 40));
  Config::SetDefault("ns3::TcpSocketBase::Timestamp", BooleanValue(false));
  Config::SetDefault("ns3::TcpSocketBase::MinRto", TimeValue(MicroSeconds(sc.tcpMinRtoUs)));
  // ns-3's SYN and zero-window-probe timers default to 3 s and 6 s: one lost SYN or window
  // update would stall a flow for seconds in a fabric whose round trip is microseconds.
  Config::SetDefault("ns3::TcpSocket::ConnTimeout", TimeValue(MicroSeconds(sc.tcpMinRtoUs)));
  Config::SetDefault("ns3::TcpSocket::PersistTimeout", TimeValue(MicroSeconds(sc.tcpMinRtoUs)));
  // ns-3 gives a connection up after 6 unanswered SYNs or 6 timeouts in a row, which from a
  // 5 ms RTO, doubling, is 0.3 s; Linux, from 1 s, waits minutes. A background flow starved
  // behind a whole ResNet-50 iteration under strict priority must wait, not fail.
  Config::SetDefault("ns3::TcpSocket::ConnCount", UintegerValue(15));
  Config::SetDefault("ns3::TcpSocket::DataRetries", UintegerValue(15));
  // The delayed ACK (200 ms by default) must be shorter than the RTO: otherwise a sender with
  // one segment in flight (after a timeout) waits out the RTO for every segment, as the
  // receiver holds its ACK for a second segment that never comes.
  Config::SetDefault("ns3::TcpSocket::DelAckTimeout", TimeValue(MicroSeconds(sc.tcpMinRtoUs / 5)));
  Config::SetDefault("ns3::TcpSocket::DelAckCount", UintegerValue(sc.tcpAckEvery));
  // TIME_WAIT lasts 2 MSL, 240 s by default: every closed background connection would keep its
  // endpoint for the whole simulation, and ns-3 finds a packet's socket by scanning a host's
  // endpoints one by one, so the cost of every segment grew with the flows already finished
  // (a tenth of the 144-host target's time). 2 x 1 ms still outlasts any segment in a fabric
  // whose round trip is microseconds.
  Config::SetDefault("ns3::TcpSocketBase::MaxSegLifetime", DoubleValue(1e-3));
  Config::SetDefault("ns3::TcpL4Protocol::SocketType",
                     TypeIdValue(sc.tcp == "dctcp"   ? TcpDctcp::GetTypeId()
                                 : sc.tcp == "cubic" ? TcpCubic::GetTypeId()
                                                     : TcpNewReno::GetTypeId()));
  if (sc.tcp == "dctcp") {
    Config::SetDefault("ns3::TcpSocketBase::UseEcn", EnumValue(TcpSocketState::On));
    // Without SACK, as the tcp scheme's DCTCP (tcp-host.h says why): with it, ns-3 3.44 aborted
    // on an assertion in DupAck when background DCTCP flows were starved at 80 % load.
    Config::SetDefault("ns3::TcpSocketBase::Sack", BooleanValue(false));
  }

  uint32_t H = sc.leaves * sc.hostsPerLeaf;
  NodeContainer hosts, leaves, spines;
  hosts.Create(H);
  leaves.Create(sc.leaves);
  spines.Create(sc.spines);

  InternetStackHelper stack;  // on hosts only: switches forward below IP (dlcp-switch.h)
  RngSeedManager::SetRun(sc.seed + 1);
  stack.SetRoutingHelper(HostRoutingHelper());
  stack.Install(hosts);

  PointToPointHelper p2p, p2pUp;  // host links, leaf-spine links
  p2p.SetDeviceAttribute("DataRate", StringValue(sc.linkRate));
  p2p.SetChannelAttribute("Delay", TimeValue(MicroSeconds(sc.linkDelayUs)));
  p2pUp.SetDeviceAttribute("DataRate", StringValue(sc.uplinkRate));
  p2pUp.SetChannelAttribute("Delay", TimeValue(MicroSeconds(sc.linkDelayUs)));
  // Every port's queue, switch or host, is a DlcpPortQueue set on the device itself, so a port
  // picks the next packet by band only when the link is free. A host's NIC takes the scheme's
  // bands and never drops (DLCP's transport paces it; TCP's window bounds what it queues).
  DlcpPortPolicy hostPort;
  hostPort.priorityMap = sc.port.priorityMap;
  hostPort.buffer = 1u << 24;
  auto portQueue = [](Ptr<NetDevice> dev, const DlcpPortPolicy& policy) {
    auto q = CreateObject<DlcpPortQueue>();
    q->SetMaxSize(QueueSize(QueueSizeUnit::PACKETS, 1u << 24));  // admission is the policy's
    q->policy = policy;
    DynamicCast<PointToPointNetDevice>(dev)->SetQueue(q);
    return q;
  };

  struct SwitchPort {
    std::string name;
    uint32_t port;
    Ptr<DlcpPortQueue> q;
  };
  std::vector<SwitchPort> ports;
  std::vector<std::vector<Ptr<NetDevice>>> leafDown(sc.leaves), leafUp(sc.leaves), spineDown(sc.spines);
  // Host j of leaf l hangs off the leaf's port j+1 and is 10.l.j.2; leaf l's uplink to spine s
  // is its port hosts_per_leaf+s+1 and the spine's port l+1.
  TrafficControlHelper noQueueDisc;
  for (uint32_t h = 0; h < H; ++h) {
    uint32_t l = h / sc.hostsPerLeaf, j = h % sc.hostsPerLeaf;
    NetDeviceContainer d = p2p.Install(leaves.Get(l), hosts.Get(h));
    std::ostringstream base;
    base << "10." << l << "." << j << ".0";
    Ipv4AddressHelper addr;
    addr.SetBase(base.str().c_str(), "255.255.255.0", "0.0.0.2");
    addr.Assign(NetDeviceContainer(d.Get(1)));
    noQueueDisc.Uninstall(d.Get(1));  // the default queue disc Assign installs: the NIC queues
    portQueue(d.Get(1), hostPort);
    ports.push_back({"l" + std::to_string(l + 1), j + 1, portQueue(d.Get(0), sc.port)});
    leafDown[l].push_back(d.Get(0));
  }
  for (uint32_t s = 0; s < sc.spines; ++s)
    for (uint32_t l = 0; l < sc.leaves; ++l) {
      NetDeviceContainer d = p2pUp.Install(leaves.Get(l), spines.Get(s));
      ports.push_back({"l" + std::to_string(l + 1), sc.hostsPerLeaf + s + 1, portQueue(d.Get(0), sc.port)});
      ports.push_back({"sp" + std::to_string(s + 1), l + 1, portQueue(d.Get(1), sc.port)});
      leafUp[l].push_back(d.Get(0));
      spineDown[s].push_back(d.Get(1));
    }
  // The spine a leaf picks per flow depends on a salt per switch and seed (which flows collide).
  auto salt = [&](Ptr<Node> n) { return (n->GetId() + 1) * 2654435761u ^ (sc.seed * 0x85ebca6bu); };
  std::vector<Ptr<LeafSpineSwitch>> switches;
  for (uint32_t l = 0; l < sc.leaves; ++l)
    switches.push_back(Create<LeafSpineSwitch>(leaves.Get(l), SwitchRole{SwitchRole::LEAF, l}, leafDown[l],
                                               leafUp[l], sc.lb, salt(leaves.Get(l)), sc.padToBytes,
                                               sc.padByBytes, sc.padMinBytes));
  for (uint32_t s = 0; s < sc.spines; ++s)
    switches.push_back(Create<LeafSpineSwitch>(spines.Get(s), SwitchRole{SwitchRole::SPINE, s},
                                               spineDown[s], std::vector<Ptr<NetDevice>>{}, sc.lb,
                                               salt(spines.Get(s))));

  std::vector<Ipv4Address> peers(H);
  for (uint32_t h = 0; h < H; ++h) {
    std::ostringstream a;
    a << "10." << h / sc.hostsPerLeaf << "." << h % sc.hostsPerLeaf << ".2";
    peers[h] = Ipv4Address(a.str().c_str());
  }
  auto store = std::make_shared<BitmapStore>();
  auto frames = std::make_shared<TcpFrames>();
  std::vector<Ptr<GradientHost>> apps(H);
  std::vector<Ptr<TcpGradHost>> tcpApps;
  for (uint32_t h = 0; h < H; ++h) {
    if (sc.tcpGradients) {
      auto a = CreateObject<TcpGradHost>();
      a->payload = sc.tp.datagram - DlcpHeader::SIZE;
      a->hostDelay = sc.tp.hostDelay;
      a->frames = frames;
      a->congestionControl = sc.gradientTcp == "dctcp"   ? TcpDctcp::GetTypeId()
                             : sc.gradientTcp == "cubic" ? TcpCubic::GetTypeId()
                                                         : TcpNewReno::GetTypeId();
      a->ecn = sc.gradientTcp == "dctcp";
      frames->hosts.push_back(PeekPointer(a));
      tcpApps.push_back(a);
      apps[h] = a;
    } else {
      auto a = CreateObject<DlcpHost>();
      a->tp = sc.tp;
      a->bitmaps = store;
      apps[h] = a;
    }
    apps[h]->rank = uint16_t(h);
    apps[h]->peers = peers;
    apps[h]->log = &std::cout;
    hosts.Get(h)->AddApplication(apps[h]);
    apps[h]->SetStartTime(Seconds(0));
  }
  std::vector<std::unique_ptr<PsJob>> psJobs;
  std::vector<std::unique_ptr<RingJob>> ringJobs;
  auto start = [&](auto job, uint32_t i) {
    job->id = i;
    job->spec = sc.jobs[i];
    job->sc = &sc;
    job->hosts = apps;
    job->Wire();
    if (sc.tcpGradients)  // connections open before training, as a framework's rendezvous does
      for (auto [src, dst] : job->Pairs())
        Simulator::Schedule(Seconds(0), [&tcpApps, src, dst]() { tcpApps[src]->Prepare(dst); });
    g_workersLeft += job->spec.workers.size();
    for (uint32_t w = 0; w < job->spec.workers.size(); ++w)
      Simulator::Schedule(MicroSeconds(1), [job, w]() { job->Begin(w, 0); });
  };
  for (uint32_t i = 0; i < sc.jobs.size(); ++i) {
    if (sc.jobs[i].ring) {
      ringJobs.push_back(std::make_unique<RingJob>());
      start(ringJobs.back().get(), i);
    } else {
      psJobs.push_back(std::make_unique<PsJob>());
      start(psJobs.back().get(), i);
    }
  }

  g_background.flows = sc.flows;
  for (uint32_t h = 0; h < H; ++h) {
    g_background.hosts.push_back(hosts.Get(h));
    g_background.addrs.push_back(peers[h]);
  }
  g_background.onDone = [](const BgFlow& f) {
    std::cout << "flow " << f.id << " " << f.src << " " << f.dst << " " << f.bytes << " " << f.start << " " << f.end
              << "\n";
    MaybeStop();
  };
  g_background.Install();

  Simulator::Stop(Seconds(sc.stopS));
  Simulator::Run();
  double simulated = Simulator::Now().GetSeconds();
  uint64_t events = Simulator::GetEventCount();
  for (auto& sw : switches)
    if (sw->unroutable) Fail("a switch received packets addressed to no host: the topology is miswired");

  for (auto& p : ports) {
    const DlcpPortStats& s = p.q->stats;
    std::cout << "port " << p.name << " " << p.port << " " << s.enqueued << " " << s.tailDrops << " " << s.marks << " "
              << s.maxDepth;
    for (auto d : s.selectiveDrops) std::cout << " " << d;
    std::cout << "\n";
  }
  for (uint32_t h = 0; h < H; ++h) {
    const HostStats& s = apps[h]->stats;
    std::cout << "host " << h << " " << s.dataSent << " " << s.retransmitted << " " << s.duplicates << " " << s.probes
              << " " << s.bitmaps << " " << s.controlSent << " " << s.messagesReceived << " " << s.packetsAtCompletion
              << " " << s.missingAtCompletion << " " << s.late << " " << s.reports << "\n";
  }
  g_background.ReportUnfinished(std::cout);
  double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  std::cout << "sim " << simulated << " " << events << " " << wall << std::endl;
  Simulator::Destroy();
  return 0;
}
