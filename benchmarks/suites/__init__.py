"""Benchmark suites: adding one is adding one module here.

A suite module (e.g. `benchmarks/suites/decode.py`) defines:

    NAME = "decode"                 # --suites name
    RESULT = "decode_h200"          # writes benchmarks/results/decode_h200.json
    def cases(quick: bool) -> list[dict]        # each with a unique "id"; cheap, no GPU
    def run_case(case: dict, ctx: Context) -> dict
        # one measured row (fields of the case + timing fields from ctx.bench(...)).
        # raise Skip("why") when a peer is not available here.
    def summarize(rows: list[dict]) -> dict     # summary computed only from rows
    # optional:
    def annotate(rows: list[dict]) -> list[dict]  # derived fields (GB/s, fractions) from
                                                  # ms/bytes and the ceiling rows in `rows`
    def plot(result: dict, out_dir: Path) -> list[Path]
    TABLE = [(header, key, fmt), ...]            # README columns; fmt is a format string
                                                 # or a callable(value) -> str

The runner (`benchmarks.run`) does the rest: ceilings, progress bar, repeats and spreads,
error rows, writing JSON, plots and the README. A case whose row has `impl == "mpfa"` and
fails makes the run exit non-zero; a failing peer is recorded and reported, not fatal. Suites import torch,
mpfa and peers inside their functions only, so `report` works on a machine without them.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from types import ModuleType

REQUIRED = ("NAME", "RESULT", "cases", "run_case", "summarize")


class Skip(Exception):
    """Raised by run_case when a case cannot run here (a peer not installed, an API absent).
    Recorded as a row with status "skipped" and the reason; the run does not fail."""


@dataclass
class Context:
    """What a suite's run_case gets from the runner."""

    quick: bool = False
    l2_bytes: int = 60 * 1024 * 1024
    mem_budget_bytes: int = 8 << 30  # cap on rotated input sets per case
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    seed: int = 0
    ceilings: dict[str, dict] = field(default_factory=dict)

    def bench(self, fn, rotate=None):
        from benchmarks.timing import bench

        return bench(fn, rotate=rotate, warmup_ms=self.warmup_ms, rep_ms=self.rep_ms)

    def rotation_count(self, bytes_per_call: int) -> int:
        from benchmarks.timing import rotation_count

        return rotation_count(bytes_per_call, self.l2_bytes, budget_bytes=self.mem_budget_bytes)


def available() -> list[str]:
    """Names of the suite modules in this package, sorted."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def load(name: str) -> ModuleType:
    """Import suite `name` and check it defines what the runner needs."""
    if name not in available():
        raise ValueError(f"unknown suite {name!r}; available: {', '.join(available()) or 'none'}")
    mod = importlib.import_module(f"{__name__}.{name}")
    missing = [a for a in REQUIRED if not hasattr(mod, a)]
    if missing:
        raise TypeError(f"suite module {mod.__name__} lacks {', '.join(missing)}")
    return mod


def for_result(result_name: str, meta: dict | None = None) -> ModuleType | None:
    """The suite that wrote results file `result_name` (by meta["suite"], else by RESULT),
    or None for files written by other scripts (accuracy, end-to-end)."""
    wanted = (meta or {}).get("suite")
    for name in available():
        mod = load(name)
        if mod.NAME == wanted or mod.RESULT == result_name:
            return mod
    return None
