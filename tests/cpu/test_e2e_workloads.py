"""CPU tests of benchmarks.e2e.throughput's mixed-length workload and concurrency-1 inter-token latency, and
of their summary ratios in benchmarks.e2e.results: the length list, the pool-fill arithmetic, the latency
statistics from given token timestamps, the ratios from given rows, the CLI's refusals, and one whole run
of both workloads against a stand-in SGLang server (SGLang and a GPU are not on the CPU machine)."""
from __future__ import annotations

import json
import re
import shutil
import socket
import sys
import textwrap
from pathlib import Path

import pytest

import mpfa
from benchmarks import results_io
from benchmarks.e2e import results
from benchmarks.e2e import throughput as tp
from benchmarks.e2e.server import StreamResult

LLAMA_POSITIONS = 131072
MIX = tp.MIXED_LENGTHS


# --- the mixed length list -----------------------------------------------------------------------------------------


def _is_long(n: int) -> bool:
    return n >= MIX.long_min


def test_mixed_lengths_are_seeded_and_a_longer_run_extends_a_shorter_one():
    a = tp.mixed_prompt_lengths(200, LLAMA_POSITIONS - 1024)
    assert a == tp.mixed_prompt_lengths(200, LLAMA_POSITIONS - 1024)
    assert tp.mixed_prompt_lengths(35, LLAMA_POSITIONS - 1024) == a[:35]
    # another model's limit moves only the long prompts: the short ones stay the same requests
    b = tp.mixed_prompt_lengths(200, 65536)
    assert [n for n in a if not _is_long(n)] == [n for n in b if not _is_long(n)]
    assert [n for n in a if _is_long(n)] != [n for n in b if _is_long(n)]


def test_mixed_lengths_stay_in_their_classes_and_every_block_has_its_long_prompt():
    long_max = LLAMA_POSITIONS - 1024
    lengths = tp.mixed_prompt_lengths(400, long_max)
    assert all(MIX.short_min <= n <= MIX.short_max or MIX.long_min <= n <= long_max for n in lengths)
    blocks = [lengths[i:i + MIX.block] for i in range(0, len(lengths), MIX.block)]
    assert all(sum(map(_is_long, b)) == MIX.long_per_block for b in blocks)
    assert len({b.index(next(n for n in b if _is_long(n))) for b in blocks}) > 1   # not always the same place
    longs, shorts = [n for n in lengths if _is_long(n)], [n for n in lengths if not _is_long(n)]
    # log-uniform over each range: both ends of each class are reached, the middle is no pile-up
    assert min(longs) < 40_000 and max(longs) > 120_000 and 0.3 < sum(n < 65536 for n in longs) / len(longs) < 0.7
    assert min(shorts) < 1300 and max(shorts) > 7000 and 0.3 < sum(n < 2896 for n in shorts) / len(shorts) < 0.7


def test_a_model_too_short_for_the_long_prompts_is_refused():
    with pytest.raises(ValueError, match="long prompts need at least 32768 tokens, the model leaves 30000"):
        tp.mixed_prompt_lengths(5, 30000)


def test_mixed_requests_fill_the_largest_pool_in_whole_blocks():
    pools = {"flashinfer-bf16": 845_632, "mpfa-qk4pv8": 1_866_000}
    long_max, out = LLAMA_POSITIONS - 1024, 1024
    n = tp.mixed_requests_to_fill(pools, ["flashinfer-bf16", "mpfa-qk4pv8"], long_max, out, fills=2.0)
    tokens = [length + out for length in tp.mixed_prompt_lengths(n, long_max)]
    assert n % MIX.block == 0
    assert sum(tokens) >= 2.0 * 1_866_000 > sum(tokens[:-MIX.block])   # the fewest whole blocks that fill it
    assert 100 < n < 300   # ~20K tokens a request on average: ~190 requests for 3.7M tokens
    assert tp.mixed_requests_to_fill(pools, ["flashinfer-bf16"], long_max, out, fills=2.0) < n
    assert tp.mixed_requests_to_fill({"flashinfer-bf16": 10}, ["flashinfer-bf16"], long_max, out) == MIX.block


def test_request_count_auto_follows_the_workload():
    rows = [{"part": "capacity", "model": "llama-3.1-8b", "config": "flashinfer-bf16", "status": "ok",
             "max_total_num_tokens": 845_632}]
    pools = tp.estimated_pool_tokens(rows, "llama-3.1-8b", tp.CONFIGS)
    ap, fixed = tp.parse_args(["--input-len", "65536"])
    assert tp.request_count(ap, fixed, rows, LLAMA_POSITIONS) == tp.requests_to_fill(pools, tp.CONFIGS, 65536, 1024)
    ap, mixed = tp.parse_args(["--workload", "mixed", "--fills", "1.5"])
    n = tp.request_count(ap, mixed, rows, LLAMA_POSITIONS)
    lengths = tp.prompt_lengths(mixed, n, LLAMA_POSITIONS)
    target = 1.5 * max(pools.values())
    assert sum(lengths) + 1024 * n >= target > sum(lengths[:-MIX.block]) + 1024 * (n - MIX.block)
    assert max(lengths) <= LLAMA_POSITIONS - 1024


def test_inputs_have_the_requested_lengths_and_fixed_inputs_are_unchanged():
    inputs = tp.inputs_of_lengths([3, 70, 1], 1000, seed=4)
    assert [len(x) for x in inputs] == [3, 70, 1] and all(100 <= t < 900 for x in inputs for t in x)
    assert tp.make_inputs(3, 50, 1000) == tp.inputs_of_lengths([50, 50, 50], 1000)


# --- latency statistics from token timestamps -----------------------------------------------------------------------


def test_itl_at_concurrency_one_from_token_timestamps():
    # gaps of 10, 20, 30, 40 ms; then one chunk bringing two tokens after 60 ms (30 ms each)
    r = StreamResult(start=0.0, chunk_times=[0.5, 0.51, 0.53, 0.56, 0.60, 0.66], chunk_tokens=[1, 2, 3, 4, 5, 7])
    fields = tp.named("itl_concurrency1", tp.itl_stats_ms([r]), "ms")
    gaps = [10, 20, 30, 40, 30, 30]
    assert fields["itl_concurrency1_mean_ms"] == pytest.approx(sum(gaps) / 6)
    assert fields["itl_concurrency1_p50_ms"] == pytest.approx(30.0)
    assert fields["itl_concurrency1_p99_ms"] == pytest.approx(30 + 10 * (0.99 * 5 - 4))   # between 30 and 40
    assert set(fields) == {"itl_concurrency1_mean_ms", "itl_concurrency1_p50_ms", "itl_concurrency1_p99_ms"}
    # the load's ITL is the same arithmetic over every request
    load = tp.summarize_run([r], wall_s=1.0, input_lens=[100])
    assert load["itl_p99_ms"] == fields["itl_concurrency1_p99_ms"] and load["ttft_p50_s"] == 0.5


def test_latency_statistics_of_a_request_without_gaps_are_absent_not_an_error():
    one_token = StreamResult(start=0.0, chunk_times=[0.2], chunk_tokens=[1])
    failed = StreamResult(start=0.0, error="HTTP 400: too long")
    assert tp.itl_stats_ms([one_token, failed]) == {"mean": None, "p50": None, "p99": None}
    assert tp.ttft_stats_s([failed]) == {"mean": None, "p50": None, "p99": None}
    assert tp.ttft_stats_s([one_token, failed])["p99"] == 0.2


def test_ttft_of_short_and_long_prompts_apart():
    def req(ttft):
        return StreamResult(start=0.0, chunk_times=[ttft, ttft + 0.01], chunk_tokens=[1, 2])
    got = tp.ttft_by_length_class([req(0.1), req(2.0), req(0.3), req(9.0), StreamResult(0.0, error="x")],
                                  [1024, 40000, 8192, 130048, 100000])
    assert got["ttft_short_mean_s"] == pytest.approx(0.2) and got["ttft_short_p50_s"] == pytest.approx(0.2)
    assert got["ttft_long_mean_s"] == pytest.approx(5.5) and got["ttft_long_p99_s"] == pytest.approx(2 + 7 * 0.99)
    with pytest.raises(ValueError):   # lengths not matching the requests is a caller's bug, not a statistic
        tp.ttft_by_length_class([req(0.1)], [1024, 2048])


def test_the_probe_generates_enough_tokens_within_the_models_positions():
    assert tp.probe_output_len(32768, 1024, LLAMA_POSITIONS) == 1024
    assert tp.probe_output_len(32768, 16, LLAMA_POSITIONS) == tp.PROBE_MIN_OUTPUT == 128
    assert tp.probe_output_len(131000, 16, LLAMA_POSITIONS) == 72
    assert tp.server_context_length(32768, 1024, LLAMA_POSITIONS) == 32768 + 1024 + 64
    assert tp.server_context_length(256, 128, LLAMA_POSITIONS) == 4096
    assert tp.server_context_length(130048, 1024, LLAMA_POSITIONS) == LLAMA_POSITIONS


# --- rows and summary ------------------------------------------------------------------------------------------------


def _fixed(config, length, tput, itl=None, ttft=1.0, model="llama-3.1-8b"):
    r = {"part": "throughput", "workload": "fixed", "model": model, "config": config, "input_len": length, "tp": 1,
         "status": "ok", "output_throughput": tput, "ttft_concurrency1_s": ttft,
         "group": f"{model}/in{length}/out1024/tp1/{config}"}
    return r if itl is None else {**r, "itl_concurrency1_mean_ms": itl}


def _mixed(config, tput, ttft_p50, itl_p50, model="llama-3.1-8b"):
    return {"part": "throughput", "workload": "mixed", "model": model, "config": config, "tp": 1, "status": "ok",
            "output_throughput": tput, "ttft_p50_s": ttft_p50, "itl_p50_ms": itl_p50, "wall_s": 100.0,
            "requests": 50, "group": f"{model}/mixed/out1024/tp1/{config}"}


def test_summary_ratios_of_itl_at_concurrency_one_and_of_the_mixed_workload():
    rows = [_fixed("flashinfer-bf16", 32768, 100.0, itl=20.0), _fixed("mpfa-qk4pv8", 32768, 150.0, itl=25.0),
            _fixed("flashinfer-bf16", 65536, 80.0, itl=22.0),
            _fixed("mpfa-qk4pv8", 65536, 120.0),                       # a row from before the ITL probe
            _fixed("mpfa-qk4pv8", 130048, 90.0, itl=30.0),              # its flashinfer-bf16 row missing
            _fixed("flashinfer-bf16", 65536, 10.0, itl=40.0, model="qwen3-14b"),
            _fixed("mpfa-qk4pv8", 65536, 15.0, itl=30.0, model="qwen3-14b"),
            _mixed("flashinfer-bf16", 400.0, 2.0, 30.0), _mixed("mpfa-qk4pv8", 600.0, 1.5, 36.0),
            _mixed("mpfa-qk4pv8", 50.0, 3.0, 40.0, model="qwen3-14b")]  # no flashinfer-bf16 mixed row
    s = results.summarize(rows)
    assert s["itl_concurrency1_ratio_vs_flashinfer_bf16"] == {"32768": 1.25, "qwen3-14b/65536": 0.75}
    assert s["mixed_output_throughput_ratio_vs_flashinfer_bf16"] == {"llama-3.1-8b": 1.5}
    assert s["mixed_ttft_p50_ratio_vs_flashinfer_bf16"] == {"llama-3.1-8b": 0.75}
    assert s["mixed_itl_p50_ratio_vs_flashinfer_bf16"] == {"llama-3.1-8b": pytest.approx(1.2)}
    # mixed rows are no input length: the per-length ratios and the wall-time split are the fixed rows' alone
    assert s["output_throughput_ratio_vs_flashinfer_bf16"] == {"32768": 1.5, "65536": 1.5, "qwen3-14b/65536": 1.5}
    assert "wall_time_split_estimate" not in s


def test_summary_names_the_build_and_load_of_every_throughput_row():
    # a rerun replaces its own lengths only: the ratios of one file can pair rows of different builds
    rows = [{**_fixed("flashinfer-bf16", 32768, 100.0), "commit": "e38a3e2b1d9c", "requests": 56},
            {**_fixed("mpfa-qk4pv8", 32768, 150.0), "commit": "e38a3e2b1d9c", "requests": 56},
            {**_fixed("mpfa-qk4pv8", 65536, 120.0), "commit": "edae8fc", "requests": 57},
            _fixed("flashinfer-bf16", 65536, 80.0),                    # a row without commit or request count
            {**_mixed("mpfa-qk4pv8", 600.0, 1.5, 36.0), "commit": "e38a3e2b1d9c"},
            {**_fixed("mpfa-qk4pv8", 65536, 15.0, model="qwen3-14b"), "commit": "e243273", "requests": 42}]
    assert results.summarize(rows)["throughput_rows_measured"] == {
        "32768/flashinfer-bf16": "e38a3e2 · 56 requests", "32768/mpfa-qk4pv8": "e38a3e2 · 56 requests",
        "65536/flashinfer-bf16": "? · ? requests", "65536/mpfa-qk4pv8": "edae8fc · 57 requests",
        "mixed/mpfa-qk4pv8": "e38a3e2 · 50 requests", "qwen3-14b/65536/mpfa-qk4pv8": "e243273 · 42 requests"}


def test_summary_ratios_pair_rows_of_the_same_load_only():
    rows = [{**_fixed("flashinfer-bf16", 32768, 100.0), "requests": 56}, {**_fixed("mpfa-qk4pv8", 32768, 150.0), "requests": 56},
            {**_fixed("flashinfer-fp8", 32768, 90.0), "requests": 111},   # measured under the older, longer load
            {**_mixed("flashinfer-bf16", 400.0, 2.0, 30.0), "requests": 105}, _mixed("mpfa-qk4pv8", 600.0, 1.5, 36.0)]
    s = results.summarize(rows)
    assert s["output_throughput_ratio_vs_flashinfer_bf16"] == {"32768": 1.5}
    assert "output_throughput_ratio_vs_flashinfer_fp8" not in s
    assert "mixed_output_throughput_ratio_vs_flashinfer_bf16" not in s   # 50 requests against 105


def test_summary_geomean_is_over_one_mpfa_build():
    rows = [_fixed("flashinfer-bf16", 32768, 100.0), {**_fixed("mpfa-qk4pv8", 32768, 200.0), "commit": "new"},
            _fixed("flashinfer-bf16", 65536, 100.0), {**_fixed("mpfa-qk4pv8", 65536, 150.0), "commit": "old"},
            _fixed("flashinfer-bf16", 130048, 100.0), {**_fixed("mpfa-qk4pv8", 130048, 300.0), "commit": "new"}]
    s = results.summarize(rows)
    assert s["output_throughput_ratio_vs_flashinfer_bf16"] == {"32768": 2.0, "65536": 1.5, "130048": 3.0}
    assert "output_throughput_ratio_vs_flashinfer_bf16_geomean" not in s
    rows[3]["commit"] = "new"
    assert results.summarize(rows)["output_throughput_ratio_vs_flashinfer_bf16_geomean"] == pytest.approx(9 ** (1 / 3))
    # the kernels' hashed names, where rows have them, decide over the commit: a docs-only commit between
    # two sessions' runs measures the same build, a kernel change under one commit name would not
    rows[1]["mpfa_kernels"] = rows[3]["mpfa_kernels"] = rows[5]["mpfa_kernels"] = ["prefill_x_0123456789ab"]
    rows[3]["commit"] = "later"
    assert "output_throughput_ratio_vs_flashinfer_bf16_geomean" in results.summarize(rows)
    # the host code around the same kernels too, where rows say it (rows from before the field do not)
    rows[1]["mpfa_host_source"] = rows[5]["mpfa_host_source"] = "aaaaaaaaaaaa"
    assert "output_throughput_ratio_vs_flashinfer_bf16_geomean" in results.summarize(rows)
    rows[3]["mpfa_host_source"] = "bbbbbbbbbbbb"
    assert "output_throughput_ratio_vs_flashinfer_bf16_geomean" not in results.summarize(rows)
    rows[3]["mpfa_host_source"] = "aaaaaaaaaaaa"
    rows[3]["mpfa_kernels"] = ["prefill_x_ba9876543210"]
    assert "output_throughput_ratio_vs_flashinfer_bf16_geomean" not in results.summarize(rows)


def test_mpfa_rows_name_the_kernels_their_server_loads(monkeypatch):
    monkeypatch.setenv("MPFA_CUDA_ARCH", "sm_90a")
    builds = tp.mpfa_kernel_builds("mpfa-qk4pv8", "llama-3.1-8b", 1)
    assert [b.split("_recipe")[0].split("_")[0] for b in builds] == ["append", "decode", "prefill"]
    assert all("recipe-qk4pv8" in b and re.fullmatch(r".*_sm_90a_[0-9a-f]{12}", b) for b in builds)
    assert tp.mpfa_kernel_builds("mpfa-bf16", "llama-3.1-8b", 1) != builds
    assert tp.mpfa_kernel_builds("flashinfer-bf16", "llama-3.1-8b", 1) is None


def test_mpfa_rows_name_their_host_code(tmp_path, monkeypatch):
    """The hash covers the served packages' Python: stable, and another for a changed file."""
    first = tp.mpfa_host_source()
    assert re.fullmatch(r"[0-9a-f]{12}", first) and tp.mpfa_host_source() == first
    real = Path(mpfa.__file__).parent
    copy = tmp_path / "mpfa"
    shutil.copytree(real, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(mpfa, "__file__", str(copy / "__init__.py"))
    assert tp.mpfa_host_source() == first
    (copy / "prefill.py").write_text((copy / "prefill.py").read_text() + "\n# a host-side change\n")
    assert tp.mpfa_host_source() != first


def test_the_plot_shows_beside_the_headline_only_rows_of_its_load():
    by = {("llama-3.1-8b", 32768, c): {**_fixed(c, 32768, t), "requests": n}
          for c, t, n in (("flashinfer-bf16", 348.0, 56), ("mpfa-qk4pv8", 557.0, 56), ("flashinfer-fp8", 368.0, 111))}
    by[("llama-3.1-8b", 65536, "flashinfer-fp8")] = {**_fixed("flashinfer-fp8", 65536, 139.0), "requests": 57}
    assert results.plotted_throughput(by) == {("llama-3.1-8b", 32768, "flashinfer-bf16"): 348.0,
                                              ("llama-3.1-8b", 32768, "mpfa-qk4pv8"): 557.0,
                                              ("llama-3.1-8b", 65536, "flashinfer-fp8"): 139.0}


def test_summary_without_the_rows_to_compare_has_no_ratio_keys():
    only_mpfa = [_fixed("mpfa-qk4pv8", 32768, 150.0, itl=25.0), _mixed("mpfa-qk4pv8", 600.0, 1.5, 36.0)]
    s = results.summarize(only_mpfa)
    assert not any("ratio" in k for k in s), s
    no_itl = [_fixed("flashinfer-bf16", 32768, 100.0), _fixed("mpfa-qk4pv8", 32768, 150.0)]
    s = results.summarize(no_itl)
    assert "itl_concurrency1_ratio_vs_flashinfer_bf16" not in s and "ttft_concurrency1_ratio_vs_flashinfer_bf16" in s
    failed = [_mixed("flashinfer-bf16", 400.0, 2.0, 30.0), {**_mixed("mpfa-qk4pv8", 1.0, 1.0, 1.0), "status": "error"}]
    assert not any(k.startswith("mixed_") for k in results.summarize(failed))


def test_a_mixed_row_never_replaces_a_fixed_row_and_is_left_out_of_the_plot():
    fixed, mixed = _fixed("mpfa-qk4pv8", 32768, 150.0), _mixed("mpfa-qk4pv8", 600.0, 1.5, 36.0)
    merged = results.merge_rows([fixed], [mixed])
    assert merged == [fixed, mixed]
    rerun = {**mixed, "output_throughput": 700.0}
    assert results.merge_rows(merged, [rerun]) == [fixed, rerun]
    assert results.plot([mixed], Path("/nonexistent")) == []   # nothing to plot: no file written


def test_tp_check_takes_the_recipes_to_set_against_flashinfer(capsys):
    assert tp.parse_args(["--tp-check"])[1].tp_recipes == ["bf16", "qk4pv8"]
    assert tp.parse_args(["--tp-check", "--tp-recipes", "qk8pv8"])[1].tp_recipes == ["qk8pv8"]
    with pytest.raises(SystemExit):
        tp.parse_args(["--tp-check", "--tp-recipes", "int4"])
    assert "--tp-recipes: choose from" in capsys.readouterr().err


def test_row_fields_name_the_workload_and_keep_groups_apart():
    _, fixed = tp.parse_args(["--input-len", "65536"])
    f = tp.workload_fields(fixed, "mpfa-qk4pv8", [65536] * 3)
    assert f == {"workload": "fixed", "input_len": 65536, "group": "llama-3.1-8b/in65536/out1024/tp1/mpfa-qk4pv8"}
    _, mixed = tp.parse_args(["--workload", "mixed", "--model", "qwen3-14b"])
    lengths = [2000, 40000, 1500, 3000, 7000]
    m = tp.workload_fields(mixed, "mpfa-qk4pv8", lengths)
    assert m["workload"] == "mixed" and m["group"] == "qwen3-14b/mixed/out1024/tp1/mpfa-qk4pv8"
    assert m["input_lens"] == lengths and m["short_requests"] == 4 and m["long_requests"] == 1
    assert m["input_tokens"] == 53500 and m["length_mix"]["long_min"] == MIX.long_min and "input_len" not in m


# --- the command line -----------------------------------------------------------------------------------------------


def _refusal(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        tp.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_fixed_runs_keep_their_defaults():
    _, args = tp.parse_args([])
    assert (args.workload, args.input_len, args.output_len, args.ttft_probe) == ("fixed", 32768, 1024, True)


def test_bad_workload_arguments_are_refused_naming_the_argument(capsys, tmp_path):
    out = ["--out", str(tmp_path)]
    err = _refusal(capsys, ["--workload", "bursty", *out])
    assert "--workload" in err and "invalid choice: 'bursty'" in err and "'fixed', 'mixed'" in err
    assert "--input-len: only with --workload fixed" in _refusal(capsys, ["--workload", "mixed", "--input-len", "4096", *out])
    assert "--requests: --workload mixed needs at least 5" in _refusal(capsys, ["--workload", "mixed", "--requests", "3", *out])
    err = _refusal(capsys, ["--workload", "mixed", "--output-len", "100000", *out])
    assert "--output-len 100000 leaves 31072" in err and "needs 32768" in err
    assert "exceeds llama-3.1-8b's 131072 positions" in _refusal(capsys, ["--input-len", "131000", *out])
    assert not (tmp_path / f"{results.RESULT}.json").exists()


# --- a whole run against a stand-in server ---------------------------------------------------------------------------

# Answers what the benchmarks ask of SGLang: /health, /server_info, /v1/models (bench_serving's ready check),
# /flush_cache and streamed /generate (one SSE event per token, its cumulative text as SGLang streams it), refusing
# requests longer than --context-length as SGLang does. Prefill takes 1 us a prompt token;
# decode 3 ms a token under mpfa (MPFA_RECIPE set) and 8 ms under flashinfer, so the ratios have a known sign.
STAND_IN_SGLANG = textwrap.dedent('''\
    import argparse, json, os, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int)
    ap.add_argument("--context-length", type=int)
    args, _ = ap.parse_known_args()
    GAP = 0.003 if os.environ.get("MPFA_RECIPE") else 0.008

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, body):
            self.send_response(code)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path in ("/health", "/server_info"):
                self._send(200, json.dumps({"max_total_num_tokens": 4321}).encode())
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [{"id": "stand-in", "object": "model"}]}).encode())
            else:
                self._send(404, b"{}")

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))   # bench_serving flushes with none
            if self.path.startswith("/flush_cache"):
                if os.environ.get("STAND_IN_FLUSH_REFUSE"):
                    return self._send(400, b"Cache not flushed because there are pending requests.")
                if os.environ.get("STAND_IN_FLUSH_LOG"):
                    with open(os.environ["STAND_IN_FLUSH_LOG"], "a") as f:
                        f.write(f"{args.port} {args.context_length}\\n")
                if os.environ.get("STAND_IN_FLUSH_SNAPSHOT"):   # STAND_IN_RESULTS as the client left it between loads
                    with open(os.environ["STAND_IN_RESULTS"]) as f, open(os.environ["STAND_IN_FLUSH_SNAPSHOT"], "w") as g:
                        g.write(f.read())
                return self._send(200, b"Cache flushed.\\n")
            req = json.loads(body)
            ids, new = req["input_ids"], req["sampling_params"]["max_new_tokens"]
            if len(ids) + new > args.context_length:
                return self._send(400, b'{"error": "longer than the context length"}')
            self.send_response(200)
            self.end_headers()
            time.sleep(1e-6 * len(ids))
            for i in range(1, new + 1):
                if i > 1:
                    time.sleep(GAP)
                event = {"text": " w" * i, "output_ids": list(range(i)), "meta_info": {"completion_tokens": i}}
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\\n\\n")
            self.wfile.write(b"data: [DONE]\\n\\n")

    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def stand_in_sglang(tmp_path, monkeypatch):
    """server_argv's own command line and environment, with the stand-in in place of sglang.launch_server."""
    script = tmp_path / "stand_in_sglang.py"
    script.write_text(STAND_IN_SGLANG)
    real = tp.server_argv

    def argv_of_stand_in(*a, **kw):
        argv, env = real(*a, **kw)
        assert argv[1:3] == ["-m", "sglang.launch_server"]
        return [sys.executable, str(script), *argv[3:]], env
    monkeypatch.setattr(tp, "server_argv", argv_of_stand_in)
    return _free_port()


def test_fixed_then_mixed_run_write_both_workloads_and_their_ratios(stand_in_sglang, tmp_path):
    common = ["--configs", "flashinfer-bf16,mpfa-qk4pv8", "--output-len", "16", "--port", str(stand_in_sglang),
              "--out", str(tmp_path)]
    assert tp.main(["--input-len", "256", "--requests", "4", *common]) == 0
    assert tp.main(["--workload", "mixed", "--requests", "5", *common]) == 0
    rows = results_io.read(tmp_path / f"{results.RESULT}.json")["rows"]
    fixed = {r["config"]: r for r in rows if r["workload"] == "fixed"}
    mixed = {r["config"]: r for r in rows if r["workload"] == "mixed"}
    assert len(rows) == 4 and set(fixed) == set(mixed) == {"flashinfer-bf16", "mpfa-qk4pv8"}

    bf16 = fixed["flashinfer-bf16"]
    assert bf16["group"] == "llama-3.1-8b/in256/out16/tp1/flashinfer-bf16" and bf16["input_len"] == 256
    assert bf16["output_tokens"] == 4 * 16 and bf16["errors"] == 0 and bf16["max_total_num_tokens"] == 4321
    assert bf16["probe_output_tokens"] == 128 and "probe_error" not in bf16   # not --output-len's 16: a stable ITL
    assert 8.0 <= bf16["itl_concurrency1_p50_ms"] < 40.0 and bf16["ttft_concurrency1_s"] is not None

    lengths = tp.mixed_prompt_lengths(5, LLAMA_POSITIONS - 16)
    m = mixed["mpfa-qk4pv8"]
    assert m["group"] == "llama-3.1-8b/mixed/out16/tp1/mpfa-qk4pv8" and m["input_lens"] == lengths
    assert m["errors"] == 0 and m["output_tokens"] == 5 * 16   # the long prompt fit the servers' context
    assert m["total_throughput"] == pytest.approx((sum(lengths) + 80) / m["wall_s"])
    assert m["ttft_long_p50_s"] > m["ttft_short_p99_s"] and "ttft_concurrency1_s" not in m

    s = results_io.read(tmp_path / f"{results.RESULT}.json")["summary"]
    assert s["itl_concurrency1_ratio_vs_flashinfer_bf16"]["256"] < 0.8     # 3 ms against 8 ms a token
    # the stand-in's ratio of wall times is at the mercy of a loaded CI machine (1.16 where 1.6 was meant, once);
    # the ratio is checked against the rows it comes from, and its direction through the per-token gaps' p50
    assert s["mixed_output_throughput_ratio_vs_flashinfer_bf16"]["llama-3.1-8b"] == pytest.approx(
        m["output_throughput"] / mixed["flashinfer-bf16"]["output_throughput"])
    assert s["mixed_itl_p50_ratio_vs_flashinfer_bf16"]["llama-3.1-8b"] < 0.8
    assert set(s["mixed_ttft_p50_ratio_vs_flashinfer_bf16"]) == {"llama-3.1-8b"}
    assert set(s["wall_time_split_estimate"]) == {"256/flashinfer-bf16", "256/mpfa-qk4pv8"}


def test_several_lengths_run_on_one_server_per_configuration(stand_in_sglang, tmp_path, monkeypatch):
    """--input-len 256,5000 --requests 4,2: one server per configuration (its context fits the longer load and its
    probe), the radix cache flushed before the second load, and a row per length like a run of that length alone's."""
    flushes = tmp_path / "flushes.log"
    monkeypatch.setenv("STAND_IN_FLUSH_LOG", str(flushes))
    assert tp.main(["--input-len", "256,5000", "--requests", "4,2", "--configs", "flashinfer-bf16,mpfa-qk4pv8",
                    "--output-len", "16", "--port", str(stand_in_sglang), "--out", str(tmp_path)]) == 0
    rows = results_io.read(tmp_path / f"{results.RESULT}.json")["rows"]
    by = {(r["config"], r["input_len"]): r for r in rows}
    assert set(by) == {(c, n) for c in ("flashinfer-bf16", "mpfa-qk4pv8") for n in (256, 5000)}
    for (config, n), r in by.items():
        assert r["status"] == "ok" and r["errors"] == 0 and r["server_lengths"] == [256, 5000]
        assert r["group"] == f"llama-3.1-8b/in{n}/out16/tp1/{config}"
        assert r["requests"] == (4 if n == 256 else 2) and r["requests_arg"] == ("4" if n == 256 else "2")
        assert r["output_tokens"] == r["requests"] * 16 and r["probe_output_tokens"] == 128
    # one flush per server (before its second load), each on a server whose context fits 5000 + the probe's 128
    assert flushes.read_text().split("\n")[:-1] == [f"{stand_in_sglang} {5000 + 128 + 64}"] * 2
    logs = sorted(p.name for p in (tmp_path / "logs" / "e2e").iterdir())
    assert logs == [f"throughput-llama-3.1-8b-256-5000-{c}.log" for c in ("flashinfer-bf16", "mpfa-qk4pv8")]


def test_a_refused_flush_fails_the_later_loads_only(stand_in_sglang, tmp_path, monkeypatch):
    """SGLang refusing the flush (HTTP 400, its reason in the row): the first load's row stays ok, every later load's
    is an error row with no time of its own, and the run says it failed."""
    monkeypatch.setenv("STAND_IN_FLUSH_REFUSE", "1")
    assert tp.main(["--input-len", "256,512,1024", "--requests", "2", "--configs", "mpfa-qk4pv8", "--output-len", "16",
                    "--no-ttft-probe", "--port", str(stand_in_sglang), "--out", str(tmp_path)]) == 1
    rows = {r["input_len"]: r for r in results_io.read(tmp_path / f"{results.RESULT}.json")["rows"]}
    assert rows[256]["status"] == "ok" and rows[256]["seconds"] > 0 and rows[256]["context_length"] == 4096
    assert rows[512]["status"] == rows[1024]["status"] == "error"
    assert "flush_cache refused (HTTP 400): Cache not flushed because there are pending requests" in rows[512]["error"]
    assert rows[512]["seconds"] is not None and rows[1024]["seconds"] is None
    assert rows[1024]["startup_s"] == rows[256]["startup_s"] and rows[1024]["max_total_num_tokens"] == 4321


def test_each_finished_load_is_in_the_results_file_before_the_next_load_runs(stand_in_sglang, tmp_path, monkeypatch):
    """A device call can end in the middle of a configuration's loads: the loads it finished must already be in the
    results file (the seventh session lost two finished fa3 BF16 loads that were kept only until the third's end)."""
    snapshot = tmp_path / "between-loads.json"
    monkeypatch.setenv("STAND_IN_RESULTS", str(tmp_path / f"{results.RESULT}.json"))
    monkeypatch.setenv("STAND_IN_FLUSH_SNAPSHOT", str(snapshot))
    assert tp.main(["--input-len", "256,512", "--requests", "2", "--configs", "flashinfer-bf16,mpfa-qk4pv8",
                    "--output-len", "16", "--no-ttft-probe", "--port", str(stand_in_sglang), "--out", str(tmp_path)]) == 0
    # the snapshot is the second configuration's flush: the first configuration's two rows and its own first
    kept = {(r["config"], r["input_len"]): r["status"] for r in json.loads(snapshot.read_text())["rows"]}
    assert kept == {("flashinfer-bf16", 256): "ok", ("flashinfer-bf16", 512): "ok", ("mpfa-qk4pv8", 256): "ok"}
    rows = results_io.read(tmp_path / f"{results.RESULT}.json")["rows"]
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)


def test_several_lengths_refusals(tmp_path, capsys):
    out = ["--out", str(tmp_path)]
    assert "3 values for 2 --input-len" in _refusal(capsys, ["--input-len", "256,512", "--requests", "1,2,3", *out])
    assert "each length once" in _refusal(capsys, ["--input-len", "256,256", *out])
    assert "positive token counts" in _refusal(capsys, ["--input-len", "256,-1", *out])
    assert "exceeds llama-3.1-8b's 131072 positions" in _refusal(capsys, ["--input-len", "256,131000", *out])


def test_serving_runs_sglangs_own_client_against_a_server(stand_in_sglang, tmp_path, monkeypatch):
    """benchmarks.e2e.serving end to end with SGLang's real client (where SGLang is installed; the GPU machine has
    it, CI does not) against the stand-in server: the synthetic tokenizer, the client's flags and ready check, its
    JSONL read into rows, the per-rate ratios of one run and the plot."""
    pytest.importorskip("sglang.bench_serving")
    from benchmarks.e2e import serving
    monkeypatch.setattr(serving, "HEADLINE", "sglang-fa3-fp8kv")   # the stand-in serves no mpfa launcher
    assert serving.main(["--rates", "2,4", "--prompts", "10", "--configs", "sglang-fa3-bf16,sglang-fa3-fp8kv",
                         "--port", str(stand_in_sglang), "--out", str(tmp_path)]) == 0
    doc = results_io.read(tmp_path / f"{serving.RESULT}.json")
    rows = {(r["config"], r["rate"]): r for r in doc["rows"]}
    assert set(rows) == {(c, r) for c in ("sglang-fa3-bf16", "sglang-fa3-fp8kv") for r in (2.0, 4.0)}
    for r in rows.values():
        assert r["status"] == "ok" and r["completed"] == 10 and r["attempts"] == 1 and r["max_total_num_tokens"] == 4321
        assert 6.0 < r["median_itl_ms"] < 40.0 and r["median_ttft_ms"] > 0 and r["output_throughput"] > 0
        assert r["p99_e2e_latency_ms"] >= r["median_e2e_latency_ms"] > r["median_ttft_ms"]
    s = doc["summary"]
    assert s["rates"] == [2.0, 4.0] and set(s["ttft_p50_ratio_vs_sglang_fa3_bf16"]) == {"2.0", "4.0"}
    assert s["output_throughput_ratio_vs_sglang_fa3_bf16"]["2.0"] == pytest.approx(
        rows["sglang-fa3-fp8kv", 2.0]["output_throughput"] / rows["sglang-fa3-bf16", 2.0]["output_throughput"])
    assert (tmp_path / f"{serving.RESULT}.png").exists()
    assert sorted(p.name for p in (tmp_path / "logs" / "serving").glob("*.jsonl")) == [
        f"{c}-{r}.jsonl" for c in ("sglang-fa3-bf16", "sglang-fa3-fp8kv") for r in (2, 4)]


def test_publish_moves_a_run_into_place_only_when_every_server_succeeded(stand_in_sglang, tmp_path, monkeypatch,
                                                                          capsys):
    """--publish runs into a staging folder under scratch; the results file, its plot and the servers' logs reach
    the published folder only from a run whose servers all succeeded (issue 30: a failed run replaced them)."""
    from benchmarks import publish
    # the machine check wants SGLang and the GPU the published file names, neither of which is here; the staging,
    # the servers (stand-ins), the files and the move are real
    monkeypatch.setattr(publish, "check_machine", lambda *a, **kw: None)
    target = tmp_path / "published"
    argv = ["--configs", "flashinfer-bf16,mpfa-qk4pv8", "--input-len", "256", "--output-len", "16", "--requests", "4",
            "--port", str(stand_in_sglang), "--out", str(target), "--publish"]
    assert tp.main(argv) == 0
    result = results_io.read(target / f"{results.RESULT}.json")
    assert "--publish" in result["meta"]["command"] and len(result["rows"]) == 2
    assert (target / f"{results.RESULT}.png").is_file()
    assert sorted(p.name for p in (target / "logs" / "e2e").iterdir()) == [
        "throughput-llama-3.1-8b-256-flashinfer-bf16.log", "throughput-llama-3.1-8b-256-mpfa-qk4pv8.log"]
    assert not [line for line in capsys.readouterr().err.splitlines() if "not published" in line]
    before = {p: p.read_bytes() for p in target.rglob("*") if p.is_file()}

    stand_in = tp.server_argv

    def mpfa_server_fails(config, *a, **kw):
        argv_, env = stand_in(config, *a, **kw)
        return ([sys.executable, "-c", "raise SystemExit(3)"] if config == "mpfa-qk4pv8" else argv_), env
    monkeypatch.setattr(tp, "server_argv", mpfa_server_fails)
    assert tp.main(argv) == 1
    err = capsys.readouterr().err
    line = re.search(r"not published: 1 failed \(llama-3.1-8b/in256/out16/tp1/mpfa-qk4pv8\); wrote (\S+) instead", err)
    assert line, err
    staged = Path(line.group(1)).resolve()
    try:
        assert publish.SCRATCH_DIR.resolve() in staged.parents and staged.is_file()
        assert [r["status"] for r in results_io.read(staged)["rows"]] == ["ok", "error"]
        assert {p: p.read_bytes() for p in target.rglob("*") if p.is_file()} == before   # no file, plot or log moved
    finally:
        import shutil
        shutil.rmtree(staged.parent)
