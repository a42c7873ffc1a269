// Generic-tier linear kernels for GGUF K-quants imported exactly (q4k, q8k, q6k, q3k, iq4_xs, q5k, q2k): the same ops,
// arguments and bits as the AVX-512 tier's ../kquant.cpp (its header gives the formulas).

#include "tiles.h"
#include "gguf_blocks.h"

namespace {

at::Tensor q8k_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const at::Tensor& supers) {
  check_q8k(x, qweight, scales, supers);
  const int64_t k = x.size(1), n = qweight.size(0);
  const int8_t* qw = qweight.data_ptr<int8_t>();
  const int8_t* sc = scales.data_ptr<int8_t>();
  const uint16_t* sup = reinterpret_cast<const uint16_t*>(supers.data_ptr<at::Half>());
  // w = q * (d * sc), d * sc in f32 per 16 columns: exact in f32; bf16 x: rounded once
  auto row_scales = [&](int64_t j, float* s) {  // row j's d * sc, [K/16]
    q8k_row_scales(sc + j * (k / 16), sup + j * (k / 256), k / 256, s);
  };
  return dot_linear(x, n, [&](int64_t n0, int64_t cols, bool bf, float* out) {
    std::vector<float> s(k / 16);
    for (int64_t j = 0; j < cols; ++j) {
      row_scales(n0 + j, s.data());
      for (int64_t i = 0; i < k / 16; ++i) q8_values(qw + (n0 + j) * k + 16 * i, 16, s[i], bf, out + j * k + 16 * i, true);
    }
  }, no_post, [&](int64_t j, int64_t k0, Pair& lo, Pair& hi, float* s) {  // k0 % 32 == 0: two scale groups of 16
    if (k0 == 0) row_scales(j, s);  // into the row's scratch at its first step
    const int8_t* q = qw + j * k + k0;
    prefetch_ahead(q);  // rows are consecutive: past the row's end this is the next one's start
    for (int h = 0; h < 2; ++h) (h ? hi : lo) = scaled_pairs<false>(simd::code_pairs(q + 16 * h), s[k0 / 16 + h], 0.f);
  });
}

// q6k, q3k, iq4_xs, q5k, q2k (B: the block kind): q8k's values and steps over the codes and scales decoded from the
// stored blocks (gguf_blocks.h), so the same bits as q8k; q5k's and q2k's weights minus dmin * m per 16 (B::kMins).
template <class B>
at::Tensor blocks_linear(const at::Tensor& x, const at::Tensor& blocks, const char* op) {
  check_blocks(x, blocks, op, 256, B::kBlockBytes);
  const int64_t k = x.size(1), n = blocks.size(0), nb = k / 256;
  const uint8_t* bw = blocks.data_ptr<uint8_t>();
  auto block = [&](int64_t j, int64_t b) { return bw + (j * nb + b) * B::kBlockBytes; };
  // per row: d * sc [K/16], then (kMins) dmin * m [K/16]
  const int64_t ls = k / 16 * (B::kMins ? 2 : 1);
  // the direct form walks one or two x rows over two weight rows side by side through the whole of K: each half
  // block fetches the same columns an even number of weight rows on (at least kStreamAhead bytes), where the
  // distance within the row's own stream left the second row of every pair cold at its start when rows are longer
  // than it; with three or four x rows it walks one weight row at a time: kStreamAhead bytes on in its own stream
  const int64_t row_bytes = nb * B::kBlockBytes;
  const int64_t ahead = x.size(0) <= 2 ? 2 * row_bytes * ((kStreamAhead + 2 * row_bytes - 1) / (2 * row_bytes))
                                       : kStreamAhead;  // bytes
  auto row_scales = [&](int64_t j, float* s) { block_row_scales<B>(block(j, 0), nb, s); };
  return dot_linear(x, n, [&](int64_t n0, int64_t cols, bool bf, float* out) {
    std::vector<float> s(ls);
    alignas(32) int8_t q[256];
    for (int64_t j = 0; j < cols; ++j) {
      row_scales(n0 + j, s.data());
      for (int64_t b = 0; b < nb; ++b) {
        B::codes128(block(n0 + j, b), 0, q);
        B::codes128(block(n0 + j, b), 1, q + 128);
        for (int64_t i = 0; i < 16; ++i) {
          float* o = out + j * k + 256 * b + 16 * i;
          if constexpr (B::kMins) q8_min_values(q + 16 * i, 16, s[16 * b + i], s[k / 16 + 16 * b + i], bf, o);
          else q8_values(q + 16 * i, 16, s[16 * b + i], bf, o, true);
        }
      }
    }
  }, no_post, [&, ahead](int64_t j, int64_t k0, Pair& lo, Pair& hi, float* s) {  // k0 % 32 == 0: two scale groups of 16
    // (`ahead` by value: read through the closure, q5k's four-row passes ran 30 % slower)
    // the row's scratch: its scales (ls floats), then the codes of two half blocks, each decoded and put in the
    // pair-split order a half block before its first use (read right after the stores that wrote them, a step's
    // 8-byte loads waited on those 32-byte stores)
    int8_t* c = reinterpret_cast<int8_t*>(s + ls);
    auto decode = [&](int64_t h0) {  // the half block from k = h0, into its buffer
      const uint8_t* bp = block(j, h0 / 256);
      // every line of the half block's share of the row (B::kBlockBytes / 2 <= 128 bytes: two), `ahead` bytes on
      const uint8_t* half = bp + ahead + h0 % 256 / 128 * (B::kBlockBytes / 2);
      __builtin_prefetch(half);
      __builtin_prefetch(half + 64);
      int8_t* o = c + (h0 / 128 % 2) * 128;
      B::codes128(bp, h0 % 256 / 128, o);
      simd::split_codes(o, 128);
    };
    if (k0 == 0) {
      row_scales(j, s);
      decode(0);
    }
    if (k0 % 128 == 0 && k0 + 128 < k) decode(k0 + 128);
    const int8_t* q = c + (k0 / 128 % 2) * 128 + k0 % 128;
    for (int h = 0; h < 2; ++h)
      (h ? hi : lo) = scaled_pairs<B::kMins>(simd::split_code_pairs(q + 16 * h), s[k0 / 16 + h],
                                             B::kMins ? s[k / 16 + k0 / 16 + h] : 0.f);
  });
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
