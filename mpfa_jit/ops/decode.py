"""Specs of the batch-decode kernel (templates/decode.cu.jinja): split-KV paged decode + merge."""
from __future__ import annotations

import ctypes

from ..errors import UnknownKernelError
from ..spec import KernelSpec

OP = "decode"
TEMPLATE = "decode.cu.jinja"
SYMBOL = "mpfa_decode"
SMEM_SYMBOL = "mpfa_decode_smem_bytes"
RESIDENT_SYMBOL = "mpfa_decode_resident_ctas"   # (device, int* ctas): CTAs per SM at once
RECIPES = ("bf16", "qk8pv8", "qk4pv8")
HEAD_DIMS = (64, 128)
PAGE_SIZES = (1, 16, 32, 64)
GROUP_SIZES = tuple(range(1, 9))

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# q, q strides (request, head), k, k8 (qk4pv8), k_block_scale, k_scale, v, v_scale, indptr, indices, last_page_len,
# batch, num_kv_heads, num_splits, tiles_per_split (device int*), sm_scale, o_part, lse_part, out, out strides, lse, device, stream
ARGTYPES = [_p, _i64, _i64, _p, _p, _p, _p, _p, _p, _p, _p, _p, _i32, _i32, _i32, _p, _f32, _p, _p, _p, _i64, _i64,
            _p, _i32, _p]


def supported(*, recipe: str, head_dim: int, page_size: int, group_size: int) -> bool:
    return (recipe in RECIPES and head_dim in HEAD_DIMS and page_size in PAGE_SIZES and group_size in GROUP_SIZES)


def spec(*, recipe: str, head_dim: int, page_size: int, group_size: int, arch: str) -> KernelSpec:
    if not supported(recipe=recipe, head_dim=head_dim, page_size=page_size, group_size=group_size):
        raise UnknownKernelError(
            f"no sm_90a decode kernel for recipe={recipe!r}, head_dim={head_dim}, page_size={page_size}, "
            f"group_size={group_size}: built for recipes {list(RECIPES)}, head_dim {list(HEAD_DIMS)}, "
            f"page_size {list(PAGE_SIZES)}, group_size (num_qo_heads / num_kv_heads) 1..8")
    return KernelSpec.make(OP, TEMPLATE, {"recipe": recipe, "head_dim": head_dim, "page_size": page_size,
                                          "group_size": group_size}, arch, symbols=(SYMBOL, SMEM_SYMBOL))


def server_specs(*, num_qo_heads: int, num_kv_heads: int, head_dim: int, recipe: str, page_size: int,
                 arch: str) -> list[KernelSpec]:
    group = num_qo_heads // num_kv_heads
    if not supported(recipe=recipe, head_dim=head_dim, page_size=page_size, group_size=group):
        return []   # the decode wrapper raises at plan for shapes without a kernel
    return [spec(recipe=recipe, head_dim=head_dim, page_size=page_size, group_size=group, arch=arch)]
