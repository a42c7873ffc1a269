// Shared pieces of the batch-invariant linear kernels (linear.cpp, kquant.cpp): scale loads, the q4 code
// tiles and their outer-form driver, the dot form. See linear.cpp for the invariance argument.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "args.h"
#include "library.h"
#include "parallel.h"
#include "stream.h"
#include "generic/linear_steps.h"
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {  // internal linkage: each tier's library (one translation unit) gets its own copy

constexpr int kRows = 6;    // x rows per register block
constexpr int kChunk = 256; // k per dequantized q4 chunk: 32 KiB of bf16 pairs / 64 KiB of f32
constexpr int kDotCols = 4; // weight rows per dot-form register block

inline __mmask16 tail_mask16(int64_t n) { return n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1); }

inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

// The floats of parameter registers, where linear_steps.h's decoders store a tile's (scale, zero): 16 columns a
// register, written through _mm512_storeu_ps (a may-alias store) and read back as the registers.
inline float* lanes_of(__m512* v) { return reinterpret_cast<float*>(v); }

// ---- outer form: q4 -------------------------------------------------------------------------------------------
// bf16 x: per group, A = x . (q - 8) by vdpbf16ps over exact bf16 codes, then y += scale * A + zero * sum(x),
// the group sum of x computed once per row. f32 x: w = (q - 8) * scale + zero in f32, then fma.

struct QPairTables {  // constants of q4_qpair
  __m512i lut, order;
  QPairTables() {
    alignas(64) uint16_t l[32];
    alignas(64) uint8_t o[64];
    for (int i = 0; i < 32; ++i) l[i] = simd::f32_to_bf16(static_cast<float>((i & 15) - 8));
    for (int j = 0; j < 32; ++j) o[2 * j] = static_cast<uint8_t>(j), o[2 * j + 1] = static_cast<uint8_t>(32 + j);
    lut = _mm512_load_si512(l);
    order = _mm512_load_si512(o);
  }
};

// Rows k, k + 1 of a full tile (64 contiguous bytes) -> 4 vectors of 16 columns x (q[k] - 8, q[k + 1] - 8) as
// bf16 (exact): one byte shuffle interleaves the rows, vpermw maps 5 index bits through a table repeated twice.
inline void q4_qpair(const uint8_t* rows, const QPairTables& tb, __m512i p[4]) {
  __m512i il = _mm512_permutexvar_epi8(tb.order, _mm512_loadu_si512(rows));
  __m512i lo = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(il));        // columns 0-15 | 32-47 (high nibbles)
  __m512i hi = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(il, 1));  // columns 16-31 | 48-63
  p[0] = _mm512_permutexvar_epi16(lo, tb.lut);
  p[1] = _mm512_permutexvar_epi16(hi, tb.lut);
  p[2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(lo, 4), tb.lut);
  p[3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(hi, 4), tb.lut);
}

// Codes of k in [k0, k0 + kn) of the tile at n0 as bf16 pairs [kn/2][64][2] (the tail tile zero-padded).
void q4_codes_chunk(const Q4& w, int64_t n0, int64_t k0, int64_t kn, const QPairTables& tb, uint16_t* buf) {
  const int64_t cols = std::min<int64_t>(kTile, w.np - n0);
  if (cols == kTile) {
    const uint8_t* tile = w.qw + n0 * (w.k / 2);
    for (int64_t k = k0; k < k0 + kn; k += 2) {
      __m512i p[4];
      q4_qpair(tile + k * 32, tb, p);
      for (int c = 0; c < 4; ++c) _mm512_store_si512(buf + (k - k0) / 2 * 128 + 32 * c, p[c]);
    }
    return;
  }
  for (int64_t k = 0; k < kn; ++k)
    for (int64_t j = 0; j < kTile; ++j)
      buf[((k / 2) * kTile + j) * 2 + (k & 1)] =
          j < cols ? simd::f32_to_bf16(static_cast<float>(q4_code(w, n0, cols, j, k0 + k) - 8)) : 0;
}

// tot[R][64] += s * A + z * xsum for one group, A = x[R rows] . (q - 8) over `npairs` code pairs from `src`.
template <int R, class Src>
inline void q4_group(Src&& src, int64_t npairs, const uint16_t* x, int64_t ldx, const float* xs, int64_t ldxs,
                     const __m512 s[4], const __m512 z[4], float* tot) {
  __m512 c[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) c[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < npairs; ++p) {
    __m512i w[4];
    src(p, w);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < 4; ++j) c[r][j] = _mm512_dpbf16_ps(c[r][j], (__m512bh)w[j], xb);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 xv = _mm512_set1_ps(xs[r * ldxs]);
    for (int j = 0; j < 4; ++j) {
      float* o = tot + r * kTile + 16 * j;
      _mm512_storeu_ps(o, q4_group_step<lanes::Lanes16>(_mm512_loadu_ps(o), c[r][j], s[j], z[j], xv));
    }
  }
}

// Weights w = (q + off) * scale + zero (exact f32, as dequantize()) of k in [k0, k0 + kn): f32 [kn][64], with
// params(group, n0, scale, zero) writing a group's parameters, 64 floats each (q4: off = -8, its stored scale and
// zero).
template <class Params>
void q4_weights_chunk(const Q4& w, int64_t n0, int64_t k0, int64_t kn, float* buf, Params&& params, int off) {
  const int64_t cols = std::min<int64_t>(kTile, w.np - n0);
  const __m512 lut = _mm512_add_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                   _mm512_set1_ps(static_cast<float>(off)));
  const uint8_t* tile = w.qw + n0 * (w.k / 2);
  __m512 s[4], z[4];
  for (int64_t g0 = k0; g0 < k0 + kn; g0 += w.g) {  // chunks start on group boundaries (kChunk % g == 0)
    params(g0 / w.g, n0, lanes_of(s), lanes_of(z));
    for (int64_t k = g0; k < g0 + w.g; ++k) {
      __m512 f[4];
      if (cols == kTile) {
        __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + k * 32));
        __m512i i0 = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(b));       // columns 0-15 | 32-47
        __m512i i1 = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(b, 1));  // columns 16-31 | 48-63
        f[0] = _mm512_permutexvar_ps(i0, lut);  // vpermps reads 4 index bits
        f[1] = _mm512_permutexvar_ps(i1, lut);
        f[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(i0, 4), lut);
        f[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(i1, 4), lut);
      } else {
        alignas(64) float q[kTile];
        for (int64_t j = 0; j < kTile; ++j)
          q[j] = j < cols ? static_cast<float>(q4_code(w, n0, cols, j, k) + off) : 0.f;
        for (int c = 0; c < 4; ++c) f[c] = _mm512_load_ps(q + 16 * c);
      }
      for (int c = 0; c < 4; ++c)
        _mm512_store_ps(buf + (k - k0) * kTile + 16 * c, _mm512_add_ps(_mm512_mul_ps(f[c], s[c]), z[c]));
    }
  }
}

template <int R>
void outer_f32(const float* buf, int64_t kn, const float* x, int64_t ldx, float* acc, bool first) {
  __m512 c[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) c[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + r * kTile + 16 * j);
  for (int64_t k = 0; k < kn; ++k) {
    const float* wk = buf + k * kTile;
    __m512 w0 = _mm512_load_ps(wk), w1 = _mm512_load_ps(wk + 16), w2 = _mm512_load_ps(wk + 32),
           w3 = _mm512_load_ps(wk + 48);
    for (int r = 0; r < R; ++r) {
      __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      c[r][0] = _mm512_fmadd_ps(xb, w0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(xb, w1, c[r][1]);
      c[r][2] = _mm512_fmadd_ps(xb, w2, c[r][2]);
      c[r][3] = _mm512_fmadd_ps(xb, w3, c[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + r * kTile + 16 * j, c[r][j]);
}

// The outer-form driver over 64-column code tiles (q4 and the two-level q4k): bf16 x uses
// params_bf16(group, n0, s, z, ds) for w ~ (q - 8) * s + z (the exact codes in the dot product, s and z in
// f32 after it); f32 x multiplies the exact weights of q4_weights_chunk(params_f32, off). ds: the thread's
// Q4kSupers (a tile's groups are asked for in order from 0).
template <class PB, class PF>
at::Tensor q4_tiles_linear(const at::Tensor& x, const Q4& w, PB&& params_bf16, PF&& params_f32, int off) {
  const int64_t t = x.size(0), k = w.k, np = w.np, g = w.g;
  const bool bf = x.scalar_type() == at::kBFloat16;
  at::Tensor y = at::empty({t, np}, x.options());
  const int64_t tiles = (np + kTile - 1) / kTile, groups = k / g;
  const uint16_t* xb = bf ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  std::vector<float> xs(bf ? t * groups : 0);  // the group sums of bf16 x [T][G]
  for (int64_t r = 0; bf && r < t; ++r)
    for (int64_t gi = 0; gi < groups; ++gi) xs[r * groups + gi] = group_sum(xb + r * k + gi * g, g);
  const QPairTables tb;
  parallel_items(tiles, [&](auto&& next) {
    std::vector<float> acc(t * kTile + 16);
    alignas(64) static thread_local float buf[kChunk * kTile];  // 64 KiB: f32 weights or (2x) bf16 code pairs
    alignas(64) static thread_local __m512 params[kChunk / 32][8];
    Q4kSupers ds;
    auto pf = [&](int64_t gi, int64_t n0, float* sv, float* zv) { params_f32(gi, n0, sv, zv, ds); };
    for (int64_t tile; (tile = next()) >= 0;) {
      const int64_t n0 = tile * kTile;
      const bool full = np - n0 >= kTile;
      if (bf) std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
        const int64_t kn = std::min<int64_t>(kChunk, k - k0), ng = kn / g;
        if (!bf) {
          q4_weights_chunk(w, n0, k0, kn, buf, pf, off);
          for_rows<kRows>(t, [&](int64_t r0, auto R) {
            outer_f32<decltype(R)::value>(buf, kn, x.data_ptr<float>() + r0 * k + k0, k, acc.data() + r0 * kTile,
                                          k0 == 0);
          });
          continue;
        }
        for (int64_t i = 0; i < ng; ++i)
          params_bf16(k0 / g + i, n0, lanes_of(params[i]), lanes_of(params[i] + 4), ds);
        if (full && t <= kRows) {  // decode: codes straight from the tile, no buffer (same values, same order)
          const uint8_t* tp = w.qw + n0 * (k / 2);
          for_rows<kRows>(t, [&](int64_t r0, auto R) {
            for (int64_t i = 0; i < ng; ++i) {
              const int64_t kg = k0 + i * g;
              q4_group<decltype(R)::value>([&](int64_t p, __m512i* v) {
                                             prefetch_ahead(tp + (kg + 2 * p) * 32);
                                             q4_qpair(tp + (kg + 2 * p) * 32, tb, v);
                                           },
                                           g / 2, xb + r0 * k + kg, k, xs.data() + r0 * groups + kg / g, groups,
                                           params[i], params[i] + 4, acc.data() + r0 * kTile);
            }
          });
          continue;
        }
        uint16_t* cb = reinterpret_cast<uint16_t*>(buf);
        q4_codes_chunk(w, n0, k0, kn, tb, cb);
        for_rows<kRows>(t, [&](int64_t r0, auto R) {
          for (int64_t i = 0; i < ng; ++i) {
            const int64_t kg = k0 + i * g;
            const uint16_t* gb = cb + i * g * kTile;
            q4_group<decltype(R)::value>(
                [&](int64_t p, __m512i* v) {
                  for (int c = 0; c < 4; ++c) v[c] = _mm512_load_si512(gb + p * 128 + 32 * c);
                },
                g / 2, xb + r0 * k + kg, k, xs.data() + r0 * groups + kg / g, groups, params[i], params[i] + 4,
                acc.data() + r0 * kTile);
          }
        });
      }
      store_rows(acc.data(), kTile, t, std::min<int64_t>(kTile, np - n0), y, n0);
    }
  });
  return y;
}

// ---- dot form: dense rows, q8 ----------------------------------------------------------------------------------

// 32 weights as bf16: stored bf16, or q8 codes widened exactly (|q| <= 127 fits bf16's 8 bits).
inline __m512bh load_w32(const uint16_t* p, __mmask32 m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }
inline __m512bh load_w32(const int8_t* p, __mmask32 m) {
  __m256i b = _mm256_maskz_loadu_epi8(m, p);
  __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
  __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// 32 int8 codes times the scale of codes 0-15 and of codes 16-31 (f32, exact), rounded to bf16 (RNE per lane, as
// _mm512_cvtneps_pbh in q8_store16): the weights the int8-valued sources (grouped q8, q8k and the GGUF blocks kept
// as stored) hand vdpbf16ps; and 16 codes times one scale in f32, for f32 x.
inline __m512 scaled_f32(__m128i q, float s) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(s));
}
inline __m512bh scaled_bf16(__m256i q, float s_lo, float s_hi) {
  return _mm512_cvtne2ps_pbh(scaled_f32(_mm256_extracti128_si256(q, 1), s_hi),
                             scaled_f32(_mm256_castsi256_si128(q), s_lo));
}
// The same for the 32 codes at p: each half widened straight from memory (no 256-bit load and lane extract).
inline __m512bh scaled_bf16(const int8_t* p, float s_lo, float s_hi) {
  return _mm512_cvtne2ps_pbh(scaled_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)), s_hi),
                             scaled_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), s_lo));
}
// The same minus an offset per 16 codes (q5k, q2k: q * (d * sc) - dmin * m; q5_1: d * q - (-m)): one fused
// multiply-subtract, whose product is exact (at most 22 significant bits), so its one rounding is the
// subtraction's (gguf's two f32 steps).
inline __m512bh scaled_min_bf16(__m256i q, float s_lo, float s_hi, float z_lo, float z_hi) {
  const __m512 lo = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))),
                                    _mm512_set1_ps(s_lo), _mm512_set1_ps(z_lo));
  const __m512 hi = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))),
                                    _mm512_set1_ps(s_hi), _mm512_set1_ps(z_hi));
  return _mm512_cvtne2ps_pbh(hi, lo);
}
inline __m512 scaled_min_f32(__m128i q, float s, float z) {
  return _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(s), _mm512_set1_ps(z));
}

// Weight rows of the dot form as a source: bf16(j, k0) gives 32 bf16 weights of row j from column k0, f32(j, k0)
// 16 f32 ones, both masked by m; at(j, k0) is where they are read from, and kStream says whether that is the
// weights as stored (read once from DRAM at decode: prefetched) or a buffer in L2. Stored rows (bf16, f32, or q8
// codes widened exactly):
template <typename W, bool Stream = false>
struct StoredRows {
  static constexpr bool kStream = Stream;
  const W* w;
  int64_t ldw;
  __m512bh bf16(int64_t j, int64_t k0, __mmask32 m) const { return load_w32(w + j * ldw + k0, m); }
  __m512 f32(int64_t j, int64_t k0, __mmask16 m) const { return _mm512_maskz_loadu_ps(m, w + j * ldw + k0); }
  const void* at(int64_t j, int64_t k0) const { return w + j * ldw + k0; }
};

// acc[R][C] (+)= lane partials of x[R rows] . w[C rows j0 ..] over columns [kb, kb + kn) (32 bf16 per step), the
// tail masked; x points at column kb.
// Both forms fetch the rows kDotAhead further on (j0 + kDotAhead ..) at the columns they read: the block's rows
// are walked side by side in chunks of kDotChunk, streams too short for the hardware prefetcher; these lines are
// used a block of 16 rows later (decode_rows' parallel block: within a block of up to 64 they are its own rows
// further on). The next register block's rows (C ahead: about C * kDotChunk weights) arrived too late from DRAM
// (docs/performance.md, "Prefetch distance of the dot form"). (Stream: decode passes over stored weights; a
// prefill pass reuses each line R times and takes no extra instructions.)
constexpr int64_t kDotAhead = 16;

template <int R, int C, bool Stream, class Src>
void dot_bf16(const uint16_t* x, int64_t ldx, const Src& w, int64_t j0, int64_t kb, int64_t kn, __m512* acc,
              bool first) {
  __m512 c[R][C];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) c[r][j] = first ? _mm512_setzero_ps() : acc[r * C + j];
  for (int64_t k0 = 0; k0 < kn; k0 += 32) {
    const __mmask32 m = kn - k0 >= 32 ? 0xffffffffu : static_cast<__mmask32>((1ull << (kn - k0)) - 1);
    __m512bh wv[C];
    for (int j = 0; j < C; ++j) {
      if constexpr (Stream) __builtin_prefetch(w.at(j0 + kDotAhead + j, kb + k0));
      wv[j] = w.bf16(j0 + j, kb + k0, m);
    }
    for (int r = 0; r < R; ++r) {
      __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * ldx + k0);
      for (int j = 0; j < C; ++j) c[r][j] = _mm512_dpbf16_ps(c[r][j], wv[j], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) acc[r * C + j] = c[r][j];
}

template <int R, int C, bool Stream, class Src>
void dot_f32(const float* x, int64_t ldx, const Src& w, int64_t j0, int64_t kb, int64_t kn, __m512* acc, bool first) {
  __m512 c[R][C];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) c[r][j] = first ? _mm512_setzero_ps() : acc[r * C + j];
  for (int64_t k0 = 0; k0 < kn; k0 += 16) {
    const __mmask16 m = kn - k0 >= 16 ? 0xffff : static_cast<__mmask16>((1u << (kn - k0)) - 1);
    __m512 wv[C];
    for (int j = 0; j < C; ++j) {
      if constexpr (Stream) __builtin_prefetch(w.at(j0 + kDotAhead + j, kb + k0));
      wv[j] = w.f32(j0 + j, kb + k0, m);
    }
    for (int r = 0; r < R; ++r) {
      __m512 xv = _mm512_maskz_loadu_ps(m, x + r * ldx + k0);
      for (int j = 0; j < C; ++j) c[r][j] = _mm512_fmadd_ps(xv, wv[j], c[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) acc[r * C + j] = c[r][j];
}

constexpr int64_t kDotChunk = 1024;  // k per pass over a block: x rows stay in L1 (6 x 2-4 KiB)

// y[T, cols] (f32, row stride ldy) = x[T, K] . w[cols, K] for one block of at most 64 weight rows: register
// blocks of R rows x C weight rows walk K in chunks, their lane partials kept in `acc` between chunks (the same
// accumulation as one pass over K), then reduced by the fixed shuffle tree of _mm512_reduce_add_ps. A row's
// arithmetic depends on K alone, never on T or on where the weights come from (Src gives the same values).
template <bool Stream, typename E, class Src>
void dot_block_pass(const E* x, int64_t t, const Src& w, int64_t k, int64_t cols, float* y, int64_t ldy) {
  alignas(64) __m512 acc[16][kRows * kDotCols];
  for_rows<kRows>(t, [&](int64_t r0, auto R) {
    constexpr int rr = decltype(R)::value;
    for (int64_t k0 = 0; k0 < k; k0 += kDotChunk) {
      const int64_t kn = std::min(kDotChunk, k - k0);
      for (int64_t j = 0, gi = 0; j < cols; j += kDotCols, ++gi) {
        auto run = [&](auto C) {
          constexpr int c = decltype(C)::value;
          if constexpr (std::is_same_v<E, uint16_t>)
            dot_bf16<rr, c, Stream>(x + r0 * k + k0, k, w, j, k0, kn, acc[gi], k0 == 0);
          else
            dot_f32<rr, c, Stream>(x + r0 * k + k0, k, w, j, k0, kn, acc[gi], k0 == 0);
        };
        switch (std::min<int64_t>(kDotCols, cols - j)) {
          case 1: run(std::integral_constant<int, 1>{}); break;
          case 2: run(std::integral_constant<int, 2>{}); break;
          case 3: run(std::integral_constant<int, 3>{}); break;
          default: run(std::integral_constant<int, kDotCols>{}); break;
        }
      }
    }
    for (int64_t j = 0, gi = 0; j < cols; j += kDotCols, ++gi) {
      const int64_t c = std::min<int64_t>(kDotCols, cols - j);
      for (int r = 0; r < rr; ++r)
        for (int64_t i = 0; i < c; ++i) y[(r0 + r) * ldy + j + i] = hsum(acc[gi][r * c + i]);
    }
  });
}

template <typename E, class Src>
void dot_block_src(const E* x, int64_t t, const Src& w, int64_t k, int64_t cols, float* y, int64_t ldy) {
  if (Src::kStream && t <= kRows) dot_block_pass<true>(x, t, w, k, cols, y, ldy);
  else dot_block_pass<false>(x, t, w, k, cols, y, ldy);
}

// w: rows in a buffer (dot_block) or the weights as stored (dot_block_stored).
template <typename E, typename W = E>
void dot_block(const E* x, int64_t t, const W* w, int64_t k, int64_t cols, float* y, int64_t ldy) {
  dot_block_src(x, t, StoredRows<W>{w, k}, k, cols, y, ldy);
}
template <typename E, typename W = E>
void dot_block_stored(const E* x, int64_t t, const W* w, int64_t k, int64_t cols, float* y, int64_t ldy) {
  dot_block_src(x, t, StoredRows<W, true>{w, k}, k, cols, y, ldy);
}

// The decode form of the row-major kinds with group scales (grouped q8, q8k, q6k, q5_0; at most kRows x rows):
// blocks of 16 weight rows, each row's f32 scales per group written by scales(row, s_row) into s [16][groups],
// then the dot form over source(n0, s), which dequantizes each weight once, in registers, as the dot product
// loads it.
template <class Scales, class Source>
at::Tensor decode_rows(const at::Tensor& x, int64_t n, int64_t groups, Scales&& scales, Source&& source) {
  const int64_t t = x.size(0), k = x.size(1);
  const bool bf = x.scalar_type() == at::kBFloat16;
  const uint16_t* xb = bf ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  const float* xf = bf ? nullptr : x.data_ptr<float>();
  at::Tensor y = at::empty({t, n}, x.options());
  constexpr int64_t rb = 16;
  parallel_items((n + rb - 1) / rb, [&](auto&& next) {
    std::vector<float> acc(t * rb), s(rb * groups);
    for (int64_t blk; (blk = next()) >= 0;) {
      const int64_t n0 = blk * rb, cols = std::min(rb, n - n0);
      for (int64_t j = 0; j < cols; ++j) scales(n0 + j, s.data() + j * groups);
      const auto src = source(n0, s.data());
      if (bf) dot_block_src(xb, t, src, k, cols, acc.data(), rb);
      else dot_block_src(xf, t, src, k, cols, acc.data(), rb);
      store_rows(acc.data(), rb, t, cols, y, n0);
    }
  });
  return y;
}

// Weight rows per parallel block: they stay in L2 (about 512 KiB) while every x row passes over them.
int64_t block_rows(int64_t k, int64_t esz) {
  int64_t rows = (512 << 10) / std::max<int64_t>(1, k * esz);
  return std::max<int64_t>(kDotCols, std::min<int64_t>(64, rows / kDotCols * kDotCols));
}

// Weight rows per block of the buffered form below: the block's f32-sized buffer stays within 128 KiB.
inline int64_t buffered_rows(int64_t k) {
  return std::max<int64_t>(kDotCols, std::min<int64_t>(16, (128 << 10) / (k * 4) / kDotCols * kDotCols));
}

// The buffered form of the q8 kinds (q8 with grouped scales or f32 x, q8k above kRows rows): y [T, n] in x's
// dtype, blocks of buffered_rows(K) weight rows, each dequantized by dequant(n0, cols, bf, buf) into bf16 rows
// (bf16 x) or f32 rows (f32 x) of K, then the dot form over them and every x row.
template <class Dequant>
at::Tensor buffered_linear(const at::Tensor& x, int64_t n, Dequant&& dequant) {
  const int64_t t = x.size(0), k = x.size(1), nb = buffered_rows(k);
  const bool bf = x.scalar_type() == at::kBFloat16;
  at::Tensor y = at::empty({t, n}, x.options());
  parallel_items((n + nb - 1) / nb, [&](auto&& next) {
    std::vector<float> acc(t * nb);
    std::vector<float> wbuf(nb * k);
    for (int64_t blk; (blk = next()) >= 0;) {
      const int64_t n0 = blk * nb, cols = std::min(nb, n - n0);
      dequant(n0, cols, bf, static_cast<void*>(wbuf.data()));
      if (bf)
        dot_block<uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), t,
                            reinterpret_cast<const uint16_t*>(wbuf.data()), k, cols, acc.data(), nb);
      else
        dot_block<float>(x.data_ptr<float>(), t, wbuf.data(), k, cols, acc.data(), nb);
      store_rows(acc.data(), nb, t, cols, y, n0);
    }
  });
  return y;
}

// q8 rows [n0, n0 + cols) dequantized (q * scale, exact in f32) into f32 rows, or bf16 rows (RNE).
inline void q8_store16(const int8_t* src, __m512 s, __mmask16 m, bool bf, void* out, int64_t off) {
  __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, src + off))), s);
  if (bf)
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + off, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  else
    _mm512_mask_storeu_ps(static_cast<float*>(out) + off, m, v);
}

// The same for 16 codes at q with an offset: q * s - z (scaled_min_f32), stored at element off of out.
inline void q8_min_store16(const int8_t* q, float s, float z, bool bf, void* out, int64_t off) {
  const __m512 v = scaled_min_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), s, z);
  if (bf)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + off),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  else
    _mm512_storeu_ps(static_cast<float*>(out) + off, v);
}

}  // namespace
