"""The 4-bit V formats of the error-budget study (issue 33, benchmarks/accuracy/error_budget.py): codes in
range and exact in E4M3, the prefill path's FP8 tile image and the decode path's fp16 values, finer scales
and INT8 outlier channels cutting the error, and the bytes per token-head."""
import pytest
import torch

from benchmarks.accuracy import error_budget as eb
from mpfa.recipes.fp8 import E4M3_DTYPE, quantize_e4m3
from mpfa.recipes.int8 import bytes_per_token_head
from mpfa.recipes.u4h import hadamard


def _values(m=256, heads=2, d=64, seed=0):
    """Values whose channels differ in magnitude (0.2 .. 5) and means, plus two spiky channels per head."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(m, heads, d, generator=g) * torch.linspace(0.2, 5, d) + torch.randn(heads, d, generator=g)
    v[:, 0, 9] *= 12.0
    v[:, 1, 40] += 30.0
    return v.bfloat16().float()


def _err(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("asym", [False, True])
def test_codes_in_range_and_exact_in_e4m3(asym):
    x = _values()
    for group in (16, 32, 64):
        q, deq = eb.int4_groups(x, group, asym=asym)
        lo, hi = (0, 15) if asym else (-7, 7)                      # 16 codes, or INT4 without -8
        assert int(q.min()) >= lo and int(q.max()) <= hi
        assert int(q.min()) == lo and int(q.max()) == hi          # the range is used
        assert torch.equal(q.float().to(E4M3_DTYPE).float(), q.float())   # every code is an E4M3 value
        # the dequantized value is code * s (+ z) with fp16 s, z: one step of s at most from x
        g = x.reshape(*x.shape[:-1], -1, group)
        span = (g.amax(-1) - g.amin(-1)) if asym else g.abs().amax(-1)
        step = span / (eb.ASYM_MAX if asym else 7)
        worst = (deq - x).abs().reshape(g.shape).amax(-1)
        assert (worst <= 0.5 * step * (1 + 2e-3) + 1e-6).all()


def test_finer_scales_cut_the_error():
    x = _values()
    e = {g: _err(eb.int4_groups(x, g, asym=False)[1], x) for g in (64, 32, 16)}
    a = {g: _err(eb.int4_groups(x, g, asym=True)[1], x) for g in (64, 32, 16)}
    assert e[16] < 0.9 * e[32] < 0.9 * 0.9 * e[64], e
    assert a[16] < 0.9 * a[32] < 0.9 * 0.9 * a[64], a
    assert a[32] < 0.8 * e[32], (a, e)                          # channel means: the zero point pays


def test_outlier_channels():
    """The D/8 largest channels of the calibration values go INT8: they are exact to ~1/254 of their
    amax, and the other channels' groups shrink, so the whole row's error falls."""
    x = _values()
    mask = eb.v4_outlier_channels(x[:128])
    assert mask.shape == (2, 64) and (mask.sum(-1) == 8).all()
    assert mask[0, 9] and mask[1, 40]
    deq = eb.v4_quantize(x, eb.V4_FORMATS["v4a32o8"], mask)
    big = x[:, mask].reshape(x.shape[0], 2, 8)
    err_big = (deq[:, mask].reshape(big.shape) - big).abs().amax(-1)
    assert (err_big <= big.abs().amax(-1) / 254 * (1 + 2e-3)).all()
    assert _err(deq, x) < 0.7 * _err(eb.v4_quantize(x, eb.V4_FORMATS["v4a32"]), x)
    assert _err(eb.v4_quantize(x, eb.V4_FORMATS["v4ato8"], mask), x) < _err(eb.v4_quantize(x, eb.V4_FORMATS["v4at"]), x)


def _cal(v):
    k = torch.zeros_like(v)
    return eb.calibrate(k, v, "none")


@pytest.mark.parametrize("fmt", ["v4t", "v4b32", "v4b32m", "v4a32", "v4a32h", "v4a32o8", "v4ato8"])
def test_prefill_is_the_fp8_tile_image_decode_is_fp16(fmt):
    """Prefill (no suffix): V / (V's fixed per-channel scale) is an E4M3 value (the FP8 tile the pre-pass
    writes); ~f: the dequantized value itself, in fp16; ~s: the first page is v8's FP8 (same scales)."""
    v = _values()
    cal = _cal(v)
    spec = eb.V4_FORMATS[fmt]
    key = "v_scale_h" if spec.rotate else "v_scale_s" if spec.centre else "v_scale"
    h = hadamard(64, dtype=torch.float32)
    base = (v - cal["mu_v"] if spec.centre else v) @ (h if spec.rotate else torch.eye(64))
    back = (lambda y: y @ h) if spec.rotate else (lambda y: y)    # undo H^T (H is symmetric and orthonormal)
    pre, mean = eb.v4_effective(v, {"format": fmt, "sink": False, "fp16": False}, cal)
    assert (mean is not None) == spec.centre
    u = back(pre) / cal[key]
    # (e * s) / s in float32: an ulp; the rotation's round trip ~1e-4 (E4M3's finest spacing is 2^-9)
    assert torch.allclose(u.to(E4M3_DTYPE).float(), u, rtol=1e-6, atol=2e-4 if spec.rotate else 0), fmt
    dec, _ = eb.v4_effective(v, {"format": fmt, "sink": False, "fp16": True}, cal)
    deq = eb.v4_quantize(base, spec, cal["v_o8"])
    assert torch.allclose(back(dec), deq.half().float(), rtol=0, atol=1e-4 if spec.rotate else 0)
    assert torch.allclose(back(pre), quantize_e4m3(deq, cal[key]).float() * cal[key], rtol=0,
                          atol=1e-4 if spec.rotate else 0)
    sink, _ = eb.v4_effective(v, {"format": fmt, "sink": True, "fp16": False}, cal)
    want = quantize_e4m3(base[:eb.SINK_TOKENS], cal[key]).float() * cal[key]
    assert torch.allclose(back(sink)[:eb.SINK_TOKENS], want, rtol=0, atol=1e-4 if spec.rotate else 0)
    assert torch.equal(sink[eb.SINK_TOKENS:], pre[eb.SINK_TOKENS:])
    # the E4M3 step adds error on top of the 4-bit step; the decode path has only the latter
    assert _err(pre, v) > _err(dec, v)


def test_rotation_and_centring():
    h = hadamard(64, dtype=torch.float32)
    assert torch.allclose(h @ h.T, torch.eye(64), atol=1e-6)
    with pytest.raises(ValueError):
        hadamard(96)
    v = _values()
    cal = _cal(v)
    err = {f: _err(eb.v4_effective(v, {"format": f, "sink": False, "fp16": True}, cal)[0] +
                   (cal["mu_v"] if eb.V4_FORMATS[f].centre else 0), v) for f in ("v4a32", "v4a32h", "v4b32", "v4b32m")}
    assert err["v4a32h"] < err["v4a32"], err                  # the spiky channels spread over all 64
    assert err["v4b32m"] < err["v4b32"], err                  # centred: the channel means leave the groups


def test_bytes_at_d128():
    """Packed codes, fp16 parameters, each field padded to 4 bytes; K + V against bf16's 512."""
    want = {"v4t": 64 + 4, "v4b32": 64 + 8, "v4b32m": 64 + 8, "v4at": 64 + 4, "v4a32": 64 + 16, "v4a32h": 64 + 16,
            "v4a32o8": 16 + 56 + 20, "v4ato8": 16 + 56 + 8,
            "v4a32hr": 64 + 16, "v4a32hz": 64 + 12, "v4a32hzr": 64 + 12}   # a code zero point: one byte a group
    assert {f: eb.v4_bytes(f) for f in eb.V4_FORMATS} == want
    assert eb.v4_bytes("v4a32o8", 64) == 8 + 28 + 12
    impl = eb.cache_bytes(eb.parse(eb.IMPL))
    assert impl["bytes_d128"] == bytes_per_token_head("i4rs", 128) == 232
    r = eb.cache_bytes(eb.parse(eb.IMPL_QKP + "+v4a32h~s"))
    assert r["bytes_d128"] == 104 + 80 and r["x_bf16"] == pytest.approx(512 / 184)
    assert r["sink_page_extra_bytes"] == 16 * (128 - 80)
    assert eb.cache_bytes(eb.parse(eb.PEER_FP8KV))["bytes_d128"] == 256
    assert eb.cache_bytes(eb.parse("exact"))["x_bf16"] == 1.0


def test_parse_v4():
    c = eb.parse(eb.IMPL_QKP + "+v4a32h~s~f")
    assert (c["q"], c["k"], c["p"], c["v"]) == ("qi8s64", "ki4", True, "4")
    assert c["v4"] == {"format": "v4a32h", "sink": True, "fp16": True}
    assert eb.parse("v4t")["v4"] == {"format": "v4t", "sink": False, "fp16": False}
    for bad in ("v4x", "v4a32~b", "v4t~f~s"):
        with pytest.raises(ValueError):
            eb.parse(bad)
    assert set(eb.ISSUE33_V4) <= set(eb.ALL_CONFIGS)


def test_model_path_orders():
    """Through the attention: every 4-bit V costs more than FP8 V, and the asymmetric per-32 format with
    its INT8 channels less than the symmetric per-token one."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(64, 4, 64, generator=g).bfloat16()
    k = torch.randn(256, 2, 64, generator=g).bfloat16()
    v = _values().bfloat16()
    r = {n: x["rel_l2"] for n, x in eb.budget([(q, k, v)], ["v8", "v4t", "v4a32", "v4a32o8~s"]).items()}
    assert r["v8"] < 0.7 * r["v4a32o8~s"] and r["v4a32o8~s"] < r["v4a32"] < r["v4t"], r


def test_code_zero_point_keeps_zero_exact_and_costs_little():
    """``zp_code``: x ~= (q - zp) s with zp an integer code: a zero value dequantizes to exactly 0 (the fp16 zero point
    of min/max does not, in general), and the squared error stays within 1.5x the fp16 zero point's on Gaussian
    groups (the range is covered up to half a step at either end)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4096, 32, generator=gen)
    x[:, 5] = 0.0
    _, deq = eb.int4_groups(x, 32, asym=True, zp_code=True)
    assert (deq[:, 5] == 0).all()
    _, ref = eb.int4_groups(x, 32, asym=True)
    assert (ref[:, 5] != 0).any()
    assert _err(deq, x) <= 1.5 * _err(ref, x)


@pytest.mark.parametrize("zp_code", [False, True])
def test_refit_is_never_worse_than_min_max(zp_code):
    """The refit keeps min/max's parameters where no round beats them, so per group its squared error is at most
    min/max's; on Gaussian groups it cuts the mean squared error by over 10% with an fp16 zero point (14% measured;
    a 21 x 21 search of the range's ends: 16%), over 4% with a code zero point (6%; the search: 7%)."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4096, 32, generator=gen)
    _, plain = eb.int4_groups(x, 32, asym=True, zp_code=zp_code)
    q, clipped = eb.int4_groups(x, 32, asym=True, zp_code=zp_code, refit=True)
    per_group = lambda d: (d - x).square().sum(dim=-1)
    assert (per_group(clipped) <= per_group(plain) + 1e-6).all()
    assert per_group(clipped).mean() < (0.96 if zp_code else 0.9) * per_group(plain).mean()
    assert int(q.min()) >= 0 and int(q.max()) <= 15
