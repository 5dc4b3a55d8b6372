"""SGLang end to end at long context: throughput of ``--attention-backend mpfa`` against SGLang's fa3 and FlashInfer.

    python -m benchmarks.e2e.throughput --input-len 32768 [--model llama-3.1-8b] [--configs ...] [--requests N]
    python -m benchmarks.e2e.throughput --input-len 65536 --weights fp8 --configs sglang-fa3-bf16,sglang-fa3-fp8kv,mpfa-qk4pv8
    python -m benchmarks.e2e.throughput --workload mixed [--output-len 1024] [--configs ...] [--requests N]
    python -m benchmarks.e2e.throughput --soak [--soak-requests 200]     # mixed lengths, cancellations
    python -m benchmarks.e2e.throughput --tp-check [--tp-recipes bf16,qk4pv8]  # TP=2 vs TP=1 (2 GPUs, saved model)

Each configuration is one SGLang server (``python -m sglang.launch_server``, dummy weights, page size 16,
``--mem-fraction-static`` of the default server config, SGLang's default chunked prefill) serving the
same input_ids: ``sglang-fa3-bf16`` and ``sglang-fa3-fp8kv`` (``--kv-cache-dtype fp8_e4m3``) are SGLang's fa3
backend (its default for these models on Hopper; sglang-kernel's FA3 library), ``flashinfer-bf16`` and
``flashinfer-fp8`` its FlashInfer backend, ``mpfa-<recipe>`` ours (the prefill CUDA graph as the plugin decides
for the plain command). ``--weights fp8`` serves every configuration with SGLang's ``--quantization fp8``
linear layers (rows of their own: ``quantization``, group ``.../w<fp8>``). A streaming client sends every request at once (or at most
``--concurrency``) with ``ignore_eos`` and records, per configuration: output and total throughput (tokens
per second of wall time from the first request sent to the last token received), time to first token and
inter-token latency (mean, p50, p99), ``max_total_num_tokens`` from the server, errors, and for mpfa the
content-hashed names of the kernels its server loads (``mpfa_kernels``: which build a row measured). Unless
``--no-ttft-probe``, one more request then runs alone, generating ``--output-len`` tokens (at least 128):
TTFT and inter-token latency (mean, p50, p99) at concurrency 1.

``--workload fixed`` (the default) sends prompts of exactly ``--input-len`` tokens. ``--workload mixed`` sends
short and long prompts together, as a long-context server sees them (``MIXED_LENGTHS``: one in five of 32K
tokens up to the model's positions less ``--output-len``, the rest 1K-8K; seeded, the same every run); its
rows (``workload: "mixed"``, group ``<model>/mixed/...``) add TTFT of the short and the long prompts apart,
and it has no concurrency-1 probe (no one input length for it to stand for).

Input lengths are exact token counts; input + output must fit the model's positions, so "128K" with 1,024
output tokens is ``--input-len 130048`` for Llama-3.1-8B (131,072 positions). Several lengths
(``--input-len 32768,65536,130048 --requests 56,29,15``) run one after another on one server per configuration,
its context long enough for the longest, the radix cache flushed before each load (prompts of one seed share
prefixes across lengths): one server start per configuration instead of one per length (~1-4 minutes each).
Each length is a row of its own, as a run of that length alone writes it, plus ``server_lengths`` (the lengths
its server ran, in order).

``--requests auto`` sends enough requests to fill the largest pool of all configurations twice (``--fills``;
from ``max_total_num_tokens`` rows already in the results file, else from the recipes' bytes per token),
counting prompt + output tokens of every request (the mixed list: whole blocks of five).
Queues of configurations can share a host, one GPU each (``CUDA_VISIBLE_DEVICES``, ``--port``, see
``benchmarks/e2e/queue.sh``); ``python -m benchmarks.e2e.merge_results`` folds their files into one.
Rows go to ``<out>/e2e_sglang_h200.json`` (part ``throughput`` / ``soak`` / ``tp``), replacing earlier rows
of the same configuration and length (or workload); the summary is ``benchmarks.e2e.results``'. ``<out>`` is
``benchmarks/results/scratch`` (git-ignored; the file starts as a copy of the published one) unless ``--publish``:
then ``benchmarks/results`` (or ``--out``), and only from a run on a GPU machine with SGLang whose GPU is the one
the published file names, all of whose servers succeeded; until then the run's file, plot and server logs stay
in a folder under scratch, which a failed run names (``benchmarks/publish.py``).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from benchmarks import cli
from benchmarks import meta as bench_meta
from benchmarks import publish, results_io
from benchmarks.e2e import results as e2e_results
from benchmarks.e2e.results import CONFIGS
from benchmarks.e2e.server import Server, flush_radix_cache, server_env, server_info, stream_generate
from mpfa.recipes import get_recipe
from mpfa.sglang.kernels import server_kernel_specs
from mpfa.sglang.model import check_hf_config, read_hf_config
from mpfa_jit.errors import MpfaJitError
from mpfa_jit.ops.decode import RECIPES

REPO = Path(__file__).resolve().parents[2]
MODELS = {"llama-3.1-8b": REPO / "server_configs/models/llama-3.1-8b",
          "qwen3-14b": REPO / "server_configs/models/qwen3-14b"}
BYTES_PER_TOKEN_HEAD_D128 = {"sglang-fa3-bf16": 512, "sglang-fa3-fp8kv": 256, "flashinfer-bf16": 512, "flashinfer-fp8": 256,
                             **{f"mpfa-{r}": get_recipe(r).bytes_per_token_head(128) for r in RECIPES}}
PORT = 30611
PAGE_SIZE = 16                   # every configuration's --page-size
WORKLOADS = ("fixed", "mixed")   # --workload: every prompt --input-len tokens, or MIXED_LENGTHS
PROBE_MIN_OUTPUT = 128           # tokens the concurrency-1 probe generates at least: its ITL averages this many gaps
PROG = "python -m benchmarks.e2e.throughput"


@dataclass(frozen=True)
class LengthMix:
    """Prompt lengths of ``--workload mixed``: the requests come in blocks of ``block``, ``long_per_block``
    of them long (at seeded places in the block), the rest short; each length log-uniform within its class.
    Long prompts run from ``long_min`` to the model's positions less the output tokens."""
    short_min: int
    short_max: int
    long_min: int
    block: int
    long_per_block: int

    def is_long(self, length: int) -> bool:
        """Whether a prompt of ``length`` tokens is of the long class."""
        return length >= self.long_min


# A long-context server's traffic: mostly chat and retrieval turns of a few thousand tokens, with a minority
# of whole-document prompts up to the context limit. One long prompt in every five requests keeps both kinds
# in flight together (long prompts' prefill chunks run between short requests' decode steps: what a short
# request's TTFT and ITL suffer from), whole blocks keep that share exact at any request count, and
# log-uniform draws spread each class over its range instead of piling it at the top.
MIXED_LENGTHS = LengthMix(short_min=1024, short_max=8192, long_min=32768, block=5, long_per_block=1)
MIXED_SEED = 0


def config_backend(config: str) -> str:
    """SGLang's --attention-backend of a configuration."""
    return "mpfa" if config.startswith("mpfa-") else ("fa3" if config in e2e_results.FA3_PEERS else "flashinfer")


def server_argv(config: str, model: str, *, context_length: int, mem_fraction: float, tp: int, port: int,
                model_path: Path | None = None, dummy: bool = True, weights: str | None = None,
                log_level: str | None = "warning") -> tuple[list, dict]:
    """(argv, extra environment) of one configuration's server; ``weights``: SGLang's --quantization (None: the
    checkpoint's BF16 weights); ``log_level``: SGLang's --log-level (None: its default, which logs every batch)."""
    backend = config_backend(config)
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path or MODELS[model]),
            *(["--load-format", "dummy"] if dummy else []), "--skip-tokenizer-init", "--attention-backend", backend, "--page-size", str(PAGE_SIZE), "--context-length",
            str(context_length), "--mem-fraction-static", str(mem_fraction), "--tp-size", str(tp), "--port", str(port),
            "--random-seed", "0", *(["--log-level", log_level] if log_level else [])]
    env = {}
    if weights:
        argv += ["--quantization", weights]
    if config in ("flashinfer-fp8", "sglang-fa3-fp8kv"):
        argv += ["--kv-cache-dtype", "fp8_e4m3"]
    if backend == "mpfa":   # the prefill CUDA graph: as the plugin decides for the plain command (docs/sglang.md)
        env["MPFA_RECIPE"] = config.split("-", 1)[1]
    return argv, env


def inputs_of_lengths(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    """One prompt of random token ids per length, the same for every configuration (dummy weights: any ids
    are valid input)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(n)] for n in lengths]


def make_inputs(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens (inputs_of_lengths)."""
    return inputs_of_lengths([length] * n, vocab, seed)


def requests_to_fill(pool_tokens: dict[str, int], configs, input_len: int, output_len: int, fills: float = 2.0) -> int:
    largest = max(pool_tokens[c] for c in configs)
    return max(1, math.ceil(fills * largest / (input_len + output_len)))


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, max(lo, int(math.exp(rng.uniform(math.log(lo), math.log(hi))))))


def mixed_length_stream(long_max: int, mix: LengthMix = MIXED_LENGTHS, seed: int = MIXED_SEED) -> Iterator[int]:
    """The mixed workload's prompt lengths, block after block, without end: the first n are the lengths of
    n requests, so a longer run sends a shorter run's prompts and more. The draws do not depend on
    ``long_max`` (only the long lengths' range does): models of different limits get the same short prompts."""
    if long_max < mix.long_min:
        raise ValueError(f"long prompts need at least {mix.long_min} tokens, the model leaves {long_max}")
    rng = random.Random(seed)
    while True:
        long_places = set(rng.sample(range(mix.block), mix.long_per_block))
        for i in range(mix.block):
            lo, hi = (mix.long_min, long_max) if i in long_places else (mix.short_min, mix.short_max)
            yield _log_uniform(rng, lo, hi)


def mixed_prompt_lengths(n: int, long_max: int, mix: LengthMix = MIXED_LENGTHS) -> list[int]:
    """The prompt lengths of ``n`` mixed requests (mixed_length_stream)."""
    return list(itertools.islice(mixed_length_stream(long_max, mix), n))


def mixed_requests_to_fill(pool_tokens: dict[str, int], configs, long_max: int, output_len: int,
                           fills: float = 2.0, mix: LengthMix = MIXED_LENGTHS) -> int:
    """The fewest whole blocks of mixed requests whose prompt and output tokens fill the largest pool of
    ``configs`` ``fills`` times (requests_to_fill's rule, over the mixed list's own lengths)."""
    target = fills * max(pool_tokens[c] for c in configs)
    total = 0
    for n, length in enumerate(mixed_length_stream(long_max, mix), 1):
        total += length + output_len
        if total >= target and n % mix.block == 0:
            return n
    raise AssertionError("mixed_length_stream never ends")


def server_context_length(longest_prompt: int, longest_output: int, max_pos: int) -> int:
    """--context-length of the servers: the longest request and a margin, at least 4096, at most the model's."""
    return min(max_pos, max(longest_prompt + longest_output + 64, 4096))


def probe_output_len(input_len: int, output_len: int, max_pos: int) -> int:
    """Output tokens of the concurrency-1 probe: the run's, or PROBE_MIN_OUTPUT where that is more (a
    stable ITL), within the model's positions."""
    return min(max(output_len, PROBE_MIN_OUTPUT), max_pos - input_len)


def model_config(model: str) -> dict:
    """The model's config.json (server_configs/models/<model>)."""
    return json.loads((MODELS[model] / "config.json").read_text())


def _head_dim(c: dict) -> int:
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def weight_bytes(model: str) -> int:
    """BF16 bytes of a decoder's weights from its config.json (embeddings, attention, gated MLP, head)."""
    c = model_config(model)
    h, layers, inter, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    d = _head_dim(c)
    attn = h * d * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    params = layers * (attn + 3 * h * inter) + vocab * h * (1 if c.get("tie_word_embeddings") else 2)
    return 2 * params


def bf16_kv_bytes_per_token(model: str) -> int:
    """Bytes of a BF16 KV cache per token, all layers and KV heads."""
    c = model_config(model)
    return c["num_hidden_layers"] * c["num_key_value_heads"] * 2 * 2 * _head_dim(c)


def estimated_pool_tokens(rows: list[dict], model: str, configs) -> dict[str, int]:
    """max_total_num_tokens per configuration: measured (capacity / throughput rows of this model) or,
    where missing, flashinfer-bf16's scaled by the bytes-per-token ratio. A model with no measured
    flashinfer-bf16 pool gets one from another model's: the same KV bytes, less the extra weight bytes
    (same GPU and memory fraction; an estimate for choosing the request count, never a reported figure)."""
    measured = e2e_results.kv_pool_tokens(rows, model)
    base = measured.get("flashinfer-bf16")
    if base is None:
        for other in (m for m in MODELS if m != model):
            ref = e2e_results.kv_pool_tokens(rows, other).get("flashinfer-bf16")
            if ref:
                kv = ref * bf16_kv_bytes_per_token(other) - (weight_bytes(model) - weight_bytes(other))
                base = int(kv // bf16_kv_bytes_per_token(model))
                break
    if base is None:
        raise ValueError(f"no measured max_total_num_tokens for {model} flashinfer-bf16 in the results: pass "
                         "--requests N, or run benchmarks.e2e.sglang_check --parts capacity first")
    return {c: measured.get(c, int(base * 512 / BYTES_PER_TOKEN_HEAD_D128[c])) for c in configs}


def percentile(values, q):
    from benchmarks.stats import percentile as p
    return p(values, q) if values else None


def mean_p50_p99(values) -> dict[str, float | None]:
    """{"mean", "p50", "p99"} of ``values`` (None each when there are none)."""
    return {"mean": sum(values) / len(values) if values else None, "p50": percentile(values, 50),
            "p99": percentile(values, 99)}


def ttft_stats_s(results) -> dict[str, float | None]:
    """Time to first token of the requests that got one, in seconds (mean_p50_p99)."""
    return mean_p50_p99([r.ttft for r in results if r.ttft is not None])


def itl_stats_ms(results) -> dict[str, float | None]:
    """Inter-token latency over every streamed token of ``results``, in ms (mean_p50_p99 of StreamResult.itls)."""
    return mean_p50_p99([1e3 * x for r in results for x in r.itls()])


def named(prefix: str, stats: dict, unit: str) -> dict:
    """Row fields of ``stats``: ``{prefix}_{stat}_{unit}``, e.g. itl_p99_ms."""
    return {f"{prefix}_{k}_{unit}": v for k, v in stats.items()}


def summarize_run(results, wall_s: float, input_lens) -> dict:
    """The load's row fields; ``input_lens`` are the requests' prompt lengths, in the order of ``results``."""
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(n for r, n in zip(results, input_lens, strict=True) if r.error is None)
    return {
        "requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if r.error), None),
        "output_tokens": out_tokens, "wall_s": wall_s,
        "output_throughput": out_tokens / wall_s if wall_s > 0 else None,
        "total_throughput": (out_tokens + in_tokens) / wall_s if wall_s > 0 else None,
        **named("ttft", ttft_stats_s(ok), "s"), **named("itl", itl_stats_ms(ok), "ms"),
    }


def ttft_by_length_class(results, input_lens, mix: LengthMix = MIXED_LENGTHS) -> dict:
    """TTFT of the short and the long prompts apart (ttft_short_p50_s, ...): a short request's first token
    waits behind long prompts' prefill, which one TTFT over both would hide."""
    out = {}
    for name, is_class in (("short", lambda n: not mix.is_long(n)), ("long", mix.is_long)):
        done = [r for r, n in zip(results, input_lens, strict=True) if is_class(n) and r.error is None]
        out.update(named(f"ttft_{name}", ttft_stats_s(done), "s"))
    return out


def run_load(port: int, inputs, output_len: int, concurrency: int | None):
    sp = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency or len(inputs)) as pool:
        results = list(pool.map(lambda ids: stream_generate(port, ids, sp), inputs))
    return results, time.perf_counter() - t0


def run_probe(port: int, probe_input: list[int], output_len: int) -> dict:
    """TTFT and inter-token latency of one request alone (concurrency 1): what a lone user sees."""
    (r,), _ = run_load(port, [probe_input], output_len, 1)
    return {"ttft_concurrency1_s": r.ttft, "probe_output_tokens": r.output_tokens,
            **named("itl_concurrency1", itl_stats_ms([r]), "ms"), **({"probe_error": r.error} if r.error else {})}


def workload_label(args) -> str:
    """What the run sent, in log names: the input length (fixed) or ``mixed``."""
    return str(args.input_len) if args.workload == "fixed" else "mixed"


def workload_title(args) -> str:
    """What the run sends, for the progress bar: ``32K`` or ``mixed``."""
    return f"{args.input_len // 1024}K" if args.workload == "fixed" else "mixed"


def workload_fields(args, config: str, input_lens: list[int]) -> dict:
    """The row fields naming what a configuration was sent. ``group`` is what the results file replaces rows
    by: fixed rows keep theirs (``<model>/in<length>/...``), mixed rows get ``<model>/mixed/...``, so a
    mixed run never replaces a fixed-length row nor the other way round."""
    tail = f"out{args.output_len}/tp{args.tp}/{config}" + (f"/w{args.weights}" if args.weights else "")
    if args.workload == "fixed":
        return {"workload": "fixed", "input_len": args.input_len, "group": f"{args.model}/in{args.input_len}/{tail}"}
    n_long = sum(map(MIXED_LENGTHS.is_long, input_lens))
    return {"workload": "mixed", "input_lens": input_lens, "length_mix": dataclasses.asdict(MIXED_LENGTHS),
            "length_seed": MIXED_SEED, "input_tokens": sum(input_lens),
            "short_requests": len(input_lens) - n_long, "long_requests": n_long,
            "group": f"{args.model}/mixed/{tail}"}


def mpfa_kernel_builds(config: str, model: str, tp: int) -> list[str] | None:
    """The content-hashed names (``KernelSpec.uri``: source, headers, flags, nvcc) of the kernels an mpfa
    configuration's server loads, so a row says which build it measured whatever commit it ran at; None for
    FlashInfer configurations, or where the GPU's arch (MPFA_CUDA_ARCH, else nvidia-smi) or nvcc (the hash
    includes its version) cannot be had."""
    if not config.startswith("mpfa-"):
        return None
    arch = os.environ.get("MPFA_CUDA_ARCH") or bench_meta.gpu_arch()
    if arch is None:
        return None
    recipe = config.split("-", 1)[1]
    facts = check_hf_config(read_hf_config(MODELS[model]), page_size=PAGE_SIZE, recipe=recipe, tp_size=tp,
                            where=str(MODELS[model] / "config.json"))
    try:
        specs = server_kernel_specs(num_qo_heads=facts["num_qo_heads"], num_kv_heads=facts["num_kv_heads"],
                                    head_dim=facts["head_dim"], recipe=recipe, page_size=PAGE_SIZE, arch=arch)
        return [s.uri() for s in specs]
    except MpfaJitError:
        return None


def mpfa_host_source() -> str:
    """sha256 (12 hex digits) of the Python an mpfa server runs around its kernels (the ``mpfa`` and ``mpfa_jit``
    packages' .py files: planning, the SGLang plugin, the wrappers), so two rows of the same kernels but other
    host code are not taken for one build."""
    import hashlib

    import mpfa
    import mpfa_jit
    h = hashlib.sha256()
    for pkg in (mpfa, mpfa_jit):
        root = Path(pkg.__file__).parent
        for path in sorted(root.rglob("*.py")):
            h.update(f"{pkg.__name__}/{path.relative_to(root).as_posix()}\0".encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:12]


@dataclass
class Load:
    """One load a configuration's server runs: ``args`` as a run of that load alone would have them (its
    ``input_len`` and ``requests``), its prompts, and the concurrency-1 probe's prompt and output (None, 0: none)."""
    args: object
    inputs: list
    probe_input: list | None
    probe_output: int


def run_config(config: str, loads: list[Load], context: int, log_dir: Path, bar, on_load=None) -> list[dict]:
    """One configuration's server under each load in turn (and each load's concurrency-1 probe where it has one):
    a row per load. ``on_load(rows)`` gets the finished rows after each load, so a caller can keep them before
    the server's later loads run (a device call that ends mid-configuration loses only the load it was in)."""
    args = loads[0].args
    argv, env_extra = server_argv(config, args.model, context_length=context, mem_fraction=args.mem_fraction,
                                  tp=args.tp, port=args.port, weights=args.weights)
    env = server_env(**env_extra, HF_HUB_OFFLINE="1")
    builds = mpfa_kernel_builds(config, args.model, args.tp)   # before the server: a failure here costs no GPU time
    host_source = mpfa_host_source() if builds else None
    lengths = [ld.args.input_len for ld in loads]
    rows = []
    for load in loads:
        a, input_lens = load.args, [len(x) for x in load.inputs]
        rows.append({"part": "throughput", "model": a.model, "config": config, **workload_fields(a, config, input_lens),
                     **({"quantization": a.weights} if a.weights else {}),
                     "output_len": a.output_len, "tp": a.tp, "mem_fraction_static": a.mem_fraction,
                     "concurrency": a.concurrency or len(load.inputs),
                     "requests_arg": a.requests, "fills": a.fills if a.requests == "auto" else None,
                     # which GPU of the host, so runs of parallel queues (one GPU each) say so
                     "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "context_length": context,
                     **({"server_lengths": lengths} if len(loads) > 1 else {}),
                     **({"mpfa_kernels": builds, "mpfa_host_source": host_source} if builds else {})})
    label = "-".join(workload_label(ld.args) for ld in loads)
    t0 = time.perf_counter()
    done = 0
    t_load = t0
    try:
        with Server(argv, env, log_dir / f"throughput-{args.model}-{label}-{config}.log", args.port) as srv:
            pool = server_info(srv.base).get("max_total_num_tokens")
            for row in rows:
                row.update(startup_s=round(srv.startup_s, 1), max_total_num_tokens=pool)
            for i, (load, row) in enumerate(zip(loads, rows)):
                if i:
                    t_load = time.perf_counter()
                    flush_radix_cache(srv.base)
                bar.set_description(f"{config} {workload_title(load.args)}: {len(load.inputs)} requests")
                results, wall = run_load(args.port, load.inputs, load.args.output_len, load.args.concurrency)
                row.update(summarize_run(results, wall, [len(x) for x in load.inputs]))
                if load.args.workload == "mixed":
                    row.update(ttft_by_length_class(results, [len(x) for x in load.inputs]))
                if load.probe_input is not None:   # a request none of the others shares a prefix with: no radix hit
                    row.update(run_probe(args.port, load.probe_input, load.probe_output))
                row["server_alive"] = srv.alive()
                row["status"] = "ok" if row["errors"] == 0 else "error"
                # a load's own time; the first load's includes the server's start, as a run of that load alone would
                row["seconds"] = round(time.perf_counter() - t_load, 1)
                done += 1
                bar.update(1)
                if on_load:
                    on_load(rows[:done])
        if done:   # and the last one the server's stop, as a run of it alone would
            rows[done - 1]["seconds"] = round(time.perf_counter() - t_load, 1)
    except Exception as e:
        for j, row in enumerate(rows[done:]):
            # the load that failed: its own time; those never run: none
            row.update(status="error", error=f"{type(e).__name__}: {e}",
                       seconds=round(time.perf_counter() - t_load, 1) if j == 0 else None)
            bar.update(1)
    return rows


def run_soak(args, log_dir: Path) -> dict:
    """200 mixed requests (1 to 100K tokens) at once, every 7th cancelled after a few chunks, against the
    default mpfa server; then the server must still answer a generate."""
    rng = random.Random(1)
    lengths = [max(1, int(math.exp(rng.uniform(0, math.log(100_000))))) for _ in range(args.soak_requests)]
    lengths[0] = 100_000                                        # the 100K-token request
    argv, env_extra = server_argv("mpfa-qk4pv8", args.model, context_length=131072, mem_fraction=args.mem_fraction,
                                  tp=args.tp, port=args.port)
    env = server_env(**env_extra, HF_HUB_OFFLINE="1")
    row = {"part": "soak", "model": args.model, "config": "mpfa-qk4pv8", "requests": len(lengths),
           "group": f"soak/{args.model}"}
    t0 = time.perf_counter()
    log = log_dir / f"soak-{args.model}.log"
    try:
        from tqdm import tqdm
        with Server(argv, env, log, args.port) as srv, tqdm(total=len(lengths), desc="soak", unit="req", file=sys.stderr) as bar:
            inputs = [[rng.randrange(100, 30000) for _ in range(n)] for n in lengths]
            outs = [rng.choice((1, 16, 256)) for _ in lengths]

            def one(i):
                cancel = 3 if i % 7 == 3 else None
                r = stream_generate(args.port, inputs[i], {"max_new_tokens": outs[i], "temperature": 0.0, "ignore_eos": True},
                                    cancel_after_chunks=cancel)
                bar.update(1)
                return r
            with ThreadPoolExecutor(max_workers=64) as pool:
                results = list(pool.map(one, range(len(lengths))))
            errors = [r.error for r in results if r.error]
            finished = [r for r, n in zip(results, outs) if not r.cancelled and r.error is None]
            long_req = results[0]
            row.update(completed=len(finished), cancelled=sum(r.cancelled for r in results), errors=len(errors),
                       first_errors=errors[:3], wrong_lengths=sum(r.output_tokens != n for r, n in zip(results, outs)
                                                                   if not r.cancelled and r.error is None),
                       long_request_tokens=lengths[0], long_request_completed=long_req.error is None
                       and long_req.output_tokens == outs[0], long_request_ttft_s=long_req.ttft)
            after = stream_generate(args.port, [11, 12, 13, 14], {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True})
            row["answers_after"] = after.error is None and after.output_tokens == 8
            row["server_alive"] = srv.alive()
        row["status"] = "ok" if (row["errors"] == 0 and row["wrong_lengths"] == 0 and row["answers_after"]
                                 and row["long_request_completed"]) else "error"
    except Exception as e:
        row.update(status="error", error=f"{type(e).__name__}: {e}")
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


TP_MODEL_LAYERS, TP_MODEL_VOCAB = 4, 32000


def write_tp_model(out: Path, seed: int = 0) -> Path:
    """A Llama-3.1-8B-shaped model cut to 4 layers (32 query / 8 KV heads, head_dim 128: 16 / 4 per GPU at
    TP=2) with seeded random weights saved to disk, so TP=1 and TP=2 load the same weights (SGLang's dummy
    init fills each rank's shard from the same seed: different models)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = model_config("llama-3.1-8b")
    cfg.update(num_hidden_layers=TP_MODEL_LAYERS, vocab_size=TP_MODEL_VOCAB, torch_dtype="bfloat16",
               tie_word_embeddings=False)
    for k in ("bos_token_id", "eos_token_id"):
        cfg[k] = 1 if k == "bos_token_id" else 2
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"}))
    model.to(torch.bfloat16).save_pretrained(str(out))
    return out


def _prompt_logprobs(port: int, inputs, new_tokens: int) -> tuple[list, list]:
    from benchmarks.e2e.server import http_json
    res = http_json(f"http://127.0.0.1:{port}/generate", {
        "input_ids": inputs, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True, "logprob_start_len": 0}, timeout=600)
    lps = [[lp for lp, *_ in r["meta_info"]["input_token_logprobs"] if lp is not None] for r in res]
    return lps, [r["output_ids"] for r in res]


def run_tp_check(args, log_dir: Path) -> list[dict]:
    """TP=2 against TP=1 on one saved model (write_tp_model), for SGLang's flashinfer backend and each mpfa recipe of
    ``--tp-recipes``: the prompt tokens' log-probabilities (a continuous output: no greedy near-ties) and the greedy
    tokens. mpfa serves TP=2 correctly when its TP=2-vs-TP=1 drift is that of flashinfer. One row per recipe, each
    with flashinfer's figures (measured once per call)."""
    model_dir = write_tp_model(Path(args.tp_model_dir))
    inputs = make_inputs(8, 1024, TP_MODEL_VOCAB, seed=2)
    configs = ["flashinfer-bf16", *(f"mpfa-{r}" for r in args.tp_recipes)]
    rows = {c: {"part": "tp", "model": "llama-3.1-8b-4layers-random", "config": c, "group": f"tp/llama-4l/{c}"}
            for c in configs[1:]}
    t0 = time.perf_counter()
    got = {}

    def drift(a, b):
        d = [abs(x - y) for la, lb in zip(a[0], b[0]) for x, y in zip(la, lb)]
        same = sum(x == y for oa, ob in zip(a[1], b[1]) for x, y in zip(oa, ob))
        return max(d), sum(d) / len(d), same / sum(len(o) for o in a[1])

    for config in configs:
        try:
            for tp in (1, 2):
                argv, env_extra = server_argv(config, args.model, context_length=4096, mem_fraction=0.5, tp=tp,
                                              port=args.port, model_path=model_dir, dummy=False)
                env = server_env(**env_extra, HF_HUB_OFFLINE="1")
                with Server(argv, env, log_dir / f"tp{tp}-{config}.log", args.port):
                    got[(config, tp)] = _prompt_logprobs(args.port, inputs, 16)
        except Exception as e:
            for c in (configs[1:] if config == configs[0] else [config]):   # flashinfer failed: no row has its control
                rows[c].update(status="error", error=f"{config}: {type(e).__name__}: {e}")
            if config == configs[0]:
                break
    for config, row in rows.items():
        if row.get("status") == "error":
            continue
        for c, key in (("flashinfer-bf16", "flashinfer"), (config, "mpfa")):
            mx, mean, agree = drift(got[(c, 1)], got[(c, 2)])
            row.update({f"{key}_tp2_vs_tp1_max_logprob_diff": mx, f"{key}_tp2_vs_tp1_mean_logprob_diff": mean,
                        f"{key}_tp2_vs_tp1_token_agreement": agree})
        mx, mean, agree = drift(got[("flashinfer-bf16", 2)], got[(config, 2)])
        row.update(mpfa_vs_flashinfer_tp2_mean_logprob_diff=mean, mpfa_vs_flashinfer_tp2_token_agreement=agree,
                   tp2_tp1_token_agreement=row["mpfa_tp2_vs_tp1_token_agreement"], status="ok")
    seconds = round(time.perf_counter() - t0, 1)
    return [{**row, "seconds": seconds} for row in rows.values()]


def run_meta(command: str, parts, previous_meta: dict) -> dict:
    """This run's meta with the calls whose rows the file already holds (results.with_calls)."""
    return e2e_results.with_calls(bench_meta.collect(command, parts=list(parts)), previous_meta)


def parse_args(argv):
    """(parser, arguments); the parser reports errors of the checks that need the model's config."""
    ap = cli.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="llama-3.1-8b")
    ap.add_argument("--workload", choices=WORKLOADS, default="fixed",
                    help="fixed: every prompt --input-len tokens; mixed: short and long prompts together "
                         f"({MIXED_LENGTHS.long_per_block} in {MIXED_LENGTHS.block} of {MIXED_LENGTHS.long_min} "
                         f"tokens up to the model's limit less --output-len, the rest {MIXED_LENGTHS.short_min}-"
                         f"{MIXED_LENGTHS.short_max}; default %(default)s)")
    ap.add_argument("--input-len", default=None,
                    help="prompt tokens of --workload fixed, or several comma-separated, run one after another on "
                         "one server per configuration (default 32768)")
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}")
    ap.add_argument("--requests", default="auto",
                    help="number of requests, or 'auto' (fill the largest pool --fills times); with several "
                         "--input-len, one for each (comma-separated) or one for all")
    ap.add_argument("--fills", type=float, default=2.0, help="pool fills for --requests auto (default 2, the issue's)")
    ap.add_argument("--concurrency", type=int, default=None, help="at most this many requests in flight (default all)")
    ap.add_argument("--no-ttft-probe", dest="ttft_probe", action="store_false",
                    help="skip the lone request after the load (TTFT and ITL at concurrency 1; fixed workload only)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--weights", choices=[e2e_results.FP8_WEIGHTS], default=None,
                    help="serve the linear layers quantized (SGLang's --quantization, every configuration; "
                         "default: the model's BF16 weights)")
    ap.add_argument("--mem-fraction", type=float, default=0.85)
    ap.add_argument("--soak", action="store_true", help="run the soak instead (mixed lengths, cancellations)")
    ap.add_argument("--soak-requests", type=int, default=200)
    ap.add_argument("--tp-check", action="store_true", help="run the TP=2 vs TP=1 check instead (2 GPUs)")
    ap.add_argument("--tp-model-dir", default="/tmp/mpfa-tp-model", help="where --tp-check writes its saved model")
    ap.add_argument("--tp-recipes", default="bf16,qk4pv8",
                    help="comma-separated mpfa recipes --tp-check sets against flashinfer (default %(default)s)")
    ap.add_argument("--port", type=int, default=PORT,
                    help="server port (default %(default)s; one per queue when queues share a host, one GPU each)")
    publish.add_arguments(ap)
    args = ap.parse_args(argv)
    args.out = publish.destination(ap, args.out, args.publish)
    if not 1024 <= args.port <= 65535:
        ap.error(f"--port must be in 1024..65535, got {args.port}")
    if args.workload == "mixed" and args.input_len is not None:
        ap.error("--input-len: only with --workload fixed (--workload mixed draws its prompt lengths from MIXED_LENGTHS)")
    args.input_lens = None
    if args.workload == "fixed":
        args.input_lens = input_lengths(ap, args.input_len or "32768")
        args.input_len = args.input_lens[0]
    if args.output_len <= 0:
        ap.error(f"--output-len must be positive, got {args.output_len}")
    args.tp_recipes = ap.comma_list("--tp-recipes", args.tp_recipes, RECIPES)
    requests = args.requests.split(",")
    if len(requests) > 1 and len(requests) != len(args.input_lens or [None]):
        ap.error(f"--requests: {len(requests)} values for {len(args.input_lens or [None])} --input-len; give one "
                 f"for each length or one for all, got {args.requests!r}")
    return ap, args


def input_lengths(ap, text: str) -> list[int]:
    """--input-len's lengths: positive integers, each once."""
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) <= 0:
        ap.error(f"--input-len takes positive token counts, one or several comma-separated, got {text!r}")
    if len(set(lengths)) != len(lengths):
        ap.error(f"--input-len: each length once, got {text!r}")
    return lengths


def load_views(args) -> list[argparse.Namespace]:
    """The arguments as a run of each load alone would have them: one per --input-len (its ``input_len`` and
    ``requests``), or the mixed workload's one."""
    if args.workload != "fixed":
        return [args]
    requests = args.requests.split(",")
    requests = requests if len(requests) > 1 else requests * len(args.input_lens)
    return [argparse.Namespace(**{**vars(args), "input_len": n, "requests": r})
            for n, r in zip(args.input_lens, requests)]


def check_fits(ap, args, max_pos: int) -> None:
    """Every request's prompt and output within the model's positions (else a parser error saying what fits)."""
    if args.workload == "fixed" and args.input_len + args.output_len > max_pos:
        ap.error(f"--input-len {args.input_len} + --output-len {args.output_len} exceeds {args.model}'s "
                 f"{max_pos} positions (for '128K' pass --input-len {max_pos - args.output_len})")
    if args.workload == "mixed" and max_pos - args.output_len < MIXED_LENGTHS.long_min:
        ap.error(f"--output-len {args.output_len} leaves {max_pos - args.output_len} of {args.model}'s {max_pos} "
                 f"positions for a prompt; --workload mixed needs {MIXED_LENGTHS.long_min} (its long prompts)")


def request_count(ap, args, previous_rows: list[dict], max_pos: int) -> int:
    """--requests as a number: the one given, or (auto) what fills the largest pool --fills times."""
    if args.requests != "auto":
        try:
            n = int(args.requests)
        except ValueError:
            n = 0
        if n <= 0:
            ap.error(f"--requests must be a positive integer or 'auto', got {args.requests!r}")
        if args.workload == "mixed" and n < MIXED_LENGTHS.block:
            ap.error(f"--requests: --workload mixed needs at least {MIXED_LENGTHS.block} (one block, short and "
                     f"long prompts), got {n}")
        return n
    if args.fills <= 0:
        ap.error(f"--fills must be positive, got {args.fills}")
    # every configuration's pool, not only those of this call: queues that run a subset each (one GPU
    # apiece) send the same requests, so their rows compare as one run's would
    pools = estimated_pool_tokens(previous_rows, args.model, CONFIGS)
    if args.workload == "fixed":
        return requests_to_fill(pools, CONFIGS, args.input_len, args.output_len, args.fills)
    return mixed_requests_to_fill(pools, CONFIGS, max_pos - args.output_len, args.output_len, args.fills)


def prompt_lengths(args, n: int, max_pos: int) -> list[int]:
    """The prompt length of each of the ``n`` requests."""
    if args.workload == "fixed":
        return [args.input_len] * n
    return mixed_prompt_lengths(n, max_pos - args.output_len)


def describe_load(args, lengths: list[int]) -> str:
    """The requests in words, for the terminal."""
    if args.workload == "fixed":
        return f"{len(lengths)} requests of {args.input_len} + {args.output_len} tokens"
    n_long = sum(map(MIXED_LENGTHS.is_long, lengths))
    return (f"{len(lengths)} mixed requests ({len(lengths) - n_long} short, {n_long} long; {min(lengths)} to "
            f"{max(lengths)} tokens, {sum(lengths):,} in all) + {args.output_len} tokens each")


def result_line(row: dict) -> str:
    """A row in one line for the terminal: throughput and the latencies its workload measures."""
    if row["status"] != "ok":
        return f"{row['config']}: {row.get('error') or row.get('first_error', '')}"
    line = f"{row['config']}: {row['output_throughput']:.0f} output tok/s"
    if row["workload"] == "mixed":
        return line + f", TTFT p50 short {row.get('ttft_short_p50_s')} s / long {row.get('ttft_long_p50_s')} s"
    return line + (f", TTFT(c=1) {row.get('ttft_concurrency1_s')} s, ITL(c=1) mean "
                   f"{row.get('itl_concurrency1_mean_ms')} ms")


def previous_result(target: Path) -> dict:
    """The rows this run's rows are merged into: the destination's file, or for a scratch run the published
    one (a scratch file is the published results plus this run, as a queue's is)."""
    if Path(target).resolve() == publish.SCRATCH_DIR.resolve():
        return e2e_results.read_result(results_io.RESULTS_DIR)
    return e2e_results.read_result(target)


def refusal(args) -> str | None:
    """Why this machine may not publish (no GPU, no SGLang, another GPU than the published file's), or None."""
    if not args.publish:
        return None
    return publish.refusal(PROG, [f"{e2e_results.RESULT}.json"], args.out, need_sglang=True)


def finish(args, rows: list[dict], work: Path) -> int:
    """Say where the run's files are; a publishing run whose rows all succeeded moves them (results file, plot,
    server logs) from its staging folder into the published folder."""
    failed = publish.failed_rows(rows)
    path = work / f"{e2e_results.RESULT}.json"
    if args.publish and failed:
        print(publish.failure_line(PROG, failed, path), file=sys.stderr)
    elif args.publish:
        for p in publish.promote(work, args.out):
            print(f"published {publish.display(p)}", file=sys.stderr)
    else:
        head = f"{PROG}: {len(failed)} of {len(rows)} failed; " if failed else ""
        print(f"{head}wrote {publish.display(path)}", file=sys.stderr)
    return 1 if failed else 0


def main(argv=None) -> int:
    ap, args = parse_args(argv)
    configs = ap.comma_list("--configs", args.configs, CONFIGS)
    command = (f"{PROG} " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    previous = previous_result(args.out)   # read once: this run's rows replace their earlier versions
    if not (args.soak or args.tp_check):
        model_cfg = model_config(args.model)
        vocab, max_pos = model_cfg["vocab_size"], model_cfg["max_position_embeddings"]
        views = load_views(args)
        for v in views:
            check_fits(ap, v, max_pos)
        counts = [request_count(ap, v, previous["rows"], max_pos) for v in views]
    why = refusal(args)
    if why:
        print(why, file=sys.stderr)
        return 2
    # a publishing run writes to staging as it goes (a killed run keeps what finished); only a whole
    # successful run reaches the published folder
    work = publish.staging_dir(e2e_results.RESULT) if args.publish else args.out
    log_dir = work / "logs" / "e2e"
    if args.soak or args.tp_check:
        rows = [run_soak(args, log_dir)] if args.soak else run_tp_check(args, log_dir)
        e2e_results.write_rows(previous["rows"], rows, work, run_meta(command, [rows[0]["part"]], previous["meta"]))
        if args.soak:   # the issue asks for the soak's summary log beside the results
            log_dir.mkdir(parents=True, exist_ok=True)
            (log_dir / f"soak-{args.model}-summary.txt").write_text(
                f"{command}\n" + "\n".join(f"{k}: {v}" for k, v in rows[0].items()) + "\n")
        print(json.dumps(rows, indent=1))
        return finish(args, rows, work)
    loads = []
    for v, n in zip(views, counts):
        inputs = inputs_of_lengths(prompt_lengths(v, n, max_pos), vocab)
        # the probe: one prompt of the load's length alone; a mixed run has no one length for it to stand for
        probe = v.ttft_probe and v.workload == "fixed"
        loads.append(Load(v, inputs, make_inputs(1, v.input_len, vocab, seed=7)[0] if probe else None,
                          probe_output_len(v.input_len, v.output_len, max_pos) if probe else 0))
    context = server_context_length(max(len(x) for ld in loads for x in ld.inputs),
                                    max(args.output_len, *(ld.probe_output for ld in loads)), max_pos)
    for ld in loads:
        print(f"{len(configs)} configurations x {describe_load(ld.args, [len(x) for x in ld.inputs])} "
              f"({args.model}, TP {args.tp})", file=sys.stderr)
    from tqdm import tqdm
    rows = []
    meta = run_meta(command, ["throughput"], previous["meta"])
    with tqdm(total=len(configs) * len(loads), unit="load", file=sys.stderr) as bar:
        for config in configs:
            def keep(finished, before=list(rows)):
                print(result_line(finished[-1]), flush=True)
                e2e_results.write_rows(previous["rows"], before + finished, work, meta)
            config_rows = run_config(config, loads, context, log_dir, bar, on_load=keep)
            rows.extend(config_rows)
            e2e_results.write_rows(previous["rows"], rows, work, meta)
            for r in config_rows:
                if r["status"] != "ok" and "error" in r:   # a load the server failed: keep() never saw it
                    print(result_line(r), flush=True)
    return finish(args, rows, work)


if __name__ == "__main__":
    sys.exit(main())
