"""One support table per op (mpfa_jit/ops/<op>.py), read by everything else: the recipe names come from
mpfa.recipes, the cache serves what the append kernel writes, the server what every kernel serves, and
an unsupported specialization raises naming the value and the table instead of being skipped."""
import re
from pathlib import Path

import pytest

import mpfa
from mpfa.recipes import RECIPES as RECIPE_TABLE
from mpfa.sglang import model, settings
from mpfa_jit import UnknownKernelError
from mpfa_jit.ops import OPS, append_kv, decode, prefill, support
from mpfa_jit.formats import Field, Recipe
from mpfa_jit.ops.layout import LAYOUT_FIELDS, cache_fields, layout_args, layout_context

ROOT = Path(__file__).resolve().parents[2]
ARCH = "sm_90a"


@pytest.mark.parametrize("recipe", list(RECIPE_TABLE))
def test_every_recipe_has_a_kernel_layout(recipe):
    """A recipe added to mpfa.recipes must reach the kernels' mpfa::Recipe and the render context every op
    passes: its enumerator exists in cache_layout.cuh and its Field table renders for every built head_dim."""
    enum = (ROOT / "templates" / "include" / "mpfa" / "cache_layout.cuh").read_text()
    declared = re.search(r"enum class Recipe : int \{([^}]*)\}", enum).group(1)
    ctx = layout_context(recipe, 128)
    assert re.search(rf"\b{ctx['recipe_enum']}\b", declared), (recipe, declared)
    for op in OPS:
        assert recipe in op.RECIPES
        for d in op.HEAD_DIMS:
            assert sum(n for _, n in cache_fields(recipe, d)) == RECIPE_TABLE[recipe].bytes_per_token_head(d)
            assert sum(layout_args(recipe, d)) == RECIPE_TABLE[recipe].bytes_per_token_head(d)


def test_the_kernels_cache_row_is_rendered_from_the_field_table():
    """mpfa::CacheLayout takes its widths as arguments, in LAYOUT_FIELDS' order, from the Field table; a field the
    C++ side has no name for is refused at render time, naming it."""
    enum = (ROOT / "templates" / "include" / "mpfa" / "cache_layout.cuh").read_text()
    params = re.search(r"template <Recipe R, int HeadDim, ([^>]*)>\s*struct CacheLayout", enum).group(1)
    assert [re.sub(r"Bytes$", "", p.split()[1]) for p in re.split(r",\s*", params.strip())] == [
        "".join(w.capitalize() for w in f.split("_")) for f in LAYOUT_FIELDS]
    assert layout_args("qk4pv8", 128) == (32, 64, 4, 4, 128, 0) and layout_args("bf16", 64) == (128, 0, 0, 0, 128, 0)
    assert layout_args("qk4pv4", 128) == (32, 64, 4, 4, 64, 16) and layout_args("qk4pv4", 64) == (16, 32, 4, 4, 32, 8)
    odd = Recipe("odd", "int8", "int8", "e4m3", (Field("k", "int8", "D"), Field("k_zero", "int8", "1")))
    with pytest.raises(ValueError, match=r"cache fields \['k_zero'\] that mpfa::CacheLayout does not name"):
        layout_args(odd, 128)


def test_every_op_is_built_for_the_same_head_dims_and_page_sizes():
    """One table (mpfa_jit.ops.support): a cache shape that one op builds and another does not serves no one."""
    assert {(op.HEAD_DIMS, op.PAGE_SIZES) for op in OPS} == {(support.HEAD_DIMS, support.PAGE_SIZES)}


def test_the_cache_and_the_server_read_the_op_tables():
    assert mpfa.HEAD_DIMS is append_kv.HEAD_DIMS and mpfa.PAGE_SIZES is append_kv.PAGE_SIZES
    assert settings.PAGE_SIZES is append_kv.PAGE_SIZES
    assert model.HEAD_DIMS == tuple(d for d in append_kv.HEAD_DIMS if d in decode.HEAD_DIMS and d in prefill.HEAD_DIMS)
    assert model.GROUP_SIZES == tuple(g for g in decode.GROUP_SIZES if g in prefill.GROUP_SIZES)
    assert model.PAGE_SIZES == tuple(p for p in append_kv.PAGE_SIZES
                                     if p in decode.PAGE_SIZES and p in prefill.PAGE_SIZES)


@pytest.mark.parametrize("make, match", [
    (lambda: decode.spec(recipe="qk4pv8", head_dim=256, page_size=16, group_size=4, arch=ARCH),
     r"no decode kernel for recipe='qk4pv8', head_dim=256, page_size=16, group_size=4: head_dim must be one of "
     r"\[64, 128\], got 256$"),
    (lambda: decode.spec(recipe="qk4pv8", head_dim=128, page_size=16, group_size=9, arch=ARCH),
     r"no decode kernel for .*: group_size must be in 1\.\.8, got 9$"),
    (lambda: prefill.spec(recipe="qk4pv8", head_dim=128, page_size=8, arch=ARCH),
     r"no batch-prefill kernel for .*: page_size must be one of \[1, 16, 32, 64\], got 8$"),
    (lambda: prefill.spec(recipe="qk4pv8", head_dim=128, page_size=16, group_size=10, arch=ARCH),
     r"no batch-prefill kernel for .*group_size=10: group_size must be in 1\.\.8, got 10$"),
    (lambda: append_kv.spec(recipe="fp4", head_dim=96, page_size=16, arch=ARCH),
     r"no KV append kernel for .*: recipe must be one of \['bf16', 'qk8pv8', 'qk4pv8', 'qk4pv4'\], got 'fp4'; "
     r"head_dim must be one of \[64, 128\], got 96$"),
])
def test_unsupported_spec_names_the_value_and_the_table(make, match):
    with pytest.raises(UnknownKernelError, match=match):
        make()


@pytest.mark.parametrize("op", [decode, prefill], ids=lambda op: op.OP)
@pytest.mark.parametrize("heads, kv_heads, head_dim, match", [
    (32, 8, 256, r"head_dim must be one of"), (80, 8, 128, r"group_size must be in 1\.\.8, got 10"),
    (30, 8, 128, r"num_qo_heads 30 must be a positive"),
    (32, 0, 128, r"num_kv_heads 0"), (32, -8, 128, r"num_kv_heads -8")])
def test_server_specs_raise_for_a_shape_without_a_kernel(op, heads, kv_heads, head_dim, match):
    """A server of this shape would fail at its first batch: the op says so instead of returning nothing."""
    with pytest.raises(ValueError, match=match):
        op.server_specs(num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, recipe="qk4pv8", page_size=16,
                        arch=ARCH)


def test_no_second_spelling_of_the_recipe_list():
    """The list of every recipe is written once (mpfa.recipes); the ops, the server and the benchmarks import it."""
    spelled = re.compile(r"""\(\s*["']bf16["'],\s*["']qk8pv8["'],\s*["']qk4pv8["']\s*\)""")
    files = [p for d in ("mpfa_jit", "python", "benchmarks") for p in (ROOT / d).rglob("*.py")]
    files += list((ROOT / "benchmarks").rglob("*.sh"))
    offenders = [str(p.relative_to(ROOT)) for p in files if spelled.search(p.read_text())]
    assert not offenders, f"these spell the recipe list instead of importing it: {offenders}"
