"""CPU tests of benchmarks/e2e: the SGLang check's prompt plan, agreement arithmetic, summary and row
merging (pure functions over rows: no SGLang, no GPU), and the SmolLM2 GGUF -> HF conversion (when the
model and ``gguf`` are installed)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks.e2e import results
from benchmarks.e2e import serving
from benchmarks.e2e import sglang_check as sc
from benchmarks.e2e import smollm2_hf
from benchmarks.e2e import throughput as tp
from benchmarks.e2e.server import StreamResult, _tokens_so_far

REPO = Path(__file__).resolve().parents[2]


def test_prompt_lengths_span_one_to_many_pages():
    lengths = sc.prompt_lengths()
    assert len(lengths) == sc.NUM_PROMPTS == 20
    assert lengths == sorted(lengths) and lengths[0] == 16 and 6000 <= lengths[-1] < 8192 - results.NEW_TOKENS
    assert sum(n % sc.PAGE_SIZE != 0 for n in lengths) >= 15   # most end inside a page


def test_agreement_is_positionwise_over_the_first_tokens():
    ref = [[1, 2, 3, 4], [5, 6]]
    assert results._agreement(ref, ref) == 1.0
    assert results._agreement(ref, [[1, 9, 3, 4], [5, 6]]) == 5 / 6
    assert results._agreement(ref, [[1, 2, 3, 4, 7], [0, 6]], n=2) == 3 / 4


def test_logprob_gaps():
    scored = {"chosen_logprob": [-0.1, -2.0, -0.5], "top1_logprob": [-0.1, -0.7, -0.5 + 1e-9]}
    gaps = sc.logprob_gaps(scored)
    assert gaps[0] == 0.0 and gaps[1] == pytest.approx(1.3) and gaps[2] == pytest.approx(1e-9)
    with pytest.raises(ValueError, match="no log-probability"):
        sc.logprob_gaps({"chosen_logprob": [None], "top1_logprob": [-1.0]})


def _agreement_rows(pset="stdlib"):
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    rows = [{"part": "agreement", "prompt_set": pset, "config": "flashinfer-bf16", "status": "ok",
             "output_ids": ref, "output_ids_cached_pass": [[1, 2, 3, 4], [5, 6, 0, 0]]},
            {"part": "agreement", "prompt_set": pset, "config": "mpfa-bf16-graphs-on", "status": "ok",
             "output_ids": ref, "output_ids_cached_pass": ref},
            {"part": "agreement", "prompt_set": pset, "config": "mpfa-qk4pv8-graphs-on", "status": "ok",
             "output_ids": [[1, 2, 9, 9], [5, 6, 7, 8]], "output_ids_cached_pass": [[1, 2, 9, 9], [5, 6, 7, 8]]},
            {"part": "agreement", "prompt_set": pset, "config": "mpfa-qk4pv8-graphs-off", "status": "ok",
             "output_ids": [[1, 2, 9, 9], [5, 6, 7, 0]], "output_ids_cached_pass": [[1, 2, 9, 9], [5, 6, 7, 0]]},
            {"part": "agreement", "prompt_set": pset, "config": results.SCORER, "status": "ok",
             "logprob_gaps": {"flashinfer-bf16": [[0, 0, 0.02, 0], [0, 0, 0, 0]],
                              "mpfa-bf16-graphs-on": [[0, 0, 0.01, 0], [0, 0, 0, 0]],
                              "mpfa-qk4pv8-graphs-on": [[0, 0, 0.5, 0.01], [0, 0, 0, 0]]}}]
    return rows


def test_summary_of_agreement_rows():
    s = results.summarize(_agreement_rows())
    d = s["agreement_by_prompt_set"]["stdlib"]
    assert s["greedy_agreement"] == {"bf16": 1.0, "qk4pv8": 0.75}
    assert d["reference_self_agreement"] == 0.75
    assert d["cuda_graph_on_off_agreement"] == {"qk4pv8": 7 / 8}
    assert d["greedy_agreement_graphs_off"] == {"qk4pv8": 5 / 8}
    assert d["reference_max_logprob_gap"] == 0.02
    assert d["teacher_forced_agreement"] == {"bf16": 7 / 8, "qk4pv8": 6 / 8}
    assert d["tie_aware_agreement"] == {"bf16": 1.0, "qk4pv8": 7 / 8}


def test_summary_takes_the_worst_prompt_set_and_survives_partial_runs():
    rows = _agreement_rows("stdlib") + _agreement_rows("kjv")
    kjv_q4 = next(r for r in rows if r["prompt_set"] == "kjv" and r["config"] == "mpfa-qk4pv8-graphs-on")
    kjv_q4["output_ids"] = [[0, 0, 0, 0], [5, 6, 7, 8]]     # worse on kjv than on stdlib
    s = results.summarize(rows)
    assert s["greedy_agreement"]["qk4pv8"] == 0.5 and set(s["agreement_by_prompt_set"]) == {"stdlib", "kjv"}
    only_ref = results.summarize(_agreement_rows()[:1])   # a run killed after the reference
    assert only_ref["greedy_agreement"] == {} and "reference_self_agreement" in only_ref["agreement_by_prompt_set"]["stdlib"]
    assert results.summarize([]) == {}


def test_summary_of_capacity_and_launch():
    rows = [{"part": "capacity", "config": "flashinfer-bf16", "status": "ok", "max_total_num_tokens": 1000},
            {"part": "capacity", "config": "mpfa-qk4pv8", "status": "ok", "max_total_num_tokens": 2510},
            {"part": "capacity", "config": "mpfa-qk8pv8", "status": "error", "error": "boom"},
            {"part": "launch", "config": "llama-3.1-8b-qk4pv8", "status": "ok"}]
    s = results.summarize(rows)
    assert s["kv_capacity_ratio"] == 2.51 and "mpfa-qk8pv8" not in s["kv_capacity_ratio_vs_flashinfer_bf16"]
    assert s["launch_command_serves_generate"] is True
    rows[-1]["status"] = "error"
    assert results.summarize(rows)["launch_command_serves_generate"] is False


def test_capacity_of_a_recipe_comes_from_its_newest_rows():
    """A recipe whose format changed after the capacity run: the throughput rows (same server arguments)
    override it, a superseded row is ignored, and SGLang's fp8 pool is one configuration under both names."""
    rows = [{"part": "capacity", "config": "flashinfer-bf16", "status": "ok", "max_total_num_tokens": 1000},
            {"part": "capacity", "config": "flashinfer-fp8_e4m3", "status": "ok", "max_total_num_tokens": 2000},
            {"part": "capacity", "config": "mpfa-qk4pv8", "status": "superseded", "max_total_num_tokens": 2510},
            {"part": "throughput", "model": "llama-3.1-8b", "tp": 1, "config": "mpfa-qk4pv8", "status": "ok",
             "max_total_num_tokens": 2207},
            {"part": "throughput", "model": "qwen3-14b", "tp": 1, "config": "mpfa-qk4pv8", "status": "ok",
             "max_total_num_tokens": 999},
            {"part": "throughput", "model": "llama-3.1-8b", "tp": 1, "config": "mpfa-bf16", "status": "ok",
             "mem_fraction_static": 0.5, "max_total_num_tokens": 400}]
    s = results.summarize(rows)
    assert s["kv_capacity_ratio"] == 2.207
    assert s["kv_capacity_ratio_vs_flashinfer_bf16"] == {"flashinfer-bf16": 1.0, "flashinfer-fp8": 2.0,
                                                         "mpfa-qk4pv8": 2.207}


def test_merge_rows_replaces_what_was_measured_again():
    old = [{"part": "agreement", "prompt_set": "stdlib", "config": "a"},
           {"part": "agreement", "prompt_set": "kjv", "config": "a"},
           {"part": "capacity", "config": "x"}, {"part": "launch", "config": "l"}]
    new = [{"part": "agreement", "prompt_set": "kjv", "config": "b"}, {"part": "capacity", "config": "y"}]
    merged = results.merge_rows(old, new)
    assert [(r["part"], r.get("prompt_set"), r["config"]) for r in merged] == [
        ("agreement", "stdlib", "a"), ("agreement", "kjv", "b"), ("capacity", None, "y"), ("launch", None, "l")]


def test_engine_args_keep_mpfa_prefill_graphs_off():
    a = sc._engine_args(Path("/m"), "mpfa", graphs=True, mem_fraction=0.3, context_length=8192, dummy=True)
    assert a["disable_prefill_cuda_graph"] and "disable_decode_cuda_graph" not in a and a["load_format"] == "dummy"
    f = sc._engine_args(Path("/m"), "flashinfer", graphs=False, mem_fraction=0.3, context_length=8192, dummy=False,
                        kv_cache_dtype="fp8_e4m3")
    assert f["disable_decode_cuda_graph"] and f["kv_cache_dtype"] == "fp8_e4m3" and "load_format" not in f


def test_committed_result_summary_matches_its_rows():
    path = REPO / "benchmarks" / "results" / f"{results.RESULT}.json"
    if not path.exists():
        pytest.skip("no committed e2e_sglang_h200.json yet")
    result = json.loads(path.read_text())
    from benchmarks.report import _same
    from benchmarks.results_io import normalize
    assert _same(normalize(results.summarize(result["rows"])), normalize(result["summary"]))


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K row permutation (the inverse of smollm2_hf._unpermute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("heads", [3, 9])
def test_unpermute_inverts_llama_cpp(heads):
    w = np.random.default_rng(0).standard_normal((heads * 64, 40)).astype(np.float32)
    assert np.array_equal(smollm2_hf._unpermute(_llama_cpp_permute(w, heads), heads), w)
    assert not np.array_equal(_llama_cpp_permute(w, heads), w)


def test_conversion_matches_the_committed_config(tmp_path):
    from benchmarks.accuracy import model
    why = model.missing_requirements()
    if why:
        pytest.skip(f"SmolLM2 GGUF not available here: {why}")
    import gguf
    reader = gguf.GGUFReader(str(Path(model.gguf_dir()) / model.GGUF_NAME))
    cfg = smollm2_hf.hf_config(reader)
    committed = json.loads((REPO / "server_configs/models/smollm2-135m/config.json").read_text())
    assert cfg == committed


# --- benchmarks.e2e.throughput / server: the pure parts (the servers run on the H200) -----------------------------


def test_server_argv_per_configuration():
    argv, env = tp.server_argv("flashinfer-fp8", "llama-3.1-8b", context_length=33856, mem_fraction=0.85, tp=1, port=9)
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e4m3" and argv[argv.index("--attention-backend") + 1] == "flashinfer"
    assert env == {} and "--disable-prefill-cuda-graph" not in argv
    assert argv[argv.index("--log-level") + 1] == "warning"   # quiet throughput servers unless log_level says else
    assert "--log-level" not in tp.server_argv("flashinfer-fp8", "llama-3.1-8b", context_length=33856, mem_fraction=0.85,
                                               tp=1, port=9, log_level=None)[0]
    # mpfa: the prefill graph is the plugin's choice, as for the plain command
    argv, env = tp.server_argv("mpfa-qk4pv8", "qwen3-14b", context_length=66560, mem_fraction=0.85, tp=2, port=9)
    assert env == {"MPFA_RECIPE": "qk4pv8"} and "--disable-prefill-cuda-graph" not in argv
    assert argv[argv.index("--tp-size") + 1] == "2" and argv[argv.index("--model-path") + 1].endswith("qwen3-14b")
    assert argv[argv.index("--page-size") + 1] == "16" and "--load-format" in argv and "--quantization" not in argv
    # SGLang's fa3 backend, BF16 and FP8 KV; FP8 weights on any configuration
    argv, env = tp.server_argv("sglang-fa3-bf16", "llama-3.1-8b", context_length=33856, mem_fraction=0.85, tp=1, port=9)
    assert argv[argv.index("--attention-backend") + 1] == "fa3" and "--kv-cache-dtype" not in argv and env == {}
    argv, env = tp.server_argv("sglang-fa3-fp8kv", "llama-3.1-8b", context_length=33856, mem_fraction=0.85, tp=1,
                               port=9, weights="fp8")
    assert argv[argv.index("--attention-backend") + 1] == "fa3" and argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    assert argv[argv.index("--quantization") + 1] == "fp8"


def test_summary_sets_the_headline_against_every_peer_and_keeps_fp8_weight_rows_apart():
    def row(config, length, tput, **kw):
        return {"part": "throughput", "status": "ok", "model": "llama-3.1-8b", "config": config, "input_len": length,
                "output_throughput": tput, "requests": 10, "commit": "abc", **kw}
    rows = [row(c, n, t) for n in results.GEOMEAN_LENGTHS
            for c, t in (("sglang-fa3-bf16", 100.0), ("sglang-fa3-fp8kv", 125.0), ("flashinfer-bf16", 80.0),
                         ("mpfa-qk4pv8", 150.0))]
    rows += [row(c, 65536, t, quantization="fp8", max_total_num_tokens=10 ** 7)
             for c, t in (("sglang-fa3-bf16", 200.0), ("mpfa-qk4pv8", 300.0))]
    # the pools (capacity ratios, request counts) are BF16-weight servers': the FP8-weight rows' larger ones stay out
    assert results.kv_pool_tokens(rows) == {}
    s = results.summarize(rows)
    assert s["output_throughput_ratio_vs_sglang_fa3_bf16_geomean"] == pytest.approx(1.5)
    assert s["output_throughput_ratio_vs_sglang_fa3_fp8kv_geomean"] == pytest.approx(1.2)
    assert s["output_throughput_ratio_vs_flashinfer_bf16"] == {str(n): pytest.approx(1.875) for n in results.GEOMEAN_LENGTHS}
    # the FP8-weights rows: their own ratios, never mixed into the BF16-weights ones
    assert s["fp8_weights_output_throughput_ratio_vs_sglang_fa3_bf16"] == {"65536": pytest.approx(1.5)}
    assert "fp8_weights_output_throughput_ratio_vs_sglang_fa3_fp8kv" not in s


def test_same_inputs_for_every_configuration():
    a, b = tp.make_inputs(3, 50, 1000), tp.make_inputs(3, 50, 1000)
    assert a == b and len(a) == 3 and all(len(x) == 50 and 100 <= min(x) and max(x) < 900 for x in a)
    assert tp.make_inputs(3, 50, 1000, seed=1) != a


def test_requests_fill_the_largest_pool_twice():
    rows = [{"part": "capacity", "model": "llama-3.1-8b", "config": "flashinfer-bf16", "status": "ok",
             "max_total_num_tokens": 1000},
            {"part": "capacity", "model": "llama-3.1-8b", "config": "flashinfer-fp8_e4m3", "status": "ok",
             "max_total_num_tokens": 2000},
            {"part": "agreement", "model": "smollm2-135m", "config": "mpfa-qk4pv8-graphs-on", "status": "ok",
             "max_total_num_tokens": 99999}]
    pools = tp.estimated_pool_tokens(rows, "llama-3.1-8b", tp.CONFIGS)
    assert pools["flashinfer-fp8"] == 2000 and pools["mpfa-qk4pv8"] == int(1000 * 512 / tp.BYTES_PER_TOKEN_HEAD_D128["mpfa-qk4pv8"])   # measured / bytes ratio
    assert max(pools.values()) == pools["mpfa-qk4pv4"]   # the smallest cache row, the largest pool
    assert tp.requests_to_fill(pools, tp.CONFIGS, 90, 10) == -(-2 * pools["mpfa-qk4pv4"] // 100)
    assert tp.requests_to_fill(pools, ["flashinfer-bf16"], 90, 10) == 20
    with pytest.raises(ValueError, match="no measured max_total_num_tokens"):
        tp.estimated_pool_tokens(rows[2:], "qwen3-14b", tp.CONFIGS)


def test_a_model_without_measurements_gets_its_pool_from_another_models():
    """Qwen3-14B's BF16 pool from Llama-3.1-8B's: the same KV bytes less the extra weight bytes."""
    llama_pool = 845_632
    rows = [{"part": "capacity", "model": "llama-3.1-8b", "config": "flashinfer-bf16", "status": "ok",
             "max_total_num_tokens": llama_pool}]
    assert tp.weight_bytes("llama-3.1-8b") == 2 * (8_030_261_248 - 266_240)   # its published count less the norms
    kv_bytes = llama_pool * 32 * 8 * 512 - (tp.weight_bytes("qwen3-14b") - tp.weight_bytes("llama-3.1-8b"))
    pools = tp.estimated_pool_tokens(rows, "qwen3-14b", tp.CONFIGS)
    assert pools["flashinfer-bf16"] == kv_bytes // (40 * 8 * 512)
    assert 500_000 < pools["flashinfer-bf16"] < llama_pool


def test_stream_metrics():
    r = StreamResult(start=10.0, chunk_times=[10.5, 10.6, 10.9], chunk_tokens=[1, 2, 5])
    assert r.ttft == 0.5 and r.output_tokens == 5
    assert r.itls() == pytest.approx([0.1, 0.1, 0.1, 0.1])
    bad = StreamResult(start=0.0, error="HTTP 500")
    s = tp.summarize_run([r, bad], wall_s=2.0, input_lens=[100, 7000])   # the failed one's prompt not counted
    assert s["completed"] == 1 and s["errors"] == 1 and s["first_error"] == "HTTP 500"
    assert s["output_throughput"] == 2.5 and s["total_throughput"] == 52.5 and s["ttft_mean_s"] == 0.5
    assert s["itl_mean_ms"] == pytest.approx(100.0)
    assert _tokens_so_far({"meta_info": {"completion_tokens": 7}}, 3, [1]) == 7
    assert _tokens_so_far({}, 3, [1, 2]) == 5


def test_throughput_summary():
    def row(config, length, t, model="llama-3.1-8b", ttft=1.0):
        return {"part": "throughput", "model": model, "config": config, "input_len": length, "tp": 1, "status": "ok",
                "output_throughput": t, "ttft_concurrency1_s": ttft, "group": f"{model}/{length}/{config}"}
    rows = [row("flashinfer-bf16", 32768, 100.0), row("mpfa-qk4pv8", 32768, 250.0, ttft=0.9),
            row("flashinfer-fp8", 32768, 200.0),
            row("flashinfer-bf16", 65536, 50.0), row("mpfa-qk4pv8", 65536, 160.0),
            row("flashinfer-bf16", 65536, 10.0, model="qwen3-14b"), row("mpfa-qk4pv8", 65536, 30.0, model="qwen3-14b"),
            {"part": "soak", "status": "ok", "group": "soak/x"},
            *({"part": "tp", "status": "ok", "config": c, "group": f"tp/x/{c}", "tp2_tp1_token_agreement": agree,
               "mpfa_tp2_vs_tp1_mean_logprob_diff": d, "flashinfer_tp2_vs_tp1_mean_logprob_diff": 0.015,
               "flashinfer_tp2_vs_tp1_token_agreement": 0.85} for c, agree, d in (("mpfa-bf16", 1.0, 0.014),
                                                                                  ("mpfa-qk4pv8", 0.9, 0.02)))]
    s = results.summarize(rows)
    assert s["output_throughput_ratio_vs_flashinfer_bf16"] == {"32768": 2.5, "65536": 3.2, "qwen3-14b/65536": 3.0}
    # the geomean spans 32K, 64K and 128K: without the 128K pair there is none
    assert "output_throughput_ratio_vs_flashinfer_bf16_geomean" not in s
    s = results.summarize(rows + [row("flashinfer-bf16", 130048, 50.0), row("mpfa-qk4pv8", 130048, 100.0)])
    assert s["output_throughput_ratio_vs_flashinfer_bf16_geomean"] == pytest.approx((2.5 * 3.2 * 2.0) ** (1 / 3))
    assert s["output_throughput_ratio_vs_flashinfer_fp8"] == {"32768": 1.25}
    assert s["ttft_concurrency1_ratio_vs_flashinfer_bf16"]["32768"] == pytest.approx(0.9)
    assert s["soak_ok"] is True and s["tp2_tp1_token_agreement"] == 0.9
    assert s["tp2_vs_tp1_mean_logprob_diff"] == {"flashinfer": 0.015, "mpfa-bf16": 0.014, "mpfa-qk4pv8": 0.02}
    assert s["tp2_tp1_token_agreement_flashinfer"] == 0.85
    assert "wall_time_split_estimate" not in s   # no wall time and request count in these rows
    timed = [dict(r, wall_s=40.0, requests=10) for r in rows[:2]]
    split = results.summarize(timed)["wall_time_split_estimate"]
    assert split["32768/mpfa-qk4pv8"] == {"requests": 10, "prefill_s": 9.0, "decode_s": 31.0, "prefill_share": 9.0 / 40.0}
    merged = results.merge_rows(rows, [row("mpfa-qk4pv8", 32768, 300.0)])
    assert len(merged) == len(rows) and results.summarize(merged)["output_throughput_ratio_vs_flashinfer_bf16"]["32768"] == 3.0


@pytest.mark.parametrize("leading_none", [True, False])
def test_scored_positions_align_to_the_output_tokens(leading_none):
    # prompt [5, 6, 7] + output [8, 9]; asked from position 2, so entries cover positions 2..4 (SGLang
    # versions differ on whether the first carries a value); positions 3 and 4 are the scored ones.
    s = {"ids": [5, 6, 7, 8, 9], "start": 3}
    first = [None, 7, None] if leading_none else [-0.5, 7, None]
    meta = {"input_token_logprobs": [first, [-1.0, 8, None], [-2.0, 9, None]],
            "input_top_logprobs": [[], [[-0.25, 4, None]], [[-2.0, 9, None]]]}
    got = sc._scored_positions(s, meta)
    assert got == {"chosen_logprob": [-1.0, -2.0], "top1_logprob": [-0.25, -2.0], "top1_id": [4, 9]}
    assert sc.logprob_gaps(got) == [0.75, 0.0]
    meta["input_token_logprobs"][1][1] = 3
    with pytest.raises(ValueError, match="misaligned"):
        sc._scored_positions(s, meta)


def test_with_calls_keeps_every_calls_provenance(monkeypatch):
    monkeypatch.setenv("MPFA_RUN", "r1")
    first = results.with_calls({"command": "a", "commit": "c1", "date": "d1", "parts": ["capacity"]}, {})
    assert first["calls"] == [{"command": "a", "commit": "c1", "date": "d1", "parts": ["capacity"], "run": "r1"}]
    assert first["run"] == "r1"
    second = results.with_calls({"command": "b", "commit": "c2", "date": "d2", "parts": ["agreement"]}, first)
    assert [c["commit"] for c in second["calls"]] == ["c1", "c2"] and second["command"] == "b"
    legacy = results.with_calls({"command": "b", "commit": "c2"}, {"command": "a", "commit": "c0"})
    assert [c["commit"] for c in legacy["calls"]] == ["c0", "c2"]


def test_throughput_plot_has_one_bar_per_measured_configuration(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"part": "throughput", "model": "llama-3.1-8b", "input_len": n, "config": c, "tp": 1, "status": "ok",
             "output_throughput": t} for n, c, t in ((32768, "flashinfer-bf16", 383.0), (32768, "mpfa-qk4pv8", 559.0),
                                                    (65536, "mpfa-qk4pv8", 300.0))]
    rows.append({"part": "throughput", "model": "llama-3.1-8b", "input_len": 32768, "config": "flashinfer-fp8",
                 "tp": 1, "status": "error"})
    (path,) = results.plot(rows, tmp_path)
    assert path.name == "e2e_sglang_h200.png" and path.stat().st_size > 1000
    assert results.plot([r for r in rows if r["config"] == "flashinfer-fp8"], tmp_path / "none") == []


def test_merge_results_takes_each_queues_new_rows_and_calls(tmp_path):
    from benchmarks import results_io
    from benchmarks.e2e import merge_results as mr
    old = {"part": "throughput", "group": "llama/in32768/bf16", "config": "flashinfer-bf16", "status": "ok", "v": 1,
           "model": "llama-3.1-8b", "input_len": 32768, "output_throughput": 100.0, "commit": "a"}
    base_meta = {"gpu": "H200", "calls": [{"command": "first", "commit": "a"}]}
    results_io.write(results.RESULT, base_meta, results.summarize([old]), [old], tmp_path)
    queues = []
    for i, (group, v) in enumerate((("llama/in65536/bf16", 2), ("llama/in65536/qk4", 3))):
        row = {**old, "group": group, "config": ("flashinfer-bf16", "mpfa-qk4pv8")[i], "input_len": 65536, "v": v,
               "commit": "b"}
        meta = {"gpu": f"H200 #{i}", "calls": base_meta["calls"] + [{"command": f"queue {i}", "commit": "b"}]}
        q = tmp_path / f"q{i}"
        results_io.write(results.RESULT, meta, results.summarize([old, row]), [old, row], q)
        queues.append(str(q / f"{results.RESULT}.json"))
    assert mr.main(queues + ["--out", str(tmp_path)]) == 0
    merged = results_io.read(tmp_path / f"{results.RESULT}.json")
    assert sorted(r["v"] for r in merged["rows"]) == [1, 2, 3]
    assert [c["command"] for c in merged["meta"]["calls"]] == ["first", "queue 0", "queue 1"]
    assert merged["meta"]["gpu"] == "H200 #1"
    assert mr.main(queues + ["--out", str(tmp_path)]) == 1   # nothing new the second time
    with pytest.raises(SystemExit):
        mr.main([str(tmp_path / "missing.json"), "--out", str(tmp_path)])


def test_server_env_keeps_nvlink_multicast_off_and_drops_mpfa_settings(monkeypatch):
    from benchmarks.e2e.server import server_env
    monkeypatch.setenv("MPFA_RECIPE", "bf16")
    monkeypatch.setenv("MPFA_CACHE_DIR", "/tmp/c")
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    env = server_env(MPFA_RECIPE="qk4pv8")
    assert env["MPFA_RECIPE"] == "qk4pv8" and env["MPFA_CACHE_DIR"] == "/tmp/c"
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1"


# --- benchmarks.e2e.serving: SGLang's bench_serving against each configuration ------------------------------------


def test_serving_servers_name_the_tokenizer_and_keep_the_throughput_runs_settings(tmp_path):
    argv, env = serving.server_command("sglang-fa3-fp8kv", 66624, 9, tmp_path)
    tok = str(serving.tokenizer_dir(tmp_path))
    assert "--skip-tokenizer-init" not in argv and argv[argv.index("--tokenizer-path") + 1] == tok
    assert argv[argv.index("--attention-backend") + 1] == "fa3" and argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    assert argv[argv.index("--page-size") + 1] == "16" and argv[argv.index("--context-length") + 1] == "66624"
    assert "--log-level" not in argv   # the peer's batch lines logged, as mpfa's are
    # mpfa through its launcher, from a copy of the served YAML
    argv, env = serving.server_command("mpfa-qk4pv8", 66624, 9, tmp_path)
    assert argv[1:3] == ["-m", "mpfa.sglang.launch"] and argv[-2:] == ["--port", "9"] and env == {}
    from mpfa.sglang.launch import build_launch
    plan = build_launch(argv[3], env={})
    assert "--skip-tokenizer-init" not in plan.argv and plan.env["MPFA_RECIPE"] == "qk4pv8"
    assert plan.argv[plan.argv.index("--tokenizer-path") + 1] == tok
    assert plan.argv[plan.argv.index("--context-length") + 1] == "66624"
    assert plan.argv[plan.argv.index("--page-size") + 1] == "16" and "--load-format" in plan.argv
    # qk4pv4 from its own served YAML, when asked for (not in the default set)
    argv, _ = serving.server_command("mpfa-qk4pv4", 66624, 9, tmp_path)
    assert build_launch(argv[3], env={}).env["MPFA_RECIPE"] == "qk4pv4"
    assert "mpfa-qk4pv4" in serving.CONFIGS and "mpfa-qk4pv4" not in serving.DEFAULT_CONFIGS
    # on two GPUs: SGLang's --tp-size for the peers, the YAML's for mpfa
    argv, _ = serving.server_command("sglang-fa3-bf16", 66624, 9, tmp_path, tp=2)
    assert argv[argv.index("--tp-size") + 1] == "2"
    argv, _ = serving.server_command("mpfa-qk4pv8", 66624, 9, tmp_path, tp=2)
    plan = build_launch(argv[3], env={})
    assert plan.argv[plan.argv.index("--tp-size") + 1] == "2"
    # --mixed-chunk: SGLang's --enable-mixed-chunk on both sides (mpfa's through its launcher's extra arguments)
    argv, _ = serving.server_command("sglang-fa3-fp8kv", 66624, 9, tmp_path, mixed_chunk=True)
    assert "--enable-mixed-chunk" in argv
    assert "--enable-mixed-chunk" not in serving.server_command("sglang-fa3-fp8kv", 66624, 9, tmp_path)[0]
    argv, _ = serving.server_command("mpfa-qk4pv8", 66624, 9, tmp_path, mixed_chunk=True)
    extra = argv[argv.index("--") + 1:]
    assert extra == ["--port", "9", "--enable-mixed-chunk"]
    assert build_launch(argv[3], extra_args=extra, env={}).argv[-1] == "--enable-mixed-chunk"


def test_serving_client_is_sglangs_with_the_same_prompts_for_everyone(tmp_path):
    cmd = serving.client_command(9, 0.3, 100, 1, tmp_path / "x.jsonl", tmp_path / "tok")
    assert cmd[1:3] == ["-m", "sglang.bench_serving"]
    flag = lambda f: cmd[cmd.index(f) + 1]
    assert flag("--dataset-name") == "random-ids" and "--tokenize-prompt" in cmd and "--flush-cache" in cmd
    assert int(flag("--random-input-len")) * float(flag("--random-range-ratio")) == 1024
    assert (flag("--num-prompts"), flag("--request-rate"), flag("--seed")) == ("100", "0.3", "1")
    assert "--output-details" in cmd   # the per-request gaps, for the stall counts


def test_serving_rows_count_the_stalls_in_the_per_request_gaps(tmp_path):
    out = tmp_path / "r.jsonl"
    gaps = [[0.03] * 500 + [1.5], [0.03] * 499, [2.0, 0.03], []]   # seconds, as bench_serving keeps them
    out.write_text(json.dumps({"completed": 4, "p99_itl_ms": 31.0, "itls": gaps}) + "\n")
    row = serving.client_row(out)
    assert row["completed"] == 4 and row["p99_itl_ms"] == 31.0 and row["mean_ttft_ms"] is None
    assert (row["itl_gaps"], row["itl_stalls"], row["requests_with_a_stall"]) == (1002, 2, 2)
    assert row["itl_stall_fraction"] == pytest.approx(2 / 1002) and row["max_itl_ms"] == pytest.approx(2000.0)
    assert row["p999_itl_ms"] == pytest.approx(1500.0)
    out.write_text(json.dumps({"completed": 1, "p99_itl_ms": 5.0}) + "\n")   # no details: no counts
    assert "itl_stalls" not in serving.client_row(out)


def test_serving_summary_sets_the_headline_against_the_fa3_peers_per_rate():
    row = lambda c, rate, ttft, itl, tput: {"config": c, "rate": rate, "status": "ok", "median_ttft_ms": ttft,
                                            "p99_itl_ms": itl, "median_e2e_latency_ms": 10.0, "output_throughput": tput}
    rows = [row("sglang-fa3-bf16", 0.3, 400.0, 40.0, 100.0), row("mpfa-qk4pv8", 0.3, 200.0, 30.0, 120.0),
            row("sglang-fa3-fp8kv", 0.3, 300.0, 35.0, 110.0), row("mpfa-qk4pv8", 0.5, 250.0, 31.0, 150.0),
            {"config": "sglang-fa3-bf16", "rate": 0.5, "status": "error"}]
    s = serving.summarize(rows)
    assert s["rates"] == [0.3, 0.5]
    assert s["ttft_p50_ratio_vs_sglang_fa3_bf16"] == {"0.3": 0.5}   # the failed peer row leaves 0.5 out
    assert s["itl_p99_ratio_vs_sglang_fa3_fp8kv"] == {"0.3": pytest.approx(30 / 35)}
    assert s["output_throughput_ratio_vs_sglang_fa3_bf16"] == {"0.3": pytest.approx(1.2)}
    assert "itl_mean_ratio_vs_sglang_fa3_bf16" not in s   # rows without the field give no ratio
    typical = serving.summarize([{**r, "median_itl_ms": 10.0 if r["config"].startswith("mpfa") else 8.0}
                                 for r in rows if r["status"] == "ok"])
    assert typical["itl_p50_ratio_vs_sglang_fa3_fp8kv"] == {"0.3": pytest.approx(1.25)}   # the typical decode step
    merged = serving.merge(rows, [row("sglang-fa3-bf16", 0.5, 500.0, 45.0, 90.0)])
    assert len(merged) == 5 and serving.summarize(merged)["ttft_p50_ratio_vs_sglang_fa3_bf16"]["0.5"] == 0.5


def test_serving_ratios_pair_rows_of_one_session_as_the_file_fills_over_sessions():
    def row(c, rate, ttft, commit):
        return {"config": c, "rate": rate, "prompts": 60, "seed": 1, "status": "ok", "median_ttft_ms": ttft,
                "p99_itl_ms": 30.0, "median_e2e_latency_ms": 10.0, "output_throughput": 100.0, "commit": commit}
    first = [row("mpfa-qk4pv8", 0.4, 200.0, "aaaaaaa"), row("sglang-fa3-bf16", 0.4, 400.0, "aaaaaaa")]
    second = [row("mpfa-qk4pv8", 0.4, 250.0, "bbbbbbb"), row("sglang-fa3-fp8kv", 0.4, 500.0, "bbbbbbb")]
    rows = serving.merge(first, second)
    assert [(r["config"], r["commit"]) for r in rows] == [
        ("sglang-fa3-bf16", "aaaaaaa"), ("sglang-fa3-fp8kv", "bbbbbbb"), ("mpfa-qk4pv8", "aaaaaaa"),
        ("mpfa-qk4pv8", "bbbbbbb")]
    s = serving.summarize(rows)
    assert s["ttft_p50_ratio_vs_sglang_fa3_bf16"] == {"0.4": 0.5} and s["ttft_p50_ratio_vs_sglang_fa3_fp8kv"] == {"0.4": 0.5}
    assert s["pairs_measured"] == {"sglang_fa3_bf16": {"0.4": "aaaaaaa"}, "sglang_fa3_fp8kv": {"0.4": "bbbbbbb"}}
    # another load (fewer prompts) is no pair
    assert "ttft_p50_ratio_vs_sglang_fa3_bf16" not in serving.summarize([{**first[0], "prompts": 30}, first[1]])
    # rows on two GPUs: their own keys, never paired with one GPU's, and kept beside them
    tp2 = [{**r, "tp": 2, "median_ttft_ms": r["median_ttft_ms"] / 2} for r in first]
    both = serving.merge(rows, tp2)
    assert len(both) == 6
    s = serving.summarize(both)
    assert s["ttft_p50_ratio_vs_sglang_fa3_bf16"] == {"0.4": 0.5, "tp2/0.4": 0.5} and s["rates"] == [0.4]
    # rows with --mixed-chunk: kept beside the others, paired only with each other, keyed mixed/<rate>
    mixed = [{**r, "mixed_chunk": True, "median_ttft_ms": r["median_ttft_ms"] / 4} for r in first[:1]] + \
        [{**first[1], "mixed_chunk": True}]
    all_rows = serving.merge(both, mixed)
    assert len(all_rows) == 8
    s = serving.summarize(all_rows)
    assert s["ttft_p50_ratio_vs_sglang_fa3_bf16"] == {"0.4": 0.5, "mixed/0.4": 0.125, "tp2/0.4": 0.5}
    assert s["rates"] == [0.4] and "mixed/0.4" not in s["ttft_p50_ratio_vs_sglang_fa3_fp8kv"]


def test_serving_plot_is_one_figure_of_three_latency_panels(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"config": c, "rate": rate, "status": "ok", "median_ttft_ms": t, "p99_itl_ms": 40.0,
             "median_e2e_latency_ms": 9000.0} for c, t in (("sglang-fa3-bf16", 900.0), ("mpfa-qk4pv8", 500.0))
            for rate in (0.25, 0.4, 0.55)]
    rows.append({**rows[0], "tp": 2})   # a two-GPU row draws no line of its own
    (path,) = serving.plot(rows, tmp_path)
    assert path.name == "serving_h200.png" and path.stat().st_size > 1000
    assert serving.plot([{**rows[0], "status": "error"}], tmp_path / "none") == []


def test_serving_refuses_bad_rates(capsys):
    with pytest.raises(SystemExit) as e:
        serving.main(["--rates", "0,fast"])
    assert e.value.code == 2 and "--rates" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        serving.main(["--rates", "0.3", "--prompts", "5"])
    assert e.value.code == 2 and "--prompts must be at least 10" in capsys.readouterr().err


def test_synthetic_tokenizer_covers_the_models_vocabulary(tmp_path):
    """Every id of the dummy Llama's vocabulary is a word (so each streamed token carries text, which
    bench_serving's TTFT waits for), and the files are what transformers loads as a fast tokenizer."""
    from benchmarks.e2e import synthetic_tokenizer as st
    out = st.write_for_model(tp.MODELS["llama-3.1-8b"], tmp_path / "tok")
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    assert spec["model"]["type"] == "WordLevel" and len(vocab) == 128256 == len(set(vocab.values()))
    assert vocab["t0"] == 0 and vocab["t128255"] == 128255
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["model_max_length"] == 131072
    tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers package (SGLang brings it) is not installed")
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == 128256 and tok.decode([5, 49152, 128255]) == "t5 t49152 t128255"
    assert tok.encode("t7 t128000").ids == [7, 128000]
    with pytest.raises(ValueError, match="at least 2"):
        st.write(tmp_path / "x", 1, 16)


def test_serving_rate_reruns_once_when_the_client_fails_and_the_server_lives(tmp_path, monkeypatch):
    """A client that fails (bench_serving stops on a refused flush) with the server alive: one more try; the second
    try's row is kept with ``attempts`` 2. With the server dead: no retry."""
    calls = []

    class Srv:
        base, startup_s = "http://127.0.0.1:9", 1.0

        def __init__(self, alive):
            self._alive = alive

        def alive(self):
            return self._alive

    def fake_run(cmd, **kw):
        calls.append(cmd)
        out = Path(cmd[cmd.index("--output-file") + 1])
        ok = len(calls) % 2 == 0
        if ok:
            out.write_text(json.dumps({"completed": 10, "output_throughput": 5.0}) + "\n")
        return subprocess.CompletedProcess(cmd, 0 if ok else 1, "", "HTTPError 400 flush_cache")
    monkeypatch.setattr(serving.subprocess, "run", fake_run)
    monkeypatch.setattr(serving, "flush_radix_cache", lambda base: None)
    args = SimpleNamespace(port=9, prompts=10, seed=1)
    row = serving.run_rate("mpfa-qk4pv8", args, 0.3, Srv(True), {"config": "mpfa-qk4pv8"}, tmp_path, tmp_path)
    assert row["status"] == "ok" and row["attempts"] == 2 and len(calls) == 2
    calls.clear()
    row = serving.run_rate("mpfa-qk4pv8", args, 0.3, Srv(False), {"config": "mpfa-qk4pv8"}, tmp_path, tmp_path)
    assert row["status"] == "error" and row["attempts"] == 1 and len(calls) == 1
    assert "bench_serving wrote no result" in row["error"] and "flush_cache" in row["error"]