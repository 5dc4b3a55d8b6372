// Which tiles of its request a decode CTA attends. The grid is (num_splits, num_kv_heads, batch), fixed
// at plan; each CTA reads its request's length and its split's range from device memory at every launch,
// so a captured CUDA graph replays correctly as lengths and the fixed split size change.
#pragma once
#include "mpfa/decode/params.cuh"
#include "mpfa/decode/traits.cuh"

namespace {

struct SplitRange {
  int page_begin;   // the request's first entry of the page table
  int num_pages;
  int kv_len;       // the request's tokens
  int tile_begin;   // the split's first kTile-token tile of the request
  int n_iter;       // its tiles (0: nothing to attend)
};

template <class Cfg>
__device__ __forceinline__ SplitRange split_range(const DecodeParams& p, int split, int b) {
  using T = DecodeTraits<Cfg>;
  SplitRange r;
  r.page_begin = p.indptr[b];
  r.num_pages = p.indptr[b + 1] - r.page_begin;
  r.kv_len = r.num_pages > 0 ? (r.num_pages - 1) * T::kPageSize + p.last_page_len[b] : 0;
  const int num_tiles = (r.kv_len + T::kTile - 1) / T::kTile;
  // A fixed split size cuts every request the same way whatever the grid (eager, CUDA graph, batch
  // composition), so its output is bit-identical across them; the last split keeps any remainder so a
  // request longer than the grid covers is still attended in full.
  const int fixed_tiles = p.tiles_per_split != nullptr ? *p.tiles_per_split : 0;
  const int per_split = fixed_tiles > 0 ? fixed_tiles : (num_tiles + p.num_splits - 1) / p.num_splits;
  r.tile_begin = split * per_split;
  const int tile_end = split == p.num_splits - 1 ? num_tiles : min(num_tiles, r.tile_begin + per_split);
  r.n_iter = tile_end > r.tile_begin ? tile_end - r.tile_begin : 0;
  return r;
}

}  // namespace
