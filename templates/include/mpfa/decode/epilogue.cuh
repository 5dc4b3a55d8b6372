// The end of a decode CTA: the kWarps warps' online-softmax states combined through shared memory (the
// stage buffers, free once every stage is consumed), O normalized and scaled by E4M3 V's channel scales, and
// written as the request's output (its only item) or as this item's fp32 partial O and log2 LSE for the
// merge kernel (merge.cuh).
#pragma once
#include <cuda_bf16.h>
#include <math_constants.h>
#include <cstdint>
#include "mpfa/common.cuh"
#include "mpfa/decode/params.cuh"
#include "mpfa/decode/traits.cuh"

namespace {

// item, h: the CTA's grid position; m_run, l_run, acc: the thread's softmax state and O^T accumulators (l_run is
// reduced over the lanes g here).
template <class Cfg>
__device__ __forceinline__ void write_output(const DecodeParams& p, uint8_t* smem, int tid, int warp, int g, int c,
                                             int item, int h, int hq0, const float (&m_run)[2],
                                             float (&l_run)[2], const float (&acc)[DecodeTraits<Cfg>::kMT][4]) {
  using T = DecodeTraits<Cfg>;
  constexpr int kHeadDim = T::kHeadDim, kGroup = T::kGroup, kWarps = T::kWarps;
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    l_run[0] += __shfl_xor_sync(0xffffffffu, l_run[0], off);
    l_run[1] += __shfl_xor_sync(0xffffffffu, l_run[1], off);
  }
  float* o_s = reinterpret_cast<float*>(smem);                       // [warp][8][D]
  float* m_s = o_s + kWarps * 8 * kHeadDim;                          // [warp][8]
  float* l_s = m_s + kWarps * 8;
  if (g == 0) {
    m_s[warp * 8 + 2 * c] = m_run[0]; m_s[warp * 8 + 2 * c + 1] = m_run[1];
    l_s[warp * 8 + 2 * c] = l_run[0]; l_s[warp * 8 + 2 * c + 1] = l_run[1];
  }
#pragma unroll
  for (int j = 0; j < T::kMT; ++j) {
    const int ch = g * T::kDV + 2 * j;
    *reinterpret_cast<float2*>(o_s + (warp * 8 + 2 * c) * kHeadDim + ch) = make_float2(acc[j][0], acc[j][2]);
    *reinterpret_cast<float2*>(o_s + (warp * 8 + 2 * c + 1) * kHeadDim + ch) = make_float2(acc[j][1], acc[j][3]);
  }
  __syncthreads();
  // The item's request and whether it is the request's only item, read again here rather than kept through the
  // tile loop: two more live registers there spilled qk4pv8 and qk8pv8 d128 at the 128-register cap.
  const int b = p.work_request[item];
  const bool final_out = p.work_indptr[b + 1] - p.work_indptr[b] == 1;
  for (int idx = tid; idx < kGroup * kHeadDim / 4; idx += T::kThreads) {
    const int gg = idx / (kHeadDim / 4), d0 = (idx % (kHeadDim / 4)) * 4;
    float m = -CUDART_INF_F;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = mpfa::max_nan(m, m_s[w * 8 + gg]);   // a NaN warp makes the head NaN
    float L = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m != -CUDART_INF_F) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float wt = exp2f(m_s[w * 8 + gg] - m);
        L += l_s[w * 8 + gg] * wt;
        const float4 ow = *reinterpret_cast<const float4*>(o_s + (w * 8 + gg) * kHeadDim + d0);
        o.x += ow.x * wt; o.y += ow.y * wt; o.z += ow.z * wt; o.w += ow.w * wt;
      }
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
    o.x *= inv; o.y *= inv; o.z *= inv; o.w *= inv;
    if constexpr (T::kQuant && !T::kV4) {   // qk4pv4's V has no fixed channel scale
      const float4 vs = *reinterpret_cast<const float4*>(p.v_scale + h * kHeadDim + d0);
      o.x *= vs.x; o.y *= vs.y; o.z *= vs.z; o.w *= vs.w;
    }
    const float lse2 = !(L <= 0.f) ? m + log2f(L) : -CUDART_INF_F;   // a NaN sum gives a NaN LSE
    const int hq = hq0 + gg;
    if (final_out) {
      __nv_bfloat162 o01 = __floats2bfloat162_rn(o.x, o.y), o23 = __floats2bfloat162_rn(o.z, o.w);
      uint2 packed;
      packed.x = *reinterpret_cast<uint32_t*>(&o01);
      packed.y = *reinterpret_cast<uint32_t*>(&o23);
      *reinterpret_cast<uint2*>(p.out + b * p.out_stride_b + hq * p.out_stride_h + d0) = packed;
      if (p.lse != nullptr && d0 == 0) p.lse[int64_t(b) * (p.num_kv_heads * kGroup) + hq] = lse2 * 0.69314718055994530942f;
    } else {
      const int64_t row = int64_t(item) * (p.num_kv_heads * kGroup) + hq;
      *reinterpret_cast<float4*>(p.o_part + row * kHeadDim + d0) = o;
      if (d0 == 0) p.lse_part[row] = lse2;
    }
  }
}

}  // namespace
