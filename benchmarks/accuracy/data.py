"""Real text for the model-level evaluation, fetched at run time into a cache folder, never committed.

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

DEFAULT_DATA_DIR = Path(os.environ.get("MPFA_EVAL_DATA", Path.home() / ".cache" / "mpfa" / "eval-data"))
KJV_PACKAGES = ("bible-kjv-text", "bible-kjv")
_LABEL = re.compile(r"^\S+\d+:\d+\s+")


class DataUnavailable(RuntimeError):
    """The text cannot be had here (no apt-get / network, no prefetched file)."""


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


def fetch_kjv(data_dir: Path | str = DEFAULT_DATA_DIR) -> Path:
    """``<data_dir>/kjv.txt``, fetching and decoding it first if absent."""
    data_dir = Path(data_dir)
    txt = data_dir / "kjv.txt"
    if txt.is_file() and txt.stat().st_size > 1_000_000:
        return txt
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


def kjv_text(data_dir: Path | str = DEFAULT_DATA_DIR) -> str:
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


def text(name: str, data_dir: Path | str = DEFAULT_DATA_DIR) -> str:
    if name == "kjv":
        return kjv_text(data_dir)
    if name == "stdlib":
        return stdlib_text()
    raise ValueError(f"text must be 'kjv' or 'stdlib', got {name!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.accuracy.data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    args = ap.parse_args(argv)
    try:
        p = fetch_kjv(args.data_dir)
    except DataUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{p}: {p.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
