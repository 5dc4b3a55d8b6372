"""Which extend batch fixes a layer's scales in the KV pool. SGLang-free, so it is tested without SGLang.

A quantized recipe fixes each layer's mu_K and V channel scales from the first extend batch the pool sees
and keeps them for the server's life, so cached prefix pages stay valid. Not every extend forward is a
request: SGLang also runs the model on zero-filled buffers while it captures its prefill CUDA graph (the
breakable graph runs attention eagerly between captured segments, outside stream capture, so the capture
test alone does not see it) and in kernel warmups. Those batches write K/V only to the padding slot (slot 0,
which SGLang's allocator never gives to a request), so the pool waits for a batch that writes a real slot.
"""
from __future__ import annotations

import torch

PADDING_SLOT = 0   # SGLang's reserved KV slot: padded and dummy tokens write here, requests never do


def fixes_scales(loc: torch.Tensor, *, capturing: bool) -> bool:
    """Whether an extend batch that writes K/V at slots ``loc`` may fix a layer's scales: not while a CUDA
    stream is being captured, and only if some slot is not the padding slot. It reads ``loc``, which costs
    one sync, and only until the layer is calibrated."""
    if capturing or loc.numel() == 0:
        return False
    return bool((loc != PADDING_SLOT).any())
