"""Where a benchmark's files go: a scratch folder, unless the run is published.

Every command that writes results, plots or logs writes them to ``benchmarks/results/scratch/``
(git-ignored) by default. ``--publish`` writes them to the published folder (``benchmarks/results``, or
``--out``), and only from a run that succeeded on the machine the published file names:

- before it measures anything, a publishing GPU run refuses (one line, exit 2) on a machine without a GPU, without
  SGLang where the command serves through it, or with a GPU other than the one in ``meta.gpu`` of the file it
  would replace (the file at the destination, else the committed one of the same name);
- a run with a failed row writes its files to scratch instead and says where (one line, exit 1).

So a benchmark started where it cannot run never replaces a committed result, its plot or its logs.
An ``--out`` inside the published folder without ``--publish`` is a usage error (exit 2).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from benchmarks import meta as bench_meta, results_io

RESULTS_DIR = results_io.RESULTS_DIR
SCRATCH_DIR = RESULTS_DIR / "scratch"


class Refused(Exception):
    """A publish that must not happen; the message is the one line the command prints."""


PUBLISH_HELP = ("write to the published results (refused without a GPU, SGLang where needed, or the GPU the published "
                "file names; a run with a failed row goes to scratch instead)")


def add_arguments(ap: argparse.ArgumentParser, *, out_help: str = "results folder",
                  published: Path | str = RESULTS_DIR, scratch: Path = SCRATCH_DIR,
                  publish_help: str = PUBLISH_HELP) -> None:
    """``--out`` (default: ``scratch``; with ``--publish`` ``published``, a path or its description) and
    ``--publish``."""
    shown = display(published) if isinstance(published, Path) else published
    ap.add_argument("--out", type=Path, default=None,
                    help=f"{out_help} (default: {display(scratch)}; with --publish {shown})")
    ap.add_argument("--publish", action="store_true", help=publish_help)


def display(path: Path) -> str:
    """``path`` relative to the working folder where it lies under it (shorter lines), else absolute."""
    path = Path(path).absolute()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _under(path: Path, folder: Path) -> bool:
    path, folder = Path(path).resolve(), Path(folder).resolve()
    return path == folder or folder in path.parents


def is_published(path: Path) -> bool:
    """Whether ``path`` (a folder or file) lies among the published results, not in scratch."""
    return _under(path, RESULTS_DIR) and not _under(path, SCRATCH_DIR)


def destination(ap: argparse.ArgumentParser, out: Path | None, publish: bool, *,
                published: Path = RESULTS_DIR, scratch: Path = SCRATCH_DIR) -> Path:
    """The folder (or file) a run writes: ``out`` where given, else ``published`` with ``--publish``, else
    ``scratch``. Writing into the published results without ``--publish`` is a parser error."""
    if out is None:
        return published if publish else scratch
    if not publish and is_published(out):
        ap.error(f"--out {out} is among the published results: add --publish to replace them "
                 f"(without it, leave --out out: the run writes to {display(scratch)})")
    return Path(out)


def named_gpu(relpath: str, target: Path, published: Path = RESULTS_DIR) -> str | None:
    """``meta.gpu`` of the results file a publish would replace: ``target/relpath``, else the committed one
    (``published/relpath``)."""
    for base in (Path(target), Path(published)):
        path = base / relpath
        if path.is_file():
            try:
                meta = json.loads(path.read_text()).get("meta")
            except (OSError, ValueError, AttributeError):   # not a results file: it names no GPU
                continue
            return meta.get("gpu") if isinstance(meta, dict) else None
    return None


def machine_refusal(found_gpu: str | None, named: dict[str, str | None], *, need_sglang: bool = False,
                    have_sglang: bool = True, need_gpu: bool = True) -> str | None:
    """Why this machine may not publish, or None. ``named``: {results file: the GPU its meta names}."""
    if need_gpu and found_gpu is None:
        return "no GPU here (nvidia-smi lists none)"
    if need_sglang and not have_sglang:
        return "SGLang is not installed here (pip install 'mpfa[sglang]')"
    for name, gpu in named.items():
        if gpu is not None and found_gpu != gpu:
            return f"{name} was measured on {gpu}, this machine has {found_gpu or 'no GPU'}"
    return None


def check_machine(relpaths: list[str], target: Path, *, need_sglang: bool = False, need_gpu: bool = True,
                  published: Path = RESULTS_DIR, found: str | None = None) -> None:
    """Raise Refused unless this machine may publish ``relpaths`` (results files, relative to ``target``; the
    committed ones relative to ``published``). ``found``: the GPU's name as the caller's meta records it (torch's),
    else nvidia-smi's."""
    found = found or bench_meta.gpu_name()
    named = {rel: named_gpu(rel, target, published) for rel in relpaths}
    have_sglang = importlib.util.find_spec("sglang") is not None if need_sglang else True
    why = machine_refusal(found, named, need_sglang=need_sglang, have_sglang=have_sglang, need_gpu=need_gpu)
    if why:
        raise Refused(f"not published: {why}")


def refusal(prog: str, relpaths: list[str], target: Path, **kw) -> str | None:
    """The one line a publishing run prints before measuring when this machine may not publish (check_machine's
    reason, after ``prog``), or None."""
    try:
        check_machine(relpaths, target, **kw)
    except Refused as e:
        return f"{prog}: {e}"
    return None


def failed_rows(rows: list[dict]) -> list[str]:
    """Ids (or configurations) of the rows whose status is "error": a run with any of them is not published."""
    return [str(r.get("id") or r.get("group") or r.get("config") or "?") for r in rows if r.get("status") == "error"]


def failure_line(prog: str, failed: list[str], where: Path) -> str:
    """The one line a run that may not publish prints: what failed and where its files went instead."""
    shown = ", ".join(failed[:3]) + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
    return f"{prog}: not published: {len(failed)} failed ({shown}); wrote {display(where)} instead"


def staging_dir(name: str) -> Path:
    """A fresh folder under scratch for a publishing run that writes as it goes (and streams logs): its files
    reach the published folder only once the whole run has succeeded (promote)."""
    SCRATCH_DIR.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=SCRATCH_DIR))


def promote(staging: Path, target: Path) -> list[Path]:
    """Copy every file under ``staging`` to the same place under ``target`` (each replaced atomically), then
    remove ``staging``; the published paths."""
    done = []
    for src in sorted(p for p in Path(staging).rglob("*") if p.is_file()):
        dest = Path(target) / src.relative_to(staging)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".publish.tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dest)
        done.append(dest)
    shutil.rmtree(staging)
    return done
