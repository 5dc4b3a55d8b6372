"""The cache layout a kernel specialization compiles against, from the one definition of it: the Field
table in ``mpfa_jit.formats`` (and ``Recipe.record``, page size 1's one record per token and head). Every kernel
template renders the table's row widths and the record's size as the arguments of ``mpfa::CacheLayout``
(templates/cache_layout_check.jinja), so C++ holds the field names and no arithmetic."""
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


def record_bytes(recipe: str, head_dim: int, page_size: int) -> int:
    """``mpfa::CacheLayout``'s RecordBytes: the record's size where ``recipe`` stores one record per (token, KV head)
    at ``page_size`` (``Recipe.record``: every field's row then follows the last one's at this stride), 0 where its
    fields are separate arrays."""
    rec = get_recipe(recipe).record(head_dim, page_size)
    return rec.nbytes if rec else 0


def layout_context(recipe: str, head_dim: int, page_size: int) -> dict:
    """The render context every kernel template's cache layout needs."""
    return {"layout_args": layout_args(recipe, head_dim) + (record_bytes(recipe, head_dim, page_size),),
            "layout_names": LAYOUT_FIELDS, "recipe_enum": recipe_enum(recipe)}
