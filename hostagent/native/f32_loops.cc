// The float32 loops of f32_loops.h: one body each, written with GCC's and Clang's vector
// extension in 8 float lanes, inlined into a build for AVX2 and one for the baseline.
#include "f32_loops.h"

#include <cmath>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DLCP_X86 1
#define DLCP_AVX2 __attribute__((target("avx2")))
#include <immintrin.h>
#endif

#include "layout.h"

namespace dlcp {
namespace {

typedef float F32x8 __attribute__((vector_size(32)));
typedef uint16_t U16x8 __attribute__((vector_size(16)));
typedef uint32_t U32x8 __attribute__((vector_size(32)));

// The lanes' sum, in double, lane 0 first.
[[gnu::always_inline]] inline double lane_sum(F32x8 s) {
    double acc = 0.0;
    for (int k = 0; k < 8; ++k) acc += s[k];
    return acc;
}

template <bool Scaled, bool L2>
[[gnu::always_inline]] inline float add_body(float* dst, const uint8_t* src, uint32_t count, float scale) {
    F32x8 s = {0, 0, 0, 0, 0, 0, 0, 0};
    const F32x8 sv = {scale, scale, scale, scale, scale, scale, scale, scale};
    uint32_t i = 0;
    for (; i + 8 <= count; i += 8) {
        F32x8 a, x;
        std::memcpy(&a, dst + i, 32);
        std::memcpy(&x, src + 4 * size_t(i), 32);
        if (Scaled) a *= sv;
        a += x;
        std::memcpy(dst + i, &a, 32);
        if (L2) s += a * a;
    }
    double acc = L2 ? lane_sum(s) : 0.0;
    for (; i < count; ++i) {
        float x;
        std::memcpy(&x, src + 4 * size_t(i), 4);
        float r = dst[i];
        if (Scaled) r *= scale;
        r += x;
        dst[i] = r;
        if (L2) acc += double(r) * r;
    }
    return L2 ? float(std::sqrt(acc)) : 0.0f;
}

[[gnu::always_inline]] inline double sumsq_f32_body(const uint8_t* data, size_t n) {
    F32x8 s = {0, 0, 0, 0, 0, 0, 0, 0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        F32x8 x;
        std::memcpy(&x, data + 4 * i, 32);
        s += x * x;
    }
    double acc = lane_sum(s);
    for (; i < n; ++i) {
        float x;
        std::memcpy(&x, data + 4 * i, 4);
        acc += double(x) * x;
    }
    return acc;
}

[[gnu::always_inline]] inline double sumsq_bf16_body(const uint8_t* data, size_t n) {
    F32x8 s = {0, 0, 0, 0, 0, 0, 0, 0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {  // (a bfloat16 is the top half of the float32 it stands for)
        U16x8 h;
        std::memcpy(&h, data + 2 * i, 16);
        U32x8 w = __builtin_convertvector(h, U32x8) << 16;
        F32x8 x;
        std::memcpy(&x, &w, 32);
        s += x * x;
    }
    double acc = lane_sum(s);
    for (; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, data + 2 * i, 2);
        uint32_t w = uint32_t(h) << 16;
        float x;
        std::memcpy(&x, &w, 4);
        acc += double(x) * x;
    }
    return acc;
}

// Each loop's two builds: the body inlined into a function compiled for AVX2, and into one for
// the baseline; `avx2()` picks. Why not target_clones (an ifunc the loader resolves): its
// resolver runs before the sanitizers' runtime is up, and the ThreadSanitizer build crashed at
// load (make sanitize); a branch per packet costs nothing beside the packet's loop.
#ifdef DLCP_X86
bool avx2() {
    static const bool yes = [] {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") != 0;
    }();
    return yes;
}

template <bool Scaled, bool L2>
DLCP_AVX2 float add_avx2(float* dst, const uint8_t* src, uint32_t count, float scale) {
    return add_body<Scaled, L2>(dst, src, count, scale);
}
// layout.h's add_bf16 in 256-bit registers, 16 elements at a time: the same widening, float
// additions and rounding, so the same bits (in-lane unpacks and a signed pack restore the order).
DLCP_AVX2 void add_bf16_avx2(uint16_t* dst, const uint8_t* src, uint32_t count) {
    uint32_t i = 0;
    const __m256i zero = _mm256_setzero_si256(), one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF),
                  magnitude = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    for (; i + 16 <= count; i += 16) {
        __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(dst + i));
        __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * size_t(i)));
        __m256i lo = _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, a)),
                                                       _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x))));
        __m256i hi = _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, a)),
                                                       _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x))));
        __m256i nan = _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_and_si256(lo, magnitude), inf),
                                      _mm256_cmpgt_epi32(_mm256_and_si256(hi, magnitude), inf));
        if (__builtin_expect(_mm256_movemask_epi8(nan) != 0, 0)) break;  // the rest as layout.h's
        lo = _mm256_add_epi32(_mm256_add_epi32(lo, bias), _mm256_and_si256(_mm256_srli_epi32(lo, 16), one));
        hi = _mm256_add_epi32(_mm256_add_epi32(hi, bias), _mm256_and_si256(_mm256_srli_epi32(hi, 16), one));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                            _mm256_packs_epi32(_mm256_srai_epi32(lo, 16), _mm256_srai_epi32(hi, 16)));
    }
    add_bf16(dst + i, src + 2 * size_t(i), count - i);
}
DLCP_AVX2 double sumsq_f32_avx2(const uint8_t* data, size_t n) { return sumsq_f32_body(data, n); }
DLCP_AVX2 double sumsq_bf16_avx2(const uint8_t* data, size_t n) { return sumsq_bf16_body(data, n); }
#endif

template <bool Scaled, bool L2>
float add_any(float* dst, const uint8_t* src, uint32_t count, float scale) {
#ifdef DLCP_X86
    if (avx2()) return add_avx2<Scaled, L2>(dst, src, count, scale);
#endif
    return add_body<Scaled, L2>(dst, src, count, scale);
}

}  // namespace

void add_f32(float* dst, const uint8_t* src, uint32_t count) { add_any<false, false>(dst, src, count, 1.0f); }

float add_f32_l2(float* dst, const uint8_t* src, uint32_t count) {
    return add_any<false, true>(dst, src, count, 1.0f);
}

void add_f32_scaled(float* dst, const uint8_t* src, uint32_t count, float scale) {
    add_any<true, false>(dst, src, count, scale);
}

float add_f32_scaled_l2(float* dst, const uint8_t* src, uint32_t count, float scale) {
    return add_any<true, true>(dst, src, count, scale);
}

void add_bf16_sum(uint16_t* dst, const uint8_t* src, uint32_t count) {
#ifdef DLCP_X86
    if (avx2()) return add_bf16_avx2(dst, src, count);
#endif
    add_bf16(dst, src, count);
}

double sumsq_f32(const uint8_t* data, size_t n) {
#ifdef DLCP_X86
    if (avx2()) return sumsq_f32_avx2(data, n);
#endif
    return sumsq_f32_body(data, n);
}

double sumsq_bf16(const uint8_t* data, size_t n) {
#ifdef DLCP_X86
    if (avx2()) return sumsq_bf16_avx2(data, n);
#endif
    return sumsq_bf16_body(data, n);
}

const char* loops_target() {
#ifdef DLCP_X86
    return avx2() ? "avx2" : "baseline";
#else
    return "portable";
#endif
}

}  // namespace dlcp
