"""Append new K/V rows to a layer of the paged cache, quantized to its recipe (fused kernel)."""
from __future__ import annotations

import ctypes
import functools

import torch

from mpfa_jit import get_kernel
from mpfa_jit.ops import append_kv as append_op

from .dispatch import data_ptr as _ptr, device_index, kernel_arch, resolve
from .kv_cache import KVCacheLayer
from .reference.append import reference_append
from .validation import check_tensor, check_vector_rows


@functools.lru_cache(maxsize=None)
def _kernel(recipe: str, head_dim: int, page_size: int, arch: str):
    spec = append_op.spec(recipe=recipe, head_dim=head_dim, page_size=page_size, arch=arch)
    return get_kernel(spec).params_fn(append_op.SYMBOL, append_op.PARAMS_LAYOUT_SYMBOL, append_op.AppendParams)


def append_kv(k: torch.Tensor, v: torch.Tensor, kv: KVCacheLayer, slots: torch.Tensor, *,
              backend: str = "auto") -> str:
    """Write ``k, v`` ``[tokens, num_kv_heads, head_dim]`` (bf16, after RoPE) into ``kv`` at ``slots``.

    Slot ``s`` is token ``s % page_size`` of page ``s // page_size``; a negative slot is skipped
    (padding in captured CUDA graphs). Quantized recipes subtract the layer's mu_K, quantize K per
    token (INT8, or i4rs: half INT8, half INT4 with integer block scales) and V with the layer's fixed
    channel scales (qk4pv4: V H as 4-bit codes with a scale and zero point per 32 channels, mpfa.recipes.u4h).
    Returns the backend that ran ('cuda' or 'reference'). Capturable in a CUDA graph when ``slots`` is int64.

    Slots at or past ``kv.cache.num_slots``: the reference backend raises ValueError before writing
    anything. The CUDA kernel reads slots on the GPU, so it cannot raise without a synchronization on
    every call: it skips those rows (no other row, page or layer is written) and counts them in the
    cache; :meth:`PagedKVCache.check_append_slots` raises for them.

    Non-finite K/V: a K row (token, head) holding NaN or +-inf gets a NaN ``k_scale`` (the key reads
    back as NaN, and attention propagates it); a NaN or infinite V element of an FP8 recipe is stored
    as E4M3 NaN; qk4pv4's 4-bit V (rotated: every channel depends on every input channel) stores NaN
    parameters in every group of such a row, so the whole row reads back as NaN; bf16 fields keep the
    values as given.
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
    slots = (slots if slots.dtype == torch.int64 else slots.long()).contiguous()
    fn = _kernel(kv.recipe.name, kv.head_dim, kv.page_size, kernel_arch(kv.device))
    f = kv.fields
    params = append_op.AppendParams(
        k=k.data_ptr(), v=v.data_ptr(), k_stride_token=k.stride(0), k_stride_head=k.stride(1),
        v_stride_token=v.stride(0), v_stride_head=v.stride(1), slots=slots.data_ptr(), num_tokens=k.shape[0],
        num_slots=kv.cache.num_slots, bad_slots=kv.cache.out_of_range_slots.data_ptr(),
        k_data=f["k"].data_ptr(), k8_data=_ptr(f.get("k8")), k_block_scale=_ptr(f.get("k_block_scale")),
        k_scale=_ptr(f.get("k_scale")), v_data=f["v"].data_ptr(), v_param=_ptr(f.get("v_param")), mu_k=_ptr(kv.mu_k),
        v_scale=_ptr(kv.v_scale),
        num_kv_heads=kv.num_kv_heads)
    fn(ctypes.byref(params), device_index(kv.device), torch.cuda.current_stream(kv.device).cuda_stream)
    return ran
