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

Symbolic links: the cache folder itself may be one (MPFA_CACHE_DIR -> /scratch/x); it is resolved once and
the real folder is the root. Inside it the store follows no link: every path it deletes must lie under the
root with no link on the way. ``clear`` unlinks a link it finds where the cache keeps its folders (lib/,
tmp/, failed/, locks/ or an entry in them) and never reads or deletes what the link points to; a build
refuses to run through such a link (CacheDirError), and a link in place of a published entry is not loaded.
"""
from __future__ import annotations

import errno
import hashlib
import itertools
import json
import logging
import os
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout

from . import env
from .build import LIB_NAME, build
from .errors import CacheDirError, NotACacheError
from .spec import KernelSpec

log = logging.getLogger("mpfa_jit")
_counter = itertools.count()

_DIRS = ("lib", "tmp", "locks", "failed")
_FILES = ("builds.log", "compiler.json")
_OWN_NAMES = frozenset(_DIRS + _FILES + (env.CACHE_MARKER,))
# The temp files the cache's writers rename into place (compiler.json, the marker): <name>.<pid>.<thread>.tmp
_OWN_TEMP = re.compile(r"^(compiler|" + re.escape(env.CACHE_MARKER) + r")\.\d+\.\d+\.tmp$")
_BUILD_DIR = re.compile(r"^(?P<uri>.+)\.(?P<pid>\d+)\.(?P<n>\d+)$")   # tmp/<uri>.<pid>.<n>

# What an older mpfa's benchmarks.accuracy.data fetched into the default cache folder (now kept apart).
_OLD_EVAL_DATA = "eval-data"

__all__ = ["CacheDirError", "Cleared", "Contents", "Entry", "NotACacheError", "Store"]


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
class Contents:
    """What lies in the cache's folders, read without following a link: the build folders per key (lib/<uri>
    with a manifest, tmp/<uri>.<pid>.<n>, failed/<uri>), the symbolic links found where those folders or
    entries belong, and the names that are not the cache's (relative to the root)."""
    builds: dict[str, list[Path]] = field(default_factory=dict)
    links: list[Path] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)


@dataclass
class Cleared:
    """What ``Store.clear`` did: bytes freed, build folders removed (published, left by a killed builder,
    failed), keys skipped because a build of them is running, names left alone as not the cache's, and
    symbolic links unlinked (relative to the root) without touching what they point to."""
    freed: int = 0
    removed: int = 0
    busy: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    unlinked: list[str] = field(default_factory=list)


def _build_key(folder: str, path: Path) -> str | None:
    """The key ``path`` (a non-link entry of the cache's ``folder``) is a build of, or None if it is none."""
    if folder == "lib":
        return path.name if path.is_dir() and (path / "manifest.json").is_file() else None
    if folder == "tmp":
        m = _BUILD_DIR.match(path.name)
        return m["uri"] if m else None
    if folder == "failed":
        return path.name if path.is_dir() else None
    return None


def _why(e: OSError) -> str:
    return e.strerror or str(e)


class Store:
    def __init__(self, root: Path | None = None):
        # Resolved once: a root the user made a link (to a scratch disk) is honoured, and every path deleted
        # later can be required to lie under this real folder.
        self.root = (Path(root) if root is not None else env.cache_dir()).resolve()

    @property
    def lib_dir(self) -> Path:
        return self.root / "lib"

    def entry_dir(self, uri: str) -> Path:
        return self.lib_dir / uri

    def library(self, uri: str) -> Path:
        return self.entry_dir(uri) / LIB_NAME

    def failed_dir(self, uri: str) -> Path:
        return self.root / "failed" / uri

    def _lock_path(self, uri: str) -> Path:
        return self.root / "locks" / f"{uri}.lock"

    def _lock(self, uri: str, timeout: float = -1) -> FileLock:
        path = self._lock_path(uri)
        if path.is_symlink():   # older filelock opens with O_TRUNC: it would empty the file the link points to
            raise self._linked(path, "refusing to lock through it")
        return FileLock(str(path), timeout=timeout)

    @contextmanager
    def _locked(self, uri: str):
        lock = self._lock(uri)
        try:
            lock.acquire()
        except OSError as e:
            raise CacheDirError(f"cannot take the build lock {lock.lock_file} of the kernel cache {self.root}: "
                                f"{_why(e)}; point MPFA_CACHE_DIR at a folder you can write") from None
        try:
            yield
        finally:
            lock.release()

    def _linked(self, path: Path, doing: str) -> CacheDirError:
        try:
            target = f" (to {os.readlink(path)})"
        except OSError:
            target = ""
        return CacheDirError(
            f"{path} is a symbolic link{target}: the kernel cache {self.root} never follows a link out of itself; "
            f"{doing}. `python -m mpfa_jit.cache clear` removes the link (not what it points to); to keep the "
            "cache elsewhere, point MPFA_CACHE_DIR there")

    def _delete(self, path: Path) -> int:
        """``_remove`` for a path of the cache only: its folder, resolved, must be itself (no link on the way, such
        as lib/ swapped for one) and lie under the root. A link at ``path`` itself is unlinked, not followed."""
        parent = path.parent
        if Path(os.path.realpath(parent)) != parent or not parent.is_relative_to(self.root):
            raise CacheDirError(f"refusing to delete {path}: {parent} leads out of the kernel cache {self.root} "
                                "through a symbolic link")
        return _remove(path)

    def _discard(self, path: Path) -> None:
        """``_delete`` where a leftover is harmless (the next build or clear retries); a link out still raises."""
        try:
            self._delete(path)
        except OSError:
            pass

    def _linked_dirs(self) -> list[Path]:
        """The cache's own folders (lib/, tmp/, locks/, failed/) that are symbolic links."""
        return [self.root / d for d in _DIRS if (self.root / d).is_symlink()]

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
        lib = self.lib_dir   # manifests reached through a link prove nothing about this folder
        if not lib.is_symlink() and lib.is_dir() and any(_build_key("lib", d) for d in lib.iterdir()
                                                         if not d.is_symlink()):
            return "legacy"
        return "unmarked"

    def _not_a_cache(self, doing: str) -> NotACacheError:
        try:
            names = sorted(p.name for p in self.root.iterdir() if p.name not in _OWN_NAMES)
        except OSError:
            names = []
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        what = f"it holds {shown}, " if shown else ""
        hint = ""
        if _OLD_EVAL_DATA in names:
            hint = (f"; {_OLD_EVAL_DATA} is evaluation text an older mpfa's benchmarks.accuracy.data fetched here: "
                    "move it to ~/.cache/mpfa-eval-data (MPFA_EVAL_DATA_DIR), where that module keeps it now")
        return NotACacheError(
            f"{self.root} is not an mpfa kernel cache ({what}no {env.CACHE_MARKER} of mpfa's): {doing}; "
            f"point MPFA_CACHE_DIR at an empty or new folder, or at an existing mpfa cache{hint}")

    def _mark(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        # The marker appears whole or not at all (written aside, then hard-linked: of several threads or processes
        # creating the cache at once, one link succeeds), so no one reads it empty and takes the folder for foreign.
        tmp = self.root / f"{env.CACHE_MARKER}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            tmp.write_text(env.CACHE_MARKER_TEXT)   # a full disk leaves a partial temp file: removed below
            os.link(tmp, self.root / env.CACHE_MARKER)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)

    def ensure(self) -> None:
        """Make the folder a cache (marker and sub-folders). NotACacheError for a folder that holds other things;
        CacheDirError for one that cannot be written or whose sub-folders are links."""
        state = self.state()
        if state == "foreign":
            raise self._not_a_cache("refusing to build into it")
        linked = self._linked_dirs()
        if linked:
            raise self._linked(linked[0], "refusing to build through it")
        doing = f"writing its marker {env.CACHE_MARKER}"
        try:
            if state != "cache":
                self._mark()
            for d in _DIRS:
                doing = f"creating {d}/"
                (self.root / d).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheDirError(f"cannot use {self.root} as the kernel cache: {doing} failed: {_why(e)}; point "
                                "MPFA_CACHE_DIR at a folder you can write") from None

    # ---- builds

    def check(self, uri: str) -> str:
        """'ok', 'missing', or 'corrupt' (manifest unreadable or the library's hash differs)."""
        folder = self.entry_dir(uri)
        if self.lib_dir.is_symlink() or folder.is_symlink():
            return "corrupt"   # never loaded through a link: a build refuses lib/ as one and replaces the entry
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
        with self._locked(uri):
            state = self.check(uri)
            if state == "ok":          # another process built it while we waited
                return self.library(uri), False
            if state == "corrupt":
                log.warning("mpfa_jit: cache entry %s is corrupt; rebuilding", uri)
                self._discard(self.entry_dir(uri))
            for stale in (self.root / "tmp").glob(f"{uri}.*"):
                self._discard(stale)   # left by a killed builder of this key
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
                self._discard(tmp)
                raise
            if not published_here:
                return self.library(uri), False
            self._discard(self.failed_dir(uri))   # an older failure of this key is moot
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
            self._discard(tmp)
            return False

    def remove(self, uri: str) -> None:
        self._discard(self.entry_dir(uri))

    # ---- inspection and cleanup (the ``python -m mpfa_jit.cache`` commands)

    def require_cache(self, doing: str) -> bool:
        """True when the folder is a cache (or an older mpfa's); False when missing or empty; NotACacheError
        otherwise: only a build may adopt an unmarked folder, deleting from one needs proof it is a cache."""
        state = self.state()
        if state in ("foreign", "unmarked"):
            raise self._not_a_cache(doing)
        return state != "empty"

    def contents(self) -> Contents:
        """The cache's folders read without following a link (see Contents)."""
        out = Contents()
        for d in _DIRS:
            top = self.root / d
            if top.is_symlink():
                out.links.append(top)
                continue
            try:
                children = sorted(top.iterdir())
            except FileNotFoundError:
                continue
            except NotADirectoryError:
                out.foreign.append(d)
                continue
            for path in children:
                if path.is_symlink():
                    out.links.append(path)
                    continue
                key = _build_key(d, path)
                if key is not None:
                    out.builds.setdefault(key, []).append(path)
                elif not (d == "locks" and path.name.endswith(".lock") and path.is_file()):
                    out.foreign.append(f"{d}/{path.name}")
        return out

    def entries(self) -> list[Entry]:
        """The published builds: folders of lib/ holding a manifest. Anything else there is not a kernel."""
        out = []
        for paths in self.contents().builds.values():
            for folder in paths:
                if folder.parent != self.lib_dir:
                    continue
                try:
                    manifest = json.loads((folder / "manifest.json").read_text())
                except (OSError, ValueError):
                    manifest = {}
                out.append(Entry(folder.name, folder, manifest, _tree_bytes(folder)))
        return sorted(out, key=lambda e: e.uri)

    def failed(self) -> list[Path]:
        """The kept folders of failed builds."""
        failed = self.root / "failed"
        return sorted(p for paths in self.contents().builds.values() for p in paths if p.parent == failed)

    def size(self) -> int:
        """Bytes of the cache's files; NotACacheError for a folder that is not one."""
        if not self.require_cache("not measuring it"):
            return 0
        return _tree_bytes(self.root)

    def clear(self) -> Cleared:
        """Delete every build the cache recognises (published, in progress of a dead builder, failed) and
        its logs; keeps the marker, the lock files there were, the sub-folders, anything unrecognised, and the files
        of a key whose build is running (skipped, named in ``busy``). Symbolic links where the cache keeps its
        folders or entries are unlinked, never followed (named in ``unlinked``). NotACacheError for a folder that is
        not a cache."""
        done = Cleared()
        if not self.require_cache("deleting nothing"):
            return done
        for linked in self._linked_dirs():   # before ensure(), which refuses them; the real folder is made anew
            self._unlink(linked, done)
        self.ensure()   # adopts an older mpfa's cache: the marker keeps it recognised once lib/ is empty
        contents = self.contents()
        for link in contents.links:
            self._unlink(link, done)
        done.foreign = contents.foreign
        for uri, paths in contents.builds.items():
            lock = self._existing_lock(uri)
            try:
                if lock is not None:
                    lock.acquire()
            except Timeout:             # a build of this key is running: its files stay
                done.busy.append(uri)
                continue
            try:
                for path in paths:
                    done.freed += self._delete(path)
                    done.removed += 1
                # Lock files stay (empty): unlinking a held lock lets a process waiting on the old file and a
                # new one on a fresh file build the key at once, and each sweeps the other's tmp folder.
            finally:
                if lock is not None:
                    lock.release()
        for name in _FILES:
            done.freed += self._delete(self.root / name)
        return done

    def _existing_lock(self, uri: str) -> FileLock | None:
        """The key's lock (not yet held) if its file exists, else None: then no builder of the key is running, as
        a builder takes the lock before it makes its tmp folder, and taking the lock would create the file."""
        return self._lock(uri, timeout=0) if os.path.lexists(self._lock_path(uri)) else None

    def _unlink(self, link: Path, done: Cleared) -> None:
        self._delete(link)
        done.unlinked.append(str(link.relative_to(self.root)))
