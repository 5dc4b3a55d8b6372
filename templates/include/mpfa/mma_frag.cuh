// Register-level building blocks of the decode kernel: cp.async, mma.sync m16n8k16, movmatrix, and
// in-register conversions of the cache formats into MMA fragments.
//
// Exactness: e4m3 and block_scale * e2m1 (block scales 2^e or 1.5 * 2^e, |product| <= 384) are
// exactly representable in fp16, so quantized K and V run fp16 MMAs with no rounding of the cache;
// bf16 Q is converted to fp16 (exact in fp16's normal range; the kernel pre-scales Q by a power
// of two when its amax is large).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace mpfa {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Asynchronous global->shared copy of N (4, 8 or 16) bytes; bytes past src_bytes are zero-filled
// (src_bytes = 0 reads nothing).
template <int N>
__device__ __forceinline__ void cp_async(uint32_t dst, const void* src, int src_bytes) {
  static_assert(N == 4 || N == 8 || N == 16, "cp.async copies 4, 8 or 16 bytes");
  if constexpr (N == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(N), "r"(src_bytes));
  }
}
// The same copy with all N bytes read (no zero-fill operand): tiles wholly inside the sequence.
template <int N>
__device__ __forceinline__ void cp_async_full(uint32_t dst, const void* src) {
  static_assert(N == 4 || N == 8 || N == 16, "cp.async copies 4, 8 or 16 bytes");
  if constexpr (N == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(src), "n"(N));
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// D(16x8, fp32) += A(16x16, row) B(16x8, col), all four accumulator registers live. Decode runs
// it "swapped": M = 16 tokens (or 16 channels of V^T), N = 8 query heads, so no row is padding.
__device__ __forceinline__ void mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Transpose of an 8x8 b16 matrix held as an mma fragment (lane g*4+c holds row g, columns 2c, 2c+1):
// afterwards the lane holds row g of the transpose (= column g of the input, rows 2c, 2c+1).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}

// prmt.b32 in its default mode. Unlike __byte_perm, every selector nibble's bit 3 is live (sign
// replication), so callers pass selectors whose nibbles are < 8; the compiler then adds no masking.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// Two e4m3 bytes (low byte -> low half) to f16x2, exactly (cvt.rn.f16x2.e4m3x2, sm_89+).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two_bytes) {
  uint32_t r;
  const uint16_t x = static_cast<uint16_t>(two_bytes);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(x));
  return r;
}
// The upper two bytes of a word (bytes 2, 3) to f16x2.
__device__ __forceinline__ uint32_t e4m3x2_hi_to_f16x2(uint32_t four_bytes) {
  uint32_t r;
  asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}\n" : "=r"(r) : "r"(four_bytes));
  return r;
}

// Eight E2M1 nibbles (element i in nibble i) -> four f16x2 words (elements 2k, 2k+1 in word k),
// unscaled. Magnitudes come from a byte table with prmt (fp16 of 0..6 has a zero low byte); the sign
// bit is moved into place with a second prmt. All selectors have nibbles < 8 (see prmt above).
__device__ __forceinline__ void e2m1x8_to_f16x2(uint32_t x, uint32_t (&out)[4]) {
  constexpr uint32_t kLutLo = 0x3E3C3800u;   // fp16 high bytes of 0, 0.5, 1, 1.5
  constexpr uint32_t kLutHi = 0x46444240u;   // of 2, 3, 4, 6
  const uint32_t xs = x << 4;
  const uint32_t even = xs & 0x70707070u;    // |code| of element 2k in bits 4..6 of byte k
  const uint32_t odd = x & 0x70707070u;      // |code| of element 2k+1 in bits 4..6 of byte k
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t sel = prmt(even, odd, k | ((4 + k) << 4));          // nibbles 1, 3 = codes; 0, 2 = 0
    const uint32_t mag = prmt(kLutLo, kLutHi, sel);                    // bytes 1, 3 = fp16 highs
    const uint32_t sgn = prmt(xs, x, (k << 4) | ((4 + k) << 12));      // bits 15, 31 = signs
    out[k] = mag | (sgn & 0x80008000u);
  }
}

__device__ __forceinline__ uint32_t hmul2_u32(uint32_t a, uint32_t b) {
  __half2 r = __hmul2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

}  // namespace mpfa
