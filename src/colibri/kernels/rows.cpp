// A pass's K and V rows into the KV cache's blocks: one call for all of a layer's tensors (keys, values and, for
// q8, their scales), where Python made two or four slice assignments a layer and decode step.
// A plain copy: the bits are the rows'.

#include <ATen/ATen.h>
#include "library.h"

#include <cstring>

namespace {

// dst[i][:, offset : offset + n] = src[i] for each i: dst [H, B, X] (rows of X contiguous elements, any strides
// between them), src [H, n, X] of dst's dtype. Returns dst[0].
at::Tensor write_rows(at::TensorList dst, at::TensorList src, int64_t offset) {
  TORCH_CHECK(!dst.empty() && dst.size() == src.size(), "write_rows: dst and src must be lists of the same length");
  for (size_t i = 0; i < dst.size(); ++i) {
    const at::Tensor& d = dst[i];
    const at::Tensor& s = src[i];
    TORCH_CHECK(d.dim() == 3 && s.dim() == 3 && d.size(0) == s.size(0) && d.size(2) == s.size(2) &&
                    d.scalar_type() == s.scalar_type() && d.stride(2) == 1 && s.stride(2) == 1 && offset >= 0 &&
                    offset + s.size(1) <= d.size(1),
                "write_rows: dst must be [H, B, X] and src [H, n, X] of its dtype, rows contiguous, inside dst");
    const int64_t H = s.size(0), n = s.size(1), row = s.size(2) * s.element_size();
    char* dp = static_cast<char*>(d.data_ptr());
    const char* sp = static_cast<const char*>(s.data_ptr());
    const int64_t es = s.element_size();
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < n; ++j)
        std::memcpy(dp + (h * d.stride(0) + (offset + j) * d.stride(1)) * es,
                    sp + (h * s.stride(0) + j * s.stride(1)) * es, row);
  }
  return dst[0];
}

}  // namespace
