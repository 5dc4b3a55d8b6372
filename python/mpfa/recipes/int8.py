"""8-bit integer QK: INT8 Q per tile, INT8 K per token, and ``i4rs`` K (half INT8, half INT4 with
integer block scales): the formats of ``qk8pv8`` (INT8 Q and K) and ``qk4pv8`` (INT8 Q, ``i4rs`` K)
in :mod:`.recipe`.

Every function here is a reference the kernels must reproduce byte for byte. Scales are float32 and
*multiply* the stored integer back (``x ~= q * scale``), as in :mod:`.fp8`. The operations, in the
order a kernel performs them:

* ``scale = amax / target`` (one float32 division; an all-zero group gets scale 1), ``inv = 1 / scale``
  (one correctly rounded reciprocal per scale), ``y = x * inv`` (one float32 multiply per element).
* ``q = rni(y)``: round to nearest, ties to even (``cvt.rni.s32.f32``; ``torch.round``), then clamp
  to ``[-target_int, target_int]``. Since ``|y| <= target * (1 + 2**-22)`` the clamp only guards
  against that last ulp; INT8 values are symmetric (``-128`` is never stored).
* Non-finite input (NaN, inf) has no INT8 encoding: a K row or Q tile holding one gets a NaN scale
  (:func:`.fp8.row_scale`), so everything stored under it dequantizes to NaN; its integer bytes (and
  block scales) are unspecified.

INT8 Q (:func:`quantize_q_per_tile`): one scale per 64 query rows (``Q_TILE``: the rows of one of the
prefill kernel's consumer warpgroups) and head, amax -> 127, on Q after smoothing (Q - mu_Q; the caller
subtracts mu_Q and adds the rank-one compensation mu_Q . K, see :mod:`.smoothing`). The scale multiplies
every score of the tile, so it rides the score FMA. (On SmolLM2 / KJV, 64-row tiles cost less than 128-row
ones: model KL 0.0045 against 0.0049 for qk8pv8 at 2K, benchmarks/NOTES.md.)

INT8 K (:func:`quantize_k_per_token`): one float32 scale per (token, KV head), amax -> 127, on K after
smoothing (K - mu_K). Cache row: ``int8 [D]`` then ``float32`` scale: ``D + 4`` bytes.

``i4rs`` K (:func:`quantize_i4rs`): ONE float32 scale per row, the row amax -> :data:`I4RS_TARGET`
(126 = 7 * 18, the largest value ``b * q`` reaches, so the row's largest element is representable
whichever half it sits in). The low-frequency RoPE half of the channels (:func:`rope_low_channels`)
is stored as INT8 ``rni(y)``; the other half in blocks of ``block`` (16 or 8) channels as INT4
``q in [-7, 7]`` with an integer block scale ``b in 1..18``, so every ``b * q`` is an INT8 value
(``|b * q| <= 126``) and the whole row is one INT8 MMA operand with one per-key scale
(:func:`i4rs_to_int8`). Block scale choice, per block (``y`` the block's scaled values):

    b_up = clamp(ceil(amax(|y|) / 7), 1, 18)                        (a float32 division by 7)
    for b = b_up - 2 .. b_up + 1, within 1 .. 18:                    (:data:`I4RS_WINDOW`)
                      q_b = clamp(rni(y * RCP[b]), -7, 7)            RCP[b] = float32(1 / b)
                      e_b = sum of (y - b * q_b)**2                  float32, order below
    b* = the first b (smallest) with the least e_b

``y - b * q_b`` is exact in float32 (``|y - b q| <= |y|`` whenever ``q != 0``), the squares and the
sum are float32 in a fixed order (:func:`_halving_sum`: each run of 8 channels, one append-kernel
thread's registers, by halving, then the runs' sums; for 16-channel blocks one shuffle between two
threads), so the kernel gets the same b*. ``b*`` always has an error no larger than the rounded-up
scale ``b_up`` (which is a candidate). The window keeps the append kernel's search at 4 candidates
(the full 1..18 search, ``window=None``, ends within 0.5% of its squared error on SmolLM2's keys and
costs 4.5x the arithmetic: benchmarks/NOTES.md, 2026-12-01).

Byte layout of an ``i4rs`` row (one token, one KV head), in this order:

============  ============================  ================================================
field         bytes                         contents
============  ============================  ================================================
``k8``        D/2                           int8 of the low-frequency channels, channel order
``k4``        D/4                           the INT4 half in channel order, two per byte:
                                            element 2i in the low nibble, 2i+1 in the high one;
                                            a nibble is q's 4-bit two's complement (0x8 unused)
``k4_scale``  D/32 (16-ch) or D/16 (8-ch)   uint8 block scales 1..18, block order
``k_scale``   4                             float32 token scale, little-endian
============  ============================  ================================================

The cache pads ``k4_scale`` to a multiple of 4 bytes (``cp.async`` copies 4 bytes or more; head_dim
64 with 16-channel blocks: 2 -> 4), as :class:`.recipe.Field` does for ``D/32``.

Issue 20's study (docs/accuracy.md, "8-bit integer QK") chose 16-channel blocks, the least-squares
block scale and the target 126 for the recipe, and no stored per-key correction.
"""
from __future__ import annotations

import torch

from mpfa_jit.formats import (BLOCK_SCALE_MAX, COMP_DIGIT_LIMIT, COMP_DIGIT_WEIGHTS, COMP_DIGITS, COMP_SCALE_DIVISOR,
                              I4RS_BLOCK, INT4_MAX, INT8_MAX, Q_TILE)

from .fp8 import fdiv, row_scale

I4RS_TARGET = INT4_MAX * BLOCK_SCALE_MAX
I4RS_BLOCKS = (16, 8)                # I4RS_BLOCK is the recipe's; 8 is a study option
I4RS_WINDOW = (2, 1)                 # the recipe's block-scale search: b_up - 2 .. b_up + 1
# float32(1 / b) for b = 0 .. 18 (index 0 unused): the kernel's constant table
RCP = torch.tensor([0.0] + [1.0 / b for b in range(1, BLOCK_SCALE_MAX + 1)], dtype=torch.float32)


def rope_low_channels(head_dim: int) -> torch.Tensor:
    """Boolean mask of the low-frequency RoPE channels (rotate_half layout: channel c pairs with
    c + D/2, and its frequency falls with c mod D/2): c mod D/2 >= D/4. K's large-mean channels and most
    of 4-bit K's error sit there (benchmarks/NOTES.md, "a kernel-friendly RoPE-aware 4-bit K"), so i4rs
    keeps them INT8."""
    c = torch.arange(head_dim)
    return (c % (head_dim // 2)) >= head_dim // 4


def rni(y: torch.Tensor) -> torch.Tensor:
    """Round to nearest integer, ties to even (``cvt.rni``), as float32."""
    return torch.round(y)


def quantize_int(x: torch.Tensor, scale: torch.Tensor | float, qmax: int = INT8_MAX) -> torch.Tensor:
    """``clamp(rni(x * (1 / scale)), -qmax, qmax)`` as int8 (one reciprocal per scale, a multiply per element)."""
    s = scale.float() if isinstance(scale, torch.Tensor) else torch.tensor(float(scale))
    inv = 1.0 / s.to(x.device)
    return rni(x.float() * inv).clamp(-qmax, qmax).to(torch.int8)


def dequantize_int(q: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    return q.float() * scale


def quantize_q_per_tile(x: torch.Tensor, tile_rows: int = Q_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 Q of one head ``[rows, D]`` (already smoothed), one scale per ``tile_rows`` rows (amax -> 127;
    the last tile may be partial). Returns ``(int8 [rows, D], scale float32 [tiles])``."""
    if x.dim() != 2:
        raise ValueError(f"x must be [rows, head_dim] (one head), got shape {tuple(x.shape)}")
    rows = x.shape[0]
    n_tiles = (rows + tile_rows - 1) // tile_rows
    amax = torch.stack([x[i * tile_rows:(i + 1) * tile_rows].float().abs().amax() for i in range(n_tiles)]) \
        if n_tiles else x.new_zeros((0,), dtype=torch.float32)
    scale = row_scale(amax, INT8_MAX)
    per_row = scale.repeat_interleave(tile_rows)[:rows].unsqueeze(-1)
    return quantize_int(x, per_row), scale


def dequantize_q_per_tile(q: torch.Tensor, scale: torch.Tensor, tile_rows: int = Q_TILE) -> torch.Tensor:
    """``q * scale`` per row in the scale's dtype (float64 scales give the exact products)."""
    return q.to(scale.dtype) * scale.repeat_interleave(tile_rows)[: q.shape[0]].unsqueeze(-1)


def quantize_k_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 K: rows ``x[..., D]`` (already smoothed), one scale per row (amax -> 127).
    Returns ``(int8 [..., D], scale float32 [...])``."""
    scale = row_scale(x.float().abs().amax(dim=-1), INT8_MAX)
    return quantize_int(x, scale.unsqueeze(-1)), scale


def dequantize_k_per_token(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float().unsqueeze(-1)


def requantize_k_tile(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One K tile's INT8 operand rows ``q [..., keys, D]`` (INT8 K, or i4rs's INT8 image) under per-key scales
    ``scale [..., keys]`` -> the same keys under the tile's largest scale s_T ``[...]``:
    ``(rni(q * (s_j / s_T)) int8, s_T)`` (what the prefill's pre-pass writes in tile_scale builds, qk4pv8's
    served one; the ratio is <= 1, so no clamp). A NaN scale makes s_T NaN (the tile's bytes are then
    unspecified); an all-zero tile keeps s_T = 0."""
    s = scale.float()
    s_t = s.amax(dim=-1)   # propagates NaN
    ratio = torch.where(s_t.unsqueeze(-1) > 0, s / s_t.unsqueeze(-1), torch.zeros_like(s))
    return rni(q.float() * ratio.unsqueeze(-1)).to(torch.int8), s_t


def tile_scaled_k(q: torch.Tensor, scale: torch.Tensor, tile: int, dtype=torch.float32) -> torch.Tensor:
    """A request's integer K ``q [m, H_kv, D]`` (INT8 MMA operand values) under per-token scales ``scale [m, H_kv]``,
    requantized to one scale per ``tile`` consecutive keys (from the request's first) and head
    (requantize_k_tile), dequantized in ``dtype``: K as a tile_scale prefill build scores it."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for t0 in range(0, q.shape[0], tile):
        q8, s_t = requantize_k_tile(q[t0:t0 + tile].transpose(0, 1), scale[t0:t0 + tile].transpose(0, 1))
        out[t0:t0 + tile] = (q8.to(dtype) * s_t.to(dtype)[:, None, None]).transpose(0, 1)
    return out


# Compensation as one more k-step of the INT8 QK MMA: the digits' format (COMP_DIGITS, COMP_DIGIT_WEIGHTS,
# COMP_DIGIT_LIMIT, COMP_SCALE_DIVISOR) is defined in mpfa_jit.formats, with why the Q scale has its floor.


def comp_digits_q_scale(amax: torch.Tensor, mu_l1: torch.Tensor) -> torch.Tensor:
    """The INT8 Q scale of a head under ``comp_mma``: ``max(amax / 127, 127 * |mu_Q|_1 / COMP_SCALE_DIVISOR)`` in
    float32 (the unit of the terms C_j as well: a head whose smoothed rows are all 0, a one-row request, takes
    the floor, so its terms keep ~19 bits), 1 if both are 0, NaN if amax or |mu_Q|_1 is not finite."""
    amax = amax.float()
    s = torch.where(amax == 0, torch.zeros_like(amax), row_scale(amax, INT8_MAX))
    floor = fdiv(INT8_MAX * mu_l1.float(), COMP_SCALE_DIVISOR)
    sq = torch.maximum(s, floor)
    sq = torch.where(sq == 0, torch.ones_like(sq), sq)
    return torch.where(torch.isnan(s) | ~torch.isfinite(floor), torch.full_like(s, float("nan")), sq)


def compensation_digits(c: torch.Tensor) -> torch.Tensor:
    """Integer terms ``c`` (|c| <= COMP_DIGIT_LIMIT) -> int8 digits ``[..., COMP_DIGITS]`` with
    ``sum(COMP_DIGIT_WEIGHTS * digits) == c``: e_0 = c - 127 hi for hi = floor((c + 63) / 127) (|e_0| <= 63), then
    |hi| as whole 127s in e_1, e_2, ... and the remainder in the next digit, all with hi's sign."""
    c = c.to(torch.int64)
    if bool((c.abs() > COMP_DIGIT_LIMIT).any()):
        raise ValueError(f"compensation terms beyond +-{COMP_DIGIT_LIMIT} have no digits")
    hi = torch.div(c + 63, INT8_MAX, rounding_mode="floor")
    m, sign = hi.abs(), torch.sign(hi)
    k = torch.arange(1, COMP_DIGITS, device=c.device)
    rest = (m.unsqueeze(-1) - INT8_MAX * (k - 1)).clamp(0, INT8_MAX)
    return torch.cat([(c - INT8_MAX * hi).unsqueeze(-1), sign.unsqueeze(-1) * rest], dim=-1).to(torch.int8)


# ---------------------------------------------------------------------------------------------
# i4rs

def _halve(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension (a power of two) as ``x[:n/2] + x[n/2:]``, repeated."""
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def _halving_sum(d2: torch.Tensor) -> torch.Tensor:
    """The fixed float32 order of the block-scale search over a block of n (8 or 16) squared errors:
    each run of 8 consecutive elements (one append-kernel thread's registers) by :func:`_halve`, then
    the runs' sums the same way (two threads of a 16-channel block: one shuffle)."""
    n = d2.shape[-1]
    run = min(8, n)
    return _halve(_halve(d2.reshape(*d2.shape[:-1], n // run, run)))


def choose_block_scales(blocks: torch.Tensor, rule: str = "mse",
                        window: tuple[int, int] | None = I4RS_WINDOW) -> tuple[torch.Tensor, torch.Tensor]:
    """Block scales and INT4 values of scaled blocks ``y [..., n_blocks, block]`` (float32).

    ``rule``: ``mse`` (the format: the smallest b in 1..18 with the least float32 squared error) or
    ``up`` (the rounded-up ``b_up = clamp(ceil(amax / 7), 1, 18)``: no clipping, the comparison baseline).
    ``window=(lo, hi)`` restricts the MSE search to ``b_up - lo .. b_up + hi``: the format's
    :data:`I4RS_WINDOW` ``(2, 1)``, 4 candidates, ends within 0.5% of the full search's squared error on
    SmolLM2's keys, where rounding up alone is 18% above it (benchmarks/NOTES.md 2026-12-01).
    None: all 18 (a study option).
    Returns ``(b uint8 [..., n_blocks], q int8 [..., n_blocks, block])``."""
    y = blocks.float()
    b_up = torch.ceil(y.abs().amax(dim=-1) / INT4_MAX).clamp(1, BLOCK_SCALE_MAX)
    if rule == "up":
        q = rni(y * RCP.to(y.device)[b_up.long()].unsqueeze(-1)).clamp(-INT4_MAX, INT4_MAX)
        return b_up.to(torch.uint8), q.to(torch.int8)
    if rule != "mse":
        raise ValueError(f"rule must be 'mse' or 'up', got {rule!r}")
    best_e = best_b = best_q = None
    for b in range(1, BLOCK_SCALE_MAX + 1):
        q = rni(y * RCP[b]).clamp(-INT4_MAX, INT4_MAX)
        d = y - b * q                                      # exact in float32
        e = _halving_sum(d * d)
        if window is not None:                             # outside the window: never taken
            out = (b < b_up - window[0]) | (b > b_up + window[1])
            e = torch.where(out, torch.full_like(e, float("inf")), e)
        if best_e is None:
            best_e, best_q = e, q
            best_b = torch.ones_like(e, dtype=torch.uint8)
        else:
            take = e < best_e                              # strict: ties keep the smaller b
            best_e = torch.where(take, e, best_e)
            best_b = torch.where(take, torch.full_like(best_b, b), best_b)
            best_q = torch.where(take.unsqueeze(-1), q, best_q)
    return best_b, best_q.to(torch.int8)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """INT4 values ``[..., n]`` (n even, in [-7, 7]) -> bytes ``[..., n/2]``: element 2i low nibble,
    2i+1 high nibble, each q's 4-bit two's complement."""
    nib = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return nib[..., 0::2] | (nib[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = (packed & 0xF).to(torch.int16), (packed >> 4).to(torch.int16)
    nib = torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return ((nib ^ 8) - 8).to(torch.int8)                  # sign-extend the nibble


def quantize_i4rs(x: torch.Tensor, *, block: int = I4RS_BLOCK, target: float = I4RS_TARGET, rule: str = "mse",
                  window: tuple[int, int] | None = I4RS_WINDOW) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``i4rs`` K of rows ``x[..., D]`` (already smoothed; D a multiple of 4 * block).

    ``target``: the value the row amax maps to (126, the format; 127 makes the block scale of a row-max
    block clip it at 126). ``rule``, ``window``: the block-scale search of :func:`choose_block_scales`.
    Returns ``(k8 int8 [..., D/2], k4 uint8 [..., D/4], k4_scale uint8 [..., D/(2*block)],
    k_scale float32 [...])``: the fields of the cache row (module docstring), without padding."""
    d = x.shape[-1]
    if block not in I4RS_BLOCKS:
        raise ValueError(f"block must be one of {I4RS_BLOCKS}, got {block}")
    if d % (4 * block):
        raise ValueError(f"head_dim must be a multiple of {4 * block} for i4rs with {block}-channel blocks, got {d}")
    x = x.float()
    low = rope_low_channels(d).to(x.device)
    k_scale = row_scale(x.abs().amax(dim=-1), target)
    inv = 1.0 / k_scale.unsqueeze(-1)
    y = x * inv
    k8 = rni(y[..., low]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    hi = y[..., ~low]
    b, q = choose_block_scales(hi.reshape(*hi.shape[:-1], hi.shape[-1] // block, block), rule, window)
    return k8, pack_int4(q.reshape(hi.shape)), b, k_scale


def i4rs_to_int8(k8: torch.Tensor, k4: torch.Tensor, k4_scale: torch.Tensor) -> torch.Tensor:
    """The INT8 K row the QK MMA consumes, in channel order: ``k8`` on the low-frequency channels,
    ``b * q`` (an INT8 value by construction) on the others."""
    d = 2 * k8.shape[-1]
    block = d // 2 // k4_scale.shape[-1]
    low = rope_low_channels(d).to(k8.device)
    out = torch.empty(*k8.shape[:-1], d, dtype=torch.int16, device=k8.device)
    out[..., low] = k8.to(torch.int16)
    out[..., ~low] = unpack_int4(k4).to(torch.int16) * k4_scale.to(torch.int16).repeat_interleave(block, dim=-1)
    return out.to(torch.int8)


def dequantize_i4rs(k8: torch.Tensor, k4: torch.Tensor, k4_scale: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    return i4rs_to_int8(k8, k4, k4_scale).float() * k_scale.float().unsqueeze(-1)


def i4rs_row_bytes(k8: torch.Tensor, k4: torch.Tensor, k4_scale: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """The stored bytes of each row, ``uint8 [..., bytes]``, in the order of the module docstring
    (block scales padded with zeros to a multiple of 4 bytes; float32 little-endian)."""
    pad = (-k4_scale.shape[-1]) % 4
    bs = torch.cat([k4_scale, k4_scale.new_zeros(*k4_scale.shape[:-1], pad)], dim=-1) if pad else k4_scale
    ts = k_scale.float().contiguous().unsqueeze(-1).view(torch.uint8)
    return torch.cat([k8.view(torch.uint8), k4, bs, ts], dim=-1)


# ---------------------------------------------------------------------------------------------
# sizes

def k_bytes_per_token_head(k_format: str, head_dim: int) -> int:
    """Bytes of K (values, block scales padded to 4, token scale) per token and KV head.

    ``k_format``: ``int8`` (per token) | ``i4rs`` (16-channel blocks) | ``i4rs8`` (8-channel blocks)."""
    if k_format == "int8":
        return head_dim + 4
    blocks = {"i4rs": 16, "i4rs8": 8}.get(k_format)
    if blocks is None:
        raise ValueError(f"k_format must be 'int8', 'i4rs' or 'i4rs8', got {k_format!r}")
    if head_dim % (4 * blocks):
        raise ValueError(f"head_dim must be a multiple of {4 * blocks} for {k_format}, got {head_dim}")
    n_scales = head_dim // (2 * blocks)
    return head_dim // 2 + head_dim // 4 + n_scales + (-n_scales) % 4 + 4


def bytes_per_token_head(k_format: str, head_dim: int) -> int:
    """K (:func:`k_bytes_per_token_head`) plus FP8 V (``head_dim`` bytes) per token and KV head: the
    cache row of the recipe that pairs this K with today's V."""
    return k_bytes_per_token_head(k_format, head_dim) + head_dim
