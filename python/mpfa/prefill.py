"""Batch prefill/extend over the paged cache: FlashInfer's plan/run split.

    w = BatchPrefillWrapper(workspace)
    w.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16, recipe="qk4pv8")
    o = w.run(q, cache.layer(i))          # every layer reuses one plan

Each request's new chunk (qo rows) must already be appended: it is the last qo_len tokens of the
request's KV, and the causal mask is aligned to that end.
"""
from __future__ import annotations

import math

import torch

from mpfa_jit import UnknownKernelError

from .backend import resolve
from .paged_plan import check_heads, check_kv_matches, check_pages_fit, check_paged, reference_run
from .validation import check_tensor

Q_TILE = 128   # query rows per tile (one FP8 scale per tile and head)


def _check_workspace(workspace_buffer):
    check_tensor("workspace_buffer", workspace_buffer, dtypes=(torch.uint8,), ndim=1)


class BatchPrefillWrapper:
    """Ragged-batch prefill/extend attention with a cached prefix in a paged cache."""

    def __init__(self, workspace_buffer: torch.Tensor, *, backend: str = "auto"):
        _check_workspace(workspace_buffer)
        self.workspace_buffer = workspace_buffer
        self.requested_backend = backend
        self.backend: str | None = None   # what `plan` chose: 'cuda' or 'reference'
        self._plan = None

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
        if self.backend == "cuda":
            raise UnknownKernelError(
                f"no sm_90a batch-prefill kernel is built for recipe={recipe_.name}, head_dim={head_dim}, "
                f"page_size={page_size}, causal={causal} in this version of mpfa; pass backend='reference' "
                "to run the PyTorch reference")
        self._plan = dict(qo_indptr=qo_indptr, total_q=int(qo[-1]), paged=paged, num_qo_heads=num_qo_heads,
                          num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, causal=causal,
                          sm_scale=1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale),
                          recipe=recipe_, compensation=compensation)

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
        return reference_run(q, p["qo_indptr"], kv, p["paged"], out, return_lse, causal=p["causal"],
                             sm_scale=p["sm_scale"], recipe=p["recipe"], compensation=p["compensation"], q_tile=Q_TILE)
