"""Specs of the batch prefill/extend kernel (templates/prefill.cu.jinja): wgmma (IGMMA + QGMMA / HGMMA) over the
paged cache; its pre-passes (mu_Q and the per-head Q scale inputs; the KV tile images with the compensation
terms) are in the same library.

Causality and the GQA group are runtime arguments (one build serves both), so a served specialization is
(recipe, head_dim, page_size, arch); its schedule and numerics are the recipe's SERVED_KNOBS."""
from __future__ import annotations

import ctypes
import math

from ..formats import COMP_DIGITS, COMP_SCALE_DIVISOR, P_SCALE, P_SCALE_POW2, Q_TILE
from ..spec import KernelSpec
from .layout import layout_context
from .support import ALL_RECIPES, HEAD_DIMS, PAGE_SIZES, check, gqa_group

OP = "prefill"
TEMPLATE = "prefill.cu.jinja"
SYMBOL = "mpfa_prefill"
SMEM_SYMBOL = "mpfa_prefill_smem_bytes"
RECIPES = ALL_RECIPES
MAX_GROUP = 8   # tested range of num_qo_heads / num_kv_heads (the kernel itself takes any group)
GROUP_SIZES = tuple(range(1, MAX_GROUP + 1))

PARAMS_LAYOUT_SYMBOL = "mpfa_prefill_params_layout"

# Tile sizes: rendered into the template (kBM, kBN, kMuRows) and used by the wrapper's schedule and workspace.
WG_ROWS = 64    # query rows per consumer warpgroup
CTA_ROWS = 3 * WG_ROWS   # query rows per CTA: three consumer warpgroups
KV_TILE = 128   # keys per K/V tile image
MU_ROWS = 128   # query rows per block of the mu_Q partial sums
# Knobs of the template and the values each accepts; every build states each one (the template has no defaults).
# The served builds are SERVED_KNOBS; the others are study variants (benchmarks/prefill_variants.py,
# benchmarks/NOTES.md), reached through mpfa.prefill's private entry points only. The paths no served build took
# (two ping-pong consumer warpgroups, persistent CTAs, exp2 on the FMA pipe, fa / fb in key order, 4 stages) are
# gone: benchmarks/NOTES.md names the commit that had them.
KNOBS = {"stages": (2, 3), "tile_scale": (0, 1), "comp_mma": (0, 1), "pv_once": (0, 1)}
# The served build of each recipe (benchmarks/NOTES.md, prefill v3). All run three consumer warpgroups of 64 rows,
# each tile's steps in order (QK -> softmax -> PV -> fold). qk4pv8 adds one K scale per 128-key tile (the pre-pass
# requantizes each K tile image to its largest token scale) so that the softmax is FlashAttention-3's, the
# compensation term as one more INT8 k-step of the QK MMA (one Q scale per request and head), both PV column
# parts before one wait, and 2 stages. qk8pv8 keeps per-key K scales and 64-row Q scales: the tile scale cost
# it 29% in KL (its INT8 K loses more to requantization than qk4pv8's 4-bit K). bf16: 2 stages (3 do not fit).
SERVED_KNOBS = {"bf16": {"stages": 2, "tile_scale": 0, "comp_mma": 0, "pv_once": 0},
                "qk8pv8": {"stages": 3, "tile_scale": 0, "comp_mma": 0, "pv_once": 0},
                "qk4pv8": {"stages": 2, "tile_scale": 1, "comp_mma": 1, "pv_once": 1}}
# qk4pv4 is qk4pv8's build: the same K, and its pre-pass writes the same FP8 V image from the 4-bit V.
SERVED_KNOBS["qk4pv4"] = dict(SERVED_KNOBS["qk4pv8"])


def build_knobs(recipe: str, knobs: dict | None = None) -> dict:
    """The knobs of a build: the served build's of ``recipe`` (SERVED_KNOBS), with a study variant's ``knobs``
    (None or {}: none) set over them; names and values checked."""
    if recipe not in SERVED_KNOBS:
        raise ValueError(f"recipe must be one of {list(SERVED_KNOBS)}, got {recipe!r}")
    if knobs is None:
        return dict(SERVED_KNOBS[recipe])
    if not isinstance(knobs, dict):
        raise ValueError(f"knobs must be a dict of prefill kernel knobs ({', '.join(KNOBS)}) or None, got {knobs!r}")
    for name, value in knobs.items():
        if value not in KNOBS.get(name, ()):
            raise ValueError(f"prefill knob {name}={value!r}: knobs and their values are {KNOBS}")
    built = {**SERVED_KNOBS[recipe], **knobs}
    if built["comp_mma"] and not built["tile_scale"]:
        raise ValueError("prefill knob comp_mma=1 needs tile_scale=1 (its digits are in units of one K scale per "
                         "tile)")
    return built


def numerics(recipe: str, knobs: dict) -> dict:
    """What a build of ``recipe`` computes beyond the recipe, as keyword arguments of mpfa.reference.batch_attention:
    ``q_tile`` (rows per INT8 Q scale), ``p_scale`` (P's scale before its E4M3 rounding), ``comp_digits`` (one Q
    scale per request and head, comp_mma) and ``k_tile`` (keys per K scale: KV_TILE with tile_scale, else None:
    one scale per key). bf16 has none of them."""
    if recipe == "bf16":
        return {}
    return {"q_tile": Q_TILE, "p_scale": p_scale(knobs), "comp_digits": bool(knobs["comp_mma"]),
            "k_tile": KV_TILE if knobs["tile_scale"] else None}


def image_bytes(recipe: str, head_dim: int) -> dict[str, int]:
    """Bytes of one KV tile's images per KV head: K (KV_TILE x head_dim MMA elements), V^T (the same: E4M3 for
    every quantized recipe, qk4pv4's 4-bit V included) and the per-key factor vector fa (quantized recipes; fb, per
    query head, has its size); and per query head, the compensation digit image of comp_mma builds (cd: KV_TILE x
    COMP_DIGITS bytes)."""
    elt = 2 if recipe == "bf16" else 1
    return {"k": KV_TILE * head_dim * elt, "v": KV_TILE * head_dim * elt, "fa": 0 if recipe == "bf16" else KV_TILE * 4,
            "cd": 0 if recipe == "bf16" else KV_TILE * COMP_DIGITS}


_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class PrefillParams(ctypes.Structure):
    """Mirror of ``PrefillParams`` (templates/include/mpfa/prefill/params.cuh), field for field."""
    _fields_ = [("q", _p), ("q_stride_t", _i64), ("q_stride_h", _i64),
                ("k", _p), ("k8", _p), ("k_block_scale", _p), ("k_scale", _p), ("v", _p), ("v_scale", _p),
                ("v_param", _p),
                ("qo_indptr", _p), ("kv_indptr", _p), ("indices", _p), ("last_page_len", _p),
                ("kv_tile_base", _p), ("tile_req", _p), ("tile_q", _p), ("kvt_req", _p), ("kvt_idx", _p),
                ("num_qo_heads", _i32), ("num_kv_heads", _i32), ("causal", _i32), ("sm_scale", _f32),
                ("num_tiles", _i32), ("num_kv_tiles", _i32), ("batch", _i32), ("mu_blocks", _i32),
                ("mu_part", _p), ("mu", _p), ("k_img", _p), ("v_img", _p), ("fa", _p), ("fb", _p),
                ("q_head", _p), ("cd_img", _p), ("out", _p), ("out_stride_t", _i64), ("out_stride_h", _i64), ("lse", _p)]


def p_scale(knobs: dict) -> float:
    """The scale of P before its E4M3 rounding in a build (formats.P_SCALE; ``tile_scale=1`` takes P_SCALE_POW2)."""
    return P_SCALE_POW2 if knobs["tile_scale"] else P_SCALE


def render_context(recipe: str, head_dim: int, knobs: dict) -> dict:
    """What the template renders besides the key: the cache layout check, the tile sizes above and P's scale."""
    img = image_bytes(recipe, head_dim)
    return dict(layout_context(recipe, head_dim), q_tile=CTA_ROWS, q_scale_rows=Q_TILE, kv_tile=KV_TILE,
                mu_rows=MU_ROWS, k_image_bytes=img["k"], v_image_bytes=img["v"], fa_bytes=img["fa"],
                log2_p_scale=repr(math.log2(p_scale(knobs))), comp_digits=COMP_DIGITS,
                comp_scale_divisor=repr(COMP_SCALE_DIVISOR))


def spec(*, recipe: str, head_dim: int, page_size: int, arch: str, group_size: int = 1,
         knobs: dict | None = None) -> KernelSpec:
    """``group_size`` (num_qo_heads / num_kv_heads) is checked against the tested range, not part of the key.
    ``knobs``: None for the served build (SERVED_KNOBS), or a study variant's knobs set over it (KNOBS,
    build_knobs); every knob joins the key."""
    check("batch-prefill", dict(recipe=recipe, head_dim=head_dim, page_size=page_size, group_size=group_size),
          dict(recipe=RECIPES, head_dim=HEAD_DIMS, page_size=PAGE_SIZES, group_size=GROUP_SIZES))
    knobs = build_knobs(recipe, knobs)
    return KernelSpec.make(OP, TEMPLATE, {"recipe": recipe, "head_dim": head_dim, "page_size": page_size, **knobs},
                           arch, symbols=(SYMBOL, SMEM_SYMBOL, PARAMS_LAYOUT_SYMBOL),
                           context=render_context(recipe, head_dim, knobs))


def server_specs(*, num_qo_heads: int, num_kv_heads: int, head_dim: int, recipe: str, page_size: int,
                 arch: str) -> list[KernelSpec]:
    """The one prefill specialization a server of this shape runs; raises when there is none."""
    return [spec(recipe=recipe, head_dim=head_dim, page_size=page_size, arch=arch,
                 group_size=gqa_group(num_qo_heads, num_kv_heads))]
