// The consumers' epilogue of one item: O / l (times v_scale for FP8 V) as bf16 rows of `out`, and the
// rows' log-sum-exp (natural log) when lse is given.
#pragma once
#include <cuda_bf16.h>
#include <math_constants.h>
#include "mpfa/mma_frag.cuh"
#include "mpfa/prefill/kernel_traits.cuh"
#include "mpfa/prefill/params.cuh"
#include "mpfa/prefill/softmax.cuh"
#include "mpfa/prefill/tile_scheduler.cuh"

namespace {

// r_lo: the thread's first row within the tile (the other is r_lo + 8); c = lane % 4.
template <class Kt>
__device__ __forceinline__ void store_o(const PrefillParams& p, const Item& it, const float (&o_acc)[Kt::kORegs],
                                        const SoftmaxRows<Kt>& st, int r_lo, int c) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = st.l_run[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int r = r_lo + 8 * h;
    if (r < it.rows) {
      const float inv = l > 0.f ? 1.f / l : 0.f;
      __nv_bfloat16* orow = p.out + int64_t(it.qo_start + it.row0 + r) * p.out_stride_t + int64_t(it.hq) * p.out_stride_h;
#pragma unroll
      for (int j = 0; j < Kt::kHeadDim / 8; ++j) {
        const int col = 8 * j + 2 * c;
        float x0 = o_acc[4 * j + 2 * h] * inv, x1 = o_acc[4 * j + 2 * h + 1] * inv;
        if constexpr (Kt::kQuant) {
          const float2 vs = *reinterpret_cast<const float2*>(p.v_scale + int64_t(it.hk) * Kt::kHeadDim + col);
          x0 *= vs.x; x1 *= vs.y;
        }
        *reinterpret_cast<uint32_t*>(orow + col) = mpfa::pack_bf16x2(x0, x1);
      }
      if (p.lse != nullptr && c == 0)   // a NaN row sum (non-finite input) gives a NaN LSE, not -inf
        p.lse[int64_t(it.qo_start + it.row0 + r) * p.num_qo_heads + it.hq] =
            !(l <= 0.f) ? (st.m_run[h] + log2f(l) - (Kt::kQuant ? Kt::kLog2P : 0.f)) * 0.69314718055994530942f
                        : -CUDART_INF_F;
    }
  }
}

}  // namespace
