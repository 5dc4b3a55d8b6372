// The decode library's arguments: DecodeParams is the C ABI (what mpfa_decode takes; mirrored by the
// ctypes.Structure of mpfa_jit/ops/decode.py and checked at load through mpfa_decode_params_layout) and
// the decode kernel's parameter, passed by value; the merge launch takes its part of it.
#pragma once
#include <cuda_bf16.h>
#include <cstdint>
#include "mpfa/abi.cuh"

// Pointers are device addresses; [..] shapes in requests, heads (Hq query, Hkv KV), pages and channels (D).
// The plan (python/mpfa/decode.py) fills the page table, work list, split and workspace fields once; each run
// sets the query, cache layer and output fields.
#define MPFA_DECODE_PARAMS(X)                                                                           \
  X(const __nv_bfloat16*, q)       /* [batch, Hq, D] */                                                 \
  X(int64_t, q_stride_b)                                                                                \
  X(int64_t, q_stride_h)                                                                                \
  X(const uint8_t*, k)             /* [pages, Hkv, page_size, Layout::k_bytes] */                       \
  X(const uint8_t*, k8)            /* qk4pv8: [pages, Hkv, page_size, Layout::k8_bytes] */              \
  X(const uint8_t*, k_block_scale) /* qk4pv8: [pages, Hkv, page_size, Layout::k_block_scale_bytes] */   \
  X(const uint8_t*, k_scale)       /* quantized K: float32 [pages, Hkv, page_size] */                   \
  X(const uint8_t*, v)             /* [pages, Hkv, page_size, Layout::v_bytes] */                       \
  X(const float*, v_scale)         /* E4M3 V: [Hkv, D] */                                               \
  X(const uint8_t*, v_param)       /* qk4pv4: [pages, Hkv, page_size, Layout::v_param_bytes] */         \
  X(const int*, indptr)            /* [batch + 1] */                                                    \
  X(const int*, indices)                                                                                \
  X(const int*, last_page_len)     /* [batch] */                                                        \
  X(int, num_kv_heads)                                                                                  \
  X(int, num_items)                /* the grid's work items (capacity); > batch: partials, a merge */   \
  X(int, batch)                                                                                         \
  /* The work list (schedule.cuh), in device memory so that a CUDA graph's replay can change it: request \
     b owns items [work_indptr[b], work_indptr[b + 1]) (at least one), its splits in order; */           \
  X(const int*, work_indptr)       /* [batch + 1] */                                                    \
  X(const int*, work_request)      /* [num_items]: each item's request, -1 past the last */             \
  /* > 0: a fixed split size in tiles (a batch-invariant partition); 0 (or null): ceil(tiles / the      \
     request's items). In device memory so that a CUDA graph's replay can change it. */                 \
  X(const int*, tiles_per_split)                                                                        \
  X(float, score_scale)            /* sm_scale * log2(e): the softmax runs in base 2 */                 \
  X(float*, o_part)                /* workspace, num_items > batch: [items, Hq, D] */                   \
  X(float*, lse_part)              /* workspace, num_items > batch: [items, Hq] (log2) */               \
  X(__nv_bfloat16*, out)           /* [batch, Hq, D] */                                                 \
  X(int64_t, out_stride_b)                                                                              \
  X(int64_t, out_stride_h)                                                                              \
  X(float*, lse)                   /* [batch, Hq] natural log, or null */

struct DecodeParams {
  MPFA_DECODE_PARAMS(MPFA_DECLARE_FIELD)
};
