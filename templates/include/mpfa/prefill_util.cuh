// Register-level helpers of the prefill kernel (copied from mma_frag.cuh / quant.cuh at the time the
// prefill kernel was written, in their own namespace, so changes to the decode kernel's headers do not
// move the prefill kernel): FP8/E2M1 conversions, packing.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>

namespace mpfa {
namespace pf {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two_bytes) {
  uint32_t r;
  const uint16_t x = static_cast<uint16_t>(two_bytes);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(x));
  return r;
}

__device__ __forceinline__ void e2m1x8_to_f16x2(uint32_t x, uint32_t (&out)[4]) {
  constexpr uint32_t kLutLo = 0x3E3C3800u;   // fp16 high bytes of 0, 0.5, 1, 1.5
  constexpr uint32_t kLutHi = 0x46444240u;   // of 2, 3, 4, 6
  const uint32_t xs = x << 4;
  const uint32_t even = xs & 0x70707070u;    // |code| of element 2k in bits 4..6 of byte k
  const uint32_t odd = x & 0x70707070u;      // |code| of element 2k+1 in bits 4..6 of byte k
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t sel = __byte_perm(even, odd, k | ((4 + k) << 4));          // nibbles 1, 3 = codes
    const uint32_t mag = __byte_perm(kLutLo, kLutHi, sel);                    // bytes 1, 3 = fp16 highs
    const uint32_t sgn = __byte_perm(xs, x, (k << 4) | ((4 + k) << 12));      // bits 15, 31 = signs
    out[k] = mag | (sgn & 0x80008000u);
  }
}

__device__ __forceinline__ uint32_t hmul2_u32(uint32_t a, uint32_t b) {
  __half2 r = __hmul2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// 2 floats -> 2 E4M3 bytes (lo in the low byte), round to nearest even, saturating at +-448.
__device__ __forceinline__ uint16_t to_e4m3x2(float lo, float hi) {
  return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

}  // namespace pf
}  // namespace mpfa
