"""What every suite does with its rows, written once: time a case on the GPU into a row, find a ceiling
measured in the same run, derive rates for the measured rows, and end the summary with the run's spread
and failure counts. (A leading underscore: ``benchmarks.suites.available`` lists suites, not this.)

A row is ``{**case, **extra, "status": "ok", **fields, **timing}``: the case as ``cases()`` made it, what
the implementation adds (its plan, a correctness check), the suite's counted bytes or FLOPs, and the
timing statistics (``Timing.as_row``).
"""
from __future__ import annotations

from typing import Callable


def run_on_gpu(impl: Callable, case: dict, ctx, *, seed: int | None = None):
    """``impl(case, ctx, gen)`` with a CUDA generator seeded with ``seed`` (``impl(case, ctx)`` without one);
    the GPU memory the case cached is released afterwards, whatever happened, so every case starts from an
    empty pool."""
    import torch
    args = (case, ctx) if seed is None else (case, ctx, torch.Generator(device="cuda").manual_seed(seed))
    try:
        return impl(*args)
    finally:
        torch.cuda.empty_cache()


def measured_row(case: dict, timing, *, extra: dict | None = None, **fields) -> dict:
    """One measured case's row (see the module's docstring for its order)."""
    return {**case, **(extra or {}), "status": "ok", **fields, **timing.as_row()}


def ok_kernels(rows: list[dict]) -> list[dict]:
    """The kernel rows that were measured (not skipped, not failed, not ceilings)."""
    return [r for r in rows if r.get("kind") == "kernel" and r.get("status") == "ok"]


def rate(row: dict, amount: str = "bytes", unit: float = 1e9) -> float:
    """``row[amount]`` per second of the row's median time, in ``unit`` (GB/s by default)."""
    return row[amount] / (row["ms"] * 1e-3) / unit


def ceiling_rate(rows: list[dict], name: str, amount: str = "bytes", unit: float = 1e9) -> float | None:
    """The rate of the same-run ceiling ``name`` (a row of kind "ceiling"), None where it failed or is absent."""
    for r in rows:
        if r.get("kind") == "ceiling" and r.get("name") == name and r.get("status", "ok") == "ok":
            return rate(r, amount, unit)
    return None


def annotate(rows: list[dict], derive: Callable[[dict], dict]) -> list[dict]:
    """Copies of ``rows`` with ``derive(row)``'s fields added to each measured kernel row."""
    return [{**r, **derive(r)} if r.get("kind") == "kernel" and r.get("status") == "ok" else dict(r) for r in rows]


def run_counts(rows: list[dict]) -> dict:
    """The end of every suite's summary: the largest spread between repeats, errors and skips."""
    from benchmarks.stats import max_spread
    return {
        "max_spread": max_spread(rows),
        "errors": sum(1 for r in rows if r.get("status") == "error"),
        "skipped": sum(1 for r in rows if r.get("status") == "skipped"),
    }
