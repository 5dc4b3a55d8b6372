"""The KV pool's rule for which extend batch fixes a layer's scales (mpfa.sglang.calibration)."""
import torch

from mpfa.sglang.calibration import PADDING_SLOT, fixes_scales


def test_a_batch_that_writes_only_the_padding_slot_does_not_fix_the_scales():
    # SGLang's prefill CUDA-graph capture: 8,192 dummy tokens from zero-filled buffers, all at slot 0
    assert not fixes_scales(torch.full((8192,), PADDING_SLOT, dtype=torch.int64), capturing=False)
    assert not fixes_scales(torch.zeros(0, dtype=torch.int32), capturing=False)


def test_a_request_batch_fixes_them_even_with_padded_tokens():
    assert fixes_scales(torch.tensor([17, 18, 19], dtype=torch.int32), capturing=False)
    # a graph-replayed batch: real slots, then padding that writes slot 0
    assert fixes_scales(torch.tensor([4097, 4098, 0, 0], dtype=torch.int64), capturing=False)


def test_nothing_is_fixed_under_stream_capture():
    assert not fixes_scales(torch.tensor([17, 18]), capturing=True)
