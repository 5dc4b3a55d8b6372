"""Builds one specialization's shared library with nvcc, driven by ninja, in a private folder."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

from . import env
from .errors import BuildError
from .render import include_dir
from .spec import KernelSpec

LIB_NAME = "kernel.so"


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


def build(spec: KernelSpec, source: str, folder: Path) -> float:
    """Build into ``folder`` (created here); returns the seconds it took. Raises BuildError."""
    folder.mkdir(parents=True)
    write_ninja(spec, source, folder)
    start = time.monotonic()
    cmd = [ninja_path(), "-C", str(folder)] + (["-v"] if env.verbose() else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (folder / "build.log").write_text(proc.stdout + proc.stderr)
    if env.verbose():
        print(proc.stdout + proc.stderr, flush=True)
    if proc.returncode != 0 or not (folder / LIB_NAME).is_file():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise BuildError(f"building {spec.key} failed (ninja exit {proc.returncode}) in {folder}:\n{tail}")
    return time.monotonic() - start
