"""Batch prefill/extend over the paged cache: FlashInfer's plan/run split.

    w = BatchPrefillWrapper(workspace)
    w.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16, recipe="qk4pv8")
    o = w.run(q, cache.layer(i))          # every layer reuses one plan

Each request's new chunk (qo rows) must already be appended: it is the last qo_len tokens of the
request's KV, and the causal mask is aligned to that end.

Kernel path (sm_90a, templates/prefill.cu.jinja): a pre-pass turns the request's paged, compressed
K/V into MMA-ready tile images in the workspace (INT8 or bf16 K, transposed V, per-key factors and
the compensation terms), then a warp-specialized wgmma kernel (quantized recipes: IGMMA for QK, QGMMA
for PV; HGMMA for bf16) runs one CTA per (query tile, query head). Every recipe's served build
(mpfa_jit/ops/prefill.py SERVED_KNOBS) takes 192-row query tiles (three consumer warpgroups); qk4pv8's also reads
K under one scale per 128-key tile and adds the compensation as one more INT8 k-step of the QK MMA under one
Q scale per (request, head). ``plan`` validates, builds the query-tile list (longest KV first) and
the KV-tile list, copies them and the page table into int32 device buffers, carves the workspace, and
builds/loads the kernel. ``run`` only launches: no host sync. qk4pv4 (V stored rotated, V H): the kernel writes
O_rot into a scratch tensor and ``run`` rotates it back into ``out`` with one bf16 GEMM (mpfa.recipes.u4h.rotate_back).
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from mpfa_jit import get_kernel
from mpfa_jit.ops import prefill as prefill_op

from .dispatch import (bind_cache_layer, data_ptr as _ptr, device_index, finish_output, kernel_arch, kernel_outputs,
                       resolve, with_reference_hint)
from .paged_plan import PagedBatch, check_heads, check_kv_matches, check_pages_fit, check_paged, reference_run
from .recipes import Recipe
from .validation import check_sm_scale, check_tensor, check_workspace, check_workspace_tensor

_ALIGN = 256   # byte alignment of each workspace section


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


# The tile sizes (query rows per CTA, keys per KV tile image, query rows per mu_Q block) are the kernel build's:
# prefill_op.CTA_ROWS, KV_TILE and MU_ROWS, rendered into its template; read here at call time.


def mu_blocks(qo_lens) -> int:
    return -(-max(qo_lens, default=0) // prefill_op.MU_ROWS)


def kv_tiles(kv_lengths, recipe: str) -> list[int]:
    """Number of KV tile images of each request (the same for every recipe; ``recipe`` is checked)."""
    if recipe not in prefill_op.RECIPES:
        raise ValueError(f"recipe must be one of {list(prefill_op.RECIPES)}, got {recipe!r}")
    return [-(-n // prefill_op.KV_TILE) for n in kv_lengths]


def workspace_layout(batch_size: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, kv_lengths,
                     recipe: str, compensation: bool, max_qo_len: int = 0) -> dict[str, tuple[int, int]]:
    """Byte (offset, size) of each workspace section the kernel path uses: the K and V^T tile images
    (n_kv_tiles x Hkv x KV_TILE x head_dim elements each), the per-key factors fa (quantized
    recipes), and with compensation mu_Q [batch, Hq, D], its partial sums [blocks of MU_ROWS rows of
    the longest chunk (``max_qo_len``; at most the longest KV), batch, Hq, D] and the per-key terms: fb
    [n_kv_tiles, Hq, KV_TILE] (fp32), or in comp_mma builds (qk4pv8's served one) each head's Q scale
    inputs q_head [batch, Hq, 2] (fp32) and the digit images cd [n_kv_tiles, Hq, KV_TILE x COMP_DIGITS bytes]."""
    return _workspace_layout(batch_size, num_qo_heads, num_kv_heads, head_dim, kv_lengths, recipe, compensation,
                             max_qo_len, knobs=None)


def _workspace_layout(batch_size: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, kv_lengths,
                      recipe: str, compensation: bool, max_qo_len: int = 0, *,
                      knobs: dict | None) -> dict[str, tuple[int, int]]:
    """workspace_layout of a kernel build: ``knobs`` None the served one, else a study variant's
    (mpfa_jit/ops/prefill.py build_knobs; benchmarks and tests only)."""
    n = sum(kv_tiles(kv_lengths, recipe))
    img = prefill_op.image_bytes(recipe, head_dim)
    sizes = {"k_img": n * num_kv_heads * img["k"], "v_img": n * num_kv_heads * img["v"]}
    if img["fa"]:
        sizes["fa"] = n * num_kv_heads * img["fa"]
        if compensation:
            sizes["mu"] = batch_size * num_qo_heads * head_dim * 4
            rows = max_qo_len or max(kv_lengths, default=0)
            sizes["mu_part"] = mu_blocks([rows]) * batch_size * num_qo_heads * head_dim * 4
            if prefill_op.build_knobs(recipe, knobs)["comp_mma"]:
                sizes["q_head"] = batch_size * num_qo_heads * 2 * 4
                sizes["cd"] = n * num_qo_heads * img["cd"]
            else:
                sizes["fb"] = n * num_qo_heads * img["fa"]
    layout, off = {}, 0
    for name, size in sizes.items():
        layout[name] = (off, size)
        off = _align(off + size)
    return layout


def workspace_bytes(batch_size: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, kv_lengths,
                    recipe: str, compensation: bool, max_qo_len: int = 0) -> int:
    """Workspace the kernel path needs (see workspace_layout): about 2 bytes per K/V element of the
    batch's keys for the FP8 recipes (4 for bf16), plus, with compensation, 32 bytes per key and query head
    (qk4pv8's served build: its compensation digits; 4 with per-key terms)."""
    return _workspace_bytes(batch_size, num_qo_heads, num_kv_heads, head_dim, kv_lengths, recipe, compensation,
                            max_qo_len, knobs=None)


def _workspace_bytes(batch_size: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, kv_lengths,
                     recipe: str, compensation: bool, max_qo_len: int = 0, *, knobs: dict | None) -> int:
    """workspace_bytes of a kernel build (``knobs``: _workspace_layout)."""
    return _layout_bytes(_workspace_layout(batch_size, num_qo_heads, num_kv_heads, head_dim, kv_lengths, recipe,
                                           compensation, max_qo_len, knobs=knobs))


def _layout_bytes(layout: dict[str, tuple[int, int]]) -> int:
    return _align(max((o + n for o, n in layout.values()), default=0))


def tile_schedule(qo_lens, kv_lengths, causal: bool, q_tile: int) -> list[tuple[int, int]]:
    """(request, query tile) pairs, the longest KV range first (a simple longest-job-first order for
    the grid). A causal tile sees keys up to its last row's diagonal. ``q_tile``: query rows per CTA of the
    kernel (prefill_op.CTA_ROWS)."""
    tiles = []
    for b, (nq, nkv) in enumerate(zip(qo_lens, kv_lengths)):
        for t in range(-(-nq // q_tile)):
            last_row = min(nq, (t + 1) * q_tile)
            work = min(nkv, last_row + nkv - nq) if causal else nkv
            tiles.append((work, b, t))
    tiles.sort(key=lambda x: (-x[0], x[1], x[2]))
    return [(b, t) for _, b, t in tiles]


def reference_numerics(recipe: str, knobs: dict | None, kv) -> dict:
    """mpfa.reference.batch_attention's keyword arguments for what a prefill build computes over all of cache layer
    ``kv``'s pages (``knobs``: the build's, None the served one; mpfa_jit/ops/prefill.py numerics), K's INT8 rows and
    scales included when the build reads K under one scale per tile (the oracle of the tests and studies; the
    reference backend passes only the batch's pages)."""
    kw = prefill_op.numerics(recipe, prefill_op.build_knobs(recipe, knobs))
    if kw.get("k_tile"):
        kw["k_operand_pages"] = kv.k_operand()
    return kw


@functools.lru_cache(maxsize=None)
def _kernel(recipe: str, head_dim: int, page_size: int, group_size: int, arch: str, knobs: tuple):
    """The library's entry point (``bind``); ``group_size`` is checked against the tested range, not built in;
    ``knobs``: the build's, as sorted (name, value) pairs."""
    spec = prefill_op.spec(recipe=recipe, head_dim=head_dim, page_size=page_size, group_size=group_size, arch=arch,
                           knobs=dict(knobs))
    return bind(get_kernel(spec))


def bind(module):
    """The entry point of a loaded prefill library, ``f(params, device, stream)``; raises KernelAbiError when the
    library's PrefillParams differs from prefill_op.PrefillParams."""
    return module.params_fn(prefill_op.SYMBOL, prefill_op.PARAMS_LAYOUT_SYMBOL, prefill_op.PrefillParams)


@dataclass
class KernelPlan:
    """The kernel path's part of a plan: the bound entry point and its arguments with every plan-time field set
    (page table and tile lists, counts, scale, workspace sections); ``run`` sets the per-call pointers."""
    fn: object
    device_index: int
    params: prefill_op.PrefillParams
    sections: dict[str, torch.Tensor]   # the workspace views params points into (mu_blocks > 0: compensation)


@dataclass
class PrefillPlan:
    qo_indptr: torch.Tensor
    total_q: int
    paged: PagedBatch
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    causal: bool
    sm_scale: float
    recipe: Recipe
    compensation: bool
    knobs: dict                        # the kernel build's (prefill_op.build_knobs): its schedule and numerics
    kernel: KernelPlan | None = None   # None on the reference backend


class BatchPrefillWrapper:
    """Ragged-batch prefill/extend attention with a cached prefix in a paged cache."""

    def __init__(self, workspace_buffer: torch.Tensor, *, backend: str = "auto"):
        check_workspace_tensor(workspace_buffer)
        self.workspace_buffer = workspace_buffer
        self.requested_backend = backend
        self.backend: str | None = None   # what `plan` chose: 'cuda' or 'reference'
        self._plan: PrefillPlan | None = None
        self._buffers = None   # capture-stable int32 page-table / tile-list copies (kernel path)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, *, causal: bool = True, sm_scale: float | None = None,
             recipe: str = "qk4pv8", compensation: bool = True) -> None:
        """Host-side scheduling for one batch (may synchronize). Raises for a missing kernel. Runs the recipe's
        served kernel build (mpfa_jit/ops/prefill.py SERVED_KNOBS)."""
        self._plan_study(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                         num_kv_heads, head_dim, page_size, causal=causal, sm_scale=sm_scale, recipe=recipe,
                         compensation=compensation, knobs=None)

    def _plan_study(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads: int,
                    num_kv_heads: int, head_dim: int, page_size: int, *, causal: bool = True,
                    sm_scale: float | None = None, recipe: str = "qk4pv8", compensation: bool = True,
                    knobs: dict | None) -> None:
        """``plan`` with a study variant of the kernel: ``knobs`` set over the recipe's served ones
        (mpfa_jit/ops/prefill.py KNOBS, build_knobs; None: the served build), whose numerics the reference
        backend follows too. Not public API: benchmarks (benchmarks/prefill_variants.py) and tests only."""
        recipe_ = check_heads(num_qo_heads, num_kv_heads, head_dim, page_size, recipe)
        paged = check_paged(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size)
        check_tensor("qo_indptr", qo_indptr, dtypes=(torch.int32, torch.int64), shape=(paged.batch_size + 1,))
        qo = qo_indptr.cpu()
        if qo[0] != 0 or bool((qo[1:] < qo[:-1]).any()):
            raise ValueError(f"qo_indptr must start at 0 and never decrease, got {qo.tolist()[:8]}...")
        qo_lens = (qo[1:] - qo[:-1]).tolist()
        for b, (nq, nkv) in enumerate(zip(qo_lens, paged.kv_lengths)):
            if nq > nkv:
                raise ValueError(f"request {b} has {nq} query rows but only {nkv} KV tokens: append the new chunk's "
                                 "K/V to the cache before run (its queries are the last qo_len tokens)")
        if not isinstance(causal, bool) or not isinstance(compensation, bool):
            raise ValueError(f"causal and compensation must be bool, got {causal!r}, {compensation!r}")
        device = paged_kv_indices.device
        self.backend = resolve(self.requested_backend, device)
        sm_scale = check_sm_scale(sm_scale, head_dim)
        knobs = prefill_op.build_knobs(recipe_.name, knobs)
        plan = PrefillPlan(qo_indptr=qo_indptr, total_q=int(qo[-1]), paged=paged, num_qo_heads=num_qo_heads,
                           num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, causal=causal,
                           sm_scale=sm_scale, recipe=recipe_, compensation=compensation, knobs=knobs)
        if self.backend == "cuda":
            group = num_qo_heads // num_kv_heads
            # Loaded once per specialization (cached); an unbuilt shape raises here, before any other work.
            fn = with_reference_hint(_kernel, recipe=recipe_.name, head_dim=head_dim, page_size=page_size,
                                     group_size=group, arch=kernel_arch(device), knobs=tuple(sorted(knobs.items())))
            plan.kernel = self._plan_kernel(fn, qo, qo_lens, paged, device, recipe_, num_qo_heads, num_kv_heads,
                                            head_dim, causal, sm_scale, compensation, knobs)
        self._plan = plan

    def _plan_kernel(self, fn, qo, qo_lens, paged, device, recipe_, num_qo_heads, num_kv_heads, head_dim, causal,
                     sm_scale, compensation, knobs) -> KernelPlan:
        dev_index = device_index(device)
        batch = paged.batch_size
        kv_lengths = paged.kv_lengths
        compensate = bool(compensation and recipe_.quantized_q)
        max_qo = max(qo_lens, default=0)
        layout = _workspace_layout(batch, num_qo_heads, num_kv_heads, head_dim, kv_lengths, recipe_.name, compensate,
                                   max_qo, knobs=knobs)
        need = _layout_bytes(layout)
        check_workspace(self.workspace_buffer, device, need, f"batch {batch}, {num_qo_heads} query / {num_kv_heads} "
                        f"KV heads, head_dim {head_dim}, {sum(kv_lengths)} KV tokens, recipe {recipe_.name}"
                        + (", compensation" if compensate else ""))
        tiles = tile_schedule(qo_lens, kv_lengths, causal, prefill_op.CTA_ROWS)
        counts = kv_tiles(kv_lengths, recipe_.name)
        kv_tile_base, kvt_req, kvt_idx = [], [], []
        for b, n in enumerate(counts):
            kv_tile_base.append(len(kvt_req))
            kvt_req += [b] * n
            kvt_idx += range(n)
        i32 = functools.partial(torch.tensor, dtype=torch.int32)
        host = dict(qo_indptr=qo.to(torch.int32), kv_indptr=paged.paged_kv_indptr.cpu().to(torch.int32),
                    indices=paged.paged_kv_indices.cpu().to(torch.int32),
                    last_page_len=paged.paged_kv_last_page_len.cpu().to(torch.int32),
                    kv_tile_base=i32(kv_tile_base), tile_req=i32([b for b, _ in tiles] or [0]),
                    tile_q=i32([t for _, t in tiles] or [0]), kvt_req=i32(kvt_req or [0]),
                    kvt_idx=i32(kvt_idx or [0]))
        buf = self._buffers
        if buf is None or any(buf[k].device != device or buf[k].numel() < max(1, v.numel()) for k, v in host.items()):
            buf = {k: torch.zeros(max(1, v.numel()), dtype=torch.int32, device=device) for k, v in host.items()}
            self._buffers = buf
        for k, v in host.items():
            if v.numel():
                buf[k][: v.numel()].copy_(v, non_blocking=True)
        ws = self.workspace_buffer
        sections = {name: ws[off: off + max(16, size)] for name, (off, size) in layout.items()}
        params = prefill_op.PrefillParams(
            qo_indptr=buf["qo_indptr"].data_ptr(), kv_indptr=buf["kv_indptr"].data_ptr(),
            indices=buf["indices"].data_ptr(), last_page_len=buf["last_page_len"].data_ptr(),
            kv_tile_base=buf["kv_tile_base"].data_ptr(), tile_req=buf["tile_req"].data_ptr(),
            tile_q=buf["tile_q"].data_ptr(), kvt_req=buf["kvt_req"].data_ptr(), kvt_idx=buf["kvt_idx"].data_ptr(),
            num_tiles=len(tiles), num_kv_tiles=len(kvt_req), batch=batch, num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, causal=int(causal), sm_scale=sm_scale,
            mu_blocks=mu_blocks(qo_lens) if compensate else 0, mu_part=_ptr(sections.get("mu_part")),
            mu=_ptr(sections.get("mu")), k_img=_ptr(sections.get("k_img")), v_img=_ptr(sections.get("v_img")),
            fa=_ptr(sections.get("fa")), fb=_ptr(sections.get("fb")), q_head=_ptr(sections.get("q_head")),
            cd_img=_ptr(sections.get("cd")))
        return KernelPlan(fn=fn, device_index=dev_index, params=params, sections=sections)

    def run(self, q: torch.Tensor, kv, *, out: torch.Tensor | None = None, return_lse: bool = False):
        """Attention of ``q [total_q, num_qo_heads, head_dim]`` (bf16) over ``kv``; returns o (and lse)."""
        if self._plan is None:
            raise RuntimeError("BatchPrefillWrapper.run called before plan")
        p = self._plan
        check_kv_matches(kv, p.recipe, p.num_kv_heads, p.head_dim, p.page_size)
        check_pages_fit(p.paged, kv)
        check_tensor("q", q, dtypes=(torch.bfloat16,), shape=(p.total_q, p.num_qo_heads, p.head_dim),
                     device=kv.device)
        if out is not None:
            check_tensor("out", out, dtypes=(torch.bfloat16,), shape=tuple(q.shape), device=kv.device)
        if self.backend == "cuda":
            return self._run_kernel(q, kv, out, return_lse)
        return reference_run(q, p.qo_indptr, kv, p.paged, out, return_lse, path="prefill", causal=p.causal,
                             sm_scale=p.sm_scale,
                             recipe=p.recipe, compensation=p.compensation, **prefill_op.numerics(p.recipe.name, p.knobs))

    def _run_kernel(self, q, kv, out, return_lse):
        k = self._plan.kernel
        written, lse = kernel_outputs(q, out, return_lse, kv)
        a = k.params
        a.q, a.q_stride_t, a.q_stride_h = q.data_ptr(), q.stride(0), q.stride(1)
        bind_cache_layer(a, kv)
        a.out, a.out_stride_t, a.out_stride_h, a.lse = written.data_ptr(), written.stride(0), written.stride(1), _ptr(lse)
        k.fn(ctypes.byref(a), k.device_index, torch.cuda.current_stream(q.device).cuda_stream)
        out = finish_output(written, kv, out)
        return (out, lse) if return_lse else out
