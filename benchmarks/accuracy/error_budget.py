"""Error budget of ``qk4pv8`` (CPU study): which quantization step costs what, and which 4-bit K
(or, issue 33, 4-bit V) format would cost less.

    python -m benchmarks.accuracy.error_budget [--contexts 1024 2048] [--q-len 256] [--out /tmp/mpfa-error-budget]
                                               [--no-model] [--no-synthetic] [--data-dir DIR]
                                               [--model-tokens N] [--model-configs C ...] [--model-dtype float32]
                                           [--configs C ...] [--no-diagnostics] [--capture-cache FILE]
                                           [--text kjv|stdlib] [--skip-tokens N] [--device cuda]

Inputs: Q/K/V after RoPE of every layer of SmolLM2-135M on KJV text (:func:`.model.capture`; the last
``q_len`` tokens of a ``context`` as queries, causal), and the synthetic ``gaussian`` / ``outlier``
inputs of :mod:`.kernel`. Each configuration quantizes some operands and keeps the others exact; its
attention output is compared with float64 exact attention on the unquantized bf16 inputs
(:mod:`mpfa.reference`), accumulated over every layer and head (rel. L2, cosine, per-layer rel. L2).

Sources, alone and combined (names are the row ``config``):

* Q: ``q8`` FP8 per 128-row tile as it is; ``q8s`` Q - mu_Q (mean of the chunk) per tile plus the
  rank-one compensation mu_Q . K added to the scores in float64 (the recipe's prefill numerics);
  ``qi8`` / ``qi8s`` the same with INT8 per tile (:func:`mpfa.recipes.int8.quantize_q_per_tile`, amax -> 127);
  ``qi8s64`` ``qi8s`` with one scale per 64-row tile (the rows one prefill consumer warpgroup holds, so
  the finer scale costs the kernel nothing); mu_Q is still the mean of the call's rows; ``qi8sH`` one
  scale per head for all the call's rows (what a K-side precomputed compensation term would need).
* K, on K~ = K - mu_K (``mu=none``: mu_K = 0; ``first``: mean of the first ``n_cal`` tokens of the
  context; ``all``: mean of every context token, what :mod:`.kernel` and a first prefill do):
  ``k4``   the implemented format (:func:`mpfa.recipes.fp4.quantize_k4`: E2M1, block 16, block scales
           restricted to 2^e / 1.5*2^e, rounded up, per-token FP32 scale);
  ``k4e``  block scales unrestricted E4M3, round-to-nearest as in NVFP4 (block max may saturate),
           per-token FP32 scale mapping the token amax to 6*448;
  ``k4f``  block scales exact FP32 (the limit of any scale format);
  ``k4b8`` the implemented format with 8-channel blocks;
  ``k4t``  no block scales: one FP32 scale per token (amax -> 6);
  ``eq``   prefix: per-channel equalization K' = K~ / t, Q' = Q * t (exact: Q K~^T = Q' K'^T),
           t = 2^round(log2 rms_c) per (layer, KV head, channel) over the calibration keys, then
           the named K format on K' (``eqk4``, ``eqk4t``, ...);
  ``k4m``  the implemented format (same bytes, same exact-on-FP8 products), but each block takes the
           better of two allowed scales (rounded up, or the next one below with the max saturating);
  ``k4r``  RoPE-aware: the low-frequency half of the channels FP8 per token, the other half ``k4e``;
  ``k4rs`` the same split with one per-token scale for the row and the implemented 4-bit blocks (one
           E4M3 operand per K tile, as the kernels need); ``k4rsq``: only the lowest-frequency quarter FP8;
  ``~s``   suffix: the first 16 keys (one page: the attention-sink token) in FP8 per token;
           ``~b``: the same page kept exact (bf16, un-smoothed: the kernel would subtract mu_K . Q there);
  ``k8``   FP8 per token (``qk8pv8``'s K).
  8-bit integer K (:mod:`mpfa.recipes.int8`, issue 20; every value the QK MMA sees is an INT8 integer
  times one per-key FP32 scale):
  ``ki8``  INT8 per token (amax -> 127); ``ki8t`` the same requantized to one scale per 128-key tile (the
           tile's largest token scale: rni(q * s_j / s_T)), the uniform K-tile scale a prefill pre-pass could
           write; ``ki4t`` the i4rs INT8 image requantized the same way;
  ``ki4``  ``i4rs``: the low-frequency RoPE half INT8, the other half INT4 in [-7, 7] times an integer
           block scale b in 1..18 per 16 channels chosen by least squared error, one scale per row
           (amax -> 126); ``ki4b8``: 8-channel blocks; ``ki4u`` / ``ki4ub8``: b rounded up
           (ceil(amax / 7), no clipping) instead of the MSE choice; ``ki4t127``: row amax -> 127 (a
           row-max element in the INT4 half clips to 126);
  ``kt8``  the peer: SGLang's ``--kv-cache-dtype fp8_e4m3`` cache, K cast to E4M3 with the per-tensor
           scale 1.0 (no smoothing; with ``vt8`` for V the same). Q and P stay exact here (FlashInfer
           keeps Q and P in bf16/fp16 and dequantizes K/V in registers: the cache is what is emulated).
  ``~c``   suffix: a stored per-key correction c = mu_Q . (K~ - K_q) per query head, E4M3 under the
           key's own scale (c / s_K, saturating; 1 byte per query head and key), added to the scores;
           mu_Q fixed at calibration (``~c``: the mean of the call's queries, ``~cf``: of its first
           ``n_cal`` query rows, as a server fixing it from an earlier prefill would).
* P: ``p8`` FP8 after exp with the static offset 448 (``e4m3(p * 448) / 448``); ``p16`` rounded to
  fp16 (what an FP16 PV MMA sees), ``pbf`` to bf16. The normalizer l is the sum of the unquantized p
  in every case, as the kernels compute it. (A per-row dynamic FP8 offset is not a configuration: the
  largest p of a row, against its running or final max, is exp(0) = 1, so mapping the row's max to 448
  is the static offset; and E4M3 is floating point, so any other power-of-two offset only moves which p
  fall below the smallest normal, p * 448 < 2^-6.)
* V: ``v8`` FP8 with per-(KV head, channel) scales 2 * amax / 448 from the context's values;
  ``v8s`` V smoothing: V~ = V - mu_V (mu_V per (KV head, channel): the mean over the context, as
  mu_K@all) in FP8 with the per-channel scales 2 * amax(|V~|) / 448, and mu_V added to the normalized
  output: O = P_q V~_q / l + mu_V. The exact identity is P V / l = P V~ / l + mu_V * rowsum(P) / l,
  and rowsum(P) = l for the unquantized p that l sums, so adding mu_V is what a kernel does cheaply (one
  add per output element in the epilogue, no rowsum of the quantized P) and it also drops the P
  rounding's error on the mean part of V, which ``v8`` keeps (its O carries mu_V * rowsum(P_q) / l).
  E4M3's error is relative to each value, so centring only helps where |V - mu_V| < |V|; the
  attention-sink token's value is near zero (SmolLM2: |V_0| ~ 1 against a median |V_j| of 5-13 past
  layer 5) and becomes ~ -mu_V, and the sink's large p carries that error into the output.
  ``v8s~s``: the same, but the first ``SINK_TOKENS`` keys' values stored uncentred (same per-channel
  scales) and the output gets mu_V * (1 - l_sink / l), l_sink the sum of the unquantized p over
  those keys (one more row accumulator, updated in the first KV tile only);
  ``vi8`` INT8 with per-(KV head, channel) scales amax / 127 from the context's values (not an FP8 PV
  operand: for a PV MMA on fp16 P, ``p16+vi8``, whose V converts to fp16 exactly in registers);
  ``vt8`` E4M3 with the per-tensor scale 1.0 (the peer's V).
  4-bit V (issue 33; :data:`V4_FORMATS`, scales and zero points stored as fp16, :func:`v4_bytes` per
  token-head): ``v4t`` INT4 in [-7, 7], one scale per token (amax -> 7); ``v4b32`` one scale per 32
  channels; ``v4b32m`` the same on V - mu_V (mu_V added in the epilogue as ``v8s``); ``v4at`` / ``v4a32``
  asymmetric: codes 0..15, x ~= q * s + z, z = min and s = (max - z) / 15 per token / per 32 channels;
  ``v4a32h`` ``v4a32`` of V H (H the orthonormal Hadamard matrix; exact: O = (P V H) H^T in the epilogue);
  ``v4a32o8`` / ``v4ato8``: the D/8 channels of largest |V| over the first ``n_cal`` tokens (per layer and
  KV head, fixed) INT8 with one fp16 scale per token, the other 7/8 ``v4a32`` in D/32 groups (28 channels
  each) / ``v4at``; ``v4a32hr`` ``v4a32h`` with each group's (s, z) refitted by least squares to its codes
  (:func:`refit_groups`; min/max's kept where no round beats it), ``v4a32hz`` its zero point an integer code
  (x ~= (q - zp) s, one byte: 180 B per token-head at d128 instead of 184), ``v4a32hzr`` both. Each models the
  prefill kernel: its pre-pass writes today's FP8 V tile from the 4-bit
  cache, so the dequantized value is rounded once more to E4M3 under V's fixed per-channel scales (of
  V - mu_V or V H where centred or rotated; every INT4 value and code 0..15 is exact in E4M3, but a
  per-token or per-group scale cannot be applied after an FP8 PV MMA). Suffixes: ``~s`` the first
  ``SINK_TOKENS`` values (the attention-sink page) stored FP8 under those scales; ``~f`` the decode path:
  the dequantized value rounded to fp16 (decode converts in registers; pair it with ``p16``, decode's P,
  and no Q quantization: ``ki4@all+p16+v4a32~f``).

Diagnostics per layer and KV head (``kind: diag`` rows): large-mean channels (|mu_c| / sd_c),
per-token amax before and after smoothing, relative K error, the logit noise the K error causes in
the scores, ``sm_scale * Q . dK`` with each query row's mean removed (a constant shift of a row is
invisible to softmax) and its part from the channels with large mu_K; the attention-sink figures:
mean probability of key 0 (``p_sink``), ||K_0 - mu|| over the median key's (``k0_norm_rel_*``),
and the score error of key 0 relative to the p-weighted mean error (``sink_logit_err_*``).

i4rs block scales (``kind: i4rs_blocks`` rows, per context and block size): where the MSE block scale
sits relative to the rounded-up one (share of blocks per offset b_mse - b_up), for the append kernel's
search.

Model level: perplexity and KL(exact || config) of SmolLM2 on KJV with every layer's attention
replaced by the configuration (registered as transformers attention ``"mpfa_budget"``; mu_K and the
other calibrated scales come from the same forward, as :class:`.model.MpfaSession` calibrates from
the first prefill; ``--model-dtype float32`` halves the CPU time of long sequences). Model and kernel
rows carry ``bytes_d128`` (K + V per token-head at head_dim 128) and ``x_bf16`` where the K format has
a cache layout here (:func:`cache_bytes`). ``--text stdlib``
reads the running Python's standard library instead of KJV, ``--skip-tokens N`` starts N tokens into
the text (a second sample of the same text). ``--device cuda`` runs the same simulation (model weights
in float32, attention in float64/float32) on a GPU: the reference numerics, not the kernels, ~100x faster
than 2 CPU cores (the 2K/4K/8K study of issue 20 took 3 minutes on the H200). Writes
``<out>/error_budget.json`` with :func:`benchmarks.results_io.write`.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from benchmarks import cli
from mpfa.recipes.fp4 import BLOCK, E2M1_MAX, TOKEN_TARGET, e2m1_codes, e2m1_values, round_up_block_scale
from mpfa.recipes import int8 as I8
from mpfa.recipes.u4h import hadamard   # the orthonormal H of the served qk4pv4: V H is stored, O = (P V H) H
from mpfa.recipes.fp8 import (E4M3_DTYPE, E4M3_MAX, P_SCALE, amax_scale, quantize_e4m3, quantize_per_tile,
                               quantize_per_token)
from mpfa.reference.attention import _run, attention
from mpfa_jit.formats import INT4_MAX
from mpfa_jit.ops.prefill import KV_TILE

from .metrics import ErrorAccumulator

Q_TILE = 128
Q_BLOCK = 512        # causal query rows per reference call: keys past the block's last row are never read
SINK_TOKENS = 16     # "~s": the first page of keys stored as FP8 per token instead of 4-bit
N_CAL = 128          # "first": mu_K from the first 128 tokens of the context


# ---------------------------------------------------------------------------------------------
# K quantizers: rows x [..., D] float32 in, dequantized float32 out

def k4(x: torch.Tensor, *, block: int = BLOCK, scales: str = "restricted") -> torch.Tensor:
    """E2M1 with one scale per ``block`` channels and one FP32 scale per row.

    ``scales``: ``restricted`` (2^e / 1.5*2^e rounded up, token amax block -> 64: the implemented
    format, identical to quantize_k4 + dequantize_k4 for block 16), ``e4m3`` (NVFP4: E4M3
    round-to-nearest, token amax -> 6*448), ``fp32`` (exact block scales), ``none`` (per-row only).
    """
    x = x.float()
    d = x.shape[-1]
    if scales == "none":
        ts = amax_scale(x.abs().amax(dim=-1), E2M1_MAX).unsqueeze(-1)
        return e2m1_values(e2m1_codes(x * (1.0 / ts))) * ts
    blocks = x.reshape(*x.shape[:-1], d // block, block)
    bamax = blocks.abs().amax(dim=-1)
    tamax = bamax.amax(dim=-1)
    if scales == "e4m3":
        ts = amax_scale(tamax, E2M1_MAX * E4M3_MAX).unsqueeze(-1)
        bs = (bamax / (ts * E2M1_MAX)).clamp(max=E4M3_MAX).to(E4M3_DTYPE).float()
    else:
        ts = amax_scale(tamax, TOKEN_TARGET).unsqueeze(-1)
        need = bamax * (1.0 / (ts * E2M1_MAX))
        if scales == "restricted_mse":
            return _k4_restricted_mse(blocks, ts, need).reshape(x.shape)
        bs = round_up_block_scale(need) if scales == "restricted" else need
        if scales not in ("restricted", "fp32"):
            raise ValueError(f"unknown block scales {scales!r}")
    denom = ts * bs
    inv = torch.where(denom > 0, 1.0 / denom, torch.zeros_like(denom))
    vals = e2m1_values(e2m1_codes(blocks * inv.unsqueeze(-1)))
    return (vals * bs.unsqueeze(-1) * ts.unsqueeze(-1)).reshape(x.shape)


def _k4_restricted_mse(blocks, ts, need):
    """Restricted scales, but per block the better (lower squared error) of the rounded-up scale and
    the next allowed scale below it (the block max may then saturate at 6): same bytes, same
    exact-on-FP8 products; the append kernel would try two scales instead of one."""
    up = round_up_block_scale(need)
    below = torch.where(torch.frexp(up)[0] == 0.5, up * 0.75, up / 1.5)      # 2^e -> 1.5*2^(e-1); 1.5*2^e -> 2^e
    below = torch.where(below >= 2.0 ** -7, below, up)                       # stay inside the allowed range
    best, best_err = None, None
    for bs in (up, below):
        inv = 1.0 / (ts * bs)
        deq = e2m1_values(e2m1_codes(blocks * inv.unsqueeze(-1))) * bs.unsqueeze(-1) * ts.unsqueeze(-1)
        err = (deq - blocks).pow(2).sum(dim=-1, keepdim=True)
        if best is None:
            best, best_err = deq, err
        else:
            take = err < best_err
            best, best_err = torch.where(take, deq, best), torch.where(take, err, best_err)
    return best


def k8(x: torch.Tensor) -> torch.Tensor:
    q, s = quantize_per_token(x.float())
    return q.float() * s.unsqueeze(-1)


def k4r(x: torch.Tensor) -> torch.Tensor:
    """RoPE-aware split (rotate_half layout: channel c pairs with c + D/2, frequency falls with c mod D/2):
    the low-frequency half (c mod D/2 >= D/4, where the large-mean channels sit) FP8 per token, the
    high-frequency half ``k4e`` (E4M3 block scales, 16-channel blocks). Two per-token scales."""
    d = x.shape[-1]
    low = ((torch.arange(d) % (d // 2)) >= d // 4).to(x.device)
    out = torch.empty_like(x, dtype=torch.float32)
    out[..., low] = k8(x[..., low])
    out[..., ~low] = k4(x[..., ~low], scales="e4m3")
    return out


def k4rs(x: torch.Tensor, *, fp8_share: float = 0.5) -> torch.Tensor:
    """The kernel-friendly RoPE-aware split: ONE per-token scale for the whole row (the implemented
    qk4pv8's, token amax -> 6 * 64 = 384), the lowest-frequency ``fp8_share`` of each rotate_half
    half (c mod D/2 >= (1 - fp8_share) * D/2) stored as E4M3 of x / scale, the other channels as the
    implemented 4-bit format (E2M1, 16-channel blocks, block scales 2^e / 1.5*2^e rounded up). Every
    stored value times its block scale is then exact in E4M3, so a K tile is one E4M3 operand with one
    per-key scale for the QK MMA, as qk4pv8's is now. ``fp8_share`` 0.5: ``k4rs``, 0.25: ``k4rsq``."""
    x = x.float()
    d = x.shape[-1]
    low = ((torch.arange(d) % (d // 2)) >= round((1 - fp8_share) * (d // 2))).to(x.device)
    ts = amax_scale(x.abs().amax(dim=-1), TOKEN_TARGET).unsqueeze(-1)
    out = torch.empty_like(x)
    out[..., low] = quantize_e4m3(x[..., low], ts).float() * ts
    rest = x[..., ~low]
    blocks = rest.reshape(*rest.shape[:-1], rest.shape[-1] // BLOCK, BLOCK)
    bs = round_up_block_scale(blocks.abs().amax(dim=-1) * (1.0 / (ts * E2M1_MAX)))
    inv = 1.0 / (ts * bs)
    vals = e2m1_values(e2m1_codes(blocks * inv.unsqueeze(-1)))
    out[..., ~low] = (vals * bs.unsqueeze(-1) * ts.unsqueeze(-1)).reshape(rest.shape)
    return out


def ki8(x: torch.Tensor) -> torch.Tensor:
    return I8.dequantize_k_per_token(*I8.quantize_k_per_token(x.float()))


def ki4(x: torch.Tensor, *, block: int = 16, rule: str = "mse", target: float = I8.I4RS_TARGET) -> torch.Tensor:
    return I8.dequantize_i4rs(*I8.quantize_i4rs(x.float(), block=block, rule=rule, target=target))


def kt8(x: torch.Tensor) -> torch.Tensor:
    """E4M3 with scale 1.0, saturating at 448 (torch's cast; an unscaled cache only sees |x| <= 448 in practice)."""
    return quantize_e4m3(x.float(), 1.0).float()


# the per-key scale each integer format stores (the correction ~c is stored under it): row amax -> target
K_SCALE_TARGET = {"ki8": I8.INT8_MAX, "ki4t127": 127.0}

def ki8t(x: torch.Tensor) -> torch.Tensor:
    """``ki8`` requantized to one scale per K tile (issue 21's uniform tile scale)."""
    q, s = I8.quantize_k_per_token(x)
    return I8.tile_scaled_k(q, s, KV_TILE)


def ki4t(x: torch.Tensor) -> torch.Tensor:
    """``ki4`` (i4rs) expanded to its INT8 image and requantized to one scale per K tile."""
    k8, k4p, bs, s = I8.quantize_i4rs(x)
    return I8.tile_scaled_k(I8.i4rs_to_int8(k8, k4p, bs), s, KV_TILE)


K_FORMATS = {
    "ki8t": ki8t,
    "ki4t": ki4t,
    "k4": lambda x: k4(x),
    "k4e": lambda x: k4(x, scales="e4m3"),
    "k4f": lambda x: k4(x, scales="fp32"),
    "k4b8": lambda x: k4(x, block=8),
    "k4b8e": lambda x: k4(x, block=8, scales="e4m3"),
    "k4m": lambda x: k4(x, scales="restricted_mse"),
    "k4t": lambda x: k4(x, scales="none"),
    "k4r": k4r,
    "k4rs": k4rs,
    "k4rsq": lambda x: k4rs(x, fp8_share=0.25),
    "k8": k8,
    "ki8": ki8,
    "ki4": ki4,
    "ki4b8": lambda x: ki4(x, block=8),
    "ki4u": lambda x: ki4(x, rule="up"),
    "ki4ub8": lambda x: ki4(x, block=8, rule="up"),
    "ki4t127": lambda x: ki4(x, target=127.0),
    "kt8": kt8,
}


# ---------------------------------------------------------------------------------------------
# 4-bit V (issue 33): values [..., D] float32 in, dequantized float32 out; scales and zero points fp16

class V4(NamedTuple):
    """A 4-bit V format: ``group`` channels per scale (None: one per token), ``asym`` codes 0..15 with a zero
    point (else INT4 in [-7, 7]), ``outliers`` D/8 channels INT8 per token, ``rotate`` Hadamard of the
    channels, ``centre`` V - mu_V; asymmetric only: ``zp_code`` the zero point an integer code (one byte, x ~=
    (q - zp) s) instead of an fp16 value, ``refit`` the group's scale and zero point refitted by least squares
    to its codes (:func:`refit_groups`) instead of min/max's."""
    group: int | None
    asym: bool
    outliers: bool = False
    rotate: bool = False
    centre: bool = False
    zp_code: bool = False
    refit: bool = False


V4_FORMATS = {
    "v4t": V4(None, False), "v4b32": V4(32, False), "v4b32m": V4(32, False, centre=True),
    "v4at": V4(None, True), "v4a32": V4(32, True), "v4a32h": V4(32, True, rotate=True),
    "v4a32o8": V4(32, True, outliers=True), "v4ato8": V4(None, True, outliers=True),
    "v4a32hr": V4(32, True, rotate=True, refit=True), "v4a32hz": V4(32, True, rotate=True, zp_code=True),
    "v4a32hzr": V4(32, True, rotate=True, zp_code=True, refit=True),
}
REFIT_ROUNDS = 4       # refit_groups: least-squares (scale, zero point) and codes, alternated
ASYM_MAX = 15


def _fp16_scale(s: torch.Tensor) -> torch.Tensor:
    """A scale rounded to the fp16 the cache stores (decode's half2 FMA takes it as it is); one that
    underflows to 0 becomes 1, as an all-zero group's."""
    h = s.half().float()
    return torch.where(h > 0, h, torch.ones_like(h))


def _asym_params(lo: torch.Tensor, hi: torch.Tensor, zp_code: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, z) of the range [lo, hi] (``[..., 1]``) as stored: s = (hi - z) / 15 in fp16 with the zero point z =
    lo in fp16, or with ``zp_code`` s = (hi - lo) / 15 and z = -zp s for the integer code zp = rni(-lo / s) in
    0..15 (zero is then exact and the zero point takes one byte)."""
    if zp_code:
        s = _fp16_scale(amax_scale(hi[..., 0] - lo[..., 0], ASYM_MAX)).unsqueeze(-1)
        return s, -I8.rni(-lo / s).clamp(0, ASYM_MAX) * s
    z = lo.half().float()
    return _fp16_scale(amax_scale(hi[..., 0] - z[..., 0], ASYM_MAX)).unsqueeze(-1), z


def _asym_codes(g: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes 0..15 of ``g [..., group]`` under (s, z) and their values q s + z."""
    q = I8.quantize_int(g - z, s, ASYM_MAX).clamp(min=0)
    return q, q.float() * s + z


def refit_groups(g: torch.Tensor, s: torch.Tensor, z: torch.Tensor, zp_code: bool):
    """Least-squares refinement of each group's (s, z) from min/max's: REFIT_ROUNDS times, the (s, z) that fit the
    current codes best (a line through (q, x)), stored as the format stores them, then the codes again; per group
    the best round (min/max's included, so never worse). Returns (s, z)."""
    q, deq = _asym_codes(g, s, z)
    best = (deq - g).square().sum(dim=-1, keepdim=True)
    n = g.shape[-1]
    for _ in range(REFIT_ROUNDS):
        qf = q.float()
        sq, sx, sqq, sqx = qf.sum(-1, True), g.sum(-1, True), qf.square().sum(-1, True), (qf * g).sum(-1, True)
        den = n * sqq - sq * sq
        fit_s = torch.where(den > 0, (n * sqx - sq * sx) / den.clamp_min(1e-30), s)
        fit_z = torch.where(den > 0, (sx - fit_s * sq) / n, z)
        lo, hi = fit_z, fit_z + ASYM_MAX * fit_s.clamp_min(0)
        ns, nz = _asym_params(lo, hi, zp_code)
        q_new, deq = _asym_codes(g, ns, nz)
        err = (deq - g).square().sum(dim=-1, keepdim=True)
        take = err < best
        s, z, best = torch.where(take, ns, s), torch.where(take, nz, z), torch.where(take, err, best)
        q = torch.where(take, q_new, q)
    return s, z


def int4_groups(x: torch.Tensor, group: int, *, asym: bool, zp_code: bool = False,
                refit: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit codes of ``x [..., n]`` in groups of ``group`` consecutive channels: symmetric INT4 in [-7, 7]
    with s = amax / 7, or asymmetric codes 0..15 with s = (max - z) / 15 and the zero point z = min
    (x ~= q * s + z). s and z are rounded to fp16 first, then the codes computed from them (one
    reciprocal per group, a multiply per element, rni, clamp: :func:`mpfa.recipes.int8.quantize_int`).
    Asymmetric only: ``zp_code`` / ``refit`` as :class:`V4` says. Returns (codes int8 ``[..., n]``, dequantized
    float32 ``[..., n]``)."""
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    if asym:
        s, z = _asym_params(g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True), zp_code)
        if refit:
            s, z = refit_groups(g, s, z, zp_code)
        q, deq = _asym_codes(g, s, z)
    else:
        s = _fp16_scale(amax_scale(g.abs().amax(dim=-1), INT4_MAX)).unsqueeze(-1)
        q = I8.quantize_int(g, s, INT4_MAX)
        deq = q.float() * s
    return q.to(torch.int8).reshape(x.shape), deq.reshape(x.shape)


def v4_outlier_channels(v_cal: torch.Tensor) -> torch.Tensor:
    """``[H_kv, D]`` bool: per KV head the D/8 channels of largest |V| over the calibration values ``[T, H_kv, D]``."""
    amax = v_cal.float().abs().amax(dim=0)
    mask = torch.zeros_like(amax, dtype=torch.bool)
    return mask.scatter_(-1, amax.topk(amax.shape[-1] // 8, dim=-1).indices, True)


def v4_quantize(x: torch.Tensor, fmt: V4, outliers: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantized 4-bit V of ``x [m, H_kv, D]`` (already centred / rotated). With ``fmt.outliers`` the
    channels of ``outliers [H_kv, D]`` are INT8 with one fp16 scale per token (amax -> 127) and the other 7/8
    form D / group groups (28 channels each for 32) in channel order, or one group for a per-token format."""
    d = x.shape[-1]
    if not fmt.outliers:
        return int4_groups(x, fmt.group or d, asym=fmt.asym, zp_code=fmt.zp_code, refit=fmt.refit)[1]
    order = torch.argsort(outliers.int(), dim=-1, stable=True).expand_as(x)    # the 4-bit channels, then the INT8 ones
    xs = x.float().gather(-1, order)
    n4 = d - d // 8
    rest, big = xs[..., :n4], xs[..., n4:]
    s8 = _fp16_scale(amax_scale(big.abs().amax(dim=-1), I8.INT8_MAX)).unsqueeze(-1)
    deq = torch.cat([int4_groups(rest, n4 // (d // fmt.group) if fmt.group else n4, asym=fmt.asym)[1],
                     I8.dequantize_int(I8.quantize_int(big, s8), s8)], dim=-1)
    return torch.empty_like(deq).scatter_(-1, order, deq)


def v4_effective(v: torch.Tensor, spec: dict, cal: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """V as the PV MMA sees it under the 4-bit format ``spec`` ({format, sink, fp16} from :func:`parse`) and
    mu_V to add to the normalized output (``centre``; else None). Prefill (default): the pre-pass writes
    today's FP8 tile image, one E4M3 rounding of the dequantized value under V's fixed per-channel scales
    (of the centred / rotated values); ``fp16`` (``~f``): the dequantized value rounded to fp16, as decode
    converts in registers. ``sink`` (``~s``): the first ``SINK_TOKENS`` rows stored FP8 under those scales."""
    fmt = V4_FORMATS[spec["format"]]
    x, scale, mean = v.float(), cal["v_scale"], None
    if fmt.centre:
        mean = cal["mu_v"]
        x, scale = x - mean, cal["v_scale_s"]
    if fmt.rotate:
        h = hadamard(x.shape[-1], dtype=torch.float32, device=x.device)
        x, scale = x @ h, cal["v_scale_h"]
    deq = v4_quantize(x, fmt, cal.get("v_o8"))
    deq = deq.half().float() if spec["fp16"] else quantize_e4m3(deq, scale).float() * scale
    if spec["sink"]:
        deq[:SINK_TOKENS] = quantize_e4m3(x[:SINK_TOKENS], scale).float() * scale
    return (deq @ h.T if fmt.rotate else deq), mean


def _pad4(n: int) -> int:
    return n + (-n) % 4


def v4_bytes(name: str, head_dim: int = 128) -> int:
    """Bytes of V per token and KV head: packed 4-bit codes (D/2, or 7D/16 beside D/8 INT8 bytes) and the
    fp16 parameters (a scale per group, a zero point per group if asymmetric, the INT8 channels' scale),
    each field padded to 4 bytes as the cache's fields are (cp.async copies 4 bytes or more; a page's
    16 rows of any field are then a whole number of 16-byte loads)."""
    fmt = V4_FORMATS[name]
    n8 = head_dim // 8 if fmt.outliers else 0
    groups = head_dim // fmt.group if fmt.group else 1
    params = groups * (2 if fmt.asym else 1) + (1 if fmt.outliers else 0)
    param_bytes = 2 * params - (groups if fmt.zp_code else 0)     # a code zero point is one byte, not two
    return _pad4(n8) + _pad4((head_dim - n8) // 2) + _pad4(param_bytes)


def cache_bytes(cfg: dict, head_dim: int = 128) -> dict:
    """Cache bytes of a configuration per token and KV head (K + V; bf16 where not quantized), its ratio to
    bf16's, and the first page's extra bytes per sequence and KV head where V keeps it FP8 (``~s``);
    empty for K formats without a cache layout here."""
    k_bytes = {None: 2 * head_dim, "ki8": I8.k_bytes_per_token_head("int8", head_dim), "k8": head_dim + 4,
               "ki4": I8.k_bytes_per_token_head("i4rs", head_dim), "kt8": head_dim}
    k_bytes.update(ki8t=k_bytes["ki8"], ki4t=k_bytes["ki4"])      # the same caches, read under tile scales
    if cfg["k"] not in k_bytes or cfg["sink"]:
        return {}
    v4 = cfg.get("v4")
    v = v4_bytes(v4["format"], head_dim) if v4 else head_dim if cfg["v"] else 2 * head_dim
    out = {"bytes_d128": k_bytes[cfg["k"]] + v, "x_bf16": 4 * head_dim / (k_bytes[cfg["k"]] + v)}
    if v4 and v4["sink"]:
        out["sink_page_extra_bytes"] = SINK_TOKENS * (head_dim - v)
    return out


def equalizer(k_cal: torch.Tensor) -> torch.Tensor:
    """Per (KV head, channel) power-of-two t = 2^round(log2 rms) of calibration keys ``[T, H_kv, D]``."""
    rms = k_cal.double().pow(2).mean(dim=0).sqrt().clamp_min(1e-6)
    return torch.exp2(torch.round(torch.log2(rms))).float()


# ---------------------------------------------------------------------------------------------
# configurations

P_ROUNDING = {"p16": torch.float16, "pbf": torch.bfloat16}     # P rounded to a 16-bit PV MMA operand
Q_TILES = {"qi8s64": 64, "qi8sH": 1 << 30}                       # Q tile rows where not Q_TILE (H: one per head)


def parse(name: str) -> dict:
    """``"q8s+k4@all+p8+v8"`` -> {'q': 'q8s', 'k': 'k4', 'eq': False, 'mu': 'all', 'p': True, 'v': True}.
    ``exact`` is nothing quantized. K's mu_K source follows ``@`` (none|first|all; default none).
    ``p`` is True (FP8), ``"p16"`` / ``"pbf"`` or False; ``v`` is True (``v8``), ``"s"`` (``v8s``), ``"s_sink"`` (``v8s~s``), ``"i8"``
    (``vi8``), ``"t8"``, ``"4"`` (a 4-bit V: ``v4`` = {format, sink, fp16}) or False."""
    cfg = {"name": name, "q": None, "k": None, "eq": False, "mu": "none", "sink": False, "p": False, "v": False,
           "corr": None}
    if name == "exact":
        return cfg
    for part in name.split("+"):
        if part in ("q8", "q8s", "qi8", "qi8s", "qi8s64", "qi8sH"):
            cfg["q"] = part
        elif part == "p8":
            cfg["p"] = True
        elif part in P_ROUNDING:
            cfg["p"] = part
        elif part == "v8":
            cfg["v"] = True
        elif part == "v8s":
            cfg["v"] = "s"
        elif part == "v8s~s":
            cfg["v"] = "s_sink"
        elif part == "vi8":
            cfg["v"] = "i8"
        elif part == "vt8":
            cfg["v"] = "t8"
        elif m := re.fullmatch(r"(v4[a-z0-9]+?)(~s)?(~f)?", part):
            if m.group(1) not in V4_FORMATS:
                raise ValueError(f"unknown part {part!r} in {name!r}")
            cfg["v"] = "4"
            cfg["v4"] = {"format": m.group(1), "sink": bool(m.group(2)), "fp16": bool(m.group(3))}
        else:
            m = re.fullmatch(r"(eq)?(k\w+?)(?:@(none|first|all))?(~s|~b)?(~cf|~c)?", part)
            if not m or m.group(2) not in K_FORMATS:
                raise ValueError(f"unknown part {part!r} in {name!r}")
            cfg["k"], cfg["eq"], cfg["mu"] = m.group(2), bool(m.group(1)), m.group(3) or "none"
            cfg["sink"] = bool(m.group(4))
            cfg["sink_exact"] = m.group(4) == "~b"
            cfg["corr"] = {None: None, "~c": "all", "~cf": "first"}[m.group(5)]
    return cfg


V1_IMPL = "q8s+k4@all+p8+v8"        # the FP8-QK recipes before the integer QK (FP8 Q, 4-bit K / FP8 K)
V1_IMPL8 = "q8s+k8@all+p8+v8"

ALONE = ["q8", "q8s", "k4", "k4@first", "k4@all", "p8", "v8", "k8", "k8@all"]
K_VARIANTS = ["k4e", "k4e@all", "k4f", "k4f@all", "k4m", "k4m@all", "k4b8", "k4b8@all", "k4b8e", "k4t", "k4t@all",
              "eqk4", "eqk4@all", "eqk4e", "eqk4t", "eqk4t@all", "eqk4b8",
              "k4~s", "k4@first~s", "k4@all~s", "k4e~s", "k4e@all~s", "k4m~s", "k4m@all~s", "k4b8e@all~s"]
COMBINED = [V1_IMPL, "q8s+k4+p8+v8", "q8+k4@all+p8+v8", "q8+k4+p8+v8", V1_IMPL8, "q8s+k8+p8+v8",
            "q8s+k4e@all+p8+v8", "q8s+k4e+p8+v8", "q8s+k4m+p8+v8", "q8s+k4b8+p8+v8", "q8s+eqk4+p8+v8",
            "q8s+k4@all~s+p8+v8", "q8s+k4e@all~s+p8+v8", "q8s+k4m@all~s+p8+v8", "q8s+k4e~s+p8+v8", "q8s+p8+v8"]
# The recipes as implemented (kernel.py: smoothing + compensation)
IMPL8 = "qi8s64+ki8@all+p8+v8"          # qk8pv8: INT8 Q per 64-row tile (smoothed) and INT8 K per token
IMPL = "qi8s64+ki4@all+p8+v8"           # qk4pv8: INT8 Q and i4rs K (16-channel blocks, MSE scales)
PEER_FP8KV = "kt8+vt8"                  # SGLang's fp8_e4m3 KV cache (FlashInfer), per-tensor scale 1.0
INT_CONFIGS = ["qi8", "qi8s", "ki8", "ki8@all", "ki4@all", "ki4b8@all", "ki4u@all", "ki4ub8@all", "ki4t127@all",
               "ki8@all~c", "ki4@all~c", "kt8", "vt8", PEER_FP8KV,
               IMPL8, IMPL, "qi8s+ki4b8@all+p8+v8", "qi8s+ki4u@all+p8+v8", "qi8s+ki8@all~c+p8+v8",
               "qi8s+ki4@all~c+p8+v8", "q8s+ki8@all+p8+v8", "qi8s+k8@all+p8+v8"]
# qk8pv8's Q / P / V budget (K as implemented): each part alone, each cheaper variant swapped into the
# recipe, and their combinations
ISSUE20_PV = ["exact", "ki8@all", "qi8s+ki8@all", "qi8s64+ki8@all", "qi8s+ki8@all+p8", "qi8s+ki8@all+v8",
              "qi8s+ki8@all+v8s", IMPL8, "ki8@all+p8+v8",
              "qi8s+ki8@all+p8+v8", "qi8s+ki8@all+p8+v8s", "qi8s+ki8@all+p16+v8", "qi8s+ki8@all+pbf+v8",
              "qi8s64+ki8@all+p8+v8s", "qi8s+ki8@all+p16+v8s", "qi8s64+ki8@all+p16+v8s",
              "qi8s+ki8@all+vi8", "qi8s+ki8@all+p16+vi8", "qi8s64+ki8@all+p16+vi8", "qi8s+ki8@all+p8+v8s~s",
              "qi8s64+ki8@all+p16+v8s~s", "v8s~s",
              "qi8s", "qi8s64", "p8", "p16", "pbf", "v8", "v8s", "vi8"]
# issue 33: qk4pv8's Q, K and P as implemented with a 4-bit V (prefill numerics; ``~f``: V as decode's fp16)
IMPL_QKP = "qi8s64+ki4@all+p8"
ISSUE33_V4 = [IMPL, PEER_FP8KV] + [f"{IMPL_QKP}+{v}" for v in ("v4t", "v4b32", "v4b32m", "v4a32", "v4a32h~s",
                                                                "v4a32o8~s", "v4ato8~s", "v4a32~s", "v4a32h")]
ALL_CONFIGS = list(dict.fromkeys(["exact"] + ALONE + K_VARIANTS + COMBINED + INT_CONFIGS + ISSUE20_PV + ISSUE33_V4))


def _expand(x, heads):
    kv = x.shape[1]
    return x.repeat_interleave(heads // kv, dim=1) if heads != kv else x


def calibrate(k_ctx: torch.Tensor, v_ctx: torch.Tensor, mu: str, n_cal: int = N_CAL,
              q_ctx: torch.Tensor | None = None) -> dict:
    """Fixed per-(KV head) quantities from the context: mu_K, the equalizer of K - mu_K, V scales, mu_V
    and the scales of V - mu_V (``v8s``), of V H (``v4...h``), V's INT8 channels (``v4...o8``: from the first
    ``n_cal`` values); with ``q_ctx`` also mu_Q per query head for the stored
    correction (``mu_q``: all rows, ``mu_q_first``: the first ``n_cal``)."""
    kf = k_ctx.float()
    if mu == "none":
        mu_k = torch.zeros_like(kf[0])
    elif mu == "first":
        mu_k = kf[:n_cal].mean(dim=0)
    elif mu == "all":
        mu_k = kf.mean(dim=0)
    else:
        raise ValueError(mu)
    vf = v_ctx.float()
    mu_v = vf.mean(dim=0)
    out = {"mu_k": mu_k, "t": equalizer(kf - mu_k), "v_scale": _v_scale(vf), "mu_v": mu_v,
           "v_scale_s": _v_scale(vf - mu_v), "v_scale_i8": I8.row_scale(vf.abs().amax(dim=0), I8.INT8_MAX),
           "v_o8": v4_outlier_channels(vf[:n_cal])}
    d = vf.shape[-1]
    if d & (d - 1) == 0:
        out["v_scale_h"] = _v_scale(vf @ hadamard(d, dtype=torch.float32, device=vf.device))
    if q_ctx is not None and q_ctx.shape[0] > 0:
        out["mu_q"] = q_ctx.float().mean(dim=0)
        out["mu_q_first"] = q_ctx[:n_cal].float().mean(dim=0)
    return out


def _v_scale(v: torch.Tensor) -> torch.Tensor:
    """Per-(KV head, channel) E4M3 scale of values ``[m, H_kv, D]``: 2 * amax / 448 (1 where all zero)."""
    amax = v.abs().amax(dim=0)
    return torch.where(amax > 0, amax * 2.0 / E4M3_MAX, torch.ones_like(amax))


def stored_correction(mu_q: torch.Tensor, ks: torch.Tensor, k_eff: torch.Tensor, target: float) -> torch.Tensor:
    """``[heads, keys]``: mu_Q . (K~ - K_q) per query head and key, stored as E4M3 of the value over the
    key's scale (row amax of K~ over ``target``, the scale the K format stores) and multiplied back."""
    heads = mu_q.shape[0]
    dk = _expand((ks - k_eff).double(), heads)                       # [keys, heads, D]
    c = torch.einsum("hd,khd->hk", mu_q.double(), dk)
    s = _expand(amax_scale(ks.abs().amax(dim=-1), target).unsqueeze(-1), heads)[..., 0].T   # [heads, keys]
    return quantize_e4m3(c.float(), s).float().double() * s.double()


def quantized_attention(q, k, v, cfg: dict, *, causal: bool = True, sm_scale: float | None = None,
                        cal: dict | None = None, dtype=torch.float64):
    """Attention of ``q [n, H, D]`` over ``k, v [m, H_kv, D]`` with ``cfg``'s quantization (float64
    scores/softmax/PV otherwise). Returns (o ``[n, H, D]``, the effective K as scored ``[m, H_kv, D]``)."""
    heads, d = q.shape[1], q.shape[2]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    cal = cal or calibrate(k, v, cfg["mu"], q_ctx=q)
    qf, kf = q.float(), k.float()
    if cfg["k"] is not None:
        ks = kf - cal["mu_k"]
        if cfg["eq"]:
            t = cal["t"]
            ks = ks / t
            qf = qf * _expand(t.unsqueeze(0), heads)[0]
        k_eff = K_FORMATS[cfg["k"]](ks)
        if cfg["sink"]:      # the first page (the attention-sink token and its neighbours) in FP8 per token
            sink = ks[:SINK_TOKENS] if cfg.get("sink_exact") else k8(ks[:SINK_TOKENS])   # "~b": kept exact (bf16)
            k_eff = torch.cat([sink, k_eff[SINK_TOKENS:]])
    else:
        k_eff = kf
    ke = _expand(k_eff.to(dtype), heads)
    bias = None
    if cfg["q"] is not None:
        smooth = cfg["q"] in ("q8s", "qi8s", "qi8s64", "qi8sH")
        quant = I8.quantize_q_per_tile if cfg["q"].startswith("qi") else quantize_per_tile
        tile = min(Q_TILES.get(cfg["q"], Q_TILE), max(1, q.shape[0]))   # qi8sH: one tile of all the rows
        mu = qf.mean(dim=0) if smooth and q.shape[0] > 0 else torch.zeros_like(qf[0])
        q_eff = torch.empty_like(qf, dtype=dtype)
        for h in range(heads):
            q8, scale = quant(qf[:, h] - mu[h], tile)
            q_eff[:, h] = q8.to(dtype) * scale.repeat_interleave(tile)[: q.shape[0]].unsqueeze(-1).to(dtype)
        if smooth:
            bias = torch.einsum("hd,khd->hk", mu.to(dtype), ke)
    else:
        q_eff = qf.to(dtype)
    if cfg.get("corr"):
        if cfg["eq"] or cfg["sink"]:
            raise ValueError(f"{cfg['name']}: the stored correction ~c is defined without eq / sink pages")
        key = "mu_q" if cfg["corr"] == "all" else "mu_q_first"
        if key not in cal:
            raise ValueError(f"{cfg['name']}: the calibration has no mu_Q (calibrate(..., q_ctx=queries))")
        corr = stored_correction(cal[key], ks, k_eff, K_SCALE_TARGET.get(cfg["k"], I8.I4RS_TARGET)).to(dtype)
        bias = corr if bias is None else bias + corr
    v_mean = None
    if cfg["v"] == "4":
        v_eff, v_mean = v4_effective(v, cfg["v4"], cal)
    elif cfg["v"] == "t8":
        v_eff = quantize_e4m3(v.float(), 1.0).float()
    elif cfg["v"] == "i8":
        v_eff = I8.dequantize_int(I8.quantize_int(v.float(), cal["v_scale_i8"]), cal["v_scale_i8"])
    elif cfg["v"] in ("s", "s_sink"):
        v_mean = cal["mu_v"]
        vc = v.float() - v_mean
        if cfg["v"] == "s_sink":
            vc[:SINK_TOKENS] = v[:SINK_TOKENS].float()
        v_eff = quantize_e4m3(vc, cal["v_scale_s"]).float() * cal["v_scale_s"]
    elif cfg["v"]:
        v_eff = quantize_e4m3(v.float(), cal["v_scale"]).float() * cal["v_scale"]
    else:
        v_eff = v.float()
    if cfg["p"] in P_ROUNDING:
        def p_quant(p):
            return p.to(P_ROUNDING[cfg["p"]]).to(dtype)
    elif cfg["p"]:
        def p_quant(p):
            return quantize_e4m3(p * P_SCALE, 1.0).to(dtype) / P_SCALE
    else:
        def p_quant(p):
            return p
    o = _run_blocked(q_eff, ke, _expand(v_eff.to(dtype), heads), bias, causal=causal, sm_scale=sm_scale,
                     p_quant=p_quant)
    if v_mean is not None:     # in the epilogue, after the division by l (module docstring, ``v8s``)
        mean_weight = 1.0
        if cfg["v"] == "s_sink":  # 1 - l_sink / l: the uncentred first keys carry their own mean
            sink = torch.zeros(k.shape[0], heads, 1, dtype=dtype, device=o.device)
            sink[:SINK_TOKENS] = 1.0
            mean_weight = 1.0 - _run_blocked(q_eff, ke, sink, bias, causal=causal, sm_scale=sm_scale,
                                             p_quant=lambda p: p)
        o = o + _expand(v_mean.to(dtype).unsqueeze(0), heads)[0] * mean_weight
    return o, k_eff


def _run_blocked(q, k, v, bias, *, causal, sm_scale, p_quant):
    """:func:`_run` over causal blocks of ``Q_BLOCK`` query rows, each with only the keys it can see
    (the masked rest of a row adds exact zeros): the same numbers, about half the work at n = m."""
    n, m = q.shape[0], k.shape[0]
    if not causal or n <= Q_BLOCK:
        return _run(q, k, v, bias, causal=causal, sm_scale=sm_scale, p_quant=p_quant)[0]
    out = []
    for s in range(0, n, Q_BLOCK):
        e = min(n, s + Q_BLOCK)
        mk = m - n + e
        out.append(_run(q[s:e], k[:mk], v[:mk], None if bias is None else bias[:, :mk], causal=True,
                        sm_scale=sm_scale, p_quant=p_quant)[0])
    return torch.cat(out)


def budget(inputs, configs=ALL_CONFIGS, *, contexts=None, n_cal: int = N_CAL, sm_scale=None) -> dict:
    """Error of each config over ``inputs`` = [(q [n, H, D], k [m, H_kv, D], v [m, H_kv, D])] (one
    per layer; queries are the last n of the m tokens, causal). Returns {config: metrics}; metrics
    has rel_l2, cos, max_abs, per_layer_rel_l2."""
    refs = [attention(q, k, v, causal=True, sm_scale=sm_scale, dtype=torch.float64)[0] for q, k, v in inputs]
    cfgs = [parse(c) if isinstance(c, str) else c for c in configs]
    acc = {c["name"]: ErrorAccumulator() for c in cfgs}
    for (q, k, v), ref in zip(inputs, refs):
        cals = {mu: calibrate(k, v, mu, n_cal, q_ctx=q) for mu in ("none", "first", "all")}
        for c in cfgs:
            o, _ = quantized_attention(q, k, v, c, sm_scale=sm_scale, cal=cals[c["mu"]])
            acc[c["name"]].add(o, ref)
    out = {}
    by_name = {c["name"]: c for c in cfgs}
    for name, a in acc.items():
        out[name] = {**a.result(), "per_layer_rel_l2": a.per_part, **cache_bytes(by_name[name])}
    return out


def block_scale_stats(ks: list[torch.Tensor], mu: str = "all") -> list[dict]:
    """Where i4rs's MSE block scale sits relative to the rounded-up one (ceil(amax / 7)), over the keys
    ``ks`` (one ``[m, H_kv, D]`` per layer, smoothed with mu_K of ``mu``): the share of blocks per offset
    b_mse - b_up (0, -1, ... -4, below -4, above 0) and the mean b. A narrow spread lets the append kernel
    search a window below b_up instead of all 18 scales."""
    out = []
    for block in I8.I4RS_BLOCKS:
        hist = torch.zeros(7, dtype=torch.float64)
        b_sum = n = 0.0
        for k in ks:
            kf = k.float()
            x = kf - (kf.mean(dim=0) if mu == "all" else 0.0)
            d = x.shape[-1]
            ts = amax_scale(x.abs().amax(dim=-1), I8.I4RS_TARGET).unsqueeze(-1)
            y = (x * (1.0 / ts))[..., ~I8.rope_low_channels(d).to(x.device)]
            y = y.reshape(*y.shape[:-1], y.shape[-1] // block, block)
            b_m = I8.choose_block_scales(y, "mse")[0].long()
            b_u = I8.choose_block_scales(y, "up")[0].long()
            off = (b_m - b_u).flatten()
            for i, j in enumerate(range(0, -5, -1)):
                hist[i] += float((off == j).sum())
            hist[5] += float((off < -4).sum())
            hist[6] += float((off > 0).sum())
            b_sum += float(b_m.sum())
            n += off.numel()
        share = (hist / max(n, 1)).tolist()
        out.append({"block": block, "blocks": int(n), "mean_b": b_sum / max(n, 1),
                    "share_offset": dict(zip(["0", "-1", "-2", "-3", "-4", "<-4", ">0"], share))})
    return out


# ---------------------------------------------------------------------------------------------
# diagnostics: why does K smoothing hurt?

def k_diagnostics(inputs, n_cal: int = N_CAL, sm_scale=None) -> list[dict]:
    """Per (layer, KV head): large-mean channels, amax, K error and the logit noise it causes, for
    ``k4`` with mu_K = 0 (tag ``none``), mu_K of all keys (``all``) and the latter with the first page
    in FP8 (``all_s``). Where the error lands: the first-order change of the probabilities,
    dp_j = p_j (e_j - sum_i p_i e_i) with e = sm * Q . dK, summed as dp^2 over queries and the group's
    heads, and its shares: key 0, keys 1-15, the 16 most recent keys of each query (``recent16``),
    the largest other single positions (``dp_top_keys_*``: [position, share]), and per 16-channel block
    of dK (``dp_block_share_*``; cross terms between blocks left out) and from the large-mean channels."""
    rows = []
    for layer, (q, k, v) in enumerate(inputs):
        heads, d = q.shape[1], q.shape[2]
        sm = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
        group = heads // k.shape[1]
        kf, qf = k.double(), q.double()
        m, n = k.shape[0], q.shape[0]
        mask = torch.arange(m).unsqueeze(0) > torch.arange(n).unsqueeze(1) + (m - n)
        for h in range(k.shape[1]):
            kk = kf[:, h]
            mu, sd = kk.mean(0), kk.std(0).clamp_min(1e-9)
            big = (mu.abs() / sd) > 2.0
            r = {"layer": layer, "kv_head": h, "max_mean_over_sd": float((mu.abs() / sd).max()),
                 "n_mean_channels": int(big.sum()), "tok_amax": float(kk.abs().amax(1).median()),
                 "tok_amax_smoothed": float((kk - mu).abs().amax(1).median())}
            qh = qf[:, h * group:(h + 1) * group]
            dist = (torch.arange(n).unsqueeze(1) + (m - n)) - torch.arange(m).unsqueeze(0)    # query pos - key pos
            recent = (dist >= 0) & (dist < SINK_TOKENS)
            for tag, mu_used in (("none", torch.zeros_like(mu)), ("all", mu), ("all_s", mu)):
                ks = (kk - mu_used).float()
                k_eff = k4(ks)
                if tag == "all_s":
                    k_eff = torch.cat([k8(ks[:SINK_TOKENS]), k_eff[SINK_TOKENS:]])
                dk = k_eff.double() - ks.double()
                w = torch.zeros(m, dtype=torch.float64)
                w_recent = 0.0
                blocks = range(0, d, BLOCK)
                w_block = [0.0] * len(blocks)
                w_big = 0.0
                r[f"k_rel_err_{tag}"] = float(dk.norm() / ks.double().norm())
                # logit noise: sm * Q . dK over visible keys, row mean removed (softmax-invariant part dropped)
                tot = chan_big = sink_err = sink_p = 0.0
                cnt = 0
                for gq in range(group):
                    qq = qh[:, gq]
                    p = torch.softmax((sm * qq @ kk.T).masked_fill(mask, -math.inf), dim=-1)
                    e_s = sm * qq @ dk.T
                    # first-order output error comes from the p-weighted spread of the score error
                    e_p = e_s - (p * e_s).sum(-1, keepdim=True)
                    dp2 = (p * e_p).pow(2)
                    w += dp2.sum(0)
                    w_recent += float(dp2[recent].sum())

                    def part_dp2(ch):
                        e_c = sm * qq[:, ch] @ dk[:, ch].T
                        return float((p * (e_c - (p * e_c).sum(-1, keepdim=True))).pow(2).sum())
                    for i, b in enumerate(blocks):
                        w_block[i] += part_dp2(slice(b, b + BLOCK))
                    w_big += part_dp2(big) if bool(big.any()) else 0.0
                    sink_err += float(e_p[:, 0].abs().mean()) / group
                    sink_p += float(p[:, 0].mean()) / group
                    e = (sm * qq @ dk.T).masked_fill(mask, float("nan"))                      # [n, m]
                    e_big = (sm * qq[:, big] @ dk[:, big].T).masked_fill(mask, float("nan"))
                    e = e - e.nanmean(1, keepdim=True)
                    e_big = e_big - e_big.nanmean(1, keepdim=True)
                    tot += float(e.nan_to_num().pow(2).sum())
                    chan_big += float(e_big.nan_to_num().pow(2).sum())
                    cnt += int((~mask).sum())
                r[f"sink_logit_err_{tag}"] = sink_err
                r["p_sink"] = sink_p
                r["k0_norm_rel"] = float((kk[0] - mu_used).norm() / (kk - mu_used).norm(dim=1).median())  # last: 'all'
                r[f"k0_norm_rel_{tag}"] = r.pop("k0_norm_rel")
                r[f"logit_noise_{tag}"] = math.sqrt(tot / cnt)
                r[f"logit_noise_meanch_{tag}"] = math.sqrt(chan_big / cnt)
                wt = float(w.sum()) or 1.0
                top = torch.topk(w[1:], min(3, m - 1))
                r[f"dp_share_key0_{tag}"] = float(w[0]) / wt
                r[f"dp_share_keys1_15_{tag}"] = float(w[1:SINK_TOKENS].sum()) / wt
                r[f"dp_share_recent16_{tag}"] = w_recent / wt
                r[f"dp_top_keys_{tag}"] = [[int(i) + 1, float(x) / wt] for x, i in zip(top.values, top.indices)]
                wb = sum(w_block) or 1.0
                r[f"dp_block_share_{tag}"] = [x / wb for x in w_block]
                r[f"dp_meanch_share_{tag}"] = w_big / wb
            rows.append(r)
    return rows


# ---------------------------------------------------------------------------------------------
# model level

_STATE: list = []


def _budget_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    cfg, dtype = _STATE[-1]
    q = query[0].transpose(0, 1).to(torch.bfloat16)
    k = key[0].transpose(0, 1).to(torch.bfloat16)
    v = value[0].transpose(0, 1).to(torch.bfloat16)
    o, _ = quantized_attention(q, k, v, cfg, sm_scale=scaling, cal=calibrate(k, v, cfg["mu"], q_ctx=q), dtype=dtype)
    return o.unsqueeze(0).to(query.dtype), None


@torch.no_grad()
def model_ppl(mdl, ids: torch.Tensor, configs, dtype=torch.float64) -> list[dict]:
    """Perplexity / KL(exact || config) / top-1 agreement of each config on ``ids`` (one forward of the
    whole sequence, causal; calibration from the same forward). ``dtype``: the attention's scores,
    softmax and PV (float32 is ~2x faster on CPU; it changes one call's output by ~1e-7 relative, but
    the rounding flips it causes in later layers moved qk4pv8's ppl at 1K by 0.3% and its KL by 6%)."""
    from transformers import AttentionInterface
    AttentionInterface.register("mpfa_budget", _budget_attention)
    rows, base = [], None
    ids = ids.to(mdl.lm_head.weight.device)
    tgt = ids[1:]
    for name in configs:
        t0 = time.time()
        _STATE.append((parse(name), dtype))
        mdl.set_attn_implementation("mpfa_budget")
        try:
            h = mdl.model(input_ids=ids.unsqueeze(0), use_cache=False).last_hidden_state[0]
        finally:
            _STATE.pop()
            mdl.set_attn_implementation("sdpa")
        logp = torch.log_softmax(mdl.lm_head(h[:-1]).double(), dim=-1)
        nll = float(-logp.gather(1, tgt[:, None]).mean())
        row = {"config": name, "tokens": int(ids.shape[0]), "nll": nll, "ppl": math.exp(nll),
               **cache_bytes(parse(name))}
        if base is None:
            base, row["kl"], row["top1_agree"] = logp, 0.0, 1.0
        else:
            row["kl"] = float((base.exp() * (base - logp)).sum(-1).mean())
            row["top1_agree"] = float((base.argmax(-1) == logp.argmax(-1)).double().mean())
        rows.append(row)
        _log(f"model {name}: ppl {row['ppl']:.4f} kl {row['kl']:.5f} ({time.time() - t0:.1f}s)")
    b = rows[0]["ppl"]
    for r in rows:
        r["ppl_increase"] = r["ppl"] / b - 1
    return rows


# ---------------------------------------------------------------------------------------------

def _log(msg):
    print(f"[error_budget] {msg}", file=sys.stderr, flush=True)


def summarize(rows: list[dict]) -> dict:
    """Key figures, from the rows only."""
    k = {r["id"]: r for r in rows if r.get("kind") == "kernel"}
    out = {}
    for key, r in k.items():
        if r.get("source", "").endswith("-activations") and r["config"] in (V1_IMPL, "k4", "k4@all", "k4e", "eqk4", "eqk4t", "k4b8",
                                                                 "q8s", "p8", "v8", V1_IMPL8, "k4@all~s", "k4e@all~s",
                                                                 "q8s+k4@all~s+p8+v8", "q8s+k4e@all~s+p8+v8",
                                                                 IMPL8, IMPL, PEER_FP8KV, "ki8@all",
                                                                 "ki4@all", "ki4b8@all", "qi8s",
                                                                 *ISSUE20_PV):
            out[f"{r['context']}/{r['config']}"] = round(r["rel_l2"], 4)
    mod = [r for r in rows if r.get("kind") == "model"]
    if mod:
        out["model_ppl_increase"] = {r["config"]: round(r["ppl_increase"], 4) for r in mod}
        out["model_kl"] = {r["config"]: round(r["kl"], 5) for r in mod}
    return {"rel_l2": out}


def check_sizes(ap, args) -> None:
    """Parser errors for sizes the study cannot take: counts below 1, a context shorter than its queries (the
    last --q-len tokens of each context are the queries)."""
    for flag, v, least in (("--q-len", args.q_len, 1), ("--model-tokens", args.model_tokens, 1),
                           ("--skip-tokens", args.skip_tokens, 0)):
        if v < least:
            ap.error(f"{flag} must be at least {least}, got {v}")
    short = [c for c in args.contexts if c < args.q_len]
    if short:
        ap.error(f"--contexts: each must be at least --q-len {args.q_len} (its last --q-len tokens are the "
                 f"queries), got {short[0]}")


def main(argv=None) -> int:
    ap = cli.Parser(prog="python -m benchmarks.accuracy.error_budget", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--q-len", type=int, default=256)
    ap.add_argument("--model-tokens", type=int, default=1024)
    ap.add_argument("--model-configs", nargs="+", default=["exact", IMPL8, IMPL, V1_IMPL8, V1_IMPL, "q8s+k4+p8+v8", "q8s+k4e@all+p8+v8",
                                                           "q8s+k4@all~s+p8+v8", "q8s+k4m@all~s+p8+v8",
                                                           "q8s+k4e@all~s+p8+v8", "q8s+eqk4+p8+v8"])
    ap.add_argument("--configs", nargs="+", default=ALL_CONFIGS)
    ap.add_argument("--out", type=Path, default=Path("/tmp/mpfa-error-budget"))
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--text", choices=["kjv", "stdlib"], default="kjv")
    ap.add_argument("--skip-tokens", type=int, default=0, help="start this many tokens into the text")
    ap.add_argument("--capture-cache", type=Path, default=None, help="torch.save file of the captured Q/K/V")
    ap.add_argument("--model-dtype", choices=["float64", "float32"], default="float64",
                    help="precision of the model-level attention (scores, softmax, PV)")
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--no-synthetic", action="store_true")
    ap.add_argument("--no-diagnostics", action="store_true", help="skip the per-(layer, KV head) diag rows")
    ap.add_argument("--device", default="cpu",
                    help="where the model (float32 weights, as on CPU) and the simulated attention run; the same "
                         "numerics in float32/float64 on a GPU, only faster (the reductions' order differs)")
    argv_used = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv_used)
    check_sizes(ap, args)
    from . import data, kernel
    from . import model as M
    from .run import _tokens
    torch.set_grad_enabled(False)
    rows = []
    from benchmarks.meta import git_commit
    meta = {"suite": "error_budget", "command": "python -m benchmarks.accuracy.error_budget " + " ".join(argv_used),
            "commit": git_commit(), "torch": torch.__version__, "q_len": args.q_len, "q_tile": Q_TILE,
            "model_tokens": args.model_tokens, "model_dtype": args.model_dtype, "text": args.text,
            "skip_tokens": args.skip_tokens,
            "n_cal": N_CAL, "model": M.MODEL_NAME, "device": args.device, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}

    def add(source, ctx, qlen, shape, res):
        for name, r in res.items():
            rows.append({"id": f"kernel/{source}/{ctx}/{name}", "kind": "kernel", "source": source, "context": ctx,
                         "q_len": qlen, **shape, "config": name, **r})

    if not args.no_synthetic:
        for outl in (False, True):
            src = "outlier" if outl else "gaussian"
            t0 = time.time()
            q, k, v = kernel.synthetic(1024, args.q_len, 8, 2, 128, outliers=outl)
            add(src, 1024, args.q_len, {"heads": 8, "kv_heads": 2, "head_dim": 128}, budget([(q, k, v)], args.configs))
            _log(f"synthetic {src}: {time.time() - t0:.1f}s")

    why = M.missing_requirements()
    if why:
        rows.append({"id": "kjv", "kind": "kernel", "status": "skipped", "reason": why})
        _log(f"real activations skipped: {why}")
    else:
        mdl, tok = M.load(args.device, dtype=torch.float32)
        text = data.text(args.text, args.data_dir) if args.data_dir else data.text(args.text)
        top = max(args.contexts + [args.model_tokens])
        skip = args.skip_tokens
        if args.capture_cache and args.capture_cache.is_file():
            cap = torch.load(args.capture_cache)["cap"]
        else:
            ids = _tokens(tok, text, skip + top)[skip:]
            cap = M.capture(mdl, ids)
            if args.capture_cache:
                torch.save({"ids": ids, "cap": cap}, args.capture_cache)
        shape = {"heads": cap[0][0].shape[1], "kv_heads": cap[0][1].shape[1], "head_dim": cap[0][0].shape[2],
                 "layers": len(cap)}
        for ctx in args.contexts:
            t0 = time.time()
            inputs = [(q[ctx - args.q_len:ctx].to(args.device), k[:ctx].to(args.device), v[:ctx].to(args.device))
                      for q, k, v in cap]
            add(f"{args.text}-activations", ctx, args.q_len, shape, budget(inputs, args.configs))
            for r in block_scale_stats([k for _, k, _ in inputs]):
                rows.append({"id": f"blocks/{args.text}/{ctx}/{r['block']}", "kind": "i4rs_blocks", "context": ctx, **r})
            _log(f"{args.text} {ctx}: {time.time() - t0:.1f}s")
            for r in ([] if args.no_diagnostics else k_diagnostics(inputs)):
                rows.append({"id": f"diag/{ctx}/{r['layer']}/{r['kv_head']}", "kind": "diag", "context": ctx, **r})
        if not args.no_model:
            ids = _tokens(tok, text, skip + args.model_tokens)[skip:]
            for r in model_ppl(mdl, ids, args.model_configs, getattr(torch, args.model_dtype)):
                rows.append({"id": f"model/{args.text}/{args.model_tokens}/{r['config']}", "kind": "model",
                             "text": args.text, "skip_tokens": skip, **r})
    from benchmarks.results_io import write
    path = write("error_budget", meta, summarize(rows), rows, args.out)
    _log(f"wrote {path}")
    for r in rows:
        if r.get("kind") == "kernel" and "rel_l2" in r:
            print(f"{r['source']:16s} {r['context']:5d} {r['config']:24s} rel_l2 {r['rel_l2']:.4f} cos {r['cos']:.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
