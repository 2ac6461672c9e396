// Message tokens: keyed BLAKE2b (RFC 7693) with a 4-byte digest, the function
// hostagent.auth.message_token computes with hashlib. The receive path needs it for data of a
// message not set up yet: such data is parked only when its token is right, so a forger cannot
// crowd out a real sender's early packets. A test checks both sides agree on many inputs.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dlcp {

// BLAKE2b of `in` (at most 128 bytes) under `key` (at most 64 bytes), `outlen` (1..64) bytes.
void blake2b_keyed(uint8_t* out, size_t outlen, const uint8_t* key, size_t keylen, const uint8_t* in, size_t inlen);

// The 32-bit token of (job, sender, message id, iteration) under a receiver's 16-byte key,
// packed as hostagent.auth packs it (big-endian: u32 job, u16 sender, u32 message, u32 iteration).
uint32_t message_token(const uint8_t key[16], uint32_t job, uint16_t sender, uint32_t message_id, uint32_t iteration);

// The 32-bit token of a CREDIT, as hostagent.auth.credit_token computes it: keyed BLAKE2b of
// 'C' followed by the whole header with its token field (4 bytes at token_off) zeroed, so every
// field (the window, the count, the sequence, the RELEASE flag, ...) is bound and none can be
// changed on the way.
uint32_t credit_token(const uint8_t key[16], const uint8_t* header, size_t header_len, size_t token_off);

}  // namespace dlcp
