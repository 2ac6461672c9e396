// The float32 loops that read every byte of a large message: a packet added into its sum
// (reduce-scatter receives; with the sum's L2 magnitude, or scaled first) and a packet's L2
// magnitude (float32 and bfloat16 packets as they first leave).
//
// Each sums in 8 float lanes (lane k takes elements k, k + 8, ...; the lanes are then added in
// double, lane 0 first, and the elements past the last whole 8 after them), every operation
// rounded on its own (no fused multiply-add: CMakeLists). That fixes the result bit for bit
// whatever the vector width, so each loop is built twice: for AVX2, where the 8 lanes are one
// 256-bit register, and for the baseline x86-64, where they are two SSE ones; the first call
// picks the one this CPU runs (loops_target() says which). Elsewhere (not x86-64) the one
// portable build.
//
// Why: the baseline build alone ran these loops 4 floats per instruction. Alone on a core the
// AVX2 build adds 1.75x faster; in a 4-rank 57 MB all_reduce, where the loops wait on memory
// beside the kernel's copies, the compiled path's CPU fell from ~6.0 to ~5.4 ms of each rank's
// ~50 ms per call (perf over the whole machine; docs/results/backend.md).
#pragma once

#include <cstddef>
#include <cstdint>

namespace dlcp {

// dst[i] += src[i] for i < count (src: unaligned bytes of float32, not overlapping dst).
void add_f32(float* dst, const uint8_t* src, uint32_t count);
// The same, and the L2 magnitude of dst[0..count) afterwards (packet_magnitudes' rule).
float add_f32_l2(float* dst, const uint8_t* src, uint32_t count);
// dst[i] = dst[i] * scale + src[i], each operation rounded on its own.
void add_f32_scaled(float* dst, const uint8_t* src, uint32_t count, float scale);
// The same, and the L2 magnitude of dst[0..count) afterwards.
float add_f32_scaled_l2(float* dst, const uint8_t* src, uint32_t count, float scale);

// dst[i] = bfloat16(float(dst[i]) + float(src[i])): layout.h's add_bf16, bit for bit, 16
// elements at a time where the CPU has AVX2 (the SSE2 build alone added a bfloat16 ring's chunks
// at half float32's elements per instruction).
void add_bf16_sum(uint16_t* dst, const uint8_t* src, uint32_t count);

// The sum of squares of `n` elements (float32, or bfloat16: float32's top half), in the lanes
// above, then in double: what packet_magnitudes takes the square root of.
double sumsq_f32(const uint8_t* data, size_t n);
double sumsq_bf16(const uint8_t* data, size_t n);

// Which build of these loops this CPU runs: "avx2" or "baseline" (x86-64), else "portable".
const char* loops_target();

}  // namespace dlcp
