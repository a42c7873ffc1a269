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
  X(pointwise, "Tensor x, str fn, int piece")                                                                     \
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
  X(iq4_xs_linear_i8, "Tensor x, Tensor blocks")

#include "library.h"

#define COLIBRI_DEF(name, args) m.def(#name "(" args ") -> Tensor", &name);
COLIBRI_LIBRARY(m) { COLIBRI_OPS(COLIBRI_DEF) }
#undef COLIBRI_DEF
