// PrefillTraits<Cfg>: the tile sizes, the tile images' byte layout and the main kernel's shared-memory layout of
// one build, derived from its config Cfg (templates/prefill.cu.jinja renders it as PrefillConfig; the values come
// from mpfa_jit/ops/prefill.py): Layout (the cache row, an mpfa::CacheLayout: its recipe, head_dim and field
// widths), kPageSize, the tile sizes kBM, kQScaleRows, kBN, kMuRows, kLog2P, kCompScaleDivisor and the knobs
// kStages, kTileScale, kCompMma, kPvOnce. Every kernel of this folder is a template on Cfg and every device
// function one on Kt = PrefillTraits<Cfg>, so a header's inputs are its template arguments (as FlashAttention-3's
// Ktraits): each header compiles alone, and nothing is read from the including file.
#pragma once
#include <cstdint>
#include <math_constants.h>
#include "mpfa/cache_layout.cuh"
#include "mpfa/quant.cuh"
#include "mpfa/prefill/params.cuh"

namespace {

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
constexpr bool fac_reads_match(int bn) {
  for (int j = 0; j < bn / 8; ++j)
    for (int c = 0; c < 4; ++c)
      for (int e = 0; e < 2; ++e)
        if (fac_pos(8 * j + 2 * c + e) != (j >> 1) * 16 + 4 * c + 2 * (j & 1) + e) return false;
  return true;
}

template <class Cfg>
struct PrefillTraits {
  // The config, as the headers read it.
  using Layout = typename Cfg::Layout;
  static constexpr int kHeadDim = Layout::kHeadDim;
  static constexpr int kPageSize = Cfg::kPageSize;
  static constexpr int kBM = Cfg::kBM;                    // query rows per CTA
  static constexpr int kQScaleRows = Cfg::kQScaleRows;    // query rows per INT8 Q scale (and head)
  static constexpr int kBN = Cfg::kBN;                    // keys per K/V tile image
  static constexpr int kMuRows = Cfg::kMuRows;            // query rows per block of the mu_Q partial sums
  static constexpr float kLog2P = Cfg::kLog2P;            // log2 of P's scale before its E4M3 rounding
  static constexpr int kStages = Cfg::kStages;
  static constexpr bool kTileScale = Cfg::kTileScale;
  static constexpr bool kCompMma = Cfg::kCompMma;
  static constexpr bool kPvOnce = Cfg::kPvOnce;
  static constexpr float kCompScaleDivisor = Cfg::kCompScaleDivisor;

  // Quantized recipes run the QK MMA on INT8 Q and K (IGMMA) and the PV MMA on e4m3 P and V (QGMMA), both
  // with 1-byte elements in the same tile layouts; bf16 runs HGMMA.
  static constexpr bool kQuant = Layout::kQuantK;
  static_assert(Layout::kQuantK == Layout::kQuantV, "the quantized path quantizes K and V together");
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");

  static constexpr int kE = kQuant ? 1 : 2;                  // bytes per MMA element
  static constexpr int kQKRow = kHeadDim * kE;               // bytes per row of the Q and K MMA tiles
  static constexpr int kW = kQKRow < 128 ? kQKRow : 128;     // their swizzle width
  // V^T rows (channels) of kBN keys: 128 bytes for FP8, 256 for bf16 (two 128-byte column blocks, like K's
  // rows, so that bf16 keeps 128-key tiles and pays each tile's fixed costs as often as FP8).
  static constexpr int kVtRow = kBN * kE;
  static constexpr int kKSteps = kQKRow / 32;                // 32-byte k-steps of the QK MMA
  static constexpr int kPK = kQuant ? kBN / 32 : kBN / 16;   // k-steps of the PV MMA
  static constexpr int kSRegs = kBN / 2;                     // S accumulator floats per thread
  static constexpr int kORegs = kHeadDim / 2;                // O accumulator floats per thread
  // FP8 PV lands in a part accumulator folded into O after each tile, in kParts column parts (head_dim 128:
  // two n64 MMAs, so the part accumulator costs 32 registers, not 64, and each softmax phase overlaps one).
  static constexpr int kParts = kQuant && kHeadDim == 128 ? 2 : 1;
  static constexpr int kPartRegs = kORegs / kParts;
  static constexpr int kOPartRegs = kQuant ? kPartRegs : 1;   // the part accumulator's floats (bf16: unused)

  // Raw cache bytes per (token, head) of each field.
  static constexpr int kKRow = Layout::k_bytes;
  static constexpr int kK8Row = Layout::k8_bytes;
  static constexpr int kBsRow = Layout::k_block_scale_bytes;
  static constexpr int kVRow = Layout::v_bytes;
  static constexpr int kVpRow = Layout::v_param_bytes;

  // Tile images (global workspace and shared memory share the byte layout).
  static constexpr int kImgK = kBN * kQKRow;
  static constexpr int kImgV = kHeadDim * kVtRow;
  static constexpr int kFac = kQuant ? kBN * 4 : 0;          // one per-key factor vector (quantized recipes only)
  // kCompMma (with kTileScale): compensation as one more k-step of the QK MMA, INT8 digits of each key's
  // term against fixed Q-side weights (python/mpfa/recipes/int8.py compensation_digits): per (KV tile, query head)
  // a digit image of kBN rows x kCdRow bytes (32-byte swizzle), and 64 identical rows of weights in shared memory.
  static constexpr int kCdRow = 32;
  static constexpr int kImgCd = kQuant && kCompMma ? kBN * kCdRow : 0;
  static constexpr int kQxBytes = kQuant && kCompMma ? 64 * kCdRow : 0;   // one warpgroup's rows, shared by all
  static_assert(!kCompMma || kTileScale, "comp_mma builds on tile_scale (one K scale per tile)");
  static_assert(kImgK % 1024 == 0 && kImgV % 1024 == 0, "images keep 1024-byte alignment");
  static_assert(fac_reads_match(kBN), "the softmax's fa / fb addresses follow fac_pos");

  // kTileScale builds: every K image carries one scale (kv_pack requantizes the tile's INT8 rows and writes s_T
  // as every key's fa, and the compensation terms from the requantized rows) and the softmax takes its
  // uniform-scale path; bf16 has no INT8 rows, so the knob does nothing there. The pre-pass and the main kernel
  // read this one definition.
  static constexpr bool kUniformK = kQuant && kTileScale;

  // Pre-passes: threads per block. kv_pack stages kPackKeys keys a block: the whole tile for 1-byte elements,
  // half of it for bf16 (a 128-key bf16 tile would need 68 KB, past the 48 KB of static shared memory), so a
  // tile takes kPackParts blocks (blockIdx.x = tile * kPackParts + part).
  static constexpr int kPackThreads = 256;
  static constexpr int kPackKeys = kQuant ? kBN : kBN / 2;
  static constexpr int kPackParts = kBN / kPackKeys;

  // Main kernel: a producer warpgroup and three consumer warpgroups of 64 query rows each, each running a tile's
  // steps in order (mainloop.cuh), their registers too few for S and the PV accumulator to live together, the
  // other two warpgroups filling the gaps.
  static constexpr int kConsumerWGs = kBM / 64;
  static_assert(kBM == 3 * 64, "three consumer warpgroups of 64 rows");
  static constexpr int kConsumers = 128 * kConsumerWGs;
  static constexpr int kThreads = 128 + kConsumers;
  // Registers per thread after setmaxnreg: the producer's 24 leave (65536 - 128 * 24) / kConsumers, rounded
  // down to a multiple of 8.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = (65536 - 128 * kProducerRegs) / kConsumers / 8 * 8;   // 160
  static_assert(128 * kProducerRegs + kConsumers * kConsumerRegs <= 65536, "the register file holds every warpgroup");
  // INT8 Q: one scale per kQScaleRows query rows (a whole number of warpgroups, within one CTA).
  static_assert(kQScaleRows % 64 == 0 && kBM % kQScaleRows == 0, "Q scale tiles are whole warpgroups of one CTA");
  static constexpr int kQScaleGroups = kBM / kQScaleRows;
  static constexpr int kQScaleThreads = 2 * kQScaleRows;   // consumer threads of one scale tile
  static constexpr int kOffQ = 0;
  static constexpr int kOffK = kOffQ + kBM * kQKRow;
  static constexpr int kOffV = kOffK + kStages * kImgK;
  static constexpr int kOffFa = kOffV + kStages * kImgV;
  static constexpr int kOffFb = kOffFa + kStages * kFac;
  static constexpr int kOffCd = kOffFb + kStages * kFac;     // kCompMma: the stages' digit images
  static constexpr int kOffQx = kOffCd + kStages * kImgCd;   // kCompMma: the digits' Q-side weights
  static constexpr int kOffRed = kOffQx + kQxBytes;          // the Q amax: one float per consumer warp (<= 16)
  static constexpr int kOffBar = kOffRed + 64;               // full_k[S], full_v[S], empty[S]
  static constexpr int kSmemUsed = kOffBar + 3 * kStages * 8;
  static constexpr int kSmemBytes = kSmemUsed + 1024;        // slack to align the base to 1024 bytes
  static_assert(kSmemBytes <= 227 * 1024, "shared memory per CTA exceeds the SM's 227 KB: use fewer stages");
  static_assert(kOffK % 1024 == 0 && kOffV % 1024 == 0 && kOffCd % 1024 == 0 && kOffQx % 1024 == 0,
                "MMA tiles 1024-aligned");
};

// kCompMma launches with compensation (p.q_head set): the digits k-step runs for every item, under one INT8 Q
// scale per (request, head), python/mpfa/recipes/int8.py comp_digits_q_scale: max(amax / 127, 127 |mu_Q|_1 /
// kCompScaleDivisor) (1 if both are 0), so that every key's term C_j = (mu_Q . Kint_j) / sq, at most
// 127 |mu_Q|_1 / sq, has digits.
// q_head: the head's [amax of Q - mu_Q, |mu_Q|_1] (prepass_q_mean.cuh).
template <class Kt>
__device__ __forceinline__ bool comp_digits(const PrefillParams& p) { return Kt::kCompMma && p.q_head != nullptr; }
template <class Kt>
__device__ __forceinline__ float head_q_scale(const PrefillParams& p, int b, int hq) {
  const float* qh = p.q_head + (int64_t(b) * p.num_qo_heads + hq) * 2;
  // amax 0 (a one-row request): the floor is the terms' unit, not 1
  const float s = qh[0] == 0.f ? 0.f : mpfa::amax_scale_or_nan(qh[0], mpfa::kInt8Max);
  const float floor = __fdiv_rn(127.f * qh[1], Kt::kCompScaleDivisor);
  const float sq = fmaxf(s, floor);
  return isnan(s) || !isfinite(floor) ? CUDART_NAN_F : sq == 0.f ? 1.f : sq;
}

// 4 floats -> 4 e4m3 bytes (the FP8 P fragment).
__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
  return uint32_t(mpfa::to_e4m3x2(a, b)) | (uint32_t(mpfa::to_e4m3x2(c, d)) << 16);
}

}  // namespace
