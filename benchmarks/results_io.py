"""Read and write `benchmarks/results/<name>.json`: one object {"meta", "summary", "rows"}.
`rows` hold every measurement, ceilings included (kind "ceiling"),
so `summary` can always be recomputed from `rows` by the suite's `summarize` - and the
report checks that it is.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
KEYS = ("meta", "summary", "rows")


class ResultsError(ValueError):
    """A results file is missing, unreadable or not of the documented schema."""


def _clean(obj):
    """JSON-safe copy: tuples to lists, NaN/inf to None (strict JSON has no NaN)."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def normalize(obj):
    """What `obj` becomes after a write and a read (used to compare summaries exactly)."""
    return json.loads(json.dumps(_clean(obj), allow_nan=False))


def validate(result: dict, where: str = "result") -> dict:
    if not isinstance(result, dict) or set(result) != set(KEYS):
        got = sorted(result) if isinstance(result, dict) else type(result).__name__
        raise ResultsError(f"{where}: expected exactly keys {list(KEYS)}, got {got}")
    if not isinstance(result["meta"], dict) or not isinstance(result["summary"], dict):
        raise ResultsError(f"{where}: meta and summary must be objects")
    if not isinstance(result["rows"], list) or not all(isinstance(r, dict) for r in result["rows"]):
        raise ResultsError(f"{where}: rows must be a list of objects")
    return result


# A list of numbers (token ids, latencies) on one line: indent=1 gives each number a line of its own, and the e2e
# file's token ids alone then took 190 KB of the results folder's budget (tests/cpu/test_repo_shape.py). Rows are
# written one per line (dumps).
_NUMBER = r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_NUMBER_LIST = re.compile(rf"\[\s*({_NUMBER}(?:\s*,\s*{_NUMBER})*)\s*\]")


def dumps(result: dict) -> str:
    """The text of a results file: meta and summary indented one space per level, lists of numbers on one line;
    then one line per row (a row's fields indented a line each took 10% of the results folder's budget, and a
    rerun's diff is then one line per row it changed)."""
    head = {k: v for k, v in result.items() if k != "rows"}
    text = json.dumps({**head, "rows": []}, indent=1, allow_nan=False)
    text = _NUMBER_LIST.sub(lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)
    rows = result.get("rows") or []
    if rows:
        assert text.endswith('"rows": []\n}'), "the rows come last (KEYS)"
        lines = ",\n".join("  " + json.dumps(r, allow_nan=False) for r in rows)
        text = text[: -len("[]\n}")] + "[\n" + lines + "\n ]\n}"
    return text + "\n"


def write(name: str, meta: dict, summary: dict, rows: list[dict],
          out_dir: Path | str = RESULTS_DIR) -> Path:
    """Write `<out_dir>/<name>.json` atomically (a killed run never leaves half a file)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = validate(_clean({"meta": meta, "summary": summary, "rows": rows}), name)
    path = out_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(dumps(result))
    os.replace(tmp, path)
    return path


def read(path: Path | str) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ResultsError(f"{path}: no such results file") from None
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path}: not valid JSON ({e})") from None
    return validate(data, str(path))


def list_results(results_dir: Path | str = RESULTS_DIR) -> list[Path]:
    """Results files in a stable order (by name), so the README section is deterministic."""
    d = Path(results_dir)
    return sorted(d.glob("*.json")) if d.is_dir() else []
