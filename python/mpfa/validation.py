"""Argument checks shared by the API. Every error names the argument and what is accepted."""
from __future__ import annotations

import math

import torch


def check_choice(name: str, value, accepted) -> None:
    # Of the accepted value's type too: 16.0 == 16 and True == 1, but a float head_dim or page size would reach
    # torch shapes and the kernels' integer fields.
    if not any(type(value) is type(a) and value == a for a in accepted):
        raise ValueError(f"{name} must be one of {list(accepted)}, got {value!r}")


def check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_sm_scale(sm_scale, head_dim: int) -> float:
    """The softmax scale a plan uses: ``1 / sqrt(head_dim)`` for None, else a finite positive number
    (a NaN or inf scale would turn every output row into NaN)."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    try:
        value = None if isinstance(sm_scale, (bool, str, bytes)) else float(sm_scale)
    except (TypeError, ValueError):
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise ValueError(f"sm_scale must be None (1/sqrt(head_dim)) or a finite positive float, got {sm_scale!r}")
    return value


def check_tensor(name: str, t, *, dtypes=None, ndim: int | None = None, shape=None, device=None) -> None:
    """``shape`` may hold None for a free dimension."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None and (len(shape) != t.dim() or any(s is not None and s != d for s, d in zip(shape, t.shape))):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} must be on {torch.device(device)}, got {t.device}")


def check_vector_rows(name: str, t: torch.Tensor) -> None:
    """Kernels load 16-byte vectors along the last dimension: it must be contiguous and aligned."""
    es = t.element_size()
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    if any((s * es) % 16 for s in t.stride()[:-1]) or t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned with strides that are multiples of 16 bytes, "
                         f"got strides {t.stride()} ({t.dtype})")


def check_workspace_tensor(workspace_buffer) -> None:
    check_tensor("workspace_buffer", workspace_buffer, dtypes=(torch.uint8,), ndim=1)
    # The kernels read and write the workspace with 16-byte vectors and bulk copies (cp.async.bulk needs 16-byte
    # aligned global addresses); a fresh torch allocation is 256-byte aligned, a slice at an odd offset is not.
    if workspace_buffer.data_ptr() % 16:
        raise ValueError(f"workspace_buffer must start at a 16-byte aligned address (got one at {workspace_buffer.data_ptr() % 16} "
                         "bytes past it): pass a fresh torch.empty(..., dtype=torch.uint8) or a slice at a multiple of 16")


def check_workspace(workspace_buffer: torch.Tensor, device: torch.device, need: int, plan: str) -> None:
    """The wrapper's workspace must be on the batch's device and hold ``need`` bytes for ``plan``."""
    if workspace_buffer.device != device:
        raise ValueError(f"workspace_buffer must be on {device}, got {workspace_buffer.device}")
    if workspace_buffer.numel() < need:
        raise ValueError(f"workspace_buffer holds {workspace_buffer.numel()} bytes but this plan ({plan}) needs "
                         f"{need} bytes: pass a larger workspace_buffer")
