// GGUF blocks kept as the file stores them (colibri/quant/kinds.py: q6k, q5_0, ...): the decoders every tier's kernels
// share, so each kind's codes are decoded by one source. Plain C++ (GCC/Clang vector extensions) or, where the tier
// has it, AVX2, whose instructions every x86 tier here has.
//
// q6k: Q6_K, 210 bytes for 256 values: ql[128] (the low 4 bits), qh[64] (the high 2), sc[16] (int8 scale per 16
// values), d (f16); value 128 h + 32 j + l (h < 2, j < 4, l < 32) has its low bits in ql[64 h + 32 (j & 1) + l] (the
// high nibble when j >= 2), its high bits in qh[32 h + l] >> 2 j, code q - 32, and w = (d * sc[v / 16]) * (q - 32):
// q8k's values, so the kernels give q8k's bits for the same weight.
// q3k: Q3_K, 110 bytes for 256 values: hmask[32] (the third bit), qs[64] (the low 2 bits), scales[12] (16 6-bit
// codes), d (f16); w = (d * (sc - 32)) * (q - 4) per 16 values: q8k's form too (codes in [-4, 3]).
// iq4_xs, iq4_nl, q5k, q2k, q5_1: below, beside their decoders.
// q5_0: Q5_0, 22 bytes for 32 values: d (f16), qh (32 high bits, little-endian), qs[16]; value j < 16 is the low
// nibble of qs[j] with bit j of qh above it, value j + 16 the high nibble with bit j + 16, code q - 16, and
// w = d * (q - 16) (exact in f32): the values of q8 with group 32 and those d as f16 scales, so the kernels give
// q8_linear's bits for the codes widened to bytes. (Both crossed on every tier: tests/test_tiers.py.)
#pragma once

#include <cstdint>
#include <cstring>

#include "../stream.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// The two bytes at p as a little-endian uint16, any alignment (a block's f16 d; IQ4_XS's scales_h).
inline uint16_t u16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

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
#if defined(__AVX2__)
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h + 32));
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h));
  const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
  // the high bits moved to bits 4-5 (16-bit shifts: the mask drops what crosses from the neighbouring byte)
  const __m256i h0 = _mm256_and_si256(_mm256_slli_epi16(q, 4), m2), h1 = _mm256_and_si256(_mm256_slli_epi16(q, 2), m2);
  const __m256i h2 = _mm256_and_si256(q, m2), h3 = _mm256_and_si256(_mm256_srli_epi16(q, 2), m2);
  const __m256i v[4] = {_mm256_or_si256(_mm256_and_si256(a, m4), h0), _mm256_or_si256(_mm256_and_si256(b, m4), h1),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), h2),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), m4), h3)};
  for (int i = 0; i < 4; ++i)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * i), _mm256_sub_epi8(v[i], off));
#else
  u8x32 a, b, q;
  std::memcpy(&a, block + 64 * h, 32);
  std::memcpy(&b, block + 64 * h + 32, 32);
  std::memcpy(&q, block + 128 + 32 * h, 32);
  const s8x32 v[4] = {reinterpret_cast<s8x32>((a & 15) | ((q & 3) << 4)) - 32,
                      reinterpret_cast<s8x32>((b & 15) | (((q >> 2) & 3) << 4)) - 32,
                      reinterpret_cast<s8x32>((a >> 4) | (((q >> 4) & 3) << 4)) - 32,
                      reinterpret_cast<s8x32>((b >> 4) | ((q >> 6) << 4)) - 32};
  for (int i = 0; i < 4; ++i) std::memcpy(out + 32 * i, &v[i], 32);
#endif
}

// The block's 16 scale codes (int8, one per 16 values) into out[16], and its d as f16 bits.
inline void scales16(const uint8_t* block, int8_t* out) { std::memcpy(out, block + 192, 16); }
inline uint16_t d_bits(const uint8_t* block) { return u16_at(block + 208); }

// The unsigned codes q (0..63, the code plus 32) of values [64 s, 64 s + 64) of a block, 32 in each of u[0], u[1],
// left in registers (the int8 decode form multiplies them as they are, vpmaddubsw's unsigned operand). Step s is
// half h = s / 2, value quarters j = 2 (s & 1) and j + 1: the same low-bit bytes for both steps of a half (low
// nibbles, then high), the high-bit byte's pairs 0-1 / 2-3 or 4-5 / 6-7. 16-bit shifts; each mask drops the bits
// crossing from the neighbouring byte.
template <int S>
inline void ucodes64(const uint8_t* block, u8x32 u[2]) {
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  constexpr int h = S / 2;
  u8x32 a, b, q;
  std::memcpy(&a, block + 64 * h, 32);
  std::memcpy(&b, block + 64 * h + 32, 32);
  std::memcpy(&q, block + 128 + 32 * h, 32);
  const u16x16 a16 = reinterpret_cast<u16x16>(a), b16 = reinterpret_cast<u16x16>(b);
  const u16x16 q16 = reinterpret_cast<u16x16>(q);
  const u8x32 m4 = u8x32{} + 15, m2 = u8x32{} + 0x30;
  if constexpr (S % 2 == 0) {
    u[0] = (a & m4) | (reinterpret_cast<u8x32>(q16 << 4) & m2);
    u[1] = (b & m4) | (reinterpret_cast<u8x32>(q16 << 2) & m2);
  } else {
    u[0] = (reinterpret_cast<u8x32>(a16 >> 4) & m4) | (q & m2);
    u[1] = (reinterpret_cast<u8x32>(b16 >> 4) & m4) | (reinterpret_cast<u8x32>(q16 >> 2) & m2);
  }
}

}  // namespace q6k

namespace q3k {

constexpr int64_t kBlockBytes = 110;
constexpr int64_t kBlockValues = 256;

// The codes q - 4 (in [-4, 3]) of half h of a block into out[128]: value 32 j + l of the half has its low 2 bits in
// qs[32 h + l] >> 2 j and its third bit in hmask[l] >> (4 h + j). (The half a template argument: every shift count
// a constant.)
template <int H>
inline void codes128_half(const uint8_t* block, int8_t* out) {
#if defined(__AVX2__)
  const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
  const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 + 32 * H));
  const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
  // the hmask bit 4 H + j moved to bit 2 (16-bit shifts, then masked)
  const __m256i hi[4] = {H ? _mm256_srli_epi16(hm, 2) : _mm256_slli_epi16(hm, 2),
                         H ? _mm256_srli_epi16(hm, 3) : _mm256_slli_epi16(hm, 1),
                         H ? _mm256_srli_epi16(hm, 4) : hm,
                         H ? _mm256_srli_epi16(hm, 5) : _mm256_srli_epi16(hm, 1)};
  const __m256i lo[4] = {qs, _mm256_srli_epi16(qs, 2), _mm256_srli_epi16(qs, 4), _mm256_srli_epi16(qs, 6)};
  for (int j = 0; j < 4; ++j)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * j),
                        _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(lo[j], three), _mm256_and_si256(hi[j], four)),
                                        four));
#else
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) {
      const int lo = (block[32 + 32 * H + l] >> (2 * j)) & 3, hi = (block[l] >> (4 * H + j)) & 1;
      out[32 * j + l] = static_cast<int8_t>((lo | (hi << 2)) - 4);
    }
#endif
}
inline void codes128(const uint8_t* block, int64_t h, int8_t* out) {
  if (h) codes128_half<1>(block, out);
  else codes128_half<0>(block, out);
}

// The block's 16 scales sc - 32 (6-bit codes packed in 12 bytes: the low 4 bits of scales 0-7 and 8-15 in the
// low and high nibbles of bytes 0-7, the high 2 bits of scale i in byte 8 + i % 4 at bit 2 (i / 4)) into out[16].
inline void scales16(const uint8_t* block, int8_t* out) {
  const uint8_t* b = block + 96;
  for (int i = 0; i < 16; ++i) {
    const int lo = i < 8 ? b[i] & 15 : b[i - 8] >> 4, hi = (b[8 + i % 4] >> (2 * (i / 4))) & 3;
    out[i] = static_cast<int8_t>((lo | (hi << 4)) - 32);
  }
}
inline uint16_t d_bits(const uint8_t* block) { return u16_at(block + 108); }

}  // namespace q3k

namespace iq4 {

// IQ4_NL / IQ4_XS: 4-bit indices into this table of int8 values (llama.cpp's kvalues_iq4nl).
constexpr int8_t kValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

#if defined(__AVX2__)
// The 32 values of 16 bytes of indices (value j < 16: the low nibble of byte j, value j + 16 its high nibble).
inline __m256i values32v(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), m4 = _mm_set1_epi8(15);
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kValues));
  return _mm256_set_m128i(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), m4)),
                          _mm_shuffle_epi8(table, _mm_and_si128(q, m4)));
}
#endif
inline void values32(const uint8_t* qs, int8_t* out) {
#if defined(__AVX2__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), values32v(qs));
#else
  for (int j = 0; j < 16; ++j) {
    out[j] = kValues[qs[j] & 15];
    out[j + 16] = kValues[qs[j] >> 4];
  }
#endif
}

}  // namespace iq4

// iq4_xs: IQ4_XS, 136 bytes for 256 values: d (f16), scales_h (uint16: the high 2 bits of group ib's scale at bit
// 2 ib), scales_l[4] (the low 4 bits, group ib in byte ib / 2, nibble ib % 2), qs[128] (16 bytes of indices a group
// of 32); w = (d * (ls - 32)) * kValues[q]: q8k's form with the per-32 scale given to both of its 16s.
namespace iq4_xs {

constexpr int64_t kBlockBytes = 136;

inline void codes128(const uint8_t* block, int64_t h, int8_t* out) {
  for (int i = 0; i < 4; ++i) iq4::values32(block + 8 + 16 * (4 * h + i), out + 32 * i);
}
inline void scales16(const uint8_t* block, int8_t* out) {
  const uint16_t hi = u16_at(block + 2);
  for (int ib = 0; ib < 8; ++ib) {
    const int ls = ((block[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (((hi >> (2 * ib)) & 3) << 4);
    out[2 * ib] = out[2 * ib + 1] = static_cast<int8_t>(ls - 32);
  }
}
inline uint16_t d_bits(const uint8_t* block) { return u16_at(block); }

}  // namespace iq4_xs

// q5k: Q5_K, 176 bytes for 256 values: d (f16), dmin (f16), scales[12] (8 + 8 6-bit codes sc, m: Q4_K's packing),
// qh[32] (the fifth bit), qs[128] (the low 4); value 32 i + l (i < 8, l < 32) has its low bits in nibble i % 2 of
// qs[32 (i / 2) + l] and its fifth bit in qh[l] >> i, code q in [0, 31], and
// w = (d * sc[i]) * q - dmin * m[i]: d * sc and dmin * m are exact in f32 (11 + 6 bits), so is their product by q
// (22 bits), one rounding in the subtraction (gguf's dequantize: the same f32 steps). q8k's form with an offset per
// 32 (kMins below): the kernels take q8k's steps over these codes and subtract the offset from each weight before
// it is used, so a fused multiply-subtract and the two steps give the same bits (the product is exact).
namespace q5k {

constexpr int64_t kBlockBytes = 176;

// The codes q (in [0, 31]) of half H of a block (values [128 H, 128 H + 128): i = 4 H + j) into out[128]. (The
// half a template argument: every shift count a constant.)
template <int H>
inline void codes128_half(const uint8_t* block, int8_t* out) {
#if defined(__AVX2__)
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16));
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 48 + 64 * H));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 80 + 64 * H));
  const __m256i m4 = _mm256_set1_epi8(15), b4 = _mm256_set1_epi8(16);
  // qh bit 4 H + j moved to bit 4 (16-bit shifts: the mask drops what crosses from the neighbouring byte)
  const __m256i hi[4] = {H ? qh : _mm256_slli_epi16(qh, 4), H ? _mm256_srli_epi16(qh, 1) : _mm256_slli_epi16(qh, 3),
                         H ? _mm256_srli_epi16(qh, 2) : _mm256_slli_epi16(qh, 2),
                         H ? _mm256_srli_epi16(qh, 3) : _mm256_slli_epi16(qh, 1)};
  const __m256i lo[4] = {a, _mm256_srli_epi16(a, 4), b, _mm256_srli_epi16(b, 4)};
  for (int j = 0; j < 4; ++j)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * j),
                        _mm256_or_si256(_mm256_and_si256(lo[j], m4), _mm256_and_si256(hi[j], b4)));
#else
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) {
      const int i = 4 * H + j;
      const int lo = (block[48 + 32 * (i / 2) + l] >> (4 * (i % 2))) & 15, hi = (block[16 + l] >> i) & 1;
      out[32 * j + l] = static_cast<int8_t>(lo | (hi << 4));
    }
#endif
}
inline void codes128(const uint8_t* block, int64_t h, int8_t* out) {
  if (h) codes128_half<1>(block, out);
  else codes128_half<0>(block, out);
}

// Q4_K's 12-byte packing of 8 + 8 6-bit codes (bytes 4-15 of the block, as three little-endian words a, b, c):
// scale codes sc (Mins false: 0-3 the low 6 bits of a's bytes, 4-7 c's low nibbles under a's top 2 bits) or offset
// codes m (Mins true: b's, and c's high nibbles under b's top 2 bits), each given to both 16s of its 32, into
// out[16]. Word arithmetic, not a loop over bytes: the kernels decode every row's codes once per call.
template <bool Mins>
inline void codes16(const uint8_t* block, int8_t* out) {
  uint32_t w[3];
  std::memcpy(w, block + 4, 12);
  const uint32_t lo = w[Mins] & 0x3f3f3f3fu;
  const uint32_t hi = ((w[2] >> (4 * Mins)) & 0x0f0f0f0fu) | ((w[Mins] >> 2) & 0x30303030u);
  const uint64_t v = lo | static_cast<uint64_t>(hi) << 32;  // code j in byte j
#if defined(__AVX2__)
  const __m128i c = _mm_cvtsi64_si128(static_cast<int64_t>(v));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_unpacklo_epi8(c, c));
#else
  for (int j = 0; j < 8; ++j) out[2 * j] = out[2 * j + 1] = static_cast<int8_t>((v >> (8 * j)) & 0xff);
#endif
}
inline void scales16(const uint8_t* block, int8_t* out) { codes16<false>(block, out); }
inline void mins16(const uint8_t* block, int8_t* out) { codes16<true>(block, out); }
inline uint16_t d_bits(const uint8_t* block) { return u16_at(block); }
inline uint16_t dmin_bits(const uint8_t* block) { return u16_at(block + 2); }

}  // namespace q5k

// The two-level int8-valued block kinds as template arguments of the kernels (q8k's form: codes and d * sc per 16;
// kMins: minus dmin * m per 16, mins16 / dmin_bits giving the codes m and dmin).
template <int64_t Bytes, void (*Codes)(const uint8_t*, int64_t, int8_t*), void (*Scales)(const uint8_t*, int8_t*),
          uint16_t (*D)(const uint8_t*)>
struct KBlocks {
  static constexpr int64_t kBlockBytes = Bytes;
  static constexpr bool kMins = false;
  static constexpr bool kUnsigned = false;  // ucodes64: the codes plus 32, unsigned, 64 values a step (q6k)
  static void codes128(const uint8_t* block, int64_t h, int8_t* out) { Codes(block, h, out); }
  static void scales16(const uint8_t* block, int8_t* out) { Scales(block, out); }
  static uint16_t d_bits(const uint8_t* block) { return D(block); }
};
// Rows [r0, r0 + rows) of a weight of block kind B without mins as q8k's arrays: codes int8 [rows, K], scale codes
// int8 [rows, K/16], d f16 bits [rows, K/256] (the LOSSY int8 mode reads these kinds with q8k's int8 kernels, so
// their bits are q8k_linear_i8's for the same values).
template <class B>
inline void rows_as_q8k(const uint8_t* blocks, int64_t k, int64_t r0, int64_t rows, int8_t* codes, int8_t* sc,
                        uint16_t* sup) {
  static_assert(!B::kMins, "q8k's form has no offsets");
  const int64_t nb = k / 256;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* bp = blocks + ((r0 + r) * nb + b) * B::kBlockBytes;
      for (int64_t o = 0; o < B::kBlockBytes; o += 64) prefetch_ahead(bp + o);  // the rows are one stream
      B::codes128(bp, 0, codes + r * k + 256 * b);
      B::codes128(bp, 1, codes + r * k + 256 * b + 128);
      B::scales16(bp, sc + r * (k / 16) + 16 * b);
      sup[r * nb + b] = B::d_bits(bp);
    }
}

struct Q6kBlocks : KBlocks<q6k::kBlockBytes, q6k::codes128, q6k::scales16, q6k::d_bits> {
  static constexpr bool kUnsigned = true;
  template <int S>
  static void ucodes64(const uint8_t* block, q6k::u8x32 u[2]) { q6k::ucodes64<S>(block, u); }
};
using Q3kBlocks = KBlocks<q3k::kBlockBytes, q3k::codes128, q3k::scales16, q3k::d_bits>;
using Iq4xsBlocks = KBlocks<iq4_xs::kBlockBytes, iq4_xs::codes128, iq4_xs::scales16, iq4_xs::d_bits>;
struct Q5kBlocks : KBlocks<q5k::kBlockBytes, q5k::codes128, q5k::scales16, q5k::d_bits> {
  static constexpr bool kMins = true;
  static void mins16(const uint8_t* block, int8_t* out) { q5k::mins16(block, out); }
  static uint16_t dmin_bits(const uint8_t* block) { return q5k::dmin_bits(block); }
};

// q2k: Q2_K, 84 bytes for 256 values: scales[16] (per 16 values sc in the low nibble, m in the high), qs[64] (2-bit
// codes), d (f16), dmin (f16); value 128 h + 32 j + l (h < 2, j < 4, l < 32) is (qs[32 h + l] >> 2 j) & 3, code q in
// [0, 3], and w = (d * sc) * q - dmin * m per 16 values: q5k's form with an offset per 16 (each product exact in f32:
// 11 + 4 + 2 bits; one rounding in the subtraction, gguf's dequantize steps).
namespace q2k {

constexpr int64_t kBlockBytes = 84;

// The codes of half h of a block (values [128 h, 128 h + 128)) into out[128].
inline void codes128(const uint8_t* block, int64_t h, int8_t* out) {
#if defined(__AVX2__)
  const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16 + 32 * h));
  const __m256i three = _mm256_set1_epi8(3);
  const __m256i v[4] = {qs, _mm256_srli_epi16(qs, 2), _mm256_srli_epi16(qs, 4), _mm256_srli_epi16(qs, 6)};
  for (int j = 0; j < 4; ++j)  // (16-bit shifts: the mask drops what crosses from the neighbouring byte)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * j), _mm256_and_si256(v[j], three));
#else
  q6k::u8x32 qs;
  std::memcpy(&qs, block + 16 + 32 * h, 32);
  for (int j = 0; j < 4; ++j) {
    const q6k::u8x32 v = (qs >> (2 * j)) & 3;
    std::memcpy(out + 32 * j, &v, 32);
  }
#endif
}

// The 16 scale codes sc (Mins false: the low nibbles) or offset codes m (Mins true: the high ones) into out[16].
template <bool Mins>
inline void codes16(const uint8_t* block, int8_t* out) {
  for (int i = 0; i < 16; ++i) out[i] = static_cast<int8_t>(Mins ? block[i] >> 4 : block[i] & 15);
}
inline void scales16(const uint8_t* block, int8_t* out) { codes16<false>(block, out); }
inline void mins16(const uint8_t* block, int8_t* out) { codes16<true>(block, out); }
inline uint16_t d_bits(const uint8_t* block) { return u16_at(block + 80); }
inline uint16_t dmin_bits(const uint8_t* block) { return u16_at(block + 82); }

}  // namespace q2k

struct Q2kBlocks : KBlocks<q2k::kBlockBytes, q2k::codes128, q2k::scales16, q2k::d_bits> {
  static constexpr bool kMins = true;
  static void mins16(const uint8_t* block, int8_t* out) { q2k::mins16(block, out); }
  static uint16_t dmin_bits(const uint8_t* block) { return q2k::dmin_bits(block); }
};

// The one-level kinds of 32-value blocks with an f16 d (q8 g32's form) as template arguments of the kernels
// (FiveBitBlocks, Iq4nlBlocks): kBlockBytes; codes32v (AVX2: in a register) and codes32 (into memory), the codes;
// d_bits, d; kMins: whether each weight is minus z = -m, m_bits giving m (Q5_1).
//
// Q5_0 / Q5_1: Bytes-byte blocks of 32 values with a 5-bit code each, d (f16) first, qh (32 fifth bits,
// little-endian) at byte Qh, qs[16] at byte Qs: value j < 16 is the low nibble of qs[j] with bit j of qh above it,
// value j + 16 the high nibble with bit j + 16; the codes are q - Bias.
template <int64_t Bytes, int Qh, int Qs, int Bias>
struct FiveBitBlocks {
  static constexpr int64_t kBlockBytes = Bytes;
  static constexpr bool kMins = false;
  static constexpr bool kUnsigned = false;  // ucodes64: the codes plus 32, unsigned, 64 values a step (q6k)
#if defined(__AVX2__)
  // The 32 codes of a block as bytes in a register (AVX2: what the avx2 and avx512 tiers use).
  static __m256i codes32v(const uint8_t* block) {
    uint32_t qh;
    std::memcpy(&qh, block + Qh, 4);
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + Qs));
    const __m128i m4 = _mm_set1_epi8(15);
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4));
    // byte i of rep: byte i / 8 of qh; its bit i % 8 is value i's fifth bit
    const __m256i rep = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)),
                                            _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                               0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
    const __m256i sixteen = _mm256_set1_epi8(16);
    const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(rep, bit), bit), sixteen);
    return _mm256_sub_epi8(_mm256_or_si256(q, high), _mm256_set1_epi8(Bias));
  }
  // The 32 codes of a block into out[32].
  static void codes32(const uint8_t* block, int8_t* out) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), codes32v(block));
  }
#else
  static void codes32(const uint8_t* block, int8_t* out) {
    uint32_t qh;
    std::memcpy(&qh, block + Qh, 4);
    for (int j = 0; j < 16; ++j) {
      const uint8_t b = block[Qs + j];
      out[j] = static_cast<int8_t>(((b & 15) | (((qh >> j) & 1) << 4)) - Bias);
      out[j + 16] = static_cast<int8_t>(((b >> 4) | (((qh >> (j + 16)) & 1) << 4)) - Bias);
    }
  }
#endif
  static uint16_t d_bits(const uint8_t* block) { return u16_at(block); }
};

// q5_0: 22 bytes, d, qh, qs; codes q - 16 (see the top of the file).
using Q50Blocks = FiveBitBlocks<22, 2, 6, 16>;

// q5_1: Q5_1, 24 bytes for 32 values: d (f16), m (f16), qh, qs[16]; codes q in [0, 31] and w = d * q + m: d * q is
// exact in f32 (11 + 5 bits), one rounding in the addition (gguf's dequantize steps). q8 g32's form with an offset
// per block (kMins): the kernels subtract z = -m (exact), w = d * q - z, the same bits as q5k's offset path.
struct Q51Blocks : FiveBitBlocks<24, 4, 8, 0> {
  static constexpr bool kMins = true;
  static uint16_t m_bits(const uint8_t* block) { return u16_at(block + 2); }
};

// iq4_nl: IQ4_NL, 18 bytes for 32 values: d (f16), qs[16]; w = d * kValues[q]: q8's form with group 32.
struct Iq4nlBlocks {
  static constexpr int64_t kBlockBytes = 18;
  static constexpr bool kMins = false;
#if defined(__AVX2__)
  static __m256i codes32v(const uint8_t* block) { return iq4::values32v(block + 2); }
#endif
  static void codes32(const uint8_t* block, int8_t* out) { iq4::values32(block + 2, out); }
  static uint16_t d_bits(const uint8_t* block) { return u16_at(block); }
};
