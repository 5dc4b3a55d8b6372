"""Device ceilings measured in the same run as the kernels, so every kernel number can be
stated as a fraction of what this GPU, at this moment, actually delivers (datasheet rates are
only leads; clocks and thermals move between runs).

Each function returns one result row of kind "ceiling": `name`, `method`, timing fields
(`ms`, ...) and either `bytes`/`gbps` (bandwidth) or `flops`/`tflops` (MMA rate).
Inputs are random, never zeros: zeros can run faster than real data.
"""

from __future__ import annotations

from typing import Callable

from benchmarks.timing import GIB, bench


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
