"""SGLang's own serving client against mpfa and SGLang's backends: latency and throughput under Poisson load.

    python -m benchmarks.e2e.serving --rates 0.25,0.4,0.55 [--configs ...] [--prompts 100] [--tp 1] [--mixed-chunk]
        [--publish]

Per configuration one server, then per request rate (lowest first) one run of SGLang's client:

    python -m sglang.bench_serving --backend sglang --dataset-name random-ids --tokenize-prompt
        --random-input-len 65536 --random-output-len 1024 --random-range-ratio 0.015625
        --num-prompts N --request-rate R --seed S --flush-cache --tokenizer <SmolLM2> --model <model dir> ...

so every configuration gets the same prompts (random token ids, input lengths uniform over 1K-64K tokens,
outputs 16-1,024: SGLang's random dataset draws both with one range ratio, 1/64) at the same Poisson arrival
times, with the radix cache flushed between rates. ``random-ids`` is SGLang's random dataset without its
ShareGPT download (the GPU machine has no network). The servers: mpfa through ``python -m mpfa.sglang.launch``
with the served YAML (server_configs/llama-3.1-8b-<recipe>.yaml, written to a temporary copy that names the
tokenizer and the context length instead of --skip-tokenizer-init), the peers through
``python -m sglang.launch_server`` with the same model, dummy weights, page size, memory fraction and context
length (``sglang-fa3-bf16``, ``sglang-fa3-fp8kv``: SGLang's fa3 backend, its default on Hopper, with a BF16 or
FP8 KV cache; ``flashinfer-bf16``). The tokenizer is a word-level one over the model's whole vocabulary, written
into the run's temporary folder (``benchmarks.e2e.synthetic_tokenizer``): the server needs one to stream text, which
bench_serving times, and with it every id the dummy weights generate is a word (a borrowed smaller tokenizer would
decode most of them to nothing and delay TTFT to the first id it knows).

Before each rate the server's radix cache is flushed (and bench_serving flushes it again after its warmup); a rate
whose client fails while the server still runs is run once more. Rows are written after every rate, and
bench_serving's JSONL output is kept beside the server logs (``logs/serving``), so a run cut short keeps what it
finished.

Rows (one per configuration and rate) carry what bench_serving reports: output throughput, TTFT, ITL, TPOT and
end-to-end latency (mean, p50, p90, p99), completed requests; and, from its per-request gaps (``--output-details``),
how many inter-token gaps were stalls of a second or more, p99.9 and the longest gap. They go to ``<out>/serving_h200.json``, replacing
earlier rows of the same configuration and rate (but an mpfa qk4pv8 row a kept peer row was measured with, in one
run: ``benchmarks.e2e.runs``), so runs of a few configurations at a time add up over sessions;
the summary sets mpfa qk4pv8 against the fa3 peers per rate (``ttft_p50_ratio_vs_sglang_fa3_bf16``, ...), and
``serving_h200.png`` plots TTFT p50, ITL p99 and end-to-end p50 against the rate, one line per configuration.
``<out>`` is benchmarks/results/scratch unless ``--publish`` (benchmarks/publish.py).

``--mixed-chunk`` serves every configuration with SGLang's ``--enable-mixed-chunk`` (decode steps ride inside prefill
batches instead of waiting behind them: the server option aimed at the stalls). Its rows stand apart, as rows on
several GPUs do: ``mixed_chunk`` in the row, ratios keyed ``mixed/<rate>``, paired only with each other, not plotted.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import cli
from benchmarks import meta as bench_meta
from benchmarks import publish, results_io
from benchmarks.e2e import results as e2e_results
from benchmarks.e2e import runs, throughput
from benchmarks.e2e import synthetic_tokenizer
from benchmarks.e2e.server import Server, flush_radix_cache, server_env, server_info

RESULT = "serving_h200"
PROG = "python -m benchmarks.e2e.serving"
REPO = Path(__file__).resolve().parents[2]
CONFIGS = ("sglang-fa3-bf16", "sglang-fa3-fp8kv", "flashinfer-bf16", "mpfa-qk8pv8", "mpfa-qk4pv8", "mpfa-qk4pv4")
DEFAULT_CONFIGS = CONFIGS[:5]   # the comparison the serving results lead with; qk4pv4 when asked for
HEADLINE = "mpfa-qk4pv8"
PEERS = {"sglang-fa3-bf16": "sglang_fa3_bf16", "sglang-fa3-fp8kv": "sglang_fa3_fp8kv"}
MODEL = "llama-3.1-8b"
INPUT_MAX, OUTPUT_MAX, RANGE_RATIO = 65536, 1024, 1 / 64
PORT = 30641
# bench_serving's result fields a row keeps (its JSONL line also has the server's whole /server_info)
FIELDS = ("duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
          "input_throughput", "output_throughput", "total_throughput", "concurrency", "max_concurrent_requests",
          *(f"{s}_{m}_ms" for m in ("ttft", "itl", "e2e_latency", "tpot") for s in ("mean", "median", "p90", "p99")))
# the summary's ratios: (row field, summary key stem). ITL p99 alone misleads near saturation: stalls of a second or
# more (decode waiting behind prefill batches) hit about 1% of a run's gaps, so p99 lands on either side of them;
# the mean ITL and p99 TPOT carry the stalls in every run, and the rows count them (``itl_stats``). ITL p50 is the
# typical decode step under the load, stalls and prefill chunks aside.
RATIOS = (("median_ttft_ms", "ttft_p50"), ("p99_itl_ms", "itl_p99"), ("median_itl_ms", "itl_p50"),
          ("mean_itl_ms", "itl_mean"), ("p99_tpot_ms", "tpot_p99"), ("median_e2e_latency_ms", "e2e_latency_p50"),
          ("output_throughput", "output_throughput"))
STALL_S = 1.0   # an inter-token gap this long is a stall a reader of the stream sees


def tokenizer_dir(tmp: Path) -> Path:
    """Where a run's tokenizer is (benchmarks.e2e.synthetic_tokenizer, written by main into its temporary folder)."""
    return Path(tmp) / "tokenizer"


def mpfa_yaml(recipe: str, context: int, tmp: Path, tp: int = 1) -> Path:
    """The served YAML of ``recipe`` as a copy in ``tmp`` that names the model by absolute path, the run's
    tokenizer instead of --skip-tokenizer-init, ``context`` tokens of context and ``tp`` GPUs."""
    import yaml
    src = REPO / "server_configs" / f"{MODEL}-{recipe}.yaml"
    doc = yaml.safe_load(src.read_text())
    doc["model"] = str((src.parent / doc["model"]).resolve())
    doc["sglang"].pop("skip-tokenizer-init", None)
    doc["sglang"].update({"tokenizer-path": str(tokenizer_dir(tmp)), "context-length": context, "tp-size": tp})
    out = tmp / f"{recipe}.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def server_command(config: str, context: int, port: int, tmp: Path, tp: int = 1,
                   mixed_chunk: bool = False) -> tuple[list, dict]:
    """(argv, extra environment) of one configuration's server on ``tp`` GPUs (``mixed_chunk``: with SGLang's
    ``--enable-mixed-chunk``)."""
    extra = ["--enable-mixed-chunk"] if mixed_chunk else []
    if config.startswith("mpfa-"):
        yaml_path = mpfa_yaml(config.split("-", 1)[1], context, tmp, tp)
        return [sys.executable, "-m", "mpfa.sglang.launch", str(yaml_path), "--", "--port", str(port), *extra], {}
    # the peers' log at SGLang's default level, as mpfa's launcher leaves it: its batch lines show queueing and retraction
    argv, env = throughput.server_argv(config, MODEL, context_length=context, mem_fraction=0.85, tp=tp, port=port,
                                       log_level=None)
    argv = [a for a in argv if a != "--skip-tokenizer-init"] + ["--tokenizer-path", str(tokenizer_dir(tmp)), *extra]
    return argv, env


def client_command(port: int, rate: float, prompts: int, seed: int, out_file: Path, tokenizer: Path) -> list:
    """SGLang's serving client for one rate (the module docstring's command)."""
    return [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--host", "127.0.0.1", "--port", str(port),
            "--model", str(throughput.MODELS[MODEL]), "--tokenizer", str(tokenizer), "--dataset-name", "random-ids",
            "--tokenize-prompt", "--random-input-len", str(INPUT_MAX), "--random-output-len", str(OUTPUT_MAX),
            "--random-range-ratio", repr(RANGE_RATIO), "--num-prompts", str(prompts), "--request-rate", repr(rate),
            "--seed", str(seed), "--flush-cache", "--warmup-requests", "2", "--disable-tqdm", "--output-details",
            "--output-file", str(out_file)]


def itl_stats(itls: list) -> dict:
    """The stalls in a run's inter-token gaps (``itls``: bench_serving's per-request lists, in seconds): how many gaps,
    how many of at least ``STALL_S``, the requests that saw one, p99.9 and the longest gap."""
    gaps = sorted(g for req in itls for g in (req or []))
    if not gaps:
        return {}
    stalls = sum(g >= STALL_S for g in gaps)
    return {"itl_gaps": len(gaps), "itl_stalls": stalls, "itl_stall_fraction": stalls / len(gaps),
            "requests_with_a_stall": sum(any(g >= STALL_S for g in (req or [])) for req in itls),
            "p999_itl_ms": 1000 * gaps[min(len(gaps) - 1, int(0.999 * len(gaps)))], "max_itl_ms": 1000 * gaps[-1]}


def client_row(out_file: Path) -> dict:
    """The fields of bench_serving's last JSONL line, with the stall counts of its per-request gaps."""
    lines = [ln for ln in out_file.read_text().splitlines() if ln.strip()] if out_file.exists() else []
    if not lines:
        raise RuntimeError(f"bench_serving wrote no result to {out_file}")
    res = json.loads(lines[-1])
    return {**{k: res.get(k) for k in FIELDS}, **itl_stats(res.get("itls") or [])}


def _servers(r: dict) -> tuple[int, bool]:
    """How a row's servers ran: the tensor-parallel size and whether decode steps rode in prefill batches
    (``--mixed-chunk``). Rows of other servers stand apart: never paired, never replacing each other."""
    return r.get("tp", 1), bool(r.get("mixed_chunk"))


def _load(r: dict) -> tuple:
    """What a row's client sent, to what servers: the rate, the request count, the seed (prompts and arrival
    times) and ``_servers``."""
    return r["rate"], r.get("prompts"), r.get("seed"), *_servers(r)


def _is_default_serving(r: dict) -> bool:
    """A row of one GPU without ``--mixed-chunk``: the rates list and the plot are theirs."""
    return _servers(r) == (1, False)


def _rate_key(r: dict) -> str:
    """A summary dict's key for a row: its rate, ``tp<N>/<rate>`` on more than one GPU, ``mixed/`` before either
    with ``--mixed-chunk``."""
    tp, mixed = _servers(r)
    key = str(r["rate"]) if tp == 1 else f"tp{tp}/{r['rate']}"
    return f"mixed/{key}" if mixed else key


def _by_rate(item: tuple[str, float]) -> tuple[str, float]:
    prefix, _, rate = item[0].rpartition("/")
    return prefix, float(rate)


def summarize(rows: list[dict]) -> dict:
    """The rates measured and, per rate, the headline's ratios over each fa3 peer (keys ``<stem>_ratio_vs_<peer>``,
    dicts keyed by the rate, ``tp<N>/<rate>`` for rows on N GPUs): below 1 for latencies is mpfa faster, above 1 for
    throughput. Each ratio pairs the peer's row with the headline row of its run and load (``runs.partner``), and
    ``pairs_measured`` names the commit of each rate's pair. ``rates``: those measured on one GPU."""
    ok = [r for r in rows if r.get("status") == "ok"]
    rates = sorted({r["rate"] for r in ok if _is_default_serving(r)})
    out: dict = {"rates": rates}
    measured: dict = {}
    for peer, suffix in PEERS.items():
        for field, stem in RATIOS:
            ratios = {}
            for b in (r for r in ok if r["config"] == peer):
                a = runs.partner([h for h in ok if h["config"] == HEADLINE and _load(h) == _load(b)], b)
                if a and a.get(field) and b.get(field):
                    ratios[_rate_key(b)] = a[field] / b[field]
                    measured.setdefault(suffix, {})[_rate_key(b)] = str(a.get("commit") or "?")[:7]
            if ratios:
                out[f"{stem}_ratio_vs_{suffix}"] = dict(sorted(ratios.items(), key=_by_rate))
    if measured:
        out["pairs_measured"] = measured
    return out


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """``serving_h200.png``: TTFT p50, ITL p99 and end-to-end latency p50 against the request rate, a panel each,
    one line per configuration (its newest rows on one GPU)."""
    from benchmarks import plots
    newest = {(r["config"], r["rate"]): r for r in rows   # rows run oldest first; one GPU's lines, no --mixed-chunk
              if r.get("status") == "ok" and _is_default_serving(r)}
    if not newest:
        return []
    rates = sorted({rate for _, rate in newest})
    configs = [c for c in CONFIGS if any(config == c for config, _ in newest)]
    panels = {f"{name} (ms)": {c: [newest.get((c, x), {}).get(field) for x in rates] for c in configs}
              for field, name in (("median_ttft_ms", "TTFT p50"), ("p99_itl_ms", "ITL p99"),
                                  ("median_e2e_latency_ms", "end-to-end latency p50"))}
    return [plots.line_panels(rates, panels, Path(out_dir) / f"{RESULT}.png", xlabel="request rate (req/s)",
                              title="SGLang bench_serving, H200: latency against request rate")]


def merge(previous: list[dict], new: list[dict]) -> list[dict]:
    """Rows after a run: a (configuration, rate) measured again replaces its earlier row, except a headline row
    that a kept peer's ratio pairs with (``runs.merge``); within a configuration and rate the newest comes last."""
    merged = runs.merge(previous, new, lambda r: (r["config"], r["rate"], *_servers(r)), _load, HEADLINE)
    return sorted(merged, key=lambda r: (CONFIGS.index(r["config"]) if r["config"] in CONFIGS else 99, r["rate"]))


def client_timeout_s(rate: float, prompts: int) -> float:
    """How long one rate's client may take: twice its arrivals (above saturation the backlog drains after them),
    and 20 minutes for the last requests and the client's own start."""
    return 2 * prompts / rate + 1200


def run_rate(config: str, args, rate: float, srv, base: dict, out_dir: Path, tokenizer: Path) -> dict:
    """One rate against a running server: the radix cache flushed, then SGLang's client; a client that fails while
    the server still runs gets one more try (bench_serving stops at a flush SGLang refuses)."""
    out_file = out_dir / f"{config}-{rate:g}.jsonl"
    for attempt in (1, 2):
        out_file.unlink(missing_ok=True)
        t0 = time.perf_counter()
        try:
            flush_radix_cache(srv.base)
            client = subprocess.run(client_command(args.port, rate, args.prompts, args.seed, out_file, tokenizer),
                                    cwd=REPO, capture_output=True, text=True, env=server_env(HF_HUB_OFFLINE="1"),
                                    timeout=client_timeout_s(rate, args.prompts))
            returncode, stderr = client.returncode, client.stderr
        except (subprocess.TimeoutExpired, RuntimeError) as e:
            returncode, stderr = None, f"{type(e).__name__}: {e}"
        row = {**base, "rate": rate, "seconds": round(time.perf_counter() - t0, 1), "attempts": attempt,
               "startup_s": round(srv.startup_s, 1)}
        try:
            row.update(client_row(out_file))
            row["status"] = "ok" if returncode == 0 and row["completed"] == args.prompts else "error"
            if row["status"] != "ok":
                row["error"] = f"exit {returncode}, {row['completed']} of {args.prompts} completed"
        except RuntimeError as e:
            row.update(status="error", error=f"{e}; client: {stderr[-800:]}")
        if row["status"] == "ok" or not srv.alive():
            return row
    return row


def run_config(config: str, args, rates: list[float], tmp: Path, log_dir: Path, bar, on_row) -> None:
    """One server, every rate against it (``on_row`` gets each rate's row as it ends); a failure becomes error rows."""
    context = throughput.server_context_length(INPUT_MAX, OUTPUT_MAX, throughput.model_config(MODEL)["max_position_embeddings"])
    argv, extra = server_command(config, context, args.port, tmp, args.tp, args.mixed_chunk)
    base = {"part": "serving", "config": config, "model": MODEL, "tp": args.tp, "prompts": args.prompts, "seed": args.seed,
            "input_len_range": [int(INPUT_MAX * RANGE_RATIO), INPUT_MAX],
            "output_len_range": [int(OUTPUT_MAX * RANGE_RATIO), OUTPUT_MAX], "dataset": "random-ids",
            "tokenizer": "synthetic word-level, the model's vocabulary",
            **({"mixed_chunk": True} if args.mixed_chunk else {})}
    done: set = set()
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        if config.startswith("mpfa-"):   # the server's kernels, built (or found) before it starts
            subprocess.run([sys.executable, "-m", "mpfa.sglang.warmup", argv[3]], check=True, cwd=REPO,
                           stdout=subprocess.DEVNULL, timeout=1800)
        with Server(argv, server_env(**extra, HF_HUB_OFFLINE="1"), log_dir / f"serving-{config}.log", args.port) as srv:
            base["max_total_num_tokens"] = server_info(srv.base).get("max_total_num_tokens")
            for rate in rates:
                bar.set_description(f"{config} at {rate} req/s")
                on_row(run_rate(config, args, rate, srv, base, log_dir, tokenizer_dir(tmp)))
                done.add(rate)
                bar.update(1)
    except Exception as e:
        for rate in rates:
            if rate not in done:
                on_row({**base, "rate": rate, "status": "error", "error": f"{type(e).__name__}: {e}"})
                bar.update(1)


def main(argv=None) -> int:
    ap = cli.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", required=True, help="comma-separated request rates (req/s), e.g. 0.25,0.4,0.55")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated subset of {', '.join(CONFIGS)} (default: all but mpfa-qk4pv4)")
    ap.add_argument("--prompts", type=int, default=100, help="requests per rate (default %(default)s)")
    ap.add_argument("--seed", type=int, default=1, help="bench_serving's seed: prompts and arrival times")
    ap.add_argument("--port", type=int, default=PORT)
    ap.add_argument("--tp", type=int, default=1, help="GPUs per server, SGLang's --tp-size (default %(default)s)")
    ap.add_argument("--mixed-chunk", action="store_true",
                    help="serve with SGLang's --enable-mixed-chunk (rows apart, ratios keyed mixed/<rate>)")
    publish.add_arguments(ap)
    args = ap.parse_args(argv)
    args.out = publish.destination(ap, args.out, args.publish)
    configs = ap.comma_list("--configs", args.configs, CONFIGS)
    try:
        rates = sorted({float(x) for x in args.rates.split(",") if x})
    except ValueError:
        rates = []
    if not rates or any(not 0 < r < 1000 for r in rates):
        ap.error(f"--rates: comma-separated request rates above 0 (req/s), got {args.rates!r}")
    if args.tp < 1:
        ap.error(f"--tp must be at least 1 (GPUs per server), got {args.tp}")
    if args.prompts < 10:
        ap.error(f"--prompts must be at least 10 (a p99 over fewer is one request), got {args.prompts}")
    why = publish.refusal(PROG, [f"{RESULT}.json"], args.out, need_sglang=True) if args.publish else None
    if why:
        print(why, file=sys.stderr)
        return 2
    target = Path(args.out)
    published = results_io.RESULTS_DIR / f"{RESULT}.json"
    source = target / f"{RESULT}.json" if (target / f"{RESULT}.json").exists() else published
    previous = results_io.read(source) if source.exists() else {"meta": {}, "rows": []}
    work = publish.staging_dir(RESULT) if args.publish else target
    command = f"{PROG} " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = e2e_results.with_calls(bench_meta.collect(command, parts=["serving"]), previous["meta"])
    from tqdm import tqdm
    rows: list[dict] = []
    merged = previous["rows"]

    def on_row(row: dict) -> None:   # written as each rate ends: a run cut short keeps what it finished
        nonlocal merged
        rows.append({**row, "commit": meta.get("commit"), "run": meta["run"]})
        merged = merge(previous["rows"], rows)
        results_io.write(RESULT, meta, summarize(merged), merged, work)

    with tempfile.TemporaryDirectory() as tmp, tqdm(total=len(configs) * len(rates), unit="run", file=sys.stderr) as bar:
        synthetic_tokenizer.write_for_model(throughput.MODELS[MODEL], tokenizer_dir(Path(tmp)))
        for config in configs:
            run_config(config, args, rates, Path(tmp), work / "logs" / "serving", bar, on_row)
    try:
        plot(merged, work)
    except RuntimeError as e:   # no matplotlib: the JSON is the result
        print(f"no plot: {e}", file=sys.stderr)
    for r in rows:
        line = (f"{r['config']} at {r['rate']} req/s: " + (f"{r['output_throughput']:.0f} output tok/s, TTFT p50 "
                f"{r['median_ttft_ms']:.0f} ms, ITL p99 {r['p99_itl_ms']:.1f} ms" if r["status"] == "ok" else r["error"]))
        print(line)
    failed = publish.failed_rows(rows)
    if args.publish and not failed:
        for p in publish.promote(work, args.out):
            print(f"published {publish.display(p)}", file=sys.stderr)
    elif failed:
        print(publish.failure_line(PROG, failed, work / f"{RESULT}.json"), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
