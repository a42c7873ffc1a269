// Batch-invariant linear kernels for AVX-512 (F, BW, VL, DQ, BF16): y = x @ W.T for dense f32 / bf16 weights
// and the stored q4 / q8 layouts (src/colibri/quant/kinds.py, docs/format.md).
//
// Invariance: every output element y[t, n] is one f32 accumulation over k in a fixed order that depends only on
// K, never on T (the rows in the pass), on which thread computes it or on the other rows. Row blocks, column
// tiles and K chunks only decide when an accumulator is loaded and stored (exact f32 round trips).
//   f32 x:  acc = fma(x[t, k], w[n, k], acc), w exact in f32 (q4: (q - 8) * scale + zero; q8: q * scale).
//   bf16 x: acc = vdpbf16ps(acc, (x[t, k], x[t, k + 1]), (w[n, k], w[n, k + 1])), w rounded once to bf16 (RNE);
//           the output is rounded once to bf16.
// Two loop forms, each used at every T for its weight kind:
//   outer (q4, whose stored tiles are k-major [K, 64 columns]): a K chunk of a 64-column tile is dequantized
//     into an L1 buffer, then register blocks of up to 6 rows x 64 columns accumulate over it.
//   dot (row-major dense weights, q8 dequantized a block of rows at a time): 16-lane partial sums along k per
//     (row, column), register blocks of up to 6 x 4, reduced at the end by the same fixed shuffle tree.
// Compiled with -ffp-contract=off so a * b + c stays two roundings where written so (the dequantization
// matches colibri.quant.kinds's dequantize()).
// The pieces of both forms (the q4 tile driver, dot_block, row stores) live in tiles.h, shared with kquant.cpp; the
// q4-tiled ops themselves (q4, q4_1, q4_0, q4k) in generic/q4_ops.h, shared with the other tiers.

#include "tiles.h"
#include "generic/gguf_blocks.h"
#include "generic/q4_ops.h"

namespace {

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w) {
  check_dense(x, w);
  const int64_t t = x.size(0), k = x.size(1), n = w.size(0);
  const bool bf = x.scalar_type() == at::kBFloat16;
  at::Tensor y = at::empty({t, n}, x.options());
  const int64_t nb = block_rows(k, w.element_size());
  parallel_items((n + nb - 1) / nb, [&](auto&& next) {
    std::vector<float> acc(t * nb);
    for (int64_t blk; (blk = next()) >= 0;) {
      const int64_t n0 = blk * nb, cols = std::min(nb, n - n0);
      if (bf) {
        auto xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
        auto wb = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()) + n0 * k;
        dot_block_stored<uint16_t>(xb, t, wb, k, cols, acc.data(), nb);
      } else {
        dot_block_stored<float>(x.data_ptr<float>(), t, w.data_ptr<float>() + n0 * k, k, cols, acc.data(), nb);
      }
      store_rows(acc.data(), nb, t, cols, y, n0);
    }
  });
  return y;
}

void q8_dequant_rows(const int8_t* qw, const void* sc, at::ScalarType st, int64_t k, int64_t g, int64_t n0,
                     int64_t cols, bool bf, void* out) {
  const int64_t groups = k / g, esz = bf ? 2 : 4;
  for (int64_t j = 0; j < cols; ++j) {
    const int8_t* row = qw + (n0 + j) * k;
    void* dst = static_cast<char*>(out) + j * k * esz;
    if (g % 16 == 0 || groups == 1) {  // a 16-wide step never straddles two groups
      for (int64_t gi = 0; gi < groups; ++gi) {
        const __m512 s = _mm512_set1_ps(load1(sc, (n0 + j) * groups + gi, st));
        for (int64_t k0 = gi * g; k0 < (gi + 1) * g; k0 += 16)
          q8_store16(row, s, k0 + 16 <= (gi + 1) * g ? 0xffff : tail_mask16((gi + 1) * g - k0), bf, dst, k0);
      }
      continue;
    }
    alignas(64) float sv[16];
    for (int64_t k0 = 0; k0 < k; k0 += 16) {
      for (int i = 0; i < 16; ++i) sv[i] = load1(sc, (n0 + j) * groups + std::min(k0 + i, k - 1) / g, st);
      q8_store16(row, _mm512_load_ps(sv), tail_mask16(k - k0), bf, dst, k0);
    }
  }
}

// Grouped q8 weight rows dequantized in registers (the decode form's source): the values of q8_dequant_rows
// (q * s in f32, bf16 x: rounded once, RNE per lane as q8_store16's _mm512_cvtneps_pbh), from the codes and the
// group scales `s` ([cols][K/g] f32). g % 16 == 0: a 16-column half never straddles two groups.
struct Q8gRows {
  static constexpr bool kStream = true;
  const int8_t* q;  // codes of row n0
  const float* s;
  int64_t k, g;
  const void* at(int64_t j, int64_t k0) const { return q + j * k + k0; }
  float scale(int64_t j, int64_t k0) const { return s[j * (k / g) + std::min(k0, k - 1) / g]; }
  __m512bh bf16(int64_t j, int64_t k0, __mmask32 m) const {
    return scaled_bf16(_mm256_maskz_loadu_epi8(m, q + j * k + k0), scale(j, k0), scale(j, k0 + 16));
  }
  __m512 f32(int64_t j, int64_t k0, __mmask16 m) const {
    return scaled_f32(_mm_maskz_loadu_epi8(m, q + j * k + k0), scale(j, k0));
  }
};

// bf16 x, one scale per channel: y = scale * (x . q) over the exact codes (straight from the int8 rows for
// passes of at most kRows rows, else widened once per block into a buffer: the same values in the same order).
// Grouped scales (and f32 x): x . (q * scale), the weights dequantized in registers for passes of at most kRows
// rows (groups a multiple of 16), else per block into a buffer (bf16 x: rounded once).
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t group_size) {
  check_q8(x, qweight, scales, group_size);
  const int64_t t = x.size(0), k = x.size(1), n = qweight.size(0);
  const int64_t g = group_size ? group_size : k;
  const bool bf = x.scalar_type() == at::kBFloat16;
  const int8_t* qw = qweight.data_ptr<int8_t>();
  const void* sc = scales.data_ptr();
  const at::ScalarType st = scales.scalar_type();
  if ((!bf || g != k) && t <= kRows && g % 16 == 0)  // decode: each weight dequantized once, in registers
    return decode_rows(x, n, k / g,
                       [&](int64_t r, float* s) { to_f32(sc, st, r * (k / g), k / g, s); },
                       [&](int64_t n0, const float* s) { return Q8gRows{qw + n0 * k, s, k, g}; });
  if (!bf || g != k)
    return buffered_linear(x, n, [&](int64_t n0, int64_t cols, bool bf16, void* buf) {
      q8_dequant_rows(qw, sc, st, k, g, n0, cols, bf16, buf);
    });
  at::Tensor y = at::empty({t, n}, x.options());
  const int64_t nb = buffered_rows(k);
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  parallel_items((n + nb - 1) / nb, [&](auto&& next) {
    std::vector<float> acc(t * nb);
    std::vector<uint16_t> wb(nb * k);
    for (int64_t blk; (blk = next()) >= 0;) {
      const int64_t n0 = blk * nb, cols = std::min(nb, n - n0);
      if (t <= kRows) {
        dot_block_stored<uint16_t, int8_t>(xb, t, qw + n0 * k, k, cols, acc.data(), nb);
      } else {
        for (int64_t j = 0; j < cols; ++j)
          for (int64_t k0 = 0; k0 < k; k0 += 32) {
            const __mmask32 m = k - k0 >= 32 ? 0xffffffffu : static_cast<__mmask32>((1ull << (k - k0)) - 1);
            _mm512_mask_storeu_epi16(wb.data() + j * k + k0, m, (__m512i)load_w32(qw + (n0 + j) * k + k0, m));
          }
        dot_block<uint16_t>(xb, t, wb.data(), k, cols, acc.data(), nb);
      }
      for (int64_t j = 0; j < cols; ++j) {
        const float s = load1(sc, n0 + j, st);
        for (int64_t r = 0; r < t; ++r) acc[r * nb + j] *= s;
      }
      store_rows(acc.data(), nb, t, cols, y, n0);
    }
  });
  return y;
}

// q5_0 (Q5_0 as stored, 22-byte blocks [N, K/32 * 22]) and iq4_nl (IQ4_NL, 18-byte blocks): q8_linear's grouped
// path (g = 32, the blocks' f16 d as scales) with the codes decoded from the blocks (generic/gguf_blocks.h) where q8
// loads them: the same bits. q5_1 (Q5_1, 24-byte blocks): the same with each weight d * q - (-m), one fused
// multiply-subtract (the product exact: gguf's d * q + m). B: the block kind.
template <class B>
struct G32Rows {
  static constexpr bool kStream = true;
  const uint8_t* blocks;  // row n0's first block
  const float* s;         // per row (stride ls): d per block [K/32], then (kMins) -m per block [K/32]
  int64_t k, ls;
  const uint8_t* block(int64_t j, int64_t k0) const { return blocks + (j * (k / 32) + k0 / 32) * B::kBlockBytes; }
  const void* at(int64_t j, int64_t k0) const { return block(j, k0); }
  __m512bh bf16(int64_t j, int64_t k0, __mmask32) const {  // k0 % 32 == 0: one block
    const float* sj = s + j * ls + k0 / 32;
    if constexpr (B::kMins) return scaled_min_bf16(B::codes32v(block(j, k0)), sj[0], sj[0], sj[k / 32], sj[k / 32]);
    return scaled_bf16(B::codes32v(block(j, k0)), sj[0], sj[0]);
  }
  __m512 f32(int64_t j, int64_t k0, __mmask16) const {
    const __m256i c = B::codes32v(block(j, k0));
    const __m128i q = k0 % 32 ? _mm256_extracti128_si256(c, 1) : _mm256_castsi256_si128(c);
    const float* sj = s + j * ls + k0 / 32;
    if constexpr (B::kMins) return scaled_min_f32(q, sj[0], sj[k / 32]);
    return scaled_f32(q, sj[0]);
  }
};

template <class B>
at::Tensor g32_linear(const at::Tensor& x, const at::Tensor& blocks, const char* op) {
  check_blocks(x, blocks, op, 32, B::kBlockBytes);
  const int64_t t = x.size(0), k = x.size(1), n = blocks.size(0), groups = k / 32;
  const uint8_t* bw = blocks.data_ptr<uint8_t>();
  auto block = [&](int64_t r, int64_t gi) { return bw + (r * groups + gi) * B::kBlockBytes; };
  if (t > kRows)
    return buffered_linear(x, n, [&](int64_t n0, int64_t cols, bool bf, void* buf) {
      alignas(32) int8_t q[32];
      for (int64_t j = 0; j < cols; ++j) {
        void* dst = static_cast<char*>(buf) + j * k * (bf ? 2 : 4);
        for (int64_t gi = 0; gi < groups; ++gi) {
          const uint8_t* bp = block(n0 + j, gi);
          B::codes32(bp, q);
          const float d = _cvtsh_ss(B::d_bits(bp));
          void* dst_g = static_cast<char*>(dst) + gi * 32 * (bf ? 2 : 4);
          for (int h = 0; h < 2; ++h) {
            if constexpr (B::kMins) q8_min_store16(q + 16 * h, d, -_cvtsh_ss(B::m_bits(bp)), bf, dst_g, 16 * h);
            else q8_store16(q, _mm512_set1_ps(d), 0xffff, bf, dst_g, 16 * h);
          }
        }
      }
    });
  const int64_t ls = groups * (B::kMins ? 2 : 1);
  return decode_rows(x, n, ls,
                     [&](int64_t r, float* s) {
                       for (int64_t gi = 0; gi < groups; ++gi) {
                         s[gi] = _cvtsh_ss(B::d_bits(block(r, gi)));
                         if constexpr (B::kMins) s[groups + gi] = -_cvtsh_ss(B::m_bits(block(r, gi)));
                       }
                     },
                     [&](int64_t n0, const float* s) { return G32Rows<B>{block(n0, 0), s, k, ls}; });
}

at::Tensor q5_0_linear(const at::Tensor& x, const at::Tensor& blocks) {
  return g32_linear<Q50Blocks>(x, blocks, "q5_0_linear");
}
at::Tensor iq4_nl_linear(const at::Tensor& x, const at::Tensor& blocks) {
  return g32_linear<Iq4nlBlocks>(x, blocks, "iq4_nl_linear");
}
at::Tensor q5_1_linear(const at::Tensor& x, const at::Tensor& blocks) {
  return g32_linear<Q51Blocks>(x, blocks, "q5_1_linear");
}

}  // namespace
