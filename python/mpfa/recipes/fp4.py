"""4-bit K: E2M1 values, one E4M3 block scale per 16 channels, one FP32 scale per token.

``qk4pv8`` stores half of each K row this way and the low-frequency RoPE half in E4M3 under the same
token scale (:func:`quantize_k4rs`); :func:`quantize_k4` is the all-4-bit row, kept for the studies.

A key row ``x`` (one token, one KV head, ``head_dim`` channels, already smoothed) is stored as

    x[d] ~= token_scale * block_scale[d // 16] * e2m1[d]

This is NVFP4's layout (E2M1 values, E4M3 scales per 16 elements, an FP32 scale above them) with
two choices made for Hopper, which has no FP4 MMA:

* Block scales are restricted to ``2**e`` and ``1.5 * 2**e``. Then every product
  ``block_scale * e2m1`` is exactly representable in E4M3, so the kernel turns 4-bit K into FP8 K
  without rounding and runs the QK product on the FP8 tensor cores (enumerated in
  :func:`exact_products`; scales with two or three mantissa bits round 30 of 280 and 154 of 560).
* The FP32 scale is per token rather than per tensor: it maps each token's largest block scale to
  64, so every block keeps the whole E4M3 range (a fixed per-tensor scale would have to cover the
  largest token ever appended). It multiplies one column of the scores, after the MMA, in the
  same FMA that applies the softmax scale.

Packing: byte ``i`` of a row holds element ``2i`` in its low nibble and ``2i + 1`` in its high one.
A nibble is ``sign << 3 | magnitude code``, codes 0..7 meaning 0, 0.5, 1, 1.5, 2, 3, 4, 6.
Rounding is to nearest, ties to the even code, saturating at 6. Every function here is the
reference the append kernel must match byte for byte.
"""
from __future__ import annotations

import torch

from .fp8 import E4M3_DTYPE, amax_scale, quantize_e4m3, row_scale
from .int8 import rope_low_channels

BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
# Block scales allowed: 2**e for e in [-8, 6] and 1.5 * 2**e for e in [-7, 5]. Below these the
# products 0.5*s or 0.75*s fall off E4M3's subnormal grid (multiples of 2**-9); above, 6*s > 448.
BLOCK_SCALE_MIN_EXP = -8
BLOCK_SCALE_MAX = 64.0
# The token scale maps the token's largest block to block scale 64: its amax to 6 * 64.
TOKEN_TARGET = E2M1_MAX * BLOCK_SCALE_MAX
# Upper rounding boundaries between consecutive codes (value > bound moves up a code). Ties go to
# the even code, so a tie at an odd code's lower bound stays below and at its upper bound goes up.
_UPPER = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def allowed_block_scales() -> list[float]:
    """Every block scale the format may store, ascending."""
    out = [2.0 ** BLOCK_SCALE_MIN_EXP]
    e = BLOCK_SCALE_MIN_EXP + 1
    while 2.0 ** e <= BLOCK_SCALE_MAX:
        out.append(2.0 ** e)
        if 1.5 * 2.0 ** e < BLOCK_SCALE_MAX:
            out.append(1.5 * 2.0 ** e)
        e += 1
    return sorted(out)


def round_up_block_scale(need: torch.Tensor) -> torch.Tensor:
    """The smallest allowed block scale >= ``need`` (clamped to the allowed range), in float32.

    ``need = f * 2**e`` with ``f`` in [1, 2): ``f == 1`` keeps ``2**e``, ``f <= 1.5`` gives
    ``1.5 * 2**e``, else ``2**(e+1)``. The kernel does the same comparisons on the same floats.
    """
    need = need.float()
    mant, exp = torch.frexp(need)            # need = mant * 2**exp, mant in [0.5, 1)
    f = mant * 2.0                           # in [1, 2), exponent exp - 1
    p = torch.ldexp(torch.ones_like(need), exp - 1)   # exact powers of two
    s = torch.where(f == 1.0, p, torch.where(f <= 1.5, 1.5 * p, 2.0 * p))
    lo = 2.0 ** BLOCK_SCALE_MIN_EXP
    s = torch.where(need <= lo, torch.full_like(s, lo), s)
    # 1.5 * 2**-8 is not allowed (its 0.5x product is off the E4M3 grid): the next scale is 2**-7.
    s = torch.where(s == 1.5 * lo, torch.full_like(s, 2 * lo), s)
    return s.clamp(max=BLOCK_SCALE_MAX)


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """Nibble codes (sign << 3 | magnitude) of ``y`` rounded to E2M1, ties to even, saturating."""
    a = y.abs()
    mag = torch.zeros_like(a, dtype=torch.uint8)
    for code, bound in enumerate(_UPPER, start=1):
        odd_below = (code - 1) % 2 == 1      # the lower code is odd: a tie moves up to even `code`
        up = (a >= bound) if odd_below else (a > bound)
        mag = torch.where(up, torch.full_like(mag, code), mag)
    sign = (y < 0).to(torch.uint8) << 3
    return mag | sign


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def quantize_k4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize rows ``x[..., D]`` (D a multiple of 16) to the 4-bit K format.

    Returns ``(packed uint8 [..., D/2], block_scale uint8 E4M3 bytes [..., D/16],
    token_scale float32 [...])``.
    """
    d = x.shape[-1]
    if d % BLOCK:
        raise ValueError(f"head_dim must be a multiple of {BLOCK} for 4-bit K, got {d}")
    x = x.float()
    token_scale = amax_scale(x.abs().amax(dim=-1), TOKEN_TARGET)
    packed, block_scale = _quantize_blocks(x, token_scale.unsqueeze(-1))
    return packed, block_scale, token_scale


def quantize_k4rs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """qk4pv8's K: rows ``x[..., D]`` (D a multiple of 64) with ONE FP32 scale per row (:func:`quantize_k4`'s:
    the row amax maps to 6 * 64), the low-frequency half of the channels (:func:`rope_low_channels`, in
    channel order) as E4M3 of ``x / token_scale``, the other half as :func:`quantize_k4`'s 4-bit blocks of 16
    under the same token scale. Every stored value (times its block scale) is then an E4M3 number, so a K
    row is one E4M3 MMA operand with one scale per key.

    A row holding NaN or inf gets a NaN token scale (:func:`row_scale`; its E4M3 bytes are then E4M3 NaN,
    its 4-bit codes and block scales unspecified: the kernel's need not match them).

    Returns ``(k8 uint8 E4M3 [..., D/2], packed uint8 [..., D/4], block_scale uint8 E4M3 [..., D/32],
    token_scale float32 [...])``.
    """
    d = x.shape[-1]
    if d % (4 * BLOCK):
        raise ValueError(f"head_dim must be a multiple of {4 * BLOCK} for qk4pv8's K, got {d}")
    x = x.float()
    low = rope_low_channels(d).to(x.device)
    token_scale = row_scale(x.abs().amax(dim=-1), TOKEN_TARGET)
    ts = token_scale.unsqueeze(-1)
    k8 = quantize_e4m3(x[..., low], ts).view(torch.uint8)
    packed, block_scale = _quantize_blocks(x[..., ~low], ts)
    return k8, packed, block_scale, token_scale


def _quantize_blocks(x: torch.Tensor, ts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 codes of ``x[..., n]`` in blocks of 16 under token scale ``ts [..., 1]``: (packed, block scales)."""
    n = x.shape[-1]
    blocks = x.reshape(*x.shape[:-1], n // BLOCK, BLOCK)
    need = blocks.abs().amax(dim=-1) * (1.0 / (ts * E2M1_MAX))   # the kernel's operations
    bs = round_up_block_scale(need)
    inv = 1.0 / (ts * bs)                                     # one reciprocal per block, as in the kernel
    codes = e2m1_codes(blocks * inv.unsqueeze(-1)).reshape(*x.shape[:-1], n)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), bs.to(E4M3_DTYPE).view(torch.uint8)


def k4rs_to_e4m3(k8: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """The FP8 K row the QK MMA consumes, in channel order: the stored E4M3 bytes on the low-frequency
    channels, ``block_scale * e2m1`` (exact) on the others."""
    d = 2 * k8.shape[-1]
    low = rope_low_channels(d).to(k8.device)
    out = torch.empty(*k8.shape[:-1], d, dtype=torch.float32, device=k8.device)
    out[..., low] = k8.view(E4M3_DTYPE).float()
    out[..., ~low] = e2m1_values(unpack_codes(packed)) * block_scale_values(block_scale).repeat_interleave(BLOCK, dim=-1)
    return out.to(E4M3_DTYPE)


def dequantize_k4rs(k8: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor,
                    token_scale: torch.Tensor) -> torch.Tensor:
    return k4rs_to_e4m3(k8, packed, block_scale).float() * token_scale.float().unsqueeze(-1)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def block_scale_values(block_scale: torch.Tensor) -> torch.Tensor:
    return block_scale.view(E4M3_DTYPE).float()


def k4_to_e4m3(packed: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """The FP8 K the QK MMA consumes: ``block_scale * e2m1`` per element, exact by construction."""
    vals = e2m1_values(unpack_codes(packed))
    bs = block_scale_values(block_scale).repeat_interleave(BLOCK, dim=-1)
    return (vals * bs).to(E4M3_DTYPE)


def dequantize_k4(packed: torch.Tensor, block_scale: torch.Tensor, token_scale: torch.Tensor) -> torch.Tensor:
    vals = e2m1_values(unpack_codes(packed))
    bs = block_scale_values(block_scale).repeat_interleave(BLOCK, dim=-1)
    return vals * bs * token_scale.float().unsqueeze(-1)


def exact_products(mantissa_bits: int, exponents: range = range(-6, 4)) -> tuple[int, int]:
    """Count (rounded, total) products ``scale * e2m1`` (nonzero E2M1 values) that E4M3 cannot hold
    exactly, over block scales ``(1 + m / 2**mantissa_bits) * 2**e`` for ``e`` in ``exponents``:
    the check behind the restriction (1 bit: 0 of 140; 2 bits: 30 of 280; 3 bits: 154 of 560)."""
    scales = [(1 + m / 2 ** mantissa_bits) * 2.0 ** e for e in exponents for m in range(2 ** mantissa_bits)]
    prods = torch.tensor([s * v for s in scales for v in E2M1_VALUES[1:]], dtype=torch.float64)
    rounded = (prods.to(E4M3_DTYPE).double() != prods).sum().item()
    return int(rounded), len(prods)
