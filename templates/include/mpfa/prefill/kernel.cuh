// prefill_kernel: warp-specialized FlashAttention over the pre-pass's tile images, one CTA per item
// (tile_scheduler.cuh):
//   warpgroup 0, the producer (kProducerRegs registers): one thread streams the K/V images (producer.cuh);
//   warpgroups 1..3, the consumers (kConsumerRegs registers): 64 query rows each; the Q tile (q_tile.cuh),
//   the KV tiles (mainloop.cuh, softmax.cuh) and the output rows (epilogue.cuh).
#pragma once
#include <math_constants.h>
#include "mpfa/common.cuh"
#include "mpfa/pipeline.cuh"
#include "mpfa/wgmma.cuh"
#include "mpfa/prefill/kernel_traits.cuh"
#include "mpfa/prefill/params.cuh"
#include "mpfa/prefill/tile_scheduler.cuh"
#include "mpfa/prefill/producer.cuh"
#include "mpfa/prefill/q_tile.cuh"
#include "mpfa/prefill/softmax.cuh"
#include "mpfa/prefill/mainloop.cuh"
#include "mpfa/prefill/epilogue.cuh"

namespace {

template <class Cfg>
__global__ void __launch_bounds__(PrefillTraits<Cfg>::kThreads, 1)
    prefill_kernel(const PrefillParams p, float score_scale) {
  using Kt = PrefillTraits<Cfg>;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = mpfa::smem_u32(smem_raw);
  const uint32_t base_addr = (raw_addr + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base_addr - raw_addr);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const Item it = item_at<Kt>(p, int(blockIdx.x));

  const Ring ring = ring_at<Kt>(base_addr);
  if (tid == 0) init_ring<Kt>(ring);
  __syncthreads();

  if (warp < 4) {
    mpfa::pipe::setmaxnreg_dec<Kt::kProducerRegs>();
    if (warp == 0 && lane == 0) produce<Kt>(p, it, ring);
    return;
  }

  mpfa::pipe::setmaxnreg_inc<Kt::kConsumerRegs>();
  const int ct = tid - 128, cw = ct / 32, wg = cw / 4, wq = cw % 4;
  const int g = lane / 4, c = lane % 4;
  float* red = reinterpret_cast<float*>(smem + Kt::kOffRed);

  const float sq = load_q<Kt>(p, it, smem, red, ct, cw, lane);
  zero_fb<Kt>(p, smem, ct);
  write_digit_weights<Kt>(smem, ct);
  mpfa::wg::fence_proxy_async();
  mpfa::pipe::named_sync(1, Kt::kConsumers);   // Q (and the zero fb, the digit weights) visible to every warpgroup

  const int r_lo = wg * 64 + wq * 16 + g;            // tile rows r_lo and r_lo + 8
  MaskRows mr;
  mr.kv_len = it.kv_len;
  mr.diag = it.diag;
  mr.wg_first_row = it.row0 + wg * 64;
  mr.i_lo = it.row0 + r_lo;                          // query index within the request's chunk
  mr.c = c;
  float o_acc[Kt::kORegs];
#pragma unroll
  for (int i = 0; i < Kt::kORegs; ++i) o_acc[i] = 0.f;
  SoftmaxRows<Kt> st;
  st.m_run[0] = st.m_run[1] = -CUDART_INF_F;
  st.l_run[0] = st.l_run[1] = 0.f;
  // Q's descriptor from a warp-uniform address (the warpgroup index through a shuffle), rebuilt per tile in
  // uniform registers: kept across the loop it lives in vector registers and costs 2 R2UR + 1 UMOV per MMA.
  const uint32_t q_addr = __shfl_sync(0xffffffffu, base_addr + Kt::kOffQ + wg * 64 * Kt::kW, 0);

  mainloop<Kt>(p, score_scale, ring, smem, it.n_tiles, q_addr, sq, mr, o_acc, st);
  store_o<Kt>(p, it, o_acc, st, r_lo, c);
}

}  // namespace
