"""Decode suite: one query token per request over a paged KV cache (issue shapes, head_dim 128,
32 query / 8 KV heads), mpfa per recipe beside FlashInfer's BatchDecodeWithPagedKVCacheWrapper.

Decode is memory-bound on the cache: bytes = the batch's tokens x KV heads x bytes per token-head
(K and V with their per-token scales) plus Q and O; the fraction is against the same-run HBM read
ceiling. Caches are far larger than L2 (the smallest, 1 x 128K qk4pv8, is 214 MB), so no rotation.

Beside the batches of one length, mixed-length batches (``SPREAD_SHAPES``: lengths spread evenly up to the
longest, as a server's running batch under a load of 1K-64K prompts), where the split plan's balance across
requests shows (ids end ``/spread``; kept out of the one-length figures and the plot).
"""
from __future__ import annotations

import random
from pathlib import Path

from benchmarks.suites import _rows
from mpfa.recipes import get_recipe
from mpfa_jit.ops.decode import RECIPES

NAME = "decode"
RESULT = "decode_h200"

QO_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SERVER_CONTEXT = 131072   # the SGLang backend's graph grid covers this context (server_decode_splits)
SHAPES = ((1, 131072), (8, 131072), (32, 32768), (128, 8192), (256, 4096))   # (batch, context)
PAGE_SIZES = (16, 1)
# the other page sizes the kernels serve, mpfa only and at the headline shape: every page size has a measured row
OTHER_PAGE_SIZES = (32, 64)
# FlashInfer NVFP4 KV: 64 B K + 64 B V values and 8 + 8 B of E4M3 block scales.
BYTES_PER_TOKEN_HEAD = {**{r: get_recipe(r).bytes_per_token_head(HEAD_DIM) for r in RECIPES},
                        "fi-bf16": 512, "fi-fp8": 256, "fi-nvfp4": 144}
HEADLINE = (32, 32768, 16)     # the comparison point
# (batch, longest) of mixed-length batches, page 16: SGLang's bench_serving load (prompts of 1K-64K tokens)
# decodes ~30-50 such requests at once; a 128K server holds fewer, longer ones.
SPREAD_SHAPES = ((32, 65536), (16, 131072))
SPREAD_IMPLS = (("mpfa", RECIPES), ("mpfa-graph", ("qk4pv8",)), ("flashinfer", ("fi-bf16", "fi-fp8")))
BIG = 256 * 1024               # batch x context from which the 80% bandwidth target applies

TABLE = [
    ("impl", "impl", "{}"),
    ("kv", "recipe", "{}"),
    ("batch", "batch", "{}"),
    ("context", "context", "{}"),
    ("lengths", "lengths", "{}"),
    ("page", "page_size", "{}"),
    ("splits", "num_splits", "{}"),
    ("ms", "ms", "{:.4f}"),
    ("GB/s", "gbps", "{:,.0f}"),
    ("of HBM read", "hbm_fraction", "{:.2f}"),
    ("rel-L2 vs fp64", "rel_l2", "{:.1e}"),
    ("spread", "spread", "{:.1%}"),
    ("status", "status", "{}"),
    ("note", "reason", lambda s: str(s)[:60]),
]


def _case(impl, recipe, batch, context, page_size, spread=False):
    """A case; ``spread``: the batch's lengths are ``spread_lengths(batch, context)``, else all ``context``."""
    case = {"id": f"{impl}/{recipe}/b{batch}/ctx{context}/page{page_size}" + ("/spread" if spread else ""),
            "kind": "kernel", "impl": impl, "recipe": recipe, "batch": batch, "context": context,
            "page_size": page_size, "qo_heads": QO_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM}
    if spread:
        case.update(spread_fields(batch, context))
    return case


def spread_fields(batch: int, longest: int) -> dict:
    """The fields that mark a case (of this suite or decode_splits) as a mixed-length batch."""
    return {"lengths": "spread", "tokens": sum(spread_lengths(batch, longest))}


def spread_lengths(batch: int, longest: int) -> list[int]:
    """``batch`` lengths spread evenly up to ``longest`` (the i-th ``longest * (i + 1) / batch``, all but the
    longest a few tokens short of a page boundary so last pages are partly full), in an order shuffled once
    per batch size: a server's batch is in arrival order, not sorted by length."""
    lengths = [longest * (i + 1) // batch - (0 if i == batch - 1 else 1 + (7 * i) % 15) for i in range(batch)]
    random.Random(batch).shuffle(lengths)
    return [max(1, n) for n in lengths]


def case_lengths(case: dict) -> list[int]:
    """The KV length of each request of a case."""
    b, c = case["batch"], case["context"]
    return spread_lengths(b, c) if case.get("lengths") == "spread" else [c] * b


def is_spread(row: dict) -> bool:
    return row.get("lengths") == "spread"


def cases(quick: bool = False) -> list[dict]:
    shapes = [HEADLINE[:2]] if quick else SHAPES
    pages = (16,) if quick else PAGE_SIZES
    out = []
    for b, ctx in shapes:
        for p in pages:
            out += [_case("mpfa", r, b, ctx, p) for r in RECIPES]
            if p == 16:   # the SGLang backend's decode splits (eager = graph replay; 128K-context server)
                out.append(_case("mpfa-graph", "qk4pv8", b, ctx, p))
            out += [_case("flashinfer", kv, b, ctx, p) for kv in ("fi-bf16", "fi-fp8", "fi-nvfp4")]
    if not quick:
        b, ctx, _ = HEADLINE
        out += [_case("mpfa", r, b, ctx, p) for p in OTHER_PAGE_SIZES for r in RECIPES]
        out += [_case(impl, r, b, ctx, 16, spread=True) for b, ctx in SPREAD_SHAPES
                for impl, recipes in SPREAD_IMPLS for r in recipes]
    return out


def _page_table(lengths, page_size, device, gen):
    """``(num_pages, indptr, indices, last_page_len)`` for requests of ``lengths`` tokens, their pages drawn in
    random order from a pool one page larger than they need."""
    import torch
    pages = [-(-n // page_size) for n in lengths]
    total = sum(pages)
    num_pages = total + 1
    indices = torch.randperm(num_pages, generator=gen, device=device)[:total].to(torch.int32)
    indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(pages, dtype=torch.int32), 0)
    last = torch.tensor([n - (k - 1) * page_size for n, k in zip(lengths, pages)], dtype=torch.int32)
    return num_pages, indptr.to(device), indices, last.to(device)


def _fill_mpfa(cache, gen):
    """Every slot holds a real appended row (random bf16 K/V through the append kernel)."""
    import torch
    import mpfa
    chunk = 65536
    layer = cache.layer(0)
    k = torch.randn(chunk, KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(chunk, KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    cache.calibrate(0, k, v)
    for start in range(0, cache.num_slots, chunk):
        n = min(chunk, cache.num_slots - start)
        mpfa.append_kv(k[:n], v[:n], layer, torch.arange(start, start + n, device="cuda"))


def server_splits(recipe: str, lengths: list[int], page_size: int) -> dict:
    """The plan arguments of the SGLang backend's decode (server_decode_splits for a 128K-context server, given
    the requests' lengths as the backend gives them) for requests of ``lengths`` tokens on this GPU."""
    import torch
    from mpfa.decode import resident_ctas, server_decode_splits
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    size, n = server_decode_splits(KV_HEADS, len(lengths), max(lengths), SERVER_CONTEXT, sms, lengths=lengths,
                                   resident_ctas=resident_ctas(recipe, HEAD_DIM, page_size, QO_HEADS // KV_HEADS, 0))
    return dict(num_splits=n, fixed_split_size=size)


def read_bytes(lengths: list[int], bytes_per_token_head: int) -> int:
    """Bytes a decode call must move: the cache of every token and KV head, q read and o written (bf16)."""
    return sum(lengths) * KV_HEADS * bytes_per_token_head + 2 * len(lengths) * QO_HEADS * HEAD_DIM * 2


def mpfa_inputs(recipe: str, lengths: list[int], page_size: int, gen):
    """An mpfa decode call's inputs for requests of ``lengths`` tokens: a filled cache (pages in random order),
    its page table ``(indptr, indices, last_page_len)`` and bf16 queries (shared with the decode_splits suite)."""
    import torch
    import mpfa
    batch = len(lengths)
    num_pages, indptr, indices, last = _page_table(lengths, page_size, "cuda", gen)
    cache = mpfa.PagedKVCache(recipe, num_layers=1, num_pages=num_pages, page_size=page_size, num_kv_heads=KV_HEADS,
                              head_dim=HEAD_DIM, device="cuda")
    _fill_mpfa(cache, gen)
    q = torch.randn(batch, QO_HEADS, HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    return cache, (indptr, indices, last), q


def _mpfa(case, ctx, gen):
    import torch
    import mpfa
    b, c, p = case["batch"], case["context"], case["page_size"]
    lengths = case_lengths(case)
    cache, (indptr, indices, last), q = mpfa_inputs(case["recipe"], lengths, p, gen)
    w = mpfa.BatchDecodeWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    splits = server_splits(case["recipe"], lengths, p) if case["impl"] == "mpfa-graph" else {}
    w.plan(indptr, indices, last, QO_HEADS, KV_HEADS, HEAD_DIM, p, recipe=case["recipe"], **splits)
    out = torch.empty_like(q)
    layer = cache.layer(0)
    timing = ctx.bench(lambda: w.run(q, layer, out=out))
    out.fill_(float("nan"))            # poisoned: a row the kernel leaves unwritten fails the check below
    w.run(q, layer, out=out)
    return timing, {"num_splits": w.num_splits, "bytes_per_token_head": cache.bytes_per_token_head,
                    "rel_l2": rel_l2_vs_fp64(q, layer, indptr, indices, lengths, out)}


def rel_l2_vs_fp64(q, layer, kv_indptr, kv_indices, lengths: list[int], out) -> float:
    """The worst request's relative L2 distance between ``out`` and fp64 attention over the dequantized cache
    (the decode issue's bound is 5e-3; the cache's own quantization error is the accuracy suite's). One
    request's pages at a time, so a 128K-token request costs ~2 GB of fp64 K and V. Inf when ``out`` holds
    a non-finite element."""
    import torch
    from mpfa.reference.attention import attention, gather_pages
    if not torch.isfinite(out).all():
        return float("inf")
    worst = 0.0
    for b in range(q.shape[0]):
        ids = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])]
        k, v = layer.dequantize(dtype=torch.float64, pages=ids)
        local = torch.arange(ids.numel(), device=ids.device)
        o, _ = attention(q[b:b + 1], gather_pages(k, local, lengths[b]), gather_pages(v, local, lengths[b]),
                         causal=False, dtype=torch.float64)
        worst = max(worst, ((out[b].double() - o[0]).norm() / o[0].norm()).item())
    return worst


def _flashinfer(case, ctx, gen):
    import torch
    from benchmarks.suites import Skip
    try:
        import flashinfer
    except ImportError as e:
        raise Skip(f"flashinfer not importable: {e}")
    b, p = case["batch"], case["page_size"]
    num_pages, indptr, indices, last = _page_table(case_lengths(case), p, "cuda", gen)
    kind = case["recipe"]
    shape = (num_pages, KV_HEADS, p, HEAD_DIM)   # HND
    run_kw = {}
    if kind == "fi-nvfp4":
        # Packed E2M1 pairs (every byte is two valid codes) with E4M3 block scales per 16 channels.
        half = shape[:-1] + (HEAD_DIM // 2,)
        kc = torch.randint(0, 256, half, generator=gen, device="cuda", dtype=torch.uint8)
        vc = torch.randint(0, 256, half, generator=gen, device="cuda", dtype=torch.uint8)
        sf = shape[:-1] + (HEAD_DIM // 16,)
        ks = (torch.rand(sf, generator=gen, device="cuda") + 0.5).to(torch.float8_e4m3fn)
        vs = (torch.rand(sf, generator=gen, device="cuda") + 0.5).to(torch.float8_e4m3fn)
        run_kw = {"kv_cache_sf": (ks, vs), "k_scale": 1.0, "v_scale": 1.0}
    else:
        kc = torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)
        vc = torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)
        if kind == "fi-fp8":
            kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
            run_kw = {"k_scale": 1.0, "v_scale": 1.0}
    q = torch.randn(b, QO_HEADS, HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    best, errors = None, []
    # FlashInfer's best configuration for the shape; its CUDA-core decode has no FP4 path (0.6.15.post1:
    # nvcc fails on DTypeKV -> float), so NVFP4 runs with tensor cores only.
    for tc in ((True,) if kind == "fi-nvfp4" else (False, True)):
        try:
            ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=tc)
            w.plan(indptr, indices, last, QO_HEADS, KV_HEADS, HEAD_DIM, p, q_data_type=torch.bfloat16,
                   kv_data_type=kc.dtype)
            t = ctx.bench(lambda: w.run(q, (kc, vc), **run_kw))
        except Exception as e:   # FlashInfer lacks this configuration for this cache type
            errors.append(f"use_tensor_cores={tc}: {type(e).__name__}: {e}")
            continue
        if best is None or t.median < best[0].median:
            best = (t, {"use_tensor_cores": tc, "bytes_per_token_head": BYTES_PER_TOKEN_HEAD[kind]})
    if best is None:
        raise RuntimeError("; ".join(errors))
    return best


def run_case(case: dict, ctx) -> dict:
    impl = _mpfa if case["impl"].startswith("mpfa") else _flashinfer
    timing, extra = _rows.run_on_gpu(impl, case, ctx, seed=ctx.seed + hash(case["id"]) % 1000)
    lengths = case_lengths(case)
    return _rows.measured_row(case, timing, extra=extra, bytes=read_bytes(lengths, extra["bytes_per_token_head"]),
                              flops=4 * sum(lengths) * QO_HEADS * HEAD_DIM)


_gbps = _rows.rate
_ok = _rows.ok_kernels


def _hbm_gbps(rows):
    return _rows.ceiling_rate(rows, "hbm_read")


def annotate(rows: list[dict]) -> list[dict]:
    hbm = _hbm_gbps(rows)

    def derive(r):
        gbps = _gbps(r)
        return {"gbps": gbps, "hbm_fraction": gbps / hbm if hbm else None}
    return _rows.annotate(rows, derive)


def spread_summary(rows: list[dict], hbm: float | None) -> dict:
    """Per mixed-length shape (``<batch>x<longest>``): its tokens, each implementation's fraction of HBM, and
    the time of mpfa qk4pv8 under the SGLang backend's split plan (``mpfa-graph``) over FlashInfer's BF16 and
    FP8 decode of the same lengths (FlashInfer plans each request's chunks from the batch's lengths)."""
    out = {}
    for r in _ok(rows):
        if not is_spread(r):
            continue
        entry = out.setdefault(f"{r['batch']}x{r['context']}", {"tokens": r.get("tokens"), "hbm_fraction": {},
                                                                "ms": {}})
        name = f"{r['impl']} {r['recipe']}"
        entry["ms"][name] = r["ms"]
        entry["hbm_fraction"][name] = _gbps(r) / hbm if hbm else None
    for entry in out.values():
        ms = entry["ms"]
        for peer in ("fi-bf16", "fi-fp8"):
            a, b = ms.get("mpfa-graph qk4pv8"), ms.get(f"flashinfer {peer}")
            entry[f"server_plan_time_ratio_vs_flashinfer_{peer[3:]}"] = a / b if a and b else None
        a, b = ms.get("mpfa-graph qk4pv8"), ms.get("mpfa qk4pv8")
        entry["server_plan_over_adaptive"] = a / b if a and b else None
    return out


def summarize(rows: list[dict]) -> dict:
    hbm = _hbm_gbps(rows)
    ok = [r for r in _ok(rows) if not is_spread(r)]   # the one-length figures

    def find(impl, recipe, b, c, p):
        return next((r for r in ok if (r["impl"], r["recipe"], r["batch"], r["context"], r["page_size"])
                     == (impl, recipe, b, c, p)), None)

    def fractions(recipe, pred):
        return [_gbps(r) / hbm for r in ok if r["impl"] == "mpfa" and r["recipe"] == recipe and pred(r)] if hbm else []

    # a recipe not run yet has no entry; its mixed-length rows alone (a --cases run) count as run for the errors
    measured = [r for r in RECIPES if any(x["recipe"] == r for x in _ok(rows))]
    by_recipe = {r: min(fractions(r, lambda x: x["batch"] * x["context"] >= BIG), default=None) for r in measured}
    pages = sorted({x["page_size"] for x in ok if x["impl"] == "mpfa"})
    by_page = {r: {str(p): min(fractions(r, lambda x, p=p: x["batch"] * x["context"] >= BIG and x["page_size"] == p),
                               default=None) for p in pages} for r in measured}
    mine = find("mpfa", "qk4pv8", *HEADLINE)

    def ratio(peer, recipe="qk4pv8"):
        ours, other = find("mpfa", recipe, *HEADLINE), find("flashinfer", peer, *HEADLINE)
        return ours["ms"] / other["ms"] if ours and other else None

    single = fractions("qk4pv8", lambda x: (x["batch"], x["context"]) == (1, 131072))
    graph = {}
    for r in ok:
        if r["impl"] == "mpfa-graph":
            base = find("mpfa", r["recipe"], r["batch"], r["context"], r["page_size"])
            if base:
                graph[f"{r['batch']}x{r['context']}"] = r["ms"] / base["ms"]
    fi_nvfp4 = find("flashinfer", "fi-nvfp4", *HEADLINE)
    errs = {r: max((x["rel_l2"] for x in _ok(rows) if x["impl"].startswith("mpfa") and x["recipe"] == r and "rel_l2" in x),
                   default=None) for r in measured}
    return {
        "hbm_read_gbps": hbm,
        "min_hbm_fraction": by_recipe.get("qk4pv8"),
        "min_hbm_fraction_by_recipe": by_recipe,
        "min_hbm_fraction_by_recipe_and_page": by_page,
        "hbm_fraction_1x128k_qk4pv8": min(single) if single else None,
        "time_ratio_vs_flashinfer_bf16": ratio("fi-bf16"),
        "time_ratio_vs_flashinfer_fp8": ratio("fi-fp8"),
        "time_ratio_vs_flashinfer_bf16_by_recipe": {r: ratio("fi-bf16", r) for r in measured if r != "bf16"},
        "speedup_vs_flashinfer_nvfp4": fi_nvfp4["ms"] / mine["ms"] if mine and fi_nvfp4 else None,
        # SGLang's decode (server_decode_splits: grid for a 128K context, split size from the batch) over
        # the adaptive plan, per shape
        "graph_fixed_split_time_ratio": graph,
        # every mpfa row against fp64 attention over its dequantized cache (bound 5e-3)
        "max_rel_l2_vs_fp64": errs,
        "spread": spread_summary(rows, hbm),
        **_rows.run_counts(rows),
    }


def roofline_points(result: dict) -> list[tuple]:
    """mpfa at the headline shape, per recipe, and the peers there (page 16)."""
    b, c, p = HEADLINE
    return [(f"decode {r['impl']} {r['recipe']}", r["flops"], r["bytes"], r["ms"] * 1e-3) for r in _ok(result["rows"])
            if (r["batch"], r["context"], r["page_size"]) == (b, c, p) and "flops" in r and not is_spread(r)]


def plot(result: dict, out_dir: Path) -> list[Path]:
    """Achieved bandwidth against batch x context, per implementation, with the HBM ceiling."""
    from benchmarks import plots
    ok = [r for r in _ok(result["rows"]) if r["page_size"] == 16 and not is_spread(r)]
    if not ok:
        return []
    xs = sorted({r["batch"] * r["context"] for r in ok})
    series = {}
    for r in ok:
        series.setdefault(f"{r['impl']} {r['recipe']}", {})[r["batch"] * r["context"]] = _gbps(r)
    hbm = _hbm_gbps(result["rows"])
    path = plots.line([x / 1024 for x in xs], {k: [v.get(x) for x in xs] for k, v in series.items()},
                      Path(out_dir) / f"{RESULT}.png", title="decode, page 16: bandwidth vs batch x context",
                      xlabel="batch x context (K tokens)", ylabel="GB/s (cache bytes read)",
                      hlines={"HBM read ceiling": hbm} if hbm else None)
    return [path]
