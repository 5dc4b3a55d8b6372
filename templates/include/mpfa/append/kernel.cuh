// The append kernel: writes new K/V rows (bf16, after RoPE) into one layer of the paged cache in the
// recipe's format, fused with K smoothing and quantization (quantize_row.cuh), a row per group of
// threads (schedule.cuh).
//
// Slots: slot s is token s % PageSize of page s / PageSize (cache_layout.cuh). A negative
// slot is padding and writes nothing. A slot at or past num_slots would land in the next layer's pages or
// past the cache: it writes nothing either, and a pass of head 0's blocks over the slots counts it in
// *bad_slots, which the host reads when it chooses to (PagedKVCache.check_append_slots): a kernel in a CUDA graph cannot raise.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>
#include "mpfa/append/params.cuh"
#include "mpfa/append/quantize_row.cuh"
#include "mpfa/append/schedule.cuh"
#include "mpfa/cache_layout.cuh"

namespace mpfa::append {

// Adds the number of slots >= num_slots to *bad_slots; run by the blocks of head 0 before their rows, as
// a pass of its own over the slots (which the row loop then reads from cache): a counter carried through
// the row loop, or this pass after it, makes the compiler reload the loop's constants in every iteration.
__device__ __forceinline__ void count_bad_slots(const AppendParams& p) {
  int bad = 0;
#pragma unroll 1
  for (int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x; t < p.num_tokens; t += int64_t(gridDim.x) * kThreads)
    bad += p.slots[t] >= p.num_slots;
  if (bad != 0) atomicAdd(p.bad_slots, bad);
}

// The (page, head, slot) row of a slot in each field (meaningless for a slot outside [0, num_slots): not written).
template <int PageSize>
__device__ __forceinline__ int64_t cache_row(int64_t slot, int num_kv_heads, int h) {
  const int64_t page = slot / PageSize, off = slot % PageSize;
  return (page * num_kv_heads + h) * PageSize + off;
}

// L: the build's cache row (mpfa::CacheLayout, rendered from the recipe's Field table).
template <class L, int PageSize>
__global__ void __launch_bounds__(kThreads, (Schedule<L::kRecipe, L::kHeadDim>::kMinBlocksPerSm))
append_kv_kernel(const AppendParams p) {
  using S = Schedule<L::kRecipe, L::kHeadDim>;
  constexpr int HeadDim = L::kHeadDim;
  static_assert(L::k_scale_bytes == 0 || L::k_scale_bytes == sizeof(float), "k_scale holds one float per row");
  const Lane me = lane_of<S>(threadIdx.x);
  const int h = blockIdx.y;   // one KV head per grid row: its fixed scales load once per thread
  __shared__ __align__(16) float mu_smem[ChannelConstants<L>::kMuShared ? HeadDim : 4];
  const ChannelConstants<L> cc(p.mu_k, p.v_scale, h, me.c0, mu_smem);
  if (h == 0) count_bad_slots(p);
  int parity = 0;   // split K's exchange buffer (schedule.cuh)
  // Offsets (elements) of this thread's 8 channels of its head in a token's K and V rows. Pinned here by an
  // empty asm: otherwise the compiler sinks h * stride into the loop's load branch and recomputes it for
  // every row.
  int64_t k_off = h * p.k_stride_head + me.c0, v_off = h * p.v_stride_head + me.v_c0;
  asm volatile("" : "+l"(k_off), "+l"(v_off));

  // Every thread of a row group runs the same number of iterations: the shuffles stay converged.
  const int64_t t_end = ((p.num_tokens + S::kRowsPerBlock - 1) / S::kRowsPerBlock) * S::kRowsPerBlock;
  for (int64_t t = int64_t(blockIdx.x) * S::kRowsPerBlock + me.row; t < t_end;
       t += int64_t(gridDim.x) * S::kRowsPerBlock) {
    const bool token = t < p.num_tokens;
    const int64_t slot = token ? p.slots[t] : -1;
    // kV4: the V row is another row of this iteration's block (Lane::v_row), with its own slot; t itself otherwise.
    const int64_t tv = t - me.row + me.v_row;
    const bool v_token = tv < p.num_tokens;
    const int64_t v_slot = L::kV4 ? (v_token ? p.slots[tv] : -1) : slot;
    // K and V are read whatever the slot (a padding token's rows are valid input, written nowhere): loads that
    // waited for the slot would put a second memory round trip in every iteration.
    uint4 kr = make_uint4(0, 0, 0, 0), vr = make_uint4(0, 0, 0, 0);
    if (token) {
      kr = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.k) + (t * p.k_stride_token + k_off));
      if constexpr (!L::kV4)
        vr = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.v) + (t * p.v_stride_token + v_off));
    }
    if constexpr (L::kV4) {
      if (v_token)
        vr = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.v) + (tv * p.v_stride_token + v_off));
    }
    const bool write = uint64_t(slot) < uint64_t(p.num_slots);   // uniform across the row group
    const int64_t row = cache_row<PageSize>(slot, p.num_kv_heads, h);   // this (token, head) row of each field
    if constexpr (!L::kQuantK) {
      if (write) store_bf16<L::k_bytes>(p.k_data, row, me.c0, kr);
    }
    // V is stored before K is quantized, so V's registers are free again for K's quantizer.
    if constexpr (!L::kQuantV) {
      if (write) store_bf16<L::v_bytes>(p.v_data, row, me.c0, vr);
    } else if constexpr (L::kV4) {
      store_v_u4h<S, L>(p, uint64_t(v_slot) < uint64_t(p.num_slots), cache_row<PageSize>(v_slot, p.num_kv_heads, h),
                        me, vr);
    } else {
      if (write) store_v_e4m3<L>(p.v_data, row, me.c0, vr, cc.inv_vs);
    }
    if constexpr (L::kQuantK) {
      float k[8], mu[8];
      cc.mu(mu);
      const float amax8 = smooth_k(kr, mu, k);
      if constexpr (L::kSplitK) {
        store_k_i4rs<S, L>(p, write, row, me, k, amax8, parity);
      } else {
        store_k_int8<S, L>(p, write, row, me, k, amax8);
      }
    }
  }
}

template <class L, int PageSize>
inline cudaError_t launch(const AppendParams& p, int device, cudaStream_t stream) {
  cudaError_t err = set_device(device);
  if (err != cudaSuccess) return err;
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.num_tokens < 0 || p.num_slots < 0 || p.num_kv_heads <= 0 || p.num_kv_heads > 65535 || p.bad_slots == nullptr)
    return cudaErrorInvalidValue;
  const dim3 grid = append::grid<Schedule<L::kRecipe, L::kHeadDim>>(p.num_tokens, p.num_kv_heads, device);
  append_kv_kernel<L, PageSize><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mpfa::append
