// Linear kernels for GGUF K-quants imported exactly (colibri/quant/kinds.py, "GGUF K-quants"): y = x @ W.T,
// batch-invariant as the kernels of linear.cpp (one f32 accumulation per output element in an order fixed by K alone).
//
// q4k (Q4_K): the q4 code tiles, group 32; per group and row the 6-bit (sc, m) codes (args.h: packed 12 bits a
// row, or a byte each in containers made before), per 256 values and row f16 (d, dmin):
//   w = (d * sc) * q - dmin * m, q in [0, 15]. The group parameters are decoded per tile on the fly:
//   bf16 x: x . (q - 8) over the exact codes, then s * A + (8 s - dmin m) * sum(x) with s = d * sc (f32);
//   f32 x: the exact weights q * s + (-dmin m) (s * q is exact in f32, one rounding as gguf's dequantize).
// q8k (Q6_K): int8 codes q - 32 [N, K], int8 scales per 16 [N, K/16], f16 d per 256 [N, K/256]:
//   w = (d * sc) * q, exact in f32 (11 + 7 + 5 significant bits; bf16 x: rounded once to bf16, RNE), then the
//   dot form. Up to kRows x rows (one register block: each weight is used by one pass) dequantize in registers
//   as dot_bf16 / dot_f32 load them; more rows dequantize a block of weight rows into a buffer that every row
//   block reads. Both give the same weight values to the same instruction sequence: rows are bit-identical.
// q6k (Q6_K as stored, 210-byte blocks [N, K/256 * 210]) and q3k (Q3_K, 110-byte blocks): q8k's values and steps,
//   codes and scales decoded from the blocks (generic/gguf_blocks.h) where q8k loads them, so y equals q8k_linear's
//   bit for bit on the same codes and scales.
// q5k (Q5_K as stored, 176-byte blocks [N, K/256 * 176]): the same with codes q in [0, 31] and each weight
//   (d * sc) * q - dmin * m, the f32 value gguf's dequantize gives (bf16 x: rounded once to bf16); q2k (Q2_K,
//   84-byte blocks) likewise with codes in [0, 3] and its (sc, m) per 16 values.

#include "tiles.h"
#include "generic/gguf_blocks.h"

namespace {

// Rows [n0, n0 + cols) of a q8k weight as f32 (exact) or bf16 (RNE) rows of K.
void q8k_dequant_rows(const int8_t* qw, const int8_t* sc, const uint16_t* sup, int64_t k, int64_t n0, int64_t cols,
                      bool bf, void* out) {
  const int64_t esz = bf ? 2 : 4;
  std::vector<float> s(k / 16);  // the row's d * sc
  for (int64_t j = 0; j < cols; ++j) {
    const int64_t r = n0 + j;
    void* dst = static_cast<char*>(out) + j * k * esz;
    q8k_row_scales(sc + r * (k / 16), sup + r * (k / 256), k / 256, s.data());
    for (int64_t i = 0; i < k / 16; ++i) q8_store16(qw + r * k, _mm512_set1_ps(s[i]), 0xffff, bf, dst, i * 16);
  }
}

// Weight rows [n0, n0 + cols) of a q8k weight dequantized in registers (the dot form's source): the values of
// q8k_dequant_rows, from the codes and the per-16 scales d * sc of `s` ([cols][K/16] f32). K % 256 == 0, so
// the dot form's steps (32 / 16 columns) never need a mask and never cross a 16-column scale group unaligned.
struct Q8kRows {
  static constexpr bool kStream = true;
  const int8_t* q;  // codes of row n0
  const float* s;
  int64_t k;
  __m512bh bf16(int64_t j, int64_t k0, __mmask32) const {
    const float* sj = s + j * (k / 16) + k0 / 16;
    return scaled_bf16(q + j * k + k0, sj[0], sj[1]);
  }
  const void* at(int64_t j, int64_t k0) const { return q + j * k + k0; }
  __m512 f32(int64_t j, int64_t k0, __mmask16) const {
    return scaled_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * k + k0)), s[j * (k / 16) + k0 / 16]);
  }
};

at::Tensor q8k_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const at::Tensor& supers) {
  check_q8k(x, qweight, scales, supers);
  const int64_t t = x.size(0), k = x.size(1), n = qweight.size(0);
  const int8_t* qw = qweight.data_ptr<int8_t>();
  const int8_t* sc = scales.data_ptr<int8_t>();
  const uint16_t* sup = reinterpret_cast<const uint16_t*>(supers.data_ptr<at::Half>());
  if (t > kRows)
    return buffered_linear(x, n, [&](int64_t n0, int64_t cols, bool bf, void* buf) {
      q8k_dequant_rows(qw, sc, sup, k, n0, cols, bf, buf);
    });
  return decode_rows(x, n, k / 16,
                     [&](int64_t r, float* s) { q8k_row_scales(sc + r * (k / 16), sup + r * (k / 256), k / 256, s); },
                     [&](int64_t n0, const float* s) { return Q8kRows{qw + n0 * k, s, k}; });
}

// Rows [n0, n0 + cols) of a q6k / q3k / iq4_xs / q5k / q2k weight (B: the block kind) as f32 (exact) or bf16 (RNE)
// rows of K: q8k_dequant_rows's values for the same codes and scales (q5k, q2k: minus dmin * m per 16).
template <class B>
void blocks_dequant_rows(const uint8_t* blocks, int64_t k, int64_t n0, int64_t cols, bool bf, void* out) {
  const int64_t esz = bf ? 2 : 4, nb = k / 256;
  alignas(64) int8_t q[256];
  std::vector<float> s(k / 16 * (B::kMins ? 2 : 1));  // the row's d * sc, then dmin * m
  for (int64_t j = 0; j < cols; ++j) {
    void* dst = static_cast<char*>(out) + j * k * esz;
    const uint8_t* row = blocks + (n0 + j) * nb * B::kBlockBytes;
    block_row_scales<B>(row, nb, s.data());
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * B::kBlockBytes;
      B::codes128(blk, 0, q);
      B::codes128(blk, 1, q + 128);
      void* dst_b = static_cast<char*>(dst) + b * 256 * esz;
      const float* sb = s.data() + 16 * b;
      // 32 codes a load, the width codes128 stored them at (a 16-byte load from half a 32-byte store waited for
      // the store to retire instead of taking its value forwarded: the T = 16 pass 1.13-1.16x q8k's time)
      for (int64_t i = 0; i < 16; i += 2) {
        const __m256i c = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + 16 * i));
        __m512 lo, hi;
        if constexpr (B::kMins) {
          lo = scaled_min_f32(_mm256_castsi256_si128(c), sb[i], sb[k / 16 + i]);
          hi = scaled_min_f32(_mm256_extracti128_si256(c, 1), sb[i + 1], sb[k / 16 + i + 1]);
        } else {
          lo = scaled_f32(_mm256_castsi256_si128(c), sb[i]);
          hi = scaled_f32(_mm256_extracti128_si256(c, 1), sb[i + 1]);
        }
        if (bf) {
          _mm512_storeu_si512(static_cast<uint16_t*>(dst_b) + 16 * i,
                              reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
        } else {
          _mm512_storeu_ps(static_cast<float*>(dst_b) + 16 * i, lo);
          _mm512_storeu_ps(static_cast<float*>(dst_b) + 16 * i + 16, hi);
        }
      }
    }
  }
}

// Weight rows of a q6k / q3k / iq4_xs / q5k / q2k weight dequantized in registers: Q8kRows over codes decoded a half
// block (128 values) at a time into a small buffer per row of the register block (the dot form walks a block's rows
// side by side, k ascending, from a multiple of 128: kDotChunk is one). s: per row (stride ls) d * sc per 16 values
// [K/16], then for q5k and q2k dmin * m per 16 [K/16].
template <class B>
struct BlockRows {
  static constexpr bool kStream = true;
  const uint8_t* blocks;  // row n0's first block
  const float* s;
  int64_t k, ls;
  mutable int8_t cache[kDotCols][128];
  // (k0 >= 0 and a multiple of 32: shifts and masks instead of signed divisions, whose sign fix-ups and the
  // multiplies by K / 256 were most of a decode step's scalar work)
  const uint8_t* block(int64_t j, int64_t k0) const { return blocks + (j * (k >> 8) + (k0 >> 8)) * B::kBlockBytes; }
  const int8_t* codes(int64_t j, int64_t k0) const {
    int8_t* c = cache[j & (kDotCols - 1)];  // j >= 0; kDotCols a power of two
    if ((k0 & 127) == 0) B::codes128(block(j, k0), (k0 >> 7) & 1, c);
    return c + (k0 & 127);
  }
  __m512bh bf16(int64_t j, int64_t k0, __mmask32) const {
    const int8_t* c = codes(j, k0);
    const float* sj = s + j * ls + (k0 >> 4);
    if constexpr (B::kMins)
      return scaled_min_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)), sj[0], sj[1], sj[k / 16],
                             sj[k / 16 + 1]);
    return scaled_bf16(c, sj[0], sj[1]);
  }
  // where the next rows' bytes are fetched from: 8 steps of 32 values spread over the block's bytes
  const void* at(int64_t j, int64_t k0) const { return block(j, k0) + (k0 & 255) * B::kBlockBytes / 256; }
  __m512 f32(int64_t j, int64_t k0, __mmask16) const {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes(j, k0)));
    const float* sj = s + j * ls + (k0 >> 4);
    if constexpr (B::kMins) return scaled_min_f32(q, sj[0], sj[k / 16]);
    return scaled_f32(q, sj[0]);
  }
};

template <class B>
at::Tensor blocks_linear(const at::Tensor& x, const at::Tensor& blocks, const char* op) {
  check_blocks(x, blocks, op, 256, B::kBlockBytes);
  const int64_t t = x.size(0), k = x.size(1), n = blocks.size(0), nb = k / 256;
  const uint8_t* bw = blocks.data_ptr<uint8_t>();
  if (t > kRows)
    return buffered_linear(x, n, [&](int64_t n0, int64_t cols, bool bf, void* buf) {
      blocks_dequant_rows<B>(bw, k, n0, cols, bf, buf);
    });
  auto block = [&](int64_t r, int64_t g) { return bw + (r * nb + g) * B::kBlockBytes; };
  const int64_t ls = k / 16 * (B::kMins ? 2 : 1);
  return decode_rows(x, n, ls, [&](int64_t r, float* s) { block_row_scales<B>(block(r, 0), nb, s); },
                     [&](int64_t n0, const float* s) { return BlockRows<B>{block(n0, 0), s, k, ls}; });
}

at::Tensor q6k_linear(const at::Tensor& x, const at::Tensor& blocks) {
  return blocks_linear<Q6kBlocks>(x, blocks, "q6k_linear");
}
at::Tensor q3k_linear(const at::Tensor& x, const at::Tensor& blocks) {
  return blocks_linear<Q3kBlocks>(x, blocks, "q3k_linear");
}
at::Tensor iq4_xs_linear(const at::Tensor& x, const at::Tensor& blocks) {
  return blocks_linear<Iq4xsBlocks>(x, blocks, "iq4_xs_linear");
}
at::Tensor q5k_linear(const at::Tensor& x, const at::Tensor& blocks) {
  return blocks_linear<Q5kBlocks>(x, blocks, "q5k_linear");
}
at::Tensor q2k_linear(const at::Tensor& x, const at::Tensor& blocks) {
  return blocks_linear<Q2kBlocks>(x, blocks, "q2k_linear");
}

}  // namespace
