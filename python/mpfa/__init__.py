"""mpfa: mixed-precision FlashAttention kernels (bf16, qk8pv8, qk4pv8, qk4pv4) for LLM serving.

A :class:`PagedKVCache` holds every layer's pages in a recipe's format; ``calibrate`` fixes a layer's
K mean and V channel scales from its first K/V, :func:`append_kv` quantizes K/V rows into slots, and
:class:`BatchPrefillWrapper` / :class:`BatchDecodeWrapper` ``plan`` a ragged batch once and ``run`` it
on every layer. Kernels run on sm_90a GPUs; ``backend="reference"`` runs the PyTorch reference on any
device. README.md's "The API in ten lines" is a complete program (run by tests/cpu/test_readme.py).
"""
from .append import append_kv
from .dispatch import BACKENDS
from .decode import BatchDecodeWrapper
from .kv_cache import HEAD_DIMS, PAGE_SIZES, KVCacheLayer, PagedKVCache
from .prefill import BatchPrefillWrapper
from .recipes import DEFAULT_RECIPE, RECIPES, get_recipe

__version__ = "0.1.0"
__all__ = ["append_kv", "BatchPrefillWrapper", "BatchDecodeWrapper", "PagedKVCache", "KVCacheLayer",
           "RECIPES", "DEFAULT_RECIPE", "get_recipe", "BACKENDS", "HEAD_DIMS", "PAGE_SIZES"]
