"""Prebuild the FlashInfer JIT modules the benchmark peers (`--set peers`, the default, into .fi_aot)
or SGLang 0.5.17's `--attention-backend flashinfer` (`--set sglang`, into .fi_aot_sglang) use, so the
GPU machine loads them instead of compiling them (an fa3 module takes ~90 s of GPU-machine time to build).

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

`--verify` regenerates the specs with FlashInfer's own generators and fails if any would compile;
`--verify --load` also loads each .so as FlashInfer would (works without a GPU too).

The sglang set (`--set sglang`) is what SGLang 0.5.17's FlashInfer backend
(python/sglang/srt/layers/attention/flashinfer_backend.py) requests for bf16 models with full attention
(no sliding window, no soft cap, no RoPE in the kernel, no custom mask, int32 indices, page size 1),
with a bf16 KV cache and with `--kv-cache-dtype fp8_e4m3`, for the models in SGLANG_MODELS:

- decode, BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="fa2", use_tensor_cores=T), eager and
  under CUDA graphs (use_cuda_graph=True, replays planned by fast_decode_plan: same module). T is
  SGLang's should_use_tensor_core: FP8 KV, or a GQA group >= 4. So SmolLM2 (9/3 heads, group 3) with bf16
  KV gets the CUDA-core batch_decode module; every other case the fa2 batch_prefill module.
- extend with a cached prefix, BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2"),
  q bf16 / kv = the cache dtype: the same fa2 batch_prefill module as tensor-core decode (also under
  the prefill CUDA graph, where SGLang plans the paged wrapper only).
- extend, ragged part (the new tokens' own K/V, always bf16, whatever the cache dtype),
  BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="auto"): "auto" is FA3 on the H200 for
  head_dim 64 and 128, so the fa3 batch_prefill module.
- extend with a prefix merges the ragged and paged parts with flashinfer.cascade.merge_state: "cascade".
- not attention, any backend: SGLang's sampler calls flashinfer's top_k_top_p_sampling_from_probs when a
  request sets top_k or top_p (temperature-only and greedy requests use torch): "sampling".

Head_dim is the only model parameter in a module's name (head counts are runtime), so Qwen3-14B adds
nothing to Llama-3.1-8B: 9 modules, 14.6 MiB stripped, ~28 min here (each fa3 module ~11 min; the two
head_dim-128 fa2 modules are the peers set's, rebuilt in no time from the kept --workdir). The models'
dtype must be bf16: an fp16 server (e.g. --dtype float16) asks for other modules. Build, install, check:

    PYTHONPATH=/tmp/site nice -n 10 python -m benchmarks.flashinfer_prebuild --set sglang --jobs 2 \
        --curand-include /tmp/fi_curand/nvidia/cu13/include                 # -> .fi_aot_sglang
    python3 -m benchmarks.flashinfer_prebuild --install --out .fi_aot_sglang  # GPU machine, after the
    python3 -m benchmarks.flashinfer_prebuild --verify --set sglang --load    # sglang bundle's install.sh
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

from benchmarks import cli

FLASHINFER_VERSION = "0.6.15.post1"
ARCH = "9.0a"
MANIFEST = "manifest.json"
SETS = ("peers", "sglang")
DEFAULT_OUT = {"peers": Path(".fi_aot"), "sglang": Path(".fi_aot_sglang")}
# The models served with SGLang's flashinfer backend: (name, head_dim, query heads, KV heads), bf16
# weights, full attention (server_configs/models/*/config.json; SmolLM2-135M-Instruct is the eval model).
SGLANG_MODELS = (
    ("SmolLM2-135M-Instruct", 64, 9, 3),
    ("Llama-3.1-8B", 128, 32, 8),
    ("Qwen3-14B", 128, 40, 8),
)
SGLANG_KV = ("bf16", "fp8_e4m3")   # --kv-cache-dtype auto (= bf16) and fp8_e4m3
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


def sglang_decode_uses_tensor_cores(kv: str, num_qo_heads: int, num_kv_heads: int) -> bool:
    """SGLang 0.5.17's should_use_tensor_core (flashinfer_backend.py) without the environment override
    SGLANG_FLASHINFER_USE_TENSOR_CORE: FP8 KV always, a bf16 KV cache from a GQA group of 4 up."""
    return kv.startswith("fp8") or num_qo_heads // num_kv_heads >= 4


def sglang_calls() -> list[tuple[str, tuple]]:
    """(SGLang call, module key) for every FlashInfer module SGLang 0.5.17 requests for SGLANG_MODELS x
    SGLANG_KV, in build-priority order (SmolLM2 and Llama bf16 KV first, then FP8 KV, then the sampler).
    A key is ("decode", kv, head_dim) for the CUDA-core batch_decode module, ("prefill", backend, kv,
    head_dim) for a batch_prefill module (q and o bf16), or ("cascade",) / ("sampling",). Plain data:
    needs neither torch nor flashinfer."""
    calls: list[tuple[str, tuple]] = []
    for kv in SGLANG_KV:
        fi_kv = "bf16" if kv == "bf16" else "e4m3"
        for name, d, hq, hk in SGLANG_MODELS:
            tc = sglang_decode_uses_tensor_cores(kv, hq, hk)
            calls.append((f"{name} {kv} KV: decode (eager + CUDA graph), use_tensor_cores={tc}",
                          ("prefill", "fa2", fi_kv, d) if tc else ("decode", fi_kv, d)))
            calls.append((f"{name} {kv} KV: extend, paged prefix (BatchPrefillWithPagedKVCacheWrapper fa2)",
                          ("prefill", "fa2", fi_kv, d)))
            calls.append((f"{name} {kv} KV: extend, ragged new tokens (BatchPrefillWithRaggedKVCacheWrapper "
                          "auto -> fa3, bf16 K/V)", ("prefill", "fa3", "bf16", d)))
        if kv == "bf16":
            calls.append(("extend with a cached prefix: merge_state of ragged + paged (all models)", ("cascade",)))
    calls.append(("sampler: top_k_top_p_sampling_from_probs, requests with top_k/top_p (any backend)",
                  ("sampling",)))
    return calls


def _sglang_specs() -> list[tuple[str, object]]:
    """(what uses it, JitSpec) for sglang_calls(); imports flashinfer."""
    import torch
    from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.cascade import gen_cascade_module
    from flashinfer.jit.sampling import gen_sampling_module

    dt = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}
    bf16, i32, posenc, swa, softcap, f16qk = torch.bfloat16, torch.int32, 0, False, False, False
    out = []
    for use, key in sglang_calls():
        if key[0] == "decode":   # decode.py _plan_impl, use_tensor_cores=False: get_batch_decode_module
            _, kv, d = key
            spec = gen_batch_decode_module(bf16, dt[kv], bf16, i32, d, d, posenc, swa, softcap)
        elif key[0] == "prefill":   # get_batch_prefill_module(backend, q, kv, o, idx, d, d, 0, swa, cap, f16qk)
            _, backend, kv, d = key
            spec = gen_batch_prefill_module(backend, bf16, dt[kv], bf16, i32, d, d, posenc, swa, softcap, f16qk)
        elif key[0] == "cascade":   # cascade.py get_cascade_module
            spec = gen_cascade_module()
        else:                       # sampling.py get_sampling_module
            spec = gen_sampling_module()
        out.append((use, spec))
    return out


def _specs(which: str) -> list[tuple[str, object]]:
    """The set's (uses, JitSpec), one row per module: the uses of one module joined by '; '."""
    rows: dict[str, list] = {}
    for use, spec in (_peer_specs() if which == "peers" else _sglang_specs()):
        rows.setdefault(spec.name, [[], spec])[0].append(use)
    return [("; ".join(uses), spec) for uses, spec in rows.values()]


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


def build(which: str, out: Path, jobs: int, workdir: Path, strip: bool, curand: Path | None) -> None:
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
    specs = _specs(which)
    out.mkdir(parents=True, exist_ok=True)
    not_buildable = NOT_BUILDABLE if which == "peers" else {}
    for use, why in not_buildable.items():
        print(f"skipped: {use}: does not compile ({why})", flush=True)
    from flashinfer.jit.cpp_ext import get_cuda_version
    rows, t_all = [], time.time()

    def write_manifest() -> dict:   # after every module: an interrupted build leaves a usable set
        manifest = {"set": which, "flashinfer": FLASHINFER_VERSION, "arch": ARCH, "nvcc": str(get_cuda_version()),
                    "modules": rows, "total_bytes": sum(r["bytes"] for r in rows), "not_buildable": not_buildable,
                    "complete": len(rows) == len(specs)}
        (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        return manifest
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
        manifest = write_manifest()
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
    print(f"{len(manifest['modules'])} prebuilt FlashInfer modules ({manifest.get('set', 'peers')} set, "
          f"{manifest['arch']}) installed into {aot}"
          + ("" if manifest.get("complete", True) else " (a partial build: --verify lists the rest)"))


def verify(which: str = "peers", load: bool = False) -> None:
    """Regenerate every spec of the set; fail if FlashInfer would build any instead of loading its .so.
    load: also load each through JitSpec.build_and_load (what FlashInfer's get_*_module calls; no GPU
    needed, only libcudart.so.13 on the loader's path)."""
    _check_flashinfer()
    import torch
    if not torch.cuda.is_available():   # no GPU to detect the arch from (a CPU machine): assume the H200's
        os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", ARCH)
    from flashinfer.jit import core

    def refuse(self, *a, **k):
        raise RuntimeError(f"{self.name} would be compiled")
    core.JitSpec.build = refuse
    specs = _specs(which)
    missing = [(use, s) for use, s in specs if not s.is_aot]
    for use, s in missing:
        print(f"would compile: {use}: {s.aot_path}")
    if missing:
        sys.exit(f"{len(missing)} of {len(specs)} {which} modules not prebuilt")
    for use, s in specs if load else ():
        s.build_and_load()   # build() refuses above: this loads <AOT dir>/<uri>/<uri>.so or raises
        print(f"loaded {s.aot_path}")
    print(f"every buildable {which} module ({len(specs)}) resolves to a prebuilt .so: none will compile")
    for use, why in (NOT_BUILDABLE if which == "peers" else {}).items():
        print(f"still compiles (and fails) at plan(): {use}: {why}")


def main() -> None:
    ap = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", dest="which", choices=SETS, default="peers",
                    help="peers: the benchmark peers' modules (default); sglang: SGLang 0.5.17's flashinfer "
                    "attention backend's (and sampler's) for SGLANG_MODELS, bf16 and FP8 KV")
    ap.add_argument("--out", type=Path, help="folder of prebuilt modules (default .fi_aot, or .fi_aot_sglang "
                    "with --set sglang)")
    ap.add_argument("--jobs", type=int, default=2, help="parallel nvcc jobs per module (MAX_JOBS; default 2)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/fi_prebuild_ws"),
                    help="FlashInfer build workspace (FLASHINFER_WORKSPACE_BASE); kept for incremental rebuilds")
    ap.add_argument("--no-strip", action="store_true", help="keep the symbol tables")
    ap.add_argument("--curand-include", type=Path, help="folder holding curand_kernel.h, if the toolkit lacks it")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--install", action="store_true", help="copy --out into the installed FlashInfer's AOT dir")
    g.add_argument("--verify", action="store_true", help="check that no module of the set would be compiled")
    ap.add_argument("--load", action="store_true", help="with --verify: also load every module's .so")
    a = ap.parse_args()
    out = a.out or DEFAULT_OUT[a.which]
    if a.install:
        install(out)
    elif a.verify:
        verify(a.which, a.load)
    else:
        build(a.which, out, a.jobs, a.workdir, not a.no_strip, a.curand_include)


if __name__ == "__main__":
    main()
