"""benchmarks.e2e.prefill_profile: reading a torch-profiler trace into kernel time by kind (no GPU needed)."""
from __future__ import annotations

import gzip
import json

import pytest

from benchmarks.e2e import prefill_profile as pp


def _event(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_kernels_are_sorted_into_kinds_mpfa_first():
    assert pp.kind_of("void mpfa::prefill_kernel<PrefillCfg<128, 16>>(PrefillParams)") == "mpfa attention"
    assert pp.kind_of("void kv_pack_kernel<Cfg>(PrefillParams)") == "mpfa pre-pass"
    assert pp.kind_of("void append_kv_kernel<L>(AppendParams)") == "mpfa append"
    assert pp.kind_of("void cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>") == "peer attention"
    assert pp.kind_of("void flashinfer::BatchPrefillWithPagedKVCacheKernel<...>") == "peer attention"
    assert pp.kind_of("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT") == "GEMM"
    assert pp.kind_of("void flashinfer::norm::FusedAddRMSNormKernel<8, bf16>") == "norm"
    # FlashInfer's CuTe-DSL RMSNorm (SGLang 0.5.17 on the H200) carries "cutlass" in its name: still a norm
    assert pp.kind_of("kernel_cutlass_kernel_flashinfernormkernelsfused_add_rmsnormFusedAddRMSNormKernel_object_at_"
                      "_tensorptrbf16gmemalign128oi64409640961") == "norm"
    assert pp.kind_of("void flashinfer::activation::act_and_mul_kernel<bf16, silu>") == "activation"
    assert pp.kind_of("void at::native::vectorized_elementwise_kernel<4, CopyFunctor>") == "elementwise and copies"
    assert pp.kind_of("some_new_kernel") == "other"


def test_busy_time_is_the_union_of_overlapping_kernels():
    events = [("a", 0.0, 10.0), ("b", 5.0, 10.0), ("c", 30.0, 5.0), ("d", 31.0, 1.0)]
    assert pp.busy_us(events) == 20.0   # [0, 15) and [30, 35)
    s = pp.summarize_events(events)
    assert s["busy_ms"] == 0.02 and s["span_ms"] == 0.035 and s["host_wait_ms"] == 0.015
    assert s["kernels_ms"] == {"other": pytest.approx(0.026)} and s["kernel_counts"] == {"other": 4}
    assert [k["name"] for k in s["top_kernels"]] == ["a", "b", "c", "d"]
    with pytest.raises(ValueError, match="no GPU events"):
        pp.summarize_events([])


def test_traces_are_read_from_gzip_and_plain_json_keeping_gpu_events_only(tmp_path):
    trace = {"traceEvents": [_event("nvjet_gemm", 100, 50), _event("Memcpy HtoD", 160, 5, cat="gpu_memcpy"),
                             {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 90, "dur": 70},
                             {"ph": "i", "cat": "kernel", "name": "marker", "ts": 1}]}
    with gzip.open(tmp_path / "r0.trace.json.gz", "wt") as f:
        json.dump(trace, f)
    (tmp_path / "r1.trace.json").write_text(json.dumps({"traceEvents": [_event("void append_kv_kernel<x>", 200, 20)]}))
    assert pp.kernel_events([_event("k", 1, 2)]) == [("k", 1.0, 2.0)]   # a bare event list is a trace too
    events = pp.read_traces(tmp_path)
    assert sorted(e[0] for e in events) == ["Memcpy HtoD", "nvjet_gemm", "void append_kv_kernel<x>"]
    s = pp.summarize_events(events)
    assert s["kernels_ms"] == {"GEMM": 0.05, "elementwise and copies": 0.005, "mpfa append": 0.02}
    assert s["span_ms"] == 0.12 and s["host_wait_ms"] == pytest.approx(0.045)


def test_the_hosts_work_inside_the_gpus_idle_stretches_is_named(tmp_path):
    """A trace with CPU activity: GPU kernels [0, 100) [150, 250) [255, 300) [1500, 1600) (the 5-us gap is a launch's
    latency, under MIN_GAP_US); host events overlapping the 50-us and 1,200-us gaps count their time inside them."""
    gpu = [_event("gemm", 0, 100), _event("gemm", 150, 100), _event("norm", 255, 45),
           _event("prefill_kernel", 1500, 100)]
    host = [_event("cudaStreamSynchronize", 90, 60, cat="cuda_runtime"),      # 50 us inside [100, 150)
            _event("aten::item", 80, 75, cat="cpu_op"),                        # 50 us inside [100, 150)
            _event("mpfa plan", 400, 1000, cat="user_annotation"),             # 1,000 us inside [300, 1500)
            _event("aten::copy_", 1450, 100, cat="cpu_op"),                    # 50 us inside [300, 1500)
            _event("aten::copy_", 10, 20, cat="cpu_op"),                       # while the GPU ran: not counted
            _event("cudaLaunchKernel", 1490, 5, cat="cuda_runtime")]           # 5 us
    (tmp_path / "r0.trace.json").write_text(json.dumps({"traceEvents": gpu + host}))
    gaps = pp.idle_gaps(pp.read_traces(tmp_path))
    assert gaps == [(100.0, 150.0), (300.0, 1500.0)]
    h = pp.host_during_gaps(gaps, pp.read_traces(tmp_path, pp.host_events))
    assert h["gaps"] == 2 and h["gap_ms"] == 1.25
    assert h["gaps_of_1ms_or_more"] == 1 and h["gaps_of_1ms_or_more_ms"] == 1.2
    inside = h["host_events_inside"]
    assert inside["user_annotation"] == [{"name": "mpfa plan", "ms": 1.0, "count": 1}]
    assert inside["cpu_op"] == [{"name": "aten::item", "ms": 0.05, "count": 1},
                                {"name": "aten::copy_", "ms": 0.05, "count": 1}]
    assert inside["cuda_runtime"] == [{"name": "cudaStreamSynchronize", "ms": 0.05, "count": 1},
                                      {"name": "cudaLaunchKernel", "ms": 0.005, "count": 1}]
    assert pp.host_during_gaps([], [("cpu_op", "x", 0.0, 10.0)])["host_events_inside"] == {}


def test_the_summary_sets_the_headline_against_each_peer():
    def row(config, kinds, busy, span, ttft):
        return {"config": config, "status": "ok", "kernels_ms": kinds, "busy_ms": busy, "span_ms": span,
                "host_wait_ms": span - busy, "ttft_s": ttft}
    rows = [row("mpfa-qk4pv8", {"GEMM": 600.0, "mpfa attention": 300.0, "mpfa pre-pass": 20.0}, 950.0, 1000.0, 1.08),
            row("sglang-fa3-fp8kv", {"GEMM": 600.0, "peer attention": 310.0}, 930.0, 960.0, 1.04),
            {"config": "sglang-fa3-bf16", "status": "error", "error": "x"}]
    s = pp.compare(rows)
    d = s["delta_ms_vs_sglang-fa3-fp8kv"]
    assert d["GEMM"] == 0.0 and d["mpfa pre-pass"] == 20.0 and d["peer attention"] == -310.0
    assert d["busy_ms"] == 20.0 and d["host_wait_ms"] == 20.0 and d["ttft_s"] == pytest.approx(0.04)
    assert list(s) == ["delta_ms_vs_sglang-fa3-fp8kv"]   # the failed row sets nothing
    assert "sm_clock_mhz_median" not in d   # neither row sampled the clocks
    assert pp.compare(rows[1:]) == {}
    rows[0]["gpu_clocks_timed"] = {"sm_clock_mhz": {"median": 1755.0, "min": 1600.0, "max": 1980.0}}
    rows[1]["gpu_clocks_timed"] = {"sm_clock_mhz": {"median": 1830.0, "min": 1700.0, "max": 1980.0}}
    assert pp.compare(rows)["delta_ms_vs_sglang-fa3-fp8kv"]["sm_clock_mhz_median"] == -75.0
    rows[1]["gpu_clocks_timed"] = {"samples": 0, "error": "nvidia-smi not found"}
    assert "sm_clock_mhz_median" not in pp.compare(rows)["delta_ms_vs_sglang-fa3-fp8kv"]


def test_refuses_bad_arguments_and_the_published_folder(capsys):
    for argv, msg in ((["--configs", "mpfa-int4"], "--configs: choose from"),
                      (["--input-len", "0"], "--input-len must be in"),
                      (["--out", str(pp.publish.RESULTS_DIR)], "published results folder")):
        with pytest.raises(SystemExit):
            pp.main(argv)
        assert msg in capsys.readouterr().err
