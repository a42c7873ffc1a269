// The LOSSY int8 ops' weights (q4_linear_i8, q8_linear_i8, q4_1 / q4_0 / q4k / q8k_linear_i8): each op's argument
// checks and the description its kernels read, the same in every tier's int8 source (int8.cpp, generic/int8.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

#include "../args.h"
#include "int8_decode.h"
#include "linear_steps.h"

namespace {

struct Weight {
  const uint8_t* qw;  // q4 tiles [Np, K/2] or q8 codes [N, K]
  const void* sc;     // q4 (scale, zero) [G, Np, 2]; q8 scales [N] or [N, G]
  at::ScalarType st;
  int64_t cols, k, g;  // cols: output columns (q4: Np); g: the x group (q8 per channel: 64)
  // GGUF K-quants: q8k: sc holds the stored int8 scale codes [N, K/16] and sup their f16 super-scales [N, K/256];
  // q4k: sup is set, and q4k says where its codes and supers lie (args.h: check_q4k_layout). Both decoded
  // where the kernels read a group's scales: q4k s = d * sc, z = 8 * s - dmin * m; q8k s = d * sc (each step one f32
  // rounding), the bits of the q4 / q8 (group 16) ops given those scales in f32. Null: sc holds the scales.
  const uint16_t* sup = nullptr;
  Q4kScales q4k{};  // q4k: its (sc, m) codes and (d, dmin) supers
  Q4Pairs pairs = Q4Pairs::kStored;  // q4 without sup: what sc holds (args.h; Q4_1's (d, m), Q4_0's d)
};

// Grouped q8 and q8k: the f32 scales of the `width` (<= 64) columns at n0 per group, prm[gi * ld + j], zero past the
// last of cols columns. Stored scales are converted 8 at a time as stored; q8k's are d * sc (its f16 super-scale
// times the int8 code, one f32 product each). Every int8 source's grouped table (the quads, dot and decode forms of
// both int8 tiers) is this one. Made 16 groups at a time: a block's [64][16] values stay in L1 and the table is
// written a row after the other (a table of many groups, K = 8960 at group 16, is larger than L2).
inline void q8_scale_table(const Weight& w, int64_t n0, int64_t cols, int64_t groups, float* prm, int64_t width = 64,
                           int64_t ld = 64) {
  constexpr int64_t kBlock = 16;
  float buf[64 * kBlock];
  const int64_t live = std::min(cols, width);
  for (int64_t g0 = 0; g0 < groups; g0 += kBlock) {
    const int64_t gn = std::min(kBlock, groups - g0);
    for (int64_t j = 0; j < live; ++j) {
      float* b = buf + j * kBlock;
      if (!w.sup) {
        to_f32(w.sc, w.st, (n0 + j) * groups + g0, gn, b);
        continue;
      }
      // q8k: int8 codes [N, G] (groups of 16; G a multiple of 16), f16 [N, G / 16]
      const int8_t* c = static_cast<const int8_t*>(w.sc) + (n0 + j) * groups + g0;
      const simd::f8 d = simd::set1(simd::f16_to_f32(w.sup[(n0 + j) * (groups / 16) + g0 / 16]));
      simd::store(b, d * simd::to_f(simd::s8x8(c)));
      simd::store(b + 8, d * simd::to_f(simd::s8x8(c + 8)));
    }
    for (int64_t gi = 0; gi < gn; ++gi)
      for (int64_t j = 0; j < width; ++j) prm[(g0 + gi) * ld + j] = j < live ? buf[j * kBlock + gi] : 0.f;
  }
}

inline Weight q4_weight(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales_zeros, int64_t g) {
  const int64_t np = qweight.size(0), k = qweight.size(1) * 2;
  check_x(x, k, "q4_linear_i8");
  TORCH_CHECK(qweight.is_contiguous() && scales_zeros.is_contiguous() && scales_zeros.size(1) == np &&
              np % 16 == 0 && g % 16 == 0 && 256 % g == 0 && k % g == 0,
              "q4_linear_i8: shapes do not match the stored layout");
  return Weight{qweight.data_ptr<uint8_t>(), scales_zeros.data_ptr(), scales_zeros.scalar_type(), np, k, g};
}

// group_size 0: one scale per channel (x groups of 64).
inline Weight q8_weight(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t group_size) {
  const int64_t n = qweight.size(0), k = qweight.size(1);
  check_x(x, k, "q8_linear_i8");
  const int64_t xg = group_size ? group_size : 64;
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() && xg % 16 == 0 && 256 % xg == 0 && k % xg == 0,
              "q8_linear_i8: group size must divide 256 and K");
  return Weight{reinterpret_cast<const uint8_t*>(qweight.data_ptr<int8_t>()), scales.data_ptr(), scales.scalar_type(),
                n, k, xg};
}

// GGUF Q4_1 / Q4_0 as stored (colibri.quant.kinds q4_1, q4_0: the q4 tiles with f16 (d, m) / d per group of 32):
// q4_linear_i8 with group 32 and the f32 pairs (d, m + 8 d) / (d, 0), made per tile.
inline Weight q4_1_weight(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales_mins) {
  const int64_t np = qweight.size(0), k = qweight.size(1) * 2;
  check_x(x, k, "q4_1_linear_i8");
  check_q4(x, qweight, scales_mins, 32, "q4_1_linear_i8");
  TORCH_CHECK(scales_mins.scalar_type() == at::kHalf, "q4_1_linear_i8: f16 (d, m)");
  Weight w{qweight.data_ptr<uint8_t>(), scales_mins.data_ptr(), at::kHalf, np, k, 32};
  w.pairs = Q4Pairs::kQ41;
  return w;
}

inline Weight q4_0_weight(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  const int64_t np = qweight.size(0), k = qweight.size(1) * 2;
  check_x(x, k, "q4_0_linear_i8");
  check_q4_0(x, qweight, scales, "q4_0_linear_i8");
  Weight w{qweight.data_ptr<uint8_t>(), scales.data_ptr(), at::kHalf, np, k, 32};
  w.pairs = Q4Pairs::kQ40;
  return w;
}

// GGUF Q4_K as stored (colibri.quant.kinds q4k): the q4 tile codes (group 32), the (sc, m) codes and (d, dmin)
// supers (args.h: check_q4k_layout).
inline Weight q4k_weight(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                         const at::Tensor& supers) {
  const int64_t np = qweight.size(0), k = qweight.size(1) * 2;
  check_x(x, k, "q4k_linear_i8");
  const Q4kScales sc = check_q4k_layout(qweight, scales, supers, k, "q4k_linear_i8");
  return Weight{qweight.data_ptr<uint8_t>(), sc.sc, at::kByte, np, k, 32, sc.sup, sc};
}

// GGUF Q6_K as stored (colibri.quant.kinds q8k): int8 codes [N, K], int8 scale codes [N, K/16], f16 d [N, K/256].
inline Weight q8k_weight(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                         const at::Tensor& supers) {
  const int64_t n = qweight.size(0), k = qweight.size(1);
  check_x(x, k, "q8k_linear_i8");
  TORCH_CHECK(qweight.is_contiguous() && qweight.scalar_type() == at::kChar && k % 256 == 0,
              "q8k_linear_i8: qweight must be contiguous int8 [N, K], K a multiple of 256");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kChar && scales.dim() == 2 &&
              scales.size(0) == n && scales.size(1) == k / 16,
              "q8k_linear_i8: scales must be contiguous int8 [N, K/16]");
  TORCH_CHECK(supers.is_contiguous() && supers.scalar_type() == at::kHalf && supers.dim() == 2 &&
              supers.size(0) == n && supers.size(1) == k / 256,
              "q8k_linear_i8: supers must be contiguous f16 [N, K/256]");
  return Weight{reinterpret_cast<const uint8_t*>(qweight.data_ptr<int8_t>()), scales.data_ptr(), at::kChar, n, k, 16,
                reinterpret_cast<const uint16_t*>(supers.data_ptr())};
}

}  // namespace
