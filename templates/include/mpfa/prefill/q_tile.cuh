// The consumers' Q tile: kBM rows of one query head into shared memory as the QK MMA's A operand
// (swizzled like the K image). Quantized recipes smooth it by mu_Q and quantize it to INT8 with one scale
// per kQScaleRows rows (amax / 127 over the scale tile's valid rows, reduced by the scale tile's own threads
// through a named barrier), byte for byte as python/mpfa/recipes/int8.py quantize_q_per_tile. The amax
// propagates NaN: a tile holding a NaN or an infinity gets a NaN scale, which the softmax multiplies into
// every score of the tile.
#pragma once
#include <cuda_bf16.h>
#include "mpfa/common.cuh"
#include "mpfa/pipeline.cuh"
#include "mpfa/quant.cuh"
#include "mpfa/wgmma.cuh"
#include "mpfa/prefill/kernel_traits.cuh"
#include "mpfa/prefill/params.cuh"
#include "mpfa/prefill/tile_scheduler.cuh"

namespace {

// Writes item `it`'s Q tile at kOffQ of smem and returns the scale of the thread's scale tile (1 for bf16).
// ct: the thread's index among the consumers, cw its warp's; red: one float per consumer warp of scratch.
template <class Kt>
__device__ __forceinline__ float load_q(const PrefillParams& p, const Item& it, uint8_t* smem, float* red, int ct,
                                        int cw, int lane) {
  constexpr int kQChunks = Kt::kHeadDim / 8;             // 8 channels (16 bf16 bytes) per unit
  constexpr int kQUnits = Kt::kQScaleRows * kQChunks / Kt::kQScaleThreads;   // units per consumer thread
  static_assert(Kt::kQScaleRows * kQChunks % Kt::kQScaleThreads == 0,
                "Q units divide among the consumer threads");
  static_assert(Kt::kConsumers / 32 <= 16, "red holds one float per consumer warp");
  // Quantized: the kQScaleThreads threads of scale tile `grp` load its rows (gt: the thread's index among them;
  // unit u of the tile is its row u / kQChunks, chunk u % kQChunks; one group spelled out: the compiler cannot
  // see ct < kConsumers).
  const int grp = Kt::kQScaleGroups == 1 ? 0 : ct / Kt::kQScaleThreads;
  const int gt = Kt::kQScaleGroups == 1 ? ct : ct % Kt::kQScaleThreads, row0 = grp * Kt::kQScaleRows;
  const int nh = p.num_qo_heads, b = it.b, hq = it.hq, rows = it.rows;
  const __nv_bfloat16* qbase = p.q + int64_t(it.qo_start + it.row0) * p.q_stride_t + int64_t(hq) * p.q_stride_h;
  float sq = 1.f;
  if constexpr (Kt::kQuant) {
    const float* mu = p.mu ? p.mu + (int64_t(b) * nh + hq) * Kt::kHeadDim : nullptr;
    // The thread's kQUnits chunks of Q (and their mu_Q) are loaded at once, before the first use (one global
    // latency per CTA, which nothing else hides in a CTA's prologue), and smoothed once for both the amax
    // and the quantization.
    uint4 raw[kQUnits];
#pragma unroll
    for (int i = 0; i < kQUnits; ++i) {
      const int u = gt + i * Kt::kQScaleThreads, r = row0 + u / kQChunks, ch = u % kQChunks;
      raw[i] = r < rows ? *reinterpret_cast<const uint4*>(qbase + r * p.q_stride_t + 8 * ch) : make_uint4(0u, 0u, 0u, 0u);
    }
    float x[kQUnits][8];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kQUnits; ++i) {
      const int u = gt + i * Kt::kQScaleThreads, r = row0 + u / kQChunks, ch = u % kQChunks;
      float4 m0 = make_float4(0.f, 0.f, 0.f, 0.f), m1 = m0;
      if (mu) { m0 = *reinterpret_cast<const float4*>(mu + 8 * ch); m1 = *reinterpret_cast<const float4*>(mu + 8 * ch + 4); }
      const float m[8] = {m0.x, m0.y, m0.z, m0.w, m1.x, m1.y, m1.z, m1.w};
      const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw[i]);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 f = __bfloat1622float2(h2[k]);
        x[i][2 * k] = f.x - m[2 * k];
        x[i][2 * k + 1] = f.y - m[2 * k + 1];
        if (r < rows) amax = mpfa::max_nan(amax, mpfa::max_nan(fabsf(x[i][2 * k]), fabsf(x[i][2 * k + 1])));
      }
    }
    // comp_mma launches with compensation: one scale for all of the request's rows of the head (kernel_traits.cuh
    // head_q_scale), so that the compensation digits, in units of sq, do not depend on the Q tile, and the tile's
    // amax is not reduced (the per-element maxima above stay: a predicate on them costs more than they do).
    // Without compensation a comp_mma build takes the tile's scale as the others do.
    const bool head_scale = comp_digits<Kt>(p);
    if (!head_scale) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) amax = mpfa::max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      if (lane == 0) red[cw] = amax;
      if constexpr (Kt::kQScaleGroups == 1) mpfa::pipe::named_sync(1, Kt::kConsumers);
      else mpfa::pipe::named_sync(4 + grp, Kt::kQScaleThreads);   // 4.. : ids no other barrier of the kernel uses
      constexpr int kGroupWarps = Kt::kQScaleThreads / 32;
      amax = red[grp * kGroupWarps];
#pragma unroll
      for (int w = 1; w < kGroupWarps; ++w) amax = mpfa::max_nan(amax, red[grp * kGroupWarps + w]);
    }
    sq = head_scale ? head_q_scale<Kt>(p, b, hq) : mpfa::amax_scale_or_nan(amax, mpfa::kInt8Max);
    const float inv = __frcp_rn(sq);
#pragma unroll
    for (int i = 0; i < kQUnits; ++i) {
      const int u = gt + i * Kt::kQScaleThreads, r = row0 + u / kQChunks, ch = u % kQChunks;
      uint2 q8 = make_uint2(0u, 0u);
      if (r < rows) {
        float y[8];   // |y| <= 127 (1 + 2^-22): rni needs no clamp
#pragma unroll
        for (int k = 0; k < 8; ++k) y[k] = __fmul_rn(x[i][k], inv);
        q8 = mpfa::pack_s8x8(y);
      }
      *reinterpret_cast<uint2*>(smem + Kt::kOffQ + mpfa::wg::tile_offset<Kt::kW>(r, 8 * ch, Kt::kBM)) = q8;
    }
    // An all-zero tile (one query row smoothed by its own mean: Q - mu_Q = 0) stores zeros under any scale;
    // the softmax gets 0 rather than 1, so its folded integer-to-float offset (softmax.cuh) is exactly 0 and
    // the scores are the compensation term alone, where scale 1 would leave an error of one unit of S times
    // the key's scale (~0.01 in LSE on the H200 tests). A NaN amax keeps its NaN scale.
    if (amax == 0.f && !head_scale) sq = 0.f;   // comp_mma: the digits' terms carry the scores under sq
  } else {   // a chunk per iteration: bf16 has no amax pass for batched loads to shorten
    for (int u = ct; u < Kt::kBM * kQChunks; u += Kt::kConsumers) {
      const int r = u / kQChunks, ch = u % kQChunks;
      uint4 raw = make_uint4(0u, 0u, 0u, 0u);
      if (r < rows) raw = *reinterpret_cast<const uint4*>(qbase + r * p.q_stride_t + 8 * ch);
      *reinterpret_cast<uint4*>(smem + Kt::kOffQ + mpfa::wg::tile_offset<Kt::kW>(r, 16 * ch, Kt::kBM)) = raw;
    }
  }
  return sq;
}

// kCompMma: the digits' Q-side operand, 64 identical rows (1, 127 x 31) in the 32-byte swizzle (python/mpfa/
// recipes/int8.py COMP_DIGIT_WEIGHTS) that every warpgroup's MMA reads; written once per CTA.
template <class Kt>
__device__ __forceinline__ void write_digit_weights(uint8_t* smem, int ct) {
  if constexpr (Kt::kCompMma) {
    for (int u = ct; u < 64 * (Kt::kCdRow / 16); u += Kt::kConsumers) {
      const int row = u / (Kt::kCdRow / 16), c16 = u % (Kt::kCdRow / 16);
      const uint32_t w0 = c16 == 0 ? 0x7F7F7F01u : 0x7F7F7F7Fu;   // byte 0 of the row is the weight 1
      *reinterpret_cast<uint4*>(smem + Kt::kOffQx + mpfa::wg::swizzle<Kt::kCdRow>(row * Kt::kCdRow + 16 * c16)) =
          make_uint4(w0, 0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu);
    }
  }
}

}  // namespace
