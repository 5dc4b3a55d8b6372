"""A kernel specialization: which template, rendered with which parameters, for which arch.

The key names what a caller asked for; the URI adds a hash of everything that decides the built
bytes (rendered source, the headers it includes, nvcc flags, compiler version), so a changed template or a
new compiler never loads an old build.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from . import env
from .render import included_headers, render

_SAFE = re.compile(r"[^A-Za-z0-9.]+")


@dataclass(frozen=True)
class KernelSpec:
    op: str                                  # the kernel family, e.g. "append_kv"
    template: str                            # file under templates/
    params: tuple[tuple[str, object], ...]   # (name, value) pairs, sorted by name
    arch: str                                # e.g. "sm_90a"
    symbols: tuple[str, ...] = field(default=(), compare=False)  # C entry points the library exports
    # Values the template renders that follow from ``params`` (e.g. the recipe's cache field widths): not part
    # of the key, but part of the rendered source and so of the URI's hash.
    context: tuple[tuple[str, object], ...] = field(default=(), compare=False)

    @staticmethod
    def make(op: str, template: str, params: dict, arch: str, symbols=(), context: dict | None = None) -> "KernelSpec":
        env.check_arch(arch)
        return KernelSpec(op, template, tuple(sorted(params.items())), arch, tuple(symbols),
                          tuple(sorted((context or {}).items())))

    @property
    def key(self) -> str:
        """Readable and unique per (op, params, arch): what the cache CLI and warmup show."""
        parts = [self.op] + [f"{k}-{_SAFE.sub('_', str(v))}" for k, v in self.params] + [self.arch]
        return "_".join(parts)

    def render(self) -> str:
        return render(self.template, dict(self.params, arch=self.arch, **dict(self.context)))

    def nvcc_flags(self) -> list[str]:
        return [
            "-O3", "-std=c++17", f"-gencode={env.gencode(self.arch)}", "-lineinfo",
            "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
            "-cudart", "static",
        ]

    def digest(self, source: str | None = None) -> str:
        source = source if source is not None else self.render()
        h = hashlib.sha256()
        h.update(source.encode())
        for name, text in included_headers(source):
            h.update(name.encode() + b"\0" + text.encode())
        h.update(" ".join(self.nvcc_flags()).encode())
        h.update(env.compiler_id().encode())
        return h.hexdigest()

    def uri(self, source: str | None = None) -> str:
        return f"{self.key}_{self.digest(source)[:12]}"
