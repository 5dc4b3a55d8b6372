"""A kernel's URI hashes the headers its source includes (directly or through other headers), not every header:
editing one op's header rebuilds that op only, and the include scan covers what nvcc itself reads."""
import shutil
import subprocess

import pytest

from mpfa_jit import env, render
from mpfa_jit.ops import append_kv, decode, prefill

ARCH = "sm_90a"


def _specs():
    return {"append_kv": append_kv.spec(recipe="qk4pv8", head_dim=128, page_size=16, arch=ARCH),
            "decode": decode.spec(recipe="qk4pv8", head_dim=128, page_size=16, group_size=4, arch=ARCH),
            "prefill": prefill.spec(recipe="qk4pv8", head_dim=128, page_size=16, arch=ARCH)}


@pytest.fixture
def include_copy(tmp_path, monkeypatch):
    """A private copy of templates/include that the key computation reads instead of the installed one."""
    copy = tmp_path / "include"
    shutil.copytree(render.include_dir(), copy)
    monkeypatch.setattr(render, "include_dir", lambda: copy)
    return copy


def test_editing_one_ops_header_changes_only_that_ops_keys(include_copy):
    specs = _specs()
    before = {op: s.uri() for op, s in specs.items()}
    with open(include_copy / "mpfa" / "decode" / "softmax.cuh", "a") as f:
        f.write("\n// an edit\n")
    after = {op: s.uri() for op, s in specs.items()}
    assert after["decode"] != before["decode"]
    assert after["prefill"] == before["prefill"] and after["append_kv"] == before["append_kv"]


def test_a_header_shared_by_every_op_changes_every_key(include_copy):
    specs = _specs()
    before = {op: s.uri() for op, s in specs.items()}
    with open(include_copy / "mpfa" / "common.cuh", "a") as f:
        f.write("\n// an edit\n")
    assert all(s.uri() != before[op] for op, s in specs.items())


def test_an_include_reached_only_through_another_header_counts(include_copy):
    spec = _specs()["append_kv"]
    names = {n for n, _ in render.included_headers(spec.render())}
    # The rendered source includes the op's kernel header, which includes the rest.
    assert {"mpfa/append/kernel.cuh", "mpfa/common.cuh", "mpfa/cache_layout.cuh"} <= names
    assert not any(n.startswith(("mpfa/decode/", "mpfa/prefill/")) for n in names)
    (include_copy / "mpfa" / "extra.cuh").write_text("// new\n")
    with open(include_copy / "mpfa" / "append" / "params.cuh", "a") as f:
        f.write('\n#include "mpfa/extra.cuh"\n')
    assert "mpfa/extra.cuh" in {n for n, _ in render.included_headers(spec.render())}


@pytest.mark.nvcc
@pytest.mark.parametrize("op", ["append_kv", "decode", "prefill"])
def test_the_include_scan_covers_nvccs_dependency_list(op, tmp_path):
    """nvcc -M lists every file the preprocessor opened; each one under include/ must be in the key's hash."""
    spec = _specs()[op]
    source = spec.render()
    (tmp_path / "kernel.cu").write_text(source)
    flags = [f for f in spec.nvcc_flags() if f not in ("-Xcompiler", "-fPIC", "-fvisibility=hidden")]
    run = subprocess.run([env.nvcc_path(), *flags, f"-I{render.include_dir()}", "-M", "kernel.cu"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    root = render.include_dir().resolve()
    deps = set()
    for token in run.stdout.replace("\\\n", " ").split():
        path = (tmp_path / token).resolve() if not token.endswith(":") else None
        if path is not None and path.is_relative_to(root):
            deps.add(str(path.relative_to(root)))
    assert deps, "nvcc -M listed no mpfa header: the comparison would prove nothing"
    scanned = {n for n, _ in render.included_headers(source)}
    assert deps <= scanned, f"headers nvcc reads that the key does not hash: {sorted(deps - scanned)}"
