"""The decode kernel's in-register INT8 / INT4 -> fp16 conversions (templates/include/mpfa/mma_frag.cuh:
s8x4_to_f16x2, i4rs_block_scale_f16x2, s4x8_to_f16x2_scaled) emulated bit for bit: every K value the
QK MMA sees must be exactly the integer of the reference (python/mpfa/recipes/int8.py), since the
kernel dequantizes K without its token scale and runs an fp16 MMA on it.

The fp16 arithmetic is emulated as the hardware does it: the operation's exact result (float64 holds
every product and sum here exactly) rounded once to fp16. The constants are the header's: a test reads
them from the functions' bodies, so a change on one side fails here until the emulation follows."""
import functools
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from mpfa.recipes import int8 as I8
from mpfa.recipes.int8 import rope_low_channels

INCLUDE = Path(__file__).resolve().parents[2] / "templates" / "include"
MMA_FRAG = INCLUDE / "mpfa" / "mma_frag.cuh"
DECODE_MMA = "mpfa/decode/mma.cuh"

# the header's constants, per function
S8_EXP, S8_FLIP, S8_BIAS, S8_SEL_LO, S8_SEL_HI = 0x64646464, 0x80808080, 0x64806480, 0x4140, 0x4342
BS_MASK, BS_EXP, BS_BIAS, BS_FACTOR = 0xFF, 0x6400, 0x64006400, 0xD4802C00
S4_MASK, S4_EXP_SIGN = 0x00F000F0, 0x64806480
AND_XOR_LUT = 0x6A
U4_MASK_LO, U4_MASK_HI, U4_EXP_LO, U4_EXP_HI = 0x000F000F, 0x00F000F0, 0x64006400, 0x54005400
CONSTANTS = {
    "lop3_and_xor": {AND_XOR_LUT},
    "s8x4_to_f16x2": {S8_EXP, S8_FLIP, S8_BIAS, S8_SEL_LO, S8_SEL_HI},
    "i4rs_block_scale_f16x2": {BS_MASK, BS_EXP, BS_BIAS, BS_FACTOR},
    "s4x8_to_f16x2_scaled": {S4_MASK, S4_EXP_SIGN},
    "u4x2_rows_to_f16x2": {U4_MASK_LO, U4_MASK_HI, U4_EXP_LO, U4_EXP_HI},
}


def _u32(x):
    return np.asarray(x, dtype=np.uint64) & 0xFFFFFFFF


def _halves(w):
    """f16x2 words -> (low half, high half) as float64."""
    w = _u32(w)
    lo = (w & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (w >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
    return lo, hi


def _pack(lo, hi):
    """float64 values that are exact fp16 results -> f16x2 words (asserting they round to themselves)."""
    lo16, hi16 = np.float16(lo), np.float16(hi)
    assert np.array_equal(lo16.astype(np.float64), lo) and np.array_equal(hi16.astype(np.float64), hi)
    return _u32(lo16.view(np.uint16).astype(np.uint64) | (hi16.view(np.uint16).astype(np.uint64) << 16))


def _round16(x):
    return np.float16(x).astype(np.float64)


def _hfma2(a, b, c):
    (al, ah), (bl, bh), (cl, ch) = _halves(a), _halves(b), _halves(c)
    return _pack(_round16(al * bl + cl), _round16(ah * bh + ch))


def _hmul2(a, b):
    (al, ah), (bl, bh) = _halves(a), _halves(b)
    return _pack(_round16(al * bl), _round16(ah * bh))


def _hsub2(a, b):
    (al, ah), (bl, bh) = _halves(a), _halves(b)
    return _pack(_round16(al - bl), _round16(ah - bh))


def _prmt(a, b, sel):
    """prmt.b32 default mode with selector nibbles < 8."""
    a, b = _u32(a), _u32(b)
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return _u32(sum(src[(sel >> (4 * i)) & 7] << np.uint64(8 * i) for i in range(4)))


def _lop3(a, b, c, lut):
    """lop3.b32: result bit = lut bit (a << 2 | b << 1 | c)."""
    a, b, c = _u32(a), _u32(b), _u32(c)
    out = np.zeros_like(a)
    for i in range(8):
        if (lut >> i) & 1:
            out |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
    return _u32(out)


def _broadcast_half(w, half):
    h = (_u32(w) >> (16 * half)) & 0xFFFF
    return h | (h << 16)


def s8x4_to_f16x2(w):
    u = _u32(w) ^ S8_FLIP
    return _hsub2(_prmt(u, S8_EXP, S8_SEL_LO), S8_BIAS), _hsub2(_prmt(u, S8_EXP, S8_SEL_HI), S8_BIAS)


def i4rs_block_scale_f16x2(b_byte):
    t = (_u32(b_byte) & BS_MASK) | BS_EXP
    b2 = _hsub2(_broadcast_half(t, 0), BS_BIAS)
    return _hmul2(b2, BS_FACTOR)


def s4x8_to_f16x2_scaled(w, scale):
    w = _u32(w)
    b, off = _broadcast_half(scale, 0), _broadcast_half(scale, 1)
    shifted = [w << 4, w, w >> 4, w >> 8]
    return [_hfma2(_lop3(y, S4_MASK, S4_EXP_SIGN, AND_XOR_LUT), b, off) for y in shifted]


def u4x2_rows_to_f16x2(two_rows, scale, zero):
    """(even, odd) f16x2 words: the low and the high nibble of each half's low byte, q * scale + zero."""
    even = _hfma2(_hsub2(_lop3(two_rows, U4_MASK_LO, U4_EXP_LO, AND_XOR_LUT), U4_EXP_LO), scale, zero)
    odd = _hfma2(_hsub2(_lop3(two_rows, U4_MASK_HI, U4_EXP_HI, AND_XOR_LUT), U4_EXP_HI), scale, zero)
    return even, odd


def _words(byte_rows):
    """uint8 [..., 4n] -> little-endian uint32 words [..., n]."""
    b = np.ascontiguousarray(byte_rows, dtype=np.uint8)
    return b.view("<u4").astype(np.uint64)


def _function_body(src, name):
    m = re.search(rf"\b{name}\([^;{{}}]*\)\s*{{", src)
    assert m, f"no definition of {name} in {MMA_FRAG}"
    open_brace = m.end() - 1
    depth, i = 0, open_brace
    while True:
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        if depth == 0:
            return src[open_brace:i + 1]
        i += 1


@pytest.mark.parametrize("name", sorted(CONSTANTS))
def test_emulation_uses_the_headers_constants(name):
    body = _function_body(MMA_FRAG.read_text(), name)
    found = {int(h, 16) for h in re.findall(r"0x([0-9A-Fa-f]+)", body)}
    assert found == CONSTANTS[name], f"{name} in mma_frag.cuh uses {sorted(map(hex, found))}"


def test_s8x4_every_byte_at_every_position_is_exact():
    rng = np.random.default_rng(0)
    x = np.arange(-128, 128)
    for pos in range(4):
        rows = rng.integers(0, 256, size=(256, 4), dtype=np.uint8)
        rows[:, pos] = x.astype(np.int8).view(np.uint8)
        lo, hi = s8x4_to_f16x2(_words(rows)[:, 0])
        vals = np.stack(_halves(lo) + _halves(hi), axis=1)          # elements 0, 1, 2, 3
        assert np.array_equal(vals, rows.view(np.int8).astype(np.float64)), pos


def test_block_scale_factor_is_b_over_16_and_minus_72b():
    b = np.arange(0, 19)                    # 0: the zero-filled rows past a sequence's end
    lo, hi = _halves(i4rs_block_scale_f16x2(b | (0xA5 << 8)))      # bits above the byte are ignored
    assert np.array_equal(lo, b / 16) and np.array_equal(hi, -72.0 * b)


def test_s4x8_every_nibble_value_position_and_block_scale_is_exact():
    rng = np.random.default_rng(1)
    b, value, slot = (a.ravel() for a in np.meshgrid(np.arange(1, 19), np.arange(-7, 8), np.arange(8)))
    q = torch.tensor(rng.integers(-7, 8, size=(b.size, 8)), dtype=torch.int8)   # random neighbours
    q[torch.arange(b.size), torch.from_numpy(slot)] = torch.from_numpy(value).to(torch.int8)
    packed = I8.pack_int4(q).numpy()
    out = s4x8_to_f16x2_scaled(_words(packed)[:, 0], i4rs_block_scale_f16x2(b))
    want = I8.unpack_int4(torch.from_numpy(packed)).numpy().astype(np.float64) * b[:, None]
    for k in range(4):                      # output word k holds the elements (k, k + 4)
        lo, hi = _halves(out[k])
        assert np.array_equal(lo, want[:, k]) and np.array_equal(hi, want[:, k + 4]), k


# --- the decode kernel's lane mapping, compiled from decode/mma.cuh ----------------------------------------------
# k_dim (the physical channel of a thread's local K dim) and qk_scores' per-lane offsets into the k8 bytes,
# the nibble bytes and the block scales are read from the header itself: nvcc compiles the real header for the
# real qk4pv8 specialization (the DecodeConfig templates/decode.cu.jinja renders) into a host program that prints
# them. k_dim is __device__; the program's copy of the header differs in that one specifier
# (__host__ __device__), and qk_scores' three offset expressions are taken from its loads by a pattern that
# must match exactly once: an edit that changes the header's shape fails here until this follows. The offsets
# name the header's constants as it does, through T = DecodeTraits<Cfg>.
_K_DIM = "__device__ __forceinline__ int k_dim(int c, int l) {"
_LANE_LOADS = {   # name -> the load it is read from (the offset expression of lane c is the group)
    "k8": r"load_words<T::kK8B>\(st \+ T::kOffK8 \+ row \* Layout::k8_bytes \+ ([^,;]+), k8w\[r\]\);",
    "k4": r"load_words<T::kK4B>\(st \+ T::kOffK \+ row \* Layout::k_bytes \+ ([^,;]+), k4w\[r\]\);",
    "bs": r"i4rs_block_scale_f16x2\(st\[T::kOffBs \+ row \* Layout::k_block_scale_bytes \+ ([^\]]+)\]\);",
}
# The rendered build's config: its anonymous namespace up to the end of struct DecodeConfig.
_CONFIG = r"(?ms)^namespace \{\n(.*?^struct DecodeConfig \{\n.*?^\};\n)"


def _one(pattern_or_text, src, what, regex=True, where=DECODE_MMA):
    found = re.findall(pattern_or_text, src) if regex else [pattern_or_text] * src.count(pattern_or_text)
    if len(found) != 1:
        raise AssertionError(f"{where}: expected exactly one {what}, found {len(found)}: the source changed "
                             "shape; update tests/cpu/test_decode_int_conversions.py's reading of it")
    return found[0]


@functools.cache
def header_lane_mapping(head_dim: int, include: Path = INCLUDE) -> dict:
    """What decode/mma.cuh (under ``include``) computes for qk4pv8 at ``head_dim``, per quad lane c:
    ``k_dim[c][l]`` for every local dim l, and the first byte of its k8 bytes, of its nibble bytes and the index
    of its block scale within a row; ``k8b``, ``k4b``: bytes of each it loads."""
    from mpfa_jit import env
    from mpfa_jit.ops import decode as decode_op
    src = (include / DECODE_MMA).read_text()
    _one(_K_DIM, src, "k_dim definition", regex=False)
    offsets = {name: _one(pat, src, f"qk_scores {name} load").strip() for name, pat in _LANE_LOADS.items()}
    rendered = decode_op.spec(recipe="qk4pv8", head_dim=head_dim, page_size=16, group_size=4, arch="sm_90a").render()
    config = _one(_CONFIG, rendered, "struct DecodeConfig in an anonymous namespace", where="templates/decode.cu.jinja")
    main = "\n".join([
        "#include <cstdio>", '#include "mpfa/cache_layout.cuh"', f'#include "{DECODE_MMA}"', "namespace {", config,
        "}  // namespace", "int main() {", "  using T = DecodeTraits<DecodeConfig>;",
        '  std::printf("k8b %d k4b %d\\n", T::kK8B, T::kK4B);',
        "  for (int c = 0; c < 4; ++c) {",
        f'    std::printf("lane %d %d %d %d\\n", c, int({offsets["k8"]}), int({offsets["k4"]}), int({offsets["bs"]}));',
        '    for (int l = 0; l < T::kHeadDim / 4; ++l) std::printf("%d ", k_dim<DecodeConfig>(c, l));',
        '    std::printf("\\n");', "  }", "}", ""])
    with tempfile.TemporaryDirectory(prefix="mpfa-mma-") as tmp:
        tmp = Path(tmp)
        (tmp / DECODE_MMA).parent.mkdir(parents=True)
        (tmp / DECODE_MMA).write_text(src.replace(_K_DIM, "__host__ " + _K_DIM))   # beside main.cu: found first
        (tmp / "main.cu").write_text(main)
        build = subprocess.run([env.nvcc_path(), "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr",
                                f"-I{include}", "-o", str(tmp / "mapping"), str(tmp / "main.cu")],
                               capture_output=True, text=True)
        assert build.returncode == 0, f"nvcc could not compile {DECODE_MMA} for the host:\n{build.stderr[-3000:]}"
        lines = subprocess.run([str(tmp / "mapping")], capture_output=True, text=True, check=True).stdout.splitlines()
    k8b, k4b = (int(x) for x in lines[0].split()[1::2])
    lanes = [[int(x) for x in line.split()[1:]] for line in lines[1::2]]
    return {"k8b": k8b, "k4b": k4b, "k_dim": [[int(x) for x in line.split()] for line in lines[2::2]],
            "k8": [r[1] for r in lanes], "k4": [r[2] for r in lanes], "bs": [r[3] for r in lanes]}


@pytest.mark.nvcc
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_threads_k_operand_is_the_references_int8_row(head_dim):
    """The kernel's qk4pv8 K operand (decode/mma.cuh qk_scores, compiled): quad lane c converts the k8 bytes and
    the nibble bytes at the header's offsets with the block scale at the header's index; together the four lanes
    must give i4rs_to_int8's values on the low and the nibble channels."""
    m = header_lane_mapping(head_dim)
    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(64, head_dim, generator=g) * torch.linspace(0.1, 4.0, head_dim) * torch.rand(64, 1, generator=g)
    k8, k4, bs, _ = I8.quantize_i4rs(x)
    ref = I8.i4rs_to_int8(k8, k4, bs).numpy().astype(np.float64)
    low = rope_low_channels(head_dim).numpy()
    got_low, got_nib = [], []
    for c in range(4):
        w8 = _words(k8.view(torch.uint8).numpy()[:, m["k8"][c]:m["k8"][c] + m["k8b"]])
        for i in range(w8.shape[1]):
            lo, hi = s8x4_to_f16x2(w8[:, i])
            got_low += [*_halves(lo), *_halves(hi)]
        assert 0 <= m["bs"][c] < bs.shape[1], f"lane {c} reads block scale {m['bs'][c]} of {bs.shape[1]}"
        scale = i4rs_block_scale_f16x2(bs.numpy()[:, m["bs"][c]].astype(np.uint64))
        w4 = _words(k4.numpy()[:, m["k4"][c]:m["k4"][c] + m["k4b"]])
        for i in range(w4.shape[1]):
            pairs = [_halves(o) for o in s4x8_to_f16x2_scaled(w4[:, i], scale)]
            got_nib += [pairs[k % 4][k // 4] for k in range(8)]
    assert len(got_low) == low.sum() and len(got_nib) == (~low).sum(), "the four lanes must cover every channel once"
    assert np.array_equal(np.stack(got_low, axis=1), ref[:, low])
    assert np.array_equal(np.stack(got_nib, axis=1), ref[:, ~low])


def test_u4_every_code_pair_is_the_references_fp16_value():
    """qk4pv4's V in decode (u4x2_rows_to_f16x2): every byte (two codes) of two rows, under fp16 scales and zero
    points from subnormal to large and of both signs, must give recipes/u4h.py decode_values bit for bit (the
    exact q * scale + zero rounded once); the bits above each half's byte are ignored."""
    from mpfa.recipes import u4h
    rng = np.random.default_rng(2)
    n = 4096
    byte = rng.integers(0, 256, size=(n, 2)).astype(np.uint64)
    junk = rng.integers(0, 256, size=(n, 2)).astype(np.uint64) << np.uint64(8)   # prmt leaves a copy there
    scale = np.float16(np.exp2(rng.uniform(-24, 6, size=(n, 2))))                # fp16 subnormals .. 64
    zero = np.float16(rng.choice([-1, 1], size=(n, 2)) * np.exp2(rng.uniform(-24, 8, size=(n, 2))))
    zero[:64] = 0.0
    word = lambda a: _pack(a[:, 0].astype(np.float64), a[:, 1].astype(np.float64))   # noqa: E731
    two_rows = (byte[:, 0] | junk[:, 0]) | ((byte[:, 1] | junk[:, 1]) << np.uint64(16))
    even, odd = u4x2_rows_to_f16x2(two_rows, word(scale), word(zero))
    for row in range(2):
        param = torch.from_numpy(np.stack([scale[:, row], zero[:, row]], axis=1).astype(np.float16))
        param = torch.cat([param, torch.ones(n, 2, dtype=torch.float16)], dim=1)      # D = 64: two groups
        packed = torch.zeros(n, 32, dtype=torch.uint8)
        packed[:, 0] = torch.from_numpy(byte[:, row].astype(np.uint8))
        want = u4h.decode_values(packed, param)[:, :2].double().numpy()
        assert np.array_equal(_halves(even)[row], want[:, 0]) and np.array_equal(_halves(odd)[row], want[:, 1]), row


def test_q_is_packed_in_the_nibble_pairs_of_the_header():
    """load_q_fragment packs Q's nibble dims by s4x8_pair_lo/hi; the emulation above (and the thread test)
    take word k = elements (k, k + 4)."""
    src = MMA_FRAG.read_text()
    assert "s4x8_pair_lo(int k) { return k; }" in src and "s4x8_pair_hi(int k) { return k + 4; }" in src


@pytest.mark.nvcc
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_split_k_channels_are_the_references_low_and_high_channels(head_dim):
    """decode/mma.cuh k_dim (split K), compiled: local dim l of quad lane c reads its lane's l-th k8 byte (l < D/8)
    or nibble; the channel it gives Q must be that byte's / nibble's channel in i4rs's channel order
    (rope_low_channels), so every channel is read exactly once, by the lane that holds it."""
    m = header_lane_mapping(head_dim)
    low = rope_low_channels(head_dim)
    low_ch, high_ch = torch.nonzero(low).flatten().tolist(), torch.nonzero(~low).flatten().tolist()
    k8b = m["k8b"]
    assert 2 * k8b == head_dim // 4, "each lane holds a quarter of the row"
    for c in range(4):
        for l in range(2 * k8b):
            is_low = l < k8b
            idx = m["k8"][c] + l if is_low else 2 * m["k4"][c] + l - k8b   # its byte / its nibble in the row
            assert m["k_dim"][c][l] == (low_ch if is_low else high_ch)[idx], (c, l)
    assert sorted(ch for lane in m["k_dim"] for ch in lane) == list(range(head_dim))
