// kv_pack's loads (prepass_kv_pack.cuh): one block's keys of the paged cache -> shared memory, K as MMA elements (rows
// of kStRow bytes; qk4pv8's 4-bit half expanded to INT8 here), V as the cache's rows (qk4pv4: as E4M3, stage_v_u4h);
// keys at or past `valid` stage zeros. row_of(key) is the key's (page, head, slot) row of the cache.
// kPrepassWide builds (a study knob) issue each thread's page-table lookups, then its chunk loads, together; the
// served loops wait on two dependent loads (page index, then chunk) per 16 bytes. The staged bytes are the same.
#pragma once
#include <cuda_fp16.h>
#include <cstdint>
#include "mpfa/quant.cuh"
#include "mpfa/prefill/kernel_traits.cuh"
#include "mpfa/prefill/params.cuh"

namespace {

// 16 channels of INT4 K (8 bytes of 4-bit two's-complement nibbles, element 2i in the low nibble of byte i;
// one unsigned integer block scale b in 1..18) -> 16 int8 bytes b * q, exactly (|b * q| <= 126).
__device__ __forceinline__ uint4 k4_block_to_s8(uint2 packed, uint32_t b) {
  uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const uint32_t word = k < 8 ? packed.x : packed.y;
    const int q = static_cast<int>(word << (28 - 4 * (k % 8))) >> 28;   // sign-extended nibble
    w[k / 4] |= (static_cast<uint32_t>(q * static_cast<int>(b)) & 0xFFu) << (8 * (k % 4));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// qk4pv4: the block's staged V rows as E4M3 (stride kHeadDim bytes), from the 4-bit codes, as
// python/mpfa/recipes/u4h.py prefill_image: x = q * scale + zero (one fmaf, in the rotated space), times the
// correctly rounded 1 / v_scale of its channel (v_scale of the rotated V), rounded to E4M3 with saturation.
// Thread tid converts 16 channels (c16 = tid % (D / 16): one constant set of 1 / v_scale) of every
// kPackThreads / (D / 16)-th key; keys at or past `valid` stage zeros.
template <class Kt, class RowOf>
__device__ __forceinline__ void stage_v_u4h(const PrefillParams& p, int hk, int valid, RowOf row_of, uint8_t* st_v) {
  constexpr int kChunks = Kt::kHeadDim / 16;
  static_assert(Kt::kPackThreads % kChunks == 0, "a thread's chunk is the same for all its keys");
  static_assert(Kt::Layout::kV4Group % 16 == 0, "a chunk's channels share one scale and zero point");
  const int c16 = int(threadIdx.x) % kChunks;
  float inv_vs[16];
#pragma unroll
  for (int e = 0; e < 16; e += 4) {
    const float4 vs = *reinterpret_cast<const float4*>(p.v_scale + hk * Kt::kHeadDim + 16 * c16 + e);
    inv_vs[e] = __frcp_rn(vs.x); inv_vs[e + 1] = __frcp_rn(vs.y);
    inv_vs[e + 2] = __frcp_rn(vs.z); inv_vs[e + 3] = __frcp_rn(vs.w);
  }
  for (int key = int(threadIdx.x) / kChunks; key < Kt::kPackKeys; key += Kt::kPackThreads / kChunks) {
    uint32_t w[4] = {0u, 0u, 0u, 0u};
    if (key < valid) {
      const int64_t row = row_of(key);
      const uint2 codes = *reinterpret_cast<const uint2*>(p.v + row * Kt::kVRow + 8 * c16);   // channel 2i: low nibble
      const __half2 param = *reinterpret_cast<const __half2*>(p.v_param + row * Kt::kVpRow +
                                                              4 * (16 * c16 / Kt::Layout::kV4Group));
      const float scale = __low2float(param), zero = __high2float(param);
#pragma unroll
      for (int e = 0; e < 16; e += 2) {
        const uint32_t word = e < 8 ? codes.x : codes.y;
        const float q0 = float((word >> (4 * (e % 8))) & 0xFu), q1 = float((word >> (4 * (e % 8) + 4)) & 0xFu);
        const uint32_t pair = mpfa::to_e4m3x2(__fmul_rn(__fmaf_rn(q0, scale, zero), inv_vs[e]),
                                              __fmul_rn(__fmaf_rn(q1, scale, zero), inv_vs[e + 1]));
        w[e / 4] |= pair << (16 * ((e / 2) % 2));
      }
    }
    *reinterpret_cast<uint4*>(st_v + key * Kt::kHeadDim + 16 * c16) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// kPrepassWide: a thread's kIters chunks of rows of kUnitsPerKey 16-byte chunks (chunk `it` is unit tid + it *
// kPackThreads, of key unit / kUnitsPerKey): their cache rows (-1 at or past `valid`), every page-table lookup issued
// before any is used, and their stores into shared memory rows of `stride` bytes.
template <class Kt, int kUnitsPerKey>
__device__ __forceinline__ int wide_key(int it) {
  return (int(threadIdx.x) + it * Kt::kPackThreads) / kUnitsPerKey;
}

template <class Kt, int kUnitsPerKey, int kIters, class RowOf>
__device__ __forceinline__ void wide_rows(int valid, RowOf row_of, int64_t (&rows)[kIters]) {
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int key = wide_key<Kt, kUnitsPerKey>(it);
    rows[it] = key < valid ? row_of(key) : -1;
  }
}

template <class Kt, int kUnitsPerKey, int kIters>
__device__ __forceinline__ void wide_store(const uint4 (&w)[kIters], uint8_t* st, int stride, int c16) {
#pragma unroll
  for (int it = 0; it < kIters; ++it)
    *reinterpret_cast<uint4*>(st + wide_key<Kt, kUnitsPerKey>(it) * stride + 16 * c16) = w[it];
}

template <class Kt, int kStRow, class RowOf>
__device__ __forceinline__ void stage_k(const PrefillParams& p, int valid, RowOf row_of, uint8_t* st_k) {
  const int tid = threadIdx.x;
  if constexpr (Kt::kPrepassWide) {
    // Each thread's kKIters 16-byte chunks: every page-table lookup, then every chunk load, in flight together,
    // then the stores (the served loop below waits on two dependent loads per chunk).
    constexpr int kKUnits = Kt::kPackKeys * (Kt::kQKRow / 16);
    constexpr int kKIters = kKUnits / Kt::kPackThreads;
    static_assert(kKUnits % Kt::kPackThreads == 0, "every thread stages the same number of K chunks");
    int64_t rows[kKIters];
    wide_rows<Kt, Kt::kQKRow / 16>(valid, row_of, rows);
    // the same for all the thread's units (kPackThreads is a multiple of the units per key)
    const int c16 = tid % (Kt::kQKRow / 16);
    uint4 w[kKIters];
    if constexpr (Kt::Layout::kSplitK) {
      // 16 channels from one side: the low-frequency ones (c mod D/2 >= D/4) are INT8 bytes already; a thread's
      // side is the same for all its chunks, so the loads of each side are issued together before any expansion
      const int idx = mpfa::split_k_index<Kt::kHeadDim>(16 * c16);   // within its half
      if (mpfa::split_k_low<Kt::kHeadDim>(16 * c16)) {
#pragma unroll
        for (int it = 0; it < kKIters; ++it)
          w[it] = rows[it] >= 0 ? *reinterpret_cast<const uint4*>(p.k8 + rows[it] * Kt::kK8Row + idx)
                                : make_uint4(0u, 0u, 0u, 0u);
      } else {
        uint2 packed[kKIters];
        uint32_t block_scale[kKIters];
#pragma unroll
        for (int it = 0; it < kKIters; ++it) {
          packed[it] = rows[it] >= 0 ? *reinterpret_cast<const uint2*>(p.k + rows[it] * Kt::kKRow + idx / 2)
                                     : make_uint2(0u, 0u);
          block_scale[it] = rows[it] >= 0 ? uint32_t(p.k_block_scale[rows[it] * Kt::kBsRow + idx / 16]) : 0u;
        }
#pragma unroll
        for (int it = 0; it < kKIters; ++it) w[it] = k4_block_to_s8(packed[it], block_scale[it]);   // zeros stay 0
      }
    } else {
#pragma unroll
      for (int it = 0; it < kKIters; ++it)
        w[it] = rows[it] >= 0 ? *reinterpret_cast<const uint4*>(p.k + rows[it] * Kt::kKRow + 16 * c16)
                              : make_uint4(0u, 0u, 0u, 0u);
    }
    wide_store<Kt, Kt::kQKRow / 16>(w, st_k, kStRow, c16);
  } else {
    constexpr int kKUnits = Kt::kPackKeys * (Kt::kQKRow / 16);
    for (int u = tid; u < kKUnits; u += Kt::kPackThreads) {
      const int key = u / (Kt::kQKRow / 16), c16 = u % (Kt::kQKRow / 16);
      uint4 w = make_uint4(0u, 0u, 0u, 0u);
      if (key < valid) {
        const int64_t row = row_of(key);
        if constexpr (Kt::Layout::kSplitK) {
          // 16 channels from one side: the low-frequency ones (c mod D/2 >= D/4) are INT8 bytes already
          const int idx = mpfa::split_k_index<Kt::kHeadDim>(16 * c16);   // within its half
          if (mpfa::split_k_low<Kt::kHeadDim>(16 * c16))
            w = *reinterpret_cast<const uint4*>(p.k8 + row * Kt::kK8Row + idx);
          else
            w = k4_block_to_s8(*reinterpret_cast<const uint2*>(p.k + row * Kt::kKRow + idx / 2),
                               uint32_t(p.k_block_scale[row * Kt::kBsRow + idx / 16]));
        } else {
          w = *reinterpret_cast<const uint4*>(p.k + row * Kt::kKRow + 16 * c16);
        }
      }
      *reinterpret_cast<uint4*>(st_k + key * kStRow + 16 * c16) = w;
    }
  }
}

template <class Kt, class RowOf>
__device__ __forceinline__ void stage_v(const PrefillParams& p, int hk, int valid, RowOf row_of, uint8_t* st_v) {
  const int tid = threadIdx.x;
  if constexpr (Kt::Layout::kV4) {
    stage_v_u4h<Kt>(p, hk, valid, row_of, st_v);
  } else if constexpr (Kt::kPrepassWide) {
    constexpr int kVUnits = Kt::kPackKeys * (Kt::kVRow / 16);
    constexpr int kVIters = kVUnits / Kt::kPackThreads;
    static_assert(kVUnits % Kt::kPackThreads == 0, "every thread stages the same number of V chunks");
    const int c16 = tid % (Kt::kVRow / 16);
    int64_t rows[kVIters];
    wide_rows<Kt, Kt::kVRow / 16>(valid, row_of, rows);
    uint4 w[kVIters];
#pragma unroll
    for (int it = 0; it < kVIters; ++it)
      w[it] = rows[it] >= 0 ? *reinterpret_cast<const uint4*>(p.v + rows[it] * Kt::kVRow + 16 * c16)
                            : make_uint4(0u, 0u, 0u, 0u);
    wide_store<Kt, Kt::kVRow / 16>(w, st_v, Kt::kVRow, c16);
  } else {
    constexpr int kVUnits = Kt::kPackKeys * (Kt::kVRow / 16);
    for (int u = tid; u < kVUnits; u += Kt::kPackThreads) {
      const int key = u / (Kt::kVRow / 16), c16 = u % (Kt::kVRow / 16);
      uint4 w = make_uint4(0u, 0u, 0u, 0u);
      if (key < valid) w = *reinterpret_cast<const uint4*>(p.v + row_of(key) * Kt::kVRow + 16 * c16);
      *reinterpret_cast<uint4*>(st_v + key * Kt::kVRow + 16 * c16) = w;
    }
  }
}

}  // namespace
