// The split-KV merge: the work items' fp32 partial O and log2 LSE (epilogue.cuh) into one bf16 output row
// and natural-log LSE per (request, query head). Launched after the decode kernel when the grid has more
// items than requests; a request of one item was written by its CTA and is skipped.
#pragma once
#include <cuda_bf16.h>
#include <math_constants.h>
#include <cstdint>
#include "mpfa/common.cuh"

namespace {

// One block per (request, query head); its 128 threads form S streams of T = kHeadDim / 4 lanes: stream k
// sums the request's splits k, k + S, ... (its items in order: the same sums wherever the work list puts
// them, eager or graph), and stream 0 adds the other streams' sums in order. A single group of lanes walking
// all the splits would wait on a chain of dependent loads (64 splits at 1 x 128K); S streams keep S times as many
// loads in flight. An empty split (LSE -inf, its partial never written) has weight 0 and its partial is dropped
// by a select after the load. Cfg: the specialization (decode/traits.cuh); only its kHeadDim matters here.
template <class Cfg>
__global__ void __launch_bounds__(128) merge_kernel(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                                                    const int* __restrict__ work_indptr, int num_qo_heads,
                                                    __nv_bfloat16* out, int64_t out_stride_b, int64_t out_stride_h,
                                                    float* lse) {
  constexpr int kHeadDim = Cfg::kHeadDim;
  constexpr int T = kHeadDim / 4, S = 128 / T;
  __shared__ float warp_max[4];
  __shared__ float4 o_stream[S][T];
  __shared__ float l_stream[S];
  const int64_t row = blockIdx.x, b = row / num_qo_heads, hq = row % num_qo_heads;
  const int first = work_indptr[b], num_splits = work_indptr[b + 1] - first;
  if (num_splits <= 1) return;   // uniform across the block
  const int stream = threadIdx.x / T, lane = threadIdx.x % T, d0 = lane * 4;
  // Split s's partial row: item first + s, head hq.
  const float* lse_row = lse_part + int64_t(first) * num_qo_heads + hq;
  const float* o_row = o_part + (int64_t(first) * num_qo_heads + hq) * kHeadDim + d0;
  float m = -CUDART_INF_F;
  // NaN-propagating: a split whose LSE is NaN (non-finite input) makes the row NaN, never "no key".
  for (int s = threadIdx.x; s < num_splits; s += 128) m = mpfa::max_nan(m, lse_row[int64_t(s) * num_qo_heads]);
#pragma unroll
  for (int x = 16; x > 0; x /= 2) m = mpfa::max_nan(m, __shfl_xor_sync(0xffffffffu, m, x));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  m = mpfa::max_nan(mpfa::max_nan(warp_max[0], warp_max[1]), mpfa::max_nan(warp_max[2], warp_max[3]));
  float L = 0.f;
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
  if (m != -CUDART_INF_F) {
#pragma unroll 4
    for (int s = stream; s < num_splits; s += S) {
      const float ls = lse_row[int64_t(s) * num_qo_heads];
      const float4 os = __ldg(reinterpret_cast<const float4*>(o_row + int64_t(s) * num_qo_heads * kHeadDim));
      const bool use = ls != -CUDART_INF_F;
      const float w = use ? exp2f(ls - m) : 0.f;
      o.x += (use ? os.x : 0.f) * w; o.y += (use ? os.y : 0.f) * w;
      o.z += (use ? os.z : 0.f) * w; o.w += (use ? os.w : 0.f) * w;
      L += w;
    }
  }
  if (stream > 0) {
    o_stream[stream][lane] = o;
    if (lane == 0) l_stream[stream] = L;
  }
  __syncthreads();
  if (stream > 0) return;
#pragma unroll
  for (int k = 1; k < S; ++k) {
    const float4 ok = o_stream[k][lane];
    o.x += ok.x; o.y += ok.y; o.z += ok.z; o.w += ok.w;
    L += l_stream[k];
  }
  const float inv = L > 0.f ? 1.f / L : 0.f;
  __nv_bfloat162 o01 = __floats2bfloat162_rn(o.x * inv, o.y * inv), o23 = __floats2bfloat162_rn(o.z * inv, o.w * inv);
  uint2 packed;
  packed.x = *reinterpret_cast<uint32_t*>(&o01);
  packed.y = *reinterpret_cast<uint32_t*>(&o23);
  *reinterpret_cast<uint2*>(out + b * out_stride_b + hq * out_stride_h + d0) = packed;
  if (lse != nullptr && d0 == 0) lse[row] = !(L <= 0.f) ? (m + log2f(L)) * 0.69314718055994530942f : -CUDART_INF_F;
}

}  // namespace
