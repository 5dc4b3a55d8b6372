"""FP8 E4M3 quantization: the 8-bit format of Q, V (every quantized recipe) and K (``qk8pv8``).

Every function here is a reference: the CUDA kernels must produce the same bytes. Scales are
float32 and *multiply* the stored value back: ``x ~= dequantize_e4m3(q, scale) = q * scale``.
"""
from __future__ import annotations

import torch

from mpfa_jit.formats import E4M3_MAX, P_SCALE, P_SCALE_POW2   # P's scales: why each, in mpfa_jit.formats

E4M3_DTYPE = torch.float8_e4m3fn


def quantize_e4m3(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``x * (1 / scale)`` rounded to nearest-even E4M3 and saturated to +-448 (no NaN from overflow).

    One correctly rounded reciprocal per scale and a multiply per element: the kernels do exactly
    this (a division per element would make the append kernel compute-bound)."""
    return _scaled(x, scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3_DTYPE)


def quantize_e4m3_fixed_scale(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """:func:`quantize_e4m3` for values under a fixed scale (V's channel scales): a NaN or infinite
    element of ``x`` is stored as E4M3 NaN, where saturating an infinity to +-448 would store a fault
    as a plausible value. Finite values saturate as in :func:`quantize_e4m3`, overflow included."""
    y = _scaled(x, scale).clamp(-E4M3_MAX, E4M3_MAX)
    return torch.where(torch.isfinite(x), y, torch.full_like(y, float("nan"))).to(E4M3_DTYPE)


def _scaled(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    inv = 1.0 / (scale.float() if isinstance(scale, torch.Tensor) else torch.tensor(float(scale)))
    return x.float() * inv.to(x.device)


def dequantize_e4m3(q: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    return as_e4m3(q).float() * scale


def as_e4m3(q: torch.Tensor) -> torch.Tensor:
    """View raw uint8 storage as E4M3 (caches keep FP8 as bytes so any torch can index them)."""
    return q.view(E4M3_DTYPE) if q.dtype == torch.uint8 else q


def fdiv(a: torch.Tensor, b) -> torch.Tensor:
    """``a / b`` in float32 as the kernels divide (IEEE, correctly rounded) on any device: the quotient in float64,
    then one rounding to float32 (innocuous for a quotient of float32 values: 53 >= 2 * 24 + 2). Not ``a / b`` with
    a Python number ``b``: on CUDA PyTorch computes that as ``a * fl(1 / b)``, an ulp off for ~5% of quotients."""
    b64 = torch.as_tensor(b, device=a.device).to(torch.float64)
    return (a.to(torch.float64) / b64).to(torch.float32)


def amax_scale(amax: torch.Tensor, target: float = E4M3_MAX) -> torch.Tensor:
    """The scale that maps ``amax`` to ``target``; an all-zero group gets scale 1 so 0/scale stays 0."""
    amax = amax.float()
    return torch.where(amax > 0, fdiv(amax, target), torch.ones_like(amax))


def row_scale(amax: torch.Tensor, target: float = E4M3_MAX) -> torch.Tensor:
    """:func:`amax_scale` of K rows, NaN where a row holds a NaN or an infinity (its amax is then NaN or
    inf): every value stored under that scale dequantizes to NaN, so attention propagates the fault
    instead of reading a finite key."""
    amax = amax.float()
    return torch.where(torch.isfinite(amax), amax_scale(amax, target), torch.full_like(amax, float("nan")))


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups the last dimension: one scale per row (per token and head), max maps to 448.

    Used for K in ``qk8pv8``: a per-key scale multiplies one column of S = Q K^T, so it is applied
    after the MMA in the same FMA that scales the scores. A row holding NaN or inf gets a NaN scale
    (:func:`row_scale`).
    """
    scale = row_scale(x.float().abs().amax(dim=-1))
    return quantize_e4m3(x, scale.unsqueeze(-1)), scale


def quantize_per_tile(x: torch.Tensor, tile_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups ``tile_rows`` consecutive rows of a ``[rows, D]`` matrix: one scale per tile.

    Used for Q in prefill (one scale per query tile and head: it multiplies every score of the
    tile, so it rides the score FMA). The last tile may be partial.
    """
    rows = x.shape[0]
    n_tiles = (rows + tile_rows - 1) // tile_rows
    amax = torch.stack([x[i * tile_rows:(i + 1) * tile_rows].float().abs().amax() for i in range(n_tiles)]) \
        if n_tiles else x.new_zeros((0,), dtype=torch.float32)
    scale = amax_scale(amax)
    per_row = scale.repeat_interleave(tile_rows)[:rows].unsqueeze(-1)
    return quantize_e4m3(x, per_row), scale
