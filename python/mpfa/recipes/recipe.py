"""The recipes: which precision each operand of attention has, and what the KV cache stores.

| recipe   | Q (prefill)              | K cache                                              | V cache            | QK MMA | PV MMA |
|----------|--------------------------|------------------------------------------------------|--------------------|--------|--------|
| bf16     | bf16                     | bf16                                                 | bf16               | bf16   | bf16   |
| qk8pv8   | int8, one scale per tile | int8, one scale per token                            | e4m3, fixed scales | int8   | e4m3   |
| qk4pv8   | int8, one scale per tile | i4rs: half int8, half int4 x integer block scale, one scale per token | e4m3, fixed scales | int8*  | e4m3   |

(*) qk4pv8's K (recipes/int8.py, ``quantize_i4rs``): the low-frequency RoPE half of the channels as INT8,
the other half as INT4 in [-7, 7] with one integer block scale 1..18 per 16 channels, so every
``block_scale * int4`` is an INT8 value and the kernels turn the whole row into INT8 K without rounding.
Quantized K is smoothed (stored as K - mu_K, mu_K fixed per layer and KV head); V has one fixed scale
per (layer, head, channel). Decode dequantizes K exactly to fp16 and keeps Q in fp16 (bf16 Q is exact
there up to a power-of-two prescale); prefill quantizes Q to INT8 per 64-row tile after smoothing.
"""
from __future__ import annotations

from dataclasses import dataclass

from .int8 import I4RS_BLOCK

DEFAULT_RECIPE = "qk4pv8"


@dataclass(frozen=True)
class Field:
    """One per-token tensor of the cache: ``[num_pages, num_kv_heads, page_size, *shape(head_dim)]``."""
    name: str
    dtype: str            # "bfloat16", "int8", "uint8" (E4M3 bytes, packed INT4, block scales), "float32"
    per_row: str          # elements per (token, head): "D", "D/2", "D/4", "D/16", "D/32" or "1"

    def numel(self, head_dim: int) -> int:
        # "D/32": at least 4 bytes (head_dim 64 pads 2 block scales to 4): cp.async copies 4 bytes or more
        return {"D": head_dim, "D/2": head_dim // 2, "D/4": head_dim // 4, "D/16": head_dim // I4RS_BLOCK,
                "D/32": max(4, head_dim // (2 * I4RS_BLOCK)), "1": 1}[self.per_row]

    def itemsize(self) -> int:
        return {"bfloat16": 2, "int8": 1, "uint8": 1, "float32": 4}[self.dtype]


@dataclass(frozen=True)
class Recipe:
    name: str
    q_format: str          # "bf16" | "int8" (prefill; decode keeps Q in fp16)
    k_format: str          # "bf16" | "int8" | "i4rs" (half int8, half int4 x block scale)
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
    "qk8pv8": Recipe("qk8pv8", "int8", "int8", "e4m3",
                     (Field("k", "int8", "D"), Field("k_scale", "float32", "1"), Field("v", "uint8", "D"))),
    "qk4pv8": Recipe("qk4pv8", "int8", "i4rs", "e4m3",
                     (Field("k8", "int8", "D/2"), Field("k", "uint8", "D/4"), Field("k_block_scale", "uint8", "D/32"),
                      Field("k_scale", "float32", "1"), Field("v", "uint8", "D"))),
}


def get_recipe(recipe: "str | Recipe") -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    try:
        return RECIPES[recipe]
    except (KeyError, TypeError):
        raise ValueError(f"recipe must be one of {list(RECIPES)}, got {recipe!r}") from None
