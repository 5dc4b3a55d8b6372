"""Real text for the model-level evaluation, fetched at run time into a data folder, never committed.

The folder: ``--data-dir``, else ``MPFA_EVAL_DATA_DIR``, else ``~/.cache/mpfa-eval-data``. It is kept apart
from mpfa's kernel cache (``MPFA_CACHE_DIR``, default ``~/.cache/mpfa``), which refuses a folder holding
anything but its own builds: a data folder inside the kernel cache is refused here.

* KJV: Debian's ``bible-kjv-text`` (compressed ``bible.data``) and ``bible-kjv`` (its reader, the
  ``bible`` program): ``apt-get download`` + ``dpkg-deb -x`` into ``<data_dir>/debs``, then the
  reader prints Genesis 1:1 .. Revelation 22:21 and the verse labels are stripped: one verse a line,
  ``<data_dir>/kjv.txt`` (~4.3 MB, ~1.2M tokens).
* Python standard library sources: the ``.py`` files at the top of the running interpreter's
  stdlib folder, sorted by name, concatenated (read where the evaluation runs).

The GPU machine has no network: prefetch here and carry the folder (see docs/accuracy.md):

    python -m benchmarks.accuracy.data --data-dir .device_cache/eval-data
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from mpfa_jit import env

DATA_DIR_ENV = "MPFA_EVAL_DATA_DIR"


def default_data_dir() -> Path:
    """``MPFA_EVAL_DATA_DIR``, else ``~/.cache/mpfa-eval-data``: beside the kernel cache, not in it."""
    raw = os.environ.get(DATA_DIR_ENV)
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "mpfa-eval-data"


DEFAULT_DATA_DIR = default_data_dir()   # read at import: the --data-dir default of the CLIs
KJV_PACKAGES = ("bible-kjv-text", "bible-kjv")
_LABEL = re.compile(r"^\S+\d+:\d+\s+")


class DataUnavailable(RuntimeError):
    """The text cannot be had here (no apt-get / network, no prefetched file)."""


class DataDirError(DataUnavailable, ValueError):
    """The data folder asked for cannot hold the text: it lies inside mpfa's kernel cache."""


def _apt_download(pkgs, dest: Path) -> list[Path]:
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        raise DataUnavailable("apt-get/dpkg-deb not found: prefetch with `python -m benchmarks.accuracy.data` "
                              "on a Debian machine and pass --data-dir")
    dest.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(["apt-get", "download", *pkgs], cwd=dest, capture_output=True, text=True)
    debs = sorted(dest.glob("*.deb"))
    if out.returncode != 0 or len(debs) < len(pkgs):
        raise DataUnavailable(f"apt-get download {' '.join(pkgs)} failed: {out.stderr.strip()[-300:]} "
                              "(run `apt-get update` first, or prefetch elsewhere and pass --data-dir)")
    return debs


def check_outside_kernel_cache(data_dir: Path) -> None:
    """DataDirError when ``data_dir`` is, or lies inside, mpfa's kernel cache: the cache refuses a folder that holds
    anything but its builds, so text there would stop every build and ``cache list``."""
    cache = env.cache_dir().resolve()
    where = Path(data_dir).expanduser().resolve()
    if where == cache or where.is_relative_to(cache):
        raise DataDirError(f"data folder {data_dir} lies inside mpfa's kernel cache {cache} (MPFA_CACHE_DIR), "
                           f"which holds only its own builds: pass --data-dir or set {DATA_DIR_ENV} to another "
                           "folder (default ~/.cache/mpfa-eval-data)")


def fetch_kjv(data_dir: Path | str | None = None) -> Path:
    """``<data_dir>/kjv.txt`` (default: default_data_dir()), fetching and decoding it first if absent;
    DataDirError for a folder inside the kernel cache."""
    data_dir = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    txt = data_dir / "kjv.txt"
    if txt.is_file() and txt.stat().st_size > 1_000_000:
        return txt
    check_outside_kernel_cache(data_dir)   # before anything is written there
    debdir = data_dir / "debs"
    debs = sorted(debdir.glob("*.deb")) if debdir.is_dir() else []
    if len(debs) < len(KJV_PACKAGES):
        debs = _apt_download(KJV_PACKAGES, debdir)
    root = data_dir / "root"
    for deb in debs:
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    reader, lib = root / "usr" / "bin" / "bible", root / "usr" / "lib"
    if not reader.is_file() or not (lib / "bible.data").is_file():
        raise DataUnavailable(f"{debdir}: the packages did not contain usr/bin/bible and usr/lib/bible.data")
    out = subprocess.run([str(reader), "-p", str(lib), "-f", "gen1:1-rev22:21"], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL)
    if out.returncode != 0 or len(out.stdout) < 1_000_000:
        raise DataUnavailable(f"the bible reader failed (rc {out.returncode}): {out.stderr.strip()[-300:]}")
    verses = [_LABEL.sub("", line).strip() for line in out.stdout.splitlines()]
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=data_dir, delete=False) as f:
        f.write("\n".join(v for v in verses if v) + "\n")
    os.replace(f.name, txt)
    return txt


def kjv_text(data_dir: Path | str | None = None) -> str:
    return fetch_kjv(data_dir).read_text()


def stdlib_text(max_chars: int = 4_000_000) -> str:
    """The running Python's top-level stdlib ``.py`` files, sorted by name, concatenated."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, n = [], 0
    for p in sorted(root.glob("*.py")):
        try:
            s = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(s)
        n += len(s)
        if n >= max_chars:
            break
    if not parts:
        raise DataUnavailable(f"no .py files under {root}")
    return "\n".join(parts)


def text(name: str, data_dir: Path | str | None = None) -> str:
    if name == "kjv":
        return kjv_text(data_dir)
    if name == "stdlib":
        return stdlib_text()
    raise ValueError(f"text must be 'kjv' or 'stdlib', got {name!r}")


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def main(argv=None) -> int:
    ap = _Parser(prog="python -m benchmarks.accuracy.data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", type=Path, default=None,
                    help=f"where the text is kept (default: ${DATA_DIR_ENV}, else ~/.cache/mpfa-eval-data; "
                         "never inside the kernel cache, MPFA_CACHE_DIR)")
    args = ap.parse_args(argv)
    try:
        p = fetch_kjv(args.data_dir)
    except DataDirError as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    except DataUnavailable as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 1
    print(f"{p}: {p.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
