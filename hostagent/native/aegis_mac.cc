// AEGISMAC-128X4 (aegis_mac.h): the algorithm once in aegis_body.inc, compiled here for three
// representations of four AES blocks, and the choice among them.
#include "aegis_mac.h"

#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DLCP_X86 1
#include <immintrin.h>
#endif

// Inline always: the state's eight blocks stay in registers only if every step is inlined.
#define DLCP_INLINE __attribute__((always_inline)) inline

// Compile what follows for `t` (GCC's and Clang's spelling), until DLCP_TARGET_END.
#if defined(__clang__)
#define DLCP_TARGET_BEGIN(t) _Pragma("clang attribute push(__attribute__((target(" #t "))), apply_to = function)")
#define DLCP_TARGET_END _Pragma("clang attribute pop")
#else
#define DLCP_PRAGMA(x) _Pragma(#x)
#define DLCP_TARGET_BEGIN(t) _Pragma("GCC push_options") DLCP_PRAGMA(GCC target(t))
#define DLCP_TARGET_END _Pragma("GCC pop_options")
#endif

namespace dlcp {
namespace {

constexpr size_t LANES = 4, HALF = 16 * LANES, RATE = 2 * HALF;  // bytes per register, per update

// The draft's constants (Fibonacci numbers mod 256) and each lane's context: byte i, byte D-1.
alignas(16) const uint8_t C0[16] = {0x00, 0x01, 0x01, 0x02, 0x03, 0x05, 0x08, 0x0d,
                                    0x15, 0x22, 0x37, 0x59, 0x90, 0xe9, 0x79, 0x62};
alignas(16) const uint8_t C1[16] = {0xdb, 0x3d, 0x18, 0x55, 0x6d, 0xc2, 0x2f, 0xf1,
                                    0x20, 0x11, 0x31, 0x42, 0x73, 0xb5, 0x28, 0xdd};
alignas(64) const uint8_t CTX[HALF] = {0, LANES - 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                       1, LANES - 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                       2, LANES - 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                       3, LANES - 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};

inline void le64(uint8_t* out, uint64_t v) {
    for (int i = 0; i < 8; ++i) out[i] = uint8_t(v >> (8 * i));
}

// ------------------------------------------------------------------ portable

namespace portable {

struct V {
    uint8_t b[HALF];
};

// The AES S-box, computed (the multiplicative inverse in GF(2^8), then the affine map) rather
// than typed in.
struct SBox {
    uint8_t t[256];
    SBox() {
        auto mul = [](uint8_t a, uint8_t b) {
            uint8_t p = 0;
            for (; b; b >>= 1) {
                if (b & 1) p ^= a;
                a = uint8_t((a << 1) ^ ((a & 0x80) ? 0x1b : 0));
            }
            return p;
        };
        auto rotl = [](uint8_t v, int n) { return uint8_t((v << n) | (v >> (8 - n))); };
        for (int v = 0; v < 256; ++v) {
            uint8_t inv = 0;  // v^254 (0 for 0)
            if (v) {
                uint8_t r = 1, base = uint8_t(v);
                for (int e = 254; e; e >>= 1, base = mul(base, base))
                    if (e & 1) r = mul(r, base);
                inv = r;
            }
            t[v] = uint8_t(inv ^ rotl(inv, 1) ^ rotl(inv, 2) ^ rotl(inv, 3) ^ rotl(inv, 4) ^ 0x63);
        }
    }
};

const SBox& sbox() {
    static const SBox s;
    return s;
}

inline uint8_t xt(uint8_t a) { return uint8_t((a << 1) ^ ((a & 0x80) ? 0x1b : 0)); }

// One AES encryption round of the 16 bytes at `in` (column-major, as AES-NI holds them).
inline void round16(const uint8_t* in, const uint8_t* rk, uint8_t* out) {
    const uint8_t* s = sbox().t;
    uint8_t t[16];
    for (int c = 0; c < 4; ++c)
        for (int r = 0; r < 4; ++r) t[r + 4 * c] = s[in[r + 4 * ((c + r) % 4)]];  // SubBytes, ShiftRows
    for (int c = 0; c < 4; ++c) {                                                // MixColumns, AddRoundKey
        uint8_t a0 = t[4 * c], a1 = t[4 * c + 1], a2 = t[4 * c + 2], a3 = t[4 * c + 3];
        out[4 * c] = uint8_t(xt(a0) ^ xt(a1) ^ a1 ^ a2 ^ a3 ^ rk[4 * c]);
        out[4 * c + 1] = uint8_t(a0 ^ xt(a1) ^ xt(a2) ^ a2 ^ a3 ^ rk[4 * c + 1]);
        out[4 * c + 2] = uint8_t(a0 ^ a1 ^ xt(a2) ^ xt(a3) ^ a3 ^ rk[4 * c + 2]);
        out[4 * c + 3] = uint8_t(xt(a0) ^ a0 ^ a1 ^ a2 ^ xt(a3) ^ rk[4 * c + 3]);
    }
}

inline V load(const uint8_t* p) {
    V v;
    std::memcpy(v.b, p, HALF);
    return v;
}
inline V bcast(const uint8_t* p) {
    V v;
    for (size_t i = 0; i < LANES; ++i) std::memcpy(v.b + 16 * i, p, 16);
    return v;
}
inline V lane0(const uint8_t* p) {
    V v = {};
    std::memcpy(v.b, p, 16);
    return v;
}
inline void store(uint8_t* p, V v) { std::memcpy(p, v.b, HALF); }
inline V x(V a, V b) {
    for (size_t i = 0; i < HALF; ++i) a.b[i] ^= b.b[i];
    return a;
}
inline V aes(V in, V rk) {
    V out;
    for (size_t i = 0; i < LANES; ++i) round16(in.b + 16 * i, rk.b + 16 * i, out.b + 16 * i);
    return out;
}

#include "aegis_body.inc"

}  // namespace portable

#ifdef DLCP_X86

// ------------------------------------------------------------------ AES-NI, four xmm registers

DLCP_TARGET_BEGIN("aes,sse4.1")
namespace aesni {

struct V {
    __m128i r[LANES];
};

DLCP_INLINE V load(const uint8_t* p) {
    V v;
    for (size_t i = 0; i < LANES; ++i) v.r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i));
    return v;
}
DLCP_INLINE V bcast(const uint8_t* p) {
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return V{{b, b, b, b}};
}
DLCP_INLINE V lane0(const uint8_t* p) {
    __m128i z = _mm_setzero_si128();
    return V{{_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), z, z, z}};
}
DLCP_INLINE void store(uint8_t* p, V v) {
    for (size_t i = 0; i < LANES; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 16 * i), v.r[i]);
}
DLCP_INLINE V x(V a, V b) {
    for (size_t i = 0; i < LANES; ++i) a.r[i] = _mm_xor_si128(a.r[i], b.r[i]);
    return a;
}
DLCP_INLINE V aes(V in, V rk) {
    for (size_t i = 0; i < LANES; ++i) in.r[i] = _mm_aesenc_si128(in.r[i], rk.r[i]);
    return in;
}

// A run of whole blocks one lane at a time (aegis_run.inc): one lane's eight blocks fit the 16
// xmm registers where all four lanes' 32 do not (spilled, the run took twice as long).
using R = __m128i;
DLCP_INLINE R r_ld(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
DLCP_INLINE R r_xor(R a, R b) { return _mm_xor_si128(a, b); }
DLCP_INLINE R r_aes(R a, R k) { return _mm_aesenc_si128(a, k); }
#include "aegis_run.inc"
#define DLCP_AEGIS_ABSORB_RUN absorb_run

#include "aegis_body.inc"

#undef DLCP_AEGIS_ABSORB_RUN
}  // namespace aesni
DLCP_TARGET_END

// ------------------------------------------------------------------ VAES, two ymm registers

DLCP_TARGET_BEGIN("avx2,vaes")
namespace vaes256 {

struct V {
    __m256i r[2];  // lanes 0-1, lanes 2-3
};

DLCP_INLINE __m256i ld(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
DLCP_INLINE V load(const uint8_t* p) { return V{{ld(p), ld(p + 32)}}; }
DLCP_INLINE V bcast(const uint8_t* p) {
    __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return V{{b, b}};
}
DLCP_INLINE V lane0(const uint8_t* p) {
    return V{{_mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), _mm256_setzero_si256()}};
}
DLCP_INLINE void store(uint8_t* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v.r[0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 32), v.r[1]);
}
DLCP_INLINE V x(V a, V b) { return V{{_mm256_xor_si256(a.r[0], b.r[0]), _mm256_xor_si256(a.r[1], b.r[1])}}; }
DLCP_INLINE V aes(V in, V rk) {
    return V{{_mm256_aesenc_epi128(in.r[0], rk.r[0]), _mm256_aesenc_epi128(in.r[1], rk.r[1])}};
}

// A run of whole blocks two lanes at a time (aegis_run.inc), for the reason aesni's goes one at
// a time: one pair's eight registers leave room in the 16 ymm ones; both pairs' 16 do not.
using R = __m256i;
DLCP_INLINE R r_ld(const uint8_t* p) { return ld(p); }
DLCP_INLINE R r_xor(R a, R b) { return _mm256_xor_si256(a, b); }
DLCP_INLINE R r_aes(R a, R k) { return _mm256_aesenc_epi128(a, k); }
#include "aegis_run.inc"
#define DLCP_AEGIS_ABSORB_RUN absorb_run

#include "aegis_body.inc"

#undef DLCP_AEGIS_ABSORB_RUN
}  // namespace vaes256
DLCP_TARGET_END

// ------------------------------------------------------------------ VAES, one zmm register

DLCP_TARGET_BEGIN("avx512f,vaes")
namespace vaes512 {

using V = __m512i;

DLCP_INLINE V load(const uint8_t* p) { return _mm512_loadu_si512(p); }
DLCP_INLINE V bcast(const uint8_t* p) {  // (not _mm512_broadcast_i32x4: GCC 12 warns inside its header)
    alignas(64) uint8_t four[HALF];
    for (size_t i = 0; i < LANES; ++i) std::memcpy(four + 16 * i, p, 16);
    return _mm512_load_si512(four);
}
DLCP_INLINE V lane0(const uint8_t* p) {
    return _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
DLCP_INLINE void store(uint8_t* p, V v) { _mm512_storeu_si512(p, v); }
DLCP_INLINE V x(V a, V b) { return _mm512_xor_si512(a, b); }
DLCP_INLINE V aes(V in, V rk) { return _mm512_aesenc_epi128(in, rk); }

#include "aegis_body.inc"

}  // namespace vaes512
DLCP_TARGET_END

#endif  // DLCP_X86

}  // namespace

struct AegisBuild {
    const char* name;
    void (*init_state)(const uint8_t*, const uint8_t*, uint8_t*);
    void (*mac_from)(const uint8_t*, const MacPart*, size_t, uint8_t*);
};

namespace {

const AegisBuild PORTABLE = {"portable", portable::init_state, portable::mac_from};
#ifdef DLCP_X86
const AegisBuild AESNI = {"aesni", aesni::init_state, aesni::mac_from};
const AegisBuild VAES256 = {"vaes256", vaes256::init_state, vaes256::mac_from};
const AegisBuild VAES512 = {"vaes512", vaes512::init_state, vaes512::mac_from};
#endif

// The named build if this CPU runs it, else null.
const AegisBuild* build_named(const char* name) {
#ifdef DLCP_X86
    __builtin_cpu_init();
    if (std::strcmp(name, "vaes512") == 0 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vaes"))
        return &VAES512;
    if (std::strcmp(name, "vaes256") == 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vaes"))
        return &VAES256;
    if (std::strcmp(name, "aesni") == 0 && __builtin_cpu_supports("aes") && __builtin_cpu_supports("sse4.1"))
        return &AESNI;
#endif
    if (std::strcmp(name, "portable") == 0) return &PORTABLE;
    return nullptr;
}

// The fastest build this CPU runs, chosen once (a function-local static: thread-safe).
const AegisBuild* best() {
    static const AegisBuild* const b = [] {
        const AegisBuild* c = build_named("vaes512");
        if (!c) c = build_named("vaes256");
        if (!c) c = build_named("aesni");
        return c ? c : build_named("portable");
    }();
    return b;
}

}  // namespace

AegisMacKey::AegisMacKey(const uint8_t key[AEGIS_KEY_BYTES], const uint8_t nonce[AEGIS_NONCE_BYTES],
                         const char* target)
    : build_(target ? build_named(target) : best()) {
    if (!build_) throw std::invalid_argument(std::string("this CPU cannot run the AEGISMAC build '") + target + "'");
    build_->init_state(key, nonce, state_);
}

AegisMacKey::~AegisMacKey() {
    volatile uint8_t* p = state_;  // (the state is as secret as the key)
    for (size_t i = 0; i < sizeof state_; ++i) p[i] = 0;
}

void AegisMacKey::mac(const MacPart* parts, size_t nparts, uint8_t tag[AEGIS_TAG_BYTES]) const {
    build_->mac_from(state_, parts, nparts, tag);
}

const char* AegisMacKey::target() const { return build_->name; }

const char* aegis_target() { return best()->name; }

}  // namespace dlcp
