"""Which implementation runs: the sm_90a kernels, or the PyTorch reference when asked by name.

``backend="auto"`` (the default) means kernels: CUDA tensors on a supported GPU run the JIT-built
kernels, and a missing specialization raises. Nothing falls back to the reference silently: it
runs only with ``backend="reference"`` (on any device).
"""
from __future__ import annotations

import torch

from mpfa_jit import UnknownKernelError, env as jit_env

from .recipes.u4h import rotate_back
from .validation import check_choice, check_vector_rows

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


def with_reference_hint(spec_fn, **params):
    """``spec_fn(**params)`` (an op's spec, which raises for a specialization mpfa does not build), its error
    naming the reference backend as the way to run such a shape anyway."""
    try:
        return spec_fn(**params)
    except UnknownKernelError as e:
        raise UnknownKernelError(f"{e}; pass backend='reference' for the PyTorch reference") from None


def kernel_arch(device: torch.device) -> str:
    return jit_env.target_arch(device)


def data_ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's device address for a kernel argument; None (a null pointer) for an absent field."""
    return None if t is None else t.data_ptr()


def bind_cache_layer(params, kv) -> None:
    """Point an attention kernel's params struct at a cache layer's fields (the decode and prefill structs name
    them alike; null where the recipe has no such field)."""
    f = kv.fields
    params.k, params.k8, params.k_block_scale = f["k"].data_ptr(), data_ptr(f.get("k8")), data_ptr(f.get("k_block_scale"))
    params.k_scale, params.v, params.v_scale = data_ptr(f.get("k_scale")), f["v"].data_ptr(), data_ptr(kv.v_scale)
    params.v_param = data_ptr(f.get("v_param"))


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def kernel_outputs(q: torch.Tensor, out: torch.Tensor | None, return_lse: bool, kv):
    """(what the kernel writes, lse) for an attention kernel writing rows like ``q``: ``out`` (checked), or a new
    tensor when not given; LSE [rows, heads] float32 only when asked for. A cache whose V is stored rotated (qk4pv4)
    has its kernel write O_rot into a new scratch tensor, which :func:`finish_output` rotates into ``out``."""
    check_vector_rows("q", q)
    if out is not None:
        check_vector_rows("out", out)
    written = out if out is not None and kv.v_rotation is None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
    return written, lse


def finish_output(kernel_out: torch.Tensor, kv, out: torch.Tensor | None) -> torch.Tensor:
    """The wrapper's output from what its kernel wrote: itself, or for a cache whose V is stored rotated (qk4pv4)
    ``O = O_rot H`` into ``out`` (mpfa.recipes.u4h.rotate_back: one bf16 GEMM, no host synchronization)."""
    if kv.v_rotation is None:
        return kernel_out
    return rotate_back(kernel_out, kv.v_rotation, out)
