"""Jinja2 rendering of templates/ into CUDA sources for one specialization."""
from __future__ import annotations

import functools
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


@functools.lru_cache(maxsize=None)
def header_sources() -> tuple[tuple[str, str], ...]:
    """Every header a kernel may include, as (relative name, text): part of every build's hash."""
    root = include_dir()
    return tuple((str(p.relative_to(root)), p.read_text()) for p in sorted(root.rglob("*.cuh")))
