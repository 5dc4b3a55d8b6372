"""Prefill kernel template knobs, A/B in one process: the same plan and inputs run through each variant of
the main kernel, timed with the suites' timer, and compared with the default variant's output.

    python -m benchmarks.prefill_variants --shapes 16K,32K --recipes qk4pv8,qk8pv8 \\
        --variants "stages=3" "pv_once=0" "tile_scale=0,comp_mma=0"

Knobs are the template's parameters (mpfa_jit/ops/prefill.py KNOBS, rendered by templates/prefill.cu.jinja:
``stages``, ``tile_scale``, ``comp_mma``, ``pv_once``); a variant lists the knobs it sets over the recipe's served
build (``""``: the served build itself; the wrapper's private ``_plan_study`` plans it). The knobs no served build used
(``pingpong``, ``consumers=2``, ``persistent``, ``poly_every``, ``fac_vec=0``, ``stages=4``) are at 649ecec
(docs/design/prefill.md). The served build (SERVED_KNOBS) is always the first variant and the
reference for the output check (``max_abs_diff`` and ``rel_l2`` against it; a knob that changes numerics shows
there, one that only reschedules shows 0). Shapes and inputs are the prefill suite's (benchmarks/suites/prefill.py:
its cache, page order and plan, made again for each variant from the same seed; compensation on for the quantized
recipes unless ``--compensation off``). Rows go to ``<out>/<name>.json`` with the meta of the run: ``<out>`` is
benchmarks/results/scratch/studies unless ``--publish`` (then benchmarks/results/studies, or ``--out``; refused on
another GPU than the published file names, and a run with a non-finite output goes to scratch instead:
benchmarks/publish.py). This is a study (a speed claim goes through the prefill suite beside its peers).
"""
from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

from benchmarks import cli, publish, results_io
from benchmarks.suites import prefill as suite
from mpfa_jit.ops.prefill import KNOBS

PROG = "python -m benchmarks.prefill_variants"
STUDIES = results_io.RESULTS_DIR / "studies"


def parse_variant(text: str) -> dict:
    """``"stages=3,pv_once=0"`` -> {"stages": 3, "pv_once": 0}; checks names and values."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in KNOBS:
            raise ValueError(f"--variants: unknown knob {name!r} (knobs: {', '.join(KNOBS)})")
        try:
            v = int(value)
        except ValueError:
            raise ValueError(f"--variants: {name} takes an integer, got {value!r}") from None
        if v not in KNOBS[name]:
            raise ValueError(f"--variants: {name} must be one of {KNOBS[name]}, got {v}")
        out[name] = v
    return out


def build(recipe: str, variants: list[dict | None]) -> None:
    """Builds every variant's library in parallel (None: the served build), so that the runs only load them."""
    from mpfa_jit import get_kernel
    from mpfa_jit.ops import prefill as op
    specs = [op.spec(recipe=recipe, head_dim=suite.HEAD_DIM, page_size=suite.PAGE, arch="sm_90a", knobs=v)
             for v in variants]
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(get_kernel, specs))


def run(shape: str, recipe: str, variants: list[dict | None], seed: int = 0, on_row=lambda row: None,
        compensation: bool = True) -> list[dict]:
    """Every variant (None: the served build) at one of the prefill suite's shapes and one recipe; ``on_row`` gets
    each row as it is measured (the caller writes the file then: a variant that hangs its kernel leaves the rows
    before it). ``compensation`` (quantized recipes): Q smoothing + the rank-one term on, as served, or off."""
    import torch
    from benchmarks.timing import bench
    from mpfa_jit.ops.prefill import build_knobs
    build(recipe, variants)
    case = suite._case("mpfa", recipe, shape, dict(suite.SHAPES)[shape], compensation if recipe != "bf16" else None)
    rows, ref = [], None
    for variant in variants:
        # the same inputs (same seed) planned for this build: its CTA height, workspace sections and kernel
        w, q, layer = suite.mpfa_setup(case, torch.Generator(device="cuda").manual_seed(seed), knobs=variant)
        out = torch.full_like(q, float("nan"))
        w.run(q, layer, out=out)
        torch.cuda.synchronize()
        if ref is None:
            ref = out.clone().float()
        diff = (out.float() - ref)
        t = bench(lambda: w.run(q, layer, out=out))
        rows.append({"recipe": recipe, "shape": shape, "variant": "served" if variant is None else variant,
                     "knobs": build_knobs(recipe, variant),
                     "compensation": compensation if recipe != "bf16" else None,
                     "ms": t.median, "tflops": case["flops"] / (t.median * 1e-3) / 1e12, "spread": t.p80 / t.p20 - 1,
                     "finite": bool(torch.isfinite(out).all()), "max_abs_diff": float(diff.abs().max()),
                     "rel_l2": float(diff.norm() / ref.norm())})
        r = rows[-1]
        on_row(r)
        print(f"{recipe:7s} {shape:18s} {str(r['variant']):28s} {r['ms']:.3f} ms {r['tflops']:5.0f} TFLOP/s "
              f"spread {r['spread']:.1%} max|diff| {r['max_abs_diff']:.3g} rel-L2 {r['rel_l2']:.2e}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = cli.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="16K,32K", help="prefill suite shapes, comma-separated (default %(default)s)")
    ap.add_argument("--recipes", default="qk4pv8,qk8pv8")
    ap.add_argument("--variants", nargs="+", default=[""],
                    help="knob sets over the served build, e.g. \"stages=3,pv_once=0\" (default: \"\", the served "
                         "build again)")
    publish.add_arguments(ap, out_help="folder of the study's file")
    ap.add_argument("--compensation", choices=["on", "off"], default="on",
                    help="quantized recipes: Q smoothing + compensation as served (on) or off (default %(default)s)")
    ap.add_argument("--name", default="prefill_variants_h200",
                    help="results file name under --out, without .json (one file per study; default %(default)s)")
    args = ap.parse_args(argv)
    if not args.name or "/" in args.name or args.name.endswith(".json"):
        ap.error(f"--name: a file name without folder or .json, got {args.name!r}")
    try:
        variants = [None] + [parse_variant(v) for v in args.variants]
    except ValueError as e:
        ap.error(str(e))
    recipes = [r for r in args.recipes.split(",") if r]
    if not recipes or any(r not in suite.RECIPES for r in recipes):
        ap.error(f"--recipes: choose from {', '.join(suite.RECIPES)}, got {args.recipes!r}")
    shapes = [x for x in args.shapes.split(",") if x]
    names = [name for name, _ in suite.SHAPES]
    if not shapes or any(x not in names for x in shapes):
        ap.error(f"--shapes: choose from {', '.join(names)}, got {args.shapes!r}")
    from benchmarks import meta as bench_meta
    command = f"{PROG} " + " ".join(argv if argv is not None else sys.argv[1:])
    target = publish.destination(ap, args.out, args.publish, published=STUDIES, scratch=publish.SCRATCH_DIR / "studies")
    if args.publish and (refused := publish.refusal(PROG, [f"{args.name}.json"], target, published=STUDIES)):
        print(refused, file=sys.stderr)
        return 2
    meta = bench_meta.collect(command.strip(), parts=["prefill_variants"])
    rows: list[dict] = []
    work = publish.staging_dir(args.name) if args.publish else target   # published only once every row is in

    def keep(row):
        rows.append(row)
        results_io.write(args.name, meta, {"variants": len(variants), "rows": len(rows)}, rows, work)
    for shape in shapes:
        for r in recipes:
            run(shape, r, variants, on_row=keep, compensation=args.compensation == "on")
    path = work / f"{args.name}.json"
    failed = [f"{r['recipe']} {r['shape']} {r['variant']}" for r in rows if not r["finite"]]
    if args.publish and failed:
        print(publish.failure_line(PROG, failed, path), file=sys.stderr)
    elif args.publish:
        for p in publish.promote(work, target):
            print(f"published {publish.display(p)}")
    else:
        print(f"wrote {publish.display(path)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
