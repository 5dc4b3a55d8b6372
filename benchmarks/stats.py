"""Pure-Python statistics shared by timing, repeats and summaries.

Kept free of torch so the CPU tests can check the arithmetic that every reported number
goes through.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default), so p50 of an even-length list is the mean of the middle two."""
    if not values:
        raise ValueError("percentile of an empty list")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def geomean(values: Iterable[float | None]) -> float | None:
    """Geometric mean of the values that are set and non-zero (None when none are)."""
    xs = [x for x in values if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


def spread(values: Sequence[float]) -> float:
    """Relative spread (max - min) / min of repeated measurements of one quantity.

    This is the number the "two consecutive runs agree within 5%" rule is checked against:
    a difference between two versions smaller than this is noise.
    """
    if not values:
        raise ValueError("spread of an empty list")
    lo, hi = min(values), max(values)
    if lo <= 0:
        raise ValueError(f"spread needs positive values, got min {lo}")
    return (hi - lo) / lo


def merge_repeats(runs: Sequence[Sequence[dict]]) -> list[dict]:
    """Merge the rows of R repeated runs of one suite into one row per case id.

    A merged row keeps the first run's fields, with `ms` the median of the runs' medians,
    `ms_min` the smallest minimum, `ms_p20`/`ms_p80` medians of the runs' quantiles,
    `ms_runs` every run's median and `spread` their relative spread. A case that failed or
    was skipped in any run keeps that run's row (no spread). With one run, rows pass through
    unchanged.
    """
    if not runs:
        return []
    if len(runs) == 1:
        return [dict(r) for r in runs[0]]
    by_id = []
    for i, run in enumerate(runs):
        ids = [r["id"] for r in run]
        if len(set(ids)) != len(ids):
            raise ValueError(f"run {i} has duplicate row ids")
        by_id.append({r["id"]: r for r in run})
    merged = []
    for row in runs[0]:
        rid = row["id"]
        reps = [m.get(rid) for m in by_id]
        if any(r is None for r in reps):
            raise ValueError(f"case {rid!r} is missing from some repeats")
        bad = [r for r in reps if r.get("status", "ok") != "ok"]
        if bad:
            merged.append(dict(bad[0]))
            continue
        out = dict(row)
        if any("ms" not in r for r in reps):   # not a timing row (e.g. the jit suite's build/load facts)
            merged.append(out)
            continue
        ms_runs = [float(r["ms"]) for r in reps]
        out["ms"] = median(ms_runs)
        if all("ms_min" in r for r in reps):
            out["ms_min"] = min(float(r["ms_min"]) for r in reps)
        for key in ("ms_p20", "ms_p80"):
            if all(key in r for r in reps):
                out[key] = median([float(r[key]) for r in reps])
        out["ms_runs"] = ms_runs
        out["spread"] = spread(ms_runs)
        merged.append(out)
    return merged


def max_spread(rows: Iterable[dict]) -> float | None:
    """Largest `spread` over rows that have one (None when the run was not repeated)."""
    vals = [float(r["spread"]) for r in rows if r.get("spread") is not None]
    return max(vals) if vals else None
