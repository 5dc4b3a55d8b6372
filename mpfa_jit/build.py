"""Builds one specialization's shared library with nvcc, driven by ninja, in a private folder.

ninja runs in its own process group and, on Linux, is told to receive SIGTERM when the building
process dies (even by SIGKILL); ninja's SIGTERM handler then stops every nvcc it started (each in a
process group of its own). An exception in the builder (Ctrl-C) stops the build the same way.
"""
from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import env
from .errors import BuildError
from .render import include_dir
from .spec import KernelSpec

LIB_NAME = "kernel.so"
log = logging.getLogger("mpfa_jit")

# Runs as `python -c` between the builder and ninja: asks the kernel for SIGTERM when the builder dies
# (PR_SET_PDEATHSIG survives the exec into ninja), then becomes ninja. preexec_fn could do the same, but
# is unsafe in a process with threads (warmup builds from a thread pool).
_EXEC_WITH_PARENT_DEATH_SIGNAL = """
import ctypes, os, signal, sys
PR_SET_PDEATHSIG = 1
try:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):   # the builder died before the request took effect
    sys.exit(143)
os.execv(sys.argv[2], sys.argv[2:])
"""


def ninja_path() -> str:
    try:
        import ninja  # the pip package ships the binary
        cand = os.path.join(ninja.BIN_DIR, "ninja")
        if os.path.isfile(cand):
            return cand
    except ImportError:
        pass
    found = shutil.which("ninja")
    if not found:
        raise BuildError("ninja not found: install the 'ninja' Python package (a dependency of mpfa)")
    return found


def write_ninja(spec: KernelSpec, source: str, folder: Path) -> None:
    (folder / "kernel.cu").write_text(source)
    flags = spec.nvcc_flags() + [f"-I{include_dir()}"]
    nvcc = env.nvcc_path()
    text = "\n".join([
        "ninja_required_version = 1.3",
        f"nvcc = {shlex.quote(nvcc)}",
        f"flags = {' '.join(shlex.quote(f) for f in flags)}",
        "rule nvcc_shared",
        "  command = $nvcc $flags -shared $in -o $out",
        "  description = nvcc $out",
        f"build {LIB_NAME}: nvcc_shared kernel.cu",
        "",
    ])
    (folder / "build.ninja").write_text(text)


def _command(ninja_args: list[str]) -> list[str]:
    if sys.platform.startswith("linux") and sys.executable:
        return [sys.executable, "-I", "-S", "-c", _EXEC_WITH_PARENT_DEATH_SIGNAL, str(os.getpid())] + ninja_args
    return ninja_args


def _stop(proc: subprocess.Popen) -> None:
    """Stop ninja's process group (ninja passes SIGTERM on to its compilers) and reap it."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _keep_failed(folder: Path, keep: Path) -> Path:
    shutil.rmtree(keep, ignore_errors=True)   # an earlier failure of the same build
    keep.parent.mkdir(parents=True, exist_ok=True)
    os.rename(folder, keep)
    return keep


def build(spec: KernelSpec, source: str, folder: Path, keep_failed: Path) -> float:
    """Build into ``folder`` (created here); returns the seconds it took. On a compiler or ninja failure the
    folder (kernel.cu, build.ninja, build.log) is moved to ``keep_failed`` and BuildError names it."""
    folder.mkdir(parents=True)
    write_ninja(spec, source, folder)
    start = time.monotonic()
    ninja_args = [ninja_path(), "-C", str(folder)] + (["-v"] if env.verbose() else [])
    proc = subprocess.Popen(_command(ninja_args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", process_group=0)
    try:
        output, _ = proc.communicate()
    except BaseException:
        _stop(proc)
        raise
    (folder / "build.log").write_text(output)
    if env.verbose():
        log.info("mpfa_jit: %s\n%s", shlex.join(ninja_args), output.rstrip())
    if proc.returncode != 0 or not (folder / LIB_NAME).is_file():
        tail = "\n".join(output.splitlines()[-40:])
        kept = _keep_failed(folder, keep_failed)
        raise BuildError(f"building {spec.key} failed (ninja exit {proc.returncode}); its kernel.cu, build.ninja "
                         f"and build.log are kept in {kept} until `python -m mpfa_jit.cache clear`:\n{tail}")
    return time.monotonic() - start
