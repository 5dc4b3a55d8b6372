"""SGLang names, looked up when first needed: a name SGLang lacks raises :class:`SGLangCompatError`
naming the installed version and the tested ones. Importing this module does not import SGLang."""
from __future__ import annotations

import importlib

TESTED_VERSIONS = ("0.5.17",)          # run on the H200
STATIC_CHECKED_VERSIONS = ("0.5.23",)  # names checked against the source only (sglang_api.json)


class SGLangCompatError(RuntimeError):
    """This SGLang lacks a name mpfa's plugin uses."""


def sglang_version() -> str:
    try:
        from importlib.metadata import version
        return version("sglang")
    except Exception:   # not installed as a distribution (source checkout)
        return "unknown"


def sglang_attr(module: str, name: str):
    """``module.name`` from SGLang, or SGLangCompatError naming the SGLang version and what is missing."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise SGLangCompatError(f"mpfa's SGLang plugin needs module {module} ({e}); SGLang {sglang_version()} is "
                                f"installed, mpfa is tested with SGLang {', '.join(TESTED_VERSIONS)}") from e
    try:
        return getattr(mod, name)
    except AttributeError:
        raise SGLangCompatError(f"mpfa's SGLang plugin needs {module}.{name}, which SGLang {sglang_version()} does "
                                f"not define; mpfa is tested with SGLang {', '.join(TESTED_VERSIONS)}") from None


def attn_tp_size() -> int:
    """The attention tensor-parallel size of this scheduler process."""
    return sglang_attr("sglang.srt.runtime_context", "get_parallel")().attn_tp_size
