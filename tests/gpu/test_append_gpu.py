"""The append kernel on the GPU against the PyTorch reference, byte for byte, for every built recipe,
head_dim and page size; poisoned caches show that every row was written and nothing else was."""
import itertools

import pytest
import torch

import mpfa
from mpfa.reference.append import quantize_rows

pytestmark = [pytest.mark.gpu]

RECIPES = ("bf16", "qk8pv8", "qk4pv8")
POISON_BYTE = 0xA5


def _poison(cache):
    for t in cache.fields.values():
        if t.dtype == torch.float32:
            t.fill_(float("nan"))
        else:
            t.view(torch.uint8).fill_(POISON_BYTE)


def _rows(n, heads, d, gen, device="cuda"):
    """bf16 rows with outlier channels (large mean and large spread), as real K/V have."""
    x = torch.randn(n, heads, d, generator=gen, device=device)
    x[..., 3] = x[..., 3] * 20 + 40
    x[..., d // 2 + 1] *= 30
    return x.to(torch.bfloat16)


def _same_bytes(a, b):
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("recipe,head_dim,page_size", list(itertools.product(RECIPES, (64, 128, 256), (1, 16, 32, 64))))
def test_append_matches_reference(recipe, head_dim, page_size, shared_jit_cache):
    gen = torch.Generator(device="cuda").manual_seed(hash((recipe, head_dim, page_size)) % 2**31)
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
def test_append_int32_slots_and_graph_replay(recipe, shared_jit_cache):
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


def test_append_reference_roundtrip_error_small(shared_jit_cache):
    """The stored cache reproduces its input within each format's precision (calibrated layer)."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    for recipe, tol_k, tol_v in (("bf16", 0, 0), ("qk8pv8", 0.04, 0.04), ("qk4pv8", 0.15, 0.04)):
        cache = mpfa.PagedKVCache(recipe, num_layers=1, num_pages=16, page_size=16, num_kv_heads=4, head_dim=128)
        k, v = _rows(256, 4, 128, gen), _rows(256, 4, 128, gen)
        cache.calibrate(0, k, v)
        mpfa.append_kv(k, v, cache.layer(0), torch.arange(256, device="cuda"))
        kd, vd = cache.layer(0).dequantize(add_mean=True)
        kd = kd.transpose(1, 2).reshape(256, 4, 128)
        vd = vd.transpose(1, 2).reshape(256, 4, 128)
        ek = ((kd - k.float()).norm() / k.float().norm()).item()
        ev = ((vd - v.float()).norm() / v.float().norm()).item()
        assert ek <= tol_k and ev <= tol_v, (recipe, ek, ev)
