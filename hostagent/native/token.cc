// BLAKE2b written from RFC 7693, sections 2 and 3 (one-shot, messages up to one block after the
// key block: all a token needs).
#include "token.h"

#include <cstring>
#include <stdexcept>

namespace dlcp {
namespace {

constexpr uint64_t IV[8] = {0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL,
                            0xA54FF53A5F1D36F1ULL, 0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL,
                            0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL};

constexpr uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

inline uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

inline uint64_t load64(const uint8_t* p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}

void compress(uint64_t h[8], const uint8_t block[128], uint64_t t, bool last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 16; ++i) m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; ++i) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t;  // low word of the byte counter (messages here are far below 2^64 bytes)
    if (last) v[14] = ~v[14];
    auto g = [&](int a, int b, int c, int d, uint64_t x, uint64_t y) {
        v[a] = v[a] + v[b] + x;
        v[d] = rotr(v[d] ^ v[a], 32);
        v[c] = v[c] + v[d];
        v[b] = rotr(v[b] ^ v[c], 24);
        v[a] = v[a] + v[b] + y;
        v[d] = rotr(v[d] ^ v[a], 16);
        v[c] = v[c] + v[d];
        v[b] = rotr(v[b] ^ v[c], 63);
    };
    for (int r = 0; r < 12; ++r) {
        const uint8_t* s = SIGMA[r];
        g(0, 4, 8, 12, m[s[0]], m[s[1]]);
        g(1, 5, 9, 13, m[s[2]], m[s[3]]);
        g(2, 6, 10, 14, m[s[4]], m[s[5]]);
        g(3, 7, 11, 15, m[s[6]], m[s[7]]);
        g(0, 5, 10, 15, m[s[8]], m[s[9]]);
        g(1, 6, 11, 12, m[s[10]], m[s[11]]);
        g(2, 7, 8, 13, m[s[12]], m[s[13]]);
        g(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; ++i) h[i] ^= v[i] ^ v[i + 8];
}

}  // namespace

void blake2b_keyed(uint8_t* out, size_t outlen, const uint8_t* key, size_t keylen, const uint8_t* in, size_t inlen) {
    if (outlen < 1 || outlen > 64 || keylen > 64 || inlen > 128)
        throw std::invalid_argument("blake2b_keyed: out 1..64, key <= 64 and input <= 128 bytes");
    uint64_t h[8];
    std::memcpy(h, IV, sizeof h);
    h[0] ^= 0x01010000ULL ^ (uint64_t(keylen) << 8) ^ uint64_t(outlen);
    uint8_t block[128];
    uint64_t t = 0;
    if (keylen > 0) {
        std::memset(block, 0, 128);
        std::memcpy(block, key, keylen);
        t += 128;
        compress(h, block, t, inlen == 0);
    }
    if (inlen > 0 || keylen == 0) {
        std::memset(block, 0, 128);
        std::memcpy(block, in, inlen);
        t += inlen;
        compress(h, block, t, true);
    }
    uint8_t digest[64];
    for (int i = 0; i < 8; ++i)
        for (int j = 0; j < 8; ++j) digest[8 * i + j] = uint8_t(h[i] >> (8 * j));
    std::memcpy(out, digest, outlen);
}

uint32_t credit_token(const uint8_t key[16], const uint8_t* header, size_t header_len, size_t token_off) {
    if (header_len + 1 > 128 || token_off + 4 > header_len)
        throw std::invalid_argument("credit_token: a header of at most 127 bytes with its token inside");
    uint8_t in[128];
    in[0] = 'C';  // (a data token's input is 14 bytes: no header can pass for one)
    std::memcpy(in + 1, header, header_len);
    std::memset(in + 1 + token_off, 0, 4);
    uint8_t d[4];
    blake2b_keyed(d, 4, key, 16, in, header_len + 1);
    return (uint32_t(d[0]) << 24) | (uint32_t(d[1]) << 16) | (uint32_t(d[2]) << 8) | d[3];
}

}  // namespace dlcp
