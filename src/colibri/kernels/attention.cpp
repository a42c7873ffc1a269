// Batch-invariant attention for AVX-512: each (head, query) reduces over exactly its visible keys [lo, p], in
// key order, so its result depends neither on the other queries in the pass nor on keys after p (a query
// computed in a decode step equals the same query inside a prefill chunk).
//
// Per query: s_j = (q . k_j) * scale (16-lane partials over Dh, fixed reduction), soft-capped; m = max s_j;
// e_j = exp(s_j - m); l = sum e_j in key order; out = (sum_j e_j v_j in key order) / l. Exact two-pass
// softmax in f32; inputs f32 or bf16 (widened exactly), output f32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "args.h"
#include "library.h"
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

// r[i] = sum of the 16 lanes of v[i], i < 16: a fixed shuffle-and-add tree (a key's score depends on its slot
// in its 16-key block, which is fixed by the query's own position: blocks start at its first visible key).
inline __m512 reduce16(const __m512 v[16]) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // z[4m + e] holds the sum of v[m + 4e]
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(idx, z);
}

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1); }

struct Pass {  // what every task of one attend() call shares
  View qv, kv, vv;
  bool qb, kb, vb;
  int64_t T, D, S, chunks, window;
  const int64_t* pos;
  float sc, cap, *out;
};

// The G query heads sharing KV head hk, at query t: each key and value row is loaded and widened once for all of
// them (the per-head loop loaded it G times). Per head, every score, exponent, sum and output element is the same
// arithmetic in the same order as the per-head loop of attend(), so the results are bit-identical to it.
template <int G>
void attend_group(const Pass& a, int64_t hk, int64_t t, std::vector<float>& scores, std::vector<__m512>& work) {
  const int64_t p = a.pos[t], D = a.D, chunks = a.chunks;
  const int64_t hi = std::min(p, a.S - 1), lo = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
  if (hi < lo) {
    for (int g = 0; g < G; ++g) std::fill(a.out + ((hk * G + g) * a.T + t) * D, a.out + ((hk * G + g) * a.T + t + 1) * D, 0.f);
    return;
  }
  const int64_t n = hi - lo + 1, ld = n + 16;
  scores.resize(G * ld);
  work.resize(G * chunks + chunks + G * 16);
  __m512* qr = work.data();            // [G][chunks]
  __m512* kr = qr + G * chunks;        // [chunks]: one key row, widened
  __m512* d = kr + chunks;             // [G][16]: lane partials of 16 keys
  for (int g = 0; g < G; ++g)
    for (int64_t c = 0; c < chunks; ++c)
      qr[g * chunks + c] = load_row(a.qv.row(hk * G + g, t), a.qb, 16 * c, tail_mask(D - 16 * c));
  __m512 mx[G];
  for (int g = 0; g < G; ++g) mx[g] = _mm512_set1_ps(-INFINITY);
  for (int64_t jb = 0; jb < n; jb += 16) {
    const int64_t nb = std::min<int64_t>(16, n - jb);
    for (int64_t i = 0; i < 16; ++i) {
      if (i >= nb) {
        for (int g = 0; g < G; ++g) d[g * 16 + i] = _mm512_setzero_ps();
        continue;
      }
      const void* row = a.kv.row(hk, lo + jb + i);
      for (int64_t c = 0; c < chunks; ++c) kr[c] = load_row(row, a.kb, 16 * c, tail_mask(D - 16 * c));
      for (int g = 0; g < G; ++g) {
        const __m512* qg = qr + g * chunks;
        __m512 acc = _mm512_mul_ps(qg[0], kr[0]);
        for (int64_t c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(qg[c], kr[c], acc);
        d[g * 16 + i] = acc;
      }
    }
    const __mmask16 mk = tail_mask(nb);
    for (int g = 0; g < G; ++g) {
      __m512 sv = _mm512_mul_ps(reduce16(d + g * 16), _mm512_set1_ps(a.sc));
      if (a.cap > 0) {
        alignas(64) float tmp[16];
        _mm512_store_ps(tmp, sv);
        for (int i = 0; i < 16; ++i) tmp[i] = std::tanh(tmp[i] / a.cap) * a.cap;
        sv = _mm512_load_ps(tmp);
      }
      _mm512_mask_storeu_ps(scores.data() + g * ld + jb, mk, sv);
      mx[g] = _mm512_mask_max_ps(mx[g], mk, mx[g], sv);
    }
  }
  float l[G];
  for (int g = 0; g < G; ++g) {
    float* sg = scores.data() + g * ld;
    const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx[g]));
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 mk = tail_mask(n - j);
      _mm512_mask_storeu_ps(sg + j, mk, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sg + j), mv)));
    }
    l[g] = 0.f;
    for (int64_t j = 0; j < n; ++j) l[g] += sg[j];
  }
  for (int64_t c0 = 0; c0 < chunks; c0 += 2) {  // two 16-lane chunks (one bf16 cache line) of every head at once
    __m512 a0[G], a1[G];
    for (int g = 0; g < G; ++g) a0[g] = a1[g] = _mm512_setzero_ps();
    const __mmask16 m0 = tail_mask(D - 16 * c0), m1 = c0 + 1 < chunks ? tail_mask(D - 16 * (c0 + 1)) : 0;
    for (int64_t j = 0; j < n; ++j) {
      const void* row = a.vv.row(hk, lo + j);
      const __m512 v0 = load_row(row, a.vb, 16 * c0, m0), v1 = load_row(row, a.vb, 16 * (c0 + 1), m1);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(scores[g * ld + j]);
        a0[g] = _mm512_fmadd_ps(w, v0, a0[g]);
        a1[g] = _mm512_fmadd_ps(w, v1, a1[g]);
      }
    }
    for (int g = 0; g < G; ++g) {
      float* o = a.out + ((hk * G + g) * a.T + t) * D;
      const __m512 lv = _mm512_set1_ps(l[g]);
      _mm512_mask_storeu_ps(o + 16 * c0, m0, _mm512_div_ps(a0[g], lv));
      if (m1) _mm512_mask_storeu_ps(o + 16 * (c0 + 1), m1, _mm512_div_ps(a1[g], lv));
    }
  }
}

template <int G>
void attend_groups(const Pass& a, int64_t hkv) {
  at::parallel_for(0, hkv * a.T, 1, [&](int64_t b, int64_t e) {
    std::vector<float> scores;
    std::vector<__m512> work;
    for (int64_t task = b; task < e; ++task) attend_group<G>(a, task / a.T, task % a.T, scores, work);
  });
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                  int64_t window, double scale, double softcap) {
  check_attend(q, k, v, positions);
  const int64_t H = q.size(0), T = q.size(1), D = q.size(2), Hkv = k.size(0), S = k.size(1);
  const View qv = view_of(q), kv = view_of(k), vv = view_of(v);
  const bool qb = q.scalar_type() == at::kBFloat16, kb = k.scalar_type() == at::kBFloat16,
             vb = v.scalar_type() == at::kBFloat16;
  const int64_t G = H / Hkv, chunks = (D + 15) / 16;
  const at::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  at::Tensor out = at::empty({H, T, D}, q.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  // query heads sharing a KV head go together where that leaves a few tasks per thread (same results either way)
  if (G >= 2 && G <= 8 && Hkv * T >= 4 * at::get_num_threads()) {
    const Pass a{qv, kv, vv, qb, kb, vb, T, D, S, chunks, window, pp, sc, cap, op};
    switch (G) {
      case 2: attend_groups<2>(a, Hkv); break;
      case 3: attend_groups<3>(a, Hkv); break;
      case 4: attend_groups<4>(a, Hkv); break;
      case 5: attend_groups<5>(a, Hkv); break;
      case 6: attend_groups<6>(a, Hkv); break;
      case 7: attend_groups<7>(a, Hkv); break;
      default: attend_groups<8>(a, Hkv); break;
    }
    return out;
  }
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
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int64_t jb = 0; jb < n; jb += 16) {  // 16 keys at a time
        const int64_t nb = std::min<int64_t>(16, n - jb);
        __m512 d[16];
        for (int64_t i = 0; i < 16; ++i) {
          if (i >= nb) {
            d[i] = _mm512_setzero_ps();
            continue;
          }
          const void* kr = kv.row(hk, lo + jb + i);
          d[i] = _mm512_mul_ps(qr[0], load_row(kr, kb, 0, tail_mask(D)));
          for (int64_t c = 1; c < chunks; ++c)
            d[i] = _mm512_fmadd_ps(qr[c], load_row(kr, kb, 16 * c, tail_mask(D - 16 * c)), d[i]);
        }
        __m512 sv = _mm512_mul_ps(reduce16(d), _mm512_set1_ps(sc));
        if (cap > 0) {
          alignas(64) float tmp[16];
          _mm512_store_ps(tmp, sv);
          for (int i = 0; i < 16; ++i) tmp[i] = std::tanh(tmp[i] / cap) * cap;
          sv = _mm512_load_ps(tmp);
        }
        const __mmask16 mk = tail_mask(nb);
        _mm512_mask_storeu_ps(scores.data() + jb, mk, sv);
        mx = _mm512_mask_max_ps(mx, mk, mx, sv);
      }
      const float m = _mm512_reduce_max_ps(mx);
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
