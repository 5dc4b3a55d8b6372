"""mpfa: mixed-precision FlashAttention kernels (bf16, qk8pv8, qk4pv8) for LLM serving.

    import torch, mpfa
    cache = mpfa.PagedKVCache("qk4pv8", num_layers=32, num_pages=4096, page_size=16, num_kv_heads=8, head_dim=128)
    mpfa.append_kv(k, v, cache.layer(0), slots)                 # bf16 K/V after RoPE -> 4-bit K, FP8 V
    prefill = mpfa.BatchPrefillWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    prefill.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16, recipe="qk4pv8")
    o = prefill.run(q, cache.layer(0))
"""
from .append import append_kv
from .backend import BACKENDS
from .decode import BatchDecodeWrapper
from .kv_cache import HEAD_DIMS, PAGE_SIZES, KVCacheLayer, PagedKVCache
from .prefill import BatchPrefillWrapper
from .recipes import DEFAULT_RECIPE, RECIPES, get_recipe

__version__ = "0.1.0"
__all__ = ["append_kv", "BatchPrefillWrapper", "BatchDecodeWrapper", "PagedKVCache", "KVCacheLayer",
           "RECIPES", "DEFAULT_RECIPE", "get_recipe", "BACKENDS", "HEAD_DIMS", "PAGE_SIZES"]
