"""Error metrics of an attention output against its fp64 reference, accumulated over many tensors
(layers, heads) so one row can report one figure for a whole model.

* ``rel_l2``  = ||O - O_ref||_2 / ||O_ref||_2 over every element accumulated;
* ``cos``     = <O, O_ref> / (||O|| ||O_ref||) over the same elements;
* ``max_abs`` = max |O - O_ref|.
"""
from __future__ import annotations

import math

import torch


class ErrorAccumulator:
    def __init__(self):
        self.err2 = self.ref2 = self.out2 = self.dot = 0.0
        self.max_abs = 0.0
        self.per_part: list[float] = []

    def add(self, out: torch.Tensor, ref: torch.Tensor) -> float:
        """Accumulate one tensor pair; returns that pair's relative L2."""
        o, r = out.double(), ref.double().to(out.device)
        d = o - r
        e2, r2 = float((d * d).sum()), float((r * r).sum())
        self.err2 += e2
        self.ref2 += r2
        self.out2 += float((o * o).sum())
        self.dot += float((o * r).sum())
        self.max_abs = max(self.max_abs, float(d.abs().max()) if d.numel() else 0.0)
        rel = math.sqrt(e2 / r2) if r2 > 0 else float("nan")
        self.per_part.append(rel)
        return rel

    def result(self) -> dict:
        rel = math.sqrt(self.err2 / self.ref2) if self.ref2 > 0 else float("nan")
        den = math.sqrt(self.out2 * self.ref2)
        return {"rel_l2": rel, "cos": self.dot / den if den > 0 else float("nan"), "max_abs": self.max_abs}


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    acc = ErrorAccumulator()
    acc.add(out, ref)
    return acc.result()
