// Pre-pass for compensation: mu_Q[b, h, :] = mean of request b's chunk rows of query head h (fp32), in two
// kernels so that the whole GPU streams Q (a long chunk's Q is hundreds of MB):
//   q_sum_kernel, grid (row blocks, batch): sums kMuRows rows of all heads (16-byte loads along the
//     contiguous [Hq, D] row) into p.mu_part[block, b, Hq, D];
//   q_mean_kernel, grid (batch, Hq): adds the p.mu_blocks blocks in a fixed order into p.mu (the result does not
//     depend on the grid).
// comp_mma builds (p.q_head; qk4pv8's served one) also need one INT8 Q scale per (request, head): q_mean_kernel writes
// |mu_Q|_1 and zeroes the amax, then q_amax_kernel, grid (row blocks, batch), takes the amax of Q - mu_Q.
#pragma once
#include <cuda_bf16.h>
#include "mpfa/common.cuh"
#include "mpfa/prefill/kernel_traits.cuh"
#include "mpfa/prefill/params.cuh"

namespace {

template <class Cfg>
__global__ void __launch_bounds__(PrefillTraits<Cfg>::kPackThreads) q_sum_kernel(const PrefillParams p) {
  using Kt = PrefillTraits<Cfg>;
  const int x = blockIdx.x, b = blockIdx.y, batch = gridDim.y;
  const int q0 = p.qo_indptr[b], n = p.qo_indptr[b + 1] - q0;
  const int r0 = x * Kt::kMuRows, r1 = min(n, r0 + Kt::kMuRows);
  constexpr int kUnitsPerHead = Kt::kHeadDim / 8;
  const int units = p.num_qo_heads * kUnitsPerHead;
  for (int u = threadIdx.x; u < units; u += Kt::kPackThreads) {
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
    float* dst = p.mu_part + ((int64_t(x) * batch + b) * p.num_qo_heads + h) * Kt::kHeadDim + ch;
    *reinterpret_cast<float4*>(dst) = make_float4(acc[0], acc[1], acc[2], acc[3]);
    *reinterpret_cast<float4*>(dst + 4) = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
}

template <class Cfg>
__global__ void __launch_bounds__(PrefillTraits<Cfg>::kHeadDim) q_mean_kernel(const PrefillParams p) {
  using Kt = PrefillTraits<Cfg>;
  const int b = blockIdx.x, h = blockIdx.y, batch = gridDim.x, d = threadIdx.x;
  const int n = p.qo_indptr[b + 1] - p.qo_indptr[b];
  const int used = min(p.mu_blocks, (n + Kt::kMuRows - 1) / Kt::kMuRows);
  float t = 0.f;
  for (int x = 0; x < used; ++x) t += p.mu_part[((int64_t(x) * batch + b) * p.num_qo_heads + h) * Kt::kHeadDim + d];
  const float mu = n > 0 ? t / float(n) : 0.f;
  p.mu[(int64_t(b) * p.num_qo_heads + h) * Kt::kHeadDim + d] = mu;
  if (p.q_head != nullptr) {
    __shared__ float warp_l1[Kt::kHeadDim / 32];
    float l1 = fabsf(mu);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    if (d % 32 == 0) warp_l1[d / 32] = l1;
    __syncthreads();
    if (d == 0) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < Kt::kHeadDim / 32; ++w) s += warp_l1[w];
      float* qh = p.q_head + (int64_t(b) * p.num_qo_heads + h) * 2;
      qh[0] = 0.f;   // q_amax_kernel's atomicMax starts from it
      qh[1] = s;
    }
  }
}

// amax over request b's rows r0.. of |Q - mu_Q| per head into q_head[b, h, 0] (atomicMax on the bits of a
// non-negative float; a NaN's bits are above every finite one, so a NaN wins as mpfa::max_nan would).
template <class Cfg>
__global__ void __launch_bounds__(PrefillTraits<Cfg>::kPackThreads) q_amax_kernel(const PrefillParams p) {
  using Kt = PrefillTraits<Cfg>;
  const int x = blockIdx.x, b = blockIdx.y;
  const int q0 = p.qo_indptr[b], n = p.qo_indptr[b + 1] - q0;
  const int r0 = x * Kt::kMuRows, r1 = min(n, r0 + Kt::kMuRows);
  if (r0 >= r1) return;
  constexpr int kUnitsPerHead = Kt::kHeadDim / 8;   // consecutive lanes of one warp: the shuffles below reduce them
  const int units = p.num_qo_heads * kUnitsPerHead;
  for (int u0 = 0; u0 < units; u0 += Kt::kPackThreads) {   // uniform trip count: every lane reaches the shuffles
    const int u = u0 + threadIdx.x;
    const bool valid = u < units;
    const int h = valid ? u / kUnitsPerHead : 0, ch = 8 * (u % kUnitsPerHead);
    float amax = 0.f;
    if (valid) {
      const float* mu = p.mu + (int64_t(b) * p.num_qo_heads + h) * Kt::kHeadDim + ch;
      const float4 m0 = *reinterpret_cast<const float4*>(mu), m1 = *reinterpret_cast<const float4*>(mu + 4);
      const float m[8] = {m0.x, m0.y, m0.z, m0.w, m1.x, m1.y, m1.z, m1.w};
      const __nv_bfloat16* src = p.q + int64_t(q0) * p.q_stride_t + int64_t(h) * p.q_stride_h + ch;
      for (int r = r0; r < r1; ++r) {
        const uint4 raw = *reinterpret_cast<const uint4*>(src + int64_t(r) * p.q_stride_t);
        const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float2 f = __bfloat1622float2(h2[k]);
          amax = mpfa::max_nan(amax, mpfa::max_nan(fabsf(f.x - m[2 * k]), fabsf(f.y - m[2 * k + 1])));
        }
      }
    }
#pragma unroll
    for (int off = kUnitsPerHead / 2; off > 0; off >>= 1) amax = mpfa::max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    if (valid && u % kUnitsPerHead == 0)
      atomicMax(reinterpret_cast<unsigned int*>(p.q_head + (int64_t(b) * p.num_qo_heads + h) * 2), __float_as_uint(amax));
  }
}

}  // namespace
