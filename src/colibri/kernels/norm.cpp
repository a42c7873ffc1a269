// Row ops of every layer that are too small to pay torch's per-op cost at decode (T = 1: a norm was ~10 ATen
// calls, RoPE ~7): RMSNorm and the rotate-half RoPE, one call each, with colibri.models.base's rounding steps:
//
// rms_norm: h = f32(x); r = 1 / sqrt(sum(h * h) / D + eps); llama: y = w * dtype(h * r) (the product in f32,
//   rounded once to x's dtype); gemma: y = dtype((h * r) * (1 + f32(w))). The sum of squares runs in a fixed order
//   (16 lane partials over the row, its tail zero-padded, then a halving tree), so every tier and CPU gives the
//   same bits; torch's mean orders its sum by the CPU's vector width, so these may differ from the torch fallback's
//   in the last bit of the sum. 1 / sqrt is ATen's vectorized rsqrt (a correctly rounded sqrt, then a division).
// rope: y = x * cos + rotate_half(x) * sin, each product and the sum rounded to x's dtype as torch's three
//   elementwise ops round them (bf16: computed in f32, rounded to nearest even), so the same bits as the Python
//   form on every CPU.
// Compiled with -ffp-contract=off (every tier): no product is fused into an add.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "library.h"

namespace {

template <typename T>
inline float row_f32(T v) {
  return static_cast<float>(v);
}

// x rounded to T's precision and back (f32: unchanged)
template <typename T>
inline float row_round(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <typename T>
float sum_squares(const T* x, int64_t d) {
  float p[16] = {};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    for (int l = 0; l < 16; ++l) {
      const float h = row_f32(x[i + l]);
      p[l] = p[l] + h * h;
    }
  for (int l = 0; i + l < d; ++l) {
    const float h = row_f32(x[i + l]);
    p[l] = p[l] + h * h;
  }
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) p[l] = p[l] + p[l + w];
  return p[0];
}

template <typename T>
void rms_rows(const T* x, const T* w, T* y, int64_t rows, int64_t d, float eps, bool gemma) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, d));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * d;
      T* yr = y + r * d;
      const float mean = sum_squares(xr, d) / static_cast<float>(d);
      const float inv = 1.0f / std::sqrt(mean + eps);
      for (int64_t i = 0; i < d; ++i) {
        const float h = row_f32(xr[i]) * inv;
        if (gemma) {
          yr[i] = static_cast<T>(h * (1.0f + row_f32(w[i])));
        } else {
          yr[i] = static_cast<T>(row_f32(w[i]) * row_round<T>(h));
        }
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool gemma) {
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1), "rms_norm: w must be [D] for x [..., D]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "rms_norm: x and w must both be float32 or both bfloat16");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t d = x.size(-1), rows = d ? xc.numel() / d : 0;
  const float e = static_cast<float>(eps);  // torch adds a Python float to an f32 tensor as an f32
  if (x.scalar_type() == at::kFloat)
    rms_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), rows, d, e, gemma);
  else
    rms_rows(xc.data_ptr<at::BFloat16>(), wc.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), rows, d, e,
             gemma);
  return y;
}

template <typename T>
void rope_rows(const at::Tensor& x, const T* cs, const T* sn, T* y, int64_t heads, int64_t t, int64_t d) {
  const int64_t half = d / 2, sh = x.stride(0), st = x.stride(1), sd = x.stride(2);
  const T* xp = x.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, d));
  at::parallel_for(0, heads * t, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t h = r / t, p = r % t;
      const T* xr = xp + h * sh + p * st;
      const T* c = cs + p * d;
      const T* s = sn + p * d;
      T* yr = y + r * d;
      for (int64_t i = 0; i < d; ++i) {
        const float v = row_f32(xr[i * sd]);
        const float rot = i < half ? -row_f32(xr[(i + half) * sd]) : row_f32(xr[(i - half) * sd]);
        yr[i] = static_cast<T>(row_round<T>(v * row_f32(c[i])) + row_round<T>(rot * row_f32(s[i])));
      }
    }
  });
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(0) == x.size(1) &&
                  cos.size(1) == x.size(2) && x.size(2) % 2 == 0,
              "rope: x must be [H, T, Dh], cos and sin [T, Dh], Dh even");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "rope: x, cos and sin must all be float32 or all bfloat16");
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t heads = x.size(0), t = x.size(1), d = x.size(2);
  if (x.scalar_type() == at::kFloat)
    rope_rows(x, cc.data_ptr<float>(), sc.data_ptr<float>(), y.data_ptr<float>(), heads, t, d);
  else
    rope_rows(x, cc.data_ptr<at::BFloat16>(), sc.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), heads, t,
              d);
  return y;
}

}  // namespace
