"""The kernel cache CLI: ``python -m mpfa_jit.cache {list,size,clear}`` (also ``mpfa-cache``).

Exit codes: 0 done; 2 bad usage, or MPFA_CACHE_DIR names a folder that is not an mpfa cache (nothing
is read or deleted there); 1 a failure while doing it (a folder that cannot be written, an OSError);
130 interrupted (Ctrl-C).

``clear`` never follows a symbolic link out of the cache: a link in place of lib/, tmp/, failed/, locks/ or
an entry in them is unlinked and named, and what it points to is left as it was.
"""
from __future__ import annotations

import argparse
import sys

from .errors import CacheDirError
from .store import NotACacheError, Store

PROG = "python -m mpfa_jit.cache"


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} GiB"


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _shown(names: list[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def _list(store: Store) -> None:
    if not store.require_cache("not listing it"):
        print(f"no kernel cache at {store.root} (nothing built yet)")
        return
    entries = store.entries()
    for e in entries:
        m = e.manifest
        state = store.check(e.uri)
        print(f"{m.get('key', e.uri):<60} {_human(e.size):>10}  built in {m.get('build_seconds', '?')} s  "
              f"{m.get('compiler', '')}  [{state}]")
    print(f"{len(entries)} kernels in {store.root}")
    failed = store.failed()
    if failed:
        print(f"{len(failed)} failed builds kept (sources and build.log) in {store.root / 'failed'} until clear")
    contents = store.contents()
    if contents.foreign:
        print(f"{len(contents.foreign)} unrecognised, not kernels, left alone by clear ({_shown(contents.foreign)})")
    if contents.links:
        links = [str(p.relative_to(store.root)) for p in contents.links]
        print(f"{_count(len(links), 'symbolic link')}, not followed; clear removes a link, never its target "
              f"({_shown(links)})")


def _clear(store: Store) -> None:
    if store.state() == "empty":
        print(f"no kernel cache at {store.root}: nothing to clear")
        return
    done = store.clear()
    line = f"freed {_human(done.freed)} ({_count(done.removed, 'build')}) from {store.root}"
    if done.busy:
        line += f"; skipped {len(done.busy)} being built now ({', '.join(done.busy)})"
    if done.foreign:
        line += f"; left {len(done.foreign)} unrecognised ({_shown(done.foreign)})"
    if done.unlinked:
        line += f"; unlinked {_count(len(done.unlinked), 'symbolic link')}, not followed ({_shown(done.unlinked)})"
    print(line)


def main(argv=None) -> int:
    ap = _Parser(prog=PROG, description="Inspect or clear mpfa's kernel cache (MPFA_CACHE_DIR, default "
                 "~/.cache/mpfa). clear deletes only the builds and logs it recognises, unlinks a symbolic link "
                 "found among them without following it, and refuses a folder without the cache's marker "
                 "(CACHEDIR.TAG).")
    ap.add_argument("command", choices=("list", "size", "clear"))
    a = ap.parse_args(argv)
    store = Store()
    try:
        if a.command == "list":
            _list(store)
        elif a.command == "size":
            print(f"{_human(store.size())}  {store.root}")
        else:
            _clear(store)
    except NotACacheError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    except CacheDirError as e:
        print(f"{PROG}: {a.command} failed: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"{PROG}: {a.command} failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
