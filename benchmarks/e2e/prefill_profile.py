"""Where one long prefill's time goes inside SGLang: GPU kernel time by kind, and the time no kernel ran.

    python -m benchmarks.e2e.prefill_profile [--configs mpfa-qk4pv8,sglang-fa3-fp8kv] [--input-len 32768]
        [--model llama-3.1-8b] [--out DIR] [--port 30651]

Against SGLang's fa3 FP8-KV backend mpfa's prefill is a tie, and its time to first token per 32K prompt carries
~77 ms more outside attention than FlashInfer's (the TTFT fit in docs/sglang.md). This says where it goes. Per
configuration one server with the throughput runs' settings (``benchmarks.e2e.throughput.server_argv``), then
three requests of ``--input-len`` tokens and one output token, each prompt new (no radix-cache hit):

1. a warmup (JIT modules, allocator);
2. one timed without the profiler (``ttft_s``), with nvidia-smi sampling the SM clock, power and clock-event
   reasons meanwhile (``gpu_clocks_timed``, benchmarks.gpu_clocks): a compute-bound kind (GEMM) slower in one
   server than in the other at the same shapes is a clock before it is a kernel;
3. one inside SGLang's torch profiler (``POST /start_profile`` with GPU activity only, then ``/stop_profile``);
4. one more with the host's activity too (torch ops and CUDA runtime calls, no Python stacks), which says what
   the host was doing while the GPU waited.

The third's trace is read back from ``<out>/traces/<config>``: every kernel (and memcpy / memset) event is summed
by kind (KINDS, the first pattern its name matches), and the span from the first kernel's start to the last
one's end, less the union of the kernels' intervals, is the time the GPU waited on the host (``host_wait_ms``;
the profiler itself adds some). ``top_kernels`` names the 15 longest in total. The fourth's trace
(``<out>/traces/<config>/host``) gives ``host_during_gpu_wait``: the GPU's idle stretches of at least MIN_GAP_US,
their count and total, and per host category (``cpu_op``, ``cuda_runtime``, ...) the events that ran inside them,
by time inside (nested torch ops each count theirs: the names say where, the sum is not a total). A sync shows
as a ``cudaStreamSynchronize`` / ``cudaMemcpyAsync`` ending where a gap ends. The summary gives each kind's
difference, mpfa's configuration less each peer's, in ms per prefill.

``<out>/prefill_profile_h200.json`` (default ``benchmarks/results/scratch/prefill_profile``, never the published
folder: the lead publishes). Time: per configuration a server start (~60-90 s) and four prefills.
"""
from __future__ import annotations

import bisect
import gzip
import json
import re
import sys
import time
from pathlib import Path

from benchmarks import cli
from benchmarks import meta as bench_meta
from benchmarks import publish
from benchmarks.gpu_clocks import GpuSampler
from benchmarks.e2e.server import Server, flush_radix_cache, http_json, server_env, server_info, stream_generate
from benchmarks.e2e.throughput import (CONFIGS, MODELS, PAGE_SIZE, make_inputs, model_config, server_argv,
                                       server_context_length)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = publish.SCRATCH_DIR / "prefill_profile"
PROG = "python -m benchmarks.e2e.prefill_profile"
FILE = "prefill_profile_h200.json"
PORT = 30651
HEADLINE = "mpfa-qk4pv8"
# Kernel kinds, first match wins (names lower-cased): mpfa's own kernels by their template names (templates/),
# then the peers' attention (FA3: flash:: / FlashAttnFwdSm90; FlashInfer's BatchPrefill..., not its other
# flashinfer:: kernels), then the rest.
KINDS = (
    ("mpfa attention", r"\b(prefill_kernel|decode_kernel|merge_kernel)\b"),
    ("mpfa pre-pass", r"\b(kv_pack_kernel|q_sum_kernel|q_mean_kernel|q_amax_kernel)\b"),
    ("mpfa append", r"\bappend_kv_kernel\b"),
    ("peer attention", r"flash_fwd|flashattn|flash::|fmha|attention|batchprefill|batchdecode|singleprefill|"
                       r"prefillwith|decodewith|mergestate"),
    ("norm", r"norm"),   # before GEMM: FlashInfer's CuTe-DSL RMSNorm is named kernel_cutlass_..._rmsnorm...
    ("GEMM", r"gemm|cutlass|nvjet|xmma|cublas|matmul|sm90_|wgmma"),
    ("KV store and casts", r"store_kv|kvcache|kv_buffer|fp8|quant|cast|convert"),
    ("activation", r"silu|gelu|act_and_mul"),
    ("rotary", r"rotary|rope"),
    ("elementwise and copies", r"elementwise|copy|memcpy|memset|fill|index|gather|scatter|cat|reduce|vectorized"),
)
EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")
# An idle stretch shorter than this is a launch's own latency, not the host holding the GPU up.
MIN_GAP_US = 20.0


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, low)), "other")


def _complete_events(trace: dict, categories: tuple[str, ...]) -> list[dict]:
    """The complete ("X") events of a chrome trace (torch profiler's export) in ``categories``."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace   # torch writes a dict; a bare list is valid too
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in categories and "ts" in e]


def kernel_events(trace: dict) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every GPU event of a chrome trace."""
    return [(e.get("name", "?"), float(e["ts"]), float(e.get("dur", 0.0)))
            for e in _complete_events(trace, EVENT_CATEGORIES)]


def host_events(trace: dict) -> list[tuple[str, str, float, float]]:
    """(category, name, start us, duration us) of the host's events of a chrome trace (HOST_CATEGORIES)."""
    return [(e["cat"], e.get("name", "?"), float(e["ts"]), float(e.get("dur", 0.0)))
            for e in _complete_events(trace, HOST_CATEGORIES)]


def idle_gaps(events: list[tuple[str, float, float]], min_us: float = MIN_GAP_US) -> list[tuple[float, float]]:
    """(start, end) us of every stretch of at least ``min_us`` between the GPU events' busy intervals."""
    gaps, end = [], None
    for _, start, dur in sorted(events, key=lambda e: e[1]):
        if end is not None and start - end >= min_us:
            gaps.append((end, start))
        end = start + dur if end is None else max(end, start + dur)
    return gaps


def host_during_gaps(gaps: list[tuple[float, float]], host: list[tuple[str, str, float, float]],
                     top: int = 12) -> dict:
    """The GPU's idle stretches (count, ms, those of 1 ms or more) and, per host category, the ``top`` host events
    by their time inside them (ms, how many of them overlapped one)."""
    starts = [g[0] for g in gaps]
    inside: dict = {}
    for cat, name, start, dur in host:
        i, stop, t = max(bisect.bisect_right(starts, start) - 1, 0), start + dur, 0.0
        while i < len(gaps) and gaps[i][0] < stop:
            t += max(0.0, min(gaps[i][1], stop) - max(gaps[i][0], start))
            i += 1
        if t > 0:
            acc = inside.setdefault(cat, {}).setdefault(name, [0.0, 0])
            acc[0] += t
            acc[1] += 1
    long_gaps = [b - a for a, b in gaps if b - a >= 1000.0]
    return {"gaps": len(gaps), "gap_ms": round(sum(b - a for a, b in gaps) / 1000, 3),
            "gaps_of_1ms_or_more": len(long_gaps), "gaps_of_1ms_or_more_ms": round(sum(long_gaps) / 1000, 3),
            "host_events_inside": {cat: [{"name": n[:160], "ms": round(v[0] / 1000, 3), "count": v[1]}
                                         for n, v in sorted(names.items(), key=lambda kv: -kv[1][0])[:top]]
                                   for cat, names in sorted(inside.items())}}


def busy_us(events: list[tuple[str, float, float]]) -> float:
    """The union of the events' intervals (kernels of several streams overlap), in us: their span less every gap."""
    if not events:
        return 0.0
    span = max(s + d for _, s, d in events) - min(s for _, s, _ in events)
    return span - sum(end - start for start, end in idle_gaps(events, min_us=0.0))


def summarize_events(events: list[tuple[str, float, float]], top: int = 15) -> dict:
    """Kernel time by kind (ms, count), busy and span (ms), the host wait between them, the longest kernels."""
    if not events:
        raise ValueError("the trace holds no GPU events: was the profiler started with GPU activity?")
    by_kind: dict = {}
    by_name: dict = {}
    for name, _, dur in events:
        k = by_kind.setdefault(kind_of(name), {"ms": 0.0, "count": 0})
        k["ms"] += dur / 1000
        k["count"] += 1
        n = by_name.setdefault(name, [0.0, 0])
        n[0] += dur / 1000
        n[1] += 1
    span = (max(s + d for _, s, d in events) - min(s for _, s, _ in events)) / 1000
    busy = busy_us(events) / 1000
    longest = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"kernels_ms": {k: round(v["ms"], 3) for k, v in sorted(by_kind.items())},
            "kernel_counts": {k: v["count"] for k, v in sorted(by_kind.items())},
            "busy_ms": round(busy, 3), "span_ms": round(span, 3), "host_wait_ms": round(span - busy, 3),
            "top_kernels": [{"name": name[:160], "kind": kind_of(name), "ms": round(ms, 3), "count": n}
                            for name, (ms, n) in longest]}


def read_traces(folder: Path, extract=kernel_events) -> list:
    """``extract``'s events (default: every GPU event) of the traces in ``folder`` (``*.json`` or ``*.json.gz``,
    one per TP rank; not its subfolders)."""
    events = []
    for path in sorted(folder.glob("*.json*")):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            events += extract(json.load(f))
    return events


def wait_for_traces(folder: Path, timeout_s: float = 300.0) -> list[Path]:
    """The trace files once they stop growing (the server writes them after /stop_profile returns, or while)."""
    t0, last = time.perf_counter(), None
    while time.perf_counter() - t0 < timeout_s:
        files = sorted(folder.glob("*.json*"))
        sizes = [p.stat().st_size for p in files]
        if files and sizes == last:
            return files
        last = sizes
        time.sleep(3)
    raise RuntimeError(f"no complete trace in {folder} after {timeout_s:.0f} s")


def profile_config(config: str, args, logs: Path, traces: Path) -> dict:
    """One configuration's server: the warmup, the timed and the profiled prefill; the profiled one's kernels."""
    cfg = model_config(args.model)
    max_pos = cfg["max_position_embeddings"]
    context = server_context_length(args.input_len, 1, max_pos)
    argv, extra = server_argv(config, args.model, context_length=context, mem_fraction=0.85, tp=1, port=args.port)
    warm, timed, profiled, host_profiled = (make_inputs(1, args.input_len, cfg["vocab_size"], seed=s)[0]
                                            for s in (11, 12, 13, 14))
    row = {"config": config, "model": args.model, "input_len": args.input_len, "page_size": PAGE_SIZE}
    one_token = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    folder, host_folder = traces / config, traces / config / "host"
    host_folder.mkdir(parents=True, exist_ok=True)
    for old in [*folder.glob("*.json*"), *host_folder.glob("*.json*")]:   # else read with this run's
        old.unlink()
    try:
        with Server(argv, server_env(**extra, HF_HUB_OFFLINE="1"), logs / f"prefill-profile-{config}.log",
                    args.port) as srv:
            info = server_info(srv.base)
            row.update(startup_s=round(srv.startup_s, 1), chunked_prefill_size=info.get("chunked_prefill_size"))

            def ask(name, prompt):
                res = stream_generate(args.port, prompt, one_token)
                if res.error:
                    raise RuntimeError(f"{name} request: {res.error}")
                return res

            ask("warmup", warm)
            flush_radix_cache(srv.base)
            with GpuSampler() as clocks:   # the timed prompt's clocks, not the warmup's
                row["ttft_s"] = round(ask("timed", timed).ttft, 4)
            row["gpu_clocks_timed"] = clocks.summary()
            flush_radix_cache(srv.base)
            for name, prompt, where, activities in (("profiled", profiled, folder, ["GPU"]),
                                                    ("host_profiled", host_profiled, host_folder, ["CPU", "GPU"])):
                http_json(f"{srv.base}/start_profile", {"output_dir": str(where), "activities": activities,
                                                        "with_stack": False}, timeout=120)
                res = stream_generate(args.port, prompt, one_token)
                http_json(f"{srv.base}/stop_profile", {}, timeout=600)
                if res.error:
                    raise RuntimeError(f"{name} request: {res.error}")
                row[f"ttft_{name}_s"] = round(res.ttft, 4)
                row[f"{name}_trace_files"] = [p.name for p in wait_for_traces(where)]
                flush_radix_cache(srv.base)
        row.update(summarize_events(read_traces(folder)))
        row["host_during_gpu_wait"] = host_during_gaps(idle_gaps(read_traces(host_folder)),
                                                       read_traces(host_folder, host_events))
        row["status"] = "ok"
    except Exception as e:   # the row records it; the other configurations still run
        row.update(status="error", error=f"{type(e).__name__}: {e}"[:800])
    return row


def compare(rows: list[dict], headline: str = HEADLINE) -> dict:
    """Per peer: the headline's kernel time per kind less the peer's, and the busy, span and host-wait differences
    (ms per prefill; above 0: the headline spends more)."""
    ok = {r["config"]: r for r in rows if r.get("status") == "ok"}
    head = ok.get(headline)
    out = {}
    if head is None:
        return out
    for config, r in ok.items():
        if config == headline:
            continue
        kinds = sorted(set(head["kernels_ms"]) | set(r["kernels_ms"]))
        out[f"delta_ms_vs_{config}"] = {
            **{k: round(head["kernels_ms"].get(k, 0.0) - r["kernels_ms"].get(k, 0.0), 3) for k in kinds},
            **{k: round(head[k] - r[k], 3) for k in ("busy_ms", "span_ms", "host_wait_ms")},
            "ttft_s": round(head["ttft_s"] - r["ttft_s"], 4)}
        clocks = [x.get("gpu_clocks_timed", {}).get("sm_clock_mhz") for x in (head, r)]
        if all(clocks):   # the timed prefill's median SM clock: a compute-bound kind's difference may be this
            out[f"delta_ms_vs_{config}"]["sm_clock_mhz_median"] = clocks[0]["median"] - clocks[1]["median"]
    return out


def _clock_words(clocks: dict) -> str:
    if "sm_clock_mhz" not in clocks:
        return f"; GPU clocks: {clocks.get('error', 'not sampled')}"
    held = ", ".join(f"{k} {v:.0%}" for k, v in clocks["reasons"].items()) or "none"
    return (f"; timed prefill at SM {clocks['sm_clock_mhz']['median']:.0f} MHz median "
            f"({clocks['sm_clock_mhz']['min']:.0f}-{clocks['sm_clock_mhz']['max']:.0f}), "
            f"{clocks['power_w']['mean']:.0f} W mean, clock-event reasons: {held}")


def main(argv=None) -> int:
    ap = cli.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=f"{HEADLINE},sglang-fa3-fp8kv",
                    help=f"comma-separated, the first one set against the others (of {', '.join(CONFIGS)})")
    ap.add_argument("--input-len", type=int, default=32768, help="prompt tokens (default %(default)s)")
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results folder (default {DEFAULT_OUT.relative_to(REPO)})")
    ap.add_argument("--port", type=int, default=PORT)
    args = ap.parse_args(argv)
    configs = ap.comma_list("--configs", args.configs, CONFIGS)
    max_pos = model_config(args.model)["max_position_embeddings"]
    if not 0 < args.input_len < max_pos:
        ap.error(f"--input-len must be in 1..{max_pos - 1} ({args.model}'s positions less one output token), "
                 f"got {args.input_len}")
    out = args.out.resolve()
    if publish.is_published(out):
        ap.error(f"--out {args.out} is in the published results folder; this study writes to scratch (the lead "
                 "publishes)")
    logs, traces = out / "logs", out / "traces"
    logs.mkdir(parents=True, exist_ok=True)
    doc = {"meta": bench_meta.collect(" ".join([PROG] + list(argv if argv is not None else sys.argv[1:])),
                                      input_len=args.input_len, model=args.model, kinds=[k for k, _ in KINDS]),
           "rows": []}
    for config in configs:
        print(f"{config}: server, then four {args.input_len}-token prefills", flush=True)
        doc["rows"].append(profile_config(config, args, logs, traces))
        doc["summary"] = compare(doc["rows"], configs[0])
        (out / FILE).write_text(json.dumps(doc, indent=1) + "\n")   # after each configuration
    for r in doc["rows"]:
        if r["status"] != "ok":
            print(f"{r['config']}: {r['error']}")
            continue
        wait = r["host_during_gpu_wait"]
        print(f"{r['config']}: TTFT {r['ttft_s']:.3f} s; kernels {r['busy_ms']:.1f} ms busy of a {r['span_ms']:.1f} ms "
              f"span; " + ", ".join(f"{k} {v:.1f}" for k, v in r["kernels_ms"].items())
              + f"; with the host traced, the GPU idled {wait['gap_ms']:.1f} ms in {wait['gaps']} stretches"
              + _clock_words(r.get("gpu_clocks_timed", {})))
    print(json.dumps(doc["summary"], indent=1))
    print(f"wrote {out / FILE}")
    return 1 if any(r["status"] != "ok" for r in doc["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
