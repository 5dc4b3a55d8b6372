"""The one benchmark command: ceilings, then the selected suites, in one process on one GPU.

    python -m benchmarks.run [--suites append,...] [--publish] [--out DIR] [--quick] [--repeat 2] [--cases spread]

Per suite it writes `<out>/<RESULT>.json` ({"meta", "summary", "rows"}, ceiling rows
included) and `<out>/<RESULT>.png`, and prints the suite's table. `<out>` is
benchmarks/results/scratch (git-ignored) unless `--publish`: then benchmarks/results (or `--out`),
and benchmarks/RESULTS.md's tables are rewritten when that is the committed folder (`--no-readme`: not). A publishing run
refuses before measuring on a GPU other than the one the published files name, and a suite with a
failed row (any implementation) goes to scratch instead (benchmarks/publish.py). `--repeat 2` runs
every case twice and stores each row's `spread` (relative difference of the two medians) and the
summary's `max_spread`, for the "two consecutive runs agree within 5%" rule.

Exit status: 0 all good; 1 an mpfa case or a ceiling failed (peers' failures are recorded,
not fatal), or a suite was not published; 2 bad arguments, no CUDA GPU, or a refused publish.
On the device machine the tree has no .git: set MPFA_BENCH_COMMIT=<hash> for meta, e.g.
`MPFA_BENCH_COMMIT=<hash> python -m benchmarks.run --suites prefill --publish --no-readme`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import traceback

from benchmarks import ceilings, cli, meta, publish, report, results_io, suites
from benchmarks.stats import merge_repeats

SPREAD_LIMIT = 0.05


def require_cuda():
    """torch, after checking a CUDA GPU is visible; a clear SystemExit(2) otherwise."""
    try:
        import torch
    except ImportError:
        raise SystemExit("benchmarks.run: PyTorch is not installed; it needs torch with CUDA "
                         "on a machine with an NVIDIA GPU") from None
    if not torch.cuda.is_available():
        print(f"benchmarks.run: no CUDA GPU visible (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda or 'none: a CPU build'}). Run it on the GPU machine.",
              file=sys.stderr)
        raise SystemExit(2)
    return torch


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="case", mininterval=1.0, dynamic_ncols=True)


def measure_ceilings(ctx: suites.Context) -> list[dict]:
    """One row per ceiling; a failure becomes an error row (and fails the run later)."""
    rows = []
    with _progress(len(ceilings.ALL), "ceilings") as bar:
        for name, fn in ceilings.ALL.items():
            bar.set_postfix_str(name)
            try:
                rows.append(fn(warmup_ms=ctx.warmup_ms, rep_ms=ctx.rep_ms))
            except Exception as e:  # keep going: the suites still produce their rows
                bar.write(traceback.format_exc())
                rows.append({"kind": "ceiling", "id": f"ceiling/{name}", "name": name,
                             "status": "error", "reason": f"{type(e).__name__}: {e}"})
            bar.update()
    return rows


def run_case(suite, case: dict, ctx: suites.Context, write=print) -> dict:
    """One case's row; Skip -> status "skipped", any other exception -> status "error"."""
    try:
        row = suite.run_case(case, ctx)
        row.setdefault("status", "ok")
        return row
    except suites.Skip as e:
        return {**case, "status": "skipped", "reason": str(e)}
    except Exception as e:
        write(f"{case['id']}: {traceback.format_exc()}")
        return {**case, "status": "error", "reason": f"{type(e).__name__}: {e}"}


def selected(cases: list[dict], patterns: list[str] | None) -> list[dict]:
    """The cases whose id contains one of ``patterns`` (all of them when None)."""
    return cases if patterns is None else [c for c in cases if any(p in c["id"] for p in patterns)]


def run_suite(suite, ctx: suites.Context, repeat: int, patterns: list[str] | None = None) -> list[dict]:
    """The suite's cases (those ``selected`` by ``patterns``), `repeat` times over, merged into one row per case."""
    cases = suite.cases(ctx.quick)
    ids = [c["id"] for c in cases]
    if len(set(ids)) != len(ids):
        raise ValueError(f"suite {suite.NAME}: case ids are not unique")
    cases = selected(cases, patterns)
    runs = []
    with _progress(len(cases) * repeat, suite.NAME) as bar:
        for rep in range(repeat):
            rows = []
            for case in cases:
                bar.set_postfix_str(f"run {rep + 1}/{repeat} {case['id']}")
                rows.append(run_case(suite, case, ctx, write=bar.write))
                bar.update()
            runs.append(rows)
    return merge_repeats(runs)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = cli.Parser(prog="python -m benchmarks.run", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suites", default="all",
                    help=f"comma-separated, or 'all' (available: {', '.join(suites.available())})")
    ap.add_argument("--quick", action="store_true", help="short timing, fewer cases (smoke run)")
    ap.add_argument("--repeat", type=int, default=1, help="run each suite N times; record spread")
    ap.add_argument("--warmup-ms", type=float, default=None)
    ap.add_argument("--rep-ms", type=float, default=None)
    ap.add_argument("--mem-budget-gib", type=float, default=8.0,
                    help="cap on memory for rotated input sets per case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", default=None,
                    help="comma-separated substrings: run only the cases whose id holds one (e.g. 'spread'); "
                         "a partial suite goes to --out or scratch, never --publish")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-readme", action="store_true",
                    help="do not rewrite benchmarks/RESULTS.md (the option predates that file)")
    publish.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.cases is not None:
        args.cases = [p.strip() for p in args.cases.split(",") if p.strip()]
        if not args.cases:
            ap.error("--cases: give comma-separated substrings of case ids, e.g. 'spread'")
        if args.publish:
            ap.error("--cases runs part of a suite, which would replace the published rows of the rest: "
                     "leave out --publish (results go to --out or scratch)")
    args.out = publish.destination(ap, args.out, args.publish)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    names = suites.available() if args.suites == "all" else [
        s.strip() for s in args.suites.split(",") if s.strip()]
    try:
        mods = [suites.load(n) for n in names]
    except (ValueError, TypeError) as e:
        print(f"benchmarks.run: {e}", file=sys.stderr)
        return 2
    for mod in mods if args.cases else ():
        if not selected(mod.cases(args.quick), args.cases):
            print(f"benchmarks.run: --cases {','.join(args.cases)} matches no case of suite {mod.NAME}"
                  f"{' (--quick)' if args.quick else ''}", file=sys.stderr)
            return 2
    torch = require_cuda()
    props = torch.cuda.get_device_properties(0)
    if args.publish and (refused := publish.refusal("benchmarks.run", [f"{m.RESULT}.json" for m in mods], args.out,
                                                     found=props.name)):
        print(refused, file=sys.stderr)
        return 2

    ctx = suites.Context(
        quick=args.quick,
        l2_bytes=getattr(props, "L2_cache_size", 60 << 20),
        mem_budget_bytes=int(args.mem_budget_gib * (1 << 30)),
        warmup_ms=args.warmup_ms if args.warmup_ms is not None else (5.0 if args.quick else 25.0),
        rep_ms=args.rep_ms if args.rep_ms is not None else (20.0 if args.quick else 100.0),
        seed=args.seed,
    )
    command = "python -m benchmarks.run" + (" " + shlex.join(argv) if argv else "")
    print(f"{props.name}, {props.multi_processor_count} SMs, L2 {ctx.l2_bytes >> 20} MiB; "
          f"suites: {', '.join(m.NAME for m in mods)}; repeat {args.repeat}", flush=True)

    ceiling_rows = measure_ceilings(ctx)
    ctx.ceilings = ceilings.by_name(ceiling_rows)
    failed = [r["id"] for r in ceiling_rows if r["status"] != "ok"]

    folders = set()   # where this run's suites went: their roofline is redrawn there
    for mod in mods:
        rows = ceiling_rows + run_suite(mod, ctx, args.repeat, args.cases)
        if hasattr(mod, "annotate"):
            rows = mod.annotate(rows)
        summary = mod.summarize(rows)
        m = meta.collect(command, suite=mod.NAME, quick=args.quick, repeat=args.repeat,
                         warmup_ms=ctx.warmup_ms, rep_ms=ctx.rep_ms, seed=args.seed)
        not_published = publish.failed_rows(rows) if args.publish else []
        out = publish.SCRATCH_DIR if not_published else args.out
        folders.add(out)
        path = results_io.write(mod.RESULT, m, summary, rows, out)
        result = results_io.read(path)
        print(f"\nwrote {path}")
        if not args.no_plots and hasattr(mod, "plot"):
            try:
                for p in mod.plot(result, out):
                    print(f"wrote {p}")
            except Exception as e:  # a plot must not cost the measurements
                print(f"plot for {mod.NAME} failed: {type(e).__name__}: {e}", file=sys.stderr)
        print(report.render_result(mod.RESULT, result), flush=True)
        failed += [r["id"] for r in rows if r.get("status") == "error" and r.get("impl") == "mpfa"]
        if not_published:
            print(publish.failure_line(f"benchmarks.run {mod.NAME}", not_published, path), file=sys.stderr)
            failed.append(f"{mod.NAME} (not published)")
        spread = summary.get("max_spread")
        if spread is not None and spread > SPREAD_LIMIT:
            print(f"WARNING {mod.NAME}: max spread between repeats {spread:.1%} > "
                  f"{SPREAD_LIMIT:.0%}: differences below that are noise", file=sys.stderr)

    if not args.no_plots:
        from benchmarks import roofline
        for folder in sorted(folders):
            path = roofline.draw(folder)
            if path:
                print(f"wrote {path}")
    published = {f.resolve() for f in folders} - {publish.SCRATCH_DIR.resolve()}
    if not args.no_readme and results_io.RESULTS_DIR.resolve() in published:
        report.main(["--results", str(results_io.RESULTS_DIR)])
    if failed:
        print(f"FAILED: {', '.join(dict.fromkeys(failed))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
