// Work items of the main kernel: one CTA per item, CTA i running item i. The plan (python/mpfa/prefill.py
// tile_schedule) orders the query tiles longest first; item i is query tile i / Hq of that list and query head i % Hq.
#pragma once
#include "mpfa/prefill/kernel_traits.cuh"
#include "mpfa/prefill/params.cuh"

namespace {

// KV length of request b (its keys are pages page_begin.. of the page table).
template <class Kt>
__device__ __forceinline__ int kv_length(const PrefillParams& p, int b, int* page_begin) {
  const int pb = p.kv_indptr[b];
  const int np = p.kv_indptr[b + 1] - pb;
  *page_begin = pb;
  return np > 0 ? (np - 1) * Kt::kPageSize + p.last_page_len[b] : 0;
}

// One work item of the main kernel: a kBM-row query tile of one request and one query head.
struct Item {
  int hq, hk, b, row0, qo_start, rows, kv_len, diag, n_tiles;
};

template <class Kt>
__device__ __forceinline__ Item item_at(const PrefillParams& p, int item) {
  Item it;
  const int nh = p.num_qo_heads;
  const int tile = item / nh;
  it.hq = item % nh;
  it.hk = it.hq / (nh / p.num_kv_heads);
  it.b = p.tile_req[tile];
  it.row0 = p.tile_q[tile] * Kt::kBM;
  it.qo_start = p.qo_indptr[it.b];
  const int qo_len = p.qo_indptr[it.b + 1] - it.qo_start;
  it.rows = min(Kt::kBM, qo_len - it.row0);
  int page_begin;
  it.kv_len = kv_length<Kt>(p, it.b, &page_begin);
  it.diag = it.kv_len - qo_len;                    // row i sees keys j <= i + diag (causal)
  const int kv_end = p.causal ? min(it.kv_len, it.row0 + it.rows + it.diag) : it.kv_len;
  it.n_tiles = (kv_end + Kt::kBN - 1) / Kt::kBN;
  return it;
}

}  // namespace
