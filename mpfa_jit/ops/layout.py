"""The cache layout a kernel specialization compiles against, from the one definition of it: the Field
table in ``mpfa_jit.formats``. Every kernel template renders the table's row widths as the arguments of
``mpfa::CacheLayout`` (templates/cache_layout_check.jinja), so C++ holds the field names and no arithmetic."""
from __future__ import annotations

from ..formats import get_recipe

# mpfa::CacheLayout's width arguments (templates/include/mpfa/cache_layout.cuh), in order: the names a Field may have.
LAYOUT_FIELDS = ("k", "k8", "k_block_scale", "k_scale", "v", "v_param")


def cache_fields(recipe: str, head_dim: int) -> tuple[tuple[str, int], ...]:
    """(field name, bytes per token and KV head) of ``recipe``'s cache at ``head_dim``, in the table's order."""
    return tuple((f.name, f.numel(head_dim) * f.itemsize()) for f in get_recipe(recipe).fields)


def layout_args(recipe: str, head_dim: int) -> tuple[int, ...]:
    """``mpfa::CacheLayout``'s widths for ``recipe`` at ``head_dim``: bytes per (token, KV head) of each name in
    LAYOUT_FIELDS, 0 where the recipe has no such field."""
    fields = dict(cache_fields(recipe, head_dim))
    unknown = sorted(set(fields) - set(LAYOUT_FIELDS))
    if unknown:
        raise ValueError(f"recipe {recipe!r} has cache fields {unknown} that mpfa::CacheLayout does not name; "
                         f"it names {list(LAYOUT_FIELDS)} (templates/include/mpfa/cache_layout.cuh)")
    return tuple(fields.get(name, 0) for name in LAYOUT_FIELDS)


def recipe_enum(recipe: str) -> str:
    """The ``mpfa::Recipe`` enumerator of a recipe name (templates/include/mpfa/cache_layout.cuh): ``k`` and the
    capitalized name, so the enum needs no second list of the recipes (bf16 -> kBf16, qk4pv8 -> kQk4pv8)."""
    return "k" + recipe[:1].upper() + recipe[1:]


def layout_context(recipe: str, head_dim: int) -> dict:
    """The render context every kernel template's cache layout needs."""
    return {"layout_args": layout_args(recipe, head_dim), "layout_names": LAYOUT_FIELDS, "recipe_enum": recipe_enum(recipe)}
