"""The prefill kernel's host side without a GPU: specs, the tile schedule, workspace sizing, the
template's rendering, and nvcc builds for sm_90a with a SASS check (IGMMA for the quantized recipes'
QK and QGMMA for their PV, HGMMA for bf16, bulk copies on mbarriers, register hand-over between warpgroups, nothing spilled) and
the library's PrefillParams against its ctypes mirror."""
import ctypes
import itertools
import math
import subprocess

import pytest
import torch

import mpfa_jit
from mpfa.prefill import (BatchPrefillWrapper, _workspace_layout, kv_tiles, mu_blocks, tile_schedule, workspace_bytes,
                          workspace_layout)
from mpfa_jit import UnknownKernelError
from mpfa_jit.abi import check_params, describe
from mpfa_jit.errors import KernelAbiError
from mpfa_jit.ops import prefill as prefill_op

ARCH = "sm_90a"
SERVED_Q_TILE = prefill_op.CTA_ROWS
PER_KEY = {"tile_scale": 0, "comp_mma": 0}   # a study build over qk4pv8's served one: per-key K scales and fb terms


def test_workspace_arithmetic_follows_the_op_modules_tile_sizes(monkeypatch):
    """The wrapper's schedule and workspace read the tile sizes the template is rendered with (mpfa_jit.ops.prefill),
    not copies of their own."""
    lens = [1000, 1, 128]
    base = workspace_layout(3, 32, 8, 128, lens, "qk4pv8", True, max_qo_len=300)
    monkeypatch.setattr(prefill_op, "KV_TILE", 64)
    monkeypatch.setattr(prefill_op, "MU_ROWS", 100)
    monkeypatch.setattr(prefill_op, "CTA_ROWS", 96)
    assert kv_tiles(lens, "qk4pv8") == [16, 1, 2] and mu_blocks([300]) == 3
    assert dict(prefill_op.spec(recipe="qk8pv8", head_dim=128, page_size=16, arch=ARCH).context)["q_tile"] == 96
    lay = workspace_layout(3, 32, 8, 128, lens, "qk4pv8", True, max_qo_len=300)
    assert lay["k_img"][1] == 19 * 8 * 64 * 128 and lay["cd"][1] == 19 * 32 * 64 * 32
    assert _workspace_layout(3, 32, 8, 128, lens, "qk4pv8", True, knobs=PER_KEY)["fb"][1] == 19 * 32 * 64 * 4
    assert lay["mu_part"][1] == 3 * 3 * 32 * 128 * 4
    assert lay != base


def test_render_context_carries_the_tile_sizes_and_cache_layout():
    s = prefill_op.spec(recipe="qk4pv8", head_dim=64, page_size=16, arch=ARCH)
    ctx = dict(s.context)
    assert (ctx["q_tile"], ctx["kv_tile"], ctx["mu_rows"]) == (SERVED_Q_TILE, prefill_op.KV_TILE, prefill_op.MU_ROWS)
    assert (ctx["k_image_bytes"], ctx["v_image_bytes"], ctx["fa_bytes"]) == (128 * 64, 128 * 64, 128 * 4)
    assert ctx["recipe_enum"] == "kQk4pv8" and dict(zip(ctx["layout_names"], ctx["layout_args"]))["k_block_scale"] == 4
    assert prefill_op.image_bytes("bf16", 128) == {"k": 128 * 128 * 2, "v": 128 * 128 * 2, "fa": 0, "cd": 0}
    assert prefill_op.image_bytes("qk4pv8", 128)["cd"] == 128 * 32   # comp_mma's digit image
    # every knob of the served build joins the key; the context does not
    assert s.key == "prefill_comp_mma-1_head_dim-64_page_size-16_pv_once-1_recipe-qk4pv8_stages-2_tile_scale-1_sm_90a"


def test_params_mirror_is_naturally_aligned():
    """The ctypes mirror's offsets are those a C compiler gives PrefillParams (every field at its natural
    alignment); the built library's own text is compared in test_library_params_layout_matches_the_mirror."""
    off = 0
    for name, ctype in prefill_op.PrefillParams._fields_:
        size = ctypes.sizeof(ctype)
        off = -(-off // size) * size
        assert getattr(prefill_op.PrefillParams, name).offset == off, name
        off += size
    assert ctypes.sizeof(prefill_op.PrefillParams) == -(-off // 8) * 8
    assert len(prefill_op.PrefillParams._fields_) == 39


def test_specs_and_unsupported_shapes():
    s = prefill_op.spec(recipe="qk4pv8", head_dim=128, page_size=16, arch=ARCH, knobs=PER_KEY)
    assert s.key == "prefill_comp_mma-0_head_dim-128_page_size-16_pv_once-1_recipe-qk4pv8_stages-2_tile_scale-0_sm_90a"
    assert prefill_op.spec(recipe="bf16", head_dim=128, page_size=16, arch=ARCH).key == \
        "prefill_comp_mma-0_head_dim-128_page_size-16_pv_once-0_recipe-bf16_stages-2_tile_scale-0_sm_90a"
    for bad in (dict(head_dim=256), dict(page_size=8), dict(recipe="fp4")):
        kw = dict(recipe="qk4pv8", head_dim=128, page_size=16, arch=ARCH) | bad
        with pytest.raises(UnknownKernelError):
            prefill_op.spec(**kw)
    assert len(prefill_op.server_specs(num_qo_heads=32, num_kv_heads=8, head_dim=128, recipe="qk4pv8",
                                       page_size=16, arch=ARCH)) == 1
    with pytest.raises(UnknownKernelError, match="group_size=16"):
        prefill_op.server_specs(num_qo_heads=64, num_kv_heads=4, head_dim=128, recipe="qk4pv8", page_size=16, arch=ARCH)
    assert prefill_op in mpfa_jit.ops.OPS
    with pytest.raises(UnknownKernelError, match="group_size=9"):
        prefill_op.spec(recipe="bf16", head_dim=128, page_size=16, group_size=9, arch=ARCH)


def test_render_substitutes_parameters():
    src = prefill_op.spec(recipe="qk8pv8", head_dim=64, page_size=32, arch=ARCH).render()
    assert "mpfa::Recipe::kQk8pv8;" in src and "constexpr int kPageSize = 32;" in src
    assert "constexpr int kHeadDim = 64;" in src
    # the cache row's widths from the Field table: k, k8, k_block_scale, k_scale, v, v_param
    assert "using Layout = mpfa::CacheLayout<kRecipe, kHeadDim, 64, 0, 0, 4, 64, 0>;" in src


def test_tile_schedule_covers_every_row_once_longest_first():
    qo = [1, 128, 129, 300, 0]
    kv = [10, 128, 1000, 300, 5]
    for causal, q_tile in itertools.product((True, False), (128, 192)):
        tiles = tile_schedule(qo, kv, causal, q_tile)
        assert sorted(tiles) == sorted((b, t) for b, n in enumerate(qo) for t in range(-(-n // q_tile)))

        def work(bt):
            b, t = bt
            last = min(qo[b], (t + 1) * q_tile)
            return min(kv[b], last + kv[b] - qo[b]) if causal else kv[b]
        ws = [work(x) for x in tiles]
        assert ws == sorted(ws, reverse=True)
    assert tile_schedule([], [], True, 128) == []


def test_workspace_layout():
    lens = [1000, 1, 128]
    assert kv_tiles(lens, "qk4pv8") == [8, 1, 1] and kv_tiles(lens, "bf16") == [8, 1, 1]
    n = 10   # KV tiles of the FP8 recipes
    lay = workspace_layout(3, 32, 8, 128, lens, "qk4pv8", True, max_qo_len=300)
    assert lay["k_img"][1] == lay["v_img"][1] == n * 8 * 128 * 128
    assert lay["fa"][1] == n * 8 * 128 * 4 and lay["mu"][1] == 3 * 32 * 128 * 4
    assert lay["mu_part"][1] == 3 * 3 * 32 * 128 * 4          # ceil(300 / MU_ROWS) blocks per request
    # the served 8-bit build: per-head Q scale inputs and digit images instead of fb
    assert lay["q_head"][1] == 3 * 32 * 2 * 4 and lay["cd"][1] == n * 32 * 128 * 32 and "fb" not in lay
    per_key = _workspace_layout(3, 32, 8, 128, lens, "qk4pv8", True, max_qo_len=300, knobs=PER_KEY)
    assert per_key["fb"][1] == n * 32 * 128 * 4 and not {"q_head", "cd"} & set(per_key)
    for layout in (lay, per_key):
        spans = sorted(layout.values())
        assert all(o % 256 == 0 for o, _ in spans)
        assert all(a[0] + a[1] <= b[0] for a, b in zip(spans, spans[1:]))     # no overlap
    total = workspace_bytes(3, 32, 8, 128, lens, "qk4pv8", True, max_qo_len=300)
    spans = sorted(lay.values())
    assert total >= spans[-1][0] + spans[-1][1] and total % 256 == 0
    assert set(workspace_layout(3, 32, 8, 128, lens, "qk4pv8", False)) == {"k_img", "v_img", "fa"}
    bf = workspace_layout(3, 32, 8, 128, lens, "bf16", True)                # no compensation for bf16
    assert set(bf) == {"k_img", "v_img"} and bf["k_img"][1] == n * 8 * 128 * 128 * 2
    assert workspace_bytes(0, 32, 8, 128, [], "qk8pv8", True) == 0


def test_plan_on_cpu_needs_reference_backend():
    indptr, indices, last = torch.tensor([0, 2]), torch.tensor([1, 0]), torch.tensor([5])
    qo = torch.tensor([0, 7])
    w = BatchPrefillWrapper(torch.empty(1024, dtype=torch.uint8))
    with pytest.raises(ValueError, match="reference"):
        w.plan(qo, indptr, indices, last, 8, 2, 128, 16, recipe="qk4pv8")
    w = BatchPrefillWrapper(torch.empty(1024, dtype=torch.uint8), backend="reference")
    w.plan(qo, indptr, indices, last, 8, 2, 128, 16, recipe="qk4pv8")
    assert w.backend == "reference"


@pytest.mark.nvcc
@pytest.mark.parametrize("recipe,head_dim,page_size,mma", [
    ("qk4pv8", 128, 16, "IGMMA.64x128x32.S8.S8"), ("qk8pv8", 128, 1, "IGMMA.64x128x32.S8.S8"),
    ("bf16", 128, 64, "HGMMA.64x128x16.F32.BF16"), ("qk4pv8", 64, 32, "IGMMA.64x128x32.S8.S8")])
def test_prefill_builds_with_wgmma_and_no_spills(recipe, head_dim, page_size, mma, jit_cache, sass_tools,
                                                 kernel_resources):
    cuobjdump, tool_env = sass_tools
    spec = prefill_op.spec(recipe=recipe, head_dim=head_dim, page_size=page_size, arch=ARCH)
    uri, built, _ = mpfa_jit.build_only(spec)
    assert built and mpfa_jit.Store(jit_cache).check(uri) == "ok"
    lib = str(mpfa_jit.Store(jit_cache).library(uri))
    res = kernel_resources(lib)
    for fn in ("prefill_kernel", "kv_pack_kernel", "q_mean_kernel") + (("q_amax_kernel",) if recipe != "bf16" else ()):
        assert res[fn]["stack"] == 0 and res[fn]["local"] == 0 and res[fn]["spill_ops"] == 0, (fn, res[fn])
    check_params(ctypes.CDLL(lib), prefill_op.PARAMS_LAYOUT_SYMBOL, prefill_op.PrefillParams, spec.key)
    sass = subprocess.run([cuobjdump, "--dump-sass", lib], capture_output=True, text=True, env=tool_env)
    assert sass.returncode == 0, sass.stderr
    assert mma in sass.stdout                                        # QK on the tensor cores (wgmma)
    # FP8 PV in n64 column parts at head_dim 128 (the part accumulator)
    pv = (f"QGMMA.64x64x32.F32.E4M3.E4M3" if recipe != "bf16" else f"HGMMA.64x{head_dim}x16.F32.BF16")
    assert pv in sass.stdout                                         # PV on the tensor cores, P from registers
    assert "UBLKCP.S.G" in sass.stdout                               # bulk copies of the tile images
    assert "SYNCS.PHASECHK.TRANS64.TRYWAIT" in sass.stdout           # mbarrier waits
    assert "USETMAXREG.DEALLOC" in sass.stdout and "USETMAXREG.TRY_ALLOC" in sass.stdout   # producer/consumers
    assert "LDL" not in sass.stdout and "STL" not in sass.stdout     # nothing spilled


@pytest.mark.nvcc
def test_library_params_layout_matches_the_mirror(jit_cache):
    """The library's exported PrefillParams text equals the mirror's, and a mirror that differs is refused."""
    spec = prefill_op.spec(recipe="qk8pv8", head_dim=64, page_size=1, arch=ARCH)
    uri, _, _ = mpfa_jit.build_only(spec)
    lib = ctypes.CDLL(str(mpfa_jit.Store(jit_cache).library(uri)))
    fn = getattr(lib, prefill_op.PARAMS_LAYOUT_SYMBOL)
    fn.restype = ctypes.c_char_p
    assert fn().decode() == describe(prefill_op.PrefillParams)
    check_params(lib, prefill_op.PARAMS_LAYOUT_SYMBOL, prefill_op.PrefillParams, spec.key)

    class Swapped(ctypes.Structure):   # two int fields in the other order: same size, other offsets
        _fields_ = [(n, t) for n, t in prefill_op.PrefillParams._fields_ if n not in ("batch", "num_kv_tiles")]
        _fields_[19:19] = [("batch", ctypes.c_int), ("num_kv_tiles", ctypes.c_int)]
    with pytest.raises(KernelAbiError, match="differs"):
        check_params(lib, prefill_op.PARAMS_LAYOUT_SYMBOL, Swapped, spec.key)


@pytest.mark.nvcc
@pytest.mark.parametrize("knobs", [dict(stages=3), dict(comp_mma=0, pv_once=0, stages=3), PER_KEY, dict(pv_once=0)])
def test_study_knob_builds_compile_without_spills(knobs, jit_cache, kernel_resources):
    spec = prefill_op.spec(recipe="qk4pv8", head_dim=128, page_size=16, arch=ARCH, knobs=knobs)
    assert all(f"{k}-{v}" in spec.key for k, v in knobs.items())
    uri, built, _ = mpfa_jit.build_only(spec)
    lib = str(mpfa_jit.Store(jit_cache).library(uri))
    res = kernel_resources(lib)["prefill_kernel"]
    assert res["stack"] == 0 and res["local"] == 0 and res["spill_ops"] == 0, res


def test_prefill_variant_knobs_parse_and_render():
    from benchmarks.prefill_variants import parse_variant
    from mpfa_jit.ops import prefill as op
    assert parse_variant("stages=3, pv_once=0") == {"stages": 3, "pv_once": 0}
    assert parse_variant("tile_scale=0") == {"tile_scale": 0}
    assert parse_variant("") == {}
    for bad, msg in (("nope=1", "unknown knob"), ("stages=x", "integer"), ("stages=4", "one of"),
                     ("pingpong=1", "unknown knob")):
        with pytest.raises(ValueError, match=msg):
            parse_variant(bad)
    with pytest.raises(ValueError, match="comp_mma=1 needs tile_scale=1"):
        op.spec(recipe="qk8pv8", head_dim=128, page_size=16, arch="sm_90a", knobs={"comp_mma": 1})
    with pytest.raises(ValueError, match="comp_mma=1 needs tile_scale=1"):   # a variant sets over the served knobs
        op.spec(recipe="qk4pv8", head_dim=128, page_size=16, arch="sm_90a", knobs={"tile_scale": 0})
    base = dict(recipe="qk4pv8", head_dim=128, page_size=16, arch="sm_90a")
    assert "constexpr int kStages = 3;" in op.spec(**base, knobs={"stages": 3}).render()
    assert "constexpr int kStages = 2;" in op.spec(**base).render()
    # P's scale: the recipe's, or a power of two in tile_scale builds, the served one (their softmax relies on
    # kLog2P = 8 exactly)
    assert "constexpr float kLog2P = 8.0f;" in op.spec(**base | {"recipe": "qk8pv8"}, knobs={"tile_scale": 1}).render()
    assert "constexpr float kLog2P = 8.0f;" in op.spec(**base).render()
    assert f"constexpr float kLog2P = {math.log2(448.0)!r}f;" in op.spec(**base, knobs=PER_KEY).render()
    for bad in ({"stages": 4}, {"nope": 1}, {"pingpong": 0}, {"consumers": 3}, {"poly_every": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            op.spec(**base, knobs=bad)


def test_every_build_states_its_knobs():
    """The template has no defaults (the renderer's StrictUndefined refuses a knob left out), and every served
    build states every knob."""
    assert "default(" not in (mpfa_jit.render.templates_dir() / prefill_op.TEMPLATE).read_text()
    assert all(set(k) == set(prefill_op.KNOBS) for k in prefill_op.SERVED_KNOBS.values())


def test_ctas_hold_three_warpgroups_192_rows_with_64_row_q_scales():
    s = prefill_op.spec(recipe="qk8pv8", head_dim=128, page_size=16, arch=ARCH)
    ctx = dict(s.context)
    assert (ctx["q_tile"], ctx["q_scale_rows"]) == (192, 64)
    from mpfa.recipes.int8 import Q_TILE as q_scale_rows
    assert dict(prefill_op.spec(recipe="qk8pv8", head_dim=128, page_size=16, arch=ARCH, knobs=PER_KEY).context)[
        "q_scale_rows"] == q_scale_rows
    assert len(tile_schedule([400], [400], causal=True, q_tile=192)) == 3
