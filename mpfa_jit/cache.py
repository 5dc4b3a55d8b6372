"""The kernel cache CLI: ``python -m mpfa_jit.cache {list,size,clear}`` (also ``mpfa-cache``)."""
from __future__ import annotations

import argparse
import sys

from .store import Store


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} GiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpfa_jit.cache", description="Inspect or clear mpfa's kernel cache "
                                 "(MPFA_CACHE_DIR, default ~/.cache/mpfa).")
    ap.add_argument("command", choices=("list", "size", "clear"))
    a = ap.parse_args(argv)
    store = Store()
    if a.command == "list":
        entries = store.entries()
        for e in entries:
            m = e.manifest
            state = store.check(e.uri)
            print(f"{m.get('key', e.uri):<60} {_human(e.size):>10}  built in {m.get('build_seconds', '?')} s  "
                  f"{m.get('compiler', '')}  [{state}]")
        print(f"{len(entries)} kernels in {store.root}")
    elif a.command == "size":
        print(f"{_human(store.size())}  {store.root}")
    else:
        print(f"freed {_human(store.clear())} from {store.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
