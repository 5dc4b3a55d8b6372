// How the append kernel's threads cover the rows (one row = one token of one KV head) and the grid.
//
// Each thread owns 8 channels of a row: one 16-byte bf16 load of K and one of V. The threads of a row
// reduce its amax with shuffles inside their aligned group of lanes. The grid is (token blocks, KV heads),
// so a thread keeps one head's mu_K and 1/v_scale in registers for the whole kernel.
//
// Split K (qk4pv8) splits each row between two warps: warps 0-3 own the 4-bit (high-frequency) half of
// their rows' channels, warps 4-7 the INT8 half, so no warp runs both quantizers one after the other
// (a warp holding both kinds of chunk would). The row's amax meets its partner warp's through shared
// memory. The other recipes keep a row in one aligned group of kThreadsPerRow lanes.
//
// qk4pv4's V (kV4) is rotated by a butterfly over the whole row (recipes/u4h.py), so its V rows take another
// mapping: each pair of warps (w, w + 4), which shares kRowsPerWarp rows of K, holds those rows' V whole, one row
// in kThreadsPerRow lanes of one warp, and the butterfly runs in registers and shuffles with no shared-memory
// exchange or barrier (K's mapping would split every V row between the two warps).
#pragma once
#include <cuda_runtime.h>
#include <cstdint>
#include "mpfa/cache_layout.cuh"
#include "mpfa/common.cuh"
#include "mpfa/quant.cuh"

namespace mpfa::append {

constexpr int kThreads = 256;

template <Recipe R, int HeadDim>
struct Schedule {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kThreadsPerRow = HeadDim / 8;
  static constexpr int kRowsPerBlock = kThreads / kThreadsPerRow;
  static constexpr bool kSplitHalves = RecipeTraits<R>::kSplitK;
  static constexpr bool kV4 = RecipeTraits<R>::kV4;
  static constexpr int kGroupLanes = kSplitHalves ? kThreadsPerRow / 2 : kThreadsPerRow;  // a row's lanes in one warp
  static constexpr int kRowsPerWarp = 32 / kGroupLanes;
  // Blocks per SM the registers are capped for (__launch_bounds__): the rate follows the rows in flight per
  // SM (benchmarks/NOTES.md). Quantized recipes: 4 (<= 64 registers); the bf16 copy: 5 (<= 48 registers),
  // which it reaches without spilling.
  static constexpr int kMinBlocksPerSm = RecipeTraits<R>::kQuantK ? 4 : 5;
  static_assert(HeadDim % 16 == 0 && kThreadsPerRow <= 32, "head_dim must be a multiple of 16, at most 256");
  static_assert(kRowsPerBlock == (kSplitHalves ? 4 : 8) * kRowsPerWarp, "both mappings cover the same rows");
  static_assert(!kSplitHalves || HeadDim % 64 == 0,
                "split K needs head_dim a multiple of 64 (whole 4-bit blocks in each quarter of the row)");
  static_assert(!kV4 || (kSplitHalves && 2 * 32 == kRowsPerWarp * kThreadsPerRow),
                "kV4's V rows: a warp pair's 64 threads hold its kRowsPerWarp rows whole");
};

struct Lane {
  int row;         // row of the block's kRowsPerBlock
  int group_lane;  // lane within the row's group (0 writes the row's scalars)
  int c0;          // first of the 8 channels this thread owns
  int half;        // split K: 0 the 4-bit half's warps, 1 the INT8 half's; else 0
  int v_row;       // the row whose V this thread holds: row, but for kV4
  int v_c0;        // first of its 8 channels of that V row
};

template <class S>
__device__ __forceinline__ Lane lane_of(int tid) {
  Lane l;
  if constexpr (S::kSplitHalves) {
    const int warp = tid / 32, lane = tid % 32;
    constexpr int q = S::kHeadDim / 32;   // 8-channel chunks per quarter of the row
    l.half = warp / 4;
    l.row = (warp % 4) * S::kRowsPerWarp + lane / S::kGroupLanes;
    l.group_lane = lane % S::kGroupLanes;
    // 4-bit chunks: the first quarter of each half of the row (split_k_low is false there); INT8: the second.
    const int j = l.group_lane;
    l.c0 = 8 * ((j / q) * 2 * q + j % q + l.half * q);
  } else {
    l.half = 0;
    l.row = tid / S::kThreadsPerRow;
    l.group_lane = tid % S::kThreadsPerRow;
    l.c0 = l.group_lane * 8;
  }
  l.v_row = l.row;
  l.v_c0 = l.c0;
  if constexpr (S::kV4) {
    const int pair_thread = l.half * 32 + tid % 32;   // of the warp pair's 64
    l.v_row = (tid / 32 % 4) * S::kRowsPerWarp + pair_thread / S::kThreadsPerRow;
    l.v_c0 = 8 * (pair_thread % S::kThreadsPerRow);
  }
  return l;
}

// Max over the kGroupLanes lanes that share a row, NaN if any lane's is NaN.
template <class S>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int off = S::kGroupLanes / 2; off > 0; off >>= 1) x = max_nan(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

// Split K: the row's amax from this warp's half and its partner's (warp w and w + 4 share rows; one named
// barrier per pair, ids 1-4). `parity` double-buffers the exchange across iterations, so a warp that runs
// ahead cannot overwrite a value its partner has not read yet.
template <class S>
__device__ __forceinline__ float row_amax_across_halves(float half_amax, const Lane& me, int& parity) {
  __shared__ float exchange[2][2][S::kRowsPerBlock];   // [parity][half][row]
  if (me.group_lane == 0) exchange[parity][me.half][me.row] = half_amax;
  asm volatile("bar.sync %0, 64;\n" ::"r"(1 + int(threadIdx.x / 32) % 4) : "memory");
  const float amax = max_nan(half_amax, exchange[parity][1 - me.half][me.row]);
  parity ^= 1;
  return amax;
}

// Enough blocks to keep loads in flight on every SM (4 times the blocks of 256 threads an SM's 2048
// threads hold); the kernel's loop covers the tokens beyond them.
template <class S>
inline dim3 grid(int64_t num_tokens, int num_kv_heads, int device) {
  const int64_t blocks_needed = (num_tokens + S::kRowsPerBlock - 1) / S::kRowsPerBlock;
  const int64_t max_blocks =
      (int64_t(sm_count(device)) * (2048 / kThreads) * 4 + num_kv_heads - 1) / num_kv_heads;
  return dim3(unsigned(blocks_needed < max_blocks ? blocks_needed : max_blocks), unsigned(num_kv_heads));
}

}  // namespace mpfa::append
