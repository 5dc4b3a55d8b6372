// Device-side quantizers of the cache formats. They mirror python/mpfa/recipes/{fp8,fp4}.py
// operation for operation (same float ops in the same order), so the bytes match the reference.
#pragma once
#include <cuda_fp8.h>
#include <cstdint>

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

// The scale that maps amax to target; an all-zero group keeps scale 1.
__device__ __forceinline__ float amax_scale(float amax, float target) {
  return amax > 0.f ? amax / target : 1.f;
}

// Smallest allowed block scale (2^e or 1.5*2^e, products with E2M1 exact in E4M3) >= need.
__device__ __forceinline__ float round_up_block_scale(float need) {
  int exp;
  float mant = frexpf(need, &exp);      // need = mant * 2^exp, mant in [0.5, 1)
  float f = mant * 2.f;
  float p = ldexpf(1.f, exp - 1);
  float s = (f == 1.f) ? p : (f <= 1.5f ? 1.5f * p : 2.f * p);
  if (need <= kBlockScaleMin) s = kBlockScaleMin;
  if (s == 1.5f * kBlockScaleMin) s = 2.f * kBlockScaleMin;  // 1.5*2^-8 leaves E4M3's grid
  return fminf(s, kBlockScaleMax);
}

// E2M1 nibble (sign << 3 | magnitude code) of y, nearest with ties to the even code, saturating.
__device__ __forceinline__ uint32_t e2m1_code(float y) {
  float a = fabsf(y);
  uint32_t m = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return m | (y < 0.f ? 8u : 0u);
}

}  // namespace mpfa
