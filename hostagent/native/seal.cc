// Packet protection with OpenSSL's AES-128-GCM (see seal.h for the format and the why).
#include "seal.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <cstring>
#include <new>
#include <stdexcept>

namespace dlcp {
namespace {

inline void make_iv(uint8_t iv[12], uint8_t ptype, uint64_t pn) {
    iv[0] = ptype;
    iv[1] = iv[2] = iv[3] = 0;
    for (int i = 0; i < 8; ++i) iv[4 + i] = uint8_t(pn >> (56 - 8 * i));
}

EVP_CIPHER_CTX* new_ctx(const uint8_t* key, bool encrypt) {
    EVP_CIPHER_CTX* c = EVP_CIPHER_CTX_new();
    if (!c) throw std::bad_alloc();
    int ok = encrypt ? EVP_EncryptInit_ex(c, EVP_aes_128_gcm(), nullptr, key, nullptr)
                     : EVP_DecryptInit_ex(c, EVP_aes_128_gcm(), nullptr, key, nullptr);
    if (ok != 1) {
        EVP_CIPHER_CTX_free(c);
        throw std::runtime_error("OpenSSL refused AES-128-GCM");
    }
    return c;
}

[[noreturn]] void fail(const char* what) { throw std::runtime_error(std::string("AES-GCM: ") + what); }

}  // namespace

Sealer::Sealer(const uint8_t key[KEY_BYTES], Protect mode) : mode_(mode) {
    std::memcpy(key_, key, KEY_BYTES);
    if (mode_ == Protect::NONE) return;
    enc_ = new_ctx(key_, true);
    try {
        dec_ = new_ctx(key_, false);
    } catch (...) {
        EVP_CIPHER_CTX_free(enc_);
        throw;
    }
}

Sealer::~Sealer() {
    EVP_CIPHER_CTX_free(enc_);
    EVP_CIPHER_CTX_free(dec_);
    OPENSSL_cleanse(key_, sizeof key_);
}

bool Sealer::same_key(const uint8_t key[KEY_BYTES]) const { return CRYPTO_memcmp(key_, key, KEY_BYTES) == 0; }

void Sealer::seal(const uint8_t* hdr, size_t hlen, size_t ptype_off, const uint8_t* payload, size_t n, uint8_t* ct,
                  uint8_t* trailer) {
    uint8_t ptype = hdr[ptype_off];
    uint64_t pn = next_pn_[ptype]++;
    sealed_ += 1;
    for (int i = 0; i < 8; ++i) trailer[i] = uint8_t(pn >> (56 - 8 * i));
    uint8_t* tag = trailer + PN_BYTES;
    if (mode_ == Protect::NONE) {
        std::memset(tag, 0, TAG_BYTES);
        return;
    }
    uint8_t iv[12];
    make_iv(iv, ptype, pn);
    int outl = 0;
    if (EVP_EncryptInit_ex(enc_, nullptr, nullptr, nullptr, iv) != 1) fail("setting the nonce");
    if (EVP_EncryptUpdate(enc_, nullptr, &outl, hdr, int(hlen)) != 1) fail("header");
    if (n > 0) {
        if (mode_ == Protect::MAC) {
            if (EVP_EncryptUpdate(enc_, nullptr, &outl, payload, int(n)) != 1) fail("payload");
        } else {
            if (EVP_EncryptUpdate(enc_, ct, &outl, payload, int(n)) != 1) fail("payload");
        }
    }
    uint8_t none[16];
    if (EVP_EncryptFinal_ex(enc_, none, &outl) != 1) fail("final");
    if (EVP_CIPHER_CTX_ctrl(enc_, EVP_CTRL_GCM_GET_TAG, int(TAG_BYTES), tag) != 1) fail("tag");
}

bool ReplayWindow::take(uint64_t pn) {
    auto bit = [this](uint64_t p) -> uint64_t& { return bits_[(p / 64) % (SIZE / 64)]; };
    uint64_t mask = uint64_t(1) << (pn % 64);
    if (!any_ || pn > top_) {
        if (!any_ || pn - top_ >= SIZE) {
            std::memset(bits_, 0, sizeof bits_);
        } else {  // clear what the window leaves behind: numbers top_+1 .. pn
            for (uint64_t p = top_ + 1; p <= pn; ++p) bit(p) &= ~(uint64_t(1) << (p % 64));
        }
        any_ = true;
        top_ = pn;
        bit(pn) |= mask;
        return true;
    }
    if (top_ - pn >= SIZE) return false;
    if (bit(pn) & mask) return false;
    bit(pn) |= mask;
    return true;
}

Opened Sealer::open(uint8_t* d, size_t len, size_t hlen, size_t ptype_off) {
    if (len < hlen + TRAILER_BYTES || ptype_off >= hlen) return Opened::FORGED;
    if (mode_ == Protect::NONE) return Opened::OK;
    size_t body = len - TRAILER_BYTES;
    const uint8_t* trailer = d + body;
    uint64_t pn = 0;
    for (int i = 0; i < 8; ++i) pn = (pn << 8) | trailer[i];
    uint8_t iv[12];
    make_iv(iv, d[ptype_off], pn);
    uint8_t tag[TAG_BYTES];
    std::memcpy(tag, trailer + PN_BYTES, TAG_BYTES);
    int outl = 0;
    const Opened forged = Opened::FORGED;
    if (EVP_DecryptInit_ex(dec_, nullptr, nullptr, nullptr, iv) != 1) return forged;
    if (mode_ == Protect::MAC) {
        if (EVP_DecryptUpdate(dec_, nullptr, &outl, d, int(body)) != 1) return forged;
    } else {
        if (EVP_DecryptUpdate(dec_, nullptr, &outl, d, int(hlen)) != 1) return forged;
        if (body > hlen && EVP_DecryptUpdate(dec_, d + hlen, &outl, d + hlen, int(body - hlen)) != 1) return forged;
    }
    if (EVP_CIPHER_CTX_ctrl(dec_, EVP_CTRL_GCM_SET_TAG, int(TAG_BYTES), tag) != 1) return forged;
    uint8_t none[16];
    if (EVP_DecryptFinal_ex(dec_, none, &outl) != 1) return forged;
    std::unique_ptr<ReplayWindow>& seen = seen_[d[ptype_off]];
    if (!seen) seen.reset(new ReplayWindow());
    return seen->take(pn) ? Opened::OK : Opened::REPLAYED;
}

}  // namespace dlcp
