"""Specs of the KV append/quantize kernel (templates/append_kv.cu.jinja).

The library's entry point takes one ``AppendParams`` (templates/include/mpfa/append/params.cuh), mirrored
here by :class:`AppendParams` and checked against the library's own layout when it is loaded."""
from __future__ import annotations

import ctypes

from ..spec import KernelSpec
from .layout import layout_context
from .support import ALL_RECIPES, HEAD_DIMS, PAGE_SIZES, check

OP = "append_kv"
TEMPLATE = "append_kv.cu.jinja"
SYMBOL = "mpfa_append_kv"                        # int (const AppendParams*, int device, void* stream)
PARAMS_LAYOUT_SYMBOL = "mpfa_append_params_layout"
# What the kernel, and so the cache (mpfa.PagedKVCache), is built for: what every op is (support.py).
RECIPES = ALL_RECIPES


class AppendParams(ctypes.Structure):
    """Mirror of templates/include/mpfa/append/params.cuh (field meanings there); pointers are device
    addresses, null where the recipe has no such field."""
    _fields_ = [
        ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
        ("k_stride_token", ctypes.c_int64), ("k_stride_head", ctypes.c_int64),
        ("v_stride_token", ctypes.c_int64), ("v_stride_head", ctypes.c_int64),
        ("slots", ctypes.c_void_p), ("num_tokens", ctypes.c_int64), ("num_slots", ctypes.c_int64),
        ("bad_slots", ctypes.c_void_p),
        ("k_data", ctypes.c_void_p), ("k8_data", ctypes.c_void_p), ("k_block_scale", ctypes.c_void_p),
        ("k_scale", ctypes.c_void_p), ("v_data", ctypes.c_void_p), ("v_param", ctypes.c_void_p),
        ("mu_k", ctypes.c_void_p), ("v_scale", ctypes.c_void_p),
        ("num_kv_heads", ctypes.c_int),
    ]


def spec(*, recipe: str, head_dim: int, page_size: int, arch: str) -> KernelSpec:
    check("KV append", dict(recipe=recipe, head_dim=head_dim, page_size=page_size),
          dict(recipe=RECIPES, head_dim=HEAD_DIMS, page_size=PAGE_SIZES))
    return KernelSpec.make(OP, TEMPLATE, {"recipe": recipe, "head_dim": head_dim, "page_size": page_size},
                           arch, symbols=(SYMBOL, PARAMS_LAYOUT_SYMBOL), context=layout_context(recipe, head_dim))


def server_specs(*, num_qo_heads: int, num_kv_heads: int, head_dim: int, recipe: str, page_size: int,
                 arch: str) -> list[KernelSpec]:
    return [spec(recipe=recipe, head_dim=head_dim, page_size=page_size, arch=arch)]
