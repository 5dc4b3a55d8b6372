// Hopper warpgroup MMA (wgmma) building blocks for the prefill kernel: shared-memory matrix
// descriptors for K-major tiles with 128-, 64- or 32-byte swizzle, the fences, and fixed-shape
// wrappers (m64nNk32 e4m3 x e4m3 -> f32 = QGMMA; m64n128k32 s8 x s8 -> s32 = IGMMA; m64nNk16 bf16 x
// bf16 -> f32 = HGMMA), with A from shared memory (ss) or from registers (rs). B always comes from
// shared memory, K-major.
//
// Tile layout (both operands, K-major): row r (an M or N index) holds the reduction dimension
// contiguously. A tile whose rows are R bytes long is stored as R / W column blocks of
// [rows x W bytes] (W = min(R, 128)), each block swizzled like CUTLASS's Swizzle<3,4,3> (W = 128:
// 16-byte chunk index ^= row % 8), Swizzle<2,4,3> (W = 64: chunk ^= (row / 2) % 4) or Swizzle<1,4,3>
// (W = 32: chunk ^= (row / 4) % 2), i.e. byte offset o -> o ^ (((o >> 7) & mask) << 4), on 1024-byte-aligned bases. The descriptor's stride
// byte offset is one 8-row group (8 * W bytes); the leading byte offset is unused for swizzled
// K-major tiles (encoded 1, as CUTLASS does). A k-step of 32 bytes advances the start address by
// 32 bytes inside the swizzle row (the hardware applies the XOR to the final address bits).
#pragma once
#include <cstdint>

namespace mpfa {
namespace wg {

template <int W>
__device__ __forceinline__ int swizzle(int o) {
  static_assert(W == 128 || W == 64 || W == 32, "swizzle width 32, 64 or 128 bytes");
  return o ^ (((o >> 7) & (W / 16 - 1)) << 4);   // Swizzle<3,4,3>, <2,4,3>, <1,4,3>
}

// Byte offset of (row, byte column) in a K-major tile of `rows` rows, swizzle width W.
template <int W>
__device__ __forceinline__ int tile_offset(int row, int col, int rows) {
  return (col / W) * rows * W + swizzle<W>(row * W + (col % W));
}

// Matrix descriptor: start address >> 4 (bits 0-13), LBO (16-29), SBO (32-45), swizzle mode (62-63:
// 1 = 128B, 2 = 64B, 3 = 32B); base offset (49-51) 0: every tile base is aligned to the swizzle repeat.
template <int W>
__device__ __forceinline__ uint64_t make_desc(uint32_t smem_addr) {
  static_assert(W == 128 || W == 64 || W == 32, "swizzle width 32, 64 or 128 bytes");
  return uint64_t((smem_addr & 0x3FFFFu) >> 4) | (uint64_t(1) << 16) | (uint64_t((8 * W) >> 4) << 32) |
         (uint64_t(W == 128 ? 1 : W == 64 ? 2 : 3) << 62);
}

// The descriptor of a tile `byte_offset` bytes past the one `desc` describes: the start-address field
// is the low 14 bits and every shared address is below 2^18, so adding offset >> 4 never carries into
// the other fields. One add per MMA instead of rebuilding the descriptor (mask, shift, or, move).
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t byte_offset) {
  return desc + (byte_offset >> 4);
}

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Generic-proxy shared-memory writes (st.shared, cp.async) made visible to the async proxy (wgmma).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keeps the compiler from moving reads/writes of accumulator registers across wgmma issue/wait.
template <int N>
__device__ __forceinline__ void fence_operand(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D[64 x 64] (+)= A B^T, e4m3; scale_d = 0 overwrites D.
__device__ __forceinline__ void mma_ss_e4m3_n64(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D[64 x 128] (+)= A B^T, e4m3; scale_d = 0 overwrites D.
__device__ __forceinline__ void mma_ss_e4m3_n128(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D[64 x 128] (+)= A B^T, s8 x s8 -> s32 (IGMMA, the FP8 rate); scale_d = 0 overwrites D. The integer form
// has no immediate A/B scale operands. D holds int32 bit patterns in float registers, so that the S array
// keeps the type the softmax and the register fences use; the caller converts them (softmax.cuh).
__device__ __forceinline__ void mma_ss_s8_n128(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p;\n}\n"
      : "+r"(reinterpret_cast<uint32_t&>(d[0])), "+r"(reinterpret_cast<uint32_t&>(d[1])), "+r"(reinterpret_cast<uint32_t&>(d[2])), "+r"(reinterpret_cast<uint32_t&>(d[3])), "+r"(reinterpret_cast<uint32_t&>(d[4])), "+r"(reinterpret_cast<uint32_t&>(d[5])), "+r"(reinterpret_cast<uint32_t&>(d[6])), "+r"(reinterpret_cast<uint32_t&>(d[7])), "+r"(reinterpret_cast<uint32_t&>(d[8])), "+r"(reinterpret_cast<uint32_t&>(d[9])), "+r"(reinterpret_cast<uint32_t&>(d[10])), "+r"(reinterpret_cast<uint32_t&>(d[11])), "+r"(reinterpret_cast<uint32_t&>(d[12])), "+r"(reinterpret_cast<uint32_t&>(d[13])), "+r"(reinterpret_cast<uint32_t&>(d[14])), "+r"(reinterpret_cast<uint32_t&>(d[15])), "+r"(reinterpret_cast<uint32_t&>(d[16])), "+r"(reinterpret_cast<uint32_t&>(d[17])), "+r"(reinterpret_cast<uint32_t&>(d[18])), "+r"(reinterpret_cast<uint32_t&>(d[19])), "+r"(reinterpret_cast<uint32_t&>(d[20])), "+r"(reinterpret_cast<uint32_t&>(d[21])), "+r"(reinterpret_cast<uint32_t&>(d[22])), "+r"(reinterpret_cast<uint32_t&>(d[23])), "+r"(reinterpret_cast<uint32_t&>(d[24])), "+r"(reinterpret_cast<uint32_t&>(d[25])), "+r"(reinterpret_cast<uint32_t&>(d[26])), "+r"(reinterpret_cast<uint32_t&>(d[27])), "+r"(reinterpret_cast<uint32_t&>(d[28])), "+r"(reinterpret_cast<uint32_t&>(d[29])), "+r"(reinterpret_cast<uint32_t&>(d[30])), "+r"(reinterpret_cast<uint32_t&>(d[31])), "+r"(reinterpret_cast<uint32_t&>(d[32])), "+r"(reinterpret_cast<uint32_t&>(d[33])), "+r"(reinterpret_cast<uint32_t&>(d[34])), "+r"(reinterpret_cast<uint32_t&>(d[35])), "+r"(reinterpret_cast<uint32_t&>(d[36])), "+r"(reinterpret_cast<uint32_t&>(d[37])), "+r"(reinterpret_cast<uint32_t&>(d[38])), "+r"(reinterpret_cast<uint32_t&>(d[39])), "+r"(reinterpret_cast<uint32_t&>(d[40])), "+r"(reinterpret_cast<uint32_t&>(d[41])), "+r"(reinterpret_cast<uint32_t&>(d[42])), "+r"(reinterpret_cast<uint32_t&>(d[43])), "+r"(reinterpret_cast<uint32_t&>(d[44])), "+r"(reinterpret_cast<uint32_t&>(d[45])), "+r"(reinterpret_cast<uint32_t&>(d[46])), "+r"(reinterpret_cast<uint32_t&>(d[47])), "+r"(reinterpret_cast<uint32_t&>(d[48])), "+r"(reinterpret_cast<uint32_t&>(d[49])), "+r"(reinterpret_cast<uint32_t&>(d[50])), "+r"(reinterpret_cast<uint32_t&>(d[51])), "+r"(reinterpret_cast<uint32_t&>(d[52])), "+r"(reinterpret_cast<uint32_t&>(d[53])), "+r"(reinterpret_cast<uint32_t&>(d[54])), "+r"(reinterpret_cast<uint32_t&>(d[55])), "+r"(reinterpret_cast<uint32_t&>(d[56])), "+r"(reinterpret_cast<uint32_t&>(d[57])), "+r"(reinterpret_cast<uint32_t&>(d[58])), "+r"(reinterpret_cast<uint32_t&>(d[59])), "+r"(reinterpret_cast<uint32_t&>(d[60])), "+r"(reinterpret_cast<uint32_t&>(d[61])), "+r"(reinterpret_cast<uint32_t&>(d[62])), "+r"(reinterpret_cast<uint32_t&>(d[63]))
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D[64 x 64] (+)= A B^T, e4m3; scale_d = 0 overwrites D.
__device__ __forceinline__ void mma_rs_e4m3_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// D[64 x 128] (+)= A B^T, e4m3; scale_d = 0 overwrites D.
__device__ __forceinline__ void mma_rs_e4m3_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// D[64 x 64] (+)= A B^T, bf16; scale_d = 0 overwrites D.
__device__ __forceinline__ void mma_ss_bf16_n64(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D[64 x 128] (+)= A B^T, bf16; scale_d = 0 overwrites D.
__device__ __forceinline__ void mma_ss_bf16_n128(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D[64 x 64] (+)= A B^T, bf16; scale_d = 0 overwrites D.
__device__ __forceinline__ void mma_rs_bf16_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// D[64 x 128] (+)= A B^T, bf16; scale_d = 0 overwrites D.
__device__ __forceinline__ void mma_rs_bf16_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

}  // namespace wg
}  // namespace mpfa
