// The decode kernel: one CTA (kWarps warps) per (work item, KV head) attends the query heads of one KV head
// over one split of one request's kTile-token tiles (the item's, schedule.cuh).
//
// Pipeline: kStages shared-memory stages of kTile tokens (every field of one head), filled with cp.async
// (tile_loads.cuh); tokens past the length are zero-filled. Page ids of the tile after next are read
// into a small shared ring one iteration ahead, so no global-load latency sits in front of the
// cp.async issue. Warp w takes tokens [16w, 16w+16) of each stage: QK MMA, online softmax, PV MMA
// (mma.cuh, softmax.cuh); the warps' states are combined at the end (epilogue.cuh).
#pragma once
#include <cuda_bf16.h>
#include <math_constants.h>
#include <cstdint>
#include "mpfa/decode/epilogue.cuh"
#include "mpfa/decode/mma.cuh"
#include "mpfa/decode/params.cuh"
#include "mpfa/decode/schedule.cuh"
#include "mpfa/decode/softmax.cuh"
#include "mpfa/decode/tile_loads.cuh"
#include "mpfa/decode/traits.cuh"
#include "mpfa/mma_frag.cuh"

namespace {

template <class Cfg>
__global__ void __launch_bounds__(DecodeTraits<Cfg>::kThreads, DecodeTraits<Cfg>::kMinBlocks)
    decode_kernel(const DecodeParams p) {
  using T = DecodeTraits<Cfg>;
  using Layout = typename T::Layout;
  extern __shared__ __align__(128) uint8_t smem[];
  uint32_t* ids_ring = reinterpret_cast<uint32_t*>(smem + (T::kSmemBytes - T::kIdsBytes));
  // The CTA's shared window base for the copies, computed once: derived at each use, it cost an S2R
  // of the CTA's cluster id + MOV + LEA at the ring write and again at the copy issue, per iteration.
  uint32_t smem_base;
  asm volatile("mov.u32 %0, %1;\n" : "=r"(smem_base) : "r"(mpfa::smem_u32(smem)));
  // KV heads in x, the fastest: the CTAs of one item's heads run side by side and read the same pages' runs (a
  // page holds every head), which page 1's 1-token runs need (items fastest was up to 1.45x slower there,
  // qk4pv8). Both from the grid, not one index divided: a divided-out head is one more live register, and
  // qk4pv8 / qk8pv8 d128 spilled at the 128-register cap.
  const int h = blockIdx.x, item = blockIdx.y;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int hq0 = h * T::kGroup;

  // --- this CTA's request and range of tiles, from device memory (graph replays see new lengths) ---
  const SplitRange range = split_range<Cfg>(p, item);
  const int b = range.b;
  if (b < 0) return;   // past the work list (a CUDA graph's capacity exceeds this batch's items)
  const int page_first = range.page_first, kv_left = range.kv_left;
  const int n_iter = range.n_iter;
  if (n_iter == 0 && range.split > 0) {
    // Nothing to attend (a fixed split size, or a work list built without the lengths, leaves an item of the
    // request empty): its O is never written, and the merge gives an item whose LSE is -inf weight 0 and drops
    // its O by a select.
    if (tid < T::kGroup) p.lse_part[int64_t(item) * (p.num_kv_heads * T::kGroup) + hq0 + tid] = -CUDART_INF_F;
    return;
  }

  uint32_t qf[T::kHeadDim / 8];
  // The Q unscales of this thread's score columns, heads 2c and 2c + 1 (bf16x2; softmax.cuh applies them).
  uint32_t q_unscale = load_q_fragment<Cfg>(p, b, hq0, g, c, qf);

  // --- page ring: ph = page_id * num_kv_heads + h locates this head's run of a page in every field ---
  const uint32_t Hkv = uint32_t(p.num_kv_heads);
  auto tile_valid = [&](int it) {   // tokens of the split's tile `it`
    const int n = kv_left - it * T::kTile;
    return n < 0 ? 0 : (n > T::kTile ? T::kTile : n);
  };
  auto fetch_ids = [&](int it) -> uint32_t {   // ph this thread stores for iteration `it` (or 0)
    if (tid < T::kPagesPerTile && it < n_iter) {
      const int pg = it * T::kPagesPerTile + tid;
      return pg * T::kPageSize < kv_left ? uint32_t(p.indices[page_first + pg]) * Hkv + uint32_t(h) : 0u;
    }
    return 0u;
  };
  FullTileCopier<Cfg> copier(p, smem);
  auto issue = [&](int it) {
    if (it < n_iter) {
      const int valid = tile_valid(it);
      const uint32_t* ph = ids_ring + (it & 1) * T::kPagesPerTile;
      const uint32_t st = smem_base + (it % T::kStages) * T::kStageBytes;
      if (valid == T::kTile) copier.copy(st, ph);
      else load_partial_tile<Cfg>(st, p, ph, valid);
    }
    mpfa::cp_async_commit();
  };

  // Online-softmax state of this thread's two heads 2c, 2c+1 (identical across g after reductions;
  // l_run is this thread's partial sum, reduced over g at the end).
  float m_run[2] = {-CUDART_INF_F, -CUDART_INF_F}, l_run[2] = {0.f, 0.f};
  // O^T accumulators: acc[mt] = rows (channels) g*kDV + 2mt (c0, c1) and g*kDV + 2mt + 1 (c2, c3),
  // columns (heads) 2c (c0, c2) and 2c + 1 (c1, c3).
  float acc[T::kMT][4];
#pragma unroll
  for (int j = 0; j < T::kMT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  // Token rows of this thread within its warp's 16: MMA rows g -> tA = 4(g/2) + g%2, rows g+8 -> tA + 2.
  // g / 2 is passed to pv_accumulate as a value, not recomputed there: a callee is simplified before it is
  // inlined, and its own g >> 1 would be folded into its shifts (two instructions more per kernel).
  const int g_half = g >> 1;
  const int tA = g_half * 4 + (g & 1);

  if (n_iter > 0) {
    // Iterations 0 .. kStages-2 are issued in the prologue: each needs its ids in the ring first.
    for (int it = 0; it < T::kStages - 1; ++it) {
      if (tid < T::kPagesPerTile) ids_ring[(it & 1) * T::kPagesPerTile + tid] = fetch_ids(it);
      __syncthreads();
      issue(it);
      __syncthreads();   // the next ring write reuses slot (it + 1) & 1 == (it - 1) & 1
    }
    uint32_t next_id = fetch_ids(T::kStages - 1);

    for (int it = 0; it < n_iter; ++it) {
      if (tid < T::kPagesPerTile) ids_ring[((it + T::kStages - 1) & 1) * T::kPagesPerTile + tid] = next_id;
      mpfa::cp_async_wait<T::kStages - 2>();
      __syncthreads();   // stage `it` landed for all threads; stage it-1 fully consumed; ids visible
      issue(it + T::kStages - 1);
      next_id = fetch_ids(it + T::kStages);

      const uint8_t* st = smem + (it % T::kStages) * T::kStageBytes;
      const int valid = tile_valid(it);
      if (valid < T::kTile) {
        // The last tile: V rows past the length must be exactly zero (P is 0 there, and 0 * NaN from a
        // stale or poisoned byte would be NaN); plain stores make that an invariant of this code rather
        // than of how each copy path fills the tail (benchmarks/NOTES.md, decode v2).
        if constexpr (T::kV4) {
          // qk4pv4: a zero scale and zero point make every code of the row 0 (q * 0 + 0); V's rows are swizzled
          // across rows (traits.cuh), v_param's are not.
          constexpr int U = Layout::v_param_bytes < 16 ? Layout::v_param_bytes : 16;
          const uint32_t vpt = mpfa::smem_u32(st) + T::kOffVp;
#pragma unroll 1
          for (int o = valid * Layout::v_param_bytes + tid * U; o < T::kTile * Layout::v_param_bytes;
               o += T::kThreads * U) {
            if constexpr (U == 16)
              asm volatile("st.shared.v4.u32 [%0], { %1, %1, %1, %1 };\n" ::"r"(vpt + o), "r"(0) : "memory");
            else
              asm volatile("st.shared.v2.u32 [%0], { %1, %1 };\n" ::"r"(vpt + o), "r"(0) : "memory");
          }
        } else {
          const uint32_t vt = mpfa::smem_u32(st) + T::kOffV;   // 32-bit shared address: no 64-bit pointer live
#pragma unroll 1
          for (int o = valid * Layout::v_bytes + tid * 16; o < T::kTile * Layout::v_bytes; o += T::kThreads * 16)
            asm volatile("st.shared.v4.u32 [%0], { %1, %1, %1, %1 };\n" ::"r"(vt + o), "r"(0) : "memory");
        }
        __syncthreads();
      }
      const int wrow = 16 * warp;
      float s[4] = {0.f, 0.f, 0.f, 0.f};
      qk_scores<Cfg>(st, wrow, tA, c, qf, s);
      float pr[4];
      // Opaque at each tile, so that its unpacking stays in the loop: hoisted, the two factors take a register
      // more through the loop, and qk4pv8 d128 spills at the 128-register cap. (bf16: the constant 1, 1.)
      if constexpr (T::kQuant) asm volatile("" : "+r"(q_unscale));
      softmax_update<Cfg>(st, wrow, tA, valid, p.score_scale, q_unscale, s, m_run, l_run, acc, pr);
      pv_accumulate<Cfg>(st, wrow, g, g_half, c, pr, acc);
    }
  }
  mpfa::cp_async_wait<0>();
  __syncthreads();   // every stage consumed: the stage buffers become the combine area

  write_output<Cfg>(p, smem, tid, warp, g, c, item, h, hq0, m_run, l_run, acc);
}

}  // namespace
