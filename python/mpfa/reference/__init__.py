"""PyTorch references of every operation (the oracle of the kernels; ``backend="reference"``)."""
from .append import reference_append
from .attention import attention, batch_attention, gather_pages, recipe_attention, request_kv_lengths

__all__ = ["attention", "recipe_attention", "batch_attention", "gather_pages", "request_kv_lengths",
           "reference_append"]
