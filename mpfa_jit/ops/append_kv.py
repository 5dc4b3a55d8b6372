"""Specs of the KV append/quantize kernel (templates/append_kv.cu.jinja)."""
from __future__ import annotations

import ctypes

from ..spec import KernelSpec

OP = "append_kv"
TEMPLATE = "append_kv.cu.jinja"
SYMBOL = "mpfa_append_kv"
RECIPES = ("bf16", "qk8pv8", "qk4pv8")
HEAD_DIMS = (64, 128, 256)
PAGE_SIZES = (1, 16, 32, 64)

_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# k, v, k/v strides (token, head), slots, num_tokens, num_kv_heads, k_data, k8_data (qk4pv8's E4M3 half),
# k_block_scale, k_scale, v_data, mu_k, v_scale, device, stream
ARGTYPES = [_p, _p, _i64, _i64, _i64, _i64, _p, _i64, _i32, _p, _p, _p, _p, _p, _p, _p, _i32, _p]


def _check(name, value, accepted):
    if value not in accepted:
        raise ValueError(f"{name} must be one of {list(accepted)}, got {value!r}")


def spec(*, recipe: str, head_dim: int, page_size: int, arch: str) -> KernelSpec:
    _check("recipe", recipe, RECIPES)
    _check("head_dim", head_dim, HEAD_DIMS)
    _check("page_size", page_size, PAGE_SIZES)
    return KernelSpec.make(OP, TEMPLATE, {"recipe": recipe, "head_dim": head_dim, "page_size": page_size},
                           arch, symbols=(SYMBOL,))


def server_specs(*, num_qo_heads: int, num_kv_heads: int, head_dim: int, recipe: str, page_size: int,
                 arch: str) -> list[KernelSpec]:
    return [spec(recipe=recipe, head_dim=head_dim, page_size=page_size, arch=arch)]
