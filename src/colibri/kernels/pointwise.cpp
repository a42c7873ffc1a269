// Elementwise functions (silu, sigmoid, rsqrt, gelu) over fixed pieces of a flat tensor, the pieces in parallel:
// the same ATen kernel on the same pieces as colibri.kernels.ops.pointwise's loop (so the same bits: every element goes
// through ATen's vectorized body, whose rounding differs from its scalar tail), without a Python step, a slice and
// a copy per piece, and on every thread (ATen runs one piece's loop inline inside the parallel region).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include "library.h"

#include <algorithm>
#include <string>

namespace {

at::Tensor pointwise(const at::Tensor& x_in, c10::string_view fn, int64_t piece) {
  TORCH_CHECK(x_in.dim() == 1 && x_in.is_contiguous() && piece > 0 && piece % 64 == 0,
              "pointwise: x must be flat and contiguous, the piece a multiple of 64");
  // a size that is not a multiple of 64 (a norm's T scale factors): zero-padded to one, as ops.pointwise's
  // Python loop pads it, so every element still goes through the vectorized body; the result is cut back
  const int64_t n_in = x_in.numel();
  const at::Tensor x = n_in % 64 == 0 ? x_in : at::constant_pad_nd(x_in, {0, 64 - n_in % 64}, 0);
  const std::string name(fn);
  const int kind = name == "silu" ? 0 : name == "sigmoid" ? 1 : name == "rsqrt" ? 2 : name == "gelu" ? 3 : -1;
  TORCH_CHECK(kind >= 0, "pointwise: ", name, " is not one of silu, sigmoid, rsqrt, gelu");
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.numel();
  auto run = [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t lo = i * piece, hi = std::min(n, lo + piece);
      const at::Tensor xs = x.slice(0, lo, hi);
      at::Tensor os = out.slice(0, lo, hi);
      switch (kind) {
        case 0: at::silu_out(os, xs); break;
        case 1: at::sigmoid_out(os, xs); break;
        case 2: at::rsqrt_out(os, xs); break;
        default: at::gelu_out(os, xs); break;
      }
    }
  };
  const int64_t pieces = (n + piece - 1) / piece;
  if (pieces == 1) {  // inline: a parallel region's fork and join cost more than one piece's work
    run(0, 1);
  } else {
    const at::ThreadLocalState state;  // the caller's (inference mode): torch's pool threads do not inherit it
    at::parallel_for(0, pieces, 1, [&](int64_t b, int64_t e) {
      const at::ThreadLocalStateGuard guard(state);
      run(b, e);
    });
  }
  return n_in == n ? out : out.slice(0, 0, n_in);
}

}  // namespace
