"""The roofline of every kernel measured, against the FP8 MMA and HBM read ceilings of the same runs.

    python -m benchmarks.roofline [--results benchmarks/results] [--publish] [--out DIR]

Suites that have FLOPs and bytes for their rows define ``roofline_points(result)`` returning
(name, flops, bytes, seconds) tuples; this collects them from the results files in ``--results`` (default: the
committed ones) and draws ``roofline_h200.png`` in benchmarks/results/scratch, or with ``--publish`` beside
the results (``benchmarks.run`` draws it beside the suites' files after they run). Exit status: 0 drawn;
1 nothing to draw (no rows with FLOPs and bytes, or no ceilings), or an unreadable results file; 2 bad
arguments.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks import cli, plots, publish, results_io
from benchmarks.report import suite_results

IMAGE = "roofline_h200.png"
PROG = "python -m benchmarks.roofline"


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


def draw(results_dir: Path, out_dir: Path | None = None) -> Path | None:
    """The roofline of ``results_dir``'s files, drawn in ``out_dir`` (default: beside them); None when they
    have nothing to draw."""
    points, fp8, hbm = collect(results_dir)
    if not points or not fp8 or not hbm:
        return None
    return plots.roofline(points, fp8, hbm, Path(out_dir or results_dir) / IMAGE)


def main(argv=None) -> int:
    ap = cli.Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=results_io.RESULTS_DIR, help="folder of results files to read")
    publish.add_arguments(ap, out_help="folder the plot goes to", published="the --results folder",
                          publish_help="draw it beside the results it reads (a drawing: any machine may)")
    a = ap.parse_args(argv)
    if not a.results.is_dir():
        ap.error(f"--results {a.results}: no such folder")
    out = publish.destination(ap, a.out, a.publish, published=a.results)
    try:
        path = draw(a.results, out)
    except results_io.ResultsError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    if path is None:
        print(f"{PROG}: nothing to draw: no results in {a.results} with FLOPs and bytes and their fp8_mma and "
              "hbm_read ceilings", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
