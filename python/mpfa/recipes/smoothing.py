"""K smoothing and Q smoothing with rank-one compensation.

Softmax over keys is unchanged when one vector is subtracted from every key a query sees, so keys
are stored as K~ = K - mu_K with mu_K fixed per (layer, KV head): fixed, so cached prefix pages stay
valid for every request (radix cache). For the queries of one request's chunk,
Q = (Q - mu_Q) + mu_Q, hence

    S = Q K~^T = (Q - mu_Q) K~^T + 1 (mu_Q K~^T)

The first product runs in FP8 on a better-conditioned operand (outlier channels with a large mean
shrink); the second is one vector over keys per head, computed in FP32 and added to the scores.
"""
from __future__ import annotations

import torch


def k_smoothing_mean(k: torch.Tensor) -> torch.Tensor:
    """mu_K per (KV head, channel) of a sample of keys ``[tokens, kv_heads, head_dim]`` (float32)."""
    return k.float().mean(dim=0)


def q_smoothing_mean(q: torch.Tensor, qo_indptr: torch.Tensor) -> torch.Tensor:
    """mu_Q per (request, query head, channel): the mean over each request's query rows.

    ``q`` is ``[total_q, heads, head_dim]``; returns ``[batch, heads, head_dim]`` float32. A request
    with no query rows gets zeros.
    """
    bounds = qo_indptr.tolist()
    out = q.new_zeros((len(bounds) - 1, q.shape[1], q.shape[2]), dtype=torch.float32)
    for b in range(len(bounds) - 1):
        if bounds[b + 1] > bounds[b]:
            out[b] = q[bounds[b]:bounds[b + 1]].float().mean(dim=0)
    return out


def compensation(mu_q: torch.Tensor, k: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The rank-one term ``mu_Q . K~_j`` per (query head, key): ``[heads, keys]``.

    ``mu_q`` is ``[heads, head_dim]`` (one request), ``k`` the keys it attends ``[keys, kv_heads,
    head_dim]`` exactly as the QK product sees them (dequantized, smoothed). GQA: query head h reads
    KV head h // (heads // kv_heads).
    """
    heads, kv_heads = mu_q.shape[0], k.shape[1]
    group = heads // kv_heads
    kk = k.to(dtype).repeat_interleave(group, dim=1)           # [keys, heads, D]
    return torch.einsum("hd,khd->hk", mu_q.to(dtype), kk)
