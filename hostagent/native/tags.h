// Per-packet tags the compiled send path computes when a message becomes ready to send:
// packet magnitudes and drop classes. The rule is hostagent.policy's (packet_magnitudes,
// drop_classes), which stays the reference; tests check this code gives the same classes for
// the same magnitudes and the same magnitudes to float32 rounding. Why here too: a ring step's
// partial sum exists only when the previous step completes, and it leaves from this thread
// without waiting for Python.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "layout.h"

namespace dlcp {

enum class Magnitude : uint8_t { L2 = 0, MaxAbs = 1 };

// Magnitude of each packet of `n_elems` elements cut into `per`-element packets.
void packet_magnitudes(const uint8_t* data, size_t n_elems, Kind kind, uint32_t per, Magnitude how, float* out);

// Drop class of each packet from its magnitude: the largest shares[0] get class 0, the next
// shares[1] class 1, ...; ties taken in packet order; NaN ranks last. `cum_bounds` are the
// class boundaries round(cumsum(shares) * n) without the last, computed by the caller exactly
// as numpy computes them (see class_bounds).
void drop_classes(const float* mags, size_t n, const std::vector<double>& shares, uint8_t* out);

}  // namespace dlcp
