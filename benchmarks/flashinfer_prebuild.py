"""Prebuild the FlashInfer JIT modules the benchmark peers use, so the GPU machine loads them
instead of compiling them (an fa3 module takes ~90 s of GPU-machine time to build).

FlashInfer 0.6.15.post1 (`flashinfer/jit/core.py`) loads `<AOT dir>/<uri>/<uri>.so` directly, without
ninja or nvcc, when that file exists (`JitSpec.is_aot`); the AOT dir is `flashinfer/data/aot` inside
the installed package (or the `flashinfer_jit_cache` package's dir when that is installed). The `.so`
files are plain tvm-ffi libraries (no Python ABI), so a build here (any x86-64 Linux with nvcc 13.0,
no GPU) serves the H200 machine (Python 3.12, torch 2.11+cu130, nvcc 13.0).

The modules are exactly what the peer code paths request (head_dim 128, bf16 queries and outputs,
int32 indices, no RoPE / sliding window / soft cap, the arguments the wrappers pass):

- decode suite, BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=False): the CUDA-core
  batch_decode module per KV dtype (bf16, e4m3, uint8 = NVFP4); with use_tensor_cores=True: the fa2
  batch_prefill module per KV dtype (FP8 KV with a bf16 query is not FA3-eligible, so "auto" -> fa2).
  NVFP4 with use_tensor_cores=False has no module: its plan() compiles one and nvcc fails on any arch
  (the CUDA-core decode template has no FP4 path; see NOT_BUILDABLE), on every call, as nothing is cached.
- prefill suite, single_prefill_with_kv_cache(..., causal=True, backend="fa3"): bf16 and e4m3 (o bf16).
- append suite, flashinfer.page.append_paged_kv_cache and nvfp4_quantize_append_paged_kv_cache: "page".

Here (CPU machine, 2 cores: ~18 min; needs a torch to import, `pip install --target /tmp/site --no-deps
flashinfer-python==0.6.15.post1 apache-tvm-ffi==0.1.11 nvidia-ml-py einops tabulate`, and, where the
toolkit lacks curand_kernel.h, `pip install --target /tmp/fi_curand --no-deps nvidia-curand==10.4.0.35`):

    PYTHONPATH=/tmp/site nice -n 10 python -m benchmarks.flashinfer_prebuild --out .fi_aot --jobs 2 \
        --curand-include /tmp/fi_curand/nvidia/cu13/include

On the GPU machine, after the three `bash .devbundle/cK/install.sh` calls (carry .fi_aot beside them):

    export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
    python3 -m benchmarks.flashinfer_prebuild --install --out .fi_aot   # copy into FlashInfer's AOT dir
    python3 -m benchmarks.flashinfer_prebuild --verify                  # optional: no module would build

`--verify` regenerates the specs with FlashInfer's own generators and fails if any would compile.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

FLASHINFER_VERSION = "0.6.15.post1"
ARCH = "9.0a"
MANIFEST = "manifest.json"
# Peer calls whose module does not compile in 0.6.15.post1: plan() attempts the build and raises.
NOT_BUILDABLE = {
    "decode nvfp4 tc=False": "batch_decode_with_kv_cache_dtype_q_bf16_dtype_kv_u8_..._use_logits_cap_False: "
    "RuntimeError: Ninja build failed ... vec_dtypes.cuh(117): error: no suitable conversion function from "
    '"const Params::DTypeKV" to "float" exists',
}


def _peer_specs() -> list[tuple[str, object]]:
    """(what uses it, JitSpec) for every module the benchmark peers load; imports flashinfer."""
    import torch
    from flashinfer.jit.attention.modules import (gen_batch_decode_module, gen_batch_prefill_module,
                                                  gen_single_prefill_module)
    from flashinfer.jit.page import gen_page_module

    bf16, e4m3, u8, i32 = torch.bfloat16, torch.float8_e4m3fn, torch.uint8, torch.int32
    d, posenc, swa, softcap, f16qk = 128, 0, False, False, False
    kvs = (("bf16", bf16), ("fp8", e4m3), ("nvfp4", u8))
    out = []
    for name, kv in kvs[:2]:   # decode.py plan(), use_tensor_cores=False: get_batch_decode_module(...)
        out.append((f"decode {name} tc=False",
                    gen_batch_decode_module(bf16, kv, bf16, i32, d, d, posenc, swa, softcap)))
    for name, kv in kvs:   # use_tensor_cores=True, backend "auto" -> "fa2": get_batch_prefill_module(...)
        out.append((f"decode {name} tc=True (fa2)",
                    gen_batch_prefill_module("fa2", bf16, kv, bf16, i32, d, d, posenc, swa, softcap, f16qk)))
    for name, q in (("bf16", bf16), ("fp8", e4m3)):   # prefill.py single_prefill_with_kv_cache(backend="fa3")
        out.append((f"prefill fa3 {name}",
                    gen_single_prefill_module("fa3", q, q, bf16, d, d, posenc, swa, softcap, f16qk)))
    out.append(("append (page)", gen_page_module()))
    return out


def _check_flashinfer() -> None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        v = version("flashinfer-python")
    except PackageNotFoundError:
        sys.exit("flashinfer-python is not installed (on the GPU machine: install the peers bundle and "
                 "export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages)")
    if v != FLASHINFER_VERSION:
        sys.exit(f"flashinfer-python {v} is installed; these modules are for {FLASHINFER_VERSION}")


def _aot_dir() -> Path:
    """FlashInfer's AOT dir (flashinfer/jit/env.py:_get_aot_dir), found without importing flashinfer."""
    if importlib.util.find_spec("flashinfer_jit_cache") is not None:
        import flashinfer_jit_cache
        return Path(flashinfer_jit_cache.get_jit_cache_dir())
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("flashinfer is not importable")
    return Path(list(spec.submodule_search_locations)[0]).resolve() / "data" / "aot"


def _cuda_home() -> Path:
    """The toolkit root: $CUDA_HOME, else /usr/local/cuda, else the one above the real nvcc."""
    for c in (os.environ.get("CUDA_HOME"), "/usr/local/cuda",
              os.path.dirname(os.path.dirname(os.path.realpath(shutil.which("nvcc") or "/")))):
        if c and os.path.isfile(os.path.join(c, "bin", "nvcc")):
            return Path(c)
    sys.exit("no CUDA toolkit found (set CUDA_HOME to the folder holding bin/nvcc)")


def _libcuda_stub(cuda_home: Path, workdir: Path) -> str:
    """FlashInfer links every module with -lcuda. A toolkit without lib64/stubs/libcuda.so (pip-assembled,
    as on the CPU machine) gets an empty stand-in with the driver's soname to satisfy the link. These
    modules call no driver API: their NEEDED list is libcudart.so.13, libstdc++, libgcc_s and libc."""
    if (cuda_home / "lib64" / "stubs" / "libcuda.so").exists():
        return ""
    d = workdir.resolve() / "stubs"
    d.mkdir(parents=True, exist_ok=True)
    (d / "empty.c").write_text("void mpfa_libcuda_stub(void) {}\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(d / "libcuda.so"),
                    str(d / "empty.c")], check=True)
    return f"-L{d}"


def _curand_include(cuda_home: Path, given: Path | None) -> str:
    """The fa3 modules include curand_kernel.h (through CUTLASS's tensor_fill.h); a pip-assembled
    toolkit may lack it: then take it from --curand-include or an nvidia-curand wheel on sys.path."""
    if (cuda_home / "include" / "curand_kernel.h").exists():
        return ""
    cands = [given] if given else [Path(p) / "nvidia" / sub / "include" for p in sys.path if p
                                   for sub in ("cu13", "curand")]
    for c in cands:
        if (c / "curand_kernel.h").exists():
            return f"-isystem {c.resolve()}"
    sys.exit(f"curand_kernel.h is not in {cuda_home}/include"
             + (f" nor in {given}" if given else " nor in an nvidia-curand wheel on sys.path")
             + ": pip install --no-deps --target /tmp/fi_curand nvidia-curand==10.4.0.35 and pass "
             "--curand-include /tmp/fi_curand/nvidia/cu13/include")


def build(out: Path, jobs: int, workdir: Path, strip: bool, curand: Path | None) -> None:
    cuda_home = _cuda_home()
    if shutil.which("ninja") is None:
        sys.exit("ninja not found (pip install ninja)")
    os.environ["CUDA_HOME"] = str(cuda_home)
    inc = _curand_include(cuda_home, curand)
    if inc:
        os.environ["FLASHINFER_EXTRA_CUDAFLAGS"] = f"{os.environ.get('FLASHINFER_EXTRA_CUDAFLAGS', '')} {inc}".strip()
    stub = _libcuda_stub(cuda_home, workdir)
    if stub:
        os.environ["FLASHINFER_EXTRA_LDFLAGS"] = (os.environ.get("FLASHINFER_EXTRA_LDFLAGS", "") + " " + stub).strip()
    if os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", ARCH) != ARCH:
        sys.exit(f"FLASHINFER_CUDA_ARCH_LIST={os.environ['FLASHINFER_CUDA_ARCH_LIST']!r}: this tool builds {ARCH} only")
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(workdir.resolve())   # read when flashinfer is imported
    os.environ["MAX_JOBS"] = str(jobs)                                  # ninja -j for each module
    os.environ.setdefault("FLASHINFER_NVCC_THREADS", "1")
    _check_flashinfer()
    specs = _peer_specs()
    out.mkdir(parents=True, exist_ok=True)
    for use, why in NOT_BUILDABLE.items():
        print(f"skipped: {use}: does not compile ({why})", flush=True)
    rows, t_all = [], time.time()
    for i, (use, spec) in enumerate(specs, 1):
        t0 = time.time()
        print(f"[{i}/{len(specs)}] {use}: {spec.name} ...", flush=True)
        try:
            spec.build(verbose=False)
        except RuntimeError as e:
            sys.exit(f"build of {spec.name} failed:\n{str(e)[-4000:]}")
        dest = out / spec.name / f"{spec.name}.so"
        dest.parent.mkdir(exist_ok=True)
        shutil.copyfile(spec.jit_library_path, dest)
        if strip and shutil.which("strip"):
            subprocess.run(["strip", "--strip-unneeded", str(dest)], check=True)
        size = dest.stat().st_size
        rows.append({"name": spec.name, "use": use, "bytes": size})
        print(f"[{i}/{len(specs)}] {use}: {size / 2**20:.1f} MiB in {time.time() - t0:.0f} s", flush=True)
    from flashinfer.jit.cpp_ext import get_cuda_version
    manifest = {"flashinfer": FLASHINFER_VERSION, "arch": ARCH, "nvcc": str(get_cuda_version()),
                "modules": rows, "total_bytes": sum(r["bytes"] for r in rows), "not_buildable": NOT_BUILDABLE}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(rows)} modules, {manifest['total_bytes'] / 2**20:.1f} MiB in {out} "
          f"({time.time() - t_all:.0f} s)")


def install(src: Path) -> None:
    mf = src / MANIFEST
    if not mf.is_file():
        sys.exit(f"{mf} not found: build with `python -m benchmarks.flashinfer_prebuild --out {src}` "
                 "and carry the folder to this machine")
    manifest = json.loads(mf.read_text())
    _check_flashinfer()
    if manifest["flashinfer"] != FLASHINFER_VERSION:
        sys.exit(f"{src} holds modules for flashinfer {manifest['flashinfer']}")
    aot = _aot_dir()
    for row in manifest["modules"]:
        so = src / row["name"] / f"{row['name']}.so"
        if not so.is_file():
            sys.exit(f"{so} is missing")
        (aot / row["name"]).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(so, aot / row["name"] / so.name)
    print(f"{len(manifest['modules'])} prebuilt FlashInfer modules ({manifest['arch']}) installed into {aot}")


def verify() -> None:
    """Regenerate every peer spec; fail if FlashInfer would build any instead of loading its .so."""
    _check_flashinfer()
    import torch
    if not torch.cuda.is_available():   # no GPU to detect the arch from (a CPU machine): assume the H200's
        os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", ARCH)
    from flashinfer.jit import core

    def refuse(self, *a, **k):
        raise RuntimeError(f"{self.name} would be compiled")
    core.JitSpec.build = refuse
    missing = [(use, s) for use, s in _peer_specs() if not s.is_aot]
    for use, s in missing:
        print(f"would compile: {use}: {s.aot_path}")
    if missing:
        sys.exit(f"{len(missing)} modules not prebuilt")
    print("every buildable peer module resolves to a prebuilt .so: none will compile")
    for use, why in NOT_BUILDABLE.items():
        print(f"still compiles (and fails) at plan(): {use}: {why}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(".fi_aot"), help="folder of prebuilt modules (default .fi_aot)")
    ap.add_argument("--jobs", type=int, default=2, help="parallel nvcc jobs per module (MAX_JOBS; default 2)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/fi_prebuild_ws"),
                    help="FlashInfer build workspace (FLASHINFER_WORKSPACE_BASE); kept for incremental rebuilds")
    ap.add_argument("--no-strip", action="store_true", help="keep the symbol tables")
    ap.add_argument("--curand-include", type=Path, help="folder holding curand_kernel.h, if the toolkit lacks it")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--install", action="store_true", help="copy --out into the installed FlashInfer's AOT dir")
    g.add_argument("--verify", action="store_true", help="check that no peer module would be compiled")
    a = ap.parse_args()
    if a.install:
        install(a.out)
    elif a.verify:
        verify()
    else:
        build(a.out, a.jobs, a.workdir, not a.no_strip, a.curand_include)


if __name__ == "__main__":
    main()
