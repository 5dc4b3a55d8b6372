"""Batch decode over the paged cache (one query token per request): FlashInfer's plan/run split.

    w = BatchDecodeWrapper(workspace)
    w.plan(kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16, recipe="qk4pv8")
    o = w.run(q, cache.layer(i))          # q: [batch, num_qo_heads, head_dim]

Decode does not smooth Q (one token: Q - mu_Q would be 0); Q stays bf16 against the dequantized cache.
"""
from __future__ import annotations

import math

import torch

from mpfa_jit import UnknownKernelError

from .backend import resolve
from .paged_plan import check_heads, check_kv_matches, check_paged
from .prefill import _check_workspace
from .reference.attention import batch_attention
from .validation import check_tensor


class BatchDecodeWrapper:
    def __init__(self, workspace_buffer: torch.Tensor, *, backend: str = "auto"):
        _check_workspace(workspace_buffer)
        self.workspace_buffer = workspace_buffer
        self.requested_backend = backend
        self.backend: str | None = None
        self._plan = None

    def plan(self, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, *, sm_scale: float | None = None, recipe: str = "qk4pv8") -> None:
        recipe_ = check_heads(num_qo_heads, num_kv_heads, head_dim, page_size, recipe)
        paged = check_paged(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size)
        self.backend = resolve(self.requested_backend, paged_kv_indices.device)
        if self.backend == "cuda":
            raise UnknownKernelError(
                f"no sm_90a batch-decode kernel is built for recipe={recipe_.name}, head_dim={head_dim}, "
                f"page_size={page_size} in this version of mpfa; pass backend='reference' to run the PyTorch reference")
        self._plan = dict(paged=paged, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          page_size=page_size, recipe=recipe_,
                          sm_scale=1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale))

    def run(self, q: torch.Tensor, kv, *, out: torch.Tensor | None = None, return_lse: bool = False):
        if self._plan is None:
            raise RuntimeError("BatchDecodeWrapper.run called before plan")
        p = self._plan
        paged = p["paged"]
        check_kv_matches(kv, p["recipe"], p["num_kv_heads"], p["head_dim"], p["page_size"])
        check_tensor("q", q, dtypes=(torch.bfloat16,), shape=(paged.batch_size, p["num_qo_heads"], p["head_dim"]),
                     device=kv.device)
        if out is not None:
            check_tensor("out", out, dtypes=(torch.bfloat16,), shape=tuple(q.shape), device=kv.device)
        ids = paged.paged_kv_indices[: int(paged.paged_kv_indptr[-1])]
        k_pages, v_pages = kv.dequantize(pages=ids)
        local = torch.arange(ids.numel(), device=ids.device)
        qo_indptr = torch.arange(paged.batch_size + 1, device=q.device)
        o, lse = batch_attention(q, qo_indptr, k_pages, v_pages, paged.paged_kv_indptr, local,
                                 paged.paged_kv_last_page_len, causal=False, sm_scale=p["sm_scale"],
                                 dtype=torch.float32)
        o = o.to(torch.bfloat16)
        if out is not None:
            out.copy_(o)
            o = out
        return (o, lse) if return_lse else o
