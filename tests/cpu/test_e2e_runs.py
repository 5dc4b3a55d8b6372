"""Ratios in the end-to-end results pair rows of one run (benchmarks.e2e.runs), as the file fills over sessions."""
from __future__ import annotations

import pytest

from benchmarks.e2e import results, runs


def _row(config, length, tput, commit, run=None, requests=56):
    r = {"part": "throughput", "workload": "fixed", "model": "llama-3.1-8b", "config": config, "input_len": length,
         "tp": 1, "status": "ok", "output_throughput": tput, "requests": requests, "commit": commit,
         "group": f"llama-3.1-8b/in{length}/out1024/tp1/{config}"}
    return {**r, "run": run} if run else r


def test_run_of_prefers_the_stamp_then_the_commit(monkeypatch):
    assert runs.run_of({"run": "r", "commit": "abcdef0123"}) == "r"
    assert runs.run_of({"commit": "abcdef0123"}) == "abcdef0"
    assert runs.run_of({}) is None
    monkeypatch.setenv("MPFA_RUN", "queue-1")
    assert runs.current("abcdef0123") == "queue-1"
    monkeypatch.delenv("MPFA_RUN")
    assert runs.current("abcdef0123").startswith("abcdef0@")


def test_partner_is_the_newest_headline_row_of_the_same_run():
    old, new = _row("mpfa-qk4pv8", 32768, 557.0, "e38a3e2"), _row("mpfa-qk4pv8", 32768, 568.0, "2d965ad")
    assert runs.partner([old, new], _row("flashinfer-bf16", 32768, 348.0, "e38a3e2")) is old
    assert runs.partner([old, new], _row("sglang-fa3-fp8kv", 32768, 468.0, "2d965ad")) is new
    assert runs.partner([old, new], _row("sglang-fa3-bf16", 32768, 400.0, "0000000")) is None
    unknown = {k: v for k, v in _row("flashinfer-bf16", 32768, 348.0, "x").items() if k != "commit"}
    assert runs.partner([old, new], unknown) is new   # a row from before commits were stamped: the newest


def test_a_rerun_keeps_the_headline_row_an_earlier_peer_was_measured_with():
    before = [_row("flashinfer-bf16", 32768, 348.0, "e38a3e2"), _row("mpfa-qk4pv8", 32768, 557.0, "e38a3e2")]
    today = [_row("mpfa-qk4pv8", 32768, 568.0, "2d965ad"), _row("sglang-fa3-fp8kv", 32768, 468.0, "2d965ad")]
    rows = results.merge_rows(before, today)
    assert [(r["config"], r["commit"]) for r in rows] == [
        ("flashinfer-bf16", "e38a3e2"), ("mpfa-qk4pv8", "e38a3e2"), ("mpfa-qk4pv8", "2d965ad"),
        ("sglang-fa3-fp8kv", "2d965ad")]
    s = results.summarize(rows)
    # each ratio pairs the rows of its own run, never today's mpfa with an earlier session's FlashInfer
    assert s["output_throughput_ratio_vs_flashinfer_bf16"] == {"32768": pytest.approx(557.0 / 348.0)}
    assert s["output_throughput_ratio_vs_sglang_fa3_fp8kv"] == {"32768": pytest.approx(568.0 / 468.0)}
    assert s["throughput_rows_measured"]["32768/mpfa-qk4pv8"] == "2d965ad · 56 requests"
    assert s["throughput_rows_measured"]["32768/mpfa-qk4pv8@e38a3e2"] == "e38a3e2 · 56 requests"
    # FlashInfer measured again without mpfa: no pair for it, and the e38a3e2 headline row has no partner left
    later = results.merge_rows(rows, [_row("flashinfer-bf16", 32768, 350.0, "1111111")])
    assert [(r["config"], r["commit"]) for r in later] == [
        ("mpfa-qk4pv8", "2d965ad"), ("sglang-fa3-fp8kv", "2d965ad"), ("flashinfer-bf16", "1111111")]
    s = results.summarize(later)
    assert "output_throughput_ratio_vs_flashinfer_bf16" not in s
    assert s["output_throughput_ratio_vs_sglang_fa3_fp8kv"] == {"32768": pytest.approx(568.0 / 468.0)}


def test_the_geomean_needs_every_length_paired_in_runs_of_one_build():
    kernels = ["prefill_x_0123456789ab"]
    rows = []
    for n, commit in ((32768, "aaaaaaa"), (65536, "aaaaaaa"), (130048, "bbbbbbb")):   # 128K in a later session
        rows += [{**_row("mpfa-qk4pv8", n, 200.0, commit), "mpfa_kernels": kernels},
                 _row("sglang-fa3-bf16", n, 100.0, commit)]
    s = results.summarize(rows)
    assert s["output_throughput_ratio_vs_sglang_fa3_bf16_geomean"] == pytest.approx(2.0)
    rows[4] = {**rows[4], "mpfa_kernels": ["prefill_x_ba9876543210"]}   # that session's kernels differed
    assert "output_throughput_ratio_vs_sglang_fa3_bf16_geomean" not in results.summarize(rows)
    assert "output_throughput_ratio_vs_sglang_fa3_bf16_geomean" not in results.summarize(rows[:4])


def test_rows_are_stamped_with_the_run_of_their_call(tmp_path, monkeypatch):
    monkeypatch.setenv("MPFA_RUN", "queue-7")
    meta = results.with_calls({"command": "x", "commit": "abc"}, {})
    rows = results.write_rows([], [_row("mpfa-qk4pv8", 32768, 1.0, "abc")], tmp_path, meta)
    assert rows[0]["run"] == "queue-7" and meta["calls"][-1]["run"] == "queue-7"
