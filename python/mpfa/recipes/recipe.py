"""The recipes: which precision each operand of attention has, and what the KV cache stores.

| recipe   | Q (prefill)              | K cache                          | V cache            | QK MMA | PV MMA |
|----------|--------------------------|----------------------------------|--------------------|--------|--------|
| bf16     | bf16                     | bf16                             | bf16               | bf16   | bf16   |
| qk8pv8   | e4m3, one scale per tile | e4m3, one scale per token        | e4m3, fixed scales | e4m3   | e4m3   |
| qk4pv8   | e4m3, one scale per tile | k4rs: half e4m3, half e2m1 + per-16 scales, one scale per token | e4m3, fixed scales | e4m3*  | e4m3   |

(*) qk4pv8's K (recipes/fp4.py, ``quantize_k4rs``): the low-frequency RoPE half of the channels in E4M3, the
other half in 4-bit blocks whose products with their block scales are exact in E4M3, so the kernel turns
the whole row into FP8 K without rounding. Quantized K is smoothed (stored as
K - mu_K, mu_K fixed per layer and KV head); V has one fixed scale per (layer, head, channel).
"""
from __future__ import annotations

from dataclasses import dataclass

from .fp4 import BLOCK

DEFAULT_RECIPE = "qk4pv8"


@dataclass(frozen=True)
class Field:
    """One per-token tensor of the cache: ``[num_pages, num_kv_heads, page_size, *shape(head_dim)]``."""
    name: str
    dtype: str            # "bfloat16", "uint8" (FP8/E2M1 bytes), "float32"
    per_row: str          # elements per (token, head): "D", "D/2", "D/4", "D/16", "D/32" or "1"

    def numel(self, head_dim: int) -> int:
        # "D/32": at least 4 bytes (head_dim 64 pads 2 block scales to 4): cp.async copies 4 bytes or more
        return {"D": head_dim, "D/2": head_dim // 2, "D/4": head_dim // 4, "D/16": head_dim // BLOCK,
                "D/32": max(4, head_dim // (2 * BLOCK)), "1": 1}[self.per_row]

    def itemsize(self) -> int:
        return {"bfloat16": 2, "uint8": 1, "float32": 4}[self.dtype]


@dataclass(frozen=True)
class Recipe:
    name: str
    q_format: str          # "bf16" | "e4m3"
    k_format: str          # "bf16" | "e4m3" | "k4rs" (half e4m3, half e2m1)
    v_format: str          # "bf16" | "e4m3"
    fields: tuple[Field, ...]

    @property
    def quantized_k(self) -> bool:
        return self.k_format != "bf16"

    @property
    def quantized_v(self) -> bool:
        return self.v_format != "bf16"

    @property
    def quantized_q(self) -> bool:
        return self.q_format != "bf16"

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)

    def bytes_per_token_head(self, head_dim: int) -> int:
        """Bytes of K and V (values and their per-token scales) that one token of one KV head stores."""
        return sum(f.numel(head_dim) * f.itemsize() for f in self.fields)


RECIPES = {
    "bf16": Recipe("bf16", "bf16", "bf16", "bf16",
                   (Field("k", "bfloat16", "D"), Field("v", "bfloat16", "D"))),
    "qk8pv8": Recipe("qk8pv8", "e4m3", "e4m3", "e4m3",
                     (Field("k", "uint8", "D"), Field("k_scale", "float32", "1"), Field("v", "uint8", "D"))),
    "qk4pv8": Recipe("qk4pv8", "e4m3", "k4rs", "e4m3",
                     (Field("k8", "uint8", "D/2"), Field("k", "uint8", "D/4"), Field("k_block_scale", "uint8", "D/32"),
                      Field("k_scale", "float32", "1"), Field("v", "uint8", "D"))),
}


def get_recipe(recipe: "str | Recipe") -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    try:
        return RECIPES[recipe]
    except (KeyError, TypeError):
        raise ValueError(f"recipe must be one of {list(RECIPES)}, got {recipe!r}") from None
