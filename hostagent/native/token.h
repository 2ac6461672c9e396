// Credit tokens: keyed BLAKE2b (RFC 7693) with a 4-byte digest, the function
// hostagent.auth.credit_token computes with hashlib (a test checks both agree). Since wire
// version 3 a credit is authenticated by its trailer's tag (seal.h); the token is checked behind
// it and protects nothing the tag does not (data packets carry none). Kept until the header's
// token field goes (issue 44, item 7).
#pragma once

#include <cstddef>
#include <cstdint>

namespace dlcp {

// BLAKE2b of `in` (at most 128 bytes) under `key` (at most 64 bytes), `outlen` (1..64) bytes.
void blake2b_keyed(uint8_t* out, size_t outlen, const uint8_t* key, size_t keylen, const uint8_t* in, size_t inlen);

// The 32-bit token of a CREDIT, as hostagent.auth.credit_token computes it: keyed BLAKE2b of
// 'C' followed by the whole header with its token field (4 bytes at token_off) zeroed, so every
// field (the window, the count, the sequence, the RELEASE flag, ...) is bound and none can be
// changed on the way.
uint32_t credit_token(const uint8_t key[16], const uint8_t* header, size_t header_len, size_t token_off);

}  // namespace dlcp
