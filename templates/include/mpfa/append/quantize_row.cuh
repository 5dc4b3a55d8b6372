// One thread's 8 channels of a row, quantized to the recipe's cache fields and stored. Each quantizer
// mirrors python/mpfa/reference/append.py quantize_rows (recipes/int8.py for K, recipes/fp8.py for V)
// operation for operation, so the bytes match the reference.
//
// Non-finite input (the reference defines the same): a K row (after - mu_K) holding a NaN or an infinity
// gets a NaN k_scale, so every value of that key dequantizes to NaN; its integer K bytes and block scales
// are unspecified. A V element that is NaN or infinite is stored as E4M3 NaN;
// finite values saturate at +-448. qk4pv4's V (recipes/u4h.py): a group of 32 rotated channels that is not
// all finite (a NaN or inf anywhere in the row reaches every group) or whose fp16 zero point or scale
// overflows stores NaN for both and codes 0. bf16 fields store the values as given.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
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

// The thread's fixed per-channel constants of its head: mu_K (quantized K) and 1 / v_scale (E4M3 V; kV4's
// append has no fixed V scale). Split K keeps mu_K in shared memory (the block's one head, read back per row)
// instead of 8 registers: its block-scale search needs them under the 64-register cap of 4 blocks per SM.
template <class L>
struct ChannelConstants {
  static constexpr bool kMuShared = L::kSplitK;
  static constexpr bool kScaledV = L::kQuantV && !L::kV4;
  float mu_r[kMuShared ? 1 : 8], inv_vs[kScaledV ? 8 : 1];
  const float* mu_s;   // kMuShared: this thread's 8 channels of the block's copy

  // Every thread of the block calls it (kMuShared: a block barrier); mu_smem: kHeadDim floats.
  __device__ __forceinline__ ChannelConstants(const float* mu_k, const float* v_scale, int h, int c0, float* mu_smem) {
    if constexpr (L::kQuantK) {
      if constexpr (kMuShared) {
        for (int i = threadIdx.x; i < L::kHeadDim / 4; i += blockDim.x)
          reinterpret_cast<float4*>(mu_smem)[i] = reinterpret_cast<const float4*>(mu_k + h * L::kHeadDim)[i];
        __syncthreads();
        mu_s = mu_smem + c0;
      } else {
        load8(mu_k + h * L::kHeadDim + c0, mu_r);
      }
    }
    if constexpr (kScaledV) {
      load8(v_scale + h * L::kHeadDim + c0, inv_vs);
#pragma unroll
      for (int i = 0; i < 8; ++i) inv_vs[i] = __frcp_rn(inv_vs[i]);   // x * (1/scale): the reference's order
    }
  }

  __device__ __forceinline__ void mu(float (&dst)[8]) const {
    if constexpr (kMuShared) {
      load8(mu_s, dst);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) dst[i] = mu_r[i];
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

// kV4's V (qk4pv4, recipes/u4h.py quantize_u4h): the row rotated by the orthonormal Hadamard matrix, r = V H,
// then 4-bit codes with an fp16 scale and zero point per 32 channels. The thread holds 8 channels of a row whose
// kThreadsPerRow lanes are one aligned group of its warp (Lane::v_row, schedule.cuh); every operation is the
// reference's, in its order, so the bytes match.
template <class S, class L>
__device__ __forceinline__ void store_v_u4h(const AppendParams& p, bool write, int64_t row, const Lane& me,
                                            uint4 vr) {
  constexpr int D = L::kHeadDim;
  static_assert(D == 64 || D == 128, "the rotation's scale 1 / sqrt(D) is written for head_dim 64 and 128");
  constexpr float kRsqrtD = D == 64 ? 0.125f : 0x1.6a09e6p-4f;   // float32(1 / sqrt(D))
  constexpr int kGroupLanes = L::kV4Group / 8;                   // lanes of a 32-channel group
  const __nv_bfloat162* vp = reinterpret_cast<const __nv_bfloat162*>(&vr);
  float x[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(vp[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
  // The butterfly, h = 1, 2, 4 inside the thread's 8 channels, then h = 8, 16, ... across lanes (partner lane ^
  // h / 8): the lower channel i takes x[i] + x[i+h], the upper x[i] - x[i+h], i.e. partner - own as
  // fma(own, -1, partner): one rounding, as the reference's subtraction.
#pragma unroll
  for (int h = 1; h < 8; h <<= 1) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if ((i & h) == 0) {
        const float a = x[i], b = x[i + h];
        x[i] = __fadd_rn(a, b);
        x[i + h] = __fsub_rn(a, b);
      }
    }
  }
  // The lane's bits give each stage's sign (the row's lanes are an aligned group: lane in row = lane % group
  // size). Opaque, so that the signs are rebuilt per row rather than hoisted out of the loop into 4 registers
  // that spill under the 64-register cap.
  uint32_t lane_bits = threadIdx.x;
  asm volatile("" : "+r"(lane_bits));
#pragma unroll
  for (int m = 1, bit = 0; m < S::kThreadsPerRow; m <<= 1, ++bit) {
    const float sign = __uint_as_float(0x3F800000u | (lane_bits & m) << (31 - bit));   // -1 on the upper lane
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = __fmaf_rn(x[i], sign, __shfl_xor_sync(0xffffffffu, x[i], m));
  }
  const int lane_in_row = me.v_c0 / 8;
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = __fmul_rn(x[i], kRsqrtD);
  float lo = x[0], hi = x[0];
#pragma unroll
  for (int i = 1; i < 8; ++i) {
    lo = min_nan(lo, x[i]);
    hi = max_nan(hi, x[i]);
  }
#pragma unroll
  for (int m = 1; m < kGroupLanes; m <<= 1) {
    lo = min_nan(lo, __shfl_xor_sync(0xffffffffu, lo, m));
    hi = max_nan(hi, __shfl_xor_sync(0xffffffffu, hi, m));
  }
  // A NaN or an infinity in the group makes lo or hi non-finite (NaN-propagating min / max), and so the fp16
  // zero point (lo) or the scale (hi - zero): testing those two finds every faulty group.
  __half zero = __float2half_rn(__fadd_rn(lo, 0.f));   // -0 + 0 = +0: the reference's canonical zero point
  const float zero_f = __half2float(zero);
  const float d = __fsub_rn(hi, zero_f);
  __half scale = __float2half_rn(__fdiv_rn(d, 15.f));
  if (d <= 0.f || __half_as_ushort(scale) == 0) scale = __ushort_as_half(0x3C00);   // 1.0: an all-equal group
  const auto finite = [](__half v) { return (__half_as_ushort(v) & 0x7C00) != 0x7C00; };
  // and a top code whose fp16 value would overflow in decode (the reference's fmaf(15, scale, zero) > 65504)
  if (!finite(zero) || !finite(scale) || __fmaf_rn(15.f, __half2float(scale), zero_f) > 65504.f) {
    zero = __ushort_as_half(0x7E00);
    scale = zero;
  }
  // A faulty group's inv is NaN, and fmaxf(NaN, 0) = 0 gives its codes 0. Clamping before rounding gives
  // clamp(rni(y), 0, 15) (rni is monotonic and 0, 15 are integers) and keeps y in the range of the FADD rounding.
  const float inv = __frcp_rn(__half2float(scale));
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float y = fminf(fmaxf(__fmul_rn(__fsub_rn(x[i], zero_f), inv), 0.f), 15.f);
    packed |= (__float_as_uint(__fadd_rn(y, kRoundMagic)) & 0xFu) << (4 * i);   // channel 2i low nibble of byte i
  }
  if (write) {
    *field_at<uint32_t>(p.v_data, row, L::v_bytes, me.v_c0 / 2) = packed;
    if (lane_in_row % kGroupLanes == 0)
      *field_at<uint32_t>(p.v_param, row, L::v_param_bytes, 4 * (me.v_c0 / L::kV4Group)) =
          uint32_t(__half_as_ushort(scale)) | uint32_t(__half_as_ushort(zero)) << 16;
  }
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

// Whole-row INT8 K (qk8pv8, recipes/int8.py quantize_k_per_token), one scale per row: the largest
// |K - mu_K| maps to 127.
template <class S, class L>
__device__ __forceinline__ void store_k_int8(const AppendParams& p, bool write, int64_t row, const Lane& me,
                                             const float (&k)[8], float amax8) {
  const float ks = amax_scale_or_nan(group_max<S>(amax8), kInt8Max);
  const float inv = __frcp_rn(ks);
  if (write) {
    float y[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) y[i] = __fmul_rn(k[i], inv);
    *field_at<uint2>(p.k_data, row, L::k_bytes, me.c0) = pack_s8x8(y);
    if (me.group_lane == 0) *field_at<float>(p.k_scale, row, L::k_scale_bytes, 0) = ks;
  }
}

// Squared error of quantizing a 16-channel INT4 block (this thread's 8 scaled values y and its partner
// lane's 8) with block scale b, summed in the reference's order (recipes/int8.py _halving_sum): the thread's
// run of 8 by halving, then the two runs with one shuffle (a + b == b + a: both lanes get the same bits).
// Every lane of the warp calls it (the shuffle), whatever its block's candidates.
__device__ __forceinline__ float i4_block_error(const float (&y)[8], float b) {
  const float rcp = __frcp_rn(b);
  float d2[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float q = int4_of(y[i], rcp);
    const float d = __fmaf_rn(-b, q, y[i]);   // y - b q, exact (b q is exact and |y - b q| <= |y| or <= 0.5 b)
    d2[i] = __fmul_rn(d, d);
  }
#pragma unroll
  for (int h = 4; h > 0; h >>= 1) {
#pragma unroll
    for (int i = 0; i < h; ++i) d2[i] = __fadd_rn(d2[i], d2[i + h]);
  }
  return __fadd_rn(d2[0], __shfl_xor_sync(0xffffffffu, d2[0], 1));
}

// i4rs K (qk4pv8, recipes/int8.py quantize_i4rs): one FP32 scale per row (amax -> 126); the low-frequency
// RoPE half (whole 8-channel chunks: each thread is on one side) as INT8, the other half as INT4 in [-7, 7]
// in blocks of 16 channels (2 lanes) with an integer block scale b: of b_up - 2 .. b_up + 1 within 1 .. 18
// (b_up = ceil(block amax / 7)), the smallest with the least squared error.
template <class S, class L>
__device__ __forceinline__ void store_k_i4rs(const AppendParams& p, bool write, int64_t row, const Lane& me,
                                             const float (&k)[8], float amax8, int& parity) {
  constexpr int D = L::kHeadDim;
  const float ts = amax_scale_or_nan(row_amax_across_halves<S>(group_max<S>(amax8), me, parity), kI4rsTarget);
  const float inv = __frcp_rn(ts);
  float y[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) y[i] = __fmul_rn(k[i], inv);
  const int idx = split_k_index<D>(me.c0);   // position within its half's field
  if (me.half == 1) {                     // = split_k_low<D>(c0), uniform per warp
    if (write) *field_at<uint2>(p.k8_data, row, L::k8_bytes, idx) = pack_s8x8(y);
  } else {
    float a = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) a = fmaxf(a, fabsf(y[i]));
    const float block_amax = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));   // 2 lanes = 16 channels
    const float b_up = fminf(fmaxf(ceilf(__fdiv_rn(block_amax, kInt4Max)), 1.f), float(kI4rsBlockScaleMax));
    float best_e = __int_as_float(0x7f800000), best_b = b_up;
#pragma unroll
    for (int c = -2; c <= 1; ++c) {
      const float b = b_up + float(c);
      const bool in_range = b >= 1.f && b <= float(kI4rsBlockScaleMax);
      const float e = i4_block_error(y, in_range ? b : b_up);
      if (in_range && e < best_e) { best_e = e; best_b = b; }   // ascending b, strict: ties keep the smaller
    }
    const float rcp = __frcp_rn(best_b);
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float q = int4_of(y[i], rcp);
      packed |= (__float_as_uint(__fadd_rn(q, kRoundMagic)) & 0xFu) << (4 * i);   // q's 4-bit two's complement
    }
    if (write) {
      *field_at<uint32_t>(p.k_data, row, L::k_bytes, idx / 2) = packed;   // 2 channels a byte
      constexpr int kScales = D / 32;   // in use; the field is padded to L::k_block_scale_bytes
      if (idx % 16 == 0)
        *field_at<uint8_t>(p.k_block_scale, row, L::k_block_scale_bytes, idx / 16) = uint8_t(best_b);
      // the padding (head_dim 64: 2 scales in a 4-byte field) is written too: every byte of a slot is defined
#pragma unroll
      for (int b = kScales; b < L::k_block_scale_bytes; ++b)
        if (idx == 0) *field_at<uint8_t>(p.k_block_scale, row, L::k_block_scale_bytes, b) = 0;
    }
  }
  if (write && me.group_lane == 0 && me.half == 0) *field_at<float>(p.k_scale, row, L::k_scale_bytes, 0) = ts;
}

}  // namespace mpfa::append
