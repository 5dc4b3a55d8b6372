"""The kernel service on a machine without a GPU: rendering, keys, nvcc builds for sm_90a, the disk
cache (hits, concurrent builders, killed builds, corrupt entries) and its errors."""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import jinja2
import pytest

import mpfa_jit
from mpfa_jit import BuildError, NvccNotFoundError, Store, UnknownKernelError, UnsupportedArchError, env
from mpfa_jit.ops import append_kv
from mpfa_jit.render import render, templates_dir

ARCH = "sm_90a"


def _spec(recipe="qk4pv8", head_dim=128, page_size=16):
    return append_kv.spec(recipe=recipe, head_dim=head_dim, page_size=page_size, arch=ARCH)


def _builds(root):
    log = root / "builds.log"
    return log.read_text().splitlines() if log.exists() else []


# A child process that asks for one key and reports what happened; used by several tests.
CHILD = textwrap.dedent("""
    import sys, time, mpfa_jit
    from mpfa_jit.ops import append_kv
    spec = append_kv.spec(recipe=sys.argv[1], head_dim=int(sys.argv[2]), page_size=int(sys.argv[3]), arch="sm_90a")
    t = time.monotonic()
    m = mpfa_jit.get_kernel(spec)
    m.params_fn(append_kv.SYMBOL, append_kv.PARAMS_LAYOUT_SYMBOL, append_kv.AppendParams)
    print("LOADED", m.uri, f"{(time.monotonic() - t) * 1000:.1f}")
""")


def _child(args, root, **kw):
    return subprocess.Popen([sys.executable, "-c", CHILD, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "MPFA_CACHE_DIR": str(root)}, **kw)


def test_templates_are_found_as_installed():
    assert (templates_dir() / "append_kv.cu.jinja").is_file()
    assert (templates_dir() / "include" / "mpfa" / "common.cuh").is_file()


def test_render_substitutes_parameters_and_rejects_missing_ones():
    src = _spec("qk4pv8", 64, 32).render()
    assert "constexpr int kHeadDim = 64;" in src and "constexpr int kPageSize = 32;" in src
    # the cache row from the Field table: k, k8, k_block_scale, k_scale, v, v_param bytes (d64: 16, 32, 4, 4, 64, 0)
    assert "kRecipe = mpfa::Recipe::kQk4pv8;" in src
    assert "mpfa::CacheLayout<kRecipe, kHeadDim, 16, 32, 4, 4, 64, 0>" in src
    bf16 = _spec("bf16", 128, 1).render()
    assert "kRecipe = mpfa::Recipe::kBf16;" in bf16
    assert "mpfa::CacheLayout<kRecipe, kHeadDim, 256, 0, 0, 0, 256, 0>" in bf16
    with pytest.raises(jinja2.UndefinedError):
        render("append_kv.cu.jinja", {"recipe": "qk4pv8", "arch": ARCH})


def test_keys_name_parameters_and_uris_hash_what_is_built(monkeypatch):
    a, b = _spec(page_size=16), _spec(page_size=32)
    assert a.key == "append_kv_head_dim-128_page_size-16_recipe-qk4pv8_sm_90a"
    assert a.key != b.key and a == _spec(page_size=16)
    assert a.uri() == _spec(page_size=16).uri()
    assert a.uri("int x;") != a.uri("int y;")          # any change to the source is a new build
    before = a.uri("int x;")
    monkeypatch.setattr("mpfa_jit.spec.env.compiler_id", lambda: "nvcc 99.9")
    assert a.uri("int x;") != before                   # and so is a new compiler
    assert before.startswith(a.key + "_")


def test_bad_specs_raise_clear_errors():
    with pytest.raises(ValueError, match=r"recipe must be one of \['bf16', 'qk8pv8', 'qk4pv8', 'qk4pv4'\], got 'fp4'"):
        append_kv.spec(recipe="fp4", head_dim=128, page_size=16, arch=ARCH)
    with pytest.raises(ValueError, match=r"head_dim must be one of \[64, 128\], got 96"):
        append_kv.spec(recipe="bf16", head_dim=96, page_size=16, arch=ARCH)
    with pytest.raises(ValueError, match=r"page_size must be one of \[1, 16, 32, 64\], got 8"):
        append_kv.spec(recipe="bf16", head_dim=128, page_size=8, arch=ARCH)
    for arch in ("sm_80", "sm_90", "sm_100a"):
        with pytest.raises(UnsupportedArchError, match="sm_90a"):
            append_kv.spec(recipe="bf16", head_dim=128, page_size=16, arch=arch)
    assert env.arch_from_capability(9, 0) == "sm_90a"
    with pytest.raises(UnknownKernelError, match="no kernel template 'nope.cu.jinja'"):
        render("nope.cu.jinja", {})


def test_missing_nvcc_is_a_clear_error(monkeypatch, jit_cache):
    monkeypatch.setenv("MPFA_NVCC", "/nonexistent/bin/nvcc")
    with pytest.raises(NvccNotFoundError, match="MPFA_NVCC='/nonexistent/bin/nvcc' is not an executable"):
        mpfa_jit.build_only(_spec())


@pytest.mark.nvcc
def test_build_then_hit_in_a_fresh_process(jit_cache):
    first = _child(("qk8pv8", 128, 16), jit_cache)
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    assert "mpfa_jit: building append_kv_head_dim-128_page_size-16_recipe-qk8pv8_sm_90a" in err
    second = _child(("qk8pv8", 128, 16), jit_cache)
    out2, err2 = second.communicate(timeout=600)
    assert second.returncode == 0, err2
    assert "building" not in err2 and out2.split()[1] == out.split()[1]
    assert len(_builds(jit_cache)) == 1
    entry = Store(jit_cache).entries()[0]
    assert entry.manifest["params"] == {"head_dim": 128, "page_size": 16, "recipe": "qk8pv8"}
    assert entry.manifest["arch"] == "sm_90a" and "cuda" in entry.manifest["compiler"].lower()


@pytest.mark.nvcc
def test_eight_processes_build_one_key_once(jit_cache):
    procs = [_child(("qk4pv8", 64, 32), jit_cache) for _ in range(8)]
    results = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1] for r in results]
    assert sum("mpfa_jit: building" in err for _, err in results) == 1
    assert len({out.split()[1] for out, _ in results}) == 1
    assert len(_builds(jit_cache)) == 1


@pytest.mark.nvcc
def test_killed_build_leaves_nothing_that_loads(jit_cache):
    proc = _child(("bf16", 128, 64), jit_cache, start_new_session=True)
    tmp = jit_cache / "tmp"
    deadline = time.monotonic() + 120
    # Wait until nvcc is running inside the private build folder, then kill the whole process group.
    while time.monotonic() < deadline and not any(tmp.glob("*/build.ninja")):
        time.sleep(0.02)
    assert any(tmp.glob("*/build.ninja")), "the build never started"
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    store = Store(jit_cache)
    spec = _spec("bf16", 128, 64)
    uri = spec.uri()
    assert store.check(uri) == "missing" and store.entries() == [] and _builds(jit_cache) == []
    again = _child(("bf16", 128, 64), jit_cache)
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err
    assert "mpfa_jit: building" in err and store.check(uri) == "ok"
    assert not any(tmp.iterdir()), "the killed build's folder was not cleaned up"


@pytest.mark.nvcc
def test_corrupt_entry_is_rebuilt(jit_cache):
    spec = _spec("qk4pv8", 128, 1)
    uri, built, _ = mpfa_jit.build_only(spec)   # not loaded here: truncating a mapped library would SIGBUS us
    assert built
    store = Store(jit_cache)
    lib = store.library(uri)
    lib.write_bytes(lib.read_bytes()[: lib.stat().st_size // 2])        # a truncated library
    assert store.check(uri) == "corrupt"
    proc = _child(("qk4pv8", 128, 1), jit_cache)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert "is corrupt; rebuilding" in err and store.check(uri) == "ok"
    (store.entry_dir(uri) / "manifest.json").write_text("{not json")  # a damaged manifest
    assert store.check(uri) == "corrupt"
    assert len(_builds(jit_cache)) == 2


@pytest.mark.nvcc
def test_compile_error_reports_the_log_and_publishes_nothing(jit_cache):
    store = Store(jit_cache)
    with pytest.raises(BuildError, match="error") as failure:
        store.get_or_build(_spec(), "this is not C++ at all;\n", "broken_source_uri")
    assert store.check("broken_source_uri") == "missing"
    assert not any((jit_cache / "tmp").iterdir())
    kept = store.failed_dir("broken_source_uri")
    assert f"kept in {kept} " in str(failure.value) and "this is not C++" in (kept / "kernel.cu").read_text()


@pytest.mark.nvcc
def test_sass_has_fp8_conversion_and_no_spills(jit_cache, sass_tools):
    cuobjdump, tool_env = sass_tools
    m = mpfa_jit.get_kernel(_spec("qk4pv8", 128, 16))
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", str(m.path)], capture_output=True, text=True,
                           env=tool_env).stdout
    assert "STACK:0" in usage and "LOCAL:0" in usage, usage
    sass = subprocess.run([cuobjdump, "--dump-sass", str(m.path)], capture_output=True, text=True, env=tool_env)
    assert sass.returncode == 0, sass.stderr
    assert "sm_90a" in sass.stdout
    assert "F2FP.SATFINITE.E4M3" in sass.stdout                   # hardware FP8 conversion
    assert "LDG.E.128" in sass.stdout                             # 16-byte loads of K and V
    assert "LDL" not in sass.stdout and "STL" not in sass.stdout  # nothing spilled


@pytest.mark.nvcc
def test_warmup_and_cache_cli(jit_cache, capsys):
    from mpfa_jit import cache as cache_cli
    from mpfa.sglang import warmup
    cfg = os.path.join(os.path.dirname(__file__), "..", "..", "server_configs", "llama-3.1-8b-qk4pv8.yaml")
    assert warmup.main([cfg, "--arch", ARCH, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"append_kv_head_dim-128_page_size-16_recipe-qk4pv8_sm_90a\s+built", out)
    ready = re.search(r"(\d+) of (\d+) ready", out)   # which kernels: tests/cpu/test_server_cli.py
    assert ready and ready[1] == ready[2] and int(ready[1]) >= 3, out
    assert warmup.main([cfg, "--arch", ARCH, "--no-progress"]) == 0
    assert re.search(r"append_kv_head_dim-128_page_size-16_recipe-qk4pv8_sm_90a\s+cached", capsys.readouterr().out)
    assert warmup.main(["--num-qo-heads", "32", "--num-kv-heads", "8", "--head-dim", "128", "--page-size", "16",
                        "--arch", "sm_80"]) == 2
    assert "sm_80" in capsys.readouterr().err
    assert cache_cli.main(["list"]) == 0
    listed = capsys.readouterr().out
    assert "append_kv_head_dim-128_page_size-16_recipe-qk4pv8_sm_90a" in listed and "[ok]" in listed
    assert cache_cli.main(["size"]) == 0
    assert re.match(r"[0-9.]+ (KiB|MiB) ", capsys.readouterr().out)
    assert cache_cli.main(["clear"]) == 0
    assert f"({ready[1]} builds)" in capsys.readouterr().out and Store(jit_cache).entries() == []


def test_server_config_shapes():
    from mpfa.sglang.model import hf_config_facts, read_hf_config
    from mpfa.sglang.settings import load_server_config
    root = os.path.join(os.path.dirname(__file__), "..", "..", "server_configs")
    llama = load_server_config(os.path.join(root, "llama-3.1-8b-qk4pv8.yaml"))
    facts = hf_config_facts(read_hf_config(llama.model_dir))
    assert (facts["num_qo_heads"], facts["num_kv_heads"], facts["head_dim"]) == (32, 8, 128)
    assert llama.mpfa["recipe"] == "qk4pv8" and llama.page_size == 16
    qwen = load_server_config(os.path.join(root, "qwen3-14b-qk4pv8.yaml"))
    qwen_cfg = read_hf_config(qwen.model_dir)
    facts = hf_config_facts(qwen_cfg)
    assert (facts["num_qo_heads"], facts["num_kv_heads"], qwen_cfg["num_hidden_layers"]) == (40, 8, 40)
    assert json.loads((llama.model_dir / "config.json").read_text())["num_hidden_layers"] == 32


def test_tests_import_the_installed_package():
    """The suite runs against the installed distribution (pip install -e . or a wheel), not a source
    tree that happens to be on sys.path: python/ is never on it, and the version matches."""
    import importlib.metadata as md
    import mpfa
    assert md.version("mpfa") == mpfa.__version__
    assert not any(os.path.abspath(p).endswith(os.sep + "python") for p in sys.path)
    from importlib import resources
    assert (resources.files("mpfa_jit.templates") / "append_kv.cu.jinja").is_file()
