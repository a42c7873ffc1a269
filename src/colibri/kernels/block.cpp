// A dense decoder block in one call: llama's and qwen2's layer (RMSNorm, the q / k / v projections, attention over
// the KV cache's blocks, the output projection and its residual, RMSNorm, gate / up, silu(gate) * up, down and its
// residual). models/base.py's DecoderModel.block makes these calls one by one from Python; in a decode step each
// of them runs with the caches the weights' stream has just evicted, the interpreter's own code and data included
// (docs/performance.md, "What the LOSSY decode step waits on here"). Here the same functions run in the same order
// on the same tensors (the linears through the op each weight names: registry.cpp's call_linear), so the bits are
// those of the calls one by one.

#include <ATen/ATen.h>
#include "library.h"

#include <array>

namespace {

// Op `op` of the tier's list (registry.cpp's COLIBRI_OPS, by position) over x with a weight's tensors w and its
// int argument g (for the ops that take one): a linear op's result, [T, N padded].
at::Tensor call_linear(int64_t op, const at::Tensor& x, at::TensorList w, int64_t g);

// x [T, D] (f32 or bf16, contiguous) -> the block's output [T, D]. norms: the two RMSNorms' weights (x's dtype;
// eps); ops, counts, groups, cols: per linear (q, k, v, o, gate, up, down) its op, how many of `weights` are its
// tensors (in order), its int argument and its output columns N (a wider result is cut to N, as the weights'
// Python `linear` cuts it); bias: none or the q / k / v biases (x's dtype, added inside attention); cos ... softcap:
// rope_attend_paged's arguments after the biases; piece: ops.pointwise's piece for silu.
at::Tensor dense_block(const at::Tensor& x, at::TensorList norms, at::IntArrayRef ops, at::TensorList weights,
                       at::IntArrayRef counts, at::IntArrayRef groups, at::IntArrayRef cols, at::TensorList bias,
                       const at::Tensor& cos, const at::Tensor& sin, at::TensorList kb, at::TensorList vb,
                       int64_t length, const at::Tensor& positions, int64_t window, double scale, double softcap,
                       double eps, int64_t piece) {
  const char* op = "dense_block";
  constexpr size_t kLinears = 7;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be contiguous [T, D]");
  TORCH_CHECK(norms.size() == 2 && ops.size() == kLinears && counts.size() == kLinears &&
                  groups.size() == kLinears && cols.size() == kLinears,
              op, ": two norms and seven linears (q, k, v, o, gate, up, down)");
  std::array<int64_t, kLinears + 1> first{};  // linear j's tensors: weights[first[j] .. first[j + 1])
  for (size_t j = 0; j < kLinears; ++j) first[j + 1] = first[j] + counts[j];
  TORCH_CHECK(first[kLinears] == static_cast<int64_t>(weights.size()), op, ": counts must add up to the weights");
  auto linear = [&](size_t j, const at::Tensor& in) {
    at::Tensor y = call_linear(ops[j], in, weights.slice(first[j], counts[j]), groups[j]);
    return y.size(1) == cols[j] ? y : y.narrow(1, 0, cols[j]).contiguous();
  };
  const at::Tensor h = rms_norm(x, norms[0], eps, false);
  const at::Tensor q = linear(0, h), k = linear(1, h), v = linear(2, h);
  const at::Tensor o = rope_attend_paged(q, k, v, bias, cos, sin, kb, vb, length, positions, window, scale, softcap);
  const at::Tensor x1 = at::add(x, linear(3, o));
  const at::Tensor h1 = rms_norm(x1, norms[1], eps, false);
  const at::Tensor g = linear(4, h1), u = linear(5, h1);
  const at::Tensor a = pointwise(g.reshape({-1}), "silu", piece).view(g.sizes());
  return at::add(x1, linear(6, at::mul(a, u)));
}

// Every layer of a dense model in one call: layer j is dense_block over its slice of each list (norms: 2 a layer;
// ops, counts, groups, cols: 7; weights: the sum of its 7 counts; bias: 3 or none at all; cos, sin, lengths,
// windows: 1; kb, vb: kv_counts[j] blocks each), the output of one the input of the next. models/base.py's
// DecoderModel makes one dense_block call a layer from Python; between two of them the weights' stream has
// evicted the interpreter's code and data, so the Python of a layer ran cold (docs/performance.md, "All layers in
// one call"). The same calls in the same order on the same tensors: the same bits.
at::Tensor dense_blocks(const at::Tensor& x, at::TensorList norms, at::IntArrayRef ops, at::TensorList weights,
                        at::IntArrayRef counts, at::IntArrayRef groups, at::IntArrayRef cols, at::TensorList bias,
                        at::TensorList cos, at::TensorList sin, at::TensorList kb, at::TensorList vb,
                        at::IntArrayRef kv_counts, at::IntArrayRef lengths, const at::Tensor& positions,
                        at::IntArrayRef windows, double scale, double softcap, double eps, int64_t piece) {
  const char* op = "dense_blocks";
  const int64_t layers = static_cast<int64_t>(windows.size());
  const auto sized = [layers](size_t n, int64_t per) { return static_cast<int64_t>(n) == layers * per; };
  TORCH_CHECK(layers > 0 && sized(norms.size(), 2) && sized(ops.size(), 7) && sized(counts.size(), 7) &&
                  sized(groups.size(), 7) && sized(cols.size(), 7) && (bias.empty() || sized(bias.size(), 3)) &&
                  sized(cos.size(), 1) && sized(sin.size(), 1) && sized(kv_counts.size(), 1) &&
                  sized(lengths.size(), 1),
              op, ": per layer two norms, seven linears, three biases or none, one cos, sin, KV count, length and "
              "window");
  int64_t w0 = 0, b0 = 0;  // layer j's first weight and first KV block
  at::Tensor h = x;
  for (int64_t j = 0; j < layers; ++j) {
    int64_t nw = 0;
    for (int64_t l = 0; l < 7; ++l) nw += counts[7 * j + l];
    const int64_t nb = kv_counts[j];
    TORCH_CHECK(nw >= 0 && nb >= 0 && w0 + nw <= static_cast<int64_t>(weights.size()) &&
                    b0 + nb <= static_cast<int64_t>(kb.size()) && b0 + nb <= static_cast<int64_t>(vb.size()),
                op, ": layer ", j, "'s weights or KV blocks run past their lists");
    h = dense_block(h, norms.slice(2 * j, 2), ops.slice(7 * j, 7), weights.slice(w0, nw), counts.slice(7 * j, 7),
                    groups.slice(7 * j, 7), cols.slice(7 * j, 7), bias.empty() ? bias : bias.slice(3 * j, 3), cos[j],
                    sin[j], kb.slice(b0, nb), vb.slice(b0, nb), lengths[j], positions, windows[j], scale, softcap,
                    eps, piece);
    w0 += nw;
    b0 += nb;
  }
  TORCH_CHECK(w0 == static_cast<int64_t>(weights.size()) && b0 == static_cast<int64_t>(kb.size()) &&
                  b0 == static_cast<int64_t>(vb.size()),
              op, ": the counts must add up to the weights and KV blocks");
  return h;
}

}  // namespace
