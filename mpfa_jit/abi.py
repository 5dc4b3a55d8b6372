"""The kernel ABI check: a library's params struct against its ctypes mirror.

Each op's entry point takes a pointer to one params struct (templates/include/mpfa/abi.cuh). The
library exports ``"<sizeof> name@offset:size ..."`` for it; :func:`describe` builds the same text from the
``ctypes.Structure`` in ``mpfa_jit/ops/<op>.py``, and :func:`check_params` refuses a library whose
struct differs, before any call can pass misplaced pointers.
"""
from __future__ import annotations

import ctypes

from .errors import KernelAbiError


def describe(struct: type[ctypes.Structure]) -> str:
    fields = " ".join(f"{name}@{getattr(struct, name).offset}:{getattr(struct, name).size}"
                      for name, *_ in struct._fields_)
    return f"{ctypes.sizeof(struct)} {fields}".strip()


def check_params(lib: ctypes.CDLL, layout_symbol: str, struct: type[ctypes.Structure], key: str) -> None:
    """Raise KernelAbiError unless ``layout_symbol`` of ``lib`` describes ``struct`` exactly."""
    try:
        fn = getattr(lib, layout_symbol)
    except AttributeError:
        raise KernelAbiError(f"{key}: the library exports no {layout_symbol}: it was built from other templates "
                             "than this mpfa; clear the kernel cache (python -m mpfa_jit.cache clear)") from None
    fn.restype, fn.argtypes = ctypes.c_char_p, []
    theirs, ours = fn().decode(), describe(struct)
    if theirs != ours:
        raise KernelAbiError(f"{key}: the kernel's {struct.__name__} differs from its mirror in mpfa_jit.ops "
                             f"(library: {theirs!r}; Python: {ours!r}); templates and mpfa_jit/ops must change together")
