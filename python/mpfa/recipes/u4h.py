"""qk4pv4's 4-bit V (v_format ``"u4h"``): asymmetric 4-bit codes of the Hadamard-rotated row ``r = V H``, one fp16
scale and one fp16 zero point per 32 channels. This module is the format's definition: the append kernel writes its
bytes exactly, and the attention kernels read the values :func:`decode_values` and :func:`prefill_image` give.

Why rotate: V's channels differ in scale by 10x and more, and a few carry large outliers; ``H`` (the orthonormal
Sylvester-Hadamard matrix, ``H = H^T``, ``H H = I``) spreads every channel over all of them, so each group of 32
rotated channels has about the row's spread and the 4-bit grid is not set by one outlier. Attention is linear in
V, so the kernels multiply the rotated values and the output is rotated back once: ``O = softmax(S) V =
(softmax(S) (V H)) H`` (:func:`rotate_back`).

One (token, KV head) row ``v`` (bf16, ``D`` channels, D = 64 or 128) is stored as, in this order:

1. ``x = float32(v)``; the rotation :func:`rotate`: for ``h = 1, 2, 4, ..., D/2`` and every ``i`` with
   ``i & h == 0``, ``(x[i], x[i+h]) = (x[i] + x[i+h], x[i] - x[i+h])``, each one fp32 rounding; then
   ``r = x * RSQRT_D`` (:func:`rsqrt_d`: float32(1 / sqrt(D)), one fp32 multiply).
2. Per group of 32 channels: ``lo, hi`` = min, max of ``r_g``; ``zero = fp16_rn(lo)``; ``d = fp32(hi - zero)``;
   ``scale = fp16_rn(fp32(d / 15))`` (an IEEE division), replaced by 1 where ``d <= 0`` or the fp16 scale is 0 (an
   all-equal group); codes ``q = clamp(rni(fp32(fp32(r - zero) * inv)), 0, 15)`` with ``inv = fp32(1 / scale)``
   (correctly rounded) and rni round half to even.
3. A faulty group stores ``scale = zero = NaN`` (any payload) and codes 0, so every channel dequantizes to NaN and
   attention propagates the fault, as the other recipes' NaN scales do: a group whose rotated values are not all
   finite (a NaN or inf anywhere in the input row reaches every group: the rotation mixes all channels), or whose
   fp16 zero point or scale overflows, or whose top code's value ``fp32(15 * scale + zero)`` exceeds fp16's 65504
   (rotated values the decode path could not hold). The zero point of a group whose minimum is -0 is +0.

Bytes: ``v`` uint8 ``[D/2]``, channel 2i in the low nibble of byte i and 2i+1 in the high one; ``v_param`` fp16
``[D/16]``, group g's ``[scale_g, zero_g]`` at halves 2g, 2g + 1.

What each attention path reads (still in the rotated space):

* decode (:func:`decode_values`): ``fp16_rn(q * scale + zero)``, the exact product and sum rounded once (one
  half2 FMA of the exact fp16 code);
* prefill (:func:`prefill_image`): the pre-pass's FP8 V image of today's recipes, ``x = fp32(q * scale + zero)``
  (one fmaf), ``e4m3_rn_satfinite(fp32(x * fp32(1 / v_scale)))`` under the pool's fixed per-channel V scale, which
  for this recipe is calibrated on the rotated V.
"""
from __future__ import annotations

import math

import torch

from .fp8 import as_e4m3, fdiv, quantize_e4m3

GROUP = 32             # channels per scale and zero point
CODE_MAX = 15          # codes 0..15
FP16_MAX = 65504.0     # the largest finite fp16 value
HEAD_DIMS = (64, 128)  # the rotation is for powers of two with whole groups; the kernels build these


def rsqrt_d(head_dim: int) -> float:
    """float32(1 / sqrt(head_dim)) as a Python float (exact in the float32 the kernels and the GEMM's alpha use)."""
    _check_head_dim(head_dim)
    return float(torch.tensor(1.0 / math.sqrt(head_dim), dtype=torch.float32))


def _check_head_dim(head_dim) -> None:
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {list(HEAD_DIMS)} for 4-bit Hadamard V (a power of two, whole "
                         f"groups of {GROUP} channels), got {head_dim!r}")


def hadamard_pm1(head_dim: int, *, dtype=torch.float32, device=None) -> torch.Tensor:
    """The unnormalized Sylvester-Hadamard matrix ``[D, D]`` of +-1 (``H[i, j] = (-1)^popcount(i & j)``), exact in
    any float dtype (bf16 included: the matrix the output rotation multiplies)."""
    _check_head_dim(head_dim)
    i = torch.arange(head_dim)
    parity = torch.zeros(head_dim, head_dim, dtype=torch.int64)
    both = i.unsqueeze(1) & i.unsqueeze(0)
    while bool(both.any()):
        parity ^= both & 1
        both = both >> 1
    return (1 - 2 * parity).to(dtype=dtype, device=device)


def hadamard(head_dim: int, *, dtype=torch.float64, device=None) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix ``H = hadamard_pm1 / sqrt(D)`` (symmetric, ``H H = I``), rounded
    once to ``dtype`` (float64 by default: the references rotate back in float64)."""
    return (hadamard_pm1(head_dim, dtype=torch.float64) / math.sqrt(head_dim)).to(dtype=dtype, device=device)


def rotate(v: torch.Tensor) -> torch.Tensor:
    """``r = V H`` of rows ``v [..., D]`` in float32, in the append kernel's exact order (module docstring, step 1):
    the butterfly over h = 1, 2, ..., D/2, each sum and difference one fp32 rounding, then one fp32 multiply by
    :func:`rsqrt_d`. Bit-reproducible on any device (elementwise float32 operations only)."""
    d = v.shape[-1]
    scale = torch.tensor(rsqrt_d(d), dtype=torch.float32, device=v.device)
    x = v.float()
    lead = x.shape[:-1]
    h = 1
    while h < d:
        pairs = x.reshape(*lead, d // (2 * h), 2, h)       # [..., block, (i, i + h), j]: i = block * 2h + j
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, d)
        h *= 2
    return x * scale


def fp16_rn(x: torch.Tensor) -> torch.Tensor:
    """float64 ``x`` rounded once to the nearest fp16 (ties to even). PyTorch converts float64 to fp16 through
    float32, which can round twice (1 + 2^-11 + 2^-40 becomes 1, not 1 + 2^-10); rounding to float32 toward odd
    first keeps the second rounding correct (24 bits > 11 + 2)."""
    y = x.to(torch.float32)
    inexact = y.to(torch.float64) != x
    even = (y.view(torch.int32) & 1) == 0
    toward = torch.where(x > y.to(torch.float64), torch.full_like(y, math.inf), torch.full_like(y, -math.inf))
    y = torch.where(inexact & even & torch.isfinite(y), torch.nextafter(y, toward), y)
    return y.to(torch.float16)


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., D]`` (0..15) -> bytes ``[..., D/2]``: channel 2i in the low nibble, 2i + 1 in the high one."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., D/2]`` -> codes ``[..., D]`` uint8 (:func:`pack_codes` undone)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def split_param(v_param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``v_param [..., D/16]`` fp16 -> (scale, zero) ``[..., D/32]`` fp16 each."""
    pairs = v_param.reshape(*v_param.shape[:-1], v_param.shape[-1] // 2, 2)
    return pairs[..., 0], pairs[..., 1]


def quantize_u4h(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``v [..., D]`` (bf16, as appended) -> (``codes`` uint8 ``[..., D/2]``, ``v_param`` fp16 ``[..., D/16]``):
    the cache fields ``v`` and ``v_param`` byte for byte (module docstring), NaN parameters bit-agnostic."""
    d = v.shape[-1]
    _check_head_dim(d)
    r = rotate(v)
    g = r.reshape(*r.shape[:-1], d // GROUP, GROUP)
    finite = torch.isfinite(g).all(dim=-1)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    zero = (lo + 0.0).to(torch.float16)   # -0 + 0 = +0: a zero point of either sign is stored +0; then one rounding
    span = hi - zero.float()                                      # one fp32 rounding
    scale = fdiv(span, 15.0).to(torch.float16)                    # IEEE division, then one rounding to fp16
    scale = torch.where((span <= 0) | (scale == 0), torch.ones_like(scale), scale)
    # the top code's value, fmaf(15, scale, zero) (the product is exact in float32): past fp16's largest finite value,
    # decode's fp16 dequantization would overflow where prefill's fp32 one does not
    top = scale.float() * CODE_MAX + zero.float()
    faulty = ~finite | ~torch.isfinite(zero) | ~torch.isfinite(scale) | (top > FP16_MAX)
    inv = fdiv(torch.ones_like(span), scale.float())              # rcp.rn
    y = (g - zero.float().unsqueeze(-1)) * inv.unsqueeze(-1)      # two fp32 roundings
    q = torch.round(torch.where(torch.isnan(y), torch.zeros_like(y), y)).clamp(0, CODE_MAX)
    q = torch.where(faulty.unsqueeze(-1), torch.zeros_like(q), q).to(torch.uint8)
    nan = torch.full_like(scale, math.nan)
    scale, zero = torch.where(faulty, nan, scale), torch.where(faulty, nan, zero)
    v_param = torch.stack((scale, zero), dim=-1).reshape(*r.shape[:-1], d // 16)
    return pack_codes(q.reshape(r.shape)), v_param


def _exact_values(packed: torch.Tensor, v_param: torch.Tensor) -> torch.Tensor:
    """``q * scale + zero`` in float64 ``[..., D]``, exact (a 4-bit code times an fp16 scale plus an fp16 zero spans
    fewer than 53 bits); NaN in a faulty group's channels."""
    q = unpack_codes(packed).to(torch.float64)
    scale, zero = split_param(v_param)
    per_channel = lambda t: t.to(torch.float64).repeat_interleave(GROUP, dim=-1)   # noqa: E731
    return q * per_channel(scale) + per_channel(zero)


def decode_values(packed: torch.Tensor, v_param: torch.Tensor) -> torch.Tensor:
    """The rotated V the decode kernel multiplies, fp16 ``[..., D]``: ``fp16_rn(q * scale + zero)`` (one rounding)."""
    return fp16_rn(_exact_values(packed, v_param))


def prefill_image(packed: torch.Tensor, v_param: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """The prefill pre-pass's FP8 V image of the rotated V, E4M3 bytes as uint8 ``[..., D]``: ``x = fp32(q * scale +
    zero)`` (one fmaf), ``e4m3_rn_satfinite(x * fp32(1 / v_scale))``; ``v_scale`` (float32, broadcast against the
    rows' ``[..., D]``: the pool's per-(KV head, channel) scale) multiplies it back in the kernel's epilogue."""
    x = _exact_values(packed, v_param).to(torch.float32)
    return quantize_e4m3(x, v_scale).view(torch.uint8)


def prefill_values(packed: torch.Tensor, v_param: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """:func:`prefill_image` times ``v_scale``, float64 (exact): the rotated V the prefill kernel's output holds."""
    return as_e4m3(prefill_image(packed, v_param, v_scale)).to(torch.float64) * v_scale.to(torch.float64)


def rotate_back(o_rot: torch.Tensor, h_pm1: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The output rotation of the wrappers, ``O = O_rot H``: ``o_rot [..., D]`` bf16 (the kernel's output, in the
    rotated space) times ``h_pm1`` (:func:`hadamard_pm1` in bf16, on o_rot's device) as ONE bf16 GEMM with fp32
    accumulation, ``alpha = RSQRT_D`` applied to the fp32 sum and one rounding to bf16 (torch.addmm, beta 0).
    Writes into ``out`` (same shape; allocated when None) and returns it. No host synchronization: capturable in a
    CUDA graph."""
    d = o_rot.shape[-1]
    rows = o_rot.reshape(-1, d)
    alpha = rsqrt_d(d)
    if out is not None and out.is_contiguous():
        dst = out.view(-1, d)
        torch.addmm(dst, rows, h_pm1, beta=0, alpha=alpha, out=dst)
        return out
    dst = torch.empty_like(rows)
    torch.addmm(dst, rows, h_pm1, beta=0, alpha=alpha, out=dst)
    if out is None:
        return dst.view(o_rot.shape)
    out.copy_(dst.view(out.shape))   # a strided ``out`` (rows apart in memory) takes a copy
    return out
