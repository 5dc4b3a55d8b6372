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

Non-finite inputs (NaN, +-inf) are never hidden as zeros. Keys a row does not see (causal mask) never
affect it, and a row whose every visible key scores -inf counts as seeing no key (0 and LSE -inf), as
in the kernels' online softmax. Past that, the rule depends on the recipe, as in its kernels:

* :func:`attention` and the bf16 recipe: plain IEEE arithmetic on the values as given. A NaN in Q, K,
  V or ``sm_scale`` makes NaN every output it reaches. An inf in channel ``c`` of a key gives each
  (row, head) that sees it the score ``sign(q[c] * k[c]) * inf``, NaN where ``q[c]`` is 0: +inf or
  NaN makes that output and LSE NaN (``exp(inf - inf)``); -inf gives the key weight 0, so the row is
  that of attention without the key, save that the key's V still meets the 0 (``0 * inf`` and
  ``0 * NaN`` are NaN). An inf in Q or ``sm_scale`` acts through the scores the same way. An inf in
  channel ``c`` of a value gives +-inf or NaN in channel ``c`` of every output that sees the key
  (``p * inf``; NaN where ``p`` is 0 or where +inf and -inf meet), never a finite value.
* Quantized recipes (INT8 Q, quantized K and V): their caches store a non-finite K row's scale and a
  non-finite V element as NaN, so the arithmetic runs on copies with non-finite inputs replaced by 0,
  and then every output that depends on one is set to NaN:

  * a non-finite ``sm_scale``: every row that sees a key (output and LSE);
  * a non-finite element of a query row: that row and head, output and LSE, and, as INT8 Q shares
    factors, every row sharing the row's INT8 scale tile (``q_tile`` rows, same
    head) and, with compensation, every row of the request for that head (mu_Q is their mean);
  * a non-finite element of a key: output and LSE of every (row, head) that sees that key;
  * a non-finite element of a value: that channel of the output of every (row, head) that sees it.

  qk4pv4 stores V rotated (4-bit codes of V H, mpfa.recipes.u4h): a NaN or inf anywhere in an appended V row
  makes every group of the stored row NaN, so its dequantized V (KVCacheLayer.dequantize) is NaN in every
  channel, and the rule above makes every channel of each output that sees it NaN, as the kernels' output is
  once rotated back (O = O_rot H mixes all channels).

qk4pv4's V: the references take V dequantized and rotated back (``KVCacheLayer.dequantize``; prefill numerics:
``path="prefill"``, the FP8 image of the rotated values under ``v_scale``; decode: the fp16 values). Attention is
linear in V, so attention on ``V_rot H`` is the kernels' ``softmax(S) V_rot`` rotated back by the wrappers,
whatever P's rounding.
"""
from __future__ import annotations

import math

import torch

from ..recipes import Recipe, get_recipe
from ..recipes.fp8 import P_SCALE, quantize_e4m3
from ..recipes.int8 import (Q_TILE, comp_digits_q_scale, dequantize_q_per_tile, quantize_int, quantize_q_per_tile,
                            tile_scaled_k)

# Score elements per chunk of the reference, to bound its memory at long contexts.
_CHUNK_ELEMS = 1 << 26


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    kv_heads = x.shape[1]
    if heads % kv_heads:
        raise ValueError(f"num_qo_heads ({heads}) must be a multiple of num_kv_heads ({kv_heads})")
    return x.repeat_interleave(heads // kv_heads, dim=1) if heads != kv_heads else x


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _nonfinite_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``[..., D] -> [...]`` bool: rows holding a NaN or inf; None when every row is finite."""
    bad = ~torch.isfinite(x).all(dim=-1)
    return bad if bool(bad.any()) else None


def _marked_kv_operands(k, v, heads: int, dtype):
    """Quantized recipes' K and V: in ``dtype``, expanded to the query heads, non-finite elements set to
    0; with the keys that held one (``[m, H]``, None if none) and the V elements that did (``[m, H, D]``,
    None if none)."""
    k, v = k.to(dtype), v.to(dtype)
    key_bad = _nonfinite_rows(k)
    v_bad = ~torch.isfinite(v)
    v_bad = v_bad if bool(v_bad.any()) else None
    if key_bad is not None:
        k, key_bad = _finite(k), _expand_kv(key_bad, heads)
    if v_bad is not None:
        v, v_bad = _finite(v), _expand_kv(v_bad, heads)
    return _expand_kv(k, heads), _expand_kv(v, heads), key_bad, v_bad


def _causal_mask(rows: slice, n_q: int, n_kv: int, device) -> torch.Tensor:
    i = torch.arange(rows.start, rows.stop, device=device).unsqueeze(-1)
    j = torch.arange(n_kv, device=device).unsqueeze(0)
    return j > i + (n_kv - n_q)


def _values(v: torch.Tensor):
    """``(v with its non-finite elements set to 0, the keys holding one)``; ``(v, [])`` when all are finite."""
    bad = ~torch.isfinite(v)
    if not bool(bad.any()):
        return v, []
    return torch.where(bad, torch.zeros_like(v), v), bad.flatten(1).any(dim=1).nonzero().flatten().tolist()


def _pv(p, v, v_finite, v_bad_keys, mask):
    """``P [H, rows, keys] . V [keys, H, D] -> [rows, H, D]`` in IEEE arithmetic over the keys each row
    sees. The keys whose V holds a NaN or inf add their products one by one, so that a masked key adds
    nothing (in a matrix product its weight 0 would meet inf: NaN) while a visible one adds p * inf."""
    o = torch.einsum("hqk,khd->qhd", p, v_finite)
    for j in v_bad_keys:
        vj = v[j]
        term = p[:, :, j].transpose(0, 1).unsqueeze(-1) * torch.where(torch.isfinite(vj), torch.zeros_like(vj), vj)
        if mask is not None:
            term = term.masked_fill(mask[:, j].view(-1, 1, 1), 0.0)
        o = o + term
    return o


def _softmax_pv(s, v, v_finite, v_bad_keys, p_quant, mask):
    """s: [H, rows, keys] scaled scores; returns (o [rows, H, D], lse [rows, H]). A (row, head) whose
    visible keys all score -inf (or that sees none) gets 0 and -inf; a NaN or +inf score gives NaN."""
    if mask is not None:
        s = s.masked_fill(mask, -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    empty = torch.isneginf(m)                                  # [H, rows, 1]
    m = m.masked_fill(empty, 0.0)                              # exp(-inf - 0) = 0 there, not NaN
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    o = _pv(p_quant(p), v, v_finite, v_bad_keys, mask) / l.squeeze(-1).transpose(0, 1).unsqueeze(-1)
    lse = (m + torch.log(l)).squeeze(-1).transpose(0, 1)
    return o.masked_fill(empty.squeeze(-1).transpose(0, 1).unsqueeze(-1), 0.0), lse


def _poison(o, lse, seen, row_bad, key_bad, v_bad):
    """Quantized recipes: set to NaN the outputs (and LSEs) of one chunk of rows that depend on a
    non-finite input (module docstring). ``seen`` [rows, keys] is 1 where the row sees the key;
    ``row_bad`` [rows, H]."""
    sees_any = (seen.sum(dim=-1) > 0).unsqueeze(-1)            # [rows, 1]
    whole = torch.zeros_like(lse, dtype=torch.bool) if row_bad is None else row_bad.clone()
    if key_bad is not None:
        whole |= (seen @ key_bad.to(seen.dtype)) > 0
    whole &= sees_any
    nan = torch.full((), math.nan, dtype=o.dtype, device=o.device)
    lse = torch.where(whole, nan, lse)
    out_bad = whole.unsqueeze(-1)
    if v_bad is not None:
        out_bad = out_bad | (torch.einsum("qk,khd->qhd", seen, v_bad.to(seen.dtype)) > 0)
    return torch.where(out_bad, nan, o), lse


def _scores(q, k, rows):
    return torch.einsum("qhd,khd->hqk", q[rows], k)


def _run(q_eff, k, v, bias, *, causal, sm_scale, p_quant, row_bad=None, key_bad=None, v_bad=None):
    """Shared chunked loop, in IEEE arithmetic. q_eff [n, H, D], k/v [m, H, D] (expanded), bias [H, m]
    or None. Quantized recipes pass finite copies and ``row_bad`` [n, H], ``key_bad`` [m, H], ``v_bad``
    [m, H, D]: where the inputs they came from were not finite (None: nowhere); the outputs that
    depend on those are set to NaN."""
    n, heads = q_eff.shape[0], q_eff.shape[1]
    m = k.shape[0]
    o = q_eff.new_zeros((n, heads, v.shape[-1]))
    lse = q_eff.new_full((n, heads), -math.inf)
    if m == 0 or n == 0:   # no keys (or no queries): zeros and -inf, as documented
        return o, lse
    poisoned = any(t is not None for t in (row_bad, key_bad, v_bad))
    v_finite, v_bad_keys = _values(v)
    step = max(1, _CHUNK_ELEMS // max(1, heads * m))
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))
        s = _scores(q_eff, k, rows)
        if bias is not None:
            s = s + bias.unsqueeze(1)
        s = s * sm_scale
        mask = _causal_mask(rows, n, m, s.device) if causal else None
        o_rows, lse_rows = _softmax_pv(s, v, v_finite, v_bad_keys, p_quant, mask)
        if poisoned:
            seen = (~mask).to(o.dtype) if mask is not None else o.new_ones((rows.stop - rows.start, m))
            o_rows, lse_rows = _poison(o_rows, lse_rows, seen, None if row_bad is None else row_bad[rows],
                                       key_bad, v_bad)
        o[rows], lse[rows] = o_rows, lse_rows
    return o, lse


def attention(q, k, v, *, causal: bool, sm_scale: float | None = None, dtype=torch.float64):
    """Exact attention of one request in IEEE arithmetic (module docstring). q ``[n, H, D]``, k/v
    ``[m, H_kv, D]``; returns (o, lse) in ``dtype``."""
    heads, d = q.shape[1], q.shape[2]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    k, v = _expand_kv(k.to(dtype), heads), _expand_kv(v.to(dtype), heads)
    return _run(q.to(dtype), k, v, None, causal=causal, sm_scale=sm_scale, p_quant=lambda p: p)


def recipe_attention(q, k, v, *, recipe: "str | Recipe", causal: bool, sm_scale: float | None = None,
                     compensation: bool = True, q_tile: int = Q_TILE, p_scale: float = P_SCALE,
                     comp_digits: bool = False, dtype=torch.float64):
    """Attention of one request with ``recipe``'s quantization of Q and P (prefill numerics).

    q ``[n, H, D]`` as the model gives it (bf16); k/v ``[m, H_kv, D]`` dequantized from the cache.
    Quantized recipes: Q - mu_Q (mu_Q the mean of this request's rows per head, when
    ``compensation``) is quantized to INT8 with one scale per ``q_tile`` rows and head; the scores
    get ``mu_Q . K_j`` added back in ``dtype``; P goes to FP8 as ``e4m3(p * p_scale) / p_scale``
    (mpfa.recipes.fp8.P_SCALE; prefill builds with tile_scale, qk4pv8's served one, take P_SCALE_POW2).
    ``comp_digits`` (comp_mma builds, with compensation): one Q scale per head, mpfa.recipes.int8.comp_digits_q_scale;
    the keys' terms are added in ``dtype`` (the kernel rounds them to whole units of the QK product). The bf16
    recipe rounds P to bf16 before the PV product, as its kernel does. qk4pv4: ``v`` is the prefill path's V
    rotated back (module docstring), so the output is the rotated-back one. Non-finite inputs: module docstring.
    """
    recipe = get_recipe(recipe)
    heads, d = q.shape[1], q.shape[2]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    bias = key_bad = v_bad = None
    if recipe.quantized_q:
        k, v, key_bad, v_bad = _marked_kv_operands(k, v, heads, dtype)
        qf = q.float()
        row_bad = _nonfinite_rows(qf)
        if row_bad is not None:
            qf = _finite(qf)
            row_bad = _spread_over_shared_q_scales(row_bad, q_tile, compensation)
        if not math.isfinite(float(sm_scale)):   # every row depends on it (_poison spares rows that see no key)
            row_bad, sm_scale = torch.ones(q.shape[:2], dtype=torch.bool, device=q.device), 1.0
        mu = qf.mean(dim=0) if (compensation and q.shape[0] > 0) else qf.new_zeros(qf.shape[1:])
        q_eff = torch.empty_like(qf, dtype=dtype)
        for h in range(heads):
            if comp_digits and compensation:
                x = qf[:, h] - mu[h]
                scale = comp_digits_q_scale(x.abs().amax() if x.numel() else x.new_zeros(()), mu[h].abs().sum())
                q_eff[:, h] = quantize_int(x, scale).to(dtype) * scale.to(dtype)
                continue
            q8, scale = quantize_q_per_tile(qf[:, h] - mu[h], q_tile)
            q_eff[:, h] = dequantize_q_per_tile(q8.to(dtype), scale.to(dtype), q_tile)
        if compensation:
            bias = torch.einsum("hd,khd->hk", mu.to(dtype), k)

        def p_quant(p):
            return quantize_e4m3(p * p_scale, 1.0).to(dtype) / p_scale
    else:
        k, v = _expand_kv(k.to(dtype), heads), _expand_kv(v.to(dtype), heads)
        q_eff, row_bad = q.to(torch.bfloat16).to(dtype), None

        def p_quant(p):
            return p.to(torch.bfloat16).to(dtype)
    return _run(q_eff, k, v, bias, causal=causal, sm_scale=sm_scale, p_quant=p_quant, row_bad=row_bad,
                key_bad=key_bad, v_bad=v_bad)


def _spread_over_shared_q_scales(row_bad: torch.Tensor, q_tile: int, compensation: bool) -> torch.Tensor:
    """``[n, H]``: the rows a non-finite Q element reaches through INT8 Q's shared factors: its scale
    tile (``q_tile`` rows of one head) and, with compensation, mu_Q (every row of the head)."""
    n = row_bad.shape[0]
    if compensation:
        return row_bad.any(dim=0, keepdim=True).expand(n, -1)
    tile = torch.arange(n, device=row_bad.device) // q_tile
    tile_bad = torch.zeros((int(tile[-1]) + 1, row_bad.shape[1]), dtype=torch.bool, device=row_bad.device)
    tile_bad.index_put_((tile,), row_bad, accumulate=True)
    return tile_bad[tile]


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
                    compensation: bool = True, q_tile: int = Q_TILE, p_scale: float = P_SCALE,
                    comp_digits: bool = False, k_tile: int | None = None, k_operand_pages=None,
                    dtype=torch.float64):
    """Ragged batch over a paged cache. ``k_pages``/``v_pages`` are dequantized ``[pages, H_kv, P, D]``.

    ``recipe=None`` gives exact attention; a recipe adds its Q/P quantization (:func:`recipe_attention`, with
    ``q_tile``, ``p_scale`` and ``comp_digits``). ``k_tile`` (a recipe with INT8 K): keys under one scale per
    ``k_tile`` keys of each request, as a tile_scale prefill build scores them: ``k_operand_pages`` = (INT8 rows
    ``[pages, H_kv, P, D]``, per-token scales ``[pages, H_kv, P]``) (mpfa.KVCacheLayer.k_operand) requantized per
    tile (mpfa.recipes.int8.tile_scaled_k) stand in for ``k_pages``.
    Returns (o ``[total_q, H, D]``, lse ``[total_q, H]``) in ``dtype``.
    """
    if k_tile is not None and (recipe is None or k_operand_pages is None):
        raise ValueError("batch_attention: k_tile needs a recipe and k_operand_pages (INT8 K rows and their scales)")
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
        if k_tile is None:
            kb = gather_pages(k_pages, ids, m).to(q.device)
        else:
            ints, scales = (gather_pages(x, ids, m).to(q.device) for x in k_operand_pages)
            kb = tile_scaled_k(ints, scales, k_tile, dtype)
        vb = gather_pages(v_pages, ids, m).to(q.device)
        if recipe is None:
            o[rows], lse[rows] = attention(q[rows], kb, vb, causal=causal, sm_scale=sm_scale, dtype=dtype)
        else:
            o[rows], lse[rows] = recipe_attention(q[rows], kb, vb, recipe=recipe, causal=causal, sm_scale=sm_scale,
                                                  compensation=compensation, q_tile=q_tile, p_scale=p_scale,
                                                  comp_digits=comp_digits, dtype=dtype)
    return o, lse
