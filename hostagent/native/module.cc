// Python bindings of the compiled data path (module hostagent._datapath), with nanobind.
//
// Thin on purpose: hostagent/datapath/native.py is the Python face (it builds the config from
// wire.py and the policy, allocates and keeps alive every buffer, turns events into records).
// Every call that can wait (for a lock a data path thread holds for a batch, for a message the
// send thread is using, for the threads to stop) releases the interpreter lock while it waits.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>

#include "aegis_mac.h"
#include "datapath.h"
#include "f32_loops.h"
#include "tags.h"
#include "seal.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace dlcp;

using Bytes1D = nb::ndarray<nb::c_contig, nb::device::cpu>;
using U8 = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using U16 = nb::ndarray<uint16_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I64 = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using F32 = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

namespace {

template <typename T>
T get(const nb::dict& d, const char* key) {
    if (!d.contains(key)) throw std::invalid_argument(std::string("datapath config lacks '") + key + "'");
    return nb::cast<T>(d[key]);
}

Config make_config(const nb::dict& d) {
    Config c;
    auto fields = get<std::map<std::string, std::pair<int, int>>>(d, "header_fields");
    c.layout = HeaderLayout::from(get<int>(d, "header_size"), fields);
    c.version = get<uint8_t>(d, "version");
    c.data_ptype = get<uint8_t>(d, "data_ptype");
    c.credit_ptype = get<uint8_t>(d, "credit_ptype");
    c.stop_ptype = get<uint8_t>(d, "stop_ptype");
    c.initial_window = get<uint32_t>(d, "initial_window");
    c.credit_timeout = get<double>(d, "credit_timeout");
    c.credit_quiet = get<double>(d, "credit_quiet");
    c.credit_share = get<uint32_t>(d, "credit_share");
    c.min_window = get<uint32_t>(d, "min_window");
    c.max_window = get<uint32_t>(d, "max_window");
    c.flag_retx = get<uint8_t>(d, "flag_retx");
    c.flag_last = get<uint8_t>(d, "flag_last");
    c.last_packets = get<uint32_t>(d, "last_packets");
    c.flag_release = get<uint8_t>(d, "flag_release");
    for (auto& kv : get<std::map<int, int>>(d, "kinds")) c.kinds[uint8_t(kv.first)] = Kind(kv.second);
    c.job_id = get<uint32_t>(d, "job_id");
    c.rank = get<uint16_t>(d, "rank");
    c.rx_fd = get<int>(d, "rx_fd");
    c.gro = get<bool>(d, "gro");
    c.offload = get<bool>(d, "offload");
    c.max_datagram = get<uint32_t>(d, "max_datagram");
    {
        int protect = get<int>(d, "protect");
        if (protect < 0 || protect > 2) throw std::invalid_argument("protect is 0 (none), 1 (MAC) or 2 (encrypt)");
        c.protect = Protect(protect);
    }
    c.rx_batch = get<uint32_t>(d, "rx_batch");
    c.batch_bytes = get<uint32_t>(d, "batch_bytes");
    c.socket_buffer = get<int>(d, "socket_buffer");
    c.park_limit = get<uint32_t>(d, "park_limit");
    c.top_priority = get<uint8_t>(d, "top_priority");
    c.dscp = get<std::vector<uint8_t>>(d, "dscp");
    c.shares = get<std::vector<double>>(d, "shares");
    c.magnitude = get<std::string>(d, "magnitude") == "maxabs" ? Magnitude::MaxAbs : Magnitude::L2;
    c.parallel_magnitude_elems = get<uint64_t>(d, "parallel_magnitude_elems");
    c.magnitude_threads = get<uint32_t>(d, "magnitude_threads");
    c.class_sampling.sampled_min = get<uint32_t>(d, "sampled_classes_packets");
    c.class_sampling.sample = get<uint32_t>(d, "class_sample");
    if (c.class_sampling.sample == 0) throw std::invalid_argument("class_sample must be > 0");
    c.line_rate = get<double>(d, "line_rate");
    c.burst_bytes = get<double>(d, "burst_bytes");
    c.pacing_slack = get<double>(d, "pacing_slack");
    c.max_inline_wait = get<double>(d, "max_inline_wait");
    c.event_defer = get<double>(d, "event_defer");
    c.drop_p = get<std::vector<double>>(d, "drop_p");
    c.delay = get<double>(d, "delay");
    c.delay_p = get<double>(d, "delay_p");
    c.reorder = get<bool>(d, "reorder");
    c.seed = get<uint64_t>(d, "seed");
    c.drain_stretch = get<double>(d, "drain_stretch");
    c.answer_grace = get<double>(d, "answer_grace");
    c.answer.max_grace = get<double>(d, "max_answer_grace");
    c.answer.gaps = get<double>(d, "answer_gaps");
    c.answer.max_busy_defer = get<double>(d, "max_busy_defer");
    c.reorder_min = get<double>(d, "reorder_min");
    c.reorder_margin = get<double>(d, "reorder_margin");
    c.reorder_decay = get<double>(d, "reorder_decay");
    c.reorder_persist = get<uint32_t>(d, "reorder_persist");
    c.fresh_window = get<uint32_t>(d, "fresh_window");
    c.fresh_kept = get<uint32_t>(d, "fresh_kept");
    c.drain_min_bytes = get<double>(d, "drain_min_bytes");
    c.drain_fresh = get<double>(d, "drain_fresh");
    c.behind_backlog = get<double>(d, "behind_backlog");
    c.source_port_base = get<uint16_t>(d, "source_port_base");
    return c;
}

// Every array the extension reads or writes through a typed pointer must be aligned to its
// elements (numpy allows views at odd byte offsets; a float* to one is undefined behaviour).
void need_aligned(const void* p, size_t align, const char* what) {
    if (reinterpret_cast<uintptr_t>(p) % align != 0)
        throw std::invalid_argument(std::string(what) + " is not aligned to its " + std::to_string(align) +
                                    "-byte elements (a view at an odd byte offset?); pass a copy");
}

Kind kind_of(int kind) {
    if (kind < 0 || kind > int(Kind::BF16)) throw std::invalid_argument("unknown element kind " + std::to_string(kind));
    return Kind(kind);
}

nb::tuple progress_tuple(const Progress& p) {
    return nb::make_tuple(p.received_pkts, p.received_elems, p.duplicates, p.retx_seen, p.first_arrival,
                          p.last_arrival, p.state, p.gaps);
}

}  // namespace

NB_MODULE(_datapath, m) {
    m.doc() = "DLCP's compiled per-packet path (see hostagent/native/datapath.h).";
    // A process group that torch (a DeviceMesh, say) keeps until the interpreter exits keeps
    // its stopped data path alive until then too; nanobind would print that as a leak.
    nb::set_leak_warnings(false);

    // The packet protection of seal.h, for the control connections, tools and tests: the same code the
    // compiled path seals and opens with, so the rule lives in one place.
    m.attr("TRAILER_BYTES") = TRAILER_BYTES;
    m.attr("EPOCH_BITS") = Sealer::EPOCH_BITS;
    m.attr("SEAL_LIBRARY") = SEAL_LIBRARY;
    m.attr("LOOPS_TARGET") = loops_target();
    m.attr("MAC_TARGET") = aegis_target();
    // AEGISMAC-128X4 (aegis_mac.h) of `data` with a named build ("" for this CPU's best), for
    // the known-answer tests and bench/seal_rate.py: given as two parts, data[:split] and the
    // rest (as a datagram's header and payload are); `repeat` times over from one Init (a rate's
    // loop, GIL released). ValueError when this CPU cannot run the build.
    m.def("aegis_mac",
          [](nb::bytes key, nb::bytes nonce, nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> data,
             std::string target, size_t repeat, size_t split) {
              if (key.size() != AEGIS_KEY_BYTES || nonce.size() != AEGIS_NONCE_BYTES)
                  throw std::invalid_argument("AEGISMAC-128X4 takes a 16-byte key and a 16-byte nonce");
              const uint8_t* k = reinterpret_cast<const uint8_t*>(key.c_str());
              const uint8_t* n = reinterpret_cast<const uint8_t*>(nonce.c_str());
              const size_t a = split < data.size() ? split : data.size();
              MacPart parts[2] = {{data.data(), a}, {data.data() + a, data.size() - a}};
              AegisMacKey mk(k, n, target.empty() ? nullptr : target.c_str());  // (invalid_argument: ValueError)
              uint8_t tag[AEGIS_TAG_BYTES];
              {
                  nb::gil_scoped_release quiet;
                  for (size_t i = 0; i < (repeat ? repeat : 1); ++i) mk.mac(parts, 2, tag);
              }
              return nb::bytes(reinterpret_cast<const char*>(tag), AEGIS_TAG_BYTES);
          },
          "key"_a, "nonce"_a, "data"_a, "target"_a = "", "repeat"_a = 1, "split"_a = SIZE_MAX);
    m.def("epoch_key",
          [](nb::bytes key, uint8_t ptype, uint64_t epoch) {
              if (key.size() != KEY_BYTES) throw std::invalid_argument("a direction key has 16 bytes");
              uint8_t out[KEY_BYTES];
              epoch_key(reinterpret_cast<const uint8_t*>(key.c_str()), ptype, epoch, out);
              return nb::bytes(reinterpret_cast<const char*>(out), KEY_BYTES);
          },
          "key"_a, "ptype"_a, "epoch"_a);
    // The rule of when an end of pass is answered (endpass.h): the receive thread's, for the
    // protocol core in Python too, so that it is written once.
    m.def("mean_gap", &mean_gap, "received_pkts"_a, "first_arrival"_a, "last_arrival"_a);
    m.def("answer_grace",
          [](double floor, double gap, double max_grace, double gaps) {
              return answer_grace(floor, gap, AnswerRule{max_grace, gaps, 0.0});
          },
          "floor"_a, "gap"_a, "max_grace"_a, "gaps"_a);
    m.def("answer_check",
          [](double now, double last_arrival, double grace, double seen_until, double since, double max_busy_defer) {
              AnswerCheck c = answer_check(now, last_arrival, grace, seen_until, since, AnswerRule{0.0, 0.0, max_busy_defer});
              return std::make_tuple(c.due, c.wake);
          },
          "now"_a, "last_arrival"_a, "grace"_a, "seen_until"_a, "since"_a, "max_busy_defer"_a);
    m.def("last_marks", &last_marks, "k"_a, "after"_a, "last_packets"_a, "lower_after"_a);
    // The reordering window's rules (endpass.h), for the reference data path in tests.
    m.def("reorder_lateness", &reorder_lateness, "last_flag"_a, "at"_a, "last_at"_a, "quiet_since"_a, "window"_a);
    m.def("narrows_window", &narrows_window, "last_seen"_a, "late"_a, "recovered"_a);
    nb::class_<Sealer>(m, "PacketSealer")
        .def("__init__",
             [](Sealer* self, nb::bytes key, int mode, unsigned epoch_bits) {
                 if (key.size() != KEY_BYTES) throw std::invalid_argument("a direction key has 16 bytes");
                 if (mode < 0 || mode > 2) throw std::invalid_argument("mode is 0 (none), 1 (MAC) or 2 (encrypt)");
                 if (epoch_bits < 1 || epoch_bits > 62) throw std::invalid_argument("epoch_bits is 1..62");
                 new (self) Sealer(reinterpret_cast<const uint8_t*>(key.c_str()), Protect(mode), epoch_bits);
             },
             "key"_a, "mode"_a, "epoch_bits"_a = Sealer::EPOCH_BITS)
        .def_prop_ro("mode", [](const Sealer& s) { return int(s.mode()); })
        .def_prop_ro("sealed", &Sealer::sealed)
        .def_prop_ro("keys_derived", &Sealer::keys_derived)
        .def("seal_rows",
             [](Sealer& s, nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> rows, I64 lengths,
                size_t header_size, size_t ptype_offset) {
                 // row i: a datagram of lengths[i] bytes; its trailer is written after it (the payload
                 // encrypted in place with ENCRYPT)
                 size_t n = rows.shape(0), width = rows.shape(1);
                 if (lengths.shape(0) != n) throw std::invalid_argument("seal_rows: one length per row");
                 need_aligned(lengths.data(), alignof(int64_t), "seal_rows: lengths");
                 for (size_t i = 0; i < n; ++i)
                     if (lengths.data()[i] < int64_t(header_size) || size_t(lengths.data()[i]) + TRAILER_BYTES > width ||
                         ptype_offset >= header_size)
                         throw std::invalid_argument("seal_rows: row " + std::to_string(i) + " holds no header, or "
                                                     "no room for its trailer");
                 nb::gil_scoped_release r;
                 for (size_t i = 0; i < n; ++i) {
                     uint8_t* d = rows.data() + i * width;
                     size_t len = size_t(lengths.data()[i]);
                     s.seal(d, header_size, ptype_offset, d + header_size, len - header_size, d + header_size, d + len);
                 }
             },
             "rows"_a, "lengths"_a, "header_size"_a, "ptype_offset"_a)
        .def("open_rows",
             [](Sealer& s, nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> rows, I64 lengths, I64 which,
                size_t header_size, size_t ptype_offset, U8 ok) {
                 // rows[which[j]] (lengths[which[j]] bytes, trailer included) checked and, with
                 // ENCRYPT, decrypted in place; ok[j]: 1 authentic, 0 not, 2 a replay (Opened)
                 size_t n = rows.shape(0), width = rows.shape(1), k = which.shape(0);
                 if (lengths.shape(0) != n || ok.shape(0) < k)
                     throw std::invalid_argument("open_rows: one length per row and one ok per row opened");
                 need_aligned(lengths.data(), alignof(int64_t), "open_rows: lengths");
                 need_aligned(which.data(), alignof(int64_t), "open_rows: which");
                 for (size_t j = 0; j < k; ++j) {
                     int64_t i = which.data()[j];
                     if (i < 0 || size_t(i) >= n) throw std::invalid_argument("open_rows: a row index out of range");
                 }
                 nb::gil_scoped_release r;
                 for (size_t j = 0; j < k; ++j) {
                     size_t i = size_t(which.data()[j]);
                     int64_t len = lengths.data()[i];
                     ok.data()[j] = uint8_t(len >= 0 && size_t(len) <= width
                                                ? s.open(rows.data() + i * width, size_t(len), header_size, ptype_offset)
                                                : Opened::FORGED);
                 }
             },
             "rows"_a, "lengths"_a, "which"_a, "header_size"_a, "ptype_offset"_a, "ok"_a);

    nb::class_<Pacer>(m, "Pacer")
        .def(nb::init<double, double>(), "burst_bytes"_a, "slack"_a = 0.0)
        .def("wait_time", &Pacer::wait_time, "nbytes"_a, "rate"_a, "now"_a)
        .def("allowance", &Pacer::allowance, "rate"_a, "now"_a, "horizon"_a)
        .def("consume", &Pacer::consume, "nbytes"_a)
        .def_ro("tokens", &Pacer::tokens);
    m.def("packet_magnitudes",
          [](Bytes1D data, int kind, uint32_t per, const std::string& how, F32 out) {
              Kind k = kind_of(kind);
              if (per == 0) throw std::invalid_argument("packet_magnitudes: per must be > 0");
              if (how != "l2" && how != "maxabs")
                  throw std::invalid_argument("packet_magnitudes: how is 'l2' or 'maxabs', not '" + how + "'");
              if (data.nbytes() % size_t(kind_size(k)))
                  throw std::invalid_argument("packet_magnitudes: data is not a whole number of elements");
              size_t n = data.nbytes() / size_t(kind_size(k));
              size_t pkts = (n + per - 1) / per;
              if (out.shape(0) < pkts)
                  throw std::invalid_argument("packet_magnitudes: out has " + std::to_string(out.shape(0)) +
                                              " entries for " + std::to_string(pkts) + " packets");
              need_aligned(out.data(), alignof(float), "packet_magnitudes: out");
              nb::gil_scoped_release r;
              packet_magnitudes(reinterpret_cast<const uint8_t*>(data.data()), n, k, per,
                                how == "maxabs" ? Magnitude::MaxAbs : Magnitude::L2, out.data());
          },
          "data"_a, "kind"_a, "per"_a, "how"_a, "out"_a);

    m.def("drop_classes",
          [](F32 mags, std::vector<double> shares, uint32_t sampled_classes_packets, uint32_t class_sample, U8 out) {
              if (class_sample == 0) throw std::invalid_argument("class_sample must be > 0");
              if (out.shape(0) < mags.shape(0)) throw std::invalid_argument("drop_classes: out too short");
              need_aligned(mags.data(), alignof(float), "drop_classes: magnitudes");
              drop_classes(mags.data(), mags.shape(0), shares, ClassSampling{sampled_classes_packets, class_sample},
                           out.data());
          },
          "magnitudes"_a, "shares"_a, "sampled_classes_packets"_a, "class_sample"_a, "out"_a);

    nb::class_<Datapath>(m, "Datapath")
        .def("__init__", [](Datapath* self, nb::dict cfg) { new (self) Datapath(make_config(cfg)); })
        .def("start", &Datapath::start, nb::call_guard<nb::gil_scoped_release>())
        .def("stop", &Datapath::stop, nb::call_guard<nb::gil_scoped_release>())
        .def("close", &Datapath::close, nb::call_guard<nb::gil_scoped_release>())
        .def("event_fd", &Datapath::event_fd)
        .def("deferred_event_fd", &Datapath::deferred_event_fd)
        .def("take_events",
             [](Datapath& d) {
                 std::vector<Event> evs;
                 {
                     nb::gil_scoped_release r;
                     evs = d.take_events();
                 }
                 nb::list out;
                 for (const Event& e : evs) out.append(nb::make_tuple(e.kind, e.peer, e.message_id, e.time, e.a));
                 return out;
             })
        .def("add_peer", &Datapath::add_peer, "rank"_a, "ipv4"_a, "port"_a, nb::call_guard<nb::gil_scoped_release>())
        .def("set_rx_key", [](Datapath& d, uint16_t rank, nb::bytes key) {
                 std::string k(key.c_str(), key.size());
                 nb::gil_scoped_release r;  // (the receive thread may hold its lock for a batch)
                 d.set_rx_key(rank, k);
             })
        .def("set_tx_key", [](Datapath& d, uint16_t rank, nb::bytes key) {
                 std::string k(key.c_str(), key.size());
                 nb::gil_scoped_release r;
                 d.set_tx_key(rank, k);
             })
        .def("expect",
             [](Datapath& d, uint16_t src, uint32_t mid, uint32_t token, uint8_t dtype, uint64_t total, uint32_t per,
                Bytes1D out, bool accumulate, uint8_t out_dtype, U8 received, U8 prio, I64 layer, uint64_t required,
                std::vector<std::pair<uint16_t, uint32_t>> triggers, double scale, uint32_t iteration,
                bool classify) {
                 RxSpec s;
                 s.iteration = iteration;
                 s.classify = classify;
                 s.src = src;
                 s.message_id = mid;
                 s.token = token;
                 s.dtype = dtype;
                 s.total_elems = total;
                 s.per = per;
                 s.out = reinterpret_cast<uint8_t*>(out.data());
                 s.accumulate = accumulate;
                 s.out_dtype = out_dtype;
                 size_t pkts = per ? size_t((total + per - 1) / per) : 0;
                 if (received.shape(0) < pkts || prio.shape(0) < pkts || layer.shape(0) < pkts)
                     throw std::invalid_argument("expect: per-packet arrays are shorter than the message");
                 s.out_bytes = out.nbytes();
                 need_aligned(layer.data(), alignof(int64_t), "expect: pkt_layer");
                 s.received = received.data();
                 s.pkt_priority = prio.data();
                 s.pkt_layer = layer.data();
                 s.required_elems = required;
                 s.triggers = std::move(triggers);
                 s.scale = float(scale);
                 nb::gil_scoped_release r;
                 d.expect(s);
             },
             "src"_a, "message_id"_a, "token"_a, "dtype"_a, "total_elems"_a, "per"_a, "out"_a, "accumulate"_a,
             "out_dtype"_a, "received"_a, "pkt_priority"_a, "pkt_layer"_a, "required_elems"_a, "triggers"_a,
             "scale"_a = 1.0, "iteration"_a = 0, "classify"_a = true)
        .def("progress",
             [](Datapath& d, uint16_t src, uint32_t mid) -> nb::object {
                 Progress p;
                 bool known;
                 {
                     nb::gil_scoped_release r;  // (the receive thread may hold its lock for a batch)
                     known = d.progress(src, mid, p);
                 }
                 if (!known) return nb::none();
                 return progress_tuple(p);
             })
        .def("progress_changed",
             [](Datapath& d) {
                 std::vector<std::tuple<uint16_t, uint32_t, Progress>> all;
                 {
                     nb::gil_scoped_release r;
                     all = d.progress_changed();
                 }
                 nb::list out;
                 for (auto& [src, mid, p] : all) out.append(nb::make_tuple(src, mid, progress_tuple(p)));
                 return out;
             })
        .def("complete", &Datapath::complete, "src"_a, "message_id"_a, "fire"_a,
             nb::call_guard<nb::gil_scoped_release>())
        .def("forget", &Datapath::forget, "src"_a, "message_id"_a, "remember"_a,
             nb::call_guard<nb::gil_scoped_release>())
        .def("expire_parked", &Datapath::expire_parked, nb::call_guard<nb::gil_scoped_release>())
        .def("take_feedback",
             [](Datapath& d, uint16_t src) {
                 uint64_t r, c, l;
                 {
                     nb::gil_scoped_release g;
                     d.take_feedback(src, r, c, l);
                 }
                 return nb::make_tuple(r, c, l);
             })
        .def("active_senders", &Datapath::active_senders, nb::call_guard<nb::gil_scoped_release>())
        .def("drain_rate", &Datapath::drain_rate, nb::call_guard<nb::gil_scoped_release>())
        .def("rx_seen_until", &Datapath::rx_seen_until, nb::call_guard<nb::gil_scoped_release>())
        .def("reorder_window", &Datapath::reorder_window, nb::call_guard<nb::gil_scoped_release>())
        .def("holes", &Datapath::holes, nb::call_guard<nb::gil_scoped_release>())
        .def("submit",
             [](Datapath& d, uint16_t dest, uint32_t mid, Bytes1D payload, uint8_t dtype, uint64_t total, uint32_t per,
                uint32_t token, uint32_t iteration, uint32_t tensor_id, uint32_t layer, uint8_t priority,
                nb::object pkt_priority, nb::object pkt_layer, U8 drop_class_out, nb::object snapshot, bool held,
                uint64_t order, bool tags_given) {
                 TxSpec s;
                 s.dest = dest;
                 s.message_id = mid;
                 s.payload = reinterpret_cast<const uint8_t*>(payload.data());
                 s.payload_bytes = payload.nbytes();
                 s.dtype = dtype;
                 s.total_elems = total;
                 s.per = per;
                 s.token = token;
                 s.iteration = iteration;
                 s.tensor_id = tensor_id;
                 s.layer = layer;
                 s.priority = priority;
                 size_t pkts = per ? size_t((total + per - 1) / per) : 0;
                 if (drop_class_out.shape(0) < pkts) throw std::invalid_argument("submit: drop_class_out too short");
                 s.drop_class_out = drop_class_out.data();
                 if (!pkt_priority.is_none()) {
                     U8 a = nb::cast<U8>(pkt_priority);
                     if (a.shape(0) < pkts) throw std::invalid_argument("submit: packet priorities too short");
                     s.pkt_priority = a.data();
                 }
                 if (!pkt_layer.is_none()) {
                     U16 a = nb::cast<U16>(pkt_layer);
                     if (a.shape(0) < pkts) throw std::invalid_argument("submit: packet layers too short");
                     need_aligned(a.data(), alignof(uint16_t), "submit: packet layers");
                     s.pkt_layer = a.data();
                 }
                 if (!snapshot.is_none()) {
                     Bytes1D a = nb::cast<Bytes1D>(snapshot);
                     s.snapshot = reinterpret_cast<uint8_t*>(a.data());
                     s.snapshot_bytes = a.nbytes();  // (checked against the message, not the payload)
                 }
                 s.held = held;
                 s.order = order;
                 s.tags_given = tags_given;
                 nb::gil_scoped_release r;
                 d.submit(s);
             },
             "dest"_a, "message_id"_a, "payload"_a, "dtype"_a, "total_elems"_a, "per"_a, "token"_a, "iteration"_a,
             "tensor_id"_a, "layer"_a, "priority"_a, nb::arg("pkt_priority").none(), nb::arg("pkt_layer").none(),
             "drop_class_out"_a,
             nb::arg("snapshot").none(), "held"_a, "order"_a, "tags_given"_a = false)
        .def("retransmit",
             [](Datapath& d, uint16_t dest, uint32_t mid, std::vector<uint32_t> seqs) {
                 nb::gil_scoped_release r;
                 return d.retransmit(dest, mid, seqs);
             })
        .def("resend",
             [](Datapath& d, uint16_t dest, uint32_t mid, std::vector<uint32_t> seqs) {
                 nb::gil_scoped_release r;
                 return d.resend(dest, mid, seqs);
             })
        .def("tx_info",
             [](Datapath& d, uint16_t dest, uint32_t mid) -> nb::object {
                 TxInfo t;
                 bool known;
                 {
                     nb::gil_scoped_release r;
                     known = d.tx_info(dest, mid, t);
                 }
                 if (!known) return nb::none();
                 return nb::make_tuple(t.packets, t.next_pos, t.retransmissions, t.pass_no, t.active, t.held);
             })
        .def("retire", &Datapath::retire, nb::call_guard<nb::gil_scoped_release>())
        .def("set_rate", &Datapath::set_rate, nb::call_guard<nb::gil_scoped_release>())
        .def("set_probe_delay", &Datapath::set_probe_delay, nb::call_guard<nb::gil_scoped_release>())
        .def("sent_packets", &Datapath::sent_packets, nb::call_guard<nb::gil_scoped_release>())
        .def("set_sockopt", &Datapath::set_sockopt, "dest"_a, "priority"_a, "level"_a, "name"_a, "value"_a,
             nb::call_guard<nb::gil_scoped_release>())
        // (each waits for a lock a data path thread may hold for a batch: never with the
        // interpreter lock, which training threads need meanwhile; results convert after)
        .def("stats", &Datapath::stats, nb::call_guard<nb::gil_scoped_release>())
        .def("rejected", &Datapath::rejected, nb::call_guard<nb::gil_scoped_release>())
        .def("injected_drops", &Datapath::injected_drops, nb::call_guard<nb::gil_scoped_release>())
        .def("data_sockets", &Datapath::data_sockets, nb::call_guard<nb::gil_scoped_release>())
        .def("gso_off_reasons", &Datapath::gso_off_reasons, nb::call_guard<nb::gil_scoped_release>())
        .def("hold_lock_for_test", &Datapath::hold_lock_for_test, "which"_a, "timeout"_a,
             nb::call_guard<nb::gil_scoped_release>())
        .def("release_lock_for_test", &Datapath::release_lock_for_test, nb::call_guard<nb::gil_scoped_release>())
        .def("failure", &Datapath::failure, nb::call_guard<nb::gil_scoped_release>())
        .def("fault_for_test", &Datapath::fault_for_test, nb::call_guard<nb::gil_scoped_release>())
        .def("emit_for_test", &Datapath::emit_for_test, nb::call_guard<nb::gil_scoped_release>())
        .def("end_passes_for_test",
             [](Datapath& d, double now, double seen_until) { return d.end_passes_for_test(now, seen_until); },
             nb::call_guard<nb::gil_scoped_release>())
        .def("credits_for_test",
             // -> (wake, [(rank, window, consumed, release, sealed datagram), ...])
             [](Datapath& d, double now, double seen_until, uint32_t socket_memory) {
                 std::vector<CreditOut> out;
                 double wake = 0;
                 {
                     nb::gil_scoped_release g;
                     out = d.credits_for_test(now, seen_until, socket_memory, wake);
                 }
                 nb::list credits;
                 for (const CreditOut& c : out)
                     credits.append(nb::make_tuple(c.rank, c.window, c.consumed, c.release,
                                                   nb::bytes(reinterpret_cast<const char*>(c.bytes.data()),
                                                             c.bytes.size())));
                 return nb::make_tuple(wake, credits);
             },
             "now"_a, "seen_until"_a, "socket_memory"_a = 0)
        .def("account_reads_for_test", &Datapath::account_reads_for_test, "reads"_a, "overflow"_a, "now"_a,
             nb::call_guard<nb::gil_scoped_release>())
        .def("drain_batch_for_test", &Datapath::drain_batch_for_test, "started"_a, "nbytes"_a, "behind"_a, "now"_a,
             nb::call_guard<nb::gil_scoped_release>())
        .def("ingest_for_test",
             [](Datapath& d, nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> rows, I64 lengths,
                double now) {
                 if (rows.shape(0) != lengths.shape(0)) throw std::invalid_argument("one length per row");
                 need_aligned(lengths.data(), alignof(int64_t), "ingest_for_test: lengths");
                 std::vector<uint8_t> r;
                 {
                     nb::gil_scoped_release g;
                     r = d.ingest_for_test(rows.data(), lengths.data(), rows.shape(0), rows.shape(1), now);
                 }
                 return r;
             });
}
