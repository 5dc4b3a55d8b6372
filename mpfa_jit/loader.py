"""Loading a built library through ctypes.

The libraries export plain C functions that take raw device pointers, sizes and a stream, and link
the CUDA runtime statically: they depend on neither Python nor torch's C++ ABI, so one build
serves any torch version (the GPU machine's 2.11 and a newer one alike).
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

from .abi import check_params
from .errors import KernelLaunchError

_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL] = {}


class KernelModule:
    """One loaded specialization. ``fn(symbol, argtypes)`` binds an entry point that returns a
    cudaError_t; calling the result raises KernelLaunchError on a non-zero code."""

    def __init__(self, key: str, uri: str, path: Path, lib: ctypes.CDLL):
        self.key, self.uri, self.path, self._lib = key, uri, path, lib
        self._error_string = lib.mpfa_error_string
        self._error_string.restype = ctypes.c_char_p
        self._error_string.argtypes = [ctypes.c_int]

    def fn(self, symbol: str, argtypes: list) -> "callable":
        raw = getattr(self._lib, symbol)
        raw.restype = ctypes.c_int
        raw.argtypes = argtypes
        key, err = self.key, self._error_string

        def call(*args):
            code = raw(*args)
            if code != 0:
                raise KernelLaunchError(f"{key}: {symbol} failed with CUDA error {code}: "
                                        f"{err(code).decode(errors='replace')}")
        call.__name__ = symbol
        return call

    def params_fn(self, symbol: str, layout_symbol: str, struct: type[ctypes.Structure]) -> "callable":
        """Bind an entry point ``int symbol(const Struct* params, int device, void* stream)`` after checking the
        library's struct against ``struct`` (mpfa_jit.abi); call it as ``f(params, device, stream)``."""
        check_params(self._lib, layout_symbol, struct, self.key)
        return self.fn(symbol, [ctypes.POINTER(struct), ctypes.c_int, ctypes.c_void_p])

    def __repr__(self) -> str:
        return f"KernelModule({self.key!r}, {str(self.path)!r})"


def load_library(path: Path) -> ctypes.CDLL:
    key = str(path)
    with _lock:
        lib = _libraries.get(key)
        if lib is None:
            lib = ctypes.CDLL(key, mode=ctypes.RTLD_LOCAL)
            _libraries[key] = lib
        return lib
