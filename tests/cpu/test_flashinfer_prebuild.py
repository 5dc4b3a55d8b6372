"""CPU tests of benchmarks/flashinfer_prebuild.py's module sets, as plain data: which FlashInfer modules
SGLang 0.5.17's flashinfer backend requests for the served shapes (no torch, FlashInfer or SGLang needed;
the JitSpecs themselves are checked against FlashInfer by `--verify --set sglang`)."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks import flashinfer_prebuild as fp

REPO = Path(__file__).resolve().parents[2]


def test_models_match_the_server_configs():
    by_name = {m[0]: m[1:] for m in fp.SGLANG_MODELS}
    for name, folder in (("Llama-3.1-8B", "llama-3.1-8b"), ("Qwen3-14B", "qwen3-14b")):
        c = json.loads((REPO / "server_configs" / "models" / folder / "config.json").read_text())
        hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        assert by_name[name] == (hd, c["num_attention_heads"], c["num_key_value_heads"])
        assert c["torch_dtype"] == "bfloat16" and not c.get("use_sliding_window") and not c.get("sliding_window")
    assert by_name["SmolLM2-135M-Instruct"] == (64, 9, 3)   # hidden 576 / 9 heads


def test_tensor_core_decode_follows_sglang():
    assert not fp.sglang_decode_uses_tensor_cores("bf16", 9, 3)    # SmolLM2: group 3, CUDA-core decode
    assert fp.sglang_decode_uses_tensor_cores("fp8_e4m3", 9, 3)    # FP8 KV: always tensor cores
    assert fp.sglang_decode_uses_tensor_cores("bf16", 32, 8)       # Llama: group 4
    assert fp.sglang_decode_uses_tensor_cores("bf16", 40, 8)       # Qwen3: group 5


def test_sglang_set_modules():
    keys = [k for _, k in fp.sglang_calls()]
    assert sorted(set(keys), key=str) == sorted({
        ("decode", "bf16", 64),
        ("prefill", "fa2", "bf16", 64), ("prefill", "fa3", "bf16", 64), ("prefill", "fa2", "e4m3", 64),
        ("prefill", "fa2", "bf16", 128), ("prefill", "fa3", "bf16", 128), ("prefill", "fa2", "e4m3", 128),
        ("cascade",), ("sampling",)}, key=str)
    # the ragged part always sees bf16 K/V (the new tokens), FP8 only in the paged (cached) part
    assert all(k == ("prefill", "fa3", "bf16", k[3]) for u, k in fp.sglang_calls() if "Ragged" in u)
    # build priority: every head_dim-64 and the 128 bf16-KV modules before any FP8 one, the sampler last
    first_fp8 = next(i for i, k in enumerate(keys) if "e4m3" in k)
    assert {("decode", "bf16", 64), ("prefill", "fa3", "bf16", 128), ("cascade",)} <= set(keys[:first_fp8])
    assert keys[-1] == ("sampling",)


def test_default_out_per_set():
    assert fp.DEFAULT_OUT == {"peers": Path(".fi_aot"), "sglang": Path(".fi_aot_sglang")}
    assert set(fp.SETS) == set(fp.DEFAULT_OUT)
