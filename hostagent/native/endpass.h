// When a receiver answers the end of a sender's pass, and which packets ask for that answer: the
// one definition of each rule, pure (no clock, no lock, no message state). The receive thread
// uses the first to complete a bounded message after its LAST (Datapath::end_passes); the
// protocol core in Python uses the same functions, through the bindings `answer_grace` and
// `answer_check`, to time its answers to a LAST or a PROBE (hostagent/protocol/incoming.py).
// Settings and why: the constants of that module (MAX_ANSWER_GRACE, ANSWER_GAPS,
// MAX_BUSY_DEFER), passed in, so they too are defined once. The send thread uses `last_marks`,
// and the reference data path through its binding (tests/reference/numpy_path.py).
#pragma once

#include <algorithm>

namespace dlcp {

struct AnswerRule {
    double max_grace = 0.1;       // an end of pass is answered after at most this much quiet
    double gaps = 4;              // ... and after at least this many of the message's mean gaps
    double max_busy_defer = 0.2;  // how long past its grace an answer waits for a reader behind
};

// The mean time between a message's packets so far, or -1 before two of them came.
inline double mean_gap(unsigned long long received_pkts, double first_arrival, double last_arrival) {
    return received_pkts >= 2 ? (last_arrival - first_arrival) / double(received_pkts - 1) : -1.0;
}

// How long no data of the message must have come before its end of pass is answered: `floor`
// (the sender's reordering window) or `gaps` of its mean gaps between packets if longer, at most
// `max_grace`; `gap` < 0 (no pace known yet): the floor. Why the message's own pace: a sprayed
// message's LAST overtakes packets still queued on another path, which come within a few
// packet times of that path; an answer sooner lists them as missing.
inline double answer_grace(double floor, double gap, const AnswerRule& r) {
    return gap < 0 ? floor : std::max(floor, std::min(r.max_grace, r.gaps * gap));
}

// How late a first-pass packet (not a resend) of a message whose end of pass was seen shows the
// sender's path to be, for its reordering window (Datapath::widen_window); <= 0: not reordered.
// `at`: its arrival; `last_at`: the pass's first LAST packet's; `quiet_since`: the message's
// previous arrival; `window`: the sender's reordering window, the floor of the end of pass's
// grace. A packet without LAST after the first LAST was overtaken: late by `at - last_at`. The
// pass's other LAST packets come after the first by design, so they count only when the
// message had been quiet longer than the window before them: late by that quiet gap, which the
// window must cover. (A slow path's grace is its message's own pace, answer_grace's gaps, which
// a window of that gap's size does not change.) Why: a path that pauses between bursts (a
// software switch descheduled for a millisecond) delivered a pass's first LAST, then after the
// pause the other two; they never widened the window, which narrowed to its floor, and answers
// within the pause listed them missing: the testbed's rings resent 0.5 % of their packets with
// nothing lost.
inline double reorder_lateness(bool last_flag, double at, double last_at, double quiet_since, double window) {
    if (last_at <= 0 || at <= last_at) return 0.0;
    if (!last_flag) return at - last_at;
    double quiet = at - quiet_since;
    return quiet > window ? quiet : 0.0;
}

// Whether a finished message counts towards narrowing its sender's reordering window (every
// reorder_persist of them in a row, Datapath::narrow_window): its pass ended (a LAST came), no
// packet of it came late, and the window was put to use: an answer had to decide on packets
// that did not come (`recovered`: resends came, or it completed with packets left out). Why only then
// (RACK's reo_wnd_persist counts loss recoveries, RFC 8985): a narrower window pays off only
// when packets are lost; narrowed by every clean pass, a ring's window fell to its floor within
// a few dozen passes on a path that never lost a packet, and every pause of that path longer
// than the floor then had packets resent.
inline bool narrows_window(bool last_seen, bool late, bool recovered) {
    return last_seen && !late && recovered;
}

struct AnswerCheck {
    bool due;     // answer now
    double wake;  // if not: when the answer can next become due (0 when due)
};

// Whether an end of pass waiting since `since` is answered at `now`: the message has been quiet
// for its grace since its `last_arrival` (the kernel's stamp), and the receive thread has read
// everything that arrived until the grace's end (`seen_until`), or it has stayed behind for
// max_busy_defer past the grace (counted from the later of `since` and the last arrival: a
// flood must not hold every answer back until the deadline). When not due, `wake` is the quiet
// time's end, or else the fallback's; a reader that moves `seen_until` makes it due sooner.
inline AnswerCheck answer_check(double now, double last_arrival, double grace, double seen_until, double since,
                                const AnswerRule& r) {
    double quiet_at = last_arrival + grace;
    if (now < quiet_at) return {false, quiet_at};
    if (seen_until >= quiet_at) return {true, 0.0};
    double fallback = std::max(since, last_arrival) + grace + r.max_busy_defer;
    if (now >= fallback) return {true, 0.0};
    return {false, fallback};
}

// How many of a sending call's `k` packets, its final ones as they leave, carry LAST (the flag that
// asks the receiver to answer the end of the pass, wire.LAST_PACKETS): those within the pass's
// final `last_packets`, with `after` packets of the pass still to go behind the call; none while
// the packets still to go include a lower priority than the call's (`lower_after`), so the LAST
// packets are those of the pass's last priority level (fewer when it has fewer). Why: a pass
// leaves by priority, and a lower priority's packets may wait behind more urgent ones, in the
// switches' strict-priority queues and at the sender behind a more urgent message. A LAST ahead
// of them had the receiver answer while they waited and list them as missing, and they were sent
// again: captured at a parameter server's worker, each pull's one packet of priority 1, left
// behind LAST on two packets of priority 3, came only as the resend its bitmap asked for, in
// every pull but the iteration's last (about 3,000 resends a run with nothing dropped).
inline unsigned last_marks(unsigned k, unsigned long long after, unsigned last_packets, bool lower_after) {
    if (lower_after || after >= last_packets) return 0;
    return unsigned(std::min<unsigned long long>(k, last_packets - after));
}

}  // namespace dlcp
