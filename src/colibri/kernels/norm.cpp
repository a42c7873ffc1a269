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
#include <cstring>

#include "generic/simd.h"
#include "library.h"

namespace {

// Elements as f32 and back through simd.h's bf16 conversions (torch's rounding), plain integer and f32 operations
// the compiler vectorizes at every tier's width (c10's BFloat16 conversions went element by element;
// docs/performance.md, "The layer's other work"). The element types as stored: f32, or bf16 bits (at::BFloat16
// read as its uint16_t bits).
template <typename T>
struct Elem;
template <>
struct Elem<float> {
  using S = float;
  static float in(float v) { return v; }
  static float out(float v) { return v; }
};
template <>
struct Elem<at::BFloat16> {
  using S = uint16_t;
  static float in(uint16_t v) { return simd::bf16_to_f32(v); }
  static uint16_t out(float v) { return simd::f32_to_bf16(v); }
};

// v rounded to T's precision and back (f32: unchanged)
template <typename T>
inline float row_round(float v) {
  return Elem<T>::in(Elem<T>::out(v));
}

template <typename T>
float sum_squares(const typename Elem<T>::S* x, int64_t d) {
  float p[16] = {};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    for (int l = 0; l < 16; ++l) {
      const float h = Elem<T>::in(x[i + l]);
      p[l] = p[l] + h * h;
    }
  for (int l = 0; i + l < d; ++l) {
    const float h = Elem<T>::in(x[i + l]);
    p[l] = p[l] + h * h;
  }
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) p[l] = p[l] + p[l + w];
  return p[0];
}

template <typename T>
void rms_rows(const T* xt, const T* wt, T* yt, int64_t rows, int64_t d, float eps, bool gemma) {
  using S = typename Elem<T>::S;
  const S* x = reinterpret_cast<const S*>(xt);
  const S* w = reinterpret_cast<const S*>(wt);
  S* y = reinterpret_cast<S*>(yt);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, d));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const S* xr = x + r * d;
      S* yr = y + r * d;
      const float mean = sum_squares<T>(xr, d) / static_cast<float>(d);
      const float inv = 1.0f / std::sqrt(mean + eps);
      if (gemma) {
        for (int64_t i = 0; i < d; ++i)
          yr[i] = Elem<T>::out((Elem<T>::in(xr[i]) * inv) * (1.0f + Elem<T>::in(w[i])));
      } else {
        for (int64_t i = 0; i < d; ++i)
          yr[i] = Elem<T>::out(Elem<T>::in(w[i]) * row_round<T>(Elem<T>::in(xr[i]) * inv));
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
void rope_rows(const at::Tensor& x, const T* cst, const T* snt, T* yt, int64_t heads, int64_t t, int64_t d) {
  using S = typename Elem<T>::S;
  const int64_t half = d / 2, sh = x.stride(0), st = x.stride(1), sd = x.stride(2);
  const S* xp = reinterpret_cast<const S*>(x.data_ptr<T>());
  const S* cs = reinterpret_cast<const S*>(cst);
  const S* sn = reinterpret_cast<const S*>(snt);
  S* y = reinterpret_cast<S*>(yt);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, d));
  // y_i = round(x_i c_i) + round(r_i s_i), r = (-x[half:], x[:half]): two loops without a branch per element
  auto part = [](const S* xr, int64_t sd, const S* xo, const S* c, const S* s, S* yr, int64_t n, float sign) {
    for (int64_t i = 0; i < n; ++i) {
      const float v = Elem<T>::in(xr[i * sd]), rot = sign * Elem<T>::in(xo[i * sd]);
      yr[i] = Elem<T>::out(row_round<T>(v * Elem<T>::in(c[i])) + row_round<T>(rot * Elem<T>::in(s[i])));
    }
  };
  at::parallel_for(0, heads * t, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t h = r / t, p = r % t;
      const S* xr = xp + h * sh + p * st;
      const S* c = cs + p * d;
      const S* s = sn + p * d;
      S* yr = y + r * d;
      if (sd == 1) {  // the contiguous rows of a pass (unit stride: the loops vectorize)
        part(xr, 1, xr + half, c, s, yr, half, -1.0f);
        part(xr + half, 1, xr, c + half, s + half, yr + half, half, 1.0f);
      } else {
        part(xr, sd, xr + half * sd, c, s, yr, half, -1.0f);
        part(xr + half * sd, sd, xr, c + half, s + half, yr + half, half, 1.0f);
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
