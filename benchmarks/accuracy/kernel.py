"""Kernel-level accuracy: each recipe's attention output against fp64 exact attention.

For one input (Q of the last ``q_len`` tokens, K/V of all ``context`` tokens, bf16) and one
configuration (recipe, compensation, K smoothing):

1. K/V go through the real cache path: :class:`mpfa.PagedKVCache` (pages in a shuffled order),
   ``cache.calibrate`` (mu_K and V channel scales from the same K/V, as the first prefill would fix
   them), :func:`mpfa.append_kv` (backend ``reference`` on CPU, ``auto`` = the append kernel on a
   GPU). "Without K smoothing" calibrates only V: the cache's mu_K is left at 0.
2. Prefill: :class:`mpfa.BatchPrefillWrapper` runs the chunk of ``q_len`` queries over the paged
   cache, causal, with or without Q smoothing + rank-one compensation (the kernel on a GPU when one
   is built; otherwise the reference, and the row's ``attn_backend`` / ``note`` say so).
   Decode: :class:`mpfa.BatchDecodeWrapper` runs the last ``decode_batch`` query tokens, each a
   request over its own prefix of the same pages (decode has no compensation: Q stays bf16).
3. Reference: :func:`mpfa.reference.attention` in float64 on the original (unquantized) bf16 K/V.

Metrics (:mod:`.metrics`): relative L2, cosine similarity, max abs error.
"""
from __future__ import annotations

import math

import torch

from mpfa_jit.ops.prefill import RECIPES

PAGE_SIZE = 16


def configs(recipes=RECIPES) -> list[dict]:
    """(recipe, compensation, smoothing) to evaluate: bf16 once, each quantized recipe 2 x 2."""
    out = []
    for r in recipes:
        if r == "bf16":
            out.append({"recipe": r, "compensation": None, "smoothing": None})
        else:
            for smooth in (True, False):
                for comp in (True, False):
                    out.append({"recipe": r, "compensation": comp, "smoothing": smooth})
    return out


# ---------------------------------------------------------------------------------------------
# inputs

def synthetic(context: int, q_len: int, heads: int, kv_heads: int, head_dim: int, *, outliers: bool,
              variance_outliers: bool = True, seed: int = 0, device="cpu"):
    """Random bf16 Q ``[q_len, H, D]`` (the last q_len positions) and K/V ``[context, H_kv, D]``.

    ``outliers``: as in real LLM activations, a few channels (spread over different 16-channel
    blocks) carry a large mean in both Q and K (signs per head), a few others a large variance,
    and V has a few large-variance channels (``variance_outliers=False``: only the mean outliers).
    Without it every element is N(0, 1).
    """
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(q_len, heads, head_dim, generator=g)
    k = torch.randn(context, kv_heads, head_dim, generator=g)
    v = torch.randn(context, kv_heads, head_dim, generator=g)
    if outliers:
        step = head_dim // 4
        mean_ch = [3 + i * step for i in range(4)]              # one per quarter of head_dim
        var_ch = [3 + step // 2 + i * step for i in range(4)]   # other 16-channel blocks (head_dim 128)
        group = heads // kv_heads
        sign = torch.where(torch.rand(kv_heads, len(mean_ch), generator=g) < 0.5, -1.0, 1.0)
        k[:, :, mean_ch] += 10.0 * sign
        q[:, :, mean_ch] += 16.0 * sign.repeat_interleave(group, dim=0)
        if variance_outliers:
            k[:, :, var_ch] *= 6.0
            q[:, :, var_ch] *= 3.0
            v[:, :, var_ch] *= 8.0
        q = q * 0.5                                            # keep softmax neither flat nor one-hot
    return (q.to(torch.bfloat16).to(device), k.to(torch.bfloat16).to(device), v.to(torch.bfloat16).to(device))


# ---------------------------------------------------------------------------------------------
# the cache path

def _workspace(device, prefill_need: int = 0):
    """Decode splits fit in 128 MiB; the prefill kernel's tile images grow with the context."""
    size = max(128 << 20, prefill_need) if torch.device(device).type == "cuda" else 1
    return torch.empty(size, dtype=torch.uint8, device=device)


def build_cache(recipe: str, k: torch.Tensor, v: torch.Tensor, *, smoothing: bool, page_size: int = PAGE_SIZE,
                seed: int = 0):
    """A one-layer cache holding ``k, v`` in shuffled pages. Returns (cache, page_order, append_backend)."""
    import mpfa
    m, kv_heads, d = k.shape
    device = k.device
    n_pages = -(-m // page_size)
    cache = mpfa.PagedKVCache(recipe, num_layers=1, num_pages=n_pages, page_size=page_size, num_kv_heads=kv_heads,
                              head_dim=d, device=device)
    if cache.recipe.quantized_k or cache.recipe.quantized_v:
        cache.calibrate(0, k, v)
        if not smoothing and cache.mu_k is not None:
            cache.mu_k[0].zero_()
    g = torch.Generator().manual_seed(seed + 1)
    order = torch.randperm(n_pages, generator=g).to(device)
    t = torch.arange(m, device=device)
    slots = order[t // page_size] * page_size + t % page_size
    backend = "auto" if device.type == "cuda" else "reference"
    ran = mpfa.append_kv(k.contiguous(), v.contiguous(), cache.layer(0), slots, backend=backend)
    return cache, order, ran


def _prefill_plan(w, order, m, q_len, heads, kv_heads, d, page_size, recipe, compensation, sm_scale):
    dev = order.device
    n_pages = -(-m // page_size)
    w.plan(torch.tensor([0, q_len], dtype=torch.int32, device=dev), torch.tensor([0, n_pages], dtype=torch.int32, device=dev),
           order.to(torch.int32), torch.tensor([m - (n_pages - 1) * page_size], dtype=torch.int32, device=dev),
           heads, kv_heads, d, page_size, causal=True, recipe=recipe, compensation=bool(compensation), sm_scale=sm_scale)


def run_prefill(cache, order, q, m: int, *, compensation: bool, sm_scale=None):
    """O ``[q_len, H, D]`` bf16 of the prefill wrapper (kernel if built, else reference) and (backend, note)."""
    import mpfa
    from mpfa_jit import UnknownKernelError
    layer = cache.layer(0)
    q_len, heads, d = q.shape
    args = (order, m, q_len, heads, cache.num_kv_heads, d, cache.page_size, cache.recipe.name, compensation, sm_scale)
    note = None
    if q.device.type == "cuda":
        need = mpfa.prefill.workspace_bytes(1, heads, cache.num_kv_heads, d, [m], cache.recipe.name,
                                            bool(compensation), q_len)
        w = mpfa.BatchPrefillWrapper(_workspace(q.device, need))
        try:
            _prefill_plan(w, *args)
        except UnknownKernelError as e:
            note = f"no prefill kernel: reference on GPU ({str(e)[:80]})"
            w = None
    else:
        w = None
    if w is None:
        w = mpfa.BatchPrefillWrapper(_workspace(q.device), backend="reference")
        _prefill_plan(w, *args)
    o = w.run(q.contiguous(), layer)
    return o, w.backend, note


def run_decode(cache, order, q_last, m: int, *, sm_scale=None):
    """Decode of ``q_last [B, H, D]``: request b is the token at position m - B + b, over keys
    0..m-B+b (a prefix of the same shuffled pages). Returns (o ``[B, H, D]``, backend)."""
    import mpfa
    B, heads, d = q_last.shape
    ps = cache.page_size
    dev = q_last.device
    lens = [m - B + 1 + b for b in range(B)]
    indptr, indices, last = [0], [], []
    for L in lens:
        n = -(-L // ps)
        indices.append(order[:n])
        indptr.append(indptr[-1] + n)
        last.append(L - (n - 1) * ps)
    w = mpfa.BatchDecodeWrapper(_workspace(dev), backend="auto" if dev.type == "cuda" else "reference")
    w.plan(torch.tensor(indptr, dtype=torch.int32, device=dev), torch.cat(indices).to(torch.int32),
           torch.tensor(last, dtype=torch.int32, device=dev), heads, cache.num_kv_heads, d, ps,
           recipe=cache.recipe.name, sm_scale=sm_scale)
    return w.run(q_last.contiguous(), cache.layer(0)), w.backend


def reference(q, k, v, sm_scale=None) -> torch.Tensor:
    """fp64 exact causal attention of the last ``q_len`` queries over all keys (bottom-right aligned)."""
    from mpfa.reference import attention
    o, _ = attention(q, k, v, causal=True, sm_scale=sm_scale, dtype=torch.float64)
    return o


# ---------------------------------------------------------------------------------------------
# one input, every configuration

def evaluate(inputs, cfgs, *, decode_batch: int = 64, sm_scale=None, seed: int = 0, progress=None) -> list[dict]:
    """Rows for one source. ``inputs`` is a list of (q, k, v) sharing one context length (one per
    layer for real activations, one for synthetic); every error is accumulated over the list."""
    from .metrics import ErrorAccumulator
    refs = [reference(q, k, v, sm_scale) for q, k, v in inputs]
    B = min(decode_batch, inputs[0][0].shape[0])
    rows = []
    by_cache: dict = {}
    for cfg in cfgs:
        key = (cfg["recipe"], cfg["smoothing"])
        by_cache.setdefault(key, []).append(cfg)
    for (recipe, smoothing), group in by_cache.items():
        pre = {id(c): ErrorAccumulator() for c in group}
        pre_backend, notes = {}, set()
        dec = ErrorAccumulator()
        dec_backend = append_backend = None
        for (q, k, v), ref in zip(inputs, refs):
            cache, order, append_backend = build_cache(recipe, k, v, smoothing=bool(smoothing), seed=seed)
            for c in group:
                o, backend, note = run_prefill(cache, order, q, k.shape[0], compensation=bool(c["compensation"]), sm_scale=sm_scale)
                pre[id(c)].add(o, ref)
                pre_backend[id(c)] = backend
                if note:
                    notes.add(note)
            if B:
                o, dec_backend = run_decode(cache, order, q[-B:], k.shape[0], sm_scale=sm_scale)
                dec.add(o, ref[-B:])
            del cache
            if progress:
                progress()
        for c in group:
            rows.append({**c, "op": "prefill", **pre[id(c)].result(), "per_layer_rel_l2": pre[id(c)].per_part
                         if len(inputs) > 1 else None, "append_backend": append_backend,
                         "attn_backend": pre_backend[id(c)], "note": "; ".join(sorted(notes)) or None})
        if B:
            rows.append({"recipe": recipe, "compensation": None, "smoothing": smoothing, "op": "decode",
                         **dec.result(), "per_layer_rel_l2": dec.per_part if len(inputs) > 1 else None,
                         "append_backend": append_backend, "attn_backend": dec_backend, "note": None,
                         "decode_batch": B})
    return rows


def synthetic_rows(context: int, *, q_len: int, heads: int, kv_heads: int, head_dim: int, outliers: bool,
                   device, recipes=RECIPES, seed: int = 0, decode_batch: int = 64) -> list[dict]:
    src = "outlier" if outliers else "gaussian"
    q_len = min(q_len, context)
    inputs = [synthetic(context, q_len, heads, kv_heads, head_dim, outliers=outliers, seed=seed, device=device)]
    rows = evaluate(inputs, configs(recipes), decode_batch=decode_batch, seed=seed)
    shape = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    return [_finish(r, src, context, q_len, shape) for r in rows]


def activation_rows(captured, context: int, *, q_len: int, recipes=RECIPES, source="kjv-activations",
                    decode_batch: int = 64, seed: int = 0) -> list[dict]:
    """Rows for Q/K/V captured from every layer (``captured``: list of (q, k, v) ``[T, H, D]`` per
    layer, T >= context), evaluated on the first ``context`` tokens, last ``q_len`` as queries."""
    q_len = min(q_len, context)
    inputs = [(q[context - q_len:context], k[:context], v[:context]) for q, k, v in captured]
    rows = evaluate(inputs, configs(recipes), decode_batch=decode_batch, seed=seed)
    q0 = captured[0][0]
    shape = {"heads": q0.shape[1], "kv_heads": captured[0][1].shape[1], "head_dim": q0.shape[2],
             "layers": len(captured)}
    return [_finish(r, source, context, q_len, shape) for r in rows]


def _finish(r, source, context, q_len, shape) -> dict:
    comp = r["compensation"]
    sm = r["smoothing"]
    tag = "" if r["recipe"] == "bf16" else f"/smooth{int(bool(sm))}" + ("" if comp is None else f"/comp{int(comp)}")
    row = {"id": f"kernel/{r['op']}/{source}/{context}/{r['recipe']}{tag}", "kind": "kernel", "source": source,
           "context": context, "q_len": q_len if r["op"] == "prefill" else r.get("decode_batch"), **shape, **r,
           "status": "ok"}
    row.pop("decode_batch", None)
    if row.get("per_layer_rel_l2") is None:
        row.pop("per_layer_rel_l2")
    for k in ("rel_l2", "cos", "max_abs"):
        if isinstance(row.get(k), float) and not math.isfinite(row[k]):
            row["status"] = "error"
    return row
