// A token bucket: how long before the next bytes may leave at a rate. The send thread keeps one
// per destination (the rate Python sets) and one for the host (the line rate); the module binds
// it as _datapath.Pacer for its tests (tests/transport/test_core_rules.py).
#pragma once

#include <algorithm>

namespace dlcp {

struct Pacer {
    // ``slack`` (s, RateConfig.pacing_slack): a deficit up to rate x slack is no wait (the bytes
    // leave on credit); a larger one is waited for whole. Tokens may go negative by what was
    // sent on credit or past the bucket (a whole GSO run).
    double burst = 0, tokens = 0, slack = 0, last = -1;
    explicit Pacer(double b = 0, double sl = 0) : burst(b), tokens(b), slack(sl) {}
    void refill(double rate, double now) {
        if (last >= 0) tokens = std::min(burst, tokens + (now - last) * rate);
        last = now;
    }
    // seconds until nbytes may leave (0: now)
    double wait_time(double nbytes, double rate, double now) {
        refill(rate, now);
        double deficit = nbytes - tokens;
        return deficit <= rate * slack ? 0.0 : deficit / rate;
    }
    // bytes that may leave within horizon s from now
    double allowance(double rate, double now, double horizon) {
        refill(rate, now);
        return tokens + rate * horizon;
    }
    void consume(double nbytes) { tokens -= nbytes; }
};

}  // namespace dlcp
