"""GPU tests run only on a Hopper GPU (sm_90a); elsewhere they are skipped with the reason.
nvcc tests need only the compiler (they build sm_90a code without a GPU). They skip where nvcc is not
found, unless MPFA_REQUIRE_NVCC=1 (.ci/run sets it on a machine that has nvcc): then they fail with the
reason, so CI cannot pass with its compile tests skipped."""
import os

import pytest
import torch


def _gpu_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU: GPU tests run on the H200 (sm_90a)"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return f"GPU is sm_{cap[0]}{cap[1]}: mpfa kernels are built for sm_90a (Hopper) only"
    return None


def _nvcc_reason():
    from mpfa_jit import env, NvccNotFoundError
    try:
        env.nvcc_path()
    except NvccNotFoundError as e:
        return f"JIT build tests need the CUDA compiler: {e}"
    return None


def _nvcc_required() -> bool:
    return os.environ.get("MPFA_REQUIRE_NVCC", "0") not in ("", "0")


# A compile test that cannot run where nvcc is required: the reason, reported as a setup error.
_NVCC_MISSING = pytest.StashKey[str]()


def _fail_required(reason):
    pytest.fail(f"{reason} (MPFA_REQUIRE_NVCC=1: this machine must run the compile tests)", pytrace=False)


def pytest_collection_modifyitems(config, items):
    gpu, nvcc = _gpu_reason(), _nvcc_reason()
    for item in items:
        if "gpu" in item.keywords and gpu:
            item.add_marker(pytest.mark.skip(reason=gpu))
        if "nvcc" in item.keywords and nvcc:
            if _nvcc_required():
                item.stash[_NVCC_MISSING] = nvcc
            else:
                item.add_marker(pytest.mark.skip(reason=nvcc))


def pytest_runtest_setup(item):
    # Runs after the skip markers (the skipping plugin's setup is tryfirst), so a GPU test without a GPU
    # still skips; and before the fixtures, so nothing is set up for a test that cannot run.
    reason = item.stash.get(_NVCC_MISSING, None)
    if reason:
        _fail_required(reason)


@pytest.fixture
def jit_cache(tmp_path, monkeypatch):
    """A private, empty kernel cache for one test."""
    root = tmp_path / "mpfa-cache"
    monkeypatch.setenv("MPFA_CACHE_DIR", str(root))
    return root


@pytest.fixture(scope="session")
def shared_jit_cache(tmp_path_factory):
    """One kernel cache for the whole session, so each specialization is compiled once per run."""
    root = os.environ.get("MPFA_TEST_CACHE_DIR") or str(tmp_path_factory.mktemp("mpfa-shared-cache"))
    old = os.environ.get("MPFA_CACHE_DIR")
    os.environ["MPFA_CACHE_DIR"] = root
    yield root
    if old is None:
        os.environ.pop("MPFA_CACHE_DIR", None)
    else:
        os.environ["MPFA_CACHE_DIR"] = old


@pytest.fixture
def sass_tools():
    """(cuobjdump, env with nvdisasm on PATH) to read the SASS of built kernels; skips where missing."""
    import os
    from mpfa_jit import env
    cuobjdump, nvdisasm = env.cuda_tool("cuobjdump"), env.cuda_tool("nvdisasm")
    if not cuobjdump or not nvdisasm:
        reason = "cuobjdump/nvdisasm not found (the test extra installs nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm)"
        if _nvcc_required():
            _fail_required(reason)
        pytest.skip(reason)
    return cuobjdump, {**os.environ, "PATH": os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", "")}


@pytest.fixture
def kernel_resources(sass_tools):
    """kernel_resources(library) -> {kernel name: {registers, stack, local, instructions, spill_ops}} of a built
    library (benchmarks.sass_census, the census the kernel changes are compared with)."""
    from benchmarks.sass_census import census_of, short_name
    return lambda library: {short_name(f): v for f, v in census_of(str(library)).items()}
