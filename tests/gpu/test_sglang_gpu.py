"""SGLang end to end with ``--attention-backend mpfa`` (H200, SGLang 0.5.17; skipped where SGLang is not
importable). Each server runs in a child process (``benchmarks.e2e.sglang_check.run_child``: an
``sglang.Engine`` that fails at startup kills its parent, which must not be pytest). It loads SmolLM2-135M
(server_configs/models/smollm2-135m: its real weights once ``python -m benchmarks.e2e.smollm2_hf`` has
converted them, else dummy weights from its config.json), takes input_ids and generates greedily with
ignore_eos. The agreement figures over 20 prompts are benchmarks.e2e.sglang_check's; these tests check
behaviour:

- the plugin registers in-process and the mpfa backend serves every recipe;
- the radix-cache pass (extend over cached prefix pages) repeats bf16's tokens exactly;
- decode CUDA graphs on and off give the same tokens, for every recipe (the backend's split policy is
  batch-invariant);
- bf16's greedy tokens are flashinfer's argmax given the same prefix, up to the near-ties flashinfer itself
  resolves either way (teacher forcing; real weights only);
- the quantized pools hold the bytes-per-token ratio more tokens than bf16's at the same memory fraction;
- an unsupported page size fails at startup with a message naming it.
"""
import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu]

pytest.importorskip("sglang", reason="SGLang is not installed (pip install -e '.[sglang]' on the H200)")

from benchmarks.e2e import sglang_check as sc  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = (ROOT / "server_configs/models/smollm2-135m").resolve()
REAL_WEIGHTS = (MODEL_DIR / "model.safetensors").exists()
NEW_TOKENS = 24
PROMPTS = [[(7 * i + 13 * j) % 30000 + 100 for j in range(n)] for i, n in enumerate((37, 300, 1029, 16))]
PROMPTS.append(PROMPTS[2] + [555, 556, 557])   # shares a 1029-token prefix with request 2 (radix cache hit)


_RUNS: dict = {}   # one server per configuration in this module: several tests read the same generation


def _run(backend, recipe=None, *, graphs=True, tmp_path, score=None, **engine_kw):
    key = (backend, recipe, graphs, tuple(sorted(engine_kw.items())))
    if score is None and key in _RUNS:
        return _RUNS[key]
    args = sc._engine_args(MODEL_DIR, backend, graphs=graphs, mem_fraction=0.3, context_length=8192,
                           dummy=not REAL_WEIGHTS)
    args.update(engine_kw)
    spec = {"engine": args, "prompts": None if score else PROMPTS, "new_tokens": NEW_TOKENS, "score": score}
    env = {"MPFA_RECIPE": recipe} if recipe else {}
    res = sc.run_child(spec, env, tmp_path / f"{backend}-{recipe}-{graphs}.log")
    if score is None and "error" not in res:
        _RUNS[key] = res
    return res


def _ok(res):
    assert "error" not in res, res["error"]
    return res


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("sglang")


@pytest.fixture(scope="module")
def bf16_graphs(logs):
    return _ok(_run("mpfa", "bf16", graphs=True, tmp_path=logs))


def test_plugin_registered_in_process():
    import mpfa.sglang.plugin as plugin
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES
    plugin.register()
    assert "mpfa" in ATTENTION_BACKEND_CHOICES and ATTENTION_BACKENDS["mpfa"] is plugin.create_backend


def test_bf16_generates_and_the_cached_pass_repeats_it(bf16_graphs):
    first, second = (p["output_ids"] for p in bf16_graphs["passes"])
    assert [len(o) for o in first] == [NEW_TOKENS] * len(PROMPTS)
    assert first == second, "the radix-cache pass (cached prefix pages) must give the same tokens"


def test_graphs_on_off_equal(bf16_graphs, logs):
    eager = _ok(_run("mpfa", "bf16", graphs=False, tmp_path=logs))
    assert eager["passes"][0]["output_ids"] == bf16_graphs["passes"][0]["output_ids"]


def test_bf16_tokens_are_flashinfers_argmax(bf16_graphs, logs):
    pytest.importorskip("flashinfer", reason="SGLang's flashinfer backend needs the flashinfer package")
    if not REAL_WEIGHTS:
        pytest.skip("dummy weights make greedy tokens near-tied: run python -m benchmarks.e2e.smollm2_hf first")
    ref = _ok(_run("flashinfer", graphs=True, tmp_path=logs))
    outs = {"flashinfer": ref["passes"][0]["output_ids"], "mpfa": bf16_graphs["passes"][0]["output_ids"]}
    score = [{"ids": p + o, "start": len(p)} for name in ("flashinfer", "mpfa") for p, o in zip(PROMPTS, outs[name])]
    scored = _ok(_run("flashinfer", graphs=True, tmp_path=logs, score=score, disable_radix_cache=True))["scored"]
    gaps = [sc.logprob_gaps(s) for s in scored]
    noise = max(max(g) for g in gaps[:len(PROMPTS)])   # flashinfer's own decode vs its own prefill
    ours = [g for seq in gaps[len(PROMPTS):] for g in seq]
    assert max(ours) <= max(noise, 0.05), (max(ours), noise)


@pytest.mark.parametrize("recipe", ["qk8pv8", "qk4pv8"])
def test_quantized_recipes(recipe, bf16_graphs, logs):
    res = _ok(_run("mpfa", recipe, graphs=True, tmp_path=logs))
    assert [len(o) for o in res["passes"][0]["output_ids"]] == [NEW_TOKENS] * len(PROMPTS)
    eager = _ok(_run("mpfa", recipe, graphs=False, tmp_path=logs))
    assert eager["passes"][0]["output_ids"] == res["passes"][0]["output_ids"], "decode CUDA graphs on and off differ"
    from mpfa.recipes import get_recipe
    d = json.loads((MODEL_DIR / "config.json").read_text())["head_dim"]
    ratio = get_recipe("bf16").bytes_per_token_head(d) / get_recipe(recipe).bytes_per_token_head(d)
    assert res["max_total_num_tokens"] >= 0.95 * ratio * bf16_graphs["max_total_num_tokens"]


@pytest.mark.parametrize("recipe", ["bf16", "qk8pv8"])
def test_breakable_prefill_graph_gives_the_eager_prefills_tokens(recipe, logs):
    # SGLang's default prefill graph runs attention eagerly on its capture's dummy batches (all K/V at the
    # padding slot): they must not fix the quantized pool's scales (mpfa.sglang.calibration), so the first
    # request calibrates as it does with the prefill graph off; bf16 (nothing to calibrate) is the control
    # for the graph's own numerics
    eager = _ok(_run("mpfa", recipe, graphs=True, tmp_path=logs))
    graph = _ok(_run("mpfa", recipe, graphs=True, tmp_path=logs / "prefill-graph", disable_prefill_cuda_graph=False))
    assert graph["passes"][0]["output_ids"] == eager["passes"][0]["output_ids"]


def test_unsupported_page_size_is_a_clear_error(logs):
    res = _run("mpfa", "bf16", graphs=False, tmp_path=logs, page_size=8)
    assert "error" in res
    log = (logs / "mpfa-bf16-False.log").read_text()
    assert "--page-size (mpfa pages) must be one of [1, 16, 32, 64], got 8" in log, log[-2000:]
