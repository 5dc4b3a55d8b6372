"""The recipes (the Field table of what each one's cache stores) are defined in :mod:`mpfa_jit.formats`, with the
other facts the kernels compile against, so that the kernel service needs nothing from ``mpfa``; this module is
their name in ``mpfa.recipes`` (its table of formats is in that module's docstring)."""
from mpfa_jit.formats import DEFAULT_RECIPE, RECIPES, Field, Recipe, get_recipe

__all__ = ["DEFAULT_RECIPE", "RECIPES", "Field", "Recipe", "get_recipe"]
