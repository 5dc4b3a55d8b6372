"""The FP8 MMA accumulation variants the GPU study scores (benchmarks.accuracy.fp8_accumulation.accumulate): the
``aligned`` one at k-step 32, 13 bits is the prefill model's rule (tensor_core_pv at its defaults, as the GPU test
runs it), and each variant behaves as its name says."""
import pytest
import torch

from benchmarks.accuracy.fp8_accumulation import ACC_MODES, accumulate
from mpfa.reference.prefill_kernel import MMA_BITS, MMA_K, tensor_core_pv


def _operands(k, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.exp2(torch.rand(16, k, generator=gen) * 14 - 6).to(torch.float8_e4m3fn).float().double()
    b = (torch.exp2(torch.rand(k, 16, generator=gen) * 10 - 4)
         * torch.where(torch.rand(k, 16, generator=gen) < 0.5, -1.0, 1.0)).to(torch.float8_e4m3fn).float().double()
    return a, b


@pytest.mark.parametrize("k", [32, 64, 128])
def test_aligned_k32_b13_is_the_prefill_models_rule(k):
    a, b = _operands(k, k)
    want = tensor_core_pv(a.unsqueeze(0), b.unsqueeze(1), k)[0, 0]
    got = accumulate(a, b, step=MMA_K, bits=MMA_BITS, acc_mode="aligned")
    assert torch.equal(got, want)
    assert not torch.equal(got, a @ b), "wide-range products must lose bits under the rule"
    # the k-step and the bits reach the rule: another of either gives other sums on these operands
    assert not torch.equal(accumulate(a, b, step=16, bits=MMA_BITS, acc_mode="aligned"), want)
    assert not torch.equal(accumulate(a, b, step=MMA_K, bits=MMA_BITS + 1, acc_mode="aligned"), want)


@pytest.mark.parametrize("acc_mode", ACC_MODES)
def test_many_bits_give_the_exact_sum_up_to_fp32(acc_mode):
    a, b = _operands(64, 5)
    got = accumulate(a, b, step=32, bits=40, acc_mode=acc_mode)
    exact = a @ b
    if acc_mode == "aligned":
        assert torch.equal(got, exact)
    else:   # one fp32 rounding per k-step
        assert ((got - exact).abs() <= 2 * 2.0 ** -23 * (a.abs() @ b.abs())).all()


def test_fewer_bits_lose_more_and_truncation_is_toward_zero():
    a, b = _operands(128, 9)
    b = b.abs()                                                               # positive sums: every loss is downward
    exact = a @ b
    errs = []
    for bits in (11, 13, 16):
        got = accumulate(a, b, step=32, bits=bits, acc_mode="fp32_rz")
        assert (got <= exact).all()
        errs.append(float((exact - got).sum()))
    assert errs[0] > errs[1] > errs[2] > 0
