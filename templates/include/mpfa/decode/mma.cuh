// The two tensor-core products of a decode tile, run "swapped" (mma.sync m16n8k16 with the G <= 8
// query heads as N = 8, so no row is padding), and the register fragments they take:
//   S^T = K Q^T: A = 16 tokens x 16 dims of K (rows g -> token tA(g) = 4(g/2) + g%2, rows g+8 ->
//     tA(g) + 2), B = Q^T held in registers for the whole kernel. The reduction (head_dim) is permuted
//     so each thread's K operand is a contiguous quarter of the row (one 16-byte shared load).
//     Quantized K is dequantized in registers to fp16 *without* its per-token scale: the integers
//     themselves (exact: INT8, or INT4 q times its integer block scale b, |b q| <= 126); the token
//     scale, sm_scale and log2(e) multiply the score rows afterwards (softmax.cuh).
//   O^T += V^T P^T: B = P^T, the S^T accumulator packed to fp16 (bf16 for the bf16 recipe) and
//     transposed per 8x8 half with movmatrix; A = V^T (e4m3 -> fp16 exact, qk4pv4's 4-bit codes -> fp16
//     q * scale + zero, or bf16): thread (g, c) reads token rows 4c..4c+3 and channels [g*D/8, (g+1)*D/8)
//     and pairs bytes of two rows with prmt. E4M3 V's per-channel scale multiplies O at the end
//     (epilogue.cuh); qk4pv4's output stays in the rotated space (O H: the wrapper rotates it back).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include "mpfa/decode/params.cuh"
#include "mpfa/decode/traits.cuh"
#include "mpfa/mma_frag.cuh"

namespace {

// B bytes (16, 8 or 4) of shared memory as 32-bit words.
template <int B>
__device__ __forceinline__ void load_words(const uint8_t* src, uint32_t (&w)[B / 4]) {
  if constexpr (B == 16) {
    const uint4 t = *reinterpret_cast<const uint4*>(src);
    w[0] = t.x; w[1] = t.y; w[2] = t.z; w[3] = t.w;
  } else if constexpr (B == 8) {
    const uint2 t = *reinterpret_cast<const uint2*>(src);
    w[0] = t.x; w[1] = t.y;
  } else {
    static_assert(B == 4, "4, 8 or 16 bytes");
    w[0] = *reinterpret_cast<const uint32_t*>(src);
  }
}

// Physical channel of the thread's local K dim l (quad lane c).
template <class Cfg>
__device__ __forceinline__ int k_dim(int c, int l) {
  using T = DecodeTraits<Cfg>;
  using Layout = typename T::Layout;
  if constexpr (Layout::kSplitK) {
    // local dims [0, kK8B): k8 byte c kK8B + l (a low-frequency channel); then kK8B nibble channels
    constexpr int kHalf = T::kHeadDim / 2, kQuarter = T::kHeadDim / 4;
    const int low = l < T::kK8B;
    const int idx = c * T::kK8B + (low ? l : l - T::kK8B);                 // position within its half
    return (idx / kQuarter) * kHalf + (low ? kQuarter : 0) + idx % kQuarter;
  } else {
    return (c + 4 * (l / T::kKChunkDims)) * T::kKChunkDims + (l % T::kKChunkDims);
  }
}

// Q^T as the QK MMA's B operand: head g (of the CTA's kGroup, zeros past it), this thread's kHeadDim/4
// channels (permuted like K). Returns the factors that undo the power-of-two prescales of the Q of heads 2c and
// 2c + 1 (the thread's columns of S^T) as bf16x2 (head 2c low; exact for powers of two and inf): one register
// through the KV loop, as one shared fp32 factor took (two fp32 factors spill qk4pv8 d128 at the 128-register cap).
template <class Cfg>
__device__ __forceinline__ uint32_t load_q_fragment(const DecodeParams& p, int b, int hq0, int g, int c,
                                                 uint32_t (&qf)[Cfg::kHeadDim / 8]) {
  using T = DecodeTraits<Cfg>;
  using Layout = typename T::Layout;
  constexpr int kHeadDim = T::kHeadDim;
  uint32_t q_unscale = 0x3F803F80u;   // 1.0, 1.0
  uint4 raw[kHeadDim / 32];
#pragma unroll
  for (int v = 0; v < kHeadDim / 32; ++v) {
    raw[v] = make_uint4(0, 0, 0, 0);
    if (g < T::kGroup)
      raw[v] = *reinterpret_cast<const uint4*>(p.q + b * p.q_stride_b + (hq0 + g) * p.q_stride_h +
                                               k_dim<Cfg>(c, 8 * v));
  }
  if constexpr (T::kQuant) {
    float amax = 0.f;
#pragma unroll
    for (int v = 0; v < kHeadDim / 32; ++v) {
      const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw[v]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h2[i]);
        amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
      }
    }
    // One factor per query head, over the quad of lanes 4g..4g+3 that holds its Q: shared by the KV head's
    // heads, one head's outlier (or inf) would scale its siblings' fp16 Q toward zero (or NaN).
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    // fp16 holds bf16 exactly in its normal range; a power of two keeps |Q| <= 2^13, so with the
    // integer K (|K| <= 127) every product stays below 2^20 and a row's score below 2^27.
    const float qs = amax > 8192.f ? exp2f(-ceilf(log2f(amax / 8192.f))) : 1.f;
#pragma unroll
    for (int v = 0; v < kHeadDim / 32; ++v) {
      const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw[v]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        // 4-bit K words come out of the dequant in the channel pairs s4x8_pair_lo/hi; Q follows
        // (qk4pv8: only the nibble dims, local dims kK8B and up).
        const bool nibbles = Layout::kSplitK && 8 * v >= T::kK8B;
        const int lo = nibbles ? mpfa::s4x8_pair_lo(i) : 2 * i;
        const int hi = nibbles ? mpfa::s4x8_pair_hi(i) : 2 * i + 1;
        qf[4 * v + i] = mpfa::pack_f16x2(__bfloat162float(h[lo]) * qs, __bfloat162float(h[hi]) * qs);
      }
    }
    const uint32_t unscale = __float_as_uint(1.f / qs);   // head g's, to the lanes whose columns are head g
    q_unscale = mpfa::prmt(__shfl_sync(0xffffffffu, unscale, 8 * c), __shfl_sync(0xffffffffu, unscale, 8 * c + 4),
                           0x7632);
  } else {
#pragma unroll
    for (int v = 0; v < kHeadDim / 32; ++v) {
      qf[4 * v] = raw[v].x; qf[4 * v + 1] = raw[v].y; qf[4 * v + 2] = raw[v].z; qf[4 * v + 3] = raw[v].w;
    }
  }
  return q_unscale;
}

// S^T = K Q^T for the warp's 16 tokens of stage st: A = K (rows: tokens tA, tA + 2), B = Q^T.
// s (zeroed by the caller): (tA, 2c), (tA, 2c+1), (tA+2, 2c), (tA+2, 2c+1), before any scale.
template <class Cfg>
__device__ __forceinline__ void qk_scores(const uint8_t* st, int wrow, int tA, int c,
                                          const uint32_t (&qf)[Cfg::kHeadDim / 8], float (&s)[4]) {
  using T = DecodeTraits<Cfg>;
  using Layout = typename T::Layout;
  if constexpr (Layout::kWholeK) {
    uint32_t kw[2][T::kKWords];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wrow + tA + 2 * r;
      const uint8_t* krow = st + T::kOffK + row * Layout::k_bytes;
#pragma unroll
      for (int i = 0; i < T::kKB / 16; ++i) {
        const uint4 t = *reinterpret_cast<const uint4*>(krow + (((c + 4 * i) ^ T::k_swizzle(row)) << 4));
        kw[r][4 * i] = t.x; kw[r][4 * i + 1] = t.y; kw[r][4 * i + 2] = t.z; kw[r][4 * i + 3] = t.w;
      }
    }
    if constexpr (!T::kQuant) {
#pragma unroll
      for (int ks = 0; ks < T::kSteps; ++ks)
        mpfa::mma_bf16(s, kw[0][2 * ks], kw[1][2 * ks], kw[0][2 * ks + 1], kw[1][2 * ks + 1], qf[2 * ks],
                       qf[2 * ks + 1]);
    } else {
#pragma unroll
      for (int ks = 0; ks < T::kSteps; ++ks) {
        uint32_t a0, a1, a2, a3;   // INT8 -> fp16: word ks's bytes (0, 1) and (2, 3) of both rows
        mpfa::s8x4_to_f16x2(kw[0][ks], a0, a2);
        mpfa::s8x4_to_f16x2(kw[1][ks], a1, a3);
        mpfa::mma_f16(s, a0, a1, a2, a3, qf[2 * ks], qf[2 * ks + 1]);
      }
    }
  } else {
    // qk4pv8 (i4rs): the thread's kK8B INT8 bytes (the qk8pv8 path), then its kK8B nibbles, all in one
    // block (c * kK8B / 16) whose integer scale b the nibble dequant folds in, so K is exactly b * q.
    uint32_t k8w[2][T::kK8B / 4], k4w[2][T::kK4B / 4], bsm[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wrow + tA + 2 * r;
      load_words<T::kK8B>(st + T::kOffK8 + row * Layout::k8_bytes + c * T::kK8B, k8w[r]);
      load_words<T::kK4B>(st + T::kOffK + row * Layout::k_bytes + c * T::kK4B, k4w[r]);
      bsm[r] = mpfa::i4rs_block_scale_f16x2(st[T::kOffBs + row * Layout::k_block_scale_bytes + c * T::kK8B / 16]);
    }
#pragma unroll
    for (int ks = 0; ks < T::kK8B / 4; ++ks) {
      uint32_t a0, a1, a2, a3;
      mpfa::s8x4_to_f16x2(k8w[0][ks], a0, a2);
      mpfa::s8x4_to_f16x2(k8w[1][ks], a1, a3);
      mpfa::mma_f16(s, a0, a1, a2, a3, qf[2 * ks], qf[2 * ks + 1]);
    }
    constexpr int q0 = T::kK8B / 2;   // Q registers of the nibble dims
#pragma unroll
    for (int w = 0; w < T::kK4B / 4; ++w) {
      uint32_t ka[4], kb[4];
      mpfa::s4x8_to_f16x2_scaled(k4w[0][w], bsm[0], ka);
      mpfa::s4x8_to_f16x2_scaled(k4w[1][w], bsm[1], kb);
      // word w holds nibble dims 8w..8w+7; k-step 2w takes the pairs (0, 4) and (1, 5) of them,
      // k-step 2w+1 the pairs (2, 6) and (3, 7) (Q is packed in the same pairs)
      mpfa::mma_f16(s, ka[0], kb[0], ka[1], kb[1], qf[q0 + 4 * w], qf[q0 + 4 * w + 1]);
      mpfa::mma_f16(s, ka[2], kb[2], ka[3], kb[3], qf[q0 + 4 * w + 2], qf[q0 + 4 * w + 3]);
    }
  }
}

// qk4pv4's O^T += V^T P^T (b0, b1: P^T as pv_accumulate builds it): row r's kVB code bytes (channels
// [g kDV, (g+1) kDV), two a byte) and its group's [scale, zero]; m-tile mt takes code byte mt of the rows,
// channels 2mt (rows g of A) and 2mt + 1 (rows g + 8).
template <class Cfg>
__device__ __forceinline__ void pv_accumulate_u4h(const uint8_t* st, int wrow, int g, int c, uint32_t b0, uint32_t b1,
                                                  float (&acc)[DecodeTraits<Cfg>::kMT][4]) {
  using T = DecodeTraits<Cfg>;
  using Layout = typename T::Layout;
  uint32_t vw[4][T::kVWords], prm[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int row = wrow + 4 * c + r;
    load_words<T::kVB>(st + T::kOffV + ((row * Layout::v_bytes + g * T::kVB) ^ (T::v_swizzle(row) << 4)), vw[r]);
    prm[r] = *reinterpret_cast<const uint32_t*>(st + T::kOffVp + row * Layout::v_param_bytes +
                                                4 * (g * T::kDV / Layout::kV4Group));
  }
  // [scale, zero] of rows (0, 1) and (2, 3) as the f16x2 pairs the A fragments hold
  const uint32_t scale01 = mpfa::prmt(prm[0], prm[1], 0x5410), zero01 = mpfa::prmt(prm[0], prm[1], 0x7632);
  const uint32_t scale23 = mpfa::prmt(prm[2], prm[3], 0x5410), zero23 = mpfa::prmt(prm[2], prm[3], 0x7632);
#pragma unroll
  for (int mt = 0; mt < T::kMT; ++mt) {
    const int w = mt / 4, b = mt % 4;
    constexpr uint32_t kByteOfBoth = 0x4400u;   // prmt selector (+ 0x1111 b): bytes (b, b, 4 + b, 4 + b)
    const uint32_t sel = kByteOfBoth + 0x1111u * uint32_t(b);
    uint32_t a0, a1, a2, a3;
    mpfa::u4x2_rows_to_f16x2(mpfa::prmt(vw[0][w], vw[1][w], sel), scale01, zero01, a0, a1);
    mpfa::u4x2_rows_to_f16x2(mpfa::prmt(vw[2][w], vw[3][w], sel), scale23, zero23, a2, a3);
    mpfa::mma_f16(acc[mt], a0, a1, a2, a3, b0, b1);
  }
}

// O^T += V^T P^T: B = P^T (k = tokens, n = heads) by an 8x8 transpose of each P half; pr as softmax_update
// leaves it (tokens tA, tA + 2 of heads 2c, 2c + 1). g_half = g / 2.
template <class Cfg>
__device__ __forceinline__ void pv_accumulate(const uint8_t* st, int wrow, int g, int g_half, int c,
                                              const float (&pr)[4], float (&acc)[DecodeTraits<Cfg>::kMT][4]) {
  using T = DecodeTraits<Cfg>;
  using Layout = typename T::Layout;
  const uint32_t b0 =
      mpfa::movmatrix_trans(T::kQuant ? mpfa::pack_f16x2(pr[0], pr[1]) : mpfa::pack_bf16x2(pr[0], pr[1]));
  const uint32_t b1 =
      mpfa::movmatrix_trans(T::kQuant ? mpfa::pack_f16x2(pr[2], pr[3]) : mpfa::pack_bf16x2(pr[2], pr[3]));
  // b0: tokens tA(2c) = 4c, tA(2c+1) = 4c+1 of head g; b1: tokens 4c+2, 4c+3. A = V^T: thread (g, c)
  // reads rows 4c..4c+3 of its warp's 16, channels [g*kDV, (g+1)*kDV).
  if constexpr (T::kV4) {
    pv_accumulate_u4h<Cfg>(st, wrow, g, c, b0, b1, acc);
  } else {
    uint32_t vw[4][T::kVWords];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = wrow + 4 * c + r;
      const uint8_t* vrow = st + T::kOffV + row * Layout::v_bytes;
      if constexpr (T::kVB == 8) {
        const int chunk = g_half;
        const uint2 t = *reinterpret_cast<const uint2*>(vrow + ((chunk ^ T::v_swizzle(row)) << 4) + (g & 1) * 8);
        vw[r][0] = t.x; vw[r][1] = t.y;
      } else {
#pragma unroll
        for (int i = 0; i < T::kVB / 16; ++i) {
          const int chunk = g * (T::kVB / 16) + i;
          const uint4 t = *reinterpret_cast<const uint4*>(vrow + ((chunk ^ T::v_swizzle(row)) << 4));
          vw[r][4 * i] = t.x; vw[r][4 * i + 1] = t.y; vw[r][4 * i + 2] = t.z; vw[r][4 * i + 3] = t.w;
        }
      }
    }
    // m-tile mt: A rows g -> channel g*kDV + 2mt, rows g+8 -> channel g*kDV + 2mt + 1.
    if constexpr (T::kQuant) {
#pragma unroll
      for (int w = 0; w < T::kVWords; ++w) {
        // bytes [row0 j, row1 j] for channels j = 4w .. 4w+3
        const uint32_t lo01 = mpfa::prmt(vw[0][w], vw[1][w], 0x5140), hi01 = mpfa::prmt(vw[0][w], vw[1][w], 0x7362);
        const uint32_t lo23 = mpfa::prmt(vw[2][w], vw[3][w], 0x5140), hi23 = mpfa::prmt(vw[2][w], vw[3][w], 0x7362);
        mpfa::mma_f16(acc[2 * w], mpfa::e4m3x2_to_f16x2(lo01), mpfa::e4m3x2_hi_to_f16x2(lo01),
                      mpfa::e4m3x2_to_f16x2(lo23), mpfa::e4m3x2_hi_to_f16x2(lo23), b0, b1);
        mpfa::mma_f16(acc[2 * w + 1], mpfa::e4m3x2_to_f16x2(hi01), mpfa::e4m3x2_hi_to_f16x2(hi01),
                      mpfa::e4m3x2_to_f16x2(hi23), mpfa::e4m3x2_hi_to_f16x2(hi23), b0, b1);
      }
    } else {
#pragma unroll
      for (int w = 0; w < T::kVWords; ++w)
        mpfa::mma_bf16(acc[w], mpfa::prmt(vw[0][w], vw[1][w], 0x5410), mpfa::prmt(vw[0][w], vw[1][w], 0x7632),
                       mpfa::prmt(vw[2][w], vw[3][w], 0x5410), mpfa::prmt(vw[2][w], vw[3][w], 0x7632), b0, b1);
    }
  }
}

}  // namespace
