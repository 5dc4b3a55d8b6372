"""The error-budget study (benchmarks/accuracy/error_budget.py) on tiny synthetic inputs: its K
quantizer is the package's, its combined configuration is the recipe's prefill numerics, and the
orderings the study reports hold with margins that can fail."""
import pytest
import torch

from benchmarks.accuracy import error_budget as eb
from benchmarks.accuracy import kernel
from mpfa.recipes.fp4 import dequantize_k4, quantize_k4
from mpfa.recipes.fp8 import quantize_e4m3
from mpfa.recipes.int8 import dequantize_i4rs, dequantize_k_per_token, quantize_i4rs, quantize_k_per_token
from mpfa.reference.attention import recipe_attention


@pytest.fixture(scope="module")
def outlier():
    return kernel.synthetic(256, 64, 4, 2, 64, outliers=True, seed=1)


@pytest.fixture(scope="module")
def res(outlier):
    return eb.budget([outlier], ["exact", "q8s", "k4", "k4@all", "k4e@all", "k4f@all", "k8@all", "p8", "v8",
                                 eb.V1_IMPL, "k4@all~s"])


def test_k4_is_the_package_format():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 2, 64, generator=g) * torch.rand(300, 2, 1, generator=g) * 20
    x[:, :, 7] += 40
    assert torch.equal(eb.k4(x), dequantize_k4(*quantize_k4(x)))
    fp32 = (eb.k4(x, scales="fp32") - x).norm()
    for s in ("restricted", "restricted_mse", "e4m3"):        # exact scales are the limit of every scale format
        assert (eb.k4(x, scales=s) - x).norm() >= fp32 * 0.999, s
    assert (eb.k4(x, scales="restricted_mse") - x).norm() <= (eb.k4(x) - x).norm()   # per block the better of two


@pytest.mark.parametrize("recipe", ["qk8pv8", "qk4pv8"])
def test_combined_is_the_recipe(outlier, recipe):
    q, k, v = outlier
    cal = eb.calibrate(k, v, "all")
    o, k_eff = eb.quantized_attention(q, k, v, eb.parse(eb.IMPL8 if recipe == "qk8pv8" else eb.IMPL), cal=cal)
    ks = k.float() - cal["mu_k"]
    k_ref = dequantize_k_per_token(*quantize_k_per_token(ks)) if recipe == "qk8pv8" else dequantize_i4rs(*quantize_i4rs(ks))
    assert torch.equal(k_eff, k_ref)
    v_ref = quantize_e4m3(v.float(), cal["v_scale"]).float() * cal["v_scale"]
    ref, _ = recipe_attention(q, k_ref, v_ref, recipe=recipe, causal=True, compensation=True)
    assert torch.allclose(o, ref, rtol=0, atol=1e-12)


def test_orderings(res):
    r = {n: m["rel_l2"] for n, m in res.items()}
    assert r["exact"] < 1e-12
    assert r["k4@all"] > 3 * r["p8"] and r["k4@all"] > 3 * r["v8"], r     # 4-bit K dominates the budget
    assert r["k8@all"] < 0.3 * r["k4@all"], r
    assert r["k4@all"] < 0.7 * r["k4"], r                                   # smoothing helps mean outliers
    assert r["k4e@all"] < r["k4@all"], r                                     # unrestricted scales: less error
    assert r[eb.V1_IMPL] >= 0.9 * r["k4@all"], r                            # the rest adds little
    assert len(res["k4"]["per_layer_rel_l2"]) == 1


def test_parse():
    c = eb.parse("q8s+eqk4e@first~s+p8+v8")
    assert (c["q"], c["k"], c["eq"], c["mu"], c["sink"], c["p"], c["v"]) == ("q8s", "k4e", True, "first", True, True, True)
    c = eb.parse("k4r@all~b")
    assert (c["k"], c["mu"], c["sink"], c["sink_exact"]) == ("k4r", "all", True, True)
    with pytest.raises(ValueError):
        eb.parse("k5")


def test_causal_blocks_change_nothing(outlier, monkeypatch):
    q, k, v = outlier
    cal = eb.calibrate(k, v, "all")
    o, _ = eb.quantized_attention(q, k, v, eb.parse(eb.IMPL), cal=cal)
    monkeypatch.setattr(eb, "Q_BLOCK", 24)                    # 64 query rows -> blocks of 24, 24, 16
    ob, _ = eb.quantized_attention(q, k, v, eb.parse(eb.IMPL), cal=cal)
    assert torch.allclose(o, ob, rtol=0, atol=1e-13)


@pytest.mark.parametrize("share", [0.5, 0.25])
def test_k4rs_is_one_e4m3_operand_per_key(share):
    """k4rs / k4rsq: every dequantized channel divided by the row's one scale is an E4M3 value (the QK
    MMA can take the whole K row as one E4M3 operand), and the FP8 channels are the low-frequency ones."""
    from mpfa.recipes.fp4 import TOKEN_TARGET
    from mpfa.recipes.fp8 import E4M3_DTYPE, amax_scale
    gen = torch.Generator().manual_seed(3)
    for d in (64, 128):
        x = torch.randn(300, d, generator=gen) * torch.linspace(0.1, 4, d)
        y = eb.k4rs(x, fp8_share=share)
        ts = amax_scale(x.abs().amax(dim=-1), TOKEN_TARGET).unsqueeze(-1)
        u = y / ts   # the stored E4M3 value times the block scale, up to float32 rounding of (q * ts) / ts
        # a value E4M3 cannot hold is off by at least 2^-4 relative; float32 rounding is ~1e-7
        assert torch.allclose(u.to(E4M3_DTYPE).float(), u, rtol=1e-5, atol=0), "not exact in E4M3"
        low = (torch.arange(d) % (d // 2)) >= round((1 - share) * (d // 2))
        assert low.sum() == round(share * d)
        err = lambda m: float(((y - x)[:, m]).norm() / x[:, m].norm())
        assert err(low) < 0.5 * err(~low)   # FP8 there, 4-bit elsewhere


def test_pv_variants_parse():
    c = eb.parse("qi8s64+ki8@all+p16+v8s")
    assert (c["q"], c["k"], c["mu"], c["p"], c["v"]) == ("qi8s64", "ki8", "all", "p16", "s")
    assert eb.parse("pbf")["p"] == "pbf" and eb.parse("p8")["p"] is True and eb.parse("v8")["v"] is True
    assert eb.parse("p16+vi8")["v"] == "i8"
    for bad in ("p4", "v8x", "qi8s32"):
        with pytest.raises(ValueError):
            eb.parse(bad)
    assert set(eb.ISSUE20_PV) <= set(eb.ALL_CONFIGS)
    for name in eb.ISSUE20_PV:
        eb.parse(name)


def test_q_tile_64(outlier):
    """qi8s64 is qi8s while the call has at most 64 query rows; where the rows' magnitude changes every
    64 rows, the finer tile has less error on the rows of the smaller tile."""
    q, k, v = outlier
    assert q.shape[0] <= 64
    cal = eb.calibrate(k, v, "all")
    o128, _ = eb.quantized_attention(q, k, v, eb.parse("qi8s"), cal=cal)
    o64, _ = eb.quantized_attention(q, k, v, eb.parse("qi8s64"), cal=cal)
    assert torch.equal(o128, o64)
    g = torch.Generator().manual_seed(5)
    n, m = 128, 256
    q = torch.randn(n, 4, 64, generator=g)
    q[:64] *= 8                                                     # the first 64-row tile is 8x larger
    k = torch.randn(m, 2, 64, generator=g)
    v = torch.randn(m, 2, 64, generator=g)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ref = eb.attention(q, k, v, causal=True)[0][64:]
    cal = eb.calibrate(k, v, "none")
    err = {name: float((eb.quantized_attention(q, k, v, eb.parse(name), cal=cal)[0][64:] - ref).norm())
           for name in ("qi8s", "qi8s64")}
    assert err["qi8s64"] < 0.4 * err["qi8s"], err


def test_p_rounding_orders(res, outlier):
    r = {name: x["rel_l2"] for name, x in eb.budget([outlier], ["p8", "p16", "pbf"]).items()}
    assert r["p16"] < 0.05 * r["p8"], r                              # 11 significant bits against 4
    assert r["p16"] < r["pbf"] < r["p8"], r


def test_v_smoothing():
    """A V channel with a large mean: v8s (centred, then FP8) has far less error than v8; a V whose rows
    are all equal is exact under v8s even with P in FP8 (mu_V added after the division by l), while
    v8 carries P's rounding into the output through rowsum(P_q) / l."""
    g = torch.Generator().manual_seed(7)
    n, m = 64, 256
    q = torch.randn(n, 4, 64, generator=g).bfloat16()
    k = torch.randn(m, 2, 64, generator=g).bfloat16()
    v = torch.randn(m, 2, 64, generator=g)
    v[:, :, 5] += 60.0
    v[:, 1, 17] -= 30.0
    r = {name: x["rel_l2"] for name, x in eb.budget([(q, k, v.bfloat16())], ["v8", "v8s", "p8+v8", "p8+v8s"]).items()}
    assert r["v8s"] < 0.5 * r["v8"], r
    vi8 = eb.budget([(q, k, v.bfloat16())], ["vi8"])["vi8"]["rel_l2"]
    assert vi8 < r["v8"], (vi8, r)             # 8 bits under one per-channel scale against E4M3's 4 significant
    assert r["p8+v8s"] < 0.7 * r["p8+v8"], r
    const = torch.randn(1, 2, 64, generator=g).expand(m, 2, 64).bfloat16()
    cal = eb.calibrate(k, const, "none")
    o_s, _ = eb.quantized_attention(q, k, const, eb.parse("p8+v8s"), cal=cal)
    o_8, _ = eb.quantized_attention(q, k, const, eb.parse("p8+v8"), cal=cal)
    want = eb._expand(const[:1].double(), 4)[0]
    assert torch.allclose(o_s, want.expand_as(o_s), rtol=0, atol=1e-12)
    assert (o_8 - want).abs().max() > 1e-4


def test_v_smoothing_sink_page(outlier):
    """v8s~s: the first SINK_TOKENS values uncentred, mu_V weighted by 1 - l_sink / l; with P exact this
    is exact attention over the dequantized values with mu_V added back to the centred ones."""
    from mpfa.recipes.fp8 import quantize_e4m3
    q, k, v = outlier
    v = (v.float() + torch.linspace(-20, 20, v.shape[-1])).bfloat16()     # channels with large means
    cal = eb.calibrate(k, v, "none")
    o, _ = eb.quantized_attention(q, k, v, eb.parse("v8s~s"), cal=cal)
    vc = v.float() - cal["mu_v"]
    vc[:eb.SINK_TOKENS] = v[:eb.SINK_TOKENS].float()
    vq = (quantize_e4m3(vc, cal["v_scale_s"]).float() * cal["v_scale_s"]).double()
    vq[eb.SINK_TOKENS:] += cal["mu_v"].double()
    want = eb.attention(q, k, vq, causal=True)[0]
    # float32 values of magnitude ~20 added to the output in float64: ~1e-6 apart
    assert torch.allclose(o, want, rtol=0, atol=1e-5), float((o - want).abs().max())
    o_plain, _ = eb.quantized_attention(q, k, v, eb.parse("v8s"), cal=cal)
    assert (o_plain - want).abs().max() > 1e-2                 # the sink page's handling is visible


def test_per_tile_k_requantization():
    """ki8t / ki4t: one scale per 128-key tile (the tile's largest token scale); equal to the per-token format when
    every token has the same scale, coarser when the scales differ, and never coarser than the tile's own grid."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 2, 64, generator=g)
    same = x / x.abs().amax(dim=-1, keepdim=True)           # every token's amax 1: one scale per tile already
    assert torch.equal(eb.ki8t(same), eb.ki8(same))
    x[::7] *= 0.1                                           # small tokens share their tile's large scale
    e_tok, e_tile = (eb.ki8(x) - x).norm(), (eb.ki8t(x) - x).norm()
    assert e_tile > 1.2 * e_tok
    step = x.abs().amax(dim=-1).reshape(2, 128, 2).amax(dim=1) / 127        # [tile, head]
    err = (eb.ki8t(x) - x).abs().amax(dim=-1).reshape(2, 128, 2).amax(dim=1)
    assert (err <= step * (1 + 1e-3)).all()   # double rounding: half a token step + half a tile step
    assert (eb.ki4t(x) - x).norm() >= 0.999 * (eb.ki4(x) - x).norm()
    assert eb.parse("qi8sH+ki8t@all+p8+v8")["q"] == "qi8sH"
