// Shared pieces of the generic tiers' linear kernels (linear.cpp, kquant.cpp): the q4 code-tile driver (outer
// form) and the dot form, written once over simd.h and giving every output element the bits of the AVX-512
// tier (../tiles.h, ../linear.cpp explain the invariance argument; here only what the bit-identity rests on).
//
// Outer form (q4, q4k: 64-column tiles, k-major): every column is its own accumulation, so the lane width is
// free; per group, A = sum over pairs of dpbf16 steps (odd element first), then tot = tot + fma(A, s, z * xsum)
// as ../tiles.h's q4_group; f32 x: w = (q + off) * s + z (two roundings), then fma over all of K.
// Dot form (dense rows, q8, q8k): 16 lane partials along k exactly as one AVX-512 register (lane i holds the
// pair (2i, 2i + 1) of each 32-element step for bf16, element i of each 16-element step for f32), kept as two
// 8-lane halves, zero-padded tails, reduced by simd::reduce16 (_mm512_reduce_add_ps's tree).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../library.h"
#include "simd.h"

namespace {

using simd::f8;
using simd::f16;
using simd::Pair;

constexpr int kTile = 64;    // q4 tile columns (the stored layout)
constexpr int kVecs = kTile / 8;
constexpr int kRows = 4;     // x rows per register block (4 x 2 vectors of accumulators, 16 registers on AVX2)
constexpr int kMaxGroup = 256;

inline float load1(const void* p, int64_t i, at::ScalarType t) {
  if (t == at::kFloat) return static_cast<const float*>(p)[i];
  if (t == at::kBFloat16) return simd::bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  return simd::f16_to_f32(static_cast<const uint16_t*>(p)[i]);
}

// Rows in ceil(t / kRows) blocks of balanced sizes: a block's row count only sets how many accumulators share
// each weight load, never the arithmetic of a row.
template <typename F>
void for_rows(int64_t t, F&& f) {
  const int64_t blocks = (t + kRows - 1) / kRows;
  int64_t r0 = 0;
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t n = t / blocks + (i < t % blocks ? 1 : 0);
    switch (n) {
      case 1: f(r0, std::integral_constant<int, 1>{}); break;
      case 2: f(r0, std::integral_constant<int, 2>{}); break;
      case 3: f(r0, std::integral_constant<int, 3>{}); break;
      default: f(r0, std::integral_constant<int, kRows>{}); break;
    }
    r0 += n;
  }
}

// acc [T][lda] f32 -> y[:, n0 : n0 + cols] in y's dtype (bf16: rounded once as vcvtneps2bf16)
void store_rows(const float* acc, int64_t lda, int64_t t, int64_t cols, at::Tensor& y, int64_t n0) {
  const int64_t ldy = y.size(1);
  if (y.scalar_type() == at::kFloat) {
    float* out = y.data_ptr<float>();
    for (int64_t r = 0; r < t; ++r) std::memcpy(out + r * ldy + n0, acc + r * lda, cols * 4);
    return;
  }
  uint16_t* out = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < t; ++r)
    for (int64_t j = 0; j < cols; j += 8) {
      const int64_t n = std::min<int64_t>(8, cols - j);
      const f8 v = n == 8 ? simd::load(acc + r * lda + j) : simd::load_n(acc + r * lda + j, n);
      simd::store_bf16(out + r * ldy + n0 + j, v, n);
    }
}

// ---- outer form: q4 tiles ------------------------------------------------------------------------------------

struct Q4 {
  const uint8_t* qw;  // [Np, K/2] stored tiles
  const uint8_t* sz;  // [G, Np, 2] (scale, zero)
  at::ScalarType st;
  int64_t np, k, g;
};

// Group sums of bf16 x row: 16-lane partials in k order (the group's tail zero-padded), then the fixed tree.
inline float group_sum(const uint16_t* x, int64_t g) {
  f16 a{simd::zero(), simd::zero()};
  for (int64_t k0 = 0; k0 < g; k0 += 16) {
    alignas(32) float v[16] = {};
    for (int64_t i = 0; i < 16 && k0 + i < g; ++i) v[i] = simd::bf16_to_f32(x[k0 + i]);
    a.lo = a.lo + simd::load(v);
    a.hi = a.hi + simd::load(v + 8);
  }
  return simd::reduce16(a);
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

// Columns [8c, 8c + 8) and [32 + 8c, 40 + 8c) of row k of a full tile as f32 codes plus off.
inline void q4_row8(const uint8_t* tile, int64_t k, int c, float off, f8& lo, f8& hi) {
  const simd::i8 b = simd::u8x8(tile + k * 32 + 8 * c);
  lo = simd::to_f(b & 15) + off;
  hi = simd::to_f(b >> 4) + off;
}

// The codes plus off of rows [k0, k0 + kn) of the tile at n0 as f32 [kn][64] (columns past the tail tile: 0).
inline void q4_codes(const Q4& w, int64_t n0, int64_t k0, int64_t kn, float off, float* buf) {
  const int64_t cols = std::min<int64_t>(kTile, w.np - n0);
  if (cols == kTile) {
    const uint8_t* tile = w.qw + n0 * (w.k / 2);
    for (int64_t k = 0; k < kn; ++k)
      for (int c = 0; c < 4; ++c) {
        f8 lo, hi;
        q4_row8(tile, k0 + k, c, off, lo, hi);
        simd::store(buf + k * kTile + 8 * c, lo);
        simd::store(buf + k * kTile + 32 + 8 * c, hi);
      }
    return;
  }
  for (int64_t k = 0; k < kn; ++k)
    for (int64_t j = 0; j < kTile; ++j)
      buf[k * kTile + j] = j < cols ? static_cast<float>(q4_code(w, n0, cols, j, k0 + k)) + off : 0.f;
}

// One group of R rows (bf16 x as f32 in xf [R][g]) over the column vectors {v0, v1}: A by dpbf16 steps over the
// group's code pairs from `codes(k, v)` (f32 codes minus 8 of row k, column vector v), then
// tot = tot + fma(A, s, z * xsum) per column.
template <int R, class Codes>
inline void q4_group(Codes&& codes, int64_t g, const float* xf, const float* xs, const float* s, const float* z,
                     int v0, int v1, float* tot) {
  f8 a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = simd::zero();
  for (int64_t k = 0; k < g; k += 2) {
    Pair p0, p1;
    codes(k, v0, v1, p0, p1);
    for (int r = 0; r < R; ++r) {
      const f8 xe = simd::set1(xf[r * kMaxGroup + k]), xo = simd::set1(xf[r * kMaxGroup + k + 1]);
      a[r][0] = simd::dpbf16(a[r][0], p0, xe, xo);
      a[r][1] = simd::dpbf16(a[r][1], p1, xe, xo);
    }
  }
  for (int r = 0; r < R; ++r) {
    const f8 xv = simd::set1(xs[r]);
    for (int i = 0; i < 2; ++i) {
      const int v = i ? v1 : v0;
      float* o = tot + r * kTile + 8 * v;
      simd::store(o, simd::load(o) + simd::fma(a[r][i], simd::load(s + 8 * v), simd::load(z + 8 * v) * xv));
    }
  }
}

// f32 x: acc[R][64] (+)= x[R rows, k] * w[k][64] over kn rows of buf, fma in k order.
template <int R>
void outer_f32(const float* buf, int64_t kn, const float* x, int64_t ldx, float* acc, bool first) {
  for (int c = 0; c < kVecs; c += 2) {
    f8 a[R][2];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 2; ++i)
        a[r][i] = first ? simd::zero() : simd::load(acc + r * kTile + 8 * (c + i));
    for (int64_t k = 0; k < kn; ++k) {
      const f8 w0 = simd::load(buf + k * kTile + 8 * c), w1 = simd::load(buf + k * kTile + 8 * c + 8);
      for (int r = 0; r < R; ++r) {
        const f8 xb = simd::set1(x[r * ldx + k]);
        a[r][0] = simd::fma(xb, w0, a[r][0]);
        a[r][1] = simd::fma(xb, w1, a[r][1]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 2; ++i) simd::store(acc + r * kTile + 8 * (c + i), a[r][i]);
  }
}

// The outer-form driver over 64-column code tiles (q4 and the two-level q4k). params(gi, n0, s[64], z[64])
// gives a group's parameters: bf16 x uses w ~ (q - 8) * s + z (the exact codes in the dot products, s and z in
// f32 after them); f32 x multiplies the exact weights (q + off) * s + z.
template <class PB, class PF>
at::Tensor q4_tiles_linear(const at::Tensor& x, const Q4& w, PB&& params_bf16, PF&& params_f32, int off) {
  const int64_t t = x.size(0), k = w.k, np = w.np, g = w.g;
  TORCH_CHECK(g % 2 == 0 && g <= kMaxGroup, "q4: group size must be even and at most 256");
  const bool bf = x.scalar_type() == at::kBFloat16;
  at::Tensor y = at::empty({t, np}, x.options());
  const int64_t tiles = (np + kTile - 1) / kTile, groups = k / g;
  const uint16_t* xb = bf ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  std::vector<float> xs;
  if (bf) {
    xs.resize(t * groups);
    at::parallel_for(0, t, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        for (int64_t gi = 0; gi < groups; ++gi) xs[r * groups + gi] = group_sum(xb + r * k + gi * g, g);
    });
  }
  at::parallel_for(0, tiles, 1, [&](int64_t b, int64_t e) {
    std::vector<float> acc(t * kTile);
    std::vector<float> buf(kMaxGroup * kTile);
    alignas(32) float s[kTile], z[kTile], xf[kRows * kMaxGroup], xsum[kRows];
    for (int64_t tile = b; tile < e; ++tile) {
      const int64_t n0 = tile * kTile;
      const bool full = np - n0 >= kTile;
      if (!bf) {
        for (int64_t gi = 0; gi < groups; ++gi) {
          params_f32(gi, n0, s, z);
          q4_codes(w, n0, gi * g, g, static_cast<float>(off), buf.data());
          for (int64_t kk = 0; kk < g; ++kk)
            for (int c = 0; c < kVecs; ++c) {
              float* p = buf.data() + kk * kTile + 8 * c;
              simd::store(p, simd::load(p) * simd::load(s + 8 * c) + simd::load(z + 8 * c));
            }
          for_rows(t, [&](int64_t r0, auto R) {
            outer_f32<decltype(R)::value>(buf.data(), g, x.data_ptr<float>() + r0 * k + gi * g, k,
                                          acc.data() + r0 * kTile, gi == 0);
          });
        }
        store_rows(acc.data(), kTile, t, std::min<int64_t>(kTile, np - n0), y, n0);
        continue;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const bool direct = full && t <= kRows;  // decode: codes straight from the tile (same values, same order)
      const uint8_t* tp = w.qw + n0 * (k / 2);
      for (int64_t gi = 0; gi < groups; ++gi) {
        const int64_t kg = gi * g;
        params_bf16(gi, n0, s, z);
        if (!direct) q4_codes(w, n0, kg, g, -8.f, buf.data());
        for_rows(t, [&](int64_t r0, auto R) {
          constexpr int rr = decltype(R)::value;
          for (int r = 0; r < rr; ++r) {
            for (int64_t i = 0; i < g; ++i) xf[r * kMaxGroup + i] = simd::bf16_to_f32(xb[(r0 + r) * k + kg + i]);
            xsum[r] = xs[(r0 + r) * groups + gi];
          }
          float* tot = acc.data() + r0 * kTile;
          if (direct) {
            for (int c = 0; c < 4; ++c)  // column vectors c and c + 4 come from the same bytes
              q4_group<rr>(
                  [&](int64_t kk, int, int, Pair& p0, Pair& p1) {
                    q4_row8(tp, kg + kk, c, -8.f, p0.even, p1.even);
                    q4_row8(tp, kg + kk + 1, c, -8.f, p0.odd, p1.odd);
                  },
                  g, xf, xsum, s, z, c, c + 4, tot);
          } else {
            const float* cb = buf.data();
            for (int c = 0; c < kVecs; c += 2)
              q4_group<rr>(
                  [&](int64_t kk, int v0, int v1, Pair& p0, Pair& p1) {
                    p0.even = simd::load(cb + kk * kTile + 8 * v0);
                    p0.odd = simd::load(cb + (kk + 1) * kTile + 8 * v0);
                    p1.even = simd::load(cb + kk * kTile + 8 * v1);
                    p1.odd = simd::load(cb + (kk + 1) * kTile + 8 * v1);
                  },
                  g, xf, xsum, s, z, c, c + 1, tot);
          }
        });
      }
      store_rows(acc.data(), kTile, t, std::min<int64_t>(kTile, np - n0), y, n0);
    }
  });
  return y;
}

// ---- dot form: dense rows, q8, q8k ----------------------------------------------------------------------------

// Weight rows as a source of the dot form: pairs(j, k0, lo, hi) gives the 32 weights of row j from column k0 as
// pairs (lanes 0-7: elements 0-15, lanes 8-15: elements 16-31; bf16 values), vals(j, k0, lo, hi) 16 f32 weights,
// at(j, k, bf) one weight (bf16-valued when bf) for the zero-padded tail. Stored rows: bf16, f32, int8 codes.
template <typename W>
struct StoredRows {
  const W* w;
  int64_t ldw;
  void pairs(int64_t j, int64_t k0, Pair& lo, Pair& hi) const {
    const W* p = w + j * ldw + k0;
    if constexpr (std::is_same_v<W, uint16_t>) {
      lo = simd::bf16_pairs(p);
      hi = simd::bf16_pairs(p + 16);
    } else {
      lo = simd::code_pairs(p);
      hi = simd::code_pairs(p + 16);
    }
  }
  void vals(int64_t j, int64_t k0, f8& lo, f8& hi) const {
    const W* p = w + j * ldw + k0;
    if constexpr (std::is_same_v<W, float>) {
      lo = simd::load(p);
      hi = simd::load(p + 8);
    }
  }
  float at(int64_t j, int64_t k) const {
    const W v = w[j * ldw + k];
    if constexpr (std::is_same_v<W, uint16_t>) return simd::bf16_to_f32(v);
    else return static_cast<float>(v);
  }
};

// acc[R][C] = lane partials of x[R rows] . w[C rows from j0] over K (bf16 x: 32 per step; f32 x: 16), then
// y[r][j] = reduce16. A row's arithmetic depends on K alone.
template <int R, int C, typename E, class Src>
void dot_rc(const E* x, int64_t ldx, const Src& w, int64_t j0, int64_t k, float* y, int64_t ldy) {
  constexpr bool bf = std::is_same_v<E, uint16_t>;
  constexpr int64_t step = bf ? 32 : 16;
  f16 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = f16{simd::zero(), simd::zero()};
  const int64_t full = k / step * step;
  for (int64_t k0 = 0; k0 < full; k0 += step) {
    if constexpr (bf) {
      Pair wl[C], wh[C];
      for (int c = 0; c < C; ++c) w.pairs(j0 + c, k0, wl[c], wh[c]);
      for (int r = 0; r < R; ++r) {
        const Pair xl = simd::bf16_pairs(x + r * ldx + k0), xh = simd::bf16_pairs(x + r * ldx + k0 + 16);
        for (int c = 0; c < C; ++c) {
          a[r][c].lo = simd::dpbf16(a[r][c].lo, wl[c], xl.even, xl.odd);
          a[r][c].hi = simd::dpbf16(a[r][c].hi, wh[c], xh.even, xh.odd);
        }
      }
    } else {
      f8 wl[C], wh[C];
      for (int c = 0; c < C; ++c) w.vals(j0 + c, k0, wl[c], wh[c]);
      for (int r = 0; r < R; ++r) {
        const f8 xl = simd::load(x + r * ldx + k0), xh = simd::load(x + r * ldx + k0 + 8);
        for (int c = 0; c < C; ++c) {
          a[r][c].lo = simd::fma(xl, wl[c], a[r][c].lo);
          a[r][c].hi = simd::fma(xh, wh[c], a[r][c].hi);
        }
      }
    }
  }
  if (full < k) {  // the tail, zero-padded as the AVX-512 tier's masked loads
    alignas(32) float wt[C][32] = {}, xt[32];
    for (int c = 0; c < C; ++c)
      for (int64_t i = 0; full + i < k; ++i) wt[c][i] = w.at(j0 + c, full + i);
    for (int r = 0; r < R; ++r) {
      std::fill(xt, xt + 32, 0.f);
      for (int64_t i = 0; full + i < k; ++i) {
        if constexpr (bf) xt[i] = simd::bf16_to_f32(x[r * ldx + full + i]);
        else xt[i] = x[r * ldx + full + i];
      }
      for (int c = 0; c < C; ++c) {
        if constexpr (bf) {
          a[r][c].lo = simd::dpbf16(a[r][c].lo, simd::f32_pairs(wt[c]), simd::f32_pairs(xt).even, simd::f32_pairs(xt).odd);
          a[r][c].hi = simd::dpbf16(a[r][c].hi, simd::f32_pairs(wt[c] + 16), simd::f32_pairs(xt + 16).even, simd::f32_pairs(xt + 16).odd);
        } else {
          a[r][c].lo = simd::fma(simd::load(xt), simd::load(wt[c]), a[r][c].lo);
          a[r][c].hi = simd::fma(simd::load(xt + 8), simd::load(wt[c] + 8), a[r][c].hi);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + j0 + c] = simd::reduce16(a[r][c]);
}

constexpr int kDotRows = 2, kDotCols = 2;  // register block of the dot form: 2 x 2 x 16 lanes (8 AVX2 registers)

// y[T, cols] (f32, row stride ldy) = x[T, K] . w[cols rows, K].
template <typename E, class Src>
void dot_block_src(const E* x, int64_t t, const Src& w, int64_t k, int64_t cols, float* y, int64_t ldy) {
  for (int64_t r0 = 0; r0 < t; r0 += kDotRows) {
    const bool two = t - r0 >= 2;
    for (int64_t j = 0; j < cols; j += kDotCols) {
      const bool pair = cols - j >= 2;
      if (two && pair) dot_rc<2, 2>(x + r0 * k, k, w, j, k, y + r0 * ldy, ldy);
      else if (two) dot_rc<2, 1>(x + r0 * k, k, w, j, k, y + r0 * ldy, ldy);
      else if (pair) dot_rc<1, 2>(x + r0 * k, k, w, j, k, y + r0 * ldy, ldy);
      else dot_rc<1, 1>(x + r0 * k, k, w, j, k, y + r0 * ldy, ldy);
    }
  }
}

template <typename E, typename W = E>
void dot_block(const E* x, int64_t t, const W* w, int64_t k, int64_t cols, float* y, int64_t ldy) {
  dot_block_src(x, t, StoredRows<W>{w, k}, k, cols, y, ldy);
}

// Weight rows per parallel block: they stay in L2 while every x row passes over them.
inline int64_t block_rows(int64_t k, int64_t esz) {
  const int64_t rows = (256 << 10) / std::max<int64_t>(1, k * esz);
  return std::max<int64_t>(4, std::min<int64_t>(64, rows / 4 * 4));
}

// The buffered form (q8 with grouped scales or f32 x, q8k with many rows): y [T, n] in x's dtype, blocks of
// weight rows each dequantized by dequant(n0, cols, bf, buf) into bf16 rows (bf16 x) or f32 rows (f32 x) of K,
// then the dot form over them and every x row.
template <class Dequant>
at::Tensor buffered_linear(const at::Tensor& x, int64_t n, Dequant&& dequant) {
  const int64_t t = x.size(0), k = x.size(1), nb = std::max<int64_t>(4, std::min<int64_t>(16, (128 << 10) / (k * 4) / 4 * 4));
  const bool bf = x.scalar_type() == at::kBFloat16;
  at::Tensor y = at::empty({t, n}, x.options());
  at::parallel_for(0, (n + nb - 1) / nb, 1, [&](int64_t b, int64_t e) {
    std::vector<float> acc(t * nb);
    std::vector<float> wbuf(nb * k);
    for (int64_t blk = b; blk < e; ++blk) {
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

// n codes times scale s, as f32 (exact: q * scale) or bf16 (RNE as vcvtneps2bf16) into out at element off.
inline void q8_store(const int8_t* q, int64_t n, float s, bool bf, void* out, int64_t off) {
  int64_t i = 0;
  const f8 sv = simd::set1(s);
  for (; i + 8 <= n; i += 8) {
    const f8 v = simd::to_f(simd::s8x8(q + i)) * sv;
    if (bf) simd::store_bf16(static_cast<uint16_t*>(out) + off + i, v);
    else simd::store(static_cast<float*>(out) + off + i, v);
  }
  for (; i < n; ++i) {
    const float v = static_cast<float>(q[i]) * s;
    if (bf) static_cast<uint16_t*>(out)[off + i] = simd::f32_to_bf16(v);
    else static_cast<float*>(out)[off + i] = v;
  }
}

}  // namespace
