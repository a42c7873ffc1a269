// Pieces of the LOSSY int8 linears shared by every tier's library: the integer primitives of the generic tiers
// (an AVX2 form under __AVX2__, plain vector arithmetic otherwise) and the decode forms (passes of at most
// kDirectRows rows reading the stored q4 tiles / q8 rows directly). The avx512 tier's int8.cpp uses the q8 decode
// form for q8k (groups of 16, which its VNNI dot form does not take); generic/int8.cpp uses both. Everything here
// has internal linkage: each library gets its own copy, compiled for its own flags.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "../parallel.h"
#include "../stream.h"
#include "gguf_blocks.h"
#include "lanes.h"
#include "linear_steps.h"
#include "simd.h"

namespace {

using simd::f8;
using i32x8 = simd::i8;
typedef int16_t i16x16 __attribute__((vector_size(32)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef int8_t s8x32 __attribute__((vector_size(32)));

template <class V>
inline V vload(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

// The activations every int8 linear takes: contiguous [T, K] f32 or bf16, K a multiple of 64.
inline void check_x(const at::Tensor& x, int64_t k, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == k, name, ": x must be contiguous [T, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, ": x must be f32 or bf16");
  TORCH_CHECK(k % 64 == 0, name, ": K must be a multiple of 64");
}

// ---- activations: every tier's int8 rows of x (over lanes.h: 16 lanes a register in avx512, 8 in the others) -----

// Per-row, per-group int8 activations, in buffers of the calling thread that its next calls reuse (fresh ones
// would fault in their pages on every call, a measurable share of a prefill pass); above kKeepBytes they are
// given back when the call ends.
constexpr size_t kKeepBytes = 16 << 20;

struct ActBuffers {
  std::vector<int8_t> q;
  std::vector<float> d, xs;
  std::vector<int32_t> qs;
};
thread_local ActBuffers act_buffers;

struct Activations {
  const int8_t* q;    // [T][K]
  const float* d;     // [T][G] scale
  const int32_t* qs;  // [T][G] sum of q
  const float* xs;    // [T][G] sum of x
  int64_t groups;
  ~Activations() {
    if (act_buffers.q.capacity() > kKeepBytes) act_buffers = ActBuffers();
  }
};

// x [T, K] (f32 or bf16) per group of xg (a multiple of 16): d = max|x| / 127, q = x * (127 / max|x|) rounded to
// nearest even and clamped to [-127, 127], the sum of q, and the f32 sum of x (16 lane partials in k order, then
// _mm512_reduce_add_ps's tree): the same values in every tier.
inline Activations quantize_rows(const at::Tensor& x, int64_t xg) {
  using S = lanes::Lanes;
  const int64_t t = x.size(0), k = x.size(1), groups = k / xg;
  ActBuffers& b = act_buffers;
  b.q.resize(t * k);
  b.d.resize(t * groups);
  b.qs.resize(t * groups);
  b.xs.resize(t * groups);
  int8_t* q = b.q.data();
  float *d = b.d.data(), *xs = b.xs.data();
  int32_t* qs = b.qs.data();
  const bool bf = x.scalar_type() == at::kBFloat16;
  const uint16_t* xb = bf ? reinterpret_cast<const uint16_t*>(x.data_ptr()) : nullptr;
  const float* xf = bf ? nullptr : x.data_ptr<float>();
  at::parallel_for(0, t, 1, [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r)
      for (int64_t gi = 0; gi < groups; ++gi) {
        const int64_t base = r * k + gi * xg;
        S::P amax = S::pzero(), sum = S::pzero();  // lanes j % 16, as one AVX-512 register
        for (int64_t j = 0; j < xg; j += 16) {
          const S::P v = bf ? S::load16(xb + base + j) : S::load16(xf + base + j);
          amax = S::pmax_abs(amax, v);
          sum = S::padd(sum, v);
        }
        const float m = S::pmax(amax);
        const S::V inv = S::set1(m > 0.f ? 127.f / m : 0.f);
        S::I qsum{};
        for (int64_t j = 0; j < xg; j += S::L) {
          S::I qi = S::cvt_rne((bf ? S::load(xb + base + j) : S::load(xf + base + j)) * inv);
          qi = qi < -127 ? -127 : qi;
          qi = qi > 127 ? 127 : qi;
          qsum += qi;
          S::store_i8(q + base + j, qi);
        }
        d[r * groups + gi] = m / 127.f;
        qs[r * groups + gi] = S::isum(qsum);
        xs[r * groups + gi] = S::psum(sum);
      }
  });
  return Activations{q, d, qs, xs, groups};
}

// ---- integer primitives: the only code with an ISA form ------------------------------------------------------

// u (unsigned bytes) x s (signed bytes), adjacent products summed into int16 lanes: vpmaddubsw (whose saturation
// never triggers here: u <= 15, |s| <= 127).
inline i16x16 maddubs(u8x32 u, s8x32 s) {
#if defined(__AVX2__)
  return reinterpret_cast<i16x16>(_mm256_maddubs_epi16(reinterpret_cast<__m256i>(u), reinterpret_cast<__m256i>(s)));
#else
  const u16x16 uw = reinterpret_cast<u16x16>(u);
  const i16x16 sw = reinterpret_cast<i16x16>(s);
  const i16x16 ue = reinterpret_cast<i16x16>(uw & 0xff), uo = reinterpret_cast<i16x16>(uw >> 8);
  const i16x16 se = (sw << 8) >> 8, so = sw >> 8;
  return ue * se + uo * so;
#endif
}

// Adjacent int16 lanes summed into int32 lanes: vpmaddwd with ones.
inline i32x8 pair_sums(i16x16 v) {
#if defined(__AVX2__)
  return reinterpret_cast<i32x8>(_mm256_madd_epi16(reinterpret_cast<__m256i>(v), _mm256_set1_epi16(1)));
#else
  const i32x8 w = reinterpret_cast<i32x8>(v);
  return ((w << 16) >> 16) + (w >> 16);
#endif
}

inline s8x32 broadcast4(const int8_t* p) {
  int32_t q;
  std::memcpy(&q, p, 4);
  return reinterpret_cast<s8x32>(i32x8{} + q);
}

// ---- decode: short passes read the stored layouts directly -----------------------------------------------------
// At T <= kDirectRows (decode, speculation's verify passes) laying a chunk out as quads costs more than its
// arithmetic: each code would be moved once and used by one or two rows. These forms take the same A (exact
// int32 sums, any method gives them) and apply the same f32 steps per (row, column, group), in group order, so the
// output bits are the chunk path's.
//   q4 (full 64-column tiles): two consecutive k rows of a tile (32 bytes each: byte j holds columns j and 32 + j)
//     interleaved bytewise give per column the (k, k + 1) code pair, which vpmaddubsw multiplies by the broadcast
//     (x[k], x[k + 1]) pair; int16 sums over 8 pairs (<= 30480), widened to int32 per window. Half 0 (the low
//     unpack) holds columns 0-7, 16-23, 32-39, 48-55; half 1 the other 32.
//   q8 (row-major): 32 codes of a weight row against 32 x codes as |w| x (x with w's sign) by vpmaddubsw
//     (|pair| <= 2 * 128 * 127 = 32512), then vpmaddwd: int32 lane i sums k = 4i .. 4i + 3; eight rows' lanes
//     summed per group by a fixed tree (int32: exact in any order).

inline u8x32 load32(const void* p) { return vload<u8x32>(p); }

// Bytes of a and b interleaved, per 128-bit half: half h of each (bytes 8h .. 8h + 7 of both halves): the
// vpunpcklbw (h = 0) / vpunpckhbw (h = 1) order.
template <int H>
inline u8x32 interleave(u8x32 a, u8x32 b) {
#if defined(__AVX2__)
  const __m256i x = reinterpret_cast<__m256i>(a), y = reinterpret_cast<__m256i>(b);
  return reinterpret_cast<u8x32>(H ? _mm256_unpackhi_epi8(x, y) : _mm256_unpacklo_epi8(x, y));
#else
  u8x32 r;
  for (int l = 0; l < 2; ++l)
    for (int i = 0; i < 8; ++i) {
      r[16 * l + 2 * i] = a[16 * l + 8 * H + i];
      r[16 * l + 2 * i + 1] = b[16 * l + 8 * H + i];
    }
  return r;
#endif
}

// int16 lanes 8h .. 8h + 7 widened to int32.
template <int H>
inline i32x8 widen(i16x16 v) {
#if defined(__AVX2__)
  const __m256i w = reinterpret_cast<__m256i>(v);
  return reinterpret_cast<i32x8>(_mm256_cvtepi16_epi32(H ? _mm256_extracti128_si256(w, 1) : _mm256_castsi256_si128(w)));
#else
  typedef int16_t i16x8 __attribute__((vector_size(16)));
  i16x8 h;
  std::memcpy(&h, reinterpret_cast<const char*>(&v) + 16 * H, 16);
  return __builtin_convertvector(h, i32x8);
#endif
}

// Sums of 4 consecutive products of 32 signed codes w and x: lane i = sum of w[j] x[j], j = 4i .. 4i + 3.
inline i32x8 dot4(s8x32 w, s8x32 x) {
#if defined(__AVX2__)
  const __m256i a = reinterpret_cast<__m256i>(w), b = reinterpret_cast<__m256i>(x);
  return pair_sums(reinterpret_cast<i16x16>(_mm256_maddubs_epi16(_mm256_abs_epi8(a), _mm256_sign_epi8(b, a))));
#else
  const i16x16 ww = reinterpret_cast<i16x16>(w), xw = reinterpret_cast<i16x16>(x);
  const i16x16 p = ((ww << 8) >> 8) * ((xw << 8) >> 8) + (ww >> 8) * (xw >> 8);  // |.| <= 32512
  return pair_sums(p);
#endif
}

// Adjacent int32 lanes of a and b summed, in vphaddd's order: per 128-bit half, a's two pairs then b's.
inline i32x8 hadd(i32x8 a, i32x8 b) {
#if defined(__AVX2__)
  return reinterpret_cast<i32x8>(_mm256_hadd_epi32(reinterpret_cast<__m256i>(a), reinterpret_cast<__m256i>(b)));
#else
  return i32x8{a[0] + a[1], a[2] + a[3], b[0] + b[1], b[2] + b[3], a[4] + a[5], a[6] + a[7], b[4] + b[5], b[6] + b[7]};
#endif
}

// Of 8 columns' int32 lanes v[c], given as p[i] = hadd(v[2i], v[2i + 1]) (taken as each pair of columns is done:
// fewer registers live): per column c the sum of lanes 0-3 (lo) and of lanes 4-7 (hi).
struct Halves {
  i32x8 lo, hi;
};
inline Halves column_sums(const i32x8* p) {
  const i32x8 q0 = hadd(p[0], p[1]), q1 = hadd(p[2], p[3]);  // columns 0-3 lo, then hi | columns 4-7
#if defined(__AVX2__)
  const __m256i a = reinterpret_cast<__m256i>(q0), b = reinterpret_cast<__m256i>(q1);
  return Halves{reinterpret_cast<i32x8>(_mm256_permute2x128_si256(a, b, 0x20)),
                reinterpret_cast<i32x8>(_mm256_permute2x128_si256(a, b, 0x31))};
#else
  return Halves{i32x8{q0[0], q0[1], q0[2], q0[3], q1[0], q1[1], q1[2], q1[3]},
                i32x8{q0[4], q0[5], q0[6], q0[7], q1[4], q1[5], q1[6], q1[7]}};
#endif
}

// Adjacent int16 lanes of a and b summed (wrapping), in vphaddw's order: per 128-bit half, a's four pairs then b's.
inline i16x16 hadd16(i16x16 a, i16x16 b) {
#if defined(__AVX2__)
  return reinterpret_cast<i16x16>(_mm256_hadd_epi16(reinterpret_cast<__m256i>(a), reinterpret_cast<__m256i>(b)));
#else
  i16x16 r;
  for (int l = 0; l < 2; ++l)
    for (int i = 0; i < 4; ++i) {
      r[8 * l + i] = static_cast<int16_t>(a[8 * l + 2 * i] + a[8 * l + 2 * i + 1]);
      r[8 * l + 4 + i] = static_cast<int16_t>(b[8 * l + 2 * i] + b[8 * l + 2 * i + 1]);
    }
  return r;
#endif
}

// Two rows' lanes summed pairwise into int32 lanes in hadd's order: int32 lanes by vphaddd; int16 lanes whose sums
// of four fit in int16 (vpmaddubsw of codes <= 63: |pair| <= 16002) pairwise in int16 first, then widened, which
// gives the same int32 lanes (hadd(pair_sums(a), pair_sums(b)) == pair_sums(hadd16(a, b))) with one vpmaddwd a pair
// of rows instead of two.
inline i32x8 rows_hadd(i32x8 a, i32x8 b) { return hadd(a, b); }
inline i32x8 rows_hadd(i16x16 a, i16x16 b) { return pair_sums(hadd16(a, b)); }

// A step of 64 k over 8 weight rows: dot(c, v) gives row c's lanes (V: int32, or int16 as rows_hadd takes them) of
// the step's first 32 k (v[0]) and second 32 (v[1]); a (from v[0]) and b (from v[1]) their column sums, each pair
// of rows reduced as it is done.
template <class V, class Dot>
inline void step_sums(Dot&& dot, Halves& a, Halves& b) {
  i32x8 p0[4], p1[4];
#pragma GCC unroll 4
  for (int c = 0; c < 8; c += 2) {
    V v[2][2];
    dot(c, v[0]);
    dot(c + 1, v[1]);
    p0[c / 2] = rows_hadd(v[0][0], v[1][0]);
    p1[c / 2] = rows_hadd(v[0][1], v[1][1]);
  }
  a = column_sums(p0);
  b = column_sums(p1);
}

// The scale codes of a block in 8 weight rows (rows[c] + off: row c's block; B::scales16's 16 int8 codes), as
// int32 lanes per step of 64 values: out[s] lane c = row c's codes of groups 4 s .. 4 s + 3 (byte g: group 4 s + g).
template <class B>
inline void scale_codes(const uint8_t* const* rows, int64_t off, i32x8 out[4]) {
  alignas(16) int8_t sc[8][16];
  for (int c = 0; c < 8; ++c) B::scales16(rows[c] + off, sc[c]);
#if defined(__AVX2__)
  __m128i q[2][4];  // rows 4 h .. 4 h + 3, their 32-bit elements s in lane c % 4 of q[h][s]
  for (int h = 0; h < 2; ++h) {
    const __m128i* r = reinterpret_cast<const __m128i*>(sc[4 * h]);
    const __m128i r0 = _mm_load_si128(r), r1 = _mm_load_si128(r + 1), r2 = _mm_load_si128(r + 2),
                  r3 = _mm_load_si128(r + 3);
    const __m128i t0 = _mm_unpacklo_epi32(r0, r1), t1 = _mm_unpackhi_epi32(r0, r1);
    const __m128i t2 = _mm_unpacklo_epi32(r2, r3), t3 = _mm_unpackhi_epi32(r2, r3);
    q[h][0] = _mm_unpacklo_epi64(t0, t2);
    q[h][1] = _mm_unpackhi_epi64(t0, t2);
    q[h][2] = _mm_unpacklo_epi64(t1, t3);
    q[h][3] = _mm_unpackhi_epi64(t1, t3);
  }
  for (int s = 0; s < 4; ++s) out[s] = reinterpret_cast<i32x8>(_mm256_set_m128i(q[1][s], q[0][s]));
#else
  for (int s = 0; s < 4; ++s)
    for (int c = 0; c < 8; ++c) std::memcpy(reinterpret_cast<char*>(&out[s]) + 4 * c, sc[c] + 4 * s, 4);
#endif
}

// How far ahead q4_direct fetches its tile's bytes: into L2 (prefetcht1), three times kStreamAhead; both measured
// faster from DRAM than kStreamAhead into L1 (docs/performance.md).
constexpr int64_t kTileAhead = 3 * kStreamAhead;

// Lanes 8 h .. 8 h + 7 of a vector of floats of any width (the avx512 tier's 16 lanes, or 8: h = 0, itself).
template <class V>
inline f8 part8(const V& v, int h) {
  f8 r;
  std::memcpy(&r, reinterpret_cast<const char*>(&v) + 32 * h, 32);
  return r;
}

// The avx2 tier's build (the avx512 tier's runs the pairs form below: see its int8.cpp)
#if defined(__AVX2__) && !defined(__AVX512F__)
#define COLIBRI_Q4_QUADS 1
// vpdpbusd on 256-bit registers, AVX-VNNI's VEX form: called only where the CPU has AVX-VNNI (int8_vnni).
#define COLIBRI_VNNI256 __attribute__((target("avxvnni")))
COLIBRI_VNNI256 inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_avx_epi32(acc, u, s);
}

// q4_direct_by's sums by vpdpbusd: four consecutive k rows of the tile interleaved bytewise (vpunpck*bw, then
// *wd) give per column the quad of codes (k .. k + 3), which vpdpbusd multiplies by the broadcast quad of x and
// adds into int32 lanes: no int16 window to widen, and one instruction where vpmaddubsw took two. The sums are
// exact either way, so A, and every f32 step after it, are q4_direct_by's. Vector i of a quad step (i < 4) holds
// columns 4 i .. 4 i + 3 and 16 + 4 i .. 16 + 4 i + 3 (low nibbles; i + 4: the high ones, 32 on), put in column
// order once per group. xg % 16 == 0.
template <int R, class Params>
COLIBRI_VNNI256 __attribute__((noinline)) void q4_direct_quads(const uint8_t* tile, int64_t groups, int64_t xg,
                                                               const int8_t* xq, const float* d, const int32_t* qs,
                                                               const float* xs, Params& params, float* tot,
                                                               int64_t ldx, int64_t lds, int64_t ldt) {
  const __m256i nib = _mm256_set1_epi8(15);
  alignas(32) float zt[R][64] = {};
  alignas(32) __m256i cb[R > 1 ? 4 : 1][8];  // R > 1: a window's quad steps, split into nibbles once
  auto quads = [&](int64_t kk, __m256i q[8]) {  // the quads of k rows kk .. kk + 3
    __builtin_prefetch(tile + kk * 32 + kTileAhead, 0, 2);
    __builtin_prefetch(tile + kk * 32 + 64 + kTileAhead, 0, 2);
    const __m256i* t = reinterpret_cast<const __m256i*>(tile + kk * 32);
    const __m256i r0 = _mm256_loadu_si256(t), r1 = _mm256_loadu_si256(t + 1), r2 = _mm256_loadu_si256(t + 2),
                  r3 = _mm256_loadu_si256(t + 3);
    const __m256i a0 = _mm256_unpacklo_epi8(r0, r1), a1 = _mm256_unpackhi_epi8(r0, r1);
    const __m256i b0 = _mm256_unpacklo_epi8(r2, r3), b1 = _mm256_unpackhi_epi8(r2, r3);
    const __m256i v[4] = {_mm256_unpacklo_epi16(a0, b0), _mm256_unpackhi_epi16(a0, b0),
                          _mm256_unpacklo_epi16(a1, b1), _mm256_unpackhi_epi16(a1, b1)};
    for (int i = 0; i < 4; ++i) {
      q[i] = _mm256_and_si256(v[i], nib);
      q[4 + i] = _mm256_and_si256(_mm256_srli_epi16(v[i], 4), nib);
    }
  };
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m256i acc[R][8];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 8; ++i) acc[r][i] = _mm256_setzero_si256();
    for (int64_t w0 = gi * xg; w0 < (gi + 1) * xg; w0 += 16) {  // windows of 4 quad steps
      if constexpr (R > 1)
        for (int s = 0; s < 4; ++s) quads(w0 + 4 * s, cb[s]);
      for (int r = 0; r < R; ++r)
        for (int s = 0; s < 4; ++s) {
          const __m256i xb = reinterpret_cast<__m256i>(broadcast4(xq + r * ldx + w0 + 4 * s));
          __m256i q[8];
          if constexpr (R > 1)
            for (int i = 0; i < 8; ++i) q[i] = cb[s][i];
          else
            quads(w0 + 4 * s, q);
          for (int i = 0; i < 8; ++i) acc[r][i] = dpbusd256(acc[r][i], q[i], xb);
        }
    }
    i32x8 col[R][8];  // columns 8 j .. 8 j + 7
    f8 dv[R], xv[R];
    for (int r = 0; r < R; ++r) {
      for (int h = 0; h < 2; ++h) {
        const __m256i* a = acc[r] + 4 * h;
        col[r][4 * h + 0] = reinterpret_cast<i32x8>(_mm256_permute2x128_si256(a[0], a[1], 0x20));
        col[r][4 * h + 1] = reinterpret_cast<i32x8>(_mm256_permute2x128_si256(a[2], a[3], 0x20));
        col[r][4 * h + 2] = reinterpret_cast<i32x8>(_mm256_permute2x128_si256(a[0], a[1], 0x31));
        col[r][4 * h + 3] = reinterpret_cast<i32x8>(_mm256_permute2x128_si256(a[2], a[3], 0x31));
      }
      const i32x8 base = i32x8{} + qs[r * lds + gi];
      for (int j = 0; j < 8; ++j) col[r][j] += base;
      dv[r] = simd::set1(d[r * lds + gi]);
      xv[r] = simd::set1(xs[r * lds + gi]);
    }
    params(gi, [&](int c, f8 sv, f8 zv) {
      for (int r = 0; r < R; ++r) {
        float* o = tot + r * ldt + c;
        simd::store(o, int8_step<lanes::Lanes8>(simd::load(o), col[r][c / 8], dv[r], sv));
        simd::store(zt[r] + c, simd::fma(zv, xv[r], simd::load(zt[r] + c)));
      }
    });
  }
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < 64; c += 8)
      simd::store(tot + r * ldt + c, simd::load(tot + r * ldt + c) + simd::load(zt[r] + c));
}
#endif

// R rows of x against a full q4 tile (tile: [K][32] bytes): tot (each row's [kCols], zeroed; row r at tot + r *
// ldt) gets each group's f32 steps, then the zero terms' chain (zero * sum(x) per group, in group order, from 0)
// added last, as the row blocks' zero_terms add it; the chain runs beside the groups' integer sums here, where a
// pass of its own waited on each fma. xq: the rows' codes (row r at xq + r * ldx); d, qs, xs: their per-group
// scale, offset term and sum of x (row r's at + r * lds); params(gi, f): calls f(c, s, z) with group gi's scales
// s and zeros z of columns c .. c + 7, for c = 0, 8, .. 56 (a table's row, or q4k's decoded where they are used:
// Q4kDirectParams), once for all the rows. With more than one row a window's codes are split into nibbles once,
// into 1 KiB of L1 that every row reads (each row's integer sums and f32 steps unchanged: the same bits). vnni: the
// sums by q4_direct_quads instead (the avx2 build, where the CPU has AVX-VNNI; elsewhere ignored).
template <int R = 1, class Params>
__attribute__((noinline)) void q4_direct_by(const uint8_t* tile, int64_t groups, int64_t xg, const int8_t* xq,
                                            const float* d, const int32_t* qs, const float* xs, Params&& params,
                                            float* tot, bool vnni, int64_t ldx = 0, int64_t lds = 0,
                                            int64_t ldt = 0) {
#if defined(COLIBRI_Q4_QUADS)
  if (vnni) return q4_direct_quads<R>(tile, groups, xg, xq, d, qs, xs, params, tot, ldx, lds, ldt);
#endif
  const u8x32 nib = u8x32{} + 15;
  alignas(32) float zt[R][64] = {};
  alignas(32) u8x32 cb[R > 1 ? 8 : 1][4];  // R > 1: a window's nibbles, [pair][interleave h, low / high]
  auto nibbles = [&](int64_t kk, u8x32 v[4]) {  // k rows kk, kk + 1 as code pairs: interleave h, low / high
    // this line's successor kTileAhead on (past the tile's end, the next tile's), into L2
    __builtin_prefetch(tile + kk * 32 + kTileAhead, 0, 2);
    const u8x32 r0 = load32(tile + kk * 32), r1 = load32(tile + (kk + 1) * 32);
    const u8x32 a = interleave<0>(r0, r1), b = interleave<1>(r0, r1);
    v[0] = a & nib;
    v[1] = reinterpret_cast<u8x32>(reinterpret_cast<u16x16>(a) >> 4) & nib;
    v[2] = b & nib;
    v[3] = reinterpret_cast<u8x32>(reinterpret_cast<u16x16>(b) >> 4) & nib;
  };
  for (int64_t gi = 0; gi < groups; ++gi) {
    i32x8 acc[R][8] = {};  // acc[r][4 h + v]: columns 16 v + 8 h .. + 7
    for (int64_t w0 = gi * xg; w0 < (gi + 1) * xg; w0 += 16) {  // windows of 8 k pairs
      if constexpr (R > 1)
        for (int p = 0; p < 8; ++p) nibbles(w0 + 2 * p, cb[p]);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq + r * ldx;
        i16x16 c[4] = {};  // interleave h, low / high nibbles
        // unrolled further, GCC reassociates the int16 sums into trees and spills every product
#pragma GCC unroll 2
        for (int p = 0; p < 8; ++p) {
          const int64_t kk = w0 + 2 * p;
          int16_t pr;
          std::memcpy(&pr, xr + kk, 2);
          const s8x32 xb = reinterpret_cast<s8x32>(i16x16{} + pr);
          u8x32 v[4];
          if constexpr (R > 1)
            for (int i = 0; i < 4; ++i) v[i] = cb[p][i];
          else
            nibbles(kk, v);
          for (int i = 0; i < 4; ++i) c[i] += maddubs(v[i], xb);
        }
        for (int h = 0; h < 2; ++h) {
          acc[r][4 * h + 0] += widen<0>(c[2 * h]);
          acc[r][4 * h + 1] += widen<1>(c[2 * h]);
          acc[r][4 * h + 2] += widen<0>(c[2 * h + 1]);
          acc[r][4 * h + 3] += widen<1>(c[2 * h + 1]);
        }
      }
    }
    f8 dv[R], xv[R];
    i32x8 base[R];
    for (int r = 0; r < R; ++r) {
      dv[r] = simd::set1(d[r * lds + gi]);
      xv[r] = simd::set1(xs[r * lds + gi]);
      base[r] = i32x8{} + qs[r * lds + gi];
    }
    params(gi, [&](int c, f8 sv, f8 zv) {
      for (int r = 0; r < R; ++r) {
        float* o = tot + r * ldt + c;
        simd::store(o, int8_step<lanes::Lanes8>(simd::load(o), acc[r][4 * (c / 8 % 2) + c / 16] + base[r], dv[r], sv));
        simd::store(zt[r] + c, simd::fma(zv, xv[r], simd::load(zt[r] + c)));
      }
    });
  }
  for (int r = 0; r < R; ++r)
    for (int64_t col = 0; col < 64; col += 8)
      simd::store(tot + r * ldt + col, simd::load(tot + r * ldt + col) + simd::load(zt[r] + col));
}

// q4_direct_by over a table: prm holds group 0's 64 scales, then its 64 zeros (group stride ldp).
template <int R = 1>
inline void q4_direct(const uint8_t* tile, int64_t groups, int64_t xg, const int8_t* xq, const float* d,
                      const int32_t* qs, const float* xs, const float* prm, int64_t ldp, float* tot, bool vnni,
                      int64_t ldx = 0, int64_t lds = 0, int64_t ldt = 0) {
  q4_direct_by<R>(tile, groups, xg, xq, d, qs, xs,
                  [prm, ldp](int64_t gi, auto&& f) {
                    const float* p = prm + gi * ldp;
                    for (int c = 0; c < 64; c += 8) f(c, simd::load(p + c), simd::load(p + 64 + c));
                  },
                  tot, vnni, ldx, lds, ldt);
}

// q4k's (scale, zero) of one group of the tile at n0 for q4_direct_by, decoded 8 columns at a time where they are
// used (q4k_params' steps, the values a tile's table holds: the same bits): a decode pass skips the table's 24 KiB a
// tile (48 groups of K = 1536), written and read back once, and the 128 floats a group it stored and loaded again.
// w: the weight's codes and supers (check_q4k_layout).
struct Q4kDirectParams {
  Q4kScales w;
  int64_t n0;
  Q4kSupers ds;
  template <class F>
  void operator()(int64_t gi, F&& f) {
    using S = lanes::Lanes;  // (the tier's widest: the avx512 tier decodes 16 columns an operation)
    const uint8_t* pc = q4k_code_row(w, gi, n0);
    if (gi % 8 == 0) q4k_supers<S>(w, gi, n0, kTile, ds);
#pragma GCC unroll 8
    for (int c = 0; c < kTile; c += S::L) {
      S::U codes, mins;
      q4k_group_codes<S>(pc, w.packed(), c, codes, mins);
      S::V s, z;
      q4k_scale_zero<S>(ds, c, codes, mins, true, s, z);
      for (int h = 0; h < S::L / 8; ++h) f(c + 8 * h, part8(s, h), part8(z, h));
    }
  }
};

// One row of x against up to 8 q8 weight rows (w: the first, row stride k; rows >= n read row n - 1, their sums
// land in columns past the tile's end): tot (the row's 8 columns) gets each group's f32 steps in group order
// (grouped: fma with the group's scales, per channel: a plain sum), kept in a register. A step covers 64 k: four
// groups of 16, two of 32, one of 64, or part of a larger group (summed over its steps).
//   Group scales: q8 grouped from prm (the tile's table, group stride lds); q8k (sc, sup set: int8 codes [N, K/16]
//   and f16 supers [N, K/256] of row 0) decoded here, d * sc (exact in f32, the value tile_params gives), four
//   codes per row and step: a table would cost more per weight than the codes' arithmetic.
template <bool Channel>
__attribute__((noinline)) void q8_direct(const int8_t* w, int64_t n, int64_t k, int64_t xg, const int8_t* xq,
                                         const float* d, const float* prm, int64_t lds, const int8_t* sc,
                                         const uint16_t* sup, float* tot) {
  const int8_t* rows[8];
  int64_t rc[8];
  for (int c = 0; c < 8; ++c) {
    rc[c] = std::min<int64_t>(c, n - 1);
    rows[c] = w + rc[c] * k;
  }
  f8 acc = simd::load(tot);
  f8 sd{};       // q8k: the rows' d of the current 256
  i32x8 codes{};  // q8k: the rows' four scale codes of the step (byte g: group 4 s + g)
  auto step = [&](int64_t gi, i32x8 a) {  // linear_steps.h's int8_step
    const f8 dv = simd::set1(d[gi]);
    if constexpr (Channel) {
      acc = int8_step<lanes::Lanes8, true>(acc, a, dv);
    } else if (sc) {
      const int sh = 8 * (3 - static_cast<int>(gi & 3));
      acc = int8_step<lanes::Lanes8>(acc, a, dv, sd * simd::to_f((codes << sh) >> 24));
    } else {
      acc = int8_step<lanes::Lanes8>(acc, a, dv, simd::load(prm + gi * lds));
    }
  };
  i32x8 big{};  // a group of more than 64: its steps' sums
  for (int64_t k0 = 0; k0 < k; k0 += 64) {
    if (sc) {
      if (k0 % 256 == 0)
        for (int c = 0; c < 8; ++c) sd[c] = simd::f16_to_f32(sup[rc[c] * (k / 256) + k0 / 256]);
      for (int c = 0; c < 8; ++c) std::memcpy(&codes[c], sc + rc[c] * (k / 16) + k0 / 16, 4);
    }
    const s8x32 x0 = vload<s8x32>(xq + k0), x1 = vload<s8x32>(xq + k0 + 32);
    Halves a, b;
    step_sums<i32x8>(
        [&](int c, i32x8 v[2]) {
          // the same bytes of the row 8 on (the next call's) into L2, as ublocks_direct's
          __builtin_prefetch(rows[c] + 8 * k + k0, 0, 2);
          v[0] = dot4(vload<s8x32>(rows[c] + k0), x0);
          v[1] = dot4(vload<s8x32>(rows[c] + k0 + 32), x1);
        },
        a, b);
    if (xg == 16) {
      step(k0 / 16, a.lo);
      step(k0 / 16 + 1, a.hi);
      step(k0 / 16 + 2, b.lo);
      step(k0 / 16 + 3, b.hi);
    } else if (xg == 32) {
      step(k0 / 32, a.lo + a.hi);
      step(k0 / 32 + 1, b.lo + b.hi);
    } else {
      big += (a.lo + a.hi) + (b.lo + b.hi);
      if ((k0 + 64) % xg == 0) {
        step(k0 / xg, big);
        big = i32x8{};
      }
    }
  }
  simd::store(tot, acc);
}

// R rows of x (R <= kDirectRows; row r's codes at xq + r * k, its scales at d + r * k / 16, its offsets at
// xoff + r * k / 16, its 8 columns at tot + r * ld) against up to 8 weight rows of blocks whose codes B::ucodes64
// gives unsigned (q6k: u = q + 32; w: the first row's blocks, rows >= n read row n - 1): q8_direct's q8k steps with
// the codes decoded in registers straight from the stored blocks (no buffer of whole rows: decoding 8 rows into
// one and reading it back cost about twice the products). A = sum(u x) - 32 sum(x) per group of 16, exact int32
// as q8_direct's sum(q x): u x by vpmaddubsw (|pair| <= 2 * 63 * 127, no saturation; two rows' pairs summed in
// int16, step_sums<i16x16>), xoff[g] = 32 * sum of the group's x codes; the scale codes of a block moved into the
// rows' lanes once (scale_codes), not a step at a time. With more than one x row a step's codes are decoded once
// into 512 bytes of L1 that every row reads (each row's arithmetic and its order unchanged: the same bits as one
// row at a time, which decoded them again per row).
// The same bytes of the row 8 on (the next call's) are fetched into L2 as these are read: with rows of a few
// blocks (K = 1536: 1260 bytes) each stream is too short for the hardware prefetcher, and fetching into L1 ran
// out of its miss buffers (docs/performance.md).
template <class B, int R>
__attribute__((noinline)) void ublocks_direct(const uint8_t* w, int64_t n, int64_t k, const int8_t* xq, const float* d,
                                              const int32_t* xoff, float* tot, int64_t ld) {
  constexpr int64_t bb = B::kBlockBytes;
  const int64_t nb = k / 256, rs = nb * bb, groups = k / 16;
  const uint8_t* rows[8];
  for (int c = 0; c < 8; ++c) rows[c] = w + std::min<int64_t>(c, n - 1) * rs;
  f8 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = simd::load(tot + r * ld);
  alignas(32) u8x32 ub[R > 1 ? 8 : 1][2];  // R > 1: a step's codes of the 8 weight rows
  for (int64_t b = 0; b < nb; ++b) {
    f8 sd;  // the rows' d of this block
    for (int c = 0; c < 8; ++c) sd[c] = simd::f16_to_f32(B::d_bits(rows[c] + b * bb));
    i32x8 codes4[4];  // per step s, the rows' four scale codes (byte g: group 4 s + g)
    scale_codes<B>(rows, b * bb, codes4);
    auto step = [&](auto S) {
      constexpr int s = decltype(S)::value;
      const int64_t k0 = 256 * b + 64 * s;
      f8 sv[4];  // the rows' d * sc of the step's four groups (every x row's)
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) sv[g] = sd * simd::to_f((codes4[s] << (8 * (3 - g))) >> 24);
      auto decode = [&](int c, u8x32 u[2]) {  // weight row c's codes of the step
        const uint8_t* bp = rows[c] + b * bb;
        __builtin_prefetch(bp + 8 * rs + 64 * s, 0, 2);  // the next call's row: into L2
        B::template ucodes64<s>(bp, u);
      };
      if constexpr (R > 1)
        for (int c = 0; c < 8; ++c) decode(c, ub[c]);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const s8x32 x0 = vload<s8x32>(xq + r * k + k0), x1 = vload<s8x32>(xq + r * k + k0 + 32);
        Halves lo, hi;
        step_sums<i16x16>(
            [&](int c, i16x16 v[2]) {
              u8x32 u[2];
              if constexpr (R > 1) {
                u[0] = ub[c][0];
                u[1] = ub[c][1];
              } else {
                decode(c, u);
              }
              v[0] = maddubs(u[0], x0);
              v[1] = maddubs(u[1], x1);
            },
            lo, hi);
        const i32x8 a[4] = {lo.lo, lo.hi, hi.lo, hi.hi};
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) {  // q8_direct's q8k step, group by group
          const int64_t gi = k0 / 16 + g;
          acc[r] = int8_step<lanes::Lanes8>(acc[r], a[g] - xoff[r * groups + gi], simd::set1(d[r * groups + gi]),
                                            sv[g]);
        }
      }
    };
    step(std::integral_constant<int, 0>{});
    step(std::integral_constant<int, 1>{});
    step(std::integral_constant<int, 2>{});
    step(std::integral_constant<int, 3>{});
  }
  for (int r = 0; r < R; ++r) simd::store(tot + r * ld, acc[r]);
}

// A decode pass's columns [n0, n0 + cols) of the GGUF blocks with q8k's values (each int8 source's
// blocks_linear_i8): 8 rows at a time decoded into the thread's buffers (codes [8][K], sc [8][K/16], sup
// [8][K/256]: in L1/L2 when q8_direct reads them), then q8k's decode steps per x row r into tot + r * ld.
template <class B>
void blocks_q8k_direct(const uint8_t* blocks, int64_t k, int64_t n0, int64_t cols, int64_t t, const int8_t* xq,
                       const float* d, int8_t* codes, int8_t* sc, uint16_t* sup, float* tot, int64_t ld) {
  for (int64_t c = 0; c < cols; c += 8) {
    rows_as_q8k<B>(blocks, k, n0 + c, std::min<int64_t>(8, cols - c), codes, sc, sup);
    for (int64_t r = 0; r < t; ++r)
      q8_direct<false>(codes, cols - c, k, 16, xq + r * k, d + r * (k / 16), nullptr, 0, sc, sup, tot + r * ld + c);
  }
}

// The passes of more than kDirectRows rows of the GGUF blocks with q8k's values (q6k, q3k, iq4_xs: each int8
// source's blocks_linear_i8): chunks of rows decoded whole into q8k's arrays (rows_as_q8k; about 1 MiB of codes a
// chunk, in L2 when they are read, and at least 4 tiles of `unit` columns a thread), each run through the tier's
// q8k_linear_i8 (q8k), which writes y's columns chunk by chunk. The decode is a small share of a long pass.
template <class B, class Q8k>
void blocks_by_q8k_chunks(const at::Tensor& x, const uint8_t* blocks, int64_t n, int64_t unit, at::Tensor& y,
                          Q8k&& q8k) {
  const int64_t k = x.size(1), nb = k / 256, groups = k / 16;
  const int64_t chunk = std::max<int64_t>(4 * unit * at::get_num_threads(), (1 << 20) / k / unit * unit);
  for (int64_t n0 = 0; n0 < n; n0 += chunk) {
    const int64_t rows = std::min(chunk, n - n0);
    at::Tensor codes = at::empty({rows, k}, at::kChar), sc = at::empty({rows, groups}, at::kChar),
               sup = at::empty({rows, nb}, at::kHalf);
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      rows_as_q8k<B>(blocks, k, n0 + b, e - b, codes.data_ptr<int8_t>() + b * k, sc.data_ptr<int8_t>() + b * groups,
                     reinterpret_cast<uint16_t*>(sup.data_ptr<at::Half>()) + b * nb);
    });
    y.narrow(1, n0, rows).copy_(q8k(x, codes, sc, sup));
  }
}

// The int8 op of the GGUF blocks with q8k's values (q6k, q3k, iq4_xs) in each int8 source (its blocks_linear_i8
// checks the arguments): q8k_linear_i8's bits over the codes, scale codes and d decoded from the blocks. Decode
// passes of a kind with unsigned codes (B::kUnsigned: q6k) multiply them in registers (ublocks_direct); the others
// decode 8 rows at a time into the thread's buffers just before q8_direct reads them (columns in tiles of `unit`);
// longer passes decode chunks of rows whole and run the tier's q8k_linear_i8 (q8k) over each. quantize(x):
// the tier's int8 rows of x per 16 values (.q, .d); store(y, acc, t, cols, n0): acc [t][unit] -> y's columns
// [n0, n0 + cols) in y's dtype.
template <class B, class Quantize, class Store, class Q8k>
at::Tensor blocks_i8(const at::Tensor& x, const at::Tensor& blocks, int64_t unit, Quantize&& quantize, Store&& store,
                     Q8k&& q8k) {
  const int64_t t = x.size(0), k = x.size(1), n = blocks.size(0), nb = k / 256, groups = k / 16;
  const uint8_t* bw = blocks.data_ptr<uint8_t>();
  at::Tensor y = at::empty({t, n}, x.options());
  if (t == 0) return y;
  if (t > kDirectRows) {
    blocks_by_q8k_chunks<B>(x, bw, n, unit, y, q8k);
    return y;
  }
  const auto a = quantize(x);
  // q6k: the codes decoded where they are multiplied, once for all the x rows
  constexpr bool fused = B::kUnsigned;
  std::vector<int32_t> xoff(fused ? t * groups : 0);  // 32 * the sum of each group's x codes (ublocks_direct)
  for (int64_t i = 0; i < static_cast<int64_t>(xoff.size()); ++i) {
    int32_t s = 0;
    for (int j = 0; j < 16; ++j) s += a.q[16 * i + j];
    xoff[i] = 32 * s;
  }
  parallel_items((n + unit - 1) / unit, [&](auto&& next) {
    std::vector<float> acc(t * unit);
    std::vector<int8_t> codes(fused ? 0 : 8 * k), sc(fused ? 0 : 8 * groups);
    std::vector<uint16_t> sup(fused ? 0 : 8 * nb);
    for (int64_t blk; (blk = next()) >= 0;) {
      const int64_t n0 = blk * unit, cols = std::min(unit, n - n0);
      std::fill(acc.begin(), acc.end(), 0.f);
      if constexpr (fused) {
        for (int64_t c = 0; c < cols; c += 8) {
          auto rows = [&](int64_t, auto R) {
            ublocks_direct<B, decltype(R)::value>(bw + (n0 + c) * nb * B::kBlockBytes, cols - c, k, a.q, a.d,
                                                  xoff.data(), acc.data() + c, unit);
          };
          with_rows<kDirectRows>(t, 0, rows);
        }
      } else {
        blocks_q8k_direct<B>(bw, k, n0, cols, t, a.q, a.d, codes.data(), sc.data(), sup.data(), acc.data(), unit);
      }
      store(y, acc.data(), t, cols, n0);
    }
  });
  return y;
}

}  // namespace
