// The consumers' online softmax of one KV tile in the S accumulator (this thread's rows r_lo and r_lo + 8,
// columns 8j + 2c + {0, 1}), in two phases so that an MMA can be issued between them:
//   softmax_max: scores scaled (quantized: fa_j * sq * s + fb_j on the INT8 MMA's integer s; bf16:
//     score_scale * s), masked, row maxima;
//     m_run advances, l_run takes the factor corr, which O must take too;
//   softmax_exp: P = exp2(s - base) (FP8: base includes -kLog2P, so P lands scaled for e4m3), summed into l_run
//     (kTileScale without compensation: the scores stay integers through the maxima and the tile's one scale
//     rides the exp's FFMA);
// then pack_p packs P in registers as the A operand of the PV MMA.
#pragma once
#include <math_constants.h>
#include <type_traits>
#include "mpfa/common.cuh"
#include "mpfa/mma_frag.cuh"
#include "mpfa/quant.cuh"
#include "mpfa/prefill/kernel_traits.cuh"
#include "mpfa/prefill/params.cuh"

namespace {

// Running state of the thread's two rows.
template <class Kt>
struct SoftmaxRows {
  float m_run[2];   // running maxima (scaled scores, log2 domain)
  float l_run[2];   // running sums of P over the thread's columns (times 2^kLog2P for FP8)
  float base[2];    // what the current tile's exp2 subtracts
  // Kt::kUniformK (tile_scale, kernel_traits.cuh): a = the tile's one scale times sq. Without compensation (raw)
  // the scores stay the MMA's integers S through the row maxima T, then become x = kRoundMagic + (S - T) (exact)
  // and exp2 takes fma(x, a, c[h]).
  // kCompMma builds: with compensation the MMA added each key's term to S (mainloop.cuh issue_qk), so every tile
  // is raw.
  bool raw;
  float a, c[2];
  __device__ __forceinline__ bool raw_tile() const { return Kt::kUniformK && raw; }
};

// What the mask needs of the thread's rows and the item.
struct MaskRows {
  int kv_len;         // keys of the request
  int diag;           // causal: row i sees keys j <= i + diag
  int wg_first_row;   // first query row of the warpgroup (within the request's chunk)
  int i_lo;           // the thread's row r_lo (within the chunk)
  int c;              // lane % 4: the thread's column pair in each 8-column group
};

// Without compensation the softmax adds fb = 0 rather than branching: every stage's fb vector is zeroed once.
template <class Kt>
__device__ __forceinline__ void zero_fb(const PrefillParams& p, uint8_t* smem, int ct) {
  if (Kt::kQuant && p.fb == nullptr) {
    float* fb_all = reinterpret_cast<float*>(smem + Kt::kOffFb);
    for (int i = ct; i < Kt::kStages * Kt::kBN; i += Kt::kConsumers) fb_all[i] = 0.f;
  }
}

// Masks the thread's scores of keys past the request's length or, causal, past each row's diagonal with `value`.
template <class Kt>
__device__ __forceinline__ void mask_scores(const PrefillParams& p, const MaskRows& mr, int key0,
                                            float (&sc)[Kt::kSRegs], float value) {
#pragma unroll
  for (int j = 0; j < Kt::kBN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = key0 + 8 * j + 2 * mr.c + (e & 1);
      const int qi = mr.i_lo + 8 * (e >> 1);
      if (!(key < mr.kv_len && (!p.causal || key <= qi + mr.diag))) sc[4 * j + e] = value;
    }
  }
}

// The maxima of the thread's two rows over the quad's columns (the scores as float, or as the int32 bit patterns
// of the MMA's integer S), as 4 independent chains per row, then a tree: one running chain would be 32 dependent
// max operations per row, and the consumer warps are latency-bound.
template <typename T>
__device__ __forceinline__ T score_as(float x) {
  if constexpr (std::is_same<T, int>::value) return __float_as_int(x);
  else return x;
}
template <class Kt, typename T>
__device__ __forceinline__ void row_maxima(const float (&sc)[Kt::kSRegs], T lowest, T (&mx)[2]) {
  T mp[2][4];
#pragma unroll
  for (int k = 0; k < 8; ++k) mp[k / 4][k % 4] = lowest;
#pragma unroll
  for (int i = 0; i < Kt::kSRegs; ++i)
    mp[(i >> 1) & 1][(i >> 2) & 3] = max(mp[(i >> 1) & 1][(i >> 2) & 3], score_as<T>(sc[i]));
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    T m = max(max(mp[h][0], mp[h][1]), max(mp[h][2], mp[h][3]));
    m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
    mx[h] = max(m, __shfl_xor_sync(0xffffffffu, m, 2));
  }
}

// The row maxima and their bookkeeping, once the tile's maxima mx (scaled scores) are known: m_run advances,
// corr rescales l_run (and O, by the caller). Returns the reference the tile's exponents subtract (m_run, or 0
// while every score so far is masked).
template <class Kt>
__device__ __forceinline__ float advance_max(SoftmaxRows<Kt>& st, float (&corr)[2], int h, float mx) {
  const float m_new = fmaxf(st.m_run[h], mx);
  const float m_ref = m_new == -CUDART_INF_F ? 0.f : m_new;
  corr[h] = mpfa::ex2(st.m_run[h] - m_ref);            // 0 while m_run was -inf (o, l are 0 then)
  st.base[h] = Kt::kQuant ? m_ref - Kt::kLog2P : m_ref;
  st.m_run[h] = m_new;
  st.l_run[h] *= corr[h];
  return m_ref;
}

// Phase 1 of a kTileScale tile without compensation: the maxima T on the integer scores (IMNMX; masked
// scores INT_MIN), m_tile = a * T, then every score becomes x = kRoundMagic + (S - T) with one IADD (masked
// ones, then negative, -inf) and c[h] = (m_tile - m_run + kLog2P) - kRoundMagic * a. When this tile holds the
// row's maximum, m_tile - m_run is 0 and c = kLog2P - kRoundMagic * a exactly (a has 22 significant bits, so
// kRoundMagic * a = 3 * 2^22 * a is a float; kLog2P = 8 is a multiple of its ulp), and the maximum's exp2
// argument fma(kRoundMagic, a, c) is kLog2P exactly: P and l agree on the row's largest term as the
// reference's do. (Taking the maxima on kRoundMagic + S instead leaves c = kLog2P - x_max * a rounded to the
// ulp of kRoundMagic * a, ~a, and a row dominated by one key off by that: 3.4e-3 rel-L2 on the H200 tests.)
template <class Kt>
__device__ __forceinline__ void softmax_max_raw(const PrefillParams& p, float (&sc)[Kt::kSRegs],
                                                SoftmaxRows<Kt>& st, float (&corr)[2], bool need_mask, int key0,
                                                const MaskRows& mr) {
  constexpr int kMasked = INT_MIN;
  if (need_mask) mask_scores<Kt>(p, mr, key0, sc, __int_as_float(kMasked));
  int row_max[2];
  row_maxima<Kt>(sc, kMasked, row_max);
  // A NaN scale (a non-finite key in the tile) reaches the rows that see a key of the tile through c (NaN),
  // not through a: fma(-inf, NaN, c) would be NaN for the masked scores of rows that see none.
  const bool a_nan = isnan(st.a);
  if (a_nan) st.a = 1.f;
  uint32_t off[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int mx = row_max[h];
    const float m_tile = mx == kMasked ? -CUDART_INF_F : a_nan ? CUDART_NAN_F : __int2float_rn(mx) * st.a;   // exact int
    const float m_ref = advance_max<Kt>(st, corr, h, m_tile);
    st.c[h] = __fsub_rn(__fadd_rn(m_tile - m_ref, Kt::kLog2P), __fmul_rn(mpfa::kRoundMagic, st.a));
    off[h] = mpfa::kRoundMagicBits - uint32_t(mx);   // a row with every key masked: re-masked below
  }
#pragma unroll
  for (int i = 0; i < Kt::kSRegs; ++i) sc[i] = __uint_as_float(__float_as_uint(sc[i]) + off[(i >> 1) & 1]);
  // A masked score became kMasked + off: a negative float (unmasked ones are near +kRoundMagic).
  if (need_mask) {
#pragma unroll
    for (int i = 0; i < Kt::kSRegs; ++i) sc[i] = __float_as_int(sc[i]) < 0 ? -CUDART_INF_F : sc[i];
  }
}

// Phase 1 for the tile of keys key0.. in ring stage s (its fa / fb vectors); sq: the Q tile's scale; score_scale
// (bf16): sm_scale * log2(e).
template <class Kt>
__device__ __forceinline__ void softmax_max(const PrefillParams& p, float score_scale, float (&sc)[Kt::kSRegs],
                                            SoftmaxRows<Kt>& st, float (&corr)[2], const uint8_t* smem, int s,
                                            int key0, const MaskRows& mr, float sq) {
  const int c = mr.c;
  const bool need_mask =
      key0 + Kt::kBN > mr.kv_len || (p.causal && key0 + Kt::kBN - 1 > mr.wg_first_row + mr.diag);
  const float* fa = reinterpret_cast<const float*>(smem + Kt::kOffFa + s * Kt::kFac);
  const float* fb = reinterpret_cast<const float*>(smem + Kt::kOffFb + s * Kt::kFac);
  if constexpr (Kt::kUniformK) {
    // One scale for the whole tile (kv_pack wrote s_T * score_scale as every key's fa), rounded to 22
    // significant bits (a relative change below 2^-22) for softmax_max_raw's exact maximum. A zero Q tile
    // takes the smallest normal instead: masked -inf must stay -inf (-inf * 0 is NaN).
    const float a = fa[0] * sq;
    st.a = __uint_as_float(__float_as_uint(a == 0.f ? __int_as_float(0x00800000) : a) & ~3u);
    st.raw = Kt::kCompMma || p.fb == nullptr;   // comp_mma: the MMA added each key's term, or there is none
    if (st.raw_tile()) {
      softmax_max_raw<Kt>(p, sc, st, corr, need_mask, key0, mr);
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < Kt::kBN / 8; ++j) {
    if constexpr (Kt::kQuant) {
      float2 a2, b2;   // b2: zeros without compensation
      // one 16-byte load serves groups j and j + 1
      const int at = (j >> 1) * 16 + 4 * c;   // = fac_pos(8 * (j & ~1) + 2 * c), c < 4 known here
      const float4 b4 = *reinterpret_cast<const float4*>(fb + at);
      b2 = (j & 1) ? make_float2(b4.z, b4.w) : make_float2(b4.x, b4.y);
      if constexpr (!Kt::kUniformK) {
        const float4 a4 = *reinterpret_cast<const float4*>(fa + at);
        a2 = (j & 1) ? make_float2(a4.z, a4.w) : make_float2(a4.x, a4.y);
      }
      if constexpr (Kt::kUniformK) {
        a2 = make_float2(st.a, st.a);
      } else {
        a2.x *= sq; a2.y *= sq;
      }
      // S is int32 (|S| <= 128 * 127^2 < 2^22): the float with bits kRoundMagicBits + S is kRoundMagic + S
      // exactly (one IADD on the integer pipe; I2F would run on the XU pipe, 16 a clock per SM, beside the
      // softmax's MUFU.EX2), and the key's offset absorbs -kRoundMagic * a (one FFMA per key, not per score).
      // That offset's rounding errs by at most one integer unit of S (times a), far below the INT8
      // products' own rounding; subtracting kRoundMagic exactly instead costs an FADD per score (32 more
      // instructions per tile and thread than the FFMA per key).
      b2.x = fmaf(-mpfa::kRoundMagic, a2.x, b2.x);
      b2.y = fmaf(-mpfa::kRoundMagic, a2.y, b2.y);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = __uint_as_float(__float_as_uint(sc[4 * j + e]) + mpfa::kRoundMagicBits);
        sc[4 * j + e] = fmaf(x, (e & 1) ? a2.y : a2.x, (e & 1) ? b2.y : b2.x);
      }
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[4 * j + e] *= score_scale;
    }
  }
  // Only the tiles on the diagonal or past the length pay for the mask (a branch, not predication:
  // the mask's compares and selects would double the softmax's instructions if run on every tile).
  if (need_mask) mask_scores<Kt>(p, mr, key0, sc, -CUDART_INF_F);
  float row_max[2];
  row_maxima<Kt>(sc, -CUDART_INF_F, row_max);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    advance_max<Kt>(st, corr, h, row_max[h]);
  }
}

// Phase 2: sc becomes P (fp32, scaled by 2^kLog2P for FP8); l_run sums it. kRaw: the x of a kTileScale tile
// (softmax_max_raw).
template <class Kt, bool kRaw>
__device__ __forceinline__ void softmax_exp_scores(float (&sc)[Kt::kSRegs], SoftmaxRows<Kt>& st) {
  float lp[2][4];   // 4 independent sums per row, as for the maxima
#pragma unroll
  for (int k = 0; k < 8; ++k) lp[k / 4][k % 4] = 0.f;
#pragma unroll
  for (int i = 0; i < Kt::kSRegs; ++i) {
    const float x = kRaw ? fmaf(sc[i], st.a, st.c[(i >> 1) & 1]) : sc[i] - st.base[(i >> 1) & 1];
    const float pr = mpfa::ex2(x);
    lp[(i >> 1) & 1][(i >> 2) & 3] += pr;
    sc[i] = pr;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) st.l_run[h] += (lp[h][0] + lp[h][1]) + (lp[h][2] + lp[h][3]);
}

template <class Kt>
__device__ __forceinline__ void softmax_exp(float (&sc)[Kt::kSRegs], SoftmaxRows<Kt>& st) {
  if (st.raw_tile()) softmax_exp_scores<Kt, true>(sc, st);
  else softmax_exp_scores<Kt, false>(sc, st);
}

// P -> the PV MMA's A fragments. FP8: the accumulator -> A-fragment mismatch (a thread holds keys 2c, 2c+1,
// 8+2c, 9+2c of each 16, the e4m3 A fragment wants 4c..4c+3) is absorbed by the key permutation of the V^T
// image (prepass_kv_pack.cuh kv_key), so P packs with no shuffles.
template <class Kt>
__device__ __forceinline__ void pack_p(const float (&sc)[Kt::kSRegs], uint32_t (&pa)[Kt::kPK][4]) {
#pragma unroll
  for (int kk = 0; kk < Kt::kPK; ++kk) {
    if constexpr (Kt::kQuant) {
      const float* s0 = sc + 16 * kk;   // groups 4kk .. 4kk+3
      pa[kk][0] = pack_e4m3x4(s0[0], s0[1], s0[4], s0[5]);
      pa[kk][1] = pack_e4m3x4(s0[2], s0[3], s0[6], s0[7]);
      pa[kk][2] = pack_e4m3x4(s0[8], s0[9], s0[12], s0[13]);
      pa[kk][3] = pack_e4m3x4(s0[10], s0[11], s0[14], s0[15]);
    } else {
      const float* s0 = sc + 8 * kk;    // groups 2kk, 2kk+1
      pa[kk][0] = mpfa::pack_bf16x2(s0[0], s0[1]);
      pa[kk][1] = mpfa::pack_bf16x2(s0[2], s0[3]);
      pa[kk][2] = mpfa::pack_bf16x2(s0[4], s0[5]);
      pa[kk][3] = mpfa::pack_bf16x2(s0[6], s0[7]);
    }
  }
}

// O of the thread's rows times the rows' correction factors.
template <class Kt>
__device__ __forceinline__ void scale_o(float (&o_acc)[Kt::kORegs], const float (&corr)[2]) {
#pragma unroll
  for (int j = 0; j < Kt::kHeadDim / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) { o_acc[4 * j + 2 * h] *= corr[h]; o_acc[4 * j + 2 * h + 1] *= corr[h]; }
  }
}

}  // namespace
