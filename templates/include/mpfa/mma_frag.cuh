// Register-level building blocks of the decode kernel (the prefill kernel shares its conversions and
// packing): cp.async, mma.sync m16n8k16, movmatrix, and
// in-register conversions of the cache formats into MMA fragments.
//
// Exactness: INT8 K (|x| <= 127), i4rs K's products b * q (|.| <= 126) and E4M3 V are exactly
// representable in fp16, and every conversion below produces them with no rounding, so quantized K and
// V run fp16 MMAs on the cache's exact values; bf16 Q is converted to fp16 (exact in fp16's normal
// range; the kernel pre-scales Q by a power of two when its amax is large). qk4pv4's V is defined by its
// fp16 dequantization, q * scale + zero rounded once (u4x2_rows_to_f16x2).
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

// (a & kMask) ^ c as one lop3.b32 (LUT 0x6A = (0xF0 & 0xCC) ^ 0xAA). Written in C with c a constant too,
// ptxas splits it into two LOP3s (one immediate operand each); here c lives in a register.
template <uint32_t kMask>
__device__ __forceinline__ uint32_t lop3_and_xor(uint32_t a, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0x6A;\n" : "=r"(r) : "r"(a), "n"(kMask), "r"(c));
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

// (lo, lo) and (hi, hi) of an f16x2: ptxas folds these into HMUL2's / HFMA2's operand swizzle (.H0_H0 /
// .H1_H1).
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

// fp16 arithmetic on f16x2 words. In the integer conversions below every operation's exact result (an
// HFMA2's product as well as its sum) is an fp16 value, so nothing is ever rounded.
__device__ __forceinline__ uint32_t hfma2_u32(uint32_t a, uint32_t b, uint32_t c) {
  __half2 r = __hfma2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b), *reinterpret_cast<__half2*>(&c));
  return *reinterpret_cast<uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t hsub2_u32(uint32_t a, uint32_t b) {
  __half2 r = __hsub2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

// Four INT8 bytes (two's complement, byte i = element i) -> f16x2 words lo = (x0, x1), hi = (x2, x3),
// exactly. x ^ 0x80 is the unsigned byte x + 128; under the high byte 0x64 it is the fp16 1024 + x + 128
// (fp16's ulp on [1024, 2048) is 1, so each of the 256 bytes is one mantissa), and subtracting 1152
// leaves the integer x, which fp16 holds exactly (the subtraction's exact result is representable, so
// it is not rounded). 5 instructions per 4 values: one LOP3, two PRMT, two HADD2.
__device__ __forceinline__ void s8x4_to_f16x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  constexpr uint32_t kExp = 0x64646464u;    // fp16 high byte of 1024
  constexpr uint32_t kBias = 0x64806480u;   // fp16 1152 = 1024 + 128 in both halves
  const uint32_t u = w ^ 0x80808080u;
  lo = hsub2_u32(prmt(u, kExp, 0x4140), kBias);
  hi = hsub2_u32(prmt(u, kExp, 0x4342), kBias);
}

// The per-row factor of s4x8_to_f16x2_scaled: (b / 16, -72 b) as an f16x2 from an i4rs block-scale
// byte b in 1..18 (bits 8.. of b_byte are ignored). 0x64 over b is the fp16 1024 + b, and 1024 + b - 1024
// = b exactly; b / 16 and -72 b are exact products (|72 b| <= 1296 = 81 * 16: 7 significant bits).
// Immediate operands only: no constant register at the 128-register cap.
__device__ __forceinline__ uint32_t i4rs_block_scale_f16x2(uint32_t b_byte) {
  const uint32_t t = (b_byte & 0xFFu) | 0x6400u;               // low half: 1024 + b
  const uint32_t b2 = hsub2_u32(low_half2(t), 0x64006400u);    // (b, b)
  return hmul2_u32(b2, 0xD4802C00u);                           // * (1/16, -72)
}

// Eight INT4 nibbles (element i in nibble i, q's 4-bit two's complement, q in [-7, 7]) times their
// block scale b -> four f16x2 words holding b * q exactly, in the pairs (0, 4), (1, 5), (2, 6), (3, 7)
// (callers permute Q the same way). scale = i4rs_block_scale_f16x2(b). Each nibble lands at bits 4..7
// of an fp16 whose high byte is 0x64, flipped by ^ 8 to q + 8 in 1..15: the fp16 1024 + 16 (q + 8) =
// 16 (72 + q); one HFMA2 with (b / 16, -72 b) gives b (72 + q) - 72 b = b q: the product (an integer
// below 2048), the constants (see above) and the result (|b q| <= 126) are all fp16 values.
// Per 8 values: 3 shifts, 4 LOP3 ((y & mask) ^ 0x64806480 sets the exponent and flips the nibble's
// sign bit at once), 4 HFMA2.
__device__ __forceinline__ void s4x8_to_f16x2_scaled(uint32_t w, uint32_t scale, uint32_t (&out)[4]) {
  constexpr uint32_t kMask = 0x00F000F0u;    // bits 4..7 of each half
  constexpr uint32_t kExpSign = 0x64806480u; // the exponent of 1024 and the nibble's bit 3 (at bit 7)
  const uint32_t b = low_half2(scale), off = high_half2(scale);
  out[0] = hfma2_u32(lop3_and_xor<kMask>(w << 4, kExpSign), b, off);   // nibbles 0, 4
  out[1] = hfma2_u32(lop3_and_xor<kMask>(w, kExpSign), b, off);        // nibbles 1, 5
  out[2] = hfma2_u32(lop3_and_xor<kMask>(w >> 4, kExpSign), b, off);   // nibbles 2, 6
  out[3] = hfma2_u32(lop3_and_xor<kMask>(w >> 8, kExpSign), b, off);   // nibbles 3, 7
}
// Local element (of 8 per word) in the low / high half of output word k above.
__host__ __device__ constexpr int s4x8_pair_lo(int k) { return k; }
__host__ __device__ constexpr int s4x8_pair_hi(int k) { return k + 4; }

// qk4pv4's V: the code byte of two rows (row 0's in bits 0..7 of the low half, row 1's in bits 0..7 of the high
// half; bits 8..15 ignored) -> f16x2 of q * scale + zero for channel 2i (low nibble: even) and 2i + 1 (high
// nibble: odd), rounded once, as the reference (recipes/u4h.py decode_values). scale, zero: f16x2 of the two
// rows'. q is made exact first: the low nibble under 0x64 is the fp16 1024 + q (ulp 1 on [1024, 2048)), the high
// nibble at bits 4..7 under 0x54 is 64 + q (ulp 1/16 on [64, 128)), and subtracting 1024 / 64 is exact; then
// one HFMA2 rounds the exact q * scale + zero. (Folding the subtraction into the zero point, (1024 + q) scale +
// (zero - 1024 scale), would round twice.) Per 4 values: 2 LOP3, 2 HADD2, 2 HFMA2.
__device__ __forceinline__ void u4x2_rows_to_f16x2(uint32_t two_rows, uint32_t scale, uint32_t zero,
                                                   uint32_t& even, uint32_t& odd) {
  constexpr uint32_t kExpLow = 0x64006400u;    // fp16 1024 in both halves
  constexpr uint32_t kExpHigh = 0x54005400u;   // fp16 64
  even = hfma2_u32(hsub2_u32(lop3_and_xor<0x000F000Fu>(two_rows, kExpLow), kExpLow), scale, zero);
  odd = hfma2_u32(hsub2_u32(lop3_and_xor<0x00F000F0u>(two_rows, kExpHigh), kExpHigh), scale, zero);
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
