"""What every op's support table shares: the recipe names (defined once, in ``mpfa_jit.formats``) and the
error an unsupported specialization raises."""
from __future__ import annotations

from ..errors import UnknownKernelError
from ..formats import RECIPES


# Every kernel is built for every recipe (mpfa_jit.formats defines them), and every op for the same head_dims and
# page sizes: a cache of a shape no attention kernel reads would serve no one. A head_dim is added here, to the
# kernels' static_asserts and to the MMA dispatch (README, "Where to change what").
ALL_RECIPES = tuple(RECIPES)
HEAD_DIMS = (64, 128)
PAGE_SIZES = (1, 16, 32, 64)


def _must(values) -> str:
    values = list(values)
    # a run of integers (the group sizes) reads as a range; names (the recipes) never do
    ints = all(isinstance(v, int) for v in values)
    if len(values) > 3 and ints and values == list(range(values[0], values[-1] + 1)):
        return f"must be in {values[0]}..{values[-1]}"
    return f"must be one of {values}"


def check(kernel: str, values: dict, accepted: dict) -> None:
    """Raise :class:`UnknownKernelError` when ``kernel`` (e.g. "decode") has no specialization for ``values``:
    the message names the specialization asked for, and each value outside its ``accepted`` table."""
    bad = [f"{name} {_must(accepted[name])}, got {value!r}" for name, value in values.items()
           if value not in accepted[name]]
    if bad:
        asked = ", ".join(f"{name}={value!r}" for name, value in values.items())
        raise UnknownKernelError(f"no {kernel} kernel for {asked}: {'; '.join(bad)}")


def gqa_group(num_qo_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head (the GQA group); raises unless num_qo_heads is a positive multiple of a
    positive num_kv_heads."""
    if not (isinstance(num_qo_heads, int) and isinstance(num_kv_heads, int) and num_qo_heads > 0
            and num_kv_heads > 0 and num_qo_heads % num_kv_heads == 0):
        raise ValueError(f"num_qo_heads {num_qo_heads!r} must be a positive multiple of num_kv_heads "
                         f"{num_kv_heads!r} (both positive integers)")
    return num_qo_heads // num_kv_heads
