// Which tiles of which request a decode CTA attends. The grid is (num_kv_heads, num_items), KV heads fastest
// (kernel.cuh): an item is one split of one request, read from the plan's work list in device memory
// at every launch, so CTAs go where the tokens are (a short request takes one item, a long one several) and a
// captured CUDA graph replays correctly as lengths, the work list and the fixed split size change.
#pragma once
#include "mpfa/decode/params.cuh"
#include "mpfa/decode/traits.cuh"

namespace {

struct SplitRange {
  int b;            // the request (-1: an item past the work list's end, nothing to do)
  int split;        // the item's split of its request
  int num_splits;   // the request's items (1: the CTA writes the output itself, no merge)
  // From the split's first tile on (a tile is whole pages; a page holds tokens of the request while its first
  // token is < kv_left): three values live through the tile loop where the request's (first page, pages,
  // tokens) and the split's first tile were four, which spilled qk4pv8 and qk8pv8 d128 at the 128-register cap
  // once the request came from memory rather than from the grid.
  int page_first;   // the split's first entry of the page table
  int kv_left;      // the request's tokens from there
  int n_iter;       // the split's tiles (0: nothing to attend)
};

template <class Cfg>
__device__ __forceinline__ SplitRange split_range(const DecodeParams& p, int item) {
  using T = DecodeTraits<Cfg>;
  SplitRange r;
  r.b = p.work_request[item];
  if (r.b < 0) return r;
  const int first = p.work_indptr[r.b];
  r.split = item - first;
  r.num_splits = p.work_indptr[r.b + 1] - first;
  const int page_begin = p.indptr[r.b], num_pages = p.indptr[r.b + 1] - page_begin;
  const int kv_len = num_pages > 0 ? (num_pages - 1) * T::kPageSize + p.last_page_len[r.b] : 0;
  const int num_tiles = (kv_len + T::kTile - 1) / T::kTile;
  // A fixed split size cuts every request the same way whatever its item count (eager, CUDA graph, batch
  // composition), so its output is bit-identical across them; the last split keeps any remainder so a
  // request longer than its items cover is still attended in full.
  const int fixed_tiles = p.tiles_per_split != nullptr ? *p.tiles_per_split : 0;
  const int per_split = fixed_tiles > 0 ? fixed_tiles : (num_tiles + r.num_splits - 1) / r.num_splits;
  const int tile_begin = r.split * per_split;
  const int tile_end = r.split == r.num_splits - 1 ? num_tiles : min(num_tiles, tile_begin + per_split);
  r.n_iter = tile_end > tile_begin ? tile_end - tile_begin : 0;
  r.page_first = page_begin + tile_begin * T::kPagesPerTile;
  r.kv_left = kv_len - tile_begin * T::kTile;
  return r;
}

}  // namespace
