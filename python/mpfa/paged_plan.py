"""Validation of the paged-KV batch description both wrappers take at ``plan`` (FlashInfer's format).

Request b owns pages ``paged_kv_indices[paged_kv_indptr[b]:paged_kv_indptr[b+1]]`` in order; its last
page holds ``paged_kv_last_page_len[b]`` tokens (1..page_size), so its KV length is
``(pages - 1) * page_size + last_page_len``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import HEAD_DIMS, PAGE_SIZES
from .recipes import get_recipe
from .recipes.u4h import rotate_back
from .validation import check_choice, check_positive_int, check_tensor

_INDEX = (torch.int32, torch.int64)


@dataclass
class PagedBatch:
    batch_size: int
    kv_lengths: list[int]
    max_page_index: int
    paged_kv_indptr: torch.Tensor
    paged_kv_indices: torch.Tensor
    paged_kv_last_page_len: torch.Tensor


def check_heads(num_qo_heads, num_kv_heads, head_dim, page_size, recipe):
    check_positive_int("num_qo_heads", num_qo_heads)
    check_positive_int("num_kv_heads", num_kv_heads)
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    check_choice("head_dim", head_dim, HEAD_DIMS)
    check_choice("page_size", page_size, PAGE_SIZES)
    return get_recipe(recipe)


def check_paged(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size) -> PagedBatch:
    check_tensor("paged_kv_indptr", paged_kv_indptr, dtypes=_INDEX, ndim=1)
    if paged_kv_indptr.numel() < 2:
        raise ValueError(f"paged_kv_indptr must have batch_size + 1 >= 2 entries, got {paged_kv_indptr.numel()}")
    batch = paged_kv_indptr.numel() - 1
    check_tensor("paged_kv_indices", paged_kv_indices, dtypes=_INDEX, ndim=1)
    check_tensor("paged_kv_last_page_len", paged_kv_last_page_len, dtypes=_INDEX, shape=(batch,))
    indptr = paged_kv_indptr.cpu()
    if indptr[0] != 0 or bool((indptr[1:] < indptr[:-1]).any()) or indptr[-1] > paged_kv_indices.numel():
        raise ValueError("paged_kv_indptr must start at 0, never decrease, and end at most at "
                         f"len(paged_kv_indices)={paged_kv_indices.numel()}; got {indptr.tolist()[:8]}...")
    last = paged_kv_last_page_len.cpu()
    n_pages = indptr[1:] - indptr[:-1]
    bad = ((n_pages > 0) & ((last < 1) | (last > page_size))) | ((n_pages == 0) & (last != 0))
    if bool(bad.any()):
        b = int(bad.nonzero()[0])
        raise ValueError(f"paged_kv_last_page_len[{b}] must be in [1, page_size={page_size}] for a request with "
                         f"pages (0 without), got {int(last[b])}")
    lengths = [0 if n == 0 else (n - 1) * page_size + l for n, l in zip(n_pages.tolist(), last.tolist())]
    used = paged_kv_indices[: int(indptr[-1])].cpu()
    if used.numel() and int(used.min()) < 0:
        raise ValueError(f"paged_kv_indices must be >= 0, got {int(used.min())}")
    max_page = int(used.max()) if used.numel() else -1
    return PagedBatch(batch, lengths, max_page, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)


def check_kv_matches(kv, recipe, num_kv_heads, head_dim, page_size) -> None:
    from .kv_cache import KVCacheLayer
    if not isinstance(kv, KVCacheLayer):
        raise ValueError(f"kv must be a KVCacheLayer (PagedKVCache.layer(i)), got {type(kv).__name__}")
    for name, planned, actual in (("recipe", recipe.name, kv.recipe.name), ("num_kv_heads", num_kv_heads, kv.num_kv_heads),
                                  ("head_dim", head_dim, kv.head_dim), ("page_size", page_size, kv.page_size)):
        if planned != actual:
            raise ValueError(f"kv does not match the plan: planned {name}={planned!r}, the cache has {actual!r}")


def check_pages_fit(paged: PagedBatch, kv) -> None:
    if paged.max_page_index >= kv.cache.num_pages:
        raise ValueError(f"paged_kv_indices must be < num_pages={kv.cache.num_pages} of the cache, "
                         f"got page {paged.max_page_index}")


def reference_run(q, qo_indptr, kv, paged: PagedBatch, out, return_lse: bool, *, path: str, **attention_kwargs):
    """Both wrappers' reference path (``path``: "decode" or "prefill", the V that path multiplies): dequantize only
    the pages the batch uses, run :func:`mpfa.reference.batch_attention` in float32, return bf16 O (into ``out`` if
    given). qk4pv4 (V stored rotated) as its kernels: attention on the rotated V, rounded to bf16, then the
    wrappers' output rotation (mpfa.recipes.u4h.rotate_back)."""
    from .reference.attention import batch_attention
    ids = paged.paged_kv_indices[: int(paged.paged_kv_indptr[-1])]
    rotation = kv.v_rotation
    k_pages, v_pages = kv.dequantize(pages=ids, path=path, rotated=rotation is not None)
    if attention_kwargs.get("k_tile"):   # K as a tile_scale prefill build scores it
        attention_kwargs["k_operand_pages"] = kv.k_operand(pages=ids)
    local = torch.arange(ids.numel(), device=ids.device)
    o, lse = batch_attention(q, qo_indptr, k_pages, v_pages, paged.paged_kv_indptr, local,
                             paged.paged_kv_last_page_len, dtype=torch.float32, **attention_kwargs)
    o = o.to(torch.bfloat16)
    if rotation is not None:
        o = rotate_back(o, rotation, out)
    elif out is not None:
        out.copy_(o)
        o = out
    return (o, lse) if return_lse else o
