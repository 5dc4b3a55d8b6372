// Pre-pass: the paged cache -> MMA-ready tile images in the workspace, one block per (KV tile part, KV head):
//   K: kBN keys x D, INT8 (quantized recipes) or bf16, K-major, swizzled exactly as the main kernel's shared
//     memory; qk4pv8's row becomes one INT8 row: the low-frequency channels' bytes as they are, each INT4
//     nibble q times its block's integer scale b (an INT8 value by construction, recipes/int8.py i4rs_to_int8);
//   V^T: D x kBN, keys contiguous and permuted for the FP8 P fragment (kv_key); qk4pv4's 4-bit V becomes the
//     E4M3 V the other quantized recipes store (stage_v_u4h), so the main loop is theirs;
//   fa_j = k_scale_j * sm_scale * log2 e (quantized recipes) and, with compensation,
//   fb[hq]_j = (mu_Q[hq] . Kint_j) * k_scale_j * sm_scale * log2 e (Kint_j the INT8 row), at fac_pos(j); zeros
//   past the request's length. kTileScale builds: the tile's largest token scale s_T in place of every
//   k_scale_j, and Kint_j requantized to it; kCompMma launches with compensation: instead of fb, the digits of
//   (mu_Q[hq] . Kint_j) / sq (sq the request's Q scale of head hq, kernel_traits.cuh head_q_scale) per (tile, query
//   head).
// Why images: the 4-bit K -> INT8 expansion and the V transpose run once per (key, KV head) instead of
// once per (query tile, query head) that reads the key, the main loop's loads become a few bulk copies,
// and no conversion sits on the MMA warps' critical path. The pass costs (read compressed + write ~2 bytes
// per element) / HBM bandwidth, under 1% of the attention time at the shapes this kernel is for.
//
// The tile is staged in shared memory as MMA elements (K rows padded by 16 bytes so that the row-per-thread
// reads of the compensation dot product are conflict-free) and raw V rows, then written out in image order
// (consecutive threads write consecutive 16-byte chunks).
#pragma once
#include <cuda_fp16.h>
#include <cstdint>
#include "mpfa/quant.cuh"
#include "mpfa/wgmma.cuh"
#include "mpfa/prefill/kernel_traits.cuh"
#include "mpfa/prefill/params.cuh"
#include "mpfa/prefill/tile_scheduler.cuh"

namespace {

// Position q (0..kBN-1) of the FP8 V^T tile's reduction dimension holds key kv_key(q): inside each 16,
// q = 4c + e holds key 2c + e (e < 2) or 8 + 2c + e - 2 (e >= 2), matching the keys a thread holds in
// the S accumulator (columns 2c, 2c+1 of two consecutive 8-column groups).
template <class Kt>
__device__ __forceinline__ int kv_key(int q) {
  if constexpr (Kt::kQuant) {
    const int r = q & 15, c = r >> 2, e = r & 3;
    return (q & ~15) | (e < 2 ? 2 * c + e : 8 + 2 * c + e - 2);
  } else {
    return q;
  }
}

// 16 channels of INT4 K (8 bytes of 4-bit two's-complement nibbles, element 2i in the low nibble of byte i;
// one unsigned integer block scale b in 1..18) -> 16 int8 bytes b * q, exactly (|b * q| <= 126).
__device__ __forceinline__ uint4 k4_block_to_s8(uint2 packed, uint32_t b) {
  uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const uint32_t word = k < 8 ? packed.x : packed.y;
    const int q = static_cast<int>(word << (28 - 4 * (k % 8))) >> 28;   // sign-extended nibble
    w[k / 4] |= (static_cast<uint32_t>(q * static_cast<int>(b)) & 0xFFu) << (8 * (k % 4));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// kCompMma: key `key`'s row of a digit image (32-byte swizzle): the term c (|c| <= kCompDigitLimit, in units
// of the INT8 QK product) as python/mpfa/recipes/int8.py compensation_digits writes it: e_0 = c - 127 hi for
// hi = floor((c + 63) / 127), then |hi| as whole 127s and a remainder, with hi's sign.
template <class Kt>
__device__ __forceinline__ void write_digits(uint8_t* img, int key, int c) {
  const int hi = (c + 63 >= 0 ? c + 63 : c + 63 - 126) / 127;   // floor division
  const int m = abs(hi), sign = hi < 0 ? -1 : 1;
  uint32_t w[Kt::kCdRow / 4];
#pragma unroll
  for (int q = 0; q < Kt::kCdRow / 4; ++q) {
    uint32_t word = 0u;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int k = 4 * q + e;
      const int v = k == 0 ? c - 127 * hi : sign * min(max(m - 127 * (k - 1), 0), 127);
      word |= (static_cast<uint32_t>(v) & 0xFFu) << (8 * e);
    }
    w[q] = word;
  }
#pragma unroll
  for (int c16 = 0; c16 < Kt::kCdRow / 16; ++c16)
    *reinterpret_cast<uint4*>(img + mpfa::wg::swizzle<Kt::kCdRow>(key * Kt::kCdRow + 16 * c16)) =
        make_uint4(w[4 * c16], w[4 * c16 + 1], w[4 * c16 + 2], w[4 * c16 + 3]);
}

// qk4pv4: the block's staged V rows as E4M3 (stride kHeadDim bytes), from the 4-bit codes, as
// python/mpfa/recipes/u4h.py prefill_image: x = q * scale + zero (one fmaf, in the rotated space), times the
// correctly rounded 1 / v_scale of its channel (v_scale of the rotated V), rounded to E4M3 with saturation.
// Thread tid converts 16 channels (c16 = tid % (D / 16): one constant set of 1 / v_scale) of every
// kPackThreads / (D / 16)-th key; keys at or past `valid` stage zeros.
template <class Kt, class RowOf>
__device__ __forceinline__ void stage_v_u4h(const PrefillParams& p, int hk, int valid, RowOf row_of, uint8_t* st_v) {
  constexpr int kChunks = Kt::kHeadDim / 16;
  static_assert(Kt::kPackThreads % kChunks == 0, "a thread's chunk is the same for all its keys");
  static_assert(Kt::Layout::kV4Group % 16 == 0, "a chunk's channels share one scale and zero point");
  const int c16 = int(threadIdx.x) % kChunks;
  float inv_vs[16];
#pragma unroll
  for (int e = 0; e < 16; e += 4) {
    const float4 vs = *reinterpret_cast<const float4*>(p.v_scale + hk * Kt::kHeadDim + 16 * c16 + e);
    inv_vs[e] = __frcp_rn(vs.x); inv_vs[e + 1] = __frcp_rn(vs.y);
    inv_vs[e + 2] = __frcp_rn(vs.z); inv_vs[e + 3] = __frcp_rn(vs.w);
  }
  for (int key = int(threadIdx.x) / kChunks; key < Kt::kPackKeys; key += Kt::kPackThreads / kChunks) {
    uint32_t w[4] = {0u, 0u, 0u, 0u};
    if (key < valid) {
      const int64_t row = row_of(key);
      const uint2 codes = *reinterpret_cast<const uint2*>(p.v + row * Kt::kVRow + 8 * c16);   // channel 2i: low nibble
      const __half2 param = *reinterpret_cast<const __half2*>(p.v_param + row * Kt::kVpRow +
                                                              4 * (16 * c16 / Kt::Layout::kV4Group));
      const float scale = __low2float(param), zero = __high2float(param);
#pragma unroll
      for (int e = 0; e < 16; e += 2) {
        const uint32_t word = e < 8 ? codes.x : codes.y;
        const float q0 = float((word >> (4 * (e % 8))) & 0xFu), q1 = float((word >> (4 * (e % 8) + 4)) & 0xFu);
        const uint32_t pair = mpfa::to_e4m3x2(__fmul_rn(__fmaf_rn(q0, scale, zero), inv_vs[e]),
                                              __fmul_rn(__fmaf_rn(q1, scale, zero), inv_vs[e + 1]));
        w[e / 4] |= pair << (16 * ((e / 2) % 2));
      }
    }
    *reinterpret_cast<uint4*>(st_v + key * Kt::kHeadDim + 16 * c16) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

template <class Cfg>
__global__ void __launch_bounds__(PrefillTraits<Cfg>::kPackThreads)
    kv_pack_kernel(const PrefillParams p, float score_scale) {
  using Kt = PrefillTraits<Cfg>;
  // The block's kPackKeys keys (kernel_traits.cuh) staged: K rows padded to kStRow bytes, V rows (the cache's,
  // or qk4pv4's as E4M3: kStVRow bytes), K scales.
  constexpr int kStRow = Kt::kQKRow + 16;
  constexpr int kStVRow = Kt::Layout::kV4 ? Kt::kHeadDim : Kt::kVRow;
  constexpr int kPackOffK = 0;
  constexpr int kPackOffV = kPackOffK + Kt::kPackKeys * kStRow;
  constexpr int kPackOffKs = kPackOffV + Kt::kPackKeys * kStVRow;
  constexpr int kPackSmem = kPackOffKs + Kt::kPackKeys * 4;
  __shared__ __align__(16) uint8_t st[kPackSmem];
  float* ks = reinterpret_cast<float*>(st + kPackOffKs);
  const int i = blockIdx.x / Kt::kPackParts, part = blockIdx.x % Kt::kPackParts;
  const int hk = blockIdx.y, tid = threadIdx.x;
  const int b = p.kvt_req[i], t = p.kvt_idx[i];
  int page_begin;
  const int kv_len = kv_length<Kt>(p, b, &page_begin);
  const int key0 = part * Kt::kPackKeys;                 // first key of the tile this block stages
  const int valid = min(Kt::kPackKeys, kv_len - t * Kt::kBN - key0);
  const int64_t img = int64_t(i) * p.num_kv_heads + hk;
  auto row_of = [&](int key) -> int64_t {   // (page, head, slot) row of the staged key `key`
    const int j = t * Kt::kBN + key0 + key;
    const int64_t page = p.indices[page_begin + j / Kt::kPageSize];
    return (page * p.num_kv_heads + hk) * Kt::kPageSize + (j % Kt::kPageSize);
  };

  constexpr int kKUnits = Kt::kPackKeys * (Kt::kQKRow / 16);
  for (int u = tid; u < kKUnits; u += Kt::kPackThreads) {
    const int key = u / (Kt::kQKRow / 16), c16 = u % (Kt::kQKRow / 16);
    uint4 w = make_uint4(0u, 0u, 0u, 0u);
    if (key < valid) {
      const int64_t row = row_of(key);
      if constexpr (Kt::Layout::kSplitK) {
        // 16 channels from one side: the low-frequency ones (c mod D/2 >= D/4) are INT8 bytes already
        const int idx = mpfa::split_k_index<Kt::kHeadDim>(16 * c16);   // within its half
        if (mpfa::split_k_low<Kt::kHeadDim>(16 * c16))
          w = *reinterpret_cast<const uint4*>(p.k8 + row * Kt::kK8Row + idx);
        else
          w = k4_block_to_s8(*reinterpret_cast<const uint2*>(p.k + row * Kt::kKRow + idx / 2),
                             uint32_t(p.k_block_scale[row * Kt::kBsRow + idx / 16]));
      } else {
        w = *reinterpret_cast<const uint4*>(p.k + row * Kt::kKRow + 16 * c16);
      }
    }
    *reinterpret_cast<uint4*>(st + kPackOffK + key * kStRow + 16 * c16) = w;
  }
  if constexpr (Kt::Layout::kV4) {
    stage_v_u4h<Kt>(p, hk, valid, row_of, st + kPackOffV);
  } else {
    constexpr int kVUnits = Kt::kPackKeys * (Kt::kVRow / 16);
    for (int u = tid; u < kVUnits; u += Kt::kPackThreads) {
      const int key = u / (Kt::kVRow / 16), c16 = u % (Kt::kVRow / 16);
      uint4 w = make_uint4(0u, 0u, 0u, 0u);
      if (key < valid) w = *reinterpret_cast<const uint4*>(p.v + row_of(key) * Kt::kVRow + 16 * c16);
      *reinterpret_cast<uint4*>(st + kPackOffV + key * Kt::kVRow + 16 * c16) = w;
    }
  }
  if (Kt::kQuant && tid < Kt::kPackKeys) ks[tid] = tid < valid ? p.k_scale[row_of(tid)] : 0.f;
  __syncthreads();
  // kTileScale: the staged INT8 rows requantized to the tile's largest token scale s_T, byte for byte as
  // python/mpfa/recipes/int8.py requantize_k_tile (rni(k * (s_j / s_T))); a non-finite key (NaN scale) makes
  // s_T, and so its whole tile, NaN.
  __shared__ float tile_scale;
  constexpr bool uniform = Kt::kUniformK;
  if constexpr (uniform) {
    if (tid < 32) {
      float m = 0.f;
      for (int k = tid; k < Kt::kPackKeys; k += 32) m = mpfa::max_nan(m, ks[k]);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) m = mpfa::max_nan(m, __shfl_xor_sync(0xffffffffu, m, off));
      if (tid == 0) tile_scale = m;
    }
    __syncthreads();
    const float s_t = tile_scale;
    for (int u = tid; u < Kt::kPackKeys * (Kt::kQKRow / 4); u += Kt::kPackThreads) {
      const int key = u / (Kt::kQKRow / 4), c4 = u % (Kt::kQKRow / 4);
      uint32_t* wp = reinterpret_cast<uint32_t*>(st + kPackOffK + key * kStRow + 4 * c4);
      const uint32_t w = *wp;
      const float r = s_t == 0.f ? 0.f : __fdiv_rn(ks[key], s_t);   // <= 1 (NaN with s_T): no clamp needed
      float y[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) y[e] = __fmul_rn(static_cast<float>(static_cast<int8_t>(w >> (8 * e))), r);
      *wp = mpfa::pack_s8x4(y[0], y[1], y[2], y[3]);
    }
    __syncthreads();
  }

  // K image: image chunk o holds (row, column) = swizzle(o) of its column block (an involution; the
  // swizzle stays inside a row, so this block's keys are kPackKeys whole rows of each column block).
  uint8_t* kimg = p.k_img + img * Kt::kImgK;
  constexpr int kRowChunks = Kt::kPackKeys * Kt::kW / 16;    // 16-byte chunks of this block's rows in one column block
  for (int u = tid; u < (Kt::kQKRow / Kt::kW) * kRowChunks; u += Kt::kPackThreads) {
    const int cb = u / kRowChunks;
    const int o = cb * (Kt::kBN * Kt::kW) + key0 * Kt::kW + 16 * (u % kRowChunks);
    const int l = mpfa::wg::swizzle<Kt::kW>(o % (Kt::kBN * Kt::kW));
    const int key = l / Kt::kW - key0, col = cb * Kt::kW + l % Kt::kW;
    *reinterpret_cast<uint4*>(kimg + o) = *reinterpret_cast<const uint4*>(st + kPackOffK + key * kStRow + col);
  }
  // V^T image (channels x keys), keys permuted by kv_key for FP8.
  uint8_t* vimg = p.v_img + img * Kt::kImgV;
  const uint8_t* rawv = st + kPackOffV;
  if constexpr (Kt::kQuant) {
    constexpr int kUnits = (Kt::kHeadDim / 4) * (Kt::kBN / 16);   // 4 channels x 16 positions
    for (int u = tid; u < kUnits; u += Kt::kPackThreads) {
      const int d0 = 4 * (u % (Kt::kHeadDim / 4)), blk = u / (Kt::kHeadDim / 4);
      uint32_t w[16];
#pragma unroll
      for (int q = 0; q < 16; ++q)
        w[q] = *reinterpret_cast<const uint32_t*>(rawv + kv_key<Kt>(16 * blk + q) * kStVRow + d0);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        uint32_t o[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const uint32_t t01 = __byte_perm(w[4 * q], w[4 * q + 1], c | ((4 + c) << 4));
          const uint32_t t23 = __byte_perm(w[4 * q + 2], w[4 * q + 3], c | ((4 + c) << 4));
          o[q] = __byte_perm(t01, t23, 0x5410);
        }
        *reinterpret_cast<uint4*>(vimg + mpfa::wg::tile_offset<128>(d0 + c, 16 * blk, Kt::kHeadDim)) =
            make_uint4(o[0], o[1], o[2], o[3]);
      }
    }
  } else {
    constexpr int kUnits = (Kt::kHeadDim / 2) * (Kt::kPackKeys / 8);    // 2 channels x 8 keys
    for (int u = tid; u < kUnits; u += Kt::kPackThreads) {
      const int d0 = 2 * (u % (Kt::kHeadDim / 2)), blk = u / (Kt::kHeadDim / 2);   // 8-key group of the staged keys
      uint32_t w[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) w[q] = *reinterpret_cast<const uint32_t*>(rawv + (8 * blk + q) * kStVRow + 2 * d0);
      uint32_t lo[4], hi[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        lo[q] = __byte_perm(w[2 * q], w[2 * q + 1], 0x5410);
        hi[q] = __byte_perm(w[2 * q], w[2 * q + 1], 0x7632);
      }
      const int col = 2 * key0 + 16 * blk;                // byte column of the V^T row (2 bytes a key)
      *reinterpret_cast<uint4*>(vimg + mpfa::wg::tile_offset<128>(d0, col, Kt::kHeadDim)) =
          make_uint4(lo[0], lo[1], lo[2], lo[3]);
      *reinterpret_cast<uint4*>(vimg + mpfa::wg::tile_offset<128>(d0 + 1, col, Kt::kHeadDim)) =
          make_uint4(hi[0], hi[1], hi[2], hi[3]);
    }
  }
  if constexpr (Kt::kQuant) {
    if (tid < Kt::kBN) p.fa[img * Kt::kBN + fac_pos(tid)] = (uniform ? tile_scale : ks[tid]) * score_scale;
    // Compensation: fb[hq]_j = (mu_Q[hq] . Kint_j) * k_scale_j * score_scale for the group's heads.
    if (p.fb != nullptr || comp_digits<Kt>(p)) {
      const int key = tid % Kt::kBN;
      const int group = p.num_qo_heads / p.num_kv_heads;
      const uint8_t* krow = st + kPackOffK + key * kStRow;
      for (int gi = tid / Kt::kBN; gi < group; gi += Kt::kPackThreads / Kt::kBN) {
        const int hq = hk * group + gi;
        const float* m = p.mu + (int64_t(b) * p.num_qo_heads + hq) * Kt::kHeadDim;
        float dot = 0.f;
#pragma unroll 2
        for (int c16 = 0; c16 < Kt::kHeadDim / 16; ++c16) {
          const uint4 w4 = *reinterpret_cast<const uint4*>(krow + 16 * c16);
          const uint32_t w[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const float* mc = m + 16 * c16 + 4 * q;
#pragma unroll
            for (int e = 0; e < 4; ++e)   // int8 -> float is exact
              dot = fmaf(mc[e], static_cast<float>(static_cast<int8_t>(w[q] >> (8 * e))), dot);
          }
        }
        if (comp_digits<Kt>(p)) {   // the digits instead of fb (the main kernel reads one or the other); a NaN scale
          // (non-finite Q) leaves the digits unspecified: its rows are NaN anyway
          const float c = __fdiv_rn(dot, head_q_scale<Kt>(p, b, hq));
          write_digits<Kt>(p.cd_img + (int64_t(i) * p.num_qo_heads + hq) * Kt::kImgCd, key,
                           isnan(c) ? 0 : __float2int_rn(c));
        } else {
          p.fb[(int64_t(i) * p.num_qo_heads + hq) * Kt::kBN + fac_pos(key)] =
              dot * (uniform ? tile_scale : ks[key]) * score_scale;
        }
      }
    }
  }
}

}  // namespace
