"""Append new K/V rows to a layer of the paged cache, quantized to its recipe (fused kernel)."""
from __future__ import annotations

import functools

import torch

from mpfa_jit import get_kernel
from mpfa_jit.ops import append_kv as append_op

from .backend import data_ptr as _ptr, device_index, kernel_arch, resolve
from .kv_cache import KVCacheLayer
from .reference.append import reference_append
from .validation import check_tensor, check_vector_rows


@functools.lru_cache(maxsize=None)
def _kernel(recipe: str, head_dim: int, page_size: int, arch: str):
    spec = append_op.spec(recipe=recipe, head_dim=head_dim, page_size=page_size, arch=arch)
    return get_kernel(spec).fn(append_op.SYMBOL, append_op.ARGTYPES)


def append_kv(k: torch.Tensor, v: torch.Tensor, kv: KVCacheLayer, slots: torch.Tensor, *,
              backend: str = "auto") -> str:
    """Write ``k, v`` ``[tokens, num_kv_heads, head_dim]`` (bf16, after RoPE) into ``kv`` at ``slots``.

    Slot ``s`` is token ``s % page_size`` of page ``s // page_size``; a negative slot is skipped
    (padding in captured CUDA graphs). Quantized recipes subtract the layer's mu_K, quantize K per
    token (FP8, or 4-bit with block scales) and V with the layer's fixed channel scales. Returns the
    backend that ran ('cuda' or 'reference'). Capturable in a CUDA graph when ``slots`` is int64.
    """
    if not isinstance(kv, KVCacheLayer):
        raise ValueError(f"kv must be a KVCacheLayer (PagedKVCache.layer(i)), got {type(kv).__name__}")
    shape = (None, kv.num_kv_heads, kv.head_dim)
    check_tensor("k", k, dtypes=(torch.bfloat16,), ndim=3, shape=shape, device=kv.device)
    check_tensor("v", v, dtypes=(torch.bfloat16,), shape=tuple(k.shape), device=kv.device)
    check_tensor("slots", slots, dtypes=(torch.int32, torch.int64), shape=(k.shape[0],), device=kv.device)
    ran = resolve(backend, kv.device)
    if ran == "reference":
        reference_append(k, v, kv, slots)
        return ran
    check_vector_rows("k", k)
    check_vector_rows("v", v)
    slots = slots if slots.dtype == torch.int64 else slots.long()
    fn = _kernel(kv.recipe.name, kv.head_dim, kv.page_size, kernel_arch(kv.device))
    f = kv.fields
    fn(k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), v.stride(0), v.stride(1), slots.contiguous().data_ptr(),
       k.shape[0], kv.num_kv_heads, f["k"].data_ptr(), _ptr(f.get("k8")), _ptr(f.get("k_block_scale")),
       _ptr(f.get("k_scale")),
       f["v"].data_ptr(), _ptr(kv.mu_k), _ptr(kv.v_scale), device_index(kv.device),
       torch.cuda.current_stream(kv.device).cuda_stream)
    return ran
