// Pre-pass for compensation: mu_Q[b, h, :] = mean of request b's chunk rows of query head h (fp32), in two
// kernels so that the whole GPU streams Q (a long chunk's Q is hundreds of MB):
//   q_sum_kernel, grid (row blocks, batch): sums kMuRows rows of all heads (16-byte loads along the
//     contiguous [Hq, D] row) into part[block, b, Hq, D];
//   q_mean_kernel, grid (batch, Hq): adds the blocks in a fixed order (the result does not depend on the grid).
#pragma once
#include <cuda_bf16.h>
#include "mpfa/prefill/kernel_traits.cuh"
#include "mpfa/prefill/params.cuh"

namespace {

__global__ void __launch_bounds__(kPackThreads) q_sum_kernel(const KernelParams p, float* part) {
  const int x = blockIdx.x, b = blockIdx.y, batch = gridDim.y;
  const int q0 = p.qo_indptr[b], n = p.qo_indptr[b + 1] - q0;
  const int r0 = x * kMuRows, r1 = min(n, r0 + kMuRows);
  constexpr int kUnitsPerHead = kHeadDim / 8;
  const int units = p.num_qo_heads * kUnitsPerHead;
  for (int u = threadIdx.x; u < units; u += kPackThreads) {
    const int h = u / kUnitsPerHead, ch = 8 * (u % kUnitsPerHead);
    const __nv_bfloat16* src = p.q + int64_t(q0) * p.q_stride_t + int64_t(h) * p.q_stride_h + ch;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int r = r0; r < r1; r += 4) {   // 4 rows' loads in flight, then their sums in row order
      uint4 raw[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        raw[k] = r + k < r1 ? *reinterpret_cast<const uint4*>(src + int64_t(r + k) * p.q_stride_t)
                            : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t w = i == 0 ? raw[k].x : (i == 1 ? raw[k].y : (i == 2 ? raw[k].z : raw[k].w));
          const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
          acc[2 * i] += f.x; acc[2 * i + 1] += f.y;
        }
      }
    }
    float* dst = part + ((int64_t(x) * batch + b) * p.num_qo_heads + h) * kHeadDim + ch;
    *reinterpret_cast<float4*>(dst) = make_float4(acc[0], acc[1], acc[2], acc[3]);
    *reinterpret_cast<float4*>(dst + 4) = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
}

__global__ void __launch_bounds__(kHeadDim) q_mean_kernel(const KernelParams p, const float* part, int blocks,
                                                          float* mu_out) {
  const int b = blockIdx.x, h = blockIdx.y, batch = gridDim.x, d = threadIdx.x;
  const int n = p.qo_indptr[b + 1] - p.qo_indptr[b];
  const int used = min(blocks, (n + kMuRows - 1) / kMuRows);
  float t = 0.f;
  for (int x = 0; x < used; ++x) t += part[((int64_t(x) * batch + b) * p.num_qo_heads + h) * kHeadDim + d];
  mu_out[(int64_t(b) * p.num_qo_heads + h) * kHeadDim + d] = n > 0 ? t / float(n) : 0.f;
}

}  // namespace
