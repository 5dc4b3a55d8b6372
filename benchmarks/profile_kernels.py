"""Launch each kernel of interest a few times at one shape, for `ncu` to profile (no timing here).
Kinds: decode, append, prefill (see each function); prefill_times prints each kernel's GPU time of one prefill call.

    ncu --clock-control none --kernel-name regex:decode --launch-skip 2 --launch-count 1 \
        python -m benchmarks.profile_kernels decode qk4pv8 [batch context page_size]
"""
from __future__ import annotations

import sys

import torch

import mpfa

QO, KV, D = 32, 8, 128


def decode(recipe: str, batch: int = 32, context: int = 32768, page_size: int = 16, launches: int = 3):
    from benchmarks.suites.decode import _fill_mpfa, _page_table
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_pages, indptr, indices, last = _page_table(batch, context, page_size, "cuda", gen)
    cache = mpfa.PagedKVCache(recipe, num_layers=1, num_pages=num_pages, page_size=page_size, num_kv_heads=KV,
                              head_dim=D)
    _fill_mpfa(cache, gen)
    w = mpfa.BatchDecodeWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(indptr, indices, last, QO, KV, D, page_size, recipe=recipe)
    q = torch.randn(batch, QO, D, device="cuda").to(torch.bfloat16)
    for _ in range(launches):
        w.run(q, cache.layer(0))
    torch.cuda.synchronize()


def append(recipe: str, tokens: int = 32768, page_size: int = 16, launches: int = 3):
    cache = mpfa.PagedKVCache(recipe, num_layers=1, num_pages=tokens // page_size + 1, page_size=page_size,
                              num_kv_heads=KV, head_dim=D)
    k = torch.randn(tokens, KV, D, device="cuda").to(torch.bfloat16)
    v = torch.randn(tokens, KV, D, device="cuda").to(torch.bfloat16)
    slots = torch.randperm(tokens, device="cuda")
    for _ in range(launches):
        mpfa.append_kv(k, v, cache.layer(0), slots)
    torch.cuda.synchronize()


class _Launches:
    """Stands in for the suite's timing context: launches the planned kernel a few times, untimed."""

    def __init__(self, launches: int):
        self.launches = launches

    def bench(self, fn):
        for _ in range(self.launches):
            fn()
        torch.cuda.synchronize()


def _prefill_setup(recipe: str, shape: str, compensation: str, knobs: str):
    """The planned wrapper, Q and layer of one of the prefill suite's shapes: compensation "on" or "off"; knobs
    "served", or a build's knobs as benchmarks/prefill_variants.py takes them ("" the template's defaults)."""
    from benchmarks.prefill_variants import parse_variant
    from benchmarks.suites.prefill import SHAPES, _case, mpfa_setup
    if compensation not in ("on", "off"):
        raise ValueError(f"compensation must be 'on' or 'off', got {compensation!r}")
    case = _case("mpfa", recipe, shape, dict(SHAPES)[shape], (compensation == "on") if recipe != "bf16" else None)
    return mpfa_setup(case, torch.Generator(device="cuda").manual_seed(0),
                      knobs=None if knobs == "served" else parse_variant(knobs))


def prefill(recipe: str, shape: str = "16K", compensation: str = "on", knobs: str = "served", launches: int = 3):
    """One of the prefill suite's shapes with its setup: ``python -m benchmarks.profile_kernels prefill qk4pv8
    [16K|32K|...] [on|off] ["served"|"consumers=2,pingpong=1"|""]`` (_prefill_setup)."""
    w, q, layer = _prefill_setup(recipe, shape, compensation, knobs)
    _Launches(launches).bench(lambda: w.run(q, layer))


def prefill_times(recipe: str, shape: str = "16K", compensation: str = "on", knobs: str = "served", calls: int = 10):
    """GPU time of each kernel of one prefill call (the pre-passes and the main kernel; torch's profiler, the mean of
    ``calls`` calls): ``python -m benchmarks.profile_kernels prefill_times qk4pv8 16K on [served|knobs]``."""
    w, q, layer = _prefill_setup(recipe, shape, compensation, knobs)
    for _ in range(3):
        w.run(q, layer)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            w.run(q, layer)
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.device_time / calls
    print(recipe, shape, f"compensation {compensation}", knobs, " | ".join(
        f"{name[:40]} {us:.1f} us" for name, us in sorted(per_kernel.items(), key=lambda x: -x[1])))


if __name__ == "__main__":
    args = [int(a) if a.isdigit() else a for a in sys.argv[2:]]   # e.g. decode qk4pv8 32 32768 1
    {"decode": decode, "append": append, "prefill": prefill, "prefill_times": prefill_times}[sys.argv[1]](*args)
