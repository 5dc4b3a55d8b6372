"""The kernel service on the GPU machine: cold build, warm load, 8 concurrent builders, a killed build.

    python -m benchmarks.run --suites jit

Each case runs in fresh processes against a fresh cache folder, the way SGLang workers meet it.
Writes jit_h200.json (rows: one per case; summary: cold build seconds, median warm load ms, builds
seen by 8 processes, whether the killed build left a loadable entry).
"""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

NAME = "jit"
RESULT = "jit_h200"

CHILD = textwrap.dedent("""
    import sys, time
    t0 = time.monotonic()
    import mpfa_jit
    from mpfa_jit.ops import append_kv
    t1 = time.monotonic()
    spec = append_kv.spec(recipe=sys.argv[1], head_dim=int(sys.argv[2]), page_size=int(sys.argv[3]), arch="sm_90a")
    m = mpfa_jit.get_kernel(spec)
    m.params_fn(append_kv.SYMBOL, append_kv.PARAMS_LAYOUT_SYMBOL, append_kv.AppendParams)
    t2 = time.monotonic()
    print(f"RESULT import_ms={(t1 - t0) * 1e3:.2f} load_ms={(t2 - t1) * 1e3:.2f}")
""")


def _child(args, cache, **kw):
    return subprocess.Popen([sys.executable, "-c", CHILD, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "MPFA_CACHE_DIR": str(cache)}, **kw)


def _result(proc):
    out, err = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}): {err[-2000:]}")
    fields = dict(kv.split("=") for kv in out.split("RESULT", 1)[1].split())
    return {k: float(v) for k, v in fields.items()}, err


def _builds(cache: Path) -> int:
    log = cache / "builds.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


KEY = ("qk4pv8", 128, 16)


def _cold_build(workdir: Path) -> dict:
    t = time.monotonic()
    r, err = _result(_child(KEY, workdir))
    return {"key": "append_kv qk4pv8 d128 p16", "wall_s": round(time.monotonic() - t, 3), "load_ms": r["load_ms"],
            "builds": _builds(workdir), "built_here": "building" in err}


def _warm_load(workdir: Path) -> dict:
    _result(_child(KEY, workdir))                       # the build this case does not time
    warm = [_result(_child(KEY, workdir))[0] for _ in range(7)]
    return {"key": "append_kv qk4pv8 d128 p16", "trials": len(warm),
            "load_ms_median": statistics.median(w["load_ms"] for w in warm),
            "load_ms_max": max(w["load_ms"] for w in warm),
            "import_ms_median": statistics.median(w["import_ms"] for w in warm), "builds": _builds(workdir)}


def _eight_processes(workdir: Path) -> dict:
    procs = [_child(("qk8pv8", 64, 32), workdir) for _ in range(8)]
    outs = [_result(p) for p in procs]
    return {"key": "append_kv qk8pv8 d64 p32", "processes": 8, "loaded": len(outs), "builds": _builds(workdir),
            "processes_that_built": sum("mpfa_jit: building" in e for _, e in outs)}


def _sigkill(workdir: Path) -> dict:
    from mpfa_jit import Store
    proc = _child(("bf16", 256, 64), workdir, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any((workdir / "tmp").glob("*/build.ninja")):
        time.sleep(0.02)
    time.sleep(0.5)   # nvcc is compiling now
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    entries_after_kill = len(Store(workdir).entries())
    _, err = _result(_child(("bf16", 256, 64), workdir))
    return {"key": "append_kv bf16 d256 p64", "entries_after_kill": entries_after_kill,
            "rebuilt_on_next_request": "mpfa_jit: building" in err, "builds": _builds(workdir),
            "stale_tmp_left": any((workdir / "tmp").iterdir())}


CASES = {"cold_build": _cold_build, "warm_load": _warm_load, "eight_processes_one_key": _eight_processes,
         "sigkill_mid_build": _sigkill}


def cases(quick: bool = False) -> list[dict]:
    return [{"id": f"jit/{name}", "kind": "service", "impl": "mpfa", "case": name} for name in CASES]


def run_case(case: dict, ctx) -> dict:
    with tempfile.TemporaryDirectory(prefix="mpfa-jit-bench-") as tmp:
        return {**case, "status": "ok", **CASES[case["case"]](Path(tmp))}


def summarize(rows: list[dict]) -> dict:
    # Rows of the earlier jit_service script carry no kind/status; they are service rows all the same.
    by = {r["case"]: r for r in rows if r.get("case") in CASES and r.get("status", "ok") == "ok"}
    get = lambda case, key: by[case][key] if case in by else None   # noqa: E731
    kill = by.get("sigkill_mid_build")
    return {
        "cold_build_s": get("cold_build", "wall_s"),
        "warm_load_ms_median": get("warm_load", "load_ms_median"),
        "warm_load_under_100ms": by["warm_load"]["load_ms_max"] < 100.0 if "warm_load" in by else None,
        "eight_process_builds": get("eight_processes_one_key", "builds"),
        "killed_build_left_entry": kill["entries_after_kill"] > 0 if kill else None,
        "killed_build_rebuilt": kill["rebuilt_on_next_request"] if kill else None,
    }
