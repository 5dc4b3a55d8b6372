"""Jinja2 rendering of templates/ into CUDA sources for one specialization."""
from __future__ import annotations

import functools
import re
from importlib import resources
from pathlib import Path

import jinja2

from .errors import UnknownKernelError


@functools.lru_cache(maxsize=None)
def templates_dir() -> Path:
    """templates/ as installed: the package data mpfa_jit.templates (pyproject.toml maps it)."""
    try:
        found = Path(str(resources.files("mpfa_jit.templates")))
    except ModuleNotFoundError:
        found = None
    if found is None or not (found / "include").is_dir():
        raise FileNotFoundError("mpfa_jit: the kernel templates are missing from this install (expected the "
                                "package data mpfa_jit.templates); reinstall mpfa with pip")
    return found


def include_dir() -> Path:
    return templates_dir() / "include"


@functools.lru_cache(maxsize=None)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,   # a parameter the caller forgot is an error, not ""
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render(template: str, params: dict) -> str:
    try:
        tmpl = _environment().get_template(template)
    except jinja2.TemplateNotFound:
        raise UnknownKernelError(f"no kernel template {template!r} under {templates_dir()}") from None
    return tmpl.render(**params)


_QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def _header(path: Path) -> tuple[str, tuple[str, ...]]:
    """(text, quoted include names) of one header; read again only when the file changes."""
    st = path.stat()
    return _read_header(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=None)
def _read_header(path: Path, mtime_ns: int, size: int) -> tuple[str, tuple[str, ...]]:
    text = path.read_text()
    return text, tuple(_QUOTED_INCLUDE.findall(text))


def _resolve_include(name: str, including_dir: Path | None) -> Path | None:
    """Where nvcc finds a quoted include: beside the including file first, then under -I include_dir()."""
    for base in ([including_dir] if including_dir is not None else []) + [include_dir()]:
        candidate = base / name
        if candidate.is_file():
            return candidate
    return None   # a toolkit or system header: the compiler id stands for those


def included_headers(source: str) -> tuple[tuple[str, str], ...]:
    """The mpfa headers ``source`` includes, directly or through other headers, as (name under include/, text),
    sorted: what a build's hash covers, so editing one op's header rebuilds only the ops that include it.

    Every quoted ``#include`` counts, also one inside an ``#if`` branch the build does not take (a superset of
    nvcc's dependency list, which a CPU test compares against ``nvcc -M``)."""
    root = include_dir().resolve()
    found: dict[str, str] = {}
    pending = [(name, None) for name in _QUOTED_INCLUDE.findall(source)]
    while pending:
        name, including_dir = pending.pop()
        path = _resolve_include(name, including_dir)
        if path is None:
            continue
        path = path.resolve()
        rel = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
        if rel in found:
            continue
        found[rel], inner = _header(path)
        pending.extend((name, path.parent) for name in inner)
    return tuple(sorted(found.items()))
