// Device-side quantizers of the cache formats and of prefill's Q. They mirror python/mpfa/recipes/
// {fp8,int8}.py operation for operation (same float ops in the same order), so the bytes match the reference.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cstdint>
#include "mpfa/common.cuh"

namespace mpfa {

// 8-bit integer QK (recipes/int8.py): INT8 values in [-127, 127]; i4rs K's INT4 values in [-7, 7] times an
// integer block scale 1..18, so every product is an INT8 value and the row amax maps to 7 * 18.
constexpr float kInt8Max = 127.0f;
constexpr float kInt4Max = 7.0f;
constexpr int kI4rsBlockScaleMax = 18;
constexpr float kI4rsTarget = kInt4Max * kI4rsBlockScaleMax;   // 126
// 1.5 * 2^23: for |y| < 2^22, y + kRoundMagic rounds y to the nearest integer, ties to even (the FP32 ulp
// there is 1), and the sum's bits are 0x4B400000 + rni(y): its low byte is rni(y) as a two's-complement
// int8 whenever |rni(y)| <= 127. One FADD instead of a conversion (F2I runs at a quarter of the FP32 rate).
constexpr float kRoundMagic = 12582912.0f;
constexpr uint32_t kRoundMagicBits = 0x4B400000u;

// rni(y) (ties to even) as float, exactly the reference's torch.round(y) for |y| < 2^22. The adds are
// explicit _rn so that the compiler cannot contract a preceding multiply into them (one rounding of the
// product first, as the reference has).
__device__ __forceinline__ float round_to_int(float y) {
  return __fsub_rn(__fadd_rn(y, kRoundMagic), kRoundMagic);
}

// 4 values (each already x * inv, |.| <= 127.5) -> 4 int8 bytes rni(.), a in the low byte.
__device__ __forceinline__ uint32_t pack_s8x4(float a, float b, float c, float d) {
  const uint32_t ba = __float_as_uint(__fadd_rn(a, kRoundMagic)), bb = __float_as_uint(__fadd_rn(b, kRoundMagic));
  const uint32_t bc = __float_as_uint(__fadd_rn(c, kRoundMagic)), bd = __float_as_uint(__fadd_rn(d, kRoundMagic));
  return __byte_perm(__byte_perm(ba, bb, 0x0040), __byte_perm(bc, bd, 0x0040), 0x5410);
}

// 8 values (each already x * inv) -> 8 int8 bytes, element i in byte i.
__device__ __forceinline__ uint2 pack_s8x8(const float (&y)[8]) {
  return make_uint2(pack_s8x4(y[0], y[1], y[2], y[3]), pack_s8x4(y[4], y[5], y[6], y[7]));
}

// An i4rs INT4 value: clamp(rni(y * rcp), -7, 7) as float, rcp = 1 / block scale (recipes/int8.py
// choose_block_scales; one rounding of the product first, as there).
__device__ __forceinline__ float int4_of(float y, float rcp) {
  return fminf(fmaxf(round_to_int(__fmul_rn(y, rcp)), -kInt4Max), kInt4Max);
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

// qk4pv8's K (recipes/int8.py quantize_i4rs) splits a row of D channels into two fields in channel
// order: the low-frequency RoPE half (c mod D/2 >= D/4) as INT8 bytes, the other half as INT4 nibbles.
template <int D>
__device__ __forceinline__ bool split_k_low(int c) { return c % (D / 2) >= D / 4; }

// Position of channel c within its half's field.
template <int D>
__device__ __forceinline__ int split_k_index(int c) {
  const int r = c % (D / 2);
  return (c / (D / 2)) * (D / 4) + (r >= D / 4 ? r - D / 4 : r);
}

}  // namespace mpfa
