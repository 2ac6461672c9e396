// The DLCP header as the compiled data path reads and writes it.
//
// The wire format is defined once, in hostagent/wire.py. This file holds no offsets of its
// own: the Python side passes every field's byte offset and width when it builds a Datapath
// (HeaderLayout::from), and the constructor refuses a layout it cannot read, so a change to
// wire.py either works here unchanged or fails at start with the field's name.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <time.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace dlcp {

struct Field {
    int off = -1;
    int bytes = 0;
};

struct HeaderLayout {
    int size = 0;
    Field version, ptype, flags, priority, drop_class, dtype, sender_rank, job_id, message_id, token,
        iteration, tensor_id, layer, elem_count, seq, total_pkts, elem_offset;

    // Build from {name: (offset, bytes)}; throws std::invalid_argument naming what is wrong.
    static HeaderLayout from(int size, const std::map<std::string, std::pair<int, int>>& fields) {
        HeaderLayout h;
        h.size = size;
        auto get = [&](const char* name) {
            auto it = fields.find(name);
            if (it == fields.end())
                throw std::invalid_argument(std::string("header layout has no field '") + name + "'");
            Field f{it->second.first, it->second.second};
            if (!(f.bytes == 1 || f.bytes == 2 || f.bytes == 4) || f.off < 0 || f.off + f.bytes > size)
                throw std::invalid_argument(std::string("header field '") + name + "' has width " +
                                            std::to_string(f.bytes) + " at offset " + std::to_string(f.off) +
                                            ": the data path reads 1, 2 or 4 bytes inside the header");
            return f;
        };
        h.version = get("version");
        h.ptype = get("ptype");
        h.flags = get("flags");
        h.priority = get("priority");
        h.drop_class = get("drop_class");
        h.dtype = get("dtype");
        h.sender_rank = get("sender_rank");
        h.job_id = get("job_id");
        h.message_id = get("message_id");
        h.token = get("token");
        h.iteration = get("iteration");
        h.tensor_id = get("tensor_id");
        h.layer = get("layer");
        h.elem_count = get("elem_count");
        h.seq = get("seq");
        h.total_pkts = get("total_pkts");
        h.elem_offset = get("elem_offset");
        for (const Field* f : {&h.flags, &h.priority, &h.drop_class})
            if (f->bytes != 1) throw std::invalid_argument("flags, priority and drop_class must be one byte each");
        return h;
    }
};

// Big-endian (network order) field access.
inline uint32_t rd(const uint8_t* p, Field f) {
    const uint8_t* q = p + f.off;
    switch (f.bytes) {
        case 1: return q[0];
        case 2: return (uint32_t(q[0]) << 8) | q[1];
        default: return (uint32_t(q[0]) << 24) | (uint32_t(q[1]) << 16) | (uint32_t(q[2]) << 8) | q[3];
    }
}

inline void wr(uint8_t* p, Field f, uint32_t v) {
    uint8_t* q = p + f.off;
    switch (f.bytes) {
        case 1: q[0] = uint8_t(v); break;
        case 2: q[0] = uint8_t(v >> 8); q[1] = uint8_t(v); break;
        default: q[0] = uint8_t(v >> 24); q[1] = uint8_t(v >> 16); q[2] = uint8_t(v >> 8); q[3] = uint8_t(v); break;
    }
}

// The 64-bit count a bare header (a CREDIT's packets read, a STOP's elements held) carries in
// total_pkts (high 32 bits) and elem_offset (low): wire-format.md.
inline uint64_t rd_wide(const uint8_t* p, const HeaderLayout& L) {
    return (uint64_t(rd(p, L.total_pkts)) << 32) | rd(p, L.elem_offset);
}
inline void wr_wide(uint8_t* p, const HeaderLayout& L, uint64_t v) {
    wr(p, L.total_pkts, uint32_t(v >> 32));
    wr(p, L.elem_offset, uint32_t(v));
}

// The same clock as Python's time.monotonic() on Linux.
inline double now_s() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

// Element kinds a payload can hold (the wire's dtype codes map onto these in Python).
enum class Kind : uint8_t { F32 = 0, F16 = 1, BF16 = 2 };

inline float half_to_float(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F;
    uint32_t man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            int e = -1;
            do { ++e; man <<= 1; } while (!(man & 0x400));
            bits = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3FF) << 13;
        }
    } else if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | (exp + 127 - 15) << 23 | (man << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline float bf16_to_float(uint16_t h) {
    uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// Element i of a little-endian payload as float32.
inline float load_elem(const uint8_t* base, size_t i, Kind kind) {
    if (kind == Kind::F32) {
        float f;
        std::memcpy(&f, base + 4 * i, 4);
        return f;
    }
    uint16_t h;
    std::memcpy(&h, base + 2 * i, 2);
    return kind == Kind::F16 ? half_to_float(h) : bf16_to_float(h);
}

inline int kind_size(Kind k) { return k == Kind::F32 ? 4 : 2; }

// float32 to IEEE half, rounded to nearest even, exactly as numpy converts (npy_floatbits_to_halfbits):
// a float16 sum made here is bit for bit the one numpy makes (numpy adds halves in float).
inline uint16_t float_to_half(float f) {
    uint32_t b;
    std::memcpy(&b, &f, 4);
    uint16_t sign = uint16_t((b & 0x80000000u) >> 16);
    uint32_t exp = b & 0x7F800000u;
    if (exp >= 0x47800000u) {  // too large for a half, infinity or NaN
        uint32_t man = b & 0x007FFFFFu;
        if (exp == 0x7F800000u && man != 0) {
            uint16_t nan = uint16_t(0x7C00u + (man >> 13));
            return uint16_t(sign + (nan == 0x7C00u ? nan + 1 : nan));
        }
        return uint16_t(sign + 0x7C00u);
    }
    if (exp <= 0x38000000u) {  // a half subnormal, or zero
        if (exp < 0x33000000u) return sign;
        exp >>= 23;
        uint32_t man = 0x00800000u + (b & 0x007FFFFFu);
        man >>= (113 - exp);
        if ((man & 0x3FFFu) != 0x1000u || (b & 0x7FFu)) man += 0x1000u;
        return uint16_t(sign + uint16_t(man >> 13));
    }
    uint16_t hexp = uint16_t((exp - 0x38000000u) >> 13);
    uint32_t man = b & 0x007FFFFFu;
    if ((man & 0x3FFFu) != 0x1000u) man += 0x1000u;
    uint16_t h = uint16_t(man >> 13);
    return uint16_t(sign + uint16_t(h + hexp));  // a carry out of the mantissa raises the exponent
}

// float32 to bfloat16, rounded to nearest even, as ml_dtypes and torch convert; a NaN becomes the
// quiet NaN of its sign, as in ml_dtypes. A bfloat16 sum made here is bit for bit ml_dtypes'.
// Branch-free (a select, not a jump), so a loop of them vectorises: a bfloat16 sum added by
// the receive path ran at a third of float32's speed per byte with the branch.
inline uint16_t float_to_bf16(float f) {
    uint32_t b;
    std::memcpy(&b, &f, 4);
    uint32_t rounded = b + 0x7FFFu + ((b >> 16) & 1u);
    uint32_t quiet_nan = (b & 0x80000000u) | 0x7FC00000u;
    return uint16_t(((b & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded) >> 16);
}

// dst[i] = bfloat16(float(dst[i]) + float(src[i])) for i < count: a bfloat16 sum, each addition
// rounded to nearest even, bit for bit float_to_bf16's; src unaligned bytes, not overlapping dst.
// Why by hand: GCC does not vectorise the scalar loop (a float from a uint16_t's bits is not a
// vector type it will take), which summed a bfloat16 ring's chunks at about a sixth of float32's
// elements per second. With SSE2 (every x86-64) eight elements at a time: widen (a bfloat16 is
// a float's top half), add as floats, round as float_to_bf16 does, and keep the top halves (an
// arithmetic shift and a signed pack keep the 16 bits exactly). A group that holds a NaN goes
// the scalar way (its quiet NaN of the sign), which keeps the vector path free of that select.
inline void add_bf16(uint16_t* dst, const uint8_t* src, uint32_t count) {
    uint32_t i = 0;
#if defined(__SSE2__)
    const __m128i zero = _mm_setzero_si128(), one = _mm_set1_epi32(1), bias = _mm_set1_epi32(0x7FFF),
                  magnitude = _mm_set1_epi32(0x7FFFFFFF), inf = _mm_set1_epi32(0x7F800000);
    for (; i + 8 <= count; i += 8) {
        __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(dst + i));
        __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * size_t(i)));
        __m128i lo = _mm_castps_si128(_mm_add_ps(_mm_castsi128_ps(_mm_unpacklo_epi16(zero, a)),
                                                 _mm_castsi128_ps(_mm_unpacklo_epi16(zero, x))));
        __m128i hi = _mm_castps_si128(_mm_add_ps(_mm_castsi128_ps(_mm_unpackhi_epi16(zero, a)),
                                                 _mm_castsi128_ps(_mm_unpackhi_epi16(zero, x))));
        __m128i nan = _mm_or_si128(_mm_cmpgt_epi32(_mm_and_si128(lo, magnitude), inf),
                                   _mm_cmpgt_epi32(_mm_and_si128(hi, magnitude), inf));
        if (__builtin_expect(_mm_movemask_epi8(nan) != 0, 0)) break;  // the rest the scalar way
        lo = _mm_add_epi32(_mm_add_epi32(lo, bias), _mm_and_si128(_mm_srli_epi32(lo, 16), one));
        hi = _mm_add_epi32(_mm_add_epi32(hi, bias), _mm_and_si128(_mm_srli_epi32(hi, 16), one));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                         _mm_packs_epi32(_mm_srai_epi32(lo, 16), _mm_srai_epi32(hi, 16)));
    }
#endif
    for (; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * size_t(i), 2);
        dst[i] = float_to_bf16(bf16_to_float(dst[i]) + bf16_to_float(h));
    }
}

}  // namespace dlcp
