// A pass's attention over the KV cache's blocks in one call: the projections' biases added, RoPE on its queries
// and keys, its keys and values written into the blocks, attention over them, the output in the layout the output
// projection reads. Python made a dozen calls a layer for these (three bias adds, views, transposes, two RoPE calls,
// the rows' write, attention, the output's transpose), each run with the caches the weights' stream had just
// evicted (docs/performance.md, "What the LOSSY decode step waits on here"). The arithmetic is norm.cpp's rope_rows
// and generic/attention.cpp's attend_rows themselves: the same bits as those calls one by one.

#include <ATen/ATen.h>
#include "library.h"

#include <cstring>

namespace {

// y = x + b per row (x [rows, n] contiguous, b [n]), each sum rounded to T as torch's add rounds it (a linear's
// `y += b`: ops.add_bias).
template <typename T>
at::Tensor plus_bias(const at::Tensor& x, const at::Tensor& b) {
  using S = typename Elem<T>::S;
  at::Tensor y = at::empty_like(x);
  const int64_t n = b.numel(), rows = x.numel() / n;
  const S* xp = reinterpret_cast<const S*>(x.data_ptr<T>());
  const S* bp = reinterpret_cast<const S*>(b.data_ptr<T>());
  S* yp = reinterpret_cast<S*>(y.data_ptr<T>());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; ++i) yp[r * n + i] = Elem<T>::out(Elem<T>::in(xp[r * n + i]) + Elem<T>::in(bp[i]));
  return y;
}

// q [T, H * Dh], k, v [T, Hkv * Dh] (any shape with T rows, contiguous: the projections' outputs, before RoPE);
// cos, sin [T, Dh] in q's dtype; kb, vb: the cache's K and V blocks ([Hkv, B, Dh] each, q's dtype) holding the
// pass's positions as rows length - T .. length - 1, which this writes (k after RoPE, v as it is) before attention
// reads rows 0 .. length - 1 of them (attend_paged's arguments after those) -> o [T, H * Dh] in q's dtype.
// bias: none, or the projections' biases [H * Dh], [Hkv * Dh], [Hkv * Dh] in q's dtype, added first (as the
// linears' `y += b`).
at::Tensor rope_attend_paged(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                             at::TensorList bias, const at::Tensor& cos, const at::Tensor& sin, at::TensorList kb,
                             at::TensorList vb, int64_t length, const at::Tensor& positions, int64_t window,
                             double scale, double softcap) {
  const char* op = "rope_attend_paged";
  check_blocks(kb, vb, length, op);
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(1) % 2 == 0, op,
              ": cos and sin must be [T, Dh], Dh even");
  const int64_t T = cos.size(0), D = cos.size(1), Hkv = kb[0].size(0), B = kb[0].size(1);
  const auto dt = q_in.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, op, ": f32 or bf16 only");
  for (const at::Tensor& t : {k_in, v_in, cos, sin, kb[0], vb[0]})
    TORCH_CHECK(t.scalar_type() == dt, op, ": q, k, v, cos, sin and the blocks must have one dtype");
  for (const at::Tensor& t : {q_in, k_in, v_in})
    TORCH_CHECK(t.dim() >= 1 && t.size(0) == T && t.is_contiguous(), op, ": q, k, v must be contiguous, T rows");
  TORCH_CHECK(T > 0 && T <= length && kb[0].size(2) == D && k_in.numel() == T * Hkv * D &&
                  v_in.numel() == T * Hkv * D && q_in.numel() % (T * Hkv * D) == 0,
              op, ": q [T, H * Dh], k and v [T, Hkv * Dh] must match the blocks' [Hkv, B, Dh]");
  TORCH_CHECK(vb[0].stride(2) == 1 && kb[0].stride(2) == 1, op, ": the blocks' rows must be contiguous");
  TORCH_CHECK(bias.empty() || bias.size() == 3, op, ": bias must be empty or (q, k, v) biases");
  at::Tensor q = q_in, k = k_in, v = v_in;
  for (size_t i = 0; i < bias.size(); ++i) {
    at::Tensor& t = i == 0 ? q : i == 1 ? k : v;
    const at::Tensor& b = bias[i];
    TORCH_CHECK(b.dim() == 1 && b.is_contiguous() && b.scalar_type() == dt && t.numel() == T * b.numel(), op,
                ": each bias must be [row size] of its tensor's dtype");
    t = dt == at::kFloat ? plus_bias<float>(t, b) : plus_bias<at::BFloat16>(t, b);
  }
  const int64_t H = q.numel() / (T * D);
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor qr = at::empty({H, T, D}, q.options()), kr = at::empty({Hkv, T, D}, q.options());
  const at::Tensor qv = q.view({T, H, D}).transpose(0, 1), kv = k.view({T, Hkv, D}).transpose(0, 1);
  if (dt == at::kFloat) {
    rope_rows(qv, cc.data_ptr<float>(), sc.data_ptr<float>(), qr.data_ptr<float>(), H, T, D);
    rope_rows(kv, cc.data_ptr<float>(), sc.data_ptr<float>(), kr.data_ptr<float>(), Hkv, T, D);
  } else {
    using BF = at::BFloat16;
    rope_rows(qv, cc.data_ptr<BF>(), sc.data_ptr<BF>(), qr.data_ptr<BF>(), H, T, D);
    rope_rows(kv, cc.data_ptr<BF>(), sc.data_ptr<BF>(), kr.data_ptr<BF>(), Hkv, T, D);
  }
  // the rows: key j of head h from kr [Hkv, T, D], value j from v [T, Hkv, D], to position length - T + j
  const int64_t es = q.element_size(), row = D * es;
  const char* ks = static_cast<const char*>(kr.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  for (int64_t j = 0; j < T; ++j) {
    const int64_t p = length - T + j, blk = p / B, r = p % B;
    const at::Tensor &kd = kb[blk], &vd = vb[blk];
    char* kp = static_cast<char*>(kd.data_ptr()) + r * kd.stride(1) * es;
    char* vp = static_cast<char*>(vd.data_ptr()) + r * vd.stride(1) * es;
    for (int64_t h = 0; h < Hkv; ++h) {
      std::memcpy(kp + h * kd.stride(0) * es, ks + (h * T + j) * row, row);
      std::memcpy(vp + h * vd.stride(0) * es, vs + (j * Hkv + h) * row, row);
    }
  }
  check_attend(qr, kb[0], vb[0], positions);
  return attend_blocks(qr, kb, vb, length, positions, window, scale, softcap, rows_ahead(qr), true);
}

}  // namespace
