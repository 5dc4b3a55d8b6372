r"""Launch each kernel of interest a few times at one shape, for `ncu` to profile (no timing here).
Kinds: decode, append, prefill (see each function); prefill_times prints each kernel's GPU time of one prefill call.

    ncu --clock-control none --kernel-name regex:decode --launch-skip 2 --launch-count 1 \
        python -m benchmarks.profile_kernels decode qk4pv8 [batch context page_size]

    python -m benchmarks.profile_kernels KIND RECIPE [ARG ...]
      decode RECIPE [batch context page_size launches]        (default 32 32768 16 3)
      append RECIPE [tokens page_size launches]               (default 32768 16 3)
      prefill RECIPE [shape on|off knobs launches]            (default 16K on served 3)
      prefill_times RECIPE [shape on|off knobs calls]         (default 16K on served 10)

Exit status: 0 done; 1 the launches failed; 2 bad arguments or no CUDA GPU.
"""
from __future__ import annotations

import argparse
import inspect
import sys

import torch

import mpfa
from benchmarks import cli
from mpfa_jit.ops.support import ALL_RECIPES

PROG = "python -m benchmarks.profile_kernels"

QO, KV, D = 32, 8, 128


def decode(recipe: str, batch: int = 32, context: int = 32768, page_size: int = 16, launches: int = 3):
    from benchmarks.suites.decode import _fill_mpfa, _page_table
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_pages, indptr, indices, last = _page_table([context] * batch, page_size, "cuda", gen)
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
    "served", or a build's knobs as benchmarks/prefill_variants.py takes them (set over the served build's)."""
    from benchmarks.prefill_variants import parse_variant
    from benchmarks.suites.prefill import SHAPES, _case, mpfa_setup
    if compensation not in ("on", "off"):
        raise ValueError(f"compensation must be 'on' or 'off', got {compensation!r}")
    if shape not in dict(SHAPES):
        raise ValueError(f"shape must be one of {', '.join(dict(SHAPES))}, got {shape!r}")
    case = _case("mpfa", recipe, shape, dict(SHAPES)[shape], (compensation == "on") if recipe != "bf16" else None)
    return mpfa_setup(case, torch.Generator(device="cuda").manual_seed(0),
                      knobs=None if knobs == "served" else parse_variant(knobs))


def prefill(recipe: str, shape: str = "16K", compensation: str = "on", knobs: str = "served", launches: int = 3):
    """One of the prefill suite's shapes with its setup: ``python -m benchmarks.profile_kernels prefill qk4pv8
    [16K|32K|...] [on|off] ["served"|"stages=3,pv_once=0"]`` (_prefill_setup)."""
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


KINDS = {"decode": decode, "append": append, "prefill": prefill, "prefill_times": prefill_times}


def _prefill_shapes() -> list[str]:
    from benchmarks.suites.prefill import SHAPES
    return [name for name, _ in SHAPES]


# the text arguments that have a fixed set of values, checked before any GPU work
TEXT_CHOICES = {"shape": _prefill_shapes, "compensation": lambda: ["on", "off"]}


def call_args(ap: argparse.ArgumentParser, kind: str, raw: list[str]) -> list:
    """The positional arguments after RECIPE as the kind's function takes them: counts positive integers, the
    rest text (a parser error for too many, or a count that is not one)."""
    params = list(inspect.signature(KINDS[kind]).parameters.values())[1:]
    if len(raw) > len(params):
        ap.error(f"{kind} takes at most {len(params)} arguments after RECIPE "
                 f"({' '.join(p.name for p in params)}), got {len(raw)}")
    out = []
    for p, text in zip(params, raw):
        if p.annotation in (int, "int"):
            if not text.isdigit() or int(text) < 1:
                ap.error(f"{kind} {p.name}: a positive integer, got {text!r}")
            out.append(int(text))
        elif p.name in TEXT_CHOICES and text not in TEXT_CHOICES[p.name]():
            ap.error(f"{kind} {p.name}: one of {', '.join(TEXT_CHOICES[p.name]())}, got {text!r}")
        else:
            out.append(text)
    return out


def main(argv=None) -> int:
    ap = cli.Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=sorted(KINDS))
    ap.add_argument("recipe", choices=list(ALL_RECIPES))
    ap.add_argument("args", nargs="*", metavar="ARG", help="the kind's arguments, in order (above)")
    a = ap.parse_args(argv)
    args = call_args(ap, a.kind, a.args)
    if not torch.cuda.is_available():
        print(f"{PROG}: no CUDA GPU visible (torch {torch.__version__}): run it on the GPU machine", file=sys.stderr)
        return 2
    try:
        KINDS[a.kind](a.recipe, *args)
    except ValueError as e:   # a shape, compensation or knob string the prefill setup refuses
        print(f"{PROG}: {a.kind}: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        print(f"{PROG}: {a.kind} {a.recipe} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
