// What every kernel tier's ops accept, checked in one place (the avx512 files and generic/ share it): the stored
// layouts of colibri/quant/kinds.py, with one-line errors. No ISA code here.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace {

inline void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [T, K] matrix");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": x must be f32/bf16");
}

// q4: qweight [Np, K/2] tiles, scales_zeros [K/g, Np, 2]; g divides the 256-k chunks the tiers walk.
inline void check_q4(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales_zeros, int64_t g,
                     const char* op = "q4_linear") {
  check_x(x, op);
  const int64_t k = x.size(1), np = qweight.size(0);
  TORCH_CHECK(qweight.is_contiguous() && scales_zeros.is_contiguous() && qweight.size(1) * 2 == k &&
              scales_zeros.size(1) == np && np % 16 == 0 && g > 0 && k % g == 0 && 256 % g == 0, op,
              ": shapes do not match the stored layout");
}

// q4_0: qweight [Np, K/2] tiles, scales f16 [K/32, Np] (d per group of 32 and row).
inline void check_q4_0(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const char* op = "q4_0_linear") {
  check_x(x, op);
  const int64_t k = x.size(1), np = qweight.size(0);
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() && qweight.scalar_type() == at::kByte &&
              scales.scalar_type() == at::kHalf && qweight.size(1) * 2 == k && k % 32 == 0 && np % 16 == 0 &&
              scales.dim() == 2 && scales.size(0) == k / 32 && scales.size(1) == np, op,
              ": shapes do not match the stored layout");
}

// Where a q4-tiled weight's (scale, zero) per group come from: q4's stored pairs; Q4_1's f16 (d, m) as stored
// (scale d, zero m + 8 d, each f32 step rounded once); Q4_0's f16 d (scale d, zero 0).
enum class Q4Pairs { kStored, kQ41, kQ40 };

inline void check_dense(const at::Tensor& x, const at::Tensor& w) {
  check_x(x, "dense_linear");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && x.size(1) == w.size(1) && x.scalar_type() == w.scalar_type(),
              "dense_linear: w must be a contiguous [N, K] matrix of x's dtype");
}

// q8: qweight int8 [N, K], scales per channel (g = 0) or per group of g.
inline void check_q8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t g) {
  check_x(x, "q8_linear");
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() && qweight.size(1) == x.size(1) &&
              x.size(1) % (g ? g : x.size(1)) == 0, "q8_linear: shapes do not match the stored layout");
}

// q4k: the q4 tiles, and the 6-bit (sc, m) codes of each group of 32 and row with the f16 (d, dmin) of each 256
// values and row in one of three layouts, told apart by their shapes (colibri/quant/kinds.py writes kTiles):
//   kTiles (containers of format version 5): scales u8 [Np/16, K/32 * 24], supers f16 [Np/16, K/256 * 32], each
//     written a tile after the other (64 rows; the last tile 16, 32 or 48): per group of the tile its rows'
//     packed codes (below), per 256 values its rows' (d, dmin) pairs. Everything a tile's pass reads beside its
//     codes is then one run of bytes, where the group-major layouts spread it over a row per group.
//   kPacked (version 4): scales u8 [K/32, Np/16, 24], supers f16 [K/256, Np, 2]: group (super-block) major.
//   kBytes (before): scales u8 [K/32, Np, 2], (sc, m) a byte each; supers as kPacked.
// Packed codes: 12 bits v = sc | m << 6 a row (GGUF Q4_K's 12 bits a group); per 16 rows the low bytes of their v,
// then 8 bytes whose low nibbles hold rows 0-7's v >> 8 and high nibbles rows 8-15's.
enum class Q4kLayout { kBytes, kPacked, kTiles };

struct Q4kScales {
  const uint8_t* sc;
  const uint16_t* sup;
  int64_t np, groups;  // rows (Np), groups of 32 (K / 32)
  Q4kLayout layout;
  bool packed() const { return layout != Q4kLayout::kBytes; }
};

inline Q4kScales check_q4k_layout(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& supers,
                                  int64_t k, const char* op) {
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() && supers.is_contiguous(), op,
              ": the q4k parts must be contiguous");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && scales.scalar_type() == at::kByte &&
              supers.scalar_type() == at::kHalf, op, ": u8 codes and scale codes, f16 supers");
  const int64_t np = qweight.size(0), g = k / 32;
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(1) * 2 == k && k % 256 == 0 && np % 16 == 0, op,
              ": shapes do not match the stored layout");
  Q4kLayout layout;
  if (scales.dim() == 2) {
    layout = Q4kLayout::kTiles;
    TORCH_CHECK(scales.size(0) == np / 16 && scales.size(1) == g * 24 && supers.dim() == 2 &&
                supers.size(0) == np / 16 && supers.size(1) == k / 256 * 32, op,
                ": shapes do not match the stored layout");
  } else {
    layout = scales.dim() == 3 && scales.size(2) == 24 ? Q4kLayout::kPacked : Q4kLayout::kBytes;
    const bool packed = layout == Q4kLayout::kPacked;
    TORCH_CHECK(scales.dim() == 3 && scales.size(0) == g && scales.size(1) == (packed ? np / 16 : np) &&
                (packed || scales.size(2) == 2) && supers.dim() == 3 && supers.size(0) == k / 256 &&
                supers.size(1) == np && supers.size(2) == 2, op, ": shapes do not match the stored layout");
  }
  return Q4kScales{scales.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(supers.data_ptr<at::Half>()), np, g,
                   layout};
}

inline Q4kScales check_q4k(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           const at::Tensor& supers) {
  check_x(x, "q4k_linear");
  return check_q4k_layout(qweight, scales, supers, x.size(1), "q4k_linear");
}

// q8k: codes int8 [N, K], scales int8 [N, K/16], supers f16 [N, K/256].
inline void check_q8k(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const at::Tensor& supers) {
  check_x(x, "q8k_linear");
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() && supers.is_contiguous());
  TORCH_CHECK(qweight.scalar_type() == at::kChar && scales.scalar_type() == at::kChar &&
              supers.scalar_type() == at::kHalf, "q8k_linear: int8 codes and scales, f16 supers");
  const int64_t k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == k && k % 256 == 0 && scales.size(0) == n && scales.size(1) == k / 16 &&
              supers.size(0) == n && supers.size(1) == k / 256, "q8k_linear: shapes do not match the stored layout");
}

// GGUF blocks as stored (q6k: 210 bytes per 256 values; q5_0: 22 per 32): uint8 [N, K / values * bytes].
inline void check_blocks(const at::Tensor& x, const at::Tensor& blocks, const char* op, int64_t values, int64_t bytes) {
  check_x(x, op);
  TORCH_CHECK(blocks.is_contiguous() && blocks.scalar_type() == at::kByte && blocks.dim() == 2, op,
              ": uint8 blocks [N, K / ", values, " * ", bytes, "]");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % values == 0 && blocks.size(1) == k / values * bytes, op, ": shapes do not match the stored layout");
}

// ---- attention -------------------------------------------------------------------------------------------------

struct View {  // a [heads, rows, Dh] tensor with a contiguous last dimension
  const char* p;
  int64_t s0, s1;  // strides in bytes
  const char* row(int64_t h, int64_t i) const { return p + h * s0 + i * s1; }
};

inline View view_of(const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1, "attend: q, k, v must be [heads, rows, Dh] with contiguous rows");
  const int64_t e = t.element_size();
  return View{static_cast<const char*>(t.data_ptr()), t.stride(0) * e, t.stride(1) * e};
}

inline void check_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "attend: q, k, v must be [heads, rows, Dh]");
  const int64_t H = q.size(0), T = q.size(1), D = q.size(2), Hkv = k.size(0), S = k.size(1);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0 && k.size(2) == D && v.size(0) == Hkv && v.size(1) == S && v.size(2) == D,
              "attend: q, k, v shapes do not agree");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T && positions.scalar_type() == at::kLong,
              "attend: positions must be int64 [T]");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16, "attend: f32 or bf16 only");
  TORCH_CHECK(D <= 1024, "attend: head dim above 1024");
}

}  // namespace
