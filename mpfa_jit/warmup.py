"""Build every kernel specialization a server will need, in parallel, before it starts.

    python -m mpfa_jit.warmup server_configs/llama-3.1-8b-qk4pv8.yaml
    python -m mpfa_jit.warmup --num-qo-heads 32 --num-kv-heads 8 --head-dim 128 --recipe qk4pv8 --page-size 16

Needs nvcc, not a GPU (the target is the GPU's arch, else MPFA_CUDA_ARCH, else sm_90a). Prints a
progress bar and a summary table (key, built or cached, seconds); exits 1 if any build failed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from tqdm import tqdm

from . import build_only, env
from .errors import MpfaJitError
from .ops import OPS
from .server_config import RECIPES, AttentionShape, load, model_shape


def default_arch() -> str:
    if os.environ.get("MPFA_CUDA_ARCH"):
        return env.target_arch()
    try:
        import torch
        if torch.cuda.is_available():
            return env.target_arch(torch.cuda.current_device())
    except ImportError:
        pass
    return env.SUPPORTED_ARCHS[0]


def server_specs(shape: AttentionShape, recipe: str, page_size: int, arch: str):
    specs = []
    for op in OPS:
        specs += op.server_specs(num_qo_heads=shape.num_qo_heads, num_kv_heads=shape.num_kv_heads,
                                 head_dim=shape.head_dim, recipe=recipe, page_size=page_size, arch=arch)
    return list(dict.fromkeys(specs))   # drop duplicates, keep order


def warmup(specs, jobs: int, progress: bool = True):
    """Build ``specs`` with ``jobs`` builds at once. Returns rows (key, status, seconds, error)."""
    rows = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(build_only, s): s for s in specs}
        bar = tqdm(total=len(specs), desc="mpfa warmup", unit="kernel", disable=not progress, file=sys.stderr)
        for fut in as_completed(futures):
            spec = futures[fut]
            try:
                _, built, seconds = fut.result()
                rows[spec.key] = (spec.key, "built" if built else "cached", seconds, "")
            except Exception as e:   # one failed key must not hide the others' results
                rows[spec.key] = (spec.key, "FAILED", 0.0, f"{type(e).__name__}: {e}")
            bar.update(1)
        bar.close()
    return [rows[s.key] for s in specs]


def format_table(rows) -> str:
    width = max([len("key")] + [len(r[0]) for r in rows])
    lines = [f"{'key':<{width}}  {'status':<6}  {'seconds':>7}", f"{'-' * width}  ------  -------"]
    lines += [f"{k:<{width}}  {st:<6}  {sec:7.2f}" for k, st, sec, _ in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpfa_jit.warmup", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", help="a server config YAML (server_configs/*.yaml)")
    ap.add_argument("--model-path", help="a model folder with config.json (instead of a server config)")
    ap.add_argument("--num-qo-heads", type=int)
    ap.add_argument("--num-kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--recipe", choices=RECIPES)
    ap.add_argument("--page-size", type=int)
    ap.add_argument("--arch", help=f"target arch (supported: {', '.join(env.SUPPORTED_ARCHS)})")
    ap.add_argument("--jobs", type=int, default=None, help="parallel builds (default MPFA_JIT_JOBS or CPU count)")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)

    if a.config:
        cfg = load(a.config)
        shape, recipe, page_size = cfg.shape, a.recipe or cfg.recipe, a.page_size or cfg.page_size
    else:
        if a.model_path:
            shape = model_shape(a.model_path, a.tp_size)
        elif None in (a.num_qo_heads, a.num_kv_heads, a.head_dim):
            ap.error("give a server config, --model-path, or all of --num-qo-heads, --num-kv-heads, --head-dim")
        else:
            shape = AttentionShape(a.num_qo_heads, a.num_kv_heads, a.head_dim, 0)
        recipe, page_size = a.recipe or "qk4pv8", a.page_size or 16
    try:
        arch = a.arch or default_arch()
        env.check_arch(arch)
        env.nvcc_path()
        specs = server_specs(shape, recipe, page_size, arch)
    except (MpfaJitError, ValueError) as e:
        print(f"mpfa warmup: {e}", file=sys.stderr)
        return 2
    jobs = a.jobs or env.jobs()
    print(f"mpfa warmup: {len(specs)} kernels for {shape.num_qo_heads} query / {shape.num_kv_heads} KV heads, "
          f"head_dim {shape.head_dim}, recipe {recipe}, page size {page_size}, {arch}, {jobs} jobs; "
          f"cache {env.cache_dir()}", file=sys.stderr)
    start = time.monotonic()
    rows = warmup(specs, jobs, progress=not a.no_progress)
    print(format_table(rows))
    failed = [r for r in rows if r[1] == "FAILED"]
    print(f"{len(rows) - len(failed)} of {len(rows)} ready in {time.monotonic() - start:.1f} s")
    for r in failed:
        print(f"\n{r[0]}:\n{r[3]}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
