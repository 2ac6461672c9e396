// The compiled per-packet path of a DLCP endpoint: everything that happens once per packet.
//
// Two threads of its own, which never take Python's interpreter lock:
//  * rx: receives datagrams in batches (recvmmsg, UDP GRO), applies the configured loss
//    injection, validates every header field and the message token, places each payload by
//    its offset into the message's destination (or adds it in, for reductions), keeps the
//    per-message bitmap and counters, parks early data of authenticated senders, measures
//    what it drains while behind, and accounts socket overruns to senders;
//  * tx: of all messages with packets left, sends the one whose next packet has the highest
//    priority (retransmissions first), paced per destination by a token bucket at the rate
//    Python sets and by a host pacer, by UDP GSO where the kernel takes it (sendmmsg
//    otherwise); builds the headers and, when a message becomes ready, its drop classes (a
//    large message's, packet by packet as they first leave: hostagent.policy.class_sample).
//
// Python keeps the policy, the protocol (completion under the bound, probes, bitmaps,
// feedback, rate decisions: hostagent.protocol) and the API. It learns what happened through
// events (an eventfd it selects on) and per-message progress, and it owns every buffer this
// code reads or writes: a buffer stays alive until the call that retires its message returns.
//
// Chaining: a received message may name sends that wait ("held") until it completes; they then
// start from this code at once, so a ring's next step leaves without a round trip through Python.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <netinet/in.h>

#include "endpass.h"
#include "layout.h"
#include "pacer.h"
#include "seal.h"
#include "tags.h"

namespace dlcp {

// Why a datagram was rejected; the same names and order as dlcp.hostagent.protocol.port.REASONS
// (tests/unit/test_port_codes.py reads this enum and Datapath::rejected's names).
enum Reason : uint8_t {
    OK = 0, TRUNCATED, BAD_VERSION, NOT_DATA, WRONG_JOB, BAD_TOKEN, UNKNOWN_MESSAGE, WRONG_DTYPE, BAD_SEQ,
    BAD_OFFSET, COUNT_MISMATCH, STALE, BAD_MAC, REPLAY, N_REASONS
};

// What happened, for the protocol core (Python reads them as tuples; the values of
// dlcp.hostagent.protocol.port.EventKind, checked by tests/unit/test_port_codes.py).
enum EventKind : uint8_t {
    EV_RX_DONE = 1,     // peer=src: the message completed here (a = 1 exact, 2 bounded after recovery)
    EV_RX_LAST = 2,     // a packet ending the sender's pass arrived: answer as to a PROBE
    EV_RX_RETX = 3,     // a = retransmitted packets that arrived in one batch
    EV_CONGESTION = 4,  // peer=src: first CE mark or overrun since its last feedback
    EV_TX_PASS = 5,     // peer=dest: a sending pass ended (a = pass number)
    EV_TX_ACTIVE = 6,   // peer=dest: a held message started (its trigger fired)
    EV_FAILED = 7,      // a thread of the data path failed and stopped (a = 0 receive, 1 send): failure() says why
    EV_TX_STOP = 8,     // peer=dest: its receiver's data path took every packet and said so (a = elements held)
};

// How a received message completed (finish_locked's `how`, EV_RX_DONE's `a`; the values of
// dlcp.hostagent.protocol.port.DONE_HOW and STOP_SENT, checked by tests/unit/test_port_codes.py).
// RX_BY_CORE: the protocol core completed it (no event: it knows). RX_EXACT_STOPPED: every
// packet came and this data path sent the sender its STOP datagram (send_stop), so the core
// sends no STOP record.
enum DoneHow : int { RX_EXACT = 1, RX_BOUNDED = 2, RX_BY_CORE = 3, RX_EXACT_STOPPED = 4 };

struct Event {
    uint8_t kind;
    uint16_t peer;
    uint32_t message_id;
    double time;
    int64_t a;
};

struct Config {
    HeaderLayout layout;
    uint8_t version = 2, data_ptype = 1, credit_ptype = 9, flag_retx = 1, flag_last = 4, flag_release = 8;
    uint8_t stop_ptype = 4;  // STOP datagrams (on_stop, send_stop); 0: none are sent
    uint32_t last_packets = 3;  // a pass's final packets that carry flag_last (wire.LAST_PACKETS)
    std::map<uint8_t, Kind> kinds;  // wire dtype code -> element kind
    uint32_t job_id = 0;
    uint16_t rank = 0;
    int rx_fd = -1;            // the bound UDP data socket (Python owns and closes it)
    bool gro = false;          // UDP_GRO is on for rx_fd
    bool offload = true;       // UDP GSO for sends
    uint32_t max_datagram = 0;  // widest valid datagram (header + a full float32 payload + trailer)
    Protect protect = Protect::MAC;  // what every datagram's trailer does (seal.h)
    uint32_t rx_batch = 2048;   // most datagrams in one receive batch
    uint32_t batch_bytes = 1 << 21;  // a batch also ends after this many bytes
    int socket_buffer = 16 << 20;
    uint32_t park_limit = 16384;
    // credits (receiver-driven flow control)
    uint32_t initial_window = 256;  // packets a sender may have unconsumed before its first credit
    double credit_timeout = 0.02;   // a sender held this long without a credit assumes its packets lost
    double credit_quiet = 0.005;    // a sender quiet this long is credited what it has consumed
    uint32_t credit_share = 16, min_window = 8, max_window = 65535;  // credit_window's terms
    // policy
    uint8_t top_priority = 7;
    std::vector<uint8_t> dscp;
    std::vector<double> shares;
    Magnitude magnitude = Magnitude::L2;
    // a message of at least this many elements has its magnitudes computed by this many
    // threads (hostagent.policy.PARALLEL_MAGNITUDE_ELEMS, magnitude_threads)
    uint64_t parallel_magnitude_elems = 4000000;
    uint32_t magnitude_threads = 1;
    ClassSampling class_sampling;  // which packets set a message's class boundaries (policy's)
    // pacing
    double line_rate = 1.25e9;
    double burst_bytes = 256 * 1024;
    double pacing_slack = 0;  // a deficit up to rate x this leaves on credit (RateConfig.pacing_slack)
    double max_inline_wait = 0.0005;
    // Events that only set later deadlines (EV_TX_PASS, EV_TX_ACTIVE) wake the control thread
    // this long after they happen, with whatever came meanwhile, rather than at once
    // (TransportConfig.probe_delay_min: no deadline they set is sooner); a pass's end to a
    // destination whose probe delay the control thread gave (set_probe_delay) that long after it,
    // when its PROBE is due. Why: a pass's end is usually followed within a round trip by its
    // receiver's STOP, which wakes the thread anyway; on loopback a 57 MB all_reduce woke it
    // five times a call for a pass end alone.
    double event_defer = 0.001;
    // loss injection (receiver side)
    std::vector<double> drop_p;
    double delay = 0, delay_p = 0;
    bool reorder = false;
    uint64_t seed = 0;
    // end of pass (endpass.h's rule, settings from hostagent.protocol.incoming): a message past its
    // bound whose last packet came completes once no data of it came for its grace;
    // answer_grace is the reordering window's start (below)
    double answer_grace = 0.002;
    AnswerRule answer;
    // the reordering window (settings: hostagent.protocol.incoming.REORDER_*): answer_grace until a
    // path is measured; a first-pass packet that comes `late` after its message's LAST widens
    // it to margin * late; every `persist` passes in a row that ended without one narrow it by
    // decay, to min
    double reorder_min = 0.0002, reorder_margin = 1.25, reorder_decay = 0.9;
    uint32_t reorder_persist = 16;
    // freshness per sender (settings: hostagent.protocol.incoming.FRESH_*): message ids set up remembered,
    // and how far behind the newest iteration set up from a sender a finished use is stale
    uint32_t fresh_window = 512, fresh_kept = 1 << 16;
    // drain meter (drain_batch; settings and why: hostagent.ratecontrol.DRAIN_*)
    double drain_stretch = 0.005, drain_min_bytes = 256 * 1024, drain_fresh = 0.5, behind_backlog = 0.5;
    // data to rank r at priority q leaves from source_port_base + 8 r + q (0: an ephemeral port),
    // so flow-hashing switches give every run with one base the same paths
    uint16_t source_port_base = 0;
};

// Buffers of one received message; Python allocates them and keeps them alive.
struct RxSpec {
    uint16_t src = 0;
    uint32_t message_id = 0;
    uint32_t token = 0;
    uint32_t iteration = 0;     // its packets carry it (another is an earlier use of the id: stale)
    uint8_t dtype = 0;          // wire code
    uint64_t total_elems = 0;
    uint32_t per = 1;
    uint8_t* out = nullptr;     // destination: wire kind (place); float32 or wire kind (accumulate)
    bool accumulate = false;
    uint8_t out_dtype = 0;      // wire code of out's elements (accumulate: float32's, or the wire's)
    uint64_t out_bytes = 0;
    uint8_t* received = nullptr;    // bool per packet
    uint8_t* pkt_priority = nullptr;
    int64_t* pkt_layer = nullptr;
    uint64_t required_elems = 0;
    std::vector<std::pair<uint16_t, uint32_t>> triggers;  // held sends to start at completion
    float scale = 1.0f;  // accumulate (float32 into float32): out = out * scale + payload, and
                         // out * scale where no packet came, at completion
    bool classify = true;  // the triggers classify by magnitude: each placed packet's is computed for them
};

struct TxSpec {
    uint16_t dest = 0;
    uint32_t message_id = 0;
    const uint8_t* payload = nullptr;
    uint64_t payload_bytes = 0;             // what payload holds: at least the message
    uint8_t dtype = 0;
    uint64_t total_elems = 0;
    uint32_t per = 1;
    uint32_t token = 0, iteration = 0, tensor_id = 0, layer = 0;
    uint8_t priority = 0;
    const uint8_t* pkt_priority = nullptr;  // per packet, or null: `priority` for all
    const uint16_t* pkt_layer = nullptr;    // per packet, or null: `layer` for all
    uint8_t* drop_class_out = nullptr;      // filled when the message becomes ready (sampled: as each packet leaves)
    uint8_t* snapshot = nullptr;            // if set: the payload is copied here when ready and sent from it
    uint64_t snapshot_bytes = 0;            // what snapshot holds: at least the message
    bool held = false;
    uint64_t order = 0;
    bool tags_given = false;  // drop_class_out already holds the classes
};

struct Progress {
    uint32_t received_pkts = 0;
    uint64_t received_elems = 0;
    uint32_t duplicates = 0;
    uint32_t retx_seen = 0;
    double first_arrival = 0, last_arrival = 0;
    int state = 0;  // 0 receiving, 1 exact, 2 bounded, 3 completed by Python
    uint32_t gaps = 0;  // first-pass packets skipped below the highest of their level (filled or not)
    bool operator==(const Progress& o) const {
        return received_pkts == o.received_pkts && received_elems == o.received_elems &&
               duplicates == o.duplicates && retx_seen == o.retx_seen && first_arrival == o.first_arrival &&
               last_arrival == o.last_arrival && state == o.state && gaps == o.gaps;
    }
};

// A credit the receive side decided to grant (due_credits): sealed, for the caller to send to
// `rank`'s data address; what it says is kept beside for credit_sent and for tests.
struct CreditOut {
    uint16_t rank = 0;
    uint32_t window = 0;       // packets the sender may have unconsumed
    uint64_t consumed = 0;     // its packets we took from the socket (or count as never coming)
    bool release = false;      // RELEASE: what was sent and not consumed was lost
    bool overrun = false, lost = false;  // why a release: our socket dropped datagrams / its packets stopped
    std::vector<uint8_t> bytes;  // the sealed datagram
};

struct TxInfo {
    uint32_t packets = 0, next_pos = 0, retransmissions = 0, pass_no = 0;
    bool active = false, held = false;
};

class Datapath {
  public:
    explicit Datapath(Config cfg);
    ~Datapath();
    void start();
    void stop();
    void close();  // stop, then close the event fd: nothing of this object is usable afterwards
    int event_fd() const { return event_fd_; }
    int deferred_event_fd() const { return defer_fd_; }  // a timerfd: deferred events are due (see event_defer)
    void emit_for_test(uint8_t kind, uint16_t peer, uint32_t mid, double t, int64_t a) { emit(kind, peer, mid, t, a); }
    std::vector<Event> take_events();

    // peers
    void add_peer(uint16_t rank, const std::string& ipv4, uint16_t port);
    void set_rx_key(uint16_t rank, const std::string& key);  // empty: not authenticated
    void set_tx_key(uint16_t rank, const std::string& key);  // the key ``rank`` gave us: signs our credits

    // receive side
    void expect(const RxSpec& spec);
    bool progress(uint16_t src, uint32_t mid, Progress& out);
    // Every received message whose progress differs from what the previous call returned for it
    // (a message expected since: always), so a caller that polls often builds no objects for
    // messages that did not move.
    std::vector<std::tuple<uint16_t, uint32_t, Progress>> progress_changed();
    bool complete(uint16_t src, uint32_t mid, bool fire);  // false if not receiving (already done)
    void forget(uint16_t src, uint32_t mid, bool remember);
    void expire_parked(double older_than);
    void take_feedback(uint16_t src, uint64_t& received, uint64_t& ce, uint64_t& lost);
    int active_senders(double now, double window);
    double drain_rate(double now);
    // Every datagram that reached the host before this time (monotonic s) has been read and
    // placed: the receive thread's kernel arrival stamps, the time it last found the socket
    // empty, or now if the socket is empty and no read is being placed.
    double rx_seen_until();
    double reorder_window(uint16_t src);  // the grace's floor for messages from src (s)
    // first-pass packets missing between the lowest and highest received of their priority
    // level, sorted (empty: unknown, finished, or none)
    std::vector<uint32_t> holes(uint16_t src, uint32_t mid);

    // send side
    void submit(const TxSpec& spec);
    uint32_t retransmit(uint16_t dest, uint32_t mid, const std::vector<uint32_t>& seqs);
    // queue the packets of seqs that the first pass has sent and that are not queued already,
    // ahead of the rest of the pass, without a new pass (holes reported before its end)
    uint32_t resend(uint16_t dest, uint32_t mid, const std::vector<uint32_t>& seqs);
    bool tx_info(uint16_t dest, uint32_t mid, TxInfo& out);
    void retire(uint16_t dest, uint32_t mid);  // stop sending; returns once no thread reads its buffers
    void set_rate(uint16_t dest, double rate);
    void set_probe_delay(uint16_t dest, double s);  // see Config::event_defer
    uint64_t sent_packets(uint16_t dest);
    // set an option on the data socket to `dest` for `priority` (made now if need be): a real
    // fault for tests (SO_NO_CHECK makes the kernel refuse GSO), a knob for experiments
    void set_sockopt(uint16_t dest, uint8_t priority, int level, int name, int value);

    std::map<std::string, int64_t> stats();
    // Why a thread of the data path failed (empty: none did). A thread catches everything it
    // raises (std::bad_alloc, a thread that cannot start, ...), records it here, emits EV_FAILED
    // and stops: the endpoint fails its messages with that reason; the process goes on.
    std::string failure();
    // Make the receive (1) or the send (2) thread raise std::bad_alloc at its next turn, as an
    // allocation that fails there would: for tests of the above.
    void fault_for_test(int where);
    // Hold the receive (1) or send (2) lock from a thread of its own, as a data path thread
    // holds it for a batch, until release_lock_for_test() or `timeout` s; returns once held.
    // release_lock_for_test() says whether it was still held (false: it timed out first).
    void hold_lock_for_test(int which, double timeout);
    bool release_lock_for_test();
    std::map<std::string, int64_t> rejected();
    std::map<int, int64_t> injected_drops();
    std::vector<std::tuple<int, int, int>> data_sockets();  // (dest, priority, local port)
    std::vector<std::string> gso_off_reasons();

    // one batch through validation and placement, for tests and start-up calibration
    std::vector<uint8_t> ingest_for_test(const uint8_t* rows, const int64_t* lengths, size_t n, size_t width,
                                         double now);
    // The receive thread's per-packet rules on a clock the caller gives, no socket needed (tests):
    // the credits due at `now` with every datagram before `seen_until` read, for a socket of
    // `socket_memory` bytes (0: as measured), each taken as sent; returns when the next falls
    // due (0: none) in `wake`.
    std::vector<CreditOut> credits_for_test(double now, double seen_until, uint32_t socket_memory, double& wake);
    // `reads` socket-buffer entries read, the socket's drop counter read as `overflow` (< 0: no
    // count came): overruns blamed on senders (account_reads).
    void account_reads_for_test(uint64_t reads, int64_t overflow, double now) {
        std::lock_guard<std::mutex> g(rx_mu_);
        account_reads(reads, overflow, now);
    }
    // one receive batch for the drain meter: begun at `started`, `nbytes` read, `behind` (more queued)
    void drain_batch_for_test(double started, uint64_t nbytes, bool behind, double now) {
        drain_batch(started, nbytes, behind, now);
    }

  private:
    // ---- receive state
    struct RxMsg {
        RxSpec spec;
        Kind kind;       // wire element kind
        int itemsize;
        Kind out_kind;   // element kind of the destination (differs from kind only when accumulating)
        uint32_t total_pkts, n_full, tail;
        Progress prog;
        // evidence of loss: first-pass packets leave by priority level and, within a level, in
        // sequence order, and a level is one run of sequence numbers (layers are contiguous): so
        // per level, missing packets between the lowest and highest received are holes (the
        // short last packet, which leaves ahead of its run, is not counted as the highest)
        uint32_t lvl_min[8], lvl_max[8], lvl_count[8];
        uint32_t holes_blamed = 0;
        RxMsg() {
            for (int i = 0; i < 8; ++i) { lvl_min[i] = UINT32_MAX; lvl_max[i] = 0; lvl_count[i] = 0; }
        }
        int64_t gaps() const {
            int64_t h = 0;
            for (int i = 0; i < 8; ++i)
                if (lvl_count[i]) h += int64_t(lvl_max[i]) - int64_t(lvl_min[i]) + 1 - int64_t(lvl_count[i]);
            return h;
        }
        int64_t holes() const { return gaps() - int64_t(holes_blamed); }
        Progress progress() const {
            Progress p = prog;
            p.gaps = uint32_t(std::max<int64_t>(0, gaps()));
            return p;
        }
        Progress reported;            // what progress_changed() last returned for it
        bool was_reported = false;
        // per batch
        uint32_t batch_new = 0, batch_retx = 0;
        bool batch_last = false;
        double batch_first_at = 0, batch_last_at = 0;  // arrival times of its packets in the batch
        bool in_batch = false;
        bool last_seen = false;  // the pass's LAST packet came (or a resend of it)
        double last_at = 0;      // when the first LAST came (0: none yet)
        bool late = false;       // a first-pass packet came after a LAST: the path reorders
        bool watched = false;    // in ends_ (past its bound, waiting out its grace)
        double watched_at = 0;   // since when (the batch that made it so)
        // the L2 magnitude of each packet as placed (float32 messages that start sends): the
        // send that forwards the same elements takes them instead of reading them back
        std::vector<float> mags;
    };
    struct Parked {
        double time;
        std::vector<uint8_t> bytes;
    };
    struct SenderFb {
        uint64_t received = 0, ce = 0, lost = 0;
        double last_seen = -1;
        bool wake_sent = false;
        bool authed = false;
        uint8_t key[16];
        uint64_t parked = 0;
        double good_since = 0;  // accepted datagrams since the last overrun was accounted
        // credits we grant this sender: its packets taken from the socket, and as of the last credit
        uint64_t consumed = 0, credited = 0;
        uint32_t credit_seq = 0;
        double last_credit = -1;  // when we last credited it
        bool overrun = false;     // our socket dropped datagrams since its last credit
        double last_arrival = -1;  // the arrival stamp of its latest packet
        bool released = false;     // a RELEASE credit went since its latest packet (release_due)
        bool has_tx_key = false;
        uint8_t tx_key[16];
        // the receive thread's openers and sealers (seal.h): the key of the sender's direction
        // checks what it sends us (data and credits); the key of ours seals the credits we grant it
        std::unique_ptr<Sealer> opener, credit_sealer;
        double reorder = -1;  // the reordering window measured on its path (s; < 0: none yet)
        uint32_t clean_passes = 0;  // passes in a row that ended with nothing after (narrow_window)
        bool has_newest = false;
        uint32_t newest = 0;  // the newest iteration of its messages set up here (freshness)
    };
    struct Use {  // the iteration a message id was last set up with, and when (fresh_kept)
        uint32_t iteration;
        uint64_t order;
    };

    // ---- send state
    struct Sock {
        int fd = -1;
        bool gso = false;
        std::string gso_off;
    };
    struct Dest {
        uint16_t rank;
        sockaddr_in addr{};
        double rate = 0;
        Pacer pacer;
        std::map<uint8_t, Sock> socks;
        std::atomic<uint64_t> sent{0};
        // the window this destination grants us (its credits): packets sent beyond `acked`
        uint64_t acked = 0;
        uint32_t window = 256, credit_seq = 0;
        double held_since = -1;  // when the window last filled (the credit timeout runs from there)
    };
    struct TxMsg {
        TxSpec spec;
        Kind kind;
        int itemsize;
        uint32_t n_pkts = 0, n_full = 0, tail = 0;
        uint32_t datagram_bytes = 0;
        std::vector<uint8_t> hdr;  // n_pkts header rows
        std::vector<uint32_t> send_order;
        std::vector<uint32_t> position;  // of each packet in send_order (made by the first resend)
        std::vector<uint8_t> prio_in_order;  // empty when every packet has one priority
        uint32_t next_pos = 0;
        std::vector<uint32_t> retx;
        size_t retx_pos = 0;
        uint32_t retransmissions = 0;
        uint32_t pass_no = 0;
        bool prepared = false, held = false, stopped = false, busy = false, queued = false;
        const uint8_t* src = nullptr;  // payload or snapshot
        // magnitudes of its packets handed over by the receive that started it (same elements,
        // same packets), where that receive placed the packet (given_have); empty: none
        std::vector<float> given_mags;
        std::vector<uint8_t> given_have;
        // classes at send time (a large message's boundaries came from a sample): each
        // packet's class is computed as it first leaves; `classed` says which have one
        std::vector<float> boundaries;
        std::vector<uint8_t> classed;
        int sending_priority() const;
        int lowest_priority() const;  // of the first pass's last packet
        int queue_priority() const;  // its place among messages (reorder_locked)
        bool has_packets() const { return !stopped && !held && (next_pos < n_pkts || retx_pos < retx.size()); }
    };

    void rx_loop();
    void tx_loop();
    // the threads' bodies: the loops above, with every exception caught and reported (fail)
    void rx_main();
    void tx_main();
    void fail(const char* thread, const char* what);
    void emit(uint8_t kind, uint16_t peer, uint32_t mid, double t, int64_t a);
    // receive helpers (rx_mu_ held)
    // ``at``: when the datagram reached the host (its read's kernel stamp; < 0: ``now``)
    uint8_t ingest_one(const uint8_t* d, uint32_t len, bool ce, double now, std::vector<RxMsg*>& touched,
                       double at = -1);
    // Check a datagram's trailer (seal.h), decrypting in place, then ingest_one it without the
    // trailer; a datagram that fails is counted (bad_mac) and nothing of it is used.
    uint8_t ingest_sealed(uint8_t* d, uint32_t len, bool ce, double now, std::vector<RxMsg*>& touched,
                          double at = -1);
    uint8_t on_credit(const uint8_t* d, uint32_t len, double now);
    uint8_t check_from_receiver(const uint8_t* d, uint32_t len);  // a CREDIT's or STOP's checks; counts a rejection
    // A STOP datagram from a receiver of ours: the message it names (and its iteration) ends
    // here as a STOP record would end it (on_stop; rx_mu_ held). send_stop sends one for a
    // message this path completed with every packet: whether it left.
    uint8_t on_stop(const uint8_t* d, uint32_t len, double now);
    bool send_stop(const RxMsg* m);
    // The credits due now (the rules hostagent/datapath/credits.py describes; rx_mu_ held), sealed, into `out`;
    // returns when the next falls due (0: none waits). credit_sent() records one that left.
    double due_credits(double now, double seen_until, std::vector<CreditOut>& out);
    void credit_sent(const CreditOut& c, double now);
    // due_credits, each sent from credit_fd_ (the receive thread's shell around the rule)
    double send_credits(double now);
    // Overrun accounting after a batch of `reads` socket-buffer entries (rx_mu_ held): when the
    // socket's drop counter moved, the drops are blamed on senders by their share of the reads,
    // at most the holes their messages show
    void account_reads(uint64_t reads, int64_t overflow, double now);
    bool window_full(Dest* d, double now, double& wait);
    void end_batch(std::vector<RxMsg*>& touched, double now);
    void finish_locked(RxMsg* m, int how, bool fire, double now);
    // The magnitude of packet seq's payload (the policy's rule), read from the message's source.
    float packet_magnitude(const TxMsg* m, uint32_t seq) const;
    // send side: give the packets `seqs` of a message whose classes wait for its sending
    // their class (header and drop_class_out), from their magnitudes (m->busy, unlocked)
    void classify(TxMsg* m, const std::vector<uint32_t>& seqs);
    // the message sent to dest as mid (null: none), after checking that every seq is one of its
    // packets (std::invalid_argument naming `caller` if not); tx_mu_ held
    TxMsg* find_tx_locked(uint16_t dest, uint32_t mid, const std::vector<uint32_t>& seqs, const char* caller);
    // Complete the watched messages whose grace ran out (rx_mu_ held); returns the next due
    // time (0: none). ``seen_until``: every datagram that arrived before it has been read.
    double end_passes(double now, double seen_until);
    // src's reordering window (rx_mu_ held): answer_grace until measured; widened by a
    // first-pass packet `late` s after its LAST, narrowed by a run of clean passes (the rule
    // hostagent.protocol.incoming describes at REORDER_MIN)
    double& window_of(uint16_t src);
    void widen_window(uint16_t src, double late);
    void narrow_window(uint16_t src);

   public:
    double end_passes_for_test(double now, double seen_until) {  // the receive thread's check, on a given clock
        std::lock_guard<std::mutex> g(rx_mu_);
        return end_passes(now, seen_until);
    }

   private:
    void replay_parked(uint64_t key, double now);
    // a token-valid datagram of (src, mid) from `iteration` that belongs to no message being
    // received was recorded earlier (the rule hostagent.protocol.incoming describes at FRESH_WINDOW; rx_mu_ held)
    bool stale(uint16_t src, uint32_t mid, uint32_t iteration);
    void drop_parked(uint16_t src);  // every datagram parked for src (rx_mu_ held)
    void fire_triggers(const std::vector<std::pair<uint16_t, uint32_t>>& triggers, double now,
                       const RxMsg* from = nullptr);
    void drain_batch(double started, uint64_t nbytes, bool behind, double now);
    // send helpers
    // What preparing a message makes (headers, order, classes): computed by the send thread
    // without tx_mu_ (m->busy), then installed under it, as resend() and pick() read them under it.
    struct Prepared {
        std::vector<uint8_t> hdr;
        std::vector<uint32_t> send_order;
        std::vector<uint8_t> prio_in_order;
        std::vector<float> boundaries;
        std::vector<uint8_t> classed;
    };
    Prepared prepare(const TxMsg* m);
    void install_locked(TxMsg* m, Prepared&& p);
    TxMsg* pick(double now, double& wait);
    void activate_locked(TxMsg* m);
    void reorder_locked();
    std::pair<uint32_t, uint64_t> send_packets(TxMsg* m, Sock& s, Sealer& sealer, const std::vector<uint32_t>& seqs,
                                                 bool retx, uint32_t marks);  // marks: of them carry LAST
    Sock& sock_for(Dest& d, uint8_t priority);
    uint64_t sendmmsg_plain(Sock& s, std::vector<struct iovec>& iov, size_t first, size_t count, uint32_t& sent);

    Config cfg_;
    int H_;
    std::atomic<bool> running_{false};
    std::atomic<int> fault_{0};  // fault_for_test
    struct LockHold {  // hold_lock_for_test
        std::thread thread;
        std::mutex mu;
        std::condition_variable cv;
        bool held = false, release = false, timed_out = false;
    };
    std::unique_ptr<LockHold> hold_;
    std::mutex fail_mu_;
    std::string failure_;  // (fail_mu_)
    int event_fd_ = -1;
    std::thread rx_thread_, tx_thread_;

    std::mutex ev_mu_;
    std::vector<Event> events_;
    int defer_fd_ = -1;           // timerfd armed by the first deferred event (event_defer)
    bool ev_signalled_ = false;   // (ev_mu_) event_fd_ written since the last take_events
    bool defer_armed_ = false;    // (ev_mu_) defer_fd_ armed since the last take_events
    double defer_due_ = 0;        // (ev_mu_) when it fires (monotonic s), while armed
    std::unordered_map<uint16_t, double> probe_delay_;  // (ev_mu_) set_probe_delay's

    // receive
    std::mutex rx_mu_;
    std::unordered_map<uint64_t, RxMsg*> rx_;
    std::vector<uint64_t> ends_;  // keys of messages past their bound after their LAST
    std::list<uint64_t> done_order_;
    std::unordered_set<uint64_t> done_;
    std::unordered_map<uint64_t, std::vector<Parked>> parked_;
    std::unordered_map<uint64_t, Use> used_;  // freshness: message ids set up, oldest first in used_order_
    std::deque<std::pair<uint64_t, uint64_t>> used_order_;
    uint64_t uses_ = 0;
    std::map<uint16_t, SenderFb> fb_;
    std::unordered_set<uint64_t> fired_;  // triggers that fired before their send was submitted
    std::atomic<double> rx_seen_until_{0.0};
    std::mutex read_mu_;  // held by the receive thread from a read until its datagrams are placed
    std::map<uint16_t, sockaddr_in> peer_addr_;  // peers' data addresses (set before start)
    int credit_fd_ = -1;
    std::vector<CreditOut> credit_out_;  // the receive thread's credits of one turn (send_credits)
    uint32_t rcvbuf_ = 0;
    double reads_since_ = 0;  // reads (socket-buffer entries) since the last overrun was accounted
    std::mt19937_64 rng_;
    std::vector<std::pair<double, std::vector<uint8_t>>> delayed_;
    // drain meter
    double drain_rate_ = 0, drain_measured_at_ = 0, drain_since_ = -1;
    uint64_t drain_bytes_ = 0;

    // send
    std::mutex tx_mu_;
    std::condition_variable tx_cv_;
    std::map<uint16_t, Dest*> dests_;
    std::unordered_map<uint64_t, TxMsg*> tx_;
    std::vector<TxMsg*> active_;
    Pacer host_pacer_;
    std::vector<uint8_t> scratch_hdr_;
    // the send thread's sealer per destination (seal.h; tx_mu_): replaced by a new key, kept
    // alive by the send in progress that holds it
    std::map<uint16_t, std::shared_ptr<Sealer>> tx_sealers_;
    std::vector<uint8_t> scratch_trailers_, scratch_ct_;  // (the send thread's)

    // counters
    std::atomic<int64_t> data_pkts_sent_{0}, data_bytes_sent_{0}, retransmitted_pkts_{0}, send_errors_{0},
        gso_calls_{0};
    // (rx_mu_ held)
    int64_t data_pkts_received_ = 0, data_bytes_received_ = 0, ce_marked_ = 0, parked_total_ = 0, late_ = 0,
            rx_overflows_ = 0, rx_dropped_estimate_ = 0, rx_dropped_reads_ = 0,
            accepted_ = 0, duplicates_ = 0, parked_now_ = 0, credits_sent_ = 0, credits_received_ = 0,
            stops_sent_ = 0, stops_received_ = 0, overrun_credits_sent_ = 0, loss_releases_sent_ = 0;
    // counted by the receive thread between reads, outside rx_mu_ (stats() reads them any time)
    std::atomic<int64_t> rx_reads_{0}, gro_reads_{0}, injected_delays_{0};
    std::atomic<int64_t> credit_waits_{0}, credit_timeouts_{0}, max_in_flight_{0}, max_window_{0};
    int64_t rejected_[N_REASONS] = {};
    std::map<int, int64_t> injected_drops_;
};

}  // namespace dlcp
