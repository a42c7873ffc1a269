// The vector-traits layer the kernels written once for every tier are templated over (attention.cpp, the linear
// kernels' shared steps in linear_steps.h, the int8 activations in int8_decode.h):
// `Lanes` is Lanes16 (one AVX-512 register) in the avx512 tier and Lanes8 (simd.h's 8-lane vectors) in the avx2
// and portable tiers, chosen by the tier's own compiler flags. Both give the same bits for every operation listed
// (tests/test_tiers.py crosses the tiers), so a kernel's arithmetic is one text and its order one definition:
//   V       L f32 lanes; +, -, *, / on it are plain IEEE f32 operations (-ffp-contract=off in every tier).
//   P       16 lane partials of a dot product along a row (element i of each 16-element chunk in lane i).
//   load16, row16  16 elements of an f32 or bf16 row as P (widened exactly): r[0:16], and [e, e + 16) of a row of
//           D with zeros past D.
//   mul16 / madd16  q[0:16] * k, and q[0:16] * k + acc rounded once (EXACT: the products are exact, so an
//           unfused multiply-add is the same; the portable tier uses it where fma is not an instruction).
//   fold, reduce_rows  the sums of L rows' 16 lane partials, each by _mm512_reduce_add_ps's tree
//           (simd::reduce16's pairing), L at once: fold(p) is the tree's first level, reduce_rows the rest.
//   max_slots  the max of n values as _mm512_mask_max_ps into 16 slots (value j in slot j % 16) and then
//           _mm512_reduce_max_ps's tree: vmaxps(a, b) = a > b ? a : b.
//   exp     e^x for x <= 0: range reduction by ln 2 (ties to even), a degree-6 Horner polynomial, scalef (~1 ulp).
//   load_i8, torch_bf16  L int8 values as f32 (exact), and each lane rounded to the nearest bf16, ties to even,
//           subnormals kept (integer arithmetic: torch's rounding of finite values; simd::round_bf16, the
//           vcvtneps2bf16 form, flushes subnormals).
//   U       L u32 lanes (a GCC vector: &, |, <<, >> per lane), for the stored layouts' integer fields
//           (linear_steps.h): load_u32 / load_u16 / load_u8 (L values zero-extended), load_u8_twice (lane i = p[i %
//           8]), lane_index; to_f (as int32, exact below 2^24), as_f (the bits), f16_lo (each lane's low 16 bits
//           as f16, exact), load_f16 (L f16 values); f32_pairs (2L floats -> their even and odd elements).
//   P ops   pzero, padd, pmax_abs (max(m, |v|) per lane, vmaxps's a > b ? a : b), psum (simd::reduce16's tree: the
//           sum of _mm512_reduce_add_ps), pmax (_mm512_reduce_max_ps's tree; max is exact in any order).
//   I       L int32 lanes (a GCC vector): cvt_rne (f32 -> int32, nearest, ties to even), store_i8 (each lane's low
//           byte), isum (the lanes' sum, exact).
//   store_bf16  the first n lanes rounded to bf16 as vcvtneps2bf16 (nearest even, subnormals to signed zero, NaN
//           quieted) and stored (a pass's output rows).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "simd.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace lanes {

// exp's polynomial: e^r for the reduced argument r, degree 6 by Horner's rule (each step one fma).
template <class S>
inline typename S::V exp_poly(typename S::V r) {
  typename S::V p = S::set1(1.3888889e-3f);
  for (const float c : {8.3333333e-3f, 4.1666667e-2f, 1.6666667e-1f, 0.5f, 1.0f, 1.0f}) p = S::fma(p, r, S::set1(c));
  return p;
}

// ---- 8 lanes: simd.h (avx2, portable) ------------------------------------------------------------------------

struct Lanes8 {
  static constexpr int L = 8;
  static constexpr int kMaxGroup = 4;  // query heads sharing one pass over a KV head's rows
  using V = simd::f8;
  using P = simd::f16;

  static V zero() { return V{}; }
  static V set1(float v) { return simd::set1(v); }
  static V load(const float* p) { return simd::load(p); }
  static V load(const uint16_t* p) { return simd::bf16x8(p); }
  static V load_n(const float* p, int64_t n) { return simd::load_n(p, n); }
  static V load_n(const uint16_t* p, int64_t n) {
    V v{};
    for (int64_t i = 0; i < n && i < 8; ++i) v[i] = simd::bf16_to_f32(p[i]);
    return v;
  }
  static void store(float* p, V v) { simd::store(p, v); }
  static void store_n(float* p, V v, int64_t n) { simd::store_n(p, v, n); }
  static V fma(V a, V b, V c) { return simd::fma(a, b, c); }
  static V load_i8(const int8_t* p) { return simd::to_f(simd::s8x8(p)); }  // L int8 values, exact
  using U = simd::u8;
  static U load_u32(const uint32_t* p) { return simd::loadu(p); }
  static U load_u16(const uint16_t* p) {
    simd::h8 h;
    std::memcpy(&h, p, 16);
    return __builtin_convertvector(h, U);
  }
  static U load_u8(const uint8_t* p) { return reinterpret_cast<U>(simd::u8x8(p)); }
  static U load_u8_twice(const uint8_t* p) { return load_u8(p); }
  static U lane_index() { return U{0, 1, 2, 3, 4, 5, 6, 7}; }
  static V to_f(U u) { return simd::to_f(reinterpret_cast<simd::i8>(u)); }
  static V as_f(U u) { return simd::as_f(u); }
  static V f16_lo(U u) { return simd::f16x8(u); }
  static V load_f16(const uint16_t* p) { return simd::f16x8(p); }
  static void f32_pairs(const float* p, V& even, V& odd) {
    const simd::Pair q = simd::f32_pairs(p);
    even = q.even;
    odd = q.odd;
  }
  static P pzero() { return P{zero(), zero()}; }
  static P padd(const P& a, const P& b) { return P{a.lo + b.lo, a.hi + b.hi}; }
  static P pmax_abs(const P& m, const P& v) {
    auto abs = [](V x) { return simd::as_f(simd::as_u(x) & 0x7fffffffu); };
    return P{simd::max(m.lo, abs(v.lo)), simd::max(m.hi, abs(v.hi))};
  }
  static float psum(const P& p) { return simd::reduce16(p); }
  static float pmax(const P& p) { return simd::reduce_max16(p); }
  using I = simd::i8;
  static I cvt_rne(V v) { return simd::cvt_rne(v); }
  static void store_i8(int8_t* p, I v) {
    for (int i = 0; i < 8; ++i) p[i] = static_cast<int8_t>(v[i]);
  }
  static int32_t isum(I v) {
    int32_t s = 0;
    for (int i = 0; i < 8; ++i) s += v[i];
    return s;
  }
  static void store_bf16(uint16_t* p, V v, int64_t n) { simd::store_bf16(p, v, n); }
  // the nearest bf16 as f32, ties to even, subnormals kept (torch's rounding of finite values)
  static V torch_bf16(V v) {
    const simd::u8 u = simd::as_u(v);
    return simd::as_f((u + (0x7fffu + ((u >> 16) & 1u))) & 0xffff0000u);
  }

  template <class T>
  static P load16(const T* r) { return P{load(r), load(r + 8)}; }
  template <class T>
  static P row16(const T* r, int64_t e, int64_t d) {
    return P{e + 8 <= d ? load(r + e) : load_n(r + e, d - e), e + 8 < d ? load_n(r + e + 8, d - e - 8) : V{}};
  }
  static P mul16(const float* q, const P& k) { return P{load(q) * k.lo, load(q + 8) * k.hi}; }
  template <bool EXACT>
  static P madd16(const float* q, const P& k, const P& acc) {
    if constexpr (EXACT) return P{simd::madd_exact(load(q), k.lo, acc.lo), simd::madd_exact(load(q + 8), k.hi, acc.hi)};
    return P{fma(load(q), k.lo, acc.lo), fma(load(q + 8), k.hi, acc.hi)};
  }
  static V fold(const P& p) { return p.hi + p.lo; }  // (x + y == y + x bit for bit)

  // r[i] = the tree's sum of row i, given t[i] = fold(row i's partials): per 128-bit half, the upper four lanes
  // plus the lower four, then lanes (0 + 2) and (1 + 3), then those two, for 8 rows at once by a transposing tree.
  static V reduce_rows(const V t[8]) {
// Two-source lane shuffle with constant lanes (8-15 are y's): clang's __builtin_shufflevector, GCC's
// __builtin_shuffle (since 4.7; the former only since GCC 12).
#if defined(__clang__)
#define LANES_SHUFFLE(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
#define LANES_SHUFFLE(x, y, ...) __builtin_shuffle(x, y, simd::i8{__VA_ARGS__})
#endif
    auto a = [](V x, V y) {  // [x0+x4 .. x3+x7, y0+y4 .. y3+y7]
      return LANES_SHUFFLE(x, y, 0, 1, 2, 3, 8, 9, 10, 11) + LANES_SHUFFLE(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
    };
    auto b = [](V x, V y) {  // per 128-bit half: [x0+x2, x1+x3, y0+y2, y1+y3]
      return LANES_SHUFFLE(x, y, 0, 1, 8, 9, 4, 5, 12, 13) + LANES_SHUFFLE(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
    };
    auto c = [](V x, V y) {  // per 128-bit half: [x0+x1, x2+x3, y0+y1, y2+y3]
      return LANES_SHUFFLE(x, y, 0, 2, 8, 10, 4, 6, 12, 14) + LANES_SHUFFLE(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
    };
#undef LANES_SHUFFLE
    // rows 0, 4 | 1, 5 | 2, 6 | 3, 7 paired so that c's lanes come out in row order
    return c(b(a(t[0], t[4]), a(t[1], t[5])), b(a(t[2], t[6]), a(t[3], t[7])));
  }

  static float max_slots(const float* s, int64_t n) {
    V m0 = set1(-INFINITY), m1 = m0;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) m0 = simd::max(m0, load(s + j)), m1 = simd::max(m1, load(s + j + 8));
    if (j < n) {
      const simd::i8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
      const simd::i8 left = simd::i8{} + static_cast<int32_t>(n - j);
      m0 = lane < left ? simd::max(m0, load(s + j)) : m0;
      m1 = lane + 8 < left ? simd::max(m1, load(s + j + 8)) : m1;
    }
    return simd::reduce_max16(simd::f16{m0, m1});
  }

  static V exp(V x) {
    x = simd::max(x, set1(-103.9f));  // below this exp is 0 (scalef saturates)
    const V n = round_even(x * set1(1.44269504088896341f)), nn = -n;  // n in [-150, 0]
    V r = fma(nn, set1(0.693359375f), x);
    r = fma(nn, set1(-2.12194440e-4f), r);
    const V p = exp_poly<Lanes8>(r);
    // scalef(p, n): one rounding. Below 2^-126 the power is not a normal f32: p * 2^-64 (exact) * 2^(n + 64).
    simd::i8 e = __builtin_convertvector(n, simd::i8);
    const simd::i8 tiny = e < -126;
    e = tiny ? e + 64 : e;
    const V pre = tiny ? set1(0x1p-64f) : set1(1.f);
    return (p * pre) * simd::as_f(reinterpret_cast<simd::u8>(e + 127) << 23);
  }

 private:
  // _mm512_roundscale_ps(y, nearest int), ties to even, for |y| < 2^22 (sign of zero kept).
  static V round_even(V y) {
    const V m = set1(12582912.f);  // 1.5 * 2^23: y + m keeps no fraction bits
    const V t = (y + m) - m;
    return simd::as_f(simd::as_u(t) | (simd::as_u(y) & 0x80000000u));
  }
};

// ---- 16 lanes: AVX-512 F (the avx512 tier) ------------------------------------------------------------------

#if defined(__AVX512F__)
struct Lanes16 {
  static constexpr int L = 16;
  static constexpr int kMaxGroup = 8;
  using V = __m512;
  using P = __m512;

  static __mmask16 first(int64_t n) { return n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1); }
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const uint16_t* p) { return load_n(p, 16); }
  static V load_n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }
  static V load_n(const uint16_t* p, int64_t n) {
    const __m256i h = _mm256_maskz_loadu_epi16(first(n), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void store_n(float* p, V v, int64_t n) { _mm512_mask_storeu_ps(p, first(n), v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  typedef uint32_t U __attribute__((vector_size(64)));
  static __m512i bits(U u) { return reinterpret_cast<__m512i>(u); }
  static U load_u32(const uint32_t* p) { return reinterpret_cast<U>(_mm512_loadu_si512(p)); }
  static U load_u16(const uint16_t* p) {
    return reinterpret_cast<U>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  static U load_u8(const uint8_t* p) {
    return reinterpret_cast<U>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static U load_u8_twice(const uint8_t* p) {
    int64_t b;
    std::memcpy(&b, p, 8);
    return reinterpret_cast<U>(_mm512_cvtepu8_epi32(_mm_set1_epi64x(b)));
  }
  static U lane_index() { return U{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }
  static V to_f(U u) { return _mm512_cvtepi32_ps(bits(u)); }
  static V as_f(U u) { return _mm512_castsi512_ps(bits(u)); }
  static V f16_lo(U u) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(bits(u))); }  // (vpmovdw keeps the low 16)
  static V load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void f32_pairs(const float* p, V& even, V& odd) {
    const __m512i e = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const V a = load(p), b = load(p + 16);
    even = _mm512_permutex2var_ps(a, e, b);
    odd = _mm512_permutex2var_ps(a, _mm512_add_epi32(e, _mm512_set1_epi32(1)), b);
  }
  static P pzero() { return zero(); }
  static P padd(P a, P b) { return _mm512_add_ps(a, b); }
  static P pmax_abs(P m, P v) { return _mm512_max_ps(m, _mm512_abs_ps(v)); }
  static float psum(P p) { return _mm512_reduce_add_ps(p); }
  static float pmax(P p) { return _mm512_reduce_max_ps(p); }
  typedef int32_t I __attribute__((vector_size(64)));
  static I cvt_rne(V v) { return reinterpret_cast<I>(_mm512_cvtps_epi32(v)); }  // (MXCSR: nearest, ties to even)
  static void store_i8(int8_t* p, I v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(reinterpret_cast<__m512i>(v)));
  }
  static int32_t isum(I v) { return _mm512_reduce_add_epi32(reinterpret_cast<__m512i>(v)); }
  static void store_bf16(uint16_t* p, V v, int64_t n) {
    _mm256_mask_storeu_epi16(p, first(n), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
  static V torch_bf16(V v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                                      _mm512_set1_epi32(1)));
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_add_epi32(u, bias), _mm512_set1_epi32(0xffff0000u)));
  }

  template <class T>
  static P load16(const T* r) { return load(r); }
  template <class T>
  static P row16(const T* r, int64_t e, int64_t d) { return load_n(r + e, d - e); }
  static P mul16(const float* q, P k) { return _mm512_mul_ps(load(q), k); }
  template <bool EXACT>
  static P madd16(const float* q, P k, P acc) { return fma(load(q), k, acc); }
  static V fold(P p) { return p; }

  // r[i] = the tree's sum of row i's 16 lanes, i < 16: per row the upper eight lanes plus the lower eight, then
  // the upper four of those plus the lower four, then lanes (0 + 2) and (1 + 3), then those two; 16 rows at once.
  static V reduce_rows(const V v[16]) {
    V w[8], x[4], y[2];
    for (int i = 0; i < 8; ++i)
      w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                           _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i)
      x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; ++i)
      y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const V z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
    // z[4m + e] holds the sum of row m + 4e
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(idx, z);
  }

  static float max_slots(const float* s, int64_t n) {
    V m = set1(-INFINITY);
    for (int64_t j = 0; j < n; j += 16) m = _mm512_mask_max_ps(m, first(n - j), m, load_n(s + j, n - j));
    return _mm512_reduce_max_ps(m);
  }

  static V exp(V x) {
    x = _mm512_max_ps(x, set1(-103.9f));
    const V n = _mm512_roundscale_ps(_mm512_mul_ps(x, set1(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm512_fnmadd_ps(n, set1(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, set1(-2.12194440e-4f), r);
    const V p = exp_poly<Lanes16>(r);
    return _mm512_scalef_ps(p, n);
  }
};
using Lanes = Lanes16;
#else
using Lanes = Lanes8;
#endif

}  // namespace lanes
