// The consumer warpgroups' main loop over an item's KV tiles: MMA issue (S = Q K^T with both operands in
// shared memory, INT8 for the quantized recipes; O += P V^T with P from registers) around the softmax.
// Each of the three consumer warpgroups runs each tile's steps in order (S = Q K^T, the softmax, P V, the fold):
// no pipelining inside a warpgroup (their registers are too few for S and the PV accumulator to live together),
// the other warpgroups filling the tensor cores while one runs its softmax (SageAttention's sm90 order).
// FP8: P V lands in its own accumulator (two-level accumulation) and is folded in as O = O * corr + O_part
// once it completes, in kParts column parts; bf16: O is rescaled before its MMA accumulates into it.
#pragma once
#include "mpfa/pipeline.cuh"
#include "mpfa/wgmma.cuh"
#include "mpfa/prefill/kernel_traits.cuh"
#include "mpfa/prefill/params.cuh"
#include "mpfa/prefill/producer.cuh"
#include "mpfa/prefill/softmax.cuh"

namespace {

// Shape dispatch on the accumulator size (dependent, so only the recipe's shape is instantiated). Quantized
// recipes: INT8 Q and K, S as int32 bit patterns (softmax_max converts them).
template <class Kt, int NR>
__device__ __forceinline__ void mma_qk(float (&d)[NR], uint64_t da, uint64_t db, int scale_d) {
  static_assert(NR == 64, "S holds 128 keys");
  if constexpr (Kt::kQuant) mpfa::wg::mma_ss_s8_n128(d, da, db, scale_d);
  else mpfa::wg::mma_ss_bf16_n128(d, da, db, scale_d);
}
template <int NR>
__device__ __forceinline__ void mma_pv_fp8(float (&d)[NR], const uint32_t (&a)[4], uint64_t db, int scale_d) {
  if constexpr (NR == 64) mpfa::wg::mma_rs_e4m3_n128(d, a, db, scale_d);    // head_dim 128
  else mpfa::wg::mma_rs_e4m3_n64(d, a, db, scale_d);                        // head_dim 64
}
template <int NR>
__device__ __forceinline__ void mma_pv_bf16(float (&d)[NR], const uint32_t (&a)[4], uint64_t db) {
  if constexpr (NR == 64) mpfa::wg::mma_rs_bf16_n128(d, a, db, 1);
  else mpfa::wg::mma_rs_bf16_n64(d, a, db, 1);
}

// S = Q K^T of the item's g-th KV tile once its K image has landed. q_addr: the warpgroup's Q rows, warp-uniform.
// digits (kCompMma): one more k-step adds each key's compensation term, its digit image against the weights
// (64 identical rows, which every warpgroup reads).
template <class Kt>
__device__ __forceinline__ void issue_qk(const Ring& ring, int g, uint32_t q_addr, bool digits,
                                         float (&sc)[Kt::kSRegs]) {
  const int s = g % Kt::kStages;
  mpfa::pipe::mbar_wait(ring.full_k + 8 * s, (g / Kt::kStages) & 1);
  const uint64_t q_desc = mpfa::wg::make_desc<Kt::kW>(q_addr);
  const uint64_t k_desc = mpfa::wg::make_desc<Kt::kW>(ring.base + Kt::kOffK + s * Kt::kImgK);
  mpfa::wg::fence();
#pragma unroll
  for (int ks = 0; ks < Kt::kKSteps; ++ks) {
    const int kb = ks * 32;
    const uint64_t da = mpfa::wg::desc_advance(q_desc, (kb / Kt::kW) * Kt::kBM * Kt::kW + (kb % Kt::kW));
    const uint64_t db = mpfa::wg::desc_advance(k_desc, (kb / Kt::kW) * Kt::kBN * Kt::kW + (kb % Kt::kW));
    mma_qk<Kt>(sc, da, db, ks > 0);
  }
  if constexpr (Kt::kCompMma) {
    if (digits)
      mma_qk<Kt>(sc, mpfa::wg::make_desc<Kt::kCdRow>(ring.base + Kt::kOffQx),
                 mpfa::wg::make_desc<Kt::kCdRow>(ring.base + Kt::kOffCd + s * Kt::kImgCd), 1);
  }
  mpfa::wg::commit();
}

// P V of the item's g-th KV tile (column part `part` for FP8, into o_part; bf16: O rescaled by corr_prev, then
// accumulated into).
template <class Kt>
__device__ __forceinline__ void issue_pv(const Ring& ring, int g, int part, const uint32_t (&pa)[Kt::kPK][4],
                                         float (&o_part)[Kt::kOPartRegs], float (&o_acc)[Kt::kORegs],
                                         const float (&corr_prev)[2]) {
  const int s = g % Kt::kStages;
  if (part == 0) mpfa::pipe::mbar_wait(ring.full_v + 8 * s, (g / Kt::kStages) & 1);
  const uint64_t vt_desc = mpfa::wg::make_desc<128>(ring.base + Kt::kOffV + s * Kt::kImgV);
  if constexpr (Kt::kQuant) {
    mpfa::wg::fence();
#pragma unroll
    for (int kk = 0; kk < Kt::kPK; ++kk)
      mma_pv_fp8(o_part, pa[kk], mpfa::wg::desc_advance(vt_desc, part * 64 * Kt::kVtRow + kk * 32), kk > 0);
  } else {
    scale_o<Kt>(o_acc, corr_prev);
    mpfa::wg::fence_operand(o_acc);
    mpfa::wg::fence();
#pragma unroll
    for (int kk = 0; kk < Kt::kPK; ++kk)   // 16 keys (32 bytes) a k-step; V^T rows span two 128-byte blocks
      mma_pv_bf16(o_acc, pa[kk], mpfa::wg::desc_advance(vt_desc, (kk * 32 / 128) * Kt::kHeadDim * 128 + kk * 32 % 128));
  }
  mpfa::wg::commit();
}

// After the wgmma wait: FP8 folds the part accumulator into O.
template <class Kt>
__device__ __forceinline__ void fold_pv(int part, float (&o_part)[Kt::kOPartRegs], float (&o_acc)[Kt::kORegs],
                                        const float (&corr_prev)[2]) {
  if constexpr (Kt::kQuant) {
    mpfa::wg::fence_operand(o_part);
#pragma unroll
    for (int i = 0; i < Kt::kPartRegs; ++i) {
      float& o = o_acc[part * Kt::kPartRegs + i];
      o = fmaf(o, corr_prev[(i >> 1) & 1], o_part[i]);
    }
  } else {
    mpfa::wg::fence_operand(o_acc);
  }
}

// Every consumer thread arrives (CUTLASS's PipelineTmaAsync does the same): an arrive releases only its own
// thread's reads of the stage (the fa / fb loads), so one lane per warp after __syncwarp would leave the other
// lanes' reads ordered only through the warp barrier, which racecheck reports as a hazard with the next fill.
template <class Kt>
__device__ __forceinline__ void release(const Ring& ring, int g) {
  mpfa::pipe::mbar_arrive(ring.empty + 8 * (g % Kt::kStages));
}

// All n_tiles KV tiles of the CTA's item: O (unnormalized) into o_acc, the rows' maxima and sums into st.
// q_addr: the warpgroup's Q rows; sq: the Q scale; score_scale: sm_scale * log2(e).
template <class Kt>
__device__ __forceinline__ void mainloop(const PrefillParams& p, float score_scale, const Ring& ring, const uint8_t* smem,
                                         int n_tiles, uint32_t q_addr, float sq, const MaskRows& mr,
                                         float (&o_acc)[Kt::kORegs], SoftmaxRows<Kt>& st) {
  uint32_t pa[Kt::kPK][4];
  float o_part[Kt::kOPartRegs];
  for (int t = 0; t < n_tiles; ++t) {
    float sc[Kt::kSRegs];
    issue_qk<Kt>(ring, t, q_addr, comp_digits<Kt>(p), sc);
    mpfa::wg::wait<0>();
    mpfa::wg::fence_operand(sc);
    float corr[2];
    softmax_max<Kt>(p, score_scale, sc, st, corr, smem, t % Kt::kStages, t * Kt::kBN, mr, sq);
    softmax_exp<Kt>(sc, st);
    pack_p<Kt>(sc, pa);
    if constexpr (Kt::kPvOnce && Kt::kParts == 2) {
      float o_part1[Kt::kOPartRegs];
      issue_pv<Kt>(ring, t, 0, pa, o_part, o_acc, corr);
      issue_pv<Kt>(ring, t, 1, pa, o_part1, o_acc, corr);
      mpfa::wg::wait<0>();
      fold_pv<Kt>(0, o_part, o_acc, corr);
      fold_pv<Kt>(1, o_part1, o_acc, corr);
    } else {
#pragma unroll
      for (int part = 0; part < Kt::kParts; ++part) {
        issue_pv<Kt>(ring, t, part, pa, o_part, o_acc, corr);
        mpfa::wg::wait<0>();
        fold_pv<Kt>(part, o_part, o_acc, corr);
      }
    }
    release<Kt>(ring, t);
  }
}

}  // namespace
