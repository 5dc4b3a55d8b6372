"""The paged KV cache of a recipe: its tensors, fixed scales and per-layer views.

Every per-token field has shape ``[num_layers, num_pages, num_kv_heads, page_size, ...]``: pages are
"HND", one page of one KV head is contiguous (a page of FP8 V at page size 16 and head_dim 128 is one
2 KiB run). Slot ``s`` is token ``s % page_size`` of page ``s // page_size``. V is stored token-major
like K: the prefill's pre-pass (kv_pack, templates/prefill.cu.jinja) transposes each 128-key V tile once
into an MMA-ready V^T image for the FP8 PV MMA, so every page size (1 included) keeps 16-byte vector
appends and the decode kernel reads whole pages.

Fixed per (layer, KV head), for the whole server (so cached prefix pages stay shareable):
``mu_k [num_kv_heads, head_dim]`` (K smoothing, quantized K only; 0 until calibrated) and
``v_scale [num_kv_heads, head_dim]`` (FP8 V channel scales; 1 until calibrated).

qk4pv4 stores V rotated (4-bit codes of V H, mpfa.recipes.u4h): its ``v_scale`` scales the rotated values (the
prefill pre-pass's FP8 image of them), and the cache holds the +-1 Hadamard matrix the wrappers rotate the
output back with (``v_rotation``, bf16 ``[head_dim, head_dim]``, None for the other recipes).
"""
from __future__ import annotations

import math
import os

import torch

from mpfa_jit.ops import append_kv as append_op

from .recipes import Recipe, get_recipe
from .recipes.fp8 import E4M3_MAX, dequantize_e4m3
from .recipes.int8 import I4RS_BLOCK, dequantize_i4rs, dequantize_k_per_token, i4rs_to_int8
from .recipes.smoothing import k_smoothing_mean
from .recipes.u4h import decode_values, hadamard, hadamard_pm1, prefill_values, rotate
from .validation import check_choice, check_positive_int, check_tensor

# The cache serves what the append kernel writes.
HEAD_DIMS, PAGE_SIZES = append_op.HEAD_DIMS, append_op.PAGE_SIZES
_DTYPES = {"bfloat16": torch.bfloat16, "int8": torch.int8, "uint8": torch.uint8, "float16": torch.float16,
           "float32": torch.float32}
# What dequantize's ``path`` accepts: the V each attention path multiplies (they differ for qk4pv4 only).
V_PATHS = ("decode", "prefill")

# V's channel scales come from whatever batch a layer sees first (a server's 3-token warmup request).
# E4M3's range is wide enough to leave room: on SmolLM2's real V (benchmarks/results/studies/
# calibration_kjv.json) headroom 256 loses nothing when the sample is large (V rel-L2 2.65% from 16 to
# 4,096 calibration tokens, as with headroom 2) and keeps a 3-token sample unsaturated (headroom 2:
# 16% of later values clipped, rel-L2 34%).
V_HEADROOM = 256.0
# The headroom calibrate accepts: at least 1 (below, the sample's own largest values saturate at 448), and at most
# what keeps the sample's largest value at E4M3's smallest normal 2^-6 or above (448 / 2^-6): past it the sample
# itself is stored as subnormals with fewer than 4 significant bits, and past 448 / 2^-10 V is stored as zeros.
E4M3_MIN_NORMAL = 2.0 ** -6
V_HEADROOM_RANGE = (1.0, E4M3_MAX / E4M3_MIN_NORMAL)
_SAMPLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


class KVCacheLayer:
    """One layer's view of a :class:`PagedKVCache`: what the append, prefill and decode calls take."""

    def __init__(self, cache: "PagedKVCache", index: int):
        self.cache, self.index = cache, index
        self.recipe: Recipe = cache.recipe
        self.page_size, self.num_kv_heads, self.head_dim = cache.page_size, cache.num_kv_heads, cache.head_dim
        self.fields = {name: t[index] for name, t in cache.fields.items()}
        self.mu_k = cache.mu_k[index] if cache.mu_k is not None else None
        self.v_scale = cache.v_scale[index] if cache.v_scale is not None else None
        self.v_rotation = cache.v_rotation

    @property
    def device(self) -> torch.device:
        return self.cache.device

    def dequantize(self, dtype=torch.float32, add_mean: bool = False, pages: torch.Tensor | None = None, *,
                   path: str = "decode", rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) as ``[num_pages, H, P, D]`` in ``dtype`` (only ``pages``, in that order, if given).
        K is the smoothed K - mu_K the kernels multiply (softmax gives the same result);
        ``add_mean`` adds mu_K back.

        ``path`` ("decode" or "prefill"): which attention path's V. They differ for qk4pv4 only: decode multiplies
        the fp16 dequantized values, prefill their FP8 image under ``v_scale`` (mpfa.recipes.u4h). qk4pv4's V
        comes back rotated back to the model's space (``V_rot H``, in float64, then ``dtype``), so that attention
        on it is the kernels' output after the wrappers' rotation; ``rotated=True`` keeps the rotated values the
        kernels multiply (qk4pv4 only)."""
        check_choice("path", path, V_PATHS)
        r = self.recipe
        if rotated and self.v_rotation is None:
            raise ValueError(f"rotated=True: recipe {r.name} stores V unrotated (only 4-bit Hadamard V, qk4pv4, "
                             "is rotated)")
        f = self.fields if pages is None else {n: t[pages.long()] for n, t in self.fields.items()}
        if r.k_format == "bf16":
            k = f["k"].to(dtype)
        elif r.k_format == "int8":
            k = dequantize_k_per_token(f["k"], f["k_scale"]).to(dtype)
        else:
            k = dequantize_i4rs(f["k8"], f["k"], self._block_scales(f), f["k_scale"]).to(dtype)
        if r.v_format == "bf16":
            v = f["v"].to(dtype)
        elif r.v_format == "e4m3":
            v = dequantize_e4m3(f["v"], self.v_scale.unsqueeze(1)).to(dtype)
        else:
            v = self._dequantize_u4h(f, path, rotated).to(dtype)
        if add_mean and self.mu_k is not None:
            k = k + self.mu_k.to(dtype).unsqueeze(1)
        return k, v

    def _dequantize_u4h(self, fields: dict, path: str, rotated: bool) -> torch.Tensor:
        """qk4pv4's V ``[pages, H, P, D]`` float64: the rotated values ``path`` multiplies, rotated back unless
        ``rotated``."""
        if path == "decode":
            v = decode_values(fields["v"], fields["v_param"]).to(torch.float64)
        else:
            v = prefill_values(fields["v"], fields["v_param"], self.v_scale.unsqueeze(1))
        return v if rotated else v @ hadamard(self.head_dim, device=v.device)

    def k_operand(self, pages: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantized K: (the INT8 rows the QK MMA multiplies ``[num_pages, H, P, D]`` int8 (qk4pv8: the i4rs row's
        INT8 image), their per-token scales ``[num_pages, H, P]`` float32), of ``pages`` only if given; K - mu_K is
        their product."""
        if self.recipe.k_format == "bf16":
            raise ValueError(f"k_operand: recipe {self.recipe.name} stores K as bf16, not as INT8 rows with scales")
        f = self.fields if pages is None else {n: t[pages.long()] for n, t in self.fields.items()}
        if self.recipe.k_format == "int8":
            ints = f["k"]
        else:
            ints = i4rs_to_int8(f["k8"], f["k"], self._block_scales(f))
        return ints, f["k_scale"].float()

    def _block_scales(self, fields: dict) -> torch.Tensor:
        """i4rs: the block scales in use of ``fields`` (the stored field is padded to 4 bytes)."""
        return fields["k_block_scale"][..., : self.head_dim // (2 * I4RS_BLOCK)]


class PagedKVCache:
    """All layers' KV pages in ``recipe``'s format.

    >>> cache = PagedKVCache("qk4pv8", num_layers=32, num_pages=4096, page_size=16, num_kv_heads=8, head_dim=128)
    >>> cache.bytes_per_token_head   # 64 (INT8 half of K) + 32 (INT4 half) + 4 (block scales) + 4 (token scale) + 128 (FP8 V)
    232
    """

    def __init__(self, recipe: "str | Recipe" = "qk4pv8", *, num_layers: int, num_pages: int, page_size: int,
                 num_kv_heads: int, head_dim: int, device="cuda"):
        self.recipe = get_recipe(recipe)
        check_positive_int("num_layers", num_layers)
        check_positive_int("num_pages", num_pages)
        check_positive_int("num_kv_heads", num_kv_heads)
        check_choice("page_size", page_size, PAGE_SIZES)
        check_choice("head_dim", head_dim, HEAD_DIMS)
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.device = _check_device(device)
        self._check_fits()
        lead = (num_layers, num_pages, num_kv_heads, page_size)
        self.fields = {}
        for f in self.recipe.fields:
            n = f.numel(head_dim)
            shape = lead if f.per_row == "1" else lead + (n,)
            self.fields[f.name] = torch.zeros(shape, dtype=_DTYPES[f.dtype], device=self.device)
        hd = (num_layers, num_kv_heads, head_dim)
        self.mu_k = torch.zeros(hd, dtype=torch.float32, device=self.device) if self.recipe.quantized_k else None
        self.v_scale = torch.ones(hd, dtype=torch.float32, device=self.device) if self.recipe.quantized_v else None
        # qk4pv4: the +-1 matrix of the output rotation, made here (outside any CUDA graph) for every wrapper call
        self.v_rotation = (hadamard_pm1(head_dim, dtype=torch.bfloat16, device=self.device)
                           if self.recipe.v_format == "u4h" else None)
        # Tokens the append kernel skipped because their slot was at or past num_slots (a kernel in a CUDA
        # graph cannot raise): int32 [1] on the device, read and reset by check_append_slots().
        self.out_of_range_slots = torch.zeros(1, dtype=torch.int32, device=self.device)

    def _check_fits(self) -> None:
        """Refuse, before allocating, a cache larger than the device can hold (torch's own failure names neither
        the argument nor the size, and a CPU allocation may succeed lazily and fail later as it is zeroed)."""
        per_slot = self.bytes_per_token_head
        scales = 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4   # mu_k, v_scale (float32)
        need = self.num_layers * self.num_pages * self.page_size * self.num_kv_heads * per_slot + scales
        have = _device_capacity(self.device)
        if have is not None and need > have:
            raise ValueError(
                f"num_pages={self.num_pages} needs {need} bytes ({need / 2**30:.1f} GiB: {self.num_layers} layers x "
                f"{self.num_pages} pages x {self.page_size} tokens x {self.num_kv_heads} KV heads x {per_slot} B, "
                f"plus the scales) but {self.device} has {have} bytes ({have / 2**30:.1f} GiB) "
                f"{'free' if self.device.type == 'cuda' else 'of memory'}: lower num_pages (or num_layers)")

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def bytes_per_token_head(self) -> int:
        return self.recipe.bytes_per_token_head(self.head_dim)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.fields.values())

    def layer(self, index: int) -> KVCacheLayer:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {index!r}")
        return KVCacheLayer(self, index)

    __getitem__ = layer

    def take_out_of_range_slots(self) -> int:
        """The append kernel's count of skipped out-of-range slots since the last call, reset to 0. Waits for
        the current stream (reads a device counter); an append on another stream between the read and the
        reset may be missed."""
        n = int(self.out_of_range_slots.item())
        if n:
            self.out_of_range_slots.zero_()
        return n

    def check_append_slots(self) -> None:
        """Raise ValueError if append_kv's CUDA kernel met slots at or past ``num_slots`` since the last
        check, and reset the count. Those rows were skipped: no other page, request or layer was written,
        but their K/V is missing from the cache.

        The count lives on the device, so this waits for the current stream: call it where a
        synchronization is already paid or harmless (after a batch of steps, in a health check, in tests),
        not on every step of a CUDA-graph loop. The reference backend raises at the append itself."""
        n = self.take_out_of_range_slots()
        if n:
            raise ValueError(f"append_kv was given {n} slot(s) outside [0, {self.num_slots}) (num_pages * page_size "
                             "of one layer; a negative slot is padding and writes nothing): those rows were skipped")

    def calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor, *, headroom: float = V_HEADROOM,
                  nonfinite: str = "raise") -> int:
        """Fix ``layer``'s mu_K and V channel scales from sample keys and values ``[tokens, H_kv, D]``, floating
        point (e.g. the first prefill). V scale = headroom * amax / 448 per channel, so later values up to
        ``headroom`` times the sample's stay unsaturated (qk4pv4: of the rotated sample V H, mpfa.recipes.u4h.rotate,
        whose FP8 image prefill multiplies). Call before the layer's first append:
        rows already written keep the scales they were written with.

        ``headroom`` is a finite number in [1, 28672] (``V_HEADROOM_RANGE``): below 1 the sample's own
        largest values saturate (0 or a negative value breaks every scale); above 448 / 2^-6 = 28672 the
        sample's largest value falls below E4M3's smallest normal, so V keeps fewer than 4 significant bits
        (and past 448 / 2^-10 it is stored as zeros).

        A non-finite mean or amax would become a fixed scale of the layer and turn every later K or V of
        that channel into NaN for the cache's life. ``nonfinite="raise"`` (the default) refuses samples
        holding NaN or inf (ValueError); ``"ignore"`` leaves those elements out of each channel's mean and
        amax (what a server does, so one bad request cannot stop it). Returns the number of non-finite
        elements left out."""
        check_choice("nonfinite", nonfinite, ("raise", "ignore"))
        _check_headroom(headroom)
        idx = self.layer(layer).index
        ignored = 0
        for name, t in (("k", k), ("v", v)):
            check_tensor(name, t, dtypes=_SAMPLE_DTYPES)   # an integer sample has no scale: its mean is not K's
            if t.dim() != 3 or t.shape[1:] != (self.num_kv_heads, self.head_dim) or t.shape[0] == 0:
                raise ValueError(f"{name} must be [tokens > 0, {self.num_kv_heads}, {self.head_dim}], got {tuple(t.shape)}")
            bad = int((~torch.isfinite(t)).sum())
            if bad and nonfinite == "raise":
                raise ValueError(f"{name} (the {name.upper()} sample calibrating layer {idx}) holds {bad} non-finite "
                                 f"elements (NaN or inf) of {t.numel()}: calibration fixes the layer's scales for the "
                                 "cache's life, so it takes only finite samples; pass rows without NaN or inf")
            ignored += bad
        if self.mu_k is not None:
            if ignored:
                kf = k.float()
                finite = torch.isfinite(kf)
                mean = torch.where(finite, kf, torch.zeros_like(kf)).sum(dim=0) / finite.sum(dim=0).clamp(min=1)
            else:
                mean = k_smoothing_mean(k)
            self.mu_k[idx] = mean.to(self.device)
        if self.v_scale is not None:
            # qk4pv4 stores V H: a row with a non-finite element is non-finite in every rotated channel, and is
            # left out of every channel's amax (the count returned stays that of the sample's elements)
            va = (rotate(v) if self.recipe.v_format == "u4h" else v.float()).abs()
            amax = torch.where(torch.isfinite(va), va, torch.zeros_like(va)).amax(dim=0)
            self.v_scale[idx] = torch.where(amax > 0, amax * headroom / E4M3_MAX, torch.ones_like(amax)).to(self.device)
        return ignored

    def __repr__(self) -> str:
        return (f"PagedKVCache(recipe={self.recipe.name!r}, num_layers={self.num_layers}, num_pages={self.num_pages}, "
                f"page_size={self.page_size}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"device={str(self.device)!r}, {self.bytes_per_token_head} B/token/head)")


def _check_headroom(headroom) -> None:
    lo, hi = V_HEADROOM_RANGE
    ok = isinstance(headroom, (int, float)) and not isinstance(headroom, bool) and math.isfinite(headroom)
    if not ok or not lo <= headroom <= hi:
        raise ValueError(f"headroom must be a finite number in [{lo:g}, {hi:g}] (V scale = headroom * amax / 448: "
                         f"below 1 the sample saturates, above {hi:g} it falls below E4M3's normal range), "
                         f"got {headroom!r}")


def _check_device(device) -> torch.device:
    """``device`` as a torch.device with its index, or ValueError naming it when this torch cannot use it."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch device such as 'cuda', 'cuda:1' or 'cpu', got {device!r}") from None
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "torch sees no CUDA GPU"
        raise ValueError(f"device={device!r}: {why} (torch {torch.__version__}); pass device='cpu' and use "
                         "backend='reference', or install a CUDA torch on a GPU machine")
    count = torch.cuda.device_count()
    if dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if dev.index >= count:
        raise ValueError(f"device={device!r}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return dev


def _device_capacity(device: torch.device) -> int | None:
    """Bytes a new cache can take on ``device``: free GPU memory (with what torch's allocator holds unused), the
    machine's physical memory for the CPU; None where unknown (e.g. 'meta')."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):   # a platform without these names
            return None
    return None
