"""Specs of the batch prefill/extend kernel (templates/prefill.cu.jinja): wgmma (QGMMA / HGMMA) over the
paged cache; its pre-passes (mu_Q; the KV tile images with the compensation vector) are in the same
library.

Causality and the GQA group are runtime arguments (one build serves both), so a specialization is
(recipe, head_dim, page_size, arch)."""
from __future__ import annotations

import ctypes

from ..errors import UnknownKernelError
from ..spec import KernelSpec

OP = "prefill"
TEMPLATE = "prefill.cu.jinja"
SYMBOL = "mpfa_prefill"
SMEM_SYMBOL = "mpfa_prefill_smem_bytes"
RECIPES = ("bf16", "qk8pv8", "qk4pv8")
HEAD_DIMS = (64, 128)
PAGE_SIZES = (1, 16, 32, 64)
MAX_GROUP = 8   # tested range of num_qo_heads / num_kv_heads (the kernel itself takes any group)

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# q, q strides (token, head), k, k8 (qk4pv8), k_block_scale, k_scale, v, v_scale, qo_indptr, kv_indptr, indices,
# last_page_len, kv_tile_base, tile_req, tile_q, kvt_req, kvt_idx, num_tiles, num_kv_tiles, batch,
# num_qo_heads, num_kv_heads, causal, sm_scale, mu_blocks, mu_part, mu, k_img, v_img, fa, fb, out, out
# strides, lse, device, stream
ARGTYPES = ([_p, _i64, _i64] + [_p] * 15 + [_i32] * 6 + [_f32, _i32] + [_p] * 7 + [_i64, _i64, _p, _i32, _p])


def supported(*, recipe: str, head_dim: int, page_size: int, group_size: int = 1) -> bool:
    return (recipe in RECIPES and head_dim in HEAD_DIMS and page_size in PAGE_SIZES
            and 1 <= group_size <= MAX_GROUP)


def spec(*, recipe: str, head_dim: int, page_size: int, arch: str) -> KernelSpec:
    if not supported(recipe=recipe, head_dim=head_dim, page_size=page_size):
        raise UnknownKernelError(
            f"no sm_90a batch-prefill kernel for recipe={recipe!r}, head_dim={head_dim}, page_size={page_size}: "
            f"built for recipes {list(RECIPES)}, head_dim {list(HEAD_DIMS)}, page_size {list(PAGE_SIZES)}")
    return KernelSpec.make(OP, TEMPLATE, {"recipe": recipe, "head_dim": head_dim, "page_size": page_size}, arch,
                           symbols=(SYMBOL, SMEM_SYMBOL))


def server_specs(*, num_qo_heads: int, num_kv_heads: int, head_dim: int, recipe: str, page_size: int,
                 arch: str) -> list[KernelSpec]:
    group = num_qo_heads // num_kv_heads
    if not supported(recipe=recipe, head_dim=head_dim, page_size=page_size, group_size=group):
        return []   # the prefill wrapper raises at plan for shapes without a kernel
    return [spec(recipe=recipe, head_dim=head_dim, page_size=page_size, arch=arch)]
