"""Device ceilings measured in the same run as the kernels, so every kernel number can be
stated as a fraction of what this GPU, at this moment, actually delivers (datasheet rates are
only leads; clocks and thermals move between runs).

Each function returns one result row of kind "ceiling": `name`, `method`, timing fields
(`ms`, ...) and either `bytes`/`gbps` (bandwidth) or `flops`/`tflops` (MMA rate).
Inputs are random, never zeros: zeros can run faster than real data.

    python -m benchmarks.ceilings [--only hbm_read,fp8_mma] [--warmup-ms 25] [--rep-ms 100]

measures them alone and prints one line each (``benchmarks.run`` measures them before every suite and
stores them in each results file). Exit status: 0 measured; 1 a ceiling failed; 2 bad arguments or no CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from benchmarks import cli
from benchmarks.timing import GIB, bench

PROG = "python -m benchmarks.ceilings"


def _row(name: str, method: str, timing, *, bytes_=None, flops=None) -> dict:
    row = {"kind": "ceiling", "id": f"ceiling/{name}", "name": name, "method": method,
           "status": "ok", **timing.as_row()}
    if bytes_ is not None:
        row["bytes"] = int(bytes_)
        row["gbps"] = bytes_ / (timing.median * 1e-3) / 1e9
    if flops is not None:
        row["flops"] = int(flops)
        row["tflops"] = flops / (timing.median * 1e-3) / 1e12
    return row


def _free() -> None:
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def hbm_read(size_bytes: int = 4 * GIB, **bench_kw) -> dict:
    """HBM read bandwidth: `torch.sum` over one fp32 tensor far larger than L2.

    A reduction to one scalar reads every byte once and writes nothing, so bytes / time is
    the read ceiling that decode kernels (read-only over the KV cache) are compared with.
    """
    import torch

    def measure():  # tensors die with this frame, before _free()
        x = torch.randn(size_bytes // 4, dtype=torch.float32, device="cuda")
        return bench(lambda: torch.sum(x), **bench_kw), x.numel() * x.element_size()

    t, nbytes = measure()
    _free()
    return _row("hbm_read", f"torch.sum over {nbytes / GIB:.1f} GiB fp32", t, bytes_=nbytes)


def copy(size_bytes: int = 2 * GIB, **bench_kw) -> dict:
    """Device copy bandwidth: `dst.copy_(src)`, counting bytes read plus bytes written.

    Append (read bf16 K/V, write the cache) is a read+write stream, so this is its ceiling.
    """
    import torch

    def measure():
        src = torch.randn(size_bytes // 4, dtype=torch.float32, device="cuda")
        dst = torch.empty_like(src)
        return bench(lambda: dst.copy_(src), **bench_kw), 2 * src.numel() * src.element_size()

    t, nbytes = measure()
    _free()
    return _row("copy", f"dst.copy_(src), {size_bytes / GIB:.1f} GiB each way, read+write", t,
                bytes_=nbytes)


def fp8_mma(n: int = 8192, *, fast_accum: bool = True, **bench_kw) -> dict:
    """FP8 (e4m3) tensor-core rate: `torch._scaled_mm` on n x n x n with per-tensor scales.

    fast_accum=True (the ceiling, "fp8_mma") keeps cuBLAS in the MMA's own reduced-precision
    accumulator; False ("fp8_mma_promoted") promotes partial sums to FP32 as our kernels'
    two-level accumulation must, and shows what that promotion costs cuBLAS.
    """
    import torch

    def measure():
        a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)  # row-major [N, K]
        bt = b.t()  # column-major [K, N], the layout _scaled_mm requires for its second operand
        sa = torch.tensor(1.0, device="cuda")
        sb = torch.tensor(1.0, device="cuda")
        return bench(lambda: torch._scaled_mm(a, bt, scale_a=sa, scale_b=sb,
                                              out_dtype=torch.bfloat16,
                                              use_fast_accum=fast_accum), **bench_kw)

    t = measure()
    _free()
    name = "fp8_mma" if fast_accum else "fp8_mma_promoted"
    return _row(name, f"torch._scaled_mm e4m3 {n}^3, bf16 out, use_fast_accum={fast_accum}", t,
                flops=2 * n**3)


def fp8_mma_promoted(n: int = 8192, **bench_kw) -> dict:
    return fp8_mma(n, fast_accum=False, **bench_kw)


def bf16_mma(n: int = 8192, **bench_kw) -> dict:
    """BF16 tensor-core rate: `torch.matmul` on n x n x n (cuBLAS)."""
    import torch

    def measure():
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        return bench(lambda: a @ b, **bench_kw)

    t = measure()
    _free()
    return _row("bf16_mma", f"torch.matmul bf16 {n}^3", t, flops=2 * n**3)


ALL: dict[str, Callable[..., dict]] = {
    "hbm_read": hbm_read,
    "copy": copy,
    "fp8_mma": fp8_mma,
    "fp8_mma_promoted": fp8_mma_promoted,
    "bf16_mma": bf16_mma,
}


def by_name(rows) -> dict[str, dict]:
    """Ceiling rows of a result, keyed by name (kernel rows ignored)."""
    return {r["name"]: r for r in rows if r.get("kind") == "ceiling"}


def describe(row: dict) -> str:
    """A ceiling row in one line: its rate and how it was measured."""
    rate = f"{row['gbps']:,.0f} GB/s" if "gbps" in row else f"{row['tflops']:,.0f} TFLOP/s"
    return f"{row['name']}: {rate} ({row['method']})"


def main(argv=None) -> int:
    ap = cli.Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(ALL), help=f"comma-separated subset of {', '.join(ALL)} (default: all)")
    ap.add_argument("--warmup-ms", type=float, default=25.0)
    ap.add_argument("--rep-ms", type=float, default=100.0)
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL]
    if unknown or not names:
        ap.error(f"--only: unknown {unknown}; choose from {', '.join(ALL)}")
    if a.warmup_ms < 0 or a.rep_ms <= 0:
        ap.error(f"--warmup-ms must be >= 0 and --rep-ms positive, got {a.warmup_ms} and {a.rep_ms}")
    import torch
    if not torch.cuda.is_available():
        print(f"{PROG}: no CUDA GPU visible (torch {torch.__version__}): run it on the GPU machine", file=sys.stderr)
        return 2
    failed = 0
    for name in names:
        try:
            print(describe(ALL[name](warmup_ms=a.warmup_ms, rep_ms=a.rep_ms)), flush=True)
        except Exception as e:   # the others still measure
            print(f"{PROG}: {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
