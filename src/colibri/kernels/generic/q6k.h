// GGUF Q6_K blocks as stored (colibri/quant/kinds.py, "q6k"): the decoder every tier's q6k kernels share. A block
// is 210 bytes for 256 values: ql[128] (the low 4 bits), qh[64] (the high 2), sc[16] (int8 scale per 16 values),
// d (f16); value 128 h + 32 j + l (h < 2, j < 4, l < 32) has the low bits in ql[64 h + 32 (j & 1) + l] (the high
// nibble when j >= 2), the high bits in qh[32 h + l] >> 2 j, code q - 32, and w = (d * sc[v / 16]) * (q - 32):
// the q8k kind's values, so the kernels give q8k's bits for the same weight (tests/test_kquant.py).
// Plain GCC/Clang vector extensions: the same source compiles to AVX-512, AVX2 or NEON instructions per tier.
#pragma once

#include <cstdint>
#include <cstring>

namespace q6k {

constexpr int64_t kBlockBytes = 210;
constexpr int64_t kBlockValues = 256;

typedef uint8_t u8x32 __attribute__((vector_size(32), aligned(1)));
typedef int8_t s8x32 __attribute__((vector_size(32), aligned(1)));

// The codes q - 32 of half h of a block (values [128 h, 128 h + 128)) into out[128]: the half's 64 low-bit bytes
// hold values 0-63 in their low nibbles and 64-127 in their high ones, its 32 high-bit bytes four values each, in
// 32-byte vectors (the kernels read a row's codes a half block at a time, 16 or 32 of them per load: stores of
// the same width forward to those loads).
inline void codes128(const uint8_t* block, int64_t h, int8_t* out) {
  u8x32 a, b, q;
  std::memcpy(&a, block + 64 * h, 32);
  std::memcpy(&b, block + 64 * h + 32, 32);
  std::memcpy(&q, block + 128 + 32 * h, 32);
  const s8x32 v[4] = {reinterpret_cast<s8x32>((a & 15) | ((q & 3) << 4)) - 32,
                      reinterpret_cast<s8x32>((b & 15) | (((q >> 2) & 3) << 4)) - 32,
                      reinterpret_cast<s8x32>((a >> 4) | (((q >> 4) & 3) << 4)) - 32,
                      reinterpret_cast<s8x32>((b >> 4) | ((q >> 6) << 4)) - 32};
  for (int i = 0; i < 4; ++i) std::memcpy(out + 32 * i, &v[i], 32);
}

// The block's 16 scale codes and its d as f16 bits.
inline const int8_t* scales(const uint8_t* block) { return reinterpret_cast<const int8_t*>(block + 192); }
inline uint16_t d_bits(const uint8_t* block) {
  uint16_t h;
  std::memcpy(&h, block + 208, 2);
  return h;
}

}  // namespace q6k
