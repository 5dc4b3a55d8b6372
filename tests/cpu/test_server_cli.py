"""The warmup and launch CLIs without a GPU or SGLang: warmup builds exactly the kernels the SGLang backend
loads, refuses what the server refuses with the server's message, and every configuration or usage error
is one line on stderr with exit status 2 (1 is a failed build, 130 an interrupt)."""
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tqdm import tqdm

from mpfa.sglang import warmup as W
from mpfa.sglang import launch as L
from mpfa.sglang.kernels import server_kernel_specs
from mpfa.sglang.model import UnsupportedModelError, check_model_supported
from mpfa.sglang.settings import MpfaConfigError, load_server_config, resolve_settings

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "server_configs").glob("*.yaml"))
DEFAULT = ROOT / "server_configs/llama-3.1-8b-qk4pv8.yaml"
LLAMA = ROOT / "server_configs/models/llama-3.1-8b"
ARCH = "sm_90a"
ENV_OVERRIDES = [{}, {"MPFA_RECIPE": "bf16"}, {"MPFA_RECIPE": "qk8pv8", "MPFA_PAGE_SIZE": "1"},
                 {"MPFA_PAGE_SIZE": "64"}, {"MPFA_PAGE_SIZE": "32", "MPFA_COMPENSATION": "0"}]


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("MPFA_RECIPE", "MPFA_PAGE_SIZE", "MPFA_COMPENSATION", "MPFA_KERNEL_BACKEND", "MPFA_CONFIG",
                 "MPFA_JIT_JOBS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MPFA_CUDA_ARCH", ARCH)
    return monkeypatch


def _backend_keys(path: Path, env: dict) -> set:
    """The kernel keys an SGLang server launched from ``path`` loads: the launcher's command and environment,
    the settings the pool hook resolves from them, the heads SGLang's ModelConfig gives the backend, and the
    function the backend itself calls (mpfa.sglang.kernels.server_kernel_specs)."""
    plan = L.build_launch(path, env=env)
    server_env = {**env, **plan.env}
    page = int(plan.argv[plan.argv.index("--page-size") + 1])
    settings = resolve_settings(server_page_size=page, env=server_env)
    hf = json.loads((plan.config.model_dir / "config.json").read_text())
    tp = int(plan.argv[plan.argv.index("--tp-size") + 1]) if "--tp-size" in plan.argv else 1
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    specs = server_kernel_specs(num_qo_heads=heads // tp, num_kv_heads=max(1, kv_heads // tp), head_dim=head_dim,
                                recipe=settings.recipe, page_size=settings.page_size, arch=ARCH)
    return {s.key for s in specs}


def _warmup_keys(argv: list, env: dict) -> set:
    settings, facts, _ = W.server_plan(W.parse_args(argv, environ=env), environ=env)
    return {s.key for s in W.kernel_specs(settings, facts, ARCH)}


@pytest.mark.parametrize("overrides", ENV_OVERRIDES, ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()) or "yaml")
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_warmup_builds_what_the_backend_loads(path, overrides, clean_env):
    backend = _backend_keys(path, overrides)
    assert {k.split("_")[0] for k in backend} == {"append", "decode", "prefill"}
    assert _warmup_keys([str(path)], overrides) == backend
    # the same server config named by MPFA_CONFIG (no argument), as a scheduler process reads it
    assert _warmup_keys([], {**overrides, "MPFA_CONFIG": str(path)}) == backend
    recipe = overrides.get("MPFA_RECIPE") or load_server_config(path).mpfa["recipe"]
    assert all(f"recipe-{recipe}" in k and f"page_size-{overrides.get('MPFA_PAGE_SIZE', '16')}_" in k for k in backend)


def test_warmup_flags_override_the_environment(clean_env):
    env = {"MPFA_RECIPE": "bf16", "MPFA_PAGE_SIZE": "1"}
    keys = _warmup_keys([str(DEFAULT), "--recipe", "qk8pv8", "--page-size", "32"], env)
    assert keys == _backend_keys(DEFAULT, {"MPFA_RECIPE": "qk8pv8", "MPFA_PAGE_SIZE": "32"})


def _run(main, argv, capsys):
    """(exit status, stdout, stderr) of a CLI's main(argv), whether it returns or exits (argparse)."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 256), (80, 8, 128), (32, -8, 128), (30, 8, 128),
                                                       (32, 0, 128), (0, 8, 128)])
def test_warmup_refuses_what_the_server_refuses(heads, kv_heads, head_dim, clean_env, capsys):
    with pytest.raises(UnsupportedModelError) as server:
        check_model_supported(head_dim=head_dim, num_qo_heads=heads, num_kv_heads=kv_heads, page_size=16,
                              recipe="qk4pv8")
    argv = ["--num-qo-heads", str(heads), "--num-kv-heads", str(kv_heads), "--head-dim", str(head_dim), "--page-size",
            "16", "--no-progress"]
    rc, out, err = _run(W.main, argv, capsys)
    assert rc == 2 and out == ""
    assert err == f"mpfa warmup: error: {server.value}\n"


def _model(tmp_path, config: dict | str | None, yaml_text: str = "model: m\nsglang: {page-size: 16}\n"):
    if config is not None:
        (tmp_path / "m").mkdir()
        (tmp_path / "m/config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    (tmp_path / "c.yaml").write_text(yaml_text)
    return str(tmp_path / "c.yaml")


def _model_dir(tmp_path, config: dict) -> str:
    return str(Path(_model(tmp_path, config)).parent / "m")


LLAMA_CFG = json.loads((LLAMA / "config.json").read_text())
NO_HEAD_DIM = {k: v for k, v in LLAMA_CFG.items() if k not in ("head_dim", "hidden_size")}

# (argv builder, environment, what the one line must say); every case exits 2
BAD_WARMUP = {
    "missing yaml": (lambda t: ["/nonexistent/c.yaml"], {}, r"/nonexistent/c.yaml: no such server config file"),
    "malformed yaml": (lambda t: [_model(t, LLAMA_CFG, "model: m\nsglang: {page-size: 16\n")], {},
                       r"not valid YAML at line 3"),
    "misspelled mpfa key": (lambda t: [_model(t, LLAMA_CFG,
                                              "model: m\nsglang: {page-size: 16}\nmpfa: {recipie: bf16}\n")], {},
                            r"unknown keys in the mpfa section: \['recipie'\]"),
    "page size twice": (lambda t: [_model(t, LLAMA_CFG, "model: m\nsglang: {page-size: 16}\nmpfa: {page_size: 16}\n")],
                        {}, r"state the page size once, as sglang.page-size"),
    "missing model folder": (lambda t: [_model(t, None)], {}, r"model folder .*/m does not exist"),
    "config.json without head_dim": (lambda t: [_model(t, NO_HEAD_DIM)], {},
                                     r"config.json: has neither head_dim nor hidden_size"),
    "config.json not json": (lambda t: [_model(t, "{")], {}, r"config.json: not valid JSON"),
    "yaml tp-size 0": (lambda t: [_model(t, LLAMA_CFG, "model: m\nsglang: {page-size: 16, tp-size: 0}\n")], {},
                       r"sglang.tp-size must be a positive integer, got 0"),
    "--tp-size 0": (lambda t: ["--model-path", str(LLAMA), "--page-size", "16", "--tp-size", "0"], {},
                    r"argument --tp-size: must be a positive integer, got '0'"),
    "--tp-size 3": (lambda t: ["--model-path", str(LLAMA), "--page-size", "16", "--tp-size", "3"], {},
                    r"tp-size 3 must divide num_attention_heads 32"),
    "--num-kv-heads 0": (lambda t: ["--num-qo-heads", "32", "--num-kv-heads", "0", "--head-dim", "128",
                                    "--page-size", "16"], {},
                         r"num_qo_heads 32 must be a positive multiple of num_kv_heads 0"),
    "--page-size 0": (lambda t: [str(DEFAULT), "--page-size", "0"], {}, r"argument --page-size: invalid choice: 0"),
    "MPFA_PAGE_SIZE=0": (lambda t: [str(DEFAULT)], {"MPFA_PAGE_SIZE": "0"}, r"MPFA_PAGE_SIZE must be one of"),
    "MPFA_RECIPE=fp4": (lambda t: [str(DEFAULT)], {"MPFA_RECIPE": "fp4"}, r"MPFA_RECIPE must be one of"),
    "MPFA_COMPENSATION=maybe": (lambda t: [str(DEFAULT)], {"MPFA_COMPENSATION": "maybe"},
                                r"MPFA_COMPENSATION must be a boolean"),
    "MPFA_CONFIG missing": (lambda t: [], {"MPFA_CONFIG": "/nonexistent/c.yaml"}, r"no such server config file"),
    "MPFA_JIT_JOBS=abc": (lambda t: [str(DEFAULT)], {"MPFA_JIT_JOBS": "abc"},
                          r"MPFA_JIT_JOBS must be a positive integer"),
    "--jobs -1": (lambda t: [str(DEFAULT), "--jobs", "-1"], {},
                  r"argument --jobs: must be a positive integer, got '-1'"),
    "--arch sm_80": (lambda t: [str(DEFAULT), "--arch", "sm_80"], {}, r"sm_80"),
    "no page size": (lambda t: ["--num-qo-heads", "32", "--num-kv-heads", "8", "--head-dim", "128"], {},
                     r"no page size: .*MPFA_PAGE_SIZE"),
    "nothing given": (lambda t: [], {}, r"give a server config, --model-path, or all of"),
    "two shapes": (lambda t: [str(DEFAULT), "--model-path", str(LLAMA)], {}, r"give one of"),
    "config.json sliding_window text": (lambda t: [_model(t, {**LLAMA_CFG, "sliding_window": "abc"})], {},
                                        r"m/config\.json: sliding_window must be an integer or absent, got 'abc'"),
    "config.json head_dim fraction": (lambda t: [_model(t, {**LLAMA_CFG, "head_dim": 128.5})], {},
                                      r"m/config\.json: head_dim must be a positive integer or absent, got 128\.5"),
    "config.json soft cap text": (lambda t: [_model(t, {**LLAMA_CFG, "attn_logit_softcapping": "x"})], {},
                                  r"m/config\.json: attn_logit_softcapping must be a number or absent, got 'x'"),
    "--model-path sliding_window text": (lambda t: ["--model-path",
                                                    _model_dir(t, {**LLAMA_CFG, "sliding_window": "abc"}),
                                                    "--page-size", "16"],
                                         {}, r"m/config\.json: sliding_window must be an integer or absent"),
}

# Server configs the launcher refuses: warmup must refuse each with the same message (both read the file through
# settings.load_server_config and decide through launch.server_settings).
REFUSED_YAML = {
    "other attention backend": ("{page-size: 16, attention-backend: flashinfer}",
                                r"sglang.attention-backend is 'flashinfer'; this launcher serves "
                                r"--attention-backend mpfa"),
    "other decode backend": ("{page-size: 16, decode-attention-backend: triton}",
                             r"sglang.decode-attention-backend must be mpfa \(or absent\)"),
    "sglang.model-path": ("{page-size: 16, model-path: /models/x}",
                          r"give the model as the top-level 'model' key, not sglang.model-path"),
    "sglang.model": ("{page-size: 16, model: /models/x}",
                     r"give the model as the top-level 'model' key, not sglang.model$"),
    "misspelled sglang key": ("{page-size: 16, tp-szie: 2}",
                              r"sglang.tp-szie is not a flag of python -m sglang.launch_server \(SGLang 0\.5\.17\); "
                              r"did you mean sglang.tp-size\?"),
    "unknown sglang key": ("{page-size: 16, turbo: true}",
                           r"sglang.turbo is not a flag of python -m sglang.launch_server \(SGLang 0\.5\.17\)$"),
    "dp-size not dividing tp-size": ("{page-size: 16, tp-size: 8, dp-size: 3, enable-dp-attention: true}",
                                     r"sglang.dp-size 3 must divide sglang.tp-size 8 with sglang.enable-dp-attention"),
    "dp attention not a boolean": ("{page-size: 16, tp-size: 2, dp-size: 2, enable-dp-attention: maybe}",
                                   r"sglang.enable-dp-attention must be a boolean"),
    "dp-size twice": ("{page-size: 16, dp-size: 2, data-parallel-size: 2}",
                      r"sglang.dp-size and sglang.data-parallel-size are one setting: keep one"),
}
for _case, (_section, _match) in REFUSED_YAML.items():
    BAD_WARMUP[f"yaml {_case}"] = (lambda t, section=_section: [_model(t, LLAMA_CFG, f"model: m\nsglang: {section}\n")],
                                   {}, r"c\.yaml: " + _match)


def _one_line_exit_2(main, case, extra, prefix, tmp_path, env_patch, capsys):
    argv, env, match = BAD_WARMUP[case]
    for k, v in env.items():
        env_patch.setenv(k, v)
    rc, out, err = _run(main, argv(tmp_path) + extra, capsys)
    assert rc == 2 and out == "", (rc, out, err)
    assert err.count("\n") == 1 and err.startswith(prefix), err
    assert re.search(match, err), err


@pytest.mark.parametrize("case", BAD_WARMUP)
def test_warmup_bad_usage_is_one_line_exit_2(case, tmp_path, clean_env, capsys):
    _one_line_exit_2(W.main, case, ["--no-progress"], "mpfa warmup: error: ", tmp_path, clean_env, capsys)


BAD_LAUNCH = ("missing yaml", "malformed yaml", "misspelled mpfa key", "page size twice", "missing model folder",
              "config.json without head_dim", "config.json not json", "yaml tp-size 0", "MPFA_PAGE_SIZE=0",
              "MPFA_RECIPE=fp4", "config.json sliding_window text", "config.json head_dim fraction",
              "config.json soft cap text") + tuple(f"yaml {case}" for case in REFUSED_YAML)


@pytest.mark.parametrize("case", BAD_LAUNCH)
def test_launch_bad_config_is_one_line_exit_2(case, tmp_path, clean_env, capsys):
    _one_line_exit_2(L.main, case, ["--print"], "mpfa launch: error: ", tmp_path, clean_env, capsys)


@pytest.mark.parametrize("case", ["config.json sliding_window text"] + [f"yaml {c}" for c in REFUSED_YAML])
def test_warmup_refuses_what_the_launcher_refuses_with_its_message(case, tmp_path, clean_env, capsys):
    argv, _, _ = BAD_WARMUP[case]
    config = argv(tmp_path)
    rc_launch, _, launch_err = _run(L.main, config + ["--print"], capsys)
    rc_warmup, _, warmup_err = _run(W.main, config + ["--no-progress"], capsys)
    assert rc_launch == rc_warmup == 2
    assert launch_err.removeprefix("mpfa launch: error: ") == warmup_err.removeprefix("mpfa warmup: error: ")


def test_launch_help_mentions_double_dash_for_sglang_arguments():
    r = subprocess.run([sys.executable, "-m", "mpfa.sglang.launch", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0
    assert "[-- SGLANG_ARGS ...]" in r.stdout and "Arguments after -- go to python -m sglang.launch_server" in r.stdout


def test_warmup_cli_bad_usage_through_the_interpreter(tmp_path):
    """The installed entry (python -m) prints the one line and exits 2, with no traceback."""
    env = {**os.environ, "MPFA_CUDA_ARCH": ARCH, "MPFA_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "mpfa.sglang.warmup", "--num-qo-heads", "32", "--num-kv-heads", "8",
                        "--head-dim", "256", "--page-size", "16"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == ["mpfa warmup: error: --attention-backend mpfa cannot serve this model: head_dim "
                                     "256 is not supported: the kernels are built for head_dim "
                                     "[64, 128]"]


def test_log_lines_go_above_the_progress_bar():
    """A build's log line while the bar is shown ends up on a line of its own: the bar is cleared first and
    redrawn after (on a terminal, the text after the last carriage return of a line is what shows)."""
    stream = io.StringIO()
    logger = logging.getLogger("mpfa_jit.test_bar")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.handlers = [logging.StreamHandler(stream)]
    bar = tqdm(total=3, desc="mpfa warmup", file=stream, mininterval=0)
    from mpfa_jit.warmup import logs_above
    with logs_above(bar, logger):
        bar.update(1)
        logger.info("mpfa_jit: built decode_x in 1.0 s")
        bar.update(1)
    bar.close()
    assert len(logger.handlers) == 1 and isinstance(logger.handlers[0], logging.StreamHandler)   # restored
    shown = [line.split("\r")[-1].strip() for line in stream.getvalue().split("\n")]
    assert "mpfa_jit: built decode_x in 1.0 s" in shown


def _fake_failing_nvcc(tmp_path) -> str:
    """A compiler that reports a version and then fails every compile (a build failure without a broken kernel)."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'Cuda compilation tools, release 13.0, V13.0.0'; "
                    "exit 0; fi\necho 'kernel.cu(1): error: this compiler fails on purpose' >&2\nexit 1\n")
    nvcc.chmod(0o755)
    return str(nvcc)


def test_failed_build_exits_1(tmp_path, clean_env, capsys):
    clean_env.setenv("MPFA_NVCC", _fake_failing_nvcc(tmp_path))
    clean_env.setenv("MPFA_CACHE_DIR", str(tmp_path / "cache"))
    rc, out, err = _run(W.main, [str(DEFAULT), "--no-progress", "--jobs", "2"], capsys)
    assert rc == 1
    assert "0 of 3 ready" in out and out.count("FAILED") == 3
    assert "fails on purpose" in err
    # --no-progress: the build log lines arrive as plain lines, not as logging errors of a disabled bar
    assert "mpfa_jit: building" in err and "Logging error" not in err and "Traceback" not in err


def test_warmup_refuses_a_cache_dir_that_is_not_a_cache(tmp_path, clean_env, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    clean_env.setenv("MPFA_CACHE_DIR", str(tmp_path))
    rc, out, err = _run(W.main, [str(DEFAULT), "--no-progress"], capsys)
    assert rc == 2 and "is not an mpfa kernel cache" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def _writable(folder: Path) -> bool:
    try:
        (folder / "probe").write_text("")
    except OSError:
        return False
    (folder / "probe").unlink()
    return True


def _warmup_subprocess(cache: Path, limit_file_size: bool = False):
    """The warmup CLI on one real configuration with MPFA_CACHE_DIR=cache; ``limit_file_size``: no file it writes
    may hold a byte (RLIMIT_FSIZE 0, a full disk as the superuser sees one; Python ignores SIGXFSZ, so a write
    fails with EFBIG)."""
    import resource
    env = {**os.environ, "MPFA_CUDA_ARCH": ARCH, "MPFA_CACHE_DIR": str(cache)}
    limit = (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))) if limit_file_size else None
    return subprocess.run([sys.executable, "-m", "mpfa.sglang.warmup", "--num-qo-heads", "32", "--num-kv-heads", "8",
                           "--head-dim", "128", "--page-size", "16", "--no-progress"], capture_output=True, text=True,
                          env=env, timeout=120, preexec_fn=limit)


@pytest.mark.parametrize("how", ["read-only", "full"])
def test_warmup_on_a_cache_dir_it_cannot_write_is_one_line_exit_1(how, tmp_path):
    """An empty MPFA_CACHE_DIR that cannot be written: the marker write was an OSError traceback. It is failed
    work, not bad usage (the arguments are fine): exit 1, one line naming the folder."""
    cache = tmp_path / "cache"
    cache.mkdir()
    if how == "read-only":
        cache.chmod(0o555)
        if _writable(cache):
            cache.chmod(0o755)
            pytest.skip("permissions do not bind this user (root): the 'full' case covers the unwritable cache")
    try:
        r = _warmup_subprocess(cache, limit_file_size=how == "full")
    finally:
        cache.chmod(0o755)
    assert r.returncode == 1 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpfa warmup: error: ") and str(cache) in lines[0], r.stderr


@pytest.mark.nvcc
def test_ctrl_c_exits_130_with_one_line(tmp_path, fake_nvcc):
    """SIGINT to the process group (what a terminal's Ctrl-C sends) mid-build: exit 130, one line, no traceback.
    The build is the stand-in nvcc's, which waits until interrupted: the signal always lands mid-build, however
    slow or fast the machine (a real compile of a few seconds could finish before the signal on a loaded one)."""
    env = {**os.environ, "MPFA_CUDA_ARCH": ARCH, "MPFA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mpfa.sglang.warmup", str(DEFAULT), "--no-progress", "--jobs", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                            preexec_fn=fake_nvcc.default_sigint)
    try:
        fake_nvcc.wait_compiling(proc, timeout=120)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("mpfa warmup: interrupted; kernels already built stay cached, run it "
                                            "again to finish")


def test_server_config_shapes():
    """What the warmup reads from each server config: the model's heads per GPU and the settings."""
    llama = load_server_config(DEFAULT)
    settings, facts, what = W.server_plan(W.parse_args([str(DEFAULT)]), environ={})
    assert (facts["num_qo_heads"], facts["num_kv_heads"], facts["head_dim"]) == (32, 8, 128)
    assert (settings.recipe, settings.page_size, settings.compensation) == ("qk4pv8", 16, True)
    assert what == str(llama.path) and llama.model_dir == LLAMA.resolve()
    qwen = ROOT / "server_configs/qwen3-14b-qk4pv8.yaml"
    _, facts, _ = W.server_plan(W.parse_args([str(qwen)]), environ={})
    assert (facts["num_qo_heads"], facts["num_kv_heads"], facts["head_dim"]) == (40, 8, 128)
    _, facts, _ = W.server_plan(W.parse_args(["--model-path", str(LLAMA), "--tp-size", "2", "--page-size", "16"]),
                                environ={})
    assert (facts["num_qo_heads"], facts["num_kv_heads"]) == (16, 4)
    with pytest.raises(MpfaConfigError):
        W.server_plan(W.parse_args(["--model-path", str(LLAMA)]), environ={})   # no page size anywhere


@pytest.mark.parametrize("sglang,tp", [
    ("{page-size: 16, tensor-parallel-size: 2}", 2),                            # SGLang's long spelling
    ("{page-size: 16, tp-size: 4, dp-size: 2, enable-dp-attention: true}", 2),  # attention TP = tp / dp
    ("{page-size: 16, tp-size: 4, dp-size: 2}", 4),                             # dp without dp-attention
    ("{page-size: 16, tp-size: 8, data-parallel-size: 4, enable-dp-attention: true}", 2),   # dp's long spelling
    ("{page-size: 16, tp-size: 4, dp-size: 2, enable-dp-attention: 'false'}", 4),            # a boolean as text
])
def test_server_config_reads_the_attention_tp_size(sglang, tp, tmp_path):
    """The heads a GPU serves follow SGLang's attention tensor-parallel size: warmup and the launcher must
    split them the same way the server does."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {LLAMA}\nsglang: {sglang}\nmpfa: {{recipe: qk4pv8}}\n")
    assert load_server_config(cfg).tp_size == tp
    both = tmp_path / "both.yaml"
    both.write_text(f"model: {LLAMA}\nsglang: {{page-size: 16, tp-size: 2, tensor-parallel-size: 2}}\n")
    with pytest.raises(MpfaConfigError, match="one setting"):
        load_server_config(both)
