// The prefill library's arguments: PrefillParams is the C ABI (what mpfa_prefill takes; mirrored by
// mpfa_jit/ops/prefill.py's ctypes.Structure and checked at load through mpfa_prefill_params_layout). The
// kernels take it by value as launched (prefill.cu.jinja's mpfa_prefill: a copy with mu, fb, q_head and cd_img
// nulled unless the launch compensates, so the kernels test fb / q_head alone), plus score_scale = sm_scale *
// log2(e) as an argument of the kernels that scale scores (kv_pack_kernel, prefill_kernel).
#pragma once
#include <cuda_bf16.h>
#include <cstdint>
#include "mpfa/abi.cuh"

// Host pointers are device addresses; [..] shapes in tokens (total_q: all requests' query rows), pages and
// heads; the tile lists and workspace sections are the wrapper's plan (python/mpfa/prefill.py). num_qo_heads and
// num_kv_heads lead the scalars as one 8-byte-aligned pair (the kernels load both with one LDC.64).
#define MPFA_PREFILL_PARAMS(X)                                                                        \
  X(const __nv_bfloat16*, q)       /* [total_q, Hq, D] */                                             \
  X(int64_t, q_stride_t)                                                                              \
  X(int64_t, q_stride_h)                                                                              \
  X(const uint8_t*, k)             /* [pages, Hkv, page_size, Layout::k_bytes] */                     \
  X(const uint8_t*, k8)            /* qk4pv8: [pages, Hkv, page_size, Layout::k8_bytes] */            \
  X(const uint8_t*, k_block_scale) /* qk4pv8: [pages, Hkv, page_size, Layout::k_block_scale_bytes] */ \
  X(const float*, k_scale)         /* quantized K: [pages, Hkv, page_size] */                         \
  X(const uint8_t*, v)             /* [pages, Hkv, page_size, Layout::v_bytes] */                     \
  X(const float*, v_scale)         /* quantized V: [Hkv, D] (qk4pv4: of the rotated V) */             \
  X(const uint8_t*, v_param)       /* qk4pv4: [pages, Hkv, page_size, Layout::v_param_bytes] */       \
  X(const int*, qo_indptr)         /* [batch + 1] */                                                  \
  X(const int*, kv_indptr)         /* [batch + 1] */                                                  \
  X(const int*, indices)                                                                              \
  X(const int*, last_page_len)     /* [batch] */                                                      \
  X(const int*, kv_tile_base)      /* [batch]: index of the request's first KV tile image */          \
  X(const int*, tile_req)          /* [num_tiles] */                                                  \
  X(const int*, tile_q)            /* [num_tiles]: query tile index within the request */             \
  X(const int*, kvt_req)           /* [num_kv_tiles] */                                               \
  X(const int*, kvt_idx)           /* [num_kv_tiles]: KV tile index within the request */             \
  X(int, num_qo_heads)                                                                                \
  X(int, num_kv_heads)                                                                                \
  X(int, causal)                                                                                      \
  X(float, sm_scale)                                                                                  \
  X(int, num_tiles)                                                                                   \
  X(int, num_kv_tiles)                                                                                \
  X(int, batch)                                                                                       \
  X(int, mu_blocks)                /* blocks of kMuRows query rows of the longest chunk; 0: no compensation */ \
  X(float*, mu_part)               /* workspace: [mu_blocks, batch, Hq, D] */                         \
  X(float*, mu)                    /* workspace: [batch, Hq, D] */                                    \
  X(uint8_t*, k_img)               /* workspace: [num_kv_tiles, Hkv, kImgK] */                        \
  X(uint8_t*, v_img)               /* workspace: [num_kv_tiles, Hkv, kImgV] */                        \
  X(float*, fa)                    /* workspace, quantized recipes: [num_kv_tiles, Hkv, kBN] */       \
  X(float*, fb)                    /* workspace, compensation: [num_kv_tiles, Hq, kBN] */             \
  X(float*, q_head)                /* comp_mma: [batch, Hq, 2] amax of Q - mu_Q, |mu_Q|_1; or null */ \
  X(uint8_t*, cd_img)              /* comp_mma: [num_kv_tiles, Hq, kImgCd] digit images; or null */ \
  X(__nv_bfloat16*, out)           /* [total_q, Hq, D] */                                             \
  X(int64_t, out_stride_t)                                                                            \
  X(int64_t, out_stride_h)                                                                            \
  X(float*, lse)                   /* [total_q, Hq] natural log, or null */

struct PrefillParams {
  MPFA_PREFILL_PARAMS(MPFA_DECLARE_FIELD)
};
