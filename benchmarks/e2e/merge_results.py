"""Fold results files of parallel throughput queues into ``benchmarks/results/e2e_sglang_h200.json``.

    python -m benchmarks.e2e.merge_results QUEUE0/e2e_sglang_h200.json QUEUE1/e2e_sglang_h200.json

Each queue (``benchmarks/e2e/queue.sh``, one GPU each) starts from a copy of the committed file and ends
with it plus its own rows. A row of a queue file that the committed file does not hold, byte for byte, is
that queue's measurement: it replaces the committed row of the same configuration and length, or of the
same configuration's mixed workload (its ``group``, ``benchmarks.e2e.results.merge_rows``), and the queue's
calls join ``meta.calls`` so each row keeps its command.
The files are taken in the order given; a later file's row wins over an earlier one's of the same key.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import results_io
from benchmarks.e2e import results as e2e_results


def _canon(obj) -> str:
    return json.dumps(results_io.normalize(obj), sort_keys=True)


def new_rows_and_calls(base: dict, queue: dict) -> tuple[list[dict], list[dict]]:
    """What ``queue`` measured beyond ``base``: its rows and its calls that ``base`` lacks."""
    known_rows = {_canon(r) for r in base["rows"]}
    known_calls = {_canon(c) for c in base["meta"].get("calls", [])}
    rows = [r for r in queue["rows"] if _canon(r) not in known_rows]
    calls = [c for c in queue["meta"].get("calls", []) if _canon(c) not in known_calls]
    return rows, calls


def merge(base: dict, queues: list[dict]) -> tuple[dict, list[dict]]:
    """(meta, new rows) of ``base`` with every queue's new rows and calls; the meta of the last queue that
    measured anything (its GPU, driver and versions), with all the calls."""
    meta, calls, rows = base["meta"], list(base["meta"].get("calls", [])), []
    for q in queues:
        q_rows, q_calls = new_rows_and_calls(base, q)
        if q_rows:
            meta = q["meta"]
        rows = e2e_results.merge_rows(rows, q_rows)
        calls += [c for c in q_calls if c not in calls]
    return {**meta, "calls": calls}, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.merge_results", description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="results files of the queues (e2e_sglang_h200.json each)")
    ap.add_argument("--out", default=str(results_io.RESULTS_DIR), help="results folder (default: %(default)s)")
    args = ap.parse_args(argv)
    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        ap.error(f"files: not found: {', '.join(missing)}")
    base = e2e_results.read_result(Path(args.out))
    queues = [results_io.read(Path(f)) for f in args.files]
    meta, rows = merge(base, queues)
    if not rows:
        print("nothing new in the queue files", file=sys.stderr)
        return 1
    e2e_results.write_rows(base["rows"], rows, Path(args.out), meta)
    for r in rows:
        print(f"{r['part']} {r.get('group', '')}: {r.get('status')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
