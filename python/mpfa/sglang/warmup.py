"""Build every kernel an mpfa SGLang server will load, in parallel, before it starts.

    python -m mpfa.sglang.warmup server_configs/llama-3.1-8b-qk4pv8.yaml
    python -m mpfa.sglang.warmup --model-path server_configs/models/llama-3.1-8b --page-size 16
    python -m mpfa.sglang.warmup --num-qo-heads 32 --num-kv-heads 8 --head-dim 128 --recipe qk4pv8 --page-size 16

Settings resolve as the server's do (mpfa.sglang.settings): --recipe / --page-size, then MPFA_RECIPE,
MPFA_PAGE_SIZE, MPFA_COMPENSATION, MPFA_KERNEL_BACKEND, then the server config (the argument, else the
one MPFA_CONFIG names), then the defaults. The model is checked as the launcher and the server check it,
with the same message, and the kernels are exactly those the backend loads at startup
(mpfa.sglang.kernels). Needs nvcc, not a GPU (target: --arch, else MPFA_CUDA_ARCH, else the GPU's, else
sm_90a). Prints a progress bar and a summary table (key, built or cached, seconds).

Exit status: 0 every kernel is ready; 1 a build failed, or the cache folder cannot be written; 2 bad usage, a
model or setting the server would refuse, or an MPFA_CACHE_DIR holding other files; 130 interrupted (Ctrl-C).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from mpfa_jit import env
from mpfa_jit.errors import MpfaJitError
from mpfa_jit.store import NotACacheError, Store
from mpfa_jit.warmup import default_arch, format_table, warmup

from ..recipes import RECIPES
from .kernels import server_kernel_specs
from .launch import server_settings
from .model import UnsupportedModelError, check_hf_config, check_model_supported, read_hf_config
from .settings import (ENV_CONFIG, ENV_PAGE_SIZE, ENV_RECIPE, PAGE_SIZES, MpfaConfigError, load_server_config,
                       resolve_settings)

EXIT_OK, EXIT_BUILD_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class _Parser(argparse.ArgumentParser):
    """Bad usage: one line naming the problem, exit 2 (argparse's default prints the usage block first)."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"mpfa warmup: error: {message} (see --help)\n")


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return n


def parse_args(argv, environ=None):
    ap = _Parser(prog="python -m mpfa.sglang.warmup", description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", help="a server config YAML (server_configs/*.yaml); default: MPFA_CONFIG's")
    ap.add_argument("--model-path", help="a model folder with config.json (instead of a server config)")
    ap.add_argument("--tp-size", type=_positive_int, help="tensor parallelism, with --model-path (default 1)")
    ap.add_argument("--num-qo-heads", type=int, help="query heads per GPU (with --num-kv-heads, --head-dim)")
    ap.add_argument("--num-kv-heads", type=int, help="KV heads per GPU")
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--recipe", choices=list(RECIPES), help="overrides MPFA_RECIPE and the config")
    ap.add_argument("--page-size", type=int, choices=list(PAGE_SIZES), help="overrides MPFA_PAGE_SIZE and the config")
    ap.add_argument("--arch", help=f"target arch (supported: {', '.join(env.SUPPORTED_ARCHS)})")
    ap.add_argument("--jobs", type=_positive_int, help="parallel builds (default MPFA_JIT_JOBS or CPU count)")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    shape_flags = [f for f, v in (("--num-qo-heads", a.num_qo_heads), ("--num-kv-heads", a.num_kv_heads),
                                  ("--head-dim", a.head_dim)) if v is not None]
    given = [what for what, on in (("a server config", a.config), ("--model-path", a.model_path),
                                   ("--num-qo-heads/--num-kv-heads/--head-dim", shape_flags)) if on]
    if len(given) > 1:
        ap.error(f"give one of a server config, --model-path, or the head flags; got {' and '.join(given)}")
    if shape_flags and len(shape_flags) < 3:
        ap.error("give all of --num-qo-heads, --num-kv-heads and --head-dim")
    if a.tp_size is not None and not a.model_path:
        ap.error("--tp-size goes with --model-path (a server config states sglang.tp-size; the head flags are "
                 "per GPU)")
    if not given and not (os.environ if environ is None else environ).get(ENV_CONFIG):
        ap.error("give a server config, --model-path, or all of --num-qo-heads, --num-kv-heads, --head-dim")
    return a


def server_plan(a, environ=None):
    """(settings, facts, what): the settings and attention shape the server would resolve for the
    arguments, refused with the server's message where it would refuse them."""
    environ = dict(os.environ if environ is None else environ)
    if a.recipe:
        environ[ENV_RECIPE] = a.recipe
    if a.page_size is not None:
        environ[ENV_PAGE_SIZE] = str(a.page_size)
    heads = a.num_qo_heads is not None
    path = a.config or (None if (heads or a.model_path) else environ.get(ENV_CONFIG))
    config = load_server_config(path) if path else None
    if config:   # what the launcher accepts, decided by the launcher's own function
        settings, facts = server_settings(config, environ)
        return settings, facts, str(config.path)
    settings = resolve_settings(env=environ)
    if heads:
        facts = dict(num_qo_heads=a.num_qo_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim)
        check_model_supported(page_size=settings.page_size, recipe=settings.recipe, **facts)
        return settings, facts, "the given shape"
    facts = check_hf_config(read_hf_config(a.model_path), page_size=settings.page_size, recipe=settings.recipe,
                            tp_size=a.tp_size or 1, where=os.path.join(str(a.model_path), "config.json"))
    return settings, facts, str(a.model_path)


def kernel_specs(settings, facts: dict, arch: str):
    """The kernels the server's backend loads for these settings and this shape (mpfa.sglang.kernels)."""
    return server_kernel_specs(num_qo_heads=facts["num_qo_heads"], num_kv_heads=facts["num_kv_heads"],
                               head_dim=facts["head_dim"], recipe=settings.recipe, page_size=settings.page_size,
                               arch=arch)


def _one_line(e: BaseException) -> str:
    """An error as one line; an OSError also names the cache folder (its str() may name no file at all)."""
    if isinstance(e, OSError):
        where = f"{e.filename}: " if e.filename else ""
        return f"cannot use {env.cache_dir()} as the kernel cache: {where}{e.strerror or e}; point MPFA_CACHE_DIR at " \
               "a folder you can write"
    return " ".join(str(e).split())


def main(argv=None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("mpfa warmup: interrupted; kernels already built stay cached, run it again to finish",
              file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv) -> int:
    a = parse_args(argv)
    try:
        settings, facts, what = server_plan(a)
        jobs = a.jobs or env.jobs()
        arch = a.arch or default_arch()
        specs = kernel_specs(settings, facts, arch)   # checks the arch
        env.nvcc_path()
    except (MpfaConfigError, UnsupportedModelError, MpfaJitError, ValueError) as e:
        print(f"mpfa warmup: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        Store().ensure()   # an MPFA_CACHE_DIR that is not a cache is refused here, once, not per kernel
    except NotACacheError as e:   # someone else's folder: the wrong MPFA_CACHE_DIR
        print(f"mpfa warmup: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (MpfaJitError, OSError) as e:   # a cache that cannot be written (read-only, full): no kernel can be built
        print(f"mpfa warmup: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_BUILD_FAILED
    print(f"mpfa warmup: {len(specs)} kernels for {what}: {facts['num_qo_heads']} query / {facts['num_kv_heads']} "
          f"KV heads per GPU, head_dim {facts['head_dim']}, recipe {settings.recipe}, page size {settings.page_size}, "
          f"{arch}, {jobs} jobs; cache {env.cache_dir()}", file=sys.stderr)
    start = time.monotonic()
    rows = warmup(specs, jobs, progress=not a.no_progress)
    print(format_table(rows))
    failed = [r for r in rows if r[1] == "FAILED"]
    print(f"{len(rows) - len(failed)} of {len(rows)} ready in {time.monotonic() - start:.1f} s")
    for r in failed:
        print(f"\n{r[0]}:\n{r[3]}", file=sys.stderr)
    return EXIT_BUILD_FAILED if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
