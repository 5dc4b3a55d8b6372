"""A/B of SGLang's default prefill CUDA graph under ``--attention-backend mpfa`` (issue 32 item 3).

    python -m benchmarks.e2e.prefill_graph_ab [--recipes qk4pv8[,bf16]] [--lengths 512,2048,8192,32768]
        [--repeats 3] [--new-tokens 32] [--tokens-model DIR] [--out DIR] [--port 30631]

For each recipe, two servers of the plain command (``python -m sglang.launch_server --model-path
server_configs/models/llama-3.1-8b --attention-backend mpfa --load-format dummy --skip-tokenizer-init``: no
page size, no prefill-graph flag; the plugin chooses both) differ only in mpfa's prefill-graph policy,
``MPFA_PREFILL_CUDA_GRAPH=1`` (SGLang 0.5.17's default "breakable" prefill graph kept) or ``=0`` (the plugin
turns it off: the configuration every measured run used). Each server, in the same order:

1. greedy tokens (temperature 0, ``--new-tokens``) of a fixed prompt set (GREEDY_LENGTHS), one request at a time;
2. time to first token at concurrency 1 (streamed ``/generate``, 4 new tokens) for each of ``--lengths``: one
   warmup request, then ``--repeats`` measured ones, every prompt new (no radix-cache hit) and the same in
   both servers.

The file ``<out>/prefill_graph_ab_h200.json`` has, per recipe: each server's startup time, the prefill-graph
backend and page size it reports (/server_info: whether the policy took), its TTFTs; per length the TTFT
medians on and off and their ratio on/off (below 1: the graph is faster); whether the greedy tokens are
identical (and where each prompt first differs); and ``keep_on`` (identical tokens and a geomean TTFT ratio
of at most 1.0: the condition for mpfa.sglang.settings.PREFILL_CUDA_GRAPH[recipe] = True; the published runs,
``benchmarks/results/studies/prefill_graph_ab*_h200.json``, one recipe each, are what a CPU test holds that table
to). Dummy weights make near-ties common, so different tokens there are a reason to look, not proof of an error:
``--tokens-model`` (a folder with real weights, e.g. server_configs/models/smollm2-135m after
``python -m benchmarks.e2e.smollm2_hf``) repeats the token check on it with two more servers.

``<out>`` defaults to ``benchmarks/results/scratch/prefill_graph_ab`` (git-ignored); never the published
folder. Server logs go to ``<out>/logs``. Time: one server start with dummy 8B weights ~60-90 s (the "on"
server also captures its prefill graphs), the requests ~30 s: ~4-5 min per recipe for both servers with
mpfa's kernels already built.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

from benchmarks import meta as bench_meta
from benchmarks import publish
from benchmarks.e2e.server import Server, server_env, server_info, stream_generate
from benchmarks.e2e.throughput import MODELS, inputs_of_lengths

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = publish.SCRATCH_DIR / "prefill_graph_ab"
PROG = "python -m benchmarks.e2e.prefill_graph_ab"
FILE = "prefill_graph_ab_h200.json"
PORT = 30631
LENGTHS = (512, 2048, 8192, 32768)   # the breakable graph captures chunks up to its max tokens: short ones matter most
GREEDY_LENGTHS = (37, 300, 1029, 2500, 6000)
TTFT_NEW_TOKENS = 4
MODES = {"on": "1", "off": "0"}      # MPFA_PREFILL_CUDA_GRAPH of each server


def plain_argv(model: Path, port: int, dummy: bool = True) -> list[str]:
    """The plain command (nothing about pages or prefill graphs) on ``port``."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--attention-backend", "mpfa",
            *(["--load-format", "dummy"] if dummy else []), "--skip-tokenizer-init", "--port", str(port)]


def vocab_size(model: Path) -> int:
    return json.loads((model / "config.json").read_text())["vocab_size"]


def ttft_prompts(lengths, repeats: int, vocab: int) -> dict[int, list[list[int]]]:
    """Per length: a warmup prompt and ``repeats`` measured ones, all different (no radix-cache hit), the same
    for every server (seeded by length)."""
    return {n: inputs_of_lengths([n] * (repeats + 1), vocab, seed=1000 + n) for n in lengths}


def greedy_prompts(vocab: int, model: Path) -> list[list[int]]:
    """GREEDY_LENGTHS prompts: synthetic ids with dummy weights; natural text where the model has a tokenizer
    and real weights (near-ties on noise would say little)."""
    if (model / "model.safetensors").exists():
        try:
            from transformers import AutoTokenizer

            from benchmarks.accuracy.data import stdlib_text
            ids = AutoTokenizer.from_pretrained(str(model))(stdlib_text(200_000), add_special_tokens=False).input_ids
            stride = (len(ids) - max(GREEDY_LENGTHS)) // len(GREEDY_LENGTHS)
            if stride > 0:
                return [ids[i * stride:i * stride + n] for i, n in enumerate(GREEDY_LENGTHS)]
        except Exception as e:   # fall back to synthetic ids, said in the output
            print(f"{PROG}: natural prompts unavailable ({type(e).__name__}: {e}); synthetic ids", file=sys.stderr)
    return inputs_of_lengths(GREEDY_LENGTHS, vocab, seed=7)


def _prefill_backend(info: dict):
    cfg = info.get("cuda_graph_config")
    if isinstance(cfg, dict):
        prefill = cfg.get("prefill")
        return prefill.get("backend") if isinstance(prefill, dict) else prefill
    return None


def _generate(port: int, ids: list[int], new_tokens: int) -> dict:
    res = stream_generate(port, ids, {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True})
    return {"ttft_s": res.ttft, "output_ids": res.output_ids, "error": res.error}


def run_server(model: Path, recipe: str, mode: str, *, port: int, logs: Path, greedy: list, ttft: dict | None,
               new_tokens: int, dummy: bool = True) -> dict:
    """One server: its facts, the greedy tokens of ``greedy``, the TTFTs of ``ttft`` (None: tokens only)."""
    env = server_env(MPFA_RECIPE=recipe, MPFA_PREFILL_CUDA_GRAPH=MODES[mode], HF_HUB_OFFLINE="1")
    log = logs / f"{model.name}-{recipe}-prefill-graph-{mode}.log"
    row: dict = {"recipe": recipe, "mode": mode, "model": model.name, "log": str(log)}
    try:
        with Server(plain_argv(model, port, dummy), env, log, port, startup_timeout=600) as server:
            info = server_info(server.base)
            row.update(startup_s=round(server.startup_s, 1), page_size=info.get("page_size"),
                       disable_prefill_cuda_graph=info.get("disable_prefill_cuda_graph"),
                       prefill_graph_backend=_prefill_backend(info))
            off = mode == "off"   # the policy took: the flag the plugin sets, and the backend SGLang derived from it
            row["policy_took"] = row["disable_prefill_cuda_graph"] is off and (
                row["prefill_graph_backend"] is None or (row["prefill_graph_backend"] == "disabled") == off)
            outs = [_generate(port, ids, new_tokens) for ids in greedy]
            row["greedy_output_ids"] = [o["output_ids"] for o in outs]
            row["errors"] = [o["error"] for o in outs if o["error"]]
            if ttft is not None:
                row["ttft_s"] = {}
                for n, prompts in ttft.items():
                    _generate(port, prompts[0], TTFT_NEW_TOKENS)                    # warmup
                    rs = [_generate(port, ids, TTFT_NEW_TOKENS) for ids in prompts[1:]]
                    row["errors"] += [r["error"] for r in rs if r["error"]]
                    row["ttft_s"][str(n)] = [r["ttft_s"] for r in rs]
                    med = statistics.median(t for t in row["ttft_s"][str(n)] if t is not None) \
                        if any(r["ttft_s"] is not None for r in rs) else None
                    print(f"  {recipe} prefill graph {mode}: {n} tokens TTFT median "
                          f"{'n/a' if med is None else f'{med * 1e3:.1f} ms'}", flush=True)
    except RuntimeError as e:   # the server did not start: the row says so, the other runs go on
        row["error"] = str(e)
    return row


def first_difference(a: list, b: list) -> int | None:
    """The first position where two token lists differ (the shorter length if one is a prefix), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(on: dict, off: dict) -> dict:
    """Tokens and TTFT of the two servers of one recipe."""
    out: dict = {}
    if "greedy_output_ids" in on and "greedy_output_ids" in off:
        diffs = [first_difference(a, b) for a, b in zip(on["greedy_output_ids"], off["greedy_output_ids"])]
        out["tokens_identical"] = all(d is None for d in diffs) and not on["errors"] and not off["errors"]
        out["first_difference"] = diffs
    medians = {}
    for n in (on.get("ttft_s") or {}):
        m = {}
        for mode, row in (("on", on), ("off", off)):
            ts = [t for t in (row.get("ttft_s") or {}).get(n, []) if t is not None]
            m[mode] = statistics.median(ts) if ts else None
        m["ratio_on_off"] = m["on"] / m["off"] if m["on"] and m["off"] else None
        medians[n] = m
    if medians:
        out["ttft_median_s"] = medians
        ratios = [m["ratio_on_off"] for m in medians.values() if m["ratio_on_off"]]
        if len(ratios) == len(medians):
            out["ttft_ratio_on_off_geomean"] = statistics.geometric_mean(ratios)
    out["policy_took"] = bool(on.get("policy_took")) and bool(off.get("policy_took"))
    if "tokens_identical" in out and "ttft_ratio_on_off_geomean" in out:
        out["keep_on"] = bool(out["tokens_identical"] and out["policy_took"] and out["ttft_ratio_on_off_geomean"] <= 1.0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", default="qk4pv8", help="comma-separated (default qk4pv8; bf16, qk8pv8 also served)")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="TTFT prompt lengths in tokens")
    ap.add_argument("--repeats", type=int, default=3, help="measured TTFT requests per length (after one warmup)")
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt of the token check")
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS), help="the timed servers' model (dummy)")
    ap.add_argument("--tokens-model", type=Path, default=None,
                    help="a model folder with real weights: two more servers per recipe repeat the token check on it")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results folder (default {DEFAULT_OUT.relative_to(REPO)})")
    ap.add_argument("--port", type=int, default=PORT)
    args = ap.parse_args(argv)
    out = args.out.resolve()
    if publish.is_published(out):
        print(f"{PROG}: error: --out {args.out} is in the published results folder; this A/B writes to scratch "
              "(the lead publishes)", file=sys.stderr)
        return 2
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    model = MODELS[args.model]
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    vocab = vocab_size(model)
    ttft, greedy = ttft_prompts(lengths, args.repeats, vocab), greedy_prompts(vocab, model)
    doc = {"meta": bench_meta.collect(" ".join([PROG] + list(argv if argv is not None else sys.argv[1:])),
                                      lengths=lengths, repeats=args.repeats, greedy_lengths=list(GREEDY_LENGTHS),
                                      new_tokens=args.new_tokens, model=args.model),
           "rows": [], "recipes": {}}
    for recipe in recipes:
        rows = {}
        for mode in ("off", "on"):
            print(f"{recipe}: server with prefill graph {mode}", flush=True)
            rows[mode] = run_server(model, recipe, mode, port=args.port, logs=logs, greedy=greedy, ttft=ttft,
                                    new_tokens=args.new_tokens)
            doc["rows"].append(rows[mode])
        doc["recipes"][recipe] = compare(rows["on"], rows["off"])
        if args.tokens_model is not None:
            tm = args.tokens_model.resolve()
            real = {mode: run_server(tm, recipe, mode, port=args.port, logs=logs, greedy=greedy_prompts(
                vocab_size(tm), tm), ttft=None, new_tokens=args.new_tokens,
                dummy=not (tm / "model.safetensors").exists()) for mode in ("off", "on")}
            doc["rows"] += list(real.values())
            doc["recipes"][recipe]["tokens_model"] = {"model": tm.name, **compare(real["on"], real["off"])}
        (out / FILE).write_text(json.dumps(doc, indent=1) + "\n")   # after each recipe: a later failure keeps it
    summary = {r: {k: v for k, v in c.items() if k in ("tokens_identical", "ttft_ratio_on_off_geomean", "keep_on",
                                                      "policy_took")} for r, c in doc["recipes"].items()}
    doc["summary"] = summary
    (out / FILE).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {out / FILE}")
    failed = [r for r in doc["rows"] if r.get("error") or r.get("errors")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
