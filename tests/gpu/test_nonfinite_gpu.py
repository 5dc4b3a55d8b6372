"""NaN and inf inputs through the public API on the GPU (PagedKVCache, append_kv, the prefill and decode
wrappers), as docs/api.md's "Non-finite inputs" defines them: never hidden as 0 or a finite value, and every
output the non-finite input cannot reach finite and bit-identical to a clean run of the same plan: the other
requests, the other KV heads' query heads of the same request and, within the request, the rows that cannot
see a non-finite key (it sits at a position the causal mask hides from them).

One non-finite element at a time, for every recipe and head_dim 64 / 128. NaN for every recipe, and inf
for the quantized ones (their cache stores a NaN scale / E4M3 NaN), give NaN:
* in Q (row r, head h): decode in (r, h), and for a quantized recipe's inf every query head of h's KV head
  (the kernel scales their Q rows together); prefill in (r, h) for bf16, and for the FP8-Q recipes in every
  row of r's request for head h (the chunk's mean mu_Q is subtracted from each row);
* in one appended K row (token t, KV head g): in every row that sees t, for g's query heads; with qk4pv8's
  one K scale per 128-key tile (tile_scale) in every row that sees any key of t's tile, which makes that
  scale NaN (docs/api.md states it; the test pins it, see K_TILE_SPREAD);
* in one appended V row (token t, KV head g, channel c): in channel c of the same outputs; channel c of
  g's other rows may be NaN too (docs/api.md: a masked key's V meets a zero probability in the tile's MMA), or
  equal to the clean run. qk4pv4 stores V rotated (V H mixes every channel), so the whole row is stored NaN and
  every channel of those outputs is: v_channels.
inf with bf16 is IEEE arithmetic: in Q (channel c) it makes every visible score +-inf or NaN, and the
set-up has a visible key with q[c] * k[c] >= 0, so (r, h) is NaN (exp(inf - inf)); in K (channel c) the
score of t is sign(q[c]) * inf for each row and head that sees t: NaN where q[c] >= 0 (0 * inf is NaN
too), finite where q[c] < 0 (the key gets weight 0); in V, NaN or inf in channel c of every output
that sees t.
Outputs are NaN-poisoned before every run, so an unwritten row cannot pass for a finite one. Masked positions
hold non-finite values in every run: the causally hidden key above, and the cache slots past each request's
length (NaN bytes, tests/gpu/conftest.py; test_nonfinite_past_the_length_is_never_read puts inf there and
checks the outputs bit for bit).
"""
import itertools
import math
import zlib

import pytest
import torch

import mpfa
from mpfa.reference import gather_pages
from mpfa.recipes import RECIPES as RECIPE_TABLE
from mpfa_jit.ops import prefill as prefill_op

pytestmark = [pytest.mark.gpu]

RECIPES = tuple(RECIPE_TABLE)   # every recipe mpfa defines
HEAD_DIMS = (64, 128)
BAD = (math.nan, math.inf)
PAGE_SIZE = 16
KV_HEADS, GROUP = 2, 4
HEAD, KV_HEAD, CHANNEL = 5, 1, 9          # the poisoned query head / KV head and channel (HEAD reads KV_HEAD)
WORKSPACE = 128 << 20

# Prefill requests as (cached prefix, new chunk); request 1 gets the poison: its chunk spans two CTAs (192 rows)
# and four 64-row Q tiles, and the poisoned token (prefix + 160, key 197: the second 128-key tile) is seen by
# chunk rows 160 and after only; rows 0..90 see no key of its tile (key 127 at most), rows 91..159 some.
PREFILL_REQUESTS = [(0, 40), (37, 250), (100, 1), (20, 60)]
PREFILL_TARGET, PREFILL_TOKEN_IN_CHUNK, PREFILL_Q_ROW_IN_CHUNK = 1, 160, 10
KV_TILE = 128
# Recipes whose prefill scores each 128-key tile under one K scale (mpfa_jit/ops/prefill.py SERVED_KNOBS
# tile_scale): a non-finite key makes its tile's scale NaN, and with it every row that sees a key of that tile.
K_TILE_SPREAD = tuple(r for r in RECIPE_TABLE if prefill_op.SERVED_KNOBS[r].get("tile_scale"))
# Decode lengths: request 1 gets the poison, long enough to be cut into several KV splits.
DECODE_LENGTHS = [300, 1500, 64, 777]
DECODE_TARGET, DECODE_TOKEN = 1, 1100


def v_channels(recipe):
    """The output channels one non-finite V element reaches: its own, or every one where V is stored rotated."""
    return slice(None) if RECIPE_TABLE[recipe].v_format == "u4h" else CHANNEL


def _seed(*parts, device="cuda"):
    return torch.Generator(device=device).manual_seed(zlib.crc32("-".join(map(str, parts)).encode()))


def _backend(device) -> str:
    """The kernels on the GPU; the reference elsewhere (tests/cpu/test_reference_prefill_kernel.py runs these cases
    on the CPU against the reference, which follows the same rules)."""
    return "auto" if str(device).startswith("cuda") else "reference"


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
    k, v = (bf16_rows(1, KV_HEADS, head_dim, gen, device=q.device.type) for _ in range(2))
    mpfa.append_kv(k, v, layer, slot, backend=_backend(q.device))
    clean = run(q)
    if where == "k":
        k = _poison(k, (0, KV_HEAD, CHANNEL), bad)
    else:
        v = _poison(v, (0, KV_HEAD, CHANNEL), bad)
    mpfa.append_kv(k, v, layer, slot, backend=_backend(q.device))
    return clean, run(q)


class Expect:
    """Bool masks [rows, heads, D] of what the outputs must be: NaN, non-finite (NaN or inf), finite, or NaN or
    equal to the clean run; every other output must be finite and equal to the clean run bit for bit."""

    def __init__(self, o):
        self.nan, self.nonfinite, self.finite, self.nan_or_equal = (
            torch.zeros(o.shape, dtype=torch.bool, device=o.device) for _ in range(4))

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


def _first_wrong(wrong, o, clean, label, what):
    at = wrong.nonzero()[0]
    raise AssertionError(f"{label}: {int(wrong.sum())} outputs that should be {what} are not (e.g. at [row, head, "
                         f"channel] {at.tolist()}: {o[tuple(at)].item()}, clean run {clean[tuple(at)].item()})")


def _assert_pattern(o, clean, expect, label):
    """``o`` matches ``expect``; every output ``expect`` does not name finite and equal to the clean run bit for
    bit (the other requests, the other KV heads, the rows the input cannot reach)."""
    if o.is_cuda:
        torch.cuda.synchronize()
    assert torch.isfinite(clean).all(), f"{label}: the clean run has non-finite outputs"
    for mask, ok, what in ((expect.nan, torch.isnan(o), "NaN"), (expect.nonfinite, ~torch.isfinite(o), "NaN or inf"),
                           (expect.finite, torch.isfinite(o), "finite"),
                           (expect.nan_or_equal, torch.isnan(o) | (o == clean), "NaN or equal to the clean run")):
        if (mask & ~ok).any():
            _first_wrong(mask & ~ok, o, clean, label, what)
    rest = ~(expect.nan | expect.nonfinite | expect.finite | expect.nan_or_equal)
    wrong = rest & ~(o == clean)          # NaN != NaN: a NaN that leaked is wrong here too
    if wrong.any():
        _first_wrong(wrong, o, clean, label, "finite and equal to the clean run (the input cannot reach them)")


@pytest.mark.parametrize("recipe,head_dim,where,bad",
                         list(itertools.product(RECIPES, HEAD_DIMS, ("q", "k", "v"), BAD)))
def test_prefill_nonfinite_input(recipe, head_dim, where, bad, paged_batch, bf16_rows, shared_jit_cache):
    prefill_case(recipe, head_dim, where, bad, paged_batch, bf16_rows)


def prefill_case(recipe, head_dim, where, bad, paged_batch, bf16_rows, device="cuda"):
    gen = _seed("prefill", recipe, head_dim, where, bad, device=device)
    lengths = [p + c for p, c in PREFILL_REQUESTS]
    batch = paged_batch(recipe, head_dim, PAGE_SIZE, KV_HEADS, lengths, gen, device=device)
    chunks = [c for _, c in PREFILL_REQUESTS]
    qo = torch.tensor([0] + list(itertools.accumulate(chunks)), dtype=torch.int32, device=device)
    q = bf16_rows(int(qo[-1]), KV_HEADS * GROUP, head_dim, gen, device=device)
    first = int(qo[PREFILL_TARGET])
    q[first + PREFILL_TOKEN_IN_CHUNK + 5, KV_HEAD * GROUP, CHANNEL] = 0    # bf16 inf in K: 0 * inf must give NaN
    rows = slice(first, int(qo[PREFILL_TARGET + 1]))
    q_row = first + PREFILL_Q_ROW_IN_CHUNK
    prefix = PREFILL_REQUESTS[PREFILL_TARGET][0]
    slot = _slot(batch, PREFILL_TARGET, prefix + PREFILL_TOKEN_IN_CHUNK)

    w = mpfa.BatchPrefillWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device=device), backend=_backend(device))
    w.plan(qo, batch.indptr, batch.indices, batch.last, KV_HEADS * GROUP, KV_HEADS, head_dim, PAGE_SIZE,
           causal=True, recipe=recipe)
    assert w.backend == ("cuda" if device == "cuda" else "reference")

    def run(q_):
        return w.run(q_, batch.layer, out=torch.full_like(q_, math.nan))

    clean, o = _clean_and_poisoned(where, bad, batch.layer, q, q_row, slot, head_dim, bf16_rows, gen, run)

    expect = Expect(o)
    ieee_inf = recipe == "bf16" and math.isinf(bad)
    group_heads = slice(KV_HEAD * GROUP, (KV_HEAD + 1) * GROUP)
    sees_token = slice(first + PREFILL_TOKEN_IN_CHUNK, rows.stop)       # bottom-right causal
    hidden = slice(first, sees_token.start)                             # the request's rows the token is masked for
    if where == "q" and ieee_inf:
        _expect_nan_row_for_inf_q(expect, q_row, _visible_keys(batch, PREFILL_TARGET,
                                                               prefix + PREFILL_Q_ROW_IN_CHUNK + 1), bad)
    elif where == "q":
        expect.nan[q_row if recipe == "bf16" else rows, HEAD] = True
    elif where == "k" and ieee_inf:
        expect.key_by_sign(sees_token, group_heads, q[sees_token, group_heads, CHANNEL], bad)
    elif where == "k":
        expect.nan[sees_token, group_heads] = True
        if recipe in K_TILE_SPREAD:   # the rows that see a key of the token's 128-key tile but not the token
            tile_first_key = (prefix + PREFILL_TOKEN_IN_CHUNK) // KV_TILE * KV_TILE
            expect.nan[first + tile_first_key - prefix:sees_token.start, group_heads] = True
    else:
        (expect.nonfinite if ieee_inf else expect.nan)[sees_token, group_heads, v_channels(recipe)] = True
        expect.nan_or_equal[hidden, group_heads, v_channels(recipe)] = True
    _assert_pattern(o, clean, expect, f"prefill {recipe} d{head_dim} {bad} in {where}")


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("recipe,head_dim,where,bad",
                         list(itertools.product(RECIPES, HEAD_DIMS, ("q", "k", "v"), BAD)))
def test_decode_nonfinite_input(recipe, head_dim, where, bad, num_splits, paged_batch, bf16_rows, shared_jit_cache):
    decode_case(recipe, head_dim, where, bad, num_splits, paged_batch, bf16_rows)


def decode_case(recipe, head_dim, where, bad, num_splits, paged_batch, bf16_rows, device="cuda"):
    gen = _seed("decode", recipe, head_dim, where, bad, num_splits, device=device)
    batch = paged_batch(recipe, head_dim, PAGE_SIZE, KV_HEADS, DECODE_LENGTHS, gen, device=device)
    q = bf16_rows(len(DECODE_LENGTHS), KV_HEADS * GROUP, head_dim, gen, device=device)
    # bf16 inf in K: the group's query heads get a score of +inf, -inf, NaN (0 * inf) and -inf
    q[DECODE_TARGET, KV_HEAD * GROUP:(KV_HEAD + 1) * GROUP, CHANNEL] = torch.tensor([1.0, -1.0, 0.0, -0.5])
    slot = _slot(batch, DECODE_TARGET, DECODE_TOKEN)

    w = mpfa.BatchDecodeWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device=device), backend=_backend(device))
    w.plan(batch.indptr, batch.indices, batch.last, KV_HEADS * GROUP, KV_HEADS, head_dim, PAGE_SIZE,
           recipe=recipe, num_splits=num_splits)
    assert w.backend == ("cuda" if device == "cuda" else "reference")
    if device == "cuda":
        assert w.num_splits == num_splits

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
        # a NaN or inf makes only its own head NaN: each query head has its own fp16 Q prescale
        expect.nan[DECODE_TARGET, HEAD] = True
    elif where == "k" and ieee_inf:
        expect.key_by_sign(row, group_heads, q[row, group_heads, CHANNEL], bad)
    elif where == "k":
        expect.nan[DECODE_TARGET, group_heads] = True
    else:
        (expect.nonfinite if ieee_inf else expect.nan)[DECODE_TARGET, group_heads, v_channels(recipe)] = True
    _assert_pattern(o, clean, expect, f"decode {recipe} d{head_dim} splits {num_splits} {bad} in {where}")


def _fill_past_length(batch, page_size: int) -> None:
    """Every field of the slots past each request's length in its last page: +inf where the field is a float
    (bf16 K/V, the float32 K scales), 0x7F in the byte fields (INT8 K, block scales; E4M3 V: NaN)."""
    for b, n in enumerate(batch.lengths):
        pages = int(batch.indptr[b + 1]) - int(batch.indptr[b])
        if pages == 0:
            continue
        page = int(batch.indices[int(batch.indptr[b + 1]) - 1])
        off = n - (pages - 1) * page_size
        for t in batch.layer.fields.values():
            if t.dtype.is_floating_point:
                t[page, :, off:] = math.inf
            else:
                t[page, :, off:].view(torch.uint8).fill_(0x7F)


@pytest.mark.parametrize("op", ["prefill", "decode"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_nonfinite_past_the_length_is_never_read(recipe, op, paged_batch, bf16_rows, shared_jit_cache):
    """The slots past each request's length (masked for every row) holding inf instead of the fixture's NaN bytes:
    the outputs stay finite and bit-identical (0 * inf would be NaN where a masked slot met a zero weight)."""
    head_dim = 128
    gen = _seed("past-length", recipe, op)
    if op == "prefill":
        lengths = [p + c for p, c in PREFILL_REQUESTS]
        batch = paged_batch(recipe, head_dim, PAGE_SIZE, KV_HEADS, lengths, gen)
        qo = torch.tensor([0] + list(itertools.accumulate(c for _, c in PREFILL_REQUESTS)), dtype=torch.int32,
                          device="cuda")
        w = mpfa.BatchPrefillWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
        w.plan(qo, batch.indptr, batch.indices, batch.last, KV_HEADS * GROUP, KV_HEADS, head_dim, PAGE_SIZE,
               causal=True, recipe=recipe)
        q = bf16_rows(int(qo[-1]), KV_HEADS * GROUP, head_dim, gen)
    else:
        batch = paged_batch(recipe, head_dim, PAGE_SIZE, KV_HEADS, DECODE_LENGTHS, gen)
        w = mpfa.BatchDecodeWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
        w.plan(batch.indptr, batch.indices, batch.last, KV_HEADS * GROUP, KV_HEADS, head_dim, PAGE_SIZE,
               recipe=recipe, num_splits=4)
        q = bf16_rows(len(DECODE_LENGTHS), KV_HEADS * GROUP, head_dim, gen)
    assert w.backend == "cuda"
    assert any(n % PAGE_SIZE for n in batch.lengths), "set-up: some request should end inside a page"
    nan_past = w.run(q, batch.layer, out=torch.full_like(q, math.nan))
    _fill_past_length(batch, PAGE_SIZE)
    inf_past = w.run(q, batch.layer, out=torch.full_like(q, math.nan))
    _assert_pattern(inf_past, nan_past, Expect(inf_past), f"{op} {recipe}: inf past the length")
