"""Batch decode over the paged cache (one query token per request): FlashInfer's plan/run split.

    w = BatchDecodeWrapper(workspace)
    w.plan(kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16, recipe="qk4pv8")
    o = w.run(q, cache.layer(i))          # q: [batch, num_qo_heads, head_dim]

Decode does not smooth Q (one token: Q - mu_Q would be 0); Q stays bf16 against the dequantized cache.
qk4pv4 stores V rotated (V H): its kernel writes O_rot into a scratch tensor and ``run`` rotates it back into
``out`` with one bf16 GEMM (mpfa.recipes.u4h.rotate_back; no host sync, so CUDA graphs capture it too).

Kernel path (sm_90a, templates/decode.cu.jinja): split-KV with a merge kernel. ``plan`` validates,
chooses the number of KV splits (adaptive: whole waves of the CTAs an SM holds, each split at least
``MIN_TOKENS_PER_SPLIT`` tokens), builds the work list (``split_counts``, ``work_list``: each request's
splits, so a short request takes one CTA per KV head and a long one several), copies it and the page
table into capture-stable int32 buffers and builds/loads the kernel. ``run`` only launches: the grid
(work items x KV heads) is fixed by the plan and the kernel reads lengths, pages and the work list from
those buffers, so a CUDA graph captured around ``run`` replays correctly after ``plan`` is called again
(same batch size, same ``num_splits``, no more pages than the first plan's capacity) with new lengths:
plan reuses the same buffers and workspace.

``fixed_split_size`` (tokens, a multiple of ``TILE``; FlashInfer's name for the same knob) makes the
partition batch-invariant: every request is cut into splits of that size whatever the grid, so its
output is bit-identical between eager runs, CUDA-graph replays and any batch it shares (a server's
graphs-on and graphs-off runs then agree token for token).
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mpfa_jit import get_kernel
from mpfa_jit.ops import decode as decode_op

from .dispatch import (bind_cache_layer, data_ptr as _ptr, device_index, finish_output, kernel_arch, kernel_outputs,
                       resolve, with_reference_hint)
from .paged_plan import PagedBatch, check_heads, check_kv_matches, check_pages_fit, check_paged, reference_run
from .recipes import Recipe
from .validation import check_sm_scale, check_tensor, check_workspace, check_workspace_tensor

TILE = decode_op.TILE          # tokens per pipeline stage of the kernel; splits are whole tiles
MIN_TOKENS_PER_SPLIT = 256     # a split streams at least this many tokens (4 tiles)
MAX_SPLITS = 128
MAX_WORK_ITEMS = 65535        # the kernel's grid is (KV heads, work items): CUDA's y dimension
FILL = 0.85                    # the smallest grid considered holds this share of one wave of resident CTAs


def wave_efficiency(ctas: int, slots: int) -> float:
    """Share of the machine the last wave keeps busy on average: ``ctas`` CTAs over waves of ``slots``."""
    return ctas / (slots * -(-ctas // slots))


def choose_num_splits(batch_size: int, num_kv_heads: int, max_kv_len: int, num_sms: int, *,
                      ctas_per_sm: int | None = None, max_splits: int = MAX_SPLITS,
                      resident_ctas: int | None = None) -> int:
    """Adaptive partitioning by waves: the GPU runs ``slots = num_sms * per_sm`` CTAs of the kernel at once
    (``per_sm``: ``ctas_per_sm`` if given, else ``resident_ctas``, the CTAs one SM holds, else 2). Of the
    split counts from the smallest whose grid fills FILL of one wave to twice that, take the best wave
    efficiency (``wave_efficiency``, to 0.01; ties to fewer splits), never cutting a request into splits
    shorter than MIN_TOKENS_PER_SPLIT, and with no split left empty by the kernel's ceil-division of tiles.

    Why waves: decode is bandwidth-bound once most slots are busy, and a grid of 1.06 waves leaves a tail
    wave of a few CTAs that cannot draw the bandwidth (qk4pv8 14 x 128K: 5 splits 1.29x the best count, 4 or
    8 splits 1.00-1.02x; benchmarks/results/decode_splits_h200.json). The rule this replaced balanced CTAs
    over SMs at 2 per SM and ranked 1.39x the best count at bf16 14 x 128K (NOTES, "decode split count")."""
    ctas = batch_size * num_kv_heads
    per_sm = ctas_per_sm if ctas_per_sm is not None else (resident_ctas or 2)
    slots = num_sms * max(1, per_sm)
    tiles = -(-max_kv_len // TILE)
    if ctas <= 0 or tiles <= 1:
        return 1
    cap = max(1, min(max_splits, tiles * TILE // MIN_TOKENS_PER_SPLIT))
    s_min = max(1, math.ceil(FILL * slots / ctas))
    if s_min >= cap:
        best = cap
    else:
        best = max(range(s_min, min(cap, 2 * s_min) + 1),
                   key=lambda s: (round(wave_efficiency(ctas * s, slots), 2), -s))
    per_split = -(-tiles // best)
    return -(-tiles // per_split)   # the kernel's split count that leaves no split empty


def fixed_num_splits(max_kv_len: int, fixed_split_size: int) -> int:
    """Splits of ``fixed_split_size`` tokens the longest request of ``max_kv_len`` tokens needs (at least 1)."""
    return max(1, -(-max_kv_len // fixed_split_size))


def split_bucket(batch_size: int) -> int:
    """The batch size ``fixed_split_policy`` plans for: the next power of two. SGLang captures a decode
    graph for every power of two up to its largest graph batch, so a batch and the padded batch its
    graph replays fall in the same bucket."""
    return 1 << max(0, int(batch_size) - 1).bit_length()


@functools.lru_cache(maxsize=4096)   # a server asks every decode step; pure in its integer arguments
def fixed_split_policy(num_kv_heads: int, max_kv_len: int, num_sms: int, batch_size: int = 1, *,
                       resident_ctas: int | None = None) -> tuple[int, int]:
    """``(fixed_split_size, num_splits)`` for a server's decode: the split count ``choose_num_splits`` gives
    a batch of ``split_bucket(batch_size)`` requests of ``max_kv_len`` tokens, turned into a split size.
    Eager and CUDA-graph decode of a batch use the same size (same bucket), so each request is cut the same
    way in both and its output is bit-identical; the graph's grid (``num_splits`` covers ``max_kv_len``) is
    the adaptive plan's, with no more empty CTAs than before."""
    tiles = max(1, -(-max_kv_len // TILE))
    per = -(-tiles // choose_num_splits(split_bucket(batch_size), num_kv_heads, max_kv_len, num_sms,
                                        resident_ctas=resident_ctas))
    return per * TILE, -(-tiles // per)


# A batch counts as mixed below this share of ``requests x longest`` tokens: one of a single length keeps the wave
# rule's size, measured on the e2e batches (decode_splits_h200.json).
MIXED_BELOW = 0.75


def mixed_split_size(lengths: Sequence[int], budget: int) -> int | None:
    """The smallest split size (a multiple of TILE; at least MIN_TOKENS_PER_SPLIT, or one split of the longest
    request when that is shorter) that cuts requests of ``lengths`` tokens into at most ``budget`` work items
    (``sum(ceil(length / size))``); None when one item per request is already more."""
    if not lengths or len(lengths) > budget:   # before the per-request work: a server asks every decode step
        return None
    tiles = [max(1, -(-int(n) // TILE)) for n in lengths]
    lo, hi = max(1, MIN_TOKENS_PER_SPLIT // TILE), max(tiles)   # in tiles; hi always fits (one item each)
    lo = min(lo, hi)
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(-(-t // mid) for t in tiles) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return lo * TILE


def server_decode_splits(num_kv_heads: int, batch_size: int, longest: int, max_context_len: int,
                         num_sms: int, *, resident_ctas: int | None = None,
                         lengths: Sequence[int] | None = None) -> tuple[int, int]:
    """``(fixed_split_size, num_splits)`` for a server's decode step, eager or CUDA-graph replay: the split
    size ``fixed_split_policy`` gives this batch's ``longest`` request, the grid it gives the longest
    context the server admits (the splits per request a graph captured once must hold: its capacity is
    ``batch x num_splits`` work items). Both depend on the batch only through its size bucket, its longest
    request and ``lengths``, so the eager run and the graph replay of a batch cut every request the same way
    (bit-identical outputs), and a short batch is cut as finely as the adaptive plan would cut it, not as a
    128K-context batch (that was 1.9x slower at 32 x 32K).

    ``lengths``: the KV lengths of the batch's real requests (a graph's padding rows left out). A batch of
    mixed lengths, under MIXED_BELOW of ``requests x longest`` tokens, takes ``mixed_split_size`` when that is
    smaller, with a budget of one wave of resident CTAs per KV head (within the graph's capacity): the work
    list gives each request only the CTAs its tokens need, so sized from the longest alone, 32 requests of
    2K-64K got 32K-token splits, 1-2 CTAs per request in a wave of 528 slots and the long ones finishing
    alone (0.84 ms vs 0.53 at the best size, qk4pv8 on the H200)."""
    longest = max(1, int(longest))
    size, _ = fixed_split_policy(num_kv_heads, longest, num_sms, batch_size, resident_ctas=resident_ctas)
    _, grid = fixed_split_policy(num_kv_heads, max_context_len, num_sms, batch_size, resident_ctas=resident_ctas)
    # The grid's ceil-division can leave it a split or two short of the adaptive count for a shorter
    # batch: grow the size so the grid always covers the longest request (no remainder-laden last split).
    size = max(size, -(-longest // (grid * TILE)) * TILE)
    if lengths and sum(lengths) < MIXED_BELOW * len(lengths) * max(lengths):
        # The requests' items, not each request's, must fit the graph's capacity: the longest may take more
        # than num_splits of them when the short ones take fewer.
        wave = num_sms * max(1, resident_ctas or 2) // num_kv_heads
        mixed = mixed_split_size(lengths, min(len(lengths) * grid, wave))
        size = min(size, mixed) if mixed else size
    return size, grid


def _check_split_size(fixed_split_size) -> None:
    if fixed_split_size is not None and (not isinstance(fixed_split_size, int) or isinstance(fixed_split_size, bool)
                                         or fixed_split_size <= 0 or fixed_split_size % TILE):
        raise ValueError(f"fixed_split_size must be None or a positive multiple of {TILE} tokens, "
                         f"got {fixed_split_size!r}")


def split_counts(kv_lengths: Sequence[int] | None, batch_size: int, num_splits: int, tiles_per_split: int) -> list[int]:
    """Each request's work items (KV splits), at least 1: ``ceil(tiles / tiles_per_split)`` for a fixed split
    size, else the splits of ``ceil(tiles / num_splits)`` tiles that hold its tiles (the kernel's split size for
    that count is the same, and no item is left empty). Without host lengths, ``num_splits`` each: a list right
    for any lengths (the items past a request's tiles are empty, the last takes any remainder)."""
    if kv_lengths is None:
        return [num_splits] * batch_size
    counts = []
    for n in kv_lengths:
        tiles = -(-int(n) // TILE)
        per = tiles_per_split or max(1, -(-tiles // num_splits))
        counts.append(max(1, -(-tiles // per)))
    return counts


def work_list(counts: Sequence[int], capacity: int) -> torch.Tensor:
    """The kernel's work list (params.cuh) as one host int32 tensor: ``work_indptr`` [batch + 1] (request b owns
    items ``[indptr[b], indptr[b + 1])``, its splits in order), then ``work_request`` [capacity] (each item's
    request, -1 past the last item: those CTAs exit at once). ``capacity`` >= the batch size. Counts that do
    not fit are cut to the largest cap that does (the longest requests' last items take the remainders, correct
    but not the same sums as the uncut list: the server's rule never needs the cut)."""
    if sum(counts) > capacity:
        lo, hi = 1, max(counts)   # the largest cap c with sum(min(count, c)) <= capacity; 1 always fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if sum(min(c, mid) for c in counts) <= capacity else (lo, mid - 1)
        counts = [min(c, lo) for c in counts]
    total = sum(counts)
    indptr = [0, *itertools.accumulate(counts)]
    request = [b for b, c in enumerate(counts) for _ in range(c)] + [-1] * (capacity - total)
    return torch.tensor(indptr + request, dtype=torch.int32)


def workspace_bytes(capacity: int, batch_size: int, num_qo_heads: int, head_dim: int) -> int:
    """Bytes of workspace the kernel path needs for a grid of ``capacity`` work items: fp32 partial O and LSE per
    item (none when every request is one item: its CTA writes the output)."""
    if capacity <= batch_size:
        return 0
    return capacity * num_qo_heads * (head_dim + 1) * 4


@functools.lru_cache(maxsize=None)
def _kernel(recipe: str, head_dim: int, page_size: int, group_size: int, arch: str):
    """The library's ``mpfa_decode(const DecodeParams*, device, stream)``, its struct checked against
    ``decode_op.DecodeParams`` at load."""
    spec = decode_op.spec(recipe=recipe, head_dim=head_dim, page_size=page_size, group_size=group_size, arch=arch)
    return get_kernel(spec).params_fn(decode_op.SYMBOL, decode_op.PARAMS_LAYOUT_SYMBOL, decode_op.DecodeParams)


@functools.lru_cache(maxsize=None)
def resident_ctas(recipe: str, head_dim: int, page_size: int, group_size: int, device_index: int) -> int:
    """CTAs of that decode kernel one SM of the device holds at once (the CUDA occupancy calculator)."""
    arch = kernel_arch(torch.device("cuda", device_index))
    spec = decode_op.spec(recipe=recipe, head_dim=head_dim, page_size=page_size, group_size=group_size, arch=arch)
    query = get_kernel(spec).fn(decode_op.RESIDENT_SYMBOL, [ctypes.c_int, ctypes.c_void_p])
    out = ctypes.c_int(0)
    query(device_index, ctypes.addressof(out))
    return out.value


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_LOG2E = ctypes.c_float(1.4426950408889634).value


def score_scale(sm_scale: float) -> float:
    """``sm_scale * log2(e)`` rounded as the kernel's float32 product: the product of two float32 values is
    exact in a double, so one rounding to float32 (the ctypes field) gives the float32 product."""
    return ctypes.c_float(sm_scale).value * _LOG2E


@dataclass
class _PageTable:
    """Capture-stable int32 copies of the page table and the work list the kernel reads (the kernel path): a
    CUDA graph captured around ``run`` keeps their addresses, and ``plan`` / ``update_page_table`` refill them."""
    batch: int
    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    tiles_per_split: torch.Tensor   # one int: > 0 a fixed split size in tiles, 0 ceil(tiles / the request's items)
    work: torch.Tensor              # ``work_list``: work_indptr [batch + 1], then work_request

    @classmethod
    def allocate(cls, batch: int, num_indices: int, capacity: int, device: torch.device) -> "_PageTable":
        return cls(batch, torch.empty(batch + 1, dtype=torch.int32, device=device),
                   torch.zeros(max(1, num_indices), dtype=torch.int32, device=device),
                   torch.empty(batch, dtype=torch.int32, device=device),
                   torch.zeros(1, dtype=torch.int32, device=device),
                   torch.empty(batch + 1 + capacity, dtype=torch.int32, device=device))

    def fits(self, batch: int, num_indices: int, capacity: int, device: torch.device) -> bool:
        return (self.batch == batch and self.indices.numel() >= max(1, num_indices)
                and self.work.numel() >= batch + 1 + capacity and self.indices.device == device)

    def copy_from(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
                  work: torch.Tensor) -> None:
        """Copies on the current stream, no host synchronization (``work``: a host tensor)."""
        self.indptr.copy_(indptr, non_blocking=True)
        self.indices[: indices.numel()].copy_(indices, non_blocking=True)
        self.last_page_len.copy_(last_page_len, non_blocking=True)
        self.work[: work.numel()].copy_(work, non_blocking=True)


@dataclass
class DecodePlan:
    """What ``plan`` decided for one batch. The kernel-path fields are None on the reference path."""
    paged: PagedBatch
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    recipe: Recipe
    sm_scale: float
    num_splits: int | None = None           # the most work items (splits) a request takes
    capacity: int | None = None             # the grid's work items
    tiles_per_split: int = 0                # the fixed split size in tiles, 0 for none
    device_index: int | None = None
    launch: Callable | None = None          # the library's mpfa_decode (``_kernel``)
    # The kernel's arguments with the plan's fields (page table, grid, split size, workspace) set; each
    # run sets the query, cache layer and output fields and launches with it.
    params: decode_op.DecodeParams | None = None


class BatchDecodeWrapper:
    def __init__(self, workspace_buffer: torch.Tensor, *, backend: str = "auto"):
        check_workspace_tensor(workspace_buffer)
        self.workspace_buffer = workspace_buffer
        self.requested_backend = backend
        self.backend: str | None = None
        self._plan: DecodePlan | None = None
        self._buffers: _PageTable | None = None

    def plan(self, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, *, sm_scale: float | None = None, recipe: str = "qk4pv8",
             num_splits: int | None = None, fixed_split_size: int | None = None) -> None:
        """Host-side scheduling for one batch (may synchronize). ``num_splits=None`` chooses the KV
        split count adaptively and launches just the work items this batch needs; pass a fixed value to keep
        the grid (``batch x num_splits`` work items, the items past this batch's at its end) across plans (CUDA
        graphs). ``fixed_split_size``: cut each request into splits of this many tokens (a multiple of 64), at
        most ``num_splits`` of them (requests longer than ``num_splits * fixed_split_size`` give the remainder
        to the last split; when None, just enough splits for this batch's longest request)."""
        recipe_ = check_heads(num_qo_heads, num_kv_heads, head_dim, page_size, recipe)
        paged = check_paged(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size)
        if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool)
                                       or not 1 <= num_splits <= MAX_WORK_ITEMS):
            raise ValueError(f"num_splits must be None (adaptive) or an int in [1, {MAX_WORK_ITEMS}], "
                             f"got {num_splits!r}")
        _check_split_size(fixed_split_size)
        self.backend = resolve(self.requested_backend, paged_kv_indices.device)
        sm_scale = check_sm_scale(sm_scale, head_dim)
        plan = DecodePlan(paged, num_qo_heads, num_kv_heads, head_dim, page_size, recipe_, sm_scale)
        if self.backend == "cuda":
            group = num_qo_heads // num_kv_heads
            device = paged_kv_indices.device
            # Loaded once per specialization (cached); an unbuilt shape raises here, before any other work.
            launch = with_reference_hint(_kernel, recipe=recipe_.name, head_dim=head_dim, page_size=page_size,
                                         group_size=group, arch=kernel_arch(device))
            dev_index = device_index(device)
            batch = paged.batch_size
            tiles_per_split = 0 if fixed_split_size is None else fixed_split_size // TILE
            fixed_grid = num_splits is not None   # a graph's: batch x num_splits work items, whatever the lengths
            if not fixed_grid:
                max_len = max(paged.kv_lengths)
                num_splits = (fixed_num_splits(max_len, fixed_split_size) if tiles_per_split
                              else choose_num_splits(batch, num_kv_heads, max_len, _num_sms(dev_index),
                                                     resident_ctas=resident_ctas(recipe_.name, head_dim, page_size,
                                                                                 group, dev_index)))
            counts = split_counts(paged.kv_lengths, batch, num_splits, tiles_per_split)
            capacity = batch * num_splits if fixed_grid else sum(counts)
            if capacity > MAX_WORK_ITEMS:
                raise ValueError(f"batch {batch} needs {capacity} work items (KV splits over its requests, num_splits "
                                 f"{num_splits}); the decode grid holds at most {MAX_WORK_ITEMS}: plan fewer splits or "
                                 f"a larger fixed_split_size, or split the batch")
            need = workspace_bytes(capacity, batch, num_qo_heads, head_dim)
            check_workspace(self.workspace_buffer, device, need, f"batch {batch}, {num_qo_heads} query heads, "
                            f"head_dim {head_dim}, {capacity} work items")
            n_idx = paged_kv_indices.numel()
            buf = self._buffers
            if buf is None or not buf.fits(batch, n_idx, capacity, device):
                buf = self._buffers = _PageTable.allocate(batch, n_idx, capacity, device)
            buf.tiles_per_split.fill_(tiles_per_split)
            buf.copy_from(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, work_list(counts, capacity))
            # Workspace: fp32 partial O [items, Hq, D], then their log2 LSE [items, Hq].
            ws = self.workspace_buffer.data_ptr()
            o_part_bytes = capacity * num_qo_heads * head_dim * 4
            plan.params = decode_op.DecodeParams(
                indptr=buf.indptr.data_ptr(), indices=buf.indices.data_ptr(),
                last_page_len=buf.last_page_len.data_ptr(), num_kv_heads=num_kv_heads, num_items=capacity,
                batch=batch, work_indptr=buf.work.data_ptr(), work_request=buf.work[batch + 1:].data_ptr(),
                tiles_per_split=buf.tiles_per_split.data_ptr(), score_scale=score_scale(sm_scale),
                o_part=ws if need else None, lse_part=ws + o_part_bytes if need else None)
            plan.num_splits, plan.capacity, plan.tiles_per_split = num_splits, capacity, tiles_per_split
            plan.device_index, plan.launch = dev_index, launch
        self._plan = plan

    def update_page_table(self, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, *,
                          fixed_split_size: int | None = None, kv_lengths: Sequence[int] | None = None) -> None:
        """Refresh the planned batch's page table without synchronizing the host (CUDA-graph decode).

        Same batch size as the last ``plan``; the tables are device tensors (e.g. built on the GPU from a
        server's slot table) and are copied into the buffers the kernel reads, on the current stream.
        Only their shapes are checked: the values are trusted, as validating them would read them back.
        ``fixed_split_size`` (a multiple of 64) changes the split size the kernel reads from device memory,
        so a captured graph (its grid stays the plan's work items) cuts this batch as a plan for its lengths
        would; None keeps the current one. ``kv_lengths``: the requests' lengths on the host (the server
        knows them), from which the work list gives each request the splits its tokens need, as ``plan``
        does; None gives every request ``num_splits`` items (right for any lengths, on a grid planned with
        ``num_splits``). On the reference backend this plans again (the reference reads host-validated
        tables).
        """
        if self._plan is None:
            raise RuntimeError("BatchDecodeWrapper.update_page_table called before plan")
        _check_split_size(fixed_split_size)
        p = self._plan
        if self.backend != "cuda":
            self.plan(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, p.num_qo_heads, p.num_kv_heads,
                      p.head_dim, p.page_size, sm_scale=p.sm_scale, recipe=p.recipe.name)
            return
        buf = self._buffers
        batch = buf.batch
        index = (torch.int32, torch.int64)
        device = buf.indices.device
        check_tensor("paged_kv_indptr", paged_kv_indptr, dtypes=index, shape=(batch + 1,), device=device)
        check_tensor("paged_kv_indices", paged_kv_indices, dtypes=index, ndim=1, device=device)
        check_tensor("paged_kv_last_page_len", paged_kv_last_page_len, dtypes=index, shape=(batch,), device=device)
        if paged_kv_indices.numel() > buf.indices.numel():
            raise ValueError(f"paged_kv_indices has {paged_kv_indices.numel()} entries; the plan's buffer holds "
                             f"{buf.indices.numel()}: plan again with the larger table")
        if kv_lengths is not None and len(kv_lengths) != batch:
            raise ValueError(f"kv_lengths has {len(kv_lengths)} entries; the plan's batch is {batch}")
        tiles = p.tiles_per_split if fixed_split_size is None else fixed_split_size // TILE
        work = work_list(split_counts(kv_lengths, batch, p.num_splits, tiles), p.capacity)
        buf.copy_from(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, work)
        buf.tiles_per_split.fill_(tiles)
        p.tiles_per_split = tiles

    @property
    def num_splits(self) -> int | None:
        """KV splits of the current plan (kernel path), None on the reference path."""
        return None if self._plan is None else self._plan.num_splits

    def run(self, q: torch.Tensor, kv, *, out: torch.Tensor | None = None, return_lse: bool = False):
        """Attention of each request's query row over its pages. Returns o ``[batch, num_qo_heads,
        head_dim]`` bf16 (and LSE ``[batch, num_qo_heads]`` float32, natural log, with ``return_lse``).
        Kernel path: launches only (no synchronization), capturable in a CUDA graph."""
        if self._plan is None:
            raise RuntimeError("BatchDecodeWrapper.run called before plan")
        p = self._plan
        paged = p.paged
        check_kv_matches(kv, p.recipe, p.num_kv_heads, p.head_dim, p.page_size)
        check_pages_fit(paged, kv)
        shape = (paged.batch_size, p.num_qo_heads, p.head_dim)
        check_tensor("q", q, dtypes=(torch.bfloat16,), shape=shape, device=kv.device)
        if out is not None:
            check_tensor("out", out, dtypes=(torch.bfloat16,), shape=shape, device=kv.device)
        if self.backend == "cuda":
            return self._run_kernel(q, kv, out, return_lse)
        qo_indptr = torch.arange(paged.batch_size + 1, device=q.device)
        return reference_run(q, qo_indptr, kv, paged, out, return_lse, path="decode", causal=False,
                             sm_scale=p.sm_scale)

    def _run_kernel(self, q, kv, out, return_lse):
        p = self._plan
        written, lse = kernel_outputs(q, out, return_lse, kv)
        a = p.params
        a.q, a.q_stride_b, a.q_stride_h = q.data_ptr(), q.stride(0), q.stride(1)
        bind_cache_layer(a, kv)
        a.out, a.out_stride_b, a.out_stride_h, a.lse = written.data_ptr(), written.stride(0), written.stride(1), _ptr(lse)
        p.launch(ctypes.byref(a), p.device_index, torch.cuda.current_stream(q.device).cuda_stream)
        out = finish_output(written, kv, out)
        return (out, lse) if return_lse else out
