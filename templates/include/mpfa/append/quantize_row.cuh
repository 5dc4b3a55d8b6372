// One thread's 8 channels of a row, quantized to the recipe's cache fields and stored. Each quantizer
// mirrors python/mpfa/reference/append.py quantize_rows (recipes/fp8.py, recipes/fp4.py) operation for
// operation, so the bytes match the reference.
//
// Non-finite input (the reference defines the same): a K row (after - mu_K) holding a NaN or an infinity
// gets a NaN k_scale, so every value of that key dequantizes to NaN; its E4M3 K bytes are E4M3 NaN, its
// 4-bit codes and block scales are unspecified. A V element that is NaN or infinite is stored as E4M3 NaN;
// finite values saturate at +-448. bf16 fields store the values as given.
#pragma once
#include <cuda_bf16.h>
#include <cstdint>
#include "mpfa/append/params.cuh"
#include "mpfa/append/schedule.cuh"
#include "mpfa/cache_layout.cuh"
#include "mpfa/quant.cuh"

namespace mpfa::append {

// Byte `offset` of row `row` of a cache field whose rows are `row_bytes` long.
template <class T>
__device__ __forceinline__ T* field_at(void* base, int64_t row, int row_bytes, int offset) {
  return reinterpret_cast<T*>(static_cast<uint8_t*>(base) + row * row_bytes + offset);
}

// The thread's fixed per-channel constants of its head: mu_K (quantized K) and 1 / v_scale (quantized V).
template <class L>
struct ChannelConstants {
  float mu[8], inv_vs[8];

  __device__ __forceinline__ ChannelConstants(const float* mu_k, const float* v_scale, int h, int c0) {
    if constexpr (L::kQuantK) load8(mu_k + h * L::kHeadDim + c0, mu);
    if constexpr (L::kQuantV) {
      load8(v_scale + h * L::kHeadDim + c0, inv_vs);
#pragma unroll
      for (int i = 0; i < 8; ++i) inv_vs[i] = __frcp_rn(inv_vs[i]);   // x * (1/scale): the reference's order
    }
  }

  __device__ __forceinline__ static void load8(const float* src, float (&dst)[8]) {
    const float4 a = reinterpret_cast<const float4*>(src)[0], b = reinterpret_cast<const float4*>(src)[1];
    dst[0] = a.x; dst[1] = a.y; dst[2] = a.z; dst[3] = a.w;
    dst[4] = b.x; dst[5] = b.y; dst[6] = b.z; dst[7] = b.w;
  }
};

// Unquantized (bf16) field: the 16 loaded bytes as they are.
template <int RowBytes>
__device__ __forceinline__ void store_bf16(void* field, int64_t row, int c0, uint4 x) {
  *field_at<uint4>(field, row, RowBytes, 2 * c0) = x;
}

// FP8 V with a fixed per-(layer, head, channel) scale, applied to the output after the PV MMA.
template <class L>
__device__ __forceinline__ void store_v_e4m3(void* v_data, int64_t row, int c0, uint4 vr, const float (&inv_vs)[8]) {
  const __nv_bfloat162* vp = reinterpret_cast<const __nv_bfloat162*>(&vr);
  uint2 out;
  uint16_t* o16 = reinterpret_cast<uint16_t*>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 vf = __bfloat1622float2(infinities_to_nan(vp[i]));
    o16[i] = to_e4m3x2(vf.x * inv_vs[2 * i], vf.y * inv_vs[2 * i + 1]);
  }
  *field_at<uint2>(v_data, row, L::v_bytes, c0) = out;
}

// K smoothing: keys are stored as K - mu_K, fixed per (layer, KV head). Returns the 8 channels' max |.|,
// NaN if one of them is NaN (inf if one is infinite).
__device__ __forceinline__ float smooth_k(uint4 kr, const float (&mu)[8], float (&k)[8]) {
  const __nv_bfloat162* kp = reinterpret_cast<const __nv_bfloat162*>(&kr);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 kf = __bfloat1622float2(kp[i]);
    k[2 * i] = kf.x;
    k[2 * i + 1] = kf.y;
  }
  float amax8 = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    k[i] -= mu[i];
    amax8 = max_nan(amax8, fabsf(k[i]));
  }
  return amax8;
}

// Whole-row FP8 K (qk8pv8), one scale per row: the largest |K - mu_K| maps to 448.
template <class S, class L>
__device__ __forceinline__ void store_k_e4m3(const AppendParams& p, bool write, int64_t row, const Lane& me,
                                             const float (&k)[8], float amax8) {
  const float ks = amax_scale_or_nan(group_max<S>(amax8), kE4M3Max);
  const float inv = __frcp_rn(ks);
  if (write) {
    uint2 out;
    uint16_t* o16 = reinterpret_cast<uint16_t*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i) o16[i] = to_e4m3x2(k[2 * i] * inv, k[2 * i + 1] * inv);
    *field_at<uint2>(p.k_data, row, L::k_bytes, me.c0) = out;
    if (me.group_lane == 0) *field_at<float>(p.k_scale, row, L::k_scale_bytes, 0) = ks;
  }
}

// Split K (qk4pv8, recipes/fp4.py quantize_k4rs): one FP32 scale per row (amax -> 6 * 64); the
// low-frequency RoPE half (whole 8-channel chunks: each thread is on one side) as E4M3 of k / ts, the
// other half as E2M1 in blocks of 16 channels (2 threads) with block scales from {2^e, 1.5 * 2^e}.
template <class S, class L>
__device__ __forceinline__ void store_k_split(const AppendParams& p, bool write, int64_t row, const Lane& me,
                                              const float (&k)[8], float amax8, int& parity) {
  constexpr int D = L::kHeadDim;
  const float ts = amax_scale_or_nan(row_amax_across_halves<S>(group_max<S>(amax8), me, parity), kTokenTarget);
  const int idx = k4rs_index<D>(me.c0);   // position within its half's field
  if (me.half == 1) {                     // = k4rs_low<D>(c0), uniform per warp
    const float inv = __frcp_rn(ts);      // x * (1/scale), as quantize_e4m3
    uint2 out;
    uint16_t* o16 = reinterpret_cast<uint16_t*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i) o16[i] = to_e4m3x2(k[2 * i] * inv, k[2 * i + 1] * inv);
    if (write) *field_at<uint2>(p.k8_data, row, L::k8_bytes, idx) = out;
  } else {
    const float block_amax = fmaxf(amax8, __shfl_xor_sync(0xffffffffu, amax8, 1));   // 2 threads = 16 channels
    const float bs = round_up_block_scale(block_amax * __frcp_rn(ts * kE2M1Max));
    const float inv = __frcp_rn(ts * bs);
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) packed |= e2m1_code(k[i] * inv) << (4 * i);
    if (write) {
      *field_at<uint32_t>(p.k_data, row, L::k_bytes, idx / 2) = packed;   // 2 channels a byte
      constexpr int kScales = D / 32;   // in use; the field is padded to L::k_block_scale_bytes
      if (idx % 16 == 0) *field_at<uint8_t>(p.k_block_scale, row, L::k_block_scale_bytes, idx / 16) = to_e4m3(bs);
      // the padding (head_dim 64: 2 scales in a 4-byte field) is written too: every byte of a slot is defined
#pragma unroll
      for (int b = kScales; b < L::k_block_scale_bytes; ++b)
        if (idx == 0) *field_at<uint8_t>(p.k_block_scale, row, L::k_block_scale_bytes, b) = 0;
    }
  }
  if (write && me.group_lane == 0 && me.half == 0) *field_at<float>(p.k_scale, row, L::k_scale_bytes, 0) = ts;
}

}  // namespace mpfa::append
