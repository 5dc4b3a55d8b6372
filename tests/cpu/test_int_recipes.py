"""The 8-bit integer QK references (python/mpfa/recipes/int8.py, issue 20): rounding, bounds, the i4rs
format's INT8-exact products and its MSE block scales, byte layout and sizes, and the error-budget
configurations built on them (benchmarks/accuracy/error_budget.py)."""
import hashlib

import pytest
import torch

from mpfa.recipes import int8 as I8
from mpfa.recipes.fp8 import amax_scale
from mpfa.recipes.int8 import rope_low_channels


def _keys(rows=400, d=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=g) * torch.linspace(0.2, 3.0, d) * torch.rand(rows, 1, generator=g) * 4
    x[:, 5] += 6.0                         # one large-mean channel, as K has
    return x


def test_rounding_is_nearest_even_and_amax_maps_to_127():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 3.49, -127.0]])
    q, s = I8.quantize_k_per_token(x)
    assert float(s) == 1.0
    assert q.tolist() == [[127, 0, 2, 2, -2, 0, 3, -127]]
    qt, st = I8.quantize_q_per_tile(x.repeat(3, 1) * 2, tile_rows=2)
    assert st.tolist() == [2.0, 2.0] and torch.equal(qt, q.repeat(3, 1))


def test_q_per_tile_bounds_and_partial_tile():
    x = _keys(300, 64) - 1.0
    q, s = I8.quantize_q_per_tile(x, 128)
    assert q.dtype == torch.int8 and s.shape == (3,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    for t in range(3):
        rows = slice(128 * t, 128 * (t + 1))
        assert torch.isclose(s[t], x[rows].abs().amax() / 127)
        assert int(q[rows].abs().max()) == 127                 # each tile's amax lands on 127
    err = (I8.dequantize_q_per_tile(q, s, 128) - x).abs()
    assert bool((err <= s.repeat_interleave(128)[:300].unsqueeze(-1) * 0.5 * (1 + 1e-5)).all())
    with pytest.raises(ValueError, match="one head"):
        I8.quantize_q_per_tile(x.reshape(300, 2, 32))


def test_k_per_token_round_trip():
    x = _keys()
    x[7] = 0.0
    q, s = I8.quantize_k_per_token(x)
    assert float(s[7]) == 1.0 and int(q[7].abs().max()) == 0      # a zero row stays zero
    y = I8.dequantize_k_per_token(q, s)
    assert bool(((y - x).abs() <= s.unsqueeze(-1) * 0.5 * (1 + 1e-5)).all())
    assert float((y - x).norm() / x.norm()) < 0.01


def test_int4_packing_nibble_order():
    q = torch.arange(-7, 8, dtype=torch.int8)
    q = torch.cat([q, torch.zeros(1, dtype=torch.int8)])
    packed = I8.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (8,)
    assert int(packed[0]) == (0x9 | (0xA << 4))                  # -7 low nibble, -6 high nibble
    assert torch.equal(I8.unpack_int4(packed), q)
    assert int(I8.pack_int4(torch.tensor([1, -1], dtype=torch.int8))[0]) == 0xF1


@pytest.mark.parametrize("block", [16, 8])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_i4rs_row_is_one_int8_operand(block, d):
    x = _keys(300, d, seed=d + block)
    k8, k4, bs, ts = I8.quantize_i4rs(x, block=block)
    assert k8.shape == (300, d // 2) and k4.shape == (300, d // 4) and bs.shape == (300, d // (2 * block))
    assert k8.dtype == torch.int8 and k4.dtype == torch.uint8 and bs.dtype == torch.uint8
    assert int(bs.min()) >= 1 and int(bs.max()) <= 18
    q4 = I8.unpack_int4(k4)
    assert int(q4.abs().max()) <= 7 and int(q4.min()) >= -7           # 0x8 (-8) never stored
    prod = q4.to(torch.int32) * bs.to(torch.int32).repeat_interleave(block, dim=-1)
    assert int(prod.abs().max()) <= 126                                # every b * q is an INT8 value
    row = I8.i4rs_to_int8(k8, k4, bs)
    low = rope_low_channels(d)
    assert torch.equal(row[:, low], k8) and torch.equal(row[:, ~low].to(torch.int32), prod)
    assert torch.equal(I8.dequantize_i4rs(k8, k4, bs, ts), row.float() * ts.unsqueeze(-1))
    assert torch.allclose(ts, x.abs().amax(-1) / 126)
    y = I8.dequantize_i4rs(k8, k4, bs, ts)
    assert bool(((y - x)[:, low].abs() <= ts.unsqueeze(-1) * 0.5 * (1 + 1e-5)).all())   # the INT8 half
    rel = float((y - x).norm() / x.norm())
    assert rel < (0.06 if block == 16 else 0.05), rel


def test_mse_block_scales_beat_round_up():
    x = _keys(2000, 128, seed=11)
    ts = amax_scale(x.abs().amax(-1), I8.I4RS_TARGET).unsqueeze(-1)
    y = (x * (1.0 / ts))[:, ~rope_low_channels(128)].reshape(2000, 4, 16)
    b_m, q_m = I8.choose_block_scales(y, "mse", window=None)       # all 18 candidates
    b_u, q_u = I8.choose_block_scales(y, "up")
    e_m = (y - b_m.float().unsqueeze(-1) * q_m.float()).pow(2).sum(-1)
    e_u = (y - b_u.float().unsqueeze(-1) * q_u.float()).pow(2).sum(-1)
    assert bool((e_m <= e_u * (1 + 1e-6)).all())                       # round-up is a candidate
    assert float(e_m.sum()) < 0.85 * float(e_u.sum())                  # and the MSE choice pays
    assert float((b_m < b_u).double().mean()) > 0.3                    # mostly by clipping the block max
    assert torch.equal(b_u, torch.ceil(y.abs().amax(-1) / 7).clamp(1, 18).to(torch.uint8))
    b_w, q_w = I8.choose_block_scales(y, "mse")                         # the format's search of 4 candidates
    assert bool(((b_w.long() - b_u.long() >= -2) & (b_w.long() - b_u.long() <= 1)).all())
    e_w = float((y - b_w.float().unsqueeze(-1) * q_w.float()).pow(2).sum())
    assert float(e_m.sum()) <= e_w < 1.02 * float(e_m.sum())
    assert torch.equal(I8.choose_block_scales(y, "mse", window=(17, 17))[0], b_m)


def test_block_search_is_exact_and_ordered():
    g = torch.Generator().manual_seed(5)
    y = (torch.rand(500, 16, generator=g) * 2 - 1) * 126
    for b in range(1, 19):
        q = torch.round(y * I8.RCP[b]).clamp(-7, 7)
        assert torch.equal((y - b * q).double(), y.double() - b * q.double())   # y - b q exact in float32
    d2 = torch.rand(7, 16, generator=g)

    def eight(x):   # one append-kernel thread's registers: i + 4, i + 2, i + 1
        x = x[:, :4] + x[:, 4:]
        x = x[:, :2] + x[:, 2:]
        return x[:, 0] + x[:, 1]
    assert torch.equal(I8._halving_sum(d2), eight(d2[:, :8]) + eight(d2[:, 8:]))   # then one shuffle
    assert torch.equal(I8._halving_sum(d2[:, :8]), eight(d2[:, :8]))
    b, q = I8.choose_block_scales(torch.zeros(3, 16))                  # every b ties: the smallest wins
    assert b.tolist() == [1, 1, 1] and int(q.abs().max()) == 0


def test_i4rs_bytes_are_deterministic_and_row_independent():
    d = 128
    c = torch.arange(64 * d).reshape(64, d)
    # exact inputs (integers over a power of two): the same bytes on every machine
    x = ((c * 7919 % 253 - 126) * (1 + c % 13)).float() / 64
    x[:, 40] += 300.0 / 8                  # a large-mean channel in the low-frequency half
    rows = I8.i4rs_row_bytes(*I8.quantize_i4rs(x))
    assert rows.shape == (64, I8.k_bytes_per_token_head("i4rs", d))
    assert torch.equal(rows, I8.i4rs_row_bytes(*I8.quantize_i4rs(x)))
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(I8.i4rs_row_bytes(*I8.quantize_i4rs(x[perm])), rows[perm])   # a row depends on itself only
    one = I8.i4rs_row_bytes(*I8.quantize_i4rs(x[9:10]))
    assert torch.equal(one[0], rows[9])
    # the float32 token scale is the last 4 bytes, little-endian
    ts = rows[:, -4:].contiguous().view(torch.float32)[:, 0]
    assert torch.allclose(ts, x.abs().amax(-1) / 126, rtol=0, atol=0)
    assert hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:16] == I4RS_GOLDEN


I4RS_GOLDEN = "192b275e1b03f752"   # sha256 prefix of the 64 rows above (window (2, 1), 8-element runs)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_bytes_per_token_head(d):
    assert I8.k_bytes_per_token_head("int8", d) == d + 4
    assert I8.k_bytes_per_token_head("i4rs", d) == d // 2 + d // 4 + max(4, d // 32) + 4
    assert I8.k_bytes_per_token_head("i4rs8", d) == d // 2 + d // 4 + max(4, d // 16) + 4
    assert I8.bytes_per_token_head("int8", d) == 2 * d + 4
    for fmt, block in (("i4rs", 16), ("i4rs8", 8)):
        row = I8.i4rs_row_bytes(*I8.quantize_i4rs(_keys(4, d), block=block))
        assert row.shape[-1] == I8.k_bytes_per_token_head(fmt, d)
    assert [I8.k_bytes_per_token_head(f, 128) for f in ("int8", "i4rs", "i4rs8")] == [132, 104, 108]


def test_bad_arguments():
    with pytest.raises(ValueError, match="multiple of 64"):
        I8.quantize_i4rs(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="block must be"):
        I8.quantize_i4rs(torch.zeros(2, 128), block=4)
    with pytest.raises(ValueError, match="rule"):
        I8.choose_block_scales(torch.zeros(2, 1, 16), "nearest")
    with pytest.raises(ValueError, match="k_format"):
        I8.k_bytes_per_token_head("int4", 128)


# ---------------------------------------------------------------------------------------------
# the error-budget configurations

@pytest.fixture(scope="module")
def outlier():
    from benchmarks.accuracy import kernel
    return kernel.synthetic(256, 64, 4, 2, 64, outliers=True, seed=1)


def test_budget_int_configs(outlier):
    from benchmarks.accuracy import error_budget as eb
    names = ["exact", "qi8", "qi8s", "q8", "q8s", "ki8@all", "k8@all", "ki4@all", "ki4u@all", "ki8@all~c",
             "kt8+vt8", eb.IMPL8, eb.IMPL, "qi8s+ki8@all~c+p8+v8"]
    r = {n: m["rel_l2"] for n, m in eb.budget([outlier], names).items()}
    assert r["qi8"] < 0.6 * r["q8"] and r["qi8s"] < 0.6 * r["q8s"], r     # 7 bits vs 3 mantissa bits
    assert r["qi8s"] < 0.7 * r["qi8"], r                                    # smoothing still pays with INT8
    assert r["ki8@all"] < 0.8 * r["k8@all"], r
    assert r["ki4@all"] <= r["ki4u@all"], r
    assert r["ki8@all~c"] < 0.6 * r["ki8@all"], r                           # the stored correction works
    assert r["qi8s+ki8@all~c+p8+v8"] < r[eb.IMPL8] < r[eb.IMPL], r


def test_budget_configs_are_the_references(outlier):
    from benchmarks.accuracy import error_budget as eb
    from mpfa.recipes.fp8 import quantize_e4m3
    from mpfa.reference.attention import attention
    q, k, v = outlier
    cal = eb.calibrate(k, v, "all", q_ctx=q)
    ks = k.float() - cal["mu_k"]
    _, k_eff = eb.quantized_attention(q, k, v, eb.parse("qi8s+ki4b8@all+p8+v8"), cal=cal)
    assert torch.equal(k_eff, I8.dequantize_i4rs(*I8.quantize_i4rs(ks, block=8)))
    _, k_eff = eb.quantized_attention(q, k, v, eb.parse(eb.IMPL8), cal=cal)
    assert torch.equal(k_eff, I8.dequantize_k_per_token(*I8.quantize_k_per_token(ks)))
    # the peer: E4M3 casts of K and V with scale 1, exact Q and P, no smoothing
    o, k_eff = eb.quantized_attention(q, k, v, eb.parse(eb.PEER_FP8KV), cal=eb.calibrate(k, v, "none"))
    assert torch.equal(k_eff, k.float().to(torch.float8_e4m3fn).float())
    ref, _ = attention(q, k_eff, quantize_e4m3(v.float(), 1.0).float(), causal=True, dtype=torch.float64)
    assert torch.allclose(o, ref, rtol=0, atol=1e-12)


def test_parse_int_configs():
    from benchmarks.accuracy import error_budget as eb
    c = eb.parse("qi8s+ki4b8@all~cf+p8+v8")
    assert (c["q"], c["k"], c["mu"], c["corr"], c["p"], c["v"]) == ("qi8s", "ki4b8", "all", "first", True, True)
    c = eb.parse("kt8+vt8")
    assert (c["k"], c["mu"], c["v"], c["corr"]) == ("kt8", "none", "t8", None)
    with pytest.raises(ValueError):
        eb.parse("ki5@all")


def test_requantize_k_tile_is_the_tiles_largest_scale():
    requantize_k_tile = I8.requantize_k_tile
    g = torch.Generator().manual_seed(3)
    x = torch.randn(128, 64, generator=g)
    x[7] *= 0.05
    q, s = I8.quantize_k_per_token(x)
    q2, s_t = requantize_k_tile(q, s)
    assert s_t == s.max() and q2.dtype == torch.int8
    assert torch.equal(q2[s.argmax()], q[s.argmax()])                       # the largest token keeps its bytes
    assert (q2.float() * s_t - q.float() * s.unsqueeze(-1)).abs().max() <= 0.5 * s_t * (1 + 1e-6)
    assert q2[7].abs().max() < q[7].abs().max()                               # a small token loses resolution
    z, s0 = requantize_k_tile(torch.zeros(4, 8, dtype=torch.int8), torch.zeros(4))
    assert s0 == 0 and not z.any()
    s_nan = s.clone()
    s_nan[3] = float("nan")
    assert torch.isnan(requantize_k_tile(q, s_nan)[1])


def test_compensation_digits_sum_to_the_term_within_int8():
    """comp_mma's digits: sum(COMP_DIGIT_WEIGHTS * digits) is the term for every |c| <= COMP_DIGIT_LIMIT
    (the ends and both signs included), every digit an INT8 value; a term past the limit has no digits."""
    g = torch.Generator().manual_seed(5)
    lim = I8.COMP_DIGIT_LIMIT
    c = torch.cat([torch.randint(-lim, lim + 1, (20000,), generator=g),
                   torch.tensor([0, 1, -1, 63, 64, -63, -64, 127, -127, 16129, -16129, lim, -lim])])
    d = I8.compensation_digits(c)
    w = torch.tensor(I8.COMP_DIGIT_WEIGHTS)
    assert d.dtype == torch.int8 and d.shape == (c.numel(), I8.COMP_DIGITS)
    assert torch.equal((d.long() * w).sum(-1), c)
    assert d[:, 0].abs().max() <= 63
    with pytest.raises(ValueError, match="no digits"):
        I8.compensation_digits(torch.tensor([lim + 1]))


def test_comp_digits_q_scale_keeps_every_term_within_the_digits():
    """The per-head Q scale of comp_mma: amax / 127 unless the mean's L1 norm needs more (a one-row request,
    whose smoothed rows are 0, or a mean ~10^4 times the spread); then 127 |mu|_1 / scale stays below the limit."""
    amax = torch.tensor([254.0, 0.0, 0.01, float("nan"), 0.0])
    l1 = torch.tensor([10.0, 40.0, 40.0, 1.0, 0.0])
    s = I8.comp_digits_q_scale(amax, l1)
    assert s[0] == 2.0                                             # the spread's scale
    floor = 127 * 40.0 / I8.COMP_SCALE_DIVISOR
    assert abs(float(s[1]) - floor) < 1e-9 and s[2] == s[1]          # the floor: the terms keep ~19 bits
    assert bool((127 * l1[:3] / s[:3] <= I8.COMP_DIGIT_LIMIT).all())
    assert torch.isnan(s[3]) and s[4] == 1.0
