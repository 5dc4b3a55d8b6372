// The online softmax of the decode kernel, per warp: each warp keeps its own running maximum and sum
// over its 16 tokens of every tile; epilogue.cuh combines the warps. A thread's state covers heads 2c,
// 2c + 1 (maxima reduced over the 8 lanes g that share them). Scores are in base 2: the token scale,
// sm_scale and log2(e) multiply each S^T row here, so each exponential is one MUFU.EX2.
#pragma once
#include <math_constants.h>
#include <cstdint>
#include "mpfa/common.cuh"
#include "mpfa/decode/traits.cuh"

namespace {

// Scales s (score_scale * the token scale of its row * the Q unscale of its column's head, q_unscale: bf16x2 of heads
// 2c, 2c + 1), masks tokens at or past `valid`, updates the running maximum m_run and sum l_run (rescaling acc when
// the maximum moves) and returns the tile's probabilities in pr (same positions as s).
// A head's Q unscale u is a power of two (or inf for an inf Q, whose scores are NaN anyway): x = u x' exactly, with
// x' the score under the row scale alone, so u multiplies the tile's maxima of x' and enters each exponent as an FFMA
// (two FMULs a tile rather than one per score).
template <class Cfg>
__device__ __forceinline__ void softmax_update(const uint8_t* st, int wrow, int tA, int valid, float score_scale,
                                               uint32_t q_unscale, const float (&s)[4], float (&m_run)[2],
                                               float (&l_run)[2], float (&acc)[DecodeTraits<Cfg>::kMT][4],
                                               float (&pr)[4]) {
  using T = DecodeTraits<Cfg>;
  float scA = score_scale, scB = score_scale;
  if constexpr (T::kQuant) {
    scA *= *reinterpret_cast<const float*>(st + T::kOffKs + (wrow + tA) * 4);
    scB *= *reinterpret_cast<const float*>(st + T::kOffKs + (wrow + tA + 2) * 4);
  }
  const float u0 = __uint_as_float(q_unscale << 16), u1 = __uint_as_float(q_unscale & 0xFFFF0000u);
  const bool okA = wrow + tA < valid, okB = wrow + tA + 2 < valid;
  float x[4];   // x': without the column factors u0, u1
  x[0] = okA ? s[0] * scA : -CUDART_INF_F;
  x[1] = okA ? s[1] * scA : -CUDART_INF_F;
  x[2] = okB ? s[2] * scB : -CUDART_INF_F;
  x[3] = okB ? s[3] * scB : -CUDART_INF_F;
  // NaN-propagating maxima: a NaN score (NaN query or key) makes the head's running max NaN, so its output is
  // NaN instead of the "no key" zeros a -inf max would give.
  float mx0 = mpfa::max_nan(x[0], x[2]), mx1 = mpfa::max_nan(x[1], x[3]);
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {   // over the 8 lanes g that share heads 2c, 2c+1
    mx0 = mpfa::max_nan(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
    mx1 = mpfa::max_nan(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
  }
  mx0 *= u0;
  mx1 *= u1;
  const float mn0 = mpfa::max_nan(m_run[0], mx0), mn1 = mpfa::max_nan(m_run[1], mx1);
  const float base0 = mn0 == -CUDART_INF_F ? 0.f : mn0;
  const float base1 = mn1 == -CUDART_INF_F ? 0.f : mn1;
  if (__any_sync(0xffffffffu, mn0 != m_run[0] || mn1 != m_run[1])) {
    const float corr0 = mpfa::ex2(m_run[0] - base0), corr1 = mpfa::ex2(m_run[1] - base1);
    l_run[0] *= corr0;
    l_run[1] *= corr1;
#pragma unroll
    for (int j = 0; j < T::kMT; ++j) {
      acc[j][0] *= corr0; acc[j][1] *= corr1; acc[j][2] *= corr0; acc[j][3] *= corr1;
    }
  }
  m_run[0] = mn0;
  m_run[1] = mn1;
  const float p0 = mpfa::ex2(x[0] * u0 - base0), p1 = mpfa::ex2(x[1] * u1 - base1);
  const float p2 = mpfa::ex2(x[2] * u0 - base0), p3 = mpfa::ex2(x[3] * u1 - base1);
  l_run[0] += p0 + p2;
  l_run[1] += p1 + p3;
  pr[0] = p0; pr[1] = p1; pr[2] = p2; pr[3] = p3;
}

}  // namespace
