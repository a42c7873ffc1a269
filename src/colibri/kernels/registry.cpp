// Every op a native tier registers, with its schema: one list for all tiers (each tier's sources define a
// function of every op's name; this file, the last of each tier's translation unit, registers them under the
// tier's namespace) and for Python (colibri/kernels/build.py reads the names from here: a library that lacks
// one failed its build). X(name, "arguments"): every op returns one Tensor.

#define COLIBRI_OPS(X)                                                                                            \
  X(dense_linear, "Tensor x, Tensor w")                                                                           \
  X(q4_linear, "Tensor x, Tensor qweight, Tensor scales_zeros, int group_size")                                   \
  X(q4_1_linear, "Tensor x, Tensor qweight, Tensor scales_mins")                                                  \
  X(q4_0_linear, "Tensor x, Tensor qweight, Tensor scales")                                                       \
  X(q8_linear, "Tensor x, Tensor qweight, Tensor scales, int group_size")                                         \
  X(q4k_linear, "Tensor x, Tensor qweight, Tensor scales, Tensor supers")                                         \
  X(q8k_linear, "Tensor x, Tensor qweight, Tensor scales, Tensor supers")                                         \
  X(q6k_linear, "Tensor x, Tensor blocks")                                                                        \
  X(q3k_linear, "Tensor x, Tensor blocks")                                                                        \
  X(iq4_xs_linear, "Tensor x, Tensor blocks")                                                                     \
  X(q5k_linear, "Tensor x, Tensor blocks")                                                                        \
  X(q2k_linear, "Tensor x, Tensor blocks")                                                                        \
  X(q5_0_linear, "Tensor x, Tensor blocks")                                                                       \
  X(q5_1_linear, "Tensor x, Tensor blocks")                                                                       \
  X(iq4_nl_linear, "Tensor x, Tensor blocks")                                                                     \
  X(attend, "Tensor q, Tensor k, Tensor v, Tensor positions, int window, float scale, float softcap")             \
  X(attend_paged, "Tensor q, Tensor[] k, Tensor[] v, int length, Tensor positions, int window, float scale, "      \
                  "float softcap")                                                                                \
  X(attend_paged_q8, "Tensor q, Tensor[] k, Tensor[] ks, Tensor[] v, Tensor[] vs, int length, Tensor positions, "   \
                     "int window, float scale, float softcap, bool bf16")                                         \
  X(rope_attend_paged, "Tensor q, Tensor k, Tensor v, Tensor[] bias, Tensor cos, Tensor sin, Tensor[] kb, "     \
                       "Tensor[] vb, int length, Tensor positions, int window, float scale, float softcap")      \
  X(pointwise, "Tensor x, str fn, int piece")                                                                     \
  X(write_rows, "Tensor[] dst, Tensor[] src, int offset")                                                         \
  X(kquant_rows, "Tensor blocks, Tensor ids, str op")                                                             \
  X(rms_norm, "Tensor x, Tensor w, float eps, bool gemma")                                                        \
  X(rope, "Tensor x, Tensor cos, Tensor sin")                                                                     \
  X(q4_linear_i8, "Tensor x, Tensor qweight, Tensor scales_zeros, int group_size")                                \
  X(q8_linear_i8, "Tensor x, Tensor qweight, Tensor scales, int group_size")                                      \
  X(q4_1_linear_i8, "Tensor x, Tensor qweight, Tensor scales_mins")                                               \
  X(q4_0_linear_i8, "Tensor x, Tensor qweight, Tensor scales")                                                    \
  X(q4k_linear_i8, "Tensor x, Tensor qweight, Tensor scales, Tensor supers")                                      \
  X(q8k_linear_i8, "Tensor x, Tensor qweight, Tensor scales, Tensor supers")                                      \
  X(q6k_linear_i8, "Tensor x, Tensor blocks")                                                                     \
  X(q3k_linear_i8, "Tensor x, Tensor blocks")                                                                     \
  X(iq4_xs_linear_i8, "Tensor x, Tensor blocks")                                                                  \
  X(int8_vnni, "int enable")                                                                                      \
  X(dense_block, "Tensor x, Tensor[] norms, int[] ops, Tensor[] weights, int[] counts, int[] groups, int[] cols, "  \
                 "Tensor[] bias, Tensor cos, Tensor sin, Tensor[] kb, Tensor[] vb, int length, Tensor positions, "  \
                 "int window, float scale, float softcap, float eps, int piece")                                 \
  X(dense_blocks, "Tensor x, Tensor[] norms, int[] ops, Tensor[] weights, int[] counts, int[] groups, int[] cols, " \
                  "Tensor[] bias, Tensor[] cos, Tensor[] sin, Tensor[] kb, Tensor[] vb, int[] kv_counts, "           \
                  "int[] lengths, Tensor positions, int[] windows, float scale, float softcap, float eps, int piece")

#include "library.h"

#include <cstddef>
#include <type_traits>
#include <utility>

namespace {

// call_linear (block.cpp): the ops of the list above whose arguments are x, then tensors, then at most one int
// (every linear op), called by their position in it; the others have no entry.
template <class F>
struct LinearOp {
  static constexpr bool kIs = false;
};
template <class... A>
struct LinearOp<at::Tensor (*)(const at::Tensor&, A...)> {
  static constexpr bool kIs = ((std::is_same_v<A, const at::Tensor&> || std::is_same_v<A, int64_t>) && ...);
  static constexpr size_t kTensors = (std::size_t{std::is_same_v<A, const at::Tensor&>} + ... + 0);
  template <class T, size_t I>
  static decltype(auto) arg(at::TensorList w, int64_t g) {
    if constexpr (std::is_same_v<T, int64_t>) return g;
    else return w[I];
  }
  template <auto F, size_t... I>
  static at::Tensor call(const at::Tensor& x, at::TensorList w, int64_t g, std::index_sequence<I...>) {
    return F(x, arg<A, I>(w, g)...);
  }
  template <auto F>
  static at::Tensor run(const at::Tensor& x, at::TensorList w, int64_t g) {
    TORCH_CHECK(w.size() == kTensors, "has ", w.size(), " tensors, its op takes ", kTensors);
    return call<F>(x, w, g, std::index_sequence_for<A...>{});
  }
};
using LinearCall = at::Tensor (*)(const at::Tensor&, at::TensorList, int64_t);
#define COLIBRI_OP_NAME(name, args) #name,
constexpr const char* kOpNames[] = {COLIBRI_OPS(COLIBRI_OP_NAME)};
#undef COLIBRI_OP_NAME
template <auto F>
constexpr LinearCall linear_entry() {
  if constexpr (LinearOp<decltype(F)>::kIs) return &LinearOp<decltype(F)>::template run<F>;
  else return nullptr;
}
#define COLIBRI_LINEAR_ENTRY(name, args) linear_entry<&name>(),
constexpr LinearCall kLinearCalls[] = {COLIBRI_OPS(COLIBRI_LINEAR_ENTRY)};
#undef COLIBRI_LINEAR_ENTRY

at::Tensor call_linear(int64_t op, const at::Tensor& x, at::TensorList w, int64_t g) {
  constexpr int64_t n = sizeof(kLinearCalls) / sizeof(kLinearCalls[0]);
  TORCH_CHECK(op >= 0 && op < n && kLinearCalls[op], "dense_block: op ", op, " is not a linear op");
  try {
    return kLinearCalls[op](x, w, g);
  } catch (const c10::Error& e) {  // (which linear of the block)
    TORCH_CHECK(false, "dense_block: ", kOpNames[op], ": ", e.what_without_backtrace());
  }
}

}  // namespace

#define COLIBRI_DEF(name, args) m.def(#name "(" args ") -> Tensor", &name);
COLIBRI_LIBRARY(m) { COLIBRI_OPS(COLIBRI_DEF) }
#undef COLIBRI_DEF

// The same ops as a Python module of the tier's name (colibri.kernels calls them here): a call through torch.ops
// parses its arguments against the schema in the dispatcher on every call, and a decode layer makes a dozen of
// these calls; a pybind11 function skips that (docs/performance.md, "The layer's other work"). The
// functions are the ops themselves, with the GIL released while they run (I/O threads keep going); Python lists
// of tensors and strings arrive as vectors and strings. Only where Python's headers are there (a system Python
// without its -dev package has none: the library is then torch.ops alone, which colibri.kernels falls back to),
// and not where COLIBRI_NO_PYTHON_MODULE is defined (tests/test_tiers.py's aarch64 cross compile: this machine
// has no aarch64 Python headers).
#if !defined(COLIBRI_NO_PYTHON_MODULE) && __has_include(<Python.h>)
// pybind11 with torch's tensor casters; not torch/extension.h, which adds torch's whole C++ frontend to every tier's
// first build (docs/performance.md, "The layer's other work")
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <type_traits>
#include <vector>

namespace {

template <class T>
struct PyArg {  // an argument as pybind11 takes it, and as the op takes it
  using type = T;
  static const T& get(const T& v) { return v; }
};
template <>
struct PyArg<at::TensorList> {
  using type = std::vector<at::Tensor>;
  static at::TensorList get(const std::vector<at::Tensor>& v) { return v; }
};
template <>
struct PyArg<at::IntArrayRef> {
  using type = std::vector<int64_t>;
  static at::IntArrayRef get(const std::vector<int64_t>& v) { return v; }
};
template <>
struct PyArg<c10::string_view> {
  using type = std::string;
  static c10::string_view get(const std::string& v) { return v; }
};
template <class T>
using Bare = std::remove_cv_t<std::remove_reference_t<T>>;

template <class... A>
auto py_op(at::Tensor (*f)(A...)) {
  return [f](const typename PyArg<Bare<A>>::type&... a) { return f(PyArg<Bare<A>>::get(a)...); };
}

}  // namespace

#define COLIBRI_PY_NAME_IMPL(ns) PYBIND11_MODULE(ns, m)
#define COLIBRI_PY_NAME(ns) COLIBRI_PY_NAME_IMPL(ns)
#define COLIBRI_PY(name, args) m.def(#name, py_op(&name), pybind11::call_guard<pybind11::gil_scoped_release>());
COLIBRI_PY_NAME(COLIBRI_NS) { COLIBRI_OPS(COLIBRI_PY) }
#undef COLIBRI_PY
#endif  // the Python module
