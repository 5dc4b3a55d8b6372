"""Which implementation runs: the sm_90a kernels, or the PyTorch reference when asked by name.

``backend="auto"`` (the default) means kernels: CUDA tensors on a supported GPU run the JIT-built
kernels, and a missing specialization raises. Nothing falls back to the reference silently: it
runs only with ``backend="reference"`` (on any device).
"""
from __future__ import annotations

import torch

from mpfa_jit import env as jit_env

from .validation import check_choice

BACKENDS = ("auto", "cuda", "reference")


def resolve(backend: str, device: torch.device) -> str:
    """'cuda' or 'reference'; raises ValueError for a device the kernels cannot run on."""
    check_choice("backend", backend, BACKENDS)
    if backend == "reference":
        return "reference"
    if device.type != "cuda":
        raise ValueError(f"tensors are on {device}: mpfa kernels run on CUDA GPUs "
                         f"({', '.join(jit_env.SUPPORTED_ARCHS)}); pass backend='reference' for the PyTorch reference")
    jit_env.target_arch(device)   # raises UnsupportedArchError on a GPU without kernels
    return "cuda"


def kernel_arch(device: torch.device) -> str:
    return jit_env.target_arch(device)
