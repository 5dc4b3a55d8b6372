"""Benchmark harness for mpfa: one entry point (`python -m benchmarks.run`) that measures the
device ceilings and the kernel suites for mpfa and its peers in one process, writes
`<name>.json` and PNG plots to benchmarks/results/scratch, or with `--publish` (a successful run on the GPU
the published files name: `benchmarks.publish`) to `benchmarks/results`, and regenerates the tables of
benchmarks/RESULTS.md.

Only `benchmarks.suites.*` touch mpfa or its peers, and only inside their functions, so the
report and the CPU tests run on a machine without a GPU or without mpfa installed.
"""
