"""CPU tests of the benchmark harness (benchmarks/): benchmarks/RESULTS.md's section is generated from the
results JSON and `--check` catches a stale one; suite summaries are computed from rows; the
timing/rotation/repeat arithmetic; the append suite's slot pattern. No GPU, no mpfa needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import report, results_io, stats, suites
from benchmarks.suites import append
from benchmarks.timing import Timing, rotation_count

REPO = Path(__file__).resolve().parents[2]

N = append.TOKENS
TOKEN_HEADS = N * append.KV_HEADS
MB = 1 << 20


def _ceiling(name, ms, *, bytes_=None, flops=None):
    row = {"kind": "ceiling", "id": f"ceiling/{name}", "name": name, "method": "test",
           "status": "ok", "ms": ms}
    if bytes_ is not None:
        row.update(bytes=bytes_, gbps=bytes_ / ms / 1e6)
    if flops is not None:
        row.update(flops=flops, tflops=flops / ms / 1e9)
    return row


def _kernel(impl, recipe, page, ms, out_bpth, *, tokens=N, status="ok"):
    row = {"id": f"{impl}/{recipe}/page{page}/n{tokens}", "kind": "kernel", "impl": impl,
           "recipe": recipe, "page_size": page, "tokens": tokens, "kv_heads": 8,
           "head_dim": 128, "status": status}
    if status == "ok":
        th = tokens * 8
        row.update(bytes=th * (512 + out_bpth), bytes_in=th * 512, bytes_out=th * out_bpth,
                   out_bytes_per_token_head=out_bpth, ms=ms, ms_min=ms * 0.98,
                   ms_p20=ms * 0.99, ms_p80=ms * 1.01, n=100, sets=2)
    else:
        row["reason"] = "RuntimeError: no kernel for this key"
    return row


def fake_rows():
    """Copy ceiling exactly 4000 GB/s; mpfa rows whose fractions are easy to state."""
    return [
        _ceiling("hbm_read", 1.0, bytes_=4_300_000_000),
        _ceiling("copy", 1.0, bytes_=4_000_000_000),
        _ceiling("fp8_mma", 1.0, flops=1_260_000_000_000),
        _kernel("mpfa", "bf16", 16, 0.0800, 512),     # 3355.4 GB/s -> 0.8388608
        _kernel("mpfa", "qk8pv8", 16, 0.0600, 260),   # 3372.9 GB/s -> 0.8432299
        _kernel("mpfa", "qk4pv8", 16, 0.0625, 204),   # 3003.1 GB/s -> 0.7507803
        _kernel("mpfa", "qk4pv8", 1, 0.1000, 204),    # 1877.0 GB/s -> 0.4692378 (the min)
        _kernel("mpfa", "qk8pv8", 1, 0.0, 260, status="error"),   # excluded: failed
        _kernel("mpfa", "bf16", 16, 1.0, 512, tokens=4096),       # excluded: not the 32K chunk
        _kernel("torch", "bf16", 16, 0.5000, 512),                # excluded: a peer
    ]


META = {"command": "python -m benchmarks.run --suites append", "commit": "0123456789abcdef",
        "date": "2026-11-30T00:00:00Z", "gpu": "NVIDIA H200", "driver": "580.159.03",
        "cuda": "13.0", "torch": "2.11.0+cu130", "flashinfer": "0.6.15.post1", "sglang": None,
        "mpfa": "0.1.0", "suite": "append", "quick": False, "repeat": 1}

DOC = "# mpfa\n\nIntro text.\n\n<!-- bench:begin -->\nold table\n<!-- bench:end -->\n\nTail.\n"


def write_fake(results_dir: Path, rows=None) -> dict:
    rows = append.annotate(rows if rows is not None else fake_rows())
    results_io.write("append_h200", META, append.summarize(rows), rows, results_dir)
    return results_io.read(results_dir / "append_h200.json")


def parse_table(text: str, first_header: str) -> list[dict]:
    """Rows of the markdown table whose header starts with `| first_header |`."""
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith(f"| {first_header} |"))
    headers = [h.strip() for h in lines[start].strip("|").split("|")]
    out = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        out.append(dict(zip(headers, (c.strip() for c in line.strip("|").split("|")))))
    return out


# ---------------------------------------------------------------- summaries from rows

def test_append_summary_is_computed_from_rows():
    s = append.summarize(append.annotate(fake_rows()))
    assert s["copy_gbps"] == pytest.approx(4000.0)
    assert s["min_copy_fraction"] == pytest.approx(0.46923776)
    assert s["copy_fraction_by_recipe"] == pytest.approx(
        {"bf16": 0.8388608, "qk8pv8": 0.84322987, "qk4pv8": 0.46923776})
    assert s["peer_copy_fraction"] == pytest.approx({"torch-bf16/page16": 268435456 / 0.5e-3 / 4e12})
    assert s["errors"] == 1 and s["max_spread"] is None


def test_append_summary_ignores_stored_derived_fields():
    """The summary follows bytes and ms, not a stale gbps/copy_fraction left in a row."""
    rows = append.annotate(fake_rows())
    for r in rows:
        if r.get("kind") == "kernel" and r["status"] == "ok":
            r["copy_fraction"] = 1.0
            r["gbps"] = 1.0
    assert append.summarize(rows)["min_copy_fraction"] == pytest.approx(0.46923776)


def test_append_summary_without_copy_ceiling_has_no_fractions():
    rows = [r for r in fake_rows() if r.get("name") != "copy"]
    s = append.summarize(append.annotate(rows))
    assert s["copy_gbps"] is None and s["min_copy_fraction"] is None
    assert s["copy_fraction_by_recipe"] == {}


def test_annotate_fills_gbps_and_fraction():
    rows = append.annotate(fake_rows())
    row = next(r for r in rows if r["id"] == "mpfa/bf16/page16/n32768")
    assert row["gbps"] == pytest.approx(268435456 / 0.08e-3 / 1e9)
    assert row["copy_fraction"] == pytest.approx(0.8388608)


# ---------------------------------------------------------------- RESULTS.md from JSON

def test_results_table_is_generated_from_json(tmp_path):
    result = write_fake(tmp_path)
    readme = tmp_path / "RESULTS.md"
    readme.write_text(DOC)
    assert report.main(["--results", str(tmp_path), "--doc", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# mpfa\n\nIntro text.\n\n<!-- bench:begin -->\n")
    assert text.endswith("<!-- bench:end -->\n\nTail.\n")
    assert "old table" not in text
    for part in ("GPU NVIDIA H200", "driver 580.159.03", "CUDA 13.0", "torch 2.11.0+cu130",
                 "flashinfer 0.6.15.post1", "commit 0123456789ab",
                 "`python -m benchmarks.run --suites append`",
                 "copy (read+write) 4,000 GB/s", "FP8 MMA 1,260 TFLOP/s",
                 "min_copy_fraction 0.4692"):
        assert part in text, part

    table = parse_table(text, "impl")
    kernels = [r for r in result["rows"] if r["kind"] != "ceiling"]
    assert len(table) == len(kernels)
    assert "spread" not in table[0]  # no row was repeated: the column is dropped
    for got, row in zip(table, kernels):
        assert (got["impl"], got["recipe"], got["page"]) == (
            row["impl"], row["recipe"], str(row["page_size"]))
        assert got["status"] == row["status"]
        if row["status"] == "ok":
            assert got["ms"] == f"{row['ms']:.4f}"
            assert got["GB/s"] == f"{row['bytes'] / row['ms'] / 1e6:,.0f}"
            assert got["of copy"] == f"{row['bytes'] / row['ms'] / 1e6 / 4000:.2f}"
        else:
            assert got["ms"] == "—" and got["note"].startswith("RuntimeError")
    # A hand-checked line, so a formatting change is seen here too.
    assert "| mpfa | qk4pv8 | 1 | 32768 | 204 | 0.1000 | 1,877 | 0.47 | ok | — |" in text


def test_check_detects_stale_table_and_leaves_the_doc_alone(tmp_path):
    write_fake(tmp_path)
    readme = tmp_path / "RESULTS.md"
    readme.write_text(DOC)
    args = ["--results", str(tmp_path), "--doc", str(readme)]
    assert report.main(args + ["--check"]) == 1  # "old table" is stale
    assert report.main(args) == 0
    assert report.main(args + ["--check"]) == 0
    generated = readme.read_text()

    rows = fake_rows()
    rows[3]["ms"] = 0.0900  # a new measurement lands in the JSON; the doc not regenerated
    write_fake(tmp_path, rows)
    assert report.main(args + ["--check"]) == 1
    assert readme.read_text() == generated  # --check writes nothing
    assert report.main(args) == 0
    assert "| mpfa | bf16 | 16 | 32768 | 512 | 0.0900 |" in readme.read_text()
    assert report.main(args + ["--check"]) == 0


def test_check_detects_summary_not_computed_from_rows(tmp_path):
    rows = append.annotate(fake_rows())
    summary = append.summarize(rows)
    summary["min_copy_fraction"] = 0.99  # hand-edited: not what the rows give
    results_io.write("append_h200", META, summary, rows, tmp_path)
    readme = tmp_path / "RESULTS.md"
    readme.write_text(DOC)
    args = ["--results", str(tmp_path), "--doc", str(readme)]
    assert report.main(args) == 1  # the doc written, but the summary is flagged
    assert report.main(args + ["--check"]) == 1
    assert report.main(args + ["--resummarize"]) == 0
    assert results_io.read(tmp_path / "append_h200.json")["summary"]["min_copy_fraction"] == \
        pytest.approx(0.46923776)
    assert report.main(args + ["--check"]) == 0


def test_missing_markers_or_doc_creates_nothing(tmp_path):
    write_fake(tmp_path)
    readme = tmp_path / "RESULTS.md"
    readme.write_text("# mpfa\n\nno markers here\n")
    assert report.main(["--results", str(tmp_path), "--doc", str(readme)]) == 2
    assert readme.read_text() == "# mpfa\n\nno markers here\n"
    missing = tmp_path / "NOPE.md"
    assert report.main(["--results", str(tmp_path), "--readme", str(missing), "--check"]) == 2
    assert not missing.exists()
    with pytest.raises(report.MarkersMissing):
        report.splice(f"{report.END}\n{report.BEGIN}\n", "x")  # wrong order


def test_no_results_leaves_an_empty_section(tmp_path):
    readme = tmp_path / "RESULTS.md"
    readme.write_text("a\n<!-- bench:begin -->\n<!-- bench:end -->\nb\n")
    args = ["--results", str(tmp_path / "none"), "--doc", str(readme)]
    assert report.main(args + ["--check"]) == 0
    readme.write_text("a\n<!-- bench:begin -->\nstale\n<!-- bench:end -->\nb\n")
    assert report.main(args + ["--check"]) == 1
    assert report.main(args) == 0
    assert readme.read_text() == "a\n<!-- bench:begin -->\n<!-- bench:end -->\nb\n"


def test_files_of_other_scripts_get_a_generic_table(tmp_path):
    results_io.write("study_h200", {"command": "python -m x"}, {"worst_rel_l2": 0.004},
                     [{"recipe": "qk4pv8", "rel_l2": 0.004, "cos": 0.99999}], tmp_path)
    section = report.render_section(tmp_path, tmp_path)
    assert "### study_h200" in section
    assert parse_table(section, "recipe") == [{"recipe": "qk4pv8", "rel_l2": "0.004",
                                               "cos": "1"}]


def test_sglang_check_results_get_their_table_and_summary_check(tmp_path):
    rows = [{"part": "capacity", "config": "flashinfer-bf16", "status": "ok", "max_total_num_tokens": 1000,
             "startup_s": 60.0, "model": "llama-3.1-8b"},
            {"part": "capacity", "config": "mpfa-qk4pv8", "status": "ok", "max_total_num_tokens": 2510,
             "startup_s": 61.0, "model": "llama-3.1-8b"}]
    from benchmarks.e2e import results as e2e_results
    results_io.write("e2e_sglang_h200", {"command": "python -m benchmarks.e2e.sglang_check"},
                     e2e_results.summarize(rows), rows, tmp_path)
    section = report.render_section(tmp_path, tmp_path)
    table = parse_table(section, "part")
    assert table[1]["configuration"] == "mpfa-qk4pv8" and table[1]["max_total_num_tokens"] == "2,510"
    assert "kv_capacity_ratio 2.51" in section and report.summary_mismatches(tmp_path) == []
    results_io.write("e2e_sglang_h200", {"command": "x"}, {"kv_capacity_ratio": 3.0}, rows, tmp_path)
    assert report.summary_mismatches(tmp_path)


def test_accuracy_results_get_the_per_recipe_table(tmp_path):
    summary = {"ppl_increase_qk4pv8": 0.03, "recipes": {
        "bf16": {"kernel_rel_l2_real": 0.0017, "ppl": 6.7, "ppl_increase": 0.0, "needle": {"2048": 1.0}},
        "qk4pv8": {"kernel_rel_l2_real": 0.25, "ppl": 6.9, "ppl_increase": 0.03, "kl": 0.1, "needle": {"2048": 0.6}}}}
    rows = [{"id": f"r{i}", "rel_l2": 0.1} for i in range(300)]
    results_io.write("accuracy", {"command": "python -m benchmarks.accuracy.run"}, summary, rows, tmp_path)
    section = report.render_section(tmp_path, tmp_path)
    table = parse_table(section, "recipe")
    assert [r["recipe"] for r in table] == ["bf16", "qk4pv8"]
    assert table[1]["ppl increase"] == "+3.0%" and table[1]["needle 2K"] == "60%" and table[0]["KL (nats)"] == "—"
    assert "300 rows in `benchmarks/results/accuracy.json`" in section and "r299" not in section
    assert "recipes." not in section                                   # the table, not a flattened summary


def test_results_schema_is_enforced(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"meta": {}, "rows": []}))
    with pytest.raises(results_io.ResultsError, match="exactly keys"):
        results_io.read(tmp_path / "bad.json")
    path = results_io.write("nan", {}, {"x": float("nan")}, [{"ms": float("inf")}], tmp_path)
    assert results_io.read(path) == {"meta": {}, "summary": {"x": None}, "rows": [{"ms": None}]}


# ---------------------------------------------------------------- timing arithmetic

def test_rotation_count_exceeds_four_times_l2():
    l2 = 60 * MB
    assert rotation_count(10 * MB, l2) == 24            # 24 x 10 MB >= 240 MB = 4 x L2
    assert rotation_count(7 * MB, l2) == 35             # ceil(240 / 7)
    assert rotation_count(300 * MB, l2) == 1            # one call already exceeds 4 x L2
    assert rotation_count(100 * MB, l2) == 3
    assert rotation_count(10 * MB, l2, factor=2) == 12
    assert rotation_count(10 * MB, l2, budget_bytes=100 * MB) == 10   # capped by memory
    assert rotation_count(1 * MB, l2) == 64                           # capped by max_sets
    assert rotation_count(10 * MB, l2, budget_bytes=5 * MB) == 1      # never below one
    with pytest.raises(ValueError):
        rotation_count(0, l2)


def test_timing_statistics():
    t = Timing(samples_ms=tuple(float(x) for x in [5, 1, 9, 3, 7, 2, 10, 4, 8, 6]),
               warmup_calls=3, rotate_sets=2)
    assert (t.median, t.min, t.p20, t.p80) == pytest.approx((5.5, 1.0, 2.8, 8.2))
    assert t.as_row() == pytest.approx({"ms": 5.5, "ms_min": 1.0, "ms_p20": 2.8,
                                        "ms_p80": 8.2, "n": 10, "sets": 2})


def test_merge_repeats_records_spread():
    a = [{"id": "x", "ms": 1.00, "ms_min": 0.9, "status": "ok"},
         {"id": "y", "ms": 2.0, "status": "ok"}]
    b = [{"id": "x", "ms": 1.04, "ms_min": 0.95, "status": "ok"},
         {"id": "y", "status": "error", "reason": "boom"}]
    x, y = stats.merge_repeats([a, b])
    assert x["ms"] == pytest.approx(1.02) and x["ms_min"] == pytest.approx(0.9)
    assert x["ms_runs"] == [1.00, 1.04] and x["spread"] == pytest.approx(0.04)
    assert y["status"] == "error" and "spread" not in y
    assert stats.max_spread([x, y]) == pytest.approx(0.04)
    assert stats.merge_repeats([a]) == a and stats.max_spread(a) is None
    with pytest.raises(ValueError, match="missing"):
        stats.merge_repeats([a, a[:1]])
    facts = [{"id": "cold build", "build_s": 1.9, "status": "ok"}]   # a row with no timing: kept as run 1 has it
    assert stats.merge_repeats([facts, [dict(facts[0], build_s=2.1)]]) == facts


def test_repeat_spread_reaches_the_summary():
    runs = [fake_rows()[3:], fake_rows()[3:]]
    runs[1][0]["ms"] = 0.0800 * 1.03
    rows = append.annotate(fake_rows()[:3] + stats.merge_repeats(runs))
    assert append.summarize(rows)["max_spread"] == pytest.approx(0.03)


# ---------------------------------------------------------------- suites

def test_suites_are_discovered_and_complete():
    assert "append" in suites.available()
    for name in suites.available():
        mod = suites.load(name)
        for quick in (False, True):
            ids = [c["id"] for c in mod.cases(quick)]
            assert ids and len(ids) == len(set(ids))
    assert suites.for_result("append_h200") is append
    assert suites.for_result("accuracy") is None
    with pytest.raises(ValueError, match="available: .*append"):
        suites.load("nope")


def test_append_cases_cover_recipes_and_page_sizes():
    mine = [c for c in append.cases() if c["impl"] == "mpfa"]
    assert {(c["recipe"], c["page_size"]) for c in mine} == {
        (r, p) for r in ("bf16", "qk8pv8", "qk4pv8", "qk4pv4") for p in (16, 1)}
    assert all(c["tokens"] == 32768 and c["kv_heads"] == 8 and c["head_dim"] == 128 for c in mine)


@pytest.mark.parametrize("page", [4, 1])
def test_append_slots_are_scattered_pages_disjoint_across_sets(page):
    torch = pytest.importorskip("torch")
    case = {"tokens": 64, "kv_heads": 2, "head_dim": 16, "page_size": page, "recipe": "bf16"}
    sets, num_pages = append._inputs(case, 3, seed=1, device="cpu")
    assert num_pages == 3 * 64 // page
    all_slots = torch.cat([s for _, _, s, _ in sets])
    assert torch.equal(all_slots.sort().values, torch.arange(num_pages * page))  # disjoint, full
    for k, v, slots, pages in sets:
        assert slots.dtype == torch.int64 and k.dtype == torch.bfloat16 and k.shape == (64, 2, 16)
        assert torch.equal(slots // page, pages.repeat_interleave(page))  # page-contiguous
        assert torch.equal(slots % page, torch.arange(64) % page)
        assert k.abs().sum() > 0 and not torch.equal(k, v)  # random, never zeros
    assert not torch.equal(sets[0][2], torch.arange(64))  # pages are shuffled


def test_append_torch_peer_writes_every_slot():
    torch = pytest.importorskip("torch")
    case = {"tokens": 32, "kv_heads": 2, "head_dim": 16, "page_size": 4, "recipe": "bf16",
            "impl": "torch"}
    sets, num_pages = append._inputs(case, 2, seed=2, device="cpu")
    target = append._torch(case, sets, num_pages, "cpu")
    fn, rotate, (kc, vc) = target["fn"], target["rotate"], target["keep"]
    assert target["out_bpth"] == 2 * 16 * 2  # K and V of head_dim 16 in bf16
    kc.fill_(float("nan"))
    vc.fill_(float("nan"))
    for args in rotate:
        fn(*args)
    assert not kc.isnan().any() and not vc.isnan().any()
    for k, v, slots in rotate:
        assert torch.equal(kc[slots], k) and torch.equal(vc[slots], v)


def test_run_without_gpu_fails_clearly(capsys):
    torch = pytest.importorskip("torch")
    from benchmarks import run

    assert run.main(["--suites", "nope"]) == 2
    assert "unknown suite 'nope'" in capsys.readouterr().err
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the no-GPU path cannot be exercised here")
    with pytest.raises(SystemExit) as exc:
        run.main(["--suites", "append", "--no-readme", "--no-plots"])
    assert exc.value.code == 2
    assert "no CUDA GPU visible" in capsys.readouterr().err


def test_run_cases_selects_part_of_a_suite_and_never_publishes_it(capsys):
    from benchmarks import run
    from benchmarks.suites import decode

    spread = run.selected(decode.cases(), ["spread"])
    assert spread and all(c["id"].endswith("/spread") for c in spread)
    assert run.selected(decode.cases(), None) == decode.cases()
    with pytest.raises(SystemExit) as exc:
        run.main(["--suites", "decode", "--cases", "spread", "--publish"])
    assert exc.value.code == 2 and "leave out --publish" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run.main(["--suites", "decode", "--cases", " , "])
    assert "--cases: give comma-separated substrings" in capsys.readouterr().err
    # a pattern no case of a suite holds is refused before any GPU is looked for
    assert run.main(["--suites", "decode,append", "--cases", "spread"]) == 2
    assert "--cases spread matches no case of suite append" in capsys.readouterr().err


def test_meta_has_the_design_fields(monkeypatch):
    from benchmarks import meta

    monkeypatch.setenv("MPFA_BENCH_COMMIT", "abc123")
    m = meta.collect("python -m benchmarks.run", suite="append")
    for key in ("command", "commit", "date", "gpu", "driver", "cuda", "torch", "flashinfer",
                "sglang", "mpfa", "nvcc"):
        assert key in m
    assert m["commit"] == "abc123" and m["suite"] == "append"
    assert m["date"].endswith("Z")


# ---------------------------------------------------------------- plots

def test_plots_write_png(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import plots

    png = b"\x89PNG\r\n\x1a\n"
    p = plots.roofline([("decode", 1e9, 2e9, 1e-3), ("prefill", 1e14, 1e9, 0.2)],
                       fp8_tflops=1260, hbm_gbps=4300, path=tmp_path / "roof.png")
    assert p.read_bytes()[:8] == png
    p = plots.line([1024, 2048], {"mpfa": [1.0, None], "fi": [2.0, 3.0]}, tmp_path / "l.png",
                   title="t", xlabel="x", ylabel="y", logx=True, hlines={"c": 3.5})
    assert p.read_bytes()[:8] == png
    result = {"meta": META, "summary": {}, "rows": append.annotate(fake_rows())}
    (p,) = append.plot(result, tmp_path)
    assert p.name == "append_h200.png" and p.read_bytes()[:8] == png
    with pytest.raises(ValueError):
        plots.roofline([], fp8_tflops=0, hbm_gbps=1, path=tmp_path / "x.png")


def test_committed_results_doc_matches_committed_results():
    """benchmarks/RESULTS.md's tables are exactly what the committed JSON generates, every stored
    summary is what its suite computes from the rows, and the default target is that file."""
    assert report.RESULTS_MD == REPO / "benchmarks" / "RESULTS.md"
    assert report.main(["--check", "--results", str(REPO / "benchmarks" / "results"),
                        "--doc", str(report.RESULTS_MD)]) == 0
    assert report.main(["--check"]) == 0                              # the defaults: the same two
    assert report.BEGIN not in (REPO / "README.md").read_text()       # the long tables left README


def test_old_readme_option_still_names_the_doc(tmp_path):
    write_fake(tmp_path)
    doc = tmp_path / "RESULTS.md"
    doc.write_text(DOC)
    assert report.main(["--results", str(tmp_path), "--readme", str(doc)]) == 0
    assert "old table" not in doc.read_text()


def test_roofline_points_come_from_decode_and_prefill_results(tmp_path):
    from benchmarks import roofline
    from benchmarks.suites import decode, prefill
    ceil = [_ceiling("hbm_read", 1.0, bytes_=4_000_000_000), _ceiling("fp8_mma", 1.0, flops=1_000_000_000_000)]
    dec = {"id": "mpfa/qk4pv8/b32/ctx32768/page16", "kind": "kernel", "impl": "mpfa", "recipe": "qk4pv8",
           "batch": 32, "context": 32768, "page_size": 16, "status": "ok", "ms": 0.5, "bytes": 2_000_000_000,
           "flops": 4 * 32 * 32768 * 32 * 128}
    off = dict(dec, id="mpfa/qk4pv8/b8/ctx131072/page16", batch=8, context=131072)   # not the headline shape
    pre = {"id": "mpfa/qk4pv8/32K/comp1", "kind": "kernel", "impl": "mpfa", "recipe": "qk4pv8", "shape": "32K",
           "compensation": True, "status": "ok", "ms": 100.0, "flops": 10**14, "bytes": 10**9}
    results_io.write(decode.RESULT, dict(META, suite="decode"), {}, ceil + [dec, off], tmp_path)
    results_io.write(prefill.RESULT, dict(META, suite="prefill"), {}, ceil + [pre], tmp_path)
    points, fp8, hbm = roofline.collect(tmp_path)
    assert sorted(p[0] for p in points) == ["decode mpfa qk4pv8", "prefill mpfa qk4pv8"]
    assert fp8 == pytest.approx(1000.0) and hbm == pytest.approx(4000.0)
    assert ("prefill mpfa qk4pv8", 10**14, 10**9, pytest.approx(0.1)) in points


def test_prefill_flops_count_unmasked_pairs_bottom_right():
    from benchmarks.suites import prefill
    assert prefill.pairs([(4, 0)]) == 10                      # 1 + 2 + 3 + 4
    assert prefill.pairs([(2, 3)]) == 2 * 3 + 3              # rows see 4 and 5 keys
    case = {c["id"]: c for c in prefill.cases(False)}["mpfa/qk4pv8/extend 8K over 56K/comp1"]
    assert case["flops"] == 4 * 128 * 32 * (8192 * 57344 + 8192 * 8193 // 2)


# ---------------------------------------------------------------- the suites' shared rows

def test_a_measured_row_keeps_the_suites_field_order():
    from benchmarks.suites import _rows
    t = Timing(samples_ms=(2.0, 1.0, 3.0), warmup_calls=1, rotate_sets=2)
    case = {"id": "mpfa/x", "kind": "kernel", "impl": "mpfa"}
    row = _rows.measured_row(case, t, extra={"num_splits": 4}, bytes=8_000_000, flops=10)
    assert list(row) == ["id", "kind", "impl", "num_splits", "status", "bytes", "flops",
                         "ms", "ms_min", "ms_p20", "ms_p80", "n", "sets"]
    assert row["ms"] == 2.0 and row["status"] == "ok" and _rows.rate(row) == 4.0   # 8 MB in 2 ms: 4 GB/s


def test_shared_annotate_and_ceiling_touch_only_what_was_measured():
    from benchmarks.suites import _rows
    rows = [_ceiling("copy", 1.0, bytes_=10**9),
            {**_ceiling("hbm_read", 1.0, bytes_=10**9), "status": "error"},
            {"kind": "kernel", "id": "a", "status": "ok", "bytes": 5 * 10**8, "ms": 1.0},
            {"kind": "kernel", "id": "b", "status": "skipped", "reason": "no peer"},
            {"kind": "kernel", "id": "c", "status": "error", "spread": 0.5}]
    assert _rows.ceiling_rate(rows, "copy") == 1000.0 and _rows.ceiling_rate(rows, "hbm_read") is None
    out = _rows.annotate(rows, lambda r: {"derived": _rows.rate(r)})
    assert [r.get("derived") for r in out] == [None, None, 500.0, None, None] and "derived" not in rows[2]
    assert _rows.ok_kernels(out) == [out[2]]
    assert _rows.run_counts(rows) == {"max_spread": 0.5, "errors": 2, "skipped": 1}


# ---------------------------------------------------------------- structure

def test_gpu_arch_reads_nvidia_smi_without_a_cuda_context(monkeypatch):
    from benchmarks import meta
    answers = {"9.0": "sm_90a", "9.0\n9.0": "sm_90a", "10.0": "sm_100a", None: None, "": None, "N/A": None}
    for out, arch in answers.items():
        monkeypatch.setattr(meta, "_run", lambda cmd, cwd=None, out=out: out)
        assert meta.gpu_arch() == arch, out
