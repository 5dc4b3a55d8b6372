"""The model of the prefill kernel's arithmetic (mpfa.reference.prefill_kernel) and the GPU prefill tests'
reference side, on the CPU: the model agrees with recipe_attention where they must, differs from it by about
what the old 4e-3 floor of tests/gpu/test_prefill_gpu.py allowed (P's running maximum and the fp32 score
arithmetic), and a broken kernel (a few dropped keys, a wrong mu_Q on a partial Q tile; the model playing the
broken kernel) lands far past the GPU test's derived bounds, which the unbroken model meets; compensation cuts
the reference's error on Q with a large mean by the factor the GPU test asks of the kernel; the GPU cases cover
every GQA group and head_dim x page size of every recipe."""
import importlib
import itertools
import math
import pytest
import torch

from mpfa.recipes import u4h
from mpfa.recipes.fp8 import as_e4m3
from mpfa.reference import gather_pages, kernel_q_mean, prefill_kernel_attention
from mpfa_jit.ops import prefill as prefill_op

gpu = importlib.import_module("tests.gpu.test_prefill_gpu")
batches = importlib.import_module("tests.gpu.conftest")

QUANTIZED = ("qk8pv8", "qk4pv8", "qk4pv4")
# Fewer heads and shorter requests than the GPU cases (two CPU cores), the same kinds: no prefix, a prefix not
# page-aligned, chunks over several 64-row Q tiles and 128-key tiles, a one-row chunk, an empty one.
REQUESTS = [(0, 1), (53, 200), (300, 77), (0, 150), (17, 0)]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _batch(recipe, requests=REQUESTS, *, seed=1, head_dim=128, page_size=16, hkv=2, group=2, q_fn=None):
    gen = _gen(seed)
    layer, qo, indptr, indices, last, lengths = gpu._make_batch(batches.make_paged_batch, recipe, head_dim, page_size,
                                                                hkv, requests, gen, device="cpu")
    q = (q_fn or batches.make_bf16_rows)(int(qo[-1]), hkv * group, head_dim, gen, device="cpu")
    return q, layer, qo, indptr, indices, last, lengths


def _served(recipe):
    return prefill_op.numerics(recipe, prefill_op.build_knobs(recipe))


def _request_kv(layer, indptr, indices, lengths, b):
    """Request b's K operand (INT8 rows, scales) or bf16 K, and V (dequantized, float64; qk4pv4: the rotated V's FP8
    image times v_scale, which the kernel multiplies)."""
    ids = indices[int(indptr[b]):int(indptr[b + 1])].long()
    local = torch.arange(ids.numel())
    m = lengths[b]
    if layer.recipe.quantized_q:
        k = tuple(gather_pages(x, local, m) for x in layer.k_operand(pages=ids))
        if layer.recipe.v_format == "u4h":
            v = gather_pages(layer.dequantize(torch.float64, pages=ids, path="prefill", rotated=True)[1], local, m)
        else:
            v = as_e4m3(gather_pages(layer.fields["v"][ids], local, m)).double() * layer.v_scale.double()
    else:
        k = gather_pages(layer.fields["k"][ids], local, m)
        v = gather_pages(layer.fields["v"][ids], local, m)
    return k, v


@pytest.fixture(scope="module", params=("qk8pv8", "qk4pv8", "qk4pv4", "bf16"))
def served(request):
    """One batch per recipe with every reference of the GPU test (compensation on), computed once."""
    recipe = request.param
    q, layer, qo, indptr, indices, last, lengths = _batch(recipe)
    refs = gpu._refs(q, qo, layer, indptr, indices, last, lengths, recipe=recipe, causal=True, compensation=True)
    return recipe, q, layer, qo, indptr, indices, last, lengths, refs


def _requests_with_rows(qo):
    return [b for b in range(len(qo) - 1) if int(qo[b + 1]) > int(qo[b])]


def test_model_is_within_the_recipes_error_of_exact(served):
    """The model is the recipe plus rounding details: as close to exact attention as recipe_attention is."""
    recipe, q, layer, qo, indptr, indices, last, lengths, (exact, quant, model, *_) = served
    for b in _requests_with_rows(qo):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        o_x = exact[b][0]
        err_model, err_ref = gpu._rel_l2(model.o[rows], o_x), gpu._rel_l2(quant[b][0], o_x)
        assert err_model <= 1.2 * err_ref + 1e-3, (recipe, b, err_model, err_ref)
        assert (model.lse[rows] - exact[b][1]).abs().max() <= 2 * (quant[b][1] - exact[b][1]).abs().max() + 2e-3


def test_model_differs_from_recipe_attention_by_about_the_old_floor(served):
    """P under the running maximum and the kernel's fp32 scores move the FP8 recipes' outputs by ~1e-3-5e-3
    rel-L2 from recipe_attention (what the old `max(err_ref, 4e-3)` absorbed), bf16's by far less; a one-key
    request not at all (its P is exactly the maximum's)."""
    recipe, q, layer, qo, indptr, indices, last, lengths, (exact, quant, model, *_) = served
    diffs = [gpu._rel_l2(model.o[int(qo[b]):int(qo[b + 1])], quant[b][0]) for b in _requests_with_rows(qo)]
    assert diffs[0] < 1e-5
    if recipe == "bf16":
        assert max(diffs) < 1e-3
    else:
        assert 1e-3 < max(diffs) < 1e-2, diffs


def test_running_maximum_alone_moves_p_by_a_fraction_of_the_old_floor():
    """The kernel's P under the running maximum of 128-key tiles against one tile of all keys (the row's final
    maximum), everything else equal (qk8pv8: per-key K scales, so the tile is only the softmax's)."""
    q, layer, qo, indptr, indices, last, lengths = _batch("qk8pv8")
    diffs = []
    for b in _requests_with_rows(qo):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        k, v = _request_kv(layer, indptr, indices, lengths, b)
        kw = dict(recipe="qk8pv8", causal=True, **_served("qk8pv8"))
        tiled = prefill_kernel_attention(q[rows], k, v, **kw)
        whole = prefill_kernel_attention(q[rows], k, v, kv_tile=lengths[b], **kw)
        diffs.append(gpu._rel_l2(tiled.o, whole.o))
    assert diffs[0] == 0.0                    # one key: one tile either way
    assert 1e-4 < max(diffs) < 4e-3, diffs


def _stand_in_kernel(model, recipe, gen):
    """What the kernel returns, as far as the model knows it: the model's output with the P V accumulation error
    the bound allows at half its size (random signs), rounded to bf16; its LSE in float32. qk4pv4: that in the
    rotated space where the kernel accumulates, then the wrapper's rotation back (mpfa.recipes.u4h.rotate_back)."""
    fam = "bf16" if recipe == "bf16" else "fp8"
    noise = (torch.rand(model.o.shape, generator=gen, dtype=torch.float64) * 2 - 1) * gpu.U_ACC[fam] / 2
    if model.o_rot is not None:
        o_rot = (model.o_rot + noise * model.o_abs).to(torch.bfloat16)
        return u4h.rotate_back(o_rot, u4h.hadamard_pm1(o_rot.shape[-1], dtype=torch.bfloat16)), model.lse.float()
    return (model.o + noise * model.o_abs).to(torch.bfloat16), model.lse.to(torch.float32)


def test_gpu_check_passes_a_kernel_that_matches_the_model(served):
    """tests/gpu/test_prefill_gpu.py's _check, dry: a stand-in kernel output within the derived bound passes."""
    recipe, q, layer, qo, indptr, indices, last, lengths, refs = served
    o, lse = _stand_in_kernel(refs[2], recipe, _gen(3))
    gpu._check(o, lse, qo, refs, recipe, q, f"{recipe} stand-in")


def _broken_dropped_keys(q, layer, qo, indptr, indices, lengths, recipe, drop):
    """The model playing a kernel that skips the prefix keys ``drop`` of every request (a causal prefix key's
    removal keeps every later key's alignment)."""
    o = torch.zeros(q.shape, dtype=torch.float64)
    for b in _requests_with_rows(qo):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        k, v = _request_kv(layer, indptr, indices, lengths, b)
        prefix = lengths[b] - (rows.stop - rows.start)
        keep = torch.tensor([j not in drop or j >= prefix for j in range(lengths[b])])
        k = tuple(x[keep] for x in k) if isinstance(k, tuple) else k[keep]
        o[rows] = prefill_kernel_attention(q[rows], k, v[keep], recipe=recipe, causal=True, **_served(recipe)).o
    return o


def _broken_mu_on_last_tile(q, layer, qo, indptr, indices, lengths, recipe):
    """The model playing a kernel whose smoothing of each request's last, partial 64-row Q tile uses a mu_Q 1/8 too
    small (its compensation the right one): Q - mu' = (Q + mu / 8) - mu on those rows."""
    o = torch.zeros(q.shape, dtype=torch.float64)
    for b in _requests_with_rows(qo):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        k, v = _request_kv(layer, indptr, indices, lengths, b)
        qb = q[rows]
        mu = kernel_q_mean(qb)
        n = qb.shape[0]
        wrong = qb.float().clone()
        wrong[n - n % 64 if n % 64 else n - 64:] += mu / 8
        o[rows] = prefill_kernel_attention(wrong.to(torch.bfloat16), k, v, recipe=recipe, causal=True, mu=mu,
                                           **_served(recipe)).o
    return o


@pytest.mark.parametrize("recipe", QUANTIZED)
@pytest.mark.parametrize("defect", ["dropped keys", "wrong mu_Q on a partial tile"])
def test_a_broken_kernel_fails_the_gpu_bounds_by_a_wide_margin(recipe, defect):
    """The GPU test's bounds against a kernel with a defect the old `max(err_ref, 4e-3)` let through: a few
    prefix keys skipped (3 of each request's) or a wrong mu_Q on the last, partial Q tile; the worst request is
    far past direct_bound, or a row far past row_bound, and _check says so."""
    q, layer, qo, indptr, indices, last, lengths = _batch(recipe)
    refs = gpu._refs(q, qo, layer, indptr, indices, last, lengths, recipe=recipe, causal=True, compensation=True)
    model = refs[2]
    if defect == "dropped keys":
        broken = _broken_dropped_keys(q, layer, qo, indptr, indices, lengths, recipe, drop={5, 17, 40})
    else:
        broken = _broken_mu_on_last_tile(q, layer, qo, indptr, indices, lengths, recipe)
    worst_request, worst_row = 0.0, 0.0
    for b in _requests_with_rows(qo):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        o = broken[rows].to(torch.bfloat16)
        worst_request = max(worst_request, gpu._rel_l2(o, model.o[rows]) / gpu.direct_bound(recipe, model, rows))
        per_row = (o.double() - model.o[rows]).norm(dim=-1) / model.o[rows].norm(dim=-1)
        worst_row = max(worst_row, (per_row / gpu.row_bound(recipe, model, rows)).max().item())
    assert max(worst_request, worst_row) > 5, (worst_request, worst_row)
    with pytest.raises(AssertionError, match="kernel model|exceed their bound"):
        gpu._check(broken.to(torch.bfloat16), None, qo, refs, recipe, q, "broken")


@pytest.mark.parametrize("recipe", QUANTIZED)
def test_compensation_cuts_the_references_error_on_q_with_a_large_mean(recipe):
    """The comparison of tests/gpu/test_prefill_gpu.py test_compensation_helps_on_q_with_a_large_mean on the
    references: recipe_attention and the kernel model, with and without compensation, against exact attention on
    the build's K, on Q whose smoothing makes the INT8 step STEP_RATIO or more times finer: the error must shrink
    by 1.5 * COMP_GAIN (room for the kernel's own rounding on top; measured ~9x)."""
    q, layer, qo, indptr, indices, last, lengths = _batch(recipe, [(500, 384), (64, 300)], seed=11, group=2,
                                                          q_fn=batches.make_large_mean_q)
    assert gpu.q_step_ratio(q, qo) >= gpu.STEP_RATIO
    exact = gpu.exact_on_kernel_k(q, qo, layer, indptr, indices, lengths, recipe)
    errs = {}
    for compensation in (True, False):
        _, quant, model, *_ = gpu._refs(q, qo, layer, indptr, indices, last, lengths, recipe=recipe, causal=True,
                                          compensation=compensation)
        o_ref = torch.cat([o for o, _ in quant])
        errs[compensation] = (gpu.request_errors(o_ref, qo, exact), gpu.request_errors(model.o, qo, exact))
    for i, name in enumerate(("recipe_attention", "kernel model")):
        assert errs[True][i] * 1.5 * gpu.COMP_GAIN <= errs[False][i], (name, errs)


@pytest.mark.parametrize("broken_mu", ["zero", "half"])
def test_compensation_that_does_not_smooth_fails_the_comparison(broken_mu):
    """The same comparison with compensation broken in the model: mu_Q = 0 (no smoothing, no rank-one term) or
    mu_Q / 2: the gain is ~1 or ~2, so the GPU test's COMP_GAIN catches either."""
    recipe = "qk8pv8"
    q, layer, qo, indptr, indices, last, lengths = _batch(recipe, [(64, 300)], seed=11, group=2,
                                                          q_fn=batches.make_large_mean_q)
    k, v = _request_kv(layer, indptr, indices, lengths, 0)
    o_x = gpu.exact_on_kernel_k(q, qo, layer, indptr, indices, lengths, recipe)[0]
    kw = dict(recipe=recipe, causal=True, **_served(recipe))
    mu = torch.zeros(q.shape[1:]) if broken_mu == "zero" else kernel_q_mean(q) / 2
    broken = prefill_kernel_attention(q, k, v, compensation=True, mu=mu, **kw)
    without = prefill_kernel_attention(q, k, v, compensation=False, **kw)
    right = prefill_kernel_attention(q, k, v, compensation=True, **kw)
    assert gpu._rel_l2(right.o, o_x) * gpu.COMP_GAIN <= gpu._rel_l2(without.o, o_x)
    assert gpu._rel_l2(broken.o, o_x) * gpu.COMP_GAIN > gpu._rel_l2(without.o, o_x)


def test_kernel_q_mean_sums_128_row_blocks_in_row_order():
    q = (torch.randn(300, 3, 64, generator=_gen(0)) * 5 + 100).to(torch.bfloat16)
    blocks = [q[r:r + 128].float() for r in range(0, 300, 128)]
    total = torch.zeros(3, 64)
    for blk in blocks:
        acc = torch.zeros(3, 64)
        for row in blk:
            acc = acc + row
        total = total + acc
    assert torch.equal(kernel_q_mean(q), total / 300.0)
    assert (kernel_q_mean(q).double() - q.double().mean(dim=0)).abs().max() < 1e-4


def test_the_gpu_cases_cover_every_group_and_build():
    """tests/gpu/test_prefill_gpu.py CASES: per recipe every (head_dim, page size) build with causal on and off,
    every GQA group with each head_dim and each causal mode; over the recipes every (page size, group) pair."""
    cases = gpu.CASES
    groups = set(prefill_op.GROUP_SIZES)
    assert {r for r, *_ in cases} == set(gpu.RECIPES)
    ps_group = set()
    for recipe in gpu.RECIPES:
        mine = [c[1:] for c in cases if c[0] == recipe]
        assert sorted((d, p, c) for d, p, _, c in mine) == sorted(
            itertools.product(prefill_op.HEAD_DIMS, prefill_op.PAGE_SIZES, (True, False)))
        for d in prefill_op.HEAD_DIMS:
            assert {g for dd, _, g, _ in mine if dd == d} == groups
        for causal in (True, False):
            assert {g for _, _, g, c in mine if c == causal} == groups
        ps_group |= {(p, g) for _, p, g, _ in mine}
    assert ps_group == set(itertools.product(prefill_op.PAGE_SIZES, groups))
    assert len(cases) == 16 * len(gpu.RECIPES)


# The model's fp32 divisions are the kernel's IEEE ones on any device (H200 run 1: on CUDA the model divided by Python
# numbers as a * fl(1 / b), PyTorch's CUDA shortcut, so ~5% of its 64-row Q scales were an ulp off the kernel's).
def _cuda_like_fdiv(a, b):
    """What the model's divisions by a Python number were on CUDA: a * fl(1 / b) in float32."""
    if isinstance(b, (int, float)):
        return a.float() * (1.0 / torch.tensor(b, dtype=torch.float32))
    return (a.double() / b.double()).float()


def test_model_divisions_are_correctly_rounded():
    import numpy as np
    from mpfa.recipes.fp8 import fdiv
    x = torch.rand(100000, generator=_gen(3)) * 200
    want = torch.from_numpy(x.numpy() / np.float32(127))
    assert torch.equal(fdiv(x, 127.0), want)
    assert torch.equal(fdiv(x, torch.full_like(x, 127.0)), want)
    assert (_cuda_like_fdiv(x, 127.0) != want).float().mean() > 0.01   # the shortcut is off often enough to matter


def _one_key(sq_div=None):
    """One query row and one key (qk8pv8, head_dim 64, no compensation): the LSE the model gives and the fp32 steps
    of the kernel's per-key score path by hand (softmax.cuh softmax_max), with ``sq_div`` as the model's division."""
    import math
    import numpy as np
    from mpfa.reference import prefill_kernel as pk
    gen = _gen(7)
    q = (torch.randn(1, 1, 64, generator=gen) * 2).clamp(-8.5, 8.5).to(torch.bfloat16)
    q[0, 0, 5] = 9.0   # the amax: 9 / 127 in float32 is an ulp from 9 * fl(1 / 127)
    k_int = torch.randint(-127, 128, (1, 1, 64), generator=gen, dtype=torch.int8)
    k_scale = torch.tensor([[0.0787]], dtype=torch.float32)
    v = torch.randn(1, 1, 64, generator=gen, dtype=torch.float64)
    from mpfa.recipes import fp8   # the Q scale's division (row_scale -> amax_scale -> fdiv)
    saved = fp8.fdiv
    if sq_div is not None:
        fp8.fdiv = sq_div
    try:
        model = prefill_kernel_attention(q, (k_int, k_scale), v, recipe="qk8pv8", causal=False, compensation=False)
    finally:
        fp8.fdiv = saved
    f32 = np.float32
    x = q.float().numpy()[0, 0]
    amax = f32(np.abs(x).max())
    sq = f32(amax / f32(127)) if sq_div is None else f32(sq_div(torch.tensor(amax), 127.0).item())
    q8 = np.round(x * (f32(1) / sq)).astype(np.int64)
    s_int = int((q8 * k_int.numpy()[0, 0].astype(np.int64)).sum())
    score_scale = f32(f32(1 / 8) * f32(math.log2(math.e)))
    a = f32(f32(f32(k_scale.item()) * score_scale) * sq)
    b = f32(-pk.ROUND_MAGIC * float(a))                        # fma(-kRoundMagic, a, 0): one rounding
    s = f32((pk.ROUND_MAGIC + s_int) * float(a) + float(b))     # fma(kRoundMagic + S, a, b): one rounding
    log2p = f32(math.log2(448.0))
    arg = f32(s - f32(s - log2p))                                # P = 2^(s - base), base = m - log2 p_scale
    lse = math.log(2) * (float(s) + float(arg) - float(log2p))   # epilogue: (m + log2 l - log2 p_scale) ln 2
    return model, float(s), float(a), s_int, lse


def test_one_key_lse_is_the_kernels_fp32_score():
    """A row with one key: LSE = ln2 * s (+ base's rounding) with s the kernel's fp32 score, off S * a by the rounding of
    fma(-kRoundMagic, a, 0) (a multiple of half an ulp of a: kRoundMagic * a has 26 significant bits)."""
    import math
    model, s, a, s_int, lse = _one_key()
    assert abs(model.lse.item() - lse) <= 1e-7     # log2 of the fp32 P (2^-24 relative) beside arg
    quantum = 2.0 ** (math.frexp(a)[1] - 2)          # a in [2^e, 2^(e+1)): kRoundMagic * a = 3 M 2^(e-1), M < 2^24
    delta = s - s_int * a                            # that product's rounding to 24 bits, then s's own (ulp(s))
    ulp_s = 2.0 ** (math.frexp(s)[1] - 24)
    assert abs(delta) <= 2 * quantum + ulp_s
    assert abs(delta - round(delta / quantum) * quantum) <= ulp_s


def test_one_key_lse_moves_with_the_q_scale_by_the_offsets_quantum():
    """The same row with the Q scale an ulp off (the division shortcut): S and the output are the same, the score
    moves by the change of that rounding, a multiple of 2^(e-1) (here the H200's 2^-8-sized step)."""
    import math
    model, s, a, s_int, _ = _one_key()
    moved, s2, a2, s_int2, lse2 = _one_key(_cuda_like_fdiv)
    assert s_int2 == s_int and torch.equal(moved.o, model.o)
    assert abs(moved.lse.item() - lse2) <= 1e-7
    assert a2 != a, "set-up: the shortcut's Q scale should move a"
    if a2 != a:
        quantum = 2.0 ** (math.frexp(a)[1] - 2)
        step = (s2 - s) - s_int * (a2 - a)
        assert abs(step - round(step / quantum) * quantum) <= 2.0 ** (math.frexp(s)[1] - 23)


def test_a_q_scale_an_ulp_off_moves_lse_by_the_offsets_quantum_not_the_output():
    """The H200 failure, on the CPU: with the division shortcut the Q scale of a 64-row tile can be an ulp off; that
    moves a = fa * sq by an ulp, the rounding of kRoundMagic * a by up to its ulp (2^-8 .. 2^-5 in log2 units), and
    so the tile's LSE by multiples of ln2 * 2^-9 .. 2^-6, while O does not move past its bound (the H200's qk8pv8
    rows: 1-6 x ln2/64 in whole tiles, outputs within the bound)."""
    import math
    gen = _gen(2024)
    recipe, d, p, g = "qk8pv8", 64, 1, 6
    requests = gpu._requests(p)
    layer, qo, indptr, indices, last, lengths = gpu._make_batch(batches.make_paged_batch, recipe, d, p, 2, requests,
                                                                gen, device="cpu")
    q = batches.make_bf16_rows(int(qo[-1]), 2 * g, d, gen, device="cpu")
    from mpfa.reference import batch_prefill_kernel_attention
    from mpfa.recipes import fp8   # the Q scale's division (row_scale -> amax_scale -> fdiv)
    runs = {}
    for name, div in (("ieee", fp8.fdiv), ("shortcut", _cuda_like_fdiv)):
        saved, fp8.fdiv = fp8.fdiv, div
        try:
            runs[name] = batch_prefill_kernel_attention(q, qo, layer, indptr, indices, last, causal=True,
                                                        compensation=False, **_served(recipe))
        finally:
            fp8.fdiv = saved
    moved_any = False
    for b in _requests_with_rows(qo):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        x = q[rows].float()
        tiles = torch.stack([t.abs().amax(dim=(0, 2)) for t in x.split(64)])          # [tiles, H]
        scale_differs = fp8.fdiv(tiles, 127.0) != _cuda_like_fdiv(tiles, 127.0)
        diff = (runs["ieee"].lse[rows] - runs["shortcut"].lse[rows]).abs()             # [rows, H]
        tile_of_row = torch.arange(diff.shape[0]) // 64
        moved = diff > 1e-6
        assert not (moved & ~scale_differs[tile_of_row]).any(), "only tiles whose Q scale differs move"
        if moved.any():
            moved_any = True
            assert diff.max() >= math.log(2) * 2.0 ** -9     # the offset's quantum, the H200's observed size
            limit = gpu.lse_bound(recipe, runs["ieee"], rows, q, lengths[b], 1.0, None)
            assert (diff > limit).any()                      # enough to fail the GPU test's LSE check
        assert gpu._rel_l2(runs["shortcut"].o[rows], runs["ieee"].o[rows]) <= gpu.direct_bound(recipe, runs["ieee"],
                                                                                                 rows)
    assert moved_any, "set-up: some 64-row tile's Q scale should differ under the shortcut"


# P rounding events repeat where the kernel's P repeats (tests/gpu/test_prefill_gpu.py docstring, "Correlated P
# rounding"): rows with equal exp2 arguments (twins: a request whose INT8 Q rows are equal, as the GPU test's Q of
# spread 1e-4 under compensation's Q-scale floor makes ~90% of them) and keys with equal arguments (tie groups).
def _equal_rows_request(causal):
    """qk4pv8 (the served build: tile_scale, comp_mma), 40 equal Q rows over 150 keys, the first 5 keys repeated as
    keys 5..9 (equal K and V rows: equal arguments in every row)."""
    recipe = "qk4pv8"
    gen = _gen(5)
    layer, qo, indptr, indices, last, lengths = gpu._make_batch(batches.make_paged_batch, recipe, 128, 16, 2,
                                                                [(110, 40)], gen, device="cpu")
    (k_int, k_scale), v = _request_kv(layer, indptr, indices, lengths, 0)
    k_int, k_scale, v = k_int.clone(), k_scale.clone(), v.clone()
    k_int[5:10], k_scale[5:10], v[5:10] = k_int[0:5], k_scale[0:5], v[0:5]
    q = batches.make_bf16_rows(1, 4, 128, gen, device="cpu").expand(40, 4, 128).contiguous()
    return prefill_kernel_attention(q, (k_int, k_scale), v, recipe=recipe, causal=causal, compensation=True,
                                    **_served(recipe)), v


def test_equal_rows_are_twins_unless_the_mask_tells_them_apart():
    full, _ = _equal_rows_request(causal=False)
    assert torch.equal(full.twins, torch.full_like(full.twins, 40.0))
    assert torch.equal(full.o, full.o[:1].expand_as(full.o))
    causal, _ = _equal_rows_request(causal=True)    # each row sees one key more: no two argument rows are equal
    assert torch.equal(causal.twins, torch.ones_like(causal.twins))
    q, layer, qo, indptr, indices, last, lengths = _batch("qk4pv8")   # Q of spread 1: distinct rows
    model = gpu._refs(q, qo, layer, indptr, indices, last, lengths, recipe="qk4pv8", causal=False,
                      compensation=True)[2]
    assert model.twins.max() == 1


def test_flip_event_is_one_rounding_event_in_every_twin():
    """flip_max is the largest tie group's sum of w_j ||v_j|| (keys 0..4 and 5..9 are equal: their P bytes round
    together), and flip_event the change of one such event in all twins: moving that group's P bytes by what
    flip_max allows in all 40 rows moves the request by sqrt(40) * flip_max, not flip_max alone (the request's
    rel-L2 is a row's, not a row's over sqrt(40))."""
    model, _ = _equal_rows_request(causal=False)
    rows = slice(0, 40)
    fm = model.flip_max[0]                                                   # [H], equal in every row
    assert model.flip_event(rows) == pytest.approx(40 ** 0.5 * fm.max().item())
    # one event in head h (the worst) in every row: the request's rel-L2 is the row's
    h = int(fm.argmax())
    moved = model.o.clone()
    direction = torch.randn(moved.shape[-1], generator=_gen(9), dtype=torch.float64)
    moved[:, h] += 2.0 ** -3 * fm[h] * direction / direction.norm()
    err = gpu._rel_l2(moved, model.o)
    assert err == pytest.approx(2.0 ** -3 * model.flip_event(rows) / model.o.norm().item())
    assert err > 5 * 2.0 ** -3 * fm.max().item() / model.o.norm().item()   # >> the independent-rows estimate


def test_flip_max_sums_keys_with_equal_arguments():
    """Duplicated keys carry their P together: flip_max covers both copies (and leaves out keys at exactly
    p_scale, which never move)."""
    model, _ = _equal_rows_request(causal=False)
    from mpfa.reference import prefill_kernel as pk
    seen = {}
    saved = pk._flip_groups

    def spy(arg, carry):
        seen["arg"], seen["carry"] = arg, carry
        return saved(arg, carry)

    pk._flip_groups = spy
    try:
        _equal_rows_request(causal=False)
    finally:
        pk._flip_groups = saved
    arg, carry = seen["arg"], seen["carry"]
    assert torch.equal(arg[..., 0:5], arg[..., 5:10])                       # the copies' arguments are equal
    single = carry.amax(dim=-1).transpose(0, 1)
    pair = (carry[..., 0:5] + carry[..., 5:10]).amax(dim=-1).transpose(0, 1)
    assert (model.flip_max >= torch.maximum(single, pair) * (1 - 1e-12)).all()
    assert (model.flip_max <= carry.sum(dim=-1).transpose(0, 1) * (1 + 1e-12)).all()
    assert (carry[arg == 8.0] == 0).all()                                    # log2 p_scale = 8: never moves


def test_hardware_exp2_off_the_gpu_is_exact_exp2_rounded_to_float32():
    """Off the GPU the model's P = 2^x is exact 2^x rounded to float32 (the GPU path: tests/gpu/test_prefill_gpu.py)."""
    from mpfa.reference.prefill_kernel import hardware_exp2
    x = torch.tensor([0.0, -1.5, 3.25, -20.123, -math.inf], dtype=torch.float64)
    got = hardware_exp2(x)
    assert got.dtype == torch.float64
    assert torch.equal(got, torch.exp2(x).float().double())


@pytest.mark.parametrize("k", [32, 64, 128])
@pytest.mark.parametrize("sign", [1, -1])
def test_tensor_core_pv_keeps_what_the_h200_kept(k, sign):
    """The FP8 MMA rule the H200 showed (benchmarks/results/studies/fp8_accumulation_h200.json): one product 2^r
    above the k - 1 others keeps them all at r <= 13 and loses them all at r >= 14, for k = 32, 64, 128 (the
    accumulator, holding the big product, is aligned with the later k-steps' products) and either sign."""
    from mpfa.reference.prefill_kernel import tensor_core_pv
    for r, kept in ((13, True), (14, False)):
        big = 16
        p8 = torch.full((1, 1, k), 2.0 ** ((big - r) // 2), dtype=torch.float64)
        v8 = torch.full((k, 1, 1), sign * 2.0 ** (big - r - (big - r) // 2), dtype=torch.float64)
        p8[0, 0, 0], v8[0, 0, 0] = 2.0 ** 8, 2.0 ** (big - 8)
        got = tensor_core_pv(p8, v8, 128).sum().item()
        small = sign * (k - 1) * 2.0 ** (big - r)
        assert got == 2.0 ** big + (small if kept else 0.0), (r, got)


def test_tensor_core_pv_is_exact_where_products_are_close_and_short():
    """Products of E4M3 values within 2^5 of each other have no bits below 2^-13 of their sum's k-step maximum:
    the aligned sum is the exact one."""
    from mpfa.reference.prefill_kernel import tensor_core_pv
    gen = torch.Generator().manual_seed(3)
    p8 = as_e4m3((torch.rand(2, 5, 300, generator=gen) * 128 + 128).to(torch.float8_e4m3fn)).double()
    v8 = as_e4m3((torch.rand(300, 2, 16, generator=gen) * 64 + 64).to(torch.float8_e4m3fn)).double()
    assert torch.equal(tensor_core_pv(p8, v8, 128).sum(0), torch.einsum("hqk,khd->hqd", p8, v8))


def test_model_with_fp8_mma_loses_toward_zero_on_a_one_sign_channel():
    """With the V scales given, a broad P over a one-sign V channel sums below the exact model (truncation toward
    zero), by less than the aligned rule's worst case (each product < one ulp of 2^-13 of the k-step's maximum)."""
    gen = torch.Generator().manual_seed(11)
    n, heads, kv, d, m = 8, 2, 1, 64, 300
    q = (torch.randn(n, heads, d, generator=gen) * 3).to(torch.bfloat16)
    k_int = torch.randint(-127, 128, (m, kv, d), generator=gen, dtype=torch.int8)
    k_scale = torch.rand(m, kv, generator=gen) * 0.02 + 0.01
    v_scale = torch.rand(kv, d, generator=gen) * 0.5 + 0.5
    v8 = as_e4m3((torch.randn(m, kv, d, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)).double()
    v8[:, :, 3] = v8[:, :, 3].abs() + 256.0                                  # the one-sign channel
    v8 = as_e4m3(v8.to(torch.float8_e4m3fn)).double()
    v = v8 * v_scale.double()
    kw = dict(recipe="qk8pv8", causal=False, compensation=False)
    exact = prefill_kernel_attention(q, (k_int, k_scale), v, **kw)
    tc = prefill_kernel_attention(q, (k_int, k_scale), v, v_scale=v_scale, **kw)
    diff = tc.o - exact.o
    assert (diff[..., 3] <= 0).all() and (diff[..., 3] < 0).any()
    tiles = -(-m // 128)
    assert (diff.abs() <= 4 * tiles * 32 * 2.0 ** -13 * exact.o_abs + 1e-12).all()
