"""Numerics of the recipes on the CPU: FP8 E4M3, 4-bit K (E2M1 + block scales), smoothing and the
recipe table. These functions are the byte-level reference the kernels must match, so the tests pin
their exact behaviour (rounding, ties, saturation, scales), not just an error budget."""
import math

import pytest
import torch

from mpfa.recipes import RECIPES, get_recipe
from mpfa.recipes import fp4, fp8
from mpfa.recipes.recipe import Recipe
from mpfa.recipes.smoothing import compensation, k_smoothing_mean, q_smoothing_mean

E4M3 = torch.float8_e4m3fn


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _outlier_rows(n, d, gen, heads=None):
    """Gaussian rows with outlier channels: one with a large mean, one with a large spread."""
    shape = (n, d) if heads is None else (n, heads, d)
    x = torch.randn(*shape, generator=gen)
    x[..., 5] = x[..., 5] * 4 + 30
    x[..., d // 2 + 1] *= 25
    return x


# --------------------------------------------------------------------------------------------------
# FP8 E4M3
# --------------------------------------------------------------------------------------------------

def test_e4m3_round_trip_relative_error_in_normal_range():
    gen = _gen(1)
    # Magnitudes spanning E4M3's normal range [2**-6, 448] with random signs, at scale 1 and 0.37.
    for scale in (1.0, 0.37):
        mag = torch.exp2(torch.empty(20000).uniform_(-6, math.log2(448), generator=gen))
        sign = torch.where(torch.rand(20000, generator=gen) < 0.5, -1.0, 1.0)
        x = sign * mag * scale
        q = fp8.quantize_e4m3(x, scale)
        assert q.dtype == E4M3
        back = fp8.dequantize_e4m3(q, scale)
        rel = ((back - x).abs() / x.abs()).max().item()
        assert rel <= 2.0 ** -4 * (1 + 1e-5), rel
        # It is round-to-nearest: the error never exceeds the distance to the other neighbour.
        assert rel > 2.0 ** -6, "a 3-bit mantissa cannot be this accurate on random inputs"


def test_e4m3_round_trip_is_nearest():
    # Every E4M3 value is a fixed point; midpoints of adjacent values round to the even neighbour.
    allv = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    finite = allv[torch.isfinite(allv)]
    pos = torch.unique(finite[finite >= 0])
    assert pos.max().item() == 448.0
    assert torch.equal(fp8.quantize_e4m3(pos, 1.0).float(), pos)
    mids = (pos[1:] + pos[:-1]) / 2
    r = fp8.quantize_e4m3(mids, 1.0).float()
    lo_codes = torch.arange(pos.numel() - 1)
    expect = torch.where(lo_codes % 2 == 0, pos[:-1], pos[1:])   # consecutive codes alternate parity
    assert torch.equal(r, expect)


def test_e4m3_saturates_without_nan_or_inf():
    x = torch.tensor([1e30, -1e30, 449.0, -449.0, 500.0, 1e6, float("inf"), -float("inf"), 448.0, 464.0, 470.0])
    q = fp8.quantize_e4m3(x, 1.0).float()
    assert torch.isfinite(q).all()
    assert torch.equal(q, torch.tensor([448.0, -448.0, 448.0, -448.0, 448.0, 448.0, 448.0, -448.0, 448.0, 448.0,
                                        448.0]))
    # With a per-row scale too: huge rows saturate, and raw bytes never hold the NaN code 0x7F/0xFF.
    big = torch.randn(64, 128, generator=_gen(2)) * 1e35
    qq = fp8.quantize_e4m3(big, torch.full((64, 1), 1e30))
    assert torch.isfinite(qq.float()).all()
    assert ((qq.view(torch.uint8) & 0x7F) != 0x7F).all()


@pytest.mark.parametrize("d", [64, 128])
def test_per_token_scale_maps_amax_to_448(d):
    x = _outlier_rows(300, d, _gen(3)).to(torch.bfloat16)
    x[7] = 0
    x[11] *= 1e-3
    q, scale = fp8.quantize_per_token(x)
    assert q.shape == x.shape and q.dtype == E4M3 and scale.shape == (300,) and scale.dtype == torch.float32
    amax = x.float().abs().amax(dim=-1)
    nz = amax > 0
    assert torch.equal(scale[nz], amax[nz] / 448.0)
    assert torch.equal(q.float().abs().amax(dim=-1)[nz], torch.full((int(nz.sum()),), 448.0))
    # All-zero row: scale 1, zero bytes.
    assert scale[7].item() == 1.0
    assert (q[7].float() == 0).all()
    back = fp8.dequantize_e4m3(q, scale.unsqueeze(-1))
    err = (back - x.float()).abs()
    assert (err <= amax.unsqueeze(-1) * 2.0 ** -4 + 1e-30).all()   # within half an ulp of the top binade


def test_per_tile_scale_maps_each_tile_amax_to_448():
    gen = _gen(4)
    rows, tile = 300, 128                           # tiles of 128, 128 and a partial 44
    x = _outlier_rows(rows, 128, gen)
    x[128:256] *= 1e-2                              # tiles of very different magnitude
    x[256:] = 0                                     # an all-zero (partial) tile
    q, scale = fp8.quantize_per_tile(x, tile)
    assert scale.shape == (3,)
    for t in range(3):
        blk = x[t * tile:(t + 1) * tile]
        amax = blk.abs().amax()
        if amax > 0:
            assert scale[t].item() == (amax / 448.0).item()
            assert q[t * tile:(t + 1) * tile].float().abs().max().item() == 448.0
        else:
            assert scale[t].item() == 1.0
            assert (q[t * tile:(t + 1) * tile].float() == 0).all()
    per_row = scale.repeat_interleave(tile)[:rows].unsqueeze(-1)
    back = fp8.dequantize_e4m3(q, per_row)
    nz = x.abs() >= per_row * 2.0 ** -6              # normal range of each tile
    rel = ((back - x).abs() / x.abs())[nz]
    assert rel.max().item() <= 2.0 ** -4 * (1 + 1e-5)
    # Zero rows in: zero tiles out.
    q0, s0 = fp8.quantize_per_tile(torch.zeros(0, 64), 128)
    assert q0.shape == (0, 64) and s0.shape == (0,)


def test_amax_scale_zero_group_gets_one():
    s = fp8.amax_scale(torch.tensor([0.0, 448.0, 1.0]))
    assert s.dtype == torch.float32
    assert torch.equal(s, torch.tensor([1.0, 1.0, 1.0 / 448.0], dtype=torch.float32))
    assert fp8.amax_scale(torch.tensor([384.0]), 384.0).item() == 1.0


# --------------------------------------------------------------------------------------------------
# 4-bit K: E2M1
# --------------------------------------------------------------------------------------------------

E2M1_POS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1(x):
    return fp4.e2m1_values(fp4.e2m1_codes(torch.as_tensor(x, dtype=torch.float32)))


def test_e2m1_table_and_ties_to_even():
    cases = {
        # exact values
        0.0: 0.0, 0.5: 0.5, 1.0: 1.0, 1.5: 1.5, 2.0: 2.0, 3.0: 3.0, 4.0: 4.0, 6.0: 6.0,
        # every tie goes to the even code (0, 1, 2, 4 have even codes 0, 2, 4, 6)
        0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0,
        # just off every tie
        0.2501: 0.5, 0.2499: 0.0, 0.7499: 0.5, 0.7501: 1.0, 1.2499: 1.0, 1.2501: 1.5, 1.7499: 1.5, 1.7501: 2.0,
        2.4999: 2.0, 2.5001: 3.0, 3.4999: 3.0, 3.5001: 4.0, 4.9999: 4.0, 5.0001: 6.0,
        # saturation
        6.5: 6.0, 7.0: 6.0, 100.0: 6.0, 1e30: 6.0, float("inf"): 6.0,
    }
    xs = torch.tensor(list(cases), dtype=torch.float32)
    want = torch.tensor(list(cases.values()), dtype=torch.float32)
    assert torch.equal(_e2m1(xs), want)
    assert torch.equal(_e2m1(-xs), -want)
    # Codes: sign bit 3, magnitudes 0..7 in table order.
    codes = fp4.e2m1_codes(torch.tensor(E2M1_POS))
    assert codes.tolist() == list(range(8))
    assert fp4.e2m1_codes(-torch.tensor(E2M1_POS[1:])).tolist() == list(range(9, 16))
    assert codes.dtype == torch.uint8


def test_e2m1_is_round_to_nearest_on_random_values():
    x = torch.empty(20000).uniform_(-7, 7, generator=_gen(5))
    r = _e2m1(x)
    grid = torch.tensor(E2M1_POS + tuple(-v for v in E2M1_POS[1:]))
    dist = (x.unsqueeze(-1) - grid).abs()
    best = dist.min(dim=-1).values
    assert torch.isin(r, grid).all()
    assert torch.allclose((x - r).abs(), best, rtol=0, atol=1e-6)   # r is a nearest grid point
    assert ((x - r).abs() <= 1.0).all() and ((x - r).abs() > 0.9).any()


def test_allowed_block_scales_exact_set():
    got = fp4.allowed_block_scales()
    want = sorted({2.0 ** e for e in range(-8, 7)} | {1.5 * 2.0 ** e for e in range(-7, 6)})
    assert got == want
    assert len(got) == 15 + 13
    assert got[0] == 2.0 ** -8 and got[-1] == 64.0


def test_every_allowed_scale_times_e2m1_is_exact_in_e4m3():
    for s in fp4.allowed_block_scales():
        for v in E2M1_POS + tuple(-x for x in E2M1_POS[1:]):
            p = torch.tensor(s * v, dtype=torch.float64)
            assert p.to(E4M3).double().item() == p.item(), (s, v)
    # ... and the allowed set is maximal at its ends: the next scales out are not exact/unsaturated.
    below = 1.5 * 2.0 ** -8
    assert torch.tensor(below * 0.5, dtype=torch.float64).to(E4M3).double().item() != below * 0.5
    assert 1.5 * 64 * 6 > 448


def test_exact_products_counts():
    assert fp4.exact_products(1) == (0, 140)
    assert fp4.exact_products(2) == (30, 280)
    assert fp4.exact_products(3) == (154, 560)


def _brute_round_up(need: torch.Tensor) -> torch.Tensor:
    allowed = torch.tensor(fp4.allowed_block_scales(), dtype=torch.float64)
    n = need.double().unsqueeze(-1)
    ok = allowed >= n
    idx = torch.where(ok.any(-1), ok.float().argmax(-1), torch.full(need.shape, len(allowed) - 1))
    return allowed[idx].float()


def test_round_up_block_scale_matches_brute_force():
    gen = _gen(6)
    need = torch.exp(torch.empty(50000).uniform_(math.log(1e-6), math.log(1e3), generator=gen)).float()
    got = fp4.round_up_block_scale(need)
    assert got.dtype == torch.float32
    assert torch.equal(got, _brute_round_up(need))
    # In range, the answer is >= need; the clamped tail (need > 64) gives 64.
    inr = need <= 64
    assert (got[inr] >= need[inr]).all()
    assert (got[~inr] == 64).all()


def test_round_up_block_scale_edges():
    allowed = torch.tensor(fp4.allowed_block_scales(), dtype=torch.float32)
    # Exactly an allowed scale: kept.
    assert torch.equal(fp4.round_up_block_scale(allowed), allowed)
    # One float32 ulp above: the next allowed scale (64 stays 64, clamped).
    up = torch.nextafter(allowed, torch.tensor(float("inf")))
    nxt = torch.cat([allowed[1:], allowed[-1:]])
    assert torch.equal(fp4.round_up_block_scale(up), nxt)
    # One ulp below: the same scale.
    down = torch.nextafter(allowed, torch.tensor(0.0))
    assert torch.equal(fp4.round_up_block_scale(down[1:]), allowed[1:])
    # The forbidden 1.5 * 2**-8 and everything in (2**-8, 2**-7] go to 2**-7; tiny needs to 2**-8.
    edge = torch.tensor([0.0, 1e-30, 2.0 ** -9, 2.0 ** -8, 1.25 * 2.0 ** -8, 1.5 * 2.0 ** -8, 1.75 * 2.0 ** -8,
                         2.0 ** -7, 48.0, 50.0, 64.0, 65.0, 1e6])
    want = torch.tensor([2.0 ** -8, 2.0 ** -8, 2.0 ** -8, 2.0 ** -8, 2.0 ** -7, 2.0 ** -7, 2.0 ** -7, 2.0 ** -7,
                         48.0, 64.0, 64.0, 64.0, 64.0])
    assert torch.equal(fp4.round_up_block_scale(edge), want)
    # Brute force over needs exactly between allowed scales too.
    mids = (allowed[1:] + allowed[:-1]) / 2
    assert torch.equal(fp4.round_up_block_scale(mids), _brute_round_up(mids))


def _k4_rows(n, d, seed):
    g = _gen(seed)
    x = torch.randn(n, d, generator=g)
    x[:, 5] += 8          # outlier channels: a large mean and a large spread
    x[:, d - 3] *= 20
    x[3] *= 1e-4          # a tiny row
    return x


@pytest.mark.parametrize("d", [64, 128, 256])
def test_quantize_k4_round_trip(d):
    x = _k4_rows(512, d, 7 + d)
    packed, bs, ts = fp4.quantize_k4(x)
    assert packed.shape == (512, d // 2) and packed.dtype == torch.uint8
    assert bs.shape == (512, d // 16) and bs.dtype == torch.uint8
    assert ts.shape == (512,) and ts.dtype == torch.float32
    deq = fp4.dequantize_k4(packed, bs, ts)
    # Whole-batch relative L2 with outlier channels; per row on plain gaussian rows.
    assert ((deq - x).norm() / x.norm()).item() < 0.15
    g = torch.randn(512, d, generator=_gen(70 + d))
    gdeq = fp4.dequantize_k4(*fp4.quantize_k4(g))
    rel_l2 = (gdeq - g).norm(dim=-1) / g.norm(dim=-1)
    assert rel_l2.max().item() < 0.15, rel_l2.max().item()
    # The round trip is not exact (it could not be at 4 bits), so the bounds are not vacuous.
    assert rel_l2.mean().item() > 0.05
    # Every element is within half the largest E2M1 gap (2 / 2 = 1) times its block's step scale.
    bsv = fp4.block_scale_values(bs)
    step = (bsv * ts.unsqueeze(-1)).repeat_interleave(16, dim=-1)
    assert ((deq - x).abs() <= step * (1 + 1e-5)).all()
    # Block scales are allowed ones, and the token's largest block scale is exactly 64.
    allowed = set(fp4.allowed_block_scales())
    assert set(bsv.unique().tolist()) <= allowed
    assert (bsv.amax(dim=-1) == 64.0).all()
    # The token scale maps the row's amax to 6 * 64.
    assert torch.allclose(ts, x.abs().amax(dim=-1) / 384.0, rtol=1e-6)


def test_quantize_k4_zero_row_and_bad_dim():
    x = torch.zeros(2, 64)
    x[1, 0] = 3.0
    packed, bs, ts = fp4.quantize_k4(x)
    assert ts[0].item() == 1.0 and (packed[0] == 0).all()
    assert torch.equal(fp4.dequantize_k4(packed, bs, ts), x)   # 3.0 = 6 * 64 * ts exactly
    with pytest.raises(ValueError, match="multiple of 16"):
        fp4.quantize_k4(torch.randn(2, 72))


def test_k4_to_e4m3_is_exact_product():
    x = _k4_rows(256, 128, 8)
    packed, bs, ts = fp4.quantize_k4(x)
    k8 = fp4.k4_to_e4m3(packed, bs)
    assert k8.dtype == E4M3
    exact = fp4.e2m1_values(fp4.unpack_codes(packed)) * fp4.block_scale_values(bs).repeat_interleave(16, dim=-1)
    assert torch.equal(k8.float(), exact)
    # And the full dequantization is that FP8 K times the token scale.
    assert torch.equal(fp4.dequantize_k4(packed, bs, ts), k8.float() * ts.unsqueeze(-1))


def test_k4_packing_order():
    # Element 2i in the low nibble, 2i+1 in the high nibble.
    vals = torch.tensor([[6.0, -0.5, 1.0, 0.0] + [0.0] * 12])      # token amax 6 -> ts = 6/384, bs = 64
    packed, bs, ts = fp4.quantize_k4(vals)
    assert fp4.block_scale_values(bs).tolist() == [[64.0]]
    assert packed[0, 0].item() == 0x7 | (0x9 << 4)   # 6 -> code 7 (low), -0.5 -> code 9 (high)
    assert packed[0, 1].item() == 0x2                # 1.0 -> code 2 (low), 0 -> 0 (high)
    assert fp4.unpack_codes(packed)[0, :4].tolist() == [7, 9, 2, 0]
    rnd = torch.randint(0, 256, (5, 32), generator=_gen(9), dtype=torch.uint8)
    codes = fp4.unpack_codes(rnd)
    assert torch.equal(codes[:, 0::2], rnd & 0xF) and torch.equal(codes[:, 1::2], rnd >> 4)


# --------------------------------------------------------------------------------------------------
# Smoothing and compensation
# --------------------------------------------------------------------------------------------------

def _softmax_scores(q, k, group):
    kk = k.repeat_interleave(group, dim=1)
    return torch.einsum("qhd,khd->hqk", q, kk)


def test_k_smoothing_leaves_softmax_unchanged():
    gen = _gen(10)
    heads, kv_heads, d = 8, 2, 64
    q = _outlier_rows(9, d, gen, heads).double()
    k = _outlier_rows(33, d, gen, kv_heads).double()
    mu = k_smoothing_mean(k)
    assert mu.shape == (kv_heads, d) and mu.dtype == torch.float32
    assert torch.allclose(mu.double(), k.mean(dim=0), rtol=1e-6, atol=1e-6)
    s = _softmax_scores(q, k, heads // kv_heads) / math.sqrt(d)
    s_smooth = _softmax_scores(q, k - mu.double(), heads // kv_heads) / math.sqrt(d)
    assert (s - s_smooth).abs().max() > 1.0          # the scores themselves do change ...
    assert torch.allclose(torch.softmax(s, -1), torch.softmax(s_smooth, -1), rtol=1e-10, atol=1e-13)  # ... not P


def test_rank_one_compensation_restores_scores_gqa():
    gen = _gen(11)
    heads, kv_heads, d = 16, 4, 128      # group 4
    q = _outlier_rows(20, d, gen, heads).double()
    k = _outlier_rows(40, d, gen, kv_heads).double()
    mu_q = q.mean(dim=0)
    comp = compensation(mu_q, k, dtype=torch.float64)
    assert comp.shape == (heads, 40) and comp.dtype == torch.float64
    # Naive loop: query head h reads KV head h // 4.
    for h in range(heads):
        for j in range(0, 40, 7):
            assert comp[h, j].item() == pytest.approx(float(mu_q[h] @ k[j, h // 4]), rel=1e-12)
    s = _softmax_scores(q, k, 4)
    s2 = _softmax_scores(q - mu_q, k, 4) + comp.unsqueeze(1)
    assert torch.allclose(s, s2, rtol=1e-12, atol=1e-10)
    # A wrong GQA mapping (h % kv_heads) would not pass.
    wrong = torch.einsum("hd,khd->hk", mu_q, k.repeat(1, 4, 1))
    assert not torch.allclose(comp, wrong)


def test_q_smoothing_mean_ragged():
    gen = _gen(12)
    q = _outlier_rows(10, 64, gen, 4).to(torch.bfloat16)
    indptr = torch.tensor([0, 3, 3, 10, 10], dtype=torch.int32)
    mu = q_smoothing_mean(q, indptr)
    assert mu.shape == (4, 4, 64) and mu.dtype == torch.float32
    assert torch.allclose(mu[0], q[0:3].float().mean(0))
    assert (mu[1] == 0).all() and (mu[3] == 0).all()
    assert torch.allclose(mu[2], q[3:10].float().mean(0))
    assert (mu[2, :, 5] > 25).all()                 # the outlier channel's mean is kept


# --------------------------------------------------------------------------------------------------
# Recipe table
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["fp4", "BF16", "", None, 3, ["bf16"]])
def test_get_recipe_error_names_accepted(bad):
    with pytest.raises(ValueError, match="recipe must be one of") as e:
        get_recipe(bad)
    for name in ("bf16", "qk8pv8", "qk4pv8", "qk4pv4"):
        assert name in str(e.value)


def test_get_recipe_accepts_names_and_objects():
    for name, r in RECIPES.items():
        assert get_recipe(name) is r
        assert get_recipe(r) is r
        assert isinstance(r, Recipe) and r.name == name
    assert set(RECIPES) == {"bf16", "qk8pv8", "qk4pv8", "qk4pv4"}


@pytest.mark.parametrize("d,want", [(128, {"bf16": 512, "qk8pv8": 260, "qk4pv8": 232, "qk4pv4": 184}),
                                    (64, {"bf16": 256, "qk8pv8": 132, "qk4pv8": 120, "qk4pv4": 96})])
def test_bytes_per_token_head(d, want):
    for name, b in want.items():
        assert get_recipe(name).bytes_per_token_head(d) == b


def test_recipe_flags():
    assert not get_recipe("bf16").quantized_k and not get_recipe("bf16").quantized_q
    r8, r4 = get_recipe("qk8pv8"), get_recipe("qk4pv8")
    assert r8.quantized_q and r8.quantized_k and r8.quantized_v and r8.q_format == r8.k_format == "int8"
    assert r4.quantized_q and r4.quantized_k and r4.quantized_v and r4.q_format == "int8" and r4.k_format == "i4rs"
    v4 = get_recipe("qk4pv4")   # qk4pv8's Q and K, 4-bit Hadamard V
    assert v4.quantized_q and v4.quantized_k and v4.quantized_v and (v4.q_format, v4.k_format, v4.v_format) == (
        "int8", "i4rs", "u4h")
    assert v4.fields[:4] == r4.fields[:4]


def test_kernel_magic_rounding_is_rni_and_its_bits_hold_the_integer():
    """The kernels round to an integer with one FP32 add of 1.5 * 2^23 (quant.cuh round_to_int, pack_s8x4,
    the append kernel's INT4 nibbles): the sum minus the magic is torch.round (ties to even), and the sum's
    low byte / nibble is the integer's two's complement (what the kernels store)."""
    from mpfa.recipes.int8 import rni
    magic = torch.tensor(12582912.0)
    g = torch.Generator().manual_seed(0)
    halves = torch.arange(-255, 256).float() / 2                          # every tie in [-127.5, 127.5]
    near = torch.cat([halves, torch.nextafter(halves, halves - 1), torch.nextafter(halves, halves + 1)])
    y = torch.cat([near, (torch.rand(200_000, generator=g) * 2 - 1) * 127.5]).float()
    t = y + magic                                                          # float32, round to nearest even
    assert torch.equal(t - magic, rni(y))
    q = rni(y).to(torch.int64)
    low_byte = t.view(torch.int32).to(torch.int64) & 0xFF
    assert torch.equal(low_byte, q & 0xFF)
    small = q.abs() <= 7
    assert torch.equal((t.view(torch.int32).to(torch.int64) & 0xF)[small], (q & 0xF)[small])


@pytest.mark.parametrize("d", [64, 128, 256])
def test_quantize_k4rs(d):
    """qk4pv8's K: the low-frequency RoPE half in E4M3 and the rest in 4-bit blocks under ONE token scale;
    the whole row times 1/scale is one E4M3 operand (k4rs_to_e4m3), dequantization is that times the scale,
    and it is far more accurate than the all-4-bit row on channels with a large spread."""
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(64, d, generator=gen) * torch.linspace(0.2, 6, d)
    k8, packed, bs, ts = fp4.quantize_k4rs(x)
    assert k8.shape == (64, d // 2) and packed.shape == (64, d // 4) and bs.shape == (64, d // 32) and ts.shape == (64,)
    low = fp4.rope_low_channels(d)
    assert low.sum() == d // 2 and bool(low[d // 4]) and not bool(low[0]) and bool(low[d - 1])
    k_fp8 = fp4.k4rs_to_e4m3(k8, packed, bs)
    deq = fp4.dequantize_k4rs(k8, packed, bs, ts)
    assert torch.equal(deq, k_fp8.float() * ts.unsqueeze(-1))
    # the low channels are exactly quantize_e4m3(x / ts); the others exactly quantize_k4's blocks on them
    assert torch.equal(k8, fp8.quantize_e4m3(x[:, low], ts.unsqueeze(-1)).view(torch.uint8))
    rel = lambda y: float((y - x).norm() / x.norm())
    assert rel(deq) < 0.7 * rel(fp4.dequantize_k4(*fp4.quantize_k4(x)))
    with pytest.raises(ValueError, match="multiple of 64"):
        fp4.quantize_k4rs(torch.randn(2, 96))


# --------------------------------------------------------------------------------------------------
# Non-finite inputs: calibration refuses them (its scales are fixed for the cache's life), plans
# refuse a non-finite or non-positive sm_scale
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", ["bf16", "qk8pv8", "qk4pv8", "qk4pv4"])
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_calibrate_refuses_nonfinite_samples_and_keeps_the_scales(recipe, which, bad):
    import mpfa
    cache = mpfa.PagedKVCache(recipe, num_layers=3, num_pages=2, page_size=16, num_kv_heads=2, head_dim=64,
                              device="cpu")
    gen = _gen(20)
    sample = {"k": _outlier_rows(40, 64, gen, 2), "v": _outlier_rows(40, 64, gen, 2)}
    sample[which][[3, 17, 30], 1, [0, 5, 63]] = bad
    with pytest.raises(ValueError, match=rf"^{which} \(the {which.upper()} sample calibrating layer 2\) holds 3 "
                                         r"non-finite elements \(NaN or inf\) of 5120"):
        cache.calibrate(2, sample["k"], sample["v"])
    if cache.mu_k is not None:
        assert (cache.mu_k == 0).all()
    if cache.v_scale is not None:
        assert (cache.v_scale == 1).all()


def test_calibrated_v_scales_stay_finite_so_later_values_read_back():
    """Why refusing matters: one inf in the V sample made that channel's scale inf, and every later V
    of the channel read back as NaN (0 * inf)."""
    import mpfa
    cache = mpfa.PagedKVCache("qk8pv8", num_layers=1, num_pages=1, page_size=16, num_kv_heads=1, head_dim=64,
                              device="cpu")
    gen = _gen(21)
    k, v = _outlier_rows(16, 64, gen, 1), _outlier_rows(16, 64, gen, 1)
    v_inf = v.clone()
    v_inf[0, 0, 7] = math.inf
    with pytest.raises(ValueError, match="non-finite"):
        cache.calibrate(0, k, v_inf)
    cache.calibrate(0, k, v)
    mpfa.append_kv(k.bfloat16(), v.bfloat16(), cache.layer(0), torch.arange(16), backend="reference")
    _, v_back = cache.layer(0).dequantize()
    assert torch.isfinite(cache.v_scale).all() and torch.isfinite(v_back).all()


def _paged_plan_args():
    one = torch.tensor([0, 1], dtype=torch.int32)
    return one, torch.tensor([0], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)


@pytest.mark.parametrize("sm_scale", [math.nan, math.inf, -math.inf, 0.0, -0.125, "0.1", True])
@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_plan_refuses_a_nonfinite_or_nonpositive_sm_scale(op, sm_scale):
    import mpfa
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    indptr, indices, last = _paged_plan_args()
    with pytest.raises(ValueError, match=r"sm_scale must be None \(1/sqrt\(head_dim\)\) or a finite positive float"):
        if op == "prefill":
            mpfa.BatchPrefillWrapper(ws, backend="reference").plan(
                torch.tensor([0, 5], dtype=torch.int32), indptr, indices, last, 4, 2, 64, 16, sm_scale=sm_scale,
                recipe="qk4pv8")
        else:
            mpfa.BatchDecodeWrapper(ws, backend="reference").plan(indptr, indices, last, 4, 2, 64, 16,
                                                                  sm_scale=sm_scale, recipe="qk4pv8")


def test_calibrate_can_leave_non_finite_elements_out():
    """What the SGLang pool does with a first batch holding NaN / inf: the scales come from the finite elements
    only (equal to calibrating on those rows alone), and the count of left-out elements is returned."""
    import mpfa
    torch.manual_seed(3)
    clean_k = torch.randn(9, 2, 64).to(torch.bfloat16)
    clean_v = torch.randn(9, 2, 64).to(torch.bfloat16)
    k = torch.cat([clean_k, torch.full((1, 2, 64), float("nan"), dtype=torch.bfloat16)])
    v = torch.cat([clean_v, torch.full((1, 2, 64), float("inf"), dtype=torch.bfloat16)])
    a = mpfa.PagedKVCache("qk8pv8", num_layers=1, num_pages=2, page_size=16, num_kv_heads=2, head_dim=64, device="cpu")
    b = mpfa.PagedKVCache("qk8pv8", num_layers=1, num_pages=2, page_size=16, num_kv_heads=2, head_dim=64, device="cpu")
    assert a.calibrate(0, k, v, nonfinite="ignore") == 2 * 2 * 64
    b.calibrate(0, clean_k, clean_v)
    torch.testing.assert_close(a.mu_k, b.mu_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(a.v_scale, b.v_scale)
    with pytest.raises(ValueError, match="nonfinite"):
        a.calibrate(0, clean_k, clean_v, nonfinite="skip")
