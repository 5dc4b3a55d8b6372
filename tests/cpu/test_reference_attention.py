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


def test_recipe_attention_quantizes_q_per_tile():
    """One FP8 scale per q_tile rows: a tile of tiny queries next to a tile of large ones keeps its
    own scale; one scale for both would push the tiny tile into E4M3's subnormals."""
    gen = _gen(301)
    q = torch.randn(256, 2, 64, generator=gen)
    q[128:] *= 3e-5
    k = torch.randn(40, 2, 64, generator=gen)
    v = torch.randn(40, 2, 64, generator=gen)
    q = q.bfloat16()
    sm = 1 / 8 / 3e-5                       # makes the tiny tile's scores O(1)
    exact, _ = attention(q, k, v, causal=False, sm_scale=sm)
    tiled, _ = recipe_attention(q, k, v, recipe="qk8pv8", causal=False, compensation=False, q_tile=128, sm_scale=sm)
    one, _ = recipe_attention(q, k, v, recipe="qk8pv8", causal=False, compensation=False, q_tile=256, sm_scale=sm)
    err_t = _rel(tiled[128:], exact[128:])
    err_1 = _rel(one[128:], exact[128:])
    assert err_t < 0.05
    assert err_t < 0.5 * err_1, (err_t, err_1)
