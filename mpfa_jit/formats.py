"""The facts the kernels compile against, defined once and importing nothing from ``mpfa``: what each recipe's
cache stores (the Field table, rendered into every template and checked against ``mpfa::CacheLayout``) and the
numerics constants the templates render (the INT8 Q tile, the compensation digits, P's scale). ``mpfa.recipes``
builds its quantizers and references on them; ``mpfa_jit.ops`` renders them.

The recipes: which precision each operand of attention has, and what the KV cache stores.

| recipe   | Q (prefill)              | K cache                                              | V cache            | QK MMA | PV MMA |
|----------|--------------------------|------------------------------------------------------|--------------------|--------|--------|
| bf16     | bf16                     | bf16                                                 | bf16               | bf16   | bf16   |
| qk8pv8   | int8, one scale per tile | int8, one scale per token                            | e4m3, fixed scales | int8   | e4m3   |
| qk4pv8   | int8, one scale per tile | i4rs: half int8, half int4 x integer block scale, one scale per token | e4m3, fixed scales | int8*  | e4m3   |
| qk4pv4   | int8, one scale per tile | i4rs (as qk4pv8)                                     | u4h: 4-bit, V H**  | int8*  | e4m3   |

(*) qk4pv8's K (mpfa/recipes/int8.py, ``quantize_i4rs``): the low-frequency RoPE half of the channels as INT8,
the other half as INT4 in [-7, 7] with one integer block scale 1..18 per 16 channels, so every
``block_scale * int4`` is an INT8 value and the kernels turn the whole row into INT8 K without rounding.
Quantized K is smoothed (stored as K - mu_K, mu_K fixed per layer and KV head); V has one fixed scale
per (layer, head, channel). Decode dequantizes K exactly to fp16 and keeps Q in fp16 (bf16 Q is exact
there up to a power-of-two prescale); prefill quantizes Q to INT8 per 64-row tile after smoothing.

(**) qk4pv4's V (mpfa/recipes/u4h.py, ``quantize_u4h``): the row rotated by the orthonormal Hadamard matrix,
r = V H, stored as 4-bit codes 0..15 with one fp16 scale and zero point per 32 channels (D/2 + D/8 bytes: 80 at
head_dim 128, 184 B per token-head with K). Decode multiplies the fp16 dequantized values; prefill's pre-pass
writes them into the same FP8 V image as the e4m3 recipes (under V's fixed scales, calibrated on V H). Both give
O H, which the wrappers rotate back with one bf16 GEMM (H H = I).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

# --- integer formats (mpfa/recipes/int8.py) ---
INT8_MAX = 127
INT4_MAX = 7
BLOCK_SCALE_MAX = 18                 # 7 * 18 = 126 <= 127: every b * q is an INT8 value
I4RS_BLOCK = 16                      # channels per i4rs block scale (8 is a study option)
Q_TILE = 64                          # query rows per INT8 Q scale (prefill; whole 64-row warpgroups)

# Compensation as one more k-step of the INT8 QK MMA (prefill builds with ``comp_mma``, qk4pv8's served one): a key's
# term in units of the QK product, C_j = rni((mu_Q . Kint_j) / sq) (sq one Q scale per request and head), is carried by
# COMP_DIGITS INT8 digits e against the fixed Q-side weights COMP_DIGIT_WEIGHTS, C = e_0 + 127 * (e_1 + ... + e_31);
# |C| <= COMP_DIGIT_LIMIT fits (63 + 127 * (30 * 127 + 126)). |C| <= 127 |mu_Q|_1 / sq, so the head's Q scale is
# the larger of amax / 127 and 127 |mu_Q|_1 / COMP_SCALE_DIVISOR (mpfa.recipes.int8.comp_digits_q_scale): every term
# fits, and only a head whose mean outweighs its spread ~31 times over (|mu_Q|_1 > 31 amax; a one-row request) gets
# the coarser scale, where the mean's term, kept to ~19 bits, carries the logits.
COMP_DIGITS = 32
COMP_DIGIT_WEIGHTS = (1,) + (INT8_MAX,) * (COMP_DIGITS - 1)
COMP_DIGIT_LIMIT = 63 + INT8_MAX * (30 * INT8_MAX + 126)
# 2^-10 below the limit for the fp32 dot's rounding; as float32, the value the kernels use
COMP_SCALE_DIVISOR = struct.unpack("f", struct.pack("f", COMP_DIGIT_LIMIT * 0.999))[0]

# --- FP8 (mpfa/recipes/fp8.py) ---
E4M3_MAX = 448.0
# P (the softmax numerators, p <= 1 after subtracting the row maximum) is quantized as e4m3(p * P_SCALE) /
# P_SCALE: 448 maps the maximum to the top of E4M3 (SageAttention's static offset). Prefill builds with
# tile_scale (qk4pv8's served one) use P_SCALE_POW2, a power of two, so that their exponent arithmetic lands a
# row's maximum on it exactly; either way P's relative precision is E4M3's.
P_SCALE = E4M3_MAX
P_SCALE_POW2 = 256.0


DEFAULT_RECIPE = "qk4pv8"


@dataclass(frozen=True)
class Field:
    """One per-token tensor of the cache: ``[num_pages, num_kv_heads, page_size, *shape(head_dim)]``."""
    name: str
    dtype: str            # "bfloat16", "int8", "uint8" (E4M3 bytes, packed INT4, block scales), "float16", "float32"
    per_row: str          # elements per (token, head): "D", "D/2", "D/4", "D/16", "D/32" or "1"

    def numel(self, head_dim: int) -> int:
        # "D/32": at least 4 bytes (head_dim 64 pads 2 block scales to 4): cp.async copies 4 bytes or more
        return {"D": head_dim, "D/2": head_dim // 2, "D/4": head_dim // 4, "D/16": head_dim // I4RS_BLOCK,
                "D/32": max(4, head_dim // (2 * I4RS_BLOCK)), "1": 1}[self.per_row]

    def itemsize(self) -> int:
        return {"bfloat16": 2, "int8": 1, "uint8": 1, "float16": 2, "float32": 4}[self.dtype]


@dataclass(frozen=True)
class Recipe:
    name: str
    q_format: str          # "bf16" | "int8" (prefill; decode keeps Q in fp16)
    k_format: str          # "bf16" | "int8" | "i4rs" (half int8, half int4 x block scale)
    v_format: str          # "bf16" | "e4m3" | "u4h" (4-bit codes of V H, a scale and zero point per 32 channels)
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
    "qk4pv4": Recipe("qk4pv4", "int8", "i4rs", "u4h",
                     (Field("k8", "int8", "D/2"), Field("k", "uint8", "D/4"), Field("k_block_scale", "uint8", "D/32"),
                      Field("k_scale", "float32", "1"), Field("v", "uint8", "D/2"), Field("v_param", "float16", "D/16"))),
}


def get_recipe(recipe: "str | Recipe") -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    try:
        return RECIPES[recipe]
    except (KeyError, TypeError):
        raise ValueError(f"recipe must be one of {list(RECIPES)}, got {recipe!r}") from None
