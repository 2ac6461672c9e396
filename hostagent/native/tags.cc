#include "tags.h"

#include "f32_loops.h"

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
                acc = sumsq_f32(data + 4 * lo, hi - lo);  // (8 float lanes: f32_loops.h)
            } else if (kind == Kind::BF16) {
                acc = sumsq_bf16(data + 2 * lo, hi - lo);
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
