"""Environment of the kernel service: cache location, nvcc, target architectures, parallelism.

| variable              | meaning                                                    | default              |
|-----------------------|------------------------------------------------------------|----------------------|
| MPFA_CACHE_DIR        | where built kernels are kept                               | ~/.cache/mpfa        |
| MPFA_NVCC             | the nvcc to build with                                     | $CUDA_HOME/bin/nvcc, then $CUDA_PATH/bin/nvcc, then PATH, then /usr/local/cuda/bin/nvcc |
| MPFA_CUDA_ARCH        | target, e.g. ``sm_90a``; set it to build without a GPU     | the current GPU's    |
| MPFA_JIT_JOBS         | parallel builds in warmup                                  | CPU count, at most 8 |
| MPFA_JIT_VERBOSE      | 1: log every build command and the compiler's output      | 0                    |
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

from .errors import NvccNotFoundError, UnsupportedArchError

# The architectures mpfa has kernels for. Blackwell (sm_100a) is the design's home but is not built yet.
SUPPORTED_ARCHS = ("sm_90a",)


# The file that makes a folder an mpfa kernel cache. CACHEDIR.TAG follows the Cache Directory Tagging
# Specification (backup tools skip the folder); the mpfa line tells it from other tools' tags.
CACHE_MARKER = "CACHEDIR.TAG"
CACHE_MARKER_TEXT = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This folder is an mpfa kernel cache (MPFA_CACHE_DIR). `python -m mpfa_jit.cache clear` deletes only\n"
    "# the builds it recognises here; see mpfa_jit/store.py for the layout.\n"
)
_MARKER_ID = "mpfa kernel cache"


def cache_dir() -> Path:
    return Path(os.environ.get("MPFA_CACHE_DIR") or Path.home() / ".cache" / "mpfa").expanduser()


def is_marked_cache(root: Path) -> bool:
    """Whether ``root`` carries mpfa's cache marker."""
    try:
        with open(Path(root) / CACHE_MARKER, encoding="utf-8", errors="replace") as f:
            return _MARKER_ID in f.read(4096)
    except OSError:
        return False


def verbose() -> bool:
    return os.environ.get("MPFA_JIT_VERBOSE", "0") not in ("", "0", "false", "False")


def jobs() -> int:
    raw = os.environ.get("MPFA_JIT_JOBS")
    if raw:
        try:
            n = int(raw)
        except ValueError:
            raise ValueError(f"MPFA_JIT_JOBS must be a positive integer, got {raw!r}") from None
        if n < 1:
            raise ValueError(f"MPFA_JIT_JOBS must be a positive integer, got {raw!r}")
        return n
    return max(1, min(8, os.cpu_count() or 1))


def nvcc_path() -> str:
    explicit = os.environ.get("MPFA_NVCC")
    if explicit:
        if os.path.isfile(explicit) and os.access(explicit, os.X_OK):
            return os.path.realpath(explicit)
        raise NvccNotFoundError(f"MPFA_NVCC={explicit!r} is not an executable file: point it at nvcc "
                                "(CUDA 13.0 tested) or unset it to search CUDA_HOME and PATH")
    candidates = []
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home:
            candidates.append(os.path.join(home, "bin", "nvcc"))
    which = shutil.which("nvcc")
    if which:
        candidates.append(which)
    candidates.append("/usr/local/cuda/bin/nvcc")
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.realpath(c)
    raise NvccNotFoundError(
        "nvcc not found: mpfa builds its kernels at first use and needs the CUDA compiler (13.0 tested). "
        f"Looked at: {', '.join(candidates)}. Install the CUDA toolkit, or set MPFA_NVCC (or CUDA_HOME) "
        "to point at it.")


def compiler_id() -> str:
    """nvcc's version line, memoized on disk per (path, size, mtime): a warm load runs no compiler."""
    path = nvcc_path()
    st = os.stat(path)
    return _compiler_id(path, st.st_size, int(st.st_mtime))


@functools.lru_cache(maxsize=None)   # per process; thread-safe enough: a duplicate call is harmless
def _compiler_id(path: str, size: int, mtime: int) -> str:
    memo = cache_dir() / "compiler.json"
    tag = f"{path}:{size}:{mtime}"
    try:
        known = json.loads(memo.read_text())
        if tag in known:
            return known[tag]
    except (OSError, ValueError):
        known = {}
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
    version = [line for line in out.splitlines() if line.strip()][-1].strip()
    known[tag] = version
    if not is_marked_cache(memo.parent):   # never write into a folder that is not (yet) a kernel cache
        return version
    # Threads of one warmup and processes of one server may all get here: unique temp names, then an
    # atomic replace; the last writer wins and every writer wrote the same version line.
    tmp = memo.with_name(f"compiler.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(known))
    os.replace(tmp, memo)
    return version


def cuda_tool(name: str) -> str | None:
    """A CUDA binary (cuobjdump, nvdisasm, ...): beside nvcc, on PATH, or from the PyPI nvidia-cuda-* wheels."""
    dirs = []
    try:
        dirs.append(os.path.dirname(nvcc_path()))
    except NvccNotFoundError:
        pass
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia
        for base in nvidia.__path__:
            dirs += [os.path.join(base, sub, "bin") for sub in ("cu13", "cuda_nvcc", "cuda_cuobjdump", "cuda_nvdisasm")]
    except ImportError:
        pass
    for d in dirs:
        cand = os.path.join(d, name)
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def arch_from_capability(major: int, minor: int) -> str:
    # Hopper's wgmma and setmaxnreg exist only on the arch-specific target sm_90a.
    return f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"


def target_arch(device=None) -> str:
    """The architecture to build for: ``device``'s when given, else MPFA_CUDA_ARCH, else the current GPU's."""
    raw = os.environ.get("MPFA_CUDA_ARCH") if device is None else None
    if raw:
        arch = raw.strip()
    else:
        import torch
        if not torch.cuda.is_available():
            raise UnsupportedArchError(
                "no CUDA device to build for: set MPFA_CUDA_ARCH=sm_90a to build Hopper kernels without a GPU "
                f"(supported: {', '.join(SUPPORTED_ARCHS)})")
        major, minor = torch.cuda.get_device_capability(device)
        arch = arch_from_capability(major, minor)
    check_arch(arch)
    return arch


def check_arch(arch: str) -> None:
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedArchError(
            f"arch {arch!r} is not supported: mpfa kernels are built for {', '.join(SUPPORTED_ARCHS)} "
            "(NVIDIA Hopper: H100/H200). Blackwell (sm_100a) is not built yet; older GPUs lack wgmma.")


def gencode(arch: str) -> str:
    num = arch[len("sm_"):]
    return f"arch=compute_{num},code=sm_{num}"
