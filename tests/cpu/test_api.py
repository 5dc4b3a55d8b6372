"""The public API on the CPU with ``backend="reference"``: the paged cache, append_kv, the prefill and
decode wrappers (plan/run), and the argument checks (every error names the argument and what is
accepted). On CPU tensors ``backend="auto"`` must refuse rather than fall back silently."""
import re

import pytest
import torch

import mpfa
from mpfa.reference import attention, batch_attention
from mpfa.recipes import get_recipe
from mpfa.reference.append import quantize_rows

RECIPES = ("bf16", "qk8pv8", "qk4pv8", "qk4pv4")
# Poison of the 1-byte fields: never a plausible write. 0x80 is -128, which INT8 K (symmetric, +-127) never
# stores; 0xFF is E4M3's NaN code (V) and a byte of INT4 K or a block scale no write produces in these tests
# (-1, -1 nibbles or scale 255).
POISON_BYTES = {torch.int8: 0x80, torch.uint8: 0xFF}


def _poisoned(t):
    return t.view(torch.uint8) == POISON_BYTES[t.dtype]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rows(n, heads, d, gen):
    """bf16 K/V rows with outlier channels (a large mean, a large spread), as real K/V have."""
    x = torch.randn(n, heads, d, generator=gen)
    x[..., 3] = x[..., 3] * 5 + 20
    x[..., d // 2 + 1] *= 15
    return x.to(torch.bfloat16)


def _cache(recipe="qk4pv8", *, layers=2, pages=24, page_size=16, heads=2, d=64):
    return mpfa.PagedKVCache(recipe, num_layers=layers, num_pages=pages, page_size=page_size, num_kv_heads=heads,
                             head_dim=d, device="cpu")


def _poison(cache):
    for t in cache.fields.values():
        if t.dtype in POISON_BYTES:
            t.view(torch.uint8).fill_(POISON_BYTES[t.dtype])
        else:
            t.fill_(float("nan"))


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32) if t.dtype == torch.float32 else t


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _assert_matches_oracle(o, ref, recipe="qk8pv8"):
    """``o`` (bf16, computed by the wrapper) against the float64 oracle ``ref`` to bf16 precision.

    With FP8 P, a probability within float32 rounding of an E4M3 rounding boundary may round the other
    way in float32 than in float64 (one P ulp, 1/14 of p near the top), so a handful of elements may
    differ by more; everything else must agree to bf16 precision (qk4pv4: plus the rotated output's first
    rounding, spread over the row: _assert_close_to_bf16)."""
    atol = 2e-3 + (2 ** -9 * ref.norm(dim=-1, keepdim=True) if get_recipe(recipe).v_format == "u4h" else 0)
    ok = (o.double() - ref).abs() <= atol + 2 ** -7 * ref.abs()
    assert ok.float().mean().item() > 0.998, (int((~ok).sum()), ok.numel(), (o.double() - ref).abs().max())
    assert _rel(o, ref) < 2 ** -8


# --------------------------------------------------------------------------------------------------
# PagedKVCache
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [64, 128])
def test_cache_fields_per_recipe(d):
    want = {
        "bf16": {"k": (torch.bfloat16, (d,)), "v": (torch.bfloat16, (d,))},
        "qk8pv8": {"k": (torch.int8, (d,)), "k_scale": (torch.float32, ()), "v": (torch.uint8, (d,))},
        "qk4pv8": {"k8": (torch.int8, (d // 2,)), "k": (torch.uint8, (d // 4,)),
                   "k_block_scale": (torch.uint8, (max(4, d // 32),)), "k_scale": (torch.float32, ()), "v": (torch.uint8, (d,))},
        "qk4pv4": {"k8": (torch.int8, (d // 2,)), "k": (torch.uint8, (d // 4,)),
                   "k_block_scale": (torch.uint8, (max(4, d // 32),)), "k_scale": (torch.float32, ()),
                   "v": (torch.uint8, (d // 2,)), "v_param": (torch.float16, (d // 16,))},
    }
    bpth = {64: {"bf16": 256, "qk8pv8": 132, "qk4pv8": 120, "qk4pv4": 96},
            128: {"bf16": 512, "qk8pv8": 260, "qk4pv8": 232, "qk4pv4": 184}}[d]
    for recipe, fields in want.items():
        c = _cache(recipe, layers=3, pages=5, page_size=32, heads=4, d=d)
        assert set(c.fields) == set(fields)
        for name, (dtype, tail) in fields.items():
            assert c.fields[name].dtype == dtype, (recipe, name)
            assert tuple(c.fields[name].shape) == (3, 5, 4, 32) + tail, (recipe, name)
        assert c.bytes_per_token_head == bpth[recipe]
        assert c.nbytes == 3 * 5 * 4 * 32 * bpth[recipe]
        assert c.num_slots == 5 * 32
        if recipe == "bf16":
            assert c.mu_k is None and c.v_scale is None
        else:
            assert c.mu_k.shape == (3, 4, d) and (c.mu_k == 0).all()
            assert c.v_scale.shape == (3, 4, d) and (c.v_scale == 1).all()
        layer = c.layer(2)
        assert layer.recipe.name == recipe and layer.index == 2
        assert layer.fields["v"].data_ptr() == c.fields["v"][2].data_ptr()    # a view, not a copy


@pytest.mark.parametrize("recipe", ["qk8pv8", "qk4pv8"])
def test_calibrate_sets_mu_k_and_v_scale(recipe):
    gen = _gen(1)
    c = _cache(recipe, layers=3, heads=2, d=64)
    k, v = _rows(50, 2, 64, gen), _rows(50, 2, 64, gen)
    v[:, 1, 7] = 0                                        # an all-zero V channel
    layer = c.layer(1)                                    # taken before calibrate: must see the update
    c.calibrate(1, k, v)
    assert torch.allclose(c.mu_k[1], k.float().mean(0), rtol=1e-6, atol=1e-6)
    assert (c.mu_k[1, :, 3] > 15).all()                  # the outlier channel's mean
    amax = v.float().abs().amax(0)
    want = torch.where(amax > 0, amax * 256 / 448, torch.ones_like(amax))
    assert torch.equal(c.v_scale[1], want)
    assert c.v_scale[1, 1, 7].item() == 1.0
    assert torch.equal(layer.mu_k, c.mu_k[1]) and torch.equal(layer.v_scale, c.v_scale[1])
    # Other layers untouched.
    assert (c.mu_k[0] == 0).all() and (c.mu_k[2] == 0).all() and (c.v_scale[0] == 1).all()
    c.calibrate(2, k, v, headroom=1.0)
    assert torch.equal(c.v_scale[2], torch.where(amax > 0, amax / 448, torch.ones_like(amax)))


def test_calibrate_bad_args():
    c = _cache("qk4pv8", heads=2, d=64)
    k = torch.randn(4, 2, 64)
    with pytest.raises(ValueError, match=r"k must be \[tokens > 0, 2, 64\]"):
        c.calibrate(0, torch.randn(4, 3, 64), k)
    with pytest.raises(ValueError, match=r"v must be \[tokens > 0, 2, 64\]"):
        c.calibrate(0, k, torch.randn(0, 2, 64))
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\)"):
        c.calibrate(2, k, k)


@pytest.mark.parametrize("headroom", [0.0, 0.5, -1.0, float("nan"), float("inf"), 1e6, True, "2", None])
def test_calibrate_refuses_headroom_outside_its_range(headroom):
    """V scale = headroom * amax / 448: 0 stored V as zeros, NaN made every output NaN, -1 negative scales, < 1
    saturates the sample, > 448 / 2^-6 pushes it below E4M3's normal range. Nothing is changed by a refusal."""
    c = _cache("qk4pv8", heads=2, d=64)
    k = torch.randn(4, 2, 64)
    match = r"headroom must be a finite number in \[1, 28672\].*got " + re.escape(repr(headroom))
    with pytest.raises(ValueError, match=match):
        c.calibrate(0, k, k, headroom=headroom)
    assert (c.v_scale == 1).all() and (c.mu_k == 0).all()


def test_calibrate_accepts_the_ends_of_the_headroom_range():
    c = _cache("qk4pv8", heads=2, d=64)
    v = torch.randn(4, 2, 64)
    amax = v.abs().amax(0)
    for headroom in (1, 28672.0):
        c.calibrate(0, v, v, headroom=headroom)
        assert torch.equal(c.v_scale[0], amax * headroom / 448)


@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("bad, match", [
    (torch.ones(4, 2, 64, dtype=torch.int8), r"must have dtype torch\.bfloat16 or torch\.float16 or torch\.float32 or "
                                             r"torch\.float64, got torch\.int8"),
    (torch.ones(4, 2, 64, dtype=torch.int32), r"must have dtype .*got torch\.int32"),
    (torch.ones(4, 2, 64).tolist(), r"must be a torch\.Tensor, got list"),
    (None, r"must be a torch\.Tensor, got NoneType"),
])
def test_calibrate_refuses_samples_that_are_not_float_tensors(name, bad, match):
    """An integer sample's amax is not V's (int8 samples stored scales of 127 / 448), a list had no .dim()."""
    c = _cache("qk4pv8", heads=2, d=64)
    args = dict(k=torch.randn(4, 2, 64), v=torch.randn(4, 2, 64))
    args[name] = bad
    with pytest.raises(ValueError, match=f"^{name} " + match):
        c.calibrate(0, **args)
    assert (c.v_scale == 1).all() and (c.mu_k == 0).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(recipe="fp4"), r"recipe must be one of \['bf16', 'qk8pv8', 'qk4pv8', 'qk4pv4'\], got 'fp4'"),
    (dict(page_size=8), r"page_size must be one of \[1, 16, 32, 64\], got 8"),
    (dict(page_size=True), r"page_size must be one of \[1, 16, 32, 64\], got True"),
    (dict(head_dim=96), r"head_dim must be one of \[64, 128\], got 96"),
    (dict(num_layers=0), r"num_layers must be a positive int, got 0"),
    (dict(num_pages=-3), r"num_pages must be a positive int, got -3"),
    (dict(num_kv_heads=2.0), r"num_kv_heads must be a positive int, got 2.0"),
    # a float that equals an accepted value is still not one (torch refused the shape naming no argument)
    (dict(head_dim=64.0), r"head_dim must be one of \[64, 128\], got 64.0"),
    (dict(page_size=16.0), r"page_size must be one of \[1, 16, 32, 64\], got 16.0"),
    (dict(num_layers=True), r"num_layers must be a positive int, got True"),
    (dict(device="bogus"), r"device must be a torch device such as 'cuda', 'cuda:1' or 'cpu', got 'bogus'"),
    # checked before allocating: 2^40 pages of 2 layers x 16 tokens x 2 heads x 120 B (qk4pv8, head_dim 64)
    (dict(num_pages=2 ** 40), rf"num_pages=1099511627776 needs {2 * 2 ** 40 * 16 * 2 * 120 + 2 * 2 * 2 * 64 * 4} bytes "
                              r"\(.* GiB: 2 layers x 1099511627776 pages x 16 tokens x 2 KV heads x 120 B, plus the "
                              r"scales\) but cpu has \d+ bytes .*: lower num_pages"),
])
def test_cache_bad_constructor_args(kwargs, match):
    args = dict(recipe="qk4pv8", num_layers=2, num_pages=4, page_size=16, num_kv_heads=2, head_dim=64, device="cpu")
    args.update(kwargs)
    recipe = args.pop("recipe")
    with pytest.raises(ValueError, match=match):
        mpfa.PagedKVCache(recipe, **args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_cache_on_a_cuda_device_this_torch_cannot_use(device):
    """Was torch's AssertionError ("Torch not compiled with CUDA enabled"), naming neither argument nor fix."""
    with pytest.raises(ValueError, match=rf"device={re.escape(repr(device))}: (this torch is built without CUDA|torch "
                                         r"sees no CUDA GPU) .*pass device='cpu' and use backend='reference'"):
        mpfa.PagedKVCache("qk4pv8", num_layers=1, num_pages=4, page_size=16, num_kv_heads=2, head_dim=64,
                          device=device)


@pytest.mark.parametrize("index", [2, -1, 1.0, "0", True])
def test_cache_layer_index_out_of_range(index):
    c = _cache(layers=2)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\)"):
        c.layer(index)
    with pytest.raises(ValueError, match="layer must be"):
        c[index]


# --------------------------------------------------------------------------------------------------
# append_kv (reference)
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_append_reference_writes_exactly_the_slots(recipe, page_size):
    gen = _gen(10 + page_size + 100 * RECIPES.index(recipe))
    heads, d = 3, 64
    pages = 160 // page_size + 3
    c = _cache(recipe, layers=2, pages=pages, page_size=page_size, heads=heads, d=d)
    c.calibrate(1, _rows(128, heads, d, gen), _rows(128, heads, d, gen))
    _poison(c)
    n = 90
    slots = torch.randperm(c.num_slots, generator=gen)[:n]       # scattered, across page boundaries
    slots[[7, 40]] = -1                                          # padding: written nowhere
    k, v = _rows(n, heads, d, gen), _rows(n, heads, d, gen)
    layer = c.layer(1)
    assert mpfa.append_kv(k, v, layer, slots.int(), backend="reference") == "reference"

    keep = slots >= 0
    want = quantize_rows(c.recipe, k[keep], v[keep], layer.mu_k, layer.v_scale)
    s = slots[keep]
    page, off = s // page_size, s % page_size
    written = torch.zeros(pages, page_size, dtype=torch.bool)
    written[page, off] = True
    for name, t in layer.fields.items():
        got = t[page, :, off]                                    # [rows, heads, ...]
        assert torch.equal(_bits(got), _bits(want[name].to(t.dtype))), name
        # Unwritten slots still hold the poison, in every layer.
        rest = t.transpose(1, 2)[~written]
        if t.dtype in POISON_BYTES:
            assert _poisoned(rest).all(), name
            assert _poisoned(c.fields[name][0]).all()
        else:
            assert torch.isnan(rest.float()).all(), name
            assert torch.isnan(c.fields[name][0].float()).all()

    # Dequantized rows are within the formats' rounding error of the inputs.
    kd, vd = layer.dequantize(torch.float64, add_mean=True)
    kd, vd = kd[page, :, off], vd[page, :, off]
    kk, vv = k[keep].double(), v[keep].double()
    if recipe == "bf16":
        assert torch.equal(kd, kk) and torch.equal(vd, vv)
    else:
        if c.recipe.v_format == "u4h":
            _assert_v_within_u4h_error(layer.fields["v"][page, :, off], layer.fields["v_param"][page, :, off], v[keep])
        else:
            _assert_v_within_e4m3_error(vd, vv, layer.v_scale.double())
        _assert_k_within_format_error(c.recipe.k_format, kd, kk, layer.mu_k.double())
        assert _rel(kd, kk) > 0            # it is quantized


# The formats' error bounds, derived from their definitions (mpfa/recipes/fp8.py, int8.py), not read off a run.
# The quantizers' float32 steps (K - mu_K, one reciprocal, one multiply, the dequantizing product) each round by
# at most 2^-24 of the value involved; F32 = 2^-21 of the row's magnitude covers them with room to spare.
F32 = 2.0 ** -21


def _assert_v_within_e4m3_error(vd, v, scale):
    """FP8 V under fixed channel scales, unsaturated (calibration leaves 256x headroom): y = v / scale is rounded
    to E4M3 (3 mantissa bits): a half-step of at most 2^-4 |y| where y is normal (|y| >= 2^-6), at most 2^-10 where
    it is subnormal (step 2^-9). So every element: |vd - v| <= 2^-4 |v| + 2^-10 scale."""
    bound = 2 ** -4 * v.abs() + 2 ** -10 * scale + F32 * (v.abs() + scale)
    err = (vd - v).abs()
    assert (err <= bound).all(), f"V off by {(err / bound).max().item():.3f}x the E4M3 error bound"


def _assert_v_within_u4h_error(codes, v_param, v):
    """4-bit Hadamard V (mpfa/recipes/u4h.py), in the rotated space r = V H where it is quantized: each group of 32
    channels has step s = (max - min) / 15 rounded to fp16; rni leaves every decoded channel within s / 2 of r, up
    to the clamp at code 0 where the fp16 zero point rounds above the minimum (half an fp16 ulp, 2^-11 |zero|) and
    the fp16 roundings of the decoded value (2^-11 of it) and of the float32 steps (F32)."""
    from mpfa.recipes import u4h
    r = u4h.rotate(v).double()
    dec = u4h.decode_values(codes, v_param).double()
    scale, zero = (t.double().repeat_interleave(u4h.GROUP, dim=-1) for t in u4h.split_param(v_param))
    bound = scale / 2 + 2 ** -11 * (zero.abs() + r.abs() + scale) + F32 * (r.abs() + scale)
    err = (dec - r).abs()
    assert (err <= bound).all(), f"V off by {(err / bound).max().item():.3f}x the 4-bit error bound"


def _assert_k_within_format_error(k_format, kd, k, mu):
    """K - mu_K quantized per (token, head) row under s = amax / target. INT8 (target 127): rni leaves every
    element within s / 2 = amax / 254. i4rs (target 126): the low-frequency half is INT8 rni (within s / 2); each
    16-channel block of the other half takes the block scale b* of least squared error, which is never worse than
    the rounded-up scale b_up = ceil(amax_block(|y|) / 7) (a candidate of its search), whose grid b_up * q leaves
    each element within b_up / 2: the block's L2 error is at most sqrt(16) * b_up / 2 * s."""
    x = k - mu
    amax = x.abs().amax(dim=-1, keepdim=True)
    err = kd - k
    if k_format == "int8":
        bound = amax / 254 + F32 * amax
        assert (err.abs() <= bound).all(), f"K off by {(err.abs() / bound).max().item():.3f}x the INT8 error bound"
        return
    from mpfa.recipes.int8 import I4RS_BLOCK, I4RS_TARGET, INT4_MAX, rope_low_channels
    s = amax / I4RS_TARGET
    low = rope_low_channels(k.shape[-1])
    bound = s / 2 + F32 * amax
    assert (err[..., low].abs() <= bound).all(), "K's INT8 half is off by more than half its step"
    blocks = lambda t: t[..., ~low].unflatten(-1, (-1, I4RS_BLOCK))   # noqa: E731
    b_up = (blocks(x / s).abs().amax(dim=-1) / INT4_MAX).ceil().clamp(1, 18)
    block_bound = I4RS_BLOCK ** 0.5 * (b_up / 2 * s + F32 * amax)
    block_err = blocks(err).norm(dim=-1)
    assert (block_err <= block_bound).all(), \
        f"K's INT4 blocks off by {(block_err / block_bound).max().item():.3f}x their rounded-up block scale's bound"


def test_append_reference_int64_slots_and_overwrite():
    gen = _gen(20)
    c = _cache("qk8pv8", pages=4, page_size=16, heads=2, d=64)
    layer = c.layer(0)
    k, v = _rows(5, 2, 64, gen), _rows(5, 2, 64, gen)
    slots = torch.tensor([0, 15, 16, 17, 63])
    mpfa.append_kv(k, v, layer, slots, backend="reference")
    k2 = _rows(5, 2, 64, gen)
    mpfa.append_kv(k2, v, layer, slots, backend="reference")     # rewriting a slot replaces it
    want = quantize_rows(c.recipe, k2, v, layer.mu_k, layer.v_scale)
    assert torch.equal(layer.fields["k"][slots // 16, :, slots % 16], want["k"])
    assert torch.equal(layer.fields["k_scale"][slots // 16, :, slots % 16], want["k_scale"])
    # All slots negative: nothing is written.
    before = {n: t.clone() for n, t in layer.fields.items()}
    mpfa.append_kv(k, v, layer, torch.full((5,), -1), backend="reference")
    for n, t in layer.fields.items():
        assert torch.equal(t, before[n])
    # No rows at all is fine too.
    mpfa.append_kv(k[:0], v[:0], layer, slots[:0], backend="reference")


def test_append_auto_backend_on_cpu_refuses():
    c = _cache("qk4pv8", heads=2, d=64)
    k = _rows(3, 2, 64, _gen(21))
    with pytest.raises(ValueError, match="backend='reference'"):
        mpfa.append_kv(k, k, c.layer(0), torch.arange(3))
    with pytest.raises(ValueError, match="backend='reference'"):
        mpfa.append_kv(k, k, c.layer(0), torch.arange(3), backend="cuda")
    with pytest.raises(ValueError, match=r"backend must be one of \['auto', 'cuda', 'reference'\], got 'bogus'"):
        mpfa.append_kv(k, k, c.layer(0), torch.arange(3), backend="bogus")


def _bad_append_cases():
    good_k = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    s = torch.arange(3)
    return [
        ("k float32", dict(k=good_k.float()), r"k must have dtype torch\.bfloat16, got torch\.float32"),
        ("k 2-d", dict(k=good_k[:, 0]), r"k must have 3 dimensions"),
        ("k heads", dict(k=torch.zeros(3, 4, 64, dtype=torch.bfloat16)), r"k must have shape \[\*, 2, 64\], got \[3, 4, 64\]"),
        ("k head_dim", dict(k=torch.zeros(3, 2, 128, dtype=torch.bfloat16)), r"k must have shape \[\*, 2, 64\]"),
        ("k not tensor", dict(k=good_k.tolist()), r"k must be a torch\.Tensor, got list"),
        ("v dtype", dict(v=good_k.half()), r"v must have dtype torch\.bfloat16, got torch\.float16"),
        ("v rows", dict(v=good_k[:2]), r"v must have shape \[3, 2, 64\], got \[2, 2, 64\]"),
        ("slots length", dict(slots=s[:2]), r"slots must have shape \[3\], got \[2\]"),
        ("slots dtype", dict(slots=s.float()), r"slots must have dtype torch\.int32 or torch\.int64, got torch\.float32"),
        ("slots 2-d", dict(slots=s[None]), r"slots must have shape \[3\]"),
        ("slots list", dict(slots=[0, 1, 2]), r"slots must be a torch\.Tensor, got list"),
    ]


@pytest.mark.parametrize("case", _bad_append_cases(), ids=lambda c: c[0])
def test_append_bad_input_names_argument(case):
    _, override, match = case
    c = _cache("qk4pv8", heads=2, d=64)
    args = dict(k=torch.zeros(3, 2, 64, dtype=torch.bfloat16), v=torch.zeros(3, 2, 64, dtype=torch.bfloat16),
                slots=torch.arange(3))
    args.update(override)
    _poison(c)
    with pytest.raises(ValueError, match=match):
        mpfa.append_kv(args["k"], args["v"], c.layer(0), args["slots"], backend="reference")
    assert _poisoned(c.fields["k"]).all()          # nothing written before the error


def test_append_bad_device_and_kv():
    c = _cache("bf16", heads=2, d=64)
    k = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    try:
        km = torch.zeros(3, 2, 64, dtype=torch.bfloat16, device="meta")
    except Exception:                                    # pragma: no cover
        pytest.skip("no meta device")
    with pytest.raises(ValueError, match=r"k must be on cpu, got meta"):
        mpfa.append_kv(km, k, c.layer(0), torch.arange(3), backend="reference")
    with pytest.raises(ValueError, match=r"slots must be on cpu, got meta"):
        mpfa.append_kv(k, k, c.layer(0), torch.arange(3, device="meta"), backend="reference")
    with pytest.raises(ValueError, match=r"kv must be a KVCacheLayer \(PagedKVCache\.layer\(i\)\), got PagedKVCache"):
        mpfa.append_kv(k, k, c, torch.arange(3), backend="reference")


# --------------------------------------------------------------------------------------------------
# Prefill / decode wrappers (reference)
# --------------------------------------------------------------------------------------------------

HEADS, KV_HEADS, PAGE = 8, 2, 16


def _workspace():
    return torch.empty(1 << 16, dtype=torch.uint8)


def _batch(recipe, d, gen, requests, *, layers=2, extra_pages=5, num_layers_filled=(0,)):
    """Append a ragged batch (prefix + new chunk per request) with page size 16 to random pages.

    requests: list of (prefix_len, chunk_len). Returns the cache, the paged description, the original
    (pre-quantization) per-request K/V of layer 0 and qo_indptr."""
    n_pages = [(p + c + PAGE - 1) // PAGE for p, c in requests]
    num_pages = sum(n_pages) + extra_pages
    cache = mpfa.PagedKVCache(recipe, num_layers=layers, num_pages=num_pages, page_size=PAGE,
                              num_kv_heads=KV_HEADS, head_dim=d, device="cpu")
    perm = torch.randperm(num_pages, generator=gen)
    indptr, indices, last, dense = [0], [], [], {}
    used = 0
    for i in num_layers_filled:
        cache.calibrate(i, _rows(256, KV_HEADS, d, gen), _rows(256, KV_HEADS, d, gen))
    for b, ((p, c), np_) in enumerate(zip(requests, n_pages)):
        ids = perm[used:used + np_]
        used += np_
        m = p + c
        slots = ids.repeat_interleave(PAGE)[:m] * PAGE + torch.arange(m) % PAGE
        for i in num_layers_filled:
            k, v = _rows(m, KV_HEADS, d, gen), _rows(m, KV_HEADS, d, gen)
            # The prefix first (already cached), then the new chunk, as a server does.
            mpfa.append_kv(k[:p], v[:p], cache.layer(i), slots[:p], backend="reference")
            mpfa.append_kv(k[p:], v[p:], cache.layer(i), slots[p:].int(), backend="reference")
            dense[(i, b)] = (k, v)
        indptr.append(indptr[-1] + np_)
        indices.append(ids)
        last.append(0 if m == 0 else m - (np_ - 1) * PAGE)
    qo = [0]
    for _, c in requests:
        qo.append(qo[-1] + c)
    paged = (torch.tensor(indptr, dtype=torch.int32), torch.cat(indices).int(), torch.tensor(last, dtype=torch.int32))
    return cache, paged, dense, torch.tensor(qo, dtype=torch.int32)


def _queries(n, d, gen):
    q = torch.randn(n, HEADS, d, generator=gen)
    q[..., 5] += 8                   # outlier channels with a large mean (what Q smoothing is for)
    q[..., 17] += 8
    return q.to(torch.bfloat16)


# rel-L2 of a request's output against exact attention on its unquantized K/V: loose per-recipe ceilings over the
# formats' errors (qk4pv4: V's 4-bit step, ~8% of a row in rel-L2, on top of qk4pv8's; a request that attends
# mostly to a few keys keeps their V error nearly whole, measured up to 0.22 on these inputs)
BOUND_VS_UNQUANTIZED = {"bf16": 0.01, "qk8pv8": 0.08, "qk4pv8": 0.2, "qk4pv4": 0.3}

# prefix lengths not page-aligned; a request with no new rows; a request with no prefix; one row
REQUESTS = [(21, 9), (40, 0), (0, 16), (37, 1), (3, 45)]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("d", [64, 128])
def test_prefill_reference_matches_oracle(recipe, d):
    gen = _gen(30 + d + RECIPES.index(recipe))
    cache, (indptr, indices, last), dense, qo_indptr = _batch(recipe, d, gen, REQUESTS, num_layers_filled=(0, 1))
    w = mpfa.BatchPrefillWrapper(_workspace(), backend="reference")
    assert w.backend is None
    w.plan(qo_indptr, indptr, indices, last, HEADS, KV_HEADS, d, PAGE, causal=True, recipe=recipe)
    assert w.backend == "reference"
    total_q = int(qo_indptr[-1])
    for layer_idx in (0, 1):                             # one plan serves every layer
        layer = cache.layer(layer_idx)
        q = _queries(total_q, d, gen)
        o, lse = w.run(q, layer, return_lse=True)
        assert o.dtype == torch.bfloat16 and o.shape == (total_q, HEADS, d)
        assert lse.shape == (total_q, HEADS) and torch.isfinite(lse).all()
        kp, vp = layer.dequantize(torch.float64, path="prefill")
        ro, rlse = batch_attention(q, qo_indptr, kp, vp, indptr, indices, last, causal=True, recipe=recipe,
                                   dtype=torch.float64, **mpfa.prefill.reference_numerics(recipe, None, layer))
        _assert_matches_oracle(o, ro, recipe)
        assert torch.allclose(lse.double(), rlse, rtol=1e-5, atol=1e-4)
        # And close to exact attention on the original, unquantized K/V of each request.
        qo = qo_indptr.tolist()
        for b in range(len(REQUESTS)):
            rows = slice(qo[b], qo[b + 1])
            if rows.start == rows.stop:
                continue
            k, v = dense[(layer_idx, b)]
            eo, _ = attention(q[rows], k, v, causal=True)
            bound = BOUND_VS_UNQUANTIZED[recipe]
            assert _rel(o[rows], eo) < bound, (b, _rel(o[rows], eo))


def test_prefill_out_in_place_and_compensation_flag():
    gen = _gen(40)
    d = 64
    cache, (indptr, indices, last), _, qo_indptr = _batch("qk8pv8", d, gen, REQUESTS)
    layer = cache.layer(0)
    q = _queries(int(qo_indptr[-1]), d, gen)
    kp, vp = layer.dequantize(torch.float64)
    outs = {}
    for comp in (True, False):
        w = mpfa.BatchPrefillWrapper(_workspace(), backend="reference")
        w.plan(qo_indptr, indptr, indices, last, HEADS, KV_HEADS, d, PAGE, recipe="qk8pv8", compensation=comp)
        out = torch.full_like(q, float("nan"))
        res = w.run(q, layer, out=out)
        assert res is out or res.data_ptr() == out.data_ptr()
        assert not torch.isnan(out).any()
        ro, _ = batch_attention(q, qo_indptr, kp, vp, indptr, indices, last, causal=True, recipe="qk8pv8",
                                compensation=comp, dtype=torch.float64, **mpfa.prefill.reference_numerics("qk8pv8", None, layer))
        _assert_matches_oracle(out, ro)
        outs[comp] = out
    assert not torch.equal(outs[True], outs[False])       # the flag reaches the numerics


@pytest.mark.parametrize("recipe", ["qk8pv8", "qk4pv8"])
def test_prefill_reference_follows_the_kernel_builds_numerics(recipe):
    """The private _plan_study(knobs=) picks a kernel build, and the reference backend computes what that build
    does: prefill v3's numerics (one K scale per 128-key tile, one Q scale per request and head with compensation)
    differ from the per-key ones (per-key K scales, 64-row Q scales), each build matching its own oracle; bad knobs
    are refused, and the public plan takes none."""
    from mpfa_jit.ops import prefill as prefill_op
    v3 = {"tile_scale": 1, "comp_mma": 1}
    gen = _gen(42)
    d = 64
    requests = [(300, 40), (0, 200), (129, 1)]   # several K tiles, a one-row request
    cache, (indptr, indices, last), _, qo_indptr = _batch(recipe, d, gen, requests)
    layer = cache.layer(0)
    q = _queries(int(qo_indptr[-1]), d, gen)
    kp, vp = layer.dequantize(torch.float64)
    outs = {}
    for name, knobs in (("served", None), ("v3", v3), ("per-key", {"tile_scale": 0, "comp_mma": 0})):
        w = mpfa.BatchPrefillWrapper(_workspace(), backend="reference")
        w._plan_study(qo_indptr, indptr, indices, last, HEADS, KV_HEADS, d, PAGE, recipe=recipe, knobs=knobs)
        outs[name] = w.run(q, layer)
        kw = mpfa.prefill.reference_numerics(recipe, knobs, layer)
        ro, _ = batch_attention(q, qo_indptr, kp, vp, indptr, indices, last, causal=True, recipe=recipe,
                                dtype=torch.float64, **kw)
        _assert_matches_oracle(outs[name], ro)
    assert not torch.equal(outs["v3"], outs["per-key"])
    assert torch.equal(outs["served"], outs["v3" if prefill_op.SERVED_KNOBS[recipe]["tile_scale"] else "per-key"])
    w = mpfa.BatchPrefillWrapper(_workspace(), backend="reference")
    for bad, msg in (({"consumers": 3}, "consumers=3"), ({"pingpong": 0}, "pingpong=0"),
                     ({"tile_scale": 0, "comp_mma": 1}, "needs tile_scale=1"), ("tile_scale=1", "knobs must be a dict")):
        with pytest.raises(ValueError, match=msg):
            w._plan_study(qo_indptr, indptr, indices, last, HEADS, KV_HEADS, d, PAGE, recipe=recipe, knobs=bad)
    with pytest.raises(TypeError, match="knobs"):
        w.plan(qo_indptr, indptr, indices, last, HEADS, KV_HEADS, d, PAGE, recipe=recipe, knobs=v3)


def test_prefill_non_causal_and_sm_scale():
    gen = _gen(41)
    d = 64
    cache, (indptr, indices, last), _, qo_indptr = _batch("bf16", d, gen, REQUESTS)
    layer = cache.layer(0)
    q = _queries(int(qo_indptr[-1]), d, gen)
    kp, vp = layer.dequantize(torch.float64)
    w = mpfa.BatchPrefillWrapper(_workspace(), backend="reference")
    w.plan(qo_indptr, indptr, indices, last, HEADS, KV_HEADS, d, PAGE, causal=False, sm_scale=0.05, recipe="bf16")
    o, lse = w.run(q, layer, return_lse=True)
    ro, rlse = batch_attention(q, qo_indptr, kp, vp, indptr, indices, last, causal=False, sm_scale=0.05,
                               recipe="bf16", dtype=torch.float64)
    _assert_matches_oracle(o, ro)
    assert torch.allclose(lse.double(), rlse, rtol=1e-5, atol=1e-4)
    causal_o, _ = batch_attention(q, qo_indptr, kp, vp, indptr, indices, last, causal=True, sm_scale=0.05,
                                  recipe="bf16", dtype=torch.float64)
    assert not torch.allclose(o.double(), causal_o, rtol=2 ** -7, atol=2e-3)


def _assert_close_to_bf16(o, ref, recipe):
    """A bf16 output ``o`` against the float64 ``ref``: rtol 2^-7 (bf16's rounding, twice over) and atol 1e-3.
    qk4pv4's output is rounded to bf16 twice, the second time after the rotation back (O = bf16(O_rot) H): O_rot's
    rounding error e (|e_c| <= 2^-9 |O_rot_c|, so ||e|| <= 2^-9 ||o||) spreads over every channel of the row,
    |(e H)_c| <= ||e||_1 / sqrt(D) <= ||e||_2, so a small channel beside a large one takes up to 2^-9 ||o_row|| more."""
    o, ref = o.double(), ref.double()
    atol = 1e-3 + (2 ** -9 * ref.norm(dim=-1, keepdim=True) if get_recipe(recipe).v_format == "u4h" else 0)
    err = (o - ref).abs()
    assert (err <= atol + 2 ** -7 * ref.abs()).all(), (err - 2 ** -7 * ref.abs()).max()


@pytest.mark.parametrize("recipe", RECIPES)
def test_decode_reference_matches_exact_on_dequantized_cache(recipe):
    gen = _gen(50 + RECIPES.index(recipe))
    d = 128
    requests = [(20, 1), (1, 0), (33, 0), (15, 1), (64, 0)]    # KV lengths 21, 1, 33, 16, 64
    cache, (indptr, indices, last), dense, _ = _batch(recipe, d, gen, requests, num_layers_filled=(0, 1))
    batch = len(requests)
    w = mpfa.BatchDecodeWrapper(_workspace(), backend="reference")
    w.plan(indptr, indices, last, HEADS, KV_HEADS, d, PAGE, recipe=recipe)
    assert w.backend == "reference"
    for layer_idx in (0, 1):
        layer = cache.layer(layer_idx)
        q = _queries(batch, d, gen)
        out = torch.empty_like(q)
        o, lse = w.run(q, layer, out=out, return_lse=True)
        assert o.data_ptr() == out.data_ptr() and o.shape == (batch, HEADS, d) and lse.shape == (batch, HEADS)
        kp, vp = layer.dequantize(torch.float64)
        ro, rlse = batch_attention(q, torch.arange(batch + 1), kp, vp, indptr, indices, last, causal=False,
                                   dtype=torch.float64)
        _assert_close_to_bf16(o, ro, recipe)
        assert torch.allclose(lse.double(), rlse, rtol=1e-5, atol=1e-4)
        # Decode does not quantize Q: against the dequantized cache (mu_K added back; softmax-invariant)
        # it is exact attention of the bf16 query.
        kf, vf = layer.dequantize(torch.float64, add_mean=True)
        for b in range(batch):
            ids = indices[indptr[b]:indptr[b + 1]].long()
            m = sum(requests[b])
            kb = kf[ids].transpose(1, 2).reshape(-1, KV_HEADS, d)[:m]
            vb = vf[ids].transpose(1, 2).reshape(-1, KV_HEADS, d)[:m]
            eo, _ = attention(q[b:b + 1], kb, vb, causal=False)
            _assert_close_to_bf16(o[b:b + 1], eo, recipe)
            k0, v0 = dense[(layer_idx, b)]
            assert _rel(o[b:b + 1], attention(q[b:b + 1], k0, v0, causal=False)[0]) < \
                BOUND_VS_UNQUANTIZED[recipe]


def test_decode_sm_scale():
    gen = _gen(52)
    d = 64
    requests = [(20, 1), (7, 0), (40, 1)]
    cache, (indptr, indices, last), _, _ = _batch("qk4pv8", d, gen, requests)
    layer = cache.layer(0)
    q = _queries(3, d, gen)
    kp, vp = layer.dequantize(torch.float64)
    w = mpfa.BatchDecodeWrapper(_workspace(), backend="reference")
    w.plan(indptr, indices, last, HEADS, KV_HEADS, d, PAGE, sm_scale=0.5, recipe="qk4pv8")
    o, lse = w.run(q, layer, return_lse=True)
    ro, rlse = batch_attention(q, torch.arange(4), kp, vp, indptr, indices, last, causal=False, sm_scale=0.5)
    assert torch.allclose(o.double(), ro, rtol=2 ** -7, atol=1e-3)
    assert torch.allclose(lse.double(), rlse, rtol=1e-5, atol=1e-4)
    default, _ = batch_attention(q, torch.arange(4), kp, vp, indptr, indices, last, causal=False)
    assert not torch.allclose(o.double(), default, rtol=2 ** -7, atol=1e-3)


def test_decode_request_with_empty_kv():
    """plan accepts a request with no pages (last_page_len 0); run must then either give o = 0 for it
    (the reference's 'row that sees no key') or plan must reject it with a ValueError."""
    gen = _gen(51)
    d = 64
    cache, (indptr, indices, last), _, _ = _batch("bf16", d, gen, [(10, 0), (0, 0), (5, 0)])
    w = mpfa.BatchDecodeWrapper(_workspace(), backend="reference")
    try:
        w.plan(indptr, indices, last, HEADS, KV_HEADS, d, PAGE, recipe="bf16")
    except ValueError:
        return
    o = w.run(_queries(3, d, gen), cache.layer(0))
    assert (o[1] == 0).all() and (o[0] != 0).any()


# --------------------------------------------------------------------------------------------------
# Wrapper argument errors
# --------------------------------------------------------------------------------------------------

def _simple_plan_args(d=64):
    """Two requests: 20 KV tokens (2 pages, last 4) with 5 new rows; 16 KV tokens (1 page) with 16 rows."""
    return dict(qo_indptr=torch.tensor([0, 5, 21], dtype=torch.int32),
                paged_kv_indptr=torch.tensor([0, 2, 3], dtype=torch.int32),
                paged_kv_indices=torch.tensor([4, 1, 2], dtype=torch.int32),
                paged_kv_last_page_len=torch.tensor([4, 16], dtype=torch.int32),
                num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=d, page_size=PAGE)


def _prefill_plan(w, recipe="qk4pv8", **over):
    a = _simple_plan_args()
    a.update(over)
    w.plan(a["qo_indptr"], a["paged_kv_indptr"], a["paged_kv_indices"], a["paged_kv_last_page_len"],
           a["num_qo_heads"], a["num_kv_heads"], a["head_dim"], a["page_size"], recipe=recipe,
           **{k: a[k] for k in ("causal", "compensation") if k in a})


def _decode_plan(w, recipe="qk4pv8", **over):
    a = _simple_plan_args()
    a.update(over)
    w.plan(a["paged_kv_indptr"], a["paged_kv_indices"], a["paged_kv_last_page_len"], a["num_qo_heads"],
           a["num_kv_heads"], a["head_dim"], a["page_size"], recipe=recipe)


I32 = dict(dtype=torch.int32)
PLAN_ERRORS = [
    ("recipe fp4", dict(recipe="fp4"), r"recipe must be one of \['bf16', 'qk8pv8', 'qk4pv8', 'qk4pv4'\], got 'fp4'"),
    ("head_dim 96", dict(head_dim=96), r"head_dim must be one of \[64, 128\], got 96"),
    ("page_size 8", dict(page_size=8), r"page_size must be one of \[1, 16, 32, 64\], got 8"),
    ("heads not multiple", dict(num_qo_heads=6, num_kv_heads=4),
     r"num_qo_heads \(6\) must be a multiple of num_kv_heads \(4\)"),
    ("heads zero", dict(num_kv_heads=0), r"num_kv_heads must be a positive int, got 0"),
    ("indptr decreasing", dict(paged_kv_indptr=torch.tensor([0, 2, 1], **I32)),
     r"paged_kv_indptr must start at 0, never decrease"),
    ("indptr not from 0", dict(paged_kv_indptr=torch.tensor([1, 2, 3], **I32)), r"paged_kv_indptr must start at 0"),
    ("indptr past indices", dict(paged_kv_indptr=torch.tensor([0, 2, 4], **I32)),
     r"paged_kv_indptr must .* end at most at len\(paged_kv_indices\)=3"),
    ("indptr float", dict(paged_kv_indptr=torch.tensor([0.0, 2.0, 3.0])),
     r"paged_kv_indptr must have dtype torch\.int32 or torch\.int64, got torch\.float32"),
    ("indptr too short", dict(paged_kv_indptr=torch.tensor([0], **I32)), r"paged_kv_indptr must have batch_size \+ 1 >= 2"),
    ("last page 0", dict(paged_kv_last_page_len=torch.tensor([0, 16], **I32)),
     r"paged_kv_last_page_len\[0\] must be in \[1, page_size=16\]"),
    ("last page 17", dict(paged_kv_last_page_len=torch.tensor([4, 17], **I32)),
     r"paged_kv_last_page_len\[1\] must be in \[1, page_size=16\]"),
    ("last page wrong length", dict(paged_kv_last_page_len=torch.tensor([4], **I32)),
     r"paged_kv_last_page_len must have shape \[2\], got \[1\]"),
    ("indices 2-d", dict(paged_kv_indices=torch.tensor([[4, 1, 2]], **I32)),
     r"paged_kv_indices must have 1 dimensions"),
    # every integer argument is an int: 64.0 == 64 was accepted and reached the kernels' integer fields
    ("head_dim float", dict(head_dim=64.0), r"head_dim must be one of \[64, 128\], got 64.0"),
    ("page_size float", dict(page_size=16.0), r"page_size must be one of \[1, 16, 32, 64\], got 16.0"),
    ("page_size bool", dict(page_size=True, paged_kv_last_page_len=torch.tensor([1, 1], **I32)),
     r"page_size must be one of \[1, 16, 32, 64\], got True"),
    ("num_qo_heads float", dict(num_qo_heads=8.0), r"num_qo_heads must be a positive int, got 8.0"),
    ("num_kv_heads bool", dict(num_kv_heads=True), r"num_kv_heads must be a positive int, got True"),
]
PREFILL_ONLY_ERRORS = [
    ("qo rows > kv", dict(qo_indptr=torch.tensor([0, 21, 22], **I32)), r"request 0 has 21 query rows but only 20 KV tokens"),
    ("qo decreasing", dict(qo_indptr=torch.tensor([0, 5, 4], **I32)), r"qo_indptr must start at 0 and never decrease"),
    ("qo wrong length", dict(qo_indptr=torch.tensor([0, 5], **I32)), r"qo_indptr must have shape \[3\], got \[2\]"),
    ("causal not bool", dict(causal=1), r"causal and compensation must be bool"),
]


@pytest.mark.parametrize("case", PLAN_ERRORS + PREFILL_ONLY_ERRORS, ids=lambda c: c[0])
def test_prefill_plan_errors(case):
    _, over, match = case
    over = dict(over)
    recipe = over.pop("recipe", "qk4pv8")
    w = mpfa.BatchPrefillWrapper(_workspace(), backend="reference")
    with pytest.raises(ValueError, match=match):
        _prefill_plan(w, recipe=recipe, **over)
    with pytest.raises(RuntimeError, match="before plan"):     # a failed plan leaves nothing to run
        w.run(torch.zeros(21, HEADS, 64, dtype=torch.bfloat16), _cache("qk4pv8", pages=8).layer(0))


@pytest.mark.parametrize("case", PLAN_ERRORS, ids=lambda c: c[0])
def test_decode_plan_errors(case):
    _, over, match = case
    over = dict(over)
    recipe = over.pop("recipe", "qk4pv8")
    w = mpfa.BatchDecodeWrapper(_workspace(), backend="reference")
    with pytest.raises(ValueError, match=match):
        _decode_plan(w, recipe=recipe, **over)


@pytest.mark.parametrize("wrapper", [mpfa.BatchPrefillWrapper, mpfa.BatchDecodeWrapper])
def test_run_before_plan_raises(wrapper):
    w = wrapper(_workspace(), backend="reference")
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(torch.zeros(2, HEADS, 64, dtype=torch.bfloat16), _cache().layer(0))


@pytest.mark.parametrize("wrapper", [mpfa.BatchPrefillWrapper, mpfa.BatchDecodeWrapper])
def test_workspace_checked(wrapper):
    with pytest.raises(ValueError, match=r"workspace_buffer must have dtype torch\.uint8"):
        wrapper(torch.empty(16, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"workspace_buffer must have 1 dimensions"):
        wrapper(torch.empty(4, 4, dtype=torch.uint8))
    buf = torch.empty(1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"workspace_buffer must start at a 16-byte aligned address \(got one at 1 bytes"):
        wrapper(buf[1:])
    wrapper(buf[16:])   # a slice at a multiple of 16 is accepted


@pytest.mark.parametrize("plan", [_prefill_plan, _decode_plan])
def test_plan_auto_backend_on_cpu_refuses(plan):
    cls = mpfa.BatchPrefillWrapper if plan is _prefill_plan else mpfa.BatchDecodeWrapper
    for backend in ("auto", "cuda"):
        w = cls(_workspace(), backend=backend)
        with pytest.raises(ValueError, match="backend='reference'"):
            plan(w)
        assert w._plan is None
    w = cls(_workspace(), backend="bogus")
    with pytest.raises(ValueError, match=r"backend must be one of \['auto', 'cuda', 'reference'\], got 'bogus'"):
        plan(w)
    # The default is the kernels, never a silent fallback.
    with pytest.raises(ValueError, match="backend='reference'"):
        plan(cls(_workspace()))


def _run_errors():
    q = torch.zeros(21, HEADS, 64, dtype=torch.bfloat16)
    return [
        ("recipe mismatch", dict(cache=_cache("qk8pv8", pages=8)),
         r"kv does not match the plan: planned recipe='qk4pv8', the cache has 'qk8pv8'"),
        ("page_size mismatch", dict(cache=_cache("qk4pv8", pages=80, page_size=1)),
         r"kv does not match the plan: planned page_size=16, the cache has 1"),
        ("heads mismatch", dict(cache=_cache("qk4pv8", pages=8, heads=4)),
         r"kv does not match the plan: planned num_kv_heads=2, the cache has 4"),
        ("head_dim mismatch", dict(cache=_cache("qk4pv8", pages=8, d=128)),
         r"kv does not match the plan: planned head_dim=64, the cache has 128"),
        ("kv not a layer", dict(cache="whole"), r"kv must be a KVCacheLayer"),
        ("page beyond the cache", dict(cache=_cache("qk4pv8", pages=4)),
         r"paged_kv_indices must be < num_pages=4 of the cache, got page 4"),
        ("q rows", dict(q=q[:20]), r"q must have shape \[21, 8, 64\], got \[20, 8, 64\]"),
        ("q heads", dict(q=torch.zeros(21, 4, 64, dtype=torch.bfloat16)), r"q must have shape \[21, 8, 64\]"),
        ("q dtype", dict(q=q.float()), r"q must have dtype torch\.bfloat16, got torch\.float32"),
        ("out shape", dict(out=q[:3]), r"out must have shape \[21, 8, 64\]"),
        ("out dtype", dict(out=q.float()), r"out must have dtype torch\.bfloat16"),
    ]


@pytest.mark.parametrize("case", _run_errors(), ids=lambda c: c[0])
def test_prefill_run_errors(case):
    _, over, match = case
    w = mpfa.BatchPrefillWrapper(_workspace(), backend="reference")
    _prefill_plan(w)
    cache = over.get("cache", _cache("qk4pv8", pages=8))
    kv = _cache("qk4pv8", pages=8) if cache == "whole" else cache.layer(0)   # "whole": the cache, not a layer
    q = over.get("q", torch.zeros(21, HEADS, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=match):
        w.run(q, kv, out=over.get("out"))


@pytest.mark.parametrize("case", _run_errors(), ids=lambda c: c[0])
def test_decode_run_errors(case):
    name, over, match = case
    w = mpfa.BatchDecodeWrapper(_workspace(), backend="reference")
    _decode_plan(w)
    cache = over.get("cache", _cache("qk4pv8", pages=8))
    kv = _cache("qk4pv8", pages=8) if cache == "whole" else cache.layer(0)
    q = torch.zeros(2, HEADS, 64, dtype=torch.bfloat16)
    out = None
    decode_q = {"q rows": (dict(q=q[:1]), r"q must have shape \[2, 8, 64\], got \[1, 8, 64\]"),
                "q heads": (dict(q=torch.zeros(2, 4, 64, dtype=torch.bfloat16)), r"q must have shape \[2, 8, 64\]"),
                "q dtype": (dict(q=q.float()), match),
                "out shape": (dict(out=q[:1]), r"out must have shape \[2, 8, 64\]"),
                "out dtype": (dict(out=q.float()), match)}
    if name in decode_q:
        args, match = decode_q[name]
        q, out = args.get("q", q), args.get("out")
    with pytest.raises(ValueError, match=match):
        w.run(q, kv, out=out)


def test_workspace_capacity_and_device_are_checked():
    from mpfa.validation import check_workspace
    ws = torch.empty(1000, dtype=torch.uint8)
    check_workspace(ws, torch.device("cpu"), 1000, "a plan")
    with pytest.raises(ValueError, match=r"workspace_buffer holds 1000 bytes but this plan \(batch 2\) needs 1001 bytes"):
        check_workspace(ws, torch.device("cpu"), 1001, "batch 2")
    with pytest.raises(ValueError, match=r"workspace_buffer must be on meta, got cpu"):
        check_workspace(ws, torch.device("meta"), 10, "a plan")


def test_kernel_outputs_allocate_or_check_the_output():
    from mpfa.dispatch import data_ptr, kernel_outputs
    q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    plain, rotated = (mpfa.PagedKVCache(r, num_layers=1, num_pages=1, page_size=16, num_kv_heads=4, head_dim=64,
                                        device="cpu").layer(0) for r in ("qk4pv8", "qk4pv4"))
    out, lse = kernel_outputs(q, None, True, plain)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous() and lse.shape == (3, 4)
    given = torch.empty_like(q)
    assert kernel_outputs(q, given, False, plain) == (given, None)
    scratch, _ = kernel_outputs(q, given, False, rotated)   # V stored rotated: the kernel writes O_rot elsewhere
    assert scratch.shape == q.shape and scratch.data_ptr() != given.data_ptr()
    for kv in (plain, rotated):   # the caller's out is checked either way
        with pytest.raises(ValueError, match="out must be contiguous in its last dimension"):
            kernel_outputs(q, torch.empty(3, 64, 4, dtype=torch.bfloat16).transpose(1, 2), False, kv)
    assert data_ptr(None) is None and data_ptr(q) == q.data_ptr()
