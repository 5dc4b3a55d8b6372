"""mpfa_jit: the kernel service. Renders templates/ per specialization, builds them with nvcc for
sm_90a through ninja, keeps them in an on-disk cache shared safely by many processes, and loads
them through ctypes.

    from mpfa_jit import get_kernel
    from mpfa_jit.ops import append_kv
    module = get_kernel(append_kv.spec(recipe="qk4pv8", head_dim=128, page_size=16, arch="sm_90a"))

One module per operation under ``mpfa_jit.ops`` turns arguments into a KernelSpec; this layer never
knows a kernel's internals.
"""
from __future__ import annotations

import logging
import sys
import time

from . import env
from .errors import (BuildError, KernelLaunchError, MpfaJitError, NvccNotFoundError, UnknownKernelError,
                     UnsupportedArchError)
from .loader import KernelModule, load_library
from .spec import KernelSpec
from .store import Store

__all__ = ["get_kernel", "KernelSpec", "KernelModule", "Store", "env", "MpfaJitError", "BuildError",
           "KernelLaunchError", "NvccNotFoundError", "UnknownKernelError", "UnsupportedArchError"]

log = logging.getLogger("mpfa_jit")
if not log.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False

_modules: dict[str, KernelModule] = {}


def get_kernel(spec: KernelSpec, store: Store | None = None) -> KernelModule:
    """Load ``spec``'s library, building it first if no valid build is cached."""
    store = store or Store()
    source = spec.render()
    uri = spec.uri(source)
    cached = _modules.get(f"{store.root}/{uri}")
    if cached is not None:
        return cached
    path, _ = store.get_or_build(spec, source, uri)
    try:
        lib = load_library(path)
    except OSError as e:   # passes the hash check yet will not load: rebuild once
        log.warning("mpfa_jit: %s failed to load (%s); rebuilding", uri, e)
        store.remove(uri)
        path, _ = store.get_or_build(spec, source, uri)
        lib = load_library(path)
    module = KernelModule(spec.key, uri, path, lib)
    _modules[f"{store.root}/{uri}"] = module
    return module


def build_only(spec: KernelSpec, store: Store | None = None) -> tuple[str, bool, float]:
    """Build (or find) ``spec`` without loading it: warmup runs where no GPU may exist.
    Returns (uri, built_now, seconds)."""
    store = store or Store()
    start = time.monotonic()
    source = spec.render()
    uri = spec.uri(source)
    _, built = store.get_or_build(spec, source, uri)
    return uri, built, time.monotonic() - start
