"""Shared set-up of the GPU kernel tests: bf16 rows with outlier channels and a paged batch in a
quantized cache, with permuted pages and NaN-poisoned slots past each request's length.

Both are fixtures that return the builder function, so a test asks for ``paged_batch`` / ``bf16_rows``
and calls it with its own shapes:

    def test_x(paged_batch, bf16_rows, shared_jit_cache):
        batch = paged_batch("qk4pv8", 128, 16, 2, [1, 300, 777], gen)
        q = bf16_rows(len(batch.lengths), 8, 128, gen)
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

import mpfa


def make_bf16_rows(n: int, heads: int, d: int, gen: torch.Generator, *, scale: float = 1.0,
                   mean_channel: int = 3) -> torch.Tensor:
    """[n, heads, d] bf16 rows with outlier channels, as real K/V have: channel ``mean_channel`` with a
    large mean (x * 20 + 40), channel d/2 + 1 with a large spread (x * 30)."""
    x = torch.randn(n, heads, d, generator=gen, device="cuda") * scale
    x[..., mean_channel] = x[..., mean_channel] * 20 + 40
    x[..., d // 2 + 1] *= 30
    return x.to(torch.bfloat16)


@dataclass
class PagedBatch:
    """A batch of requests over layer 1 of a two-layer cache (layer 0 is left uncalibrated)."""
    cache: mpfa.PagedKVCache
    layer: object                  # cache.layer(1)
    indptr: torch.Tensor           # int32 [batch + 1]: request b owns indices[indptr[b]:indptr[b + 1]]
    indices: torch.Tensor          # int32 page ids, a random permutation of the cache's pages
    last: torch.Tensor             # int32 [batch]: tokens in each request's last page (0 for an empty request)
    lengths: list[int]             # tokens per request


def make_paged_batch(recipe: str, head_dim: int, page_size: int, num_kv_heads: int, lengths, gen: torch.Generator,
                     *, extra_pages: int = 5, k_mean_channel: int = 3) -> PagedBatch:
    """Every slot of the cache written by append_kv from outlier rows (K's large-mean channel is
    ``k_mean_channel``, V's is 3) after calibrating layer 1 on the first 256; each request gets
    ceil(length / page_size) pages drawn at random from all (``extra_pages`` more than needed exist), and
    the slots past its length in its last page are NaN bytes in every field: a kernel that reads them
    produces NaN. A request of length 0 owns no pages."""
    lengths = [int(n) for n in lengths]
    pages_per = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_per) + extra_pages
    cache = mpfa.PagedKVCache(recipe, num_layers=2, num_pages=num_pages, page_size=page_size,
                              num_kv_heads=num_kv_heads, head_dim=head_dim, device="cuda")
    n_slots = num_pages * page_size
    k = make_bf16_rows(n_slots, num_kv_heads, head_dim, gen, mean_channel=k_mean_channel)
    v = make_bf16_rows(n_slots, num_kv_heads, head_dim, gen)
    cache.calibrate(1, k[:256], v[:256])
    layer = cache.layer(1)
    mpfa.append_kv(k, v, layer, torch.arange(n_slots, device="cuda"))
    perm = torch.randperm(num_pages, generator=gen, device="cuda")
    indices = perm[: sum(pages_per)].to(torch.int32)
    indptr = torch.tensor([0] + list(itertools.accumulate(pages_per)), dtype=torch.int32, device="cuda")
    last = torch.tensor([n - (k - 1) * page_size if k else 0 for n, k in zip(lengths, pages_per)],
                        dtype=torch.int32, device="cuda")
    for b, n in enumerate(lengths):
        if pages_per[b] == 0:
            continue
        page = int(indices[int(indptr[b + 1]) - 1])
        off = n - (pages_per[b] - 1) * page_size
        for t in layer.fields.values():
            t[page, :, off:].view(torch.uint8).fill_(0xFF)
    return PagedBatch(cache, layer, indptr, indices, last, lengths)


@pytest.fixture
def bf16_rows():
    """``make_bf16_rows``: ``bf16_rows(n, heads, d, gen, *, scale=1.0, mean_channel=3)``."""
    return make_bf16_rows


@pytest.fixture
def paged_batch():
    """``make_paged_batch``: ``paged_batch(recipe, head_dim, page_size, num_kv_heads, lengths, gen, *,
    extra_pages=5, k_mean_channel=3) -> PagedBatch``."""
    return make_paged_batch
