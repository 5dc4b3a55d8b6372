"""Every header of templates/include/mpfa/prefill compiles alone: its kernels and device functions are templates on
the build's config (PrefillConfig, rendered by templates/prefill.cu.jinja) or on PrefillTraits of it, so no header
reads a name that only the including file defines (an editor opening one header sees what the build compiles)."""
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from mpfa_jit import env, render

HEADERS = sorted((render.include_dir() / "mpfa" / "prefill").glob("*.cuh"))


def test_the_prefill_headers_are_found():
    assert {"kernel.cuh", "kernel_traits.cuh", "params.cuh"} <= {h.name for h in HEADERS}


@pytest.mark.nvcc
def test_each_prefill_header_compiles_alone(tmp_path):
    def front_end(header):
        # --cuda runs the C++ front end over host and device code (every template's non-dependent names are
        # looked up), without instantiating anything
        source = tmp_path / f"{header.stem}.cu"
        source.write_text(f'#include "mpfa/prefill/{header.name}"\n')
        run = subprocess.run([env.nvcc_path(), "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr",
                              f"-I{render.include_dir()}", "--cuda", str(source), "-o", os.devnull],
                             capture_output=True, text=True)
        return header.name, run.returncode, run.stderr[-2000:]

    with ThreadPoolExecutor(max_workers=2) as pool:
        failed = [(name, err) for name, rc, err in pool.map(front_end, HEADERS) if rc != 0]
    assert not failed, failed
