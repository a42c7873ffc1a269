// The vector-traits layer of the generic kernel tiers (avx2, portable): 8-lane f32 / i32 vectors as GCC/Clang
// vector extensions, compiled once per tier (-mavx2 -mfma -mf16c for avx2; the compiler's baseline for portable,
// e.g. aarch64 NEON), plus the few steps whose exact rounding is part of the math and must equal the AVX-512
// tier's instructions bit for bit:
//   - dpbf16: AVX-512 BF16's vdpbf16ps, measured on hardware (tests/test_tiers.py crosses the tiers): per f32
//     lane, acc = (acc + x[odd] * w[odd]) + x[even] * w[even], each sum rounded to f32 (RNE). The products of
//     two bf16 values are exact in f32, so fma and mul + add give the same sums. (The instruction also flushes
//     denormal sums and keeps out-of-range products exact: only sums below 2^-126 or products outside f32's
//     range, which the models never produce, can differ.)
//   - bf16 rounding: vcvtneps2bf16 (RNE, denormals to signed zero, NaN quieted).
//   - reduce16: _mm512_reduce_add_ps's fixed tree over 16 lane partials (GCC's avx512fintrin.h).
//   - fma: a single rounding (vfmadd on x86 with FMA, fmla on aarch64, fmaf elsewhere).
// Everything else is plain IEEE f32 arithmetic, identical on every ISA under -ffp-contract=off.
#pragma once

#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace simd {

typedef float f8 __attribute__((vector_size(32), aligned(4)));  // loads/stores of any alignment
typedef int32_t i8 __attribute__((vector_size(32), aligned(4)));
typedef uint32_t u8 __attribute__((vector_size(32), aligned(4)));
typedef uint8_t b8 __attribute__((vector_size(8), aligned(1)));     // 8 bytes
typedef int8_t sb8 __attribute__((vector_size(8), aligned(1)));
typedef uint16_t h8 __attribute__((vector_size(16), aligned(2)));   // 8 bf16 / f16 halves

inline f8 zero() { return f8{}; }
inline f8 set1(float v) { return f8{v, v, v, v, v, v, v, v}; }  // (f8{} + v would turn -0 into +0)
inline f8 load(const float* p) { return *reinterpret_cast<const f8*>(p); }
inline void store(float* p, f8 v) { *reinterpret_cast<f8*>(p) = v; }
inline f8 as_f(u8 v) { return reinterpret_cast<f8>(v); }
inline u8 as_u(f8 v) { return reinterpret_cast<u8>(v); }

// The first n (< 8) lanes from p, the others 0 / stores of the first n lanes.
inline f8 load_n(const float* p, int64_t n) {
  f8 v{};
  for (int64_t i = 0; i < n && i < 8; ++i) v[i] = p[i];
  return v;
}
inline void store_n(float* p, f8 v, int64_t n) {
  for (int64_t i = 0; i < n && i < 8; ++i) p[i] = v[i];
}

// a * b + c with one rounding.
inline f8 fma(f8 a, f8 b, f8 c) {
#if defined(__FMA__)
  return reinterpret_cast<f8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                              reinterpret_cast<__m256>(c)));
#else
  f8 r;
  for (int i = 0; i < 8; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

// a * b + c where the product a * b is exact in f32 (bf16 x bf16, small integer codes x bf16): one rounding
// whether fused or not, so the cheaper form is used.
inline f8 madd_exact(f8 a, f8 b, f8 c) {
#if defined(__FMA__)
  return fma(a, b, c);
#else
  return a * b + c;
#endif
}

// Lane-wise a > b ? a : b: _mm512_max_ps(a, b) / vmaxps, which returns b where either is NaN or both are zero.
inline f8 max(f8 a, f8 b) { return a > b ? a : b; }

// ---- bf16 / f16 ----------------------------------------------------------------------------------------------

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// f32 -> bf16 bits as torch converts: c10's round_to_nearest_even (NaN -> 0x7fc0), branch-free, so loops of it
// vectorize (norm.cpp's rows, attention's output).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t r = (u + (0x7fffu + ((u >> 16) & 1u))) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : static_cast<uint16_t>(r);
}

// 8 bf16 -> f32 (exact)
inline f8 bf16x8(const uint16_t* p) {
#if defined(__AVX2__)
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<f8>(_mm256_slli_epi32(w, 16));
#else
  h8 h;
  std::memcpy(&h, p, 16);
  return as_f(__builtin_convertvector(h, u8) << 16);
#endif
}

// f32 -> bf16 bits as vcvtneps2bf16: RNE, denormals to signed zero, NaN quieted; returned in the high half of
// each lane with the low half zero (the bf16 value as f32).
inline u8 bf16_round_bits(f8 v) {
  const u8 u = as_u(v);
  const u8 exp = u & 0x7f800000u;
  const u8 rounded = (u + (0x7fffu + ((u >> 16) & 1u))) & 0xffff0000u;
  const u8 nan = (u | 0x00400000u) & 0xffff0000u;
  const u8 r = (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
  return exp == 0 ? (u & 0x80000000u) : r;
}
inline f8 round_bf16(f8 v) { return as_f(bf16_round_bits(v)); }
// The same for lanes known to be zero or normal, finite and below 2^110 in magnitude (products of codes and
// f16-derived scales: an f16 times an int8 is at least 2^-24 in magnitude or zero): Veltkamp's split with the
// factor 2^16 + 1, c = v (2^16 + 1), v' = c - (c - v), keeps the top 8 significant bits of v rounded to nearest,
// ties to even (checked against the integer form below for every f32 significand, both signs, ties included), in
// three FP operations where the bit form takes five integer ones. Needs every operation rounded on its own
// (-ffp-contract=off, no -ffast-math).
inline f8 round_bf16_normal(f8 v) {
  const f8 c = v * set1(65537.f);
  return c - (c - v);
}

// 8 f32 -> bf16 stored at p (n < 8: the first n)
inline void store_bf16(uint16_t* p, f8 v, int64_t n = 8) {
  const u8 b = bf16_round_bits(v) >> 16;
  if (n >= 8) {
#if defined(__AVX2__)
    const __m256i w = reinterpret_cast<__m256i>(b);  // lanes < 2^16: the unsigned-saturating pack is exact
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
#else
    const h8 h = __builtin_convertvector(b, h8);
    std::memcpy(p, &h, 16);
#endif
    return;
  }
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<uint16_t>(b[i]);
}

// 8 f16 -> f32 (exact on every path)
inline f8 f16x8(const uint16_t* p) {
#if defined(__F16C__)
  return reinterpret_cast<f8>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  f8 r;
  for (int i = 0; i < 8; ++i) r[i] = static_cast<float>(c10::Half(p[i], c10::Half::from_bits()));
  return r;
#endif
}
inline float f16_to_f32(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
inline f8 f16x8(u8 halves) {  // the low 16 bits of each lane as f16 -> f32
#if defined(__F16C__)
  const __m256i w = reinterpret_cast<__m256i>(halves & 0xffffu);
  return reinterpret_cast<f8>(_mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1))));
#else
  f8 r;
  for (int i = 0; i < 8; ++i) r[i] = f16_to_f32(static_cast<uint16_t>(halves[i]));
  return r;
#endif
}
inline u8 loadu(const uint32_t* p) {
  u8 v;
  std::memcpy(&v, p, 32);
  return v;
}

// ---- integer codes -------------------------------------------------------------------------------------------

// (GCC lowers these conversions of 8-byte vectors lane by lane: AVX2 gets its one-instruction forms.)
inline i8 u8x8(const uint8_t* p) {  // 8 bytes zero-extended
#if defined(__AVX2__)
  return reinterpret_cast<i8>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  b8 b;
  std::memcpy(&b, p, 8);
  return __builtin_convertvector(b, i8);
#endif
}
inline i8 s8x8(const int8_t* p) {  // 8 signed bytes sign-extended
#if defined(__AVX2__)
  return reinterpret_cast<i8>(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  sb8 b;
  std::memcpy(&b, p, 8);
  return __builtin_convertvector(b, i8);
#endif
}
inline f8 to_f(i8 v) { return __builtin_convertvector(v, f8); }

// ---- q4 codes in the nibble order (the outer form's decode path) --------------------------------------------
// A stored q4 tile row is 32 bytes, byte j holding column j in its low nibble and column j + 32 in its high one.
// nibbles(row, half, out) gives the 32 columns of one half (0: low nibbles, columns 0-31; 1: high, 32-63) as
// f32 values code - 8 (exact) in the nibble order: vector v (0-3), lane i holds column nibble_col(half * 4 + v, i).
// It is the order AVX2's in-lane byte and word unpacks leave: a table lookup per nibble gives the two bytes of
// the value's bf16 bits (which are its f32 bits' upper half), two unpacks put them into f32 lanes. Each column
// keeps its own accumulation, so the lane order changes no bit (the driver permutes s, z and the sums to match).
constexpr int nibble_col(int v, int i) { return 32 * (v >> 2) + 4 * (v & 3) + (i & 3) + 16 * (i >> 2); }

#if defined(__AVX2__)
struct NibbleTables {
  __m256i hi, lo, mask;  // bf16 bits of code - 8 for codes 0-15 (both 128-bit lanes): upper and lower bytes
};
inline NibbleTables nibble_tables() {
  alignas(32) uint8_t hi[32], lo[32];
  for (int q = 0; q < 32; ++q) {
    const float f = static_cast<float>((q & 15) - 8);
    uint32_t u;
    std::memcpy(&u, &f, 4);  // small integers: the low 16 bits are zero
    hi[q] = static_cast<uint8_t>(u >> 24);
    lo[q] = static_cast<uint8_t>(u >> 16);
  }
  return NibbleTables{_mm256_load_si256(reinterpret_cast<const __m256i*>(hi)),
                      _mm256_load_si256(reinterpret_cast<const __m256i*>(lo)), _mm256_set1_epi8(15)};
}
inline void nibbles(const NibbleTables& t, const uint8_t* row, int half, f8 out[4]) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  const __m256i idx = _mm256_and_si256(half ? _mm256_srli_epi16(b, 4) : b, t.mask);
  const __m256i hb = _mm256_shuffle_epi8(t.hi, idx), lb = _mm256_shuffle_epi8(t.lo, idx);
  const __m256i w0 = _mm256_unpacklo_epi8(lb, hb), w1 = _mm256_unpackhi_epi8(lb, hb);  // bytes 0-7 / 8-15 per lane
  const __m256i z = _mm256_setzero_si256();
  out[0] = reinterpret_cast<f8>(_mm256_unpacklo_epi16(z, w0));
  out[1] = reinterpret_cast<f8>(_mm256_unpackhi_epi16(z, w0));
  out[2] = reinterpret_cast<f8>(_mm256_unpacklo_epi16(z, w1));
  out[3] = reinterpret_cast<f8>(_mm256_unpackhi_epi16(z, w1));
}
#else
struct NibbleTables {};
inline NibbleTables nibble_tables() { return {}; }
inline void nibbles(const NibbleTables&, const uint8_t* row, int half, f8 out[4]) {
  for (int v = 0; v < 4; ++v)
    for (int i = 0; i < 8; ++i) {
      const uint8_t b = row[nibble_col(v, i)];
      out[v][i] = static_cast<float>((half ? b >> 4 : b & 15) - 8);
    }
}
#endif

// One half's four vectors in the nibble order (A, B, C, D) -> column order (n0 .. n3), in registers: A = (columns
// 0-3, 16-19) holds the low halves of n0 and n2, B their high halves, C and D those of n1 and n3; so n0 = the low
// halves of A and B, n1 of C and D, n2 and n3 their high halves.
inline void nibble_columns(f8 v[4]) {
  const i8 lo{0, 1, 2, 3, 8, 9, 10, 11}, hi{4, 5, 6, 7, 12, 13, 14, 15};
  const f8 a = v[0], b = v[1], c = v[2], d = v[3];
  v[0] = __builtin_shuffle(a, b, lo);
  v[1] = __builtin_shuffle(c, d, lo);
  v[2] = __builtin_shuffle(a, b, hi);
  v[3] = __builtin_shuffle(c, d, hi);
}

// ---- pairs: the operands of dpbf16 ---------------------------------------------------------------------------
// A vdpbf16ps lane holds the pair (element 2i, element 2i + 1) of 32 bf16; the generic tiers keep a pair vector
// of 8 lanes as its two halves, even and odd, each as f32 values.
struct Pair {
  f8 even, odd;
};

// acc + x[odd] * w[odd] + x[even] * w[even], as vdpbf16ps: the odd product first.
inline f8 dpbf16(f8 acc, const Pair& w, f8 x_even, f8 x_odd) {
  return madd_exact(w.even, x_even, madd_exact(w.odd, x_odd, acc));
}

// 16 bf16 at p as 8 pairs.
inline Pair bf16_pairs(const uint16_t* p) {
  u8 u;
  std::memcpy(&u, p, 32);
  return Pair{as_f(u << 16), as_f(u & 0xffff0000u)};
}

// 16 int8 codes at p as 8 pairs of their f32 values (exact).
inline Pair code_pairs(const int8_t* p) {
#if defined(__AVX2__)
  const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));  // 16 x i16
  const __m256i e = _mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16), o = _mm256_srai_epi32(v, 16);
  return Pair{reinterpret_cast<f8>(_mm256_cvtepi32_ps(e)), reinterpret_cast<f8>(_mm256_cvtepi32_ps(o))};
#else
  typedef int16_t s16 __attribute__((vector_size(16), aligned(1)));
  s16 v;
  std::memcpy(&v, p, 16);
  const s16 e = static_cast<s16>(v << 8) >> 8, o = v >> 8;
  return Pair{to_f(__builtin_convertvector(e, i8)), to_f(__builtin_convertvector(o, i8))};
#endif
}

// n int8 codes (n % 32 == 0) in place into the pair-split order: per 16, their 8 even elements, then their 8 odd
// ones, so that split_code_pairs widens each half of code_pairs' pairs with one sign-extending load (a decode row's
// codes are split once where they are decoded, not shifted apart at every use).
inline void split_codes(int8_t* p, int64_t n) {
#if defined(__AVX2__)
  const __m256i idx = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                       0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int64_t i = 0; i < n; i += 32) {
    __m256i* q = reinterpret_cast<__m256i*>(p + i);
    _mm256_storeu_si256(q, _mm256_shuffle_epi8(_mm256_loadu_si256(q), idx));
  }
#else
  typedef int8_t s16b __attribute__((vector_size(16), aligned(1)));
  for (int64_t i = 0; i < n; i += 16) {
    s16b v;
    std::memcpy(&v, p + i, 16);
    v = __builtin_shuffle(v, s16b{0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15});
    std::memcpy(p + i, &v, 16);
  }
#endif
}

// 16 int8 codes in the pair-split order at p as 8 pairs of their f32 values: code_pairs of the codes before the split.
inline Pair split_code_pairs(const int8_t* p) { return Pair{to_f(s8x8(p)), to_f(s8x8(p + 8))}; }

// v[c] = row c's 8 values in, v[e] = the 8 rows' element e out (unpack pairs, then quads, then 128-bit halves).
inline void transpose8(f8 v[8]) {
  f8 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], i8{0, 8, 1, 9, 4, 12, 5, 13});
    t[2 * i + 1] = __builtin_shuffle(v[2 * i], v[2 * i + 1], i8{2, 10, 3, 11, 6, 14, 7, 15});
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      const f8 a = t[4 * i + j], b = t[4 * i + j + 2];
      u[4 * i + 2 * j] = __builtin_shuffle(a, b, i8{0, 1, 8, 9, 4, 5, 12, 13});
      u[4 * i + 2 * j + 1] = __builtin_shuffle(a, b, i8{2, 3, 10, 11, 6, 7, 14, 15});
    }
  for (int j = 0; j < 4; ++j) {
    v[j] = __builtin_shuffle(u[j], u[j + 4], i8{0, 1, 2, 3, 8, 9, 10, 11});
    v[j + 4] = __builtin_shuffle(u[j], u[j + 4], i8{4, 5, 6, 7, 12, 13, 14, 15});
  }
}

// Each pair of neighbouring lanes swapped: [v1, v0, v3, v2, ...] (a bf16 pair's odd element first).
inline f8 swap_pairs(f8 v) { return __builtin_shuffle(v, i8{1, 0, 3, 2, 5, 4, 7, 6}); }

// 16 f32 (bf16-valued) at v as 8 pairs.
inline Pair f32_pairs(const float* v) {
  const f8 a = load(v), b = load(v + 8);
  return Pair{__builtin_shuffle(a, b, i8{0, 2, 4, 6, 8, 10, 12, 14}), __builtin_shuffle(a, b, i8{1, 3, 5, 7, 9, 11, 13, 15})};
}

// ---- 16-lane partial sums (the dot form's and group sums' lanes, as one AVX-512 register) --------------------

struct f16 {
  f8 lo, hi;  // lanes 0-7, 8-15
};

// The tree of _mm512_reduce_add_ps: (l[i] + h[i]) for i < 8, then the upper four plus the lower four, then
// lanes (0 + 2) and (1 + 3), then those two.
inline float reduce16(const f16& v) {
  const f8 t3 = v.hi + v.lo;
  float t6[4];
  for (int i = 0; i < 4; ++i) t6[i] = t3[4 + i] + t3[i];
  const float a = t6[0] + t6[2], b = t6[1] + t6[3];
  return a + b;
}
// The same tree lane-wise: p[i] holds lane i's partials of 8 outputs (one per vector lane); their 8 sums.
inline f8 reduce16_lanes(const f8 p[16]) {
  f8 t3[8], t6[4];
  for (int i = 0; i < 8; ++i) t3[i] = p[8 + i] + p[i];
  for (int i = 0; i < 4; ++i) t6[i] = t3[4 + i] + t3[i];
  return (t6[0] + t6[2]) + (t6[1] + t6[3]);
}

// ---- int8 activations (int8.cpp) -----------------------------------------------------------------------------

// _mm512_reduce_max_ps's fixed tree over 16 lanes (GCC's avx512fintrin.h), each step vmaxps(a, b) = a > b ? a : b
// (b where either is NaN): max(hi, lo) per lane, then the upper four against the lower four, then lanes
// (0, 2) and (1, 3), then those two.
inline float reduce_max16(const f16& v) {
  const f8 t3 = max(v.hi, v.lo);
  float t6[4];
  for (int i = 0; i < 4; ++i) t6[i] = t3[4 + i] > t3[i] ? t3[4 + i] : t3[i];
  const float a = t6[0] > t6[2] ? t6[0] : t6[2], b = t6[1] > t6[3] ? t6[1] : t6[3];
  return a > b ? a : b;
}

// f32 -> int32 as vcvtps2dq under the default rounding mode: round to nearest even; NaN and values outside
// int32's range give INT32_MIN.
inline i8 cvt_rne(f8 v) {
#if defined(__AVX2__)
  return reinterpret_cast<i8>(_mm256_cvtps_epi32(reinterpret_cast<__m256>(v)));
#else
  const f8 a = as_f(as_u(v) & 0x7fffffffu);
  const f8 big = set1(8388608.f);                                          // 2^23: a >= it is an integer
  const f8 r = a < big ? (a + big) - big : a;                              // |v| rounded, ties to even
  const f8 s = as_f(as_u(r) | (as_u(v) & 0x80000000u));                    // v's sign back
  const auto ok = a < set1(2147483648.f);                                  // false for NaN
  const i8 c = __builtin_convertvector(ok ? s : zero(), i8);
  return ok ? c : i8{} + INT32_MIN;
#endif
}

}  // namespace simd
