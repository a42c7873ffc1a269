// Rows in and out of stored tables: a pass's K and V rows into the KV cache's blocks (write_rows), and rows of a
// table stored as K-quant blocks decoded (kquant_rows, the token embedding).

#include <ATen/ATen.h>
#include "library.h"

#include <cstring>

namespace {

// One call for all of a layer's tensors (keys, values and, for q8, their scales), where Python made two or four
// slice assignments a layer and decode step. A plain copy: the bits are the rows'.
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

// ---- rows of a table stored as GGUF K-quant blocks ---------------------------------------------------------------
#include "generic/gguf_blocks.h"
#include "generic/linear_steps.h"

#include <string>
#include <vector>

namespace {

// Rows `ids` of a table of block kind B (uint8 [N, K / 256 * bytes]) as f32 [n, K]: the values its Python `rows`
// gives, q * (d * sc) per 16 (kinds with mins: minus dmin * m), each product exact in f32 and one rounding in the
// subtraction (-ffp-contract=off). A decode step's token embedding (the 1.5B's Q6_K table): about twenty torch ops
// on one row, run cold, where this is one call.
template <class B>
at::Tensor kquant_rows_of(const at::Tensor& blocks, const at::Tensor& ids) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) % B::kBlockBytes == 0 && ids.dim() == 1 && ids.scalar_type() == at::kLong,
              "kquant_rows: blocks must be uint8 [N, K / 256 * block bytes], ids int64 [n]");
  const int64_t n = blocks.size(0), nb = blocks.size(1) / B::kBlockBytes, k = nb * 256;
  const at::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  at::Tensor out = at::empty({idc.size(0), k}, blocks.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  std::vector<float> s(k / 16 * (B::kMins ? 2 : 1));  // d * sc per 16, then dmin * m
  alignas(32) int8_t q[128];
  for (int64_t i = 0; i < idc.size(0); ++i, o += k) {
    TORCH_CHECK(id[i] >= 0 && id[i] < n, "kquant_rows: row ", id[i], " is not in the table's ", n);
    const uint8_t* row = blocks.data_ptr<uint8_t>() + id[i] * nb * B::kBlockBytes;
    block_row_scales<B>(row, nb, s.data());
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t h = 0; h < 2; ++h) {
        B::codes128(row + b * B::kBlockBytes, h, q);
        for (int64_t e = 0; e < 128; ++e) {
          const int64_t j = 256 * b + 128 * h + e;
          const float v = static_cast<float>(q[e]) * s[j / 16];
          o[j] = B::kMins ? v - s[k / 16 + j / 16] : v;
        }
      }
  }
  return out;
}

// op: the kind's linear op (its weight's OP), which names the block kind.
at::Tensor kquant_rows(const at::Tensor& blocks, const at::Tensor& ids, c10::string_view op) {
  if (op == "q6k_linear") return kquant_rows_of<Q6kBlocks>(blocks, ids);
  if (op == "q3k_linear") return kquant_rows_of<Q3kBlocks>(blocks, ids);
  if (op == "iq4_xs_linear") return kquant_rows_of<Iq4xsBlocks>(blocks, ids);
  if (op == "q5k_linear") return kquant_rows_of<Q5kBlocks>(blocks, ids);
  if (op == "q2k_linear") return kquant_rows_of<Q2kBlocks>(blocks, ids);
  TORCH_CHECK(false, "kquant_rows: ", std::string(op), " is not a K-quant block kind's op");
}

}  // namespace
