// Generic-tier (avx2, portable) LOSSY int8-activation linears: q4_linear_i8 / q8_linear_i8 with the ops, arguments
// and output bits of the AVX-512 VNNI tier's ../int8.cpp (its header gives the math and the invariance argument).
//
// What the bit-identity rests on:
//   - activations: the same f32 steps per row and x group, with the AVX-512 lane structure: |x| maxima and x sums
//     in 16 lanes (x[j] goes to lane j % 16, kept as two 8-lane halves), reduced by _mm512_reduce_max_ps's /
//     _mm512_reduce_add_ps's trees (simd::reduce_max16, simd::reduce16); inv = 127 / m (a division, then
//     multiplies), codes converted as vcvtps2dq (simd::cvt_rne: round to nearest even) and clamped to
//     [-127, 127]; d = m / 127.
//   - A (per row, column and group) is an exact int32 sum, so any exact integer method gives the AVX-512 tier's
//     value. Here: unsigned codes u (q4: q in [0, 15]; q8: u = q + 128 split into nibbles u = 16 h + l) times the
//     x codes by vpmaddubsw (u8 x s8 -> adjacent-pair int16 sums; |pair| <= 2 * 15 * 127 = 3810, never
//     saturating), summed in int16 over windows of at most 8 quad steps (<= 30480 < 32767), then widened by
//     vpmaddwd (q8: 16 * the high nibbles' sum plus the low ones'); A = that - off * sum(xq), off = 8 or 128.
//     Where the CPU has AVX-VNNI, passes of more than kDirectRows rows sum the quads by vpdpbusd into int32
//     instead (q8: its codes whole), the same exact A (block_groups_vnni).
//     The portable build computes the same products with plain vector arithmetic.
//   - the f32 steps per (row, column, group), in group order, written as in ../int8.cpp: f = float(A) * d, then
//     q4 / q8 grouped: tot = fma(f, scale, tot); q8 per channel: tot = tot + f and tot * scale at the end; q4:
//     plus (added last) the fma chain of zero * sum(x) over the groups; the output rounded once to x's dtype
//     (bf16 as vcvtneps2bf16). -ffp-contract=off keeps every other product and sum separately rounded.
// K is walked in chunks and rows in register blocks; neither changes a (row, column)'s sequence of f32 steps.
// q4k_linear_i8 / q8k_linear_i8 (GGUF Q4_K / Q6_K as stored) are q4 (group 32) / q8 grouped (group 16) with the
// per-tile scale read decoding the two-level scales (Weight::sup): the bits of those ops given the f32 scales.
//
// Loop form: 64-column tiles (parallel; q4's stored tile). Above kDirectRows rows (below: "decode"), per K chunk
// of kChunk the tile's codes are laid out as "quads" (4 consecutive k of 8 columns in 32 bytes), pair by pair (a
// pair: 16 q4 columns, or the two nibble planes of 8 q8 columns; its chunk is one contiguous run, in L1 while it
// is used); each pair
// then meets every register block of kRowBlock rows: per quad step the rows' x quads broadcast, one vpmaddubsw +
// vpaddw per row and vector (4 x 2 int16 accumulators); the vpaddw share vpmaddubsw's ports, and the per-group
// f32 steps cost the rest (rates in docs/performance.md, "Figures moved from source comments"). q8 does two
// vpmaddubsw per quad (its nibble planes).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../library.h"
#include "int8_decode.h"
#include "int8_weights.h"
#include "tiles.h"

namespace {


constexpr int64_t kCols = 64;      // columns per tile (the q4 layout's tile)
constexpr int kRowBlock = 4;       // x rows per register block: 4 x 2 int16 accumulators
constexpr int kVnniRows = 6;       // the same with AVX-VNNI: 6 x 2 int32 accumulators, 15 registers
constexpr int64_t kChunk = 1024;   // k per laid-out chunk: 64 KiB of q4 quads, 128 KiB of q8 planes (in L2)

enum Kind { kQ4 = 0, kQ8Grouped = 1, kQ8Channel = 2 };

// ---- weights as quads ----------------------------------------------------------------------------------------
// A chunk of kn k of a tile is laid out pair by pair: pair p holds, for each quad step s (k = 4 s .. 4 s + 3),
// two 32-byte vectors at buf + (p * kn / 4 + s) * 64 (+ 32): the pair's codes for the whole chunk are one
// contiguous run. A vector holds 8 columns, byte 4i + kk = the code of its column i at k = 4 s + kk.
//   q4: pair p = columns 16p .. 16p + 15 (vector h: 16p + 8h ..).
//   q8: pair p = columns 8p .. 8p + 7, u = q + 128 in two nibble planes: vector 0 the low nibbles, 1 the high.

inline uint8_t* slot(uint8_t* buf, int64_t steps, int64_t pair, int64_t s) { return buf + (pair * steps + s) * 64; }

// Quads of k in [k0, k0 + kn) of the q4 tile at column n0 into buf (4 pairs).
void q4_chunk(const uint8_t* qw, int64_t np, int64_t k, int64_t n0, int64_t k0, int64_t kn, uint8_t* buf) {
  const int64_t cols = std::min(kCols, np - n0), steps = kn / 4;
  const uint8_t* tile = qw + n0 * (k / 2);
  if (cols == kCols) {  // byte (k, j) = q[j, k] | q[32 + j, k] << 4
#if defined(__AVX2__)
    const __m256i nib = _mm256_set1_epi8(0x0f);
    for (int64_t s = 0; s < steps; ++s) {  // the bytes as quads first (byte column j: columns j and 32 + j), then
      const uint8_t* rows = tile + (k0 + 4 * s) * 32;  // their nibbles
      __m256i r[4];
      for (int i = 0; i < 4; ++i) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + 32 * i));
      const __m256i a = _mm256_unpacklo_epi8(r[0], r[1]), a2 = _mm256_unpackhi_epi8(r[0], r[1]);
      const __m256i b = _mm256_unpacklo_epi8(r[2], r[3]), b2 = _mm256_unpackhi_epi8(r[2], r[3]);
      const __m256i p0 = _mm256_unpacklo_epi16(a, b), p1 = _mm256_unpackhi_epi16(a, b);     // 0-3 | 16-19, 4-7 | 20-23
      const __m256i p2 = _mm256_unpacklo_epi16(a2, b2), p3 = _mm256_unpackhi_epi16(a2, b2);  // 8-11 | 24-27, ...
      const __m256i q[4] = {_mm256_permute2x128_si256(p0, p1, 0x20), _mm256_permute2x128_si256(p2, p3, 0x20),
                            _mm256_permute2x128_si256(p0, p1, 0x31), _mm256_permute2x128_si256(p2, p3, 0x31)};
      for (int i = 0; i < 4; ++i) {  // byte columns 8i .. 8i + 7: vector i of pair i / 2 (low nibbles) and of
        __m256i* lo = reinterpret_cast<__m256i*>(slot(buf, steps, i / 2, s)) + i % 2;      // pair 2 + i / 2
        __m256i* hi = reinterpret_cast<__m256i*>(slot(buf, steps, 2 + i / 2, s)) + i % 2;  // (high)
        _mm256_store_si256(lo, _mm256_and_si256(q[i], nib));
        _mm256_store_si256(hi, _mm256_and_si256(_mm256_srli_epi16(q[i], 4), nib));
      }
    }
#else
    for (int64_t kk = 0; kk < kn; ++kk) {
      const uint8_t* row = tile + (k0 + kk) * 32;
      for (int64_t j = 0; j < 64; ++j)
        slot(buf, steps, j / 16, kk / 4)[j % 16 * 4 + (kk & 3)] = j < 32 ? row[j] & 15 : row[j - 32] >> 4;
    }
#endif
    return;
  }
  // the last tile of cols (16, 32 or 48) rows is stored as row pairs: byte (k, i) = q[2i, k] | q[2i + 1, k] << 4
  for (int64_t kk = 0; kk < kn; ++kk)
    for (int64_t j = 0; j < cols; ++j) {
      const uint8_t byte = tile[(k0 + kk) * (cols / 2) + j / 2];
      slot(buf, steps, j / 16, kk / 4)[j % 16 * 4 + (kk & 3)] = (j & 1) ? byte >> 4 : byte & 15;
    }
}

// q8 rows [n0, n0 + 8 pairs) (zero codes past n), k in [k0, k0 + kn), into buf; whole (AVX-VNNI's form): the
// unsigned codes q + 128 whole in each step's first vector instead of its two nibble planes.
void q8_chunk(const int8_t* qw, int64_t n, int64_t k, int64_t n0, int64_t k0, int64_t kn, uint8_t* buf,
              bool whole = false) {
  const int64_t steps = kn / 4, pairs = std::min<int64_t>(8, (n - n0 + 7) / 8);
#if defined(__AVX2__)
  const __m256i nib = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t v = 0; v < pairs; ++v)
    for (int64_t kk = 0; kk < kn; kk += 32) {  // 8 rows x 8 quads, transposed
      __m256i r[8];
      for (int i = 0; i < 8; ++i) {
        const int64_t row = n0 + 8 * v + i;
        r[i] = row < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + row * k + k0 + kk))
                       : _mm256_setzero_si256();
      }
      __m256i t[8], u[8];
      for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);      // quads 0, 1 | 4, 5 of rows 2i, 2i + 1
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);  // quads 2, 3 | 6, 7
      }
      for (int i = 0; i < 2; ++i) {  // rows 4i .. 4i + 3
        u[4 * i + 0] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);      // quad 0 | 4
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);      // quad 1 | 5
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);  // quad 2 | 6
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);  // quad 3 | 7
      }
      for (int m = 0; m < 4; ++m) {
        const __m256i lo = _mm256_permute2x128_si256(u[m], u[4 + m], 0x20);  // quad m of rows 0-7
        const __m256i hi = _mm256_permute2x128_si256(u[m], u[4 + m], 0x31);  // quad m + 4
        for (int h = 0; h < 2; ++h) {
          const __m256i q = _mm256_xor_si256(h ? hi : lo, flip);
          __m256i* o = reinterpret_cast<__m256i*>(slot(buf, steps, v, kk / 4 + m + 4 * h));
          if (whole) {
            _mm256_store_si256(o, q);
            continue;
          }
          _mm256_store_si256(o, _mm256_and_si256(q, nib));
          _mm256_store_si256(o + 1, _mm256_and_si256(_mm256_srli_epi16(q, 4), nib));
        }
      }
    }
#else
  for (int64_t j = 0; j < 8 * pairs; ++j) {
    const int64_t row = n0 + j;
    const int8_t* src = row < n ? qw + row * k + k0 : nullptr;
    for (int64_t kk = 0; kk < kn; ++kk) {
      const uint8_t u = static_cast<uint8_t>((src ? src[kk] : 0) ^ 0x80);
      uint8_t* o = slot(buf, steps, j / 8, kk / 4) + j % 8 * 4 + (kk & 3);
      o[0] = u & 15;
      o[32] = u >> 4;
    }
  }
#endif
}

// ---- the register block --------------------------------------------------------------------------------------

// linear_steps.h's int8_step for group gi of R rows: tot[R][16 or 8] (row stride kCols) from the group's exact
// sums acc (block_groups' arguments; q8 with whole codes: acc[r][1] stays zero).
template <int R, int K>
inline void group_steps(i32x8 (&acc)[R][2], int64_t gi, const float* d, const int32_t* qs, int64_t ldg,
                        const float* prm, int64_t lds, float* tot) {
  for (int r = 0; r < R; ++r) {
    const int64_t o = r * ldg + gi;
    const f8 dv = simd::set1(d[o]);
    const i32x8 base = i32x8{} + qs[o];
    if constexpr (K == kQ4) {
      for (int j = 0; j < 2; ++j) {
        float* t = tot + r * kCols + 8 * j;
        simd::store(t, int8_step<lanes::Lanes8>(simd::load(t), acc[r][j] + base, dv,
                                                simd::load(prm + gi * lds + 8 * j)));
      }
    } else {
      const i32x8 a = (acc[r][0] + (acc[r][1] << 4)) + base;  // u = l + 16 h
      float* t = tot + r * kCols;
      simd::store(t, int8_step<lanes::Lanes8, K == kQ8Channel>(
                         simd::load(t), a, dv, K == kQ8Channel ? f8{} : simd::load(prm + gi * lds)));
    }
  }
}

// One (row block, vector pair) over the groups [g0, g1) of a chunk: tot[R][16 or 8] (row stride kCols) gets
// each group's f32 steps in order. A group is NW windows of W quad steps (W = 8; x groups of 16: one of 4), summed
// in int16 over each window.
//   wb: the pair's chunk (64 bytes per step); xq: x codes of the block's first row at the chunk's first k (row
//   stride ldx); d, qs: the block's first row's group 0 (row stride ldg; qs holds -off * sum(xq)); prm: per
//   group (q4, q8 grouped) the pair's 16 (q4) or 8 (q8) column scales, group stride lds.
template <int R, int K, int W, int NW>
__attribute__((noinline)) void block_groups(const uint8_t* wb, const int8_t* xq, int64_t ldx, int64_t g0, int64_t g1,
                                            const float* d, const int32_t* qs, int64_t ldg, const float* prm,
                                            int64_t lds, float* tot) {
  constexpr int64_t steps = W * NW;
  for (int64_t gi = g0; gi < g1; ++gi) {
    const int64_t s0 = (gi - g0) * steps;
    i32x8 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = i32x8{};
    for (int64_t w0 = s0; w0 < s0 + steps; w0 += W) {
      i16x16 c[R][2];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) c[r][0] = c[r][1] = i16x16{};
      // not fully unrolled: GCC then reassociates the int16 sums into trees and spills every product
#pragma GCC unroll 2
      for (int s = 0; s < W; ++s) {
        const uint8_t* p = wb + (w0 + s) * 64;
        const u8x32 a = vload<u8x32>(p), b = vload<u8x32>(p + 32);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const s8x32 xb = broadcast4(xq + r * ldx + 4 * (w0 + s));
          c[r][0] += maddubs(a, xb);
          c[r][1] += maddubs(b, xb);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        acc[r][0] += pair_sums(c[r][0]);
        acc[r][1] += pair_sums(c[r][1]);
      }
    }
    group_steps<R, K>(acc, gi, d, qs, ldg, prm, lds, tot);
  }
}

#if defined(__AVX2__)
// The same with AVX-VNNI's vpdpbusd where the CPU has it (Intel since Alder Lake and Sapphire Rapids, AMD since Zen
// 5): each quad's four products go straight into the int32 sums, one instruction where vpmaddubsw takes two and a
// widening every window, and q8's codes u = q + 128 whole (no int16 sum to saturate: q8_chunk's `whole` plane),
// one product where the nibble planes take two. The sums are exact either way: the same A, the same bits. 6 x 2
// int32 accumulators (kVnniRows). Steps: quad steps per group.
template <int R, int K, int Steps>
__attribute__((target("avxvnni"), noinline)) void block_groups_vnni(const uint8_t* wb, const int8_t* xq, int64_t ldx,
                                                                    int64_t g0, int64_t g1, const float* d,
                                                                    const int32_t* qs, int64_t ldg, const float* prm,
                                                                    int64_t lds, float* tot) {
  constexpr int64_t steps = Steps;
  for (int64_t gi = g0; gi < g1; ++gi) {
    const int64_t s0 = (gi - g0) * steps;
    i32x8 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = i32x8{};
#pragma GCC unroll 2
    for (int64_t s = s0; s < s0 + steps; ++s) {
      const __m256i a = _mm256_load_si256(reinterpret_cast<const __m256i*>(wb + s * 64));
      const __m256i b = K == kQ4 ? _mm256_load_si256(reinterpret_cast<const __m256i*>(wb + s * 64 + 32)) : a;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i xb = reinterpret_cast<__m256i>(broadcast4(xq + r * ldx + 4 * s));
        acc[r][0] = reinterpret_cast<i32x8>(_mm256_dpbusd_avx_epi32(reinterpret_cast<__m256i>(acc[r][0]), a, xb));
        if constexpr (K == kQ4)
          acc[r][1] = reinterpret_cast<i32x8>(_mm256_dpbusd_avx_epi32(reinterpret_cast<__m256i>(acc[r][1]), b, xb));
      }
    }
    group_steps<R, K>(acc, gi, d, qs, ldg, prm, lds, tot);
  }
}
#endif

// Whether the passes use block_groups_vnni: where the CPU has AVX-VNNI, unless int8_vnni turned it off (the tests
// run both forms on such a CPU).
bool cpu_has_vnni() {
#if defined(__AVX2__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avxvnni");
#else
  return false;
#endif
}
std::atomic<bool> vnni_on{cpu_has_vnni()};

// q4: tot[R][16] (row stride kCols) += per row the fma chain over the groups of zero * sum(x), from 0 (../int8.cpp
// adds it last). z: the 16 columns' zeros of group 0, group stride lds; xs: the first row's sums (row stride G).
template <int R>
__attribute__((noinline)) void zero_terms(const float* z, int64_t lds, const float* xs, int64_t groups, float* tot) {
  f8 zv[R][2] = {};
  for (int64_t gi = 0; gi < groups; ++gi) {
    const f8 z0 = simd::load(z + gi * lds), z1 = simd::load(z + gi * lds + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const f8 xv = simd::set1(xs[r * groups + gi]);
      zv[r][0] = simd::fma(z0, xv, zv[r][0]);
      zv[r][1] = simd::fma(z1, xv, zv[r][1]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2; ++j) simd::store(tot + r * kCols + 8 * j, simd::load(tot + r * kCols + 8 * j) + zv[r][j]);
}

// A tile's column parameters, zero past its last column: q4 per group scales [64] then zeros [64]; q8 grouped per
// group scales [64]; q8 per channel scales [64].
template <int K>
void tile_params(const Weight& w, int64_t groups, int64_t n0, int64_t cols, float* prm) {
  if constexpr (K == kQ4) {  // the exact kernels' (tiles.h): q4 (scale, zero) pairs, q4k's with codes from 8
    const Q4 q4{w.qw, static_cast<const uint8_t*>(w.sc), w.st, w.cols, w.k, w.g};
    Q4kSupers ds;
    for (int64_t gi = 0; gi < groups; ++gi) {
      float* o = prm + gi * 2 * kCols;
      if (w.sup) {
        q4k_params(w.q4k, gi, n0, true, o, o + kCols, ds);
      } else {
        q4_pairs_params(q4, w.pairs, gi, n0, o, o + kCols);
      }
    }
  } else if constexpr (K == kQ8Grouped) {  // [N, G]
    q8_scale_table(w, n0, cols, groups, prm);
  } else {  // [N]
    std::fill(prm, prm + kCols, 0.f);
    to_f32(w.sc, w.st, n0, cols, prm);
  }
}

template <int K>
at::Tensor linear_i8(const at::Tensor& x, const Weight& w) {
  const int64_t t = x.size(0), k = w.k, xg = w.g;
  at::Tensor y = at::empty({t, w.cols}, x.options());
  if (t == 0) return y;
  const Activations a = quantize_rows(x, xg);
  const int64_t groups = a.groups;
  // each group's offset term of A, -off * sum(q) (off: 8 for the q4 codes, 128 for the q8 ones made unsigned)
  std::vector<int32_t> qoff(t * groups);
  for (size_t i = 0; i < qoff.size(); ++i) qoff[i] = (K == kQ4 ? -8 : -128) * a.qs[i];
  const int64_t tiles = (w.cols + kCols - 1) / kCols;
  const bool vnni = vnni_on.load(std::memory_order_relaxed);
  parallel_items(tiles, [&](auto&& next) {
    // a K chunk of the tile's quads (64-byte aligned: each step of a pair is one cache line), kept for the
    // thread's next call
    static thread_local std::vector<uint8_t> buf;
    buf.resize(std::min(kChunk, k) / 4 * 64 * (K == kQ4 ? 4 : 8) + 64);
    uint8_t* const bp = buf.data() + (-reinterpret_cast<uintptr_t>(buf.data()) & 63);
    // per group: q4 scales [64] then zeros [64]; q8 grouped: scales [64]; q8 per channel: scales [64]; none for
    // q8k's decode passes, which decode their scales from the codes (a zeroed table per call on the hot path)
    const bool q8k_direct = K == kQ8Grouped && w.sup && t <= kDirectRows;
    // q4k's decode passes over whole tiles decode each group's scales where q4_direct_by uses them: no table
    const bool q4k_direct = K == kQ4 && w.sup && t <= kDirectRows && w.cols % kCols == 0;
    std::vector<float> prm(q8k_direct || q4k_direct ? 0
                           : K == kQ8Channel      ? kCols
                                                  : groups * (K == kQ4 ? 2 : 1) * kCols);
    std::vector<float> tot(t * kCols);
    for (int64_t tile; (tile = next()) >= 0;) {
      const int64_t n0 = tile * kCols, cols = std::min(kCols, w.cols - n0);
      const bool direct = t <= kDirectRows && (K != kQ4 || cols == kCols);
      if (!q8k_direct && !q4k_direct) tile_params<K>(w, groups, n0, cols, prm.data());
      std::fill(tot.begin(), tot.end(), 0.f);
      if (direct) {
        if constexpr (K == kQ4) {  // every row in one call: a group's codes split and its scales decoded once
          const uint8_t* tp = w.qw + n0 * (k / 2);
          auto rows = [&](int64_t, auto R) {
            constexpr int rr = decltype(R)::value;
            if (q4k_direct)
              q4_direct_by<rr>(tp, groups, xg, a.q, a.d, qoff.data(), a.xs, Q4kDirectParams{w.q4k, n0}, tot.data(),
                               vnni, k, groups, kCols);
            else
              q4_direct<rr>(tp, groups, xg, a.q, a.d, qoff.data(), a.xs, prm.data(), 2 * kCols, tot.data(), vnni, k,
                            groups, kCols);
          };
          with_rows<kDirectRows>(t, 0, rows);
        } else {
          for (int64_t r = 0; r < t; ++r) {
            const int8_t* xq = a.q + r * k;
            const float* dr = a.d + r * groups;
            float* tr = tot.data() + r * kCols;
            const bool kq = q8k_direct;  // q8k: scales decoded from the codes, no table
            for (int64_t c = 0; c < cols; c += 8)
              q8_direct<K == kQ8Channel>(reinterpret_cast<const int8_t*>(w.qw) + (n0 + c) * k, cols - c, k, xg, xq, dr,
                           kq ? nullptr : prm.data() + c, kCols,
                           kq ? static_cast<const int8_t*>(w.sc) + (n0 + c) * (k / 16) : nullptr,
                           kq ? static_cast<const uint16_t*>(w.sup) + (n0 + c) * (k / 256) : nullptr, tr + c);
          }
        }
      }
      // vector pairs: q4 16 columns each (stored tiles hold a multiple of 16), q8 the two planes of 8 columns
      const int64_t pairs = K == kQ4 ? cols / 16 : (cols + 7) / 8;
      const int64_t pair_cols = K == kQ4 ? 16 : 8;
      for (int64_t k0 = 0; k0 < (direct ? 0 : k); k0 += kChunk) {
        const int64_t kn = std::min(kChunk, k - k0), g0 = k0 / xg, g1 = (k0 + kn) / xg;
        if constexpr (K == kQ4) q4_chunk(w.qw, w.cols, k, n0, k0, kn, bp);
        else q8_chunk(reinterpret_cast<const int8_t*>(w.qw), w.cols, k, n0, k0, kn, bp, vnni);
        for (int64_t pr = 0; pr < pairs; ++pr) {  // the pair's codes for the chunk stay in L1 over the rows
          const uint8_t* wb = slot(bp, kn / 4, pr, 0);
          const float* pp = prm.data() + pr * pair_cols;
          const int64_t lds = K == kQ4 ? 2 * kCols : kCols;
          auto block = [&](int64_t r0, auto R, auto Vnni) {
            constexpr int rr = decltype(R)::value;
            auto run = [&](auto W, auto NW) {
              constexpr int w_ = decltype(W)::value, nw = decltype(NW)::value;
              if constexpr (decltype(Vnni)::value) {
#if defined(__AVX2__)
                block_groups_vnni<rr, K, w_ * nw>(wb, a.q + r0 * k + k0, k, g0, g1, a.d + r0 * groups,
                                                   qoff.data() + r0 * groups, groups, pp, lds,
                                                   tot.data() + r0 * kCols + pr * pair_cols);
#endif
              } else {
                block_groups<rr, K, w_, nw>(wb, a.q + r0 * k + k0, k, g0, g1, a.d + r0 * groups,
                                            qoff.data() + r0 * groups, groups, pp, lds,
                                            tot.data() + r0 * kCols + pr * pair_cols);
              }
            };
            using I4 = std::integral_constant<int, 4>;
            using I8 = std::integral_constant<int, 8>;
            switch (xg) {
              case 16: run(I4{}, std::integral_constant<int, 1>{}); break;
              case 32: run(I8{}, std::integral_constant<int, 1>{}); break;
              case 64: run(I8{}, std::integral_constant<int, 2>{}); break;
              case 128: run(I8{}, std::integral_constant<int, 4>{}); break;
              default: run(I8{}, std::integral_constant<int, 8>{}); break;
            }
          };
#if defined(__AVX2__)  // (elsewhere vnni is false: no AVX-VNNI form is compiled)
          if (vnni) {
            row_blocks<kVnniRows>(t, [&](int64_t r0, auto R) { block(r0, R, std::true_type{}); });
            continue;
          }
#endif
          row_blocks<kRowBlock>(t, [&](int64_t r0, auto R) { block(r0, R, std::false_type{}); });
        }
      }
      if (K == kQ4 && !direct)  // zero * sum(x) per group, in group order, added last (q4_direct adds its own)
        for (int64_t pr = 0; pr < pairs; ++pr)
          row_blocks<kRowBlock>(t, [&](int64_t r0, auto R) {
            zero_terms<decltype(R)::value>(prm.data() + kCols + 16 * pr, 2 * kCols, a.xs + r0 * groups, groups,
                                           tot.data() + r0 * kCols + 16 * pr);
          });
      if constexpr (K == kQ8Channel)
        for (int64_t r = 0; r < t; ++r)
          for (int64_t j = 0; j < cols; ++j) tot[r * kCols + j] *= prm[j];
      store_rows(tot.data(), kCols, t, cols, y, n0);  // tiles.h
    }
  });
  return y;
}

at::Tensor q4_linear_i8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales_zeros,
                        int64_t group_size) {
  return linear_i8<kQ4>(x, q4_weight(x, qweight, scales_zeros, group_size));
}

at::Tensor q8_linear_i8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t group_size) {
  const Weight w = q8_weight(x, qweight, scales, group_size);
  return group_size ? linear_i8<kQ8Grouped>(x, w) : linear_i8<kQ8Channel>(x, w);
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
  return linear_i8<kQ8Grouped>(x, q8k_weight(x, qweight, scales, supers));
}

// GGUF blocks kept as stored whose values are q8k's (q6k, q3k, iq4_xs): int8_decode.h's blocks_i8 with this tier's
// activations, store and q8k_linear_i8.
template <class B>
at::Tensor blocks_linear_i8(const at::Tensor& x, const at::Tensor& blocks, const char* op) {
  check_blocks(x, blocks, op, 256, B::kBlockBytes);
  check_x(x, x.size(1), op);
  return blocks_i8<B>(
      x, blocks, kCols, [](const at::Tensor& x) { return quantize_rows(x, 16); },
      [](at::Tensor& y, const float* acc, int64_t t, int64_t cols, int64_t n0) {
        store_rows(acc, kCols, t, cols, y, n0);  // tiles.h
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

// enable < 0: asks; 0: the passes use vpmaddubsw; 1: AVX-VNNI where the CPU has it. Returns whether they use it.
at::Tensor int8_vnni(int64_t enable) {
  if (enable >= 0) vnni_on.store(enable > 0 && cpu_has_vnni());
  return at::scalar_tensor(vnni_on.load(), at::kBool);
}

}  // namespace
