// AEGISMAC-128X4: the MAC that tags every datagram of the data path (seal.h, Protect::MAC).
//
// The `Mac` function of AEGIS-128X with 4 lanes (draft-irtf-cfrg-aegis-aead-18, "AEGIS as a
// Message Authentication Code", AEGISMAC-128X; AEGIS is in the CAESAR portfolio and libsodium):
// a 128-bit key and nonce, 128-bit tags. Four AEGIS-128L states, one per 128-bit lane, absorb
// 128 bytes per update with eight AES rounds; FinalizeMac folds the lanes' tags into lane 0.
//
// Why it and not GMAC (wire version 4's): the tag was the largest single cost of a rank's CPU
// in a 57 MB all_reduce on loopback (9.3 of 55.5 ms per call, GMAC at ~18 GB/s on this CPU,
// docs/results/backend.md); with VAES on 512-bit registers AEGISMAC-128X4 runs the same bytes
// about 2.7x as fast for a 64 KB datagram and as fast for a 1,428-byte one (bench/seal_rate.py).
// It keeps what the format needs: a 128-bit tag and a 128-bit key per epoch. Its nonce may be
// reused with different inputs (the only AEGIS function that allows it), so seal.cc gives every
// datagram of an epoch the same one and the packet type and number as the first 16 bytes of
// the data: one Init per key (AegisMacKey), and no input ever MACed twice under a key.
//
// Four builds of the one algorithm (aegis_body.inc), the first call picking the fastest this
// CPU runs: "vaes512" (the four lanes in one 512-bit register; AVX-512F and VAES), "vaes256"
// (two 256-bit registers; AVX2 and VAES: AMD Zen 3, Intel without AVX-512), "aesni" (four
// 128-bit registers; any x86-64 with AES-NI), and "portable" (AES rounds in C++, table lookups:
// not constant-time, for CPUs without AES instructions only). All give the same tags (the
// draft's known answer and an independent model pin them: tests/transport/test_aegis_mac.py).
#pragma once

#include <cstddef>
#include <cstdint>

namespace dlcp {

constexpr size_t AEGIS_KEY_BYTES = 16, AEGIS_NONCE_BYTES = 16, AEGIS_TAG_BYTES = 16;

// One part of the data a MAC covers; the parts are taken as one input, in order.
struct MacPart {
    const uint8_t* data;
    size_t len;
};

struct AegisBuild;  // one build's functions (aegis_mac.cc)

// A key and nonce ready to MAC with: Init(key, nonce) computed once (10 of the 26 state updates
// a MAC spends besides its data's), for the build this CPU runs or a named one.
class AegisMacKey {
  public:
    // `target`: "vaes512", "vaes256", "aesni" or "portable"; null for the fastest this CPU runs. Throws
    // std::invalid_argument when this CPU cannot run the named build.
    AegisMacKey(const uint8_t key[AEGIS_KEY_BYTES], const uint8_t nonce[AEGIS_NONCE_BYTES],
                const char* target = nullptr);
    ~AegisMacKey();
    AegisMacKey(const AegisMacKey&) = delete;
    AegisMacKey& operator=(const AegisMacKey&) = delete;

    // The 128-bit AEGISMAC-128X4 tag of the concatenation of `parts` (a datagram's header and
    // payload need not be contiguous).
    void mac(const MacPart* parts, size_t nparts, uint8_t tag[AEGIS_TAG_BYTES]) const;
    // The build it runs.
    const char* target() const;

  private:
    alignas(64) uint8_t state_[8 * 64];  // Init's 8 registers of 4 lanes
    const AegisBuild* build_;
};

// Which build this CPU runs fastest: "vaes512", "vaes256", "aesni" or "portable".
const char* aegis_target();

}  // namespace dlcp
