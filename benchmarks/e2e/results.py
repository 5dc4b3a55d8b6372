"""The SGLang end-to-end results file, ``benchmarks/results/e2e_sglang_h200.json``: the rows of
``benchmarks.e2e.sglang_check`` (agreement, capacity, launch) and ``benchmarks.e2e.throughput`` (throughput,
soak, tp) in one file, merged call by call, with its summary, README table and plot. Both scripts write it
through this module (as does ``benchmarks.e2e.merge_results``); neither imports the other.
"""
from __future__ import annotations

import sys
from pathlib import Path

from benchmarks import results_io
from benchmarks.e2e import runs
from benchmarks.stats import geomean
from mpfa_jit.ops.decode import RECIPES

RESULT = "e2e_sglang_h200"
ALL_PARTS = ("agreement", "capacity", "launch", "throughput", "soak", "tp")   # sglang_check's, then throughput's
# The throughput configurations, in the plot's order: SGLang's fa3 backend (its default on Hopper) with a BF16 and an
# FP8 KV cache, its FlashInfer backend (BF16 / FP8 KV), then mpfa's.
FA3_PEERS = ("sglang-fa3-bf16", "sglang-fa3-fp8kv")
CONFIGS = (*FA3_PEERS, "flashinfer-bf16", "flashinfer-fp8", "mpfa-bf16", "mpfa-qk8pv8", "mpfa-qk4pv8", "mpfa-qk4pv4")
# The peers the summary sets the headline recipe against, with its keys' suffixes.
PEERS = {"sglang-fa3-bf16": "sglang_fa3_bf16", "sglang-fa3-fp8kv": "sglang_fa3_fp8kv",
         "flashinfer-bf16": "flashinfer_bf16", "flashinfer-fp8": "flashinfer_fp8"}
FP8_WEIGHTS = "fp8"   # --weights fp8: SGLang's --quantization fp8 on both sides, rows of their own
NEW_TOKENS = 64                     # tokens the agreement part generates per prompt, and compares
SCORER = "flashinfer-bf16-scoring"  # the agreement part's teacher-forced scoring configuration
# README columns (benchmarks.report): one row per server started
TABLE = [("part", "part", "{}"), ("configuration", "config", "{}"), ("prompts", "prompt_set", "{}"),
         ("model", "model", "{}"), ("status", "status", "{}"), ("max_total_num_tokens", "max_total_num_tokens", "{:,}"),
         ("startup s", "startup_s", "{:.0f}"), ("error", "error", "{}")]


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
        if ratios.get("mpfa-qk4pv4") is not None:
            out["kv_capacity_ratio_qk4pv4"] = ratios["mpfa-qk4pv4"]
        out["kv_capacity_ratio_vs_flashinfer_bf16"] = ratios
    launch = [r for r in rows if r["part"] == "launch"]
    if launch:
        out["launch_command_serves_generate"] = all(r.get("status") == "ok" for r in launch)
    out.update(_throughput_summary(rows))
    return out


def kv_pool_tokens(rows: list[dict], model: str = "llama-3.1-8b") -> dict[str, int]:
    """max_total_num_tokens per configuration of ``model`` at TP 1, the default memory fraction and BF16 weights:
    from the capacity rows, overridden by the throughput rows (measured later, same server arguments), so a
    recipe whose format changed after the capacity run is counted as it serves now. Rows of quantized weights
    (``--weights fp8``) are left out: the memory their weights free goes to the pool."""
    pools = {}
    for part in ("capacity", "throughput"):
        for r in rows:
            if (r["part"] == part and r.get("status") == "ok" and r.get("max_total_num_tokens")
                    and r.get("model", "llama-3.1-8b") == model and r.get("tp", 1) == 1
                    and r.get("mem_fraction_static", 0.85) == 0.85 and r.get("quantization") is None):
                pools[r["config"].replace("fp8_e4m3", "fp8")] = r["max_total_num_tokens"]
    return pools


def _label(model: str, *parts) -> str:
    """A summary key: ``<length>[/<config>]`` for Llama-3.1-8B (the issue's model), ``<model>/...`` otherwise."""
    return "/".join(str(p) for p in (parts if model == "llama-3.1-8b" else (model, *parts)))


HEADLINE = "mpfa-qk4pv8"   # the recipe whose ratios over SGLang + FlashInfer the summary reports
# The fixed-length loads the summary's geomeans span (32K / 64K / 128K positions: 130048 + 1,024 output tokens
# fill Llama-3.1-8B's 131,072): a geomean over some of them would not be the same figure.
GEOMEAN_LENGTHS = (32768, 65536, 130048)


def _throughput_rows(rows: list[dict], workload: str, weights: str | None = None) -> list[dict]:
    """The throughput rows of ``workload`` that measured something, at TP 1, with BF16 weights or (``weights``)
    SGLang's ``--quantization`` of that name (rows from before ``--workload`` existed are fixed-length ones)."""
    return [r for r in rows if r["part"] == "throughput" and r.get("status") == "ok" and r.get("tp", 1) == 1
            and r.get("output_throughput") and r.get("workload", "fixed") == workload
            and r.get("quantization") == weights]


def _measured(rows: list[dict], place) -> tuple[dict[tuple, dict], dict[tuple, list[dict]]]:
    """({(*place, config): the newest row}, {place: the headline's rows, oldest first}) of ``rows``: a place can
    hold older headline rows that a peer's ratio still pairs with (``runs``)."""
    newest, heads = {}, {}
    for r in rows:
        newest[(*place(r), r["config"])] = r
        if r["config"] == HEADLINE:
            heads.setdefault(place(r), []).append(r)
    return newest, heads


def _pairs(measured: tuple[dict, dict], field: str, peer: str) -> dict[tuple, tuple[dict, dict]]:
    """{place: (headline row, ``peer``'s row)} where both were measured in one run (``runs.partner``), ran the
    same load and have ``field``; missing rows or fields, another run's or another load's rows leave it out."""
    newest, heads = measured
    out = {}
    for key in sorted(newest, key=str):
        *place, config = key
        if config != peer:
            continue
        other = newest[key]
        r = runs.partner(heads.get(tuple(place), []), other)
        if r and r.get(field) and other.get(field) and _same_load(r, other):
            out[tuple(place)] = (r, other)
    return out


def _headline_over(measured: tuple[dict, dict], field: str, peer: str) -> dict[tuple, float]:
    """{place: HEADLINE's ``field`` / ``peer``'s} over the pairs of one run (``_pairs``)."""
    return {place: r[field] / other[field] for place, (r, other) in _pairs(measured, field, peer).items()}


def _same_load(a: dict, b: dict) -> bool:
    """Whether two throughput rows sent the same requests (rows that do not say are taken to have)."""
    return a.get("requests") is None or b.get("requests") is None or a["requests"] == b["requests"]


def _throughput_summary(rows: list[dict]) -> dict:
    """Output-throughput ratios of mpfa qk4pv8 over each peer (SGLang's fa3 and FlashInfer backends, BF16 and FP8
    KV) per model and input length (TP 1), their geometric means for Llama-3.1-8B, the FP8-weights rows' ratios,
    TTFT and ITL at concurrency 1, the mixed workload's ratios, soak and TP checks."""
    by_length = lambda r: (r["model"], r["input_len"])   # noqa: E731
    fixed = _measured(_throughput_rows(rows, "fixed"), by_length)
    tput = fixed[0]
    out: dict = {}
    for peer, suffix in PEERS.items():
        key = f"output_throughput_ratio_vs_{suffix}"
        pairs = _pairs(fixed, "output_throughput", peer)
        if pairs:
            ratio = {place: r["output_throughput"] / p["output_throughput"] for place, (r, p) in pairs.items()}
            out[key] = {_label(*place): v for place, v in ratio.items()}
            llama = {place[1]: place for place in pairs if place[0] == "llama-3.1-8b"}
            # one figure over the three lengths for one build: a geomean over some lengths, or over lengths
            # measured with different mpfa kernels or host code (a rerun of some lengths only), would blend
            # figures; rows from before ``mpfa_host_source`` are judged by their kernels alone
            builds = {_build(pairs[place][0]) for place in llama.values()}
            hosts = {pairs[place][0].get("mpfa_host_source") for place in llama.values()} - {None}
            if set(GEOMEAN_LENGTHS) <= set(llama) and len(builds) == 1 and len(hosts) <= 1:
                out[key + "_geomean"] = geomean([ratio[llama[n]] for n in GEOMEAN_LENGTHS])
    fp8w = _measured(_throughput_rows(rows, "fixed", FP8_WEIGHTS), by_length)
    for peer, suffix in PEERS.items():
        over = _headline_over(fp8w, "output_throughput", peer)
        if over:
            out[f"fp8_weights_output_throughput_ratio_vs_{suffix}"] = {_label(*place): v for place, v in over.items()}
    # a lone request's latencies: TTFT is its prefill, the ITL (mean: its whole decode over its tokens) its decode
    for field, key in (("ttft_concurrency1_s", "ttft_concurrency1_ratio_vs_flashinfer_bf16"),
                       ("itl_concurrency1_mean_ms", "itl_concurrency1_ratio_vs_flashinfer_bf16")):
        ratios = {_label(*place): v for place, v in _headline_over(fixed, field, "flashinfer-bf16").items()}
        if ratios:
            out[key] = ratios
    out.update(_mixed_summary(rows))
    measured = {**{_label(m, n, c): r for (m, n, c), r in tput.items()},
                **{_label(m, n, c, f"{FP8_WEIGHTS}-weights"): r for (m, n, c), r in fp8w[0].items()},
                **{_label(r["model"], "mixed", r["config"]): r for r in _throughput_rows(rows, "mixed")}}
    # older headline rows a peer's ratio still pairs with (runs.merge keeps them): ``<label>@<commit>``
    measured.update({f"{_label(*place, HEADLINE)}@{str(r.get('commit') or '?')[:7]}": r
                     for place, heads in fixed[1].items() for r in heads[:-1]})
    if measured:
        # Rows of one results file come from different runs and builds (a rerun replaces only its own rows):
        # each ratio pairs two rows of one run, and the summary names every row's commit and load.
        out["throughput_rows_measured"] = {k: _provenance(r) for k, r in sorted(measured.items())}
    # Where a run's wall time goes: SGLang runs prefill chunks and decode batches in turn, and N requests'
    # prefill takes about N x TTFT(c=1); the rest is decode (docs/sglang.md, "Where the time goes"). Each entry
    # names its load: the newest row of a configuration may have run another request count than its neighbours.
    split = {}
    for (model, length, config), r in sorted(tput.items()):
        if r.get("ttft_concurrency1_s") and r.get("wall_s") and r.get("requests"):
            prefill = r["requests"] * r["ttft_concurrency1_s"]
            split[_label(model, length, config)] = {"requests": r["requests"], "prefill_s": prefill,
                                                    "decode_s": r["wall_s"] - prefill,
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
        # flashinfer's (mpfa serves TP=2 correctly when its drift is no larger), per mpfa configuration.
        drift = {"flashinfer": max(r["flashinfer_tp2_vs_tp1_mean_logprob_diff"] for r in tp)}
        drift.update({r["config"]: r["mpfa_tp2_vs_tp1_mean_logprob_diff"] for r in tp})
        out["tp2_vs_tp1_mean_logprob_diff"] = drift
        out["tp2_tp1_token_agreement_flashinfer"] = min(r["flashinfer_tp2_vs_tp1_token_agreement"] for r in tp)
    return out


def _build(row: dict):
    """What an mpfa row measured: its kernels' content-hashed names where it has them, else its commit."""
    return tuple(row["mpfa_kernels"]) if row.get("mpfa_kernels") else row.get("commit")


def _provenance(row: dict) -> str:
    """``<commit> · <n> requests`` of a throughput row: the build it measured and the load it ran."""
    return f"{str(row.get('commit') or '?')[:7]} · {row.get('requests', '?')} requests"


def _mixed_summary(rows: list[dict]) -> dict:
    """The mixed workload's ratios of mpfa qk4pv8 over SGLang + FlashInfer BF16, per model: output
    throughput, TTFT p50 (all requests) and ITL p50."""
    mixed = _measured(_throughput_rows(rows, "mixed"), lambda r: (r["model"],))
    out = {}
    for field, key in (("output_throughput", "mixed_output_throughput_ratio_vs_flashinfer_bf16"),
                       ("ttft_p50_s", "mixed_ttft_p50_ratio_vs_flashinfer_bf16"),
                       ("itl_p50_ms", "mixed_itl_p50_ratio_vs_flashinfer_bf16")):
        ratios = {model: v for (model,), v in _headline_over(mixed, field, "flashinfer-bf16").items()}
        if ratios:
            out[key] = ratios
    return out


# --- the file -----------------------------------------------------------------------------------------------------
def _merge_key(r: dict) -> tuple:
    return r.get("part"), r.get("prompt_set"), r.get("group")


def _pair_place(r: dict) -> tuple | None:
    """Where a throughput row's ratios pair it with another configuration's: its group less the configuration."""
    if r.get("part") != "throughput" or not r.get("group"):
        return None
    return tuple(p for p in r["group"].split("/") if p != r.get("config"))


def merge_rows(previous: list[dict], new: list[dict]) -> list[dict]:
    """The file's rows after a run: what was measured again (same part and prompt set, or same group for
    the throughput rows) replaces its earlier rows, except a headline row a kept peer's ratio pairs with
    (``runs.merge``); the rest stay."""
    merged = runs.merge(previous, new, _merge_key, _pair_place, HEADLINE)
    return sorted(merged, key=lambda r: ALL_PARTS.index(r["part"]))


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
    meta = {**meta, "run": meta.get("run") or runs.current(meta.get("commit"))}
    this = {k: meta.get(k) for k in ("command", "commit", "date", "parts", "run")}
    return {**meta, "calls": calls + [this]}


def plotted_throughput(by: dict[tuple, dict]) -> dict[tuple, float]:
    """{(model, length, config): output tok/s} of the rows the plot shows: beside each length's headline row
    only the rows of its load (a rerun with other ``--fills`` leaves older rows of other configurations at
    that length, which ran other requests)."""
    return {key: r["output_throughput"] for key, r in by.items() if _same_load(r, by.get((*key[:2], HEADLINE), r))}


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """Output throughput per input length and configuration (the fixed-length throughput rows, TP 1), one
    plot per model in one figure's groups: ``<model> <length>``."""
    ok = _throughput_rows(rows, "fixed")   # a mixed row has no one input length to stand at
    if not ok:
        return []
    from benchmarks import plots
    groups = sorted({(r["model"], r["input_len"]) for r in ok})
    measured = _measured(ok, lambda r: (r["model"], r["input_len"]))
    by = measured[0]
    val = plotted_throughput(by)
    configs = [c for c in CONFIGS if any(key[2] == c for key in val)]
    # under each group the headline's ratio over SGLang's default (fa3 BF16) where measured in one run with it,
    # else over fa3 FP8-KV, else over FlashInfer BF16; and the commit of that run
    ratio = {}
    for peer, name in (("flashinfer-bf16", "flashinfer bf16"), ("sglang-fa3-fp8kv", "fa3 fp8kv"),
                       ("sglang-fa3-bf16", "fa3 bf16")):
        for place, (r, other) in _pairs(measured, "output_throughput", peer).items():
            ratio[place] = (f"\nqk4pv8 {r['output_throughput'] / other['output_throughput']:.2f}x {name}"
                            f" ({str(r.get('commit') or '')[:7]})")
    labels = [f"{m} {n:,} in" + ratio.get((m, n), "") for m, n in groups]
    series = {c: [val.get((m, n, c)) for m, n in groups] for c in configs}
    return [plots.bar(labels, series, Path(out_dir) / f"{RESULT}.png", title="SGLang output throughput, H200, 1,024 output tokens",
                      ylabel="output tokens / s")]


def write_rows(previous_rows: list[dict], new_rows: list[dict], out_dir: Path, meta: dict) -> list[dict]:
    """Merge ``new_rows`` (each stamped with this call's commit) into the rows the file had when the run
    started, write it with the summary of the result, return the rows. Called after every configuration:
    a killed run keeps what finished."""
    for r in new_rows:
        r.setdefault("commit", meta.get("commit"))
        if meta.get("run"):
            r.setdefault("run", meta["run"])
    rows = merge_rows(previous_rows, new_rows)
    results_io.write(RESULT, meta, summarize(rows), rows, out_dir)
    try:
        plot(rows, out_dir)
    except RuntimeError as e:   # no matplotlib: the JSON is the result, the plot a view of it
        print(f"no plot: {e}", file=sys.stderr)
    return rows
