"""The on-disk kernel cache: exactly one builder per key, atomic publish, corrupt entries rebuilt.

Layout under the cache directory (``MPFA_CACHE_DIR``, default ``~/.cache/mpfa``):

    lib/<uri>/kernel.so, manifest.json   published builds; the manifest (sha256 of the library)
                                         is written before the folder is renamed into lib/
    tmp/<uri>.<pid>.<n>/                 builds in progress; a killed build leaves one here, and
                                         the next builder of that key removes it
    locks/<uri>.lock                     a file lock held while a key is checked and built
    builds.log                           one line per finished build (time, pid, key, seconds)

Many processes (SGLang's tensor-parallel workers) may ask for one key at once: each takes the
key's lock, looks again, and only the first finds nothing and builds; the rest wait and load.
A process killed mid-build releases its lock with its death (the OS drops the flock) and never
reaches the rename, so no half-written library is ever published.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from . import env
from .build import LIB_NAME, build
from .spec import KernelSpec

log = logging.getLogger("mpfa_jit")
_counter = itertools.count()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Entry:
    uri: str
    path: Path
    manifest: dict
    size: int


class Store:
    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else env.cache_dir()

    @property
    def lib_dir(self) -> Path:
        return self.root / "lib"

    def entry_dir(self, uri: str) -> Path:
        return self.lib_dir / uri

    def library(self, uri: str) -> Path:
        return self.entry_dir(uri) / LIB_NAME

    def check(self, uri: str) -> str:
        """'ok', 'missing', or 'corrupt' (manifest unreadable or the library's hash differs)."""
        folder = self.entry_dir(uri)
        if not folder.exists():
            return "missing"
        try:
            manifest = json.loads((folder / "manifest.json").read_text())
            lib = folder / LIB_NAME
            if lib.stat().st_size != manifest["size"] or _sha256(lib) != manifest["sha256"]:
                return "corrupt"
        except (OSError, ValueError, KeyError):
            return "corrupt"
        return "ok"

    def get_or_build(self, spec: KernelSpec, source: str, uri: str) -> tuple[Path, bool]:
        """The published library for ``uri``, built first if needed. Returns (path, built_here)."""
        if self.check(uri) == "ok":
            return self.library(uri), False
        for d in ("lib", "tmp", "locks"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.root / "locks" / f"{uri}.lock")):
            state = self.check(uri)
            if state == "ok":          # another process built it while we waited
                return self.library(uri), False
            if state == "corrupt":
                log.warning("mpfa_jit: cache entry %s is corrupt; rebuilding", uri)
                shutil.rmtree(self.entry_dir(uri), ignore_errors=True)
            for stale in (self.root / "tmp").glob(f"{uri}.*"):
                shutil.rmtree(stale, ignore_errors=True)   # left by a killed builder of this key
            tmp = self.root / "tmp" / f"{uri}.{os.getpid()}.{next(_counter)}"
            log.info("mpfa_jit: building %s", spec.key)
            try:
                seconds = build(spec, source, tmp)
                lib = tmp / LIB_NAME
                manifest = {
                    "key": spec.key, "uri": uri, "op": spec.op, "params": dict(spec.params), "arch": spec.arch,
                    "compiler": env.compiler_id(), "sha256": _sha256(lib), "size": lib.stat().st_size,
                    "build_seconds": round(seconds, 3), "created": time.time(),
                }
                (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
                os.rename(tmp, self.entry_dir(uri))   # the publish: atomic within one filesystem
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            with open(self.root / "builds.log", "a") as f:
                f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} pid={os.getpid()} built {uri} in {seconds:.1f}s\n")
            log.info("mpfa_jit: built %s in %.1f s", spec.key, seconds)
            return self.library(uri), True

    def remove(self, uri: str) -> None:
        shutil.rmtree(self.entry_dir(uri), ignore_errors=True)

    def entries(self) -> list[Entry]:
        out = []
        if not self.lib_dir.is_dir():
            return out
        for folder in sorted(self.lib_dir.iterdir()):
            try:
                manifest = json.loads((folder / "manifest.json").read_text())
            except (OSError, ValueError):
                manifest = {}
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            out.append(Entry(folder.name, folder, manifest, size))
        return out

    def size(self) -> int:
        if not self.root.is_dir():
            return 0
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())

    def clear(self) -> int:
        """Remove every build (published and in progress); returns the bytes freed."""
        freed = self.size()
        for d in ("lib", "tmp", "locks"):
            shutil.rmtree(self.root / d, ignore_errors=True)
        for f in ("builds.log", "compiler.json"):
            (self.root / f).unlink(missing_ok=True)
        return freed
