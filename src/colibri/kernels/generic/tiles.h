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
#include <memory>
#include <type_traits>
#include <vector>

#include "../args.h"
#include "../library.h"
#include "../parallel.h"
#include "../stream.h"
#include "simd.h"
#include "linear_steps.h"

namespace {

using simd::f8;
using simd::f16;
using simd::Pair;

constexpr int kVecs = kTile / 8;
constexpr int kRows = 4;     // x rows per register block (4 x 2 vectors of accumulators, 16 registers on AVX2)
constexpr int kOuterRows = 6;  // the same where a group's codes come from a buffer (q4_group_buf)
constexpr int kMaxGroup = 256;

// k bf16 values -> f32 (exact).
inline void widen_bf16(const uint16_t* x, int64_t k, float* out) {
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) simd::store(out + i, simd::bf16x8(x + i));
  for (; i < k; ++i) out[i] = simd::bf16_to_f32(x[i]);
}

// ---- outer form: q4 tiles ------------------------------------------------------------------------------------

// Columns [8c, 8c + 8) and [32 + 8c, 40 + 8c) of row k of a full tile as f32 codes plus off.
inline void q4_row8(const uint8_t* tile, int64_t k, int c, int off, f8& lo, f8& hi) {
  const simd::i8 b = simd::u8x8(tile + k * 32 + 8 * c);
  lo = simd::to_f((b & 15) + off);  // the offset in integers (the same exact value): the FP units do only the
  hi = simd::to_f((b >> 4) + off);  // conversion and the dot product's fma, which bound the decode form
}

// The codes plus off of rows [k0, k0 + kn) of the tile at n0 as f32 [kn][64] (columns past the tail tile: 0).
inline void q4_codes(const Q4& w, int64_t n0, int64_t k0, int64_t kn, int off, float* buf) {
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

// A group's end for R rows and V column vectors vid[0..V): tot = tot + fma(A, s, z * xsum) per column.
template <int R, int V>
inline void q4_group_end(const f8 (&a)[R][V], const float* xs, const float* s, const float* z, const int* vid,
                         float* tot) {
  for (int r = 0; r < R; ++r) {
    const f8 xv = simd::set1(xs[r]);
    for (int i = 0; i < V; ++i) {
      float* o = tot + r * kTile + 8 * vid[i];
      simd::store(o, q4_group_step<lanes::Lanes8>(simd::load(o), a[r][i], simd::load(s + 8 * vid[i]),
                                                  simd::load(z + 8 * vid[i]), xv));
    }
  }
}

// One group of R rows (bf16 x as f32 in xf [R][g]) over V column vectors vid[0..V): A by dpbf16 steps over the
// group's code pairs from codes(k, p) (p[i]: f32 codes minus 8 of rows k, k + 1 for column vector vid[i]), then
// tot = tot + fma(A, s, z * xsum) per column. Each step is two dependent roundings per accumulator: R * V
// independent chains (at least 4) keep the FMA units from waiting on their latency.
template <int R, int V, class Codes>
inline void q4_group(Codes&& codes, int64_t g, const float* xf, int64_t ldx, const float* xs, const float* s,
                     const float* z, const int* vid, float* tot) {
  f8 a[R][V];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < V; ++i) a[r][i] = simd::zero();
  for (int64_t k = 0; k < g; k += 2) {
    Pair p[V];
    codes(k, p);
    for (int r = 0; r < R; ++r) {
      const f8 xe = simd::set1(xf[r * ldx + k]), xo = simd::set1(xf[r * ldx + k + 1]);
      for (int i = 0; i < V; ++i) a[r][i] = simd::dpbf16(a[r][i], p[i], xe, xo);
    }
  }
  q4_group_end<R, V>(a, xs, s, z, vid, tot);
}

// The same for a group's codes already in buf ([g][64] f32, codes minus 8) over the column vectors c, c + 1, for
// R up to kOuterRows rows: each parity of a step (odd row of codes first) loads its two code vectors once and meets
// the rows one broadcast at a time, so R x 2 accumulators, two code vectors and one x value are live (6 x 2: 15
// of AVX2's sixteen registers, twelve independent chains; q4_group's four code vectors and two x values per row
// held at most 4 x 2 without spilling).
template <int R>
inline void q4_group_buf(const float* cb, int c, int64_t g, const float* xf, int64_t ldx, const float* xs,
                         const float* s, const float* z, float* tot) {
  f8 a[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = simd::zero();
  for (int64_t k = 0; k < g; k += 2) {
#pragma GCC unroll 2
    for (int p = 1; p >= 0; --p) {
      const f8 w0 = simd::load(cb + (k + p) * kTile + 8 * c), w1 = simd::load(cb + (k + p) * kTile + 8 * c + 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const f8 xb = simd::set1(xf[r * ldx + k + p]);
        a[r][0] = simd::madd_exact(w0, xb, a[r][0]);
        a[r][1] = simd::madd_exact(w1, xb, a[r][1]);
      }
    }
  }
  const int vid[2] = {c, c + 1};
  q4_group_end<R, 2>(a, xs, s, z, vid, tot);
}

// Decode (one row, full tiles): one group of the tile's rows (32 bytes each, from its first), nibble half h, read
// straight in the nibble order (simd.h): per column the same dpbf16 steps (odd element first) and update of tot
// as q4_group, the accumulators put back in column order first (s, z and tot stay in it). A step's odd row is
// widened and multiplied before its even one: four accumulators, four weight vectors and the two x values stay in
// AVX2's sixteen registers.
template <int H>
inline void q4_group_nibbles(const simd::NibbleTables& nt, const uint8_t* rows, int64_t g, const float* xf,
                             float xs, const float* s, const float* z, float* tot) {
  f8 a[4] = {simd::zero(), simd::zero(), simd::zero(), simd::zero()};
  for (int64_t k = 0; k < g; k += 2) {
    f8 v[4];
    simd::nibbles(nt, rows + (k + 1) * 32, H, v);
    const f8 xo = simd::set1(xf[k + 1]);
    for (int i = 0; i < 4; ++i) a[i] = simd::madd_exact(v[i], xo, a[i]);
    simd::nibbles(nt, rows + k * 32, H, v);
    const f8 xe = simd::set1(xf[k]);
    for (int i = 0; i < 4; ++i) a[i] = simd::madd_exact(v[i], xe, a[i]);
  }
  simd::nibble_columns(a);
  const f8 xv = simd::set1(xs);
  for (int i = 0; i < 4; ++i) {
    float* o = tot + 8 * (4 * H + i);
    simd::store(o, q4_group_step<lanes::Lanes8>(simd::load(o), a[i], simd::load(s + 8 * (4 * H + i)),
                                                simd::load(z + 8 * (4 * H + i)), xv));
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

// The outer-form driver over 64-column code tiles (q4 and the two-level q4k). params(gi, n0, s[64], z[64], ds)
// gives a group's parameters (linear_steps.h; ds: the thread's Q4kSupers, a tile's groups asked for in order from
// 0): bf16 x uses w ~ (q - 8) * s + z (the exact codes in the dot products, s and z in f32 after them); f32 x
// multiplies the exact weights (q + off) * s + z.
template <class PB, class PF>
at::Tensor q4_tiles_linear(const at::Tensor& x, const Q4& w, PB&& params_bf16, PF&& params_f32, int off) {
  const int64_t t = x.size(0), k = w.k, np = w.np, g = w.g;
  TORCH_CHECK(g % 2 == 0 && g <= kMaxGroup, "q4: group size must be even and at most 256");
  const bool bf = x.scalar_type() == at::kBFloat16;
  at::Tensor y = at::empty({t, np}, x.options());
  const int64_t tiles = (np + kTile - 1) / kTile, groups = k / g;
  const uint16_t* xb = bf ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  // x as f32 once per call, group-major [G][T][g] (a group's slices of every row in one run: a long pass at a large
  // K otherwise reads T lines K * 4 bytes apart per group and tile, which the hardware prefetcher does not follow;
  // 1536 x 8960 at T = 256 ran at half the rate of 8960 x 1536), and for bf16 x its group sums [T][G]
  std::vector<float> xs(bf ? t * groups : 0), xf(t * k);
  at::parallel_for(0, t, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      for (int64_t gi = 0; gi < groups; ++gi) {
        float* dst = xf.data() + (gi * t + r) * g;
        if (!bf) {
          std::memcpy(dst, x.data_ptr<float>() + r * k + gi * g, g * 4);
          continue;
        }
        xs[r * groups + gi] = group_sum(xb + r * k + gi * g, g);
        widen_bf16(xb + r * k + gi * g, g, dst);
      }
  });
  parallel_items(tiles, [&](auto&& next) {
    std::vector<float> acc(t * kTile);
    // a group's codes or weights [g][64], where a pass does not read a tile directly; not value-initialized (every
    // element is written before it is read: zeroing 64 KiB per call and thread took 8 % of a 192 x 576 decode call)
    std::unique_ptr<float[]> buf(bf && t <= kRows && np % kTile == 0 ? nullptr : new float[kMaxGroup * kTile]);
    alignas(32) float s[kTile], z[kTile], xsum[std::max(kRows, kOuterRows)];
    Q4kSupers ds;
    const simd::NibbleTables nt = simd::nibble_tables();
    for (int64_t tile; (tile = next()) >= 0;) {
      const int64_t n0 = tile * kTile;
      const bool full = np - n0 >= kTile;
      if (!bf) {
        for (int64_t gi = 0; gi < groups; ++gi) {
          params_f32(gi, n0, s, z, ds);
          q4_codes(w, n0, gi * g, g, off, buf.get());
          for (int64_t kk = 0; kk < g; ++kk)
            for (int c = 0; c < kVecs; ++c) {
              float* p = buf.get() + kk * kTile + 8 * c;
              simd::store(p, simd::load(p) * simd::load(s + 8 * c) + simd::load(z + 8 * c));
            }
          for_rows<kRows>(t, [&](int64_t r0, auto R) {
            outer_f32<decltype(R)::value>(buf.get(), g, xf.data() + (gi * t + r0) * g, g, acc.data() + r0 * kTile,
                                          gi == 0);
          });
        }
        store_rows(acc.data(), kTile, t, std::min<int64_t>(kTile, np - n0), y, n0);
        continue;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const bool direct = full && t <= kRows;  // decode: codes straight from the tile (same values, same order)
      const bool nib = full && t == 1;         // ... in the nibble order (the sums put back in column order)
      const uint8_t* tp = w.qw + n0 * (k / 2);
      for (int64_t gi = 0; gi < groups; ++gi) {
        const int64_t kg = gi * g;
        params_bf16(gi, n0, s, z, ds);
        if (direct)  // the group's successors in the tile (one run: the rows of k follow each other)
          for (int64_t b = 0; b < g * kTile / 2; b += 64) prefetch_ahead(tp + kg * (kTile / 2) + b);
        if (!direct) {
          q4_codes(w, n0, kg, g, -8, buf.get());
          for_rows<kOuterRows>(t, [&](int64_t r0, auto R) {
            constexpr int rr = decltype(R)::value;
            for (int r = 0; r < rr; ++r) xsum[r] = xs[(r0 + r) * groups + gi];
            const float* xr = xf.data() + (gi * t + r0) * g;  // rows g apart
            for (int c = 0; c < kVecs; c += 2)
              q4_group_buf<rr>(buf.get(), c, g, xr, g, xsum, s, z, acc.data() + r0 * kTile);
          });
          continue;
        }
        for_rows<kRows>(t, [&](int64_t r0, auto R) {
          constexpr int rr = decltype(R)::value;
          for (int r = 0; r < rr; ++r) xsum[r] = xs[(r0 + r) * groups + gi];
          const float* xr = xf.data() + (gi * t + r0) * g;  // rows g apart
          float* tot = acc.data() + r0 * kTile;
          const uint8_t* rows = tp + kg * (kTile / 2);
          if (nib) {
            q4_group_nibbles<0>(nt, rows, g, xr, xsum[0], s, z, tot);
            return q4_group_nibbles<1>(nt, rows, g, xr, xsum[0], s, z, tot);
          }
          for (int c = 0; c < 4; ++c) {  // 2-4 rows (one takes the nibble order): column vectors c and c + 4 share
            const int vid[2] = {c, c + 4};  // their bytes
            q4_group<rr, 2>(
                [&](int64_t kk, Pair* p) {
                  q4_row8(tp, kg + kk, c, -8, p[0].even, p[1].even);
                  q4_row8(tp, kg + kk + 1, c, -8, p[0].odd, p[1].odd);
                },
                g, xr, g, xsum, s, z, vid, tot);
          }
        });
      }
      store_rows(acc.data(), kTile, t, std::min<int64_t>(kTile, np - n0), y, n0);
    }
  });
  return y;
}

// ---- dot form: dense rows, q8, q8k ----------------------------------------------------------------------------
// Both operands are first laid out as f32 rows of kp = K rounded up to 32 (zero-padded: the AVX-512 tier's masked
// tail loads): bf16 x and bf16-valued weights "pair-split" per 32-element step as [even 0-15][odd 0-15]
// [even 16-31][odd 16-31] (8 each: the two halves of a vdpbf16ps register's pairs), f32 ones as they are. The
// kernel then only loads and multiplies: each weight is widened, dequantized and rounded once per pass, not
// once per row block.

constexpr int64_t kStep = 32;     // elements per dot-form step (one vdpbf16ps of 32 bf16; two f32 steps of 16)
constexpr int64_t kKChunk = 1024; // k per pass over a row block's weights: the x rows stay in L1

inline int64_t padded(int64_t k) { return (k + kStep - 1) / kStep * kStep; }

// 32 bf16-valued f32 -> the pair-split layout, in place-safe (out may not alias v).
inline void split32(const float* v, float* out) {
  const Pair lo = simd::f32_pairs(v), hi = simd::f32_pairs(v + 16);
  simd::store(out, lo.even);
  simd::store(out + 8, lo.odd);
  simd::store(out + 16, hi.even);
  simd::store(out + 24, hi.odd);
}

// One f32 row of k values (bf: bf16-valued) -> its dot-form layout of kp (split when bf), zero-padded.
inline void lay_out(const float* v, int64_t k, bool bf, float* out) {
  const int64_t full = k / kStep * kStep, kp = padded(k);
  if (!bf) {
    std::memcpy(out, v, k * 4);
    std::fill(out + k, out + kp, 0.f);
    return;
  }
  for (int64_t k0 = 0; k0 < full; k0 += kStep) split32(v + k0, out + k0);
  if (full < k) {
    alignas(32) float t[kStep] = {};
    std::memcpy(t, v + full, (k - full) * 4);
    split32(t, out + full);
  }
}

// x [T, K] (f32 or bf16) as f32 rows of kp, each laid out by row(v, bf, out) from its values v (bf16 widened).
template <class Row>
inline std::vector<float> lay_out_rows(const at::Tensor& x, Row&& row) {
  const int64_t t = x.size(0), k = x.size(1), kp = padded(k);
  const bool bf = x.scalar_type() == at::kBFloat16;
  std::vector<float> out(t * kp);
  at::parallel_for(0, t, 1, [&](int64_t b, int64_t e) {
    std::vector<float> widened(bf ? k : 0);
    for (int64_t r = b; r < e; ++r) {
      if (bf) widen_bf16(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + r * k, k, widened.data());
      row(bf ? widened.data() : x.data_ptr<float>() + r * k, bf, out.data() + r * kp);
    }
  });
  return out;
}

// x in the dot-form layout: [T][kp] f32.
inline std::vector<float> lay_out_x(const at::Tensor& x) {
  const int64_t k = x.size(1);
  return lay_out_rows(x, [k](const float* v, bool bf, float* out) { lay_out(v, k, bf, out); });
}

// acc[R][C] (+)= lane partials of x[R rows] . w[C rows] over kn laid-out columns (multiples of 32). The two
// halves of the 16 lanes are independent accumulations (lanes 0-7, 8-15: elements 0-15 and 16-31 of each 32-element
// step for bf16, of each 16-element step for f32), so each runs over all kn on its own, and a bf16 step's odd
// products go before its even ones for every accumulator at once: R x C accumulators, C weight vectors and R x
// vectors live at a time (3 x 3: 15 of AVX2's 16 registers, two loads per three fmas; both halves and both parities
// at once held only a 2 x 2 block, a load per fma: T = 256 ran at 52 % of AVX2's fma peak, now 60-75 %).
template <bool BF, int R, int C>
inline void dot_tile(const float* x, const float* w, int64_t ld, int64_t kn, f16* acc) {
  for (int h = 0; h < 2; ++h) {
    f8 a[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) a[r][c] = h ? acc[r * C + c].hi : acc[r * C + c].lo;
    for (int64_t k0 = 0; k0 < kn; k0 += kStep) {
      if constexpr (BF) {  // [even][odd] of this half's 16 elements
        const int64_t o = k0 + 16 * h;
        for (int p = 8; p >= 0; p -= 8) {  // the odd elements' products first, then the even ones'
          f8 wv[C], xv[R];
          for (int c = 0; c < C; ++c) wv[c] = simd::load(w + c * ld + o + p);
          for (int r = 0; r < R; ++r) xv[r] = simd::load(x + r * ld + o + p);
          for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) a[r][c] = simd::madd_exact(wv[c], xv[r], a[r][c]);
        }
      } else {  // two steps of 16: lane i holds element i; this half's lanes are elements 8h .. 8h + 7 of each
        for (int64_t s = 0; s < kStep; s += 16) {
          const int64_t o = k0 + s + 8 * h;
          f8 wv[C];
          for (int c = 0; c < C; ++c) wv[c] = simd::load(w + c * ld + o);
          for (int r = 0; r < R; ++r) {
            const f8 xv = simd::load(x + r * ld + o);
            for (int c = 0; c < C; ++c) a[r][c] = simd::fma(xv, wv[c], a[r][c]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) (h ? acc[r * C + c].hi : acc[r * C + c].lo) = a[r][c];
  }
}

// dot_tile's register block: 3 x 3 fits AVX2's sixteen 8-lane registers and aarch64's thirty-two 4-lane ones (an
// f8 is two); with SSE's sixteen 4-lane ones (the x86-64 baseline) it spills, and still ran bf16 passes within
// 10 % of the old 2 x 2 block of both halves (a 2 x 2 block per half: 20-40 % slower, its chains too few).
constexpr int kDotRows = 3, kDotCols = 3;

// y[r][j] for the rows of x (laid out, [T][kp]) and the weight rows of w (laid out, [cols][kp]): every row block
// of kDotRows walks K in chunks over every block of kDotCols weight rows, the lane partials kept between chunks
// (the same accumulation as one pass), then reduce16. A row's arithmetic depends on K alone. Two orders, the same
// arithmetic: row blocks outermost, the partials of one block in L1, where the weight rows fit L2 whole; at a long
// K (chunk_outer) the chunks outermost, so that one chunk of the weights (cols x kKChunk f32) stays in L2 while
// every x row passes over it, and the partials of all T x cols outputs wait in `partials` between chunks.
template <bool BF>
void dot_rows(const float* x, int64_t t, const float* w, int64_t cols, int64_t kp, float* y, int64_t ldy,
              bool chunk_outer, std::vector<f16>& partials) {
  const int64_t lda = kDotRows * (cols + kDotCols), blocks = (t + kDotRows - 1) / kDotRows;  // f16 per row block
  auto chunk = [&](int64_t rb, int64_t k0, f16* part) {  // row block rb over K chunk k0
    const int64_t r0 = rb * kDotRows, kn = std::min(kKChunk, kp - k0);
    const int rr = std::min<int64_t>(kDotRows, t - r0);
    for (int64_t j = 0; j < cols; j += kDotCols) {
      f16* a = part + j * kDotRows;
      const float* xr = x + r0 * kp + k0;
      const float* wr = w + j * kp + k0;
      auto run = [&](auto C) {
        constexpr int c = decltype(C)::value;
        switch (rr) {
          case 1: dot_tile<BF, 1, c>(xr, wr, kp, kn, a); break;
          case 2: dot_tile<BF, 2, c>(xr, wr, kp, kn, a); break;
          default: dot_tile<BF, kDotRows, c>(xr, wr, kp, kn, a); break;
        }
      };
      if (cols - j >= kDotCols) run(std::integral_constant<int, kDotCols>{});
      else if (cols - j == 2) run(std::integral_constant<int, 2>{});
      else run(std::integral_constant<int, 1>{});
    }
  };
  auto reduce = [&](int64_t rb, const f16* part) {
    const int64_t r0 = rb * kDotRows;
    const int rr = std::min<int64_t>(kDotRows, t - r0);
    for (int64_t j = 0; j < cols; j += kDotCols) {
      const int64_t c = std::min<int64_t>(kDotCols, cols - j);
      for (int r = 0; r < rr; ++r)
        for (int64_t i = 0; i < c; ++i) y[(r0 + r) * ldy + j + i] = simd::reduce16(part[j * kDotRows + r * c + i]);
    }
  };
  const f16 zero{simd::zero(), simd::zero()};
  if (chunk_outer) {
    partials.assign(blocks * lda, zero);
    for (int64_t k0 = 0; k0 < kp; k0 += kKChunk)
      for (int64_t rb = 0; rb < blocks; ++rb) chunk(rb, k0, partials.data() + rb * lda);
    for (int64_t rb = 0; rb < blocks; ++rb) reduce(rb, partials.data() + rb * lda);
    return;
  }
  partials.resize(lda);
  for (int64_t rb = 0; rb < blocks; ++rb) {
    std::fill(partials.begin(), partials.end(), zero);
    for (int64_t k0 = 0; k0 < kp; k0 += kKChunk) chunk(rb, k0, partials.data());
    reduce(rb, partials.data());
  }
}

// ---- lane form: the dot form's arithmetic for long passes ------------------------------------------------------
// Output (r, j) of the dot form is 16 lane partials, lane l summing its own elements of K in order (bf16: the pair
// (2l, 2l + 1) of each 32-element step, odd element first; f32: element l of each 16-element step), then reduce16.
// dot_tile keeps an output's lanes in one register, so its products form one chain (two links a bf16 step), and
// its 3 x 3 block leaves the FMA units waiting on their latency. The lane form keeps one lane of 16 weight rows in
// two registers instead: x's elements in lane order (lay_lanes_x: [T][16 lanes][kp / 16]) are broadcast against
// weights laid out [lane][position][16 rows] (lay_lanes), so a 6 x 2 block runs 12 independent chains; after the 16
// lanes their partials meet in reduce16's tree, lane-wise over 8 rows at once. The same products and sums in the
// same order for every output: the same bits.
constexpr int kLaneRows = 6;       // x rows per register block: 6 x 2 accumulators and three operands, 15 registers
constexpr int64_t kLaneCols = 16;  // weight rows per group: two 8-lane vectors
// Passes of at least this many rows take the lane form: in shorter ones laying the weights out costs what the form
// saves. AVX2 only: the portable tier on x86-64's baseline (SSE, sixteen 4-lane registers) ran it slower than the
// dot form, and on aarch64 it is not measured (docs/performance.md).
#if defined(__AVX2__)
constexpr int64_t kLaneMinRows = 32;
#else
constexpr int64_t kLaneMinRows = INT64_MAX;
#endif

// Position i of lane l in the lane order <-> element e of a 32-element step s (bf16: lane e / 2, odd element at
// position 2 s; f32: lane e % 16, position 2 s + e / 16).
inline int lane_of(bool bf, int e) { return bf ? e / 2 : e % 16; }
inline int64_t lane_position(bool bf, int64_t s, int e) { return bf ? 2 * s + 1 - (e & 1) : 2 * s + e / 16; }

// Rows c0 .. c1 of f32 values v [rows][k] (row stride k), the elements of step s -> their lanes' positions in out
// ([lane][kp / 16][width], row c at offset c of each position), zero past `rows` and past k.
inline void lay_lanes_step(const float* v, int64_t rows, int64_t k, int64_t len, bool bf, int64_t width, int64_t s,
                           int64_t c0, int64_t c1, float* out) {
  for (int64_t c = c0; c < c1; ++c)
    for (int e = 0; e < kStep; ++e) {
      const int64_t el = kStep * s + e;
      out[(lane_of(bf, e) * len + lane_position(bf, s, e)) * width + c] = c < rows && el < k ? v[c * k + el] : 0.f;
    }
}

// Weight rows v [rows][k] -> [lane][kp / 16][kLaneCols], zero-padded to kp and to kLaneCols rows: each full step
// of 8 rows by four 8 x 8 transposes, the rest element by element.
inline void lay_lanes(const float* v, int64_t rows, int64_t k, int64_t kp, bool bf, float* out) {
  const int64_t len = kp / 16;
  for (int64_t s = 0; s < kp / kStep; ++s)
    for (int64_t c0 = 0; c0 < kLaneCols; c0 += 8) {
      if (c0 + 8 > rows || kStep * (s + 1) > k) {
        lay_lanes_step(v, rows, k, len, bf, kLaneCols, s, c0, c0 + 8, out);
        continue;
      }
      for (int q = 0; q < kStep; q += 8) {
        f8 t[8];
        for (int c = 0; c < 8; ++c) t[c] = simd::load(v + (c0 + c) * k + kStep * s + q);
        simd::transpose8(t);
        for (int e = 0; e < 8; ++e)
          simd::store(out + (lane_of(bf, q + e) * len + lane_position(bf, s, q + e)) * kLaneCols + c0, t[e]);
      }
    }
}

// x in the lane order: [T][kp] f32, each row [16 lanes][kp / 16]. bf16 x: a full step's pairs swapped (odd element
// first) and stored two floats a lane.
inline std::vector<float> lay_lanes_x(const at::Tensor& x) {
  const int64_t k = x.size(1), kp = padded(k), len = kp / 16;
  return lay_out_rows(x, [=](const float* v, bool bf, float* o) {
    for (int64_t s = 0; s < kp / kStep; ++s) {
      if (!bf || kStep * (s + 1) > k) {
        lay_lanes_step(v, 1, k, len, bf, 1, s, 0, 1, o);
        continue;
      }
      for (int q = 0; q < kStep; q += 8) {  // lanes q / 2 .. q / 2 + 3
        const f8 sw = simd::swap_pairs(simd::load(v + kStep * s + q));
        for (int i = 0; i < 4; ++i)
          std::memcpy(o + (q / 2 + i) * len + 2 * s, reinterpret_cast<const float*>(&sw) + 2 * i, 8);
      }
    }
  });
}

// y[r][c] for R rows of x (lane order, row stride kp) and one group of weight rows (lay_lanes, width kLaneCols):
// per lane, R x 2 accumulators over its kp / 16 positions; then reduce16's tree over the lanes. cols: the group's
// rows that exist (at most kLaneCols).
template <bool BF, int R>
void lane_block(const float* x, int64_t kp, const float* w, int64_t cols, float* y, int64_t ldy) {
  const int64_t len = kp / 16;
  f8 part[R][2][16];  // [row][vector][lane]
  for (int l = 0; l < 16; ++l) {
    f8 a[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = simd::zero();
    const float* wl = w + l * len * kLaneCols;
    const float* xl = x + l * len;
    for (int64_t i = 0; i < len; ++i) {
      const f8 w0 = simd::load(wl + i * kLaneCols), w1 = simd::load(wl + i * kLaneCols + 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const f8 xb = simd::set1(xl[r * kp + i]);
        if constexpr (BF) {  // dot_tile's operations: exact products, one rounding each sum
          a[r][0] = simd::madd_exact(w0, xb, a[r][0]);
          a[r][1] = simd::madd_exact(w1, xb, a[r][1]);
        } else {
          a[r][0] = simd::fma(xb, w0, a[r][0]);
          a[r][1] = simd::fma(xb, w1, a[r][1]);
        }
      }
    }
    for (int r = 0; r < R; ++r) part[r][0][l] = a[r][0], part[r][1][l] = a[r][1];
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) {
      const f8 sum = simd::reduce16_lanes(part[r][v]);
      for (int64_t c = 8 * v; c < std::min<int64_t>(cols, 8 * v + 8); ++c) y[r * ldy + c] = sum[c - 8 * v];
    }
}

// Every x row (lane order) against one group of weight rows: y [T][ldy] from column 0, in register blocks of
// nearly equal rows, kLaneRows or one fewer (R = 6: from T = 25 on; T = 32 as 6, 6, 5, 5, 5, 5), where blocks of 6
// and a rest of 2 would leave that block 4 chains.
template <bool BF>
void lane_rows(const float* x, int64_t t, int64_t kp, const float* w, int64_t cols, float* y, int64_t ldy) {
  static_assert(kLaneMinRows >= kLaneRows * (kLaneRows - 2) + 1, "blocks of kLaneRows or kLaneRows - 1 rows");
  const int64_t blocks = (t + kLaneRows - 1) / kLaneRows;
  for (int64_t b = 0, r0 = 0; b < blocks; ++b) {
    const int64_t rows = t / blocks + (b < t % blocks);
    if (rows == kLaneRows) lane_block<BF, kLaneRows>(x + r0 * kp, kp, w, cols, y + r0 * ldy, ldy);
    else lane_block<BF, kLaneRows - 1>(x + r0 * kp, kp, w, cols, y + r0 * ldy, ldy);
    r0 += rows;
  }
}

// Decode (bf16 x, at most kDirectRows rows, K a multiple of 32): the weights straight from their source in registers,
// pairs(j, k0, lo, hi, scratch) giving the pairs of row j's 32 elements from k0 (the values fill would write,
// split), so each weight is read and dequantized once with no buffer; scratch (kp floats) is the row's own while
// its steps run, k0 = 0 first (a source may keep per-row scales there). The same accumulation as dot_rows.
// (Column counts are compile-time: accumulators indexed by a run-time count went to the stack.)
template <int R, int C, class Pairs>
inline void dot_direct_rows(const float* x, int64_t kp, Pairs& pairs, int64_t j, float* y, int64_t ldy,
                            float* scratch) {
  f16 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = f16{simd::zero(), simd::zero()};
  auto step = [&](int64_t k0) {
    // unrolled: a loop over c or r left standing indexes the accumulators at run time, and they live on the stack
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      Pair lo, hi;
      pairs(j + c, k0, lo, hi, scratch + c * kp);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const float* p = x + r * kp + k0;
        a[r][c].lo = simd::madd_exact(lo.even, simd::load(p), simd::madd_exact(lo.odd, simd::load(p + 8), a[r][c].lo));
        a[r][c].hi =
            simd::madd_exact(hi.even, simd::load(p + 16), simd::madd_exact(hi.odd, simd::load(p + 24), a[r][c].hi));
      }
    }
  };
  // the first step apart: a source's once-a-row work at k0 = 0 (its scales, by a call never inlined) then stays out
  // of the loop, whose accumulators the call would otherwise keep in memory for every step
  step(0);
  for (int64_t k0 = kStep; k0 < kp; k0 += kStep) step(k0);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + j + c] = simd::reduce16(a[r][c]);
}

// Two weight rows at a time: each step is two dependent roundings per accumulator, so four independent chains keep
// the FMA units busy where one row's two would wait on their latency.
// (Three or four x rows: one weight row at a time, their accumulators fill the registers.)
template <int R, class Pairs>
void dot_direct(const float* x, int64_t kp, Pairs&& pairs, int64_t cols, float* y, int64_t ldy, float* scratch) {
  int64_t j = 0;
  if constexpr (R <= 2)
    for (; j + 2 <= cols; j += 2) dot_direct_rows<R, 2>(x, kp, pairs, j, y, ldy, scratch);
  for (; j < cols; ++j) dot_direct_rows<R, 1>(x, kp, pairs, j, y, ldy, scratch);
}

struct NoPairs {};

// The dot-form driver of every row-major kind: y [T, n] in x's dtype. fill(n0, cols, bf, out) writes weight rows
// [n0, n0 + cols) as f32 rows of K (bf16-valued when bf: the values the AVX-512 tier hands vdpbf16ps) into out
// [cols][K]; post(n0, cols, acc, lda) may scale the f32 results (q8 per channel) before the store. Three forms, one
// arithmetic: the direct form at decode (pairs), the lane form for passes of kLaneMinRows rows or more, the dot form
// (dot_rows over laid-out rows) between.
template <class Fill, class Post, class Pairs = NoPairs>
at::Tensor dot_linear(const at::Tensor& x, int64_t n, Fill&& fill, Post&& post, Pairs&& pairs = NoPairs{}) {
  const int64_t t = x.size(0), k = x.size(1), kp = padded(k);
  const bool bf = x.scalar_type() == at::kBFloat16;
  at::Tensor y = at::empty({t, n}, x.options());
  if (t >= kLaneMinRows) {  // the lane form, a group of kLaneCols weight rows a task
    const std::vector<float> xl = lay_lanes_x(x);
    parallel_items((n + kLaneCols - 1) / kLaneCols, [&](auto&& next) {
      std::unique_ptr<float[]> acc(new float[t * kLaneCols]), raw(new float[kLaneCols * k]),
          wl(new float[kLaneCols * kp]);
      for (int64_t blk; (blk = next()) >= 0;) {
        const int64_t n0 = blk * kLaneCols, cols = std::min(kLaneCols, n - n0);
        fill(n0, cols, bf, raw.get());
        lay_lanes(raw.get(), cols, k, kp, bf, wl.get());
        if (bf) lane_rows<true>(xl.data(), t, kp, wl.get(), cols, acc.get(), kLaneCols);
        else lane_rows<false>(xl.data(), t, kp, wl.get(), cols, acc.get(), kLaneCols);
        post(n0, cols, acc.get(), kLaneCols);
        store_rows(acc.get(), kLaneCols, t, cols, y, n0);
      }
    });
    return y;
  }
  const std::vector<float> xl = lay_out_x(x);
  constexpr bool has_pairs = !std::is_same_v<std::decay_t<Pairs>, NoPairs>;
  const bool direct = has_pairs && bf && t <= kDirectRows && k % kStep == 0;
  // weight rows per task: their f32 rows within 256 KiB (L2) while every x row passes over them; where that is
  // under 16 rows (K > 4096) in a pass of more than a few rows, 63 with dot_rows' chunk_outer order, which keeps a
  // K chunk of them (252 KiB) in L2 instead (x was read again for every few rows: 1536 x 8960 at T = 512 ran at
  // 40 % of 8960 x 1536's rate)
  const int64_t fit = (64 << 10) / kp;
  const bool chunk_outer = fit < 16 && t > kDirectRows;
  const int64_t nb = chunk_outer ? 63 : std::max<int64_t>(2, std::min<int64_t>(64, fit / 2 * 2));
  parallel_items((n + nb - 1) / nb, [&](auto&& next) {
    // not value-initialized: every element is written before it is read (fresh zeroed pages of a few hundred
    // KiB per call cost as much as a decode row's arithmetic)
    std::unique_ptr<float[]> acc(new float[t * nb]), raw(direct ? nullptr : new float[nb * k]),
        wl(new float[(direct ? 2 : nb) * kp]);
    std::vector<f16> partials;  // dot_rows' lane partials
    for (int64_t blk; (blk = next()) >= 0;) {
      const int64_t n0 = blk * nb, cols = std::min(nb, n - n0);
      if constexpr (has_pairs) {
        if (direct) {
          auto src = [&](int64_t j, int64_t k0, Pair& lo, Pair& hi, float* row) { pairs(n0 + j, k0, lo, hi, row); };
          switch (t) {
            case 1: dot_direct<1>(xl.data(), kp, src, cols, acc.get(), nb, wl.get()); break;
            case 2: dot_direct<2>(xl.data(), kp, src, cols, acc.get(), nb, wl.get()); break;
            case 3: dot_direct<3>(xl.data(), kp, src, cols, acc.get(), nb, wl.get()); break;
            default: dot_direct<4>(xl.data(), kp, src, cols, acc.get(), nb, wl.get()); break;
          }
          post(n0, cols, acc.get(), nb);
          store_rows(acc.get(), nb, t, cols, y, n0);
          continue;
        }
      }
      fill(n0, cols, bf, raw.get());
      for (int64_t j = 0; j < cols; ++j) lay_out(raw.get() + j * k, k, bf, wl.get() + j * kp);
      if (bf) dot_rows<true>(xl.data(), t, wl.get(), cols, kp, acc.get(), nb, chunk_outer, partials);
      else dot_rows<false>(xl.data(), t, wl.get(), cols, kp, acc.get(), nb, chunk_outer, partials);
      post(n0, cols, acc.get(), nb);
      store_rows(acc.get(), nb, t, cols, y, n0);
    }
  });
  return y;
}

inline void no_post(int64_t, int64_t, float*, int64_t) {}

// n codes times scale s as f32 (exact: q * scale), rounded to bf16 values when bf (RNE as vcvtneps2bf16; s is
// finite and q * s zero or normal, see round_bf16_normal, where s comes from f16 or bf16 scales; an f32 scale of
// a q8 weight gets the full rounding).
inline void q8_values(const int8_t* q, int64_t n, float s, bool bf, float* out, bool normal = false) {
  int64_t i = 0;
  const f8 sv = simd::set1(s);
  for (; i + 8 <= n; i += 8) {
    const f8 v = simd::to_f(simd::s8x8(q + i)) * sv;
    simd::store(out + i, !bf ? v : normal ? simd::round_bf16_normal(v) : simd::round_bf16(v));
  }
  for (; i < n; ++i) {
    const f8 v = simd::set1(static_cast<float>(q[i]) * s);
    out[i] = bf ? simd::round_bf16(v)[0] : v[0];
  }
}

// The same minus an offset (q5k, q2k, q5_1: w = q * s - z): q * s exact, one rounding in the subtraction
// (-ffp-contract=off), the values zero or normal (multiples of f16's least step). n % 8 == 0.
inline void q8_min_values(const int8_t* q, int64_t n, float s, float z, bool bf, float* out) {
  const f8 sv = simd::set1(s), zv = simd::set1(z);
  for (int64_t i = 0; i < n; i += 8) {
    const f8 v = simd::to_f(simd::s8x8(q + i)) * sv - zv;
    simd::store(out + i, bf ? simd::round_bf16_normal(v) : v);
  }
}

// The pairs of 16 codes v (code_pairs' or split_code_pairs' lanes) times s (Mins: minus z), rounded to bf16 values:
// q8_values' / q8_min_values' values for bf16 x (the decode forms' source of the int8-valued kinds). Normal: the
// values are zero or normal in f32 (f16 or K-quant scales), so the short rounding holds; else the full one.
template <bool Mins, bool Normal = true>
inline Pair scaled_pairs(const Pair& v, float s, float z) {
  const f8 sv = simd::set1(s);
  auto round = [](f8 w) { return Normal ? simd::round_bf16_normal(w) : simd::round_bf16(w); };
  if constexpr (Mins) {
    const f8 zv = simd::set1(z);
    return Pair{round(v.even * sv - zv), round(v.odd * sv - zv)};
  }
  return Pair{round(v.even * sv), round(v.odd * sv)};
}

}  // namespace
