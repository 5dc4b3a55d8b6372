"""The SGLang plugin on the CPU, without SGLang and without mocks of it: the installed entry point, the
settings precedence, the launch command, the unsupported-model checks, the page-table builder, and the
names the plugin imports against what SGLang 0.5.17 / 0.5.23 define (recorded from their sources in
python/mpfa/sglang/sglang_api.json). What needs the real ``sglang.srt`` is skipped with the reason."""
import importlib.metadata
import importlib.util
import json
import shlex
from pathlib import Path

import pytest
import torch

from mpfa.sglang import compat, launch as L, model as M, settings as S
from mpfa.sglang.page_table import KVLayoutError, build_page_table, check_extend_slots, page_table_capacity

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "server_configs"
DEFAULT = CONFIGS / "llama-3.1-8b-qk4pv8.yaml"
API = json.loads((ROOT / "python/mpfa/sglang/sglang_api.json").read_text())


def _plugin_source():
    """plugin.py's name lists, read without importing SGLang (the module imports it only in register())."""
    spec = importlib.util.find_spec("mpfa.sglang.plugin")
    assert spec is not None
    import mpfa.sglang.plugin as plugin
    return plugin


# --- entry point -------------------------------------------------------------------------------------------------

def test_entry_point_installed():
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    mine = [ep for ep in eps if ep.name == "mpfa"]
    assert mine, ("no 'mpfa' entry point in group sglang.srt.plugins: run `pip install -e .` "
                  f"(found {[ep.name for ep in eps]})")
    assert mine[0].value == "mpfa.sglang.plugin:register"
    assert mine[0].dist is not None and mine[0].dist.name == "mpfa"
    fn = mine[0].load()          # importing the plugin module must not need SGLang
    assert callable(fn) and fn.__name__ == "register"


def test_plugin_module_does_not_import_sglang():
    import sys
    import mpfa.sglang.plugin  # noqa: F401
    import mpfa.sglang.settings  # noqa: F401
    import mpfa.sglang.model  # noqa: F401
    import mpfa.sglang.kernels  # noqa: F401
    import mpfa.sglang.launch  # noqa: F401
    if importlib.util.find_spec("sglang") is None:
        assert "sglang" not in sys.modules


# --- static compatibility: the names we use exist in 0.5.17 and 0.5.23 -------------------------------------------

def _recorded():
    return {(e["module"], e["name"]): e for e in API["names"]}


def test_every_sglang_name_is_recorded_for_both_versions():
    plugin = _plugin_source()
    rec = _recorded()
    used = list(plugin.SGLANG_NAMES) + list(plugin.RUNTIME_NAMES)
    used += [(t.rsplit(".", 2)[0], ".".join(t.rsplit(".", 2)[1:])) for t in plugin.HOOK_TARGETS]
    for key in used:
        assert key in rec, f"{key} is used by the plugin but not recorded in sglang_api.json"
        for version in ("0.5.17", "0.5.23"):
            where = rec[key][version]
            assert where, f"{key[0]}.{key[1]} is not defined in SGLang {version}"
            assert where["file"].startswith("python/sglang/") and where["line"] > 0


def test_registration_names_are_the_design_ones():
    # SGLang registers a plugin through these two names alone (docs/sglang.md); 0.5.23 still exports them.
    plugin = _plugin_source()
    assert ("sglang.srt.server_args", "add_attention_backend_choices") in plugin.SGLANG_NAMES
    assert ("sglang.srt.layers.attention.attention_registry", "register_attention_backend") in plugin.SGLANG_NAMES
    assert plugin.ENTRY_POINT_GROUP == "sglang.srt.plugins"
    rec = _recorded()
    assert rec[("sglang.srt.plugins", "GENERAL_PLUGINS_GROUP")]["0.5.23"]["text"].endswith('"sglang.srt.plugins"')


def test_cuda_graph_contract_is_0_5_17s():
    plugin = _plugin_source()
    rec = _recorded()
    for name in plugin.GRAPH_METHODS:
        assert rec[("sglang.srt.layers.attention.base_attn_backend", f"AttentionBackend.{name}")]["0.5.17"]


def test_missing_sglang_name_is_a_clear_error():
    with pytest.raises(compat.SGLangCompatError, match=r"mpfa_no_such_module.*SGLang .*tested with SGLang 0\.5\.17"):
        compat.sglang_attr("mpfa_no_such_module", "x")
    with pytest.raises(compat.SGLangCompatError, match=r"json\.no_such_name.*SGLang"):
        compat.sglang_attr("json", "no_such_name")


def test_no_import_circle_in_the_sglang_package():
    """backend, pool and plugin share the SGLang lookups through compat, never each other."""
    import ast
    pkg = ROOT / "python/mpfa/sglang"
    imports = {}
    for f in pkg.glob("*.py"):
        tree = ast.parse(f.read_text())
        imports[f.stem] = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module}

    def reaches(start, target, seen=()):
        return any(m == target or (m not in seen and reaches(m, target, seen + (m,))) for m in imports.get(start, ()))
    circles = sorted(m for m in imports if reaches(m, m))
    assert not circles, f"modules of mpfa.sglang that import themselves through others: {circles}"


class _Args:
    def __init__(self, attention_backend=None, prefill=None, decode=None):
        self.attention_backend, self.prefill_attention_backend, self.decode_attention_backend = \
            attention_backend, prefill, decode


def test_mpfa_selected():
    plugin = _plugin_source()
    assert plugin.mpfa_selected(_Args("mpfa"))
    assert not plugin.mpfa_selected(_Args("flashinfer"))
    assert plugin.mpfa_selected(_Args("flashinfer", "mpfa", "mpfa"))
    with pytest.raises(S.MpfaConfigError, match="both be mpfa"):
        plugin.mpfa_selected(_Args("mpfa", prefill="flashinfer"))


# --- settings precedence -----------------------------------------------------------------------------------------

def test_defaults():
    s = S.resolve_settings(server_page_size=16, env={})
    assert (s.recipe, s.compensation, s.page_size, s.kernel_backend) == ("qk4pv8", True, 16, "auto")
    assert s.sources["page_size"] == "sglang --page-size" and s.sources["recipe"] == "default"


def _yaml(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_env_overrides_yaml_overrides_default(tmp_path):
    y = S.load_server_config(_yaml(tmp_path, "model: m\nsglang: {page-size: 16}\nmpfa: {recipe: qk8pv8, compensation: false}\n"))
    s = S.resolve_settings(server_page_size=16, env={}, config=y)
    assert (s.recipe, s.compensation) == ("qk8pv8", False) and s.sources["recipe"] == f"yaml {y.path}"
    assert s.sources["page_size"] == f"yaml {y.path}"
    s = S.resolve_settings(server_page_size=16, env={"MPFA_RECIPE": "bf16", "MPFA_COMPENSATION": "on"}, config=y)
    assert (s.recipe, s.compensation) == ("bf16", True) and s.sources["recipe"] == "env MPFA_RECIPE"
    # MPFA_CONFIG names the YAML the scheduler processes read
    s = S.resolve_settings(server_page_size=16, env={"MPFA_CONFIG": str(CONFIGS / "llama-3.1-8b-qk8pv8.yaml")})
    assert s.recipe == "qk8pv8" and s.sources["recipe"].startswith("yaml ")
    s = S.resolve_settings(server_page_size=16, env={"MPFA_CONFIG": str(DEFAULT), "MPFA_RECIPE": "bf16"})
    assert s.recipe == "bf16"
    s = S.resolve_settings(server_page_size=16, env={"MPFA_RECIPE": ""}, config=y)   # empty = unset
    assert s.recipe == "qk8pv8"


def test_page_size_must_match_sglang():
    assert S.resolve_settings(server_page_size=32, env={"MPFA_PAGE_SIZE": "32"}).page_size == 32
    with pytest.raises(S.MpfaConfigError, match=r"page size 16 \(from env MPFA_PAGE_SIZE\) differs from SGLang's --page-size 32"):
        S.resolve_settings(server_page_size=32, env={"MPFA_PAGE_SIZE": "16"})
    with pytest.raises(S.MpfaConfigError, match=r"SGLang --page-size.*one of \[1, 16, 32, 64\], got 8"):
        S.resolve_settings(server_page_size=8, env={})
    with pytest.raises(S.MpfaConfigError, match="no page size"):
        S.resolve_settings(env={})


@pytest.mark.parametrize("env, match", [
    ({"MPFA_RECIPE": "fp4"}, r"MPFA_RECIPE must be one of \['bf16', 'qk8pv8', 'qk4pv8', 'qk4pv4'\], got 'fp4'"),
    ({"MPFA_COMPENSATION": "maybe"}, r"MPFA_COMPENSATION must be a boolean"),
    ({"MPFA_PAGE_SIZE": "sixteen"}, r"MPFA_PAGE_SIZE must be one of"),
    ({"MPFA_KERNEL_BACKEND": "cuda"}, r"MPFA_KERNEL_BACKEND must be one of \['auto', 'reference'\]"),
    ({"MPFA_CONFIG": "/nonexistent/x.yaml"}, r"no such server config file"),
])
def test_bad_settings(env, match):
    with pytest.raises(S.MpfaConfigError, match=match):
        S.resolve_settings(server_page_size=16, env=env)


@pytest.mark.parametrize("text, match", [
    ("model: m\nmpfa: {recipe: qk4pv8, recipie: bf16}\n", r"unknown keys in the mpfa section: \['recipie'\]"),
    ("model: m\nsglang: {page-size: 16}\nmpfa: {page_size: 16}\n",
     r"mpfa.page_size: state the page size once, as sglang.page-size"),
    ("model: m\nsglang: {page-size: 12}\n", r"sglang.page-size must be one of \[1, 16, 32, 64\], got 12"),
    ("model: m\nsglang: {tp-size: 0}\n", r"sglang.tp-size must be a positive integer, got 0"),
    ("model: m\nmpfa: {recipe: fp4}\n", r"mpfa.recipe must be one of \['bf16', 'qk8pv8', 'qk4pv8', 'qk4pv4'\], got 'fp4'"),
    ("model: m\nmpfa: {compensation: maybe}\n", r"mpfa.compensation must be a boolean"),
    ("sglang: {page-size: 16}\n", r"missing 'model'"),
    ("model: m\nmodle: x\n", r"unknown top-level keys \['modle'\]"),
    ("model: m\nsglang: [page-size, 16]\n", r"sglang must be a mapping"),
    ("model: m\nsglang: {page-size: 16\n", r"not valid YAML at line 3, column 1 .*: fix the syntax"),
    # every sglang: key is passed to SGLang as --key: one SGLang does not take fails the server, or (misspelled)
    # leaves the setting mpfa reads at its default
    ("model: m\nsglang: {tp-szie: 2}\n", r"sglang.tp-szie is not a flag of python -m sglang.launch_server \(SGLang "
                                          r"0\.5\.17\); did you mean sglang.tp-size\?"),
    ("model: m\nsglang: {page_szie: 16}\n", r"sglang.page-szie is not a flag .*did you mean sglang.page-size\?"),
    ("model: m\nsglang: {flux-capacitor: 1}\n", r"sglang.flux-capacitor is not a flag of python -m "
                                                 r"sglang.launch_server \(SGLang 0\.5\.17\)$"),
    ("model: m\nsglang: {attention-backend: flashinfer}\n", r"sglang.attention-backend is 'flashinfer'"),
    ("model: m\nsglang: {prefill-attention-backend: fa3}\n", r"sglang.prefill-attention-backend must be mpfa"),
    ("model: m\nsglang: {model-path: /x}\n", r"give the model as the top-level 'model' key, not sglang.model-path"),
    # SGLang 0.5.17 asserts tp_size % dp_size == 0 with DP attention (server_args.py, _handle_data_parallelism)
    ("model: m\nsglang: {tp-size: 8, dp-size: 3, enable-dp-attention: true}\n",
     r"sglang.dp-size 3 must divide sglang.tp-size 8 with sglang.enable-dp-attention"),
    ("model: m\nsglang: {tp-size: 2, data-parallel-size: 4, enable-dp-attention: on}\n",
     r"sglang.dp-size 4 must divide sglang.tp-size 2"),
    ("model: m\nsglang: {dp-size: 0}\n", r"sglang.dp-size must be a positive integer, got 0"),
    ("model: m\nsglang: {enable-dp-attention: sometimes}\n", r"sglang.enable-dp-attention must be a boolean"),
])
def test_bad_server_config(tmp_path, text, match):
    with pytest.raises(S.MpfaConfigError, match=r"c\.yaml: .*" + match):
        S.load_server_config(_yaml(tmp_path, text))


@pytest.mark.parametrize("section, tp", [("{tp-size: 8, dp-size: 4, enable-dp-attention: true}", 2),
                                         ("{tp-size: 8, dp-size: 3}", 8),
                                         ("{tp-size: 8, dp-size: 8, enable-dp-attention: true}", 1)])
def test_dp_attention_that_sglang_accepts(section, tp, tmp_path):
    """dp-size dividing tp-size is what SGLang runs; without enable-dp-attention dp-size replicates whole servers."""
    assert S.load_server_config(_yaml(tmp_path, f"model: m\nsglang: {section}\n")).tp_size == tp


def test_the_recorded_sglang_flags_are_0_5_17s_server_args():
    """The list load_server_config checks keys against (sglang_api.json, read from SGLang 0.5.17's
    server_args.py): what mpfa's configs and launcher use is in it, and it is the whole parser, not a sample."""
    flags = S.sglang_flags()
    assert flags == frozenset(API["launch_server_flags"]["0.5.17"])
    used = {"page-size", "tp-size", "tensor-parallel-size", "dp-size", "data-parallel-size", "enable-dp-attention",
            "attention-backend", "prefill-attention-backend", "decode-attention-backend", "model-path",
            "disable-prefill-cuda-graph", "port", "host"}
    assert used <= flags
    for path in CONFIGS.glob("*.yaml"):
        assert set(S.load_server_config(path).sglang) <= flags
    assert len(flags) > 400 and not any(f.startswith("-") or "_" in f for f in flags)


def test_every_server_config_states_the_page_size_once():
    for path in CONFIGS.glob("*.yaml"):
        cfg = S.load_server_config(path)   # raises if the mpfa section states it too
        assert cfg.page_size == 16 and "page_size" not in cfg.mpfa


def test_cell_size():
    # bytes per token per layer = num_kv_heads * recipe.bytes_per_token_head(head_dim)
    for recipe, per_head in (("bf16", 512), ("qk8pv8", 260), ("qk4pv8", 232)):
        s = S.resolve_settings(server_page_size=16, env={"MPFA_RECIPE": recipe})
        assert s.bytes_per_token_layer(8, 128) == 8 * per_head


# --- launch command ----------------------------------------------------------------------------------------------

def test_launch_command_default_config():
    plan = L.build_launch(DEFAULT, env={}, python="python")
    a = plan.argv
    assert a[:3] == ["python", "-m", "sglang.launch_server"]
    assert a[a.index("--model-path") + 1] == str((CONFIGS / "models/llama-3.1-8b").resolve())
    assert Path(a[a.index("--model-path") + 1]).is_absolute()
    assert a[a.index("--attention-backend") + 1] == "mpfa" and a.count("--attention-backend") == 1
    assert a[a.index("--page-size") + 1] == "16" and a.count("--page-size") == 1
    assert a[a.index("--load-format") + 1] == "dummy"
    assert "--skip-tokenizer-init" in a
    # the prefill CUDA graph is the plugin's decision in the server (MPFA_CONFIG names the YAML it reads)
    assert not any("prefill-cuda-graph" in x or "cuda-graph-backend" in x for x in a)
    assert a[a.index("--context-length") + 1] == "131072"
    assert plan.env == {"MPFA_CONFIG": str(DEFAULT.resolve()), "MPFA_RECIPE": "qk4pv8", "MPFA_COMPENSATION": "1",
                        "MPFA_PAGE_SIZE": "16", "MPFA_KERNEL_BACKEND": "auto", "HF_HUB_OFFLINE": "1"}
    assert shlex.split(plan.shell())[-len(a):] == a


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_server_config_launches(path):
    plan = L.build_launch(path, env={})
    assert plan.settings.recipe == plan.config.mpfa["recipe"] and plan.settings.page_size == plan.config.page_size


def test_launch_env_precedence_and_extra_args():
    plan = L.build_launch(DEFAULT, env={"MPFA_RECIPE": "bf16", "MPFA_PAGE_SIZE": "32", "SGLANG_PLUGINS": "other"},
                          extra_args=["--port", "30001"])
    assert plan.env["MPFA_RECIPE"] == "bf16" and plan.env["MPFA_PAGE_SIZE"] == "32"
    assert plan.argv[plan.argv.index("--page-size") + 1] == "32"
    assert plan.argv[-2:] == ["--port", "30001"]
    assert plan.env["SGLANG_PLUGINS"] == "other,mpfa"


def test_launch_rejects_other_backend(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m/config.json").write_text((CONFIGS / "models/llama-3.1-8b/config.json").read_text())
    p = tmp_path / "c.yaml"
    p.write_text("model: m\nsglang: {attention-backend: flashinfer, page-size: 16}\nmpfa: {recipe: bf16}\n")
    with pytest.raises(S.MpfaConfigError, match="serves --attention-backend mpfa"):
        L.build_launch(p, env={})
    p.write_text("model: m\nsglang: {page-size: 16, disable-prefill-cuda-graph: false}\n")
    assert "--disable-prefill-cuda-graph" not in L.build_launch(p, env={}).argv   # the YAML's choice wins
    assert S.resolve_prefill_cuda_graph(env={}, config=S.load_server_config(p))[0] is True   # ... in the plugin too
    p.write_text("model: m\nsglang: {page-size: 16, disable-prefill-cuda-graph: true}\n")
    assert "--disable-prefill-cuda-graph" in L.build_launch(p, env={}).argv


def test_launch_refuses_a_bad_prefill_graph_setting():
    with pytest.raises(S.MpfaConfigError, match="MPFA_PREFILL_CUDA_GRAPH must be a boolean"):
        L.build_launch(DEFAULT, env={"MPFA_PREFILL_CUDA_GRAPH": "sometimes"})


def test_launch_cli_print(capsys):
    from mpfa.sglang.launch import main
    assert main([str(DEFAULT), "--print", "--", "--port", "3"]) == 0
    out = capsys.readouterr().out
    assert "MPFA_RECIPE=qk4pv8" in out and "-m sglang.launch_server" in out and out.strip().endswith("--port 3")
    assert main(["/nonexistent.yaml", "--print"]) == 2


def test_sglang_args():
    assert L.sglang_args({"a-b": 1, "c_d": True, "e": False, "f": None, "g": [1, 2]}) == \
        ["--a-b", "1", "--c-d", "--g", "1", "2"]


# --- unsupported models (pure functions) -------------------------------------------------------------------------

OK = dict(head_dim=128, num_qo_heads=32, num_kv_heads=8, page_size=16, recipe="qk4pv8")


def test_supported_shapes():
    M.check_model_supported(**OK)
    M.check_model_supported(**{**OK, "head_dim": 64, "num_qo_heads": 9, "num_kv_heads": 3})   # SmolLM2
    M.check_model_supported(**{**OK, "sliding_window": -1, "logit_cap": 0.0, "attn_type": "decoder"})


@pytest.mark.parametrize("change, match", [
    ({"head_dim": 256}, r"head_dim 256 is not supported: the kernels are built for head_dim \[64, 128\]"),
    ({"head_dim": 96}, r"head_dim 96"),
    ({"sliding_window": 4096}, r"sliding-window attention \(window 4096\)"),
    ({"logit_cap": 50.0}, r"attention logit soft cap \(50.0\)"),
    ({"use_mla": True}, r"multi-head latent attention"),
    ({"is_cross_attention": True}, r"cross attention"),
    ({"is_encoder_decoder": True}, r"cross attention"),
    ({"attn_type": "encoder_only"}, r"attention type 'encoder_only'"),
    ({"hybrid": "Mamba"}, r"hybrid architecture \(Mamba\)"),
    ({"v_head_dim": 64}, r"V head_dim 64 differs"),
    ({"num_qo_heads": 12}, r"num_qo_heads 12 must be a positive multiple of num_kv_heads 8"),
    ({"num_qo_heads": 80}, r"GQA group size 10"),
    ({"page_size": 8}, r"page size 8"),
    ({"recipe": "fp4"}, r"recipe 'fp4'"),
])
def test_unsupported(change, match):
    with pytest.raises(M.UnsupportedModelError, match="--attention-backend mpfa cannot serve this model: " + match):
        M.check_model_supported(**{**OK, **change})


def test_hf_configs():
    llama = json.loads((CONFIGS / "models/llama-3.1-8b/config.json").read_text())
    qwen = json.loads((CONFIGS / "models/qwen3-14b/config.json").read_text())
    assert M.check_hf_config(llama, page_size=16, recipe="qk4pv8")["num_kv_heads"] == 8
    assert M.check_hf_config(qwen, page_size=16, recipe="qk4pv8")["num_qo_heads"] == 40
    assert M.check_hf_config(llama, page_size=16, recipe="bf16", tp_size=2)["num_kv_heads"] == 4
    mistral = {**llama, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    with pytest.raises(M.UnsupportedModelError, match=r"model \(MistralForCausalLM\).*sliding-window"):
        M.check_hf_config(mistral, page_size=16, recipe="qk4pv8")
    gemma2 = {**llama, "architectures": ["Gemma2ForCausalLM"], "head_dim": 256, "attn_logit_softcapping": 50.0}
    with pytest.raises(M.UnsupportedModelError, match="Gemma2ForCausalLM"):
        M.check_hf_config(gemma2, page_size=16, recipe="qk4pv8")
    deepseek = {**llama, "kv_lora_rank": 512}
    with pytest.raises(M.UnsupportedModelError, match="latent attention"):
        M.check_hf_config(deepseek, page_size=16, recipe="qk4pv8")
    qwen_window_off = {**qwen, "sliding_window": 4096, "use_sliding_window": False}
    assert M.check_hf_config(qwen_window_off, page_size=16, recipe="qk4pv8")["num_qo_heads"] == 40


@pytest.mark.parametrize("change, match", [
    ({"sliding_window": "abc"}, r"sliding_window must be an integer or absent, got 'abc'"),
    ({"sliding_window": 4096.5}, r"sliding_window must be an integer or absent, got 4096\.5"),
    ({"head_dim": 128.0}, r"head_dim must be a positive integer or absent, got 128\.0"),
    ({"head_dim": "128"}, r"head_dim must be a positive integer or absent, got '128'"),
    ({"v_head_dim": "128"}, r"v_head_dim must be an integer or absent, got '128'"),
    ({"num_key_value_heads": 8.0}, r"num_key_value_heads must be an integer or absent, got 8\.0"),
    ({"num_key_value_heads": -8}, r"num_key_value_heads must be a positive integer, got -8"),
    ({"num_attention_heads": True}, r"num_attention_heads must be a positive integer, got True"),
    ({"attn_logit_softcapping": "50"}, r"attn_logit_softcapping must be a number or absent, got '50'"),
    ({"layer_types": "full_attention"}, r"layer_types must be a list of strings or absent"),
])
def test_hf_config_field_of_the_wrong_type_names_file_and_key(change, match):
    """A config.json field of the wrong type was a ValueError from int() naming neither (the launcher printed a
    traceback), or was coerced (head_dim 128.5 served as 128)."""
    llama = json.loads((CONFIGS / "models/llama-3.1-8b/config.json").read_text())
    with pytest.raises(S.MpfaConfigError, match=r"^/m/config\.json: " + match):
        M.check_hf_config({**llama, **change}, page_size=16, recipe="qk4pv8", where="/m/config.json")


# --- page table from req_to_token ---------------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 16])
def test_page_table(page_size):
    gen = torch.Generator().manual_seed(0)
    num_pages, width_tokens = 64, 20 * page_size
    r2t = torch.zeros(6, width_tokens + 3, dtype=torch.int32)
    perm = torch.randperm(num_pages - 1, generator=gen) + 1          # page 0 is SGLang's padding page
    lens = [1, page_size * 3, page_size * 2 + 1 if page_size > 1 else 7, 0, 5]
    req_idx = [4, 1, 2, 0, 3]
    used, expect = 0, []
    for r, n in zip(req_idx, lens):
        pages = perm[used: used + -(-n // page_size)].tolist()
        used += len(pages)
        expect.append(pages)
        for t in range(n):
            r2t[r, t] = pages[t // page_size] * page_size + t % page_size
    max_pages = -(-r2t.shape[1] // page_size)
    indptr, indices, last = build_page_table(r2t, torch.tensor(req_idx), torch.tensor(lens), page_size, max_pages)
    assert indices.numel() == page_table_capacity(len(lens), max_pages)
    assert indptr.tolist() == [0] + torch.cumsum(torch.tensor([len(p) for p in expect]), 0).tolist()
    for b, pages in enumerate(expect):
        assert indices[indptr[b]: indptr[b + 1]].tolist() == pages
        n = lens[b]
        assert last[b] == (0 if n == 0 else n - (len(pages) - 1) * page_size)
    # static-shape reuse (the CUDA-graph path): fixed buffers, a smaller batch, stale entries overwritten
    cap = page_table_capacity(8, max_pages, num_pages)
    bufs = dict(indptr_out=torch.full((9,), -7, dtype=torch.int32), indices_out=torch.full((cap,), -7, dtype=torch.int32),
                last_page_len_out=torch.full((8,), -7, dtype=torch.int32))
    i2, x2, l2 = build_page_table(r2t, torch.tensor(req_idx[:2]), torch.tensor(lens[:2]), page_size, max_pages,
                                  indptr_out=bufs["indptr_out"][:3], indices_out=bufs["indices_out"],
                                  last_page_len_out=bufs["last_page_len_out"][:2])
    assert x2.data_ptr() == bufs["indices_out"].data_ptr()
    assert x2[: int(i2[-1])].tolist() == expect[0] + expect[1]
    assert bufs["indptr_out"][3:].tolist() == [-7] * 6


@pytest.mark.parametrize("page_size", [4, 16])
def test_extend_slots_off_the_paged_layout_are_refused_by_name(page_size):
    """SGLang's paged allocator puts token p of a request at offset p % page_size of its page; an extend batch
    whose new tokens sit elsewhere (the attention kit's non_monotonic_extend layout) is refused with the token,
    its slot and where the kernels would read it, instead of giving wrong attention."""
    gen = torch.Generator().manual_seed(3)
    r2t = torch.zeros(3, 8 * page_size, dtype=torch.int32)
    prefix, extend = [page_size + 1, 2], [2 * page_size - 1, page_size + 3]   # ragged, across page boundaries
    pages = (torch.randperm(16, generator=gen) + 1).tolist()
    positions, locs, req = [], [], [1, 2]
    for r, p0, n in zip(req, prefix, extend):
        mine = [pages.pop() for _ in range(-(-(p0 + n) // page_size))]
        for t in range(p0 + n):
            r2t[r, t] = mine[t // page_size] * page_size + t % page_size
        positions += list(range(p0, p0 + n))
        locs += [int(r2t[r, t]) for t in range(p0, p0 + n)]
    args = (torch.tensor(req), torch.tensor(extend), torch.tensor(positions))
    check_extend_slots(r2t, *args, torch.tensor(locs), page_size)   # the paged layout: accepted
    check_extend_slots(r2t, *args, torch.tensor(locs[::-1]), 1)      # page size 1: any slot is a page
    # two new tokens of request 2 swap slots (the allocator's pages, wrong offsets): refused, naming the first
    bad = list(locs)
    i, j = len(locs) - 3, len(locs) - 1
    bad[i], bad[j] = bad[j], bad[i]
    with pytest.raises(KVLayoutError, match=rf"extend token {i} \(request pool index 2, position {positions[i]}\)"):
        check_extend_slots(r2t, *args, torch.tensor(bad), page_size)
    # right offset, wrong page: refused too
    moved = list(locs)
    moved[0] = pages[0] * page_size + positions[0] % page_size
    with pytest.raises(KVLayoutError, match=f"--page-size {page_size}"):
        check_extend_slots(r2t, *args, torch.tensor(moved), page_size)


# --- what needs SGLang ---------------------------------------------------------------------------------------------

def test_register_with_real_sglang():
    pytest.importorskip("sglang.srt", reason="SGLang is not installed here (CI cannot install its CUDA stack); "
                                             "tests/gpu/test_sglang_gpu.py runs it on the H200")
    from sglang.srt import server_args
    from sglang.srt.layers.attention import attention_registry
    from sglang.srt.plugins.hook_registry import HookRegistry
    import mpfa.sglang.plugin as plugin
    plugin.register()
    plugin.register()   # idempotent
    assert server_args.ATTENTION_BACKEND_CHOICES.count("mpfa") == 1
    assert attention_registry.ATTENTION_BACKENDS["mpfa"] is plugin.create_backend
    for target in plugin.HOOK_TARGETS:
        assert sum(1 for _, h, _ in HookRegistry._hooks[target] if h.__module__ == plugin.__name__) == 1


def test_the_pool_hooks_resolve_the_settings_once(monkeypatch):
    """Both KV-pool hooks of a scheduler process share one resolution (the backend then reads the pool's);
    a different environment is a different resolution."""
    from types import SimpleNamespace
    plugin = _plugin_source()
    for name in S.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    configurator = SimpleNamespace(page_size=16)   # the one attribute the hooks read for the settings
    first = plugin._settings_for(configurator)
    assert plugin._settings_for(configurator) is first and first.recipe == "qk4pv8"
    monkeypatch.setenv("MPFA_RECIPE", "bf16")
    assert plugin._settings_for(configurator).recipe == "bf16"
    monkeypatch.setenv("MPFA_PAGE_SIZE", "32")
    with pytest.raises(S.MpfaConfigError, match="differs from SGLang's --page-size 16"):
        plugin._settings_for(configurator)


# --- the plain command: ServerArgs hooks (page size, prefill CUDA graph) -------------------------------------------
# SGLang is not installed here: the hooks run on a stand-in ServerArgs holding the fields SGLang 0.5.17's
# ServerArgs has (server_args.py); _FakeServerArgs.__post_init__ calls its two steps in 0.5.17's order with
# 0.5.17's effects (_parse_cuda_graph_config: the flags, then SGLang's "breakable" default; _page_size_default:
# None -> 1), and _apply_around wraps a method as HookRegistry's AROUND does (hook(original, self, ...)).

class _ServerArgsFields:
    def __init__(self, attention_backend="mpfa", page_size=None, **kw):
        self.attention_backend, self.page_size = attention_backend, page_size
        self.prefill_attention_backend = self.decode_attention_backend = None
        self.disable_cuda_graph = self.disable_prefill_cuda_graph = False
        self.cuda_graph_backend_prefill = self.cuda_graph_config = None
        for k, v in kw.items():
            setattr(self, k, v)


class _FakeServerArgs(_ServerArgsFields):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.__post_init__()

    def __post_init__(self):
        self._handle_cuda_graph_config()
        self._handle_page_size()

    def _handle_cuda_graph_config(self):
        if self.cuda_graph_backend_prefill is not None:
            self.prefill_graph = self.cuda_graph_backend_prefill
        elif self.disable_cuda_graph or self.disable_prefill_cuda_graph:
            self.prefill_graph = "disabled"
        else:
            self.prefill_graph = "breakable"

    def _handle_page_size(self):
        if self.page_size is None:
            self.page_size = 1


def _apply_around(monkeypatch, cls, method, hook):
    original = getattr(cls, method)
    monkeypatch.setattr(cls, method, lambda self, *a, **k: hook(original, self, *a, **k))


@pytest.fixture
def hooked(monkeypatch):
    """_FakeServerArgs with mpfa's two ServerArgs hooks applied, in an environment without MPFA_* settings."""
    plugin = _plugin_source()
    for name in S.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    cls = type("ServerArgs", (_FakeServerArgs,), {})
    _apply_around(monkeypatch, cls, "_handle_cuda_graph_config", plugin.handle_cuda_graph_config_hook)
    _apply_around(monkeypatch, cls, "_handle_page_size", plugin.handle_page_size_hook)
    return cls


def _mpfa_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("mpfa:")]


def test_served_page_size():
    assert S.DEFAULT_PAGE_SIZE == 16 and S.DEFAULT_PAGE_SIZE in S.PAGE_SIZES
    assert S.served_page_size(env={}) == (16, "default")
    assert S.served_page_size(env={"MPFA_PAGE_SIZE": "32"}) == (32, "env MPFA_PAGE_SIZE")
    cfg = S.load_server_config(CONFIGS / "llama-3.1-8b-qk8pv8.yaml")
    assert S.served_page_size(env={"MPFA_CONFIG": str(cfg.path)}) == (cfg.page_size, f"yaml {cfg.path}")
    assert S.served_page_size(env={"MPFA_CONFIG": str(cfg.path), "MPFA_PAGE_SIZE": "64"})[0] == 64
    with pytest.raises(S.MpfaConfigError, match=r"MPFA_PAGE_SIZE must be one of \[1, 16, 32, 64\], got '8'"):
        S.served_page_size(env={"MPFA_PAGE_SIZE": "8"})


def test_plain_command_serves_page_size_16_and_logs_it(hooked, caplog):
    caplog.set_level("INFO", logger="mpfa.sglang.plugin")
    args = hooked()
    assert args.page_size == 16
    lines = [m for m in _mpfa_lines(caplog) if "page size" in m]
    assert len(lines) == 1 and lines[0].startswith("mpfa: --page-size not given; serving page size 16 "
                                                   "(mpfa decodes fastest there"), lines


@pytest.mark.parametrize("page", [1, 16, 32, 64])
def test_a_given_page_size_is_left_alone(hooked, caplog, page):
    caplog.set_level("INFO", logger="mpfa.sglang.plugin")
    assert hooked(page_size=page).page_size == page
    assert not [m for m in _mpfa_lines(caplog) if "page size" in m]


def test_page_size_from_mpfa_settings(hooked, caplog, monkeypatch, tmp_path):
    caplog.set_level("INFO", logger="mpfa.sglang.plugin")
    monkeypatch.setenv("MPFA_PAGE_SIZE", "32")
    assert hooked().page_size == 32
    assert "serving page size 32 (from env MPFA_PAGE_SIZE)" in "\n".join(_mpfa_lines(caplog))
    monkeypatch.delenv("MPFA_PAGE_SIZE")
    y = _yaml(tmp_path, "model: m\nsglang: {page-size: 64}\n")
    monkeypatch.setenv("MPFA_CONFIG", str(y))
    assert hooked().page_size == 64
    monkeypatch.setenv("MPFA_PAGE_SIZE", "bad")
    with pytest.raises(S.MpfaConfigError, match="MPFA_PAGE_SIZE must be one of"):
        hooked()


@pytest.mark.parametrize("backends", [dict(attention_backend="flashinfer"), dict(attention_backend="fa3"),
                                      dict(attention_backend=None),
                                      dict(attention_backend="mpfa", decode_attention_backend="flashinfer"),
                                      dict(attention_backend="fa3", prefill_attention_backend="mpfa")])
def test_other_backends_are_untouched(hooked, caplog, backends):
    """SGLang's own defaults for every other backend, a mix with mpfa included (the KV-pool hooks refuse it
    with their message when the pool is built; the ServerArgs hooks neither act nor raise)."""
    caplog.set_level("INFO", logger="mpfa.sglang.plugin")
    args = hooked(**backends)
    assert (args.page_size, args.prefill_graph, args.disable_prefill_cuda_graph) == (1, "breakable", False)
    assert _mpfa_lines(caplog) == []


def test_mpfa_named_for_prefill_and_decode_counts_as_mpfa(hooked):
    args = hooked(attention_backend=None, prefill_attention_backend="mpfa", decode_attention_backend="mpfa")
    assert args.page_size == 16 and args.prefill_graph == "disabled"


def test_page_size_hook_reads_sglangs_resolving_view(monkeypatch):
    """A page size SGLang declared for the model before _handle_page_size (0.5.17 keeps it in a stash that
    resolved_view overlays) is a page size given: the hook leaves it."""
    from types import SimpleNamespace
    plugin = _plugin_source()
    monkeypatch.setattr(plugin, "sglang_attr", lambda module, name: (
        lambda sa: SimpleNamespace(**{**vars(sa), "page_size": 64})))
    args, calls = _ServerArgsFields(), []
    plugin.handle_page_size_hook(lambda sa: calls.append(sa), args)
    assert args.page_size is None and calls == [args]   # SGLang's step then materializes its 64


def _set_policy(monkeypatch, on: bool):
    monkeypatch.setattr(S, "PREFILL_CUDA_GRAPH", dict.fromkeys(S.PREFILL_CUDA_GRAPH, on))


# (policy, disable_prefill_cuda_graph after the hook, the graph SGLang then derives, the start of the one log line)
_POLICY_LINES = [
    (False, True, "disabled", "mpfa: prefill CUDA graph off: mpfa turned SGLang's default prefill graph off (mpfa "
                              "prefill_cuda_graph policy off, mpfa's default for qk4pv8; MPFA_PREFILL_CUDA_GRAPH=1"),
    (True, False, "breakable", "mpfa: prefill CUDA graph on: SGLang's default prefill graph kept (mpfa "
                               "prefill_cuda_graph policy on, mpfa's default for qk4pv8)"),
]


@pytest.mark.parametrize("policy,disabled,graph,line", _POLICY_LINES, ids=["policy-off", "policy-on"])
def test_plain_command_prefill_graph_policy(policy, disabled, graph, line, hooked, caplog, monkeypatch):
    caplog.set_level("INFO", logger="mpfa.sglang.plugin")
    _set_policy(monkeypatch, policy)
    args = hooked()
    assert args.disable_prefill_cuda_graph is disabled and args.prefill_graph == graph
    lines = [m for m in _mpfa_lines(caplog) if m.startswith("mpfa: prefill CUDA graph")]
    assert len(lines) == 1 and lines[0].startswith(line), lines


def test_prefill_graph_default_is_the_served_recipes(hooked, monkeypatch, tmp_path):
    monkeypatch.setattr(S, "PREFILL_CUDA_GRAPH", {**dict.fromkeys(S.PREFILL_CUDA_GRAPH, False), "bf16": True})
    assert hooked().prefill_graph == "disabled"   # qk4pv8, mpfa's default recipe
    monkeypatch.setenv("MPFA_RECIPE", "bf16")
    assert hooked().prefill_graph == "breakable"
    monkeypatch.delenv("MPFA_RECIPE")
    monkeypatch.setenv("MPFA_CONFIG", str(_yaml(tmp_path, "model: m\nmpfa: {recipe: bf16}\n")))
    assert S.resolve_prefill_cuda_graph() == (True, "mpfa's default for bf16")
    assert hooked().prefill_graph == "breakable"


def test_prefill_graph_defaults_are_the_h200_ab():
    """Each recipe's default is the published A/B's keep_on (python -m benchmarks.e2e.prefill_graph_ab); a recipe
    the A/B has not run keeps the graph off."""
    measured = {}
    for path in sorted((ROOT / "benchmarks/results/studies").glob("prefill_graph_ab*_h200.json")):
        for recipe, r in json.loads(path.read_text())["summary"].items():
            assert recipe not in measured, f"{recipe} in two A/B files"
            measured[recipe] = r["keep_on"]
    assert measured, "no prefill-graph A/B published"
    assert S.PREFILL_CUDA_GRAPH == {r: measured.get(r, False) for r in S.PREFILL_CUDA_GRAPH}


@pytest.mark.parametrize("default", [False, True])
def test_prefill_graph_policy_overrides(hooked, monkeypatch, tmp_path, default):
    _set_policy(monkeypatch, default)
    for value, on in (("1", True), ("off", False)):
        monkeypatch.setenv("MPFA_PREFILL_CUDA_GRAPH", value)
        assert hooked().prefill_graph == ("breakable" if on else "disabled")
    monkeypatch.delenv("MPFA_PREFILL_CUDA_GRAPH")
    for text, on in (("mpfa: {prefill_cuda_graph: true}", True), ("mpfa: {prefill_cuda_graph: false}", False),
                     ("sglang: {disable-prefill-cuda-graph: false}", True)):
        monkeypatch.setenv("MPFA_CONFIG", str(_yaml(tmp_path, f"model: m\n{text}\n")))
        assert hooked().prefill_graph == ("breakable" if on else "disabled"), text
    monkeypatch.setenv("MPFA_PREFILL_CUDA_GRAPH", "maybe")
    with pytest.raises(S.MpfaConfigError, match="MPFA_PREFILL_CUDA_GRAPH must be a boolean"):
        hooked()


@pytest.mark.parametrize("default", [False, True])
@pytest.mark.parametrize("flags, graph, said", [
    (dict(cuda_graph_backend_prefill="breakable"), "breakable", "--cuda-graph-backend-prefill breakable"),
    (dict(cuda_graph_backend_prefill="disabled"), "disabled", "--cuda-graph-backend-prefill disabled"),
    (dict(disable_prefill_cuda_graph=True), "disabled", "--disable-prefill-cuda-graph"),
    (dict(disable_cuda_graph=True), "disabled", "--disable-cuda-graph"),
    (dict(cuda_graph_config={"prefill": {"backend": "breakable"}}), "breakable", "prefill backend breakable"),
    (dict(cuda_graph_config='{"prefill": {"backend": "breakable"}}'), "breakable", "prefill backend breakable"),
])
def test_a_configured_prefill_graph_is_left_alone(hooked, caplog, monkeypatch, flags, graph, said, default):
    caplog.set_level("INFO", logger="mpfa.sglang.plugin")
    _set_policy(monkeypatch, default)
    args = hooked(**flags)
    if "cuda_graph_config" in flags:   # the stand-in's parse ignores the JSON: what matters is mpfa's flag
        assert args.disable_prefill_cuda_graph is False
    else:
        assert args.prefill_graph == graph
    lines = [m for m in _mpfa_lines(caplog) if m.startswith("mpfa: prefill CUDA graph")]
    assert len(lines) == 1 and lines[0].startswith("mpfa: prefill CUDA graph as the command line sets it (") \
        and said in lines[0], lines


def test_cuda_graph_config_object_with_only_decode_settings_is_not_a_prefill_choice(hooked, monkeypatch):
    """SGLang's CudaGraphConfig.to_dict() holds the fields that differ from its defaults."""
    _set_policy(monkeypatch, False)

    class Cfg:
        def __init__(self, d):
            self.d = d

        def to_dict(self):
            return self.d
    assert hooked(cuda_graph_config=Cfg({"decode": {"max_bs": 64}})).disable_prefill_cuda_graph is True
    assert hooked(cuda_graph_config=Cfg({"prefill": {"backend": "tc_piecewise"}})).disable_prefill_cuda_graph is False


# --- register(): the ServerArgs hooks where SGLang has the methods, a warning where it does not ----------------------

class _FakeRegistry:
    registered: list = []

    @classmethod
    def register(cls, target, hook, hook_type):
        cls.registered.append((target, hook, hook_type))


def _fake_sglang(monkeypatch):
    from types import SimpleNamespace
    plugin = _plugin_source()
    _FakeRegistry.registered = []
    names = {"add_attention_backend_choices": lambda choices: None, "ATTENTION_BACKEND_CHOICES": ["mpfa"],
             "register_attention_backend": lambda name: (lambda fn: fn), "HookRegistry": _FakeRegistry,
             "HookType": SimpleNamespace(AROUND="around")}
    monkeypatch.setattr(plugin, "sglang_attr", lambda module, name: names[name])
    monkeypatch.setattr(plugin, "_registered", False)
    return plugin


def test_register_hooks_the_server_args_steps(monkeypatch):
    plugin = _fake_sglang(monkeypatch)
    monkeypatch.setattr(plugin, "_hook_target_exists", lambda target: True)
    plugin.register()
    hooks = {t: (h, ht) for t, h, ht in _FakeRegistry.registered}
    assert hooks["sglang.srt.server_args.ServerArgs._handle_page_size"] == (plugin.handle_page_size_hook, "around")
    assert hooks["sglang.srt.server_args.ServerArgs._handle_cuda_graph_config"] == \
        (plugin.handle_cuda_graph_config_hook, "around")
    assert set(hooks) == set(plugin.HOOK_TARGETS) | set(plugin.SERVER_ARGS_HOOK_TARGETS)


def test_register_without_the_server_args_steps_warns_and_goes_on(monkeypatch, caplog):
    """SGLang 0.5.23 has neither ServerArgs method (sglang_api.json): register() must not fail, must keep the
    KV-pool hooks, and must say what to pass instead."""
    caplog.set_level("INFO", logger="mpfa.sglang.plugin")
    plugin = _fake_sglang(monkeypatch)
    assert not plugin._hook_target_exists("mpfa_no_such_module.ServerArgs._handle_page_size")
    assert not plugin._hook_target_exists("json.JSONDecoder._no_such_method")
    monkeypatch.setattr(plugin, "_hook_target_exists", lambda target: "ServerArgs" not in target)
    plugin.register()
    assert [t for t, _, _ in _FakeRegistry.registered] == list(plugin.HOOK_TARGETS)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2
    assert any("ServerArgs._handle_page_size" in w and "pass --page-size 16" in w for w in warned), warned
    assert any("ServerArgs._handle_cuda_graph_config" in w and "--disable-prefill-cuda-graph" in w for w in warned)


def test_server_args_hooks_are_recorded_for_0_5_17_only():
    plugin = _plugin_source()
    rec = _recorded()
    keys = [(t.rsplit(".", 2)[0], ".".join(t.rsplit(".", 2)[1:])) for t in plugin.SERVER_ARGS_HOOK_TARGETS]
    assert keys == [("sglang.srt.server_args", "ServerArgs._handle_cuda_graph_config"),
                    ("sglang.srt.server_args", "ServerArgs._handle_page_size")]
    for key in keys + list(plugin.SERVER_ARGS_NAMES):
        assert key in rec, f"{key} is used by the plugin but not recorded in sglang_api.json"
        where = rec[key]["0.5.17"]
        assert where and where["file"].startswith("python/sglang/") and where["line"] > 0
    for key in keys:   # 0.5.23 resolves ServerArgs in sglang.srt.arg_groups.pipeline: register() warns
        assert rec[key]["0.5.23"] is None
