"""Append suite: write a 32K-token chunk of new K/V (bf16, already rotated) into a paged cache
in each recipe's format, and compare the achieved bandwidth with the device copy ceiling
measured in the same run.

Append moves bytes and does almost no arithmetic, so its floor is bytes / copy bandwidth:
bytes read (K and V in bf16, 512 B per token per KV head at D=128) plus bytes written
(`cache.bytes_per_token_head` per token per KV head). The slot indices (8 B per token) are
left out of the count (0.2% at 8 KV heads).

Slots follow a random permutation of pages, as in a live cache whose free pages are
scattered: within a page tokens are consecutive; page size 1 scatters every token.
Each case rotates among enough input sets (and disjoint cache regions) to exceed 4x L2.

Peers, each in its natural configuration for this job:
- torch index_put into a token-major [slots, H, D] buffer: what SGLang's MHATokenToKVPool
  does for a bf16 pool (`k_buffer[loc] = k`), and for an fp8 pool after `k.to(e4m3)`
  (stored through a uint8 view, no scale, as SGLang does without k_scale).
- flashinfer.page.append_paged_kv_cache (bf16, NHD) and, where the installed FlashInfer has
  it, nvfp4_quantize_append_paged_kv_cache (NVFP4 K and V, E4M3 block scales).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.suites import _rows
from mpfa.recipes import get_recipe
from mpfa_jit.ops.append_kv import RECIPES

NAME = "append"
RESULT = "append_h200"

TOKENS = 32768
KV_HEADS = 8
HEAD_DIM = 128
PAGE_SIZES = (16, 1)

# Bytes written per token per KV head (K and V together) at D=128; used only to size the
# rotation before the cache exists. Reported bytes come from the cache itself for mpfa.
# bytes written per token and head: mpfa recipes from their cache fields, peers nominal
NOMINAL_OUT = {**{r: get_recipe(r).bytes_per_token_head(HEAD_DIM) for r in RECIPES}, "fp8": 256, "nvfp4": 144}
IN_BYTES_PER_TOKEN_HEAD = 2 * HEAD_DIM * 2  # K and V, bf16

TABLE = [
    ("impl", "impl", "{}"),
    ("recipe", "recipe", "{}"),
    ("page", "page_size", "{}"),
    ("tokens", "tokens", "{}"),
    ("out B/tok/head", "out_bytes_per_token_head", "{}"),
    ("ms", "ms", "{:.4f}"),
    ("GB/s", "gbps", "{:,.0f}"),
    ("of copy", "copy_fraction", "{:.2f}"),
    ("spread", "spread", "{:.1%}"),
    ("check", "check_rel_l2", "{:.1e}"),
    ("status", "status", "{}"),
    ("note", "reason", lambda s: str(s)[:60]),
]


def _case(impl: str, recipe: str, page_size: int) -> dict:
    return {
        "id": f"{impl}/{recipe}/page{page_size}/n{TOKENS}",
        "kind": "kernel",
        "impl": impl,
        "recipe": recipe,
        "page_size": page_size,
        "tokens": TOKENS,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
    }


def cases(quick: bool = False) -> list[dict]:
    """mpfa for every recipe and page size, then the peers. Quick: page size 16 only."""
    pages = PAGE_SIZES[:1] if quick else PAGE_SIZES
    out = [_case("mpfa", r, p) for p in pages for r in RECIPES]
    out += [_case("torch", "bf16", p) for p in pages]
    out.append(_case("torch", "fp8", 16))
    out.append(_case("flashinfer", "bf16", 16))
    out.append(_case("flashinfer", "nvfp4", 16))
    return out


def _inputs(case: dict, sets: int, seed: int, device: str = "cuda"):
    """`sets` input sets on disjoint, randomly placed pages: (k, v, slots, pages) each,
    and the number of pages the target cache needs."""
    import torch

    n, h, d, p = case["tokens"], case["kv_heads"], case["head_dim"], case["page_size"]
    pages_per_set = -(-n // p)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    perm = torch.randperm(sets * pages_per_set, device=device, generator=gen)
    t = torch.arange(n, device=device)
    out = []
    for s in range(sets):
        pages = perm[s * pages_per_set:(s + 1) * pages_per_set]
        slots = pages[t // p] * p + t % p  # int64: slot -> page slot // p, offset slot % p
        k = torch.randn(n, h, d, device=device, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(n, h, d, device=device, dtype=torch.bfloat16, generator=gen)
        out.append((k, v, slots, pages))
    return out, sets * pages_per_set


CHECK_TOL = 1e-2  # rel. L2, kernel vs reference cache contents: an indexing bug gives O(1)


def _poison(cache) -> None:
    """NaN (or 0xFF bytes) in every field, so a slot the kernel fails to write shows up."""
    import torch

    for t in cache.fields.values():
        if t.element_size() == 1:
            t.view(torch.uint8).fill_(255)
        else:
            t.fill_(float("nan"))


def _check_mpfa(mpfa, case, kw, layer, k, v, slots, pages) -> float:
    """Relative L2 distance between what the kernel and the PyTorch reference wrote for one
    input set (dequantized); raises past CHECK_TOL. Timing a wrong kernel is worse than none."""
    import torch

    ref = mpfa.PagedKVCache(recipe=case["recipe"], **kw)
    if ref.mu_k is not None:
        ref.mu_k.copy_(layer.cache.mu_k)
    if ref.v_scale is not None:
        ref.v_scale.copy_(layer.cache.v_scale)
    _poison(layer.cache)
    ran = mpfa.append_kv(k, v, layer, slots, backend="cuda")
    mpfa.append_kv(k, v, ref.layer(0), slots, backend="reference")
    if ran != "cuda":
        raise RuntimeError(f"mpfa.append_kv ran {ran!r}, not the CUDA kernel")
    errs = [(torch.linalg.vector_norm(got.double() - want.double())
             / torch.linalg.vector_norm(want.double())).item()
            for got, want in zip(layer.dequantize(pages=pages), ref.layer(0).dequantize(pages=pages))]
    err = max(errs) if all(e == e for e in errs) else float("nan")
    if not err <= CHECK_TOL:  # NaN fails too: an unwritten slot
        raise RuntimeError(f"append {case['recipe']} page {case['page_size']}: kernel vs reference "
                           f"rel. L2 {err:.3g} > {CHECK_TOL} (NaN: unwritten slots)")
    return err


def _mpfa(case, sets_in, num_pages, device):
    import mpfa  # lazy: the report and CPU tests must not need mpfa

    kw = dict(num_layers=1, num_pages=num_pages, page_size=case["page_size"],
              num_kv_heads=case["kv_heads"], head_dim=case["head_dim"], device=device)
    cache = mpfa.PagedKVCache(recipe=case["recipe"], **kw)
    k0, v0, slots0, pages0 = sets_in[0]
    cache.calibrate(0, k0, v0)  # fixed mu_K / V scales, as a server does from its first prefill
    layer = cache.layer(0)
    err = _check_mpfa(mpfa, case, kw, layer, k0, v0, slots0, pages0)

    def fn(k, v, slots):
        mpfa.append_kv(k, v, layer, slots, backend="cuda")

    return dict(fn=fn, rotate=[(k, v, s) for k, v, s, _ in sets_in],
                out_bpth=int(cache.bytes_per_token_head), keep=cache,
                extra={"check_rel_l2": err})


def _torch(case, sets_in, num_pages, device):
    import torch

    n_slots = num_pages * case["page_size"]
    shape = (n_slots, case["kv_heads"], case["head_dim"])
    if case["recipe"] == "bf16":
        kc = torch.empty(shape, device=device, dtype=torch.bfloat16)
        vc = torch.empty_like(kc)

        def fn(k, v, slots):
            kc.index_put_((slots,), k)
            vc.index_put_((slots,), v)
    else:  # fp8: cast, then store through a uint8 view like SGLang's fp8 pool
        kc = torch.empty(shape, device=device, dtype=torch.uint8)
        vc = torch.empty_like(kc)
        e4m3 = torch.float8_e4m3fn

        def fn(k, v, slots):
            kc.index_put_((slots,), k.to(e4m3).view(torch.uint8))
            vc.index_put_((slots,), v.to(e4m3).view(torch.uint8))

    return dict(fn=fn, rotate=[(k, v, s) for k, v, s, _ in sets_in],
                out_bpth=2 * case["head_dim"] * kc.element_size(), keep=(kc, vc))


def _flashinfer(case, sets_in, num_pages, device):
    import torch

    from benchmarks.suites import Skip

    try:
        import flashinfer.page as fp
    except ImportError as e:
        raise Skip(f"flashinfer not importable: {e}") from None
    n, h, d, p = case["tokens"], case["kv_heads"], case["head_dim"], case["page_size"]
    pages_per_set = -(-n // p)
    batch_indices = torch.zeros(n, dtype=torch.int32, device=device)
    positions = torch.arange(n, dtype=torch.int32, device=device)
    indptr = torch.tensor([0, pages_per_set], dtype=torch.int32, device=device)
    last_len = torch.tensor([n - (pages_per_set - 1) * p], dtype=torch.int32, device=device)
    rotate = [(k, v, pages.to(torch.int32)) for k, v, _, pages in sets_in]
    if case["recipe"] == "bf16":
        kc = torch.empty(num_pages, p, h, d, device=device, dtype=torch.bfloat16)
        vc = torch.empty_like(kc)

        def fn(k, v, idx):
            fp.append_paged_kv_cache(k, v, batch_indices, positions, (kc, vc), idx, indptr,
                                     last_len, kv_layout="NHD")

        return dict(fn=fn, rotate=rotate, out_bpth=2 * d * 2, keep=(kc, vc))
    if not hasattr(fp, "nvfp4_quantize_append_paged_kv_cache"):
        raise Skip("this FlashInfer has no nvfp4_quantize_append_paged_kv_cache")
    kc = torch.empty(num_pages, p, h, d // 2, device=device, dtype=torch.uint8)
    vc = torch.empty_like(kc)
    ksf = torch.empty(num_pages, p, h, d // 16, device=device, dtype=torch.float8_e4m3fn)
    vsf = torch.empty_like(ksf)

    def fn(k, v, idx):
        fp.nvfp4_quantize_append_paged_kv_cache(k, v, batch_indices, positions, (kc, vc),
                                                (ksf, vsf), idx, indptr, last_len,
                                                1.0, 1.0, kv_layout="NHD")

    return dict(fn=fn, rotate=rotate, out_bpth=2 * (d // 2 + d // 16), keep=(kc, vc, ksf, vsf))


IMPLS = {"mpfa": _mpfa, "torch": _torch, "flashinfer": _flashinfer}


def _measure(case: dict, ctx):
    """(timing, target): every tensor dies when this returns.

    Each IMPLS entry builds its target cache and returns dict(fn, rotate, out_bpth, keep,
    extra): the function to time, its rotated argument tuples, bytes written per token-head,
    tensors to keep alive, and extra row fields (e.g. the correctness check)."""
    n, h = case["tokens"], case["kv_heads"]
    nominal = n * h * (IN_BYTES_PER_TOKEN_HEAD + NOMINAL_OUT.get(case["recipe"], 512)) + 8 * n
    sets_in, num_pages = _inputs(case, ctx.rotation_count(nominal), ctx.seed)
    target = IMPLS[case["impl"]](case, sets_in, num_pages, "cuda")
    timing = ctx.bench(target["fn"], rotate=target["rotate"])
    return timing, {"out_bpth": target["out_bpth"], "extra": target.get("extra", {})}


def run_case(case: dict, ctx) -> dict:
    """Build inputs and the target cache for one case, time it, return the row."""
    timing, target = _rows.run_on_gpu(_measure, case, ctx)   # _inputs seeds its own generator
    n, h = case["tokens"], case["kv_heads"]
    out_bpth = target["out_bpth"]
    return _rows.measured_row(case, timing, extra=target["extra"],
                              bytes_in=n * h * IN_BYTES_PER_TOKEN_HEAD,
                              bytes_out=n * h * out_bpth,
                              bytes=n * h * (IN_BYTES_PER_TOKEN_HEAD + out_bpth),
                              out_bytes_per_token_head=out_bpth)


_gbps = _rows.rate   # achieved bandwidth from a row's counted bytes and median time (GB/s, 1e9 B)
_ok_kernels = _rows.ok_kernels


def _copy_gbps(rows: list[dict]) -> float | None:
    return _rows.ceiling_rate(rows, "copy")


def annotate(rows: list[dict]) -> list[dict]:
    """Fill `gbps` and `copy_fraction` of kernel rows from bytes, ms and the copy ceiling."""
    copy = _copy_gbps(rows)

    def derive(r):
        gbps = _gbps(r)
        return {"gbps": gbps, "copy_fraction": gbps / copy if copy else None}
    return _rows.annotate(rows, derive)


def summarize(rows: list[dict]) -> dict:
    """Summary computed from rows only: copy-ceiling fractions of mpfa at the 32K chunk."""
    copy = _copy_gbps(rows)
    ok = _ok_kernels(rows)
    mine = [r for r in ok if r["impl"] == "mpfa" and r["tokens"] == TOKENS]
    by_recipe: dict[str, float] = {}  # the lowest over page sizes: the claim that holds for all
    if copy:
        for r in mine:
            frac = _gbps(r) / copy
            by_recipe[r["recipe"]] = min(frac, by_recipe.get(r["recipe"], frac))
    peers = {f"{r['impl']}-{r['recipe']}/page{r['page_size']}": _gbps(r) / copy
             for r in ok if r["impl"] != "mpfa" and copy}
    return {
        "copy_gbps": copy,
        "min_copy_fraction": min(by_recipe.values()) if by_recipe else None,
        "copy_fraction_by_recipe": by_recipe,
        "peer_copy_fraction": peers,
        **_rows.run_counts(rows),
    }


def plot(result: dict, out_dir: Path) -> list[Path]:
    """Achieved GB/s per case, with the same-run copy ceiling as a line."""
    from benchmarks import plots

    ok = _ok_kernels(result["rows"])
    if not ok:
        return []
    labels = [f"{r['impl']} {r['recipe']} p{r['page_size']}" for r in ok]
    copy = _copy_gbps(result["rows"])
    path = plots.bar(labels, {"achieved": [_gbps(r) for r in ok]},
                     Path(out_dir) / f"{RESULT}.png",
                     title=f"append {TOKENS} tokens x {KV_HEADS} KV heads, D={HEAD_DIM}",
                     ylabel="GB/s (bytes read + written)",
                     hlines={"copy ceiling": copy} if copy else None)
    return [path]
