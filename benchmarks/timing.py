"""Device timing: warm-up, many timed calls, median, and rotation among input sets.

Why this shape:
- GPU work is asynchronous, so each call is bracketed by CUDA events (device time, not host
  time), the way `triton.testing.do_bench` does it; we keep our own loop to rotate inputs and
  to return every sample, not only one statistic.
- Warm-up calls run first, so JIT builds, module loads and handle creation stay out of the
  numbers; warm-up and measurement are given in milliseconds and turned into call counts
  from a short estimate, so a 20 us kernel and a 2 ms kernel both get a stable median.
- If a call's inputs and outputs fit in L2 (H200: 50-60 MB), timing the same buffers again
  and again measures the cache, not HBM. Callers pass several prepared argument tuples
  (`rotate`) whose combined size exceeds a few times L2; `rotation_count` picks how many.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from benchmarks.stats import percentile

GIB = 1 << 30


@dataclass(frozen=True)
class Timing:
    """All timed samples of one benchmark, in milliseconds, with the usual statistics."""

    samples_ms: tuple[float, ...]
    warmup_calls: int
    rotate_sets: int

    @property
    def median(self) -> float:
        return percentile(self.samples_ms, 50)

    @property
    def min(self) -> float:
        return min(self.samples_ms)

    @property
    def p20(self) -> float:
        return percentile(self.samples_ms, 20)

    @property
    def p80(self) -> float:
        return percentile(self.samples_ms, 80)

    def as_row(self) -> dict:
        """The fields a result row stores (the raw samples stay out of the JSON)."""
        return {
            "ms": self.median,
            "ms_min": self.min,
            "ms_p20": self.p20,
            "ms_p80": self.p80,
            "n": len(self.samples_ms),
            "sets": self.rotate_sets,
        }


def rotation_count(
    bytes_per_call: int,
    l2_bytes: int,
    *,
    factor: float = 4.0,
    budget_bytes: int = 8 * GIB,
    max_sets: int = 64,
) -> int:
    """How many distinct input sets to rotate among so that successive calls miss in L2.

    `bytes_per_call` is the memory one set occupies (inputs plus the outputs it writes).
    Enough sets are chosen that together they exceed `factor` x L2, capped by what fits in
    `budget_bytes` and by `max_sets`; never fewer than one. A call that alone exceeds
    factor x L2 needs no rotation (1).
    """
    if bytes_per_call <= 0:
        raise ValueError(f"bytes_per_call must be positive, got {bytes_per_call}")
    if l2_bytes < 0 or factor <= 0 or budget_bytes <= 0 or max_sets < 1:
        raise ValueError("l2_bytes >= 0, factor > 0, budget_bytes > 0, max_sets >= 1 required")
    need = math.ceil(factor * l2_bytes / bytes_per_call)
    fit = budget_bytes // bytes_per_call
    return max(1, min(need, fit, max_sets))


def bench(
    fn: Callable[..., object],
    *,
    rotate: Sequence[tuple] | None = None,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    min_calls: int = 10,
    max_calls: int = 2000,
) -> Timing:
    """Time `fn` on the current CUDA device; returns every sample (median via `.median`).

    `rotate`: a list of argument tuples; call i runs `fn(*rotate[i % len(rotate)])`.
    Without it, `fn()` is called. Each timed call is bracketed by its own pair of CUDA
    events; the device is synchronized (surfacing asynchronous CUDA errors) before and after.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("bench() needs a CUDA device (torch.cuda.is_available() is False)")
    sets = list(rotate) if rotate is not None else [()]
    if not sets:
        raise ValueError("rotate must hold at least one argument tuple")
    if warmup_ms < 0 or rep_ms <= 0 or min_calls < 1 or max_calls < min_calls:
        raise ValueError("need warmup_ms >= 0, rep_ms > 0, 1 <= min_calls <= max_calls")

    def call(i: int) -> None:
        fn(*sets[i % len(sets)])

    # First call on its own: JIT build / module load / autotuning happen here.
    call(0)
    torch.cuda.synchronize()

    # Estimate per-call time over a few rotated calls.
    est_calls = max(5, len(sets))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(est_calls):
        call(i)
    end.record()
    torch.cuda.synchronize()
    est_ms = max(start.elapsed_time(end) / est_calls, 1e-4)

    n_warmup = max(1, int(warmup_ms / est_ms))
    n_rep = max(min_calls, min(max_calls, int(rep_ms / est_ms)))

    for i in range(n_warmup):
        call(i)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    torch.cuda.synchronize()
    for i in range(n_rep):
        starts[i].record()
        call(n_warmup + i)
        ends[i].record()
    torch.cuda.synchronize()
    samples = tuple(s.elapsed_time(e) for s, e in zip(starts, ends))
    return Timing(samples_ms=samples, warmup_calls=n_warmup, rotate_sets=len(sets))
