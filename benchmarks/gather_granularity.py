"""How many HBM bytes a scattered token read really costs (page size 1), by layout.

    python -m benchmarks.gather_granularity [--tokens 1048576] [--out benchmarks/results/studies]

At page size 1 every token of a request sits in its own slot, and SGLang hands slots out in no
particular order, so decode reads each token's fields from scattered places. If the memory system
fetches a fixed granule per access (32-byte sectors, or more), a 4-byte scale costs a whole granule
and the layout, not the byte count, sets the decode rate. This study reads 2^20 tokens in a random
order (an odd-multiplier hash, a bijection on the token index) under candidate layouts of the
recipes' per-token fields: today's one-array-per-field ("split"), one contiguous record per token
(at its natural size and padded), and merged small fields; and once in order (the streaming read every
fraction is taken of). It repeats under each cudaLimitMaxL2FetchGranularity the driver accepts.

Consecutive lanes read consecutive 16-, 8- or 4-byte pieces of a token (the widest its alignment allows), as
the decode kernel's copies do, and every lane has 8 tokens' loads in flight at once; the loads' result is
kept live by a never-taken store. The footprint should be that of a decode batch (the default 2^20 tokens:
~240 MB at 232 B), not far larger: random reads over gigabytes measure TLB misses as well. Writes ``gather_granularity_h200.json``
(rows: layout, order, granularity, ms, useful GB/s, fraction of the in-order read of the same layout).
"""
from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

# Each layout: a list of fields (stride bytes, bytes read); one array per field, token t at t * stride.
LAYOUTS = {
    # qk4pv8 d128: k8 64 B, k (INT4) 32 B, block scales 4 B, token scale 4 B, V 128 B
    "qk4pv8/split": [(64, 64), (32, 32), (4, 4), (4, 4), (128, 128)],
    "qk4pv8/record232": [(232, 232)],
    "qk4pv8/record240": [(240, 232)],
    "qk4pv8/record256": [(256, 232)],
    "qk4pv8/k+scales": [(64, 64), (40, 40), (128, 128)],          # nibbles and both scales in one 40 B field
    "qk4pv8/scales8": [(64, 64), (32, 32), (8, 8), (128, 128)],   # the two scales in one 8 B field
    # qk8pv8 d128: k 128 B, token scale 4 B, V 128 B
    "qk8pv8/split": [(128, 128), (4, 4), (128, 128)],
    "qk8pv8/record272": [(272, 260)],
    # bf16 d128: k 256 B, v 256 B
    "bf16/split": [(256, 256), (256, 256)],
}

UNROLL = 8   # tokens each lane group reads, all loads in flight together


def pieces(fields) -> list[tuple[int, int, int]]:
    """A token's reads as (field, byte offset, width): the widest of 16 / 8 / 4 bytes the field's stride and
    length allow, as the decode kernel's cp.async copies are."""
    out = []
    for j, (stride, nbytes) in enumerate(fields):
        o = 0
        while o < nbytes:
            w = next(w for w in (16, 8, 4) if stride % w == 0 and o % w == 0 and nbytes - o >= w)
            out.append((j, o, w))
            o += w
    if len(out) > 32:
        raise ValueError(f"{fields}: {len(out)} pieces per token, at most 32 (one warp)")
    return out


def _kernel_source() -> str:
    """One kernel per layout. As in the decode kernel's tile copies, consecutive lanes read consecutive pieces
    of one token (a warp covers 32 // pieces tokens per step), and each lane issues UNROLL tokens' loads
    before using any (a loop of dependent loads would measure latency, not the memory system)."""
    parts = [r"""
#include <cstdint>
#include <cuda_runtime.h>

template <int W>
__device__ __forceinline__ uint32_t load_piece(const uint8_t* p) {
  if constexpr (W == 16) { const uint4 v = __ldg(reinterpret_cast<const uint4*>(p)); return v.x ^ v.y ^ v.z ^ v.w; }
  else if constexpr (W == 8) { const uint2 v = __ldg(reinterpret_cast<const uint2*>(p)); return v.x ^ v.y; }
  else return __ldg(reinterpret_cast<const uint32_t*>(p));
}

extern "C" int set_fetch_granularity(int bytes, int* now) {
  cudaError_t e = cudaDeviceSetLimit(cudaLimitMaxL2FetchGranularity, size_t(bytes));
  size_t v = 0;
  cudaDeviceGetLimit(&v, cudaLimitMaxL2FetchGranularity);
  *now = int(v);
  return int(e);
}
"""]
    for n, (name, fields) in enumerate(LAYOUTS.items()):
        ps = pieces(fields)
        per = 32 // len(ps)
        args = ", ".join(f"const uint8_t* b{j}" for j in range(len(fields)))
        cases = "\n".join(
            f"    case {i}: for (int u = 0; u < {UNROLL}; ++u) acc ^= load_piece<{w}>(b{j} + uint64_t(t[u]) * {fields[j][0]} + {o}); break;"
            for i, (j, o, w) in enumerate(ps))
        parts.append(f"""
// {name}: {len(ps)} pieces per token, {per} token(s) per warp step
__global__ void __launch_bounds__(256) gather{n}({args}, uint32_t tokens, uint32_t mult, uint32_t* sink) {{
  const int lane = threadIdx.x % 32;
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int group = lane / {len(ps)}, piece = lane % {len(ps)};
  if (group >= {per}) return;
  uint32_t t[{UNROLL}];
#pragma unroll
  for (int u = 0; u < {UNROLL}; ++u) t[u] = (((warp * {UNROLL} + u) * {per} + group) * mult) & (tokens - 1);
  uint32_t acc = 0;
  switch (piece) {{
{cases}
  }}
  if (acc == 0x9E3779B9u) sink[0] = acc;
}}
extern "C" int run{n}(const void* const* b, uint32_t tokens, uint32_t mult, uint32_t* sink, void* stream) {{
  const uint32_t warps = (tokens + {per * UNROLL - 1}) / {per * UNROLL};
  gather{n}<<<(warps + 7) / 8, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      {", ".join(f"static_cast<const uint8_t*>(b[{j}])" for j in range(len(fields)))}, tokens, mult, sink);
  return int(cudaGetLastError());
}}
""")
    return "".join(parts)


def build(workdir: Path) -> ctypes.CDLL:
    src = workdir / "gather.cu"
    lib = workdir / "gather.so"
    src.write_text(_kernel_source())
    subprocess.run(["nvcc", "-O3", "-shared", "-Xcompiler", "-fPIC", "-cudart", "shared",
                    "-gencode", "arch=compute_90a,code=sm_90a", "-o", str(lib), str(src)], check=True)
    return ctypes.CDLL(str(lib))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gather_granularity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1 << 20, help="tokens per layout (a power of two, at least 256)")
    ap.add_argument("--granularities", type=int, nargs="+", default=[0, 32, 64, 128],
                    help="cudaLimitMaxL2FetchGranularity values to try (0: leave the driver's default)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "studies")
    args = ap.parse_args(argv)
    if args.tokens < 256 or args.tokens & (args.tokens - 1):
        ap.error(f"--tokens must be a power of two >= 256, got {args.tokens}")

    import torch

    from benchmarks import meta, results_io
    from benchmarks.timing import bench

    lib = build(Path(tempfile.mkdtemp(prefix="mpfa-gather-")))
    torch.cuda.init()
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    rows = []
    lib.set_fetch_granularity.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    for gran in args.granularities:
        now = ctypes.c_int(0)
        # 0 keeps the driver's default and only reads it back (a set of 0 is refused)
        err = lib.set_fetch_granularity(gran, ctypes.byref(now)) if gran else 0
        for n, (name, fields) in enumerate(LAYOUTS.items()):
            run = getattr(lib, f"run{n}")
            run.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p,
                            ctypes.c_void_p]
            bufs = [torch.randint(-2**31, 2**31 - 1, (args.tokens * s // 4,), dtype=torch.int32, device="cuda")
                    for s, _ in fields]
            bases = (ctypes.c_void_p * len(fields))(*[b.data_ptr() for b in bufs])
            useful = sum(n for _, n in fields) * args.tokens
            stream = torch.cuda.current_stream().cuda_stream
            res = {}
            for order, mult in (("in_order", 1), ("random", 2654435761)):
                def launch():
                    rc = run(bases, args.tokens, mult, ctypes.c_void_p(sink.data_ptr()), ctypes.c_void_p(stream))
                    if rc:
                        raise RuntimeError(f"gather launch failed: CUDA error {rc}")
                t = bench(launch)
                res[order] = t.median
                rows.append({"kind": "gather", "layout": name, "order": order, "granularity_set": gran,
                             "granularity_now": now.value, "set_error": err, "tokens": args.tokens,
                             "useful_bytes_per_token": sum(n for _, n in fields),
                             "stored_bytes_per_token": sum(s for s, _ in fields), **t.as_row(),
                             "useful_gbps": useful / (t.median * 1e-3) / 1e9})
            rows[-1]["fraction_of_in_order"] = res["in_order"] / res["random"]
            print(f"gran {gran:>3} (now {now.value}) {name:<20} in-order {useful / res['in_order'] / 1e6:7.0f} GB/s"
                  f"  random {useful / res['random'] / 1e6:7.0f} GB/s  ratio {res['in_order'] / res['random']:.3f}",
                  flush=True)
            del bufs
            torch.cuda.empty_cache()
    cmd = "python -m benchmarks.gather_granularity " + " ".join(sys.argv[1:] if argv is None else argv)
    summary = {r["layout"] + "@" + str(r["granularity_set"]): round(r["fraction_of_in_order"], 3)
               for r in rows if "fraction_of_in_order" in r}
    path = results_io.write("gather_granularity_h200", meta.collect(cmd), summary, rows, args.out)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
