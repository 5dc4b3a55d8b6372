// The append library's arguments: AppendParams is the C ABI (what mpfa_append_kv takes; mirrored by the
// ctypes.Structure of mpfa_jit/ops/append_kv.py and checked at load through mpfa_append_params_layout)
// and the kernel's parameter, passed by value.
#pragma once
#include <cstdint>
#include "mpfa/abi.cuh"

// Pointers are device addresses. Rows are [tokens, Hkv, D] (bf16, after RoPE, any token and head stride);
// cache fields are one layer's [pages, Hkv, page_size, Layout::<field>_bytes], null where the recipe has
// no such field.
#define MPFA_APPEND_PARAMS(X)                                                                              \
  X(const void*, k)               /* bf16 rows */                                                          \
  X(const void*, v)                                                                                        \
  X(int64_t, k_stride_token)      /* in elements */                                                        \
  X(int64_t, k_stride_head)                                                                                \
  X(int64_t, v_stride_token)                                                                               \
  X(int64_t, v_stride_head)                                                                                \
  X(const int64_t*, slots)        /* [num_tokens]; negative: padding (a CUDA graph's), writes nothing */   \
  X(int64_t, num_tokens)                                                                                   \
  X(int64_t, num_slots)           /* the layer's pages * page_size: a slot at or past it is skipped */     \
  X(int*, bad_slots)              /* [1]: += the number of skipped slots >= num_slots (tokens, not rows) */ \
  X(void*, k_data)                /* field "k": bf16 | INT8 | qk4pv8's INT4 nibbles */                      \
  X(void*, k8_data)               /* field "k8": qk4pv8's INT8 half of K */                                \
  X(void*, k_block_scale)         /* field "k_block_scale": qk4pv8 */                                      \
  X(void*, k_scale)               /* field "k_scale": float per (token, head), quantized K */              \
  X(void*, v_data)                /* field "v": bf16 | E4M3 | qk4pv4's 4-bit codes */                      \
  X(void*, v_param)               /* field "v_param": qk4pv4's fp16 scale and zero point per 32 channels */ \
  X(const float*, mu_k)           /* quantized K: [Hkv, D] K smoothing mean */                             \
  X(const float*, v_scale)        /* E4M3 V: [Hkv, D] fixed channel scales */                              \
  X(int, num_kv_heads)

struct AppendParams {
  MPFA_APPEND_PARAMS(MPFA_DECLARE_FIELD)
};
