"""README's "The API in ten lines" is a complete program: this test runs that code block as README.md
holds it (so the two cannot drift), on the CPU with the reference backend and on a GPU with the kernels."""
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## The API in ten lines"


def api_block() -> str:
    """The first ```python block of README's API section."""
    text = README.read_text()
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    assert "```python\n" in section, f"README.md's {SECTION!r} has no ```python block"
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_api_block_runs_as_written():
    code = api_block()
    assert 10 <= len(code.strip().splitlines()) <= 16, "keep README's API example about ten lines"
    namespace = {"__name__": "__main__"}
    exec(compile(code, f"{README}:{SECTION}", "exec"), namespace)   # a fresh namespace: it imports what it needs
    o, o1, q = namespace["o"], namespace["o1"], namespace["q"]
    assert o.shape == q.shape and o1.shape == (1, *q.shape[1:])
    assert torch.isfinite(o).all() and torch.isfinite(o1).all()
    # The decode query is the prompt's last row over the same keys: the prefill's last output row, up to
    # the prefill's INT8 Q and E4M3 P rounding (decode keeps Q and P in fp16), within twice the error those
    # formats predict for this very data (predicted_prefill_decode_gap).
    err = ((o[-1].double() - o1[0].double()).norm() / o1.double().norm()).item()
    bound = 2 * predicted_prefill_decode_gap(namespace)
    assert err <= bound, f"decode of the last prompt row vs the prefill's last row: rel-L2 {err:.4f} > {bound:.4f}"


def predicted_prefill_decode_gap(ns: dict) -> float:
    """RMS relative L2 gap between the prefill's and the decode's output for the last prompt row that the
    formats predict, to first order, for the README's data (``ns``: its names).

    Both read the same stored V and integer K; the prefill rounds more. With w the softmax weights,
    O = sum_j w_j v_j, a score error ds_j and a relative P error d_j: dO = sum_j w_j (v_j - O) (ds_j + d_j).
    - Q: INT8, Q - mu_Q under a scale s_Q no larger than amax|Q - mu_Q| / 127 over the request (or, comp_mma
      builds, 127 |mu_Q|_1 / COMP_SCALE_DIVISOR if larger: mpfa.recipes.int8); each element off by
      u ~ U(+-s_Q / 2), variance s_Q^2 / 12, one u for every key: E|dO_Q|^2 = s_Q^2 / 12 * |M|_F^2 with
      M = sm * sum_j w_j (v_j - O) K_j^T.
    - per key, independent: K requantized to its tile's largest scale (tile_scale builds, at most the largest
      token scale s_K: variance s_K^2 / 12 per element, sm^2 s_K^2 / 12 |q|^2 on the score) and the compensation
      term rounded to s_Q s_K (variance sm^2 s_Q^2 s_K^2 / 12): E|dO_K|^2 = sum_j w_j^2 var_j |v_j - O|^2.
    - P: E4M3, 3 mantissa bits: relative error within +-2^-4 (half the 2^-3 spacing at the bottom of a
      binade), variance <= 2^-8 / 3, independent per key: E|dO_P|^2 <= 2^-8 / 3 * sum_j w_j^2 |v_j - O|^2
      (|v_j| where the normaliser sums unrounded P; the larger is taken).
    - both outputs are bf16: relative 2^-9 at most each, variance <= 2^-18 / 3 each.
    Sums over ~4K channel terms concentrate: 2x this RMS is a bound the first-order model leaves room in."""
    from mpfa.recipes.int8 import COMP_SCALE_DIVISOR, INT8_MAX
    q, layer = ns["q"].double().cpu(), ns["cache"].layer(0)
    kd, vd = (t.cpu() for t in layer.dequantize(dtype=torch.float64))   # [pages, H_kv, P, D]
    n, heads, d = q.shape
    group = heads // kd.shape[1]
    rows = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1], *t.shape[3:])[:n]   # [pages, H, P, ...] -> [n, H, ...]
    keys, values = rows(kd), rows(vd)
    s_k = rows(layer.fields["k_scale"].double().cpu().unsqueeze(-1)).amax(dim=(0, 2))   # per KV head
    sm = d ** -0.5
    mu = q.mean(0)
    s_q = torch.maximum((q - mu).abs().amax(dim=(0, 2)) / INT8_MAX, INT8_MAX * mu.abs().sum(-1) / COMP_SCALE_DIVISOR)
    var = out2 = 0.0
    for h in range(heads):
        k_h, v_h, sk = keys[:, h // group], values[:, h // group], s_k[h // group].item()
        w = torch.softmax(sm * k_h @ q[-1, h], 0)
        o_h = w @ v_h
        m = sm * (w[:, None] * (v_h - o_h)).T @ k_h
        per_key = sm ** 2 * sk ** 2 / 12 * ((q[-1, h] ** 2).sum().item() + s_q[h].item() ** 2)
        spread = torch.maximum((v_h - o_h).norm(dim=1), v_h.norm(dim=1))
        var += s_q[h].item() ** 2 / 12 * (m ** 2).sum().item()
        var += (per_key * ((w * (v_h - o_h).norm(dim=1)) ** 2).sum() + 2.0 ** -8 / 3 * ((w * spread) ** 2).sum()).item()
        out2 += (o_h ** 2).sum().item()
    var += 2 * 2.0 ** -18 / 3 * out2
    return (var / out2) ** 0.5
