"""The on-disk kernel cache: exactly one builder per key, atomic publish, corrupt entries rebuilt.

Layout under the cache directory (``MPFA_CACHE_DIR``, default ``~/.cache/mpfa``):

    CACHEDIR.TAG                         the marker that makes the folder an mpfa cache; written when
                                         the store first creates the cache
    lib/<uri>/kernel.so, manifest.json   published builds; the manifest (sha256 of the library)
                                         is written before the folder is renamed into lib/
    tmp/<uri>.<pid>.<n>/                 builds in progress; a killed build leaves one here, and
                                         the next builder of that key removes it
    failed/<uri>/                        the last failed build of a key (kernel.cu, build.ninja,
                                         build.log), kept for reading until the next clear
    locks/<uri>.lock                     a file lock held while a key is checked and built
    builds.log                           one line per finished build (time, pid, key, seconds)
    compiler.json                        nvcc's version line per nvcc binary (env.compiler_id)

Many processes (SGLang's tensor-parallel workers) may ask for one key at once: each takes the
key's lock, looks again, and only the first finds nothing and builds; the rest wait and load.
A process killed mid-build releases its lock with its death (the OS drops the flock) and never
reaches the rename, so no half-written library is ever published.

The store builds only into a folder that is missing, empty, or already a cache: it never mixes
its files into a folder of other things. ``clear`` deletes only the entries above, each key under
its lock (a key being built is skipped), and refuses a folder without the marker. A cache made by
an older mpfa (no marker; nothing but the names above, with at least one manifest in lib/) is
recognised by its manifests and adopted: the marker is written at its next build or clear.
"""
from __future__ import annotations

import errno
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout

from . import env
from .build import LIB_NAME, build
from .errors import MpfaJitError
from .spec import KernelSpec

log = logging.getLogger("mpfa_jit")
_counter = itertools.count()

_DIRS = ("lib", "tmp", "locks", "failed")
_FILES = ("builds.log", "compiler.json")
_OWN_NAMES = frozenset(_DIRS + _FILES + (env.CACHE_MARKER,))
# The temp files the cache's writers rename into place (compiler.json, the marker): <name>.<pid>.<thread>.tmp
_OWN_TEMP = re.compile(r"^(compiler|" + re.escape(env.CACHE_MARKER) + r")\.\d+\.\d+\.tmp$")
_BUILD_DIR = re.compile(r"^(?P<uri>.+)\.(?P<pid>\d+)\.(?P<n>\d+)$")   # tmp/<uri>.<pid>.<n>


class NotACacheError(MpfaJitError):
    """The cache directory holds files that are not mpfa's: nothing there is built into or deleted."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (or of ``path`` itself); files that vanish meanwhile count 0."""
    if path.is_symlink() or not path.is_dir():
        try:
            return path.lstat().st_size if path.is_file() and not path.is_symlink() else 0
        except OSError:
            return 0
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def _remove(path: Path) -> int:
    """Delete ``path`` (a file, a link, or a folder, never following links); returns the bytes of the files
    actually deleted. Files that vanish meanwhile (another process's cleanup) are not an error."""
    if path.is_symlink() or not path.is_dir():
        try:
            size = path.lstat().st_size if not path.is_symlink() else 0
            path.unlink()
            return size
        except FileNotFoundError:
            return 0
    freed = 0
    for folder, dirs, files in os.walk(path, topdown=False):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            full = os.path.join(folder, name)
            try:
                size = os.lstat(full).st_size if not os.path.islink(full) else 0
                os.unlink(full)
                freed += size
            except FileNotFoundError:
                pass
        try:
            os.rmdir(folder)
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno != errno.ENOTEMPTY:   # a file written meanwhile stays, with its folder
                raise
    return freed


@dataclass
class Entry:
    uri: str
    path: Path
    manifest: dict
    size: int


@dataclass
class Cleared:
    """What ``Store.clear`` did: bytes freed, build folders removed (published, left by a killed builder,
    failed), keys skipped because a build of them is running, and names left alone as not the cache's."""
    freed: int = 0
    removed: int = 0
    busy: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)


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

    def failed_dir(self, uri: str) -> Path:
        return self.root / "failed" / uri

    def _lock(self, uri: str, timeout: float = -1) -> FileLock:
        return FileLock(str(self.root / "locks" / f"{uri}.lock"), timeout=timeout)

    # ---- what the folder is

    def state(self) -> str:
        """'cache' (marked); 'legacy' (an older mpfa's cache: only the cache's names, and manifests in lib/);
        'empty' (missing or empty); 'unmarked' (only the cache's names, no manifest: a cache being created
        by another process, or a folder that merely looks like one); 'foreign' (anything else)."""
        if env.is_marked_cache(self.root):
            return "cache"
        try:
            names = {p.name for p in self.root.iterdir()}
        except FileNotFoundError:
            return "empty"
        except NotADirectoryError:
            return "foreign"
        if not names:
            return "empty"
        if any(n not in _OWN_NAMES and not _OWN_TEMP.match(n) for n in names):
            return "foreign"
        if self.lib_dir.is_dir() and any((d / "manifest.json").is_file() for d in self.lib_dir.iterdir()):
            return "legacy"
        return "unmarked"

    def _not_a_cache(self, doing: str) -> NotACacheError:
        try:
            names = sorted(p.name for p in self.root.iterdir() if p.name not in _OWN_NAMES)
        except OSError:
            names = []
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        what = f"it holds {shown}, " if shown else ""
        return NotACacheError(
            f"{self.root} is not an mpfa kernel cache ({what}no {env.CACHE_MARKER} of mpfa's): {doing}; "
            "point MPFA_CACHE_DIR at an empty or new folder, or at an existing mpfa cache")

    def _mark(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        # The marker appears whole or not at all (written aside, then hard-linked: of several threads or processes
        # creating the cache at once, one link succeeds), so no one reads it empty and takes the folder for foreign.
        tmp = self.root / f"{env.CACHE_MARKER}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_text(env.CACHE_MARKER_TEXT)
        try:
            os.link(tmp, self.root / env.CACHE_MARKER)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)

    def ensure(self) -> None:
        """Make the folder a cache (marker and sub-folders); refuses a folder that holds other things."""
        state = self.state()
        if state == "foreign":
            raise self._not_a_cache("refusing to build into it")
        if state != "cache":
            self._mark()
        for d in _DIRS:
            (self.root / d).mkdir(parents=True, exist_ok=True)

    # ---- builds

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
        self.ensure()
        with self._lock(uri):
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
                seconds = build(spec, source, tmp, keep_failed=self.failed_dir(uri))
                lib = tmp / LIB_NAME
                manifest = {
                    "key": spec.key, "uri": uri, "op": spec.op, "params": dict(spec.params), "arch": spec.arch,
                    "compiler": env.compiler_id(), "sha256": _sha256(lib), "size": lib.stat().st_size,
                    "build_seconds": round(seconds, 3), "created": time.time(),
                }
                (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
                published_here = self._publish(tmp, uri)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            if not published_here:
                return self.library(uri), False
            shutil.rmtree(self.failed_dir(uri), ignore_errors=True)   # an older failure of this key is moot
            with open(self.root / "builds.log", "a") as f:
                f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} pid={os.getpid()} built {uri} in {seconds:.1f}s\n")
            log.info("mpfa_jit: built %s in %.1f s", spec.key, seconds)
            return self.library(uri), True

    def _publish(self, tmp: Path, uri: str) -> bool:
        """Rename the finished build into lib/ (atomic within one filesystem). False when another builder
        published the key first: possible only if a ``clear`` deleted the lock file a waiter held."""
        self.lib_dir.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(tmp, self.entry_dir(uri))
            return True
        except OSError:
            if self.check(uri) != "ok":
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return False

    def remove(self, uri: str) -> None:
        shutil.rmtree(self.entry_dir(uri), ignore_errors=True)

    # ---- inspection and cleanup (the ``python -m mpfa_jit.cache`` commands)

    def require_cache(self, doing: str) -> bool:
        """True when the folder is a cache (or an older mpfa's); False when missing or empty; NotACacheError
        otherwise: only a build may adopt an unmarked folder, deleting from one needs proof it is a cache."""
        state = self.state()
        if state in ("foreign", "unmarked"):
            raise self._not_a_cache(doing)
        return state != "empty"

    def entries(self) -> list[Entry]:
        out = []
        if not self.lib_dir.is_dir():
            return out
        for folder in sorted(self.lib_dir.iterdir()):
            if folder.is_symlink() or not folder.is_dir():
                continue
            try:
                manifest = json.loads((folder / "manifest.json").read_text())
            except (OSError, ValueError):
                manifest = {}
            out.append(Entry(folder.name, folder, manifest, _tree_bytes(folder)))
        return out

    def failed(self) -> list[Path]:
        """The kept folders of failed builds."""
        folder = self.root / "failed"
        return sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []

    def size(self) -> int:
        """Bytes of the cache's files; NotACacheError for a folder that is not one."""
        if not self.require_cache("not measuring it"):
            return 0
        return _tree_bytes(self.root)

    def clear(self) -> Cleared:
        """Delete every build the cache recognises (published, in progress of a dead builder, failed) and
        its logs; keeps the marker, the (empty) lock files, the sub-folders, anything unrecognised, and the files of a key
        whose build is running (skipped, named in ``busy``). NotACacheError for a folder that is not a cache."""
        done = Cleared()
        if not self.require_cache("deleting nothing"):
            return done
        self.ensure()   # adopts an older mpfa's cache: the marker keeps it recognised once lib/ is empty
        by_uri: dict[str, list[Path]] = {}
        for folder in sorted(self.lib_dir.iterdir()):
            if not folder.is_symlink() and (folder / "manifest.json").is_file():
                by_uri.setdefault(folder.name, []).append(folder)
            else:
                done.foreign.append(f"lib/{folder.name}")
        for folder in sorted((self.root / "tmp").iterdir()):
            m = _BUILD_DIR.match(folder.name)
            if m:
                by_uri.setdefault(m["uri"], []).append(folder)
            else:
                done.foreign.append(f"tmp/{folder.name}")
        for folder in sorted((self.root / "failed").iterdir()):
            if not folder.is_symlink() and folder.is_dir():
                by_uri.setdefault(folder.name, []).append(folder)
            else:
                done.foreign.append(f"failed/{folder.name}")
        for lock_file in sorted((self.root / "locks").iterdir()):
            if lock_file.name.endswith(".lock") and not lock_file.is_symlink():
                by_uri.setdefault(lock_file.name[: -len(".lock")], [])
            else:
                done.foreign.append(f"locks/{lock_file.name}")
        for uri, paths in by_uri.items():
            lock = self._lock(uri, timeout=0)
            try:
                lock.acquire()
            except Timeout:             # a build of this key is running: its files stay
                done.busy.append(uri)
                continue
            try:
                for path in paths:
                    done.freed += _remove(path)
                    done.removed += 1
                # Lock files stay (empty): unlinking a held lock lets a process waiting on the old file and a
                # new one on a fresh file build the key at once, and each sweeps the other's tmp folder.
            finally:
                lock.release()
        for name in _FILES:
            done.freed += _remove(self.root / name)
        return done
