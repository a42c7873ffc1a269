// Batch-invariant attention for the generic tiers (avx2, portable), bit-identical to the AVX-512 tier's
// attention.cpp on every input: the same arithmetic in the same order, on 8-lane vectors (simd.h).
//
// Per query: s_j = (q . k_j) * scale, soft-capped; m = max s_j; e_j = exp(s_j - m); l = sum e_j in key order;
// out = (sum_j e_j v_j in key order) / l. What has to match the AVX-512 instructions exactly:
//   - q . k_j: 16-lane partials over Dh (lane i sums elements i, i + 16, ...: a multiply for the first chunk of
//     16, then one fma per chunk; lanes past Dh multiply zeros), kept here as two 8-lane halves, then summed by
//     attention.cpp's reduce16 shuffle tree. Per key that tree adds t[e] = v[e] + v[8 + e] (e < 8), then
//     u[e] = t[e] + t[4 + e] (e < 4), then (u[0] + u[2]) + (u[1] + u[3]): simd::reduce16's pairing (IEEE
//     addition commutes), done here for 8 keys at once by a transposing tree (reduce8).
//   - the max: _mm512_mask_max_ps into 16 slots (key j in slot j % 16), then _mm512_reduce_max_ps's tree.
//   - exp_ps: rounding to the nearest integer (ties to even), fnmadd = fma(-n, c, x), the Horner fmas, and
//     scalef(p, n) = p * 2^n rounded once (two exact-power products below 2^-126, the first of them exact).
// The rest (scale, std::tanh softcap, the key-order sum, the fmas of e_j * v_j, the division) is plain IEEE f32,
// identical on every ISA under -ffp-contract=off.
//
// The query heads sharing a KV head go through each key and value row together, up to 4 at a time (the AVX-512
// tier's grouped and per-head paths give the same results, so either task split is valid here).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "../args.h"
#include "../library.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using simd::f8;
using simd::i8;
using simd::u8;

inline f8 load8(const float* p) { return simd::load(p); }
inline f8 load8(const uint16_t* p) { return simd::bf16x8(p); }
inline f8 load8_n(const float* p, int64_t n) { return simd::load_n(p, n); }
inline f8 load8_n(const uint16_t* p, int64_t n) {
  f8 v{};
  for (int64_t i = 0; i < n && i < 8; ++i) v[i] = simd::bf16_to_f32(p[i]);
  return v;
}

// _mm512_roundscale_ps(y, nearest int), ties to even, for |y| < 2^22 (sign of zero kept).
inline f8 round_even(f8 y) {
  const f8 m = simd::set1(12582912.f);  // 1.5 * 2^23: y + m keeps no fraction bits
  const f8 t = (y + m) - m;
  return simd::as_f(simd::as_u(t) | (simd::as_u(y) & 0x80000000u));
}

// attention.cpp's exp_ps (x <= 0).
inline f8 exp8(f8 x) {
  x = simd::max(x, simd::set1(-103.9f));
  const f8 n = round_even(x * simd::set1(1.44269504088896341f)), nn = -n;  // n in [-150, 0]
  f8 r = simd::fma(nn, simd::set1(0.693359375f), x);
  r = simd::fma(nn, simd::set1(-2.12194440e-4f), r);
  f8 p = simd::set1(1.3888889e-3f);
  p = simd::fma(p, r, simd::set1(8.3333333e-3f));
  p = simd::fma(p, r, simd::set1(4.1666667e-2f));
  p = simd::fma(p, r, simd::set1(1.6666667e-1f));
  p = simd::fma(p, r, simd::set1(0.5f));
  p = simd::fma(p, r, simd::set1(1.0f));
  p = simd::fma(p, r, simd::set1(1.0f));
  // scalef(p, n): one rounding. Below 2^-126 the power is not a normal f32: p * 2^-64 (exact) * 2^(n + 64).
  i8 e = __builtin_convertvector(n, i8);
  const i8 tiny = e < -126;
  e = tiny ? e + 64 : e;
  const f8 pre = tiny ? simd::set1(0x1p-64f) : simd::set1(1.f);
  return (p * pre) * simd::as_f(reinterpret_cast<u8>(e + 127) << 23);
}

// Two-source lane shuffle (lanes 8-15 are y's): __builtin_shufflevector is clang's and GCC 12's, __builtin_shuffle
// GCC's since 4.7.
#if defined(__clang__)
#define SHUFFLE(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
#define SHUFFLE(x, y, ...) __builtin_shuffle(x, y, i8{__VA_ARGS__})
#endif

// r[i] = attention.cpp's reduce16 sum of key i's 16 lane partials, given t[i] = lanes 0-7 + lanes 8-15.
inline f8 reduce8(const f8 t[8]) {
  auto a = [](f8 x, f8 y) {  // [x0+x4 .. x3+x7, y0+y4 .. y3+y7]
    return SHUFFLE(x, y, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
  };
  auto b = [](f8 x, f8 y) {  // per 128-bit half: [x0+x2, x1+x3, y0+y2, y1+y3]
    return SHUFFLE(x, y, 0, 1, 8, 9, 4, 5, 12, 13) + SHUFFLE(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
  };
  auto c = [](f8 x, f8 y) {  // per 128-bit half: [x0+x1, x2+x3, y0+y1, y2+y3]
    return SHUFFLE(x, y, 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
  };
  // keys 0, 4 | 1, 5 | 2, 6 | 3, 7 paired so that c's lanes come out in key order
  return c(b(a(t[0], t[4]), a(t[1], t[5])), b(a(t[2], t[6]), a(t[3], t[7])));
}
#undef SHUFFLE

struct Pass {  // what every task of one attend() call shares
  View qv, kv, vv;
  bool qb, kb, vb;
  int64_t T, D, S, G, Dp, window;
  const int64_t* pos;
  float sc, cap, *out;
};

template <bool EXACT>
inline f8 madd(f8 a, f8 b, f8 c) { return EXACT ? simd::madd_exact(a, b, c) : simd::fma(a, b, c); }

// Key row k's 16-lane partials with GB query rows (q + g * Dp, zero-padded to Dp = 16 * chunks), summed to 8
// lanes: t[g] = lanes 0-7 + lanes 8-15. EXACT: q and k both bf16, so every product is exact in f32 and a
// multiply-add rounds once, as an fma does (cheaper where fma is not an instruction).
template <class KT, int GB, bool EXACT>
inline void key_dots(const KT* k, const float* q, int64_t Dp, int64_t D, f8* t) {
  f8 lo[GB], hi[GB];
  const int64_t full = D / 16;  // chunks of 16 inside D
  auto tail = [&](int64_t c, f8& a, f8& b) {  // chunk c past the full ones: masked loads, zeros past D
    const int64_t e = 16 * c;
    a = e + 8 <= D ? load8(k + e) : load8_n(k + e, D - e);
    b = e + 8 < D ? load8_n(k + e + 8, D - e - 8) : f8{};
  };
  f8 a, b;
  if (full > 0) {
    a = load8(k), b = load8(k + 8);
  } else {
    tail(0, a, b);
  }
  for (int g = 0; g < GB; ++g) lo[g] = simd::load(q + g * Dp) * a, hi[g] = simd::load(q + g * Dp + 8) * b;
  for (int64_t c = 1; c < full; ++c) {
    a = load8(k + 16 * c), b = load8(k + 16 * c + 8);
    for (int g = 0; g < GB; ++g) {
      lo[g] = madd<EXACT>(simd::load(q + g * Dp + 16 * c), a, lo[g]);
      hi[g] = madd<EXACT>(simd::load(q + g * Dp + 16 * c + 8), b, hi[g]);
    }
  }
  if (full > 0 && 16 * full < D) {
    tail(full, a, b);
    for (int g = 0; g < GB; ++g) {
      lo[g] = madd<EXACT>(simd::load(q + g * Dp + 16 * full), a, lo[g]);
      hi[g] = madd<EXACT>(simd::load(q + g * Dp + 16 * full + 8), b, hi[g]);
    }
  }
  for (int g = 0; g < GB; ++g) t[g] = lo[g] + hi[g];
}

// Scores of keys lo .. lo + n - 1 for GB heads into s + g * ld (scaled, not yet capped); 8 keys per block, the
// last block's extra lanes (below ld) hold junk.
template <class KT, int GB, bool EXACT>
void scores(const Pass& a, int64_t hk, int64_t lo, int64_t n, const float* q, float* s, int64_t ld) {
  for (int64_t jb = 0; jb < n; jb += 8) {
    f8 t[GB][8], r[GB];
    const int64_t nb = std::min<int64_t>(8, n - jb);
    for (int64_t i = 0; i < 8; ++i) {
      if (i < nb) {
        key_dots<KT, GB, EXACT>(reinterpret_cast<const KT*>(a.kv.row(hk, lo + jb + i)), q, a.Dp, a.D, r);
        for (int g = 0; g < GB; ++g) t[g][i] = r[g];
      } else {
        for (int g = 0; g < GB; ++g) t[g][i] = f8{};
      }
    }
    for (int g = 0; g < GB; ++g) simd::store(s + g * ld + jb, reduce8(t[g]) * simd::set1(a.sc));
  }
}

// out[g][col, col + 8 * NV) = (sum_j e[g][j] * v_j) / l[g], in key order.
template <class VT, int GB, int NV>
void weighted(const Pass& a, int64_t hk, int64_t lo, int64_t n, const float* e, int64_t ld, const float* l,
              float* const* out, int64_t col) {
  f8 acc[GB][NV];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = f8{};
  const char* base = a.vv.row(hk, lo);
  for (int64_t j = 0; j < n; ++j) {
    const VT* r = reinterpret_cast<const VT*>(base + j * a.vv.s1) + col;
    f8 v[NV];
    for (int c = 0; c < NV; ++c) v[c] = load8(r + 8 * c);
    for (int g = 0; g < GB; ++g) {
      const f8 w = simd::set1(e[g * ld + j]);
      for (int c = 0; c < NV; ++c) acc[g][c] = simd::fma(w, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NV; ++c) simd::store(out[g] + col + 8 * c, acc[g][c] / simd::set1(l[g]));
}

// The same for the last m (< 8) columns.
template <class VT, int GB>
void weighted_tail(const Pass& a, int64_t hk, int64_t lo, int64_t n, const float* e, int64_t ld, const float* l,
                   float* const* out, int64_t col, int64_t m) {
  f8 acc[GB];
  for (int g = 0; g < GB; ++g) acc[g] = f8{};
  const char* base = a.vv.row(hk, lo);
  for (int64_t j = 0; j < n; ++j) {
    const f8 v = load8_n(reinterpret_cast<const VT*>(base + j * a.vv.s1) + col, m);
    for (int g = 0; g < GB; ++g) acc[g] = simd::fma(simd::set1(e[g * ld + j]), v, acc[g]);
  }
  for (int g = 0; g < GB; ++g) simd::store_n(out[g] + col, acc[g] / simd::set1(l[g]), m);
}

template <class VT, int GB>
void outputs(const Pass& a, int64_t hk, int64_t lo, int64_t n, const float* e, int64_t ld, const float* l,
             float* const* out) {
  constexpr int W = GB == 1 ? 8 : GB == 2 ? 4 : 2;  // 8-lane vectors per pass over the values
  const int64_t D = a.D;
  int64_t col = 0;
  for (; col + 8 * W <= D; col += 8 * W) weighted<VT, GB, W>(a, hk, lo, n, e, ld, l, out, col);
  if (W > 4 && col + 32 <= D) weighted<VT, GB, 4>(a, hk, lo, n, e, ld, l, out, col), col += 32;
  for (; W > 2 && col + 16 <= D; col += 16) weighted<VT, GB, 2>(a, hk, lo, n, e, ld, l, out, col);
  for (; col + 8 <= D; col += 8) weighted<VT, GB, 1>(a, hk, lo, n, e, ld, l, out, col);
  if (col < D) weighted_tail<VT, GB>(a, hk, lo, n, e, ld, l, out, col, D - col);
}

// Query t of the GB heads h0 .. h0 + GB - 1 (all of KV head hk).
template <int GB>
void attend_heads(const Pass& a, int64_t hk, int64_t h0, int64_t t, std::vector<float>& buf) {
  const int64_t p = a.pos[t], D = a.D, Dp = a.Dp;
  const int64_t hi = std::min(p, a.S - 1), lo = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
  float* out[GB];
  for (int g = 0; g < GB; ++g) out[g] = a.out + ((h0 + g) * a.T + t) * D;
  if (hi < lo) {
    for (int g = 0; g < GB; ++g) std::fill(out[g], out[g] + D, 0.f);
    return;
  }
  const int64_t n = hi - lo + 1, ld = n + 16;
  buf.resize(GB * Dp + GB * ld);
  float* q = buf.data();  // [GB][Dp], zero-padded
  float* s = q + GB * Dp; // [GB][ld]
  for (int g = 0; g < GB; ++g) {
    const char* row = a.qv.row(h0 + g, t);
    float* qg = q + g * Dp;
    if (a.qb) {
      const uint16_t* r = reinterpret_cast<const uint16_t*>(row);
      for (int64_t i = 0; i < D; ++i) qg[i] = simd::bf16_to_f32(r[i]);
    } else {
      std::copy(reinterpret_cast<const float*>(row), reinterpret_cast<const float*>(row) + D, qg);
    }
    std::fill(qg + D, qg + Dp, 0.f);
  }
  if (a.kb && a.qb)
    scores<uint16_t, GB, true>(a, hk, lo, n, q, s, ld);
  else if (a.kb)
    scores<uint16_t, GB, false>(a, hk, lo, n, q, s, ld);
  else
    scores<float, GB, false>(a, hk, lo, n, q, s, ld);
  float l[GB];
  for (int g = 0; g < GB; ++g) {
    float* sg = s + g * ld;
    if (a.cap > 0)
      for (int64_t j = 0; j < n; ++j) sg[j] = std::tanh(sg[j] / a.cap) * a.cap;
    // _mm512_mask_max_ps over 16 slots (key j in slot j % 16), then _mm512_reduce_max_ps's tree
    f8 m0 = simd::set1(-INFINITY), m1 = m0;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) m0 = simd::max(m0, simd::load(sg + j)), m1 = simd::max(m1, simd::load(sg + j + 8));
    if (j < n) {
      const i8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
      const i8 left = i8{} + static_cast<int32_t>(n - j);
      m0 = lane < left ? simd::max(m0, simd::load(sg + j)) : m0;
      m1 = lane + 8 < left ? simd::max(m1, simd::load(sg + j + 8)) : m1;
    }
    const f8 t3 = simd::max(m1, m0);
    float t6[4];
    for (int i = 0; i < 4; ++i) t6[i] = t3[4 + i] > t3[i] ? t3[4 + i] : t3[i];
    const float x = t6[0] > t6[2] ? t6[0] : t6[2], y = t6[1] > t6[3] ? t6[1] : t6[3];
    const f8 mv = simd::set1(x > y ? x : y);
    for (j = 0; j < n; j += 8) simd::store(sg + j, exp8(simd::load(sg + j) - mv));
    float sum = 0.f;
    for (j = 0; j < n; ++j) sum += sg[j];
    l[g] = sum;
  }
  if (a.vb)
    outputs<uint16_t, GB>(a, hk, lo, n, s, ld, l, out);
  else
    outputs<float, GB>(a, hk, lo, n, s, ld, l, out);
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                  int64_t window, double scale, double softcap) {
  check_attend(q, k, v, positions);
  const int64_t H = q.size(0), T = q.size(1), D = q.size(2), Hkv = k.size(0), S = k.size(1);
  const View qv = view_of(q), kv = view_of(k), vv = view_of(v);
  const bool qb = q.scalar_type() == at::kBFloat16, kb = k.scalar_type() == at::kBFloat16,
             vb = v.scalar_type() == at::kBFloat16;
  const int64_t G = H / Hkv;
  const at::Tensor pos = positions.contiguous();
  at::Tensor out = at::empty({H, T, D}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) return out;
  const Pass a{qv, kv, vv, qb, kb, vb, T, D, S, G, 16 * ((D + 15) / 16), window, pos.data_ptr<int64_t>(),
               static_cast<float>(scale), static_cast<float>(softcap), out.data_ptr<float>()};
  // Tasks: (KV head, query, group of up to 4 of its query heads); smaller groups where that leaves too few
  // tasks for the threads (same results either way).
  int64_t gs = std::min<int64_t>(G, 4);
  while (gs > 1 && Hkv * T * ((G + gs - 1) / gs) < 4 * at::get_num_threads()) --gs;
  const int64_t ng = (G + gs - 1) / gs;
  at::parallel_for(0, Hkv * T * ng, 1, [&](int64_t b, int64_t e) {
    std::vector<float> buf;
    for (int64_t task = b; task < e; ++task) {
      const int64_t hk = task / (T * ng), t = task / ng % T, g0 = task % ng * gs, h0 = hk * G + g0;
      switch (std::min(gs, G - g0)) {
        case 1: attend_heads<1>(a, hk, h0, t, buf); break;
        case 2: attend_heads<2>(a, hk, h0, t, buf); break;
        case 3: attend_heads<3>(a, hk, h0, t, buf); break;
        default: attend_heads<4>(a, hk, h0, t, buf); break;
      }
    }
  });
  return out;
}

}  // namespace
