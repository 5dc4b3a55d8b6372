"""Every kernel header under templates/include/mpfa compiles alone: the decode and prefill kernels and device
functions are templates on the build's config (DecodeConfig / PrefillConfig, rendered by the op's .cu.jinja) or on
the traits derived from it (DecodeTraits, PrefillTraits), append's on the cache row type, so no header reads a
name that only the including file defines (an editor opening one header sees what the build compiles)."""
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from mpfa_jit import env, render

ROOT = render.include_dir() / "mpfa"
HEADERS = sorted(ROOT.rglob("*.cuh"))


def test_every_ops_headers_are_found():
    names = {str(h.relative_to(ROOT)) for h in HEADERS}
    assert {"cache_layout.cuh", "append/kernel.cuh", "decode/kernel.cuh", "decode/traits.cuh", "prefill/kernel.cuh",
            "prefill/kernel_traits.cuh"} <= names


@pytest.mark.nvcc
def test_each_header_compiles_alone(tmp_path):
    def front_end(header):
        # --cuda runs the C++ front end over host and device code (every template's non-dependent names are
        # looked up), without instantiating anything
        rel = header.relative_to(ROOT)
        source = tmp_path / (str(rel).replace("/", "_") + ".cu")
        source.write_text(f'#include "mpfa/{rel}"\n')
        run = subprocess.run([env.nvcc_path(), "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr",
                              f"-I{render.include_dir()}", "--cuda", str(source), "-o", os.devnull],
                             capture_output=True, text=True)
        return str(rel), run.returncode, run.stderr[-2000:]

    with ThreadPoolExecutor(max_workers=2) as pool:
        failed = [(name, err) for name, rc, err in pool.map(front_end, HEADERS) if rc != 0]
    assert not failed, failed
