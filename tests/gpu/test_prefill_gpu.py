"""The batch-prefill kernel (wgmma) on the GPU: every built recipe against the fp64 exact attention on
the dequantized cache, against ``recipe_attention`` with the kernel build's numerics (the same Q/K/P
quantization: mpfa_jit/ops/prefill.py numerics) and against ``prefill_kernel_attention``, the model of the
build's own arithmetic (mpfa.reference.prefill_kernel: the same INT8 Q bytes from the same fp32 mu_Q, the
same fp32 score arithmetic, P rounded under the running maximum of the 128-key tiles seen so far), over
ragged batches whose cached prefixes are not page-aligned and whose chunks cross page boundaries, permuted
pages, every GQA group 1..8 and head_dim x page size (a covering design, CASES), outlier channels in Q
(large mean) and K, NaN-poisoned outputs (LSE and default outputs too: their blocks are NaN-filled before
the run) and NaN-poisoned cache slots past each request's length, causal and not, compensation on and off.

Tolerances:
* against exact fp64: rel-L2(kernel) <= 1.5 * rel-L2(recipe_attention) + 1.5 * rel-L2(bf16(exact))
  per request: the recipe's own error plus rounding the exact answer to the bf16 output.
* against the model (direct_bound, row_bound): the kernel and the model differ only where the model does
  not follow the kernel's rounding, which bounds the difference from the accumulation order alone:
  - the bf16 output: |bf16(x) - x| <= 2^-8 |x| per element (8 significant bits), rel-L2 err_out =
    rel-L2(bf16(o_model), o_model) for the request (computed; ~1.4e-3 on these inputs);
  - P V: the FP8 MMA's products are exact; each k-step of 32 keys aligns them and the accumulator to the largest
    and drops what lies below 2^-13 of it, toward zero. The model does the same (KernelModel: tensor_core_pv,
    ``fp8_mma=True``; the rule from benchmarks/results/studies/fp8_accumulation_h200.json); what it may still
    miss (the rounding of a k-step's sum to FP22, 13 mantissa bits: 4 * 2^-13 = 2^-11 of sum_j p_j |v_j| per
    128-key tile), then the tile's fold into fp32 (2^-24 per tile): U_ACC = 2^-11 of o_abs = sum_j w_j |v_j|
    (the model's; bf16's HGMMA accumulates in fp32: 16 k-steps, 2^-20). Without the aligned truncation in the
    model a one-sign channel (V's large mean) missed this by 3.3x on the H200 (docs/design/prefill.md);
  - P's rounding: on the GPU the model's exp2 is the kernel's own ex2.approx.ftz ("Correlated P rounding" below);
    a model on exact exp2 (within 2 ulp, 2^-22, of it) sees an
    E4M3 byte of P round the other way only where P lies that close to a rounding point (probability
    ~2^-22 / 2^-3.5 = 2^-18.5 per key and row: rare); bf16's P differs more often, its scores being fp32
    sums of 128 products in the tensor cores' order (relative 2^-24 * D * sum |q_d k_d|, some 1e-5): a
    bf16 P byte may move one ulp (2^-7) in a percent of keys. The row's largest P is exactly 2^log2(p_scale)
    and never moves, so this scales with o_abs_rest (o_abs without that key): U_P 2^-9 (RMS) per request,
    2^-7 per row for bf16; 0 per request and one E4M3 step (2^-3) of the largest other key's w_j ||v_j|| per
    row for the FP8 recipes;
  - the epilogue's fp32 (O * (1/l) * v_scale: three roundings, 2^-22) and double rounding to bf16 at ties:
    FLOOR = 2^-12.
  - qk4pv4 (V stored as 4-bit codes of V H): the kernel writes O_rot = P V_rot (the model's ``o_rot``, whose PV error
    the terms above bound in the rotated space: norms carry over, H being orthonormal) rounded to bf16, and the
    wrapper rounds O = O_rot H to bf16 again after one bf16 GEMM (fp32 accumulation: 2^-24 D, inside FLOOR): one
    more bf16 rounding, err_out_rot = rel-L2(bf16(o_rot), o_rot) per request and 2^-8 per row.
  Per request: rel-L2(kernel, model) <= 2 * sqrt(err_out^2 + (U_ACC R_abs)^2 + (U_P R_rest)^2 + FLOOR^2)
  (R = ||o_abs|| / ||o||, the errors independent, x2 safety; an E4M3 flip moves one row, which the request's
  rel-L2 divides by the square root of its rows: only a request of a few rows with a near-tie could feel it,
  ~1e-3 of the runs; see "Correlated P rounding" below); per (row, head): ||kernel - model|| / ||model||
  <= 2^-8 + 2 * (U_ACC R_abs,row + U_P,row) + FLOOR (the bf16 term a hard bound). The old bound, the recipe's
  whole error vs exact (~5e-2 for the FP8 recipes) or 4e-3, let dropped keys or a wrong mu_Q on one tile
  through; these do not (tests/cpu/test_reference_prefill_kernel.py shows both well past the bound).
* LSE (natural log) against the exact one: max |LSE - LSE_exact| <= 1.5 * max |LSE_recipe - LSE_exact| + 2e-3
  per request; against the model: m is an exact fp32 maximum in both, so they differ by l's fp32 sum (at most
  one rounding per key and per tile's rescale: (keys + 4 tiles) * 2^-24 relative, plus ex2's 2^-22), log2f and
  the fp32 LSE itself (|LSE| * 2^-23, 2^-18): lse_bound, x3; bf16 adds its scores' fp32 sums,
  2 * D * 2^-24 * sm_scale * ||q|| * max ||k|| (Cauchy-Schwarz on sum |q_d k_d|). An INT8 Q byte that rounds the
  other way moves a logit by ~|k_d| * sq * sm_scale (~0.1-1): with mu_Q and the Q scales bit-equal there is none
  (the model divides as the kernel does, IEEE: a Q scale an ulp off moves a per-key build's scores by the rounding of
  kRoundMagic * a, 2^-9 .. 2^-5 in log2 units, whole 64-row tiles at once: H200 run 1),
  but a few (LSE_FLIPS of the rows and heads) may exceed lse_bound as long as they meet the bound against exact.

Correlated P rounding. The kernel's P of a key is a function of its fp32 exp2 argument alone (the served qk4pv8
build's SASS: separate FMUL/FADD roundings for m and c, one FFMA per score into MUFU.EX2, then F2FP to E4M3; the
model computes the same). So rows with equal arguments for every key (equal INT8 Q rows: KernelModel.twins) have
bit-equal P, and keys with equal arguments in a row round together (tie groups, KernelModel.flip_max): one byte
rounding the other way moves all K twin rows, the request's rel-L2 by 2^-3 sqrt(K) F / ||o|| (KernelModel.flip_event)
instead of being diluted by sqrt(rows). On the GPU the model takes P = 2^x from the GPU's own ex2.approx.ftz
(mpfa.reference.prefill_kernel.hardware_exp2; test_model_exp2_is_the_gpus checks that path is active), so its P
bytes are the kernel's and no such event occurs; the request bound grants none. (The FP8 MMA's accumulator is modelled
too: docs/design/prefill.md, "The FP8 MMA's accumulator in the GPU test's model".) row_bound's flip term (for a model on
exact exp2) uses the tie groups and leaves out keys whose P is exactly p_scale (exact exp2 of 8), as it does the
row's largest. (benchmarks/NOTES.md, 2026-12-02.)
"""
import itertools
import math
import os
import re
import zlib

import pytest
import torch

import mpfa
from mpfa.reference import batch_attention, batch_prefill_kernel_attention, gather_pages
from mpfa.reference.attention import attention
from mpfa.reference.prefill_kernel import kernel_mu_l1, kernel_q_mean
from mpfa.recipes import RECIPES as RECIPE_TABLE
from mpfa.recipes.int8 import tile_scaled_k
from mpfa.recipes.u4h import hadamard
from mpfa_jit.ops import prefill as prefill_op

pytestmark = [pytest.mark.gpu]

RECIPES = tuple(RECIPE_TABLE)   # every recipe mpfa defines
WORKSPACE = 128 << 20
BF16_U = 2.0 ** -8              # bf16's unit roundoff: 8 significant bits
U_ACC = {"fp8": 2.0 ** -11, "bf16": 2.0 ** -20}
FLOOR = 2.0 ** -12
LSE_FLIPS = 1e-3


def _requests(page_size):
    """(prefix, chunk) per request: prefixes not page-aligned, chunks crossing pages and Q tiles,
    a request with no prefix, one with an empty chunk, one-token chunks."""
    p = page_size
    return [(0, 1), (3 * p + 5, 200), (37, 128), (300, 77), (0, 260), (p + 1, 0), (1000, 129), (5, 1)]


def _make_batch(paged_batch, recipe, head_dim, page_size, num_kv_heads, requests, gen, device="cuda"):
    """The paged batch of (prefix, chunk) requests (tests/gpu/conftest.py: permuted pages, NaN bytes past each
    request's length) and the chunks' qo_indptr."""
    batch = paged_batch(recipe, head_dim, page_size, num_kv_heads, [a + b for a, b in requests], gen, k_mean_channel=5,
                        device=device)
    qo = torch.tensor([0] + list(itertools.accumulate(c for _, c in requests)), dtype=torch.int32, device=device)
    return batch.layer, qo, batch.indptr, batch.indices, batch.last, batch.lengths


def _references(q, qo, layer, indptr, indices, last, lengths, *, recipe, causal, compensation, sm_scale=None,
                knobs=None):
    """Per request: (exact fp64 attention on the dequantized cache, recipe_attention with the kernel build's
    numerics (``knobs``: None the served build; mpfa_jit/ops/prefill.py numerics), each as (o, lse)); and the
    model of the build's arithmetic over the whole batch (mpfa.reference.KernelModel)."""
    kd, vd = layer.dequantize(dtype=torch.float64, path="prefill")
    kw = mpfa.prefill.reference_numerics(recipe, knobs, layer)
    o, lse = batch_attention(q, qo, kd, vd, indptr, indices, last, causal=causal, sm_scale=sm_scale, recipe=recipe,
                             compensation=compensation, **kw)
    model = batch_prefill_kernel_attention(q, qo, layer, indptr, indices, last, causal=causal, sm_scale=sm_scale,
                                           compensation=compensation, fp8_mma=True,
                                           **prefill_op.numerics(recipe, prefill_op.build_knobs(recipe, knobs)))
    exact, quant = [], []
    for b, n in enumerate(lengths):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        ids = indices[int(indptr[b]):int(indptr[b + 1])]
        exact.append(attention(q[rows], gather_pages(kd, ids, n), gather_pages(vd, ids, n), causal=causal,
                               sm_scale=sm_scale))
        quant.append((o[rows], lse[rows]))
    return exact, quant, model


def _rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _ratio(num, den):
    return (num.norm() / den.norm().clamp_min(1e-300)).item()


def direct_bound(recipe, model, rows) -> float:
    """The largest rel-L2 between the kernel's bf16 output and the model's over ``rows`` (module docstring)."""
    fam = "bf16" if recipe == "bf16" else "fp8"
    o = model.o[rows]
    err_out = _rel_l2(o.to(torch.bfloat16), o)
    if model.o_rot is not None:   # qk4pv4: O_rot rounded to bf16 before the rotation back, then O
        err_out = math.hypot(err_out, _rel_l2(model.o_rot[rows].to(torch.bfloat16), model.o_rot[rows]))
    rest = 2.0 ** -9 * _ratio(model.o_abs_rest[rows], o) if fam == "bf16" else 0.0
    return 2 * math.sqrt(err_out ** 2 + (U_ACC[fam] * _ratio(model.o_abs[rows], o)) ** 2 + rest ** 2 + FLOOR ** 2)


def row_bound(recipe, model, rows) -> torch.Tensor:
    """``[rows, H]``: the largest ||kernel - model|| / ||model|| of each row and head (module docstring)."""
    o_norm = model.o[rows].norm(dim=-1).clamp_min(1e-300)
    acc = U_ACC["bf16" if recipe == "bf16" else "fp8"] * model.o_abs[rows].norm(dim=-1) / o_norm
    flip = (2.0 ** -7 * model.o_abs_rest[rows].norm(dim=-1) if recipe == "bf16"
            else 2.0 ** -3 * model.flip_max[rows]) / o_norm
    rounding = 2 * BF16_U if model.o_rot is not None else BF16_U   # qk4pv4: O_rot and O each rounded to bf16
    return rounding + 2 * (acc + flip) + FLOOR


def lse_bound(recipe, model, rows, q, kv_len, k_norm_max, sm_scale) -> torch.Tensor:
    """``[rows, H]``: the largest |LSE_kernel - LSE_model| of each row and head (module docstring)."""
    tiles = -(-kv_len // prefill_op.KV_TILE)
    lse = model.lse[rows].abs()
    bound = (kv_len + 4 * tiles) * 2.0 ** -24 + 2.0 ** -22 + lse * 2.0 ** -23 + 2.0 ** -18
    if recipe == "bf16":
        d = q.shape[-1]
        scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
        bound = bound + 2 * d * 2.0 ** -24 * scale * q[rows].double().norm(dim=-1) * k_norm_max
    return 3 * bound


def _check(o, lse, qo, refs, recipe, q, label, sm_scale=None):
    """The kernel's ``o`` (and ``lse``) against the references of :func:`_references` (module docstring)."""
    exact, quant, model, k_norms, kv_lens, inputs = refs
    assert torch.isfinite(o).all(), f"{label}: output has non-finite elements (unwritten row or NaN read)"
    for b in range(len(exact)):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        if rows.stop == rows.start:
            continue
        (o_x, _), (o_r, lse_r) = exact[b], quant[b]
        err, err_ref = _rel_l2(o[rows], o_x), _rel_l2(o_r, o_x)
        err_out = _rel_l2(o_x.to(torch.bfloat16), o_x)   # rounding the exact answer to the output format
        if model.o_rot is not None:   # qk4pv4: and rounding it in the rotated space first (the kernel's O_rot)
            x_rot = o_x @ hadamard(o_x.shape[-1], device=o_x.device)
            err_out += _rel_l2(x_rot.to(torch.bfloat16), x_rot)
        assert err <= 1.5 * err_ref + 1.5 * err_out, \
            f"{label} request {b}: rel-L2 {err:.2e} vs reference's {err_ref:.2e} (+ bf16 output rounding {err_out:.2e})"
        direct, bound = _rel_l2(o[rows], model.o[rows]), direct_bound(recipe, model, rows)
        # what one P byte rounding the other way in every twin row could move, said so that an excess reads as such
        flip = 2.0 ** -3 * model.flip_event(rows) / model.o[rows].norm().item()
        if direct > bound and os.environ.get("MPFA_GPU_TEST_DUMP"):   # the tensors of a failure, for a study off the GPU
            torch.save({"o": o[rows].cpu(), "model_o": model.o[rows].cpu(), "o_abs": model.o_abs[rows].cpu(),
                        "twins": model.twins[rows].cpu(), "flip_max": model.flip_max[rows].cpu(), "q": q[rows].cpu(),
                        "o_recipe": o_r.cpu(), "o_exact": o_x.cpu(), **inputs(b)},
                       os.path.join(os.environ["MPFA_GPU_TEST_DUMP"], re.sub(r"[^A-Za-z0-9._-]", "_", f"{label}-request{b}.pt")))
        assert direct <= bound, (f"{label} request {b}: rel-L2 to the kernel model {direct:.2e} > bound {bound:.2e} "
                                 f"({direct / bound:.1f}x; recipe_attention is {_rel_l2(o[rows], o_r):.2e} away; "
                                 f"{int(model.twins[rows].max())} twin rows, one correlated P flip moves up to {flip:.2e})")
        per_row = (o[rows].double() - model.o[rows]).norm(dim=-1) / model.o[rows].norm(dim=-1).clamp_min(1e-300)
        limit = row_bound(recipe, model, rows)
        worst = int((per_row / limit).flatten().argmax())
        r, h = divmod(worst, per_row.shape[1])
        assert bool((per_row <= limit).all()), \
            (f"{label} request {b}: {int((per_row > limit).sum())} of {per_row.numel()} (row, head) exceed their "
             f"bound; worst row {r} head {h}: {per_row[r, h].item():.2e} > {limit[r, h].item():.2e}")
    # LSE after every request's output, so an LSE-only fault is reported as such.
    for b in range(len(exact)):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        if lse is None or rows.stop == rows.start:
            continue
        lse_x, lse_r = exact[b][1], quant[b][1]
        assert torch.isfinite(lse[rows]).all(), f"{label} request {b}: LSE has non-finite elements"
        err = (lse[rows].double() - lse_x).abs().max().item()
        err_ref = (lse_r - lse_x).abs().max().item()
        assert err <= 1.5 * err_ref + 2e-3, f"{label} request {b}: LSE max error {err:.2e} vs the recipe's {err_ref:.2e}"
        diff = (lse[rows].double() - model.lse[rows]).abs()
        limit = lse_bound(recipe, model, rows, q, kv_lens[b], k_norms[b], sm_scale)
        over = int((diff > limit).sum())
        worst = int((diff / limit).flatten().argmax())   # the row and head furthest past its own bound
        assert over <= LSE_FLIPS * diff.numel(), \
            (f"{label} request {b}: {over} of {diff.numel()} LSE (row, head) differ from the kernel model by more than "
             f"their bound (worst {diff.flatten()[worst].item():.2e} > {limit.flatten()[worst].item():.2e} at row "
             f"{worst // diff.shape[1]} head {worst % diff.shape[1]}; max {diff.max().item():.2e}): "
             "more than an INT8 Q byte rounding the other way now and then")


def _refs(q, qo, layer, indptr, indices, last, lengths, **kw):
    """:func:`_references` plus what the LSE bound needs (each request's largest key norm and its KV length) and a
    function of a request giving the model's inputs for it (CPU tensors: what MPFA_GPU_TEST_DUMP saves of a failing
    request, so that prefill_kernel_attention can be rerun on it off the GPU)."""
    exact, quant, model = _references(q, qo, layer, indptr, indices, last, lengths, **kw)
    kd, vd = layer.dequantize(dtype=torch.float64, path="prefill")
    ids = [indices[int(indptr[b]):int(indptr[b + 1])] for b in range(len(lengths))]
    k_norms = [gather_pages(kd, ids[b], n).norm(dim=-1).max().item() if n else 0.0 for b, n in enumerate(lengths)]

    def inputs(b):
        n, local = lengths[b], torch.arange(ids[b].numel(), device=ids[b].device)
        out = {"v": gather_pages(vd, ids[b], n).cpu(), "numerics": {k: v for k, v in kw.items() if k != "knobs"},
               "v_scale": None if layer.v_scale is None else layer.v_scale.cpu()}
        if layer.recipe.quantized_q:
            k_int, k_scale = (gather_pages(x, local, n) for x in layer.k_operand(pages=ids[b].long()))
            out.update(k_int=k_int.cpu(), k_scale=k_scale.cpu())
        return out
    return exact, quant, model, k_norms, lengths, inputs


# A covering design over each recipe's 8 builds (head_dim x page size) and the runtime GQA group 1..8
# (mpfa_jit/ops/prefill.py GROUP_SIZES), causal and not: per recipe the 16 (head_dim, page size, causal)
# combinations, the group (2 * page-size index + head-dim index + 3 * causal + 2 * recipe index) mod 8 + 1, so
# that each recipe runs every group with each head_dim and with each causal mode, and the three recipes together
# run every (page size, group) pair (tests/cpu/test_reference_prefill_kernel.py checks these properties).
def _group(recipe_index, head_dim, page_size, causal):
    return (2 * prefill_op.PAGE_SIZES.index(page_size) + prefill_op.HEAD_DIMS.index(head_dim) + 3 * int(causal)
            + 2 * recipe_index) % 8 + 1


CASES = [(r, d, p, _group(i, d, p, c), c) for i, r in enumerate(RECIPES) for d in prefill_op.HEAD_DIMS
         for p in prefill_op.PAGE_SIZES for c in (True, False)]


def _run_kernel(w, q, layer, nan_blocks):
    """``w.run`` into a NaN-filled ``out``, its LSE allocated from a NaN-filled block."""
    out = torch.full_like(q, float("nan"))
    nan_blocks((q.shape[:2], torch.float32))
    o, lse = w.run(q, layer, out=out, return_lse=True)
    assert o.data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    return o, lse


@pytest.mark.parametrize("recipe,head_dim,page_size,group,causal", CASES,
                         ids=[f"{r}-d{d}-p{p}-g{g}-{'causal' if c else 'full'}" for r, d, p, g, c in CASES])
def test_prefill_matches_references(recipe, head_dim, page_size, group, causal, paged_batch, bf16_rows, nan_blocks,
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
        o, lse = _run_kernel(w, q, layer, nan_blocks)
        refs = _refs(q, qo, layer, indptr, indices, last, lengths, recipe=recipe, causal=causal,
                     compensation=compensation)
        _check(o, lse, qo, refs, recipe, q, f"compensation={compensation} q spread {q[..., 0].float().std():.1e}")


# Smoothing Q must make its INT8 step ~10x finer on large_mean_q (tests/gpu/conftest.py make_large_mean_q: each
# 64-row tile's amax ~51.5 without, the spread's ~4.5 with; STEP_RATIO checks the set-up). Against exact attention
# on the K the build multiplies (exact_on_kernel_k: qk4pv8's K tiles are requantized to one scale, an error
# times Q's mean that compensation cannot touch), the output's error is sqrt(E_Q^2 + E_P^2): E_Q Q's rounding,
# proportional to its step, the term compensation shrinks; E_P P's E4M3 rounding, which it does not. The CPU
# reference (tests/cpu/test_reference_prefill_kernel.py) gives ~8e-3 with, ~7e-2 without (ratio ~9, about the
# step ratio: E_Q dominates without, and with it E_Q / 10 is below E_P). The kernel adds at most direct_bound
# (~3e-3) to each, so COMP_GAIN = 4 leaves room (7e-2 / 1.1e-2 > 6), while compensation that does nothing
# (ratio ~1) or smooths by half the mean (step ratio ~2) fails.
STEP_RATIO, COMP_GAIN = 8.0, 4.0


def q_step_ratio(q, qo) -> float:
    """The smallest, over requests and heads, of (largest 64-row tile amax of Q) / (amax of Q - mu_Q): how much
    finer smoothing makes the INT8 Q step."""
    ratios = []
    for b in range(len(qo) - 1):
        x = q[int(qo[b]):int(qo[b + 1])].float()
        if x.shape[0] == 0:
            continue
        tiles = torch.stack([t.abs().amax(dim=(0, 2)) for t in x.split(64)]).amax(dim=0)
        ratios.append((tiles / (x - x.mean(dim=0)).abs().amax(dim=(0, 2))).min().item())
    return min(ratios)


def exact_on_kernel_k(q, qo, layer, indptr, indices, lengths, recipe, causal=True) -> list:
    """Per request, exact fp64 attention (o) on the K the served build multiplies: tile_scale builds requantize each
    128-key tile to its largest token scale (mpfa.recipes.int8.tile_scaled_k), the others the cache's K."""
    k_tile = prefill_op.numerics(recipe, prefill_op.build_knobs(recipe)).get("k_tile")
    kd, vd = layer.dequantize(dtype=torch.float64, path="prefill")
    out = []
    for b, n in enumerate(lengths):
        rows, ids = slice(int(qo[b]), int(qo[b + 1])), indices[int(indptr[b]):int(indptr[b + 1])]
        if k_tile:
            ints, scales = (gather_pages(x, ids, n) for x in layer.k_operand())
            k = tile_scaled_k(ints, scales, k_tile, torch.float64)
        else:
            k = gather_pages(kd, ids, n)
        out.append(attention(q[rows], k, gather_pages(vd, ids, n), causal=causal)[0])
    return out


def request_errors(o, qo, exact) -> float:
    """rel-L2 of every request's rows against ``exact`` (a list of each request's o), over the whole batch."""
    num = sum((o[int(qo[b]):int(qo[b + 1])].double() - x).norm() ** 2 for b, x in enumerate(exact))
    return math.sqrt(num / sum(x.norm() ** 2 for x in exact))


def test_model_exp2_is_the_gpus():
    """The kernel model's P = 2^x on the GPU is ex2.approx.ftz (within 2 ulp of 2^x, and not correctly rounded
    everywhere: a model that fell back to exact exp2 fails here)."""
    from mpfa.reference.prefill_kernel import hardware_exp2
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = (torch.rand(1 << 20, generator=gen, device="cuda", dtype=torch.float32) * -30).double()
    got, exact = hardware_exp2(x), torch.exp2(x)
    assert ((got - exact).abs() / exact).max().item() <= 2 * 2.0 ** -23
    assert (got != exact.float().double()).any(), "model's exp2 is correctly rounded: not the GPU's ex2.approx"
    assert hardware_exp2(torch.tensor([-math.inf, 0.0], device="cuda", dtype=torch.float64)).tolist() == [0.0, 1.0]


@pytest.mark.parametrize("recipe", ["qk8pv8", "qk4pv8", "qk4pv4"])
def test_compensation_helps_on_q_with_a_large_mean(recipe, paged_batch, large_mean_q, nan_blocks, shared_jit_cache):
    """Q with a large common mean in a few channels and a small spread: with Q smoothing and compensation the
    INT8 Q grid resolves the spread, without it the mean sets the step; the output error against exact must
    shrink by COMP_GAIN (derivation above), and both runs stay within their references' bounds."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    hkv, group, d, p = 2, 4, 128, 16
    requests = [(500, 384), (64, 300)]
    layer, qo, indptr, indices, last, lengths = _make_batch(paged_batch, recipe, d, p, hkv, requests, gen)
    q = large_mean_q(int(qo[-1]), hkv * group, d, gen)
    assert q_step_ratio(q, qo) >= STEP_RATIO, "set-up: smoothing should make the INT8 Q step much finer"
    exact = exact_on_kernel_k(q, qo, layer, indptr, indices, lengths, recipe)
    errs = {}
    for compensation in (True, False):
        w = mpfa.BatchPrefillWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
        w.plan(qo, indptr, indices, last, hkv * group, hkv, d, p, recipe=recipe, compensation=compensation)
        o, lse = _run_kernel(w, q, layer, nan_blocks)
        refs = _refs(q, qo, layer, indptr, indices, last, lengths, recipe=recipe, causal=True,
                     compensation=compensation)
        _check(o, lse, qo, refs, recipe, q, f"compensation={compensation}")
        errs[compensation] = request_errors(o, qo, exact)
    assert errs[True] * COMP_GAIN <= errs[False], \
        f"compensation should cut the error {COMP_GAIN}x: {errs[True]:.2e} with, {errs[False]:.2e} without"


def test_sm_scale_and_default_out(paged_batch, bf16_rows, nan_blocks, shared_jit_cache):
    gen = torch.Generator(device="cuda").manual_seed(5)
    hkv, group, d, p = 2, 2, 128, 32
    requests = [(100, 150), (0, 33)]
    for recipe in RECIPES:
        layer, qo, indptr, indices, last, lengths = _make_batch(paged_batch, recipe, d, p, hkv, requests, gen)
        q = bf16_rows(int(qo[-1]), hkv * group, d, gen)
        w = mpfa.BatchPrefillWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
        w.plan(qo, indptr, indices, last, hkv * group, hkv, d, p, recipe=recipe, sm_scale=0.03)
        nan_blocks((q.shape, q.dtype), (q.shape[:2], torch.float32))   # the default out and the LSE start as NaN
        o, lse = w.run(q, layer, return_lse=True)
        torch.cuda.synchronize()
        refs = _refs(q, qo, layer, indptr, indices, last, lengths, recipe=recipe, causal=True, compensation=True,
                     sm_scale=0.03)
        _check(o, lse, qo, refs, recipe, q, recipe, sm_scale=0.03)


# (head_dim, query heads, KV heads): 8-channel units of a Q row (Hq x D / 8) that fill a group of 256 threads
# (Llama: 512), leave the last group part-empty (320) and fill less than one (64).
PREPASS_HEADS = [(128, 32, 8), (64, 40, 8), (128, 4, 4)]


@pytest.mark.parametrize("head_dim,num_qo_heads,num_kv_heads", PREPASS_HEADS, ids=lambda x: str(x))
@pytest.mark.parametrize("recipe", [r for r in RECIPES if RECIPE_TABLE[r].quantized_q])
def test_q_prepass_writes_the_models_mu_and_q_scales(recipe, head_dim, num_qo_heads, num_kv_heads, paged_batch,
                                                     bf16_rows, shared_jit_cache):
    """The compensation pre-pass (prepass_q_mean.cuh) bit for bit against the model (mpfa.reference.prefill_kernel):
    mu_Q of every request and head (kernel_q_mean: 128-row blocks, each in row order), and in comp_mma builds each
    head's amax |Q - mu_Q| (fp32 differences, an exact maximum) and |mu_Q|_1 (kernel_mu_l1). The sections start
    as NaN bytes, so an element the kernels skip fails. Chunks of 1, 8, 300, 1,029 rows (several row blocks, not a
    multiple of 128 or 8), an empty one; Q with outlier channels (a large mean)."""
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"prepass-{recipe}-{head_dim}-{num_qo_heads}".encode()))
    page_size = 16
    requests = [(0, 1), (37, 300), (5, 0), (0, 1029), (130, 8)]
    layer, qo, indptr, indices, last, _ = _make_batch(paged_batch, recipe, head_dim, page_size, num_kv_heads,
                                                      requests, gen)
    q = bf16_rows(int(qo[-1]), num_qo_heads, head_dim, gen)
    w = mpfa.BatchPrefillWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
    w.plan(qo, indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size, recipe=recipe,
           compensation=True)
    assert w.backend == "cuda"
    sections = w._plan.kernel.sections
    batch = len(requests)
    views = {"mu": (batch, num_qo_heads, head_dim)}
    comp_mma = prefill_op.build_knobs(recipe)["comp_mma"]
    if comp_mma:
        views["q_head"] = (batch, num_qo_heads, 2)
    got = {}
    for name, shape in views.items():
        sections[name].fill_(0xFF)   # NaN in every fp32 element
        got[name] = sections[name][: 4 * math.prod(shape)].view(torch.float32).view(shape)
    w.run(q, layer)
    torch.cuda.synchronize()
    bounds = qo.tolist()
    for b in range(batch):
        rows = q[bounds[b]:bounds[b + 1]]
        mu = kernel_q_mean(rows)
        assert torch.equal(got["mu"][b].view(torch.int32), mu.view(torch.int32)), \
            f"request {b} ({rows.shape[0]} rows): mu_Q differs from the model at " \
            f"{torch.nonzero(got['mu'][b].view(torch.int32) != mu.view(torch.int32))[:4].tolist()}"
        if comp_mma:
            amax = (rows.float() - mu[None]).abs().amax(dim=(0, 2)) if rows.shape[0] else torch.zeros_like(mu[:, 0])
            assert torch.equal(got["q_head"][b, :, 0], amax), f"request {b}: amax |Q - mu_Q| per head differs"
            assert torch.equal(got["q_head"][b, :, 1], kernel_mu_l1(mu)), f"request {b}: |mu_Q|_1 per head differs"


def test_unbuilt_shapes_and_small_workspace_raise(shared_jit_cache):
    from mpfa_jit import UnknownKernelError
    qo = torch.tensor([0, 4], dtype=torch.int32, device="cuda")
    indptr = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    idx = torch.tensor([0], dtype=torch.int32, device="cuda")
    last = torch.tensor([9], dtype=torch.int32, device="cuda")
    w = mpfa.BatchPrefillWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
    with pytest.raises(UnknownKernelError):
        w.plan(qo, indptr, idx, last, 32, 2, 128, 16, recipe="qk4pv8")    # group 16
    with pytest.raises(ValueError, match=r"head_dim must be one of \[64, 128\], got 256"):   # checked before any build
        w.plan(qo, indptr, idx, last, 8, 2, 256, 16, recipe="qk4pv8")     # head_dim 256
    w = mpfa.BatchPrefillWrapper(torch.empty(64, dtype=torch.uint8, device="cuda"))
    with pytest.raises(ValueError, match="workspace_buffer"):
        w.plan(qo, indptr, idx, last, 8, 2, 128, 16, recipe="qk4pv8")


# Builds besides the served one (mpfa_jit/ops/prefill.py SERVED_KNOBS; every knob stated, so each is the same build
# for both recipes): per-key K scales (qk8pv8's served build), then one step each up to prefill v3's (one K scale
# per tile, compensation as an MMA k-step, both PV parts before one wait), at 3 stages. bf16 has none (3 stages do
# not fit its shared memory). The two-warpgroup builds are gone with their knobs (docs/design/prefill.md).
PER_KEY = {"stages": 3, "tile_scale": 0, "comp_mma": 0, "pv_once": 0}
_BUILDS = {"qk8pv8": [PER_KEY, {**PER_KEY, "tile_scale": 1}, {**PER_KEY, "tile_scale": 1, "comp_mma": 1},
                      {**PER_KEY, "tile_scale": 1, "comp_mma": 1, "pv_once": 1}]}
_BUILDS["qk4pv8"] = _BUILDS["qk8pv8"]
STUDY_CASES = [(r, k) for r, ks in _BUILDS.items() for k in ks if k != prefill_op.SERVED_KNOBS[r]]


@pytest.mark.parametrize("recipe,knobs", STUDY_CASES,
                         ids=[f"{r}-" + ",".join(f"{a}={b}" for a, b in k.items()) for r, k in STUDY_CASES])
@pytest.mark.parametrize("head_dim,page_size", [(128, 16), (128, 1), (64, 16)])
def test_study_builds_match_their_references(recipe, head_dim, page_size, knobs, paged_batch, bf16_rows, nan_blocks,
                                             shared_jit_cache):
    """The prefill's other builds (the private _plan_study(knobs=); benchmarks/prefill_variants.py) against the same
    references as the served one, each with its own numerics: stages and pv_once change only the schedule; tile_scale scores
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
        w._plan_study(qo, indptr, indices, last, hkv * group, hkv, head_dim, page_size, causal=True, recipe=recipe,
                      compensation=compensation, knobs=knobs)
        o, lse = _run_kernel(w, q, layer, nan_blocks)
        refs = _refs(q, qo, layer, indptr, indices, last, lengths, recipe=recipe, causal=True,
                     compensation=compensation, knobs=knobs)
        _check(o, lse, qo, refs, recipe, q, f"{knobs} compensation={compensation} q spread {q[..., 0].float().std():.1e}")
