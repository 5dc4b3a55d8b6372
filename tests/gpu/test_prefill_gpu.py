"""The batch-prefill kernel (wgmma) on the GPU: every built recipe against the fp64 exact attention on
the dequantized cache and against ``recipe_attention`` with the kernel build's numerics (the same Q/K/P
quantization: mpfa_jit/ops/prefill.py numerics; the served 8-bit build's K tile scale), over ragged batches
whose cached prefixes are not page-aligned and whose chunks cross page boundaries, permuted pages,
GQA groups 1/3/4/5/8, outlier channels in Q (large mean) and K, NaN-poisoned outputs and NaN-poisoned
cache slots past each request's length, causal and not, compensation on and off, LSE.

Tolerances:
* against exact fp64: rel-L2(kernel) <= 1.5 * rel-L2(recipe_attention) + 1.5 * rel-L2(bf16(exact))
  per request: the recipe's own error plus rounding the exact answer to the bf16 output (bf16 keeps
  8 significant bits: up to 2^-8 = 3.9e-3 per element, ~2e-3 rel-L2; a one-key row, whose recipe
  error is 0, measured 2.2e-3 on the H200).
* against recipe_attention (same Q bytes, same K/V): the kernel quantizes P = exp2(s - m_running)
  with the running maximum of the tiles seen so far, the reference with the row's final maximum,
  so P's e4m3 rounding points differ (each within E4M3's 2^-4 relative step) - a difference of
  the order of the recipe's own P-rounding error, not more; plus bf16 output rounding (~1e-3) and
  fp32-vs-fp64 accumulation. Bound: rel-L2 <= max(1.0 * rel-L2(recipe vs exact), 4e-3).
* LSE (natural log) against the exact one: max |LSE - LSE_exact| <= 1.5 * max |LSE_recipe -
  LSE_exact| + 2e-3 per request. (A direct atol against recipe_attention cannot hold for quantized Q:
  the kernel's mu_Q and tile amax are FP32 sums in another order, so a few FP8 roundings of Q - mu_Q
  flip, and with outlier channels one flip moves a logit by ~|q_d k_d| / 16; the H200 showed LSE
  differences of 0.1-0.6 on logits of ~100-500 while every output passed.)
"""
import itertools
import zlib

import pytest
import torch

import mpfa
from mpfa.reference import batch_attention, gather_pages
from mpfa.reference.attention import attention
from mpfa.recipes import RECIPES as RECIPE_TABLE
from mpfa_jit.ops import prefill as prefill_op

pytestmark = [pytest.mark.gpu]

RECIPES = tuple(RECIPE_TABLE)   # every recipe mpfa defines
WORKSPACE = 128 << 20


def _requests(page_size):
    """(prefix, chunk) per request: prefixes not page-aligned, chunks crossing pages and Q tiles,
    a request with no prefix, one with an empty chunk, one-token chunks."""
    p = page_size
    return [(0, 1), (3 * p + 5, 200), (37, 128), (300, 77), (0, 260), (p + 1, 0), (1000, 129), (5, 1)]


def _make_batch(paged_batch, recipe, head_dim, page_size, num_kv_heads, requests, gen):
    """The paged batch of (prefix, chunk) requests (tests/gpu/conftest.py: permuted pages, NaN bytes past each
    request's length) and the chunks' qo_indptr."""
    batch = paged_batch(recipe, head_dim, page_size, num_kv_heads, [a + b for a, b in requests], gen, k_mean_channel=5)
    qo = torch.tensor([0] + list(itertools.accumulate(c for _, c in requests)), dtype=torch.int32, device="cuda")
    return batch.layer, qo, batch.indptr, batch.indices, batch.last, batch.lengths


def _references(q, qo, layer, indptr, indices, last, lengths, *, recipe, causal, compensation, sm_scale=None,
                knobs=None):
    """Per request: (exact fp64 attention on the dequantized cache, recipe_attention with the kernel build's numerics
    (``knobs``: None the served build; mpfa_jit/ops/prefill.py numerics), each as (o, lse)."""
    kd, vd = layer.dequantize(dtype=torch.float64)
    kw = mpfa.prefill.reference_numerics(recipe, knobs, layer)
    o, lse = batch_attention(q, qo, kd, vd, indptr, indices, last, causal=causal, sm_scale=sm_scale, recipe=recipe,
                             compensation=compensation, **kw)
    exact, quant = [], []
    for b, n in enumerate(lengths):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        ids = indices[int(indptr[b]):int(indptr[b + 1])]
        exact.append(attention(q[rows], gather_pages(kd, ids, n), gather_pages(vd, ids, n), causal=causal,
                               sm_scale=sm_scale))
        quant.append((o[rows], lse[rows]))
    return exact, quant


def _rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _check(o, lse, qo, exact, quant, label):
    assert torch.isfinite(o).all(), f"{label}: output has non-finite elements (unwritten row or NaN read)"
    for b in range(len(exact)):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        if rows.stop == rows.start:
            continue
        (o_x, _), (o_r, lse_r) = exact[b], quant[b]
        err, err_ref = _rel_l2(o[rows], o_x), _rel_l2(o_r, o_x)
        err_out = _rel_l2(o_x.to(torch.bfloat16), o_x)   # rounding the exact answer to the output format
        assert err <= 1.5 * err_ref + 1.5 * err_out, \
            f"{label} request {b}: rel-L2 {err:.2e} vs reference's {err_ref:.2e} (+ bf16 output rounding {err_out:.2e})"
        direct = _rel_l2(o[rows], o_r)
        assert direct <= max(err_ref, 4e-3), f"{label} request {b}: rel-L2 to recipe_attention {direct:.2e}"
    # LSE after every request's output, so an LSE-only fault is reported as such.
    for b in range(len(exact)):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        if lse is None or rows.stop == rows.start:
            continue
        lse_x, lse_r = exact[b][1], quant[b][1]
        assert torch.isfinite(lse[rows]).all()
        err = (lse[rows].double() - lse_x).abs().max().item()
        err_ref = (lse_r - lse_x).abs().max().item()
        assert err <= 1.5 * err_ref + 2e-3, f"{label} request {b}: LSE max error {err:.2e} vs the recipe's {err_ref:.2e}"


CASES = ([(128, p, 4) for p in (1, 16, 32, 64)] + [(128, 16, g) for g in (1, 3, 5, 8)]
         + [(64, p, g) for p, g in ((1, 4), (16, 1), (64, 8))])


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("head_dim,page_size,group", CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_matches_references(recipe, head_dim, page_size, group, causal, paged_batch, bf16_rows,
                                    shared_jit_cache):
    gen = torch.Generator(device="cuda").manual_seed(
        zlib.crc32(f"{recipe}-{head_dim}-{page_size}-{group}-{causal}".encode()))
    hkv = 2
    requests = _requests(page_size)
    layer, qo, indptr, indices, last, lengths = _make_batch(paged_batch, recipe, head_dim, page_size, hkv, requests,
                                                            gen)
    q = bf16_rows(int(qo[-1]), hkv * group, head_dim, gen)
    cases = [(q, True)] + ([(q, False)] if recipe != "bf16" else [])
    if prefill_op.SERVED_KNOBS[recipe].get("tile_scale"):
        # and Q whose mean is ~10^4 times its spread: the compensation term carries the scores (comp_mma: under the
        # Q scale's floor)
        cases.append((bf16_rows(int(qo[-1]), hkv * group, head_dim, gen, scale=1e-4), True))
    for q, compensation in cases:
        w = mpfa.BatchPrefillWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
        w.plan(qo, indptr, indices, last, hkv * group, hkv, head_dim, page_size, causal=causal, recipe=recipe,
               compensation=compensation)
        assert w.backend == "cuda"
        out = torch.full_like(q, float("nan"))
        o, lse = w.run(q, layer, out=out, return_lse=True)
        assert o.data_ptr() == out.data_ptr()
        torch.cuda.synchronize()
        exact, quant = _references(q, qo, layer, indptr, indices, last, lengths, recipe=recipe, causal=causal,
                                   compensation=compensation)
        _check(o, lse, qo, exact, quant, f"compensation={compensation} q spread {q[..., 0].float().std():.1e}")


@pytest.mark.parametrize("recipe", ["qk8pv8", "qk4pv8"])
def test_compensation_helps_on_q_with_a_large_mean(recipe, paged_batch, shared_jit_cache):
    """Q with a large common mean on every channel: Q smoothing + compensation must not be worse
    than plain per-tile quantization (the design's point); both stay within the reference bound."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    hkv, group, d, p = 2, 4, 128, 16
    requests = [(500, 384), (64, 300)]
    layer, qo, indptr, indices, last, lengths = _make_batch(paged_batch, recipe, d, p, hkv, requests, gen)
    q = (torch.randn(int(qo[-1]), hkv * group, d, generator=gen, device="cuda") * 0.5
         + 6 * torch.randn(1, hkv * group, d, generator=gen, device="cuda")).to(torch.bfloat16)
    errs = {}
    for compensation in (True, False):
        w = mpfa.BatchPrefillWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
        w.plan(qo, indptr, indices, last, hkv * group, hkv, d, p, recipe=recipe, compensation=compensation)
        o = w.run(q, layer)
        torch.cuda.synchronize()
        exact, quant = _references(q, qo, layer, indptr, indices, last, lengths, recipe=recipe, causal=True,
                                   compensation=compensation)
        _check(o, None, qo, exact, quant, f"compensation={compensation}")
        errs[compensation] = sum(_rel_l2(o[int(qo[b]):int(qo[b + 1])], exact[b][0]) for b in range(len(lengths)))
    assert errs[True] <= errs[False] * 1.05, errs


def test_sm_scale_and_default_out(paged_batch, bf16_rows, shared_jit_cache):
    gen = torch.Generator(device="cuda").manual_seed(5)
    hkv, group, d, p = 2, 2, 128, 32
    requests = [(100, 150), (0, 33)]
    for recipe in RECIPES:
        layer, qo, indptr, indices, last, lengths = _make_batch(paged_batch, recipe, d, p, hkv, requests, gen)
        q = bf16_rows(int(qo[-1]), hkv * group, d, gen)
        w = mpfa.BatchPrefillWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
        w.plan(qo, indptr, indices, last, hkv * group, hkv, d, p, recipe=recipe, sm_scale=0.03)
        o, lse = w.run(q, layer, return_lse=True)
        torch.cuda.synchronize()
        exact, quant = _references(q, qo, layer, indptr, indices, last, lengths, recipe=recipe, causal=True,
                                   compensation=True, sm_scale=0.03)
        _check(o, lse, qo, exact, quant, recipe)


def test_unbuilt_shapes_and_small_workspace_raise(shared_jit_cache):
    from mpfa_jit import UnknownKernelError
    qo = torch.tensor([0, 4], dtype=torch.int32, device="cuda")
    indptr = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    idx = torch.tensor([0], dtype=torch.int32, device="cuda")
    last = torch.tensor([9], dtype=torch.int32, device="cuda")
    w = mpfa.BatchPrefillWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
    with pytest.raises(UnknownKernelError):
        w.plan(qo, indptr, idx, last, 32, 2, 128, 16, recipe="qk4pv8")    # group 16
    with pytest.raises(UnknownKernelError):
        w.plan(qo, indptr, idx, last, 8, 2, 256, 16, recipe="qk4pv8")     # head_dim 256
    w = mpfa.BatchPrefillWrapper(torch.empty(64, dtype=torch.uint8, device="cuda"))
    with pytest.raises(ValueError, match="workspace_buffer"):
        w.plan(qo, indptr, idx, last, 8, 2, 128, 16, recipe="qk4pv8")


# Builds besides the served one (mpfa_jit/ops/prefill.py SERVED_KNOBS): {} is the template's defaults (per-key K
# scales, two warpgroups in ping-pong: the build served before prefill v3); the others take one step each, up to
# prefill v3's (three warpgroups, one K scale per tile, compensation as an MMA k-step).
V3 = {"tile_scale": 1, "comp_mma": 1, "consumers": 3, "pingpong": 0}
_BUILDS = {"qk8pv8": [{}, {"consumers": 3, "pingpong": 0}, {"tile_scale": 1},
                      {"tile_scale": 1, "consumers": 3, "pingpong": 0}, {"tile_scale": 1, "comp_mma": 1}, V3,
                      {**V3, "pv_once": 1}],
           "bf16": [{}, {"consumers": 3, "pingpong": 0, "stages": 2}]}
_BUILDS["qk4pv8"] = _BUILDS["qk8pv8"]
STUDY_CASES = [(r, k) for r, ks in _BUILDS.items() for k in ks if k != prefill_op.SERVED_KNOBS[r]]


@pytest.mark.parametrize("recipe,knobs", STUDY_CASES,
                         ids=[f"{r}-" + (",".join(f"{a}={b}" for a, b in k.items()) or "defaults") for r, k in STUDY_CASES])
@pytest.mark.parametrize("head_dim,page_size", [(128, 16), (128, 1), (64, 16)])
def test_study_builds_match_their_references(recipe, head_dim, page_size, knobs, paged_batch, bf16_rows,
                                             shared_jit_cache):
    """The prefill's other builds (plan(knobs=); benchmarks/prefill_variants.py) against the same references as the
    served one, each with its own numerics: three consumer warpgroups change only the schedule; tile_scale scores
    each K tile under one scale and scales P by a power of two; comp_mma adds each key's compensation term by one
    more MMA k-step under one Q scale per head. With tile_scale a second Q whose mean is ~10^4 times its spread
    (the compensation term carries nearly all of each score; comp_mma: the Q scale's floor)."""
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"study-{recipe}-{head_dim}-{page_size}-{knobs}".encode()))
    hkv, group = 2, 4
    requests = _requests(page_size)
    layer, qo, indptr, indices, last, lengths = _make_batch(paged_batch, recipe, head_dim, page_size, hkv, requests,
                                                            gen)
    q_usual = bf16_rows(int(qo[-1]), hkv * group, head_dim, gen)
    cases = [(q_usual, True)] + ([(q_usual, False)] if recipe != "bf16" else [])
    if knobs.get("tile_scale"):
        cases.append((bf16_rows(int(qo[-1]), hkv * group, head_dim, gen, scale=1e-4), True))
    for q, compensation in cases:
        w = mpfa.BatchPrefillWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
        w.plan(qo, indptr, indices, last, hkv * group, hkv, head_dim, page_size, causal=True, recipe=recipe,
               compensation=compensation, knobs=knobs)
        out = torch.full_like(q, float("nan"))
        o, lse = w.run(q, layer, out=out, return_lse=True)
        torch.cuda.synchronize()
        exact, quant = _references(q, qo, layer, indptr, indices, last, lengths, recipe=recipe, causal=True,
                                   compensation=compensation, knobs=knobs)
        _check(o, lse, qo, exact, quant, f"{knobs} compensation={compensation} q spread {q[..., 0].float().std():.1e}")
