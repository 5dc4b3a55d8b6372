"""SASS census of built kernels: instructions, registers and spills per kernel function, without a GPU.

    MPFA_CUDA_ARCH=sm_90a python -m benchmarks.sass_census --out /tmp/sass_after.json
    python -m benchmarks.sass_census --compare /tmp/sass_before.json /tmp/sass_after.json

A kernel change is predicted here before it spends GPU time: a refactor must leave every count within
1% and every register count equal; a speed change names the instructions it removes. Builds go through
the JIT service (the cache in MPFA_CACHE_DIR), so a rerun of unchanged kernels only reads SASS.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

from benchmarks import cli

# The page sizes whose code differs: 1 (one token per page), 16 (the common case), 64 (a page larger than a
# decode tile); decode's GQA groups 1, 4 and 8. Recipes and head_dims: every one the op builds.
_PAGES = (1, 16, 64)


def _default_params(op: str) -> list[dict]:
    from mpfa_jit import ops
    mod = getattr(ops, op)
    pages = [p for p in _PAGES if p in mod.PAGE_SIZES and (op == "decode" or p != 64)]
    rows = [dict(recipe=r, head_dim=d, page_size=p) for r in mod.RECIPES for d in mod.HEAD_DIMS for p in pages]
    if op == "decode":
        rows = [dict(row, group_size=g) for row in rows for g in (1, 4, 8)]
    return rows


OPS = ("append_kv", "decode", "prefill")
HISTORY_KEY = "census_in_git_history"   # a reduced census file's pointer to the full one: not a build

_INSTR = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_FUNC = re.compile(r"^\s+Function : (\S+)")
_RES = re.compile(r"Function (\S+):\s*\n?\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def _specs(ops):
    from mpfa_jit import env
    from mpfa_jit import ops as op_modules
    arch = env.target_arch()
    return [getattr(op_modules, op).spec(**params, arch=arch) for op in ops for params in _default_params(op)]


def tool_env() -> tuple[str, dict]:
    """(cuobjdump, an environment with nvdisasm on PATH): --dump-sass runs nvdisasm."""
    from mpfa_jit import env
    cuobjdump, nvdisasm = env.cuda_tool("cuobjdump"), env.cuda_tool("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        raise FileNotFoundError("cuobjdump / nvdisasm not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm "
                                "(the test extra)")
    return cuobjdump, {**os.environ, "PATH": os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", "")}


def census_of(library: str) -> dict:
    """{function: {instructions, registers, stack, local, spill_ops}} of one built library."""
    cuobjdump, tenv = tool_env()
    res = subprocess.run([cuobjdump, "--dump-resource-usage", library], capture_output=True, text=True, check=True,
                         env=tenv)
    out = {}
    for m in _RES.finditer(res.stdout):
        out[m.group(1)] = dict(registers=int(m.group(2)), stack=int(m.group(3)), local=int(m.group(5)),
                               instructions=0, spill_ops=0)
    sass = subprocess.run([cuobjdump, "--dump-sass", library], capture_output=True, text=True, check=True, env=tenv)
    func = None
    for line in sass.stdout.splitlines():
        fm = _FUNC.match(line)
        if fm:
            func = fm.group(1)
            out.setdefault(func, dict(registers=-1, stack=0, local=0, instructions=0, spill_ops=0))
            continue
        im = _INSTR.match(line)
        if im and func:
            op = im.group(2)
            if op in ("NOP",):
                continue
            out[func]["instructions"] += 1
            if op.startswith(("LDL", "STL")):
                out[func]["spill_ops"] += 1
    return out


def run(ops, jobs: int) -> dict:
    from mpfa_jit import Store, build_only
    specs = _specs(ops)
    store = Store()
    result = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futs = {pool.submit(build_only, s): s for s in specs}
        for fut in tqdm(futs, desc="sass census", unit="kernel", file=sys.stderr):
            spec = futs[fut]
            uri = fut.result()[0]
            result[spec.key] = census_of(str(store.library(uri)))
    return result


def short_name(mangled: str) -> str:
    """A kernel's unqualified name: builds name the anonymous namespace after a per-build hash, and a refactor
    may move a kernel into a named namespace or change its parameter types, so functions match by this."""
    try:
        name = subprocess.run(["c++filt", mangled], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        name = mangled
    name = name.replace("(anonymous namespace)", "")
    while True:   # drop template arguments, innermost first
        stripped = re.sub(r"<[^<>]*>", "", name)
        if stripped == name:
            break
        name = stripped
    return name.split("(")[0].split("::")[-1]


def compare(before: dict, after: dict, tolerance: float = 0.01) -> int:
    """Print every function whose counts moved; returns the number outside tolerance (instructions by
    ``tolerance``, registers or spills by any amount)."""
    bad = 0
    for key in sorted(set(before) | set(after)):
        if key not in before or key not in after:
            print(f"{key}: only in {'after' if key in after else 'before'}")
            bad += 1
            continue
        b_funcs, a_funcs = before[key], after[key]
        bmap = {short_name(f): v for f, v in b_funcs.items()}
        amap = {short_name(f): v for f, v in a_funcs.items()}
        for f in sorted(set(bmap) | set(amap)):
            b, a = bmap.get(f), amap.get(f)
            if b is None or a is None:
                print(f"{key} {f}: only in {'after' if b is None else 'before'}")
                bad += 1
                continue
            di = (a["instructions"] - b["instructions"]) / max(1, b["instructions"])
            out_of = abs(di) > tolerance or a["registers"] != b["registers"] or a["spill_ops"] != b["spill_ops"]
            if out_of or a["instructions"] != b["instructions"]:
                print(f"{'OUT ' if out_of else '    '}{key} {f}: instructions {b['instructions']} -> {a['instructions']} "
                      f"({di:+.2%}), registers {b['registers']} -> {a['registers']}, spills {b['spill_ops']} -> "
                      f"{a['spill_ops']}")
            bad += out_of
    print(f"{bad} functions outside {tolerance:.0%} instructions / equal registers and spills")
    return bad


def read_census(ap, path: str) -> dict:
    """A census file written by --out (a parser error naming the file when it is missing or not one)."""
    try:
        with open(path) as f:
            census = json.load(f)
    except OSError as e:
        ap.error(f"--compare: cannot read {path}: {e.strerror}")
    except json.JSONDecodeError as e:
        ap.error(f"--compare: {path} is not JSON ({e})")
    if isinstance(census, dict):
        # the committed studies keep kernels by short name (as compared) and point to the full census in git history
        census.pop(HISTORY_KEY, None)
    if not isinstance(census, dict) or not all(isinstance(v, dict) for v in census.values()):
        ap.error(f"--compare: {path} is not a census file (an object of kernels, as --out writes)")
    return census


def main(argv=None) -> int:
    ap = cli.Parser(prog="python -m benchmarks.sass_census", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="append_kv,decode,prefill", help="comma-separated ops (default: all three)")
    ap.add_argument("--out", help="write the census JSON here")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two census files")
    a = ap.parse_args(argv)
    if a.compare:
        before, after = (read_census(ap, path) for path in a.compare)
        return 1 if compare(before, after) else 0
    ops = [o.strip() for o in a.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        ap.error(f"--ops: unknown {unknown}; accepted: {list(OPS)}")
    result = run(ops, a.jobs)
    text = json.dumps(result, indent=1, sort_keys=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
