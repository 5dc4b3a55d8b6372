"""A model of the batch-prefill kernel's own arithmetic (templates/prefill.cu.jinja and
templates/include/mpfa/prefill/): what the kernel computes, rounding for rounding where it rounds, so that
the GPU tests can hold the kernel to a bound derived from accumulation order alone
(tests/gpu/test_prefill_gpu.py). :func:`mpfa.reference.recipe_attention` models the recipe (what
quantizing Q and P costs); this models the build, which differs from it in three ways the recipe's error
would otherwise hide:

* P's rounding points: the kernel's online softmax rounds P = 2^(s - m_t) to E4M3 (bf16: to bf16) with
  m_t the running maximum over the 128-key tiles it has seen so far (tiles of the request's keys from its
  first, in ascending order: mainloop.cuh), and rescales earlier tiles' sums by 2^(m_t - m_t') as the
  maximum grows; recipe_attention rounds exp(s - m) with the row's final maximum.
* the scores' float32 arithmetic (softmax.cuh, log2 units): per-key builds take
  s = fma(kRoundMagic + S, a_j, fma(-kRoundMagic, a_j, fb_j)) with a_j = fa_j * sq, whose inner FMA rounds
  to the ulp of kRoundMagic * a_j (one integer unit of S times a_j: up to ~4% of a key's weight at the tests'
  scales); tile_scale builds without fb take the maxima on the integer scores and round
  c = (m_tile - m_ref + log2 p_scale) - kRoundMagic * a once per (row, tile); comp_mma builds round each
  key's compensation term to whole units of the QK product, C_j = rni((mu_Q . Kint_j) / sq).
* mu_Q's float32 order (prepass_q_mean.cuh): 128-row blocks summed in row order, the blocks' sums in
  order, then / n; comp_mma's |mu_Q|_1: a warp butterfly per 32 channels, then the warps in order.
  With mu_Q bit-equal, INT8 Q is byte-equal (mpfa.recipes.int8 is the kernel's quantizer).
* the kernel's fp32 divisions (mu_Q = t / n, the Q scale amax / 127, comp_mma's floor 127 |mu_Q|_1 / divisor, the
  terms dot / sq) are IEEE divisions, correctly rounded: :func:`mpfa.recipes.fp8.fdiv` does them so on any device. (PyTorch on CUDA
  divides by a Python number as a * fl(1 / b), off by an ulp for ~5% of quotients; a Q scale an ulp off moves every
  per-key score of its 64-row tile by a multiple of the ulp of kRoundMagic * a (the offset fma(-kRoundMagic, a, fb)
  rounds to it: 2^-8 .. 2^-5 in log2 units at the tests' scales), which left the outputs alone but moved whole
  tiles' LSE by 1-6 x ln2 / 64 on the H200.)

qk4pv4 (V stored as 4-bit codes of V H, mpfa.recipes.u4h): the kernel multiplies the pre-pass's FP8 image of the
rotated values (``u4h.prefill_image``) exactly as it multiplies the e4m3 recipes' V, and writes O_rot = P V_rot; the
wrapper rotates it back, O = bf16(O_rot) H (one bf16 GEMM with fp32 accumulation, mpfa.recipes.u4h.rotate_back).
The model computes ``o_rot`` as above and ``o = o_rot H`` in float64; the scales of the PV error (o_abs, o_abs_rest,
flip_max) stay in the rotated space where the kernel accumulates (H is orthonormal: norms carry over).

P itself is the kernel's: on a CUDA device the model takes P = 2^x with the kernel's own instruction
(ex2.approx.ftz.f32, through Triton: :func:`hardware_exp2`), so P bytes round as the kernel's do. Elsewhere (CPU,
or no Triton) exp2 is exact, within 2 ulp (2^-22 relative) of the kernel's, and a P byte then flips where P lies
that close to an E4M3 rounding point.

The FP8 recipes' P V sums, given ``v_scale`` (:func:`tensor_core_pv`): the FP8 MMA (wgmma, 32 keys a k-step) adds
each k-step's 32 products to its accumulator after aligning all of them and the accumulator to the largest one's
exponent e and dropping, toward zero, what lies below 2^(e - 13) (the rule the H200 showed:
benchmarks/results/studies/fp8_accumulation_h200.json, one product 2^13 above 31 others keeps them all, 2^14 loses
them all, at k = 32, 64 and 128 and either sign); the kernel folds each 128-key tile's sum into float32 O.
Without ``v_scale`` the sums are exact.

What it does not reproduce, and so what a comparison with the kernel must allow for (the test's bound):
the running-maximum corrections' exp2 (exact here; they scale sums and round nothing to E4M3); P V within a tile
(exact without ``v_scale``; with it, whatever of the FP8 MMA the rule above misses, e.g. a rounding of each k-step's
sum), and l and the fold across tiles, in float64 (the kernel: float32); the output stays float64 (the kernel
rounds it to bf16). Finite inputs only: non-finite ones have their own rules
(:mod:`mpfa.reference.attention`) and their own tests.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..recipes import get_recipe
from ..recipes.fp8 import E4M3_DTYPE, E4M3_MAX, P_SCALE, as_e4m3, fdiv, row_scale
from ..recipes.int8 import INT8_MAX, Q_TILE, comp_digits_q_scale, requantize_k_tile
from ..recipes.u4h import hadamard, prefill_values
from .attention import gather_pages, request_kv_lengths

KV_TILE = 128        # keys per tile of the main loop (mpfa_jit/ops/prefill.py KV_TILE)
MU_ROWS = 128        # rows per block of mu_Q's partial sums (mpfa_jit/ops/prefill.py MU_ROWS)
ROUND_MAGIC = 12582912.0   # 1.5 * 2^23 (mpfa/quant.cuh kRoundMagic): kRoundMagic + S is exact for |S| < 2^22
LOG2E = 1.4426950408889634
_F32, _F64 = torch.float32, torch.float64


@dataclass
class KernelModel:
    """What :func:`prefill_kernel_attention` returns, float64, rows ``[n, H, ...]``:

    * ``o`` ``[n, H, D]``, ``lse`` ``[n, H]`` (natural log): the output before the kernel's bf16 rounding
      (0 and -inf for a row that sees no key);
    * ``o_abs`` ``[n, H, D]``: sum_j w_j |v_j| (w_j = P_j / l), the scale of the P V accumulation's error;
    * ``o_abs_rest`` ``[n, H, D]``: the same without each row's largest-P key, which no rounding moves: the scale
      of what P bytes rounding the other way (an ulp apart in the kernel) can change;
    * ``flip_max`` ``[n, H]``: the most one P rounding event can carry, max over the row's groups of keys with
      equal exp2 arguments of sum_j w_j ||v_j|| (keys with equal arguments have equal P in the kernel too, so their
      bytes round the other way together), keys whose P is exactly p_scale (exp2 of log2 p_scale: each tile that
      raises the running maximum, the row's largest key among them) left out: they never move;
    * ``o_rot`` ``[n, H, D]``: qk4pv4 only (None otherwise): the kernel's output before the wrapper's rotation,
      ``o = o_rot H`` (float64); ``o_abs``, ``o_abs_rest`` are then in this rotated space;
    * ``twins`` ``[n, H]``: how many rows of the request (this one included) have, in this head, the same exp2
      argument for every key as this row (the same scores up to a constant and the same visible keys: a request
      whose Q rows are equal, as INT8 bytes). The kernel computes their P bit for bit alike, so a P byte that
      rounds the other way in one of them does so in all of them: such a rounding event moves ``twins`` rows.
    """
    o: torch.Tensor
    lse: torch.Tensor
    o_abs: torch.Tensor
    o_abs_rest: torch.Tensor
    flip_max: torch.Tensor
    twins: torch.Tensor
    o_rot: torch.Tensor | None = None

    def flip_event(self, rows) -> float:
        """The norm, over ``rows`` (one request's), of the largest change one P rounding event can make:
        max over (row, head) of sqrt(twins) * flip_max; times one E4M3 step (2^-3) over ||o||, the request-level
        term of "Correlated P rounding" in tests/gpu/test_prefill_gpu.py's docstring."""
        if rows.stop == rows.start:
            return 0.0
        return (self.twins[rows].sqrt() * self.flip_max[rows]).max().item()


def _f32(x: torch.Tensor) -> torch.Tensor:
    """Round to float32 (a value computed exactly in float64 -> one float32 rounding, as an FMA or an
    IEEE operation of the kernel), kept in float64."""
    return x.to(_F32).to(_F64)


def _quantize_q(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """load_q's INT8 bytes as float64: rni(x * fl(1 / s)) (__frcp_rn, then one fp32 multiply; |.| <= 127)."""
    inv = fdiv(torch.ones_like(s, dtype=_F32), s)
    return torch.round(x.to(_F32) * inv).clamp(-INT8_MAX, INT8_MAX).to(_F64)


def kernel_q_mean(q: torch.Tensor) -> torch.Tensor:
    """mu_Q ``[H, D]`` float32 of one request's chunk ``q [n, H, D]`` in the pre-pass's order
    (prepass_q_mean.cuh): each block of MU_ROWS rows summed in row order from 0, the blocks' sums added in
    order from 0, divided by n. Zeros for an empty chunk."""
    n = q.shape[0]
    if n == 0:
        return q.new_zeros(q.shape[1:], dtype=_F32)
    qf = q.to(_F32)
    total = torch.zeros(q.shape[1:], dtype=_F32, device=q.device)
    for r0 in range(0, n, MU_ROWS):
        acc = torch.zeros_like(total)
        for r in range(r0, min(n, r0 + MU_ROWS)):
            acc = acc + qf[r]
        total = total + acc
    return fdiv(total, float(n))   # q_mean_kernel: t / float(n), an IEEE division


def kernel_mu_l1(mu: torch.Tensor) -> torch.Tensor:
    """|mu_Q|_1 per head ``[H]`` float32 as q_mean_kernel sums it: within each warp of 32 channels a
    butterfly (lane i + lane i + 16, then + 8, ...: halving), then the warps' sums in order from 0."""
    x = mu.to(_F32).abs()
    warps = x.reshape(x.shape[0], -1, 32)
    while warps.shape[-1] > 1:
        h = warps.shape[-1] // 2
        warps = warps[..., :h] + warps[..., h:]
    total = torch.zeros(x.shape[0], dtype=_F32, device=x.device)
    for w in range(warps.shape[1]):
        total = total + warps[:, w, 0]
    return total


def _fp32_dot_chain(mu: torch.Tensor, k_int: torch.Tensor) -> torch.Tensor:
    """``dot[h, j] = mu[h] . k_int[h, j]`` as kv_pack's FMA chain: fmaf(mu_c, k_c, dot) over the channels
    in order, float32 (each step exact in float64, then one rounding). mu [H, D] float32, k_int [H, m, D]."""
    mu64 = mu.to(_F64)
    k64 = k_int.to(_F64)
    dot = torch.zeros(k_int.shape[:2], dtype=_F64, device=k_int.device)
    for c in range(k_int.shape[-1]):
        dot = _f32(mu64[:, c:c + 1] * k64[:, :, c] + dot)
    return dot


def _tiles(m: int, tile: int) -> torch.Tensor:
    return torch.arange(m) // tile


def _expand(x: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[dim], dim=dim) if x.shape[dim] != heads else x


def _quantized_q(q, compensation, comp_digits, q_tile, mu):
    """(INT8 Q [n, H, D] as float64, the scale each row's scores take [H, n] float64, mu_Q [H, D] float32):
    load_q of q_tile.cuh. Per q_tile rows: amax / 127 (an all-zero tile stores zeros and scores with 0);
    comp_mma with compensation: one scale per head (mpfa.recipes.int8.comp_digits_q_scale on the kernel's |mu_Q|_1)."""
    n, heads, d = q.shape
    qf = q.to(_F32)
    if mu is None:
        mu = kernel_q_mean(q) if compensation else qf.new_zeros((heads, d))
    x = qf - mu.to(_F32)
    q8 = torch.empty_like(x, dtype=_F64)
    sq = torch.empty((heads, n), dtype=_F64, device=q.device)
    if comp_digits and compensation:
        amax = x.abs().amax(dim=(0, 2)) if n else x.new_zeros(heads)
        s = comp_digits_q_scale(amax, kernel_mu_l1(mu))
        for h in range(heads):
            q8[:, h] = _quantize_q(x[:, h], s[h])
            sq[h] = s[h].to(_F64)
        return q8, sq, mu
    for t0 in range(0, n, q_tile):
        rows = slice(t0, min(n, t0 + q_tile))
        amax = x[rows].abs().amax(dim=(0, 2))                 # [H]
        s = row_scale(amax, INT8_MAX)                                     # 1 for an all-zero tile
        q8[rows] = _quantize_q(x[rows], s.view(1, heads, 1))
        sq[:, rows] = torch.where(amax == 0, torch.zeros_like(s), s).to(_F64).unsqueeze(-1)
    return q8, sq, mu


def _visible(n: int, m: int, causal: bool, device) -> torch.Tensor:
    """[n, m] bool: row i sees key j (bottom-right causal alignment)."""
    j = torch.arange(m, device=device).unsqueeze(0)
    if not causal:
        return torch.ones((n, m), dtype=torch.bool, device=device)
    return j <= torch.arange(n, device=device).unsqueeze(-1) + (m - n)


def _tile_max(x: torch.Tensor, tile: int) -> torch.Tensor:
    """``x [H, n, m]`` (masked entries -inf) -> the maxima of each tile of ``tile`` keys ``[H, n, T]``."""
    m = x.shape[-1]
    pad = (-m) % tile
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=-math.inf)
    return x.reshape(*x.shape[:-1], -1, tile).amax(dim=-1)


def _per_key(t: torch.Tensor, tile: int, m: int) -> torch.Tensor:
    """``[H, n, T]`` per-tile values -> ``[H, n, m]`` at each key."""
    return t.repeat_interleave(tile, dim=-1)[..., :m]


def _softmax_weights(arg, visible, m_tile, kv_tile, p_round):
    """From each key's exp2 argument ``arg [H, n, m]`` (relative to its tile's running maximum) and the
    tiles' maxima ``m_tile [H, n, T]`` (log2 units, -inf for a tile a row sees no key of): the kernel's P
    bytes as values (``p_round``), each key's frame factor 2^(m_ref(t) - m_final) (the product of the
    later tiles' corrections), and m_final ``[H, n]`` (-inf where a row sees no key)."""
    m_run = torch.cummax(m_tile, dim=-1).values                # fmaxf over the tiles so far
    m_ref = torch.where(torch.isneginf(m_run), torch.zeros_like(m_run), m_run)
    m_final = m_run[..., -1]
    frame = torch.exp2(m_ref - torch.where(torch.isneginf(m_final), torch.zeros_like(m_final),
                                           m_final).unsqueeze(-1))
    frame = _per_key(frame, kv_tile, arg.shape[-1])
    p = torch.where(visible, hardware_exp2(arg), torch.zeros_like(arg))
    return p, p_round(p), frame, m_final


_EX2_KERNEL = None


def _ex2_kernel():
    """A Triton kernel applying the prefill kernel's ex2.approx.ftz.f32 (mpfa/common.cuh ex2) elementwise, or
    None where Triton is not importable."""
    global _EX2_KERNEL
    if _EX2_KERNEL is None:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            _EX2_KERNEL = False
            return None

        @triton.jit
        def ex2(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + offs, mask=mask, other=0.0)
            y = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                          is_pure=True, pack=1)
            tl.store(y_ptr + offs, y, mask=mask)

        _EX2_KERNEL = ex2
    return _EX2_KERNEL or None


def hardware_exp2(x: torch.Tensor) -> torch.Tensor:
    """2^x of float32 values ``x`` (kept in float64) as the kernel computes them: on a CUDA device the GPU's
    ex2.approx.ftz.f32 (what the kernel runs: within 2 ulp of 2^x, its own rounding), elsewhere exact 2^x rounded
    to float32. Returned as float64."""
    kernel = _ex2_kernel() if x.is_cuda else None
    if kernel is None:
        return _f32(torch.exp2(x))
    xf = x.to(_F32).contiguous()
    y = torch.empty_like(xf)
    n = xf.numel()
    if n:
        kernel[(-(-n // 1024),)](xf, y, n, BLOCK=1024)
    return y.to(_F64)


def _raw_tile_args(s_int, visible, a_t, log2_p, kv_tile):
    """tile_scale builds without per-key terms (softmax_max_raw): the maxima T on the integer scores,
    m_tile = fp32(T * a), c = fp32(fp32(fp32(m_tile - m_ref) + log2 p_scale) - kRoundMagic * a) per
    (row, tile), each score's argument fp32(fma(kRoundMagic + (S - T), a, c))."""
    m = s_int.shape[-1]
    t_int = _tile_max(torch.where(visible, s_int, torch.full_like(s_int, -math.inf)), kv_tile)
    seen = torch.isfinite(t_int)
    m_tile = torch.where(seen, _f32(torch.where(seen, t_int, torch.zeros_like(t_int)) * a_t),
                         torch.full_like(t_int, -math.inf))
    m_run = torch.cummax(m_tile, dim=-1).values
    m_ref = torch.where(torch.isneginf(m_run), torch.zeros_like(m_run), m_run)
    c = _f32(_f32(_f32(m_tile - m_ref) + log2_p) - ROUND_MAGIC * a_t)     # kRoundMagic * a: exact (22-bit a)
    t_key = _per_key(torch.where(seen, t_int, torch.zeros_like(t_int)), kv_tile, m)
    x = ROUND_MAGIC + (s_int - t_key)
    arg = _f32(x * _per_key(a_t, kv_tile, m) + _per_key(c, kv_tile, m))
    return torch.where(visible, arg, torch.full_like(arg, -math.inf)), m_tile


def _float_scores_args(s, visible, log2_p, kv_tile):
    """Builds whose scores are floats before the maxima (per-key scales, tile_scale with per-key terms,
    bf16): masked scores -inf, the tiles' maxima, base = fp32(m_ref - log2 p_scale), argument fp32(s - base)."""
    s = torch.where(visible, s, torch.full_like(s, -math.inf))
    m_tile = _tile_max(s, kv_tile)
    m_run = torch.cummax(m_tile, dim=-1).values
    m_ref = torch.where(torch.isneginf(m_run), torch.zeros_like(m_run), m_run)
    base = _per_key(_f32(m_ref - log2_p), kv_tile, s.shape[-1])
    return _f32(s - base), m_tile


def prefill_kernel_attention(q, k, v, *, recipe, causal: bool, sm_scale: float | None = None,
                             compensation: bool = True, q_tile: int = Q_TILE, p_scale: float = P_SCALE,
                             comp_digits: bool = False, k_tile: int | None = None, kv_tile: int = KV_TILE,
                             mu: torch.Tensor | None = None, v_scale: torch.Tensor | None = None):
    """One request as the prefill kernel computes it (module docstring), in float64 where the kernel is exact or
    accumulates. ``q [n, H, D]`` bf16. Quantized recipes: ``k`` = (INT8 rows ``[m, H_kv, D]`` (qk4pv8: the i4rs
    row's INT8 image), per-token scales ``[m, H_kv]`` float32) as mpfa.KVCacheLayer.k_operand gives them, ``v``
    ``[m, H_kv, D]`` the dequantized FP8 V (exact in float64; qk4pv4: the FP8 image of the rotated V times v_scale,
    mpfa.recipes.u4h.prefill_values, and the output is rotated back); bf16: ``k``, ``v`` the bf16 rows. ``q_tile``,
    ``p_scale``, ``comp_digits``, ``k_tile``: the build's numerics (mpfa_jit/ops/prefill.py numerics);
    ``kv_tile``: keys per main-loop tile (the kernel's 128; a tile of all keys gives the final-maximum P of
    recipe_attention); ``mu``: the smoothing vector ``[H, D]`` to use instead of the kernel's mean (a study of
    what a wrong one costs); ``v_scale``: the FP8 recipes' V channel scales ``[H_kv, D]`` (``v`` is their E4M3
    operand times them): given, the P V sums are the FP8 MMA's (:func:`tensor_core_pv`), else exact.

    Returns a :class:`KernelModel` (o, lse and the scales of the kernel's remaining rounding)."""
    recipe = get_recipe(recipe)
    if k_tile is not None and kv_tile != k_tile:
        raise ValueError(f"kv_tile ({kv_tile}) must equal k_tile ({k_tile}): a tile_scale build's K scale is per "
                         "main-loop tile")
    n, heads, d = q.shape
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    score_scale = float(torch.tensor(sm_scale, dtype=_F32) * torch.tensor(LOG2E, dtype=_F32))
    device = q.device
    if recipe.quantized_q:
        k_int, k_scale = k
        m = k_int.shape[0]
        kv_tile = max(1, min(kv_tile, m))   # a tile past the last key is that many keys
        log2_p = float(torch.tensor(math.log2(p_scale), dtype=_F32))
        if k_tile is not None:   # the pre-pass requantizes each tile to its largest token scale
            ints, scales = torch.empty_like(k_int), torch.empty_like(k_scale, dtype=_F32)
            for t0 in range(0, m, k_tile):
                q8, s_t = requantize_k_tile(k_int[t0:t0 + k_tile].transpose(0, 1),
                                            k_scale[t0:t0 + k_tile].transpose(0, 1))
                ints[t0:t0 + k_tile] = q8.transpose(0, 1)
                scales[t0:t0 + k_tile] = s_t.unsqueeze(0)
            k_int, k_scale = ints, scales
        v64 = v.to(_F64)
        q8, sq, mu = _quantized_q(q, compensation, comp_digits, q_tile, mu)
        kint_h = _expand(k_int, heads, 1).transpose(0, 1).to(_F64)            # [H, m, D]
        ks_h = _expand(k_scale.to(_F32), heads, 1).transpose(0, 1)            # [H, m] float32
        fa = _f32(ks_h.to(_F64) * score_scale)                                # kv_pack's fa_j
        digits = comp_digits and compensation
        dot = _fp32_dot_chain(mu, kint_h) if compensation else None
        s_int = torch.einsum("qhd,hkd->hqk", q8, kint_h)                     # exact: |S| < 2^22
        if digits:   # C_j = rni(fp32(dot / sq)), added by the MMA's extra k-step
            c = torch.round(fdiv(dot.to(_F32), sq[:, :1].to(_F32)).to(_F64))
            s_int = s_int + c.unsqueeze(1)
        visible = _visible(n, m, causal, device)
        sq3 = sq.unsqueeze(-1)                                                # [H, n, 1]
        if k_tile is not None:
            fa_t = fa[:, ::kv_tile].unsqueeze(1)                              # the tile's one factor [H, 1, T]
            a_t = _f32(fa_t * sq3)
            a_t = torch.where(a_t == 0, torch.full_like(a_t, 2.0 ** -126), a_t)
            a_t = (a_t.to(_F32).view(torch.int32) & ~3).view(_F32).to(_F64)   # 22 significant bits
        raw = k_tile is not None and (comp_digits or not compensation)
        if raw:
            arg, m_tile = _raw_tile_args(s_int, visible, a_t, log2_p, kv_tile)
        else:
            a = _per_key(a_t, kv_tile, m) if k_tile is not None else _f32(fa.unsqueeze(1) * sq3)
            fb = torch.zeros_like(fa) if not compensation else _f32(_f32(dot * ks_h.to(_F64)) * score_scale)
            b = _f32(fb.unsqueeze(1) - ROUND_MAGIC * a)
            s = _f32((ROUND_MAGIC + s_int) * a + b)
            arg, m_tile = _float_scores_args(s, visible, log2_p, kv_tile)

        def p_round(p):
            return as_e4m3(p.clamp(max=E4M3_MAX).to(_F32).to(E4M3_DTYPE)).to(_F64)
    else:
        m = k.shape[0]
        kv_tile = max(1, min(kv_tile, m))
        log2_p = 0.0
        v64 = v.to(_F64)
        kh = _expand(k, heads, 1).to(_F64)
        s = _f32(_f32(torch.einsum("qhd,khd->hqk", q.to(_F64), kh)) * score_scale)
        visible = _visible(n, m, causal, device)
        arg, m_tile = _float_scores_args(s, visible, 0.0, kv_tile)

        def p_round(p):
            return p.to(torch.bfloat16).to(_F64)
    p, p8, frame, m_final = _softmax_weights(arg, visible, m_tile, kv_tile, p_round)
    l = (p * frame).sum(dim=-1)                                               # [H, n]
    w = p8 * frame / torch.where(l > 0, l, torch.ones_like(l)).unsqueeze(-1)
    # The row's largest P is p_scale (exactly 2^log2 p_scale for a power of two; 448 to the last bits, the top of
    # E4M3, far from a rounding point): no rounding moves it. Any other key's P byte may round the other way where
    # the kernel's P differs from the model's by an ulp.
    top = (p * frame).argmax(dim=-1, keepdim=True)
    w_rest = w.scatter(-1, top, 0.0)
    vh = _expand(v64, heads, 1)
    v_norm = vh.norm(dim=-1).transpose(0, 1).unsqueeze(1)                     # [H, 1, m]
    lse = torch.where(l > 0, (m_final + torch.log2(torch.where(l > 0, l, torch.ones_like(l))) - log2_p) * math.log(2),
                      torch.full_like(l, -math.inf)).transpose(0, 1)
    if m:
        flip_max, twins = _flip_groups(arg, torch.where(arg == log2_p, torch.zeros_like(w_rest), w_rest) * v_norm)
    else:
        flip_max, twins = torch.zeros_like(lse), torch.ones_like(lse)
    if v_scale is not None and recipe.quantized_q and m:
        vs = _expand(v_scale.to(_F64), heads, 0)                              # [H, D]
        sums = tensor_core_pv(p8, vh / vs.unsqueeze(0), kv_tile)               # [T, H, n, D], the E4M3 operands' units
        frames = frame[..., ::kv_tile]                                        # [H, n, T]: constant over a tile
        l_safe = torch.where(l > 0, l, torch.ones_like(l))
        o = (torch.einsum("thqd,hqt->qhd", sums, frames) * vs.unsqueeze(0)) / l_safe.transpose(0, 1).unsqueeze(-1)
    else:
        o = torch.einsum("hqk,khd->qhd", w, vh)
    o_rot = None
    if recipe.v_format == "u4h":   # the kernel's output is O_rot; the wrapper rotates it back
        o_rot, o = o, o @ hadamard(d, device=o.device)
    return KernelModel(o=o, lse=lse, o_abs=torch.einsum("hqk,khd->qhd", w, vh.abs()),
                       o_abs_rest=torch.einsum("hqk,khd->qhd", w_rest, vh.abs()),
                       flip_max=flip_max, twins=twins, o_rot=o_rot)


MMA_K = 32          # keys per FP8 wgmma k-step (the PV product's K)
MMA_BITS = 13       # bits kept below the largest addend's leading bit in a k-step's aligned sum


def tensor_core_pv(p8: torch.Tensor, v8: torch.Tensor, kv_tile: int, *, mma_k: int = MMA_K,
                   bits: int = MMA_BITS) -> torch.Tensor:
    """Each ``kv_tile``-key tile's P V sum as the FP8 MMA accumulates it: ``p8 [H, n, m]`` the E4M3 P values, ``v8 [m,
    H, D]`` the E4M3 V operand (both exact in float64). Per tile a fresh accumulator; per k-step of ``mma_k`` keys the
    accumulator and the products p_j v_j are aligned to the largest one's exponent e (of |.|, per output element),
    each truncated toward zero to a multiple of 2^(e - ``bits``), and summed (exactly: at most ~20 significant
    bits). ``mma_k`` and ``bits`` other than the kernel's: variants for benchmarks.accuracy.fp8_accumulation.
    Returns ``[T, H, n, D]`` float64."""
    heads, n, m = p8.shape
    d = v8.shape[-1]
    tiles = -(-m // kv_tile)
    out = torch.empty((tiles, heads, n, d), dtype=_F64, device=p8.device)
    vt = v8.transpose(0, 1)                                                   # [H, m, D]
    for t in range(tiles):
        acc = torch.zeros((heads, n, d), dtype=_F64, device=p8.device)
        for k0 in range(t * kv_tile, min(m, (t + 1) * kv_tile), mma_k):
            k1 = min(m, k0 + mma_k, (t + 1) * kv_tile)
            terms = p8[:, :, k0:k1, None] * vt[:, None, k0:k1, :]            # [H, n, k, D], exact
            big = torch.maximum(acc.abs(), terms.abs().amax(dim=2))
            ulp = torch.ldexp(torch.ones_like(big), torch.frexp(big).exponent - 1 - bits)
            acc = torch.trunc(acc / ulp) * ulp + (torch.trunc(terms / ulp.unsqueeze(2)) * ulp.unsqueeze(2)).sum(dim=2)
        out[t] = acc
    return out


def _flip_groups(arg: torch.Tensor, carry: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From the exp2 arguments ``arg [H, n, m]`` and what each key's P byte carries, ``carry = w_j ||v_j||`` (0 for
    keys that cannot move): (``flip_max [n, H]``: per row, the largest sum of ``carry`` over a group of keys with
    equal arguments; ``twins [n, H]``: per row, the number of rows with the same argument row, float64)."""
    srt, order = arg.sort(dim=-1)
    group = torch.cat([torch.zeros_like(srt[..., :1], dtype=torch.long),
                       (srt[..., 1:] != srt[..., :-1]).long().cumsum(dim=-1)], dim=-1)
    sums = torch.zeros_like(carry).scatter_add_(-1, group, carry.gather(-1, order))
    flip_max = sums.amax(dim=-1).transpose(0, 1)
    twins = torch.empty(arg.shape[:2], dtype=_F64, device=arg.device)
    for h in range(arg.shape[0]):
        _, inverse, counts = torch.unique(arg[h], dim=0, return_inverse=True, return_counts=True)
        twins[h] = counts[inverse].to(_F64)
    return flip_max, twins.transpose(0, 1)


def batch_prefill_kernel_attention(q, qo_indptr, layer, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                                   *, causal: bool, sm_scale: float | None = None, compensation: bool = True,
                                   q_tile: int = Q_TILE, p_scale: float = P_SCALE, comp_digits: bool = False,
                                   k_tile: int | None = None, kv_tile: int = KV_TILE, fp8_mma: bool = False):
    """:func:`prefill_kernel_attention` over a ragged batch in ``layer`` (an mpfa.KVCacheLayer), the keyword
    arguments being the build's numerics (mpfa_jit/ops/prefill.py numerics); ``fp8_mma``: the FP8 recipes' P V sums
    as the tensor cores accumulate them (:func:`tensor_core_pv`), else exact. Returns one :class:`KernelModel` of
    all rows (zeros and LSE -inf for requests without rows)."""
    recipe = layer.recipe
    rotated = recipe.v_format == "u4h"
    lengths = request_kv_lengths(paged_kv_indptr, paged_kv_last_page_len, layer.page_size)
    qo, kv = qo_indptr.tolist(), paged_kv_indptr.tolist()
    rows_d = torch.zeros((q.shape[0], q.shape[1], layer.head_dim), dtype=_F64, device=q.device)
    out = KernelModel(o=rows_d, lse=torch.full(q.shape[:2], -math.inf, dtype=_F64, device=q.device),
                      o_abs=rows_d.clone(), o_abs_rest=rows_d.clone(),
                      flip_max=torch.zeros(q.shape[:2], dtype=_F64, device=q.device),
                      twins=torch.ones(q.shape[:2], dtype=_F64, device=q.device),
                      o_rot=rows_d.clone() if rotated else None)
    for b, m in enumerate(lengths):
        rows = slice(qo[b], qo[b + 1])
        if rows.stop == rows.start:
            continue
        ids = paged_kv_indices[kv[b]:kv[b + 1]].long()
        local = torch.arange(ids.numel(), device=ids.device)
        if recipe.quantized_q:
            k = tuple(gather_pages(x, local, m) for x in layer.k_operand(pages=ids))
            v8 = gather_pages(layer.fields["v"][ids], local, m)
            if rotated:   # the pre-pass's FP8 image of the rotated V, times v_scale
                v = prefill_values(v8, gather_pages(layer.fields["v_param"][ids], local, m), layer.v_scale)
            else:
                v = as_e4m3(v8).to(_F64) * layer.v_scale.to(_F64).unsqueeze(0)
        else:
            k = gather_pages(layer.fields["k"][ids], local, m)
            v = gather_pages(layer.fields["v"][ids], local, m)
        one = prefill_kernel_attention(q[rows], k, v, recipe=recipe, causal=causal, sm_scale=sm_scale,
                                       compensation=compensation, q_tile=q_tile, p_scale=p_scale,
                                       comp_digits=comp_digits, k_tile=k_tile, kv_tile=kv_tile,
                                       v_scale=layer.v_scale if fp8_mma and recipe.quantized_q else None)
        for name in ("o", "lse", "o_abs", "o_abs_rest", "flip_max", "twins") + (("o_rot",) if rotated else ()):
            getattr(out, name)[rows] = getattr(one, name)
    return out
