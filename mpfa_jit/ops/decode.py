"""Specs of the batch-decode kernel (templates/decode.cu.jinja): split-KV paged decode + merge.

The library's entry point takes one ``DecodeParams`` (templates/include/mpfa/decode/params.cuh), mirrored
here by :class:`DecodeParams` and checked against the library's own layout when it is loaded."""
from __future__ import annotations

import ctypes

from ..spec import KernelSpec
from .layout import layout_context
from .support import ALL_RECIPES, HEAD_DIMS, PAGE_SIZES, check, gqa_group

OP = "decode"
TEMPLATE = "decode.cu.jinja"
SYMBOL = "mpfa_decode"                          # int (const DecodeParams*, int device, void* stream)
PARAMS_LAYOUT_SYMBOL = "mpfa_decode_params_layout"
SMEM_SYMBOL = "mpfa_decode_smem_bytes"
RESIDENT_SYMBOL = "mpfa_decode_resident_ctas"   # (device, int* ctas): CTAs per SM at once
RECIPES = ALL_RECIPES
GROUP_SIZES = tuple(range(1, 9))   # num_qo_heads / num_kv_heads: one specialization each

# The kernel's tile: kWarps warps per CTA, 16 tokens of each tile apiece (rendered into the template);
# KV splits are whole tiles.
WARPS = 4
TILE = 16 * WARPS


class DecodeParams(ctypes.Structure):
    """Mirror of templates/include/mpfa/decode/params.cuh (field meanings there); pointers are device
    addresses, null where the recipe has no such field."""
    _fields_ = [
        ("q", ctypes.c_void_p), ("q_stride_b", ctypes.c_int64), ("q_stride_h", ctypes.c_int64),
        ("k", ctypes.c_void_p), ("k8", ctypes.c_void_p), ("k_block_scale", ctypes.c_void_p),
        ("k_scale", ctypes.c_void_p), ("v", ctypes.c_void_p), ("v_scale", ctypes.c_void_p),
        ("v_param", ctypes.c_void_p),
        ("indptr", ctypes.c_void_p), ("indices", ctypes.c_void_p), ("last_page_len", ctypes.c_void_p),
        ("num_kv_heads", ctypes.c_int), ("num_items", ctypes.c_int), ("batch", ctypes.c_int),
        ("work_indptr", ctypes.c_void_p), ("work_request", ctypes.c_void_p), ("tiles_per_split", ctypes.c_void_p),
        ("score_scale", ctypes.c_float),
        ("o_part", ctypes.c_void_p), ("lse_part", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("out_stride_b", ctypes.c_int64), ("out_stride_h", ctypes.c_int64),
        ("lse", ctypes.c_void_p),
    ]


def spec(*, recipe: str, head_dim: int, page_size: int, group_size: int, arch: str) -> KernelSpec:
    check("decode", dict(recipe=recipe, head_dim=head_dim, page_size=page_size, group_size=group_size),
          dict(recipe=RECIPES, head_dim=HEAD_DIMS, page_size=PAGE_SIZES, group_size=GROUP_SIZES))
    return KernelSpec.make(OP, TEMPLATE, {"recipe": recipe, "head_dim": head_dim, "page_size": page_size,
                                          "group_size": group_size}, arch,
                           symbols=(SYMBOL, PARAMS_LAYOUT_SYMBOL, SMEM_SYMBOL, RESIDENT_SYMBOL),
                           context=dict(layout_context(recipe, head_dim), warps=WARPS))


def server_specs(*, num_qo_heads: int, num_kv_heads: int, head_dim: int, recipe: str, page_size: int,
                 arch: str) -> list[KernelSpec]:
    """The one decode specialization a server of this shape runs; raises when there is none."""
    return [spec(recipe=recipe, head_dim=head_dim, page_size=page_size,
                 group_size=gqa_group(num_qo_heads, num_kv_heads), arch=arch)]
