// Linear kernels for GGUF K-quants imported exactly (colibri/quant.py, "GGUF K-quants"): y = x @ W.T, batch-invariant as the
// kernels of linear.cpp (one f32 accumulation per output element in an order fixed by K alone).
//
// q4k (Q4_K): the q4 code tiles, group 32; per group and row uint8 (sc, m), per 256 values and row f16 (d, dmin):
//   w = (d * sc) * q - dmin * m, q in [0, 15]. The group parameters are decoded per tile on the fly:
//   bf16 x: x . (q - 8) over the exact codes, then s * A + (8 s - dmin m) * sum(x) with s = d * sc (f32);
//   f32 x: the exact weights q * s + (-dmin m) (s * q is exact in f32, one rounding as gguf's dequantize).
// q8k (Q6_K): int8 codes q - 32 [N, K], int8 scales per 16 [N, K/16], f16 d per 256 [N, K/256]:
//   w = (d * sc) * q, exact in f32 (11 + 7 + 5 significant bits); rows dequantized a block at a time (bf16 x:
//   rounded once to bf16), then the dot form.

#include "tiles.h"

namespace {

// (s, z) of group gi for the 64 columns of the tile at n0 (0 past the last column). signed_codes: z for
// w ~ (q - 8) * s + z (the bf16 path), else z = -dmin * m for w = q * s + z (the f32 path, exact).
inline void q4k_params(const uint8_t* sc, const uint16_t* sup, int64_t np, int64_t gi, int64_t n0, bool signed_codes,
                       __m512 s[4], __m512 z[4]) {
  const int64_t cols = std::min<int64_t>(kTile, np - n0);
  const uint16_t* pm = reinterpret_cast<const uint16_t*>(sc) + gi * np + n0;  // (sc | m << 8) per column
  const uint32_t* pd = reinterpret_cast<const uint32_t*>(sup) + (gi / 8) * np + n0;  // (d | dmin << 16) per column
  const __m512i lo8 = _mm512_set1_epi32(0xff), lo16 = _mm512_set1_epi32(0xffff);
  for (int c = 0; c < 4; ++c) {
    const int64_t left = cols - 16 * c;
    const __mmask16 m = left <= 0 ? 0 : tail_mask16(left);
    const __m512i codes = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, pm + 16 * c));
    const __m512i halves = _mm512_maskz_loadu_epi32(m, pd + 16 * c);
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_and_si512(halves, lo16)));
    const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(halves, 16)));
    s[c] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(codes, lo8)));
    const __m512 mm = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_srli_epi32(codes, 8)));
    z[c] = signed_codes ? _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(8.f), s[c]), mm)
                        : _mm512_sub_ps(_mm512_setzero_ps(), mm);
  }
}

at::Tensor q4k_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const at::Tensor& supers) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && qweight.is_contiguous() && scales.is_contiguous() &&
              supers.is_contiguous());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "q4k_linear: x must be f32/bf16");
  TORCH_CHECK(scales.scalar_type() == at::kByte && supers.scalar_type() == at::kHalf, "q4k_linear: u8 / f16 scales");
  const int64_t k = x.size(1), np = qweight.size(0);
  TORCH_CHECK(qweight.size(1) * 2 == k && k % 256 == 0 && np % 16 == 0 && scales.size(0) == k / 32 &&
              scales.size(1) == np && supers.size(0) == k / 256 && supers.size(1) == np,
              "q4k_linear: shapes do not match the stored layout");
  const Q4 w{qweight.data_ptr<uint8_t>(), nullptr, at::kHalf, 2, np, k, 32};
  const uint8_t* sc = scales.data_ptr<uint8_t>();
  const uint16_t* sup = reinterpret_cast<const uint16_t*>(supers.data_ptr<at::Half>());
  auto bf = [&](int64_t gi, int64_t n0, __m512* s, __m512* z) { q4k_params(sc, sup, np, gi, n0, true, s, z); };
  auto f32 = [&](int64_t gi, int64_t n0, __m512* s, __m512* z) { q4k_params(sc, sup, np, gi, n0, false, s, z); };
  return q4_tiles_linear(x, w, bf, f32, 0);
}

// Rows [n0, n0 + cols) of a q8k weight as f32 (exact) or bf16 (RNE) rows of K.
void q8k_dequant_rows(const int8_t* qw, const int8_t* sc, const at::Half* sup, int64_t k, int64_t n0, int64_t cols,
                      bool bf, void* out) {
  const int64_t esz = bf ? 2 : 4;
  for (int64_t j = 0; j < cols; ++j) {
    const int64_t r = n0 + j;
    void* dst = static_cast<char*>(out) + j * k * esz;
    for (int64_t b = 0; b < k / 256; ++b) {
      const float d = static_cast<float>(sup[r * (k / 256) + b]);
      for (int64_t i = 0; i < 16; ++i) {
        const float s = d * static_cast<float>(sc[r * (k / 16) + b * 16 + i]);
        q8_store16(qw + r * k, _mm512_set1_ps(s), 0xffff, bf, dst, b * 256 + i * 16);
      }
    }
  }
}

at::Tensor q8k_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const at::Tensor& supers) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && qweight.is_contiguous() && scales.is_contiguous() &&
              supers.is_contiguous());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "q8k_linear: x must be f32/bf16");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && scales.scalar_type() == at::kChar &&
              supers.scalar_type() == at::kHalf, "q8k_linear: int8 codes and scales, f16 supers");
  const int64_t t = x.size(0), k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == k && k % 256 == 0 && scales.size(0) == n && scales.size(1) == k / 16 &&
              supers.size(0) == n && supers.size(1) == k / 256, "q8k_linear: shapes do not match the stored layout");
  const bool bf = x.scalar_type() == at::kBFloat16;
  at::Tensor y = at::empty({t, n}, x.options());
  const int64_t nb = std::max<int64_t>(kCols, std::min<int64_t>(16, (128 << 10) / (k * 4) / kCols * kCols));
  const int8_t* qw = qweight.data_ptr<int8_t>();
  const int8_t* sc = scales.data_ptr<int8_t>();
  const at::Half* sup = supers.data_ptr<at::Half>();
  at::parallel_for(0, (n + nb - 1) / nb, 1, [&](int64_t b, int64_t e) {
    std::vector<float> acc(t * nb);
    std::vector<float> wbuf(nb * k);
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t n0 = blk * nb, cols = std::min(nb, n - n0);
      q8k_dequant_rows(qw, sc, sup, k, n0, cols, bf, wbuf.data());
      if (bf)
        dot_block<uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), t,
                            reinterpret_cast<const uint16_t*>(wbuf.data()), k, cols, acc.data(), nb);
      else
        dot_block<float>(x.data_ptr<float>(), t, wbuf.data(), k, cols, acc.data(), nb);
      store_rows(acc.data(), nb, t, cols, y, n0);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(colibri_kernels, m) {
  m.def("q4k_linear(Tensor x, Tensor qweight, Tensor scales, Tensor supers) -> Tensor", &q4k_linear);
  m.def("q8k_linear(Tensor x, Tensor qweight, Tensor scales, Tensor supers) -> Tensor", &q8k_linear);
}
