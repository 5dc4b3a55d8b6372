// Device-side quantizers of the cache formats. They mirror python/mpfa/recipes/{fp8,fp4}.py
// operation for operation (same float ops in the same order), so the bytes match the reference.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cstdint>
#include "mpfa/common.cuh"

namespace mpfa {

constexpr float kE4M3Max = 448.0f;
constexpr float kE2M1Max = 6.0f;
constexpr float kBlockScaleMax = 64.0f;               // largest allowed 4-bit-K block scale
constexpr float kBlockScaleMin = 0.00390625f;         // 2^-8, the smallest
constexpr float kTokenTarget = kE2M1Max * kBlockScaleMax;  // a token's amax maps here (384)

__device__ __forceinline__ uint8_t to_e4m3(float x) {
  // Round to nearest even, saturating at +-448: the reference clamps, then casts.
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

// 2 floats -> 2 E4M3 bytes in one instruction (cvt.rn.satfinite.e4m3x2.f32).
__device__ __forceinline__ uint16_t to_e4m3x2(float lo, float hi) {
  return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

// The scale that maps a row's amax (taken with max_nan) to target; an all-zero row keeps scale 1, and a row
// holding a NaN or an infinity gets a NaN scale, so every value stored under it dequantizes to NaN and
// attention propagates it (recipes/fp8.py row_scale).
// A NaN amax fails `amax <= 0` and takes the division, which keeps it NaN; s * 0 + s is s for every finite
// s and NaN for an infinite one.
__device__ __forceinline__ float amax_scale_or_nan(float amax, float target) {
  const float s = !(amax <= 0.f) ? amax / target : 1.f;
  return __fmaf_rn(s, 0.f, s);
}

// Two bf16 values as they are, but NaN where one is +-inf: for values quantized with a fixed scale, whose
// E4M3 conversion would saturate an infinity to +-448 and so store a fault as a plausible value. x * 0 + x
// is exactly x for every finite x (-0 included) and NaN for an infinite one: one bf16x2 FMA for two values.
__device__ __forceinline__ __nv_bfloat162 infinities_to_nan(__nv_bfloat162 x) {
  return __hfma2(x, __float2bfloat162_rn(0.f), x);
}

// Smallest allowed block scale (2^e or 1.5*2^e, products with E2M1 exact in E4M3) >= need, on the
// FP32 bits: a zero mantissa keeps 2^e, a mantissa <= .5 gives 1.5*2^e, else 2^(e+1); then the
// clamps of the allowed range (the reference does the same with frexp).
__device__ __forceinline__ float round_up_block_scale(float need) {
  const uint32_t b = __float_as_uint(need);
  const uint32_t e = b & 0x7f800000u, m = b & 0x007fffffu;
  float s = __uint_as_float(m == 0 ? e : (m <= 0x00400000u ? (e | 0x00400000u) : e + 0x00800000u));
  if (need <= kBlockScaleMin) s = kBlockScaleMin;
  if (s == 1.5f * kBlockScaleMin) s = 2.f * kBlockScaleMin;  // 1.5*2^-8 leaves E4M3's grid
  return fminf(s, kBlockScaleMax);
}

// E2M1 nibble (sign << 3 | magnitude code) of y, nearest with ties to the even code, saturating.
// Below 1 the grid is {0, 0.5, 1}: two compares. From 1 up, E2M1 is a float with one mantissa
// bit: round the FP32 bits to nearest-even at bit 22, then (exponent << 1 | mantissa bit) - 252
// is the code (1.0 -> 2 ... 6.0 -> 7), clamped at 7. Same results as the reference's thresholds
// (tests/cpu/test_recipes.py checks the bit trick against them).
__device__ __forceinline__ uint32_t e2m1_code(float y) {
  const uint32_t bits = __float_as_uint(y);
  const uint32_t a = bits & 0x7fffffffu;
  const float af = __uint_as_float(a);
  const uint32_t rounded = a + 0x1fffffu + ((a >> 22) & 1u);
  const uint32_t normal = min(rounded >> 22, 259u) - 252u;
  const uint32_t small = (af > 0.25f ? 1u : 0u) + (af >= 0.75f ? 1u : 0u);
  return (af < 1.f ? small : normal) | (a != 0 ? (bits >> 28) & 8u : 0u);   // -0 keeps no sign, like y < 0
}

// qk4pv8's K (recipes/fp4.py quantize_k4rs) splits a row of D channels into two fields in channel
// order: the low-frequency RoPE half (c mod D/2 >= D/4) as E4M3 bytes, the other half as E2M1 nibbles.
template <int D>
__device__ __forceinline__ bool k4rs_low(int c) { return c % (D / 2) >= D / 4; }

// Position of channel c within its half's field.
template <int D>
__device__ __forceinline__ int k4rs_index(int c) {
  const int r = c % (D / 2);
  return (c / (D / 2)) * (D / 4) + (r >= D / 4 ? r - D / 4 : r);
}

}  // namespace mpfa
