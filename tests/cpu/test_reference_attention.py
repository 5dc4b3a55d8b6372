"""The PyTorch reference attention (the oracle of every kernel) against a naive float64 loop, plus
paging, ragged batches, chunking and the recipe numerics (Q/P quantization, rank-one compensation)."""
import importlib
import math

import pytest
import torch

from mpfa.reference import attention, batch_attention, gather_pages, recipe_attention, request_kv_lengths

# `mpfa.reference.attention` is the function (the package re-exports it), so fetch the module itself.
ref_attn = importlib.import_module("mpfa.reference.attention")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _naive(q, k, v, causal, sm_scale=None):
    """Loops over heads and rows, float64; bottom-right causal; rows seeing no key give (0, -inf)."""
    q, k, v = q.double(), k.double(), v.double()
    n, heads, d = q.shape
    m, kv_heads = k.shape[0], k.shape[1]
    group = heads // kv_heads
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    o = torch.zeros(n, heads, v.shape[-1], dtype=torch.float64)
    lse = torch.full((n, heads), -math.inf, dtype=torch.float64)
    for h in range(heads):
        kh, vh = k[:, h // group], v[:, h // group]
        for i in range(n):
            visible = m if not causal else max(0, min(m, i + m - n + 1))
            if visible == 0:
                continue
            s = (kh[:visible] @ q[i, h]) * sm_scale
            mx = s.max()
            e = torch.exp(s - mx)
            o[i, h] = (e @ vh[:visible]) / e.sum()
            lse[i, h] = mx + torch.log(e.sum())
    return o, lse


def _qkv(n, m, heads, kv_heads, d, gen, outliers=True):
    q = torch.randn(n, heads, d, generator=gen)
    k = torch.randn(m, kv_heads, d, generator=gen)
    v = torch.randn(m, kv_heads, d, generator=gen)
    if outliers:
        q[..., 5] += 8
        q[..., 17] += 8
        k[..., 3] = k[..., 3] * 6 + 4
        v[..., d // 2] *= 10
    return q, k, v


def _close(a, b, tol=1e-10):
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    assert torch.equal(fa, fb)
    assert torch.equal(a[~fa], b[~fb])
    assert torch.allclose(a[fa], b[fb], rtol=tol, atol=tol), (a[fa] - b[fb]).abs().max()


@pytest.mark.parametrize("group", [1, 3, 4, 5, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,n,m", [(False, 7, 13), (True, 7, 13), (True, 11, 11), (False, 1, 5), (True, 1, 5)])
def test_attention_matches_naive(group, d, causal, n, m):
    gen = _gen(group * 1000 + d + n * 7 + m + causal)
    kv_heads = 2
    q, k, v = _qkv(n, m, kv_heads * group, kv_heads, d, gen)
    o, lse = attention(q, k, v, causal=causal)
    assert o.dtype == torch.float64 and o.shape == (n, kv_heads * group, d) and lse.shape == (n, kv_heads * group)
    no, nlse = _naive(q, k, v, causal)
    _close(o, no)
    _close(lse, nlse)


def test_attention_lse_is_natural_log_of_denominator_with_sm_scale():
    gen = _gen(1)
    q, k, v = _qkv(3, 9, 4, 4, 64, gen)
    o, lse = attention(q, k, v, causal=False, sm_scale=0.3)
    s = torch.einsum("qhd,khd->qhk", q.double(), k.double()) * 0.3
    assert torch.allclose(lse, torch.log(torch.exp(s).sum(-1)), rtol=1e-12)
    assert not torch.allclose(lse, torch.log2(torch.exp2(s).sum(-1)))
    no, _ = _naive(q, k, v, False, sm_scale=0.3)
    _close(o, no)


def test_attention_causal_more_queries_than_keys_first_rows_see_nothing():
    gen = _gen(2)
    n, m = 9, 5                        # bottom-right: row i sees keys j <= i - 4
    q, k, v = _qkv(n, m, 6, 2, 64, gen)
    o, lse = attention(q, k, v, causal=True)
    assert (o[:4] == 0).all() and torch.isneginf(lse[:4]).all()
    assert torch.isfinite(lse[4:]).all() and (o[4:].abs().sum(-1) > 0).all()
    # Row 4 sees exactly key 0: its output is v[0] of its KV head.
    assert torch.allclose(o[4], v[0].double().repeat_interleave(3, dim=0))
    no, nlse = _naive(q, k, v, True)
    _close(o, no)
    _close(lse, nlse)
    # Same in float32 (no NaN from the empty rows).
    o32, lse32 = attention(q, k, v, causal=True, dtype=torch.float32)
    assert not torch.isnan(o32).any() and (o32[:4] == 0).all() and torch.isneginf(lse32[:4]).all()


@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_no_keys_gives_zero_and_neg_inf(causal):
    """The module promises: a row that sees no key gets output 0 and LSE -inf. With zero keys every
    row sees none (e.g. a decode request whose KV is empty)."""
    q = torch.randn(2, 4, 64, generator=_gen(3))
    k = torch.zeros(0, 2, 64)
    o, lse = attention(q, k, k, causal=causal)
    assert o.shape == (2, 4, 64) and (o == 0).all()
    assert torch.isneginf(lse).all()


def test_attention_chunking_gives_identical_results(monkeypatch):
    """Chunking rows only bounds memory: results agree to float64 rounding (the score matmul of a
    smaller row block may sum in another order, so bit equality is not promised)."""
    gen = _gen(4)
    q, k, v = _qkv(37, 53, 8, 2, 64, gen)
    full = attention(q, k, v, causal=True)
    full_r = recipe_attention(q.bfloat16(), k, v, recipe="qk4pv8", causal=True)
    calls = []
    real_scores = ref_attn._scores
    monkeypatch.setattr(ref_attn, "_scores", lambda q_, k_, rows: calls.append(rows) or real_scores(q_, k_, rows))
    for elems, rows_per_chunk in ((1, 1), (8 * 53 * 3, 3), (8 * 53 * 10 + 7, 10)):
        monkeypatch.setattr(ref_attn, "_CHUNK_ELEMS", elems)
        calls.clear()
        part = attention(q, k, v, causal=True)
        assert len(calls) == math.ceil(37 / rows_per_chunk)      # it did chunk
        _close(part[0], full[0], 1e-13)
        _close(part[1], full[1], 1e-13)
        part_r = recipe_attention(q.bfloat16(), k, v, recipe="qk4pv8", causal=True)
        _close(part_r[0], full_r[0], 1e-12)
        _close(part_r[1], full_r[1], 1e-12)


def _paginate(x, page_size, num_pages, gen):
    """Scatter dense ``[tokens, H, D]`` into random pages of ``[num_pages, H, P, D]``; returns pages, ids."""
    tokens = x.shape[0]
    n = (tokens + page_size - 1) // page_size
    ids = torch.randperm(num_pages, generator=gen)[:n]
    pages = torch.randn(num_pages, x.shape[1], page_size, *x.shape[2:], generator=gen)   # garbage elsewhere
    for t in range(tokens):
        pages[ids[t // page_size], :, t % page_size] = x[t]
    return pages, ids


@pytest.mark.parametrize("page_size", [1, 16, 32, 64])
@pytest.mark.parametrize("tokens", [1, 15, 64, 97, 128])
def test_gather_pages(page_size, tokens):
    gen = _gen(page_size * 1000 + tokens)
    x = torch.randn(tokens, 3, 8, generator=gen)
    num_pages = (tokens + page_size - 1) // page_size + 5
    pages, ids = _paginate(x, page_size, num_pages, gen)
    for idt in (torch.int32, torch.int64):
        got = gather_pages(pages, ids.to(idt), tokens)
        assert torch.equal(got, x)
    # Per-token scalar fields (no trailing dim) too.
    s = x[..., 0]
    spages, sids = _paginate(s, page_size, num_pages, gen)
    assert torch.equal(gather_pages(spages, sids, tokens), s)


def test_request_kv_lengths():
    indptr = torch.tensor([0, 3, 3, 4, 8])
    last = torch.tensor([5, 0, 16, 1])
    assert request_kv_lengths(indptr, last, 16) == [37, 0, 16, 49]


def _build_batch(requests, page_size, kv_heads, d, gen, extra_pages=7):
    """requests: list of (qo_len, kv_len). Returns dense per-request K/V and the paged form."""
    n_pages = [(m + page_size - 1) // page_size for _, m in requests]
    total = sum(n_pages) + extra_pages
    perm = torch.randperm(total, generator=gen)
    k_pages = torch.randn(total, kv_heads, page_size, d, generator=gen)
    v_pages = torch.randn(total, kv_heads, page_size, d, generator=gen)
    dense, indices, indptr, last = [], [], [0], []
    used = 0
    for (_, m), np_ in zip(requests, n_pages):
        ids = perm[used:used + np_]
        used += np_
        k = torch.randn(m, kv_heads, d, generator=gen)
        k[..., 3] += 5
        v = torch.randn(m, kv_heads, d, generator=gen)
        for t in range(m):
            k_pages[ids[t // page_size], :, t % page_size] = k[t]
            v_pages[ids[t // page_size], :, t % page_size] = v[t]
        dense.append((k, v))
        indices.append(ids)
        indptr.append(indptr[-1] + np_)
        last.append(0 if m == 0 else m - (np_ - 1) * page_size)
    qo_indptr = torch.tensor([0] + [sum(r[0] for r in requests[:i + 1]) for i in range(len(requests))],
                             dtype=torch.int32)
    return (dense, k_pages, v_pages, torch.tensor(indptr, dtype=torch.int32), torch.cat(indices).int(),
            torch.tensor(last, dtype=torch.int32), qo_indptr)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("recipe", [None, "bf16", "qk8pv8"])
def test_batch_attention_matches_per_request(page_size, recipe):
    gen = _gen(page_size + 3)
    heads, kv_heads, d = 8, 2, 64
    # (qo_len, kv_len): prefix lengths not page-aligned, a request with no query rows, a decode-like one.
    requests = [(5, 5 + 21), (0, 17), (1, 40), (12, 12), (7, 7 + 3)]
    dense, kp, vp, indptr, indices, last, qo_indptr = _build_batch(requests, page_size, kv_heads, d, gen)
    q = torch.randn(int(qo_indptr[-1]), heads, d, generator=gen)
    q[..., 5] += 8
    if recipe is not None:
        q = q.bfloat16()
    o, lse = batch_attention(q, qo_indptr, kp, vp, indptr, indices, last, causal=True, recipe=recipe)
    assert o.shape == (q.shape[0], heads, d) and lse.shape == (q.shape[0], heads)
    qo = qo_indptr.tolist()
    for b, (k, v) in enumerate(dense):
        rows = slice(qo[b], qo[b + 1])
        if rows.start == rows.stop:
            continue
        if recipe is None:
            eo, else_ = attention(q[rows], k, v, causal=True)
        else:
            eo, else_ = recipe_attention(q[rows], k, v, recipe=recipe, causal=True)
        assert torch.equal(o[rows], eo) and torch.equal(lse[rows], else_), b
    # And against the naive oracle for exact attention.
    if recipe is None:
        for b, (k, v) in enumerate(dense):
            rows = slice(qo[b], qo[b + 1])
            no, nlse = _naive(q[rows], k, v, True)
            _close(o[rows], no)
            _close(lse[rows], nlse)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("seed", [0, 1])
def test_recipe_attention_bf16_close_to_exact(seed):
    gen = _gen(100 + seed)
    q, k, v = _qkv(64, 96, 8, 2, 128, gen)
    q = q.bfloat16()
    k, v = k.bfloat16().float(), v.bfloat16().float()
    exact, else_ = attention(q, k, v, causal=True)
    o, lse = recipe_attention(q, k, v, recipe="bf16", causal=True)
    err = _rel(o, exact)
    assert err < 1e-2
    assert err > 0           # P is rounded to bf16: not exact
    assert torch.allclose(lse, else_, rtol=1e-12, atol=1e-12)   # scores are exact (bf16 Q, K) in float64


@pytest.mark.parametrize("recipe", ["qk8pv8", "qk4pv8"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compensation_recovers_q_quantization_error(recipe, seed):
    """Q with outlier channels of mean +8 (channels 5 and 17): quantizing Q - mu_Q and adding
    mu_Q . K back in float64 must beat quantizing Q directly, against exact fp64 attention."""
    gen = _gen(200 + seed)
    n, m, heads, kv_heads, d = 160, 224, 8, 2, 128
    q = torch.randn(n, heads, d, generator=gen)
    q[..., 5] += 8
    q[..., 17] += 8
    k = torch.randn(m, kv_heads, d, generator=gen)
    k[..., 5] *= 3
    k[..., 17] *= 3
    v = torch.randn(m, kv_heads, d, generator=gen)
    q, k, v = q.bfloat16(), k.bfloat16().float(), v.bfloat16().float()
    exact, _ = attention(q, k, v, causal=True)
    with_c, _ = recipe_attention(q, k, v, recipe=recipe, causal=True, compensation=True)
    without, _ = recipe_attention(q, k, v, recipe=recipe, causal=True, compensation=False)
    e_on, e_off = _rel(with_c, exact), _rel(without, exact)
    assert e_on < 0.8 * e_off, (e_on, e_off)
    assert e_on < 0.05
    # The quantized recipe is measurably lossy (FP8 Q and P), unlike the exact reference.
    assert e_on > 1e-3


def test_recipe_attention_compensation_restores_scores_exactly_in_fp64():
    """With Q quantization out of the picture (Q - mu_Q exactly representable), the compensated
    scores equal the exact ones: LSE matches exact attention up to P quantization (which LSE skips)."""
    gen = _gen(300)
    heads, kv_heads, d, n, m = 4, 1, 64, 8, 20
    mu = torch.zeros(heads, d)
    mu[:, 5] = 8.0
    mu[:, 17] = -8.0
    # Q - mu_Q has values in {-1, 1}: FP8 holds them exactly. Balanced signs keep the mean at mu.
    signs = torch.where(torch.rand(n // 2, heads, d, generator=gen) < 0.5, -1.0, 1.0)
    q = torch.cat([signs, -signs]) + mu
    k = torch.randn(m, kv_heads, d, generator=gen).bfloat16().float()
    v = torch.randn(m, kv_heads, d, generator=gen)
    _, lse_exact = attention(q.bfloat16(), k, v, causal=False)
    _, lse_c = recipe_attention(q.bfloat16(), k, v, recipe="qk8pv8", causal=False, compensation=True)
    _, lse_nc = recipe_attention(q.bfloat16(), k, v, recipe="qk8pv8", causal=False, compensation=False)
    # Only the float32 scale 1/448 (not exactly representable) separates them ...
    assert (lse_c - lse_exact).abs().max().item() < 1e-6
    # ... while quantizing Q with its +-8 channels in place loses precision.
    assert (lse_nc - lse_exact).abs().max().item() > 1e-3


def test_recipe_attention_empty_chunk():
    """A request chunk with no query rows gives empty outputs (batch_attention skips such requests,
    but recipe_attention guards ``q.shape[0] > 0`` itself, so it must handle it)."""
    k = torch.randn(5, 2, 64, generator=_gen(302))
    for recipe in ("bf16", "qk8pv8", "qk4pv8"):
        for comp in (True, False):
            o, lse = recipe_attention(torch.zeros(0, 4, 64, dtype=torch.bfloat16), k, k, recipe=recipe,
                                      causal=True, compensation=comp)
            assert o.shape == (0, 4, 64) and lse.shape == (0, 4)


def _large_then_tiny_rows(seed: int, tiny: float):
    """q [256, 2, 64] bf16 whose last 128 rows are ``tiny`` times the first's, and k, v [40, 2, 64]."""
    gen = _gen(seed)
    q = torch.randn(256, 2, 64, generator=gen)
    q[128:] *= tiny
    return q.bfloat16(), torch.randn(40, 2, 64, generator=gen), torch.randn(40, 2, 64, generator=gen)


def test_recipe_attention_quantizes_q_per_tile():
    """One INT8 scale per q_tile rows: a tile of tiny queries next to a tile of large ones keeps its
    own scale; one scale for both would push the tiny tile into E4M3's subnormals."""
    q, k, v = _large_then_tiny_rows(301, 3e-5)
    sm = 1 / 8 / 3e-5                       # makes the tiny tile's scores O(1)
    exact, _ = attention(q, k, v, causal=False, sm_scale=sm)
    tiled, _ = recipe_attention(q, k, v, recipe="qk8pv8", causal=False, compensation=False, q_tile=128, sm_scale=sm)
    one, _ = recipe_attention(q, k, v, recipe="qk8pv8", causal=False, compensation=False, q_tile=256, sm_scale=sm)
    err_t = _rel(tiled[128:], exact[128:])
    err_1 = _rel(one[128:], exact[128:])
    assert err_t < 0.05
    assert err_t < 0.5 * err_1, (err_t, err_1)


# --------------------------------------------------------------------------------------------------
# Non-finite inputs (module docstring of mpfa.reference.attention): attention() and the bf16 recipe
# compute in IEEE arithmetic; the quantized recipes set every output that depends on one to NaN.
# Either way never 0 or a finite value where one reaches, and the outputs it does not reach equal a
# clean run bit for bit.
# --------------------------------------------------------------------------------------------------

BAD = [math.nan, math.inf, -math.inf]
QUANTIZED = ["qk8pv8", "qk4pv8"]


def _bf16_recipe(q, k, v, **kw):
    return recipe_attention(q, k, v, recipe="bf16", **kw)


IEEE = {"attention": attention, "bf16": _bf16_recipe}


def _fn(name):
    if name in IEEE:
        return IEEE[name]
    return lambda q, k, v, **kw: recipe_attention(q.bfloat16(), k, v, recipe=name, **kw)


def _poisoned_copy(x, index, value):
    y = x.clone()
    y[index] = value
    return y


def _same_where(a, b, where):
    """``a`` equals ``b`` bit for bit at ``where`` (a bool mask broadcast to a's shape)."""
    where = where.expand_as(a)
    assert torch.equal(a[where], b[where])


def _sees(n, m, causal):
    """``[n, m]``: query row i sees key j (bottom-right causal)."""
    if not causal:
        return torch.ones(n, m, dtype=torch.bool)
    return torch.arange(m).unsqueeze(0) <= torch.arange(n).unsqueeze(1) + (m - n)


@pytest.mark.parametrize("fn,bad", [(f, math.nan) for f in IEEE] + [(r, b) for r in QUANTIZED for b in BAD])
@pytest.mark.parametrize("causal", [False, True])
def test_nonfinite_key_gives_nan_in_every_row_that_sees_it(fn, bad, causal):
    """NaN under IEEE arithmetic; any non-finite element for the quantized recipes (NaN scale)."""
    n, m, heads, kv_heads = 6, 9, 4, 2
    q, k, v = _qkv(n, m, heads, kv_heads, 64, _gen(403))
    f = _fn(fn)
    clean_o, clean_lse = f(q, k, v, causal=causal)
    o, lse = f(q, _poisoned_copy(k, (5, 1, 40), bad), v, causal=causal)
    hit = torch.zeros(n, heads, dtype=torch.bool)
    hit[_sees(n, m, causal)[:, 5], 2:4] = True          # KV head 1 serves query heads 2, 3
    assert torch.isnan(o[hit]).all() and torch.isnan(lse[hit]).all()
    _same_where(o, clean_o, ~hit.unsqueeze(-1))
    _same_where(lse, clean_lse, ~hit)


@pytest.mark.parametrize("fn,bad", [(f, math.nan) for f in IEEE] + [(r, b) for r in QUANTIZED for b in BAD])
@pytest.mark.parametrize("causal", [False, True])
def test_nonfinite_value_gives_nan_in_its_channel_of_every_row_that_sees_it(fn, bad, causal):
    n, m, heads, kv_heads, d = 6, 9, 4, 2, 64
    q, k, v = _qkv(n, m, heads, kv_heads, d, _gen(404))
    f = _fn(fn)
    clean_o, clean_lse = f(q, k, v, causal=causal)
    o, lse = f(q, k, _poisoned_copy(v, (7, 0, 11), bad), causal=causal)
    hit = torch.zeros(n, heads, d, dtype=torch.bool)
    hit[_sees(n, m, causal)[:, 7], 0:2, 11] = True
    assert hit.any() and torch.isnan(o[hit]).all()
    _same_where(o, clean_o, ~hit)
    assert torch.equal(lse, clean_lse)                  # LSE does not read V


@pytest.mark.parametrize("fn", list(IEEE))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bad", [math.inf, -math.inf])
def test_inf_value_gives_inf_in_its_channel_of_every_row_that_sees_it(fn, causal, bad):
    """p * inf with p > 0 for every row that sees the key: that inf, exactly."""
    n, m, heads, kv_heads, d = 6, 9, 4, 2, 64
    q, k, v = _qkv(n, m, heads, kv_heads, d, _gen(404))
    f = IEEE[fn]
    clean_o, clean_lse = f(q, k, v, causal=causal)
    o, lse = f(q, k, _poisoned_copy(v, (7, 0, 11), bad), causal=causal)
    hit = torch.zeros(n, heads, d, dtype=torch.bool)
    hit[_sees(n, m, causal)[:, 7], 0:2, 11] = True
    assert hit.any() and (o[hit] == bad).all()
    _same_where(o, clean_o, ~hit)
    assert torch.equal(lse, clean_lse)


@pytest.mark.parametrize("fn", list(IEEE))
def test_inf_values_give_nan_where_opposite_infs_meet_or_the_weight_is_zero(fn):
    """Channel 3: +inf and -inf in two keys every row sees (inf - inf). Channel 5: inf in the V of a key
    whose score is -inf for head 0 (its K holds inf against q < 0): weight 0, and 0 * inf is NaN; for
    head 1 (q > 0) that score is +inf, so the whole row is NaN."""
    n, m, d = 4, 6, 16
    q, k, v = _qkv(n, m, 2, 1, d, _gen(408), outliers=False)
    v[1, 0, 3], v[2, 0, 3] = math.inf, -math.inf
    q[:, 0, 8], q[:, 1, 8] = -1.0, 1.0
    k[4, 0, 8], v[4, 0, 5] = math.inf, math.inf
    o, lse = IEEE[fn](q, k, v, causal=False)
    assert torch.isnan(o[:, 1]).all() and torch.isnan(lse[:, 1]).all()
    assert torch.isnan(o[:, 0, 3]).all() and torch.isnan(o[:, 0, 5]).all()
    finite = torch.ones(d, dtype=torch.bool)
    finite[[3, 5]] = False
    assert torch.isfinite(o[:, 0, finite]).all() and torch.isfinite(lse[:, 0]).all()


@pytest.mark.parametrize("fn", list(IEEE))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bad", [math.inf, -math.inf])
def test_inf_key_gives_nan_or_drops_the_key_by_the_sign_of_its_product_with_q(fn, causal, bad):
    """Score sign(q[c] * k[c]) * inf: +inf, or NaN where q[c] = 0, makes output and LSE NaN; -inf gives
    the key weight 0, so the row is that of attention without the key."""
    n, m, heads, kv_heads, c = 6, 9, 4, 2, 40
    q, k, v = _qkv(n, m, heads, kv_heads, 64, _gen(409))
    q[:, 2:4, c] = torch.tensor([1.0, -1.0, 0.0, -2.0, 3.0, -0.5]).unsqueeze(1) * torch.tensor([1.0, -1.0])
    f = IEEE[fn]
    clean_o, clean_lse = f(q, k, v, causal=causal)
    bad_k = _poisoned_copy(k, (5, 1, c), bad)
    o, lse = f(q, bad_k, v, causal=causal)
    sees = _sees(n, m, causal)
    in_group = torch.zeros(n, heads, dtype=torch.bool)
    in_group[sees[:, 5], 2:4] = True                    # KV head 1 serves query heads 2, 3
    dropped = in_group & (q[:, :, c] * bad < 0)
    nan = in_group & ~dropped
    assert nan.any() and dropped.any()
    assert torch.isnan(o[nan]).all() and torch.isnan(lse[nan]).all()
    assert torch.isfinite(o[dropped]).all() and torch.isfinite(lse[dropped]).all()
    for i, h in dropped.nonzero().tolist():
        keys = [j for j in range(m) if sees[i, j] and j != 5]
        o_ref, lse_ref = f(q[i:i + 1], k[keys], v[keys], causal=False)
        _close(o[i, h], o_ref[0, h], tol=1e-12)
        _close(lse[i, h], lse_ref[0, h], tol=1e-12)
    _same_where(o, clean_o, ~in_group.unsqueeze(-1))
    _same_where(lse, clean_lse, ~in_group)


@pytest.mark.parametrize("fn", list(IEEE))
@pytest.mark.parametrize("causal", [False, True])
def test_nan_query_element_gives_nan_in_its_row_and_head(fn, causal):
    q, k, v = _qkv(6, 9, 4, 2, 64, _gen(400))
    f = IEEE[fn]
    clean_o, clean_lse = f(q, k, v, causal=causal)
    o, lse = f(_poisoned_copy(q, (2, 3, 17), math.nan), k, v, causal=causal)
    hit = torch.zeros(6, 4, dtype=torch.bool)
    hit[2, 3] = True
    assert torch.isnan(o[2, 3]).all() and torch.isnan(lse[2, 3])
    _same_where(o, clean_o, ~hit.unsqueeze(-1))
    _same_where(lse, clean_lse, ~hit)


@pytest.mark.parametrize("fn", list(IEEE))
@pytest.mark.parametrize("bad,zero_key,expect", [(-math.inf, False, "nan"), (math.inf, True, "nan"),
                                                 (math.inf, False, "no key")])
def test_inf_query_element_acts_through_the_scores(fn, bad, zero_key, expect):
    """Channel 17 of every key of KV head 1 is negative: -inf in q gives +inf scores (exp(inf - inf) is
    NaN); +inf gives -inf scores, so the row counts as seeing no key (0, LSE -inf), unless a key it sees
    has 0 there (0 * inf: NaN)."""
    q, k, v = _qkv(6, 9, 4, 2, 64, _gen(400))
    k[:, 1, 17] = -k[:, 1, 17].abs() - 0.5
    if zero_key:
        k[2, 1, 17] = 0.0                                # row 4 sees key 2 (keys j <= i + 3)
    f = IEEE[fn]
    clean_o, clean_lse = f(q, k, v, causal=True)
    o, lse = f(_poisoned_copy(q, (4, 3, 17), bad), k, v, causal=True)
    if expect == "nan":
        assert torch.isnan(o[4, 3]).all() and torch.isnan(lse[4, 3])
    else:
        assert (o[4, 3] == 0).all() and torch.isneginf(lse[4, 3])
    hit = torch.zeros(6, 4, dtype=torch.bool)
    hit[4, 3] = True
    _same_where(o, clean_o, ~hit.unsqueeze(-1))
    _same_where(lse, clean_lse, ~hit)


def test_nonfinite_sm_scale():
    """NaN: every row that sees a key is NaN. inf (IEEE): a (row, head) with a visible score >= 0 gets
    +inf or NaN there, so NaN; one whose visible scores are all < 0 gets -inf everywhere, as if it saw no
    key. The quantized recipes give NaN for both."""
    n, m, heads = 5, 8, 4
    q, k, v = _qkv(n, m, heads, 2, 64, _gen(401), outliers=False)
    k[:, 0] = k[:, 0].abs()
    q[:, 0:2] = -q[:, 0:2].abs()                         # query heads 0, 1 read KV head 0: every score < 0
    scores = torch.einsum("qhd,khd->qhk", q.double(), k.double().repeat_interleave(2, dim=1))
    sees = _sees(n, m, True).unsqueeze(1)
    some_nonneg = ((scores >= 0) & sees).any(dim=-1)     # [n, H]
    assert not some_nonneg[:, 0:2].any() and some_nonneg[:, 2:4].any()
    for fn in IEEE.values():
        o, lse = fn(q, k, v, causal=True, sm_scale=math.nan)
        assert torch.isnan(o).all() and torch.isnan(lse).all()
        o, lse = fn(q, k, v, causal=True, sm_scale=math.inf)
        assert torch.isnan(o[some_nonneg]).all() and torch.isnan(lse[some_nonneg]).all()
        assert (o[~some_nonneg] == 0).all() and torch.isneginf(lse[~some_nonneg]).all()
    for sm_scale in (math.nan, math.inf):
        o, lse = recipe_attention(q.bfloat16(), k, v, recipe="qk4pv8", causal=True, sm_scale=sm_scale)
        assert torch.isnan(o).all() and torch.isnan(lse).all()


@pytest.mark.parametrize("fn", list(IEEE) + QUANTIZED)
def test_rows_that_see_no_key_stay_zero_with_a_nonfinite_input(fn):
    q, k, v = _qkv(9, 5, 6, 2, 64, _gen(402))            # bottom-right causal: rows 0-3 see no key
    f = _fn(fn)
    for o, lse in (f(_poisoned_copy(q, (1, 0, 0), math.nan), k, v, causal=True),
                   f(q, k, v, causal=True, sm_scale=math.nan),
                   f(q, _poisoned_copy(k, (4, 1, 3), math.inf), _poisoned_copy(v, (4, 0, 3), -math.inf), causal=True)):
        assert (o[:4] == 0).all() and torch.isneginf(lse[:4]).all()
    o, _ = f(q, k, v, causal=True, sm_scale=math.nan)
    assert torch.isnan(o[4:]).all()


@pytest.mark.parametrize("recipe", QUANTIZED)
@pytest.mark.parametrize("bad", BAD)
def test_quantized_q_spreads_a_nonfinite_element_over_the_rows_sharing_its_factors(recipe, bad):
    """FP8 Q: with compensation, mu_Q is the mean of the request's rows per head, so every row of that
    head is NaN; without, the rows of the element's scale tile (q_tile rows, same head)."""
    n, heads = 10, 4
    q, k, v = _qkv(n, 14, heads, 2, 64, _gen(405))
    q = q.bfloat16()
    bad_q = _poisoned_copy(q, (6, 1, 9), bad)
    for compensation, rows in ((True, slice(None)), (False, slice(4, 8))):
        kw = dict(recipe=recipe, causal=True, compensation=compensation, q_tile=4)
        clean_o, clean_lse = recipe_attention(q, k, v, **kw)
        o, lse = recipe_attention(bad_q, k, v, **kw)
        hit = torch.zeros(n, heads, dtype=torch.bool)
        hit[rows, 1] = True
        assert torch.isnan(o[hit]).all() and torch.isnan(lse[hit]).all(), compensation
        _same_where(o, clean_o, ~hit.unsqueeze(-1))
        _same_where(lse, clean_lse, ~hit)


@pytest.mark.parametrize("recipe", [None, "bf16", "qk8pv8"])
def test_batch_keeps_a_nonfinite_input_inside_its_request(recipe):
    gen = _gen(406)
    heads, kv_heads, d, page_size = 4, 2, 64, 16
    requests = [(5, 26), (7, 7), (1, 40)]
    dense, kp, vp, indptr, indices, last, qo_indptr = _build_batch(requests, page_size, kv_heads, d, gen)
    q = torch.randn(int(qo_indptr[-1]), heads, d, generator=gen)
    if recipe is not None:
        q = q.bfloat16()
    kw = dict(causal=True, recipe=recipe)
    clean_o, clean_lse = batch_attention(q, qo_indptr, kp, vp, indptr, indices, last, **kw)
    # Request 1 (rows 5..11): NaN in its Q and K, and -inf in V of its last token (page 0 of its pages).
    q1, kp1, vp1 = q.clone(), kp.clone(), vp.clone()
    q1[8, 0, 3] = math.nan
    page = int(indices[int(indptr[1])])
    kp1[page, 1, 6, 0] = math.nan
    vp1[page, 0, 6, 2] = -math.inf
    o, lse = batch_attention(q1, qo_indptr, kp1, vp1, indptr, indices, last, **kw)
    assert torch.isnan(o[8, 0]).all()                  # the NaN query row
    assert torch.isnan(o[11, 2:4]).all()               # the last row sees the NaN key (KV head 1) ...
    value = o[11, 0:2, 2]                              # ... and the -inf value (KV head 0, channel 2)
    assert torch.isnan(value).all() if recipe == "qk8pv8" else (value == -math.inf).all()
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[5:12] = False
    assert torch.isfinite(o[others]).all()
    assert torch.equal(o[others], clean_o[others]) and torch.equal(lse[others], clean_lse[others])


def _reference_wrappers(recipe, v_poison=None):
    """A one-layer cache on the CPU holding 40 tokens (calibrated on clean ones, then appended with V
    element ``v_poison = (token, kv_head, channel, value)``), and plans of both wrappers with
    backend="reference": request 0 is tokens 0-7 (8 query rows), request 1 tokens 16-47 (5 rows)."""
    import mpfa
    gen = _gen(407)
    heads, kv_heads, d, page = 4, 2, 64, 16
    cache = mpfa.PagedKVCache(recipe, num_layers=1, num_pages=4, page_size=page, num_kv_heads=kv_heads, head_dim=d,
                              device="cpu")
    k, v = torch.randn(40, kv_heads, d, generator=gen), torch.randn(40, kv_heads, d, generator=gen)
    cache.calibrate(0, k, v)
    if v_poison is not None:
        v[v_poison[:3]] = v_poison[3]
    mpfa.append_kv(k.bfloat16(), v.bfloat16(), cache.layer(0), torch.arange(40), backend="reference")
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)
    pages = (i32(0, 1, 3), i32(0, 1, 2), i32(8, 16))
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    prefill = mpfa.BatchPrefillWrapper(ws, backend="reference")
    prefill.plan(i32(0, 8, 13), *pages, heads, kv_heads, d, page, recipe=recipe)
    decode = mpfa.BatchDecodeWrapper(ws, backend="reference")
    decode.plan(*pages, heads, kv_heads, d, page, recipe=recipe)
    q = torch.randn(8 + 5, heads, d, generator=gen).bfloat16()
    return cache.layer(0), prefill, decode, q


@pytest.mark.parametrize("recipe", ["bf16", "qk8pv8", "qk4pv8"])
def test_wrappers_reference_path_gives_nan_for_a_nan_query(recipe):
    """backend="reference" through the public API: a NaN in one query row reaches that request's rows
    (all of its chunk for that head with FP8 Q), never zeros, and no other request."""
    layer, prefill, decode, q = _reference_wrappers(recipe)
    q[9, 2, 7] = math.nan                                  # request 1's second row, head 2
    o = prefill.run(q, layer)
    assert torch.isnan(o[9, 2]).all()
    assert torch.isnan(o[8:13, 2]).all() == (recipe != "bf16")
    assert torch.isfinite(o[:8]).all() and torch.isfinite(o[8:13, [0, 1, 3]]).all()
    o = decode.run(q[[0, 9]], layer)
    assert torch.isnan(o[1, 2]).all() and torch.isfinite(o[0]).all() and torch.isfinite(o[1, [0, 1, 3]]).all()


@pytest.mark.parametrize("recipe", ["bf16", "qk8pv8", "qk4pv8"])
def test_wrappers_reference_path_follow_the_recipe_for_an_inf_value(recipe):
    """inf in V of token 20 (request 1's key 4; KV head 1, channel 5): the bf16 cache stores it and
    the outputs that see it carry inf in that channel; a quantized cache stores E4M3 NaN: NaN."""
    layer, prefill, decode, q = _reference_wrappers(recipe, (20, 1, 5, math.inf))
    expect = torch.isinf if recipe == "bf16" else torch.isnan
    for o, rows in ((prefill.run(q, layer), slice(8, 13)), (decode.run(q[[0, 9]], layer), slice(1, 2))):
        assert expect(o[rows, 2:4, 5]).all()               # query heads 2, 3 read KV head 1
        finite = torch.ones_like(o, dtype=torch.bool)
        finite[rows, 2:4, 5] = False
        assert torch.isfinite(o[finite]).all()


def test_recipe_attention_comp_digits_scale_is_per_head():
    """comp_digits: one Q scale for all rows of a head (the comp_mma build's), so a tile of tiny rows next to
    large ones shares the large rows' scale; with compensation and a mean that dwarfs the spread the result
    stays close to exact attention (the mean's term is exact in the reference)."""
    q, k, v = _large_then_tiny_rows(302, 3e-2)
    gen = _gen(303)
    exact, _ = attention(q, k, v, causal=False)
    tiled, _ = recipe_attention(q, k, v, recipe="qk8pv8", causal=False, compensation=True)
    head, _ = recipe_attention(q, k, v, recipe="qk8pv8", causal=False, compensation=True, comp_digits=True)
    assert _rel(head[128:], exact[128:]) > _rel(tiled[128:], exact[128:])   # coarser on the tiny tile
    assert _rel(head, exact) < 0.05
    big = (torch.randn(64, 2, 64, generator=gen) * 1e-3 + 30.0).bfloat16()
    ex, _ = attention(big, k, v, causal=False)
    o, _ = recipe_attention(big, k, v, recipe="qk4pv8", causal=False, compensation=True, comp_digits=True)
    assert _rel(o, ex) < 0.05
