"""SGLang with ``--attention-backend mpfa`` on the GPU: what the SGLang backend issue must show, written to
``benchmarks/results/e2e_sglang_h200.json``.

    python -m benchmarks.e2e.sglang_check [--parts agreement,capacity,launch] [--out DIR]

Every configuration runs in its own child process (one ``sglang.Engine`` or server at a time, so a crash
or a hang in one cannot take the others down and each starts on a free GPU); its log goes to
``<out>/logs/``. Rows of the parts run now replace that part's rows in the existing file, so the parts can
run in separate calls. Parts:

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

from benchmarks import meta as bench_meta
from benchmarks import results_io
from benchmarks.stats import geomean

REPO = Path(__file__).resolve().parents[2]
RESULT = "e2e_sglang_h200"
PARTS = ("agreement", "capacity", "launch")
ALL_PARTS = PARTS + ("throughput", "soak", "tp")   # the last three: benchmarks.e2e.throughput
RECIPES = ("bf16", "qk8pv8", "qk4pv8")
SMOLLM2_DIR = REPO / "server_configs" / "models" / "smollm2-135m"
LLAMA_DIR = REPO / "server_configs" / "models" / "llama-3.1-8b"
DEFAULT_CONFIG = REPO / "server_configs" / "llama-3.1-8b-qk4pv8.yaml"
NUM_PROMPTS, NEW_TOKENS = 20, 64
# README columns (benchmarks.report): one row per server started
TABLE = [("part", "part", "{}"), ("configuration", "config", "{}"), ("prompts", "prompt_set", "{}"),
         ("model", "model", "{}"), ("status", "status", "{}"), ("max_total_num_tokens", "max_total_num_tokens", "{:,}"),
         ("startup s", "startup_s", "{:.0f}"), ("error", "error", "{}")]
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
        args["disable_prefill_cuda_graph"] = True   # mpfa captures decode graphs only (docs/sglang.md)
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


SCORER = "flashinfer-bf16-scoring"


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


# --- summary -------------------------------------------------------------------------------------------------------
def _agreement(ref: list[list[int]], ours: list[list[int]], n: int = NEW_TOKENS) -> float:
    total = sum(min(n, len(r)) for r in ref)
    same = sum(a == b for r, o in zip(ref, ours) for a, b in zip(r[:n], o[:n]))
    return same / total if total else float("nan")


def _agreement_by_set(rows: list[dict]) -> dict[str, dict]:
    """Per prompt set: agreement of each mpfa configuration with flashinfer, and the reference's own
    reproducibility (flashinfer's radix-cache pass against its first pass: the noise floor).

    Position-wise agreement (``greedy_agreement``, the issue's figure) counts every token after a first
    divergence as a miss, though the two runs then continue different texts. With the scorer's
    teacher-forced log-probabilities: ``teacher_forced_agreement`` = share of mpfa's tokens that are
    flashinfer's argmax given the same prefix; ``tie_aware_agreement`` = share within
    ``reference_max_logprob_gap``, the largest gap flashinfer's own greedy tokens (its decode path) show
    under its own prefill path, i.e. the near-ties the reference itself resolves either way."""
    out = {}
    for pset in dict.fromkeys(r.get("prompt_set", "stdlib") for r in rows if r["part"] == "agreement"):
        ok = {r["config"]: r for r in rows
              if r["part"] == "agreement" and r.get("status") == "ok" and r.get("prompt_set", "stdlib") == pset}
        ref = ok.get("flashinfer-bf16")
        if not ref:
            continue
        ref_off = ok.get("flashinfer-bf16-graphs-off")
        d = {"reference_self_agreement": _agreement(ref["output_ids"], ref["output_ids_cached_pass"]),
             "reference_graph_on_off_agreement": _agreement(ref["output_ids"], ref_off["output_ids"]) if ref_off else None,
             "greedy_agreement": {}, "greedy_agreement_graphs_off": {}, "cuda_graph_on_off_agreement": {},
             "radix_cache_pass_agreement": {}}
        for recipe in RECIPES:
            on, off = ok.get(f"mpfa-{recipe}-graphs-on"), ok.get(f"mpfa-{recipe}-graphs-off")
            if on:
                d["greedy_agreement"][recipe] = _agreement(ref["output_ids"], on["output_ids"])
                d["radix_cache_pass_agreement"][recipe] = _agreement(on["output_ids"], on["output_ids_cached_pass"])
            if off:
                d["greedy_agreement_graphs_off"][recipe] = _agreement(ref["output_ids"], off["output_ids"])
            if on and off:
                d["cuda_graph_on_off_agreement"][recipe] = _agreement(off["output_ids"], on["output_ids"])
        scorer = ok.get(SCORER)
        if scorer and "flashinfer-bf16" in scorer.get("logprob_gaps", {}):
            gaps = scorer["logprob_gaps"]
            noise = max((g for seq in gaps["flashinfer-bf16"] for g in seq[:NEW_TOKENS]), default=0.0)
            d["reference_max_logprob_gap"] = noise
            d["teacher_forced_agreement"], d["tie_aware_agreement"] = {}, {}
            for recipe in RECIPES:
                name = f"mpfa-{recipe}-graphs-on"
                if name in gaps:
                    flat = [g for seq in gaps[name] for g in seq[:NEW_TOKENS]]
                    d["teacher_forced_agreement"][recipe] = sum(g == 0 for g in flat) / len(flat)
                    d["tie_aware_agreement"][recipe] = sum(g <= noise for g in flat) / len(flat)
        out[pset] = {k: v for k, v in d.items() if v != {} and v is not None}
    return out


def summarize(rows: list[dict]) -> dict:
    """``greedy_agreement`` is the lowest over the prompt sets measured (each set's figures are kept)."""
    out: dict = {}
    by_set = _agreement_by_set(rows)
    if by_set:
        worst: dict = {}
        for d in by_set.values():
            for recipe, v in d.get("greedy_agreement", {}).items():
                worst[recipe] = min(v, worst.get(recipe, v))
        out["greedy_agreement"] = worst
        out["agreement_by_prompt_set"] = by_set
    pools = kv_pool_tokens(rows)
    base = pools.get("flashinfer-bf16")
    if base:
        ratios = {config: tokens / base for config, tokens in pools.items()}
        q4 = ratios.get("mpfa-qk4pv8")
        if q4 is not None:
            out["kv_capacity_ratio"] = q4
        out["kv_capacity_ratio_vs_flashinfer_bf16"] = ratios
    launch = [r for r in rows if r["part"] == "launch"]
    if launch:
        out["launch_command_serves_generate"] = all(r.get("status") == "ok" for r in launch)
    out.update(_throughput_summary(rows))
    return out


def kv_pool_tokens(rows: list[dict], model: str = "llama-3.1-8b") -> dict[str, int]:
    """max_total_num_tokens per configuration of ``model`` at TP 1 and the default memory fraction: from
    the capacity rows, overridden by the throughput rows (measured later, same server arguments), so a
    recipe whose format changed after the capacity run is counted as it serves now."""
    pools = {}
    for part in ("capacity", "throughput"):
        for r in rows:
            if (r["part"] == part and r.get("status") == "ok" and r.get("max_total_num_tokens")
                    and r.get("model", "llama-3.1-8b") == model and r.get("tp", 1) == 1
                    and r.get("mem_fraction_static", 0.85) == 0.85):
                pools[r["config"].replace("fp8_e4m3", "fp8")] = r["max_total_num_tokens"]
    return pools


def _label(model: str, *parts) -> str:
    """A summary key: ``<length>[/<config>]`` for Llama-3.1-8B (the issue's model), ``<model>/...`` otherwise."""
    return "/".join(str(p) for p in (parts if model == "llama-3.1-8b" else (model, *parts)))


def _throughput_summary(rows: list[dict]) -> dict:
    """Output-throughput ratios of mpfa qk4pv8 over SGLang + FlashInfer (BF16 and FP8 KV) per model and
    input length (TP 1), their geometric means for Llama-3.1-8B, TTFT at concurrency 1, soak and TP checks."""
    tput = {}
    for r in rows:
        if r["part"] == "throughput" and r.get("status") == "ok" and r.get("tp", 1) == 1 and r.get("output_throughput"):
            tput[(r["model"], r["input_len"], r["config"])] = r
    out: dict = {}
    for peer, key in (("flashinfer-bf16", "output_throughput_ratio_vs_flashinfer_bf16"),
                      ("flashinfer-fp8", "output_throughput_ratio_vs_flashinfer_fp8")):
        ratios = {}
        for (model, length, config), r in sorted(tput.items()):
            other = tput.get((model, length, peer))
            if config == "mpfa-qk4pv8" and other:
                ratios[_label(model, length)] = r["output_throughput"] / other["output_throughput"]
        if ratios:
            out[key] = ratios
            llama = [v for k, v in ratios.items() if "/" not in k]
            if llama:
                out[key + "_geomean"] = geomean(llama)
    ttft = {}
    for (model, length, config), r in sorted(tput.items()):
        other = tput.get((model, length, "flashinfer-bf16"))
        if config == "mpfa-qk4pv8" and other and r.get("ttft_concurrency1_s") and other.get("ttft_concurrency1_s"):
            ttft[_label(model, length)] = (
                r["ttft_concurrency1_s"] / other["ttft_concurrency1_s"])
    if ttft:
        out["ttft_concurrency1_ratio_vs_flashinfer_bf16"] = ttft
    # Where a run's wall time goes: SGLang runs prefill chunks and decode batches in turn, and N requests'
    # prefill takes about N x TTFT(c=1); the rest is decode (docs/sglang.md, "Where the time goes").
    split = {}
    for (model, length, config), r in sorted(tput.items()):
        if r.get("ttft_concurrency1_s") and r.get("wall_s") and r.get("requests"):
            prefill = r["requests"] * r["ttft_concurrency1_s"]
            split[_label(model, length, config)] = {"prefill_s": prefill, "decode_s": r["wall_s"] - prefill,
                            "prefill_share": prefill / r["wall_s"]}
    if split:
        out["wall_time_split_estimate"] = split
    soak = [r for r in rows if r["part"] == "soak"]
    if soak:
        out["soak_ok"] = all(r.get("status") == "ok" for r in soak)
    tp = [r for r in rows if r["part"] == "tp" and r.get("status") == "ok"]
    if tp:
        out["tp2_tp1_token_agreement"] = min(r["tp2_tp1_token_agreement"] for r in tp)
        # The greedy tokens of a random-weight model sit on near-ties, so flashinfer's own TP=2 run agrees only
        # partly with its TP=1 run; the continuous measure is the prompt log-probabilities' drift, set beside
        # flashinfer's (mpfa serves TP=2 correctly when its drift is no larger).
        drift = {}
        for k in ("mpfa", "flashinfer"):
            if all(f"{k}_tp2_vs_tp1_mean_logprob_diff" in r for r in tp):
                drift[k] = max(r[f"{k}_tp2_vs_tp1_mean_logprob_diff"] for r in tp)
        out["tp2_vs_tp1_mean_logprob_diff"] = drift
        if all("flashinfer_tp2_vs_tp1_token_agreement" in r for r in tp):
            out["tp2_tp1_token_agreement_flashinfer"] = min(r["flashinfer_tp2_vs_tp1_token_agreement"] for r in tp)
    return out


# --- main ----------------------------------------------------------------------------------------------------------
def _merge_key(r: dict) -> tuple:
    return r.get("part"), r.get("prompt_set"), r.get("group")


def merge_rows(previous: list[dict], new: list[dict]) -> list[dict]:
    """The file's rows after a run: what was measured again (same part and prompt set, or same group for
    the throughput rows) replaces its earlier rows; the rest stay."""
    fresh = {_merge_key(r) for r in new}
    kept = [r for r in previous if _merge_key(r) not in fresh]
    return sorted(kept + new, key=lambda r: ALL_PARTS.index(r["part"]))


def read_result(out_dir: Path) -> dict:
    """The results file in ``out_dir`` (meta and rows), or an empty one."""
    path = Path(out_dir) / f"{RESULT}.json"
    return results_io.read(path) if path.exists() else {"meta": {}, "summary": {}, "rows": []}


def with_calls(meta: dict, previous_meta: dict) -> dict:
    """``meta`` of this call plus ``calls``: every call whose rows the file keeps (command, commit, date),
    the earlier ones from ``previous_meta``, so rows merged from several calls keep their provenance."""
    calls = list(previous_meta.get("calls", []))
    if not calls and previous_meta.get("command"):
        calls = [{k: previous_meta.get(k) for k in ("command", "commit", "date", "parts")}]
    this = {k: meta.get(k) for k in ("command", "commit", "date", "parts")}
    return {**meta, "calls": calls + [this]}


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """Output throughput per input length and configuration (the throughput rows, TP 1), one plot per model
    in one figure's groups: ``<model> <length>``."""
    ok = [r for r in rows if r["part"] == "throughput" and r.get("status") == "ok" and r.get("tp", 1) == 1]
    if not ok:
        return []
    from benchmarks import plots
    from benchmarks.e2e.throughput import CONFIGS   # here: that module imports this one
    groups = sorted({(r["model"], r["input_len"]) for r in ok})
    configs = [c for c in CONFIGS if any(r["config"] == c for r in ok)]
    val = {(r["model"], r["input_len"], r["config"]): r["output_throughput"] for r in ok}

    def label(m, n):   # the headline ratio under each group, where both were measured
        b, q = val.get((m, n, "flashinfer-bf16")), val.get((m, n, "mpfa-qk4pv8"))
        return f"{m} {n:,} in" + (f"\nqk4pv8 {q / b:.2f}x bf16" if b and q else "")
    labels = [label(m, n) for m, n in groups]
    series = {c: [val.get((m, n, c)) for m, n in groups] for c in configs}
    return [plots.bar(labels, series, Path(out_dir) / f"{RESULT}.png", title="SGLang output throughput, H200, 1,024 output tokens",
                      ylabel="output tokens / s")]


def write_rows(previous_rows: list[dict], new_rows: list[dict], out_dir: Path, meta: dict) -> list[dict]:
    """Merge ``new_rows`` (each stamped with this call's commit) into the rows the file had when the run
    started, write it with the summary of the result, return the rows. Called after every configuration:
    a killed run keeps what finished."""
    for r in new_rows:
        r.setdefault("commit", meta.get("commit"))
    rows = merge_rows(previous_rows, new_rows)
    results_io.write(RESULT, meta, summarize(rows), rows, out_dir)
    try:
        plot(rows, out_dir)
    except RuntimeError as e:   # no matplotlib: the JSON is the result, the plot a view of it
        print(f"no plot: {e}", file=sys.stderr)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.sglang_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    ap.add_argument("--out", default=str(results_io.RESULTS_DIR), help="results folder (default: %(default)s)")
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

    from mpfa_jit import server_config
    mem_fraction = float(server_config.load(DEFAULT_CONFIG).sglang["mem-fraction-static"])
    out_dir = Path(args.out)
    graphs_off = not args.no_graphs_off
    recipes = [r for r in args.recipes.split(",") if r]
    if any(r not in RECIPES for r in recipes):
        ap.error(f"--recipes: choose from {', '.join(RECIPES)}, got {args.recipes!r}")
    n = sum(len(_configs(p, smollm2, mem_fraction, graphs_off, recipes)) + (p == "agreement") if p != "launch" else 1
            for p in parts)
    before = read_result(out_dir)
    previous = before["rows"]
    command = "python -m benchmarks.e2e.sglang_check " + " ".join(argv if argv is not None else sys.argv[1:])
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
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
