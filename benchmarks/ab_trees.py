"""A/B of two source trees' kernels in alternating processes: the check that a refactor left speed alone.

    python -m benchmarks.ab_trees --old /tmp/mpfa-old [--ops decode,prefill] [--rounds 2] [--publish]
        [--page-size 1 --permute-pages] [--recipes qk4pv8,qk4pv4]
    git archive <commit> mpfa_jit python templates | tar -x -C /tmp/mpfa-old      # an old tree, made here

Each round runs one process per tree, old then new, timing the same shapes through the public API
(PagedKVCache, append_kv, BatchDecodeWrapper, BatchPrefillWrapper): kernel speed drifts with clocks and
temperature over minutes, so alternating processes spread that drift over both trees instead of charging it
to whichever ran second. An old-tree process imports mpfa and mpfa_jit from --old (the editable install's
import hook removed; --old's templates/ linked where its mpfa_jit looks for them) with a kernel cache of its
own; a new-tree process imports this checkout's. A first pair of processes builds each tree's kernels in
parallel, untimed. Per shape: the median of each process's timed calls (CUDA events), then per tree the
median over its processes; ``new_over_old_time`` is new / old (1.0: no change; the refactor rule is within
1%). Pages are each request's consecutive pages unless ``--permute-pages`` scatters them (one seeded
permutation of the cache's pages, the same in both trees: a long-running server's page table, and at page size 1
each token somewhere else). Rows go to ``<out>/ab_trees_h200.json`` (benchmarks/results/scratch unless --publish).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

RESULT = "ab_trees_h200"
PROG = "python -m benchmarks.ab_trees"
REPO = Path(__file__).resolve().parents[1]
# Llama-3.1-8B's attention (32 query / 8 KV heads, head_dim 128) at page size 16 (--page-size), SGLang's long-context shapes:
# decode batches over 32K and 128K contexts; prefill of one 16K prompt and of a chunk after a cached prefix.
QO_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
SHAPES = {
    "decode": [("32x32768", 32, 32768, 1), ("8x131072", 8, 131072, 1)],
    "prefill": [("1x16384", 1, 16384, 16384), ("4x8192+chunk4096", 4, 8192, 4096)],
}


# --- the worker: one process, one tree (imports nothing from benchmarks: an old tree has its own) -------------------
def _use_tree(tree: str) -> None:
    """Import mpfa and mpfa_jit from ``tree`` instead of the installed checkout."""
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    link = Path(tree) / "mpfa_jit" / "templates"
    if link.is_symlink() and not link.exists():   # a link made on another machine
        link.unlink()
    if not link.exists():
        link.symlink_to(Path(tree).resolve() / "templates", target_is_directory=True)
    sys.path[:0] = [str(Path(tree) / "python"), str(tree)]


def _timed_ms(fn, reps: int) -> float:
    import torch
    fn()
    torch.cuda.synchronize()
    for _ in range(3):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _case(op: str, recipe: str, batch: int, kv_len: int, q_len: int, reps: int, page: int = PAGE,
          permute: bool = False) -> float:
    """Median ms of one planned batch: ``batch`` requests of ``kv_len`` keys, the last ``q_len`` of them queries,
    in pages of ``page`` tokens (``permute``: scattered over the cache)."""
    import torch
    import mpfa
    dev = "cuda"
    pages_per = -(-kv_len // page)
    cache = mpfa.PagedKVCache(recipe, num_layers=1, num_pages=batch * pages_per, page_size=page,
                              num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(batch * kv_len, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev, generator=gen)
    v = torch.randn(batch * kv_len, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev, generator=gen)
    cache.calibrate(0, k[:4096], v[:4096])
    i32 = lambda x: torch.as_tensor(x, dtype=torch.int32, device=dev)
    indices = (torch.randperm(batch * pages_per, generator=torch.Generator(device=dev).manual_seed(1), device=dev)
               if permute else torch.arange(batch * pages_per, device=dev)).to(torch.int32)
    t = torch.arange(kv_len, device=dev)
    pages = indices.view(batch, pages_per).long()[:, t // page]
    slots = (pages * page + t % page).reshape(-1)
    mpfa.append_kv(k, v, cache.layer(0), slots)
    indptr = i32([b * pages_per for b in range(batch + 1)])
    last = i32([kv_len - (pages_per - 1) * page] * batch)
    q = torch.randn(batch * q_len, QO_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev, generator=gen)
    ws = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    if op == "decode":
        w = mpfa.BatchDecodeWrapper(ws)
        w.plan(indptr, indices, last, QO_HEADS, KV_HEADS, HEAD_DIM, page, recipe=recipe)
    else:
        w = mpfa.BatchPrefillWrapper(ws)
        w.plan(i32([b * q_len for b in range(batch + 1)]), indptr, indices, last, QO_HEADS, KV_HEADS, HEAD_DIM, page,
               causal=True, recipe=recipe)
    layer = cache.layer(0)
    return _timed_ms(lambda: w.run(q, layer), reps)


def _build(ops: list[str], recipes: list[str], page: int) -> None:
    """Build (or find in the cache) every kernel the cases load, in parallel: untimed."""
    from concurrent.futures import ThreadPoolExecutor
    import torch
    from mpfa_jit import build_only
    from mpfa_jit.ops import append_kv, decode, prefill
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}{'a' if major >= 9 else ''}"
    specs = [append_kv.spec(recipe=r, head_dim=HEAD_DIM, page_size=page, arch=arch) for r in recipes]
    if "decode" in ops:
        specs += [decode.spec(recipe=r, head_dim=HEAD_DIM, page_size=page, group_size=QO_HEADS // KV_HEADS, arch=arch)
                  for r in recipes]
    if "prefill" in ops:
        specs += [prefill.spec(recipe=r, head_dim=HEAD_DIM, page_size=page, arch=arch) for r in recipes]
    with ThreadPoolExecutor(max(1, min(len(specs), os.cpu_count() or 1))) as pool:
        list(pool.map(build_only, specs))


def worker(tree: str | None, ops: list[str], reps: int, build: bool = False, page: int = PAGE, permute: bool = False,
           recipes: list[str] | None = None) -> list[dict]:
    """Rows {op, recipe, shape, ms} of every case, timed in this process (``build``: build the kernels first;
    ``recipes``: None, every recipe of the tree)."""
    if tree:
        _use_tree(tree)
    from mpfa.recipes import RECIPES   # the tree's own recipes
    recipes = list(RECIPES) if recipes is None else recipes
    if build:
        _build(ops, recipes, page)
    rows = []
    for op in ops:
        for recipe in recipes:
            for name, batch, kv_len, q_len in SHAPES[op]:
                rows.append({"op": op, "recipe": recipe, "shape": name,
                             "ms": _case(op, recipe, batch, kv_len, q_len, reps, page, permute)})
    return rows


# --- the driver ----------------------------------------------------------------------------------------------------
def _run_worker(tree: str | None, ops: list[str], reps: int, cache_dir: str | None, build: bool, page: int = PAGE,
                permute: bool = False, recipes: list[str] | None = None) -> list[dict]:
    env = dict(os.environ)
    if cache_dir:
        env["MPFA_CACHE_DIR"] = cache_dir
    code = (f"import json, runpy; w = runpy.run_path({str(Path(__file__).resolve())!r}, run_name='ab_worker'); "
            f"print('AB_ROWS ' + json.dumps(w['worker']({tree!r}, {ops!r}, {reps}, {build!r}, {page}, {permute!r}, "
            f"{recipes!r})))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd="/", capture_output=True, text=True)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("AB_ROWS ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"{'old' if tree else 'new'} tree worker failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(line[len("AB_ROWS "):])


def summarize(runs: dict[str, list[list[dict]]]) -> tuple[dict, list[dict]]:
    """(summary, rows) from each tree's per-process rows."""
    key = lambda r: f"{r['op']}/{r['recipe']}/{r['shape']}"
    per = {tree: {} for tree in runs}
    for tree, procs in runs.items():
        for rows in procs:
            for r in rows:
                per[tree].setdefault(key(r), []).append(r["ms"])
    rows, ratio = [], {}
    for k in per["new"]:
        old, new = statistics.median(per["old"][k]), statistics.median(per["new"][k])
        ratio[k] = new / old
        rows.append({"case": k, "old_ms": per["old"][k], "new_ms": per["new"][k], "old_median_ms": old,
                     "new_median_ms": new, "new_over_old_time": new / old})
    vals = list(ratio.values())
    summary = {"new_over_old_time": ratio, "geomean": statistics.geometric_mean(vals),
               "max": max(vals), "min": min(vals), "within_1_percent": all(abs(v - 1) <= 0.01 for v in vals)}
    return summary, rows


def main(argv=None) -> int:
    # the driver's imports: a worker process loads this file for worker() alone, before its tree's mpfa
    from benchmarks import cli
    from benchmarks import meta as bench_meta
    from benchmarks import publish, results_io
    ap = cli.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="the old source tree (mpfa_jit/, python/, templates/)")
    ap.add_argument("--old-label", default=None, help="what the old tree is, for meta (e.g. its commit)")
    ap.add_argument("--ops", default="decode,prefill", help="comma-separated subset of decode, prefill")
    ap.add_argument("--rounds", type=int, default=2, help="old/new process pairs (default %(default)s)")
    ap.add_argument("--reps", type=int, default=50, help="timed calls per case and process (default %(default)s)")
    ap.add_argument("--old-cache-dir", default="/tmp/mpfa-ab-old-cache", help="the old tree's kernel cache")
    ap.add_argument("--page-size", type=int, default=PAGE, help="tokens per page (default %(default)s)")
    ap.add_argument("--permute-pages", action="store_true", help="scatter the pages over the cache (one seeded "
                    "permutation) instead of each request's consecutive pages")
    ap.add_argument("--recipes", default=None, help="comma-separated recipes (default: every recipe of the tree)")
    publish.add_arguments(ap)
    args = ap.parse_args(argv)
    args.out = publish.destination(ap, args.out, args.publish)
    ops = ap.comma_list("--ops", args.ops, tuple(SHAPES))
    if not all((args.old / d).is_dir() for d in ("mpfa_jit", "python", "templates")):
        ap.error(f"--old {args.old}: not a source tree (needs mpfa_jit/, python/ and templates/)")
    if args.rounds < 1 or args.reps < 5:
        ap.error("--rounds must be at least 1 and --reps at least 5")
    from mpfa_jit.ops.support import PAGE_SIZES
    if args.page_size not in PAGE_SIZES:
        ap.error(f"--page-size {args.page_size}: the kernels are built for page sizes {', '.join(map(str, PAGE_SIZES))}")
    from mpfa.recipes import RECIPES
    recipes = None if args.recipes is None else ap.comma_list("--recipes", args.recipes, tuple(RECIPES))
    why = publish.refusal(PROG, [f"{RESULT}.json"], args.out) if args.publish else None
    if why:
        print(why, file=sys.stderr)
        return 2
    from tqdm import tqdm
    runs: dict[str, list] = {"old": [], "new": []}
    trees = {"old": str(args.old.resolve()), "new": None}
    with tqdm(total=2 * (args.rounds + 1), unit="process", desc="A/B (first pair builds)", file=sys.stderr) as bar:
        for i in range(args.rounds + 1):
            for name in ("old", "new"):
                rows = _run_worker(trees[name], ops, args.reps if i else 5, args.old_cache_dir if name == "old" else None,
                                   build=i == 0, page=args.page_size, permute=args.permute_pages, recipes=recipes)
                if i:   # the first pair builds and loads the kernels; not counted
                    runs[name].append(rows)
                bar.update(1)
    summary, rows = summarize(runs)
    command = f"{PROG} " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = bench_meta.collect(command, old_tree=args.old_label or str(args.old), rounds=args.rounds, reps=args.reps,
                              page_size=args.page_size, permute_pages=args.permute_pages)
    path = results_io.write(RESULT, meta, summary, rows, args.out)
    for r in rows:
        print(f"{r['case']:32s} old {r['old_median_ms']:.4f} ms  new {r['new_median_ms']:.4f} ms  "
              f"new/old {r['new_over_old_time']:.4f}")
    print(f"geomean {summary['geomean']:.4f}, range {summary['min']:.4f}..{summary['max']:.4f}; wrote {publish.display(path)}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
