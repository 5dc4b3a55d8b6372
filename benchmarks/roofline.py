"""The roofline of every kernel measured, against the FP8 MMA and HBM read ceilings of the same runs.

    python -m benchmarks.roofline [--results benchmarks/results]

Suites that have FLOPs and bytes for their rows define ``roofline_points(result)`` returning
(name, flops, bytes, seconds) tuples; this collects them from the committed results files and draws
benchmarks/results/roofline_h200.png (``benchmarks.run`` calls it after the suites).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks import plots, results_io
from benchmarks.report import suite_results

IMAGE = "roofline_h200.png"


def _ceiling(rows, name, key):
    for r in rows:
        if r.get("kind") == "ceiling" and r.get("name") == name and r.get("status", "ok") == "ok":
            return r[key] / (r["ms"] * 1e-3) / (1e12 if key == "flops" else 1e9)
    return None


def collect(results_dir: Path):
    points, fp8, hbm = [], None, None
    for _, result, suite in suite_results(results_dir):
        if not hasattr(suite, "roofline_points"):
            continue
        points += suite.roofline_points(result)
        fp8 = fp8 or _ceiling(result["rows"], "fp8_mma", "flops")
        hbm = hbm or _ceiling(result["rows"], "hbm_read", "bytes")
    return points, fp8, hbm


def draw(results_dir: Path) -> Path | None:
    points, fp8, hbm = collect(results_dir)
    if not points or not fp8 or not hbm:
        return None
    return plots.roofline(points, fp8, hbm, Path(results_dir) / IMAGE)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=results_io.RESULTS_DIR)
    a = ap.parse_args(argv)
    path = draw(a.results)
    print(f"wrote {path}" if path else "no results with FLOPs and bytes yet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
