"""Recipes and their quantizers: the numerics every kernel must reproduce."""
from .recipe import DEFAULT_RECIPE, RECIPES, Field, Recipe, get_recipe

__all__ = ["DEFAULT_RECIPE", "RECIPES", "Field", "Recipe", "get_recipe"]
