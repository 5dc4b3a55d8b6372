"""The accuracy harness's fa3 FP8-KV peer (benchmarks.accuracy.model.fa3_fp8_attention) against the kernel it
emulates: sglang-kernel's FA3 (``sgl_kernel.flash_attn``) on E4M3 Q, K, V with descales of 1.0, as SGLang's fa3
backend calls it over ``--kv-cache-dtype fp8_e4m3``. The emulation stands for the kernel in accuracy.json when the
two differ by much less than either differs from exact attention: a fraction of the kernel's own error. SmolLM2's
attention shape (9 query / 3 KV heads, head_dim 64) and a Llama one (32 / 8, 128), inputs with outlier channels."""
import math

import pytest
import torch

from benchmarks.accuracy.model import fa3_fp8_attention

pytestmark = [pytest.mark.gpu]
flash_attn = pytest.importorskip("sgl_kernel.flash_attn", reason="sglang-kernel's FA3 library is not installed "
                                 "(the fa3 device bundle; docs/accuracy.md)")

E4M3 = torch.float8_e4m3fn


def _rows(n, h, d, gen, scale=1.0):
    x = torch.randn(n, h, d, generator=gen, device="cuda") * scale
    x[..., 3] = x[..., 3] * 4 + 6          # a large-mean channel, as real K/V have
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (32, 8, 128)])
def test_emulation_tracks_fa3s_fp8_kernel(hq, hk, d):
    gen = torch.Generator(device="cuda").manual_seed(hq * d)
    n = 1536
    q, k, v = _rows(n, hq, d, gen, 1.5), _rows(n, hk, d, gen, 1.5), _rows(n, hk, d, gen)
    scale = 1 / math.sqrt(d)
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    ones = torch.ones(1, hk, dtype=torch.float32, device="cuda")
    out = flash_attn.flash_attn_varlen_func(q.to(E4M3), k.to(E4M3), v.to(E4M3), cu, cu, n, n, softmax_scale=scale,
                                            causal=True, k_descale=ones, v_descale=ones)
    out = (out[0] if isinstance(out, tuple) else out).double()
    emu = fa3_fp8_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale)
    emu = emu[0].transpose(0, 1).double()
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None].double(), k.transpose(0, 1)[None].double().repeat_interleave(hq // hk, 1),
        v.transpose(0, 1)[None].double().repeat_interleave(hq // hk, 1), is_causal=True)[0].transpose(0, 1)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    err_kernel, err_emu, gap = rel(out, exact), rel(emu, exact), rel(out, emu)
    assert torch.isfinite(out).all()
    assert 0.5 * err_kernel <= err_emu <= 1.5 * err_kernel, (err_kernel, err_emu)
    assert gap <= 0.5 * err_kernel, (gap, err_kernel)
