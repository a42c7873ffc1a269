// Generic-tier linear kernels (avx2, portable): y = x @ W.T for dense f32 / bf16 weights and the stored q4 / q8
// layouts, the same ops, arguments and bits as the AVX-512 tier's ../linear.cpp (its header explains the
// invariance; tiles.h here what the bit-identity rests on).

#include "tiles.h"
#include "gguf_blocks.h"
#include "q4_ops.h"

namespace {

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w) {
  check_dense(x, w);
  const int64_t k = x.size(1);
  const bool bf = x.scalar_type() == at::kBFloat16;
  const uint16_t* wb = bf ? reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()) : nullptr;
  const float* wf = bf ? nullptr : w.data_ptr<float>();
  return dot_linear(x, w.size(0), [&](int64_t n0, int64_t cols, bool, float* out) {
    if (!bf) {
      std::memcpy(out, wf + n0 * k, cols * k * 4);
      return;
    }
    widen_bf16(wb + n0 * k, cols * k, out);
  }, no_post, [&](int64_t j, int64_t k0, Pair& lo, Pair& hi, float*) {
    prefetch_ahead(wb + j * k + k0);  // the step's line a row's stream ahead (rows are consecutive)
    lo = simd::bf16_pairs(wb + j * k + k0);
    hi = simd::bf16_pairs(wb + j * k + k0 + 16);
  });
}

// Row j's scale of each 32-element step (g % 32 == 0), f32, into s [K/32]: its stored scales as they are for g = 32.
// Never inlined: called once a row, inlined into the decode form's step it cost the step's loop registers.
__attribute__((noinline)) void q8_step_scales(const void* sc, at::ScalarType st, int64_t j, int64_t k, int64_t g,
                                              float* s) {
  const int64_t groups = k / g;
  if (g == kStep) return to_f32(sc, st, j * groups, groups, s);
  for (int64_t i = 0; i < k / kStep; ++i) s[i] = load1(sc, j * groups + i * kStep / g, st);
}

// bf16 x, one scale per channel: y = scale * (x . q) over the exact codes. Grouped scales (and f32 x):
// x . (q * scale), the weights dequantized (bf16 x: rounded once).
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t group_size) {
  check_q8(x, qweight, scales, group_size);
  const int64_t t = x.size(0), k = x.size(1), n = qweight.size(0);
  const int64_t g = group_size ? group_size : k, groups = k / g;
  const bool channel = x.scalar_type() == at::kBFloat16 && g == k;
  const int8_t* qw = qweight.data_ptr<int8_t>();
  const void* sc = scales.data_ptr();
  const at::ScalarType st = scales.scalar_type();
  const bool normal = st == at::kHalf;  // f16 scale x code: zero or normal in f32, the short bf16 rounding holds
  auto fill = [&](int64_t n0, int64_t cols, bool bf, float* out) {
    for (int64_t j = 0; j < cols; ++j)
      for (int64_t gi = 0; gi < groups; ++gi)
        q8_values(qw + (n0 + j) * k + gi * g, g, channel ? 1.f : load1(sc, (n0 + j) * groups + gi, st), bf,
                  out + j * k + gi * g, normal);
  };
  auto post = [&](int64_t n0, int64_t cols, float* acc, int64_t lda) {
    if (!channel) return;
    for (int64_t j = 0; j < cols; ++j) {
      const float s = load1(sc, n0 + j, st);
      for (int64_t r = 0; r < t; ++r) acc[r * lda + j] *= s;
    }
  };
  // the decode form's source (bf16 x only: per channel means g == k), one per case so that each step carries only
  // its own work (the three in one source ran grouped q8's decode at half the rate)
  if (channel)
    return dot_linear(x, n, fill, post, [&](int64_t j, int64_t k0, Pair& lo, Pair& hi, float*) {
      const int8_t* q = qw + j * k + k0;
      if ((k0 & 63) == 0) prefetch_ahead(q);  // a line a row's stream ahead (rows are consecutive)
      lo = simd::code_pairs(q);
      hi = simd::code_pairs(q + 16);
    });
  if (g % kStep == 0) {  // a step within one group: the row's step scales set at its first step, in its scratch
    auto stepped = [&](auto normal_values) {
      constexpr bool kNormal = decltype(normal_values)::value;
      return dot_linear(x, n, fill, post, [&](int64_t j, int64_t k0, Pair& lo, Pair& hi, float* s) {
        const int8_t* q = qw + j * k + k0;
        if ((k0 & 63) == 0) prefetch_ahead(q);
        if (k0 == 0) q8_step_scales(sc, st, j, k, g, s);
        for (int h = 0; h < 2; ++h)  // the values of q8_values, in code_pairs' lanes
          (h ? hi : lo) = scaled_pairs<false, kNormal>(simd::code_pairs(q + 16 * h), s[k0 / kStep], 0.f);
      });
    };
    return normal ? stepped(std::true_type{}) : stepped(std::false_type{});
  }
  return dot_linear(x, n, fill, post, [&](int64_t j, int64_t k0, Pair& lo, Pair& hi, float*) {
    const int8_t* q = qw + j * k + k0;
    if ((k0 & 63) == 0) prefetch_ahead(q);
    alignas(32) float v[kStep];  // grouped: values as fill writes them, a run of one group's scale at a time
    for (int64_t i = 0; i < kStep;) {
      const int64_t gi = (k0 + i) / g, m = std::min<int64_t>(kStep - i, (gi + 1) * g - (k0 + i));
      q8_values(q + i, m, load1(sc, j * groups + gi, st), true, v + i, normal);
      i += m;
    }
    lo = simd::f32_pairs(v);
    hi = simd::f32_pairs(v + 16);
  });
}

// q5_0, iq4_nl, q5_1 (B: the block kind): q8_linear's grouped path (g = 32, f16 scales) over the codes decoded from
// the stored blocks (gguf_blocks.h); q5_1's weights minus z = -m per block (B::kMins: one rounding, as q5k's).
template <class B>
at::Tensor g32_linear(const at::Tensor& x, const at::Tensor& blocks, const char* op) {
  check_blocks(x, blocks, op, 32, B::kBlockBytes);
  const int64_t k = x.size(1), groups = k / 32;
  const uint8_t* bw = blocks.data_ptr<uint8_t>();
  auto block = [&](int64_t r, int64_t gi) { return bw + (r * groups + gi) * B::kBlockBytes; };
  auto offset = [](const uint8_t* bp) {  // z = -m (kMins), else unused
    if constexpr (B::kMins) return -simd::f16_to_f32(B::m_bits(bp));
    return 0.f;
  };
  return dot_linear(x, blocks.size(0), [&](int64_t n0, int64_t cols, bool bf, float* out) {
    alignas(32) int8_t q[32];
    for (int64_t j = 0; j < cols; ++j)
      for (int64_t gi = 0; gi < groups; ++gi) {
        const uint8_t* bp = block(n0 + j, gi);
        B::codes32(bp, q);
        const float d = simd::f16_to_f32(B::d_bits(bp));
        if constexpr (B::kMins) q8_min_values(q, 32, d, offset(bp), bf, out + j * k + gi * 32);
        else q8_values(q, 32, d, bf, out + j * k + gi * 32, true);
      }
  }, no_post, [&](int64_t j, int64_t k0, Pair& lo, Pair& hi, float*) {  // k0 % 32 == 0: one block
    const uint8_t* bp = block(j, k0 / 32);
    prefetch_ahead(bp);
    alignas(32) int8_t q[32];
    B::codes32(bp, q);
    const float d = simd::f16_to_f32(B::d_bits(bp)), z = offset(bp);
    for (int h = 0; h < 2; ++h) (h ? hi : lo) = scaled_pairs<B::kMins>(simd::code_pairs(q + 16 * h), d, z);
  });
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
