// The exact ops over q4 code tiles (q4_linear, q4_1_linear, q4_0_linear, q4k_linear), one text for every tier: each
// kind's group parameters (linear_steps.h) handed to the tier's q4_tiles_linear (its tiles.h: the avx512 tier's
// vdpbf16ps outer form, the 8-lane tiers' pair-split emulation of it). Included by each tier's linear source after
// its tiles.h.
#pragma once

namespace {

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales_zeros,
                     int64_t group_size) {
  check_q4(x, qweight, scales_zeros, group_size);
  const int64_t k = x.size(1), np = qweight.size(0), g = group_size;
  const Q4 w{qweight.data_ptr<uint8_t>(), static_cast<const uint8_t*>(scales_zeros.data_ptr()),
             scales_zeros.scalar_type(), np, k, g};
  auto params = [&](int64_t gi, int64_t n0, float* s, float* z, Q4kSupers&) { q4_group_params(w, gi, n0, s, z); };
  return q4_tiles_linear(x, w, params, params, -8);
}

// q4_1 (Q4_1 kept as stored: f16 (d, m) per group of 32, w = d q + m): the q4 tile kernel with scale d and zero
// m + 8 d, computed in f32 from the stored pair (exact: the converter checks it), as q4 with f32 (d, m + 8 d).
at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales_mins) {
  check_q4(x, qweight, scales_mins, 32);
  TORCH_CHECK(scales_mins.scalar_type() == at::kHalf, "q4_1_linear: f16 (d, m)");
  const int64_t k = x.size(1), np = qweight.size(0);
  const Q4 w{qweight.data_ptr<uint8_t>(), static_cast<const uint8_t*>(scales_mins.data_ptr()), at::kHalf, np, k, 32};
  auto params = [&](int64_t gi, int64_t n0, float* s, float* z, Q4kSupers&) {
    q4_pairs_params(w, Q4Pairs::kQ41, gi, n0, s, z);
  };
  return q4_tiles_linear(x, w, params, params, -8);
}

// q4_0 (Q4_0 kept as stored: f16 d per group of 32, w = d (q - 8)): the q4 tile kernel with scale d and zero 0,
// as q4 with f16 (d, +0) (check_q4_0: scales f16 [K/32, Np]).
at::Tensor q4_0_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  check_q4_0(x, qweight, scales);
  const int64_t k = x.size(1), np = qweight.size(0);
  const Q4 w{qweight.data_ptr<uint8_t>(), static_cast<const uint8_t*>(scales.data_ptr()), at::kHalf, np, k, 32};
  auto params = [&](int64_t gi, int64_t n0, float* s, float* z, Q4kSupers&) {
    q4_pairs_params(w, Q4Pairs::kQ40, gi, n0, s, z);
  };
  return q4_tiles_linear(x, w, params, params, -8);
}

// q4k (Q4_K kept as stored, ../kquant.cpp's header gives the formulas): the q4 code tiles, group 32, the parameters
// decoded per tile from the (sc, m) codes and the f16 (d, dmin); bf16 x counts the codes from 8, f32 x from 0.
at::Tensor q4k_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const at::Tensor& supers) {
  const Q4kScales sc = check_q4k(x, qweight, scales, supers);
  const int64_t k = x.size(1), np = qweight.size(0);
  const Q4 w{qweight.data_ptr<uint8_t>(), nullptr, at::kHalf, np, k, 32};
  auto bf = [&](int64_t gi, int64_t n0, float* s, float* z, Q4kSupers& ds) {
    q4k_params(sc, gi, n0, true, s, z, ds);
  };
  auto f32 = [&](int64_t gi, int64_t n0, float* s, float* z, Q4kSupers& ds) {
    q4k_params(sc, gi, n0, false, s, z, ds);
  };
  return q4_tiles_linear(x, w, bf, f32, 0);
}

}  // namespace
