"""SGLang's token-slot table -> mpfa's paged-KV description, on the device, with static shapes.

SGLang gives ``req_to_token[req_pool_index, position] = slot`` and allocates whole pages: token
``position`` of a request sits at slot ``page * page_size + position % page_size``. So request ``b``'s
page list is ``req_to_token[r_b, 0::page_size][:ceil(len_b / page_size)] // page_size``.

Every op here is a fixed-shape tensor op (no ``.item()``, ``.cpu()`` or data-dependent shape): the
CUDA-graph path runs it before each replay without synchronizing the host. ``check_extend_slots`` (eager
extend batches only) checks that the batch's new tokens keep to that layout.
"""
from __future__ import annotations

import torch


def page_table_capacity(batch_size: int, max_pages_per_req: int, pool_pages: int | None = None) -> int:
    """Entries ``build_page_table`` needs in ``indices_out``: every page of the batch plus one trash
    entry (where masked-out columns land). A batch never holds more pages than the pool, plus one
    padding page per (padded) request."""
    n = batch_size * max_pages_per_req
    if pool_pages is not None:
        n = min(n, pool_pages + batch_size)
    return n + 1


def build_page_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                     page_size: int, max_pages_per_req: int, *, indptr_out: torch.Tensor | None = None,
                     indices_out: torch.Tensor | None = None, last_page_len_out: torch.Tensor | None = None):
    """Fill (or allocate) int32 ``indptr [bs + 1]``, ``indices [capacity]`` and ``last_page_len [bs]``
    (FlashInfer's paged-KV format) for requests ``req_pool_indices`` with KV lengths ``seq_lens``.
    ``max_pages_per_req`` bounds every request's page count (a static shape). Entries of ``indices``
    past ``indptr[-1]`` are scratch. Returns ``(indptr, indices, last_page_len)``."""
    bs = req_pool_indices.shape[0]
    device = req_to_token.device
    width = max(1, int(max_pages_per_req))
    if indptr_out is None:
        indptr_out = torch.empty(bs + 1, dtype=torch.int32, device=device)
    if last_page_len_out is None:
        last_page_len_out = torch.empty(bs, dtype=torch.int32, device=device)
    if indices_out is None:
        indices_out = torch.empty(page_table_capacity(bs, width), dtype=torch.int32, device=device)
    lens = seq_lens.to(torch.int64)
    n_pages = (lens + page_size - 1) // page_size
    indptr_out[:1].zero_()
    ends = torch.cumsum(n_pages, 0)
    indptr_out[1:].copy_(ends)
    last_page_len_out.copy_(torch.where(n_pages > 0, lens - (n_pages - 1) * page_size, torch.zeros_like(lens)))
    cols = torch.arange(width, device=device, dtype=torch.int64)
    pos = (cols * page_size).clamp_(max=req_to_token.shape[1] - 1)
    slots = req_to_token[req_pool_indices.to(torch.int64)[:, None], pos[None, :]]     # [bs, width]
    pages = torch.div(slots, page_size, rounding_mode="floor").to(torch.int32)
    valid = cols[None, :] < n_pages[:, None]
    trash = indices_out.shape[0] - 1
    dest = torch.where(valid, (ends - n_pages)[:, None] + cols[None, :],
                       torch.full_like(cols, trash)[None, :])
    dest = dest.clamp_(max=trash)
    indices_out.scatter_(0, dest.reshape(-1), pages.reshape(-1))
    return indptr_out, indices_out, last_page_len_out


class KVLayoutError(ValueError):
    """A batch's KV slots break the paged layout the kernels read (token ``position`` at offset
    ``position % page_size`` of the page its page's first token is in)."""


def check_extend_slots(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, extend_seq_lens: torch.Tensor,
                       positions: torch.Tensor, out_cache_loc: torch.Tensor, page_size: int) -> None:
    """Raise KVLayoutError unless every new token of an extend batch (``positions`` and ``out_cache_loc``, request
    by request, ``extend_seq_lens`` tokens each) sits at offset ``position % page_size`` of the page that
    ``req_to_token`` gives for its page's first position: the kernels find a key by its position in the page list
    (build_page_table), so a token elsewhere would be read as another. SGLang's paged allocator always keeps to
    this; a page size of 1 has nothing to check. Synchronizes the host (one reduction)."""
    if page_size == 1 or out_cache_loc.numel() == 0:
        return
    # output_size: the lengths are on the device, and without it repeat_interleave syncs once more to size its output
    req = torch.repeat_interleave(req_pool_indices.to(torch.int64), extend_seq_lens.to(torch.int64),
                                  output_size=out_cache_loc.numel())
    pos = positions.to(torch.int64)
    slot = out_cache_loc.to(torch.int64)
    page_head = req_to_token[req, pos - pos % page_size].to(torch.int64)
    bad = (torch.div(slot, page_size, rounding_mode="floor") != torch.div(page_head, page_size, rounding_mode="floor")) \
        | (slot % page_size != pos % page_size)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise KVLayoutError(
            f"mpfa: extend token {i} (request pool index {int(req[i])}, position {int(pos[i])}) is at KV slot "
            f"{int(slot[i])}, but --page-size {page_size} puts position {int(pos[i])} at offset "
            f"{int(pos[i]) % page_size} of page {int(page_head[i]) // page_size} (slot "
            f"{int(page_head[i]) // page_size * page_size + int(pos[i]) % page_size}); the paged kernels read keys "
            f"by position. Allocate whole pages in order (SGLang's paged allocator does), or serve with --page-size 1")
