// The receive half of the compiled data path: batches, validation, placement, parking,
// overrun accounting and the drain meter. See datapath.h for the division of labour.
#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <new>

#include <linux/udp.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "datapath.h"
#include "f32_loops.h"

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif
#ifndef SO_RXQ_OVFL
#define SO_RXQ_OVFL 40
#endif
#ifndef SO_MEMINFO
#define SO_MEMINFO 55
#endif

namespace dlcp {

namespace {

// A payload placed into its message's buffer (a message that is not a sum: an all-gather's, a
// broadcast's). With `stream`, from 4 KB up on x86-64, with streaming stores (SSE2, every x86-64
// has them): they write whole lines to memory without first reading what the destination held,
// where a plain copy reads each line of the destination before writing it. Why: the destination
// is a tensor of tens of MB, not in cache, so the plain copy (libc's memcpy) read as many bytes
// as it wrote: 4.2 of a rank's 46 CPU ms in a 4-rank 57 MB all_reduce. Not for a message a
// chained send reads next (its triggers: the ring's all-gather forwards all but its last
// chunk): that send tags the bytes as it reads them, at memory's pace if streaming left them
// out of cache (measured: streaming everything 44.8 ms per rank and call, only messages
// without triggers 43.9, never 46.2; bench/cpu_profile.py, docs/results/backend.md). The
// sfence orders the streamed lines before whatever tells another thread the slot is filled
// (the receive lock's release).
void place_payload(uint8_t* dst, const uint8_t* src, size_t n, bool stream) {
#if defined(__x86_64__)
    if (stream && n >= 4096) {
        size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
        std::memcpy(dst, src, head);
        size_t i = head;
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
            __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
            __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
            __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
            _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
            _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
            _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
            _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
        }
        std::memcpy(dst + i, src + i, n - i);
        _mm_sfence();
        return;
    }
#endif
    std::memcpy(dst, src, n);
}

// Datagram reads per recvmmsg. Each batch is opened, checked and placed under rx_mu_ while it is
// still in cache: 8 reads of up to a GRO super-datagram each (512 KB) fit a core's L2, where 64
// (4 MB) did not, and the lock is held an eighth as long (the control thread waits on it).
// Measured: a 4-process 57 MB all_reduce through the backend took 120.5 ms with 8, 122.0 with 16
// and 127.0 with 64 (5 interleaved rounds; docs/results/backend.md, 2026-11-30).
constexpr int READS = 8;
constexpr size_t READ_BYTES = 65536 + 512;  // one read: a whole GRO super-datagram
constexpr size_t DONE_KEPT = 4096;      // finished messages remembered (their late packets are not malformed)

inline uint64_t key_of(uint16_t src, uint32_t mid) { return (uint64_t(src) << 32) | mid; }

// a comes before b among 32-bit iterations (serial number arithmetic, RFC 1982)
inline bool before(uint32_t a, uint32_t b) { return int32_t(a - b) < 0; }

// Whether no datagram waits in the UDP socket `fd`. Not FIONREAD (or SIOCINQ, the same call):
// for UDP it is the length of the *first* queued datagram, so an empty datagram ahead of others
// reads 0. A non-blocking peek of one byte fails with EAGAIN only when the queue is empty (an
// empty datagram peeks as 0 bytes); any other error says nothing, so it is not "empty".
bool socket_empty(int fd) {
    uint8_t b;
    ssize_t r = ::recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

// Add ``count`` 2-byte elements of ``payload`` into ``dst`` of the same type: each pair added in
// float and rounded back (a float16 or bfloat16 sum, as numpy and torch make it).
template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void add_rounded(uint16_t* dst, const uint8_t* payload, uint32_t count) {
    for (uint32_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, payload + 2 * i, 2);
        dst[i] = FromFloat(ToFloat(dst[i]) + ToFloat(h));
    }
}
}  // namespace

void Datapath::set_probe_delay(uint16_t dest, double s) {
    std::lock_guard<std::mutex> g(ev_mu_);
    probe_delay_[dest] = std::max(cfg_.event_defer, s);
}

// Wakes the control thread through event_fd_ once per batch; an event that only sets a later
// deadline (a pass's end, a held send that started) arms defer_fd_ instead, for when that
// deadline is due (Config::event_defer), so that it usually leaves with the event that follows
// it (its receiver's STOP).
void Datapath::emit(uint8_t kind, uint16_t peer, uint32_t mid, double t, int64_t a) {
    std::lock_guard<std::mutex> g(ev_mu_);
    events_.push_back(Event{kind, peer, mid, t, a});
    if (ev_signalled_) return;
    bool deferred = (kind == EV_TX_PASS || kind == EV_TX_ACTIVE) && cfg_.event_defer > 0 && defer_fd_ >= 0;
    if (deferred) {
        auto it = kind == EV_TX_PASS ? probe_delay_.find(peer) : probe_delay_.end();
        double due_at = t + (it != probe_delay_.end() ? it->second : cfg_.event_defer);
        if (defer_armed_ && defer_due_ <= due_at) return;
        itimerspec due{};  // (absolute, on CLOCK_MONOTONIC: the clock of t)
        due.it_value.tv_sec = time_t(due_at);
        due.it_value.tv_nsec = long((due_at - double(due.it_value.tv_sec)) * 1e9);
        if (due.it_value.tv_sec == 0 && due.it_value.tv_nsec == 0) due.it_value.tv_nsec = 1;
        if (::timerfd_settime(defer_fd_, TFD_TIMER_ABSTIME, &due, nullptr) == 0) {
            defer_armed_ = true;
            defer_due_ = due_at;
            return;
        }  // (else: signal at once)
    }
    if (event_fd_ >= 0) {
        uint64_t one = 1;
        ssize_t r = ::write(event_fd_, &one, sizeof one);
        (void)r;
        ev_signalled_ = true;
    }
}

std::vector<Event> Datapath::take_events() {
    std::lock_guard<std::mutex> g(ev_mu_);
    uint64_t v;
    if (ev_signalled_ && event_fd_ >= 0) {
        ssize_t r = ::read(event_fd_, &v, sizeof v);  // reset the eventfd (nonblocking)
        (void)r;
    }
    if (defer_armed_ && defer_fd_ >= 0) {  // disarm, and clear an expiry not yet read
        itimerspec off{};
        ::timerfd_settime(defer_fd_, 0, &off, nullptr);
        ssize_t r = ::read(defer_fd_, &v, sizeof v);
        (void)r;
    }
    ev_signalled_ = defer_armed_ = false;
    std::vector<Event> out;
    out.swap(events_);
    return out;
}

// ------------------------------------------------------------------ Python-facing calls

void Datapath::set_rx_key(uint16_t rank, const std::string& key) {
    std::lock_guard<std::mutex> g(rx_mu_);
    SenderFb& s = fb_[rank];
    bool same = s.authed && key.size() == 16 && std::memcmp(s.key, key.data(), 16) == 0;
    if (!same) drop_parked(rank);  // closed, or a new key: what it parked waits for nothing now
    if (key.size() == 16) {
        std::memcpy(s.key, key.data(), 16);
        s.authed = true;
        if (!s.opener || !s.opener->same_key(s.key)) s.opener.reset(new Sealer(s.key, cfg_.protect));
    } else {
        s.authed = false;
        s.opener.reset();
    }
}

void Datapath::drop_parked(uint16_t src) {
    for (auto it = parked_.begin(); it != parked_.end();) {
        if (uint16_t(it->first >> 32) == src) {
            parked_now_ -= int64_t(it->second.size());
            it = parked_.erase(it);
        } else {
            ++it;
        }
    }
    fb_[src].parked = 0;
}

bool Datapath::stale(uint16_t src, uint32_t mid, uint32_t iteration) {
    auto u = used_.find(key_of(src, mid));
    if (u == used_.end()) return false;  // early data of a message not set up yet
    uint32_t last = u->second.iteration;
    if (iteration != last) return before(iteration, last);  // an earlier use (a later one: early data)
    const SenderFb& s = fb_[src];  // its last use, over: stale once the sender has moved far on
    return s.has_newest && !before(s.newest, iteration) && s.newest - iteration >= cfg_.fresh_window;
}

void Datapath::set_tx_key(uint16_t rank, const std::string& key) {
    std::lock_guard<std::mutex> g(rx_mu_);
    SenderFb& s = fb_[rank];
    s.has_tx_key = key.size() == 16;
    if (s.has_tx_key) std::memcpy(s.tx_key, key.data(), 16);
    // The same key again (a second connection with the peer) keeps its sealers and so their
    // packet numbers: a nonce is never used twice under a key.
    if (!s.has_tx_key) {
        s.credit_sealer.reset();
    } else if (!s.credit_sealer || !s.credit_sealer->same_key(s.tx_key)) {
        s.credit_sealer.reset(new Sealer(s.tx_key, cfg_.protect));
    }
    std::lock_guard<std::mutex> t(tx_mu_);  // (lock order: rx_mu_, then tx_mu_, as on_credit takes them)
    auto it = tx_sealers_.find(rank);
    if (!s.has_tx_key) {
        if (it != tx_sealers_.end()) tx_sealers_.erase(it);
    } else if (it == tx_sealers_.end() || !it->second->same_key(s.tx_key)) {
        tx_sealers_[rank] = std::make_shared<Sealer>(s.tx_key, cfg_.protect);
    }
}

void Datapath::expect(const RxSpec& spec) {
    auto kit = cfg_.kinds.find(spec.dtype);
    if (kit == cfg_.kinds.end()) throw std::invalid_argument("expect: unknown dtype code");
    if (spec.per == 0) throw std::invalid_argument("expect: per must be > 0");
    auto oit = cfg_.kinds.find(spec.out_dtype);
    if (oit == cfg_.kinds.end()) throw std::invalid_argument("expect: unknown out dtype code");
    if (oit->second != kit->second && !(spec.accumulate && oit->second == Kind::F32))
        throw std::invalid_argument("expect: out must have the wire's element type, or float32 to accumulate into");
    if (spec.out_bytes < spec.total_elems * uint64_t(kind_size(oit->second)))
        throw std::invalid_argument("expect: out is smaller than the message");
    if (reinterpret_cast<uintptr_t>(spec.out) % uintptr_t(kind_size(oit->second)) != 0)
        // (a sum is added through a float* or uint16_t* into it)
        throw std::invalid_argument("expect: out is not aligned to its " + std::to_string(kind_size(oit->second)) +
                                    "-byte elements (a view at an odd byte offset?); pass a copy");
    if (spec.scale != 1.0f && !(spec.accumulate && kit->second == Kind::F32 && oit->second == Kind::F32))
        throw std::invalid_argument("expect: a scale needs a float32 message added into float32");
    uint64_t key = key_of(spec.src, spec.message_id);
    double now = now_s();
    std::lock_guard<std::mutex> g(rx_mu_);
    auto old = rx_.find(key);
    if (old != rx_.end()) {
        if (old->second->prog.state == 0)
            throw std::invalid_argument("message " + std::to_string(spec.message_id) + " from rank " +
                                        std::to_string(spec.src) + " is already expected");
        delete old->second;  // finished and not yet forgotten: the id is used again
        rx_.erase(old);
    }
    auto* m = new RxMsg();
    m->spec = spec;
    m->kind = kit->second;
    m->itemsize = kind_size(m->kind);
    m->out_kind = oit->second;
    m->total_pkts = uint32_t((spec.total_elems + spec.per - 1) / spec.per);
    m->n_full = uint32_t(spec.total_elems / spec.per);
    m->tail = uint32_t(spec.total_elems % spec.per);
    if (!spec.triggers.empty() && spec.classify && cfg_.magnitude == Magnitude::L2 &&
        ((m->kind == Kind::F32 && m->out_kind == Kind::F32) || (m->kind == Kind::BF16 && m->out_kind == Kind::BF16)))
        m->mags.assign(m->total_pkts, 0.0f);
    rx_[key] = m;
    done_.erase(key);  // a message id used again (a later iteration)
    // freshness: this id's latest use, and the sender's newest iteration
    used_[key] = Use{spec.iteration, ++uses_};
    used_order_.emplace_back(key, uses_);
    while (used_order_.size() > size_t(cfg_.fresh_kept)) {  // the last fresh_kept set-ups
        auto [k, order] = used_order_.front();
        used_order_.pop_front();
        auto u = used_.find(k);
        if (u != used_.end() && u->second.order == order) used_.erase(u);
    }
    SenderFb& f = fb_[spec.src];
    if (!f.has_newest || before(f.newest, spec.iteration)) {
        f.newest = spec.iteration;
        f.has_newest = true;
    }
    if (m->total_pkts == 0) {
        finish_locked(m, RX_EXACT, true, now);
        return;
    }
    replay_parked(key, now);
}

bool Datapath::progress(uint16_t src, uint32_t mid, Progress& out) {
    std::lock_guard<std::mutex> g(rx_mu_);
    auto it = rx_.find(key_of(src, mid));
    if (it == rx_.end()) return false;
    out = it->second->progress();
    return true;
}

std::vector<std::tuple<uint16_t, uint32_t, Progress>> Datapath::progress_changed() {
    std::lock_guard<std::mutex> g(rx_mu_);
    std::vector<std::tuple<uint16_t, uint32_t, Progress>> out;
    for (auto& kv : rx_) {
        RxMsg* m = kv.second;
        Progress p = m->progress();
        if (m->was_reported && p == m->reported) continue;
        m->reported = p;
        m->was_reported = true;
        out.emplace_back(m->spec.src, m->spec.message_id, p);
    }
    return out;
}

bool Datapath::complete(uint16_t src, uint32_t mid, bool fire) {
    std::lock_guard<std::mutex> g(rx_mu_);
    auto it = rx_.find(key_of(src, mid));
    if (it == rx_.end() || it->second->prog.state != 0) return false;
    finish_locked(it->second, RX_BY_CORE, fire, now_s());
    return true;
}

void Datapath::forget(uint16_t src, uint32_t mid, bool remember) {
    uint64_t key = key_of(src, mid);
    std::lock_guard<std::mutex> g(rx_mu_);
    auto it = rx_.find(key);
    if (it != rx_.end()) {
        delete it->second;
        rx_.erase(it);
    }
    if (remember) {
        if (done_.insert(key).second) {
            done_order_.push_back(key);
            while (done_order_.size() > DONE_KEPT) {
                done_.erase(done_order_.front());
                done_order_.pop_front();
            }
        }
    } else {
        done_.erase(key);
    }
    auto pit = parked_.find(key);
    if (pit != parked_.end()) {
        fb_[src].parked -= pit->second.size();
        parked_now_ -= int64_t(pit->second.size());
        parked_.erase(pit);
    }
}

void Datapath::expire_parked(double older_than) {
    std::lock_guard<std::mutex> g(rx_mu_);
    for (auto it = parked_.begin(); it != parked_.end();) {
        if (!it->second.empty() && it->second.front().time < older_than) {
            fb_[uint16_t(it->first >> 32)].parked -= it->second.size();
            parked_now_ -= int64_t(it->second.size());
            it = parked_.erase(it);
        } else {
            ++it;
        }
    }
}

void Datapath::take_feedback(uint16_t src, uint64_t& received, uint64_t& ce, uint64_t& lost) {
    std::lock_guard<std::mutex> g(rx_mu_);
    SenderFb& s = fb_[src];
    received = s.received;
    ce = s.ce;
    lost = s.lost;
    s.received = s.ce = s.lost = 0;
    s.wake_sent = false;
}

int Datapath::active_senders(double now, double window) {
    std::lock_guard<std::mutex> g(rx_mu_);
    int n = 0;
    for (auto& kv : fb_)
        if (kv.second.last_seen >= 0 && now - kv.second.last_seen < window) ++n;
    return n;
}

double Datapath::rx_seen_until() {
    double now = now_s();
    std::lock_guard<std::mutex> g(read_mu_);  // no read half placed
    if (socket_empty(cfg_.rx_fd)) return now;  // nothing unread since before now
    return rx_seen_until_.load(std::memory_order_acquire);
}

double Datapath::reorder_window(uint16_t src) {
    std::lock_guard<std::mutex> g(rx_mu_);
    auto it = fb_.find(src);
    return it == fb_.end() || it->second.reorder < 0 ? cfg_.answer_grace : it->second.reorder;
}

std::vector<uint32_t> Datapath::holes(uint16_t src, uint32_t mid) {
    std::lock_guard<std::mutex> g(rx_mu_);
    std::vector<uint32_t> out;
    auto it = rx_.find(key_of(src, mid));
    if (it == rx_.end() || it->second->prog.state != 0) return out;
    const RxMsg* m = it->second;
    for (int l = 0; l < 8; ++l) {
        if (!m->lvl_count[l] || m->lvl_max[l] - m->lvl_min[l] + 1 <= m->lvl_count[l]) continue;
        for (uint32_t seq = m->lvl_min[l]; seq <= m->lvl_max[l]; ++seq)
            if (!m->spec.received[seq]) out.push_back(seq);
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
}

double& Datapath::window_of(uint16_t src) {
    double& w = fb_[src].reorder;
    if (w < 0) w = cfg_.answer_grace;
    return w;
}

void Datapath::widen_window(uint16_t src, double late) {
    double& w = window_of(src);
    w = std::min(cfg_.answer.max_grace, std::max(w, cfg_.reorder_margin * std::max(0.0, late)));
    fb_[src].clean_passes = 0;
}

void Datapath::narrow_window(uint16_t src) {
    double& w = window_of(src);
    uint32_t& clean = fb_[src].clean_passes;
    if (++clean < std::max<uint32_t>(1, cfg_.reorder_persist)) return;
    clean = 0;
    w = std::max(cfg_.reorder_min, w * cfg_.reorder_decay);
}

double Datapath::drain_rate(double now) {
    std::lock_guard<std::mutex> g(rx_mu_);
    return (drain_rate_ > 0 && now - drain_measured_at_ <= cfg_.drain_fresh) ? drain_rate_ : 0.0;
}

// ------------------------------------------------------------------ validation and placement

uint8_t Datapath::ingest_sealed(uint8_t* d, uint32_t len, bool ce, double now, std::vector<RxMsg*>& touched,
                                double at) {
    const HeaderLayout& L = cfg_.layout;
    // What ingest_one rejects on the header alone (no key needed) it rejects and counts there,
    // before a tag is computed: junk costs no AES.
    if (len < uint32_t(H_) || len > cfg_.max_datagram || rd(d, L.version) != cfg_.version ||
        (rd(d, L.ptype) != cfg_.data_ptype && rd(d, L.ptype) != cfg_.credit_ptype && rd(d, L.ptype) != cfg_.stop_ptype) ||
        rd(d, L.job_id) != cfg_.job_id)
        return ingest_one(d, len, ce, now, touched, at);
    uint8_t reason = OK;
    if (len < uint32_t(H_) + TRAILER_BYTES) {
        reason = TRUNCATED;
    } else if (cfg_.protect != Protect::NONE) {
        // checked under the key of the direction the sender claims: only it holds that key
        auto fit = fb_.find(uint16_t(rd(d, L.sender_rank)));
        Sealer* o = fit == fb_.end() ? nullptr : fit->second.opener.get();
        Opened got = o ? o->open(d, len, size_t(H_), size_t(L.ptype.off)) : Opened::FORGED;
        if (got == Opened::FORGED) reason = BAD_MAC;
        else if (got == Opened::REPLAYED) reason = REPLAY;
    }
    if (reason != OK) {
        data_pkts_received_ += 1;
        data_bytes_received_ += len;
        ce_marked_ += ce;
        rejected_[reason] += 1;
        return reason;
    }
    return ingest_one(d, len - uint32_t(TRAILER_BYTES), ce, now, touched, at);
}

uint8_t Datapath::ingest_one(const uint8_t* d, uint32_t len, bool ce, double now, std::vector<RxMsg*>& touched,
                             double at) {
    const HeaderLayout& L = cfg_.layout;
    if (at < 0) at = now;
    data_pkts_received_ += 1;
    data_bytes_received_ += len;
    ce_marked_ += ce;
    uint8_t reason = OK;
    uint16_t sender = 0;
    if (len < uint32_t(H_) || len > cfg_.max_datagram) {
        reason = TRUNCATED;
    } else if (rd(d, L.version) != cfg_.version) {
        reason = BAD_VERSION;
    } else if (rd(d, L.ptype) == cfg_.credit_ptype) {
        return on_credit(d, len, now);
    } else if (rd(d, L.ptype) == cfg_.stop_ptype) {
        return on_stop(d, len, now);
    } else if (rd(d, L.ptype) != cfg_.data_ptype) {
        reason = NOT_DATA;
    } else if (rd(d, L.job_id) != cfg_.job_id) {
        reason = WRONG_JOB;
    }
    if (reason != OK) {
        rejected_[reason] += 1;
        return reason;
    }
    sender = uint16_t(rd(d, L.sender_rank));
    uint32_t mid = rd(d, L.message_id);
    uint64_t key = key_of(sender, mid);
    auto it = rx_.find(key);
    SenderFb* fb = nullptr;
    if (it == rx_.end() || it->second->prog.state != 0) {  // unknown, or finished (its stragglers are late)
        // Not set up (yet): kept only from an authenticated sender (its tag, checked before
        // this, was right: ingest_sealed).
        auto fit = fb_.find(sender);
        if (fit == fb_.end() || !fit->second.authed || sender == cfg_.rank) {
            rejected_[UNKNOWN_MESSAGE] += 1;
            return UNKNOWN_MESSAGE;
        }
        fb = &fit->second;
        if (stale(sender, mid, rd(d, L.iteration))) {  // recorded earlier: it neither parks, widens nor counts
            rejected_[STALE] += 1;
            return STALE;
        }
        // Of the use that finished (its iteration), or early data of the id's next use: after
        // 1,024 iterations message ids repeat (exchange.message_id), and a rank that is ahead
        // sends the next use's packets before this one has set it up. Those park; taken for
        // stragglers, they were dropped and the next use waited for its deadline (back-to-back
        // barriers hung at the 1,026th).
        auto u = used_.find(key);
        bool of_done_use = u != used_.end() && u->second.iteration == rd(d, L.iteration);
        if (of_done_use && it != rx_.end() && !(rd(d, L.flags) & cfg_.flag_retx) && it->second->last_at > 0)
            // a first-pass packet after its message completed at the end of its pass: the
            // window was too narrow (a bitmap listed it, or a bound left it out)
            widen_window(sender, at - it->second->last_at);
        if (of_done_use && done_.count(key)) {
            late_ += 1;
        } else if (fb->parked >= cfg_.park_limit) {
            rejected_[UNKNOWN_MESSAGE] += 1;
            return UNKNOWN_MESSAGE;
        } else {
            parked_[key].push_back(Parked{at, std::vector<uint8_t>(d, d + len)});
            fb->parked += 1;
            parked_total_ += 1;
            parked_now_ += 1;
        }
    } else {
        RxMsg* m = it->second;
        const RxSpec& s = m->spec;
        uint32_t seq = rd(d, L.seq);
        if (rd(d, L.token) != s.token) {
            reason = BAD_TOKEN;
        } else if (rd(d, L.iteration) != s.iteration) {
            reason = STALE;  // an earlier use of the message id (recorded then: its tag is right)
        } else if (rd(d, L.dtype) != s.dtype) {
            reason = WRONG_DTYPE;
        } else if (rd(d, L.total_pkts) != m->total_pkts || seq >= m->total_pkts) {
            reason = BAD_SEQ;
        } else if (uint64_t(rd(d, L.elem_offset)) != uint64_t(seq) * s.per) {
            reason = BAD_OFFSET;
        } else {
            uint32_t count = (m->tail && seq == m->n_full) ? m->tail : s.per;
            if (rd(d, L.elem_count) != count || len != uint32_t(H_) + count * uint32_t(m->itemsize))
                reason = COUNT_MISMATCH;
        }
        if (reason != OK) {
            rejected_[reason] += 1;
            return reason;
        }
        uint8_t flags = uint8_t(rd(d, L.flags));
        bool retx = flags & cfg_.flag_retx;
        // the message's previous arrival (this batch's earlier packets of it count)
        double quiet_since = m->in_batch ? std::max(m->prog.last_arrival, m->batch_last_at) : m->prog.last_arrival;
        if (!m->in_batch) {
            m->in_batch = true;
            m->batch_first_at = m->batch_last_at = at;
            touched.push_back(m);
        }
        m->batch_first_at = std::min(m->batch_first_at, at);
        m->batch_last_at = std::max(m->batch_last_at, at);
        if (flags & cfg_.flag_last) m->batch_last = true;
        if (!retx && m->last_at > 0) {
            double late = reorder_lateness(flags & cfg_.flag_last, at, m->last_at, quiet_since, window_of(sender));
            if (late > 0) {  // reordered past the end of its pass (endpass.h)
                widen_window(sender, late);
                m->late = true;
            }
        }
        if (s.received[seq]) {
            m->prog.duplicates += 1;
            duplicates_ += 1;
        } else {
            uint32_t count = (m->tail && seq == m->n_full) ? m->tail : s.per;
            const uint8_t* payload = d + H_;
            uint64_t first = uint64_t(seq) * s.per;
            if (!s.accumulate) {
                place_payload(s.out + first * m->itemsize, payload, size_t(count) * m->itemsize,
                              s.triggers.empty());
                if (!m->mags.empty())  // (from the datagram, still in cache: the same values)
                    packet_magnitudes(payload, count, m->kind, count, Magnitude::L2, &m->mags[seq]);
            } else if (m->out_kind == Kind::F16) {  // a float16 sum: each addition rounded to half
                add_rounded<half_to_float, float_to_half>(reinterpret_cast<uint16_t*>(s.out) + first, payload, count);
            } else if (m->out_kind == Kind::BF16) {  // a bfloat16 sum: each addition rounded to it
                uint16_t* dst = reinterpret_cast<uint16_t*>(s.out) + first;
                add_bf16_sum(dst, payload, count);
                if (!m->mags.empty())  // (the sum a held send forwards, still in cache)
                    packet_magnitudes(reinterpret_cast<const uint8_t*>(dst), count, Kind::BF16, count, Magnitude::L2,
                                      &m->mags[seq]);
            } else {
                float* dst = reinterpret_cast<float*>(s.out) + first;
                if (m->kind == Kind::F32) {
                    bool scaled = s.scale != 1.0f;
                    if (!m->mags.empty())
                        m->mags[seq] = scaled ? add_f32_scaled_l2(dst, payload, count, s.scale)
                                              : add_f32_l2(dst, payload, count);
                    else if (scaled)
                        add_f32_scaled(dst, payload, count, s.scale);
                    else
                        add_f32(dst, payload, count);
                } else {
                    for (uint32_t i = 0; i < count; ++i) dst[i] += load_elem(payload, i, m->kind);
                }
            }
            s.received[seq] = 1;
            if (!retx) {
                uint8_t prio = uint8_t(rd(d, L.priority));
                s.pkt_priority[seq] = prio;
                s.pkt_layer[seq] = int64_t(rd(d, L.layer));
                if (!(m->tail && seq == m->n_full)) {
                    int l = prio & 7;
                    m->lvl_min[l] = std::min(m->lvl_min[l], seq);
                    m->lvl_max[l] = std::max(m->lvl_max[l], seq);
                    m->lvl_count[l] += 1;
                }
            }
            m->prog.received_pkts += 1;
            m->prog.received_elems += count;
            m->batch_new += 1;
            // a resend that brought a packet: finish_locked counts the first sending of each as
            // never coming (a duplicate resend was consumed as it was read, and counts no more)
            if (retx) m->batch_retx += 1;
            accepted_ += 1;
        }
        fb = &fb_[sender];
    }
    // accepted, duplicate, parked or late: a packet of a known sender, for its feedback and credits
    fb->received += 1;
    fb->consumed += 1;
    fb->good_since += 1;
    fb->last_seen = now;
    fb->last_arrival = std::max(fb->last_arrival, at);
    fb->released = false;
    if (ce) {
        fb->ce += 1;
        if (!fb->wake_sent) {
            fb->wake_sent = true;
            emit(EV_CONGESTION, sender, 0, now, 0);
        }
    }
    return OK;
}

// ------------------------------------------------------------------ credits

uint8_t Datapath::check_from_receiver(const uint8_t* d, uint32_t len) {
    // A CREDIT's or a STOP's checks beyond its tag (rx_mu_ held): a bare header of our job from
    // an authenticated peer other than us. The rejection is counted here.
    const HeaderLayout& L = cfg_.layout;
    uint16_t from = uint16_t(rd(d, L.sender_rank));
    auto fit = fb_.find(from);
    uint8_t reason = OK;
    if (rd(d, L.job_id) != cfg_.job_id) {
        reason = WRONG_JOB;
    } else if (len != uint32_t(H_)) {
        reason = COUNT_MISMATCH;
    } else if (fit == fb_.end() || !fit->second.authed || from == cfg_.rank) {
        reason = BAD_TOKEN;  // (not from a peer we send to: its tag was checked under its key already)
    }
    if (reason != OK) rejected_[reason] += 1;
    return reason;
}

uint8_t Datapath::on_credit(const uint8_t* d, uint32_t len, double now) {
    // A credit from a receiver we send to: the window it grants us (rx_mu_ held).
    const HeaderLayout& L = cfg_.layout;
    if (uint8_t reason = check_from_receiver(d, len); reason != OK) return reason;
    uint16_t granter = uint16_t(rd(d, L.sender_rank));
    uint32_t seq = rd(d, L.iteration);
    uint64_t consumed = rd_wide(d, L);
    bool release = rd(d, L.flags) & cfg_.flag_release;
    credits_received_ += 1;
    std::lock_guard<std::mutex> g(tx_mu_);
    auto it = dests_.find(granter);
    if (it == dests_.end()) return OK;
    Dest* dst = it->second;
    if (seq > dst->credit_seq) {  // newer than any seen: a replay or a late one grants nothing
        dst->credit_seq = seq;
        // acked_after_credit: a RELEASE credit also releases all we sent (what was not consumed was lost)
        dst->acked = std::max(dst->acked, release ? dst->sent.load() : consumed);
        dst->window = std::max<uint32_t>(1, rd(d, L.elem_count));
        dst->held_since = -1;
        tx_cv_.notify_all();
    }
    (void)now;
    return OK;
}

// ------------------------------------------------------------------ STOP datagrams
//
// A message that completed here with every packet is answered at once, from this thread: a
// STOP datagram to its sender, sealed like a credit (its own packet numbers under the direction
// key), naming the message and its iteration, with the elements held. Why here and not as a
// record on the control connection: the record cost both control threads a frame each (built,
// sealed, sent, read, opened, parsed: over half of a control thread's time in a 4 MB
// all_reduce), and its sender's send waited for both. A datagram that does not arrive costs
// what a lost record would have cost without a reliable connection: the sender probes after
// its pass (its PROBE is answered with a STOP record, the message being remembered as done).
// Only exact completions go this way; a bounded one's STOP carries the missing bitmap, from
// the protocol core.

bool Datapath::send_stop(const RxMsg* m) {
    const HeaderLayout& L = cfg_.layout;
    uint16_t src = m->spec.src;
    auto fit = fb_.find(src);
    if (cfg_.stop_ptype == 0 || credit_fd_ < 0 || fit == fb_.end() || !fit->second.credit_sealer) return false;
    auto ait = peer_addr_.find(src);
    if (ait == peer_addr_.end()) return false;
    uint64_t held = m->prog.received_elems;
    uint8_t h[256 + TRAILER_BYTES];
    std::memset(h, 0, size_t(H_));
    wr(h, L.version, cfg_.version);
    wr(h, L.ptype, cfg_.stop_ptype);
    wr(h, L.priority, cfg_.top_priority);
    wr(h, L.sender_rank, cfg_.rank);
    wr(h, L.job_id, cfg_.job_id);
    wr(h, L.message_id, m->spec.message_id);
    wr(h, L.iteration, m->spec.iteration);
    wr_wide(h, L, held);
    fit->second.credit_sealer->seal(h, size_t(H_), size_t(L.ptype.off), nullptr, 0, nullptr, h + H_);
    ssize_t r = sendto(credit_fd_, h, size_t(H_) + TRAILER_BYTES, MSG_DONTWAIT,
                       reinterpret_cast<const sockaddr*>(&ait->second), sizeof(sockaddr_in));
    if (r != ssize_t(size_t(H_) + TRAILER_BYTES)) return false;
    stops_sent_ += 1;
    return true;
}

uint8_t Datapath::on_stop(const uint8_t* d, uint32_t len, double now) {
    // A STOP from a receiver we send to (rx_mu_ held; its tag was checked under its key).
    const HeaderLayout& L = cfg_.layout;
    if (uint8_t reason = check_from_receiver(d, len); reason != OK) return reason;
    uint16_t receiver = uint16_t(rd(d, L.sender_rank));
    uint32_t mid = rd(d, L.message_id);
    uint64_t held = rd_wide(d, L);
    std::lock_guard<std::mutex> g(tx_mu_);
    auto it = tx_.find(key_of(receiver, mid));
    // a message already retired, or another use of its id (a STOP of an earlier iteration that
    // came late): nothing to stop
    if (it == tx_.end() || it->second->stopped || it->second->spec.iteration != rd(d, L.iteration)) return OK;
    TxMsg* m = it->second;
    if (held != m->spec.total_elems) {
        rejected_[COUNT_MISMATCH] += 1;  // (only a complete message is stopped this way)
        return COUNT_MISMATCH;
    }
    m->stopped = true;  // the send thread sends nothing more of it; Python retires it at the event
    stops_received_ += 1;
    emit(EV_TX_STOP, receiver, mid, now, int64_t(held));
    return OK;
}

double Datapath::due_credits(double now, double seen_until, std::vector<CreditOut>& out) {
    // Grant every sender whose packets we took from the socket a window (rx_mu_ held), by the
    // rules of hostagent/datapath/credits.py: the window is credit_window (a sixteenth of the
    // socket's memory limit in datagrams, shared among every authenticated peer, so the windows
    // together fit); a credit goes when a quarter of it was used since the last (credit_due),
    // or when the sender's packets stopped coming for credit_quiet (it may be held by its
    // window); flagged RELEASE when a message of its is incomplete and either our socket dropped
    // datagrams since its last credit, or (release_due) everything that arrived up to
    // seen_until is read and nothing of it came for credit_quiet before that. Returns when a
    // quiet sender's credit or release falls due (0: none waits).
    out.clear();
    int senders = 0;
    for (auto& kv : fb_)
        if (kv.second.authed && kv.first != cfg_.rank) ++senders;
    uint64_t grant64 = uint64_t(rcvbuf_) / cfg_.credit_share / std::max<uint32_t>(1, cfg_.max_datagram) /
                       uint64_t(std::max(1, senders));
    uint32_t grant = uint32_t(std::min<uint64_t>(cfg_.max_window, std::max<uint64_t>(cfg_.min_window, grant64)));
    double wake = 0;
    const HeaderLayout& L = cfg_.layout;
    std::unordered_set<uint16_t> waiting;  // senders with an incomplete message
    for (auto& m : rx_)
        if (m.second->prog.state == 0) waiting.insert(m.second->spec.src);
    auto wake_at = [&wake](double at) { wake = wake == 0 ? at : std::min(wake, at); };
    for (auto& kv : fb_) {
        SenderFb& s = kv.second;
        if (!s.authed || !s.has_tx_key || kv.first == cfg_.rank) continue;
        uint64_t pending = s.consumed - s.credited;
        bool incomplete = waiting.count(kv.first) > 0;
        bool overrun = s.overrun && incomplete;
        // release_due: its packets stopped coming while a message of its is incomplete
        bool watch = incomplete && !s.released && s.last_arrival >= 0;
        bool lost = watch && seen_until - s.last_arrival >= cfg_.credit_quiet;
        double quiet_since = std::max(s.last_seen, s.last_credit);
        bool quiet = now - quiet_since >= cfg_.credit_quiet;
        bool due = lost || (overrun && quiet) ||
                   (pending > 0 && (pending >= std::max<uint32_t>(1, grant / 4) || quiet));
        if (!due) {
            if (pending > 0 || overrun) wake_at(quiet_since + cfg_.credit_quiet);
            if (watch) wake_at(s.last_arrival + cfg_.credit_quiet);
            continue;
        }
        if (peer_addr_.find(kv.first) == peer_addr_.end()) continue;
        CreditOut c;
        c.rank = kv.first;
        c.window = grant;
        c.consumed = s.consumed;
        c.overrun = overrun;
        c.lost = lost;
        c.release = overrun || lost;
        uint8_t h[256 + TRAILER_BYTES];
        std::memset(h, 0, size_t(H_));
        s.credit_seq += 1;
        wr(h, L.version, cfg_.version);
        wr(h, L.ptype, cfg_.credit_ptype);
        wr(h, L.priority, cfg_.top_priority);
        wr(h, L.sender_rank, cfg_.rank);
        wr(h, L.job_id, cfg_.job_id);
        wr(h, L.iteration, s.credit_seq);
        wr(h, L.flags, c.release ? cfg_.flag_release : 0);
        wr(h, L.elem_count, grant);
        wr_wide(h, L, s.consumed);
        if (!s.credit_sealer) continue;
        s.credit_sealer->seal(h, size_t(H_), size_t(L.ptype.off), nullptr, 0, nullptr, h + H_);
        c.bytes.assign(h, h + H_ + TRAILER_BYTES);
        out.push_back(std::move(c));
    }
    return wake;
}

void Datapath::credit_sent(const CreditOut& c, double now) {
    SenderFb& s = fb_[c.rank];
    s.credited = c.consumed;
    s.last_credit = now;
    if (c.overrun) {
        s.overrun = false;
        overrun_credits_sent_ += 1;
    } else if (c.lost) {
        loss_releases_sent_ += 1;
    }
    if (c.release) s.released = true;
    credits_sent_ += 1;
}

double Datapath::send_credits(double now) {
    if (credit_fd_ < 0) return 0;
    double wake = due_credits(now, rx_seen_until_.load(std::memory_order_acquire), credit_out_);
    for (const CreditOut& c : credit_out_) {
        auto ait = peer_addr_.find(c.rank);
        ssize_t r = sendto(credit_fd_, c.bytes.data(), c.bytes.size(), MSG_DONTWAIT,
                           reinterpret_cast<const sockaddr*>(&ait->second), sizeof(sockaddr_in));
        if (r == ssize_t(c.bytes.size())) credit_sent(c, now);
    }
    return wake;
}

std::vector<CreditOut> Datapath::credits_for_test(double now, double seen_until, uint32_t socket_memory,
                                                  double& wake) {
    std::lock_guard<std::mutex> g(rx_mu_);
    if (socket_memory) rcvbuf_ = socket_memory;
    std::vector<CreditOut> out;
    wake = due_credits(now, seen_until, out);
    for (const CreditOut& c : out) credit_sent(c, now);
    return out;
}

void Datapath::account_reads(uint64_t reads, int64_t overflow, double now) {
    reads_since_ += double(reads);
    if (overflow >= 0 && overflow != rx_overflows_) {
        // SO_RXQ_OVFL counts dropped socket-buffer entries (a GRO read is one entry of
        // many datagrams, a junk datagram one of none of ours). Each dropped entry is
        // taken as a random draw of the entries that arrived meanwhile: it held, on
        // average, a sender's accepted datagrams over all reads since the last drops were
        // accounted. So junk in the buffer dilutes the blame instead of multiplying it,
        // and nobody is blamed for drops among junk alone.
        int64_t dropped = (overflow - rx_overflows_) & 0xFFFFFFFFLL;
        rx_overflows_ = overflow;
        for (auto& kv : fb_) kv.second.overrun = true;  // its next credit may release what it lost
        rx_dropped_reads_ += dropped;
        //
        // That share overstates a flood's effect (a flood fills every gap in the buffer,
        // paced senders meet it less often), so a sender is blamed for no more than the
        // holes its own messages show (RxMsg::holes). Junk cannot make those.
        std::map<uint16_t, std::vector<RxMsg*>> msgs;
        for (auto& kv : rx_)
            if (kv.second->prog.state == 0) msgs[kv.second->spec.src].push_back(kv.second);
        for (auto& kv : fb_) {
            SenderFb& s = kv.second;
            if (s.good_since <= 0 || !s.authed || kv.first == cfg_.rank) continue;
            int64_t share = std::llround(double(dropped) * s.good_since / std::max(1.0, reads_since_));
            int64_t blame = 0;
            for (RxMsg* m : msgs[kv.first]) {
                int64_t take = std::min<int64_t>(std::max<int64_t>(0, m->holes()), share - blame);
                if (take <= 0) continue;
                m->holes_blamed += uint32_t(take);
                blame += take;
            }
            if (blame == 0) continue;
            s.lost += blame;
            rx_dropped_estimate_ += blame;
            if (!s.wake_sent) {
                s.wake_sent = true;
                emit(EV_CONGESTION, kv.first, 0, now, 0);
            }
        }
        reads_since_ = 0;
        for (auto& kv : fb_) kv.second.good_since = 0;
    } else if (reads_since_ > 8192) {  // a long quiet stretch: older reads weigh less
        reads_since_ /= 2;
        for (auto& kv : fb_) kv.second.good_since /= 2;
    }
}

void Datapath::end_batch(std::vector<RxMsg*>& touched, double now) {
    for (RxMsg* m : touched) {
        m->in_batch = false;
        uint32_t n_new = m->batch_new, n_retx = m->batch_retx;
        bool last = m->batch_last;
        m->batch_new = m->batch_retx = 0;
        m->batch_last = false;
        if (n_new == 0) continue;  // only duplicates: nothing new to report
        // Arrival times are when the packets reached the host (the kernel's stamps), not when
        // they were read: a reader that is behind must not stretch a message's grace, which
        // is measured against the stamps of what it has read (rx_seen_until).
        double at = m->batch_last_at;
        Progress& p = m->prog;
        p.last_arrival = std::max(p.last_arrival, at);
        if (p.first_arrival == 0) p.first_arrival = m->batch_first_at;
        p.retx_seen += n_retx;
        if (last) emit(EV_RX_LAST, m->spec.src, m->spec.message_id, at, 0);
        if (n_retx) emit(EV_RX_RETX, m->spec.src, m->spec.message_id, at, n_retx);
        if (last && m->last_at == 0) m->last_at = at;
        if (last) m->last_seen = true;
        if (p.received_pkts == m->total_pkts) {
            finish_locked(m, RX_EXACT, true, now);
        } else if (p.retx_seen && p.received_elems >= m->spec.required_elems) {
            finish_locked(m, RX_BOUNDED, true, now);  // recovery reached the bound: stop now
        } else if (m->last_seen && p.received_elems >= m->spec.required_elems && !m->watched) {
            m->watched = true;  // the pass is over and the bound met: complete after the grace
            m->watched_at = now;
            ends_.push_back(key_of(m->spec.src, m->spec.message_id));
        }
    }
    touched.clear();
}

double Datapath::end_passes(double now, double seen_until) {
    // endpass.h's rule, the one the protocol core answers a LAST or a PROBE by, here so that a
    // ring's bounded step completes and starts the next one without a round through Python.
    double next = 0;
    size_t keep = 0;
    for (size_t i = 0; i < ends_.size(); ++i) {
        auto it = rx_.find(ends_[i]);
        if (it == rx_.end() || it->second->prog.state != 0 || !it->second->watched) continue;  // done, or a new message under the key
        RxMsg* m = it->second;
        const Progress& p = m->prog;
        double grace = answer_grace(window_of(m->spec.src), mean_gap(p.received_pkts, p.first_arrival, p.last_arrival),
                                    cfg_.answer);
        AnswerCheck c = answer_check(now, p.last_arrival, grace, seen_until, m->watched_at, cfg_.answer);
        if (c.due) {
            m->watched = false;
            finish_locked(m, RX_BOUNDED, true, now);
            continue;
        }
        // not yet quiet: wake at the grace; quiet but the reader behind: every batch looks
        // again (it moves seen_until), and the fallback wakes it at the latest
        next = next == 0 ? c.wake : std::min(next, c.wake);
        ends_[keep++] = ends_[i];
    }
    ends_.resize(keep);
    return next;
}

void Datapath::finish_locked(RxMsg* m, int how, bool fire, double now) {
    m->prog.state = how;
    const RxSpec& s = m->spec;
    // (resends came, or it completes with packets left out: an answer decided without them)
    bool recovered = m->prog.retx_seen > 0 || m->prog.received_pkts < m->total_pkts;
    if (narrows_window(m->last_at > 0, m->late, recovered)) narrow_window(s.src);
    // The sender's transmissions this message will never bring: packets that never came, and the
    // first sending of each packet that came as a resend. They count as read for its credits,
    // or its window would shrink by every loss (a bound's losses are never resent at all).
    fb_[s.src].consumed += uint64_t(m->total_pkts - m->prog.received_pkts) + m->prog.retx_seen;
    if (!s.accumulate && m->prog.received_pkts < m->total_pkts) {
        // missing elements read as zero, before a chained send reads the buffer
        for (uint32_t seq = 0; seq < m->total_pkts; ++seq) {
            if (s.received[seq]) continue;
            uint32_t count = (m->tail && seq == m->n_full) ? m->tail : s.per;
            std::memset(s.out + size_t(seq) * s.per * m->itemsize, 0, size_t(count) * m->itemsize);
        }
    } else if (s.accumulate && s.scale != 1.0f && m->prog.received_pkts < m->total_pkts) {
        // a scaled sum: where nothing was added, out is scaled all the same (before a chained
        // send reads it)
        for (uint32_t seq = 0; seq < m->total_pkts; ++seq) {
            if (s.received[seq]) continue;
            uint32_t count = (m->tail && seq == m->n_full) ? m->tail : s.per;
            float* dst = reinterpret_cast<float*>(s.out) + size_t(seq) * s.per;
            for (uint32_t i = 0; i < count; ++i) dst[i] *= s.scale;
        }
    }
    uint64_t key = key_of(m->spec.src, m->spec.message_id);
    // The message stays readable (progress) until Python forgets it; packets are no longer placed.
    if (done_.insert(key).second) {
        done_order_.push_back(key);
        while (done_order_.size() > DONE_KEPT) {
            done_.erase(done_order_.front());
            done_order_.pop_front();
        }
    }
    if (fire && !m->spec.triggers.empty()) fire_triggers(m->spec.triggers, now, m);
    if (how == RX_EXACT && send_stop(m)) how = RX_EXACT_STOPPED;
    if (how != RX_BY_CORE) emit(EV_RX_DONE, m->spec.src, m->spec.message_id, now, how);
}

void Datapath::replay_parked(uint64_t key, double now) {
    auto pit = parked_.find(key);
    if (pit == parked_.end()) return;
    std::vector<Parked> items;
    items.swap(pit->second);
    parked_.erase(pit);
    uint16_t src = uint16_t(key >> 32);
    fb_[src].parked -= items.size();
    parked_now_ -= int64_t(items.size());
    std::vector<RxMsg*> touched;
    auto it = rx_.find(key);
    for (auto& p : items) {
        if (it != rx_.end() && rd(p.bytes.data(), cfg_.layout.iteration) != it->second->spec.iteration) {
            rejected_[STALE] += 1;  // another use of the id (its token was right for its own iteration)
            continue;
        }
        ingest_one(p.bytes.data(), uint32_t(p.bytes.size()), false, now, touched, p.time);
    }
    end_batch(touched, now);
}

// ------------------------------------------------------------------ the receive thread

void Datapath::drain_batch(double started, uint64_t nbytes, bool behind, double now) {
    std::lock_guard<std::mutex> g(rx_mu_);
    if (drain_since_ < 0) {
        if (!behind) return;
        drain_since_ = started;
        drain_bytes_ = 0;
    }
    drain_bytes_ += nbytes;
    double span = now - drain_since_;
    if (!behind || span >= cfg_.drain_stretch) {
        if (span > 0 && double(drain_bytes_) >= cfg_.drain_min_bytes) {
            double sample = double(drain_bytes_) / span;
            drain_rate_ = drain_rate_ <= 0 ? sample : 0.7 * drain_rate_ + 0.3 * sample;
            drain_measured_at_ = now;
        }
        drain_since_ = behind ? now : -1;
        drain_bytes_ = 0;
    }
}

void Datapath::rx_loop() {
    std::vector<uint8_t> buf(size_t(READS) * READ_BYTES);
    std::vector<mmsghdr> msgs(READS);
    std::vector<iovec> iov(READS);
    // IP_TOS, SO_RXQ_OVFL, UDP_GRO and the arrival stamp (SCM_TIMESTAMPNS), with room to spare
    constexpr size_t CTL = CMSG_SPACE(sizeof(int)) * 4 + CMSG_SPACE(sizeof(timespec)) * 2;
    std::vector<std::array<uint8_t, CTL>> ctl(READS);
    struct Dg {
        const uint8_t* p;
        uint32_t len;
        bool ce;
        double at;  // when it reached the host
    };
    std::vector<Dg> dgs;
    std::vector<RxMsg*> touched;
    pollfd pfd{cfg_.rx_fd, POLLIN, 0};
    int rcvbuf = 0;
    socklen_t optlen = sizeof rcvbuf;
    getsockopt(cfg_.rx_fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, &optlen);
    uint64_t batch_limit = std::max<uint64_t>(cfg_.max_datagram, std::min<uint64_t>(cfg_.batch_bytes, uint64_t(rcvbuf) / 8));
    {
        std::lock_guard<std::mutex> g(rx_mu_);
        rcvbuf_ = uint32_t(rcvbuf);
    }
    std::uniform_real_distribution<double> uni(0.0, 1.0);
    const bool injecting = !cfg_.drop_p.empty() || (cfg_.delay > 0 && cfg_.delay_p > 0) || cfg_.reorder;

    double credit_due = 0;  // when a quiet sender's credit falls due (0: none waits)
    auto release_delayed = [&]() {
        if (delayed_.empty()) return;
        double now = now_s();
        std::vector<std::vector<uint8_t>> due;
        for (auto it = delayed_.begin(); it != delayed_.end();) {
            if (it->first <= now) {
                due.push_back(std::move(it->second));
                it = delayed_.erase(it);
            } else {
                ++it;
            }
        }
        if (due.empty()) return;
        std::lock_guard<std::mutex> g(rx_mu_);
        for (auto& d : due) ingest_sealed(d.data(), uint32_t(d.size()), false, now, touched);
        end_batch(touched, now);
        credit_due = send_credits(now);
    };

    double next_end = 0;  // when the earliest watched end of pass is due (0: none)
    while (running_) {
        if (fault_.load(std::memory_order_relaxed) == 1) throw std::bad_alloc();
        // to the microsecond: an end of pass is due a reordering window after its LAST, which on
        // a path that does not reorder is a fraction of a millisecond
        double wait = delayed_.empty() ? 0.05 : 0.005;
        for (double due : {next_end, credit_due})
            if (due > 0) wait = std::min(wait, std::max(0.0, due - now_s()));
        timespec ts{time_t(wait), long((wait - double(time_t(wait))) * 1e9)};
        int r = ppoll(&pfd, 1, &ts, nullptr);
        if (r <= 0) {
            double empty_at = now_s();  // nothing unread when poll gave up
            release_delayed();
            std::lock_guard<std::mutex> g(rx_mu_);
            rx_seen_until_.store(empty_at, std::memory_order_release);
            next_end = end_passes(now_s(), empty_at);
            credit_due = send_credits(now_s());
            continue;
        }
        double t_batch = now_s();
        uint64_t batch_dgrams = 0, batch_bytes = 0, batch_reads = 0;
        int64_t overflow = -1;
        bool dry = false;
        while (batch_dgrams < cfg_.rx_batch && batch_bytes < batch_limit) {
            for (int i = 0; i < READS; ++i) {
                iov[i].iov_base = buf.data() + size_t(i) * READ_BYTES;
                iov[i].iov_len = READ_BYTES;
                std::memset(&msgs[i].msg_hdr, 0, sizeof(msghdr));
                msgs[i].msg_hdr.msg_iov = &iov[i];
                msgs[i].msg_hdr.msg_iovlen = 1;
                msgs[i].msg_hdr.msg_control = ctl[i].data();
                msgs[i].msg_hdr.msg_controllen = CTL;
                msgs[i].msg_len = 0;
            }
            // The kernel stamps arrivals on the real-time clock: this read's offset to ours.
            std::unique_lock<std::mutex> reading(read_mu_);
            double before = now_s();
            timespec real;
            clock_gettime(CLOCK_REALTIME, &real);
            double real_off = double(real.tv_sec) + double(real.tv_nsec) * 1e-9 - before;
            int k = recvmmsg(cfg_.rx_fd, msgs.data(), READS, MSG_DONTWAIT, nullptr);
            if (k <= 0) {
                dry = true;
                if (before > rx_seen_until_.load()) rx_seen_until_.store(before, std::memory_order_release);
                break;
            }
            double now = now_s();
            double arrived = 0;  // the latest arrival stamp of this read (0: none)
            dgs.clear();
            for (int i = 0; i < k; ++i) {
                uint32_t len = msgs[i].msg_len;
                int tos = 0, seg = 0;
                double at = now;  // without a stamp: when it was read
                for (cmsghdr* c = CMSG_FIRSTHDR(&msgs[i].msg_hdr); c; c = CMSG_NXTHDR(&msgs[i].msg_hdr, c)) {
                    if (c->cmsg_level == IPPROTO_IP && c->cmsg_type == IP_TOS) {
                        tos = *reinterpret_cast<const uint8_t*>(CMSG_DATA(c));
                    } else if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SO_RXQ_OVFL) {
                        uint32_t v;
                        std::memcpy(&v, CMSG_DATA(c), 4);
                        overflow = v;
                    } else if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) {
                        int v;
                        std::memcpy(&v, CMSG_DATA(c), sizeof v);
                        seg = v;
                    } else if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS) {
                        timespec ts;
                        std::memcpy(&ts, CMSG_DATA(c), sizeof ts);
                        at = std::min(now, double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9 - real_off);
                        arrived = std::max(arrived, at);
                    }
                }
                rx_reads_ += 1;
                batch_reads += 1;
                batch_bytes += len;
                const uint8_t* base = buf.data() + size_t(i) * READ_BYTES;
                bool ce = (tos & 3) == 3;
                if (cfg_.gro && seg > 0 && len > uint32_t(seg)) {
                    gro_reads_ += 1;
                    for (uint32_t off = 0; off < len; off += seg)
                        dgs.push_back(Dg{base + off, std::min<uint32_t>(seg, len - off), ce, at});
                } else {
                    dgs.push_back(Dg{base, len, ce, at});
                }
            }
            batch_dgrams += dgs.size();
            if (injecting) {
                std::vector<Dg> kept;
                kept.reserve(dgs.size());
                double now2 = now_s();
                for (const Dg& g : dgs) {
                    if (g.len >= uint32_t(H_) && !cfg_.drop_p.empty()) {
                        uint8_t cls = g.p[cfg_.layout.drop_class.off];
                        if (cls < cfg_.drop_p.size() && uni(rng_) < cfg_.drop_p[cls]) {
                            std::lock_guard<std::mutex> lk(rx_mu_);
                            injected_drops_[cls] += 1;
                            continue;
                        }
                    }
                    if (cfg_.delay > 0 && cfg_.delay_p > 0 && uni(rng_) < cfg_.delay_p) {
                        delayed_.emplace_back(now2 + cfg_.delay, std::vector<uint8_t>(g.p, g.p + g.len));
                        injected_delays_ += 1;
                        continue;
                    }
                    kept.push_back(g);
                }
                if (cfg_.reorder) std::shuffle(kept.begin(), kept.end(), rng_);
                dgs.swap(kept);
            }
            {
                std::lock_guard<std::mutex> g(rx_mu_);
                // (the read buffer is ours: opened, and decrypted, in place)
                for (const Dg& x : dgs) ingest_sealed(const_cast<uint8_t*>(x.p), x.len, x.ce, now, touched, x.at);
                end_batch(touched, now);
                credit_due = send_credits(now);
                // The socket is a queue: all that arrived before this read's last datagram is
                // read now, or all that arrived before the read began if it emptied the socket.
                double seen = k < READS ? before : std::min(arrived, now);
                if (seen > rx_seen_until_.load()) rx_seen_until_.store(seen, std::memory_order_release);
            }
            reading.unlock();
            if (k < READS) {
                dry = true;
                break;
            }
        }
        double now = now_s();
        {
            std::lock_guard<std::mutex> g(rx_mu_);
            account_reads(batch_reads, overflow, now);
        }
        bool behind = !dry && (batch_dgrams >= cfg_.rx_batch || batch_bytes >= batch_limit);
        if (behind) {
            uint32_t mem[9] = {0};
            socklen_t ml = sizeof mem;
            if (getsockopt(cfg_.rx_fd, SOL_SOCKET, SO_MEMINFO, mem, &ml) == 0 && mem[1] > 0)
                behind = double(mem[0]) / double(mem[1]) >= cfg_.behind_backlog;
        }
        drain_batch(t_batch, batch_bytes, behind, now_s());
        release_delayed();
        {
            std::lock_guard<std::mutex> g(rx_mu_);
            next_end = end_passes(now_s(), rx_seen_until_.load());
        }
    }
}

std::vector<uint8_t> Datapath::ingest_for_test(const uint8_t* rows, const int64_t* lengths, size_t n, size_t width,
                                               double now) {
    std::vector<uint8_t> reasons(n);
    std::lock_guard<std::mutex> g(rx_mu_);
    std::vector<RxMsg*> touched;
    std::vector<uint8_t> row;  // a copy: a datagram is opened (decrypted) in place, the caller's rows stay
    for (size_t i = 0; i < n; ++i) {
        int64_t len = lengths[i];
        // a datagram longer than its row was cut by the read: the receive thread's "truncated"
        uint32_t l = len > int64_t(width) ? cfg_.max_datagram + 1 : uint32_t(std::max<int64_t>(0, len));
        row.assign(rows + i * width, rows + i * width + std::min<size_t>(width, l));
        row.resize(std::max<size_t>(row.size(), 1));
        if (l > width) row.resize(l, 0);
        reasons[i] = ingest_sealed(row.data(), l, false, now, touched);
    }
    end_batch(touched, now);
    return reasons;
}

}  // namespace dlcp
