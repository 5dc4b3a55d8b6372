"""Fold results files of parallel throughput queues into ``benchmarks/results/e2e_sglang_h200.json``.

    python -m benchmarks.e2e.merge_results --publish QUEUE0/e2e_sglang_h200.json QUEUE1/e2e_sglang_h200.json

Each queue (``benchmarks/e2e/queue.sh``, one GPU each) starts from a copy of the committed file and ends
with it plus its own rows. A row of a queue file that the committed file does not hold, byte for byte, is
that queue's measurement: it replaces the committed row of the same configuration and length, or of the
same configuration's mixed workload (its ``group``, ``benchmarks.e2e.results.merge_rows``), and the queue's
calls join ``meta.calls`` so each row keeps its command.
The files are taken in the order given; a later file's row wins over an earlier one's of the same key.
The merged file goes to ``benchmarks/results/scratch`` unless ``--publish`` (then ``benchmarks/results``, or
``--out``): publishing refuses queue files measured on another GPU than the published file names (exit 2), and a
merge with a failed new row goes to scratch instead (exit 1).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks import cli, publish, results_io
from benchmarks.e2e import results as e2e_results

PROG = "python -m benchmarks.e2e.merge_results"


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


def gpu_refusal(base: dict, queues: dict[str, dict]) -> str | None:
    """Why the queues' rows may not be published over ``base``: a queue that measured something on another GPU
    than the one the published file names."""
    named = base["meta"].get("gpu")
    for name, q in queues.items():
        if named is not None and new_rows_and_calls(base, q)[0] and q["meta"].get("gpu") != named:
            return (f"not published: {name} was measured on {q['meta'].get('gpu') or 'no GPU'}, the published file "
                    f"on {named}")
    return None


def main(argv=None) -> int:
    ap = cli.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="results files of the queues (e2e_sglang_h200.json each)")
    publish.add_arguments(ap)
    args = ap.parse_args(argv)
    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        ap.error(f"files: not found: {', '.join(missing)}")
    target = publish.destination(ap, args.out, args.publish)
    scratch = target.resolve() == publish.SCRATCH_DIR.resolve()
    base = e2e_results.read_result(results_io.RESULTS_DIR if scratch else target)
    try:
        queues = {f: results_io.read(Path(f)) for f in args.files}
    except results_io.ResultsError as e:
        ap.error(f"files: {e}")
    why = gpu_refusal(base, queues) if args.publish else None
    if why:
        print(f"{PROG}: {why}", file=sys.stderr)
        return 2
    meta, rows = merge(base, list(queues.values()))
    if not rows:
        print("nothing new in the queue files", file=sys.stderr)
        return 1
    failed = publish.failed_rows(rows)
    out = publish.SCRATCH_DIR if args.publish and failed else target
    e2e_results.write_rows(base["rows"], rows, out, meta)
    for r in rows:
        print(f"{r['part']} {r.get('group', '')}: {r.get('status')}")
    path = out / f"{e2e_results.RESULT}.json"
    if args.publish and failed:
        print(publish.failure_line(PROG, failed, path), file=sys.stderr)
        return 1
    print(f"{'published' if args.publish else 'wrote'} {publish.display(path)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
