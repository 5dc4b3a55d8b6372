"""NaN and inf inputs through the public API on the GPU (PagedKVCache, append_kv, the prefill and decode
wrappers), as README's "Non-finite inputs" defines them: never hidden as 0 or a finite value, and the
other requests of the batch finite and bit-identical to a clean run of the same plan.

One non-finite element at a time, for every recipe and head_dim 64 / 128. NaN for every recipe, and inf
for the quantized ones (their cache stores a NaN scale / E4M3 NaN), give NaN:
* in Q (row r, head h): decode in (r, h); prefill in (r, h) for bf16, and for the FP8-Q recipes in every
  row of r's request for head h (the chunk's mean mu_Q is subtracted from each row);
* in one appended K row (token t, KV head g): in every row that sees t, for g's query heads;
* in one appended V row (token t, KV head g, channel c): in channel c of the same outputs.
inf with bf16 is IEEE arithmetic: in Q (channel c) it makes every visible score +-inf or NaN, and the
set-up has a visible key with q[c] * k[c] >= 0, so (r, h) is NaN (exp(inf - inf)); in K (channel c) the
score of t is sign(q[c]) * inf for each row and head that sees t: NaN where q[c] >= 0 (0 * inf is NaN
too), finite where q[c] < 0 (the key gets weight 0); in V, NaN or inf in channel c of every output
that sees t.
Outputs are NaN-poisoned before every run, so an unwritten row cannot pass for a finite one.
"""
import itertools
import math
import zlib

import pytest
import torch

import mpfa
from mpfa.reference import gather_pages
from mpfa.recipes import RECIPES as RECIPE_TABLE

pytestmark = [pytest.mark.gpu]

RECIPES = tuple(RECIPE_TABLE)   # every recipe mpfa defines
HEAD_DIMS = (64, 128)
BAD = (math.nan, math.inf)
PAGE_SIZE = 16
KV_HEADS, GROUP = 2, 4
HEAD, KV_HEAD, CHANNEL = 5, 1, 9          # the poisoned query head / KV head and channel (HEAD reads KV_HEAD)
WORKSPACE = 128 << 20

# Prefill requests as (cached prefix, new chunk); request 1 gets the poison: its chunk spans two Q tiles
# and the poisoned token (prefix + 60) is seen by chunk rows 60 and after only.
PREFILL_REQUESTS = [(0, 40), (37, 150), (100, 1), (20, 60)]
PREFILL_TARGET, PREFILL_TOKEN_IN_CHUNK, PREFILL_Q_ROW_IN_CHUNK = 1, 60, 10
# Decode lengths: request 1 gets the poison, long enough to be cut into several KV splits.
DECODE_LENGTHS = [300, 1500, 64, 777]
DECODE_TARGET, DECODE_TOKEN = 1, 1100


def _seed(*parts):
    return torch.Generator(device="cuda").manual_seed(zlib.crc32("-".join(map(str, parts)).encode()))


def _slot(batch, request: int, token: int) -> torch.Tensor:
    page = batch.indices[int(batch.indptr[request]) + token // PAGE_SIZE]
    return (page.long() * PAGE_SIZE + token % PAGE_SIZE).view(1)


def _poison(x: torch.Tensor, index, bad: float) -> torch.Tensor:
    y = x.clone()
    y[index] = bad
    return y


def _clean_and_poisoned(where, bad, layer, q, q_row, slot, head_dim, bf16_rows, gen, run):
    """Outputs of ``run(q)`` before and after one element of Q (row ``q_row``), or of the K / V row
    appended at ``slot``, is made ``bad``. For K / V a fresh clean row is appended at that slot first,
    then the same row with the element poisoned."""
    if where == "q":
        return run(q), run(_poison(q, (q_row, HEAD, CHANNEL), bad))
    k, v = bf16_rows(1, KV_HEADS, head_dim, gen), bf16_rows(1, KV_HEADS, head_dim, gen)
    mpfa.append_kv(k, v, layer, slot)
    clean = run(q)
    if where == "k":
        k = _poison(k, (0, KV_HEAD, CHANNEL), bad)
    else:
        v = _poison(v, (0, KV_HEAD, CHANNEL), bad)
    mpfa.append_kv(k, v, layer, slot)
    return clean, run(q)


class Expect:
    """Bool masks [rows, heads, D] of what the outputs must be: NaN, non-finite (NaN or inf), finite."""

    def __init__(self, o):
        self.nan, self.nonfinite, self.finite = (torch.zeros(o.shape, dtype=torch.bool, device=o.device)
                                                 for _ in range(3))

    def key_by_sign(self, rows, heads, q_channel, bad):
        """inf in K channel c for (rows, heads) that see it: NaN where q[c] * inf >= 0 (score +inf or
        NaN), finite where it is < 0 (score -inf). bf16 q: exact, 0 included."""
        nan = ~(q_channel.float() * bad < 0).unsqueeze(-1)       # 0 * inf is NaN: not < 0
        self.nan[rows, heads] |= nan
        self.finite[rows, heads] |= ~nan
        assert nan.any() and not nan.all(), "set-up: the rows that see the key should have q[c] of both signs"


def _visible_keys(batch, request: int, count: int) -> torch.Tensor:
    """The first ``count`` keys of ``request`` as the bf16 cache holds them, [count, KV_HEADS, D]."""
    pages = batch.indices[int(batch.indptr[request]):int(batch.indptr[request + 1])]
    return gather_pages(batch.layer.fields["k"], pages, count)


def _expect_nan_row_for_inf_q(expect, row, keys, bad):
    """bf16 inf in q[row, HEAD, CHANNEL]: every visible score is +-inf or NaN; a +inf or NaN one (a key
    with k[c] * inf >= 0) makes the row NaN, which is what the set-up provides."""
    assert (~(keys[:, KV_HEAD, CHANNEL].float() * bad < 0)).any(), "set-up: no visible key gives +inf or NaN"
    expect.nan[row, HEAD] = True


def _assert_pattern(o, clean, expect, others, label):
    """``o`` matches ``expect``; the rows ``others`` (other requests) finite and equal to the clean run
    bit for bit."""
    torch.cuda.synchronize()
    for mask, ok, what in ((expect.nan, torch.isnan(o), "NaN"), (expect.nonfinite, ~torch.isfinite(o), "NaN or inf"),
                           (expect.finite, torch.isfinite(o), "finite")):
        wrong = mask & ~ok
        if wrong.any():
            at = wrong.nonzero()[0]
            raise AssertionError(f"{label}: {int(wrong.sum())} of {int(mask.sum())} outputs that should be {what} "
                                 f"are not (e.g. at {at.tolist()}: {o[tuple(at)].item()})")
    assert torch.isfinite(clean[others]).all(), f"{label}: the clean run has non-finite outputs"
    assert torch.isfinite(o[others]).all(), f"{label}: another request's output is not finite"
    assert torch.equal(o[others], clean[others]), f"{label}: another request's output changed"


@pytest.mark.parametrize("recipe,head_dim,where,bad",
                         list(itertools.product(RECIPES, HEAD_DIMS, ("q", "k", "v"), BAD)))
def test_prefill_nonfinite_input(recipe, head_dim, where, bad, paged_batch, bf16_rows, shared_jit_cache):
    gen = _seed("prefill", recipe, head_dim, where, bad)
    lengths = [p + c for p, c in PREFILL_REQUESTS]
    batch = paged_batch(recipe, head_dim, PAGE_SIZE, KV_HEADS, lengths, gen)
    chunks = [c for _, c in PREFILL_REQUESTS]
    qo = torch.tensor([0] + list(itertools.accumulate(chunks)), dtype=torch.int32, device="cuda")
    q = bf16_rows(int(qo[-1]), KV_HEADS * GROUP, head_dim, gen)
    first = int(qo[PREFILL_TARGET])
    q[first + PREFILL_TOKEN_IN_CHUNK + 5, KV_HEAD * GROUP, CHANNEL] = 0    # bf16 inf in K: 0 * inf must give NaN
    rows = slice(first, int(qo[PREFILL_TARGET + 1]))
    q_row = first + PREFILL_Q_ROW_IN_CHUNK
    prefix = PREFILL_REQUESTS[PREFILL_TARGET][0]
    slot = _slot(batch, PREFILL_TARGET, prefix + PREFILL_TOKEN_IN_CHUNK)

    w = mpfa.BatchPrefillWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
    w.plan(qo, batch.indptr, batch.indices, batch.last, KV_HEADS * GROUP, KV_HEADS, head_dim, PAGE_SIZE,
           causal=True, recipe=recipe)
    assert w.backend == "cuda"

    def run(q_):
        return w.run(q_, batch.layer, out=torch.full_like(q_, math.nan))

    clean, o = _clean_and_poisoned(where, bad, batch.layer, q, q_row, slot, head_dim, bf16_rows, gen, run)

    expect = Expect(o)
    ieee_inf = recipe == "bf16" and math.isinf(bad)
    group_heads = slice(KV_HEAD * GROUP, (KV_HEAD + 1) * GROUP)
    sees_token = slice(first + PREFILL_TOKEN_IN_CHUNK, rows.stop)       # bottom-right causal
    if where == "q" and ieee_inf:
        _expect_nan_row_for_inf_q(expect, q_row, _visible_keys(batch, PREFILL_TARGET,
                                                               prefix + PREFILL_Q_ROW_IN_CHUNK + 1), bad)
    elif where == "q":
        expect.nan[q_row if recipe == "bf16" else rows, HEAD] = True
    elif where == "k" and ieee_inf:
        expect.key_by_sign(sees_token, group_heads, q[sees_token, group_heads, CHANNEL], bad)
    elif where == "k":
        expect.nan[sees_token, group_heads] = True
    else:
        (expect.nonfinite if ieee_inf else expect.nan)[sees_token, group_heads, CHANNEL] = True
    others = torch.ones(o.shape[0], dtype=torch.bool, device="cuda")
    others[rows] = False
    _assert_pattern(o, clean, expect, others, f"prefill {recipe} d{head_dim} {bad} in {where}")


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("recipe,head_dim,where,bad",
                         list(itertools.product(RECIPES, HEAD_DIMS, ("q", "k", "v"), BAD)))
def test_decode_nonfinite_input(recipe, head_dim, where, bad, num_splits, paged_batch, bf16_rows, shared_jit_cache):
    gen = _seed("decode", recipe, head_dim, where, bad, num_splits)
    batch = paged_batch(recipe, head_dim, PAGE_SIZE, KV_HEADS, DECODE_LENGTHS, gen)
    q = bf16_rows(len(DECODE_LENGTHS), KV_HEADS * GROUP, head_dim, gen)
    # bf16 inf in K: the group's query heads get a score of +inf, -inf, NaN (0 * inf) and -inf
    q[DECODE_TARGET, KV_HEAD * GROUP:(KV_HEAD + 1) * GROUP, CHANNEL] = torch.tensor([1.0, -1.0, 0.0, -0.5])
    slot = _slot(batch, DECODE_TARGET, DECODE_TOKEN)

    w = mpfa.BatchDecodeWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
    w.plan(batch.indptr, batch.indices, batch.last, KV_HEADS * GROUP, KV_HEADS, head_dim, PAGE_SIZE,
           recipe=recipe, num_splits=num_splits)
    assert w.backend == "cuda" and w.num_splits == num_splits

    def run(q_):
        return w.run(q_, batch.layer, out=torch.full_like(q_, math.nan))

    clean, o = _clean_and_poisoned(where, bad, batch.layer, q, DECODE_TARGET, slot, head_dim, bf16_rows, gen, run)

    expect = Expect(o)
    ieee_inf = recipe == "bf16" and math.isinf(bad)
    group_heads = slice(KV_HEAD * GROUP, (KV_HEAD + 1) * GROUP)
    row = slice(DECODE_TARGET, DECODE_TARGET + 1)
    if where == "q" and ieee_inf:
        _expect_nan_row_for_inf_q(expect, DECODE_TARGET,
                                  _visible_keys(batch, DECODE_TARGET, DECODE_LENGTHS[DECODE_TARGET]), bad)
    elif where == "q":
        expect.nan[DECODE_TARGET, HEAD] = True
    elif where == "k" and ieee_inf:
        expect.key_by_sign(row, group_heads, q[row, group_heads, CHANNEL], bad)
    elif where == "k":
        expect.nan[DECODE_TARGET, group_heads] = True
    else:
        (expect.nonfinite if ieee_inf else expect.nan)[DECODE_TARGET, group_heads, CHANNEL] = True
    others = torch.ones(o.shape[0], dtype=torch.bool, device="cuda")
    others[DECODE_TARGET] = False
    _assert_pattern(o, clean, expect, others, f"decode {recipe} d{head_dim} splits {num_splits} {bad} in {where}")
