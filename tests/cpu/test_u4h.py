"""qk4pv4's 4-bit Hadamard V (mpfa.recipes.u4h) against its module docstring's definition: the rotation (orthonormal, the exact
fp32 butterfly order), the quantizer's error bound from its step, byte layout, the all-equal and non-finite rules,
the decode / prefill views, the output rotation, and the reference append byte for byte against a literal
scalar implementation of the contract (numpy float32 / float16 arithmetic, one operation at a time)."""
import math

import numpy as np
import pytest
import torch

import mpfa
from mpfa.recipes import get_recipe
from mpfa.recipes.fp8 import E4M3_DTYPE
from mpfa.recipes import u4h

HEAD_DIMS = (64, 128)


def _rows(n, d, seed, *, spread=True):
    """bf16 rows whose channels differ in scale (0.2 .. 5), with a mean and one spiky channel: real V's shape."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    if spread:
        x = x * torch.linspace(0.2, 5, d) + torch.randn(d, generator=g)
        x[:, 7] *= 12
    return x.bfloat16()


# --- a literal implementation of the contract, one scalar operation at a time -----------------------------------

def _literal_rotate(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float32).copy()
    d = x.size
    h = 1
    while h < d:
        for i in range(d):
            if i & h == 0:
                a, b = x[i], x[i + h]
                x[i], x[i + h] = np.float32(a + b), np.float32(a - b)
        h *= 2
    return (x * np.float32(1.0 / math.sqrt(d))).astype(np.float32)


def _literal_quantize(row_bf16: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(bytes uint8 [D/2], params float16 [D/16]) of one bf16 row, the contract step by step."""
    r = _literal_rotate(row_bf16.float().numpy())
    d = r.size
    codes = np.zeros(d, dtype=np.uint8)
    params = np.zeros(d // 16, dtype=np.float16)
    for g in range(d // 32):
        x = r[32 * g:32 * (g + 1)]
        if not np.isfinite(x).all():
            params[2 * g] = params[2 * g + 1] = np.float16(np.nan)
            continue
        lo, hi = np.float32(x.min()), np.float32(x.max())
        with np.errstate(over="ignore"):
            zero = np.float16(np.float32(lo + np.float32(0)))   # -0 + 0 = +0
            span = np.float32(hi - np.float32(zero))
            scale = np.float16(np.float32(span / np.float32(15)))
        if span <= 0 or scale == 0:
            scale = np.float16(1)
        top = np.float32(np.float32(15) * np.float32(scale) + np.float32(zero))   # the product is exact
        if not (np.isfinite(zero) and np.isfinite(scale)) or top > 65504:
            params[2 * g] = params[2 * g + 1] = np.float16(np.nan)
            continue
        inv = np.float32(np.float32(1) / np.float32(scale))
        for c in range(32):
            y = np.float32(np.float32(x[c] - np.float32(zero)) * inv)
            codes[32 * g + c] = int(min(max(np.rint(y), 0), 15))        # np.rint: half to even
        params[2 * g], params[2 * g + 1] = scale, zero
    packed = np.array([codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(d // 2)], dtype=np.uint8)
    return packed, params


def _same_params(a: torch.Tensor, b: np.ndarray) -> bool:
    """fp16 parameters equal bit for bit, NaN equal to NaN whatever its payload (the contract leaves it open)."""
    a = a.numpy()
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    return bool((nan_a == nan_b).all() and (a[~nan_a].view(np.uint16) == b[~nan_b].view(np.uint16)).all())


# --- the rotation -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d", HEAD_DIMS)
def test_hadamard_is_symmetric_orthonormal_and_sylvester(d):
    hp = u4h.hadamard_pm1(d)
    assert set(hp.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(hp, hp.T) and torch.equal(hp @ hp, d * torch.eye(d))
    half = u4h.hadamard_pm1(d // 2) if d > 64 else None
    if half is not None:   # Sylvester: H_2n = [[H, H], [H, -H]]
        assert torch.equal(hp, torch.cat([torch.cat([half, half], 1), torch.cat([half, -half], 1)]))
    assert torch.equal(u4h.hadamard_pm1(d, dtype=torch.bfloat16).float(), hp)     # exact in bf16
    h = u4h.hadamard(d)
    assert torch.allclose(h @ h, torch.eye(d, dtype=torch.float64), atol=1e-15)
    assert u4h.rsqrt_d(64) == 0.125
    assert u4h.rsqrt_d(128) == float(np.float32(0.08838834764831845))


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_rotation_is_v_times_h_within_fp32_rounding(d):
    """Each of the log2(D) butterfly stages rounds values no larger than the row's L1 norm once, the final
    multiply once more: |r - V H| <= (log2 D + 1) * 2^-24 * ||v||_1 / sqrt(D) elementwise (float64 reference)."""
    v = _rows(200, d, 1)
    r = u4h.rotate(v).double()
    exact = v.double() @ u4h.hadamard(d)
    bound = (math.log2(d) + 1) * 2.0 ** -24 * v.double().abs().sum(-1, keepdim=True) / math.sqrt(d)
    err = (r - exact).abs()
    assert (err <= bound).all()
    assert err.max() > 0                       # fp32 arithmetic, not a float64 matmul in disguise
    assert torch.allclose(r, (v.float() @ u4h.hadamard(d, dtype=torch.float32)).double(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_rotation_follows_the_butterfly_order_bit_for_bit(d):
    # channels 10^-4 .. 10^4 apart: bf16's 8 bits over a 27-bit range, so partial sums round in fp32 and the order
    # of the additions shows in the bits
    g = torch.Generator().manual_seed(2)
    v = (torch.randn(24, d, generator=g) * 10.0 ** (8 * torch.rand(24, d, generator=g) - 4)).bfloat16()
    r = u4h.rotate(v)
    for i in range(v.shape[0]):
        assert np.array_equal(r[i].numpy().view(np.uint32), _literal_rotate(v[i].float().numpy()).view(np.uint32))
    # another fp32 order (the stages from h = D/2 down) gives other bits on some rows: the test can tell orders apart
    x = v.float()
    h = d // 2
    while h >= 1:
        p = x.reshape(-1, d // (2 * h), 2, h)
        x = torch.stack((p[..., 0, :] + p[..., 1, :], p[..., 0, :] - p[..., 1, :]), dim=-2).reshape(-1, d)
        h //= 2
    other = x * torch.tensor(u4h.rsqrt_d(d))
    assert not torch.equal(other, r)


# --- quantize / dequantize --------------------------------------------------------------------------------------

def _step_bound(r: torch.Tensor, v_param: torch.Tensor) -> torch.Tensor:
    """Per channel, the largest |decode - r| the contract allows: half a step s (rni; the two fp32 roundings of
    (r - zero) * inv move y by < 3 * 16 * 2^-24) or, in a group whose fp16 zero point rounded above its minimum,
    the clamp at code 0 (at most half an fp16 ulp of lo <= 2^-11 |lo|); the top never clamps (s >= d / 15 to fp16's
    2^-11, so y < 15.01); plus decode's own fp16 rounding (2^-11 of the value)."""
    d = r.shape[-1]
    scale, zero = (t.double().repeat_interleave(u4h.GROUP, dim=-1) for t in u4h.split_param(v_param))
    return scale * (0.5 + 48 * 2.0 ** -24) + 2.0 ** -11 * zero.abs() + 2.0 ** -11 * (r.abs() + scale * 0.5)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_round_trip_error_within_half_a_step(d):
    v = _rows(500, d, 3)
    packed, v_param = u4h.quantize_u4h(v)
    assert packed.dtype == torch.uint8 and packed.shape == (500, d // 2)
    assert v_param.dtype == torch.float16 and v_param.shape == (500, d // 16)
    r = u4h.rotate(v).double()
    dec = u4h.decode_values(packed, v_param).double()
    err = (dec - r).abs()
    bound = _step_bound(r, v_param)
    assert (err <= bound).all(), (err / bound).max()
    scale = u4h.split_param(v_param)[0].double().repeat_interleave(u4h.GROUP, dim=-1)
    assert (err / scale).max() > 0.45          # the bound is about half a step, not a loose multiple of it
    # Gaussian-like groups: the step is the group's range / 15 (~4 sd of 32 samples), a uniform error of s / sqrt(12)
    # gives rel-L2 ~ (4 / 15) / sqrt(12) ~ 0.077; back in the model's space the error has the same norm
    rel = ((dec - r).norm() / r.norm()).item()
    assert 0.05 < rel < 0.10, rel
    back = dec @ u4h.hadamard(d)
    assert abs(((back - v.double()).norm() / v.double().norm()).item() - rel) < 0.01


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_codes_span_the_range_and_bytes_pack_low_nibble_first(d):
    v = _rows(64, d, 4)
    packed, v_param = u4h.quantize_u4h(v)
    codes = u4h.unpack_codes(packed)
    assert int(codes.min()) == 0 and int(codes.max()) == 15
    g = codes.reshape(64, d // 32, 32)
    assert (g.amin(-1) == 0).all()             # each group's minimum is (within the fp16 zero's rounding) code 0
    q = torch.arange(d, dtype=torch.uint8) % 16
    b = u4h.pack_codes(q)
    assert b[0] == 0x10 and b[1] == 0x32 and b[7] == 0xFE        # channel 2i low nibble, 2i + 1 high
    assert torch.equal(u4h.unpack_codes(b), q)


def test_all_equal_groups():
    """One nonzero channel 0 makes every rotated channel c * RSQRT_D (row 0 of H is all +1): every group all-equal.
    Where fp16(lo) >= lo (zeros; head_dim 64, whose RSQRT_D is 1/8; or fp16 rounding lo up) d = hi - zero <= 0: scale
    1, codes 0, decoded to the fp16 zero. Where fp16 rounds lo down, d > 0 is the rounding residue: its own tiny
    scale, and the decoded value is fp16_rn(lo) as well (the residue is below half an fp16 ulp)."""
    cases = {"scale one": 0, "tiny scale": 0}
    for d in HEAD_DIMS:
        for c in (0.0, 1.0, 3.0, 5.0, 7.0, 11.0, 13.0, -3.0):
            v = torch.zeros(1, d, dtype=torch.bfloat16)
            v[0, 0] = c
            packed, v_param = u4h.quantize_u4h(v)
            scale, zero = u4h.split_param(v_param[0])
            r = u4h.rotate(v)[0]
            assert (r == r[0]).all()
            assert (zero == r[0].half()).all()
            dec = u4h.decode_values(packed, v_param)[0]
            assert (dec == r[0].half()).all(), (d, c)
            if zero[0].float() >= r[0]:
                assert (scale == 1).all() and (packed == 0).all(), (d, c)
                cases["scale one"] += 1
            else:
                assert (scale.float() == (r[0] - zero[0].float()).div(15).half().float()).all() and (scale < 1e-3).all()
                cases["tiny scale"] += 1
    assert min(cases.values()) > 2, cases


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_rows_store_nan_parameters_everywhere(bad):
    d = 128
    v = _rows(4, d, 5)
    v[1, 17] = bad
    v[3, 0] = 1e6            # finite, but V H reaches 88388 > fp16's 65504: its groups' zero points overflow
    packed, v_param = u4h.quantize_u4h(v)
    clean_packed, clean_param = u4h.quantize_u4h(v[[0, 2]])
    assert torch.isnan(v_param[1]).all() and (packed[1] == 0).all()
    assert torch.isnan(u4h.decode_values(packed[1], v_param[1])).all()
    assert torch.isnan(u4h.prefill_image(packed[1], v_param[1], torch.ones(d)).view(E4M3_DTYPE).float()).all()
    r3 = u4h.rotate(v[3:4])[0].reshape(-1, 32)
    overflow = r3.amin(-1).half().isinf() | (r3.amax(-1) - r3.amin(-1).half().float()).div(15).half().isinf()
    assert overflow.any()
    assert torch.equal(torch.isnan(u4h.split_param(v_param[3])[1]), overflow)
    assert torch.equal(packed[[0, 2]], clean_packed) and torch.equal(v_param[[0, 2]], clean_param)


def test_fp16_rounding_from_float64_is_single():
    x = torch.tensor([1 + 2 ** -11 + 2 ** -40, 1 + 2 ** -11, 1 + 3 * 2 ** -11, -(1 + 2 ** -11 + 2 ** -40),
                      65519.0, 65520.0, 2 ** -25 + 2 ** -50], dtype=torch.float64)
    with np.errstate(over="ignore"):
        want = torch.tensor([np.float16(t) for t in x.tolist()], dtype=torch.float16)
    assert torch.equal(u4h.fp16_rn(x), want)
    assert float(u4h.fp16_rn(x[:1])) == 1 + 2 ** -10 != float(x[:1].half())   # torch's own conversion rounds twice


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_decode_and_prefill_views_follow_the_contract(d):
    v = _rows(40, d, 6)
    packed, v_param = u4h.quantize_u4h(v)
    v_scale = (u4h.rotate(v).abs().amax(0) * 2 / 448).float()
    dec = u4h.decode_values(packed, v_param)
    img = u4h.prefill_image(packed, v_param, v_scale)
    codes = u4h.unpack_codes(packed).numpy().astype(np.float64)
    s, z = (t.numpy().astype(np.float64).repeat(32, axis=-1) for t in u4h.split_param(v_param))
    exact = codes * s + z                                    # exact in float64
    assert np.array_equal(dec.numpy().view(np.uint16), exact.astype(np.float16).view(np.uint16))
    x = exact.astype(np.float32)                             # fmaf: one rounding
    inv = (np.float32(1) / v_scale.numpy()).astype(np.float32)
    want = torch.from_numpy((x * inv).astype(np.float32)).clamp(-448, 448).to(E4M3_DTYPE).view(torch.uint8)
    assert torch.equal(img, want)
    pre = u4h.prefill_values(packed, v_param, v_scale)
    assert torch.equal(pre, img.view(E4M3_DTYPE).double() * v_scale.double())


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_rotate_back_is_one_bf16_gemm(d):
    g = torch.Generator().manual_seed(7)
    o_rot = torch.randn(3, 5, d, generator=g).bfloat16()
    h = u4h.hadamard_pm1(d, dtype=torch.bfloat16)
    exact = o_rot.double() @ u4h.hadamard(d)
    o = u4h.rotate_back(o_rot, h)
    assert o.dtype == torch.bfloat16 and o.shape == o_rot.shape
    assert ((o.double() - exact).abs() <= 2.0 ** -8 * exact.abs() + 1e-6).all()      # one bf16 rounding
    out = torch.full_like(o_rot, math.nan)
    assert u4h.rotate_back(o_rot, h, out) is out and torch.equal(out, o)
    strided = torch.full((3, 8, d), math.nan, dtype=torch.bfloat16)[:, :5]
    assert not strided.is_contiguous()
    u4h.rotate_back(o_rot, h, strided)
    assert torch.equal(strided, o)
    assert torch.allclose(u4h.rotate_back(o, h).double(), o_rot.double(), atol=0.02, rtol=0.02)     # H H = I


def test_head_dim_outside_the_kernels_is_refused():
    with pytest.raises(ValueError, match="head_dim must be one of"):
        u4h.quantize_u4h(torch.zeros(2, 96, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="head_dim"):
        u4h.hadamard_pm1(32)


# --- the cache and the reference append -------------------------------------------------------------------------

def test_a_top_code_past_fp16s_range_is_a_faulty_group():
    """zero and scale finite, but 15 * scale + zero above 65504: decode's fp16 value of the top code would be inf
    where prefill's fp32 is finite, so the group is stored faulty (NaN parameters, codes 0); one just inside is not."""
    d = 64
    # v = (v0, v1, 0, ...) rotates exactly to (v0 + v1) / 8 on even channels and (v0 - v1) / 8 on odd ones
    v = torch.zeros(2, d, dtype=torch.bfloat16)
    v[0, 0], v[0, 1] = 135168.0, 397312.0     # 66560 and -32768: zero -32768, scale fp16(99328 / 15) = 6620, top 66532
    v[1, 1] = 262144.0                        # +-32768: scale 4368, top 32752
    rot = u4h.rotate(v)
    assert rot[0].amax() == 66560 and rot[0].amin() == -32768 and rot[1].abs().amax() == 32768
    packed, v_param = u4h.quantize_u4h(v)
    scale, zero = u4h.split_param(v_param)
    assert torch.isnan(scale[0, 0]) and torch.isnan(zero[0, 0]) and (packed[0, :16] == 0).all()
    assert torch.isfinite(scale[1]).all() and torch.isfinite(u4h.decode_values(packed[1], v_param[1]).float()).all()
    lit_packed, lit_params = _literal_quantize(v[0])
    assert np.array_equal(packed[0].numpy(), lit_packed) and _same_params(v_param[0], lit_params)


def test_a_negative_zero_minimum_is_stored_as_positive_zero():
    """A group whose minimum is -0 (here an all -0 row: its rotation is -0 in channel 0 and +0 elsewhere, and a
    min over both signs may return either) stores the zero point +0 bit for bit, as the kernel does (lo + 0)."""
    d = 64
    v = torch.full((1, d), -0.0, dtype=torch.bfloat16)
    _, v_param = u4h.quantize_u4h(v)
    _, zero = u4h.split_param(v_param)
    assert (zero.view(torch.int16) == 0).all()
    assert _same_params(v_param[0], _literal_quantize(v[0])[1])


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_reference_append_matches_a_literal_implementation_byte_for_byte(d):
    cache = mpfa.PagedKVCache("qk4pv4", num_layers=1, num_pages=6, page_size=16, num_kv_heads=2, head_dim=d,
                              device="cpu")
    twin = mpfa.PagedKVCache("qk4pv8", num_layers=1, num_pages=6, page_size=16, num_kv_heads=2, head_dim=d,
                             device="cpu")
    n = 40
    k = torch.stack([_rows(n, d, 8), _rows(n, d, 9)], dim=1)
    v = torch.stack([_rows(n, d, 10), _rows(n, d, 11)], dim=1)
    v[5, 1, 3] = math.nan
    v[6, 0, 100 % d] = math.inf
    for c in (cache, twin):
        c.calibrate(0, k.float(), v.float(), nonfinite="ignore")
    slots = torch.randperm(96, generator=torch.Generator().manual_seed(1))[:n]
    slots[0] = -1                                            # padding: skipped
    for c in (cache, twin):
        mpfa.append_kv(k, v, c.layer(0), slots, backend="reference")
    f, t = cache.layer(0).fields, twin.layer(0).fields
    for name in ("k8", "k", "k_block_scale", "k_scale"):     # K exactly as qk4pv8 writes it
        assert torch.equal(f[name], t[name]), name
    for i in range(n):
        s = int(slots[i])
        page, off = s // 16, s % 16
        if s < 0:
            continue
        for head in range(2):
            packed, params = _literal_quantize(v[i, head])
            assert np.array_equal(f["v"][page, head, off].numpy(), packed), (i, head)
            assert _same_params(f["v_param"][page, head, off], params), (i, head)
    written = torch.zeros(96, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert (f["v"].reshape(6, 2, 16, -1).transpose(1, 2).reshape(96, -1)[~written] == 0).all()


def test_cache_fields_sizes_and_rotation_matrix():
    r = get_recipe("qk4pv4")
    assert r.v_format == "u4h" and r.quantized_v and r.quantized_k and r.quantized_q
    assert r.bytes_per_token_head(128) == 104 + 64 + 16 == 184
    assert r.bytes_per_token_head(64) == 56 + 32 + 8
    cache = mpfa.PagedKVCache("qk4pv4", num_layers=2, num_pages=3, page_size=16, num_kv_heads=2, head_dim=64,
                              device="cpu")
    assert cache.fields["v"].shape == (2, 3, 2, 16, 32) and cache.fields["v"].dtype == torch.uint8
    assert cache.fields["v_param"].shape == (2, 3, 2, 16, 4) and cache.fields["v_param"].dtype == torch.float16
    assert cache.nbytes == 2 * 3 * 2 * 16 * cache.bytes_per_token_head
    assert torch.equal(cache.v_rotation, u4h.hadamard_pm1(64, dtype=torch.bfloat16))
    assert cache.layer(1).v_rotation is cache.v_rotation
    assert mpfa.PagedKVCache("qk4pv8", num_layers=1, num_pages=1, page_size=16, num_kv_heads=1, head_dim=64,
                             device="cpu").v_rotation is None


def test_calibration_scales_the_rotated_values():
    d = 64
    cache = mpfa.PagedKVCache("qk4pv4", num_layers=1, num_pages=2, page_size=16, num_kv_heads=2, head_dim=d,
                              device="cpu")
    k = torch.randn(30, 2, d)
    v = torch.stack([_rows(30, d, 12), _rows(30, d, 13)], dim=1)
    cache.calibrate(0, k, v, headroom=4.0)
    want = u4h.rotate(v).abs().amax(0) * 4.0 / 448
    assert torch.equal(cache.v_scale[0], want)
    assert not torch.allclose(want, v.float().abs().amax(0) * 4.0 / 448)     # not V's own scales
    v[3, 1, 5] = math.nan                                   # a non-finite row leaves every rotated channel
    assert cache.calibrate(0, k, v, headroom=4.0, nonfinite="ignore") == 1
    rows = torch.ones(30, dtype=torch.bool)
    rows[3] = False
    assert torch.equal(cache.v_scale[0, 1], u4h.rotate(v[rows, 1]).abs().amax(0) * 4.0 / 448)


def test_dequantize_paths_and_rotation():
    d = 64
    cache = mpfa.PagedKVCache("qk4pv4", num_layers=1, num_pages=2, page_size=16, num_kv_heads=2, head_dim=d,
                              device="cpu")
    v = torch.stack([_rows(32, d, 14), _rows(32, d, 15)], dim=1)
    k = torch.stack([_rows(32, d, 16), _rows(32, d, 17)], dim=1)
    cache.calibrate(0, k, v)
    layer = cache.layer(0)
    mpfa.append_kv(k, v, layer, torch.arange(32), backend="reference")
    f = layer.fields
    _, dec_rot = layer.dequantize(torch.float64, path="decode", rotated=True)
    _, pre_rot = layer.dequantize(torch.float64, path="prefill", rotated=True)
    assert torch.equal(dec_rot, u4h.decode_values(f["v"], f["v_param"]).double())
    assert torch.equal(pre_rot, u4h.prefill_values(f["v"], f["v_param"], layer.v_scale.unsqueeze(1)))
    _, dec = layer.dequantize(torch.float64)
    assert torch.equal(dec, dec_rot @ u4h.hadamard(d))                   # real space: V_rot H (H H = I)
    assert not torch.equal(dec_rot, pre_rot)                             # prefill adds the FP8 image's rounding
    rel = (dec - v.double().reshape(2, 16, 2, d).transpose(1, 2)).norm() / v.double().norm()
    assert rel < 0.1
    with pytest.raises(ValueError, match="path must be one of"):
        layer.dequantize(path="both")
    other = mpfa.PagedKVCache("qk4pv8", num_layers=1, num_pages=1, page_size=16, num_kv_heads=2, head_dim=d,
                              device="cpu")
    with pytest.raises(ValueError, match="rotated=True: recipe qk4pv8 stores V unrotated"):
        other.layer(0).dequantize(rotated=True)
    a, b = other.layer(0).dequantize(path="decode"), other.layer(0).dequantize(path="prefill")
    assert torch.equal(a[1], b[1])                                       # one V for the other recipes


def test_decode_reference_backend_rotates_back_like_the_wrapper():
    """The reference backend's decode of qk4pv4: attention on the rotated fp16 V, bf16, then rotate_back; equal to
    that composition bit for bit, and within two bf16 roundings of exact attention on the rotated-back V."""
    from mpfa.reference import attention, batch_attention, gather_pages
    d, hkv, group = 64, 2, 4
    g = torch.Generator().manual_seed(18)
    cache = mpfa.PagedKVCache("qk4pv4", num_layers=1, num_pages=8, page_size=16, num_kv_heads=hkv, head_dim=d,
                              device="cpu")
    k, v = torch.randn(128, hkv, d, generator=g).bfloat16(), torch.randn(128, hkv, d, generator=g).bfloat16()
    cache.calibrate(0, k, v)
    layer = cache.layer(0)
    mpfa.append_kv(k, v, layer, torch.arange(128), backend="reference")
    indptr = torch.tensor([0, 3, 8], dtype=torch.int32)
    indices = torch.tensor([4, 0, 2, 1, 3, 5, 6, 7], dtype=torch.int32)
    last = torch.tensor([9, 16], dtype=torch.int32)
    q = torch.randn(2, hkv * group, d, generator=g).bfloat16()
    w = mpfa.BatchDecodeWrapper(torch.empty(1 << 20, dtype=torch.uint8), backend="reference")
    w.plan(indptr, indices, last, hkv * group, hkv, d, 16, recipe="qk4pv4")
    out = torch.full_like(q, math.nan)
    o = w.run(q, layer, out=out)
    assert o is out
    kd, vr = layer.dequantize(pages=indices, rotated=True)
    o_rot, _ = batch_attention(q, torch.arange(3), kd, vr, indptr, torch.arange(8), last, causal=False,
                               dtype=torch.float32)
    assert torch.equal(o, u4h.rotate_back(o_rot.bfloat16(), cache.v_rotation))
    kx, vx = layer.dequantize(torch.float64)
    for b, n in enumerate((41, 80)):
        ids = indices[int(indptr[b]):int(indptr[b + 1])]
        ox, _ = attention(q[b:b + 1], gather_pages(kx, ids, n), gather_pages(vx, ids, n), causal=False)
        assert ((o[b].double() - ox[0]).norm() / ox[0].norm()).item() < 2 * 2.0 ** -8
