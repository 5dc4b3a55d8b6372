"""Reference of the append kernel: quantize new K/V rows with the recipe and scatter them into pages.

Non-finite input, as the kernel (templates/include/mpfa/append/quantize_row.cuh) stores it: a K row
(token, head; after - mu_K) holding NaN or +-inf gets a NaN ``k_scale``, so the key reads back as NaN;
its integer K bytes and block scales are unspecified. An FP8 V element
that is NaN or infinite is stored as E4M3 NaN (0x7F or 0xFF); finite values saturate at +-448. qk4pv4's
4-bit V (mpfa.recipes.u4h) stores a NaN scale and zero point (any payload) and codes 0 in every group of a row
holding a NaN or inf (the rotation mixes all channels), and in a group whose fp16 parameters overflow. bf16
fields keep the values as given.
"""
from __future__ import annotations

import torch

from ..recipes.fp8 import quantize_e4m3_fixed_scale
from ..recipes.int8 import quantize_i4rs, quantize_k_per_token
from ..recipes.u4h import quantize_u4h


def quantize_rows(recipe, k: torch.Tensor, v: torch.Tensor, mu_k, v_scale) -> dict[str, torch.Tensor]:
    """The cache fields of rows ``[..., D]`` (bf16 in), keyed like the recipe's fields."""
    if recipe.name == "bf16":
        return {"k": k.to(torch.bfloat16), "v": v.to(torch.bfloat16)}
    ks = k.float() - mu_k
    if recipe.v_format == "u4h":
        codes, v_param = quantize_u4h(v)
        out = {"v": codes, "v_param": v_param}
    else:
        out = {"v": quantize_e4m3_fixed_scale(v.float(), v_scale).view(torch.uint8)}
    if recipe.k_format == "int8":
        q, scale = quantize_k_per_token(ks)
        out.update(k=q, k_scale=scale)
    else:
        k8, packed, block_scale, token_scale = quantize_i4rs(ks)
        pad = recipe.field("k_block_scale").numel(ks.shape[-1]) - block_scale.shape[-1]   # head_dim 64: 2 -> 4 bytes
        block_scale = torch.nn.functional.pad(block_scale, (0, pad))
        out.update(k8=k8, k=packed, k_block_scale=block_scale, k_scale=token_scale)
    return out


def check_slots(slots: torch.Tensor, num_slots: int) -> None:
    """Raise ValueError naming ``slots`` unless every slot is below ``num_slots`` (negative: padding)."""
    bad = slots >= num_slots
    n = int(bad.sum())
    if n:
        raise ValueError(f"slots must lie in [0, {num_slots}) (num_pages * page_size of one layer) or be negative "
                         f"(-1: padding, writes nothing); got {n} slot(s) >= {num_slots}, the largest "
                         f"{int(slots.max())}")


def reference_append(k: torch.Tensor, v: torch.Tensor, layer, slots: torch.Tensor) -> None:
    """Write rows ``k, v [N, H, D]`` to ``layer`` at ``slots`` (negative slots are skipped); raises
    ValueError, writing nothing, if a slot is at or past the layer's ``num_pages * page_size``."""
    check_slots(slots, layer.cache.num_slots)
    keep = slots >= 0
    slots = slots[keep].long()
    if slots.numel() == 0:
        return
    k, v = k[keep], v[keep]
    fields = quantize_rows(layer.recipe, k, v, layer.mu_k, layer.v_scale)
    page, off = slots // layer.page_size, slots % layer.page_size
    for name, value in fields.items():
        layer.fields[name][page, :, off] = value.to(layer.fields[name].device)
