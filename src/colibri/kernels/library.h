// The torch namespace a kernel library registers its ops under: one per tier (colibri_avx512, colibri_avx2,
// colibri_portable), given by the build as -DCOLIBRI_NS=<ns> (colibri/kernels/__init__.py), so the libraries of
// several tiers load side by side in one process (tests cross them) and every tier registers the same op names.
#pragma once

#include <torch/library.h>

#ifndef COLIBRI_NS
#define COLIBRI_NS colibri_kernels
#endif
// One level of indirection: TORCH_LIBRARY_FRAGMENT pastes its argument, which would not expand COLIBRI_NS.
#define COLIBRI_LIBRARY_IMPL(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define COLIBRI_LIBRARY(m) COLIBRI_LIBRARY_IMPL(COLIBRI_NS, m)
