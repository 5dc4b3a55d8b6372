#!/usr/bin/env bash
# One device call on the H200: install, prebuild kernels in parallel, GPU + CPU tests, benchmarks.
#   MPFA_BENCH_COMMIT=<hash> bash benchmarks/h200_session.sh [suites]   (results: benchmarks/results and $OUT)
# (the device copy of the tree has no .git: the commit for the results' meta comes from the caller)
set -uo pipefail
export PYTHONUNBUFFERED=1 MPFA_CACHE_DIR=${MPFA_CACHE_DIR:-/tmp/mpfa-cache} MPFA_TEST_CACHE_DIR=/tmp/mpfa-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . 2>&1 | grep -v WARNING
python3 - <<'PY'
# Build every append specialization the GPU tests use, 16 at a time.
import itertools
from mpfa_jit.ops import append_kv
from mpfa_jit.warmup import warmup, format_table
specs = [append_kv.spec(recipe=r, head_dim=d, page_size=p, arch="sm_90a")
         for r, d, p in itertools.product(append_kv.RECIPES, append_kv.HEAD_DIMS, append_kv.PAGE_SIZES)]
print(format_table(warmup(specs, jobs=16, progress=False)))
PY
python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
python3 -m pytest tests/cpu -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cpu.log" | tail -5
python3 -m benchmarks.jit_service 2>&1 | tail -3
python3 -m benchmarks.run --suites "${1:-append}" 2>&1 | tee "$OUT/bench.log" | tail -30
cp benchmarks/results/*.json "$OUT/" 2>/dev/null; cp benchmarks/results/*.png "$OUT/" 2>/dev/null; ls "$OUT"
