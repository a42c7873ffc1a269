// LOSSY linear kernels with int8 activations for the q4 and q8 layouts: AVX-512 VNNI `vpdpbusd` (64 multiply-adds
// of u8 x s8 per instruction, twice the rate of bf16 dot products). Opt-in (EngineConfig.lossy_int8_activations,
// COLIBRI_LOSSY_INT8=1); the exact bf16 kernels (linear.cpp) stay the default.
//
// Activations: each row is quantized on its own, per group of xg inputs (xg = the weight's group; 64 for q8 with
// one scale per channel): d = max|x| / 127, xq = round(x / d) in [-127, 127], and per group the sum of xq and
// the exact f32 sum of x.
// Weights, unsigned operand: q4 codes q in [0, 15] as they are; q8 codes with the sign bit flipped (q + 128).
// Per (row, column, group): A = sum(u * xq) - off * sum(xq) (off = 8 or 128: A = x~ . (q - 8), resp. x~ . q,
// exact in int32), then in f32
//   q4:            y = sum over groups of scale * (d * A), plus (added last) the sum over groups of zero * sum(x)
//   q8 grouped:    y += scale * (d * A)
//   q8 per channel: y += d * A, and y *= scale at the end.
// Invariance: the int32 sums are exact and the f32 steps run per (row, column) over the groups in K order, the
// same for every pass size; row blocks and K chunks only decide which accumulators are live. The output is rounded
// once to x's dtype.
// Two loop forms; the int32 sums are exact whatever the order of their terms, and both run the same f32 steps per
// (row, column) in group order, so a row's result is the same in either (tests/test_int8_kernels.py crosses them):
//   quads (q4 at every T, q8 from kDotMaxRows + 1 rows, x groups of 16 or 32 above kDirectRows): 64-column tiles; the
//     tile's weights for all of K are laid out once as "quads" (4 consecutive k of 16 columns in one 32-bit lane
//     each, 4 vectors per 64 columns; about K * 64 bytes, in L2) and register blocks of up to kRowBlock rows x 64
//     columns walk all of K over them, their f32 sums in L1. q4 passes of at most 4 rows take the quads straight
//     from the stored tile in registers.
//   dot (q8 up to kDotMaxRows rows, x groups a multiple of 64): see q8_dot16; the codes are read as stored.
//   decode (grouped q8 and q8k up to kDirectRows rows, x groups of 16 or 32; q4 passes of one row):
//     generic/int8_decode.h's q8 and q4 forms, shared with the generic tiers (AVX2 instructions, which every CPU of
//     this tier has).

// GGUF K-quants in their stored form (q4k_linear_i8, q8k_linear_i8): the same kernels (Weight.sup set), with each
// group's scale computed where the stored one is read, from the 8-bit codes and the f16 super-scales, in f32 with
// every step rounded: q4k (s, z) = (d * sc, 8 * s - dmin * m), q8k scale = d * sc. Bit for bit the q4 / q8 (group
// 16) results with those scales stored as f32.

// The VNNI code is compiled for that target only (the pragma below): the rest of the library loads on machines
// without it, and Python uses these ops only where /proc/cpuinfo lists avx512_vnni.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "library.h"
#include "tiles.h"
#include "generic/int8_decode.h"
#include "generic/int8_weights.h"
#include "stream.h"
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx512vnni")

namespace {

constexpr int64_t kCols = 64;   // columns per tile (the q4 layout's tile)
constexpr int kRowBlock = 6;    // x rows per register block: 6 x 4 int32 accumulators
constexpr int64_t kSpan = 256;  // k per step of laying out a q4 tile's quads (x groups divide it)
// q8 steps are longer: the transpose then reads 1 KiB runs of each of 16 rows at a time, which keeps each row's
// stream long enough for the hardware prefetcher (docs/performance.md, "Figures moved from source comments")
constexpr int64_t kSpanQ8 = 1024;
constexpr int64_t kQuad = 256;  // bytes of one quad step for 64 columns

enum Kind { kQ4 = 0, kQ8Grouped = 1, kQ8Channel = 2 };

// ---- weights as quads --------------------------------------------------------------------------------------------

struct Tables {
  __m512i q4lo, q4hi, nib;  // q4: 4 tile rows (128 bytes) -> quads of columns 0-15 / 16-31, low nibble mask
  __m512i ta[4], tb[4];     // 16 x 16 dword transpose, one pair of index vectors per stage
  Tables() {
    alignas(64) uint8_t lo[64], hi[64];
    for (int j = 0; j < 16; ++j)
      for (int i = 0; i < 4; ++i) lo[4 * j + i] = static_cast<uint8_t>(32 * i + j), hi[4 * j + i] = lo[4 * j + i] + 16;
    q4lo = _mm512_load_si512(lo);
    q4hi = _mm512_load_si512(hi);
    nib = _mm512_set1_epi8(0x0f);
    for (int s = 0; s < 4; ++s) {
      alignas(64) int32_t a[16], b[16];
      const int bit = 1 << s;
      for (int j = 0; j < 16; ++j) {
        a[j] = (j & bit) ? 16 + (j ^ bit) : j;
        b[j] = (j & bit) ? 16 + j : (j ^ bit);
      }
      ta[s] = _mm512_load_si512(a);
      tb[s] = _mm512_load_si512(b);
    }
  }
};

// Tile rows k..k+3 of a full q4 tile (128 contiguous bytes: byte (k, j) = q[j, k] | q[32 + j, k] << 4) -> 4 quad
// vectors for columns 0-15, 16-31, 32-47, 48-63.
inline void q4_quads(const uint8_t* rows, const Tables& tb, __m512i w[4]) {
  const __m512i a = _mm512_loadu_si512(rows), b = _mm512_loadu_si512(rows + 64);
  const __m512i v0 = _mm512_permutex2var_epi8(a, tb.q4lo, b), v1 = _mm512_permutex2var_epi8(a, tb.q4hi, b);
  w[0] = _mm512_and_si512(v0, tb.nib);
  w[1] = _mm512_and_si512(v1, tb.nib);
  w[2] = _mm512_and_si512(_mm512_srli_epi16(v0, 4), tb.nib);
  w[3] = _mm512_and_si512(_mm512_srli_epi16(v1, 4), tb.nib);
}

// Quads of k in [k0, k0 + kn) of the q4 tile at column n0 into buf [kn/4][64 columns][4].
void q4_chunk(const uint8_t* qw, int64_t np, int64_t k, int64_t n0, int64_t k0, int64_t kn, const Tables& tb,
              uint8_t* buf) {
  const int64_t cols = std::min(kCols, np - n0);
  const uint8_t* tile = qw + n0 * (k / 2);
  if (cols == kCols) {
    for (int64_t s = 0; s < kn / 4; ++s) {
      __m512i w[4];
      q4_quads(tile + (k0 + 4 * s) * 32, tb, w);
      for (int c = 0; c < 4; ++c) _mm512_store_si512(buf + s * kQuad + 64 * c, w[c]);
    }
    return;
  }
  // the last tile of cols (16, 32 or 48) rows is stored as row pairs: byte (k, i) = q[2i, k] | q[2i + 1, k] << 4
  std::memset(buf, 0, kn / 4 * kQuad);
  for (int64_t kk = 0; kk < kn; ++kk)
    for (int64_t j = 0; j < cols; ++j) {
      const uint8_t byte = tile[(k0 + kk) * (cols / 2) + j / 2];
      buf[kk / 4 * kQuad + j * 4 + (kk & 3)] = (j & 1) ? byte >> 4 : byte & 15;
    }
}

// 16 vectors of 16 dwords, transposed in place (stage s swaps bit s of the row and the column index).
inline void transpose16(__m512i r[16], const Tables& tb) {
  for (int s = 0; s < 4; ++s) {
    const int bit = 1 << s;
    for (int i = 0; i < 16; ++i) {
      if (i & bit) continue;
      const __m512i a = _mm512_permutex2var_epi32(r[i], tb.ta[s], r[i | bit]);
      const __m512i b = _mm512_permutex2var_epi32(r[i], tb.tb[s], r[i | bit]);
      r[i] = a;
      r[i | bit] = b;
    }
  }
}

// q8 rows [n0, n0 + 64) (those below n), k in [k0, k0 + kn), as quads of q + 128 into buf.
void q8_chunk(const int8_t* qw, int64_t n, int64_t k, int64_t n0, int64_t k0, int64_t kn, const Tables& tb,
              uint8_t* buf) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int c = 0; c < 4; ++c)
    for (int64_t kk = 0; kk < kn; kk += 64) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t row = n0 + 16 * c + i;
        r[i] = row < n ? _mm512_loadu_si512(qw + row * k + k0 + kk) : _mm512_setzero_si512();
      }
      transpose16(r, tb);
      for (int m = 0; m < 16; ++m)
        _mm512_store_si512(buf + (kk / 4 + m) * kQuad + 64 * c, _mm512_xor_si512(r[m], flip));
    }
}

// ---- the register block --------------------------------------------------------------------------------------------

// tot[R][64] += this group's terms for R rows: `steps` quads from `src`, x codes xq (row stride ldx), the rows'
// group scale d and code sum qs (stride ldg), and the group's column scales prm[0..3].
// Never inlined: inlined into the tile loop, GCC 12 spilled the accumulators on every step.
template <int R, int K, class Src>
__attribute__((noinline)) void group_dot(Src&& src, int64_t steps, const int8_t* xq, int64_t ldx, const float* d,
                                         const int32_t* qs, int64_t ldg, const __m512* prm, float* tot) {
  constexpr int32_t off = K == kQ4 ? 8 : 128;
  __m512i c[R][4];  // start at -off * sum(xq): the offset of the unsigned codes, exact in int32
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) c[r][j] = _mm512_set1_epi32(-off * qs[r * ldg]);
  for (int64_t p = 0; p < steps; ++p) {
    __m512i w[4];
    src(p, w);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, xq + r * ldx + 4 * p, 4);
      const __m512i xb = _mm512_set1_epi32(quad);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) c[r][j] = _mm512_dpbusd_epi32(c[r][j], w[j], xb);
    }
  }
  // the sums go through memory: with the f32 steps below working on the registers, GCC 12 kept a stack copy of
  // every accumulator up to date on each step of the loop above
  alignas(64) int32_t sums[R][kCols];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm512_store_si512(sums[r] + 16 * j, c[r][j]);
  for (int r = 0; r < R; ++r) {
    const __m512 dv = _mm512_set1_ps(d[r * ldg]);
    for (int j = 0; j < 4; ++j) {  // linear_steps.h's int8_step
      float* o = tot + r * kCols + 16 * j;
      _mm512_storeu_ps(o, int8_step<lanes::Lanes16, K == kQ8Channel>(_mm512_loadu_ps(o),
                                                                     _mm512_load_si512(sums[r] + 16 * j), dv, prm[j]));
    }
  }
}

// (scale, zero) of q4 group gi for the 64 columns at n0 (zero past the last column): the exact kernels' own
// (tiles.h), q4k's with the codes counted from 8 as the q4 quads are.
void q4_params(const Weight& w, int64_t gi, int64_t n0, __m512 prm[8], Q4kSupers& ds) {
  if (w.sup)
    return q4k_params(w.q4k, gi, n0, true, lanes_of(prm), lanes_of(prm + 4), ds);
  q4_pairs_params(Q4{w.qw, static_cast<const uint8_t*>(w.sc), w.st, w.cols, w.k, w.g}, w.pairs, gi, n0, lanes_of(prm),
                  lanes_of(prm + 4));
}

// ---- q8, small passes: the dot form ---------------------------------------------------------------------------
// Passes of at most kDotMaxRows rows, x groups a multiple of 64: no quads (at one row, nothing would share their
// transpose). Per 16 columns and 64 k, the 16 weight rows' bytes are regrouped by 16-byte blocks in registers (8
// shuffles per 4 rows): one vpdpbusd against x's block q (broadcast) then adds into 4 dword partials for each of 4
// columns, and at the end of a group two shuffle-add levels sum each column's 4 partials: one vector of 16 columns'
// A, in order. The int32 sums are exact, so A is the quads form's, and the f32 steps after it are the same code.

constexpr int kDotRows = 4;      // x rows per register block
constexpr int64_t kDotSpan = 1024;  // k per chunk: 16 KiB of a block's codes
// the quads form from 17 rows: where the two forms' costs cross (docs/performance.md, "Figures moved from source
// comments")
constexpr int64_t kDotMaxRows = 16;

// 4 rows' 64 bytes -> W[q] = (block q of a0, of a1, of a2, of a3)
inline void blocks4(const __m512i a[4], __m512i wv[4]) {
  const __m512i t0 = _mm512_shuffle_i64x2(a[0], a[1], 0x44), t1 = _mm512_shuffle_i64x2(a[0], a[1], 0xEE);
  const __m512i t2 = _mm512_shuffle_i64x2(a[2], a[3], 0x44), t3 = _mm512_shuffle_i64x2(a[2], a[3], 0xEE);
  wv[0] = _mm512_shuffle_i64x2(t0, t2, 0x88);
  wv[1] = _mm512_shuffle_i64x2(t0, t2, 0xDD);
  wv[2] = _mm512_shuffle_i64x2(t1, t3, 0x88);
  wv[3] = _mm512_shuffle_i64x2(t1, t3, 0xDD);
}

// v[c]: block i holds 4 partials of column 4i + c -> lane j = column j's sum.
inline __m512i reduce16(const __m512i v[4]) {
  const __m512i u0 = _mm512_add_epi32(_mm512_unpacklo_epi64(v[0], v[1]), _mm512_unpackhi_epi64(v[0], v[1]));
  const __m512i u1 = _mm512_add_epi32(_mm512_unpacklo_epi64(v[2], v[3]), _mm512_unpackhi_epi64(v[2], v[3]));
  const __m512 p0 = _mm512_castsi512_ps(u0), p1 = _mm512_castsi512_ps(u1);
  return _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(p0, p1, 0x88)),
                          _mm512_castps_si512(_mm512_shuffle_ps(p0, p1, 0xDD)));
}

// tot[R][16] (in and out) += the f32 steps of the groups in [k0, k1) for the pass rows r0 .. r0 + R - 1 and the 16
// columns whose code rows are rows[0..15]; grouped: their scales prm [groups][16] (q8_scale_table).
template <int R, int K>
__attribute__((noinline)) void q8_dot16(const Weight& w, const Activations& a, const int8_t* const* rows,
                                        const float* prm, int64_t r0, int64_t k0, int64_t k1, float* tot) {
  constexpr int32_t off = 128;
  const int64_t k = w.k, xg = w.g, groups = a.groups;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 tv[R];
  for (int r = 0; r < R; ++r) tv[r] = _mm512_loadu_ps(tot + r * 16);
  for (int64_t gi = k0 / xg; gi < k1 / xg; ++gi) {
    __m512i v[R][4];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) v[r][c] = _mm512_setzero_si512();
    for (int64_t kk = gi * xg; kk < (gi + 1) * xg; kk += 64) {
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        __m512i rw[4], wv[4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) rw[i] = _mm512_xor_si512(_mm512_loadu_si512(rows[4 * i + c] + kk), flip);
        blocks4(rw, wv);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = a.q + (r0 + r) * k + kk;
#pragma GCC unroll 4
          for (int q = 0; q < 4; ++q)
            v[r][c] = _mm512_dpbusd_epi32(
                v[r][c], wv[q], _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xr + 16 * q))));
        }
      }
    }
    const __m512 sv = K == kQ8Grouped ? _mm512_loadu_ps(prm + gi * 16) : _mm512_setzero_ps();  // the group's scales
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {  // the f32 steps of group_dot
      const int64_t o = (r0 + r) * groups + gi;
      const __m512i cj = _mm512_add_epi32(reduce16(v[r]), _mm512_set1_epi32(-off * a.qs[o]));
      tv[r] = int8_step<lanes::Lanes16, K == kQ8Channel>(tv[r], cj, _mm512_set1_ps(a.d[o]), sv);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(tot + r * 16, tv[r]);
}

// q8 per channel: acc[r][j] *= the scale of column n0 + j, for cols columns of t rows (row stride lda).
void scale_columns(const Weight& w, int64_t n0, int64_t cols, int64_t t, float* acc, int64_t lda) {
  for (int64_t j = 0; j < cols; ++j) {
    const float s = load1(w.sc, n0 + j, w.st);
    for (int64_t r = 0; r < t; ++r) acc[r * lda + j] *= s;
  }
}

template <int K>
at::Tensor linear_i8(const at::Tensor& x, const Weight& w) {
  const int64_t t = x.size(0), k = w.k, xg = w.g;
  at::Tensor y = at::empty({t, w.cols}, x.options());
  if (t == 0) return y;
  const Activations a = quantize_rows(x, xg);
  const int64_t groups = a.groups;
  const Tables tb;
  const int64_t tiles = (w.cols + kCols - 1) / kCols;
  // q4_direct's offset term of A per (row, group): -8 * the sum of the x codes
  std::vector<int32_t> qoff(K == kQ4 && t == 1 ? groups : 0);
  for (size_t i = 0; i < qoff.size(); ++i) qoff[i] = -8 * a.qs[i];
  parallel_items(tiles, [&](auto&& next) {
    static thread_local std::vector<__m512i> quads;  // a tile's quads for all of K (K * 64 bytes: in L2 while the
                                                     // row blocks pass), kept for the thread's next call
    std::vector<__m512> prm(groups * 8);
    Q4kSupers ds;  // q4k: a super-block's (d, dmin), for q4_params
    for (int64_t tile; (tile = next()) >= 0;) {
      const int64_t n0 = tile * kCols, cols = std::min(kCols, w.cols - n0);
      // q4 quads straight from the tile for passes of at most 4 rows (above, the unpacking repeated in every
      // register block costs more than laying the quads out once); the same codes either way
      const bool direct = K == kQ4 && cols == kCols && t <= 4;
      // one row: int8_decode.h's q4 decode form (the generic tiers' own), which reads the tile's bytes as stored and
      // ran faster from DRAM than the quads made from them in registers (docs/performance.md)
      const bool q4_row = direct && t == 1;
      const bool q4k_row = q4_row && w.sup;  // q4k: each group's scales decoded where q4_direct_by uses them
      if constexpr (K == kQ4)
        for (int64_t gi = 0; gi < (q4k_row ? 0 : groups); ++gi) q4_params(w, gi, n0, &prm[gi * 8], ds);
      if constexpr (K == kQ8Grouped)  // per group the 64 scales in its first 4 vectors
        q8_scale_table(w, n0, cols, groups, reinterpret_cast<float*>(prm.data()), kCols, 8 * 16);
      uint8_t* buf = nullptr;
      if (!direct) {
        quads.resize(k);
        buf = reinterpret_cast<uint8_t*>(quads.data());
        constexpr int64_t span = K == kQ4 ? kSpan : kSpanQ8;
        for (int64_t k0 = 0; k0 < k; k0 += span) {
          const int64_t kn = std::min(span, k - k0);
          if constexpr (K == kQ4) q4_chunk(w.qw, w.cols, k, n0, k0, kn, tb, buf + k0 / 4 * kQuad);
          else q8_chunk(reinterpret_cast<const int8_t*>(w.qw), w.cols, k, n0, k0, kn, tb, buf + k0 / 4 * kQuad);
        }
      }
      const uint8_t* tp = w.qw + n0 * (k / 2);
      row_blocks<kRowBlock>(t, [&](int64_t r0, auto R) {  // each block over all of K: its sums stay in L1
        constexpr int rr = decltype(R)::value;
        alignas(64) float tot[rr * kCols];
        __m512 zero = _mm512_setzero_ps();
        for (int i = 0; i < rr * kCols; i += 16) {
          asm("" : "+v"(zero));  // keeps GCC from making this a `rep stos`, whose startup costs more than 16 stores
          _mm512_store_ps(tot + i, zero);
        }
        // (the pairs form: its quads by vpdpbusd, q4_direct_quads, ran the one-row kernel 0.87x the time, yet the
        // 1.5B's LOSSY decode step 4 % slower, its Q6_K calls the slower part: docs/performance.md)
        if (q4k_row)
          q4_direct_by(tp, groups, xg, a.q, a.d, qoff.data(), a.xs,
                       Q4kDirectParams{w.q4k, n0}, tot, false);
        else if (q4_row)  // prm as floats: per group the 64 scales, then the 64 zeros (q4_direct's table)
          q4_direct(tp, groups, xg, a.q, a.d, qoff.data(), a.xs, reinterpret_cast<const float*>(prm.data()), 2 * kCols,
                    tot, false);
        for (int64_t gi = 0; gi < (q4_row ? 0 : groups); ++gi) {
          const int64_t kg = gi * xg, off = r0 * groups + gi;
          const int8_t* xq = a.q + r0 * k + kg;
          if (direct) {
            group_dot<rr, K>([&](int64_t p, __m512i* v) {
                               prefetch_ahead(tp + (kg + 4 * p) * 32);
                               prefetch_ahead(tp + (kg + 4 * p) * 32 + 64);
                               q4_quads(tp + (kg + 4 * p) * 32, tb, v);
                             }, xg / 4, xq, k,
                             a.d + off, a.qs + off, groups, &prm[gi * 8], tot);
          } else {
            const uint8_t* qb = buf + kg / 4 * kQuad;
            group_dot<rr, K>(
                [&](int64_t p, __m512i* v) {
                  for (int c = 0; c < 4; ++c) v[c] = _mm512_load_si512(qb + p * kQuad + 64 * c);
                },
                xg / 4, xq, k, a.d + off, a.qs + off, groups, &prm[gi * 8], tot);
          }
        }
        if (K == kQ4 && !q4_row)  // zero * sum(x) per group, in group order, added last (q4_direct adds its own)
          for (int r = 0; r < rr; ++r) {
            __m512 zv[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int64_t gi = 0; gi < groups; ++gi) {
              const __m512 xv = _mm512_set1_ps(a.xs[(r0 + r) * groups + gi]);
              for (int j = 0; j < 4; ++j) zv[j] = _mm512_fmadd_ps(prm[gi * 8 + 4 + j], xv, zv[j]);
            }
            float* o = tot + r * kCols;
            for (int j = 0; j < 4; ++j) _mm512_storeu_ps(o + 16 * j, _mm512_add_ps(_mm512_loadu_ps(o + 16 * j), zv[j]));
          }
        if constexpr (K == kQ8Channel) scale_columns(w, n0, cols, rr, tot, kCols);
        store_rows(tot, kCols, rr, cols, y, n0, r0);  // linear_steps.h
      });
    }
  });
  return y;
}

// q8 with x groups a multiple of 64, up to kDotMaxRows rows: 16-column blocks (parallel), K in chunks of kDotSpan
// (the block's codes stay in L1), row blocks of up to kDotRows rows.
template <int K>
at::Tensor q8_linear_dot(const at::Tensor& x, const Weight& w) {
  const int64_t t = x.size(0), k = w.k;
  at::Tensor y = at::empty({t, w.cols}, x.options());
  if (t == 0) return y;
  const Activations a = quantize_rows(x, w.g);
  const std::vector<int8_t> zrow(k);
  const int8_t* qw = reinterpret_cast<const int8_t*>(w.qw);
  parallel_items((w.cols + 15) / 16, [&](auto&& next) {
    std::vector<float> acc(t * 16), prm(K == kQ8Grouped ? a.groups * 16 : 0);
    const int8_t* rows[16];
    for (int64_t blk; (blk = next()) >= 0;) {
      const int64_t n0 = blk * 16, cols = std::min<int64_t>(16, w.cols - n0);
      for (int j = 0; j < 16; ++j) rows[j] = j < cols ? qw + (n0 + j) * k : zrow.data();  // zero codes past the end
      if constexpr (K == kQ8Grouped) q8_scale_table(w, n0, cols, a.groups, prm.data(), 16, 16);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t k0 = 0; k0 < k; k0 += kDotSpan) {
        const int64_t k1 = std::min(k, k0 + kDotSpan);
        for (int64_t r0 = 0; r0 < t; r0 += kDotRows) {
          float* tot = acc.data() + r0 * 16;
          switch (std::min<int64_t>(kDotRows, t - r0)) {
            case 1: q8_dot16<1, K>(w, a, rows, prm.data(), r0, k0, k1, tot); break;
            case 2: q8_dot16<2, K>(w, a, rows, prm.data(), r0, k0, k1, tot); break;
            case 3: q8_dot16<3, K>(w, a, rows, prm.data(), r0, k0, k1, tot); break;
            default: q8_dot16<kDotRows, K>(w, a, rows, prm.data(), r0, k0, k1, tot); break;
          }
        }
      }
      if constexpr (K == kQ8Channel) scale_columns(w, n0, cols, t, acc.data(), 16);
      store_rows(acc.data(), 16, t, cols, y, n0);
    }
  });
  return y;
}

// Grouped q8 passes of at most kDirectRows rows whose x groups the dot form does not take (q8k's 16, and 32):
// generic/int8_decode.h's q8 decode form, 64-column blocks (parallel). The same int32 sums and f32 steps per (row,
// column, group) as the quads, so the same bits. q8k decodes its scales from the codes; q8 reads a table of the
// block's [G][64] scales.
at::Tensor q8_decode(const at::Tensor& x, const Weight& w) {
  const int64_t t = x.size(0), k = w.k, xg = w.g, groups = k / xg;
  at::Tensor y = at::empty({t, w.cols}, x.options());
  if (t == 0) return y;
  const Activations a = quantize_rows(x, xg);
  const int8_t* qw = reinterpret_cast<const int8_t*>(w.qw);
  const int8_t* sc = w.sup ? static_cast<const int8_t*>(w.sc) : nullptr;
  parallel_items((w.cols + kCols - 1) / kCols, [&](auto&& next) {
    alignas(64) float acc[kDirectRows * kCols];
    std::vector<float> prm(w.sup ? 0 : groups * kCols);
    for (int64_t blk; (blk = next()) >= 0;) {
      const int64_t n0 = blk * kCols, cols = std::min(kCols, w.cols - n0);
      if (!w.sup) q8_scale_table(w, n0, cols, groups, prm.data());
      std::fill(acc, acc + t * kCols, 0.f);
      for (int64_t r = 0; r < t; ++r)
        for (int64_t c = 0; c < cols; c += 8)
          q8_direct<false>(qw + (n0 + c) * k, cols - c, k, xg, a.q + r * k, a.d + r * groups,
                           w.sup ? nullptr : prm.data() + c, kCols, w.sup ? sc + (n0 + c) * groups : nullptr,
                           w.sup ? w.sup + (n0 + c) * (k / 256) : nullptr, acc + r * kCols + c);
      store_rows(acc, kCols, t, cols, y, n0);
    }
  });
  return y;
}

at::Tensor q4_linear_i8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales_zeros,
                        int64_t group_size) {
  return linear_i8<kQ4>(x, q4_weight(x, qweight, scales_zeros, group_size));
}

// q8 (w.g: the x group; group_size 0: per channel): the dot form for small passes where the x group allows it.
at::Tensor q8_run(const at::Tensor& x, const Weight& w, int64_t group_size) {
  const int64_t xg = w.g;
  if (xg % 64 == 0 && x.size(0) <= kDotMaxRows)
    return group_size ? q8_linear_dot<kQ8Grouped>(x, w) : q8_linear_dot<kQ8Channel>(x, w);
  if (group_size && x.size(0) <= kDirectRows) return q8_decode(x, w);
  return group_size ? linear_i8<kQ8Grouped>(x, w) : linear_i8<kQ8Channel>(x, w);
}

at::Tensor q8_linear_i8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t group_size) {
  return q8_run(x, q8_weight(x, qweight, scales, group_size), group_size);
}

at::Tensor q4_1_linear_i8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales_mins) {
  return linear_i8<kQ4>(x, q4_1_weight(x, qweight, scales_mins));
}

at::Tensor q4_0_linear_i8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  return linear_i8<kQ4>(x, q4_0_weight(x, qweight, scales));
}

at::Tensor q4k_linear_i8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                         const at::Tensor& supers) {
  return linear_i8<kQ4>(x, q4k_weight(x, qweight, scales, supers));
}

at::Tensor q8k_linear_i8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                         const at::Tensor& supers) {
  return q8_run(x, q8k_weight(x, qweight, scales, supers), 16);
}

// GGUF blocks kept as stored whose values are q8k's (q6k, q3k, iq4_xs; gguf_blocks.h): int8_decode.h's blocks_i8
// with this tier's activations, store and q8k_linear_i8 (decode passes: q8_decode's q8_direct).
template <class B>
at::Tensor blocks_linear_i8(const at::Tensor& x, const at::Tensor& blocks, const char* op) {
  check_blocks(x, blocks, op, 256, B::kBlockBytes);
  check_x(x, x.size(1), op);
  return blocks_i8<B>(
      x, blocks, kCols, [](const at::Tensor& x) { return quantize_rows(x, 16); },
      [](at::Tensor& y, const float* acc, int64_t t, int64_t cols, int64_t n0) {
        store_rows(acc, kCols, t, cols, y, n0);
      },
      q8k_linear_i8);
}

at::Tensor q6k_linear_i8(const at::Tensor& x, const at::Tensor& blocks) {
  return blocks_linear_i8<Q6kBlocks>(x, blocks, "q6k_linear_i8");
}
at::Tensor q3k_linear_i8(const at::Tensor& x, const at::Tensor& blocks) {
  return blocks_linear_i8<Q3kBlocks>(x, blocks, "q3k_linear_i8");
}
at::Tensor iq4_xs_linear_i8(const at::Tensor& x, const at::Tensor& blocks) {
  return blocks_linear_i8<Iq4xsBlocks>(x, blocks, "iq4_xs_linear_i8");
}

// The generic tiers' AVX-VNNI switch (generic/int8.cpp): this tier's int8 ops always use AVX-512 VNNI.
at::Tensor int8_vnni(int64_t) { return at::scalar_tensor(false, at::kBool); }

}  // namespace

#pragma GCC pop_options
