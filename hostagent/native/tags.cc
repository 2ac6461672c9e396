#include "tags.h"

#include <algorithm>
#include <cfenv>
#include <cmath>
#include <limits>

namespace dlcp {

void packet_magnitudes(const uint8_t* data, size_t n_elems, Kind kind, uint32_t per, Magnitude how, float* out) {
    size_t n = per ? (n_elems + per - 1) / per : 0;
    for (size_t p = 0; p < n; ++p) {
        size_t lo = p * per, hi = std::min(n_elems, lo + per);
        if (how == Magnitude::L2) {
            double acc = 0.0;
            if (kind == Kind::F32) {
                // float32 products summed in 8 lanes (lane k takes elements k, k + 8, ...), two
                // 4-wide vectors: the compiler left the plain loop scalar, through the stack
                F32x4 a = {0, 0, 0, 0}, b = {0, 0, 0, 0};
                size_t i = lo;
                for (; i + 8 <= hi; i += 8) {
                    F32x4 x, y;
                    std::memcpy(&x, data + 4 * i, 16);
                    std::memcpy(&y, data + 4 * i + 16, 16);
                    a += x * x;
                    b += y * y;
                }
                float lane[8];
                std::memcpy(lane, &a, 16);
                std::memcpy(lane + 4, &b, 16);
                for (int k = 0; k < 8; ++k) acc += lane[k];
                for (; i < hi; ++i) {
                    float x = load_elem(data, i, kind);
                    acc += double(x) * x;
                }
            } else if (kind == Kind::BF16) {
                // bfloat16 is float32's top half: widened 8 at a time, then the float32 lanes
                // above (the element kind tested per element kept this loop scalar: a quarter
                // of a bfloat16 ring's send-side CPU)
                F32x4 a = {0, 0, 0, 0}, b = {0, 0, 0, 0};
                size_t i = lo;
                for (; i + 8 <= hi; i += 8) {
                    uint16_t h[8];
                    uint32_t w[8];
                    std::memcpy(h, data + 2 * i, 16);
                    for (int k = 0; k < 8; ++k) w[k] = uint32_t(h[k]) << 16;
                    F32x4 x, y;
                    std::memcpy(&x, w, 16);
                    std::memcpy(&y, w + 4, 16);
                    a += x * x;
                    b += y * y;
                }
                float lane[8];
                std::memcpy(lane, &a, 16);
                std::memcpy(lane + 4, &b, 16);
                for (int k = 0; k < 8; ++k) acc += lane[k];
                for (; i < hi; ++i) {
                    float x = load_elem(data, i, kind);
                    acc += double(x) * x;
                }
            } else {
                for (size_t i = lo; i < hi; ++i) {
                    float x = load_elem(data, i, kind);
                    acc += double(x) * x;
                }
            }
            out[p] = float(std::sqrt(acc));
        } else {
            float m = 0.0f;
            bool nan = false;
            for (size_t i = lo; i < hi; ++i) {
                float x = std::fabs(load_elem(data, i, kind));
                if (std::isnan(x)) nan = true;
                m = std::max(m, x);
            }
            out[p] = nan ? std::numeric_limits<float>::quiet_NaN() : m;
        }
    }
}

namespace {
// numpy's round(cumsum(shares) * n), half to even, without the last: the class boundaries
// counted in packets of n
std::vector<long> boundary_counts(const std::vector<double>& shares, size_t n) {
    std::vector<long> bounds;
    double cum = 0.0;
    int mode = std::fegetround();
    std::fesetround(FE_TONEAREST);
    for (size_t i = 0; i + 1 < shares.size(); ++i) {
        cum += shares[i];
        bounds.push_back(long(std::nearbyint(cum * double(n))));
    }
    std::fesetround(mode);
    return bounds;
}
}  // namespace

std::vector<float> class_boundaries(const float* sample, size_t k, const std::vector<double>& shares) {
    constexpr float inf = std::numeric_limits<float>::infinity();
    std::vector<float> s(sample, sample + k);
    for (float& m : s)
        if (std::isnan(m)) m = -inf;
    std::vector<float> out;
    for (long b : boundary_counts(shares, k)) {
        if (b <= 0) {
            out.push_back(inf);  // no packet within the top 0
        } else if (b >= long(k)) {
            out.push_back(-inf);  // every packet within
        } else {
            std::nth_element(s.begin(), s.begin() + (long(k) - b), s.end());
            out.push_back(s[size_t(long(k) - b)]);  // the b-th largest
        }
    }
    return out;
}

void drop_classes(const float* mags_in, size_t n, const std::vector<double>& shares, const ClassSampling& sampling,
                  uint8_t* out) {
    const size_t classes = shares.size();
    std::fill(out, out + n, uint8_t(0));
    if (classes <= 1 || n == 0) return;
    if (uint32_t stride = sampling.stride(n); stride > 1) {
        std::vector<float> sample;
        for (size_t r = 0; r < n / stride; ++r) sample.push_back(mags_in[sampling.index(r, stride)]);
        std::vector<float> b = class_boundaries(sample.data(), sample.size(), shares);
        for (size_t i = 0; i < n; ++i) out[i] = class_of(mags_in[i], b);
        return;
    }
    std::vector<float> mags(mags_in, mags_in + n);
    for (float& m : mags)
        if (std::isnan(m)) m = -std::numeric_limits<float>::infinity();
    std::vector<long> bounds = boundary_counts(shares, n);
    std::vector<float> scratch;
    std::vector<uint8_t> top(n);
    for (long b : bounds) {
        if (b >= long(n)) continue;  // every packet is within the top b
        if (b <= 0) {
            for (size_t i = 0; i < n; ++i) out[i] += 1;
            continue;
        }
        scratch = mags;
        std::nth_element(scratch.begin(), scratch.begin() + (n - b), scratch.end());
        float t = scratch[n - b];  // the b-th largest
        long above = 0, ties = 0;
        for (size_t i = 0; i < n; ++i) {
            above += mags[i] > t;
            ties += mags[i] == t;
        }
        long need = b - above;
        long taken = 0;
        for (size_t i = 0; i < n; ++i) {
            bool in_top = mags[i] > t;
            if (!in_top && mags[i] == t && (need >= ties || taken < need)) {
                in_top = true;
                ++taken;
            }
            if (!in_top) out[i] += 1;
        }
    }
    for (size_t i = 0; i < n; ++i) out[i] = std::min<uint8_t>(out[i], uint8_t(classes - 1));
}

}  // namespace dlcp
