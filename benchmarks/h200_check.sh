#!/usr/bin/env bash
# One device call: install, prebuild every kernel the GPU tests use (16 parallel builds), run the GPU
# tests of the given files (default: all), then the given benchmark suites (published: benchmarks.run --publish).
#   MPFA_BENCH_COMMIT=<hash> bash benchmarks/h200_check.sh "tests/gpu" "append,decode" [--quick]
# MPFA_PREBUILD_OPS (default "append_kv,decode,prefill") limits the prebuild to those ops' kernels;
# MPFA_CHECK_TIMEOUT (default 480 s) bounds the tests and the suites each.
set -uo pipefail
export PYTHONUNBUFFERED=1 MPFA_CACHE_DIR=${MPFA_CACHE_DIR:-/tmp/mpfa-cache} MPFA_TEST_CACHE_DIR=${MPFA_CACHE_DIR:-/tmp/mpfa-cache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . 2>&1 | grep -v WARNING
MPFA_PREBUILD_OPS=${MPFA_PREBUILD_OPS:-append_kv,decode,prefill} python3 - <<'PY' 2>&1 | grep -v "^mpfa_jit"
import itertools, os
from mpfa_jit.ops import append_kv, decode, prefill
from mpfa_jit.warmup import warmup
A = "sm_90a"
s = [append_kv.spec(recipe=r, head_dim=d, page_size=p, arch=A)
     for r, d, p in itertools.product(append_kv.RECIPES, append_kv.HEAD_DIMS, append_kv.PAGE_SIZES)]
s += [decode.spec(recipe=r, head_dim=d, page_size=p, group_size=g, arch=A)
      for r, d, p, g in itertools.product(decode.RECIPES, decode.HEAD_DIMS, decode.PAGE_SIZES, decode.GROUP_SIZES)]
s += [prefill.spec(recipe=r, head_dim=d, page_size=p, arch=A)
      for r, d, p in itertools.product(prefill.RECIPES, prefill.HEAD_DIMS, prefill.PAGE_SIZES)]
ops = os.environ["MPFA_PREBUILD_OPS"].split(",")
s = [x for x in s if x.op in ops]
rows = warmup(s, 16, False)
bad = [r for r in rows if r[1] == "FAILED"]
print(f"{len(rows) - len(bad)} of {len(rows)} kernels built", *[f"\n{r[0]}: {r[3][-600:]}" for r in bad[:3]])
PY
# A hung kernel (a barrier mismatch in a new kernel) must not eat the whole device call: each step has a limit.
timeout "${MPFA_CHECK_TIMEOUT:-480}" python3 -m pytest ${1:-tests/gpu} -q -p no:cacheprovider --tb=line 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
if [ -n "${2:-}" ]; then
  # --publish: a suite whose rows all succeeded on the GPU its results file names replaces that file here (the
  # device's copy of the tree); one with a failed row goes to benchmarks/results/scratch (git-ignored) instead
  timeout "${MPFA_CHECK_TIMEOUT:-480}" python3 -m benchmarks.run --suites "$2" --publish --no-readme ${3:-} 2>&1 | tee "$OUT/bench.log" | grep -E "^\| |^Summary|FAILED|Error|not published" | tail -60
  # only the suites' own files: $OUT returns at most 8 files, and the other results would crowd them out. A suite
  # that was not published comes back as not-published-<file>, so it is never copied over a committed result.
  for suite in ${2//,/ }; do
    for f in "$suite"_h200.json "$suite"_h200.png; do
      if [ -f benchmarks/results/scratch/"$f" ]; then cp benchmarks/results/scratch/"$f" "$OUT/not-published-$f"
      else cp benchmarks/results/"$f" "$OUT/" 2>/dev/null; fi
    done
  done
fi
