"""Benchmarks never replace a published result from a run that cannot or did not succeed (issue 30, item 3):
the commands of the issue, run here (no GPU, no SGLang) as a user would, leave every committed file under
benchmarks/results byte for byte as it was, write to benchmarks/results/scratch instead and say so in one line;
with --publish they are refused. Also the rules benchmarks/publish.py decides by, and the merge of queue files."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import meta as bench_meta, publish, report, results_io
from benchmarks.e2e import merge_results, results

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
SCRATCH = RESULTS / "scratch"
NO_TRACEBACK = "Traceback"


def published_files() -> dict[str, str]:
    """Every file under benchmarks/results outside scratch (results, plots, logs, studies) with its bytes' hash:
    a file replaced, changed, added or removed shows in a comparison of two of these."""
    return {str(p.relative_to(RESULTS)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(RESULTS.rglob("*")) if p.is_file() and SCRATCH not in p.parents}


def run_module(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m <argv>`` from the repository root, as the issue's commands are run."""
    return subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def committed_results_doc_is_current() -> bool:
    return report.main(["--check", "--results", str(RESULTS), "--doc", str(REPO / "benchmarks" / "RESULTS.md")]) == 0


@pytest.fixture
def untouched():
    """Asserts after the test that no published file changed, and that the benchmarks/RESULTS.md check still passes."""
    before = published_files()
    yield
    after = published_files()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"published files changed: {changed[:10]}"
    assert committed_results_doc_is_current()


def _sglang_server_could_start() -> bool:
    return importlib.util.find_spec("sglang") is not None and bench_meta.gpu_name() is not None


E2E_ARGS = ("benchmarks.e2e.throughput", "--configs", "flashinfer-bf16", "--input-len", "256", "--output-len", "16",
            "--requests", "1", "--no-ttft-probe")


# --- the commands, on a machine where they cannot run --------------------------------------------------------

def test_e2e_throughput_that_cannot_start_a_server_writes_scratch_not_the_published_results(untouched):
    if _sglang_server_could_start():
        pytest.skip("SGLang and a GPU are here: the servers would start")
    res = run_module(*E2E_ARGS, "--port", str(free_port()))
    assert res.returncode == 1, res.stderr[-2000:]
    scratch_file = f"benchmarks/results/scratch/{results.RESULT}.json"
    assert f"1 of 1 failed; wrote {scratch_file}" in res.stderr
    # the scratch file is the published rows plus this run's failed one; the server's log went to scratch too
    published = results_io.read(RESULTS / f"{results.RESULT}.json")["rows"]
    rows = results_io.read(REPO / scratch_file)["rows"]
    assert len(rows) == len(published) + 1
    (new,) = [r for r in rows if r.get("input_len") == 256]
    assert new["status"] == "error" and "exited" in new["error"]
    assert (SCRATCH / "logs" / "e2e" / "throughput-llama-3.1-8b-256-flashinfer-bf16.log").is_file()


def test_e2e_throughput_publish_is_refused_without_sglang_or_a_gpu(untouched):
    if _sglang_server_could_start():
        pytest.skip("SGLang and a GPU are here: the publish would not be refused")
    staged = set(SCRATCH.glob(f"{results.RESULT}-*")) if SCRATCH.is_dir() else set()
    res = run_module(*E2E_ARGS, "--port", str(free_port()), "--publish")
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "not published: " in res.stderr, res.stderr
    assert "no GPU here" in res.stderr or "SGLang is not installed" in res.stderr
    # refused before any server: no staging folder either
    assert (set(SCRATCH.glob(f"{results.RESULT}-*")) if SCRATCH.is_dir() else set()) == staged


def test_accuracy_cpu_run_with_the_default_out_writes_scratch(untouched):
    # the command; the sizes only make it quicker (where it writes does not depend on them)
    res = run_module("benchmarks.accuracy.run", "--device", "cpu", "--quick", "--no-model",
                     "--lengths", "128", "--q-len", "64", "--shape", "2", "1", "64")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "wrote " + str(SCRATCH / "accuracy.json") in res.stdout
    scratch = results_io.read(SCRATCH / "accuracy.json")
    assert scratch["meta"]["device"] == "cpu" and scratch["rows"]
    assert (SCRATCH / "accuracy.png").is_file()


def test_accuracy_cpu_run_may_not_publish(untouched):
    res = run_module("benchmarks.accuracy.run", "--device", "cpu", "--quick", "--no-model", "--publish")
    assert res.returncode == 2
    assert res.stderr == ("python -m benchmarks.accuracy.run: not published: --device cpu: the published "
                          "accuracy.json is a cuda run\n")


@pytest.mark.parametrize("module, argv", [
    ("benchmarks.run", ["--suites", "prefill"]),
    ("benchmarks.e2e.throughput", []),
    ("benchmarks.e2e.sglang_check", ["--parts", "capacity"]),
    ("benchmarks.e2e.merge_results", [str(RESULTS / f"{results.RESULT}.json")]),
    ("benchmarks.accuracy.run", ["--device", "cpu"]),
    ("benchmarks.accuracy.calibration", []),
    ("benchmarks.accuracy.fp8_accumulation", []),
    ("benchmarks.prefill_variants", []),
    ("benchmarks.roofline", []),
], ids=lambda a: a if isinstance(a, str) else None)
def test_out_among_the_published_results_needs_publish(module, argv, capsys, untouched):
    """--out inside benchmarks/results without --publish is bad usage: one line, exit 2, nothing written."""
    import importlib
    study_file = module.endswith(("calibration", "fp8_accumulation"))
    out = str(RESULTS / "studies" / "x.json") if study_file else str(RESULTS)
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(module).main([*argv, "--out", out])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is among the published results: add --publish" in err, err


# --- the rules --------------------------------------------------------------------------------------------------------

def test_published_files_name_the_h200_and_the_rule_compares_with_them(tmp_path):
    assert publish.named_gpu(f"{results.RESULT}.json", tmp_path) == "NVIDIA H200"   # the committed file
    assert publish.named_gpu("accuracy.json", RESULTS) == "NVIDIA H200"
    assert publish.named_gpu("fp8_accumulation_h200.json", tmp_path, RESULTS / "studies") == "NVIDIA H200"
    assert publish.named_gpu("nothing_yet.json", tmp_path) is None
    named = {"prefill_h200.json": "NVIDIA H200"}
    assert publish.machine_refusal("NVIDIA H200", named) is None
    assert publish.machine_refusal("NVIDIA H100 80GB HBM3", named) == (
        "prefill_h200.json was measured on NVIDIA H200, this machine has NVIDIA H100 80GB HBM3")
    assert publish.machine_refusal(None, named) == "no GPU here (nvidia-smi lists none)"
    assert "SGLang is not installed" in publish.machine_refusal("NVIDIA H200", named, need_sglang=True,
                                                                have_sglang=False)
    assert publish.machine_refusal(None, {"calibration_kjv.json": None}, need_gpu=False) is None   # a CPU study


def test_destination_defaults_to_scratch_and_publish_to_the_results(tmp_path):
    import argparse
    ap = argparse.ArgumentParser()
    assert publish.destination(ap, None, False) == publish.SCRATCH_DIR
    assert publish.destination(ap, None, True) == results_io.RESULTS_DIR
    assert publish.destination(ap, tmp_path, False) == tmp_path
    assert publish.destination(ap, SCRATCH / "mine", False) == SCRATCH / "mine"
    for inside in (RESULTS, RESULTS / "studies", RESULTS / "logs" / "e2e"):
        with pytest.raises(SystemExit):
            publish.destination(ap, inside, False)
        assert publish.destination(ap, inside, True) == inside


def test_promote_moves_every_staged_file_and_replaces_the_published_ones(tmp_path):
    staging, target = tmp_path / "staging", tmp_path / "target"
    (staging / "logs" / "e2e").mkdir(parents=True)
    (staging / "r.json").write_text("new")
    (staging / "logs" / "e2e" / "a.log").write_text("log")
    (target / "logs").mkdir(parents=True)
    (target / "r.json").write_text("old")
    (target / "kept.png").write_text("kept")
    assert sorted(p.relative_to(target).as_posix() for p in publish.promote(staging, target)) == [
        "logs/e2e/a.log", "r.json"]
    assert (target / "r.json").read_text() == "new" and (target / "logs/e2e/a.log").read_text() == "log"
    assert (target / "kept.png").read_text() == "kept" and not staging.exists()
    assert not list(target.rglob("*.tmp"))


def test_failure_line_names_what_failed_and_where_the_files_went(tmp_path):
    line = publish.failure_line("prog", ["a", "b", "c", "d", "e"], tmp_path / "x.json")
    assert line == f"prog: not published: 5 failed (a, b, c and 2 more); wrote {tmp_path / 'x.json'} instead"
    assert publish.failed_rows([{"id": "x", "status": "error"}, {"id": "y", "status": "ok"},
                                {"group": "g", "status": "error"}, {"id": "z", "status": "skipped"}]) == ["x", "g"]


# --- merging queue files ----------------------------------------------------------------------------------------------

def _row(group: str, status: str = "ok", v: int = 1) -> dict:
    return {"part": "throughput", "group": group, "config": "flashinfer-bf16", "status": status, "v": v,
            "model": "llama-3.1-8b", "input_len": 32768, "output_throughput": 100.0}


def _queue(folder: Path, gpu: str, rows: list[dict]) -> str:
    results_io.write(results.RESULT, {"gpu": gpu, "calls": []}, results.summarize(rows), rows, folder)
    return str(folder / f"{results.RESULT}.json")


@pytest.fixture
def published_base(tmp_path):
    base = tmp_path / "published"
    results_io.write(results.RESULT, {"gpu": "NVIDIA H200"}, results.summarize([_row("a")]), [_row("a")], base)
    return base, (base / f"{results.RESULT}.json").read_bytes()


def test_merge_publish_refuses_queues_measured_on_another_gpu(tmp_path, published_base, capsys):
    base, before = published_base
    queue = _queue(tmp_path / "q0", "NVIDIA H100 80GB HBM3", [_row("a"), _row("b", v=2)])
    assert merge_results.main([queue, "--out", str(base), "--publish"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was measured on NVIDIA H100 80GB HBM3, the published file on NVIDIA H200" in err
    assert (base / f"{results.RESULT}.json").read_bytes() == before


def test_merge_publish_of_a_failed_row_goes_to_scratch(tmp_path, published_base, capsys, untouched):
    base, before = published_base
    queue = _queue(tmp_path / "q0", "NVIDIA H200", [_row("a"), _row("b", status="error", v=2)])
    assert merge_results.main([queue, "--out", str(base), "--publish"]) == 1
    err = capsys.readouterr().err
    assert f"not published: 1 failed (b); wrote {publish.display(SCRATCH / f'{results.RESULT}.json')} instead" in err
    assert (base / f"{results.RESULT}.json").read_bytes() == before
    assert [r["v"] for r in results_io.read(SCRATCH / f"{results.RESULT}.json")["rows"]] == [1, 2]
    queue = _queue(tmp_path / "q1", "NVIDIA H200", [_row("a"), _row("b", v=3)])
    assert merge_results.main([queue, "--out", str(base), "--publish"]) == 0   # a clean queue publishes
    assert [r["v"] for r in results_io.read(base / f"{results.RESULT}.json")["rows"]] == [1, 3]


def test_merge_without_publish_starts_from_the_published_file_and_writes_scratch(tmp_path, untouched):
    queue = _queue(tmp_path / "q0", "NVIDIA H200", [_row("llama/in999/new", v=7)])
    assert merge_results.main([queue]) == 0
    merged = results_io.read(SCRATCH / f"{results.RESULT}.json")
    published = json.loads((RESULTS / f"{results.RESULT}.json").read_text())
    assert len(merged["rows"]) == len(published["rows"]) + 1


def test_results_text_puts_lists_of_numbers_on_one_line_and_reads_back_equal():
    from benchmarks import results_io
    doc = {"meta": {"command": "x, [1, 2]"}, "summary": {"ids": [1, -2, 3.5e-3, 4E+2], "mixed": [1, "a, b", None]},
           "rows": [{"ids": [7, 8], "nested": [[1, 2], {"a": [3]}], "mixed": [1, "a, b", None], "empty": []},
                    {"part": "x", "v": 1.5}]}
    text = results_io.dumps(doc)
    assert json.loads(text) == doc
    assert '"ids": [1, -2, 0.0035, 400.0]' in text and '"ids": [7, 8]' in text and "[1, 2]" in text
    assert '"command": "x, [1, 2]"' in text                  # strings are left alone
    assert '"mixed": [\n' in text                            # a summary list holding a string or null keeps its lines
    lines = text.splitlines()
    assert lines[-4:] == ['  {"ids": [7, 8], "nested": [[1, 2], {"a": [3]}], "mixed": [1, "a, b", None], '
                          '"empty": []},'.replace("None", "null"), '  {"part": "x", "v": 1.5}', " ]", "}"]
    assert json.loads(results_io.dumps({**doc, "rows": []})) == {**doc, "rows": []}
