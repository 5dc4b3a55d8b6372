"""The fa3 FP8-KV peer of the accuracy harness (benchmarks.accuracy.model.fa3_fp8_attention): SGLang's fa3 backend
over an FP8 E4M3 cache runs FA3's FP8 path, Q, K, V and P in E4M3 with P = exp2(s - max + 8); checked here against a
plain per-row loop of that definition, and for what sets it apart from the FlashInfer peer (E4M3 Q and P)."""
import math

import torch

from benchmarks.accuracy.model import FA3_FP8_MAX_OFFSET, fa3_fp8_attention

E4M3 = torch.float8_e4m3fn


def _rows(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(torch.bfloat16)


def _loop(q, k, v, scaling):
    """The definition, one (batch, head, row) at a time, causal with the keys aligned to the end."""
    b, h, n, d = q.shape
    group, m = h // k.shape[1], k.shape[2]
    out = torch.zeros(b, h, n, d, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            q8, k8 = q[bi, hi].to(E4M3).double(), k[bi, hi // group].to(E4M3).double()
            v8 = v[bi, hi // group].to(E4M3).double()
            for i in range(n):
                seen = m - n + i + 1
                s = [float((q8[i] * k8[j]).sum()) * scaling * math.log2(math.e) for j in range(seen)]
                top = max(s)
                p = torch.tensor([2.0 ** (x - top + FA3_FP8_MAX_OFFSET) for x in s], dtype=torch.float32)
                out[bi, hi, i] = (p.to(E4M3).double() @ v8[:seen]) / p.double().sum()
    return out


def test_fa3_fp8_attention_is_its_definition():
    q, k, v = _rows(1, 4, 5, 16, seed=1) * 3, _rows(1, 2, 7, 16, seed=2) * 3, _rows(1, 2, 7, 16, seed=3)
    got = fa3_fp8_attention(q, k, v, 0.25).double()
    want = _loop(q, k, v, 0.25)
    assert torch.allclose(got, want.to(torch.bfloat16).double(), rtol=2 ** -7, atol=1e-6)
    # a boolean mask that says the same (True = attend) gives the same output
    mask = torch.ones(5, 7, dtype=torch.bool).tril(2)[None, None]
    assert torch.equal(fa3_fp8_attention(q, k, v, 0.25, mask=mask), fa3_fp8_attention(q, k, v, 0.25))


def test_fa3_fp8_rounds_q_and_p_where_the_flashinfer_peer_does_not():
    """Q off the E4M3 grid moves the output (FlashInfer keeps Q in bf16); K/V already on the grid isolate it."""
    q = _rows(1, 2, 64, 32, seed=4) * 2
    k, v = _rows(1, 2, 64, 32, seed=5).to(E4M3).to(torch.bfloat16), _rows(1, 2, 64, 32, seed=6).to(E4M3).to(torch.bfloat16)
    exact = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    on_grid = fa3_fp8_attention(q.to(E4M3).to(torch.bfloat16), k, v, 1 / math.sqrt(32)).double()
    got = fa3_fp8_attention(q, k, v, 1 / math.sqrt(32)).double()
    rel = lambda a: ((a - exact).norm() / exact.norm()).item()
    assert torch.equal(got, on_grid)            # Q is cast to E4M3 first: the same as giving it on the grid
    assert 1e-3 < rel(got) < 0.1                 # Q's and P's E4M3 steps: visible, not wild



def test_summary_sets_both_fp8_kv_peers_beside_the_recipes():
    from benchmarks.accuracy.model import PEER_FA3_FP8_KV, PEER_FP8_KV
    from benchmarks.accuracy.summary import summarize

    def row(impl, recipe, ppl, kl, comp=None, smooth=None):
        return {"kind": "model", "status": "ok", "text": "kjv", "context": 8192, "impl": impl, "recipe": recipe,
                "compensation": comp, "smoothing": smooth, "ppl": ppl, "kl": kl}
    rows = [row("mpfa", "bf16", 10.0, 0.0), row("mpfa", "qk4pv8", 10.15, 0.015, True, True),
            row(PEER_FP8_KV, None, 10.2, 0.02), row(PEER_FA3_FP8_KV, None, 10.3, 0.03)]
    s = summarize(rows)
    assert math.isclose(s["ppl_increase_sglang_fa3_fp8kv"], 0.03) and s["kl_sglang_fa3_fp8kv"] == 0.03
    assert math.isclose(s["ppl_increase_flashinfer_fp8kv"], 0.02) and s["ppl_context"] == 8192
    assert {f"{PEER_FP8_KV} (peer)", f"{PEER_FA3_FP8_KV} (peer)"} <= set(s["recipes"])
