"""The decode kernel's host side without a GPU: the split heuristic, workspace sizing, specs, and
nvcc builds of the decode template for sm_90a (SASS: tensor-core MMAs, cp.async, nothing spilled)."""
import ctypes
import itertools
import math
import subprocess

import pytest
import torch

import mpfa_jit
from mpfa.decode import (FILL, MIN_TOKENS_PER_SPLIT, MIXED_BELOW, TILE, BatchDecodeWrapper, choose_num_splits,
                         fixed_num_splits, fixed_split_policy, mixed_split_size, server_decode_splits, split_bucket,
                         split_counts, wave_efficiency, work_list, workspace_bytes)
from mpfa_jit import UnknownKernelError
from mpfa_jit.ops import decode as decode_op

ARCH = "sm_90a"


def _kernel_split_ranges(kv_len, num_splits):
    """The kernel's partition of a request's tiles: ceil(tiles / num_splits) per split."""
    tiles = -(-kv_len // TILE)
    per = -(-tiles // num_splits) if tiles else 0
    return [(s * per, min(tiles, (s + 1) * per)) for s in range(num_splits)]


@pytest.mark.parametrize("batch,heads,length", [(32, 8, 32768), (1, 8, 32768), (4, 8, 4096), (2, 8, 1000),
                                                 (128, 8, 32768), (8, 2, 131072), (1, 1, 64), (3, 4, 1),
                                                 (64, 8, 512), (1, 32, 8192)])
def test_split_heuristic_fills_the_gpu_without_tiny_or_empty_splits(batch, heads, length):
    sms = 132
    s = choose_num_splits(batch, heads, length, sms)
    assert 1 <= s <= 128
    ranges = _kernel_split_ranges(length, s)
    assert all(hi > lo for lo, hi in ranges), "a split of the longest request is empty"
    assert sum(hi - lo for lo, hi in ranges) == -(-length // TILE)
    slots = 2 * sms                         # resident CTAs unknown: 2 per SM
    ctas = batch * heads
    s_fill = max(1, math.ceil(FILL * slots / ctas))
    if s > 1:
        assert min(hi - lo for lo, hi in ranges[:-1]) * TILE >= MIN_TOKENS_PER_SPLIT
        assert s <= 2 * s_fill                # never cut further than twice the count that fills a wave
    if ctas >= FILL * slots:
        assert s <= 2
    elif length >= 2 * slots * MIN_TOKENS_PER_SPLIT:
        assert ctas * s >= 0.8 * slots        # long requests: most of a wave is busy


def test_split_heuristic_issue_shape():
    # The issue's target shape (32 requests x 32K, 8 KV heads) keeps a few splits at most; one request
    # of 32K is cut into many.
    assert choose_num_splits(32, 8, 32768, 132) <= 2
    assert choose_num_splits(1, 8, 32768, 132) >= 16


def test_workspace_bytes():
    assert workspace_bytes(32, 32, 32, 128) == 0                       # one item per request: no partials
    assert workspace_bytes(4 * 32, 32, 32, 128) == 4 * 32 * 32 * 129 * 4   # as many bytes as 4 splits of each
    assert workspace_bytes(33, 32, 32, 128) == 33 * 32 * 129 * 4


def _kernel_items(counts, work, tiles_per_split, kv_lengths):
    """The kernel's reading of a work list (schedule.cuh): for each item, None past the list's end, else
    (request, split, count, tile range)."""
    batch = len(kv_lengths)
    indptr, request = work[: batch + 1].tolist(), work[batch + 1:].tolist()
    out = []
    for item, b in enumerate(request):
        if b < 0:
            out.append(None)
            continue
        split, count = item - indptr[b], indptr[b + 1] - indptr[b]
        tiles = -(-kv_lengths[b] // TILE)
        per = tiles_per_split or -(-tiles // count)
        begin = split * per
        end = tiles if split == count - 1 else min(tiles, begin + per)
        out.append((b, split, count, (begin, max(begin, end))))
    return out


@pytest.mark.parametrize("tiles_per_split", [0, 1, 4, 64])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_work_list_covers_every_request_once_in_order(tiles_per_split, num_splits):
    lengths = [0, 1, 63, 64, 65, 1000, 4097, 64 * 37 + 5, 131072]
    for kv in (lengths, None):
        counts = split_counts(kv, len(lengths), num_splits, tiles_per_split)
        assert min(counts) >= 1 and (kv is not None or counts == [num_splits] * len(lengths))
        for capacity in sorted({sum(counts), sum(counts) + 5, len(lengths) * num_splits, len(lengths)}):
            work = work_list(counts, capacity)
            assert work.dtype == torch.int32 and work.numel() == len(lengths) + 1 + capacity
            items = _kernel_items(counts, work, tiles_per_split, lengths)
            live = [it for it in items if it is not None]
            assert all(it is None for it in items[len(live):]), "empty items only at the tail"
            assert len(live) <= capacity and [it[0] for it in live] == sorted(it[0] for it in live)
            for b, n in enumerate(lengths):
                mine = [it for it in live if it[0] == b]
                assert [it[1] for it in mine] == list(range(len(mine))) and mine, "every request, its splits in order"
                ranges = [it[3] for it in mine if it[3][1] > it[3][0]]
                tiles = -(-n // TILE)
                assert [t for r in ranges for t in range(*r)] == list(range(tiles)), "every tile exactly once"
                if sum(counts) <= capacity:
                    assert len(mine) == counts[b]
                    if kv is not None and tiles:
                        assert len(ranges) == len(mine), "no empty item when the list knows the lengths"
                    if tiles_per_split and kv is not None:   # the fixed size cuts alike whatever the capacity
                        assert all(e - s == tiles_per_split for s, e in ranges[:-1])


def test_split_counts_match_the_uniform_grid_partition():
    # adaptive: a request's count gives the kernel the split size ceil(tiles / num_splits) of a uniform grid,
    # without its empty splits
    for n in (1, 64, 65, 320, 321, 4097, 131072):
        for splits in (1, 2, 3, 7, 64):
            tiles = -(-n // TILE)
            (count,) = split_counts([n], 1, splits, 0)
            assert -(-tiles // count) == -(-tiles // splits) and count <= splits
            assert [r for r in _kernel_split_ranges(n, splits) if r[1] > r[0]] == \
                [it[3] for it in _kernel_items([count], work_list([count], count), 0, [n])]
    assert split_counts([1, 4096, 4097], 3, 2, 64 // 64 * 8) == [1, 8, 9]          # fixed: no cap per request
    # more items than the capacity: the longest requests are cut to the largest cap that fits
    assert work_list([1, 3, 9, 2], 8)[:5].tolist() == [0, 1, 3, 5, 7]


def test_specs_and_unsupported_shapes():
    s = decode_op.spec(recipe="qk4pv8", head_dim=128, page_size=16, group_size=4, arch=ARCH)
    assert s.key == "decode_group_size-4_head_dim-128_page_size-16_recipe-qk4pv8_sm_90a"
    for bad in (dict(head_dim=256), dict(group_size=9), dict(page_size=8), dict(recipe="fp4")):
        kw = dict(recipe="qk4pv8", head_dim=128, page_size=16, group_size=4, arch=ARCH) | bad
        with pytest.raises(UnknownKernelError):
            decode_op.spec(**kw)
    assert len(decode_op.server_specs(num_qo_heads=32, num_kv_heads=8, head_dim=128, recipe="qk4pv8",
                                      page_size=16, arch=ARCH)) == 1
    with pytest.raises(UnknownKernelError, match="group_size=16"):
        decode_op.server_specs(num_qo_heads=64, num_kv_heads=4, head_dim=128, recipe="qk4pv8", page_size=16, arch=ARCH)
    assert decode_op in mpfa_jit.ops.OPS


@pytest.mark.nvcc
def test_library_params_match_the_ctypes_mirror(jit_cache):
    """The library's DecodeParams (size and every field's offset, exported by mpfa_decode_params_layout) is the
    mirror's; a mirror with a field dropped, or one of another width, is refused at load with both layouts."""
    from mpfa_jit.errors import KernelAbiError
    spec = decode_op.spec(recipe="qk4pv8", head_dim=64, page_size=16, group_size=4, arch=ARCH)
    module = mpfa_jit.get_kernel(spec)
    module.params_fn(decode_op.SYMBOL, decode_op.PARAMS_LAYOUT_SYMBOL, decode_op.DecodeParams)
    fields = decode_op.DecodeParams._fields_
    dropped = type("Dropped", (ctypes.Structure,), {"_fields_": [f for f in fields if f[0] != "batch"]})
    narrow = type("Narrow", (ctypes.Structure,), {"_fields_": [(n, ctypes.c_int64 if n == "num_kv_heads" else t)
                                                                for n, t in fields]})
    for wrong in (dropped, narrow):
        with pytest.raises(KernelAbiError, match="mpfa_jit.ops"):
            module.params_fn(decode_op.SYMBOL, decode_op.PARAMS_LAYOUT_SYMBOL, wrong)


def test_score_scale_is_the_float32_product():
    """The kernel's softmax scale, sm_scale * log2(e), rounded as a float32 multiply in C rounds it."""
    from mpfa.decode import score_scale
    for sm in (1 / math.sqrt(128), 1 / math.sqrt(64), 1e-4, 0.3):
        want = (torch.tensor(sm, dtype=torch.float32) * torch.tensor(1.4426950408889634, dtype=torch.float32)).item()
        got = ctypes.c_float(score_scale(sm)).value   # what the DecodeParams field holds
        assert got == want, (sm, got, want)


def test_plan_validates_on_cpu_reference():
    # The reference path plans anywhere; num_splits is validated before the backend is chosen.
    w = BatchDecodeWrapper(torch.empty(1024, dtype=torch.uint8), backend="reference")
    indptr = torch.tensor([0, 2, 3])
    indices = torch.tensor([4, 1, 0])
    last = torch.tensor([5, 16])
    w.plan(indptr, indices, last, 8, 2, 128, 16, recipe="qk4pv8")
    assert w.num_splits is None
    with pytest.raises(ValueError, match="num_splits"):
        w.plan(indptr, indices, last, 8, 2, 128, 16, recipe="qk4pv8", num_splits=0)
    for bad in (0, 100, -64, 64.0, True):
        with pytest.raises(ValueError, match="fixed_split_size must be None or a positive multiple of 64"):
            w.plan(indptr, indices, last, 8, 2, 128, 16, recipe="qk4pv8", fixed_split_size=bad)


@pytest.mark.parametrize("batch", [1, 3, 20, 32, 256])
@pytest.mark.parametrize("heads,length", [(3, 8192), (8, 131072), (8, 32768), (1, 131072), (8, 100), (40, 40000)])
def test_fixed_split_policy(heads, length, batch):
    size, splits = fixed_split_policy(heads, length, 132, batch)
    assert size % TILE == 0 and size >= TILE
    assert (splits - 1) * size < length <= splits * size          # the grid covers the context, no empty tail
    adaptive = choose_num_splits(split_bucket(batch), heads, length, 132)
    assert splits <= adaptive                                       # the adaptive plan's grid at most
    assert fixed_split_policy(heads, length, 132, split_bucket(batch)) == (size, splits)


@pytest.mark.parametrize("heads,context", [(1, 32768), (8, 131072), (2, 40000), (4, 4096)])
def test_server_decode_splits_cover_the_batch_within_the_graph_grid(heads, context):
    for batch in (1, 3, 8, 20, 32, 128, 256):
        grid = server_decode_splits(heads, batch, context, context, 132)[1]
        adaptive_full = choose_num_splits(split_bucket(batch), heads, context, 132)
        assert grid == fixed_split_policy(heads, context, 132, batch)[1] <= adaptive_full
        for longest in sorted({1, 63, 64, 65, 1000, 4097, context // 3, context - 1, context}):
            size, g = server_decode_splits(heads, batch, longest, context, 132)
            assert g == grid, "the grid must not depend on the batch's lengths (a graph is captured once)"
            assert size % TILE == 0 and fixed_num_splits(longest, size) <= grid
            # as fine as the adaptive plan for this batch (within the ceil-division of tiles)
            assert size <= max(fixed_split_policy(heads, longest, 132, batch)[0], -(-longest // (grid * TILE)) * TILE)
            assert server_decode_splits(heads, split_bucket(batch), longest, context, 132) == (size, g)


def test_split_bucket_matches_sglang_graph_padding():
    # SGLang pads a decode batch to the next captured size; its capture list holds every power of two up
    # to the largest (1, 2, 4, 8, 12, 16, 24, 32, ...): the padded batch falls in the same bucket.
    captured = [1, 2, 4, 8, 12, 16, 24, 32] + list(range(40, 257, 8))
    for bs in range(1, 257):
        padded = min(c for c in captured if c >= bs)
        assert split_bucket(padded) == split_bucket(bs), (bs, padded)
    assert [split_bucket(b) for b in (1, 2, 3, 5, 33)] == [1, 2, 4, 8, 64]


@pytest.mark.nvcc
@pytest.mark.parametrize("recipe,head_dim,page_size,group", [("qk4pv8", 128, 16, 4), ("bf16", 64, 1, 1),
                                                             ("qk8pv8", 128, 32, 8), ("qk4pv8", 64, 64, 5)])
def test_decode_template_compiles(recipe, head_dim, page_size, group, jit_cache):
    spec = decode_op.spec(recipe=recipe, head_dim=head_dim, page_size=page_size, group_size=group, arch=ARCH)
    uri, built, _ = mpfa_jit.build_only(spec)
    assert built and mpfa_jit.Store(jit_cache).check(uri) == "ok"


@pytest.mark.nvcc
def test_decode_sass_has_mma_and_no_spills(jit_cache, sass_tools, kernel_resources):
    cuobjdump, tool_env = sass_tools
    spec = decode_op.spec(recipe="qk4pv8", head_dim=128, page_size=16, group_size=4, arch=ARCH)
    uri, _, _ = mpfa_jit.build_only(spec)
    lib = str(mpfa_jit.Store(jit_cache).library(uri))
    res = kernel_resources(lib)["decode_kernel"]
    assert res["stack"] == 0 and res["local"] == 0 and res["spill_ops"] == 0, res
    assert res["registers"] <= 128      # __launch_bounds__(128, 4): four CTAs per SM
    sass = subprocess.run([cuobjdump, "--dump-sass", lib], capture_output=True, text=True, env=tool_env)
    assert sass.returncode == 0, sass.stderr
    assert "HMMA.16816.F32" in sass.stdout                        # tensor-core mma.sync, fp32 accumulate
    assert "MOVM" in sass.stdout                                  # P^T for the swapped PV MMA by movmatrix
    assert "LDGSTS" in sass.stdout                                # cp.async into shared memory
    assert "LDS.128" in sass.stdout                               # 16-byte shared reads of K/V
    assert "LDL" not in sass.stdout and "STL" not in sass.stdout  # nothing spilled


def test_update_page_table_on_the_reference_path_matches_a_new_plan():
    import mpfa
    gen = torch.Generator().manual_seed(3)
    cache = mpfa.PagedKVCache("qk8pv8", num_layers=1, num_pages=12, page_size=16, num_kv_heads=2, head_dim=64,
                              device="cpu")
    layer = cache.layer(0)
    k = torch.randn(192, 2, 64, generator=gen).to(torch.bfloat16)
    mpfa.append_kv(k, k.flip(0), layer, torch.arange(192), backend="reference")
    q = torch.randn(2, 8, 64, generator=gen).to(torch.bfloat16)
    w = BatchDecodeWrapper(torch.empty(1024, dtype=torch.uint8), backend="reference")
    w.plan(torch.tensor([0, 1, 3]), torch.tensor([4, 0, 7]), torch.tensor([5, 16]), 8, 2, 64, 16, recipe="qk8pv8")
    w.update_page_table(torch.tensor([0, 2, 3]), torch.tensor([4, 5, 7]), torch.tensor([3, 9]))
    fresh = BatchDecodeWrapper(torch.empty(1024, dtype=torch.uint8), backend="reference")
    fresh.plan(torch.tensor([0, 2, 3]), torch.tensor([4, 5, 7]), torch.tensor([3, 9]), 8, 2, 64, 16, recipe="qk8pv8")
    assert torch.equal(w.run(q, layer), fresh.run(q, layer))
    with pytest.raises(RuntimeError, match="before plan"):
        BatchDecodeWrapper(torch.empty(8, dtype=torch.uint8)).update_page_table(None, None, None)


def test_split_count_fills_whole_waves_of_resident_ctas():
    # 1 x 128K with 8 KV heads: a kernel an SM holds 4 of gets a grid of 4 per SM, one an SM holds 2 of
    # (bf16 head_dim 128) half that (64 splits ran it in two waves on the H200).
    four = choose_num_splits(1, 8, 131072, 132, resident_ctas=4)
    two = choose_num_splits(1, 8, 131072, 132, resident_ctas=2)
    assert (four, two) == (64, 33)
    assert choose_num_splits(1, 8, 131072, 132) == two                     # unknown: 2 per SM
    assert choose_num_splits(1, 8, 131072, 132, ctas_per_sm=4) == four     # an explicit count wins
    assert choose_num_splits(32, 8, 32768, 132, resident_ctas=4) == 2
    assert server_decode_splits(8, 1, 131072, 131072, 132, resident_ctas=2)[1] <= two
    # The e2e batches of decode_splits_h200.json: the counts that leave a tail wave of a few CTAs (qk4pv8
    # 14 x 128K at 5 splits: 560 CTAs, 1.06 waves of 528, 1.29x the best count; bf16 at 3: 1.38x) are out.
    for resident, bad in ((4, 5), (2, 3)):
        s = choose_num_splits(14, 8, 131072, 132, resident_ctas=resident)
        assert s != bad and wave_efficiency(14 * 8 * s, 132 * resident) >= 0.84


def test_wave_efficiency():
    assert wave_efficiency(528, 528) == 1.0 and wave_efficiency(1056, 528) == 1.0
    assert wave_efficiency(560, 528) == 560 / 1056
    assert wave_efficiency(1, 528) == 1 / 528


def test_split_sweep_cases_and_summary():
    from benchmarks.suites import decode_splits as ds
    assert ds.forced_counts(1, 131072)[-1] == 64 and ds.forced_counts(55, 32768) == [1, 2, 3, 4]
    assert ds.forced_counts(1, 1024) == [1, 2, 3, 4]   # no split under MIN_TOKENS_PER_SPLIT tokens
    plans = {(c["recipe"], c["batch"], c["context"], c["plan"]) for c in ds.cases()}
    assert all((r, b, ctx, p) in plans for r in ds.RECIPES for b, ctx in ds.SHAPES for p in ("adaptive", "server", "forced"))

    def row(plan, splits, ms):
        return {"kind": "kernel", "status": "ok", "recipe": "qk4pv8", "batch": 14, "context": 131072, "plan": plan,
                "num_splits": splits, "ms": ms, "forced_splits": splits if plan == "forced" else None,
                "resident_ctas": 4, "num_sms": 132}
    rows = [row("adaptive", 3, 1.2), row("server", 4, 1.1), row("forced", 3, 1.2), row("forced", 4, 1.1),
            row("forced", 8, 1.0)]
    summary = ds.summarize(rows)
    s = summary["by_shape"]["qk4pv8/14x131072"]
    # The rules of this checkout replayed: the server's split size cuts 14 x 128K into 4 splits (timed: 1.1),
    # the adaptive plan picks 9 (untimed here: None).
    assert s == {"best_splits": 8, "best_ms": 1.0, "adaptive_splits": 3, "adaptive_over_best": 1.2,
                 "server_splits": 4, "server_over_best": pytest.approx(1.1),
                 "rule_adaptive_splits": 9, "rule_adaptive_over_best": None,
                 "rule_server_splits": 4, "rule_server_over_best": pytest.approx(1.1)}
    assert summary["rule_counts_untimed"] == 1 and summary["rule_server_over_best_geomean"] == pytest.approx(1.1)
    assert [(r["plan"], r["num_splits"]) for r in ds.readme_rows(rows)] == [("adaptive", 3), ("server", 4), ("forced", 8)]


def test_decode_suite_accuracy_check_against_fp64():
    # The decode suite's per-row check on the reference backend (CPU): the float32 reference is within
    # 1e-5 of fp64, a perturbed output is not, and a NaN (an unwritten element) is infinite. Mixed lengths,
    # one of them a whole number of pages and one a partial single page, as the suite's mixed-length batches.
    from benchmarks.suites import decode as suite
    import mpfa
    gen = torch.Generator().manual_seed(0)
    lengths, page = [80, 37, 5], 16
    batch = len(lengths)
    num_pages, indptr, indices, last = suite._page_table(lengths, page, "cpu", gen)
    assert indptr.tolist() == [0, 5, 8, 9] and last.tolist() == [16, 5, 5] and num_pages == 10
    cache = mpfa.PagedKVCache("qk4pv8", num_layers=1, num_pages=num_pages, page_size=page, num_kv_heads=8,
                              head_dim=128, device="cpu")
    k = torch.randn(cache.num_slots, 8, 128, generator=gen).to(torch.bfloat16)
    v = torch.randn(cache.num_slots, 8, 128, generator=gen).to(torch.bfloat16)
    cache.calibrate(0, k, v)
    layer = cache.layer(0)
    mpfa.append_kv(k, v, layer, torch.arange(cache.num_slots), backend="reference")
    w = mpfa.BatchDecodeWrapper(torch.empty(1 << 20, dtype=torch.uint8), backend="reference")
    w.plan(indptr, indices, last, 32, 8, 128, page, recipe="qk4pv8")
    q = torch.randn(batch, 32, 128, generator=gen).to(torch.bfloat16)
    out = w.run(q, layer)
    assert suite.rel_l2_vs_fp64(q, layer, indptr, indices, lengths, out) < 5e-3
    worse = out.clone()
    worse[1] += 0.05 * worse[1].abs().max()
    assert suite.rel_l2_vs_fp64(q, layer, indptr, indices, lengths, worse) > 5e-3
    worse[2, 0, 0] = float("nan")
    assert suite.rel_l2_vs_fp64(q, layer, indptr, indices, lengths, worse) == float("inf")


def test_mixed_length_batches_in_the_decode_suites():
    from benchmarks.suites import decode as suite
    from benchmarks.suites import decode_splits as ds
    lengths = suite.spread_lengths(32, 65536)
    # 2K, 4K, ..., 64K, all but the longest ending inside a page, in arrival (shuffled) order
    assert max(lengths) == 65536 and len(set(lengths)) == 32 and lengths != sorted(lengths)
    assert sorted(-(-n // 2048) for n in lengths) == list(range(1, 33)) and sum(n % 16 != 0 for n in lengths) == 31
    assert suite.spread_lengths(32, 65536) == lengths                      # the same batch every run
    spread = [c for c in suite.cases() if suite.is_spread(c)]
    assert {(c["impl"], c["recipe"]) for c in spread} >= {("mpfa-graph", "qk4pv8"), ("flashinfer", "fi-fp8")}
    assert all(c["id"].endswith("/spread") and c["tokens"] == sum(suite.case_lengths(c)) for c in spread)
    assert not any(suite.is_spread(c) for c in suite.cases(quick=True))
    assert suite.read_bytes([3, 5], 100) == 8 * suite.KV_HEADS * 100 + 2 * 2 * suite.QO_HEADS * suite.HEAD_DIM * 2

    sizes = {c["forced_split_size"] for c in ds.cases() if c["plan"] == "size" and c["context"] == 65536}
    assert sizes == {w for w in ds.FORCED_SIZES if w <= 65536}

    def row(plan, splits, ms, size=None):
        r = {"kind": "kernel", "status": "ok", "recipe": "qk4pv8", "batch": 32, "context": 65536, "plan": plan,
             "num_splits": splits, "ms": ms, "forced_splits": splits if plan == "forced" else None,
             "resident_ctas": 4, "num_sms": 132, "lengths": "spread"}
        return {**r, "forced_split_size": size} if size else r
    # The server's rule cuts this batch into 22,528-token splits (3 for the longest); a size row there times it.
    rows = [row("adaptive", 2, 1.3), row("server", 3, 1.2), row("forced", 2, 1.3), row("forced", 4, 1.1),
            row("size", 8, 1.0, 8192), row("size", 2, 1.25, 32768), row("size", 3, 1.05, 22528)]
    summary = ds.summarize(rows)
    s = summary["by_shape"]["qk4pv8/32x65536/spread"]
    assert s["best_split_size"] == 8192 and s["best_ms"] == 1.0 and s["server_over_best"] == pytest.approx(1.2)
    assert (s["rule_server_splits"], s["rule_server_over_best"]) == (3, pytest.approx(1.05))  # the size row
    assert (s["rule_adaptive_splits"], s["rule_adaptive_over_best"]) == (2, pytest.approx(1.3))
    assert summary["spread_server_over_best_worst"] == pytest.approx(1.2)
    assert summary["server_over_best_worst"] is None                     # no one-length shape in these rows
    assert [r["plan"] for r in ds.readme_rows(rows)] == ["adaptive", "server", "size"]

    def drow(impl, recipe, ms):
        return {"kind": "kernel", "status": "ok", "impl": impl, "recipe": recipe, "batch": 32, "context": 65536,
                "page_size": 16, "lengths": "spread", "tokens": sum(lengths), "ms": ms,
                "bytes": suite.read_bytes(lengths, 100)}
    ceiling = {"kind": "ceiling", "status": "ok", "id": "hbm_read", "name": "hbm_read", "ms": 1.0, "bytes": 4e9}
    d = suite.spread_summary([ceiling, drow("mpfa-graph", "qk4pv8", 0.6), drow("mpfa", "qk4pv8", 0.5),
                              drow("flashinfer", "fi-fp8", 0.75)], 4000.0)["32x65536"]
    assert d["server_plan_time_ratio_vs_flashinfer_fp8"] == pytest.approx(0.8)
    assert d["server_plan_over_adaptive"] == pytest.approx(1.2) and d["server_plan_time_ratio_vs_flashinfer_bf16"] is None
    assert d["hbm_fraction"]["mpfa qk4pv8"] == pytest.approx(suite.read_bytes(lengths, 100) / 0.5e-3 / 1e9 / 4000)
    # a run of the mixed-length cases alone (benchmarks.run --cases spread) still summarizes
    whole = suite.summarize([drow("mpfa-graph", "qk4pv8", 0.6), drow("flashinfer", "fi-fp8", 0.75)])
    assert whole["min_hbm_fraction"] is None and whole["spread"]["32x65536"]["ms"]["mpfa-graph qk4pv8"] == 0.6


def _items(lengths, size):
    return sum(max(1, -(-n // size)) for n in lengths)


def test_server_splits_of_a_mixed_length_batch_come_from_its_lengths():
    from benchmarks.suites.decode import spread_lengths
    for heads, resident in ((8, 4), (8, 2), (2, 4), (32, 1)):
        wave = 132 * resident // heads
        for batch, longest in ((32, 65536), (16, 131072), (3, 40000), (48, 65536), (8, 131072), (100, 20000)):
            lengths = spread_lengths(batch, longest)
            one = server_decode_splits(heads, batch, longest, 131072, 132, resident_ctas=resident)
            size, grid = server_decode_splits(heads, batch, longest, 131072, 132, resident_ctas=resident,
                                              lengths=lengths)
            assert grid == one[1], "the grid must not depend on the batch's lengths (a graph is captured once)"
            assert size <= one[0] and size % TILE == 0
            budget = min(batch * grid, wave)
            if size < one[0]:
                assert _items(lengths, size) <= budget, "within the graph's capacity and one wave"
                smaller = size - TILE
                assert smaller < MIN_TOKENS_PER_SPLIT or _items(lengths, smaller) > budget, "the smallest that fits"
            # the graph (padded to the bucket with length-1 rows) holds the batch's work items
            bucket = split_bucket(batch)
            assert _items(lengths, size) + (bucket - batch) <= bucket * grid
            # eager (the real batch) and its graph replay (padded to the bucket) cut alike
            assert server_decode_splits(heads, bucket, longest, 131072, 132, resident_ctas=resident,
                                        lengths=lengths) == (size, grid)
    # 32 x 2K-64K (Llama-8B, qk4pv8): 22,528-token splits, 63 items of the graph's 64 (528 CTAs of one wave hold
    # 66 per KV head), where sizing from the longest gave 32K (48 items, the long ones finishing alone)
    spread = spread_lengths(32, 65536)
    assert server_decode_splits(8, 32, 65536, 131072, 132, resident_ctas=4, lengths=spread) == (22528, 2)
    assert _items(spread, 22528) == 63 and _items(spread, 32768) == 48
    # just under MIXED_BELOW of requests x longest is mixed, just over it is not
    short = int((MIXED_BELOW * 8 * 131072 - 131072) / 7) - 64
    mixed, even = [131072] + [short] * 7, [131072] + [short + 128] * 7
    assert sum(mixed) < MIXED_BELOW * 8 * 131072 <= sum(even)
    plain = server_decode_splits(8, 8, 131072, 131072, 132, resident_ctas=4)
    assert server_decode_splits(8, 8, 131072, 131072, 132, resident_ctas=4, lengths=mixed)[0] < plain[0]
    assert server_decode_splits(8, 8, 131072, 131072, 132, resident_ctas=4, lengths=even) == plain
    assert mixed_split_size([4096] * 67, 66) is None   # one split each is more than the budget
    assert mixed_split_size([2000, 30], 66) == 256     # never under MIN_TOKENS_PER_SPLIT
    assert mixed_split_size([100, 30], 66) == 128      # unless one split holds the longest
    assert mixed_split_size([], 66) is None


@pytest.mark.parametrize("heads,resident", [(8, 4), (8, 2), (1, 4), (4, 3), (32, 1)])
def test_one_length_batches_keep_their_split_size(heads, resident):
    """A batch of one length keeps the wave rule's size and grid (the graph launches the CTAs it did before the
    work list: batch x grid, the items past each request's splits at the tail)."""
    for batch in (1, 2, 3, 8, 14, 32, 55, 128, 256):
        for n in (2, 100, 4096, 32768, 65536, 131072):
            plain = server_decode_splits(heads, batch, n, 131072, 132, resident_ctas=resident)
            assert server_decode_splits(heads, batch, n, 131072, 132, resident_ctas=resident,
                                        lengths=[n] * batch) == plain
            size, grid = plain
            assert fixed_num_splits(n, size) <= grid   # every request in its own row of the grid, as before


def test_graph_capacity_covers_every_batch():
    """Random batches of a server (lengths 2 .. 128K, a graph padded to the bucket with length-1 rows): the
    rule's items fit the graph's capacity, uncut, so the replay's work list is the eager plan's."""
    import random
    rng = random.Random(7)
    for _ in range(300):
        batch = rng.randint(1, 256)
        top = rng.choice((4096, 32768, 131072))
        lengths = [rng.randint(2, top) for _ in range(batch)]
        heads, resident = rng.choice(((8, 4), (8, 2), (2, 4), (32, 1), (4, 2)))
        size, grid = server_decode_splits(heads, batch, max(lengths), 131072, 132, resident_ctas=resident,
                                          lengths=lengths)
        bucket = split_bucket(batch)
        padded = lengths + [1] * (bucket - batch)
        counts = split_counts(padded, bucket, grid, size // TILE)
        assert sum(counts) <= bucket * grid
        assert work_list(counts, bucket * grid)[: bucket + 1].tolist() == [0, *itertools.accumulate(counts)]
        eager = split_counts(lengths, batch, grid, size // TILE)
        assert eager == counts[:batch]
