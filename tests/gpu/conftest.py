"""Shared set-up of the GPU kernel tests: bf16 rows with outlier channels and a paged batch in a
quantized cache, with permuted pages and NaN-poisoned slots past each request's length.

Both are fixtures that return the builder function, so a test asks for ``paged_batch`` / ``bf16_rows``
and calls it with its own shapes:

    def test_x(paged_batch, bf16_rows, shared_jit_cache):
        batch = paged_batch("qk4pv8", 128, 16, 2, [1, 300, 777], gen)
        q = bf16_rows(len(batch.lengths), 8, 128, gen)

The builders take ``device="cpu"`` too (with a CPU generator; the cache is then written by the reference
backend), so that CPU tests can run the GPU tests' reference side on the same batches
(tests/cpu/test_reference_prefill_kernel.py).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

import mpfa


def make_bf16_rows(n: int, heads: int, d: int, gen: torch.Generator, *, scale: float = 1.0,
                   mean_channel: int = 3, device: str = "cuda") -> torch.Tensor:
    """[n, heads, d] bf16 rows with outlier channels, as real K/V have: channel ``mean_channel`` with a
    large mean (x * 20 + 40), channel d/2 + 1 with a large spread (x * 30)."""
    x = torch.randn(n, heads, d, generator=gen, device=device) * scale
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
                     *, extra_pages: int = 5, k_mean_channel: int = 3, device: str = "cuda") -> PagedBatch:
    """Every slot of the cache written by append_kv from outlier rows (K's large-mean channel is
    ``k_mean_channel``, V's is 3) after calibrating layer 1 on the first 256; each request gets
    ceil(length / page_size) pages drawn at random from all (``extra_pages`` more than needed exist), and
    the slots past its length in its last page are NaN bytes in every field: a kernel that reads them
    produces NaN. A request of length 0 owns no pages."""
    lengths = [int(n) for n in lengths]
    pages_per = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_per) + extra_pages
    cache = mpfa.PagedKVCache(recipe, num_layers=2, num_pages=num_pages, page_size=page_size,
                              num_kv_heads=num_kv_heads, head_dim=head_dim, device=device)
    n_slots = num_pages * page_size
    k = make_bf16_rows(n_slots, num_kv_heads, head_dim, gen, mean_channel=k_mean_channel, device=device)
    v = make_bf16_rows(n_slots, num_kv_heads, head_dim, gen, device=device)
    cache.calibrate(1, k[:256], v[:256])
    layer = cache.layer(1)
    mpfa.append_kv(k, v, layer, torch.arange(n_slots, device=device),
                   backend="auto" if device == "cuda" else "reference")
    perm = torch.randperm(num_pages, generator=gen, device=device)
    indices = perm[: sum(pages_per)].to(torch.int32)
    indptr = torch.tensor([0] + list(itertools.accumulate(pages_per)), dtype=torch.int32, device=device)
    last = torch.tensor([n - (k - 1) * page_size if k else 0 for n, k in zip(lengths, pages_per)],
                        dtype=torch.int32, device=device)
    for b, n in enumerate(lengths):
        if pages_per[b] == 0:
            continue
        page = int(indices[int(indptr[b + 1]) - 1])
        off = n - (pages_per[b] - 1) * page_size
        for t in layer.fields.values():
            t[page, :, off:].view(torch.uint8).fill_(0xFF)
    return PagedBatch(cache, layer, indptr, indices, last, lengths)


def make_large_mean_q(n: int, heads: int, d: int, gen: torch.Generator, *, device: str = "cuda") -> torch.Tensor:
    """[n, heads, d] bf16 Q whose spread is small beside a large common mean in a few channels, as real Q's
    outlier channels are: N(0, 1) rows plus, per head, a mean of +-48 on channels 1 and d/2 + 3 (a mean shared
    by every row of the head, so mu_Q holds it). Without smoothing each 64-row INT8 Q scale is set by the mean
    (step ~(48 + 3.5) / 127 ~ 0.41); smoothed, by the spread (step ~4.5 / 127 ~ 0.035): ~11x finer. The mean
    sits in two channels so that |mu_Q|_1 (~100 plus the sample noise of the other channels' means) stays below
    31 x amax(Q - mu_Q) (~140), where qk4pv8's comp_mma Q scale would take its floor 127 |mu_Q|_1 /
    COMP_SCALE_DIVISOR instead (mpfa.recipes.int8.comp_digits_q_scale): with a large mean on every channel that
    floor is as coarse as no smoothing, and compensation buys nothing there."""
    x = torch.randn(n, heads, d, generator=gen, device=device)
    sign = torch.randint(0, 2, (2, heads), generator=gen, device=device) * 2 - 1
    x[:, :, 1] += 48 * sign[0]
    x[:, :, d // 2 + 3] += 48 * sign[1]
    return x.to(torch.bfloat16)


def nan_filled_blocks(*shapes_dtypes, device: str = "cuda") -> None:
    """Fill and free a NaN tensor of each ``(shape, dtype)``, so that the caching allocator hands those NaN-filled
    blocks to the next allocations of those sizes: a run that allocates its outputs (the default ``out``, the LSE)
    then starts from NaN, and a row it does not write cannot pass for a finite one. Call it right before the run."""
    blocks = [torch.full(shape, float("nan"), dtype=dtype, device=device) for shape, dtype in shapes_dtypes]
    del blocks


@pytest.fixture
def bf16_rows():
    """``make_bf16_rows``: ``bf16_rows(n, heads, d, gen, *, scale=1.0, mean_channel=3)``."""
    return make_bf16_rows


@pytest.fixture
def paged_batch():
    """``make_paged_batch``: ``paged_batch(recipe, head_dim, page_size, num_kv_heads, lengths, gen, *,
    extra_pages=5, k_mean_channel=3) -> PagedBatch``."""
    return make_paged_batch


@pytest.fixture
def large_mean_q():
    """``make_large_mean_q``: ``large_mean_q(n, heads, d, gen, *, device="cuda")``."""
    return make_large_mean_q


@pytest.fixture
def nan_blocks():
    """``nan_filled_blocks``: ``nan_blocks((shape, dtype), ...)`` right before a run that allocates its outputs."""
    return nan_filled_blocks
