// Batch-invariant attention for AVX-512: each (head, query) reduces over exactly its visible keys [lo, p], in
// key order, so its result depends neither on the other queries in the pass nor on keys after p (a query
// computed in a decode step equals the same query inside a prefill chunk).
//
// Per query: s_j = (q . k_j) * scale (16-lane partials over Dh, fixed reduction), soft-capped; m = max s_j;
// e_j = exp(s_j - m); l = sum e_j in key order; out = (sum_j e_j v_j in key order) / l. Exact two-pass
// softmax in f32; inputs f32 or bf16 (widened exactly), output f32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// exp for x <= 0 (scores minus their max): range reduction by ln 2 and a degree-6 polynomial, ~1 ulp.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.9f));  // exp underflows to 0 below this (scalef saturates)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.3888889e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3333333e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1666667e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666667e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16 (masked) elements of a row of f32 or bf16 -> f32
inline __m512 load_row(const void* base, bool bf, int64_t i, __mmask16 m) {
  if (!bf) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(base) + i);
  __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(base) + i);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1); }

struct View {  // a [heads, rows, Dh] tensor with a contiguous last dimension
  const char* p;
  int64_t s0, s1;  // strides in bytes
  const void* row(int64_t h, int64_t i) const { return p + h * s0 + i * s1; }
};

View view_of(const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1, "attend: q, k, v must be [heads, rows, Dh] with contiguous rows");
  const int64_t e = t.element_size();
  return View{static_cast<const char*>(t.data_ptr()), t.stride(0) * e, t.stride(1) * e};
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                  int64_t window, double scale, double softcap) {
  const int64_t H = q.size(0), T = q.size(1), D = q.size(2), Hkv = k.size(0), S = k.size(1);
  TORCH_CHECK(H % Hkv == 0 && k.size(2) == D && v.size(0) == Hkv && v.size(1) == S && v.size(2) == D);
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T && positions.scalar_type() == at::kLong);
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16, "attend: f32 or bf16 only");
  TORCH_CHECK(D <= 1024, "attend: head dim above 1024");
  const View qv = view_of(q), kv = view_of(k), vv = view_of(v);
  const bool qb = q.scalar_type() == at::kBFloat16, kb = k.scalar_type() == at::kBFloat16,
             vb = v.scalar_type() == at::kBFloat16;
  const int64_t G = H / Hkv, chunks = (D + 15) / 16;
  const at::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  at::Tensor out = at::empty({H, T, D}, q.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  at::parallel_for(0, H * T, 1, [&](int64_t b, int64_t e) {
    std::vector<float> scores;
    __m512 qr[64], acc[64];
    for (int64_t task = b; task < e; ++task) {
      const int64_t h = task / T, t = task % T, hk = h / G, p = pp[t];
      const int64_t hi = std::min(p, S - 1), lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
      float* o = op + (h * T + t) * D;
      if (hi < lo) {
        std::fill(o, o + D, 0.f);
        continue;
      }
      const int64_t n = hi - lo + 1;
      scores.resize(n + 16);
      for (int64_t c = 0; c < chunks; ++c) qr[c] = load_row(qv.row(h, t), qb, 16 * c, tail_mask(D - 16 * c));
      float m = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        const void* kr = kv.row(hk, lo + j);
        __m512 d = _mm512_mul_ps(qr[0], load_row(kr, kb, 0, tail_mask(D)));
        for (int64_t c = 1; c < chunks; ++c) d = _mm512_fmadd_ps(qr[c], load_row(kr, kb, 16 * c, tail_mask(D - 16 * c)), d);
        float s = _mm512_reduce_add_ps(d) * sc;
        if (cap > 0) s = std::tanh(s / cap) * cap;
        scores[j] = s;
        m = std::max(m, s);
      }
      const __m512 mv = _mm512_set1_ps(m);
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 mk = tail_mask(n - j);
        _mm512_mask_storeu_ps(scores.data() + j, mk, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, scores.data() + j), mv)));
      }
      float l = 0.f;
      for (int64_t j = 0; j < n; ++j) l += scores[j];
      for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {
        const void* vr = vv.row(hk, lo + j);
        const __m512 w = _mm512_set1_ps(scores[j]);
        for (int64_t c = 0; c < chunks; ++c)
          acc[c] = _mm512_fmadd_ps(w, load_row(vr, vb, 16 * c, tail_mask(D - 16 * c)), acc[c]);
      }
      const __m512 lv = _mm512_set1_ps(l);
      for (int64_t c = 0; c < chunks; ++c) _mm512_mask_storeu_ps(o + 16 * c, tail_mask(D - 16 * c), _mm512_div_ps(acc[c], lv));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(colibri_kernels, m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor positions, int window, float scale, float softcap) -> Tensor",
        &attend);
}
