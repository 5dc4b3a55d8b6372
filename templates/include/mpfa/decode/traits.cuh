// Tile, shared-memory and register-fragment constants of the decode kernel, derived from one
// specialization's config type. Every decode header's functions and kernels are templates on that type
// (Cfg), which templates/decode.cu.jinja renders as DecodeConfig; it has
//   kRecipe (mpfa::Recipe), kHeadDim, kPageSize, kGroup (query heads per KV head: the N = 8 columns of the
//   swapped MMAs), kWarps (per CTA, 16 tokens of each tile apiece; mpfa_jit/ops/decode.py) and
//   Layout (the cache's field widths, as mpfa::CacheLayout names them: k_bytes .. v_bytes, kQuantK, kSplitK, ...).
#pragma once

namespace {

template <class Cfg>
struct DecodeTraits {
  static constexpr int kHeadDim = Cfg::kHeadDim;
  static constexpr int kPageSize = Cfg::kPageSize;
  static constexpr int kGroup = Cfg::kGroup;
  static constexpr int kWarps = Cfg::kWarps;
  using Layout = typename Cfg::Layout;
  static_assert(Layout::kRecipe == Cfg::kRecipe && Layout::kHeadDim == kHeadDim, "the layout of another build");

  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kTile = 16 * kWarps;                      // tokens per stage: 16 per warp
  // Quantized recipes: fp16 MMAs on integer K (INT8, or i4rs's INT8 half and INT4 * block scale) and
  // E4M3 V (or kV4's 4-bit V, dequantized to fp16 by its per-token scale and zero point), one FP32 scale per
  // (token, head) of K.
  static constexpr bool kQuant = Layout::kQuantK;
  static constexpr bool kV4 = Layout::kV4;
  static_assert(Layout::kQuantK == Layout::kQuantV, "the fp16 path dequantizes K and V together");
  static_assert(kGroup >= 1 && kGroup <= 8, "group size (query heads per KV head) must be 1..8");
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
  static_assert(kTile % kPageSize == 0, "page size must divide the tile");

  // CTAs per SM the registers are capped for (__launch_bounds__): 4 (<= 128 registers) everywhere but
  // bf16 d128 (2: its K/V fragments are twice as wide, and 3 stages of 32 KB fill the SM anyway).
  static constexpr int kMinBlocks = (!kQuant && kHeadDim == 128) ? 2 : 4;

  // One stage: each field's rows of kTile tokens, in the cache's field order.
  static constexpr int kOffK = 0;
  static constexpr int kOffK8 = kOffK + kTile * Layout::k_bytes;
  static constexpr int kOffBs = kOffK8 + kTile * Layout::k8_bytes;
  static constexpr int kOffKs = kOffBs + kTile * Layout::k_block_scale_bytes;
  static constexpr int kOffV = kOffKs + kTile * Layout::k_scale_bytes;
  static constexpr int kOffVp = kOffV + kTile * Layout::v_bytes;
  static constexpr int kStageBytes = kOffVp + kTile * Layout::v_param_bytes;
  static constexpr int kPagesPerTile = kTile / kPageSize;
  static constexpr int kIdsBytes = 2 * kPagesPerTile * 4;        // page-id ring (2 tiles)
  // Full tiles copy the block and token scales (and kV4's v_param) as one set of 16-byte pieces
  // (FullTileScales), with a 16-byte per-thread descriptor in shared memory; needs 16-byte pieces in each
  // (page size >= 4).
  static constexpr bool kMergedScales =
      kQuant && kPageSize * Layout::k_scale_bytes >= 16 &&
      (Layout::k_block_scale_bytes == 0 || kPageSize * Layout::k_block_scale_bytes >= 16) &&
      (Layout::v_param_bytes == 0 || kPageSize * Layout::v_param_bytes >= 16);
  static constexpr int kDescBytes = kMergedScales ? kThreads * 16 : 0;
  static constexpr int kCombineBytes = kWarps * 8 * kHeadDim * 4 + 2 * kWarps * 8 * 4;
  // As many stages (2..4) as fit kMinBlocks CTAs in the SM's 228 KB (1 KB reserved per CTA).
  static constexpr int kStagesFit = ((228 * 1024) / kMinBlocks - 1024 - kIdsBytes - kDescBytes) / kStageBytes;
  static constexpr int kStages = kStagesFit > 4 ? 4 : (kStagesFit < 2 ? 2 : kStagesFit);
  // [stages (the combine area after the loop) | scale-copy descriptors | page-id ring]
  static constexpr int kOffDesc = kStages * kStageBytes > kCombineBytes ? kStages * kStageBytes : kCombineBytes;
  static constexpr int kSmemBytes = kOffDesc + kDescBytes + kIdsBytes;
  static_assert(kSmemBytes * kMinBlocks + 1024 * kMinBlocks <= 228 * 1024, "kMinBlocks CTAs must fit in shared memory");

  // K operand: each thread of a quad (c = lane % 4) holds a quarter of a key row, kKB bytes, read as
  // 16-byte chunks c, c + 4, ... (8 bytes at 8c for qk4pv8 d64). Dims per 16-byte chunk:
  // qk4pv8: a quarter of the reduction is kK8B INT8 bytes (k8 bytes [c kK8B, (c+1) kK8B)) then 2 kK8B nibbles
  // (k bytes [c kK4B, (c+1) kK4B), high-frequency channels [c kK8B, (c+1) kK8B), inside block c * kK8B / 16).
  static constexpr int kKB = Layout::k_bytes / 4;
  static constexpr int kKChunkDims = kQuant ? 16 : 8;
  static constexpr int kKWords = kKB / 4;
  // (placeholders of 4 for the other recipes: their kernels instantiate the split-K branch too)
  static constexpr int kK8B = Layout::kSplitK ? Layout::k8_bytes / 4 : 4;   // split K: INT8 bytes per thread per row
  static constexpr int kK4B = Layout::kSplitK ? Layout::k_bytes / 4 : 4;    // split K: nibble bytes per thread per row
  static constexpr int kSteps = kHeadDim / 16;                  // k16 steps of the QK MMA
  // V operand: thread (g, c) reads rows 4c..4c+3 of its warp's 16, channels [g*kDV, (g+1)*kDV) (kV4: all in
  // one group of 32 channels, so one scale and zero point per row).
  static constexpr int kDV = kHeadDim / 8;                      // channels per thread
  static constexpr int kMT = kHeadDim / 16;                     // m16 tiles of the PV MMA (O^T rows = channels)
  static constexpr int kVB = kV4 ? kDV / 2 : kDV * (kQuant ? 1 : 2);   // bytes per row per thread
  static constexpr int kVWords = kVB / 4;
  static_assert(!kV4 || Layout::kV4Group % kDV == 0, "a thread's V channels share one scale and zero point");

  // Shared-memory XOR swizzles of 16-byte chunks: the byte offset o = row * row bytes + 16 chunk + b is stored
  // at o ^ (f(row) << 4), which makes the compute reads bank-conflict-free where the row length allows it.
  __device__ __forceinline__ static int k_swizzle(int row) { return (Layout::k_bytes >= 128) ? ((row & 1) << 2) : 0; }
  __device__ __forceinline__ static int v_swizzle(int row) {
    const int c = (row >> 2) & 3;
    if constexpr (kV4) {
      // 64- (32-) byte rows, read kVB bytes at g kVB by every lane (g, c) in rows 4c + r: unswizzled, the quads
      // c = 0..3 read the same 16 (8) banks. Moving each row within its 128-byte line by c (f(row) reaches past
      // the row's own chunks: the rows of a line trade places) gives each quad other banks: the minimum
      // wavefronts.
      return (c & (128 / Layout::v_bytes - 1)) * (Layout::v_bytes / 16);
    } else if constexpr (Layout::v_bytes == 128) {
      return c << 1;                         // 8 chunks per row
    } else if constexpr (Layout::v_bytes == 256) {
      return (c & 1) | ((c & 2) << 1);       // 16 chunks per row
    } else {
      return 0;                              // E4M3 64-byte rows: 2-way conflicts remain
    }
  }
};

}  // namespace
