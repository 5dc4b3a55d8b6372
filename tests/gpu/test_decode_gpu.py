"""The batch-decode kernel on the GPU against the fp64 reference on the dequantized cache, for every
built recipe, head_dim, page size and group size; ragged lengths, permuted pages, NaN-poisoned
outputs and NaN-poisoned cache slots past each request's length (the kernel must never read them);
forced split counts; the work list (mixed lengths, one item for a short request and several for a long one);
and CUDA-graph replay while lengths grow or the batch's composition changes."""
import itertools
import zlib

import pytest
import torch

import mpfa
from mpfa.reference import attention, gather_pages
from mpfa.recipes import RECIPES as RECIPE_TABLE

pytestmark = [pytest.mark.gpu]

RECIPES = tuple(RECIPE_TABLE)   # every recipe mpfa defines
WORKSPACE = 64 << 20


def _lengths(page_size):
    p = page_size
    return [1, 3 * p, 5 * p + (7 if p > 8 else 0) + 37, 64 * 3, 777, 64 * 5 + 1]


def _reference(q, layer, indptr, indices, lengths, sm_scale=None):
    kd, vd = layer.dequantize(dtype=torch.float64)
    outs, lses = [], []
    for b, n in enumerate(lengths):
        ids = indices[int(indptr[b]):int(indptr[b + 1])]
        kb, vb = gather_pages(kd, ids, n), gather_pages(vd, ids, n)
        o, lse = attention(q[b:b + 1], kb, vb, causal=False, sm_scale=sm_scale, dtype=torch.float64)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


def _poisoned_like(q):
    """An output buffer of NaN: an element the kernel leaves unwritten stays NaN and fails _check."""
    return torch.full_like(q, float("nan"))


def _rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _check(o, lse, o_ref, lse_ref, tol=5e-3, recipe=None):
    """Per request rel-L2 <= ``tol``; a recipe whose V is stored rotated (qk4pv4) rounds its output to bf16 once
    more (the kernel's O_rot, before the wrapper's O = O_rot H): at most 2^-9 more in rel-L2 (round to nearest,
    8 significant bits; H keeps norms)."""
    if recipe is not None and RECIPE_TABLE[recipe].v_format == "u4h":
        tol += 2.0 ** -9
    assert torch.isfinite(o).all(), "output has non-finite elements (unwritten or NaN read)"
    for b in range(o.shape[0]):
        err = _rel_l2(o[b], o_ref[b])
        assert err <= tol, f"request {b}: rel-L2 {err:.2e} > {tol}"
    if lse is not None:
        assert torch.isfinite(lse).all()
        assert torch.allclose(lse.double(), lse_ref, atol=2e-3, rtol=1e-4), (lse.double() - lse_ref).abs().max()


@pytest.mark.parametrize("recipe,head_dim,page_size,group",
                         list(itertools.product(RECIPES, (64, 128), (1, 16, 32, 64), (1, 3, 4, 5, 8))))
def test_decode_matches_fp64_reference(recipe, head_dim, page_size, group, paged_batch, bf16_rows, shared_jit_cache):
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{recipe}-{head_dim}-{page_size}-{group}".encode()))
    hkv = 2
    lengths = _lengths(page_size)
    batch = paged_batch(recipe, head_dim, page_size, hkv, lengths, gen)
    layer, indptr, indices, last = batch.layer, batch.indptr, batch.indices, batch.last
    q = bf16_rows(len(lengths), hkv * group, head_dim, gen)
    w = mpfa.BatchDecodeWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
    w.plan(indptr, indices, last, hkv * group, hkv, head_dim, page_size, recipe=recipe)
    assert w.backend == "cuda"
    out = _poisoned_like(q)
    o, lse = w.run(q, layer, out=out, return_lse=True)
    assert o.data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    o_ref, lse_ref = _reference(q, layer, indptr, indices, lengths)
    _check(o, lse, o_ref, lse_ref, recipe=recipe)


@pytest.mark.parametrize("recipe,group", list(itertools.product(RECIPES, (2, 6, 7))))
def test_decode_remaining_group_sizes(recipe, group, paged_batch, bf16_rows, shared_jit_cache):
    # Query heads are the N = 8 columns of the swapped MMAs: every group size maps heads to lanes
    # (2c, 2c + 1) differently; the parametrization above covers 1, 3, 4, 5, 8.
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"groups-{recipe}-{group}".encode()))
    hkv, head_dim, page_size = 2, 128, 16
    lengths = _lengths(page_size)
    batch = paged_batch(recipe, head_dim, page_size, hkv, lengths, gen)
    layer, indptr, indices, last = batch.layer, batch.indptr, batch.indices, batch.last
    q = bf16_rows(len(lengths), hkv * group, head_dim, gen)
    w = mpfa.BatchDecodeWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
    w.plan(indptr, indices, last, hkv * group, hkv, head_dim, page_size, recipe=recipe)
    o, lse = w.run(q, layer, out=_poisoned_like(q), return_lse=True)
    torch.cuda.synchronize()
    o_ref, lse_ref = _reference(q, layer, indptr, indices, lengths)
    _check(o, lse, o_ref, lse_ref, recipe=recipe)


@pytest.mark.parametrize("recipe", RECIPES)
def test_forced_num_splits_agree(recipe, paged_batch, bf16_rows, shared_jit_cache):
    gen = torch.Generator(device="cuda").manual_seed(3)
    hkv, group, d, p = 2, 4, 128, 16
    lengths = [1, 16, 1000, 4097, 64, 65]
    batch = paged_batch(recipe, d, p, hkv, lengths, gen)
    layer, indptr, indices, last = batch.layer, batch.indptr, batch.indices, batch.last
    q = bf16_rows(len(lengths), hkv * group, d, gen)
    o_ref, lse_ref = _reference(q, layer, indptr, indices, lengths)
    results = []
    for splits in (1, 2, 7, None):
        w = mpfa.BatchDecodeWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
        w.plan(indptr, indices, last, hkv * group, hkv, d, p, recipe=recipe, num_splits=splits)
        if splits is not None:
            assert w.num_splits == splits
        o, lse = w.run(q, layer, out=_poisoned_like(q), return_lse=True)
        torch.cuda.synchronize()
        _check(o, lse, o_ref, lse_ref, recipe=recipe)
        results.append(o.float())
    for r in results[1:]:
        assert _rel_l2(r, results[0]) <= 3e-3


@pytest.mark.parametrize("recipe", RECIPES)
def test_fixed_split_size_is_batch_invariant(recipe, paged_batch, bf16_rows, shared_jit_cache):
    """fixed_split_size cuts each request the same way whatever the grid or the batch: outputs are
    bit-identical between the batch's own grid, a larger fixed grid (a CUDA graph's), a grid of too few
    splits for the longest request (the work list lends it the items the short ones leave) and each
    request alone; all match the fp64 reference."""
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"fixed-{recipe}".encode()))
    hkv, group, d, p = 2, 4, 128, 16
    lengths = [1, 16, 1000, 4097, 64, 65, 2500]
    batch = paged_batch(recipe, d, p, hkv, lengths, gen)
    layer, indptr, indices, last = batch.layer, batch.indptr, batch.indices, batch.last
    q = bf16_rows(len(lengths), hkv * group, d, gen)
    o_ref, lse_ref = _reference(q, layer, indptr, indices, lengths)
    ws = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")

    def run(num_splits, ip=indptr, ids=indices, lp=last, qq=q):
        w = mpfa.BatchDecodeWrapper(ws)
        w.plan(ip, ids, lp, hkv * group, hkv, d, p, recipe=recipe, num_splits=num_splits, fixed_split_size=512)
        o, lse = w.run(qq, layer, out=_poisoned_like(qq), return_lse=True)
        torch.cuda.synchronize()
        return w.num_splits, o.clone(), lse.clone()

    splits, o_own, lse_own = run(None)
    assert splits == -(-4097 // 512)
    _check(o_own, lse_own, o_ref, lse_ref, recipe=recipe)
    _, o_big, lse_big = run(40)
    assert torch.equal(o_big, o_own) and torch.equal(lse_big, lse_own)
    _, o_small, lse_small = run(3)   # 4097 and 2500 tokens need 9 and 5 splits of 512: 20 of 21 items
    assert torch.equal(o_small, o_own) and torch.equal(lse_small, lse_own)
    for b in (2, 3, 6):
        pages = indices[int(indptr[b]):int(indptr[b + 1])]
        ip1 = torch.tensor([0, pages.numel()], dtype=torch.int32, device="cuda")
        _, o1, lse1 = run(40, ip1, pages, last[b:b + 1], q[b:b + 1].contiguous())
        assert torch.equal(o1[0], o_own[b]) and torch.equal(lse1[0], lse_own[b]), f"request {b} alone differs"
    with pytest.raises(ValueError, match="fixed_split_size"):
        mpfa.BatchDecodeWrapper(ws).plan(indptr, indices, last, hkv * group, hkv, d, p, recipe=recipe,
                                         fixed_split_size=100)


def test_workspace_too_small_names_the_buffer(paged_batch, shared_jit_cache):
    gen = torch.Generator(device="cuda").manual_seed(5)
    batch = paged_batch("qk4pv8", 128, 16, 2, [4000, 4000], gen)
    indptr, indices, last = batch.indptr, batch.indices, batch.last
    w = mpfa.BatchDecodeWrapper(torch.empty(1024, dtype=torch.uint8, device="cuda"))
    with pytest.raises(ValueError, match="workspace_buffer"):
        w.plan(indptr, indices, last, 8, 2, 128, 16, recipe="qk4pv8", num_splits=8)


def test_more_work_items_than_the_grid_holds_names_the_arguments(paged_batch, shared_jit_cache):
    """The grid's y dimension holds 65535 work items: a graph-style plan of 2 requests x 40,000 splits is refused
    before any launch, naming num_splits."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    batch = paged_batch("qk4pv8", 128, 16, 2, [4000, 4000], gen)
    w = mpfa.BatchDecodeWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
    with pytest.raises(ValueError, match=r"needs 80000 work items .*num_splits 40000.*at most 65535"):
        w.plan(batch.indptr, batch.indices, batch.last, 8, 2, 128, 16, recipe="qk4pv8", num_splits=40000)


def test_unbuilt_shapes_raise(shared_jit_cache):
    from mpfa_jit import UnknownKernelError
    w = mpfa.BatchDecodeWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
    indptr = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    idx = torch.tensor([0], dtype=torch.int32, device="cuda")
    last = torch.tensor([3], dtype=torch.int32, device="cuda")
    with pytest.raises(UnknownKernelError):
        w.plan(indptr, idx, last, 32, 2, 128, 16, recipe="qk4pv8")    # group 16
    with pytest.raises(ValueError, match=r"head_dim must be one of \[64, 128\], got 256"):   # checked before any build
        w.plan(indptr, idx, last, 8, 2, 256, 16, recipe="qk4pv8")     # head_dim 256


def test_large_query_and_empty_request(paged_batch, bf16_rows, shared_jit_cache):
    """|Q| beyond fp16's range takes the kernel's power-of-two prescale; a request with no pages gets
    O = 0 and LSE = -inf."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    hkv, group, d, p = 2, 4, 128, 16
    lengths = [300, 77]
    for recipe in RECIPES:
        batch = paged_batch(recipe, d, p, hkv, lengths, gen)
        layer, indptr, indices, last = batch.layer, batch.indptr, batch.indices, batch.last
        q = (torch.randn(2, hkv * group, d, generator=gen, device="cuda") * 3e4).to(torch.bfloat16)
        w = mpfa.BatchDecodeWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
        w.plan(indptr, indices, last, hkv * group, hkv, d, p, recipe=recipe, sm_scale=1e-4)
        o, lse = w.run(q, layer, out=_poisoned_like(q), return_lse=True)
        torch.cuda.synchronize()
        o_ref, lse_ref = _reference(q, layer, indptr, indices, lengths, sm_scale=1e-4)
        _check(o, None, o_ref, lse_ref, recipe=recipe)
        assert torch.allclose(lse.double(), lse_ref, atol=1e-2, rtol=1e-4)
    # An empty request (0 pages, last_page_len 0) between two others.
    batch = paged_batch("qk4pv8", d, p, hkv, [50, 20], gen)
    layer, indptr, indices, last = batch.layer, batch.indptr, batch.indices, batch.last
    indptr3 = torch.tensor([0, int(indptr[1]), int(indptr[1]), int(indptr[2])], dtype=torch.int32, device="cuda")
    last3 = torch.tensor([int(last[0]), 0, int(last[1])], dtype=torch.int32, device="cuda")
    q = bf16_rows(3, hkv * group, d, gen)
    for splits in (1, 3):
        w = mpfa.BatchDecodeWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
        w.plan(indptr3, indices, last3, hkv * group, hkv, d, p, recipe="qk4pv8", num_splits=splits)
        o, lse = w.run(q, layer, out=_poisoned_like(q), return_lse=True)
        torch.cuda.synchronize()
        assert (o[1] == 0).all() and torch.isinf(lse[1]).all() and (lse[1] < 0).all()
        o_ref, lse_ref = _reference(q[[0, 2]], layer, indptr, indices, [50, 20])
        _check(o[[0, 2]], lse[[0, 2]], o_ref, lse_ref, recipe="qk4pv8")


@pytest.mark.parametrize("refresh", ["plan", "update_page_table", "split_size"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_graph_replay_with_growing_lengths(recipe, refresh, bf16_rows, shared_jit_cache):
    """Capture run once; then for 50 steps append a token per request, update the page table in
    place, refresh the wrapper (re-plan with the same num_splits, or update_page_table without a host
    sync, or that with the host lengths and a new fixed split size each step, as the SGLang backend does) and
    replay. Each replay equals an eager run of the same grid and split size."""
    gen = torch.Generator(device="cuda").manual_seed(17)
    hkv, group, d, p, steps, splits = 2, 4, 128, 16, 50, 3
    start = [1, 15, 16, 63, 300]
    batch = len(start)
    max_pages = [-(-(n + steps) // p) for n in start]
    num_pages = sum(max_pages) + 3
    cache = mpfa.PagedKVCache(recipe, num_layers=1, num_pages=num_pages, page_size=p, num_kv_heads=hkv, head_dim=d)
    layer = cache.layer(0)
    cache.calibrate(0, bf16_rows(256, hkv, d, gen), bf16_rows(256, hkv, d, gen))
    perm = torch.randperm(num_pages, generator=gen, device="cuda")
    owned, pos = [], 0
    for m in max_pages:
        owned.append(perm[pos:pos + m])
        pos += m
    slots_of = [torch.stack([owned[b][t // p] * p + t % p for t in range(start[b] + steps)]) for b in range(batch)]
    for b in range(batch):   # the prefix
        n = start[b]
        mpfa.append_kv(bf16_rows(n, hkv, d, gen), bf16_rows(n, hkv, d, gen), layer, slots_of[b][:n])
    indptr = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    indices = torch.zeros(sum(max_pages), dtype=torch.int32, device="cuda")
    last = torch.zeros(batch, dtype=torch.int32, device="cuda")
    lengths = list(start)

    def update_tables():
        n_pages = [-(-n // p) for n in lengths]
        indptr.copy_(torch.tensor([0] + list(itertools.accumulate(n_pages)), dtype=torch.int32))
        indices.zero_()
        indices[: sum(n_pages)].copy_(torch.cat([owned[b][:n_pages[b]] for b in range(batch)]).to(torch.int32))
        last.copy_(torch.tensor([n - (k - 1) * p for n, k in zip(lengths, n_pages)], dtype=torch.int32))

    update_tables()
    ws_graph = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
    w = mpfa.BatchDecodeWrapper(ws_graph)
    eager = mpfa.BatchDecodeWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
    q = bf16_rows(batch, hkv * group, d, gen)
    out = _poisoned_like(q)
    split_size = (lambda step: 64 * (1 + step % 4)) if refresh == "split_size" else (lambda step: None)
    w.plan(indptr, indices, last, hkv * group, hkv, d, p, recipe=recipe, num_splits=splits,
           fixed_split_size=split_size(-1))
    w.run(q, layer, out=out)                     # load and configure the kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse_g = w.run(q, layer, out=out, return_lse=True)
    for step in range(steps):
        for b in range(batch):   # one new token per request
            mpfa.append_kv(bf16_rows(1, hkv, d, gen), bf16_rows(1, hkv, d, gen), layer, slots_of[b][lengths[b]:lengths[b] + 1])
            lengths[b] += 1
        update_tables()
        q.copy_(bf16_rows(batch, hkv * group, d, gen))
        if refresh == "plan":
            w.plan(indptr, indices, last, hkv * group, hkv, d, p, recipe=recipe, num_splits=splits)
        elif refresh == "update_page_table":   # no host lengths: 3 items each, the eager plan's partition
            w.update_page_table(indptr, indices, last)
        else:   # split sizes 64..256 over up to 350 tokens: the host lengths give a request up to 6 of the 15 items
            w.update_page_table(indptr, indices, last, fixed_split_size=split_size(step), kv_lengths=list(lengths))
        out.fill_(float("nan"))   # each replay must write every element again
        graph.replay()
        eager.plan(indptr, indices, last, hkv * group, hkv, d, p, recipe=recipe, num_splits=splits,
                   fixed_split_size=split_size(step))
        o_e, lse_e = eager.run(q, layer, out=_poisoned_like(q), return_lse=True)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and torch.isfinite(o_e).all(), f"step {step}: an output left unwritten"
        assert torch.equal(out, o_e), f"step {step}: graph replay differs from the eager run"
        assert torch.equal(lse_g, lse_e)
        if step % 10 == 9:
            o_ref, lse_ref = _reference(q, layer, indptr, indices, lengths)
            _check(out, lse_g, o_ref, lse_ref, recipe=recipe)


# Mixed lengths with partial last pages (page 16): one token, a few tiles, many tiles, a long one.
_MIXED = [1, 37, 64 * 3 + 5, 1000, 64 * 41 + 9, 129, 5000, 2]


def _sub_table(indptr, indices, lengths, page_size):
    """The page table of the same requests at ``lengths`` (each at most its planned length): its first pages."""
    pages = [-(-n // page_size) for n in lengths]
    ids = torch.cat([indices[int(indptr[b]):int(indptr[b]) + k] for b, k in enumerate(pages)]).to(torch.int32)
    ip = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32, device="cuda")
    last = torch.tensor([n - (k - 1) * page_size if k else 0 for n, k in zip(lengths, pages)], dtype=torch.int32,
                        device="cuda")
    return ip, ids, last


@pytest.mark.parametrize("recipe,head_dim,group", list(itertools.product(RECIPES, (64, 128), (1, 4, 8))))
def test_work_list_of_mixed_lengths_matches_fp64_reference(recipe, head_dim, group, paged_batch, bf16_rows,
                                                            shared_jit_cache):
    """The work list gives a short request one item and a long one several: mixed lengths (one token, partial
    last pages) under a fixed split size, its own grid or a larger one (a graph's, items at the tail empty), a
    grid too small for the batch's splits (the work list cuts the longest requests, their last items take the
    remainders) and the adaptive plan; every element written, each within the reference's tolerance."""
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"work-{recipe}-{head_dim}-{group}".encode()))
    hkv, p = 2, 16
    batch = paged_batch(recipe, head_dim, p, hkv, _MIXED, gen)
    layer, indptr, indices, last = batch.layer, batch.indptr, batch.indices, batch.last
    q = bf16_rows(len(_MIXED), hkv * group, head_dim, gen)
    o_ref, lse_ref = _reference(q, layer, indptr, indices, _MIXED)
    ws = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
    for splits, size in ((None, 256), (12, 256), (2, 64), (None, None), (5, None)):
        w = mpfa.BatchDecodeWrapper(ws)
        w.plan(indptr, indices, last, hkv * group, hkv, head_dim, p, recipe=recipe, num_splits=splits,
               fixed_split_size=size)
        o, lse = w.run(q, layer, out=_poisoned_like(q), return_lse=True)
        torch.cuda.synchronize()
        _check(o, lse, o_ref, lse_ref, recipe=recipe)


@pytest.mark.parametrize("recipe", RECIPES)
def test_graph_replay_of_mixed_batches_is_bit_identical_to_eager(recipe, paged_batch, bf16_rows, shared_jit_cache):
    """A graph captured once (batch 8, 3 splits per request: 24 work items) replays batches of other
    compositions (host lengths in update_page_table, a new split size each): each replay equals the eager plan
    of the same lengths and size (just its items, no num_splits) bit for bit, and the fp64 reference. Padding
    rows of length 1, a request longer than three splits (it takes items the short ones leave), and one longer
    than the whole capacity's splits (the work list is cut, its last item takes the remainder: the eager plan,
    uncut, is then only checked against the reference)."""
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"graph-work-{recipe}".encode()))
    hkv, group, d, p, splits = 2, 4, 128, 16, 3
    batch = paged_batch(recipe, d, p, hkv, [6000] * 8, gen)
    layer, indptr, indices, last = batch.layer, batch.indptr, batch.indices, batch.last
    steps = [  # (lengths, fixed split size, the eager plan cuts alike)
        ([2, 2, 2, 2, 2, 2, 2, 2], 256, True),
        ([5000, 3, 1, 1, 700, 1, 64, 1], 1024, True),           # 5 items for the longest, padding rows
        ([1, 6000, 1, 2000, 33, 1, 1, 1], 512, True),
        ([4000, 4000, 4000, 4000, 100, 1, 1, 1], 256, False),   # 16 x 4 + 4: more than 24 items, cut
        ([6000, 6000, 6000, 6000, 6000, 6000, 6000, 6000], 2048, True),
    ]
    ip, ids, lp = (t.clone() for t in _sub_table(indptr, indices, steps[0][0], p))
    ids_buf = torch.zeros(indices.numel(), dtype=torch.int32, device="cuda")
    ids_buf[: ids.numel()].copy_(ids)
    w = mpfa.BatchDecodeWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
    w.plan(ip, ids_buf, lp, hkv * group, hkv, d, p, recipe=recipe, num_splits=splits, fixed_split_size=steps[0][1])
    q = bf16_rows(8, hkv * group, d, gen)
    out = _poisoned_like(q)
    w.run(q, layer, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse_g = w.run(q, layer, out=out, return_lse=True)
    eager = mpfa.BatchDecodeWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
    for lengths, size, alike in steps:
        sub = _sub_table(indptr, indices, lengths, p)
        ip.copy_(sub[0])
        ids_buf.zero_()
        ids_buf[: sub[1].numel()].copy_(sub[1])
        lp.copy_(sub[2])
        q.copy_(bf16_rows(8, hkv * group, d, gen))
        w.update_page_table(ip, ids_buf, lp, fixed_split_size=size, kv_lengths=lengths)
        out.fill_(float("nan"))   # each replay must write every element again
        lse_g.fill_(float("nan"))
        graph.replay()
        eager.plan(*sub, hkv * group, hkv, d, p, recipe=recipe, fixed_split_size=size)
        o_e, lse_e = eager.run(q, layer, out=_poisoned_like(q), return_lse=True)
        torch.cuda.synchronize()
        o_ref, lse_ref = _reference(q, layer, *sub[:2], lengths)
        _check(out, lse_g, o_ref, lse_ref, recipe=recipe)
        _check(o_e, lse_e, o_ref, lse_ref, recipe=recipe)
        if alike:
            assert torch.equal(out, o_e) and torch.equal(lse_g, lse_e), f"{lengths}: replay differs from eager"


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_plan_splits_fill_whole_waves_of_resident_ctas(recipe, head_dim, shared_jit_cache):
    """plan's adaptive split count never targets more CTAs per SM than the kernel's occupancy allows."""
    from mpfa.decode import choose_num_splits, resident_ctas
    ctas = resident_ctas(recipe, head_dim, 16, 4, 0)
    assert 1 <= ctas <= 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    hkv, length = 8, 131072
    pages = length // 16
    indptr = torch.tensor([0, pages], dtype=torch.int32, device="cuda")
    indices = torch.arange(pages, dtype=torch.int32, device="cuda")
    last = torch.tensor([16], dtype=torch.int32, device="cuda")
    w = mpfa.BatchDecodeWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
    w.plan(indptr, indices, last, 4 * hkv, hkv, head_dim, 16, recipe=recipe)
    assert w.num_splits == choose_num_splits(1, hkv, length, sms, resident_ctas=ctas)
