// Tile, shared-memory and register-fragment constants of the decode kernel, derived from the
// specialization constants templates/decode.cu.jinja defines before including this header: kRecipe,
// kHeadDim, kPageSize, kGroup, kWarps (mpfa_jit/ops/decode.py) and Layout (mpfa::CacheLayout, the
// cache's field widths).
#pragma once
#include "mpfa/cache_layout.cuh"
#ifndef MPFA_DECODE_SPECIALIZATION
#include "mpfa/decode/editor_defaults.cuh"
#endif

namespace {

constexpr int kThreads = 32 * kWarps;
constexpr int kTile = 16 * kWarps;                      // tokens per stage: 16 per warp
// Quantized recipes: fp16 MMAs on integer K (INT8, or i4rs's INT8 half and INT4 * block scale) and
// E4M3 V, one FP32 scale per (token, head) of K.
constexpr bool kQuant = Layout::kQuantK;
static_assert(Layout::kQuantK == Layout::kQuantV, "the fp16 path dequantizes K and V together");
static_assert(kGroup >= 1 && kGroup <= 8, "group size (query heads per KV head) must be 1..8");
static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
static_assert(kTile % kPageSize == 0, "page size must divide the tile");

// CTAs per SM the registers are capped for (__launch_bounds__): 4 (<= 128 registers) everywhere but
// bf16 d128 (2: its K/V fragments are twice as wide, and 3 stages of 32 KB fill the SM anyway).
constexpr int kMinBlocks = (!kQuant && kHeadDim == 128) ? 2 : 4;

// One stage: each field's rows of kTile tokens, in the cache's field order.
constexpr int kOffK = 0;
constexpr int kOffK8 = kOffK + kTile * Layout::k_bytes;
constexpr int kOffBs = kOffK8 + kTile * Layout::k8_bytes;
constexpr int kOffKs = kOffBs + kTile * Layout::k_block_scale_bytes;
constexpr int kOffV = kOffKs + kTile * Layout::k_scale_bytes;
constexpr int kStageBytes = kOffV + kTile * Layout::v_bytes;
constexpr int kPagesPerTile = kTile / kPageSize;
constexpr int kIdsBytes = 2 * kPagesPerTile * 4;        // page-id ring (2 tiles)
// Full tiles copy the block and token scales as one set of 16-byte pieces (FullTileScales), with a
// 16-byte per-thread descriptor in shared memory; needs 16-byte pieces in both (page size >= 4).
constexpr bool kMergedScales = kQuant && kPageSize * Layout::k_scale_bytes >= 16 &&
                               (Layout::k_block_scale_bytes == 0 || kPageSize * Layout::k_block_scale_bytes >= 16);
constexpr int kDescBytes = kMergedScales ? kThreads * 16 : 0;
constexpr int kCombineBytes = kWarps * 8 * kHeadDim * 4 + 2 * kWarps * 8 * 4;
// As many stages (2..4) as fit kMinBlocks CTAs in the SM's 228 KB (1 KB reserved per CTA).
constexpr int kStagesFit = ((228 * 1024) / kMinBlocks - 1024 - kIdsBytes - kDescBytes) / kStageBytes;
constexpr int kStages = kStagesFit > 4 ? 4 : (kStagesFit < 2 ? 2 : kStagesFit);
// [stages (the combine area after the loop) | scale-copy descriptors | page-id ring]
constexpr int kOffDesc = kStages * kStageBytes > kCombineBytes ? kStages * kStageBytes : kCombineBytes;
constexpr int kSmemBytes = kOffDesc + kDescBytes + kIdsBytes;
static_assert(kSmemBytes * kMinBlocks + 1024 * kMinBlocks <= 228 * 1024, "kMinBlocks CTAs must fit in shared memory");

// K operand: each thread of a quad (c = lane % 4) holds a quarter of a key row, kKB bytes, read as
// 16-byte chunks c, c + 4, ... (8 bytes at 8c for qk4pv8 d64). Dims per 16-byte chunk:
// qk4pv8: a quarter of the reduction is kK8B INT8 bytes (k8 bytes [c kK8B, (c+1) kK8B)) then 2 kK8B nibbles
// (k bytes [c kK4B, (c+1) kK4B), high-frequency channels [c kK8B, (c+1) kK8B), inside block c * kK8B / 16).
constexpr int kKB = Layout::k_bytes / 4;
constexpr int kKChunkDims = kQuant ? 16 : 8;
constexpr int kKWords = kKB / 4;
// (placeholders of 4 for the other recipes: their kernels instantiate the split-K branch too)
constexpr int kK8B = Layout::kSplitK ? Layout::k8_bytes / 4 : 4;   // split K: INT8 bytes per thread per row
constexpr int kK4B = Layout::kSplitK ? Layout::k_bytes / 4 : 4;    // split K: nibble bytes per thread per row
constexpr int kSteps = kHeadDim / 16;                  // k16 steps of the QK MMA
// V operand: thread (g, c) reads rows 4c..4c+3 of its warp's 16, channels [g*kDV, (g+1)*kDV).
constexpr int kDV = kHeadDim / 8;                      // channels per thread
constexpr int kMT = kHeadDim / 16;                     // m16 tiles of the PV MMA (O^T rows = channels)
constexpr int kVB = kDV * (kQuant ? 1 : 2);            // bytes per row per thread
constexpr int kVWords = kVB / 4;

// Shared-memory XOR swizzles of 16-byte chunks (chunk ^ f(row)) that make the compute reads
// bank-conflict-free where the row length allows it.
__device__ __forceinline__ int k_swizzle(int row) { return (Layout::k_bytes >= 128) ? ((row & 1) << 2) : 0; }
__device__ __forceinline__ int v_swizzle(int row) {
  const int c = (row >> 2) & 3;
  if constexpr (Layout::v_bytes == 128) return c << 1;                        // 8 chunks per row
  else if constexpr (Layout::v_bytes == 256) return (c & 1) | ((c & 2) << 1);  // 16 chunks per row
  else return 0;                                                               // 64-byte rows: 2-way conflicts remain
}

}  // namespace
