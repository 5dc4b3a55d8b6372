"""Batch prefill/extend over the paged cache: FlashInfer's plan/run split.

    w = BatchPrefillWrapper(workspace)
    w.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16, recipe="qk4pv8")
    o = w.run(q, cache.layer(i))          # every layer reuses one plan

Each request's new chunk (qo rows) must already be appended: it is the last qo_len tokens of the
request's KV, and the causal mask is aligned to that end.

Kernel path (sm_90a, templates/prefill.cu.jinja): wgmma (QGMMA for the FP8 recipes, HGMMA for bf16),
one CTA per (request, 128-row query tile, query head). ``plan`` validates, builds the tile list
(longest KV first), copies the page table and tile list into int32 device buffers, carves mu_Q and
the compensation vector out of the workspace, and builds/loads the kernel. ``run`` only launches
(pre-passes mu_Q and c = mu_Q . K~ when compensation is on, then the main kernel): no host sync.
"""
from __future__ import annotations

import functools
import math

import torch

from mpfa_jit import UnknownKernelError, get_kernel
from mpfa_jit.ops import prefill as prefill_op

from .backend import data_ptr as _ptr, device_index, kernel_arch, kernel_outputs, resolve
from .paged_plan import check_heads, check_kv_matches, check_pages_fit, check_paged, reference_run
from .validation import check_tensor, check_workspace, check_workspace_tensor

Q_TILE = 128   # query rows per tile (one FP8 scale per tile and head); the kernel's CTA rows
_ALIGN = 256


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def workspace_bytes(batch_size: int, num_qo_heads: int, head_dim: int, total_kv: int, compensation: bool) -> int:
    """Workspace the kernel path needs: mu_Q [batch, Hq, D] and c [Hq, total_kv] (fp32), with
    compensation on a quantized recipe; nothing otherwise."""
    if not compensation:
        return 0
    return _align(batch_size * num_qo_heads * head_dim * 4) + _align(num_qo_heads * total_kv * 4)


def tile_schedule(qo_lens, kv_lengths, causal: bool) -> list[tuple[int, int]]:
    """(request, query tile) pairs, the longest KV range first (a simple longest-job-first order for
    the grid). A causal tile sees keys up to its last row's diagonal."""
    tiles = []
    for b, (nq, nkv) in enumerate(zip(qo_lens, kv_lengths)):
        for t in range(-(-nq // Q_TILE)):
            last_row = min(nq, (t + 1) * Q_TILE)
            work = min(nkv, last_row + nkv - nq) if causal else nkv
            tiles.append((work, b, t))
    tiles.sort(key=lambda x: (-x[0], x[1], x[2]))
    return [(b, t) for _, b, t in tiles]


@functools.lru_cache(maxsize=None)
def _kernel(recipe: str, head_dim: int, page_size: int, arch: str):
    spec = prefill_op.spec(recipe=recipe, head_dim=head_dim, page_size=page_size, arch=arch)
    return get_kernel(spec).fn(prefill_op.SYMBOL, prefill_op.ARGTYPES)


class BatchPrefillWrapper:
    """Ragged-batch prefill/extend attention with a cached prefix in a paged cache."""

    def __init__(self, workspace_buffer: torch.Tensor, *, backend: str = "auto"):
        check_workspace_tensor(workspace_buffer)
        self.workspace_buffer = workspace_buffer
        self.requested_backend = backend
        self.backend: str | None = None   # what `plan` chose: 'cuda' or 'reference'
        self._plan = None
        self._buffers = None   # capture-stable int32 page-table / tile-list copies (kernel path)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, *, causal: bool = True, sm_scale: float | None = None,
             recipe: str = "qk4pv8", compensation: bool = True) -> None:
        """Host-side scheduling for one batch (may synchronize). Raises for a missing kernel."""
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
        sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
        plan = dict(qo_indptr=qo_indptr, total_q=int(qo[-1]), paged=paged, num_qo_heads=num_qo_heads,
                    num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, causal=causal,
                    sm_scale=sm_scale, recipe=recipe_, compensation=compensation)
        if self.backend == "cuda":
            group = num_qo_heads // num_kv_heads
            if not prefill_op.supported(recipe=recipe_.name, head_dim=head_dim, page_size=page_size,
                                        group_size=group):
                raise UnknownKernelError(
                    f"no sm_90a batch-prefill kernel is built for recipe={recipe_.name}, head_dim={head_dim}, "
                    f"page_size={page_size}, group size {group} (num_qo_heads / num_kv_heads): built for "
                    f"head_dim {list(prefill_op.HEAD_DIMS)}, page_size {list(prefill_op.PAGE_SIZES)}, group sizes "
                    f"1..{prefill_op.MAX_GROUP}; pass backend='reference' to run the PyTorch reference")
            plan.update(self._plan_kernel(qo, qo_lens, paged, device, recipe_, num_qo_heads, num_kv_heads, head_dim,
                                          page_size, causal, compensation))
        self._plan = plan

    def _plan_kernel(self, qo, qo_lens, paged, device, recipe_, num_qo_heads, num_kv_heads, head_dim, page_size,
                     causal, compensation):
        dev_index = device_index(device)
        batch = paged.batch_size
        kv_lengths = paged.kv_lengths
        total_kv = sum(kv_lengths)
        compensate = bool(compensation and recipe_.quantized_q)
        need = workspace_bytes(batch, num_qo_heads, head_dim, total_kv, compensate)
        check_workspace(self.workspace_buffer, device, need, f"batch {batch}, {num_qo_heads} query heads, "
                        f"head_dim {head_dim}, {total_kv} KV tokens, compensation")
        fn = _kernel(recipe_.name, head_dim, page_size, kernel_arch(device))
        tiles = tile_schedule(qo_lens, kv_lengths, causal)
        kv_offset = [0]
        for n in kv_lengths[:-1]:
            kv_offset.append(kv_offset[-1] + n)
        host = dict(qo_indptr=qo.to(torch.int32), kv_indptr=paged.paged_kv_indptr.cpu().to(torch.int32),
                    indices=paged.paged_kv_indices.cpu().to(torch.int32),
                    last_page_len=paged.paged_kv_last_page_len.cpu().to(torch.int32),
                    kv_offset=torch.tensor(kv_offset, dtype=torch.int32),
                    tile_req=torch.tensor([b for b, _ in tiles] or [0], dtype=torch.int32),
                    tile_q=torch.tensor([t for _, t in tiles] or [0], dtype=torch.int32))
        buf = self._buffers
        if buf is None or any(buf[k].device != device or buf[k].numel() < max(1, v.numel()) for k, v in host.items()):
            buf = {k: torch.zeros(max(1, v.numel()), dtype=torch.int32, device=device) for k, v in host.items()}
            self._buffers = buf
        for k, v in host.items():
            if v.numel():
                buf[k][: v.numel()].copy_(v, non_blocking=True)
        mu = comp = None
        if compensate:
            ws = self.workspace_buffer
            mu_bytes = batch * num_qo_heads * head_dim * 4
            mu = ws[:mu_bytes].view(torch.float32)
            comp_off = _align(mu_bytes)
            comp = ws[comp_off: comp_off + max(4, num_qo_heads * total_kv * 4)].view(torch.float32)
        comp_grid_x = max(1, min(4096, -(-max(kv_lengths + [1]) // 8)))
        return dict(fn=fn, device_index=dev_index, num_tiles=len(tiles), total_kv=total_kv, mu=mu, comp=comp,
                    comp_grid_x=comp_grid_x)

    def run(self, q: torch.Tensor, kv, *, out: torch.Tensor | None = None, return_lse: bool = False):
        """Attention of ``q [total_q, num_qo_heads, head_dim]`` (bf16) over ``kv``; returns o (and lse)."""
        if self._plan is None:
            raise RuntimeError("BatchPrefillWrapper.run called before plan")
        p = self._plan
        check_kv_matches(kv, p["recipe"], p["num_kv_heads"], p["head_dim"], p["page_size"])
        check_pages_fit(p["paged"], kv)
        check_tensor("q", q, dtypes=(torch.bfloat16,), shape=(p["total_q"], p["num_qo_heads"], p["head_dim"]),
                     device=kv.device)
        if out is not None:
            check_tensor("out", out, dtypes=(torch.bfloat16,), shape=tuple(q.shape), device=kv.device)
        if self.backend == "cuda":
            return self._run_kernel(q, kv, out, return_lse)
        return reference_run(q, p["qo_indptr"], kv, p["paged"], out, return_lse, causal=p["causal"],
                             sm_scale=p["sm_scale"], recipe=p["recipe"], compensation=p["compensation"], q_tile=Q_TILE)

    def _run_kernel(self, q, kv, out, return_lse):
        p, buf = self._plan, self._buffers
        out, lse = kernel_outputs(q, out, return_lse)
        f = kv.fields
        p["fn"](q.data_ptr(), q.stride(0), q.stride(1), f["k"].data_ptr(), _ptr(f.get("k_block_scale")),
                _ptr(f.get("k_scale")), f["v"].data_ptr(), _ptr(kv.v_scale), buf["qo_indptr"].data_ptr(),
                buf["kv_indptr"].data_ptr(), buf["indices"].data_ptr(), buf["last_page_len"].data_ptr(),
                buf["kv_offset"].data_ptr(), buf["tile_req"].data_ptr(), buf["tile_q"].data_ptr(), p["num_tiles"],
                p["paged"].batch_size, p["num_qo_heads"], p["num_kv_heads"], p["total_kv"], p["comp_grid_x"],
                int(p["causal"]), p["sm_scale"], _ptr(p["mu"]), _ptr(p["comp"]), out.data_ptr(), out.stride(0),
                out.stride(1), _ptr(lse), p["device_index"], torch.cuda.current_stream(q.device).cuda_stream)
        return (out, lse) if return_lse else out
