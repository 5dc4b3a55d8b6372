"""Reference attention in PyTorch: the oracle every kernel is tested against. Runs on CPU or GPU.

* :func:`attention` is exact attention of one request in a chosen precision (float64 by default).
* :func:`recipe_attention` is the same with a recipe's on-the-fly quantization of Q (per tile, after
  Q smoothing, plus the rank-one compensation) and of P (FP8 after exp2, or bf16), so it shows what
  a recipe costs beyond its cache. K and V come in already dequantized from the cache.
* :func:`batch_attention` runs either over a ragged batch whose keys live in a paged cache.

Causal masks are aligned bottom-right: query row i of a chunk of ``n`` rows over ``m`` keys sees keys
``j <= i + m - n`` (the chunk is the last ``n`` tokens of the sequence). LSE is the natural log of
the softmax denominator (scores already multiplied by ``sm_scale``); a row that sees no key gets
output 0 and LSE -inf.
"""
from __future__ import annotations

import math

import torch

from ..recipes import Recipe, get_recipe
from ..recipes.fp8 import E4M3_MAX, quantize_e4m3, quantize_per_tile

# P is quantized as e4m3(p * P_SCALE) / P_SCALE: p <= 1 after subtracting the row max, so the max maps
# to the top of E4M3 (SageAttention's static offset).
P_SCALE = E4M3_MAX
# Score elements per chunk of the reference, to bound its memory at long contexts.
_CHUNK_ELEMS = 1 << 26


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    kv_heads = x.shape[1]
    if heads % kv_heads:
        raise ValueError(f"num_qo_heads ({heads}) must be a multiple of num_kv_heads ({kv_heads})")
    return x.repeat_interleave(heads // kv_heads, dim=1) if heads != kv_heads else x


def _causal_mask(rows: slice, n_q: int, n_kv: int, device) -> torch.Tensor:
    i = torch.arange(rows.start, rows.stop, device=device).unsqueeze(-1)
    j = torch.arange(n_kv, device=device).unsqueeze(0)
    return j > i + (n_kv - n_q)


def _softmax_pv(s, v, p_quant, mask):
    """s: [H, rows, keys] scaled scores; returns (o [rows, H, D], lse [rows, H])."""
    if mask is not None:
        s = s.masked_fill(mask, -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    pq = p_quant(p)
    o = torch.einsum("hqk,khd->qhd", pq, v) / l.squeeze(-1).transpose(0, 1).unsqueeze(-1).clamp_min(1e-300)
    o = torch.where(l.squeeze(-1).transpose(0, 1).unsqueeze(-1) > 0, o, torch.zeros_like(o))
    lse = (m + torch.log(l)).squeeze(-1).transpose(0, 1)
    return o, lse


def _scores(q, k, rows):
    return torch.einsum("qhd,khd->hqk", q[rows], k)


def _run(q_eff, k, v, bias, *, causal, sm_scale, p_quant):
    """Shared chunked loop. q_eff [n, H, D], k/v [m, H, D] (expanded), bias [H, m] or None."""
    n, heads = q_eff.shape[0], q_eff.shape[1]
    m = k.shape[0]
    o = q_eff.new_zeros((n, heads, v.shape[-1]))
    lse = q_eff.new_full((n, heads), -math.inf)
    if m == 0 or n == 0:   # no keys (or no queries): zeros and -inf, as documented
        return o, lse
    step = max(1, _CHUNK_ELEMS // max(1, heads * m))
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))
        s = _scores(q_eff, k, rows)
        if bias is not None:
            s = s + bias.unsqueeze(1)
        s = s * sm_scale
        mask = _causal_mask(rows, n, m, s.device) if causal else None
        o[rows], lse[rows] = _softmax_pv(s, v, p_quant, mask)
    return o, lse


def attention(q, k, v, *, causal: bool, sm_scale: float | None = None, dtype=torch.float64):
    """Exact attention of one request. q ``[n, H, D]``, k/v ``[m, H_kv, D]``; returns (o, lse) in ``dtype``."""
    heads, d = q.shape[1], q.shape[2]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    k = _expand_kv(k.to(dtype), heads)
    v = _expand_kv(v.to(dtype), heads)
    return _run(q.to(dtype), k, v, None, causal=causal, sm_scale=sm_scale, p_quant=lambda p: p)


def recipe_attention(q, k, v, *, recipe: "str | Recipe", causal: bool, sm_scale: float | None = None,
                     compensation: bool = True, q_tile: int = 128, dtype=torch.float64):
    """Attention of one request with ``recipe``'s quantization of Q and P (prefill numerics).

    q ``[n, H, D]`` as the model gives it (bf16); k/v ``[m, H_kv, D]`` dequantized from the cache.
    Quantized recipes: Q - mu_Q (mu_Q the mean of this request's rows per head, when
    ``compensation``) is quantized to FP8 with one scale per ``q_tile`` rows and head; the scores
    get ``mu_Q . K_j`` added back in ``dtype``; P goes to FP8 as ``e4m3(p * 448) / 448``. The bf16
    recipe rounds P to bf16 before the PV product, as its kernel does.
    """
    recipe = get_recipe(recipe)
    heads, d = q.shape[1], q.shape[2]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    k = _expand_kv(k.to(dtype), heads)
    v = _expand_kv(v.to(dtype), heads)
    bias = None
    if recipe.quantized_q:
        qf = q.float()
        mu = qf.mean(dim=0) if (compensation and q.shape[0] > 0) else qf.new_zeros(qf.shape[1:])
        q_eff = torch.empty_like(qf, dtype=dtype)
        for h in range(heads):
            q8, scale = quantize_per_tile(qf[:, h] - mu[h], q_tile)
            per_row = scale.repeat_interleave(q_tile)[: q.shape[0]].unsqueeze(-1)
            q_eff[:, h] = q8.to(dtype) * per_row.to(dtype)
        if compensation:
            bias = torch.einsum("hd,khd->hk", mu.to(dtype), k)

        def p_quant(p):
            return quantize_e4m3(p * P_SCALE, 1.0).to(dtype) / P_SCALE
    else:
        q_eff = q.to(torch.bfloat16).to(dtype)

        def p_quant(p):
            return p.to(torch.bfloat16).to(dtype)
    return _run(q_eff, k, v, bias, causal=causal, sm_scale=sm_scale, p_quant=p_quant)


def gather_pages(pages: torch.Tensor, page_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` tokens of the listed pages: ``[pages, H, P, ...] -> [tokens, H, ...]``."""
    sel = pages[page_ids.long()]                       # [n_pages, H, P, ...]
    sel = sel.transpose(1, 2)                          # [n_pages, P, H, ...]
    return sel.reshape(-1, *sel.shape[2:])[:num_tokens]


def request_kv_lengths(paged_kv_indptr, paged_kv_last_page_len, page_size: int) -> list[int]:
    n_pages = (paged_kv_indptr[1:] - paged_kv_indptr[:-1]).tolist()
    last = paged_kv_last_page_len.tolist()
    return [0 if n == 0 else (n - 1) * page_size + l for n, l in zip(n_pages, last)]


def batch_attention(q, qo_indptr, k_pages, v_pages, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                    *, causal: bool, sm_scale: float | None = None, recipe: "str | Recipe | None" = None,
                    compensation: bool = True, q_tile: int = 128, dtype=torch.float64):
    """Ragged batch over a paged cache. ``k_pages``/``v_pages`` are dequantized ``[pages, H_kv, P, D]``.

    ``recipe=None`` gives exact attention; a recipe adds its Q/P quantization (:func:`recipe_attention`).
    Returns (o ``[total_q, H, D]``, lse ``[total_q, H]``) in ``dtype``.
    """
    page_size = k_pages.shape[2]
    lengths = request_kv_lengths(paged_kv_indptr, paged_kv_last_page_len, page_size)
    qo = qo_indptr.tolist()
    kv = paged_kv_indptr.tolist()
    o = torch.zeros((q.shape[0], q.shape[1], v_pages.shape[-1]), dtype=dtype, device=q.device)
    lse = torch.full((q.shape[0], q.shape[1]), -math.inf, dtype=dtype, device=q.device)
    for b, m in enumerate(lengths):
        rows = slice(qo[b], qo[b + 1])
        if rows.stop == rows.start:
            continue
        ids = paged_kv_indices[kv[b]:kv[b + 1]]
        kb = gather_pages(k_pages, ids, m).to(q.device)
        vb = gather_pages(v_pages, ids, m).to(q.device)
        if recipe is None:
            o[rows], lse[rows] = attention(q[rows], kb, vb, causal=causal, sm_scale=sm_scale, dtype=dtype)
        else:
            o[rows], lse[rows] = recipe_attention(q[rows], kb, vb, recipe=recipe, causal=causal, sm_scale=sm_scale,
                                                  compensation=compensation, q_tile=q_tile, dtype=dtype)
    return o, lse
