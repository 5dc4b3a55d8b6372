// Register-level building blocks of the decode kernel (the prefill kernel shares its conversions and
// packing): cp.async, mma.sync m16n8k16, movmatrix, and
// in-register conversions of the cache formats into MMA fragments.
//
// Exactness: e4m3 and block_scale * e2m1 (block scales 2^e or 1.5 * 2^e, |product| <= 384) are
// exactly representable in fp16, so quantized K and V run fp16 MMAs with no rounding of the cache
// (4-bit K is built as (e2m1 * 2^-6) * (block_scale * 2^6): both factors and the product exact);
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

// (a & mask) | (b & ~mask) as one lop3.b32 (LUT 0xE4 = (0xF0 & 0xAA) | (0xCC & ~0xAA)).
template <uint32_t kMask>
__device__ __forceinline__ uint32_t lop3_select(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xE4;\n" : "=r"(r) : "r"(a), "r"(b), "n"(kMask));
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

// Eight E2M1 nibbles (element i in nibble i, sign << 3 | code) -> four f16x2 words holding
// e2m1 * 2^-6 exactly, in the pairs (0, 2), (4, 6), (1, 3), (5, 7) (callers permute Q the same way).
// Why it is cheap: an E2M1 code placed at bits 2..4 of a byte, with its sign at bit 7, is the E4M3
// byte of e2m1 * 2^-6 for every code (codes 0 and 1 land on E4M3's zero and subnormal 2^-7, as the
// E2M1 zero and subnormal 0.5 need), so one shift + one masked merge per 4 nibbles builds E4M3 bytes
// and the hardware's e4m3x2 -> f16x2 conversion does the rest: 10 instructions per 8 values, where a
// byte table per nibble pair took 19 (and 2 registers of table constants).
__device__ __forceinline__ void e2m1x8_to_f16x2_scaled(uint32_t x, uint32_t (&out)[4]) {
  constexpr uint32_t kCode = 0x1C1C1C1Cu;    // bits 2..4 of each byte: the E2M1 code
  const uint32_t sg = x & 0x88888888u;       // signs of both nibbles of each byte (bits 3, 7)
  // (a & kCode) | (b & ~kCode) in one lop3: the sign terms have nothing outside kCode but bit 7 of
  // each byte (their bit 3 lies inside kCode). Written in C, the compiler rewrites (sg << 4) & ~kCode
  // as (x << 4) & 0x80808080 and splits the merge into two lop3s; and ptxas re-derives sg << 4 from x
  // (two instructions) unless it is a rotate, whose wrapped-around bit (31 -> 3) kCode drops anyway.
  const uint32_t even = lop3_select<kCode>(x << 2, __funnelshift_l(sg, sg, 4));   // nibble 2k -> byte k
  const uint32_t odd = lop3_select<kCode>(x >> 2, sg);         // nibble 2k+1 -> byte k
  out[0] = e4m3x2_to_f16x2(even);
  out[1] = e4m3x2_hi_to_f16x2(even);
  out[2] = e4m3x2_to_f16x2(odd);
  out[3] = e4m3x2_hi_to_f16x2(odd);
}
// Local element (of 8 per word) in the low / high half of output word k above.
__host__ __device__ constexpr int e2m1x8_pair_lo(int k) { return (k & 1) * 4 + (k >> 1); }
__host__ __device__ constexpr int e2m1x8_pair_hi(int k) { return e2m1x8_pair_lo(k) + 2; }

// (lo, lo) and (hi, hi) of an f16x2: ptxas folds these into HMUL2's operand swizzle (.H0_H0 / .H1_H1).
__device__ __forceinline__ uint32_t low_half2(uint32_t a) {
  __half2 h = __low2half2(*reinterpret_cast<__half2*>(&a));
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t high_half2(uint32_t a) {
  __half2 h = __high2half2(*reinterpret_cast<__half2*>(&a));
  return *reinterpret_cast<uint32_t*>(&h);
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
