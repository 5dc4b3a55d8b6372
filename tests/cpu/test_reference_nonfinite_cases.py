"""tests/gpu/test_nonfinite_gpu.py's prefill and decode cases on the CPU with the reference backend, which follows
docs/api.md's "Non-finite inputs" rules as the kernels do: the expected patterns (what must be NaN, what must stay
bit-identical to a clean run: other requests, other KV heads, the rows a causally hidden key cannot reach;
qk4pv8's NaN over the poisoned key's 128-key tile) hold for the oracle, so a GPU failure is the kernel's."""
import importlib
import itertools
import math

import pytest

batches = importlib.import_module("tests.gpu.conftest")
cases = importlib.import_module("tests.gpu.test_nonfinite_gpu")


@pytest.mark.parametrize("recipe,where,bad", list(itertools.product(cases.RECIPES, ("q", "k", "v"), cases.BAD)))
def test_prefill_case_on_the_reference(recipe, where, bad):
    cases.prefill_case(recipe, 64, where, bad, batches.make_paged_batch, batches.make_bf16_rows, device="cpu")


@pytest.mark.parametrize("recipe,where,bad", list(itertools.product(cases.RECIPES, ("q", "k", "v"), cases.BAD)))
def test_decode_case_on_the_reference(recipe, where, bad):
    cases.decode_case(recipe, 64, where, bad, 1, batches.make_paged_batch, batches.make_bf16_rows, device="cpu")


def test_the_pattern_rejects_nan_leaking_past_the_mask_or_across_heads():
    """_assert_pattern on hand-made outputs: a NaN in a row the poisoned key is hidden from, in another KV head's
    query head or a changed value in another request fails; a NaN where the V caveat allows one passes."""
    import torch
    clean = torch.randn(6, 4, 8)
    expect = cases.Expect(clean)
    expect.nan[4:, :2] = True                   # rows 4, 5 see the key (KV head 0: query heads 0, 1)
    expect.nan_or_equal[:4, :2, 3] = True       # channel 3 of the rows it is hidden from: NaN allowed (V caveat)
    good = clean.clone()
    good[4:, :2] = math.nan
    good[1, 0, 3] = math.nan
    cases._assert_pattern(good, clean, expect, "good")
    for where in ((2, 0, 0), (5, 2, 0), (0, 3, 7)):   # hidden row, other KV head, (another request's) other row
        bad = good.clone()
        bad[where] = math.nan
        with pytest.raises(AssertionError, match="equal to the clean run"):
            cases._assert_pattern(bad, clean, expect, "leak")
    bad = good.clone()
    bad[0, 3, 7] += 1.0
    with pytest.raises(AssertionError, match="equal to the clean run"):
        cases._assert_pattern(bad, clean, expect, "changed")
