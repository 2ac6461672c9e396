// Per-packet tags the compiled send path computes: packet magnitudes and drop classes (when a
// message becomes ready to send, or for a large message, each packet's as it first leaves,
// from boundaries a sample set). The rule is hostagent.policy's (packet_magnitudes,
// drop_classes), which stays the reference; tests check this code gives the same classes for
// the same magnitudes and the same magnitudes to float32 rounding. Why here too: a ring step's
// partial sum exists only when the previous step completes, and it leaves from this thread
// without waiting for Python.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "layout.h"

namespace dlcp {

enum class Magnitude : uint8_t { L2 = 0, MaxAbs = 1 };

// Magnitude of each packet of `n_elems` elements cut into `per`-element packets.
void packet_magnitudes(const uint8_t* data, size_t n_elems, Kind kind, uint32_t per, Magnitude how, float* out);

// Which packets set a message's class boundaries (hostagent.policy.class_sample): every one
// below `sampled_min` packets; else one of each run of stride(n) packets (n / stride runs), at
// the offset index(run) gives.
struct ClassSampling {
    uint32_t sampled_min = 4096;  // policy.SAMPLED_CLASSES_PACKETS
    uint32_t sample = 1024;       // policy.CLASS_SAMPLE
    uint32_t stride(size_t n) const { return n < sampled_min ? 1 : uint32_t(n / sample); }
    size_t index(size_t run, uint32_t stride) const {
        return run * stride + uint32_t(uint64_t(run) * 2654435761u) % stride;
    }
};

// Drop class of each packet from its magnitude: the largest shares[0] get class 0, the next
// shares[1] class 1, ...; NaN ranks last. Below sampling.sampled_min packets exactly by rank
// (ties taken in packet order); from it on by the boundaries a sample gives (class_boundaries).
void drop_classes(const float* mags, size_t n, const std::vector<double>& shares, const ClassSampling& sampling,
                  uint8_t* out);

// The value of each class boundary from a sample of k magnitudes (policy.class_boundaries):
// the b-th largest, +inf where b is 0 (no packet within), -inf where b is k (every one).
std::vector<float> class_boundaries(const float* sample, size_t k, const std::vector<double>& shares);

// A packet's class from the boundaries: how many it is below (NaN: below every one).
inline uint8_t class_of(float m, const std::vector<float>& boundaries) {
    uint8_t c = 0;
    for (float t : boundaries) c += (t == __builtin_inff()) || (t != -__builtin_inff() && !(m >= t));
    return std::min<uint8_t>(c, uint8_t(boundaries.size()));
}

}  // namespace dlcp
