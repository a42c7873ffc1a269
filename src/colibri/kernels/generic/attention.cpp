// Batch-invariant attention, one text for every tier: each (head, query) reduces over exactly its visible keys
// [lo, p], in key order, so its result depends neither on the other queries in the pass nor on keys after p (a
// query computed in a decode step equals the same query inside a prefill chunk). Written over lanes.h's traits:
// 16-lane AVX-512 registers in the avx512 tier, simd.h's 8-lane vectors in avx2 and portable, the same bits.
//
// Per query: s_j = (q . k_j) * scale, soft-capped; m = max s_j; e_j = exp(s_j - m); l = sum e_j in key order;
// out = (sum_j e_j v_j in key order) / l. Exact two-pass softmax in f32; inputs f32 or bf16 (widened exactly),
// output in q's dtype (bf16: out rounded as torch's conversion rounds it, NaN to 0x7fc0). The order, step by step:
//   - q . k_j: 16 lane partials over Dh (lane i sums elements i, i + 16, ...: a multiply for the first chunk of
//     16, then one fma per chunk; lanes past Dh multiply zeros), then per key the fixed tree of
//     _mm512_reduce_add_ps (lanes.h: fold, reduce_rows), L keys at a time.
//   - the max: into 16 slots (key j in slot j % 16), then _mm512_reduce_max_ps's tree (lanes.h: max_slots).
//   - exp: lanes.h's exp (range reduction, Horner fmas, scalef).
//   - the soft cap: cap * tanh(s / cap), tanh(y) = sign(y) (1 - e) / (1 + e) with e = lanes.h's exp(-2 |y|), a
//     series below |y| = 0.5 (soft_cap; not std::tanh, each C library's own: aarch64's glibc gave other bits).
// The rest (scale, the key-order sum, the fmas of e_j * v_j, the division) is plain IEEE f32.
//
// The query heads sharing a KV head go through each key and value row together, up to Lanes::kMaxGroup at a time
// (each head's arithmetic is the same whatever the group, so any task split is valid).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "../args.h"
#include "../library.h"
#include "../stream.h"
#include "lanes.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using lanes::Lanes;
using V = Lanes::V;
constexpr int kL = Lanes::L;

// Key or value rows: row j of head h at rows[j] + h * s0 (bytes). One table entry per key, so the rows may lie
// in one tensor (attend) or in the KV cache's blocks where they are stored (attend_paged): the same rows, read in
// the same order, give the same bits. A decode step reads them once, from DRAM, in runs of a block's rows (the
// blocks lie apart, and the hardware prefetcher starts over in each): fetch(h, j, off, bytes) asks for bytes
// [off, off + bytes) of row j + ahead (ahead = 0: a longer pass, whose queries share the rows in cache; nothing).
constexpr int64_t kAheadRows = 16;  // the best of 0-32 measured (docs/performance.md, "Long contexts")
struct Rows {
  const char* const* rows;
  int64_t s0, n, ahead;  // n: rows in the table
  const char* const* scales = nullptr;  // q8 rows: row j's scales of head h at scales[j] + h * ss0
  int64_t ss0 = 0;
  const char* row(int64_t h, int64_t j) const { return rows[j] + h * s0; }
  void fetch(int64_t h, int64_t j, int64_t off, int64_t bytes) const {
    if (ahead > 0 && j + ahead < n) prefetch_span(row(h, j + ahead) + off, bytes);
  }
};

// q8 rows (--kv-quant q8): int8 codes [Hkv, B, Dh] and f32 scales [Hkv, B, Dh / kQ8Group] per block. A value is
// its code times its group's scale in f32, rounded to bf16 (to nearest, ties to even: torch's conversion) where
// the cache's dtype is bf16: ops.dequantize_q8, so attention over q8 rows is attention over those rows
// dequantized, bit for bit, without a dequantized copy of the context per layer and step. The row type `Q8`:
// scores and outputs dequantize each row (or a pass's columns of it) into a small buffer where they read it.
constexpr int64_t kQ8Group = 32;
constexpr int64_t kQ8MaxD = 512;
struct Q8 {
  int8_t code;  // (sizeof: a stored value's bytes)
};

// Values [c0, c0 + n) of q8 row j of head h into out (c0 and n multiples of kL: Dh % 32 == 0 is checked, and the
// passes over a value row's columns take whole vectors).
inline void q8_values(const Rows& r, int64_t h, int64_t j, int64_t c0, int64_t n, bool bf, float* out) {
  const int8_t* c = reinterpret_cast<const int8_t*>(r.row(h, j));
  const float* s = reinterpret_cast<const float*>(r.scales[j] + h * r.ss0);
  for (int64_t i = c0; i < c0 + n; i += kL) {
    const V v = Lanes::load_i8(c + i) * Lanes::set1(s[i / kQ8Group]);
    Lanes::store(out + (i - c0), bf ? Lanes::torch_bf16(v) : v);
  }
}

// Query-key products (H * T * S * Dh) below which a pass runs on the calling thread (attend_rows): measured on
// decode steps of SmolLM2's and Qwen2.5-1.5B's shapes (docs/performance.md, "The layer's other work").
constexpr int64_t kInlineWork = int64_t{1} << 18;

struct Pass {  // what every task of one attend() call shares
  View qv;
  Rows kv, vv;
  bool qb, kb, vb, q8;  // kb, vb: the values are bf16 (q8: dequantized to bf16); q8: the rows have scales
  int64_t T, D, S, G, Dp, window;
  const int64_t* pos;
  float sc, cap, *out;
  int64_t oh, ot;  // out's strides (floats) per head and per query: [H, T, D] or, for attend_pass.cpp, [T, H, D]
};

// Key row k's dot products with GB query rows (q + g * Dp, zero-padded to Dp = 16 * chunks) as 16 lane partials,
// folded for reduce_rows: t[g]. EXACT: q and k both bf16, so every product is exact in f32.
template <class KT, int GB, bool EXACT>
inline void key_dots(const KT* k, const float* q, int64_t Dp, int64_t D, V* t) {
  Lanes::P acc[GB];
  const int64_t full = D / 16 * 16;  // the chunks inside D, then at most one partial one
  Lanes::P kc = full > 0 ? Lanes::load16(k) : Lanes::row16(k, 0, D);
  for (int g = 0; g < GB; ++g) acc[g] = Lanes::mul16(q + g * Dp, kc);
  for (int64_t e = 16; e < full; e += 16) {
    kc = Lanes::load16(k + e);
    for (int g = 0; g < GB; ++g) acc[g] = Lanes::madd16<EXACT>(q + g * Dp + e, kc, acc[g]);
  }
  if (full > 0 && full < D) {
    kc = Lanes::row16(k, full, D);
    for (int g = 0; g < GB; ++g) acc[g] = Lanes::madd16<EXACT>(q + g * Dp + full, kc, acc[g]);
  }
  for (int g = 0; g < GB; ++g) t[g] = Lanes::fold(acc[g]);
}

// tanh(a) for 0 <= a < 0.5: its series to a^15, by Horner's rule over a^2 (IEEE steps): (1 - e) / (1 + e) below
// loses the small values' bits to 1 - e (soft_cap: 3 ulp of the exact result at most, as glibc's tanhf).
inline float tanh_small(float a) {
  const float z = a * a;
  float p = -1.4558344e-3f;  // -929569 / 638512875
  for (const float c : {3.5921280e-3f, -8.8632355e-3f, 2.1869489e-2f, -5.3968254e-2f, 1.3333334e-1f, -3.3333334e-1f})
    p = p * z + c;
  return a + a * (z * p);
}

// s[0, n) = cap * tanh(s / cap) (s has room for whole vectors past n): tanh(y) = sign(y) (1 - e) / (1 + e), e =
// exp(-2 |y|) by lanes.h's exp (tanh_small below |y| = 0.5), the rest IEEE f32 steps, so the same bits in every tier
// and on every CPU; NaN stays NaN.
inline void soft_cap(float* s, int64_t n, float cap) {
  alignas(64) float y[kL], e[kL];
  for (int64_t j = 0; j < n; j += kL) {
    const int64_t m = std::min<int64_t>(kL, n - j);
    for (int64_t i = 0; i < kL; ++i) {
      y[i] = i < m ? s[j + i] / cap : 0.f;
      e[i] = -2.f * std::fabs(y[i]);
    }
    Lanes::store(e, Lanes::exp(Lanes::load(e)));
    for (int64_t i = 0; i < m; ++i) {
      const float a = std::fabs(y[i]);
      const float t = a < 0.5f ? tanh_small(a) : (1.f - e[i]) / (1.f + e[i]);
      s[j + i] = std::isnan(y[i]) ? y[i] : std::copysign(t, y[i]) * cap;
    }
  }
}

// Scores of keys lo .. lo + n - 1 for GB heads into s + g * ld (scaled, not yet capped); kL keys per block, the
// last block's extra lanes (below ld) hold junk.
template <class KT, int GB, bool EXACT>
void scores(const Pass& a, int64_t hk, int64_t lo, int64_t n, const float* q, float* s, int64_t ld) {
  for (int64_t jb = 0; jb < n; jb += kL) {
    V t[GB][kL], r[GB];
    const int64_t nb = std::min<int64_t>(kL, n - jb);
    for (int64_t i = 0; i < kL; ++i) {
      if (i < nb) {
        a.kv.fetch(hk, lo + jb + i, 0, a.D * sizeof(KT));
        if constexpr (std::is_same_v<KT, Q8>) {
          alignas(64) float k[kQ8MaxD];
          q8_values(a.kv, hk, lo + jb + i, 0, a.D, a.kb, k);
          key_dots<float, GB, EXACT>(k, q, a.Dp, a.D, r);
        } else {
          key_dots<KT, GB, EXACT>(reinterpret_cast<const KT*>(a.kv.row(hk, lo + jb + i)), q, a.Dp, a.D, r);
        }
        for (int g = 0; g < GB; ++g) t[g][i] = r[g];
      } else {
        for (int g = 0; g < GB; ++g) t[g][i] = Lanes::zero();
      }
    }
    for (int g = 0; g < GB; ++g) Lanes::store(s + g * ld + jb, Lanes::reduce_rows(t[g]) * Lanes::set1(a.sc));
  }
}

// Columns [col, col + n) of value row j: where they are stored, or (q8) dequantized into buf.
template <class VT>
inline auto value_columns(const Pass& a, int64_t hk, int64_t j, int64_t col, int64_t n, float* buf) {
  if constexpr (std::is_same_v<VT, Q8>) {
    q8_values(a.vv, hk, j, col, n, a.vb, buf);
    return static_cast<const float*>(buf);
  } else {
    return reinterpret_cast<const VT*>(a.vv.row(hk, j)) + col;
  }
}

// out[g][col, col + kL * NV) = (sum_j e[g][j] * v_j) / l[g], in key order.
template <class VT, int GB, int NV>
void weighted(const Pass& a, int64_t hk, int64_t lo, int64_t n, const float* e, int64_t ld, const float* l,
              float* const* out, int64_t col) {
  V acc[GB][NV];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = Lanes::zero();
  alignas(64) float buf[kL * NV];
  for (int64_t j = 0; j < n; ++j) {
    a.vv.fetch(hk, lo + j, col * sizeof(VT), kL * NV * sizeof(VT));  // this pass's columns of the row
    const auto* r = value_columns<VT>(a, hk, lo + j, col, kL * NV, buf);
    V v[NV];
    for (int c = 0; c < NV; ++c) v[c] = Lanes::load(r + kL * c);
    for (int g = 0; g < GB; ++g) {
      const V w = Lanes::set1(e[g * ld + j]);
      for (int c = 0; c < NV; ++c) acc[g][c] = Lanes::fma(w, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NV; ++c) Lanes::store(out[g] + col + kL * c, acc[g][c] / Lanes::set1(l[g]));
}

// The same for the last m (< kL) columns.
template <class VT, int GB>
void weighted_tail(const Pass& a, int64_t hk, int64_t lo, int64_t n, const float* e, int64_t ld, const float* l,
                   float* const* out, int64_t col, int64_t m) {
  V acc[GB];
  for (int g = 0; g < GB; ++g) acc[g] = Lanes::zero();
  alignas(64) float buf[kL];
  for (int64_t j = 0; j < n; ++j) {
    const V v = Lanes::load_n(value_columns<VT>(a, hk, lo + j, col, m, buf), m);
    for (int g = 0; g < GB; ++g) acc[g] = Lanes::fma(Lanes::set1(e[g * ld + j]), v, acc[g]);
  }
  for (int g = 0; g < GB; ++g) Lanes::store_n(out[g] + col, acc[g] / Lanes::set1(l[g]), m);
}

template <class VT, int GB>
void outputs(const Pass& a, int64_t hk, int64_t lo, int64_t n, const float* e, int64_t ld, const float* l,
             float* const* out) {
  constexpr int W = GB == 1 ? 8 : GB == 2 ? 4 : 2;  // vectors per pass over the values
  const int64_t D = a.D;
  int64_t col = 0;
  for (; col + kL * W <= D; col += kL * W) weighted<VT, GB, W>(a, hk, lo, n, e, ld, l, out, col);
  if (W > 4 && col + kL * 4 <= D) weighted<VT, GB, 4>(a, hk, lo, n, e, ld, l, out, col), col += kL * 4;
  for (; W > 2 && col + kL * 2 <= D; col += kL * 2) weighted<VT, GB, 2>(a, hk, lo, n, e, ld, l, out, col);
  for (; col + kL <= D; col += kL) weighted<VT, GB, 1>(a, hk, lo, n, e, ld, l, out, col);
  if (col < D) weighted_tail<VT, GB>(a, hk, lo, n, e, ld, l, out, col, D - col);
}

// Query t of the GB heads h0 .. h0 + GB - 1 (all of KV head hk).
template <int GB>
void attend_heads(const Pass& a, int64_t hk, int64_t h0, int64_t t, std::vector<float>& buf) {
  const int64_t p = a.pos[t], D = a.D, Dp = a.Dp;
  const int64_t hi = std::min(p, a.S - 1), lo = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
  float* out[GB];
  for (int g = 0; g < GB; ++g) out[g] = a.out + (h0 + g) * a.oh + t * a.ot;
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
  if (a.q8 && a.kb && a.qb)
    scores<Q8, GB, true>(a, hk, lo, n, q, s, ld);
  else if (a.q8)
    scores<Q8, GB, false>(a, hk, lo, n, q, s, ld);
  else if (a.kb && a.qb)
    scores<uint16_t, GB, true>(a, hk, lo, n, q, s, ld);
  else if (a.kb)
    scores<uint16_t, GB, false>(a, hk, lo, n, q, s, ld);
  else
    scores<float, GB, false>(a, hk, lo, n, q, s, ld);
  float l[GB];
  for (int g = 0; g < GB; ++g) {
    float* sg = s + g * ld;
    if (a.cap > 0)
      soft_cap(sg, n, a.cap);
    const V mv = Lanes::set1(Lanes::max_slots(sg, n));
    for (int64_t j = 0; j < n; j += kL) Lanes::store(sg + j, Lanes::exp(Lanes::load(sg + j) - mv));
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) sum += sg[j];
    l[g] = sum;
  }
  if (a.q8)
    outputs<Q8, GB>(a, hk, lo, n, s, ld, l, out);
  else if (a.vb)
    outputs<uint16_t, GB>(a, hk, lo, n, s, ld, l, out);
  else
    outputs<float, GB>(a, hk, lo, n, s, ld, l, out);
}

template <int GB>
void attend_task(const Pass& a, int64_t hk, int64_t h0, int64_t t, std::vector<float>& buf, int64_t gb) {
  if constexpr (GB > 1)
    if (gb < GB) return attend_task<GB - 1>(a, hk, h0, t, buf, gb);
  attend_heads<GB>(a, hk, h0, t, buf);
}

// The pass over q's queries and heads, with the key and value rows laid out as tables (S entries each) -> [H, T, D],
// or with by_query [T, H * D] (each query's heads side by side: the layout the output projection reads).
at::Tensor attend_rows(const at::Tensor& q, const Rows& kr, const Rows& vr, bool kb, bool vb, int64_t Hkv, int64_t S,
                       const at::Tensor& positions, int64_t window, double scale, double softcap,
                       bool by_query = false) {
  const int64_t H = q.size(0), T = q.size(1), D = q.size(2);
  const View qv = view_of(q);
  const bool qb = q.scalar_type() == at::kBFloat16;
  const int64_t G = H / Hkv;
  const at::Tensor pos = positions.contiguous();
  at::Tensor out = at::empty(by_query ? at::IntArrayRef{T, H * D} : at::IntArrayRef{H, T, D},
                             q.options().dtype(at::kFloat));
  if (out.numel() == 0) return out.to(q.scalar_type());
  const Pass a{qv, kr, vr, qb, kb, vb, kr.scales != nullptr, T, D, S, G, 16 * ((D + 15) / 16), window,
               pos.data_ptr<int64_t>(), static_cast<float>(scale), static_cast<float>(softcap), out.data_ptr<float>(),
               by_query ? D : T * D, by_query ? H * D : D};
  // Tasks: (KV head, query, group of up to kMaxGroup of its query heads); smaller groups only where that leaves
  // fewer tasks than threads: every group re-reads its KV head's rows, and single heads (four tasks a thread, the
  // rule before) made long decode steps slower (docs/performance.md). A pass with little work (a decode step over
  // a short context: below kInlineWork query-key products) runs on the calling thread, where the fork and join of
  // a parallel region cost more than the second thread saves. Same results either way.
  const bool inline_pass = H * T * S * D < kInlineWork || at::get_num_threads() == 1 || at::in_parallel_region();
  const int64_t threads = inline_pass ? 1 : at::get_num_threads();
  int64_t gs = std::min<int64_t>(G, Lanes::kMaxGroup);
  while (gs > 1 && Hkv * T * ((G + gs - 1) / gs) < threads) --gs;
  const int64_t ng = (G + gs - 1) / gs;
  auto run = [&](int64_t b, int64_t e) {
    std::vector<float> buf;
    for (int64_t task = b; task < e; ++task) {
      const int64_t hk = task / (T * ng), t = task / ng % T, g0 = task % ng * gs, h0 = hk * G + g0;
      attend_task<Lanes::kMaxGroup>(a, hk, h0, t, buf, std::min(gs, G - g0));
    }
  };
  if (inline_pass)
    run(0, Hkv * T * ng);
  else
    at::parallel_for(0, Hkv * T * ng, 1, run);
  if (qb) {  // here rather than a torch conversion after the call: one op less per layer and decode step
    at::Tensor o16 = at::empty(out.sizes(), q.options().dtype(at::kBFloat16));
    const float* src = out.data_ptr<float>();
    uint16_t* dst = reinterpret_cast<uint16_t*>(o16.data_ptr<at::BFloat16>());
    for (int64_t i = 0; i < out.numel(); ++i) dst[i] = simd::f32_to_bf16(src[i]);
    return o16;
  }
  return out;
}

// The table of the first `length` rows of blocks of [Hkv, B, ...] rows with the same strides (rows [i * B,
// (i + 1) * B) in block i): row j's address, each where it lies.
std::vector<const char*> row_table(at::TensorList blocks, int64_t length) {
  const int64_t B = blocks[0].size(1), s1 = view_of(blocks[0]).s1;
  std::vector<const char*> rows(length);
  for (int64_t j = 0; j < length; ++j)
    rows[j] = static_cast<const char*>(blocks[j / B].data_ptr()) + j % B * s1;
  return rows;
}

// The prefetch distance of a pass over rows that lie apart: decode passes (a few queries) read each row once.
int64_t rows_ahead(const at::Tensor& q) { return q.size(1) <= 4 ? kAheadRows : 0; }

// Keys and values in blocks of [Hkv, B, Dh] rows (the same strides), keys [i * B, (i + 1) * B) in block i; the
// first `length` attended, each row read where it lies (ahead: attend_rows' prefetch distance, 0 for none).
at::Tensor attend_blocks(const at::Tensor& q, at::TensorList k, at::TensorList v, int64_t length,
                         const at::Tensor& positions, int64_t window, double scale, double softcap, int64_t ahead,
                         bool by_query = false) {
  const std::vector<const char*> kr = row_table(k, length), vr = row_table(v, length);
  return attend_rows(q, Rows{kr.data(), view_of(k[0]).s0, length, ahead},
                     Rows{vr.data(), view_of(v[0]).s0, length, ahead}, k[0].scalar_type() == at::kBFloat16,
                     v[0].scalar_type() == at::kBFloat16, k[0].size(0), length, positions, window, scale, softcap,
                     by_query);
}

// k, v: [Hkv, S, Dh] tensors (strided rows, contiguous last dimension): one block of S rows, with no software
// prefetch (one run of rows per head: the hardware prefetcher follows it, and an assembled context is in cache).
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                  int64_t window, double scale, double softcap) {
  check_attend(q, k, v, positions);
  return attend_blocks(q, {k}, {v}, k.size(1), positions, window, scale, softcap, 0);
}

// KV blocks k, v: lists of [Hkv, B, Dh] blocks, each list's of one shape, strides and dtype, holding `length` rows.
void check_blocks(at::TensorList k, at::TensorList v, int64_t length, const char* op) {
  TORCH_CHECK(!k.empty() && k.size() == v.size(), op, ": k and v must be lists of the same number of blocks");
  const int64_t B = k[0].size(1);
  TORCH_CHECK(k[0].dim() == 3 && B > 0 && length >= 0 && length <= B * static_cast<int64_t>(k.size()), op,
              ": blocks must be [Hkv, B, Dh] and hold `length` keys");
  for (const at::TensorList* l : {&k, &v})
    for (const at::Tensor& t : *l)
      TORCH_CHECK(t.sizes() == k[0].sizes() && t.strides() == (*l)[0].strides() &&
                      t.scalar_type() == (*l)[0].scalar_type(),
                  op, ": every block of k (of v) must have the same shape, strides and dtype");
}

// k, v: the KV cache's blocks as stored, [Hkv, B, Dh] each (the same shape, dtype and strides), holding keys
// [i * B, (i + 1) * B) in block i; the first `length` keys are attended (attend's result for the blocks
// concatenated along their rows, bit for bit: the kernel reads the same rows in the same order).
at::Tensor attend_paged(const at::Tensor& q, at::TensorList k, at::TensorList v, int64_t length,
                        const at::Tensor& positions, int64_t window, double scale, double softcap) {
  check_blocks(k, v, length, "attend_paged");
  check_attend(q, k[0], v[0], positions);
  return attend_blocks(q, k, v, length, positions, window, scale, softcap, rows_ahead(q));
}

// The same over q8 blocks (--kv-quant q8): codes k, v [Hkv, B, Dh] int8 and their scales ks, vs [Hkv, B, Dh / 32]
// f32 per block; bf16: the cache's dtype is bf16 (values rounded as they are dequantized), else f32. attend's
// result for the blocks dequantized and concatenated, bit for bit.
at::Tensor attend_paged_q8(const at::Tensor& q, at::TensorList k, at::TensorList ks, at::TensorList v,
                           at::TensorList vs, int64_t length, const at::Tensor& positions, int64_t window, double scale,
                           double softcap, bool bf16) {
  TORCH_CHECK(!k.empty() && ks.size() == k.size() && v.size() == k.size() && vs.size() == k.size(),
              "attend_paged_q8: k, k scales, v and v scales must be lists of the same number of blocks");
  const int64_t Hkv = k[0].size(0), B = k[0].size(1), D = k[0].size(2);
  TORCH_CHECK(k[0].dim() == 3 && B > 0 && length >= 0 && length <= B * static_cast<int64_t>(k.size()),
              "attend_paged_q8: blocks must be [Hkv, B, Dh] and hold `length` keys");
  TORCH_CHECK(D % kQ8Group == 0 && D <= kQ8MaxD, "attend_paged_q8: Dh must be a multiple of 32, at most 512");
  for (const at::TensorList* l : {&k, &v, &ks, &vs}) {
    const bool codes = l == &k || l == &v;
    for (const at::Tensor& t : *l)
      TORCH_CHECK(t.dim() == 3 && t.size(0) == Hkv && t.size(1) == B && t.size(2) == (codes ? D : D / kQ8Group) &&
                      t.stride(2) == 1 && t.strides() == (*l)[0].strides() &&
                      t.scalar_type() == (codes ? at::kChar : at::kFloat),
                  "attend_paged_q8: every block must be int8 [Hkv, B, Dh] codes or f32 [Hkv, B, Dh / 32] scales, "
                  "each list with the same strides");
  }
  TORCH_CHECK(q.dim() == 3 && q.size(2) == D && Hkv > 0 && q.size(0) % Hkv == 0,
              "attend_paged_q8: q must be [heads, rows, Dh], heads a multiple of the KV heads");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "attend_paged_q8: f32 or bf16 q");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == q.size(1) && positions.scalar_type() == at::kLong,
              "attend_paged_q8: positions must be int64 [T]");
  const std::vector<const char*> kr = row_table(k, length), vr = row_table(v, length),
                                  ksr = row_table(ks, length), vsr = row_table(vs, length);
  const int64_t ahead = rows_ahead(q);
  return attend_rows(q, Rows{kr.data(), view_of(k[0]).s0, length, ahead, ksr.data(), view_of(ks[0]).s0},
                     Rows{vr.data(), view_of(v[0]).s0, length, ahead, vsr.data(), view_of(vs[0]).s0}, bf16, bf16, Hkv,
                     length, positions, window, scale, softcap);
}

}  // namespace
