"""The `meta` block of a results file: what ran, where, with which versions.

Every field degrades to None/"unknown" rather than failing, because a benchmark that ran for
minutes must not be lost to a missing `nvidia-smi`. On the device machine the working tree
is copied without `.git`: pass the commit in `MPFA_BENCH_COMMIT` there.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as _md
import os
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def pkg_version(name: str) -> str | None:
    try:
        return _md.version(name)
    except _md.PackageNotFoundError:
        return None


def git_commit() -> str:
    """HEAD's hash (+"-dirty" when the tree has changes), MPFA_BENCH_COMMIT, or "unknown"."""
    env = os.environ.get("MPFA_BENCH_COMMIT")
    if env:
        return env
    head = _run(["git", "rev-parse", "HEAD"], cwd=REPO)
    if not head:
        return "unknown"
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO)
    return head + ("-dirty" if dirty else "")


def driver_version() -> str | None:
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if out:
        return out.splitlines()[0].strip()
    try:
        import pynvml

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:
        return None


def gpu_name() -> str | None:
    """The first GPU's name (``NVIDIA H200``) from nvidia-smi, or None; like gpu_arch, no CUDA context."""
    out = _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def gpu_arch() -> str | None:
    """The first GPU's build target (``sm_90a`` on the H200) from nvidia-smi, or None: unlike asking torch,
    this opens no CUDA context in the caller, whose memory a server started next would not get."""
    out = _run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"])
    try:
        major, minor = (int(x) for x in out.splitlines()[0].strip().split("."))
    except (AttributeError, IndexError, ValueError):
        return None
    from mpfa_jit.env import arch_from_capability
    return arch_from_capability(major, minor)


def gpu_state() -> str | None:
    """SM/memory clocks, temperature and power when the results are written: a row that moves between
    runs of the same code is first checked against these (the clocks are never changed, only read)."""
    out = _run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
                "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def nvcc_version() -> str | None:
    """e.g. "13.0.88" from `nvcc --version` (PATH, then $CUDA_HOME/bin, then /usr/local/cuda)."""
    cands = [shutil.which("nvcc")]
    for base in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if base:
            cands.append(str(Path(base) / "bin" / "nvcc"))
    for exe in cands:
        if exe and Path(exe).exists():
            out = _run([exe, "--version"])
            if out:
                m = re.search(r"V(\d+\.\d+\.\d+)", out) or re.search(r"release (\S+),", out)
                return m.group(1) if m else out.splitlines()[-1]
    return None


def mpfa_version() -> str | None:
    v = pkg_version("mpfa")
    if v:
        return v
    try:
        import mpfa  # noqa: PLC0415 - lazy on purpose: the report must work without mpfa

        return getattr(mpfa, "__version__", "unversioned")
    except Exception:
        return None


def collect(command: str, **extra) -> dict:
    """Meta for one results file. `extra` (suite name, quick, repeat, ...) is merged in."""
    meta: dict = {
        "command": command,
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": None,
        "sms": None,
        "l2_bytes": None,
        "driver": driver_version(),
        "gpu_state": gpu_state(),
        "cuda": None,
        "torch": None,
        "flashinfer": pkg_version("flashinfer-python") or pkg_version("flashinfer"),
        "sglang": pkg_version("sglang"),
        "triton": pkg_version("triton"),
        "mpfa": mpfa_version(),
        "nvcc": nvcc_version(),
    }
    try:
        import torch

        meta["torch"] = torch.__version__
        meta["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            meta["gpu"] = p.name
            meta["sms"] = p.multi_processor_count
            meta["l2_bytes"] = getattr(p, "L2_cache_size", None)
    except ImportError:
        pass
    meta.update(extra)
    return meta
