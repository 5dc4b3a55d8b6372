"""The append kernel on the GPU against the PyTorch reference, byte for byte, for every built recipe,
head_dim and page size; poisoned caches show that every row was written and nothing else was, also when
slots point past the layer; NaN / inf rows give the defined bytes."""
import itertools
import zlib

import pytest
import torch

import mpfa
from mpfa.reference.append import quantize_rows
from mpfa_jit.ops import append_kv as append_op

pytestmark = [pytest.mark.gpu]

RECIPES = tuple(append_op.RECIPES)
POISON_BYTE = 0xA5


def _seed(*key) -> int:
    """A seed per test case that is the same in every process (str hashes are randomised per process)."""
    return zlib.crc32(repr(key).encode())


def _poison(cache):
    for t in cache.fields.values():
        if t.dtype == torch.float32:
            t.fill_(float("nan"))
        else:
            t.view(torch.uint8).fill_(POISON_BYTE)


def _same_bytes(a, b):
    if a.dtype == torch.float16:   # qk4pv4's v_param: bit for bit, a NaN of any payload (the contract leaves it open)
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        return torch.equal(nan_a, nan_b) and torch.equal(a.view(torch.int16)[~nan_a], b.view(torch.int16)[~nan_b])
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("recipe,head_dim,page_size", list(itertools.product(RECIPES, append_op.HEAD_DIMS, append_op.PAGE_SIZES)))
def test_append_matches_reference(recipe, head_dim, page_size, shared_jit_cache, bf16_rows):
    _rows = bf16_rows
    gen = torch.Generator(device="cuda").manual_seed(_seed(recipe, head_dim, page_size))
    heads, pages, layers = 3, 37, 2
    cache = mpfa.PagedKVCache(recipe, num_layers=layers, num_pages=pages, page_size=page_size, num_kv_heads=heads,
                              head_dim=head_dim, device="cuda")
    cache.calibrate(1, _rows(64, heads, head_dim, gen), _rows(64, heads, head_dim, gen))
    _poison(cache)
    n = min(pages * page_size - 5, 300)
    # Scattered slots that cross page boundaries; one padding slot (-1) that must write nothing.
    slots = torch.randperm(pages * page_size, generator=gen, device="cuda")[:n]
    slots[n // 2] = -1
    # K and V as strided views of one fused projection [tokens, 2 * heads, D], like a QKV output.
    kv_proj = _rows(n, 2 * heads + 1, head_dim, gen)
    k, v = kv_proj[:, 1:heads + 1], kv_proj[:, heads + 1:]
    layer = cache.layer(1)
    assert mpfa.append_kv(k, v, layer, slots) == "cuda"
    torch.cuda.synchronize()

    keep = slots >= 0
    # The reference runs on the CPU, whose float ops are IEEE-exact like the kernel's.
    cpu = lambda t: None if t is None else t.cpu()
    want = quantize_rows(cache.recipe, k[keep].cpu(), v[keep].cpu(), cpu(layer.mu_k), cpu(layer.v_scale))
    page, off = slots[keep] // page_size, slots[keep] % page_size
    for name, t in layer.fields.items():
        got = t[page, :, off]
        assert _same_bytes(got.cpu(), want[name].to(got.dtype)), f"{name} differs from the reference"
        # Every other slot of this layer, and all of layer 0, still holds the poison.
        written = torch.zeros(pages * page_size, dtype=torch.bool, device="cuda")
        written[slots[keep]] = True
        untouched = t.reshape(pages, heads, page_size, -1).transpose(1, 2).reshape(pages * page_size, heads, -1)[~written]
        other = cache.fields[name][0]
        for rest in (untouched, other):
            if rest.dtype == torch.float32:
                assert torch.isnan(rest).all(), f"{name}: a slot that was not appended was written"
            else:
                assert (rest.view(torch.uint8) == POISON_BYTE).all(), f"{name}: a slot that was not appended was written"


@pytest.mark.parametrize("recipe", RECIPES)
def test_append_int32_slots_and_graph_replay(recipe, shared_jit_cache, bf16_rows):
    _rows = bf16_rows
    gen = torch.Generator(device="cuda").manual_seed(7)
    cache = mpfa.PagedKVCache(recipe, num_layers=1, num_pages=64, page_size=16, num_kv_heads=8, head_dim=128)
    ref = mpfa.PagedKVCache(recipe, num_layers=1, num_pages=64, page_size=16, num_kv_heads=8, head_dim=128)
    k = torch.empty(32, 8, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.empty_like(k)
    slots = torch.empty(32, dtype=torch.int64, device="cuda")
    for c in (cache, ref):   # loads the kernel before capture; both caches start equal
        mpfa.append_kv(k.normal_(generator=gen) if c is cache else k, v.normal_(generator=gen) if c is cache else v,
                       c.layer(0), slots.copy_(torch.arange(32)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mpfa.append_kv(k, v, cache.layer(0), slots)
    for step in range(5):   # new rows and new slots each replay, like decode steps
        k.copy_(_rows(32, 8, 128, gen))
        v.copy_(_rows(32, 8, 128, gen))
        slots.copy_(torch.randperm(1024, generator=gen, device="cuda")[:32])
        graph.replay()
        mpfa.append_kv(k, v, ref.layer(0), slots.to(torch.int32))
        torch.cuda.synchronize()
        for name in cache.fields:
            assert _same_bytes(cache.fields[name], ref.fields[name]), f"step {step}: {name} differs from eager"


# --- the format's rounding: how far a stored element may sit from its input -------------------------------
# Derived from each format's definition (python/mpfa/recipes), not from a measured error. x = K - mu_K
# (float32), the smoothed row the cache stores; float32 steps (1 / s, x * (1 / s), q * s) add at most a few
# 2^-24 relative each, covered by SLACK.
# - bf16: stored as given: error 0.
# - INT8 K (qk8pv8; qk4pv8's low-frequency half): s = amax|x| / T per (token, head), T = 127 (i4rs: 126), and
#   q = rni(x / s) with |x / s| <= T, so nothing clips: |x - q s| <= s / 2.
# - i4rs nibble channels: y = x / s, q = clamp(rni(y / b), +-7) with the block's integer scale b:
#   unclipped |y - b q| <= b / 2, clipped (|y| > 7 b) |y| - 7 b; so |x - b q s| <= max(b / 2, |y| - 7 b) s. b is
#   the format's choice within I4RS_WINDOW of b_up = clamp(ceil(max|y| / 7), 1, 18).
# - E4M3 V under its channel scale c: z = v / c. E4M3 has 3 mantissa bits: in the binade [2^e, 2^(e+1)), e >= -6,
#   the spacing is 2^(e-3) and round-to-nearest errs by at most half of it, 2^(e-4) (<= 2^-4 |z|); below 2^-6
#   (subnormals) the spacing is 2^-9, the error <= 2^-10. The calibration on these very rows keeps
#   |z| <= 448 / headroom: nothing saturates. So |v - e4m3(z) c| <= 2^(max(floor(log2|z|), -6) - 4) c.
# - 4-bit Hadamard V (qk4pv4), in the rotated space r = V H where it is quantized: per 32 channels the step is
#   s = fp16((max - min) / 15) and rni leaves |r - (q s + zero)| <= s / 2, or, where the fp16 zero point rounded
#   above the group's minimum and code 0 clamps, half an fp16 ulp of it (2^-11 |zero|); the decode path's fp16
#   rounding adds 2^-11 of the value.
SLACK = 2.0 ** -20


def _int8_bound(x, target):
    s = x.abs().amax(dim=-1, keepdim=True) / target
    return s, s / 2 + SLACK * (x.abs() + s)


def _k_error_bound(recipe, x, block_scales):
    """Per element of x [..., D]: the largest |x - stored| the recipe's K format allows (see above)."""
    from mpfa.recipes.int8 import BLOCK_SCALE_MAX, I4RS_BLOCK, I4RS_TARGET, I4RS_WINDOW, INT4_MAX, INT8_MAX
    from mpfa.recipes.int8 import rope_low_channels
    if recipe == "qk8pv8":
        return _int8_bound(x, INT8_MAX)[1]
    s, bound = _int8_bound(x, I4RS_TARGET)          # qk4pv8 (i4rs): the low half as it stands
    high = ~rope_low_channels(x.shape[-1]).to(x.device)
    y = (x[..., high] / s).reshape(*x.shape[:-1], -1, I4RS_BLOCK)
    b = block_scales.float().unsqueeze(-1)
    b_up = torch.ceil(y.abs().amax(dim=-1, keepdim=True) / INT4_MAX).clamp(1, BLOCK_SCALE_MAX)
    lo, hi = I4RS_WINDOW
    assert ((b >= (b_up - lo).clamp_min(1)) & (b <= (b_up + hi).clamp_max(BLOCK_SCALE_MAX))).all(), \
        "a block scale outside the format's window around ceil(block max / 7)"
    nib = torch.maximum(b / 2, y.abs() - INT4_MAX * b) * s.unsqueeze(-1)
    bound[..., high] = nib.reshape(*x.shape[:-1], -1) + SLACK * (x[..., high].abs() + s)
    return bound


def _v_error_bound(v, scale):
    """Per element of v: half the E4M3 spacing at v / scale, in v's units (see above)."""
    z = v / scale
    assert (z.abs() <= 448).all(), "V past the calibrated range: the bound assumes no saturation"
    e = torch.frexp(z.abs().clamp_min(2.0 ** -6)).exponent - 1      # floor(log2 |z|), exactly
    return torch.ldexp(scale.expand_as(z), e - 4) + SLACK * v.abs()


def _u4h_ratio(layer, as_rows, v):
    """qk4pv4: the largest |decode - r| / bound over the stored rows, r = V H in float32 (see above)."""
    from mpfa.recipes import u4h
    codes, v_param = (as_rows(layer.fields[name].cpu()) for name in ("v", "v_param"))
    r = u4h.rotate(v).double()
    dec = u4h.decode_values(codes, v_param).double()
    scale, zero = (t.double().repeat_interleave(u4h.GROUP, dim=-1) for t in u4h.split_param(v_param))
    bound = scale / 2 + 2.0 ** -11 * (zero.abs() + r.abs() + scale) + SLACK * (r.abs() + scale)
    return ((dec - r).abs() / bound).max().item()


def check_roundtrip_within_format(recipe, layer, k, v):
    """Every stored element of tokens 0..n-1 (slot = token) dequantizes to its input within its format's
    rounding (bounds above). Returns the largest error / bound ratio of K and of V."""
    n, heads, d = k.shape
    # on the CPU (IEEE float32 like the kernel's, and the same in every run)
    kd, vd = (t.cpu() for t in layer.dequantize())              # K - mu_K as stored, V
    as_rows = lambda t: t.transpose(1, 2).reshape(-1, heads, t.shape[-1])[:n]   # [pages, H, P, X] -> [token, H, X]
    kd, vd, x, v = as_rows(kd), as_rows(vd), k.float().cpu(), v.float().cpu()
    if recipe == "bf16":
        assert torch.equal(kd, x) and torch.equal(vd, v), "bf16 stores K and V as given"
        return 0.0, 0.0
    x = x - layer.mu_k.float().cpu()
    bs = layer.fields.get("k_block_scale")
    bs = None if bs is None else as_rows(bs[..., : d // 32].cpu())
    k_ratio = ((kd - x).abs() / _k_error_bound(recipe, x, bs)).max().item()
    assert k_ratio <= 1, f"{recipe}: a K element is {k_ratio:.3f}x its format's rounding bound from its input"
    if layer.recipe.v_format == "u4h":
        v_ratio = _u4h_ratio(layer, as_rows, v)
        assert v_ratio <= 1, f"{recipe}: a rotated V element is {v_ratio:.3f}x the 4-bit half step from its input"
        return k_ratio, v_ratio
    v_ratio = ((vd - v).abs() / _v_error_bound(v, layer.v_scale.float().cpu())).max().item()
    assert v_ratio <= 1, f"{recipe}: a V element is {v_ratio:.3f}x E4M3's half spacing from its input"
    return k_ratio, v_ratio


@pytest.mark.parametrize("recipe", RECIPES)
def test_append_stores_each_element_within_its_formats_rounding(recipe, shared_jit_cache, bf16_rows):
    """The stored cache gives back each input element to within its format's rounding (a poisoned cache, so
    a row the kernel skipped cannot pass as zeros)."""
    gen = torch.Generator(device="cuda").manual_seed(_seed(recipe, "roundtrip"))
    cache = mpfa.PagedKVCache(recipe, num_layers=1, num_pages=16, page_size=16, num_kv_heads=4, head_dim=128)
    k, v = bf16_rows(256, 4, 128, gen), bf16_rows(256, 4, 128, gen)
    cache.calibrate(0, k, v)
    _poison_all(cache)
    assert mpfa.append_kv(k, v, cache.layer(0), torch.arange(256, device="cuda")) == "cuda"
    torch.cuda.synchronize()
    check_roundtrip_within_format(recipe, cache.layer(0), k, v)


def _poison_all(cache):
    """Every byte of every field of every layer: 0xA5 (float32 fields: a NaN pattern too)."""
    for t in cache.fields.values():
        t.view(torch.uint8).fill_(POISON_BYTE)


@pytest.mark.parametrize("recipe,head_dim,page_size", [(r, d, p) for r in RECIPES for d, p in ((128, 16), (64, 1), (64, 64))])
def test_append_out_of_range_slots_write_nothing_and_are_counted(recipe, head_dim, page_size, shared_jit_cache,
                                                                 bf16_rows):
    """Slots just past the layer, a page further, far past and at the int32 limit, on the middle and the last
    layer: every other layer and every page not addressed keeps its bytes, the in-range rows are the
    reference's bytes, and the cache counts each bad token once (not once per head)."""
    gen = torch.Generator(device="cuda").manual_seed(_seed(recipe, head_dim, page_size, "oob"))
    heads, pages, layers = 3, 9, 3
    cache = mpfa.PagedKVCache(recipe, num_layers=layers, num_pages=pages, page_size=page_size, num_kv_heads=heads,
                              head_dim=head_dim, device="cuda")
    for i in range(layers):
        cache.calibrate(i, bf16_rows(64, heads, head_dim, gen), bf16_rows(64, heads, head_dim, gen))
    n_slots = cache.num_slots
    bad = [n_slots, n_slots + page_size + 1, n_slots + 3 * n_slots, 1 << 40, 2**31 - 1]
    for target in (1, layers - 1):
        _poison_all(cache)
        before = {name: t.clone() for name, t in cache.fields.items()}
        good = torch.randperm(n_slots, generator=gen, device="cuda")[:2 * page_size + 5]
        slots = torch.cat([good, torch.tensor(bad + [-1], device="cuda")])
        slots = slots[torch.randperm(slots.numel(), generator=gen, device="cuda")]
        k, v = bf16_rows(slots.numel(), heads, head_dim, gen), bf16_rows(slots.numel(), heads, head_dim, gen)
        layer = cache.layer(target)
        assert mpfa.append_kv(k, v, layer, slots) == "cuda"
        torch.cuda.synchronize()
        assert int(cache.out_of_range_slots.item()) == len(bad), "one count per out-of-range token"
        with pytest.raises(ValueError, match=rf"{len(bad)} slot\(s\) outside \[0, {n_slots}\)"):
            cache.check_append_slots()
        assert int(cache.out_of_range_slots.item()) == 0

        keep = (slots >= 0) & (slots < n_slots)
        want = quantize_rows(cache.recipe, k[keep].cpu(), v[keep].cpu(), layer.mu_k.cpu() if layer.mu_k is not None
                             else None, layer.v_scale.cpu() if layer.v_scale is not None else None)
        page, off = slots[keep] // page_size, slots[keep] % page_size
        written = torch.zeros(n_slots, dtype=torch.bool, device="cuda")
        written[slots[keep]] = True
        def slot_bytes(x):   # one layer's field as [slot, head, bytes]
            x = x.reshape(pages, heads, page_size, -1).transpose(1, 2).reshape(n_slots, heads, -1)
            return x.view(torch.uint8)

        for name, t in cache.fields.items():
            got = t[target][page, :, off]
            assert _same_bytes(got.cpu(), want[name].to(got.dtype)), f"{name}: an in-range row differs from the reference"
            assert torch.equal(slot_bytes(t[target])[~written], slot_bytes(before[name][target])[~written]), \
                f"{name}: a slot the append did not address changed"
            for other in range(layers):
                if other != target:
                    assert torch.equal(t[other].view(torch.uint8), before[name][other].view(torch.uint8)), \
                        f"{name}: layer {other} changed by an append to layer {target}"


@pytest.mark.parametrize("recipe", RECIPES)
def test_append_counts_out_of_range_slots_in_graph_replays(recipe, shared_jit_cache, bf16_rows):
    """In a CUDA graph the slots change between replays: each replay's bad slots add to the count."""
    gen = torch.Generator(device="cuda").manual_seed(13)
    cache = mpfa.PagedKVCache(recipe, num_layers=2, num_pages=8, page_size=16, num_kv_heads=4, head_dim=128)
    k, v = bf16_rows(16, 4, 128, gen), bf16_rows(16, 4, 128, gen)
    slots = torch.arange(16, device="cuda")
    mpfa.append_kv(k, v, cache.layer(1), slots)   # loads the kernel before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mpfa.append_kv(k, v, cache.layer(1), slots)
    snapshot = cache.fields["v"][0].clone()
    for bad in (0, 3, 16):
        slots.copy_(torch.arange(16, device="cuda"))
        slots[:bad] = cache.num_slots + torch.arange(bad, device="cuda") * 1000
        graph.replay()
    torch.cuda.synchronize()
    assert int(cache.out_of_range_slots.item()) == 19
    assert torch.equal(cache.fields["v"][0], snapshot), "layer 0 changed by appends to layer 1"
    with pytest.raises(ValueError, match=r"19 slot\(s\)"):
        cache.check_append_slots()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("head_dim", append_op.HEAD_DIMS)
def test_append_nonfinite_rows_give_the_defined_bytes(recipe, head_dim, shared_jit_cache, bf16_rows):
    """NaN / +-inf in K: the row's k_scale is NaN (its integer K bytes and block scales are unspecified:
    the scale carries the fault); NaN / +-inf in V: E4M3 NaN, never 448; every other byte (finite rows, finite V,
    finite V past the scale, subnormal and -0 V) is the reference's; bf16 keeps the values as given."""
    gen = torch.Generator(device="cuda").manual_seed(_seed(recipe, head_dim, "nan"))
    heads, n = 2, 40
    cache = mpfa.PagedKVCache(recipe, num_layers=1, num_pages=8, page_size=16, num_kv_heads=heads, head_dim=head_dim)
    cache.calibrate(0, bf16_rows(64, heads, head_dim, gen), bf16_rows(64, heads, head_dim, gen))
    layer = cache.layer(0)
    if layer.v_scale is not None:
        layer.v_scale[1] = 2e-38   # head 1: a scale under which bf16 subnormals are E4M3 numbers
    k, v = bf16_rows(n, heads, head_dim, gen), bf16_rows(n, heads, head_dim, gen)
    nan, inf = float("nan"), float("inf")
    low = head_dim // 4 + 1   # qk4pv8: an INT8-half channel; channel 0 is in the 4-bit half
    k[1, 0, 0], k[2, 1, low], k[3, 0, head_dim - 1], k[4, 1, 5] = nan, inf, -inf, nan
    k[5, 0, :] = inf
    v[6, 0, 1], v[6, 0, 8], v[7, 1, 9], v[8, 0, :] = nan, inf, -inf, -inf
    v[9, 0, 2] = 3e38                                            # finite, past any scale: saturates
    v[10, 1, :8] = torch.tensor([9e-41, -9e-41, 1e-39, -0.0, 0.0, 5e-40, -2e-39, 1e-38])   # subnormal and zero V
    slots = torch.randperm(cache.num_slots, generator=gen, device="cuda")[:n]
    mpfa.append_kv(k, v, layer, slots)
    torch.cuda.synchronize()

    want = quantize_rows(cache.recipe, k.cpu(), v.cpu(), layer.mu_k.cpu() if layer.mu_k is not None else None,
                         layer.v_scale.cpu() if layer.v_scale is not None else None)
    got = {name: t[slots // 16, :, slots % 16].cpu() for name, t in layer.fields.items()}
    if recipe == "bf16":
        for name in ("k", "v"):
            assert _same_bytes(got[name], want[name]), f"{name}: bf16 stores the values as given"
        return
    bad_k = ~torch.isfinite(k.float().cpu() - layer.mu_k.cpu()).all(dim=-1)   # [n, heads]
    assert int(bad_k.sum()) == 5
    assert torch.isnan(got["k_scale"][bad_k]).all(), "a non-finite K row's k_scale is NaN"
    assert _same_bytes(got["k_scale"][~bad_k], want["k_scale"][~bad_k])
    for name in ("k", "k8", "k_block_scale"):
        if name in got:
            assert _same_bytes(got[name][~bad_k], want[name][~bad_k]), f"{name}: a finite row differs"
    if layer.recipe.v_format == "u4h":
        # the rotation mixes every channel: a non-finite row, or one whose rotated values pass fp16's range (3e38),
        # stores NaN parameters and codes 0 in every group; every other row is the reference's, bytes and params
        bad_rows = ~torch.isfinite(v.cpu()).all(dim=-1)
        bad_rows[9, 0] = True
        assert torch.isnan(got["v_param"][bad_rows]).all() and (got["v"][bad_rows] == 0).all()
        assert _same_bytes(got["v"][~bad_rows], want["v"][~bad_rows])
        assert _same_bytes(got["v_param"][~bad_rows], want["v_param"][~bad_rows])
        return
    bad_v = ~torch.isfinite(v.cpu())
    assert ((got["v"][bad_v] & 0x7F) == 0x7F).all(), "NaN and +-inf V are stored as E4M3 NaN"
    assert _same_bytes(got["v"][~bad_v], want["v"][~bad_v]), "finite V (saturating, subnormal, -0 included)"
    assert got["v"][9, 0, 2] == 0x7E
