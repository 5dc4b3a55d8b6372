"""The cache layout a kernel specialization compiles against, from the one definition of it: the Field
table in ``mpfa_jit.formats``. Rendered into every kernel template as ``cache_fields`` and checked there
against ``mpfa::CacheLayout`` (templates/cache_layout_check.jinja)."""
from __future__ import annotations

from ..formats import get_recipe


def cache_fields(recipe: str, head_dim: int) -> tuple[tuple[str, int], ...]:
    """(field name, bytes per token and KV head) of ``recipe``'s cache at ``head_dim``, in the table's order."""
    return tuple((f.name, f.numel(head_dim) * f.itemsize()) for f in get_recipe(recipe).fields)


def recipe_enum(recipe: str) -> str:
    """The ``mpfa::Recipe`` enumerator of a recipe name (templates/include/mpfa/cache_layout.cuh): ``k`` and the
    capitalized name, so the enum needs no second list of the recipes (bf16 -> kBf16, qk4pv8 -> kQk4pv8)."""
    return "k" + recipe[:1].upper() + recipe[1:]


def layout_context(recipe: str, head_dim: int) -> dict:
    """The render context every kernel template's cache-layout check needs."""
    return {"cache_fields": cache_fields(recipe, head_dim), "recipe_enum": recipe_enum(recipe)}
