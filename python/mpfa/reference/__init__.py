"""PyTorch references of every operation (the oracle of the kernels; ``backend="reference"``)."""
from .append import reference_append
from .attention import attention, batch_attention, gather_pages, recipe_attention, request_kv_lengths
from .prefill_kernel import KernelModel, batch_prefill_kernel_attention, kernel_q_mean, prefill_kernel_attention

__all__ = ["attention", "recipe_attention", "batch_attention", "gather_pages", "request_kv_lengths",
           "reference_append", "KernelModel", "prefill_kernel_attention", "batch_prefill_kernel_attention",
           "kernel_q_mean"]
