// Packet protection (see seal.h for the format, the key renewal and the why): EpochKey is the one
// place a datagram's tag is computed, AEGISMAC-128X4 (aegis_mac.h) for MAC, AES-128-GCM (GcmKey:
// intel-ipsec-mb where the build found it, DLCP_WITH_IPSEC_MB, OpenSSL otherwise) for ENCRYPT;
// everything else here is the format.
#include "seal.h"

#include "aegis_mac.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/opensslv.h>

#ifdef DLCP_WITH_IPSEC_MB
#include <intel-ipsec-mb.h>
#endif

#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

namespace dlcp {
namespace {

[[noreturn]] void fail(const char* what) { throw std::runtime_error(std::string("AES-GCM: ") + what); }

inline void make_iv(uint8_t iv[12], uint8_t ptype, uint64_t pn) {
    iv[0] = ptype;
    iv[1] = iv[2] = iv[3] = 0;
    for (int i = 0; i < 8; ++i) iv[4 + i] = uint8_t(pn >> (56 - 8 * i));
}

#ifdef DLCP_WITH_IPSEC_MB
// One manager per thread: it holds only the functions picked for this CPU (init_mb_mgr_auto),
// no key, so every key a thread uses shares it.
IMB_MGR* thread_mgr() {
    thread_local struct Mgr {
        IMB_MGR* m = nullptr;
        Mgr() {
            m = alloc_mb_mgr(0);
            if (!m) throw std::bad_alloc();
            init_mb_mgr_auto(m, nullptr);
            if (imb_get_errno(m) != 0) {
                free_mb_mgr(m);
                m = nullptr;
                fail("intel-ipsec-mb has no implementation for this CPU");
            }
        }
        ~Mgr() { free_mb_mgr(m); }
    } mgr;
    return mgr.m;
}
#endif

}  // namespace

#ifdef DLCP_WITH_IPSEC_MB
const char* const SEAL_LIBRARY = "intel-ipsec-mb " IMB_VERSION_STR;
#else
const char* const SEAL_LIBRARY = OPENSSL_VERSION_TEXT;
#endif

// One AES-128-GCM key with its working state: the operations the format needs, each with a
// 12-byte nonce and a 16-byte tag.
class GcmKey {
  public:
    explicit GcmKey(const uint8_t key[KEY_BYTES]);
    ~GcmKey();
    GcmKey(const GcmKey&) = delete;
    GcmKey& operator=(const GcmKey&) = delete;

    // The tag of a || b as additional data, nothing encrypted (GMAC).
    void mac(const uint8_t iv[12], const uint8_t* a, size_t alen, const uint8_t* b, size_t blen, uint8_t tag[16]);
    // Encrypt `n` bytes of `in` into `out` under additional data `aad`; the tag.
    void encrypt(const uint8_t iv[12], const uint8_t* aad, size_t alen, const uint8_t* in, size_t n, uint8_t* out,
                 uint8_t tag[16]);
    // Decrypt `n` bytes in place under additional data `aad`; whether `tag` is theirs (else
    // the bytes are left undefined).
    bool decrypt(const uint8_t iv[12], const uint8_t* aad, size_t alen, uint8_t* inout, size_t n,
                 const uint8_t tag[16]);

  private:
#ifdef DLCP_WITH_IPSEC_MB
    struct gcm_key_data* kd_;  // (64-byte aligned, as the library wants)
#else
    EVP_CIPHER_CTX* enc_ = nullptr;
    EVP_CIPHER_CTX* dec_ = nullptr;
#endif
};

#ifdef DLCP_WITH_IPSEC_MB

GcmKey::GcmKey(const uint8_t key[KEY_BYTES]) {
    void* p = nullptr;
    if (posix_memalign(&p, 64, sizeof(struct gcm_key_data)) != 0) throw std::bad_alloc();
    kd_ = static_cast<struct gcm_key_data*>(p);
    IMB_AES128_GCM_PRE(thread_mgr(), key, kd_);
}

GcmKey::~GcmKey() {
    OPENSSL_cleanse(kd_, sizeof(struct gcm_key_data));
    free(kd_);
}

void GcmKey::mac(const uint8_t iv[12], const uint8_t* a, size_t alen, const uint8_t* b, size_t blen,
                 uint8_t tag[16]) {
    IMB_MGR* m = thread_mgr();
    struct gcm_context_data ctx;
    IMB_AES128_GMAC_INIT(m, kd_, &ctx, iv, 12);
    IMB_AES128_GMAC_UPDATE(m, kd_, &ctx, a, alen);
    if (blen) IMB_AES128_GMAC_UPDATE(m, kd_, &ctx, b, blen);
    IMB_AES128_GMAC_FINALIZE(m, kd_, &ctx, tag, 16);
}

void GcmKey::encrypt(const uint8_t iv[12], const uint8_t* aad, size_t alen, const uint8_t* in, size_t n,
                     uint8_t* out, uint8_t tag[16]) {
    if (n == 0) return mac(iv, aad, alen, nullptr, 0, tag);  // (GCM of nothing: the GMAC of its data)
    struct gcm_context_data ctx;
    IMB_AES128_GCM_ENC(thread_mgr(), kd_, &ctx, out, in, n, iv, aad, alen, tag, 16);
}

bool GcmKey::decrypt(const uint8_t iv[12], const uint8_t* aad, size_t alen, uint8_t* inout, size_t n,
                     const uint8_t tag[16]) {
    uint8_t mine[16];
    if (n == 0) {
        mac(iv, aad, alen, nullptr, 0, mine);
        return CRYPTO_memcmp(mine, tag, 16) == 0;
    }
    struct gcm_context_data ctx;
    IMB_AES128_GCM_DEC(thread_mgr(), kd_, &ctx, inout, inout, n, iv, aad, alen, mine, 16);
    return CRYPTO_memcmp(mine, tag, 16) == 0;
}

#else  // OpenSSL's EVP: a context per key and direction; per datagram only the nonce is set

namespace {
EVP_CIPHER_CTX* new_ctx(const uint8_t* key, bool encrypt) {
    EVP_CIPHER_CTX* c = EVP_CIPHER_CTX_new();
    if (!c) throw std::bad_alloc();
    int ok = encrypt ? EVP_EncryptInit_ex(c, EVP_aes_128_gcm(), nullptr, key, nullptr)
                     : EVP_DecryptInit_ex(c, EVP_aes_128_gcm(), nullptr, key, nullptr);
    if (ok != 1) {
        EVP_CIPHER_CTX_free(c);
        fail("OpenSSL refused AES-128-GCM");
    }
    return c;
}
}  // namespace

GcmKey::GcmKey(const uint8_t key[KEY_BYTES]) {
    enc_ = new_ctx(key, true);
    try {
        dec_ = new_ctx(key, false);
    } catch (...) {
        EVP_CIPHER_CTX_free(enc_);
        throw;
    }
}

GcmKey::~GcmKey() {
    EVP_CIPHER_CTX_free(enc_);
    EVP_CIPHER_CTX_free(dec_);
}

void GcmKey::mac(const uint8_t iv[12], const uint8_t* a, size_t alen, const uint8_t* b, size_t blen,
                 uint8_t tag[16]) {
    int outl = 0;
    uint8_t none[16];
    if (EVP_EncryptInit_ex(enc_, nullptr, nullptr, nullptr, iv) != 1) fail("setting the nonce");
    if (EVP_EncryptUpdate(enc_, nullptr, &outl, a, int(alen)) != 1) fail("additional data");
    if (blen && EVP_EncryptUpdate(enc_, nullptr, &outl, b, int(blen)) != 1) fail("additional data");
    if (EVP_EncryptFinal_ex(enc_, none, &outl) != 1) fail("final");
    if (EVP_CIPHER_CTX_ctrl(enc_, EVP_CTRL_GCM_GET_TAG, 16, tag) != 1) fail("tag");
}

void GcmKey::encrypt(const uint8_t iv[12], const uint8_t* aad, size_t alen, const uint8_t* in, size_t n,
                     uint8_t* out, uint8_t tag[16]) {
    int outl = 0;
    uint8_t none[16];
    if (EVP_EncryptInit_ex(enc_, nullptr, nullptr, nullptr, iv) != 1) fail("setting the nonce");
    if (EVP_EncryptUpdate(enc_, nullptr, &outl, aad, int(alen)) != 1) fail("additional data");
    if (n && EVP_EncryptUpdate(enc_, out, &outl, in, int(n)) != 1) fail("payload");
    if (EVP_EncryptFinal_ex(enc_, none, &outl) != 1) fail("final");
    if (EVP_CIPHER_CTX_ctrl(enc_, EVP_CTRL_GCM_GET_TAG, 16, tag) != 1) fail("tag");
}

bool GcmKey::decrypt(const uint8_t iv[12], const uint8_t* aad, size_t alen, uint8_t* inout, size_t n,
                     const uint8_t tag[16]) {
    int outl = 0;
    uint8_t none[16], t[16];
    std::memcpy(t, tag, 16);
    if (EVP_DecryptInit_ex(dec_, nullptr, nullptr, nullptr, iv) != 1) return false;
    if (EVP_DecryptUpdate(dec_, nullptr, &outl, aad, int(alen)) != 1) return false;
    if (n && EVP_DecryptUpdate(dec_, inout, &outl, inout, int(n)) != 1) return false;
    if (EVP_CIPHER_CTX_ctrl(dec_, EVP_CTRL_GCM_SET_TAG, 16, t) != 1) return false;
    return EVP_DecryptFinal_ex(dec_, none, &outl) == 1;
}

#endif

// One epoch's key: AEGISMAC's, its Init done once (Protect::MAC), or AES-GCM's working state,
// computed once (Protect::ENCRYPT).
class EpochKey {
  public:
    EpochKey(const uint8_t key[KEY_BYTES], Protect mode) {
        static const uint8_t zero_nonce[AEGIS_NONCE_BYTES] = {};
        if (mode == Protect::MAC)  // (not == ENCRYPT: intel-ipsec-mb.h defines ENCRYPT as a macro)
            mac_.reset(new AegisMacKey(key, zero_nonce));
        else
            gcm_.reset(new GcmKey(key));
    }
    EpochKey(const EpochKey&) = delete;
    EpochKey& operator=(const EpochKey&) = delete;

    // The MAC of a datagram: AEGISMAC-128X4 under the epoch's key and a fixed (zero) nonce, of
    // `iv` (the datagram's type and packet number) zero-padded to 16 bytes, then header, then
    // payload. Why the nonce inside the data and not as AEGIS's nonce: every datagram of an
    // epoch then starts from one Init (10 of the 26 state updates a MAC spends besides its data:
    // a 1,428-byte datagram's MAC went from 11.4 to 16.5 GB/s), and the MAC is the one AEGIS
    // function that allows a (key, nonce) pair to be reused with different inputs
    // (draft-irtf-cfrg-aegis-aead-18, "AEGIS as a MAC"); the inputs differ, as each begins with
    // its own type and packet number.
    void mac(const uint8_t iv[12], const uint8_t* a, size_t alen, const uint8_t* b, size_t blen, uint8_t tag[16]) const {
        uint8_t first[16] = {};
        std::memcpy(first, iv, 12);
        MacPart parts[3] = {{first, sizeof first}, {a, alen}, {b, blen}};
        mac_->mac(parts, 3, tag);
    }
    GcmKey& gcm() { return *gcm_; }

  private:
    std::unique_ptr<AegisMacKey> mac_;
    std::unique_ptr<GcmKey> gcm_;
};

// ------------------------------------------------------------------ keys

void epoch_key(const uint8_t key[KEY_BYTES], uint8_t ptype, uint64_t epoch, uint8_t out[KEY_BYTES]) {
    static const char label[] = "dlcp epoch";
    uint8_t info[sizeof label - 1 + 1 + 8];
    std::memcpy(info, label, sizeof label - 1);
    info[sizeof label - 1] = ptype;
    for (int i = 0; i < 8; ++i) info[sizeof label + i] = uint8_t(epoch >> (56 - 8 * i));
    EVP_KDF* kdf = EVP_KDF_fetch(nullptr, "HKDF", nullptr);
    EVP_KDF_CTX* kctx = kdf ? EVP_KDF_CTX_new(kdf) : nullptr;
    EVP_KDF_free(kdf);
    if (!kctx) throw std::runtime_error("OpenSSL has no HKDF");
    char digest[] = "SHA256";
    OSSL_PARAM params[] = {
        OSSL_PARAM_construct_utf8_string(OSSL_KDF_PARAM_DIGEST, digest, 0),
        OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_KEY, const_cast<uint8_t*>(key), KEY_BYTES),
        OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_INFO, info, sizeof info),
        OSSL_PARAM_construct_end(),
    };
    int ok = EVP_KDF_derive(kctx, out, KEY_BYTES, params);
    EVP_KDF_CTX_free(kctx);
    if (ok != 1) throw std::runtime_error("HKDF failed");
}

Sealer::Sealer(const uint8_t key[KEY_BYTES], Protect mode, unsigned epoch_bits) : mode_(mode), epoch_bits_(epoch_bits) {
    if (epoch_bits_ < 1 || epoch_bits_ > 62) throw std::invalid_argument("epoch_bits is 1..62");
    std::memcpy(key_, key, KEY_BYTES);
    if (mode_ == Protect::NONE) return;
    derive(0, 0);  // fail here, not at the first datagram on a data path's thread, if a library part is missing
}

Sealer::~Sealer() { OPENSSL_cleanse(key_, sizeof key_); }

Sealer::Lane::Lane() = default;
Sealer::Lane::~Lane() = default;

Sealer::Lane& Sealer::lane(uint8_t ptype) {
    std::unique_ptr<Lane>& l = lanes_[ptype];
    if (!l) l.reset(new Lane());
    return *l;
}

std::unique_ptr<EpochKey> Sealer::derive(uint8_t ptype, uint64_t epoch) {
    uint8_t k[KEY_BYTES];
    epoch_key(key_, ptype, epoch, k);
    keys_derived_ += 1;
    try {
        std::unique_ptr<EpochKey> g(new EpochKey(k, mode_));
        OPENSSL_cleanse(k, sizeof k);
        return g;
    } catch (...) {
        OPENSSL_cleanse(k, sizeof k);
        throw;
    }
}

bool Sealer::same_key(const uint8_t key[KEY_BYTES]) const { return CRYPTO_memcmp(key_, key, KEY_BYTES) == 0; }

// ------------------------------------------------------------------ sealing and opening

void Sealer::seal(const uint8_t* hdr, size_t hlen, size_t ptype_off, const uint8_t* payload, size_t n, uint8_t* ct,
                  uint8_t* trailer) {
    uint8_t ptype = hdr[ptype_off];
    Lane& l = lane(ptype);
    uint64_t pn = l.next_pn++;
    sealed_ += 1;
    for (int i = 0; i < 8; ++i) trailer[i] = uint8_t(pn >> (56 - 8 * i));
    uint8_t* tag = trailer + PN_BYTES;
    if (mode_ == Protect::NONE) {
        std::memset(tag, 0, TAG_BYTES);
        return;
    }
    uint64_t epoch = pn >> epoch_bits_;
    if (!l.tx || l.tx_epoch != epoch) {  // the type's first datagram, or its first of an epoch
        l.tx = derive(ptype, epoch);
        l.tx_epoch = epoch;
    }
    uint8_t iv[12];
    make_iv(iv, ptype, pn);
    if (mode_ == Protect::MAC)
        l.tx->mac(iv, hdr, hlen, payload, n, tag);
    else
        l.tx->gcm().encrypt(iv, hdr, hlen, payload, n, ct, tag);
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
    // the key of the datagram's epoch: the current one's, the one before or the one after
    uint8_t ptype = d[ptype_off];
    Lane& l = lane(ptype);
    uint64_t epoch = pn >> epoch_bits_;
    int slot = epoch == l.rx_epoch ? 1 : epoch == l.rx_epoch + 1 ? 2 : epoch + 1 == l.rx_epoch ? 0 : -1;
    if (slot < 0) return Opened::FORGED;
    if (!l.rx[slot]) l.rx[slot] = derive(ptype, epoch);  // (once per epoch)
    EpochKey& k = *l.rx[slot];
    uint8_t iv[12];
    make_iv(iv, ptype, pn);
    uint8_t tag[TAG_BYTES];
    std::memcpy(tag, trailer + PN_BYTES, TAG_BYTES);
    if (mode_ == Protect::MAC) {
        uint8_t mine[TAG_BYTES];
        k.mac(iv, d, body, nullptr, 0, mine);
        if (CRYPTO_memcmp(mine, tag, TAG_BYTES) != 0) return Opened::FORGED;
    } else if (!k.gcm().decrypt(iv, d, hlen, d + hlen, body - hlen, tag)) {
        return Opened::FORGED;
    }
    if (!l.seen.take(pn)) return Opened::REPLAYED;
    if (slot == 2) {  // the sender is in the next epoch: it becomes the current one
        l.rx[0] = std::move(l.rx[1]);
        l.rx[1] = std::move(l.rx[2]);
        l.rx_epoch = epoch;
    }
    return Opened::OK;
}

}  // namespace dlcp
