"""How many bits does Hopper's FP8 tensor-core accumulation keep? (GPU study for the prefill's QK product.)

    python -m benchmarks.accuracy.fp8_accumulation [--publish] [--out FILE]

writes benchmarks/results/scratch/studies/fp8_accumulation_h200.json, or with --publish (on the GPU the published
file names) benchmarks/results/studies/.

The prefill kernel's 3 failing GPU cases (one query row, a Q outlier channel, compensation off) are
suspected to come from the FP8 MMA's accumulator: DeepSeek-V3's report puts it at ~14 bits on H800, and
a dot product dominated by one large term then loses the small terms below that term's 2^-14. This probes
it with ``torch._scaled_mm`` (cuBLASLt FP8 GEMM; ``use_fast_accum=True`` accumulates in the tensor core
like the kernel's QGMMA chain, ``False`` promotes partial sums to FP32 every few k-steps): a row with one
product ``2^r`` times larger than the ``k - 1`` others (all exact in E4M3), for k = 32, 64, 128 and
r = 0 .. 28. The share of the small terms lost, as r grows, gives the accumulator's width.

Then the rule the prefill kernel's model takes from that (mpfa.reference.prefill_kernel.tensor_core_pv: per k-step of
32, the accumulator and the products aligned to the largest and truncated toward zero below 2^-13 of it), checked
against the tensor cores on random dot products whose products span a wide range (positive P-like E4M3 operands
times signed V-like ones, k = 32, 64, 128, fast accumulation): per k, the share of dot products the rule gives
bit for bit, against the share an exact sum gives (rows ``{"rule_check": true, ...}``), and the share each variant
of the rule gives (``variant_match``: accumulator kept on the products' grid or in fp32, k-step 16 or 32, 11 to 16
bits; ``accumulate``), so one run says which rule the tensor cores follow.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks import cli, publish
from benchmarks import meta as bench_meta

STUDIES = Path(__file__).resolve().parents[1] / "results" / "studies"
DEFAULT_OUT = STUDIES / "fp8_accumulation_h200.json"   # with --publish
PROG = "python -m benchmarks.accuracy.fp8_accumulation"
SCRATCH_OUT = publish.SCRATCH_DIR / "studies" / DEFAULT_OUT.name


def _split(e: int) -> tuple[float, float]:
    """2^e as a product of two E4M3 normals (exponents -6 .. 8 each)."""
    ea = e // 2
    a, b = 2.0 ** ea, 2.0 ** (e - ea)
    assert 2.0 ** -6 <= min(a, b) and max(a, b) <= 256, f"2^{e} does not split into two E4M3 normals"
    return a, b


def probe(k: int, ratio_log2: int, fast: bool, small_sign: int = 1) -> float:
    """Fraction of the k - 1 small products lost when one product is 2^ratio_log2 times larger
    (0: all kept; 1: all dropped). Big product 2^min(16, ratio), small ones 2^(big - ratio)."""
    import torch
    e4m3 = torch.float8_e4m3fn
    big = min(16, ratio_log2)
    small = big - ratio_log2
    (ba, bb), (sa, sb) = _split(big), _split(small)
    a = torch.full((16, k), sa, dtype=torch.float32, device="cuda")
    b = torch.full((k, 16), sb * small_sign, dtype=torch.float32, device="cuda")
    a[:, 0], b[0, :] = ba, bb
    one = torch.ones((), device="cuda")
    out = torch._scaled_mm(a.to(e4m3), b.t().contiguous().t().to(e4m3), scale_a=one, scale_b=one,
                           out_dtype=torch.float32, use_fast_accum=fast)
    small_sum = small_sign * (k - 1) * 2.0 ** small
    return float((2.0 ** big + small_sum - out[0, 0].double()) / small_sum)


ACC_MODES = ("aligned", "fp32_rn", "fp32_rz")
VARIANT_STEPS = (16, 32)
VARIANT_BITS = tuple(range(11, 17))


def accumulate(a, b, *, step: int, bits: int, acc_mode: str):
    """``a [r, k] @ b [k, c]`` (float64 holding E4M3 values) summed as an FP8 MMA might: per k-step of ``step``
    products, the products (and, for ``aligned``, the accumulator too) aligned to the largest one's leading bit and
    truncated toward zero ``bits`` below it; ``aligned`` keeps the accumulator on that grid, ``fp32_rn`` / ``fp32_rz``
    add the step's aligned sum to an fp32 accumulator rounding to nearest / toward zero. ``aligned`` is
    mpfa.reference.prefill_kernel.tensor_core_pv (the prefill model's rule at k-step 32, 13 bits) over one tile."""
    import torch
    from mpfa.reference.prefill_kernel import tensor_core_pv
    if acc_mode == "aligned":
        return tensor_core_pv(a.unsqueeze(0), b.unsqueeze(1), a.shape[1], mma_k=step, bits=bits)[0, 0]
    terms = a[:, :, None] * b[None, :, :]                                     # [r, k, c], exact
    acc = torch.zeros((a.shape[0], b.shape[1]), dtype=torch.float64, device=a.device)
    for k0 in range(0, a.shape[1], step):
        t = terms[:, k0:k0 + step]
        big = t.abs().amax(dim=1)
        ulp = torch.ldexp(torch.ones_like(big), torch.frexp(big).exponent - 1 - bits)
        acc = acc + (torch.trunc(t / ulp[:, None]) * ulp[:, None]).sum(dim=1)
        if acc_mode == "fp32_rn":
            acc = acc.float().double()
        else:
            ulp32 = torch.ldexp(torch.ones_like(acc), torch.frexp(acc).exponent - 24)
            acc = torch.trunc(acc / ulp32) * ulp32
    return acc


def variant_name(acc_mode: str, step: int, bits: int) -> str:
    return f"{acc_mode}/k{step}/b{bits}"


def rule_check(k: int, batches: int = 4, seed: int = 0) -> dict:
    """How many of ``batches`` x 256 random length-``k`` dot products of E4M3 operands the tensor cores (cuBLASLt,
    fast accumulation) return exactly as tensor_core_pv's rule does, and as an exact sum does; and, per variant of the
    rule (``accumulate``: accumulator mode, k-step, bits kept), the share it gives bit for bit."""
    import torch
    from mpfa.reference.prefill_kernel import tensor_core_pv
    e4m3 = torch.float8_e4m3fn
    gen = torch.Generator(device="cuda").manual_seed(seed)
    one = torch.ones((), device="cuda")
    rule = exact = 0
    worst_rule = worst_exact = 0.0
    variants = {variant_name(m, st, bi): 0 for m in ACC_MODES for st in VARIANT_STEPS for bi in VARIANT_BITS}
    for _ in range(batches):
        # P-like: 2^-6 .. 2^8 (positive, as P is); V-like: signed, 2^-4 .. 2^6
        a = torch.exp2(torch.rand(16, k, generator=gen, device="cuda") * 14 - 6).to(e4m3)
        b = (torch.exp2(torch.rand(k, 16, generator=gen, device="cuda") * 10 - 4)
             * torch.where(torch.rand(k, 16, generator=gen, device="cuda") < 0.5, -1.0, 1.0)).to(e4m3)
        got = torch._scaled_mm(a, b.t().contiguous().t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                               use_fast_accum=True).double()
        a64, b64 = a.float().double(), b.float().double()
        want = tensor_core_pv(a64.unsqueeze(0), b64.unsqueeze(1), k)[0, 0]   # [16, 16]: rows of a x columns of b
        full = a64 @ b64
        scale = (a64.abs() @ b64.abs()).clamp_min(1e-30)
        rule += int((got == want).sum())
        exact += int((got == full).sum())
        worst_rule = max(worst_rule, float(((got - want).abs() / scale).max()))
        worst_exact = max(worst_exact, float(((got - full).abs() / scale).max()))
        for m in ACC_MODES:
            for st in VARIANT_STEPS:
                for bi in VARIANT_BITS:
                    variants[variant_name(m, st, bi)] += int((got == accumulate(a64, b64, step=st, bits=bi,
                                                                                 acc_mode=m)).sum())
    n = batches * 256
    return {"rule_check": True, "k": k, "dot_products": n, "match_rule": rule / n, "match_exact": exact / n,
            "max_diff_rule_rel_abs_sum": worst_rule, "max_diff_exact_rel_abs_sum": worst_exact,
            "variant_match": {name: c / n for name, c in variants.items()}}


def main(argv=None) -> int:
    ap = cli.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    publish.add_arguments(ap, out_help="the study's file", published=DEFAULT_OUT, scratch=SCRATCH_OUT)
    args = ap.parse_args(argv)
    out = publish.destination(ap, args.out, args.publish, published=DEFAULT_OUT, scratch=SCRATCH_OUT)
    import torch
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU with FP8 tensor cores (sm_89+)", file=sys.stderr)
        return 2
    if args.publish and (refused := publish.refusal(PROG, [out.name], out.parent, published=STUDIES)):
        print(refused, file=sys.stderr)
        return 2
    rows = []
    for fast in (True, False):
        for k in (32, 64, 128):
            for ratio in range(0, 29):
                for sign in (1, -1):
                    rows.append({"use_fast_accum": fast, "k": k, "ratio_log2": ratio, "small_sign": sign,
                                 "lost_fraction": probe(k, ratio, fast, sign)})
    for fast in (True, False):
        print(f"use_fast_accum={fast}: share of the small terms lost (k=128, positive) by log2(big / small)")
        print("  " + " ".join(f"{r['ratio_log2']:>2d}:{r['lost_fraction']:.2f}" for r in rows
                              if r["use_fast_accum"] == fast and r["k"] == 128 and r["small_sign"] == 1))
    for k in (32, 64, 128):
        rows.append(rule_check(k))
        r = rows[-1]
        print(f"k={k}: the rule gives {r['match_rule']:.1%} of {r['dot_products']} dot products bit for bit "
              f"(exact sums {r['match_exact']:.1%}); worst difference, of sum |a b|: rule "
              f"{r['max_diff_rule_rel_abs_sum']:.1e}, exact {r['max_diff_exact_rel_abs_sum']:.1e}")
        best = sorted(r["variant_match"].items(), key=lambda kv: -kv[1])[:3]
        print("  best variants: " + ", ".join(f"{name} {share:.1%}" for name, share in best))
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = bench_meta.collect(" ".join([PROG, *(sys.argv[1:] if argv is None else argv)]))
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
