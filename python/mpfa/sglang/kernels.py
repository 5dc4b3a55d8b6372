"""The kernel specializations a server loads: the backend loads exactly these at startup and
``python -m mpfa.sglang.warmup`` builds exactly these, so a warmed cache never compiles in the server."""
from __future__ import annotations

from mpfa_jit import KernelSpec
from mpfa_jit.ops import OPS


def server_kernel_specs(*, num_qo_heads: int, num_kv_heads: int, head_dim: int, recipe: str, page_size: int,
                        arch: str) -> list[KernelSpec]:
    """Every op's specializations for a server of this shape (heads per GPU), in OPS order, each once;
    raises (mpfa_jit.UnknownKernelError, ValueError) when an op has none for it."""
    specs = []
    for op in OPS:
        specs += op.server_specs(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                 recipe=recipe, page_size=page_size, arch=arch)
    return list(dict.fromkeys(specs))
