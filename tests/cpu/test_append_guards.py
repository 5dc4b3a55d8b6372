"""The append kernel's guards on the CPU: slots past the layer refused by the reference (host) path and
counted by the cache, the defined bytes of non-finite K/V, the library's AppendParams against its ctypes
mirror, and every specialization compiling without spills (nvcc). The kernel's own guard runs in
tests/gpu/test_append_gpu.py."""
import ctypes
import itertools
import subprocess

import pytest
import torch

import mpfa
import mpfa_jit
from mpfa.reference.append import quantize_rows
from mpfa_jit.errors import KernelAbiError
from mpfa_jit.ops import append_kv as append_op

ARCH = "sm_90a"
RECIPES = ("bf16", "qk8pv8", "qk4pv8", "qk4pv4")


def _cache(recipe, num_layers=3, num_pages=5, page_size=16, heads=2, head_dim=64):
    return mpfa.PagedKVCache(recipe, num_layers=num_layers, num_pages=num_pages, page_size=page_size,
                             num_kv_heads=heads, head_dim=head_dim, device="cpu")


def _rows(n, heads, d, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, heads, d, generator=g) * 2).to(torch.bfloat16)


def _snapshot(cache):
    return {name: t.clone() for name, t in cache.fields.items()}


# --- slots outside the layer -------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("layer", [0, 2])   # the last layer: past it is past the cache's buffers
@pytest.mark.parametrize("bad", ["just_past", "next_page", "far", "int32_max"])
def test_reference_refuses_slots_past_the_layer_and_writes_nothing(recipe, layer, bad):
    cache = _cache(recipe)
    n = cache.num_slots   # 80
    bad_slot = {"just_past": n, "next_page": n + 17, "far": 1 << 40, "int32_max": 2**31 - 1}[bad]
    k, v = _rows(4, 2, 64, 1), _rows(4, 2, 64, 2)
    before = _snapshot(cache)
    for dtype in (torch.int64, torch.int32):
        if bad_slot >= 2**31 and dtype == torch.int32:
            continue
        slots = torch.tensor([3, bad_slot, -1, 40], dtype=dtype)
        with pytest.raises(ValueError, match=rf"slots must lie in \[0, {n}\) .*negative \(-1: padding.*got 1 slot"):
            mpfa.append_kv(k, v, cache.layer(layer), slots, backend="reference")
        for name, t in cache.fields.items():   # refused before any row was written
            assert torch.equal(t.view(torch.uint8), before[name].view(torch.uint8)), name


def test_reference_negative_slots_are_padding_and_the_last_slot_is_in_range():
    cache = _cache("qk8pv8")
    k, v = _rows(3, 2, 64, 3), _rows(3, 2, 64, 4)
    slots = torch.tensor([-1, cache.num_slots - 1, -(1 << 40)])
    mpfa.append_kv(k, v, cache.layer(2), slots, backend="reference")
    want = quantize_rows(cache.recipe, k[1:2], v[1:2], cache.layer(2).mu_k, cache.layer(2).v_scale)
    last_page, last_off = divmod(cache.num_slots - 1, cache.page_size)
    assert torch.equal(cache.layer(2).fields["k"][last_page, :, last_off], want["k"][0])
    assert int((cache.fields["k_scale"] != 0).sum()) == 2   # that one row (2 heads) and nothing else


def test_check_append_slots_reports_the_kernels_count_and_resets_it():
    cache = _cache("qk4pv8")
    cache.check_append_slots()   # nothing counted: no error
    cache.out_of_range_slots.fill_(3)   # what the kernel's guard adds for three skipped tokens
    with pytest.raises(ValueError, match=r"append_kv was given 3 slot\(s\) outside \[0, 80\) .* skipped"):
        cache.check_append_slots()
    assert int(cache.out_of_range_slots.item()) == 0
    cache.check_append_slots()


# --- non-finite K / V: the defined bytes ----------------------------------------------------------------


def _nonfinite_rows(head_dim):
    """K and V [6, 2, D]: row 0 finite, row 1 NaN in K (a 4-bit-half channel of qk4pv8), row 2 +inf in K (an
    INT8-half channel), row 3 -inf in K, row 4 NaN / +inf / -inf in V, row 5 a V far past the scale (finite)."""
    k, v = _rows(6, 2, head_dim, 5), _rows(6, 2, head_dim, 6)
    k[1, 0, 0] = float("nan")
    k[2, 1, head_dim // 4 + 3] = float("inf")
    k[3, 0, head_dim - 1] = -float("inf")
    v[4, 0, 1], v[4, 0, 7], v[4, 1, 9] = float("nan"), float("inf"), -float("inf")
    v[5, 1, 2] = 3e38
    return k, v


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("recipe", ["qk8pv8", "qk4pv8", "qk4pv4"])
def test_nonfinite_k_row_gets_nan_scale_and_v_nan_bytes(recipe, head_dim):
    cache = _cache(recipe, head_dim=head_dim)
    cache.calibrate(0, _rows(32, 2, head_dim, 7), _rows(32, 2, head_dim, 8))
    layer = cache.layer(0)
    k, v = _nonfinite_rows(head_dim)
    got = quantize_rows(cache.recipe, k, v, layer.mu_k, layer.v_scale)
    bad_k = {(1, 0), (2, 1), (3, 0)}
    for t, h in itertools.product(range(6), range(2)):
        if (t, h) in bad_k:   # its integer bytes are unspecified: the NaN scale carries the fault
            assert torch.isnan(got["k_scale"][t, h]), (t, h)
        else:   # a finite row is quantized alone, whatever its neighbours hold
            alone = quantize_rows(cache.recipe, k[t:t + 1, h:h + 1], v[t:t + 1, h:h + 1], layer.mu_k[h:h + 1],
                                  layer.v_scale[h:h + 1])
            for name in ("k", "k8", "k_block_scale", "k_scale"):
                if name in got:
                    assert torch.equal(got[name][t, h].reshape(-1).view(torch.uint8),
                                       alone[name][0, 0].reshape(-1).view(torch.uint8)), name
    if cache.recipe.v_format == "u4h":
        # 4-bit Hadamard V: a non-finite element reaches every rotated channel, and 3e38 overflows the fp16 zero
        # points: those rows store NaN parameters and codes 0 in every group; the other rows as quantized alone
        bad_v = {(4, 0), (4, 1), (5, 1)}
        for t, h in itertools.product(range(6), range(2)):
            if (t, h) in bad_v:
                assert torch.isnan(got["v_param"][t, h]).all() and (got["v"][t, h] == 0).all(), (t, h)
            else:
                alone = quantize_rows(cache.recipe, k[t:t + 1, h:h + 1], v[t:t + 1, h:h + 1], layer.mu_k[h:h + 1],
                                      layer.v_scale[h:h + 1])
                assert torch.equal(got["v"][t, h], alone["v"][0, 0]) and torch.equal(got["v_param"][t, h],
                                                                                    alone["v_param"][0, 0])
    else:
        bad_v = set()
        vb = got["v"]
        nonfinite_v = ~torch.isfinite(v.float())
        assert ((vb[nonfinite_v] & 0x7F) == 0x7F).all(), "NaN and +-inf V are stored as E4M3 NaN, never 448"
        assert vb[5, 1, 2] == 0x7E, "a finite V past the scale saturates to 448"
        finite_rows = quantize_rows(cache.recipe, k, torch.where(nonfinite_v, torch.zeros_like(v), v), layer.mu_k,
                                    layer.v_scale)["v"]
        assert torch.equal(vb[~nonfinite_v], finite_rows[~nonfinite_v])
    # Written to the cache, such a key reads back as NaN in every channel; the finite ones stay finite (4-bit V:
    # the same for values, on both attention paths).
    mpfa.append_kv(k, v, layer, torch.arange(6) * 3, backend="reference")
    for path in ("decode", "prefill"):
        kd, vd = layer.dequantize(path=path)
        keys = kd.transpose(1, 2).reshape(-1, 2, head_dim)[torch.arange(6) * 3]
        values = vd.transpose(1, 2).reshape(-1, 2, head_dim)[torch.arange(6) * 3]
        for t, h in itertools.product(range(6), range(2)):
            assert torch.isnan(keys[t, h]).all() if (t, h) in bad_k else torch.isfinite(keys[t, h]).all()
            if bad_v:
                assert torch.isnan(values[t, h]).all() if (t, h) in bad_v else torch.isfinite(values[t, h]).all()


def test_bf16_cache_stores_nonfinite_values_as_given():
    cache = _cache("bf16")
    k, v = _nonfinite_rows(64)
    mpfa.append_kv(k, v, cache.layer(1), torch.arange(6), backend="reference")
    assert torch.equal(cache.layer(1).fields["k"][0, :, :6].transpose(0, 1).view(torch.int16), k.view(torch.int16))
    assert torch.equal(cache.layer(1).fields["v"][0, :, :6].transpose(0, 1).view(torch.int16), v.view(torch.int16))


# --- the library -------------------------------------------------------------------------------------


@pytest.mark.nvcc
def test_library_params_match_the_ctypes_mirror(jit_cache):
    """The library's AppendParams (size and every field's offset, exported by mpfa_append_params_layout) is
    the mirror's; a mirror with a field dropped, or two fields in another order, is refused at load."""
    module = mpfa_jit.get_kernel(append_op.spec(recipe="qk4pv8", head_dim=64, page_size=16, arch=ARCH))
    module.params_fn(append_op.SYMBOL, append_op.PARAMS_LAYOUT_SYMBOL, append_op.AppendParams)
    fields = append_op.AppendParams._fields_
    dropped = type("Dropped", (ctypes.Structure,), {"_fields_": [f for f in fields if f[0] != "num_slots"]})
    names = [f[0] for f in fields]
    i, j = names.index("num_tokens"), names.index("num_slots")
    swapped = type("Swapped", (ctypes.Structure,), {"_fields_": fields[:i] + [fields[j], fields[i]] + fields[j + 1:]})
    assert j == i + 1
    for wrong in (dropped, swapped):
        with pytest.raises(KernelAbiError, match="mpfa_jit.ops"):
            module.params_fn(append_op.SYMBOL, append_op.PARAMS_LAYOUT_SYMBOL, wrong)


@pytest.mark.nvcc
@pytest.mark.parametrize("recipe,head_dim,page_size", list(itertools.product(
    RECIPES, append_op.HEAD_DIMS, append_op.PAGE_SIZES)))
def test_every_specialization_builds_without_spills(recipe, head_dim, page_size, shared_jit_cache, sass_tools):
    cuobjdump, tool_env = sass_tools
    module = mpfa_jit.get_kernel(append_op.spec(recipe=recipe, head_dim=head_dim, page_size=page_size, arch=ARCH))
    module.params_fn(append_op.SYMBOL, append_op.PARAMS_LAYOUT_SYMBOL, append_op.AppendParams)
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", str(module.path)], capture_output=True, text=True,
                           env=tool_env).stdout
    # 4 blocks of 256 per SM cap the kernel at 64 registers (__launch_bounds__): nothing may spill for it
    assert "append_kv_kernel" in usage and "STACK:0" in usage and "LOCAL:0" in usage, usage
