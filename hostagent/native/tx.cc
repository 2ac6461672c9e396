// The send half of the compiled data path: message preparation (headers, drop classes),
// priority scheduling, pacing and batched sends. See datapath.h for the division of labour.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <new>
#include <system_error>

#include <arpa/inet.h>
#include <pthread.h>
#include <linux/udp.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "datapath.h"

#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif

namespace dlcp {

namespace {
constexpr int MAX_SEGMENTS = 64;        // segments per GSO call (Linux takes 64 up to 6.8, 128 after)
constexpr uint32_t MAX_GSO_BYTES = 65507;  // the UDP payload of one IPv4 packet
constexpr int ECT0 = 0b10;
inline uint64_t key_of(uint16_t peer, uint32_t mid) { return (uint64_t(peer) << 32) | mid; }

void sleep_for(double s) {
    if (s <= 0) return;
    timespec ts;
    ts.tv_sec = time_t(s);
    ts.tv_nsec = long((s - double(ts.tv_sec)) * 1e9);
    nanosleep(&ts, nullptr);
}

bool gso_refused(int err) { return err == EIO || err == EINVAL || err == ENOPROTOOPT || err == EOPNOTSUPP; }
}  // namespace

// ------------------------------------------------------------------ lifecycle and peers

Datapath::Datapath(Config cfg) : cfg_(std::move(cfg)), H_(cfg_.layout.size), rng_(cfg_.seed),
                                 host_pacer_(cfg_.burst_bytes, cfg_.pacing_slack) {
    if (H_ <= 0) throw std::invalid_argument("header layout has no size");
    if (cfg_.max_datagram < uint32_t(H_)) throw std::invalid_argument("max_datagram is smaller than a header");
    if (cfg_.dscp.empty()) throw std::invalid_argument("dscp table is empty");
    if (cfg_.line_rate <= 0 || cfg_.burst_bytes <= 0) throw std::invalid_argument("line_rate and burst must be > 0");
    if (cfg_.pacing_slack < 0) throw std::invalid_argument("pacing_slack must be >= 0");
    if (!(cfg_.event_defer >= 0 && cfg_.event_defer < 1e6)) throw std::invalid_argument("event_defer must be >= 0 s");
    event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (event_fd_ < 0) throw std::runtime_error(std::string("eventfd: ") + std::strerror(errno));
    defer_fd_ = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (defer_fd_ < 0) {
        int err = errno;
        ::close(event_fd_);
        throw std::runtime_error(std::string("timerfd_create: ") + std::strerror(err));
    }
}

Datapath::~Datapath() {
    release_lock_for_test();
    stop();
    for (auto& kv : dests_) {
        for (auto& s : kv.second->socks)
            if (s.second.fd >= 0) ::close(s.second.fd);
        delete kv.second;
    }
    for (auto& kv : tx_) delete kv.second;
    for (auto& kv : rx_) delete kv.second;
    if (event_fd_ >= 0) ::close(event_fd_);
    if (defer_fd_ >= 0) ::close(defer_fd_);
}

void Datapath::start() {
    if (running_.exchange(true)) return;
    credit_fd_ = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (credit_fd_ >= 0) {  // credits leave at the top priority, as control records do
        int tos = int(cfg_.dscp[std::min<size_t>(cfg_.top_priority, cfg_.dscp.size() - 1)]) << 2;
        setsockopt(credit_fd_, IPPROTO_IP, IP_TOS, &tos, sizeof tos);
    }
    try {
        rx_thread_ = std::thread([this] { rx_main(); });
        tx_thread_ = std::thread([this] { tx_main(); });
    } catch (const std::exception& e) {  // (a thread that cannot start: the caller's error, not an abort)
        stop();
        throw std::runtime_error(std::string("the data path's threads cannot start: ") + e.what());
    }
    pthread_setname_np(rx_thread_.native_handle(), ("dlcp-rx-" + std::to_string(cfg_.rank)).substr(0, 15).c_str());
    pthread_setname_np(tx_thread_.native_handle(), ("dlcp-tx-" + std::to_string(cfg_.rank)).substr(0, 15).c_str());
}

void Datapath::fail(const char* thread, const char* what) {
    try {
        {
            std::lock_guard<std::mutex> g(fail_mu_);
            if (!failure_.empty()) return;  // the first says why
            failure_ = std::string("the data path's ") + thread + " thread failed: " + what;
        }
        emit(EV_FAILED, 0, 0, now_s(), thread[0] == 's' ? 1 : 0);
    } catch (...) {  // (out of memory even for the report: the thread stops all the same)
    }
}

std::string Datapath::failure() {
    std::lock_guard<std::mutex> g(fail_mu_);
    return failure_;
}

void Datapath::fault_for_test(int where) {
    fault_.store(where);
    std::lock_guard<std::mutex> g(tx_mu_);
    tx_cv_.notify_all();
}

void Datapath::hold_lock_for_test(int which, double timeout) {
    release_lock_for_test();
    hold_ = std::make_unique<LockHold>();
    LockHold* h = hold_.get();
    std::mutex& target = which == 1 ? rx_mu_ : tx_mu_;
    h->thread = std::thread([h, &target, timeout] {
        std::lock_guard<std::mutex> g(target);
        std::unique_lock<std::mutex> lk(h->mu);
        h->held = true;
        h->cv.notify_all();
        h->timed_out = !h->cv.wait_for(lk, std::chrono::duration<double>(timeout), [h] { return h->release; });
    });
    std::unique_lock<std::mutex> lk(h->mu);
    h->cv.wait(lk, [h] { return h->held; });
}

bool Datapath::release_lock_for_test() {
    if (!hold_) return false;
    {
        std::lock_guard<std::mutex> lk(hold_->mu);
        hold_->release = true;
        hold_->cv.notify_all();
    }
    hold_->thread.join();
    bool held = !hold_->timed_out;
    hold_.reset();
    return held;
}

void Datapath::rx_main() {
    try {
        rx_loop();
    } catch (const std::exception& e) {
        fail("receive", e.what());
    } catch (...) {
        fail("receive", "an unknown exception");
    }
}

void Datapath::tx_main() {
    try {
        tx_loop();
    } catch (const std::exception& e) {
        fail("send", e.what());
    } catch (...) {
        fail("send", "an unknown exception");
    }
    // Nothing is being sent any more: a retire() waiting for a message to be put down returns.
    std::lock_guard<std::mutex> g(tx_mu_);
    for (auto& kv : tx_) kv.second->busy = false;
    tx_cv_.notify_all();
}

void Datapath::stop() {
    if (!running_.exchange(false)) return;
    {
        std::lock_guard<std::mutex> g(tx_mu_);
        tx_cv_.notify_all();
    }
    if (rx_thread_.joinable()) rx_thread_.join();
    if (tx_thread_.joinable()) tx_thread_.join();
    std::lock_guard<std::mutex> g(tx_mu_);
    for (auto& kv : dests_)
        for (auto& s : kv.second->socks)
            if (s.second.fd >= 0) {
                ::close(s.second.fd);
                s.second.fd = -1;
            }
    if (credit_fd_ >= 0) {
        ::close(credit_fd_);
        credit_fd_ = -1;
    }
}

void Datapath::close() {
    stop();
    std::lock_guard<std::mutex> g(ev_mu_);  // (emit and take_events use the fds under it)
    if (event_fd_ >= 0) {
        ::close(event_fd_);
        event_fd_ = -1;
    }
    if (defer_fd_ >= 0) {
        ::close(defer_fd_);
        defer_fd_ = -1;
    }
}

void Datapath::add_peer(uint16_t rank, const std::string& ipv4, uint16_t port) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    if (inet_pton(AF_INET, ipv4.c_str(), &addr.sin_addr) != 1)
        throw std::invalid_argument("peer " + std::to_string(rank) + ": '" + ipv4 + "' is not an IPv4 address");
    {
        std::lock_guard<std::mutex> g(tx_mu_);
        if (dests_.count(rank)) return;
        auto* d = new Dest();
        d->rank = rank;
        d->addr = addr;
        d->pacer = Pacer(cfg_.burst_bytes, cfg_.pacing_slack);
        d->rate = std::min(cfg_.line_rate, 0.5e9);
        d->window = std::max<uint32_t>(1, cfg_.initial_window);
        dests_[rank] = d;
    }
    std::lock_guard<std::mutex> g(rx_mu_);  // (never under tx_mu_: the receive thread takes rx, then tx)
    peer_addr_[rank] = addr;
}

void Datapath::set_rate(uint16_t dest, double rate) {
    std::lock_guard<std::mutex> g(tx_mu_);
    auto it = dests_.find(dest);
    if (it == dests_.end()) throw std::invalid_argument("set_rate: unknown destination rank " + std::to_string(dest));
    it->second->rate = std::max(1.0, rate);
    tx_cv_.notify_all();
}

void Datapath::set_sockopt(uint16_t dest, uint8_t priority, int level, int name, int value) {
    std::lock_guard<std::mutex> g(tx_mu_);
    auto it = dests_.find(dest);
    if (it == dests_.end()) throw std::invalid_argument("set_sockopt: unknown destination rank " + std::to_string(dest));
    Sock& s = sock_for(*it->second, priority);
    if (setsockopt(s.fd, level, name, &value, sizeof value) != 0)
        throw std::runtime_error(std::string("setsockopt: ") + std::strerror(errno));
}

uint64_t Datapath::sent_packets(uint16_t dest) {
    std::lock_guard<std::mutex> g(tx_mu_);
    auto it = dests_.find(dest);
    return it == dests_.end() ? 0 : it->second->sent.load();
}

Datapath::Sock& Datapath::sock_for(Dest& d, uint8_t priority) {
    uint8_t p = std::min<uint8_t>(priority, cfg_.top_priority);  // one socket per queue
    Sock& s = d.socks[p];
    if (s.fd >= 0) return s;
    int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw std::runtime_error(std::string("socket: ") + std::strerror(errno));
    int buf = cfg_.socket_buffer;
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
    int tos = (int(cfg_.dscp[std::min<size_t>(p, cfg_.dscp.size() - 1)]) << 2) | ECT0;
    setsockopt(fd, IPPROTO_IP, IP_TOS, &tos, sizeof tos);
    if (cfg_.source_port_base) {
        sockaddr_in src{};
        src.sin_family = AF_INET;
        src.sin_port = htons(uint16_t(cfg_.source_port_base + 8 * d.rank + p));
        if (::bind(fd, reinterpret_cast<const sockaddr*>(&src), sizeof src) != 0) {
            int e = errno;
            ::close(fd);
            throw std::runtime_error("bind data socket to rank " + std::to_string(d.rank) + " to source port " +
                                     std::to_string(ntohs(src.sin_port)) + ": " + std::strerror(e));
        }
    }
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&d.addr), sizeof d.addr) != 0) {
        int e = errno;
        ::close(fd);
        throw std::runtime_error("connect to rank " + std::to_string(d.rank) + ": " + std::strerror(e));
    }
    s.fd = fd;
    if (cfg_.offload) {
        int seg = 0;
        socklen_t len = sizeof seg;
        if (getsockopt(fd, SOL_UDP, UDP_SEGMENT, &seg, &len) == 0) {
            s.gso = true;
        } else {
            s.gso_off = "kernel refuses UDP_SEGMENT on this socket (getsockopt probe)";
        }
    } else {
        s.gso_off = "turned off by the caller (offload=False)";
    }
    return s;
}

// ------------------------------------------------------------------ messages

int Datapath::TxMsg::sending_priority() const {
    if (retx_pos < retx.size()) return 255;
    if (!prio_in_order.empty() && next_pos < prio_in_order.size()) return prio_in_order[next_pos];
    return spec.priority;
}

int Datapath::TxMsg::queue_priority() const {
    return retx_pos < retx.size() ? 255 : spec.priority;
}

int Datapath::TxMsg::lowest_priority() const {
    return prio_in_order.empty() ? spec.priority : prio_in_order.back();  // (send_order is by priority)
}

void Datapath::submit(const TxSpec& spec) {
    auto kit = cfg_.kinds.find(spec.dtype);
    if (kit == cfg_.kinds.end()) throw std::invalid_argument("submit: unknown dtype code");
    if (spec.per == 0) throw std::invalid_argument("submit: per must be > 0");
    uint64_t need = spec.total_elems * uint64_t(kind_size(kit->second));
    if (spec.payload_bytes < need)
        throw std::invalid_argument("submit: the payload holds " + std::to_string(spec.payload_bytes) +
                                    " bytes, the message " + std::to_string(spec.total_elems) + " elements (" +
                                    std::to_string(need) + " bytes)");
    if (spec.snapshot && spec.snapshot_bytes < need)
        throw std::invalid_argument("submit: the snapshot holds " + std::to_string(spec.snapshot_bytes) +
                                    " bytes, the message " + std::to_string(need));
    auto* m = new TxMsg();
    m->spec = spec;
    m->kind = kit->second;
    m->itemsize = kind_size(m->kind);
    m->n_pkts = uint32_t((spec.total_elems + spec.per - 1) / spec.per);
    m->n_full = uint32_t(spec.total_elems / spec.per);
    m->tail = uint32_t(spec.total_elems % spec.per);
    m->datagram_bytes = uint32_t(H_) + spec.per * uint32_t(m->itemsize) + uint32_t(TRAILER_BYTES);
    m->held = spec.held;
    uint64_t key = key_of(spec.dest, spec.message_id);
    std::lock_guard<std::mutex> g(tx_mu_);  // the send thread prepares it (tags from the payload) when it picks it
    if (!dests_.count(spec.dest)) {
        delete m;
        throw std::invalid_argument("submit: unknown destination rank " + std::to_string(spec.dest));
    }
    if (tx_.count(key)) {
        delete m;
        throw std::invalid_argument("message " + std::to_string(spec.message_id) + " to rank " +
                                    std::to_string(spec.dest) + " is already in flight");
    }
    tx_[key] = m;
    if (m->held && fired_.erase(key)) {  // its trigger fired before it was submitted
        m->held = false;
        emit(EV_TX_ACTIVE, spec.dest, spec.message_id, now_s(), 0);
    }
    if (!m->held) activate_locked(m);
}

Datapath::Prepared Datapath::prepare(const TxMsg* m) {
    // Headers of every packet, drop classes from the payload's magnitudes (the policy's rule).
    // (m->src is set, and m->given_* stay as they are, while m->busy: the caller's lock is off)
    const TxSpec& s = m->spec;
    const HeaderLayout& L = cfg_.layout;
    Prepared out;
    if (s.snapshot) std::memcpy(s.snapshot, s.payload, size_t(s.total_elems) * m->itemsize);
    uint32_t n = m->n_pkts;
    std::vector<float> mags(n);
    std::vector<uint8_t> classes(n, 0);
    if (s.tags_given) {
        std::memcpy(classes.data(), s.drop_class_out, n);
    } else {
        if (cfg_.shares.size() <= 1) {
            // one drop class: every packet is class 0, no magnitude is needed
        } else if (n && m->given_mags.size() == n && m->given_have.size() == n) {
            // those the receive did not place (missing, zero-filled) from the payload
            for (uint32_t p = 0; p < n; ++p) mags[p] = m->given_have[p] ? m->given_mags[p] : packet_magnitude(m, p);
            drop_classes(mags.data(), n, cfg_.shares, cfg_.class_sampling, classes.data());
        } else if (uint32_t stride = cfg_.class_sampling.stride(n); stride > 1) {
            // Boundaries from a sample (the policy's rule for a large message): its first packet
            // leaves without a pass over the whole message; classify() gives each packet its
            // class as it first leaves, from memory the copy into the socket reads next.
            std::vector<float> sample;
            for (size_t r = 0; r < n / stride; ++r) sample.push_back(packet_magnitude(m, cfg_.class_sampling.index(r, stride)));
            out.boundaries = class_boundaries(sample.data(), sample.size(), cfg_.shares);
            out.classed.assign(n, 0);
        } else if (n) {
            // Every magnitude is needed before the first packet leaves (classes are quantiles):
            // on a large message, share the pass between threads (rows are independent).
            uint32_t k = s.total_elems >= cfg_.parallel_magnitude_elems ? std::min(cfg_.magnitude_threads, n) : 1;
            // A helper that cannot start (std::system_error) leaves its rows to this thread; the
            // helpers are joined whatever happens (a joinable std::thread destroyed would abort).
            struct Joined {
                std::vector<std::thread> threads;
                ~Joined() {
                    for (auto& t : threads)
                        if (t.joinable()) t.join();
                }
            } helpers;
            std::vector<std::pair<uint32_t, uint32_t>> inline_rows;
            for (uint32_t j = 1; j < k; ++j) {
                uint32_t a = uint32_t(uint64_t(n) * j / k), b = uint32_t(uint64_t(n) * (j + 1) / k);
                size_t lo = size_t(a) * s.per, cnt = std::min<size_t>(size_t(b) * s.per, size_t(s.total_elems)) - lo;
                try {
                    helpers.threads.emplace_back([this, m, lo, cnt, a, &s, &mags] {
                        packet_magnitudes(m->src + lo * m->itemsize, cnt, m->kind, s.per, cfg_.magnitude, &mags[a]);
                    });
                } catch (const std::system_error&) {
                    inline_rows.emplace_back(a, b);
                }
            }
            uint32_t first = uint32_t(uint64_t(n) / k);
            packet_magnitudes(m->src, std::min<size_t>(size_t(first) * s.per, size_t(s.total_elems)), m->kind, s.per,
                              cfg_.magnitude, mags.data());
            for (auto [a, b] : inline_rows) {
                size_t lo = size_t(a) * s.per, cnt = std::min<size_t>(size_t(b) * s.per, size_t(s.total_elems)) - lo;
                packet_magnitudes(m->src + lo * m->itemsize, cnt, m->kind, s.per, cfg_.magnitude, &mags[a]);
            }
            for (auto& t : helpers.threads) t.join();
            drop_classes(mags.data(), n, cfg_.shares, cfg_.class_sampling, classes.data());
        }
        if (s.drop_class_out && out.classed.empty()) std::memcpy(s.drop_class_out, classes.data(), n);
    }
    out.hdr.assign(size_t(n) * H_, 0);
    uint8_t tmpl[256];
    std::memset(tmpl, 0, sizeof tmpl);
    wr(tmpl, L.version, cfg_.version);
    wr(tmpl, L.ptype, cfg_.data_ptype);
    wr(tmpl, L.dtype, s.dtype);
    wr(tmpl, L.sender_rank, cfg_.rank);
    wr(tmpl, L.job_id, cfg_.job_id);
    wr(tmpl, L.message_id, s.message_id);
    wr(tmpl, L.token, s.token);
    wr(tmpl, L.iteration, s.iteration);
    wr(tmpl, L.tensor_id, s.tensor_id);
    wr(tmpl, L.total_pkts, n);
    for (uint32_t i = 0; i < n; ++i) {
        uint8_t* h = out.hdr.data() + size_t(i) * H_;
        std::memcpy(h, tmpl, H_);
        wr(h, L.priority, s.pkt_priority ? s.pkt_priority[i] : s.priority);
        wr(h, L.drop_class, classes[i]);
        wr(h, L.layer, s.pkt_layer ? s.pkt_layer[i] : s.layer);
        wr(h, L.elem_count, (m->tail && i == m->n_full) ? m->tail : s.per);
        wr(h, L.seq, i);
        wr(h, L.elem_offset, i * s.per);
    }
    // Packets leave by their own priority (a fused message carries several layers), ties in order.
    out.send_order.resize(n);
    for (uint32_t i = 0; i < n; ++i) out.send_order[i] = i;
    bool uniform = true;
    if (s.pkt_priority)
        for (uint32_t i = 1; i < n; ++i)
            if (s.pkt_priority[i] != s.pkt_priority[0]) uniform = false;
    if (!uniform) {
        std::stable_sort(out.send_order.begin(), out.send_order.end(),
                         [&](uint32_t a, uint32_t b) { return s.pkt_priority[a] > s.pkt_priority[b]; });
        out.prio_in_order.resize(n);
        for (uint32_t i = 0; i < n; ++i) out.prio_in_order[i] = s.pkt_priority[out.send_order[i]];
    }
    return out;
}

void Datapath::install_locked(TxMsg* m, Prepared&& p) {
    m->hdr = std::move(p.hdr);
    m->send_order = std::move(p.send_order);
    m->prio_in_order = std::move(p.prio_in_order);
    m->boundaries = std::move(p.boundaries);
    m->classed = std::move(p.classed);
    m->given_mags.clear();
    m->given_mags.shrink_to_fit();
    m->given_have.clear();
    m->given_have.shrink_to_fit();
    m->prepared = true;
}

void Datapath::activate_locked(TxMsg* m) {
    if (m->n_pkts == 0) {  // nothing to send: the pass is over at once
        emit(EV_TX_PASS, m->spec.dest, m->spec.message_id, now_s(), m->pass_no);
        return;
    }
    if (!m->queued) {
        active_.push_back(m);
        m->queued = true;
    }
    reorder_locked();
    tx_cv_.notify_all();
}

// The order the send thread serves its messages in (pick takes the first whose destination may
// send): resends first; then by the message's priority (its most urgent layer's), ties in order;
// a message's own packets by theirs (send_order). Why the message's and not its next packet's:
// ranked by their next packet, a message's least urgent level sank behind every other message's
// more urgent packets, and a chain of messages that each wait for the one before (a ring's steps)
// or a receiver that needs the whole message (a parameter server's pull) waited for it.
void Datapath::reorder_locked() {
    std::stable_sort(active_.begin(), active_.end(), [](const TxMsg* a, const TxMsg* b) {
        int pa = a->queue_priority(), pb = b->queue_priority();
        if (pa != pb) return pa > pb;
        return a->spec.order < b->spec.order;
    });
}

void Datapath::fire_triggers(const std::vector<std::pair<uint16_t, uint32_t>>& triggers, double now,
                             const RxMsg* from) {
    std::lock_guard<std::mutex> g(tx_mu_);
    for (auto& t : triggers) {
        uint64_t key = key_of(t.first, t.second);
        auto it = tx_.find(key);
        if (it == tx_.end()) {
            fired_.insert(key);  // submitted later: it starts at once then
            continue;
        }
        TxMsg* m = it->second;
        if (!m->held) continue;
        m->held = false;
        // it forwards what the receive placed (a ring step): the magnitudes come with it
        if (from && !from->mags.empty() && !m->prepared && m->kind == from->kind &&
            m->spec.payload == from->spec.out && m->spec.total_elems == from->spec.total_elems &&
            m->spec.per == from->spec.per) {
            m->given_mags = from->mags;
            m->given_have.assign(from->spec.received, from->spec.received + from->total_pkts);
        }
        // ACTIVE before anything the activation emits: an empty message's pass ends inside
        // activate_locked, and a PASS read before ACTIVE left the core waiting on a pass
        // that had already ended (no probe, no completion: barriers hung until the deadline)
        emit(EV_TX_ACTIVE, t.first, t.second, now, 0);
        activate_locked(m);
    }
}

Datapath::TxMsg* Datapath::find_tx_locked(uint16_t dest, uint32_t mid, const std::vector<uint32_t>& seqs,
                                          const char* caller) {
    auto it = tx_.find(key_of(dest, mid));
    if (it == tx_.end()) return nullptr;
    for (uint32_t s : seqs)
        if (s >= it->second->n_pkts)
            throw std::invalid_argument(std::string(caller) + ": sequence number beyond the message");
    return it->second;
}

uint32_t Datapath::retransmit(uint16_t dest, uint32_t mid, const std::vector<uint32_t>& seqs) {
    std::lock_guard<std::mutex> g(tx_mu_);
    TxMsg* m = find_tx_locked(dest, mid, seqs, "retransmit");
    if (!m) return 0;
    m->retx.assign(seqs.begin(), seqs.end());
    m->retx_pos = 0;
    m->pass_no += 1;
    if (!seqs.empty() && !m->stopped) activate_locked(m);
    return m->pass_no;
}

uint32_t Datapath::resend(uint16_t dest, uint32_t mid, const std::vector<uint32_t>& seqs) {
    std::lock_guard<std::mutex> g(tx_mu_);
    TxMsg* m = find_tx_locked(dest, mid, seqs, "resend");
    if (!m) return 0;
    // (a first pass that is over: the answer to its end lists what is missing)
    if (m->stopped || !m->prepared || m->next_pos >= m->n_pkts) return 0;
    if (m->position.empty()) {
        m->position.resize(m->n_pkts);
        for (uint32_t i = 0; i < m->n_pkts; ++i) m->position[m->send_order[i]] = i;
    }
    std::vector<uint32_t> pending(m->retx.begin() + m->retx_pos, m->retx.end());
    std::vector<uint8_t> queued(m->n_pkts, 0);
    for (uint32_t s : pending) queued[s] = 1;
    uint32_t added = 0;
    for (uint32_t s : seqs) {
        if (queued[s] || m->position[s] >= m->next_pos) continue;
        queued[s] = 1;
        pending.push_back(s);
        added += 1;
    }
    if (!added) return 0;
    std::sort(pending.begin() + (pending.size() - added), pending.end());
    m->retx.swap(pending);
    m->retx_pos = 0;
    activate_locked(m);
    return added;
}

bool Datapath::tx_info(uint16_t dest, uint32_t mid, TxInfo& out) {
    std::lock_guard<std::mutex> g(tx_mu_);
    auto it = tx_.find(key_of(dest, mid));
    if (it == tx_.end()) return false;
    const TxMsg* m = it->second;
    out.packets = m->n_pkts;
    out.next_pos = m->next_pos;
    out.retransmissions = m->retransmissions;
    out.pass_no = m->pass_no;
    out.held = m->held;
    out.active = m->has_packets();
    return true;
}

void Datapath::retire(uint16_t dest, uint32_t mid) {
    std::unique_lock<std::mutex> g(tx_mu_);
    uint64_t key = key_of(dest, mid);
    auto it = tx_.find(key);
    fired_.erase(key);
    if (it == tx_.end()) return;
    TxMsg* m = it->second;
    m->stopped = true;
    tx_cv_.wait(g, [&] { return !m->busy; });  // the send thread reads its buffers no more
    tx_.erase(key);
    active_.erase(std::remove(active_.begin(), active_.end(), m), active_.end());
    delete m;
    bool more = false;
    for (auto& kv : tx_)
        if (kv.second->spec.dest == dest) more = true;
    auto dit = dests_.find(dest);
    if (!more && dit != dests_.end()) {  // nothing in flight to it: what was never credited was lost
        dit->second->acked = dit->second->sent.load();
        dit->second->held_since = -1;
    }
}

bool Datapath::window_full(Dest* d, double now, double& wait) {
    // Whether `d` has as many of our packets unconsumed as its window allows (tx_mu_ held). A
    // destination that grants nothing more for credit_timeout is taken to have lost them.
    uint64_t sent = d->sent.load();
    uint64_t in_flight = sent > d->acked ? sent - d->acked : 0;
    if (in_flight < d->window) {
        d->held_since = -1;
        return false;
    }
    if (d->held_since < 0) {
        d->held_since = now;
        credit_waits_ += 1;
    }
    if (now - d->held_since >= cfg_.credit_timeout) {
        d->acked = sent;
        d->held_since = -1;
        credit_timeouts_ += 1;
        return false;
    }
    wait = d->held_since + cfg_.credit_timeout - now;
    return true;
}

// ------------------------------------------------------------------ the send thread

Datapath::TxMsg* Datapath::pick(double now, double& wait) {
    wait = 1.0;
    active_.erase(std::remove_if(active_.begin(), active_.end(),
                                 [](TxMsg* m) {
                                     if (m->has_packets() || !m->prepared) return false;
                                     m->queued = false;
                                     return true;
                                 }),
                  active_.end());
    std::map<uint16_t, double> blocked;
    for (TxMsg* m : active_) {
        if (!m->prepared) return m;  // ready to become a message: prepare it first
        uint16_t dest = m->spec.dest;
        auto b = blocked.find(dest);
        if (b == blocked.end()) {
            Dest* d = dests_[dest];
            double w = 0;
            if (!window_full(d, now, w))
                w = std::max(d->pacer.wait_time(m->datagram_bytes, d->rate, now),
                             host_pacer_.wait_time(m->datagram_bytes, cfg_.line_rate, now));
            b = blocked.emplace(dest, w).first;
        }
        if (b->second > 0) {
            wait = std::min(wait, b->second);
            continue;
        }
        return m;
    }
    return nullptr;
}

void Datapath::tx_loop() {
    std::vector<uint32_t> seqs;
    std::unique_lock<std::mutex> g(tx_mu_);
    while (running_) {
        if (fault_.load(std::memory_order_relaxed) == 2) throw std::bad_alloc();
        double wait;
        TxMsg* m = pick(now_s(), wait);
        if (!m) {
            tx_cv_.wait_for(g, std::chrono::duration<double>(std::min(wait, 0.05)));
            continue;
        }
        if (!m->prepared) {  // a held message whose trigger fired: tags from its payload as it is now
            m->busy = true;
            m->src = m->spec.snapshot ? m->spec.snapshot : m->spec.payload;
            g.unlock();
            Prepared p = prepare(m);
            g.lock();
            install_locked(m, std::move(p));
            m->busy = false;
            tx_cv_.notify_all();
            reorder_locked();
            continue;
        }
        Dest* d = dests_[m->spec.dest];
        bool retx = m->retx_pos < m->retx.size();
        // packets per pick: one GSO call's worth (the preemption granularity between priorities)
        uint32_t size = m->datagram_bytes;
        // (exactly one call's worth: with jumbo frames a call takes 7, and 8 made a 7-segment GSO
        // call and a single datagram of every run, a second system call and skb for one packet)
        uint32_t per_call = std::min<uint32_t>(MAX_SEGMENTS, MAX_GSO_BYTES / size);
        // A datagram of over 32 KB (loopback's 64 KB MTU) is a call of its own, and goes alone,
        // sealed just before its send, so that the kernel's copy reads a payload the tag has
        // just read (eight sealed first are 512 KB, half a core's L2). Measured: a 4-rank 57 MB
        // all_reduce 0.96x the time with one than with eight (median of 9 interleaved rounds).
        uint32_t chunk = per_call < 2 ? 1 : cfg_.offload ? per_call : 8;
        double now = now_s();
        double allowed = std::min(d->pacer.allowance(d->rate, now, cfg_.max_inline_wait),
                                  host_pacer_.allowance(cfg_.line_rate, now, cfg_.max_inline_wait));
        chunk = std::max<uint32_t>(1, std::min<uint32_t>(chunk, uint32_t(std::max(0.0, allowed) / size)));
        uint64_t in_flight = d->sent.load() > d->acked ? d->sent.load() - d->acked : 0;
        if (in_flight < d->window) chunk = std::min<uint32_t>(chunk, uint32_t(d->window - in_flight));
        int before = m->queue_priority();
        seqs.clear();
        // A pass's LAST packets leave in one call: a call that would leave fewer than
        // last_packets behind takes them too (within the credit window). A pass is the first
        // pass with any holes resent during it (resend), or a retransmission.
        uint32_t room = in_flight < d->window ? uint32_t(d->window - in_flight) : chunk;
        uint32_t after;  // packets of the pass still to go after this call
        bool lower_after;  // ... some of them of a lower priority than this call's (endpass.h, last_marks)
        if (retx) {
            uint32_t rest = m->n_pkts - m->next_pos;  // of the first pass, behind its resent holes
            size_t stop = std::min(m->retx.size(), m->retx_pos + chunk);
            if (m->retx.size() - stop + rest < cfg_.last_packets && m->retx.size() - m->retx_pos <= room)
                stop = m->retx.size();
            seqs.assign(m->retx.begin() + m->retx_pos, m->retx.begin() + stop);
            m->retx_pos = stop;
            after = uint32_t(m->retx.size() - stop) + rest;
            lower_after = rest > 0 && m->lowest_priority() < int(cfg_.top_priority);
        } else {
            uint32_t stop = std::min(m->n_pkts, m->next_pos + chunk);
            if (m->n_pkts - stop < cfg_.last_packets && m->n_pkts - m->next_pos <= room) stop = m->n_pkts;
            if (!m->prio_in_order.empty()) {  // one priority per run
                uint8_t p0 = m->prio_in_order[m->next_pos];
                uint32_t j = m->next_pos;
                while (j < stop && m->prio_in_order[j] == p0) ++j;
                stop = j;
            }
            lower_after = stop < m->n_pkts && m->lowest_priority() < m->sending_priority();
            seqs.assign(m->send_order.begin() + m->next_pos, m->send_order.begin() + stop);
            m->next_pos = stop;
            after = m->n_pkts - stop;
        }
        bool finished_pass = !m->has_packets();
        if (!finished_pass && m->queue_priority() != before) reorder_locked();  // (its resends are done)
        uint32_t pass_no = m->pass_no;
        Sock* sk = nullptr;
        auto sit = tx_sealers_.find(d->rank);
        std::shared_ptr<Sealer> sealer = sit == tx_sealers_.end() ? nullptr : sit->second;
        try {
            uint8_t prio = retx ? cfg_.top_priority
                                : uint8_t(rd(m->hdr.data() + size_t(seqs[0]) * H_, cfg_.layout.priority));
            if (sealer) sk = &sock_for(*d, prio);
        } catch (const std::exception&) {
        }
        if (!sk) send_errors_ += int64_t(seqs.size());  // no socket, or no key (peer lost): its control path tells
        m->busy = true;
        g.unlock();
        if (!m->classed.empty()) classify(m, seqs);
        // pace: sleep out this run's deficit (at most about max_inline_wait, by the fit above)
        double total = double(seqs.size()) * size;
        now = now_s();
        double w;
        {
            std::lock_guard<std::mutex> lk(tx_mu_);
            w = std::max(d->pacer.wait_time(total, d->rate, now), host_pacer_.wait_time(total, cfg_.line_rate, now));
        }
        sleep_for(w);
        std::pair<uint32_t, uint64_t> sent{0, 0};
        if (sk) sent = send_packets(m, *sk, *sealer, seqs, retx, last_marks(uint32_t(seqs.size()), after,
                                                                             cfg_.last_packets, lower_after));
        g.lock();
        m->busy = false;
        d->pacer.consume(double(sent.second));
        host_pacer_.consume(double(sent.second));
        d->sent += sent.first;
        {
            int64_t f = int64_t(d->sent.load()) - int64_t(d->acked);
            if (f > max_in_flight_) max_in_flight_ = f;
            if (int64_t(d->window) > max_window_) max_window_ = d->window;
        }
        data_pkts_sent_ += sent.first;
        data_bytes_sent_ += int64_t(sent.second);
        if (retx) {
            m->retransmissions += sent.first;
            retransmitted_pkts_ += sent.first;
        }
        tx_cv_.notify_all();
        if (finished_pass && !m->stopped) emit(EV_TX_PASS, m->spec.dest, m->spec.message_id, now_s(), pass_no);
    }
}

float Datapath::packet_magnitude(const TxMsg* m, uint32_t seq) const {
    const TxSpec& s = m->spec;
    size_t lo = size_t(seq) * s.per, cnt = std::min<size_t>(s.per, size_t(s.total_elems) - lo);
    float v;
    packet_magnitudes(m->src + lo * m->itemsize, cnt, m->kind, uint32_t(cnt), cfg_.magnitude, &v);
    return v;
}

void Datapath::classify(TxMsg* m, const std::vector<uint32_t>& seqs) {
    const TxSpec& s = m->spec;
    for (uint32_t seq : seqs) {
        if (m->classed[seq]) continue;
        uint8_t c = class_of(packet_magnitude(m, seq), m->boundaries);
        wr(m->hdr.data() + size_t(seq) * H_, cfg_.layout.drop_class, c);
        if (s.drop_class_out) s.drop_class_out[seq] = c;
        m->classed[seq] = 1;
    }
}

uint64_t Datapath::sendmmsg_plain(Sock& s, std::vector<iovec>& iov, size_t first, size_t count, uint32_t& sent) {
    // one datagram per mmsghdr (header, payload and trailer gathered by the kernel)
    uint64_t bytes = 0;
    std::vector<mmsghdr> mm(count);
    for (size_t i = 0; i < count; ++i) {
        std::memset(&mm[i], 0, sizeof(mmsghdr));
        mm[i].msg_hdr.msg_iov = &iov[3 * (first + i)];
        mm[i].msg_hdr.msg_iovlen = 3;
    }
    size_t done = 0;
    while (done < count) {
        int r = sendmmsg(s.fd, mm.data() + done, unsigned(count - done), 0);
        if (r < 0) {
            if (errno == EINTR) continue;
            send_errors_ += 1;  // e.g. ECONNREFUSED from a dead peer: skip this datagram
            done += 1;
            continue;
        }
        for (int i = 0; i < r; ++i) bytes += mm[done + i].msg_len;
        sent += uint32_t(r);
        done += size_t(r);
    }
    return bytes;
}

std::pair<uint32_t, uint64_t> Datapath::send_packets(TxMsg* m, Sock& s, Sealer& sealer,
                                                     const std::vector<uint32_t>& seqs, bool retx, uint32_t marks) {
    const HeaderLayout& L = cfg_.layout;
    size_t k = seqs.size();
    if (k == 0) return {0, 0};
    std::vector<uint8_t>& sh = scratch_hdr_;  // only this thread sends
    const uint8_t* hrows;
    std::vector<const uint8_t*> hp(k);
    if (retx) {
        sh.resize(k * size_t(H_));
        for (size_t i = 0; i < k; ++i) {
            uint8_t* h = sh.data() + i * H_;
            std::memcpy(h, m->hdr.data() + size_t(seqs[i]) * H_, H_);
            wr(h, L.priority, cfg_.top_priority);
            wr(h, L.drop_class, 0);
            wr(h, L.flags, (rd(h, L.flags) & ~uint32_t(cfg_.flag_last)) | cfg_.flag_retx);
            hp[i] = h;
        }
    } else {
        hrows = m->hdr.data();
        for (size_t i = 0; i < k; ++i) hp[i] = hrows + size_t(seqs[i]) * H_;
    }
    // the short last packet of a message leaves first, so LAST lands on the run's final rows
    int short_pos = -1;
    if (m->tail)
        for (size_t i = 0; i < k; ++i)
            if (seqs[i] == m->n_full) short_pos = int(i);
    std::vector<size_t> order;
    order.reserve(k);
    if (short_pos >= 0) order.push_back(size_t(short_pos));
    for (size_t i = 0; i < k; ++i)
        if (int(i) != short_pos) order.push_back(i);
    // LAST on the final `marks` packets to leave (last_marks: the pass's final last_packets, of its last level)
    for (size_t j = 0; j < k; ++j) {
        if (k - j > marks) continue;
        uint8_t* h = const_cast<uint8_t*>(hp[order[j]]);
        wr(h, L.flags, rd(h, L.flags) | cfg_.flag_last);
    }
    // Each datagram sealed as it is about to leave, its header final (LAST, a resend's flags, its
    // class): header | payload (or, encrypted, its ciphertext) | trailer, gathered by the kernel.
    std::vector<iovec> iov(3 * k);
    std::vector<uint32_t> len(k);
    const bool encrypt = sealer.mode() == Protect::ENCRYPT;
    scratch_trailers_.resize(k * TRAILER_BYTES);
    if (encrypt) scratch_ct_.resize(k * size_t(m->spec.per) * size_t(m->itemsize));
    for (size_t j = 0; j < k; ++j) {
        size_t i = order[j];
        uint32_t seq = seqs[i];
        uint32_t count = (m->tail && seq == m->n_full) ? m->tail : m->spec.per;
        const uint8_t* payload = m->src + size_t(seq) * m->spec.per * m->itemsize;
        size_t nbytes = size_t(count) * m->itemsize;
        uint8_t* ct = encrypt ? scratch_ct_.data() + j * size_t(m->spec.per) * size_t(m->itemsize) : nullptr;
        uint8_t* trailer = scratch_trailers_.data() + j * TRAILER_BYTES;
        sealer.seal(hp[i], size_t(H_), size_t(L.ptype.off), payload, nbytes, ct, trailer);
        iov[3 * j].iov_base = const_cast<uint8_t*>(hp[i]);
        iov[3 * j].iov_len = size_t(H_);
        iov[3 * j + 1].iov_base = const_cast<uint8_t*>(encrypt ? ct : payload);
        iov[3 * j + 1].iov_len = nbytes;
        iov[3 * j + 2].iov_base = trailer;
        iov[3 * j + 2].iov_len = TRAILER_BYTES;
        len[j] = uint32_t(H_) + count * uint32_t(m->itemsize) + uint32_t(TRAILER_BYTES);
    }
    uint32_t sent = 0;
    uint64_t bytes = 0;
    size_t j = 0;
    while (j < k) {
        // a GSO call: a run of equal-size datagrams (at most MAX_SEGMENTS, MAX_GSO_BYTES)
        size_t stop = j + 1;
        uint32_t seg = len[j];
        while (stop < k && stop - j < size_t(MAX_SEGMENTS) && len[stop] == seg && (stop - j + 1) * seg <= MAX_GSO_BYTES)
            ++stop;
        if (s.gso && stop - j > 1) {
            msghdr mh{};
            mh.msg_iov = &iov[3 * j];
            mh.msg_iovlen = 3 * (stop - j);
            alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(uint16_t))] = {};
            mh.msg_control = cbuf;
            mh.msg_controllen = sizeof cbuf;
            cmsghdr* c = CMSG_FIRSTHDR(&mh);
            c->cmsg_level = SOL_UDP;
            c->cmsg_type = UDP_SEGMENT;
            c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
            uint16_t segsz = uint16_t(seg);
            std::memcpy(CMSG_DATA(c), &segsz, sizeof segsz);
            gso_calls_ += 1;
            ssize_t r;
            do {
                r = sendmsg(s.fd, &mh, 0);
            } while (r < 0 && errno == EINTR);
            if (r >= 0) {
                sent += uint32_t(stop - j);
                bytes += uint64_t(r);
                j = stop;
                continue;
            }
            if (gso_refused(errno)) {
                std::string why = std::string("sendmsg with UDP_SEGMENT failed: ") + std::strerror(errno);
                std::lock_guard<std::mutex> lk(tx_mu_);  // (gso_off_reasons reads it under the lock)
                s.gso = false;
                s.gso_off = std::move(why);
            }
            // this call's datagrams one by one
        }
        bytes += sendmmsg_plain(s, iov, j, stop - j, sent);
        j = stop;
    }
    return {sent, bytes};
}

// ------------------------------------------------------------------ counters

std::map<std::string, int64_t> Datapath::stats() {
    std::map<std::string, int64_t> out;
    out["data_pkts_sent"] = data_pkts_sent_;
    out["data_bytes_sent"] = data_bytes_sent_;
    out["retransmitted_pkts"] = retransmitted_pkts_;
    out["send_errors"] = send_errors_;
    out["gso_calls"] = gso_calls_;
    std::lock_guard<std::mutex> g(rx_mu_);
    out["credit_waits"] = credit_waits_;
    out["credit_timeouts"] = credit_timeouts_;
    out["max_in_flight"] = max_in_flight_;
    out["max_window"] = max_window_;
    out["data_pkts_received"] = data_pkts_received_;
    out["credits_sent"] = credits_sent_;
    out["overrun_credits_sent"] = overrun_credits_sent_;
    out["loss_releases_sent"] = loss_releases_sent_;
    out["credits_received"] = credits_received_;
    out["stops_sent"] = stops_sent_;
    out["stops_received"] = stops_received_;
    out["data_bytes_received"] = data_bytes_received_;
    out["ce_marked"] = ce_marked_;
    out["parked"] = parked_total_;
    out["parked_now"] = parked_now_;
    out["late"] = late_;
    out["rx_overflows"] = rx_overflows_;
    out["rx_dropped_estimate"] = rx_dropped_estimate_;
    out["rx_dropped_reads"] = rx_dropped_reads_;
    out["gro_reads"] = gro_reads_;
    out["rx_reads"] = rx_reads_;
    out["injected_delays"] = injected_delays_;
    out["accepted"] = accepted_;
    out["duplicates"] = duplicates_;
    return out;
}

std::map<std::string, int64_t> Datapath::rejected() {
    static const char* names[N_REASONS] = {"ok", "truncated", "bad_version", "not_data", "wrong_job", "bad_token",
                                           "unknown_message", "wrong_dtype", "bad_seq", "bad_offset", "count_mismatch",
                                           "stale", "bad_mac", "replay"};
    std::map<std::string, int64_t> out;
    std::lock_guard<std::mutex> g(rx_mu_);
    for (int i = 1; i < N_REASONS; ++i)
        if (rejected_[i]) out[names[i]] = rejected_[i];
    return out;
}

std::map<int, int64_t> Datapath::injected_drops() {
    std::lock_guard<std::mutex> g(rx_mu_);
    return injected_drops_;
}

std::vector<std::tuple<int, int, int>> Datapath::data_sockets() {
    std::vector<std::tuple<int, int, int>> out;
    std::lock_guard<std::mutex> g(tx_mu_);
    for (auto& kv : dests_)
        for (auto& s : kv.second->socks) {
            if (s.second.fd < 0) continue;
            sockaddr_in a{};
            socklen_t l = sizeof a;
            if (getsockname(s.second.fd, reinterpret_cast<sockaddr*>(&a), &l) == 0)
                out.emplace_back(kv.first, s.first, ntohs(a.sin_port));
        }
    return out;
}

std::vector<std::string> Datapath::gso_off_reasons() {
    std::vector<std::string> out;
    std::lock_guard<std::mutex> g(tx_mu_);
    for (auto& kv : dests_)
        for (auto& s : kv.second->socks)
            if (s.second.fd >= 0 && !s.second.gso_off.empty()) out.push_back(s.second.gso_off);
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
}

}  // namespace dlcp
