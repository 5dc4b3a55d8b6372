"""Reference of the append kernel: quantize new K/V rows with the recipe and scatter them into pages."""
from __future__ import annotations

import torch

from ..recipes.fp4 import quantize_k4rs
from ..recipes.fp8 import quantize_e4m3, quantize_per_token


def quantize_rows(recipe, k: torch.Tensor, v: torch.Tensor, mu_k, v_scale) -> dict[str, torch.Tensor]:
    """The cache fields of rows ``[..., D]`` (bf16 in), keyed like the recipe's fields."""
    if recipe.name == "bf16":
        return {"k": k.to(torch.bfloat16), "v": v.to(torch.bfloat16)}
    ks = k.float() - mu_k
    out = {"v": quantize_e4m3(v.float(), v_scale).view(torch.uint8)}
    if recipe.name == "qk8pv8":
        q, scale = quantize_per_token(ks)
        out.update(k=q.view(torch.uint8), k_scale=scale)
    else:
        k8, packed, block_scale, token_scale = quantize_k4rs(ks)
        pad = recipe.field("k_block_scale").numel(ks.shape[-1]) - block_scale.shape[-1]   # head_dim 64: 2 -> 4 bytes
        block_scale = torch.nn.functional.pad(block_scale, (0, pad))
        out.update(k8=k8, k=packed, k_block_scale=block_scale, k_scale=token_scale)
    return out


def reference_append(k: torch.Tensor, v: torch.Tensor, layer, slots: torch.Tensor) -> None:
    """Write rows ``k, v [N, H, D]`` to ``layer`` at ``slots`` (negative slots are skipped)."""
    keep = slots >= 0
    slots = slots[keep].long()
    if slots.numel() == 0:
        return
    k, v = k[keep], v[keep]
    fields = quantize_rows(layer.recipe, k, v, layer.mu_k, layer.v_scale)
    page, off = slots // layer.page_size, slots % layer.page_size
    for name, value in fields.items():
        layer.fields[name][page, :, off] = value.to(layer.fields[name].device)
