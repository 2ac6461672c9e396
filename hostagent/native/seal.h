// Packet protection: every datagram of the data path (DATA and CREDIT) ends in a trailer,
//
//     header | payload | pn (8 bytes, big-endian) | tag (16 bytes)
//
// AES-128-GCM under the key of its direction (sender -> receiver, hostagent.auth.direction_keys:
// derived in the handshake, never sent), nonce = ptype (1 byte) | 3 zero bytes | pn, where pn
// counts the datagrams of that type the sender sealed under the key: no nonce is ever used twice
// under one key (a resend is sealed afresh with the next pn, so its changed header never
// meets an old tag's nonce). Three modes:
//   * MAC (the default): the whole datagram (header and payload) is GCM's additional data, the
//     tag a 128-bit GMAC over it: any bit changed anywhere fails the check;
//   * ENCRYPT: the header is the additional data and the payload is encrypted (AEAD);
//   * NONE: the trailer is sent zero and not checked (only to measure what protection costs).
// The check comes before a byte of the payload is used: a receiver opens a datagram in its own
// read buffer (decrypting in place) and only then reads its fields as trustworthy.
//
// Why AES-GCM from OpenSSL: the CPUs this runs on have AES-NI and carry-less multiply (this
// one VAES and VPCLMULQDQ too), OpenSSL's GHASH and AES-GCM use them, it is in every
// distribution (libssl-dev), and it gives a MAC and the AEAD from one primitive and one key.
// An EVP context is set up once per key (its key schedule and hash key computed then); per
// datagram only the nonce is set.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

typedef struct evp_cipher_ctx_st EVP_CIPHER_CTX;

namespace dlcp {

constexpr size_t PN_BYTES = 8, TAG_BYTES = 16, TRAILER_BYTES = PN_BYTES + TAG_BYTES;
constexpr size_t KEY_BYTES = 16;

enum class Protect : uint8_t { NONE = 0, MAC = 1, ENCRYPT = 2 };

// What Sealer::open found: a datagram not authentic under the key, an authentic one, or an
// authentic one whose packet number was seen before (a replay: a copy of a datagram recorded
// on the way and sent again, or one so late that REPLAY_WINDOW later numbers came before it).
enum class Opened : uint8_t { FORGED = 0, OK = 1, REPLAYED = 2 };

// The packet numbers one key and packet type took: the highest, and which of the
// REPLAY_WINDOW below it (IPsec's and WireGuard's sliding window, RFC 6479). A number is taken
// once; one older than the window is refused too (resends are sealed with new numbers, so
// nothing genuine arrives twice). Updated only after the tag checked: a forged number moves
// nothing. Why 8192: datagrams sprayed over paths of different delay arrive out of order by a
// path's queue at most, far fewer; a late one refused is a loss, recovered by a resend.
class ReplayWindow {
  public:
    static constexpr uint64_t SIZE = 8192;
    bool take(uint64_t pn);

  private:
    bool any_ = false;
    uint64_t top_ = 0;
    uint64_t bits_[SIZE / 64] = {};
};

// One direction's key, for one thread at a time (an EVP context is not shared between threads).
class Sealer {
  public:
    Sealer(const uint8_t key[KEY_BYTES], Protect mode);
    ~Sealer();
    Sealer(const Sealer&) = delete;
    Sealer& operator=(const Sealer&) = delete;

    Protect mode() const { return mode_; }
    bool same_key(const uint8_t key[KEY_BYTES]) const;

    // Seal a datagram of `hlen` header bytes and `n` payload bytes with the next packet number
    // for its type (hdr's byte `ptype_off`): writes the trailer (TRAILER_BYTES) and, with
    // ENCRYPT, the ciphertext of the payload into `ct` (n bytes; unused otherwise, may be null).
    void seal(const uint8_t* hdr, size_t hlen, size_t ptype_off, const uint8_t* payload, size_t n, uint8_t* ct,
              uint8_t* trailer);

    // Check the datagram `d` of `len` bytes (trailer included) whose header is `hlen` bytes;
    // with ENCRYPT the payload is decrypted in place. FORGED (and, with ENCRYPT, the payload
    // bytes left undefined) when it is shorter than a header and a trailer or not authentic;
    // REPLAYED when authentic but its packet number was taken already (ReplayWindow). With
    // NONE nothing is checked: always OK.
    Opened open(uint8_t* d, size_t len, size_t hlen, size_t ptype_off);

    // Datagrams sealed so far under this key (of every type).
    uint64_t sealed() const { return sealed_; }

  private:
    uint8_t key_[KEY_BYTES];
    Protect mode_;
    EVP_CIPHER_CTX* enc_ = nullptr;
    EVP_CIPHER_CTX* dec_ = nullptr;
    uint64_t next_pn_[256] = {};  // per packet type
    std::unique_ptr<ReplayWindow> seen_[256];  // per packet type, made at its first datagram
    uint64_t sealed_ = 0;
};

}  // namespace dlcp
