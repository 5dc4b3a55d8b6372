"""SGLang with ``--attention-backend mpfa`` on the GPU: what the SGLang backend issue must show, written to
``benchmarks/results/e2e_sglang_h200.json``.

    python -m benchmarks.e2e.sglang_check [--parts agreement,capacity,launch] [--publish] [--out DIR]

Every configuration runs in its own child process (one ``sglang.Engine`` or server at a time, so a crash
or a hang in one cannot take the others down and each starts on a free GPU); its log goes to
``<out>/logs/``. Rows of the parts run now replace that part's rows in the existing file, so the parts can
run in separate calls. ``<out>`` is ``benchmarks/results/scratch`` (git-ignored; the file starts as a copy of the
published one) unless ``--publish``: then ``benchmarks/results`` (or ``--out``), and only from a run on a GPU
machine with SGLang whose GPU is the one the published file names and whose rows all succeeded; until then
its files and logs stay in a folder under scratch (``benchmarks/publish.py``). Parts:

- ``agreement``: the real SmolLM2-135M (``python -m benchmarks.e2e.smollm2_hf`` converts the GGUF first),
  20 prompts cut from the Python standard library sources (16 to 6,000 tokens), greedy, 64 new tokens,
  ``ignore_eos``. SGLang's flashinfer backend (BF16 KV) is the reference; mpfa runs each recipe with decode
  CUDA graphs on and off. Each configuration generates twice: the second pass hits the radix cache
  (extend over cached prefix pages). Agreement = tokens equal at the same position / all tokens.
- ``capacity``: Llama-3.1-8B shape with dummy weights at the default server config's
  ``--mem-fraction-static``: ``max_total_num_tokens`` of flashinfer BF16 and FP8 KV and of mpfa per recipe.
- ``launch``: README's launch command (``python -m mpfa.sglang.launch server_configs/llama-3.1-8b-qk4pv8.yaml``)
  must serve ``/generate`` with input_ids; its ``max_total_num_tokens`` is recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import cli
from benchmarks import meta as bench_meta
from benchmarks import publish, results_io
# RESULT, TABLE and summarize: benchmarks.report finds the file's summary and table through this module.
from benchmarks.e2e.results import (NEW_TOKENS, RESULT, SCORER, TABLE, read_result, summarize,  # noqa: F401
                                    with_calls, write_rows)
from mpfa_jit.ops.decode import RECIPES

REPO = Path(__file__).resolve().parents[2]
PARTS = ("agreement", "capacity", "launch")
PROG = "python -m benchmarks.e2e.sglang_check"
SMOLLM2_DIR = REPO / "server_configs" / "models" / "smollm2-135m"
LLAMA_DIR = REPO / "server_configs" / "models" / "llama-3.1-8b"
DEFAULT_CONFIG = REPO / "server_configs" / "llama-3.1-8b-qk4pv8.yaml"
NUM_PROMPTS = 20
PAGE_SIZE = 16
CHILD_MARK = "@@sglang_check@@"
CHILD_TIMEOUT_S = 420


# --- prompts ----------------------------------------------------------------------------------------------------
def prompt_lengths(n: int = NUM_PROMPTS, lo: int = 16, hi: int = 6000) -> list[int]:
    """n lengths spread geometrically over [lo, hi], nudged off page multiples so tails vary."""
    out = []
    for i in range(n):
        x = lo * (hi / lo) ** (i / max(1, n - 1))
        out.append(int(round(x)) + (i % 5))
    return out


def make_prompts(tokenizer_dir: Path | str, prompt_set: str = "stdlib", n: int = NUM_PROMPTS) -> list[list[int]]:
    """n prompts cut at evenly spaced offsets from the Python standard library sources ("stdlib": code,
    cut mid-line) or the King James Bible ("kjv": prose; benchmarks.accuracy.data fetches it)."""
    from transformers import AutoTokenizer

    from benchmarks.accuracy import data
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    text = data.stdlib_text(2_000_000) if prompt_set == "stdlib" else data.kjv_text()[:2_000_000]
    ids = tok(text, add_special_tokens=False).input_ids
    lengths = prompt_lengths(n)
    stride = (len(ids) - max(lengths)) // n
    if stride <= 0:
        raise ValueError(f"the standard library text gave only {len(ids)} tokens")
    return [ids[i * stride: i * stride + length] for i, length in enumerate(lengths)]


# --- one configuration, in a child process -------------------------------------------------------------------------
def _child(spec: dict) -> dict:
    """Start one sglang.Engine, generate the prompts twice (second pass: radix-cache hits), report."""
    import sglang
    t0 = time.perf_counter()
    engine = sglang.Engine(**spec["engine"])
    out = {"startup_s": round(time.perf_counter() - t0, 1)}
    try:
        info = engine.get_server_info()
        out["max_total_num_tokens"] = info.get("max_total_num_tokens")
        prompts = spec.get("prompts")
        if prompts:  # greedy, twice
            sp = {"max_new_tokens": spec["new_tokens"], "temperature": 0.0, "ignore_eos": True}
            passes = []
            for _ in range(2):
                t1 = time.perf_counter()
                res = engine.generate(input_ids=prompts, sampling_params=[dict(sp) for _ in prompts])
                passes.append({"seconds": round(time.perf_counter() - t1, 2),
                               "output_ids": [r["output_ids"] for r in res]})
            out["passes"] = passes
        if spec.get("score"):
            out["scored"] = score_sequences(engine, spec["score"])
    finally:
        engine.shutdown()
    return out


def score_sequences(engine, score: list[dict]) -> list[dict]:
    """Teacher forcing: for each ``{"ids": prompt + output, "start": len(prompt)}`` the engine's prefill
    log-probability of every output token and of its own top-1 token at that position."""
    seqs = [s["ids"] for s in score]
    # Asked from one position early: SGLang's first input entry carries no log-probability (None) in some
    # versions and the scored one in others; the list always ends at the last input position, so the
    # last len(ids) - start entries are positions start .. len(ids) - 1 either way.
    res = engine.generate(input_ids=seqs, sampling_params=[{"max_new_tokens": 1, "temperature": 0.0}] * len(seqs),
                          return_logprob=True, logprob_start_len=[max(0, s["start"] - 1) for s in score],
                          top_logprobs_num=1)
    return [_scored_positions(s, r["meta_info"]) for s, r in zip(score, res)]


def _scored_positions(s: dict, meta_info: dict) -> dict:
    """Positions ``start .. len(ids) - 1`` of one scored sequence: position p holds log P(ids[p] | ids[:p])
    and the scorer's top-1 there. Checks that each entry's token is ids[p] (the alignment is right)."""
    n = len(s["ids"]) - s["start"]
    entries, tops = meta_info["input_token_logprobs"][-n:], meta_info["input_top_logprobs"][-n:]
    if len(entries) != n or len(tops) != n:
        raise ValueError(f"the scorer returned {len(entries)} input log-probabilities for {n} output tokens")
    for p, (_lp, tid, *_rest) in zip(range(s["start"], len(s["ids"])), entries):
        if tid != s["ids"][p]:
            raise ValueError(f"scored entry for position {p} is token {tid}, not {s['ids'][p]}: misaligned")
    top = [(t[0][0], t[0][1]) if t else (None, None) for t in tops]
    return {"chosen_logprob": [e[0] for e in entries], "top1_logprob": [v for v, _ in top],
            "top1_id": [i for _, i in top]}


def logprob_gaps(scored: dict) -> list[float]:
    """top-1 minus chosen log-probability per output token (0 where the token is the scorer's argmax)."""
    gaps = []
    for lp, top in zip(scored["chosen_logprob"], scored["top1_logprob"]):
        if lp is None or top is None:
            raise ValueError("a scored output token has no log-probability (logprob_start_len too late?)")
        gaps.append(max(0.0, top - lp))
    return gaps


def run_child(spec: dict, env_extra: dict, log_path: Path, timeout: float = CHILD_TIMEOUT_S) -> dict:
    """Run _child(spec) in a fresh interpreter; returns its result or {"error": ...} (never raises)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **env_extra}
    for k in ("MPFA_RECIPE", "MPFA_COMPENSATION"):
        if k not in env_extra:
            env.pop(k, None)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path = log_path.with_suffix(".spec.json")   # prompts are too long for one argv string
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "benchmarks.e2e.sglang_check", "--child", str(spec_path)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                                start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"error": f"timed out after {timeout:.0f} s (log {log_path.name})"}
    for line in stdout.splitlines():
        if line.startswith(CHILD_MARK):
            return json.loads(line[len(CHILD_MARK):])
    tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def _engine_args(model: Path, backend: str, *, graphs: bool, mem_fraction: float, context_length: int,
                 dummy: bool, kv_cache_dtype: str | None = None) -> dict:
    args = dict(model_path=str(model), attention_backend=backend, page_size=PAGE_SIZE, skip_tokenizer_init=True,
                context_length=context_length, mem_fraction_static=mem_fraction, random_seed=0,
                log_level="warning", cuda_graph_max_bs_decode=32)
    if dummy:
        args["load_format"] = "dummy"
    if backend == "mpfa":
        # eager prefill for every recipe, as these checks always measured it (the plugin's default is per recipe:
        # settings.PREFILL_CUDA_GRAPH; the graph gives the eager tokens, tests/gpu/test_sglang_gpu.py)
        args["disable_prefill_cuda_graph"] = True
    if not graphs:
        args["disable_decode_cuda_graph"] = True
        args["disable_prefill_cuda_graph"] = True
    if kv_cache_dtype:
        args["kv_cache_dtype"] = kv_cache_dtype
    return args


# --- parts -----------------------------------------------------------------------------------------------------------
def _configs(part: str, smollm2: Path, mem_fraction: float, graphs_off: bool = True,
             recipes=RECIPES) -> list[dict]:
    """(label, backend, recipe, graphs, engine args) of every configuration a part runs."""
    out = []
    if part == "agreement":
        kw = dict(mem_fraction=0.3, context_length=8192, dummy=False)
        out.append(dict(config="flashinfer-bf16", backend="flashinfer", recipe=None, graphs=True,
                        engine=_engine_args(smollm2, "flashinfer", graphs=True, **kw)))
        if graphs_off:   # the control: graphs also change the other layers' GEMM shapes (padded batch)
            out.append(dict(config="flashinfer-bf16-graphs-off", backend="flashinfer", recipe=None, graphs=False,
                            engine=_engine_args(smollm2, "flashinfer", graphs=False, **kw)))
        for recipe in recipes:
            for graphs in ((True, False) if graphs_off else (True,)):
                out.append(dict(config=f"mpfa-{recipe}-graphs-{'on' if graphs else 'off'}", backend="mpfa",
                                recipe=recipe, graphs=graphs,
                                engine=_engine_args(smollm2, "mpfa", graphs=graphs, **kw)))
    elif part == "capacity":
        kw = dict(mem_fraction=mem_fraction, context_length=131072, dummy=True, graphs=False)
        out.append(dict(config="flashinfer-bf16", backend="flashinfer", recipe=None, kv_cache_dtype="auto",
                        engine=_engine_args(LLAMA_DIR, "flashinfer", **kw)))
        out.append(dict(config="flashinfer-fp8_e4m3", backend="flashinfer", recipe=None, kv_cache_dtype="fp8_e4m3",
                        engine=_engine_args(LLAMA_DIR, "flashinfer", kv_cache_dtype="fp8_e4m3", **kw)))
        for recipe in RECIPES:
            out.append(dict(config=f"mpfa-{recipe}", backend="mpfa", recipe=recipe,
                            engine=_engine_args(LLAMA_DIR, "mpfa", **kw)))
    return out



def _row(part: str, cfg: dict, res: dict, seconds: float, prompt_set: str | None) -> dict:
    row = {"part": part, "config": cfg["config"], "backend": cfg["backend"], "recipe": cfg.get("recipe"),
           "model": Path(cfg["engine"]["model_path"]).name, "page_size": PAGE_SIZE,
           "mem_fraction_static": cfg["engine"]["mem_fraction_static"], "seconds": round(seconds, 1),
           **{k: v for k, v in cfg.items() if k in ("graphs", "kv_cache_dtype")}}
    if prompt_set is not None:
        row["prompt_set"] = prompt_set
    if "error" in res:
        row.update(status="error", error=res["error"])
    else:
        row.update(status="ok", startup_s=res.get("startup_s"), max_total_num_tokens=res.get("max_total_num_tokens"))
    return row


def run_engine_part(part: str, out_dir: Path, smollm2: Path, mem_fraction: float, bar, prompt_set: str = "stdlib",
                    graphs_off: bool = True, recipes=RECIPES):
    """Yields one row per configuration (the caller saves after each: a killed run keeps what finished).
    The agreement part ends with a flashinfer engine scoring every configuration's greedy tokens by
    teacher forcing (``score_sequences``)."""
    agreement = part == "agreement"
    prompts = make_prompts(smollm2, prompt_set) if agreement else None
    pset = prompt_set if agreement else None
    outputs = {}
    for cfg in _configs(part, smollm2, mem_fraction, graphs_off, recipes):
        bar.set_description(f"{part}: {cfg['config']}")
        spec = {"engine": cfg["engine"], "prompts": prompts, "new_tokens": NEW_TOKENS}
        env = {"MPFA_RECIPE": cfg["recipe"]} if cfg["recipe"] else {}
        t0 = time.perf_counter()
        tag = f"-{prompt_set}" if agreement else ""
        res = run_child(spec, env, out_dir / "logs" / f"{part}{tag}-{cfg['config']}.log")
        row = _row(part, cfg, res, time.perf_counter() - t0, pset)
        if agreement and row["status"] == "ok":
            row["prompt_lengths"] = [len(p) for p in prompts]
            row["output_ids"] = res["passes"][0]["output_ids"]
            row["output_ids_cached_pass"] = res["passes"][1]["output_ids"]
            row["generate_s"] = [p["seconds"] for p in res["passes"]]
            outputs[cfg["config"]] = row["output_ids"]
        bar.update(1)
        yield row
    if agreement and outputs:
        bar.set_description(f"{part}: {SCORER}")
        cfg = dict(config=SCORER, backend="flashinfer", recipe=None, graphs=True,
                   engine=dict(_engine_args(smollm2, "flashinfer", graphs=True, mem_fraction=0.3, context_length=8192,
                                            dummy=False), disable_radix_cache=True))
        score = [{"ids": list(p) + list(o), "start": len(p)} for outs in outputs.values() for p, o in zip(prompts, outs)]
        t0 = time.perf_counter()
        res = run_child({"engine": cfg["engine"], "score": score}, {},
                        out_dir / "logs" / f"{part}-{prompt_set}-{SCORER}.log")
        row = _row(part, cfg, res, time.perf_counter() - t0, pset)
        if row["status"] == "ok":
            scored = iter(res["scored"])
            row["logprob_gaps"] = {name: [[round(g, 5) for g in logprob_gaps(next(scored))] for _ in prompts]
                                   for name in outputs}
        bar.update(1)
        yield row


def run_launch_part(out_dir: Path, config: Path, bar, port: int = 30517, timeout: float = CHILD_TIMEOUT_S) -> list[dict]:
    """README's launch command, /generate with input_ids, then the server's max_total_num_tokens."""
    from benchmarks.e2e.server import Server, http_json, server_env, server_info
    bar.set_description(f"launch: {config.name}")
    cmd = [sys.executable, "-m", "mpfa.sglang.launch", str(config), "--", "--port", str(port), "--log-level", "warning"]
    env = server_env()
    row = {"part": "launch", "config": config.stem, "backend": "mpfa", "command": " ".join(cmd[1:])}
    t0 = time.perf_counter()
    try:
        with Server(cmd, env, out_dir / "logs" / f"launch-{config.stem}.log", port, startup_timeout=timeout) as srv:
            row["startup_s"] = round(srv.startup_s, 1)
            ids = [[(37 * i + 11 * j) % 30000 + 100 for j in range(n)] for i, n in enumerate((5, 777, 3001))]
            res = http_json(f"{srv.base}/generate", {"input_ids": ids, "sampling_params": {
                "max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}})
            row["generated_tokens"] = [len(r["output_ids"]) for r in res]
            info = server_info(srv.base)
            row["max_total_num_tokens"] = info.get("max_total_num_tokens")
            row["attention_backend"] = info.get("attention_backend")
            row["status"] = "ok" if row["generated_tokens"] == [16, 16, 16] else "error"
    except Exception as e:   # the row records it; the log has the server's side
        row.update(status="error", error=f"{type(e).__name__}: {e}")
    row["seconds"] = round(time.perf_counter() - t0, 1)
    bar.update(1)
    return [row]


# --- main ----------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = cli.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    publish.add_arguments(ap)
    ap.add_argument("--smollm2", default=str(SMOLLM2_DIR), help="SmolLM2 HF folder (benchmarks.e2e.smollm2_hf)")
    ap.add_argument("--prompt-set", choices=("stdlib", "kjv"), default="stdlib",
                    help="agreement prompts: Python standard library code or KJV prose (default: %(default)s)")
    ap.add_argument("--no-graphs-off", action="store_true", help="agreement: skip the mpfa runs with graphs off")
    ap.add_argument("--recipes", default=",".join(RECIPES), help="agreement: mpfa recipes to run (default: all)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        res = _child(json.loads(Path(args.child).read_text()))
        print(CHILD_MARK + json.dumps(res), flush=True)
        return 0
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        ap.error(f"--parts: unknown {bad}; choose from {', '.join(PARTS)}")
    smollm2 = Path(args.smollm2)
    if "agreement" in parts and not (smollm2 / "model.safetensors").exists():
        ap.error(f"--smollm2 {smollm2} has no model.safetensors: run python -m benchmarks.e2e.smollm2_hf first")
    from tqdm import tqdm

    from mpfa.sglang.settings import load_server_config
    mem_fraction = float(load_server_config(DEFAULT_CONFIG).sglang["mem-fraction-static"])
    graphs_off = not args.no_graphs_off
    recipes = [r for r in args.recipes.split(",") if r]
    if any(r not in RECIPES for r in recipes):
        ap.error(f"--recipes: choose from {', '.join(RECIPES)}, got {args.recipes!r}")
    n = sum(len(_configs(p, smollm2, mem_fraction, graphs_off, recipes)) + (p == "agreement") if p != "launch" else 1
            for p in parts)
    target = publish.destination(ap, args.out, args.publish)
    scratch = target.resolve() == publish.SCRATCH_DIR.resolve()
    before = read_result(results_io.RESULTS_DIR if scratch else target)   # scratch: a copy of the published file
    previous = before["rows"]
    if args.publish and (refused := publish.refusal(PROG, [f"{RESULT}.json"], target, need_sglang=True)):
        print(refused, file=sys.stderr)
        return 2
    # a publishing run writes to staging (logs too); only a run whose rows all succeeded reaches the target
    out_dir = publish.staging_dir(RESULT) if args.publish else target
    command = f"{PROG} " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = with_calls(bench_meta.collect(command.strip(), parts=parts), before["meta"])
    new: list[dict] = []

    with tqdm(total=n, unit="server", file=sys.stderr) as bar:
        for part in parts:
            found = (run_launch_part(out_dir, DEFAULT_CONFIG, bar) if part == "launch" else
                     run_engine_part(part, out_dir, smollm2, mem_fraction, bar, args.prompt_set, graphs_off, recipes))
            for row in found:
                new.append(row)
                rows = write_rows(previous, new, out_dir, meta)
    for r in rows:
        if r.get("status") != "ok":
            print(f"{r['part']} {r['config']}: {r.get('error')}", file=sys.stderr)
    print(json.dumps(summarize(rows), indent=1))
    failed = [r["config"] for r in new if r.get("status") != "ok"]
    path = out_dir / f"{RESULT}.json"
    if args.publish and failed:
        print(publish.failure_line(PROG, failed, path), file=sys.stderr)
    elif args.publish:
        for p in publish.promote(out_dir, target):
            print(f"published {publish.display(p)}", file=sys.stderr)
    else:
        print(f"wrote {publish.display(path)}", file=sys.stderr)
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
