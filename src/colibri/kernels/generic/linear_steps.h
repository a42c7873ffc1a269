// Steps of the linear kernels written once for every tier, over lanes.h's traits (16 lanes a register in the avx512
// tier, 8 in avx2 and portable; every value the same IEEE f32 operation on the same inputs in each, so the tiers
// agree bit for bit: tests/test_tiers.py crosses them):
//   - the q4 code tiles' group parameters: (scale, zero) per column of a 64-column tile for one group of K, from the
//     stored layouts (args.h: q4's pairs, Q4_1's and Q4_0's f16, q4k's 6-bit codes under f16 super-scales), into
//     float arrays of kTile (0 past the tile's last column; the avx512 drivers hand their 4 registers' storage),
//     and a tile's code at (column, k);
//   - the sum of a group of bf16 x (the zero term's factor in the exact q4 path);
//   - the K-quants' f32 scales per 16 values (d * sc, dmin * m);
//   - the store of a pass's f32 results into y's dtype.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../args.h"
#include "../stream.h"
#include "lanes.h"

namespace {

constexpr int kTile = 64;  // q4 tile columns (the stored layout; Np is a multiple of 16, so tiles are 16, 32, 48
                           // or 64 columns: whole vectors of either lane width)

struct Q4 {
  const uint8_t* qw;  // [Np, K/2] stored tiles
  const uint8_t* sz;  // [G, Np, 2] (scale, zero); Q4_1: f16 (d, m) the same way; Q4_0: f16 d [G, Np]
  at::ScalarType st;
  int64_t np, k, g;
  int64_t esz() const { return st == at::kFloat ? 4 : 2; }  // bytes of one stored scale or zero
};

inline float load1(const void* p, int64_t i, at::ScalarType t) {
  if (t == at::kFloat) return static_cast<const float*>(p)[i];
  if (t == at::kBFloat16) return simd::bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  return simd::f16_to_f32(static_cast<const uint16_t*>(p)[i]);
}

// (scale, zero) of group gi for the 64 columns of the tile at n0, from the stored pairs of w's dtype: f32 pairs
// split into their even and odd elements; a 16-bit pair is one u32 lane per column, (scale | zero << 16), widened
// exactly (bf16: the bits moved up; f16: converted).
inline void q4_group_params(const Q4& w, int64_t gi, int64_t n0, float* s, float* z) {
  using S = lanes::Lanes;
  const int64_t cols = std::min<int64_t>(kTile, w.np - n0), base = (gi * w.np + n0) * 2;
  prefetch_span(w.sz + (base + 2 * kTile) * w.esz(), 2 * kTile * w.esz());  // the next tile's, used a tile from now
  for (int64_t j = 0; j < kTile; j += S::L) {
    S::V sv = S::zero(), zv = S::zero();
    if (j < cols) {
      if (w.st == at::kFloat) {
        S::f32_pairs(reinterpret_cast<const float*>(w.sz) + base + 2 * j, sv, zv);
      } else {
        const S::U h = S::load_u32(reinterpret_cast<const uint32_t*>(w.sz) + (base + 2 * j) / 2);
        const bool bf = w.st == at::kBFloat16;
        sv = bf ? S::as_f(h << 16) : S::f16_lo(h);
        zv = bf ? S::as_f(h & 0xffff0000u) : S::f16_lo(h >> 16);
      }
    }
    S::store(s + j, sv);
    S::store(z + j, zv);
  }
}

// (scale, zero) of group gi for the tile at n0 by where the weight keeps them (args.h's Q4Pairs; sz points at
// them): q4's stored pairs; Q4_1's f16 (d, m) pairs, zero m + 8 d; Q4_0's f16 d [G, Np], zero 0.
inline void q4_pairs_params(const Q4& w, Q4Pairs pairs, int64_t gi, int64_t n0, float* s, float* z) {
  using S = lanes::Lanes;
  if (pairs != Q4Pairs::kQ40) {
    q4_group_params(w, gi, n0, s, z);
    if (pairs == Q4Pairs::kQ41)
      for (int64_t j = 0; j < kTile; j += S::L) S::store(z + j, S::load(z + j) + S::set1(8.f) * S::load(s + j));
    return;
  }
  const uint16_t* d = reinterpret_cast<const uint16_t*>(w.sz) + gi * w.np + n0;
  const int64_t cols = std::min<int64_t>(kTile, w.np - n0);
  prefetch_span(d + kTile, 2 * kTile);  // the next tile's, used a tile from now
  for (int64_t j = 0; j < kTile; j += S::L) {
    S::store(s + j, j < cols ? S::load_f16(d + j) : S::zero());
    S::store(z + j, S::zero());
  }
}

// q4k: the f32 (d, dmin) of a tile's 64 columns in one super-block (8 groups of 32): decoded by q4k_params for the
// super-block's first group and read by all eight (the caller keeps one per thread and asks for a tile's groups in
// order from 0, as every driver does).
struct Q4kSupers {
  alignas(64) float d[kTile], dmin[kTile];
};

// q4k: the (sc, m) codes of columns [c, c + L) (c % L == 0) of a group's packed row p (args.h: 24 bytes per 16
// columns, their v's low bytes, then 8 bytes whose low nibbles are columns 0-7's v >> 8 and high nibbles 8-15's).
template <class S = lanes::Lanes>
inline void q4k_codes(const uint8_t* p, int64_t c, typename S::U& sc, typename S::U& m) {
  const uint8_t* unit = p + c / 16 * 24;
  const typename S::U lo = S::load_u8(unit + c % 16);
  const typename S::U nib = S::load_u8_twice(unit + 16);  // lane i: byte i % 8, its nibble (c % 16 + i) / 8
  const typename S::U hi = (nib >> (((S::lane_index() + static_cast<uint32_t>(c % 16)) >> 3) << 2)) & 15u;
  sc = lo & 63u;
  m = (lo >> 6) | (hi << 2);
}

// q4k: the codes of columns [c, c + L) of a group's row at pc (packed, or (sc | m << 8) a column: args.h).
template <class S = lanes::Lanes>
inline void q4k_group_codes(const uint8_t* pc, bool packed, int64_t c, typename S::U& sc, typename S::U& m) {
  if (packed) {
    q4k_codes<S>(pc, c, sc, m);
    return;
  }
  const typename S::U codes = S::load_u16(reinterpret_cast<const uint16_t*>(pc) + c);
  sc = codes & 0xffu;
  m = codes >> 8;
}

// q4k: the first code row of group gi's codes for the tile at n0, and the same of the next tile prefetched (in the
// group-major layouts a page away from the next group's row; in kTiles a tile's run of codes ahead).
inline const uint8_t* q4k_code_row(const Q4kScales& w, int64_t gi, int64_t n0) {
  if (w.layout == Q4kLayout::kTiles) {
    const int64_t row = std::min<int64_t>(kTile, w.np - n0) / 16 * 24;  // one group's bytes in this tile
    const uint8_t* pc = w.sc + n0 / 16 * 24 * w.groups + gi * row;
    prefetch_span(pc + kTile / 16 * 24 * w.groups, row);
    return pc;
  }
  const bool packed = w.packed();
  const int64_t at = gi * w.np + n0;  // the tile's first column in the group's row of codes
  const uint8_t* pc = w.sc + (packed ? at / 16 * 24 : at * 2);
  const int64_t tile_bytes = packed ? kTile / 16 * 24 : 2 * kTile;
  prefetch_span(pc + tile_bytes, tile_bytes);
  return pc;
}

// q4k: the f32 (d, dmin) of columns [0, cols) of the tile at n0 in the super-block of group gi.
template <class S = lanes::Lanes>
inline void q4k_supers(const Q4kScales& w, int64_t gi, int64_t n0, int64_t cols, Q4kSupers& ds) {
  const uint32_t* sup = reinterpret_cast<const uint32_t*>(w.sup);  // (d | dmin << 16) a column
  const int64_t nb = w.groups / 8;
  const uint32_t* pd = w.layout == Q4kLayout::kTiles ? sup + n0 * nb + (gi / 8) * std::min<int64_t>(kTile, w.np - n0)
                                                     : sup + (gi / 8) * w.np + n0;
  prefetch_span(pd + (w.layout == Q4kLayout::kTiles ? kTile * nb : kTile), 4 * kTile);
  for (int64_t j = 0; j < cols; j += S::L) {
    const typename S::U halves = S::load_u32(pd + j);
    S::store(ds.d + j, S::f16_lo(halves));
    S::store(ds.dmin + j, S::f16_lo(halves >> 16));
  }
}

// q4k: (s, z) of columns [j, j + L) from their codes: s = d * sc; z = 8 s - dmin m (signed_codes) or 0 - dmin m.
template <class S = lanes::Lanes>
inline void q4k_scale_zero(const Q4kSupers& ds, int64_t j, typename S::U c, typename S::U mc, bool signed_codes,
                           typename S::V& s, typename S::V& z) {
  s = S::load(ds.d + j) * S::to_f(c);
  const typename S::V mm = S::load(ds.dmin + j) * S::to_f(mc);
  z = signed_codes ? S::set1(8.f) * s - mm : S::zero() - mm;
}

// q4k: (s, z) of group gi for the 64 columns of the tile at n0 (0 past the last column): s = d * sc; signed_codes:
// z for w ~ (q - 8) * s + z (the bf16 path and the int8 mode) = 8 s - dmin m, else z = 0 - dmin m for
// w = q * s + z (the f32 path, exact). w: the weight's codes and supers (args.h, check_q4k_layout), the supers
// decoded into ds when gi % 8 == 0.
inline void q4k_params(const Q4kScales& w, int64_t gi, int64_t n0, bool signed_codes, float* s, float* z,
                       Q4kSupers& ds) {
  using S = lanes::Lanes;
  const int64_t cols = std::min<int64_t>(kTile, w.np - n0);
  const uint8_t* pc = q4k_code_row(w, gi, n0);
  if (gi % 8 == 0) q4k_supers(w, gi, n0, cols, ds);
  for (int64_t j = 0; j < kTile; j += S::L) {
    if (j >= cols) {
      S::store(s + j, S::zero());
      S::store(z + j, S::zero());
      continue;
    }
    S::U c, mc;
    q4k_group_codes(pc, w.packed(), j, c, mc);
    S::V sv, zv;
    q4k_scale_zero(ds, j, c, mc, signed_codes, sv, zv);
    S::store(s + j, sv);
    S::store(z + j, zv);
  }
}

// The sum of g bf16 x values: 16 lane partials in k order (the tail zero-padded), then _mm512_reduce_add_ps's tree.
inline float group_sum(const uint16_t* x, int64_t g) {
  using S = lanes::Lanes;
  S::P a = S::pzero();
  for (int64_t k0 = 0; k0 < g; k0 += 16) a = S::padd(a, S::row16(x, k0, g));
  return S::psum(a);
}

// out[0 .. n) = p[i .. i + n) as f32 (exact: f32, bf16 or f16 values).
inline void to_f32(const void* p, at::ScalarType t, int64_t i, int64_t n, float* out) {
  const float* pf = static_cast<const float*>(p) + i;
  const uint16_t* ph = static_cast<const uint16_t*>(p) + i;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    simd::store(out + j, t == at::kFloat ? simd::load(pf + j) : t == at::kBFloat16 ? simd::bf16x8(ph + j)
                                                                                  : simd::f16x8(ph + j));
  for (; j < n; ++j)
    out[j] = t == at::kFloat ? pf[j] : t == at::kBFloat16 ? simd::bf16_to_f32(ph[j]) : simd::f16_to_f32(ph[j]);
}

// ---- the K-quants' per-16 scales -------------------------------------------------------------------------------
// The f32 factors the K-quants with q8k's values multiply their codes by, in every tier (kquant.cpp and
// generic/kquant.cpp, the exact and the decode forms alike): per 256-value block, s[i] = d * sc[i] for its 16 scale
// codes (exact in f32: an f16 times a code of at most 8 bits).
inline void kquant_scales16(const int8_t* sc, float d, float* s) {
  using S = lanes::Lanes;
  for (int i = 0; i < 16; i += S::L) S::store(s + i, S::set1(d) * S::load_i8(sc + i));
}

// The same for one row of q8k (nb blocks): its scale codes sc [16 nb] and f16 d bits sup [nb].
// (The row functions are never inlined: called once a row, inlined into a decode form's step they cost its loop
// registers.)
__attribute__((noinline)) inline void q8k_row_scales(const int8_t* sc, const uint16_t* sup, int64_t nb, float* s) {
  for (int64_t b = 0; b < nb; ++b) kquant_scales16(sc + 16 * b, simd::f16_to_f32(sup[b]), s + 16 * b);
}

// The same for one row of GGUF blocks kept as stored (B: gguf_blocks.h's kind, nb blocks from `row`): s[16 b + i]
// = d * sc[i] of block b, then for the kinds with mins (B::kMins) s[16 nb + 16 b + i] = dmin * m[i].
template <class B>
__attribute__((noinline)) void block_row_scales(const uint8_t* row, int64_t nb, float* s) {
  alignas(16) int8_t codes[16];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* bp = row + b * B::kBlockBytes;
    B::scales16(bp, codes);
    kquant_scales16(codes, simd::f16_to_f32(B::d_bits(bp)), s + 16 * b);
    if constexpr (B::kMins) {
      B::mins16(bp, codes);
      kquant_scales16(codes, simd::f16_to_f32(B::dmin_bits(bp)), s + 16 * nb + 16 * b);
    }
  }
}

// ---- the exact q4 group step -----------------------------------------------------------------------------------
// Per (row, column, group) of the q4-tiled kinds with bf16 x (q4, Q4_1, Q4_0, q4k), in group order, in every tier
// (tiles.h's and generic/tiles.h's q4_group, generic/tiles.h's q4_group_nibbles): y = y + fma(A, s, z * xsum), A
// the group's dot product of x with the codes minus 8 (in vdpbf16ps's order), s and z the group's scale and zero
// for the column, xv the group's sum of x in every lane.
template <class S>
inline typename S::V q4_group_step(typename S::V y, typename S::V a, typename S::V s, typename S::V z,
                                   typename S::V xv) {
  return y + S::fma(a, s, z * xv);
}

// ---- the LOSSY int8 ops' f32 step ------------------------------------------------------------------------------
// Per (row, column, group), in group order, in every int8 form of every tier (int8.cpp, generic/int8.cpp,
// int8_decode.h): f = float(A) * d, A the group's exact int32 sum and d the row's x scale (dv: d in every lane,
// which callers make once per row and group), then y = fma(f, scale, y)
// (q4: the group's scale, its zero term added apart; grouped q8 and q8k: the group's scale) or y + f (q8 with one
// scale per channel, which multiplies y at the end). S: the form's lanes (Lanes16 in the avx512 tier's own forms,
// Lanes8 in int8_decode.h's, which both x86 tiers run); a: its int32 sums as any vector of S::U's size.
template <class S, bool Channel = false, class A>
inline typename S::V int8_step(typename S::V y, A a, typename S::V dv, typename S::V scale = S::zero()) {
  const typename S::V f = S::to_f(reinterpret_cast<typename S::U>(a)) * dv;
  if constexpr (Channel) return y + f;
  else return S::fma(f, scale, y);
}

// ---- row blocks: f(first row, row count as a constant), every tier's kernels over a pass's rows ------------------
// A block's row count only sets how many accumulators share each weight load, never the arithmetic of a row.

// f(r0, n as a constant), n in [1, B].
template <int B, int R = 1, class F>
inline void with_rows(int64_t n, int64_t r0, F& f) {
  if constexpr (R == B) {
    f(r0, std::integral_constant<int, B>{});
  } else if (n == R) {
    f(r0, std::integral_constant<int, R>{});
  } else {
    with_rows<B, R + 1>(n, r0, f);
  }
}

// t rows in ceil(t / B) blocks of balanced sizes (t = 8, B = 6: 4 + 4, not 6 + 2).
template <int B, class F>
void for_rows(int64_t t, F&& f) {
  const int64_t blocks = (t + B - 1) / B;
  int64_t r0 = 0;
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t n = t / blocks + (i < t % blocks ? 1 : 0);
    with_rows<B>(n, r0, f);
    r0 += n;
  }
}

// t rows in blocks of B and one remainder block.
template <int B, class F>
void row_blocks(int64_t t, F&& f) {
  int64_t r0 = 0;
  for (; r0 + B <= t; r0 += B) f(r0, std::integral_constant<int, B>{});
  if (t > r0) with_rows<B>(t - r0, r0, f);
}

// acc [T][lda] f32 -> y[r0 : r0 + T, n0 : n0 + cols] in y's dtype (bf16: rounded once, as vcvtneps2bf16).
inline void store_rows(const float* acc, int64_t lda, int64_t t, int64_t cols, at::Tensor& y, int64_t n0,
                       int64_t r0 = 0) {
  using S = lanes::Lanes;
  const int64_t ldy = y.size(1);
  if (y.scalar_type() == at::kFloat) {
    float* out = y.data_ptr<float>() + r0 * ldy;
    for (int64_t r = 0; r < t; ++r) std::memcpy(out + r * ldy + n0, acc + r * lda, cols * 4);
    return;
  }
  uint16_t* out = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()) + r0 * ldy;
  for (int64_t r = 0; r < t; ++r)
    for (int64_t j = 0; j < cols; j += S::L) {
      const int64_t n = std::min<int64_t>(S::L, cols - j);
      const float* a = acc + r * lda + j;
      S::store_bf16(out + r * ldy + n0 + j, n == S::L ? S::load(a) : S::load_n(a, n), n);
    }
}

// The code q (0..15) of column j, row k, of the tile at n0 (full tiles: 32 bytes a row, byte j holding columns j
// and j + 32; the tail tile: cols / 2 bytes a row, column pairs in a byte).
inline int q4_code(const Q4& w, int64_t n0, int64_t cols, int64_t j, int64_t k) {
  const uint8_t* base = w.qw + n0 * (w.k / 2);
  if (cols == kTile) {
    const uint8_t byte = base[k * 32 + (j & 31)];
    return j < 32 ? byte & 15 : byte >> 4;
  }
  const uint8_t byte = base[k * (cols / 2) + j / 2];
  return (j & 1) ? byte >> 4 : byte & 15;
}

}  // namespace
