// Tile sizes, the tile images' byte layout and the main kernel's shared-memory layout, derived from the
// specialization constants prefill.cu.jinja defines before including this header: kRecipe, kHeadDim,
// kPageSize, Layout (mpfa::CacheLayout), kBM, kBN, kMuRows, kLog2P (mpfa_jit/ops/prefill.py) and the knobs
// kStages, kTileScale, kCompMma, kPvOnce (mpfa_jit/ops/prefill.py).
#pragma once
#include <cstdint>
#include <math_constants.h>
#include "mpfa/cache_layout.cuh"
#include "mpfa/quant.cuh"
#include "mpfa/prefill/params.cuh"
#ifndef MPFA_PREFILL_SPECIALIZATION
#include "mpfa/prefill/editor_defaults.cuh"
#endif

namespace {

// Quantized recipes run the QK MMA on INT8 Q and K (IGMMA) and the PV MMA on e4m3 P and V (QGMMA), both
// with 1-byte elements in the same tile layouts; bf16 runs HGMMA.
constexpr bool kQuant = Layout::kQuantK;
static_assert(Layout::kQuantK == Layout::kQuantV, "the quantized path quantizes K and V together");
static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");

constexpr int kE = kQuant ? 1 : 2;                  // bytes per MMA element
constexpr int kQKRow = kHeadDim * kE;               // bytes per row of the Q and K MMA tiles
constexpr int kW = kQKRow < 128 ? kQKRow : 128;     // their swizzle width
// V^T rows (channels) of kBN keys: 128 bytes for FP8, 256 for bf16 (two 128-byte column blocks, like K's
// rows, so that bf16 keeps 128-key tiles and pays each tile's fixed costs as often as FP8).
constexpr int kVtRow = kBN * kE;
constexpr int kKSteps = kQKRow / 32;                // 32-byte k-steps of the QK MMA
constexpr int kPK = kQuant ? kBN / 32 : kBN / 16;   // k-steps of the PV MMA
constexpr int kSRegs = kBN / 2;                     // S accumulator floats per thread
constexpr int kORegs = kHeadDim / 2;                // O accumulator floats per thread
// FP8 PV lands in a part accumulator folded into O after each tile, in kParts column parts (head_dim 128:
// two n64 MMAs, so the part accumulator costs 32 registers, not 64, and each softmax phase overlaps one).
constexpr int kParts = kQuant && kHeadDim == 128 ? 2 : 1;
constexpr int kPartRegs = kORegs / kParts;

// Raw cache bytes per (token, head) of each field.
constexpr int kKRow = Layout::k_bytes;
constexpr int kK8Row = Layout::k8_bytes;
constexpr int kBsRow = Layout::k_block_scale_bytes;
constexpr int kVRow = Layout::v_bytes;

// Tile images (global workspace and shared memory share the byte layout).
constexpr int kImgK = kBN * kQKRow;
constexpr int kImgV = kHeadDim * kVtRow;
constexpr int kFac = kQuant ? kBN * 4 : 0;          // one per-key factor vector (quantized recipes only)
// kCompMma (with kTileScale): compensation as one more k-step of the QK MMA, INT8 digits of each key's
// term against fixed Q-side weights (python/mpfa/recipes/int8.py compensation_digits): per (KV tile, query head) a
// digit image of kBN rows x kCdRow bytes (32-byte swizzle), and 64 identical rows of weights in shared memory.
constexpr int kCdRow = 32;
constexpr int kImgCd = kQuant && kCompMma ? kBN * kCdRow : 0;
constexpr int kQxBytes = kQuant && kCompMma ? 64 * kCdRow : 0;   // one warpgroup's rows, shared by all
static_assert(!kCompMma || kTileScale, "comp_mma builds on tile_scale (one K scale per tile)");
static_assert(kImgK % 1024 == 0 && kImgV % 1024 == 0, "images keep 1024-byte alignment");

// Order of the per-key factors fa / fb in a tile's vector: the 4 keys a consumer thread holds in
// two consecutive 8-column groups of the S accumulator (columns 8j + 2c + e, j = 2m or 2m + 1, e < 2; its
// lane's c = lane % 4) are adjacent, and the 4 lanes of one g hold 16-byte chunks in turn: the softmax reads
// a vector with 8 LDS.128 instead of 16 LDS.64, 64 contiguous bytes per warp instruction (no bank
// conflict).
__host__ __device__ constexpr int fac_pos(int key) {   // key (0..kBN-1) -> its place in the fa / fb vector
  return (key >> 4) * 16 + ((key & 7) >> 1) * 4 + ((key >> 3) & 1) * 2 + (key & 1);
}
// The softmax reads the vector at (j / 2) * 16 + 4c (+2 for odd j) directly, where the compiler cannot see
// c < 4 through fac_pos: that address must be fac_pos of the key it stands for, for every j, c and e.
constexpr bool fac_reads_match() {
  for (int j = 0; j < kBN / 8; ++j)
    for (int c = 0; c < 4; ++c)
      for (int e = 0; e < 2; ++e)
        if (fac_pos(8 * j + 2 * c + e) != (j >> 1) * 16 + 4 * c + 2 * (j & 1) + e) return false;
  return true;
}
static_assert(fac_reads_match(), "the softmax's fa / fb addresses follow fac_pos");

// Pre-passes: threads per block.
constexpr int kPackThreads = 256;

// Main kernel: a producer warpgroup and three consumer warpgroups of 64 query rows each, each running a tile's
// steps in order (mainloop.cuh), their registers too few for S and the PV accumulator to live together, the
// other two warpgroups filling the gaps.
constexpr int kConsumerWGs = kBM / 64;
static_assert(kBM == 3 * 64, "three consumer warpgroups of 64 rows");
constexpr int kConsumers = 128 * kConsumerWGs;
constexpr int kThreads = 128 + kConsumers;
// Registers per thread after setmaxnreg: the producer's 24 leave (65536 - 128 * 24) / kConsumers, rounded
// down to a multiple of 8.
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = (65536 - 128 * kProducerRegs) / kConsumers / 8 * 8;   // 160
static_assert(128 * kProducerRegs + kConsumers * kConsumerRegs <= 65536, "the register file holds every warpgroup");
// INT8 Q: one scale per kQScaleRows query rows (a whole number of warpgroups, within one CTA).
static_assert(kQScaleRows % 64 == 0 && kBM % kQScaleRows == 0, "Q scale tiles are whole warpgroups of one CTA");
constexpr int kQScaleGroups = kBM / kQScaleRows;
constexpr int kQScaleThreads = 2 * kQScaleRows;   // consumer threads of one scale tile
constexpr int kOffQ = 0;
constexpr int kOffK = kOffQ + kBM * kQKRow;
constexpr int kOffV = kOffK + kStages * kImgK;
constexpr int kOffFa = kOffV + kStages * kImgV;
constexpr int kOffFb = kOffFa + kStages * kFac;
constexpr int kOffCd = kOffFb + kStages * kFac;     // kCompMma: the stages' digit images
constexpr int kOffQx = kOffCd + kStages * kImgCd;   // kCompMma: the digits' Q-side weights
constexpr int kOffRed = kOffQx + kQxBytes;          // the Q amax: one float per consumer warp (<= 16)
constexpr int kOffBar = kOffRed + 64;               // full_k[S], full_v[S], empty[S]
constexpr int kSmemUsed = kOffBar + 3 * kStages * 8;
constexpr int kSmemBytes = kSmemUsed + 1024;        // slack to align the base to 1024 bytes
static_assert(kSmemBytes <= 227 * 1024, "shared memory per CTA exceeds the SM's 227 KB: use fewer stages");
static_assert(kOffK % 1024 == 0 && kOffV % 1024 == 0 && kOffCd % 1024 == 0 && kOffQx % 1024 == 0,
              "MMA tiles 1024-aligned");

// kTileScale builds: every K image carries one scale (kv_pack requantizes the tile and writes s_T as every key's
// fa, and the compensation terms from the requantized rows) and the softmax takes its uniform-scale path. The
// pre-pass and the main kernel must agree on this one test.
__device__ __forceinline__ constexpr bool uniform_k_tiles() { return kQuant && kTileScale; }

// kCompMma launches with compensation (p.q_head set): the digits k-step runs for every item, under one INT8 Q
// scale per (request, head), python/mpfa/recipes/int8.py comp_digits_q_scale: max(amax / 127, 127 |mu_Q|_1 /
// kCompScaleDivisor) (1 if both are 0), so that every key's term C_j = (mu_Q . Kint_j) / sq, at most
// 127 |mu_Q|_1 / sq, has digits.
// q_head: the head's [amax of Q - mu_Q, |mu_Q|_1] (prepass_q_mean.cuh).
__device__ __forceinline__ bool comp_digits(const PrefillParams& p) { return kCompMma && p.q_head != nullptr; }
__device__ __forceinline__ float head_q_scale(const PrefillParams& p, int b, int hq) {
  const float* qh = p.q_head + (int64_t(b) * p.num_qo_heads + hq) * 2;
  // amax 0 (a one-row request): the floor is the terms' unit, not 1
  const float s = qh[0] == 0.f ? 0.f : mpfa::amax_scale_or_nan(qh[0], mpfa::kInt8Max);
  const float floor = __fdiv_rn(127.f * qh[1], kCompScaleDivisor);
  const float sq = fmaxf(s, floor);
  return isnan(s) || !isfinite(floor) ? CUDART_NAN_F : sq == 0.f ? 1.f : sq;
}

// 4 floats -> 4 e4m3 bytes (the FP8 P fragment).
__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
  return uint32_t(mpfa::to_e4m3x2(a, b)) | (uint32_t(mpfa::to_e4m3x2(c, d)) << 16);
}

}  // namespace
