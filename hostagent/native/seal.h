// Packet protection: every datagram of the data path (DATA and CREDIT) ends in a trailer,
//
//     header | payload | pn (8 bytes, big-endian) | tag (16 bytes)
//
// under a key derived from its direction's (sender -> receiver, hostagent.auth.direction_keys:
// derived in the handshake, never sent; renewed by epoch, below), nonce = ptype (1 byte) | 3 zero
// bytes | pn (| 4 zero bytes for AEGIS's 16), where pn counts the datagrams of that type the
// sender sealed under the key: no nonce is ever used twice under one key (a resend is sealed
// afresh with the next pn, so its changed header never meets an old tag's nonce). Three modes:
//   * MAC (the default): the tag is AEGISMAC-128X4 (aegis_mac.h) of the whole datagram (header
//     and payload): any bit changed anywhere fails the check;
//   * ENCRYPT: AES-128-GCM, the header the additional data and the payload encrypted (AEAD);
//   * NONE: the trailer is sent zero and not checked (only to measure what protection costs).
// The check comes before a byte of the payload is used: a receiver opens a datagram in its own
// read buffer (decrypting in place) and only then reads its fields as trustworthy.
//
// Key renewal: a direction's key is never a MAC or AES key itself. Each packet type's numbers
// are cut into epochs of 2^EPOCH_BITS, and epoch e of type t is sealed under
//     K(t, e) = HKDF-SHA256(ikm = direction key, info = "dlcp epoch" | t | e (8 bytes, big-endian))
// (RFC 5869, OpenSSL's), so no key seals more than 2^22 datagrams: far below AES-GCM's
// limits (RFC 9001 section 6.6: 2^23 encrypted packets for confidentiality) however long a
// job runs, and without a message to agree on it: both sides read the epoch from the packet
// number. A receiver holds the keys of the previous, current and next epoch of each type; a
// datagram of any other epoch is refused as FORGED at no cost (a genuine one is never two epochs
// late: the replay window refuses far less late ones), and the next epoch's key is derived once,
// at the first datagram claiming it, and becomes current when one authenticates under it. The
// 64-bit packet numbers do not wrap in any job's life (2^64 datagrams).
//
// Why two algorithms: the MAC runs over every byte of every collective (twice: the sender's tag,
// the receiver's check), so it is the fastest sound one these CPUs offer: AEGISMAC-128X4 with
// VAES, ~49 GB/s per core here against AES-GMAC's ~18 (aegis_mac.h says why it is sound to
// use). Encryption, an option for shared networks, stays AES-GCM, what QUIC and TLS 1.3 seal each
// packet with: Intel's intel-ipsec-mb where the build finds it (Debian's libipsec-mb-dev; x86-64;
// VAES and VPCLMULQDQ on 512-bit registers: 3-4x faster per datagram here than OpenSSL 3.0's,
// docs/design/security.md), OpenSSL 3 otherwise (every distribution's libssl-dev, which also
// gives HKDF). Known-answer tests pin both (SEAL_LIBRARY says which AES-GCM a build uses,
// aegis_target() which MAC build runs). An AES-GCM key's working state (key schedule and
// hash-key powers) is computed once per key (GcmKey); per datagram only the nonce changes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace dlcp {

class EpochKey;  // one epoch's key, ready to use (seal.cc)

// The library behind the AES-GCM of ENCRYPT, and its version ("intel-ipsec-mb 1.3.0" or "OpenSSL 3.0.x").
extern const char* const SEAL_LIBRARY;

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

// Derive K(ptype, epoch) of a direction key (above). Throws std::runtime_error if OpenSSL fails.
void epoch_key(const uint8_t key[KEY_BYTES], uint8_t ptype, uint64_t epoch, uint8_t out[KEY_BYTES]);

// One direction's key, for one thread at a time (its keys' working state is not shared).
class Sealer {
  public:
    static constexpr unsigned EPOCH_BITS = 22;

    // `epoch_bits`: the epochs' length (EPOCH_BITS; tests make them short to cross several).
    Sealer(const uint8_t key[KEY_BYTES], Protect mode, unsigned epoch_bits = EPOCH_BITS);
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

    // Epoch keys derived so far (both directions of use, every type): how often keys changed.
    uint64_t keys_derived() const { return keys_derived_; }

  private:
    // One packet type's numbers under this key: what sealing and opening it needs.
    struct Lane {
        uint64_t next_pn = 0;
        uint64_t tx_epoch = 0;
        std::unique_ptr<EpochKey> tx;  // epoch tx_epoch's, made at the type's first seal
        uint64_t rx_epoch = 0;       // the current epoch: rx[1]; rx[0] the one before, rx[2] after
        std::unique_ptr<EpochKey> rx[3];
        ReplayWindow seen;
        Lane();
        ~Lane();
    };
    Lane& lane(uint8_t ptype);
    std::unique_ptr<EpochKey> derive(uint8_t ptype, uint64_t epoch);

    uint8_t key_[KEY_BYTES];
    Protect mode_;
    unsigned epoch_bits_;
    std::unique_ptr<Lane> lanes_[256];  // per packet type, made at its first datagram
    uint64_t sealed_ = 0;
    uint64_t keys_derived_ = 0;
};

}  // namespace dlcp
