"""Page size 1's cache layout: one record per (token, KV head) for the quantized recipes (mpfa_jit.formats
Recipe.record), each field a strided view into it, which every kernel addresses by the record's stride
(mpfa::CacheLayout's RecordBytes). The kernels' reads and writes of it run on the GPU (tests/gpu); here: the
definition's invariants, the views, and the reference writer's bytes against a page-16 cache."""
import pytest
import torch

import mpfa
from mpfa.recipes import RECIPES
from mpfa_jit.formats import RECORD_ALIGN
from mpfa_jit.ops.layout import layout_context, record_bytes
from mpfa_jit.ops.support import HEAD_DIMS, PAGE_SIZES

QUANTIZED = [r for r in RECIPES if RECIPES[r].quantized_k]


@pytest.mark.parametrize("recipe", QUANTIZED)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_a_record_holds_every_field_aligned_and_apart(recipe, head_dim):
    r = RECIPES[recipe]
    rec = r.record(head_dim, 1)
    spans = sorted((rec.offsets[f.name], rec.offsets[f.name] + f.numel(head_dim) * f.itemsize(), f) for f in r.fields)
    assert set(rec.offsets) == {f.name for f in r.fields}
    for (a, b, f), (c, _, _) in zip(spans, spans[1:] + [(rec.nbytes, None, None)]):
        assert b <= c, f"{f.name} overlaps the next field"
        assert a % f.itemsize() == 0, f"{f.name} at {a} is not aligned to its {f.itemsize()}-byte elements"
        if (b - a) % RECORD_ALIGN == 0:
            assert a % RECORD_ALIGN == 0, f"{f.name}'s 16-byte pieces would start off a 16-byte boundary"
        else:   # a small field is copied whole: its own size must align it (cp.async of 4 or 8 bytes)
            assert a % (b - a) == 0, (f.name, a, b - a)
    assert rec.nbytes % RECORD_ALIGN == 0 and 0 <= rec.nbytes - r.bytes_per_token_head(head_dim) < RECORD_ALIGN
    assert r.slot_bytes(head_dim, 1) == rec.nbytes == record_bytes(recipe, head_dim, 1)
    assert layout_context(recipe, head_dim, 1)["layout_args"][-1] == rec.nbytes


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_only_page_size_1_of_the_quantized_recipes_is_a_record(recipe, page_size):
    r = RECIPES[recipe]
    has = r.record(128, page_size) is not None
    assert has == (page_size == 1 and r.quantized_k)
    if not has:
        assert r.slot_bytes(128, page_size) == r.bytes_per_token_head(128)
        assert layout_context(recipe, 128, page_size)["layout_args"][-1] == 0


@pytest.mark.parametrize("recipe", QUANTIZED)
def test_the_fields_are_views_of_one_record_per_token_and_head(recipe):
    d, h, pages, layers = 128, 3, 5, 2
    cache = mpfa.PagedKVCache(recipe, num_layers=layers, num_pages=pages, page_size=1, num_kv_heads=h, head_dim=d,
                              device="cpu")
    rec = cache.record
    base = cache.fields["k"].data_ptr() - rec.offsets["k"]
    for name, t in cache.fields.items():
        assert t.untyped_storage().data_ptr() == cache.fields["k"].untyped_storage().data_ptr()
        assert t.data_ptr() - base == rec.offsets[name]
        assert t.stride()[:3] == tuple(s // t.element_size() for s in (pages * h * rec.nbytes, h * rec.nbytes,
                                                                      rec.nbytes))
        assert t.shape[:4] == (layers, pages, h, 1) and t.stride(-1) == 1
        t.view(torch.uint8)   # tests and tools poison fields bytewise: every field views as bytes
    assert cache.nbytes == layers * pages * h * rec.nbytes
    assert cache.slot_bytes == rec.nbytes and cache.bytes_per_token_head == RECIPES[recipe].bytes_per_token_head(d)


@pytest.mark.parametrize("recipe", QUANTIZED)
def test_the_reference_writes_the_same_values_into_records_as_into_pages(recipe):
    """The append reference into a page-1 cache (records) and into a page-16 cache: every field of every written
    slot equal, and the records' padding untouched (zero)."""
    d, h, n = 64, 2, 40
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(n, h, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    k[5, 1, 7] = 40.0   # an outlier channel
    caches = {p: mpfa.PagedKVCache(recipe, num_layers=1, num_pages=64 // p, page_size=p, num_kv_heads=h, head_dim=d,
                                   device="cpu") for p in (1, 16)}
    slots = torch.randperm(64, generator=gen)[:n]
    for cache in caches.values():
        cache.calibrate(0, k, v)
        mpfa.append_kv(k, v, cache.layer(0), slots, backend="reference")
    for name in caches[1].fields:
        one = caches[1].fields[name][0, :, :, 0]                                   # [slot, head, ...]
        sixteen = caches[16].fields[name][0].transpose(1, 2).reshape(64, h, *one.shape[2:])
        assert torch.equal(one[slots], sixteen[slots]), name
    rec = caches[1].record
    used = torch.zeros(rec.nbytes, dtype=torch.bool)
    for f in RECIPES[recipe].fields:
        used[rec.offsets[f.name]:rec.offsets[f.name] + f.numel(d) * f.itemsize()] = True
    assert not caches[1].records[..., ~used].any(), "the reference wrote into a record's padding"
