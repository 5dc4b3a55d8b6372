"""Decode split-count sweep: the same decode call at forced KV split counts, beside the adaptive plan
(`choose_num_splits`) and the SGLang backend's (`server_decode_splits`), at the running batches SGLang
decodes in the long-context throughput runs (benchmarks/e2e; e.g. ~14 x 128K for qk4pv8's pool, ~6 x 128K
for FlashInfer BF16's).

    python -m benchmarks.run --suites decode_splits

Each (batch, context, recipe) builds one cache (random bf16 K/V through the append kernel, pages in random
order, as the decode suite) and times every split count on it: the split rule's choices are judged against
the best forced count in the same run, not against an earlier sweep (which let part of the cache sit in
L2: benchmarks/NOTES.md, "decode split count"). Page size 16, head_dim 128, 32 query / 8 KV heads.

The decode suite's mixed-length batches (``SPREAD_SHAPES``, ids ending ``/spread``) also run at forced split
sizes (``plan`` "size": every request cut into splits of that many tokens, the grid just covering the longest),
the cut the SGLang backend makes with its one size per batch: the best size against the server's shows what
sizing splits from the longest request costs when the batch's lengths differ.
"""
from __future__ import annotations

from benchmarks.suites import _rows
from benchmarks.suites import decode as _decode

NAME = "decode_splits"
RESULT = "decode_splits_h200"

PAGE = 16
RECIPES = ("bf16", "qk4pv8")
# (batch, context): the issue's single long request, the e2e runs' running batches (BF16 / qk4pv8 pools at
# 128K, 64K, 32K), and the decode suite's 8 x 128K.
SHAPES = ((1, 131072), (6, 131072), (8, 131072), (14, 131072), (12, 65536), (28, 65536), (25, 32768), (55, 32768))
FORCED = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64)
SPREAD_SHAPES = _decode.SPREAD_SHAPES
# tokens per split on the mixed-length batches: every 2K up to 32K (a rule's size lands within ~10% of one), then coarser
FORCED_SIZES = (1024, *range(2048, 32769, 2048), 49152, 65536, 98304, 131072)
MAX_CTAS = 132 * 16   # forced counts past ~16 CTAs per SM (4 waves at 4 resident) only add merge work

TABLE = [
    ("kv", "recipe", "{}"),
    ("batch", "batch", "{}"),
    ("context", "context", "{}"),
    ("lengths", "lengths", "{}"),
    ("plan", "plan", "{}"),
    ("split size", "forced_split_size", "{}"),
    ("splits", "num_splits", "{}"),
    ("ms", "ms", "{:.4f}"),
    ("of HBM read", "hbm_fraction", "{:.2f}"),
    ("status", "status", "{}"),
]


def _case(recipe, batch, context, plan, splits=None, *, size=None, spread=False):
    tag = f"size{size}" if size else plan if splits is None else f"forced{splits}"
    case = {"id": f"{recipe}/b{batch}/ctx{context}/{tag}" + ("/spread" if spread else ""), "kind": "kernel",
            "impl": "mpfa", "recipe": recipe, "batch": batch, "context": context, "page_size": PAGE, "plan": plan,
            "forced_splits": splits, "qo_heads": _decode.QO_HEADS, "kv_heads": _decode.KV_HEADS,
            "head_dim": _decode.HEAD_DIM}
    if size:
        case["forced_split_size"] = size
    if spread:
        case.update(_decode.spread_fields(batch, context))
    return case


def forced_counts(batch: int, context: int) -> list[int]:
    """The forced split counts worth timing for a shape: no split shorter than the kernel allows, no grid
    past MAX_CTAS (but always 1)."""
    from mpfa.decode import MIN_TOKENS_PER_SPLIT
    cap = max(1, context // MIN_TOKENS_PER_SPLIT)
    return [s for s in FORCED if s == 1 or (s <= cap and batch * _decode.KV_HEADS * s <= MAX_CTAS)]


def cases(quick: bool = False) -> list[dict]:
    shapes = SHAPES[:2] if quick else SHAPES
    out = []
    for b, ctx in shapes:
        for r in RECIPES:   # grouped by (shape, recipe): consecutive cases share one cache
            out += [_case(r, b, ctx, "adaptive"), _case(r, b, ctx, "server")]
            out += [_case(r, b, ctx, "forced", s) for s in forced_counts(b, ctx)]
    for b, ctx in ([] if quick else SPREAD_SHAPES):
        for r in RECIPES:
            out += [_case(r, b, ctx, "adaptive", spread=True), _case(r, b, ctx, "server", spread=True)]
            out += [_case(r, b, ctx, "forced", s, spread=True) for s in forced_counts(b, ctx)]
            out += [_case(r, b, ctx, "size", size=w, spread=True) for w in FORCED_SIZES if w <= ctx]
    return out


_built: dict = {}   # the last (recipe, batch, context)'s cache, page table and query


def _setup(case, seed):
    import torch
    key = (case["recipe"], case["batch"], case["context"], _decode.is_spread(case))
    if key not in _built:
        _built.clear()
        torch.cuda.empty_cache()
        gen = torch.Generator(device="cuda").manual_seed(seed)
        _built[key] = _decode.mpfa_inputs(case["recipe"], _decode.case_lengths(case), PAGE, gen)
    return _built[key]


def run_case(case: dict, ctx) -> dict:
    import torch
    import mpfa
    from mpfa.decode import resident_ctas
    cache, (indptr, indices, last), q = _setup(case, ctx.seed)
    b, c, r = case["batch"], case["context"], case["recipe"]
    splits = ({"num_splits": case["forced_splits"]} if case["plan"] == "forced" else
              {"fixed_split_size": case["forced_split_size"]} if case["plan"] == "size" else
              _decode.server_splits(r, _decode.case_lengths(case), PAGE) if case["plan"] == "server" else {})
    w = mpfa.BatchDecodeWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(indptr, indices, last, _decode.QO_HEADS, _decode.KV_HEADS, _decode.HEAD_DIM, PAGE, recipe=r, **splits)
    out = torch.empty_like(q)
    layer = cache.layer(0)
    timing = ctx.bench(lambda: w.run(q, layer, out=out))
    return _rows.measured_row(case, timing, num_splits=w.num_splits, bytes_per_token_head=cache.bytes_per_token_head,
                              num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                              resident_ctas=resident_ctas(r, _decode.HEAD_DIM, PAGE, _decode.QO_HEADS // _decode.KV_HEADS, 0),
                              bytes=_decode.read_bytes(_decode.case_lengths(case), cache.bytes_per_token_head))


annotate = _decode.annotate


def _by_shape(rows: list[dict]) -> dict[tuple, tuple[list[dict], dict | None]]:
    """(recipe, batch, context, mixed lengths) -> (its measured rows, its fastest forced row, count or size, or
    None)."""
    per: dict = {}
    for r in _rows.ok_kernels(rows):
        per.setdefault((r["recipe"], r["batch"], r["context"], _decode.is_spread(r)), []).append(r)
    return {k: (group, min((r for r in group if r["plan"] in ("forced", "size")), key=lambda r: r["ms"], default=None))
            for k, group in sorted(per.items())}


def readme_rows(rows: list[dict]) -> list[dict]:
    """The README's table: per (recipe, shape) the adaptive and server plans and the fastest forced row."""
    best = {id(b) for _, b in _by_shape(rows).values() if b is not None}
    return [r for r in rows if r.get("kind") != "kernel" or r.get("status") != "ok"
            or r["plan"] not in ("forced", "size") or id(r) in best]


def rule_replay(recipe: str, batch: int, context: int, group: list[dict], spread: bool = False) -> dict[str, int]:
    """What this checkout's rules give a shape whose longest request has ``context`` tokens: the adaptive
    plan's split count (``choose_num_splits``), and the SGLang backend's split size (``server_decode_splits``)
    with the count it cuts the longest request into (the rest of its grid, past the last split, exits at once);
    ``spread``: the batch's lengths are the decode suite's ``spread_lengths`` (else all ``context``)."""
    from mpfa.decode import TILE, choose_num_splits, server_decode_splits
    sms, resident = group[0]["num_sms"], group[0]["resident_ctas"]
    size, _ = server_decode_splits(_decode.KV_HEADS, batch, context, _decode.SERVER_CONTEXT, sms, resident_ctas=resident,
                                   lengths=_decode.spread_lengths(batch, context) if spread else [context] * batch)
    tiles, per = -(-context // TILE), size // TILE
    return {"adaptive": choose_num_splits(batch, _decode.KV_HEADS, context, sms, resident_ctas=resident),
            "server": -(-tiles // per), "server_size": size}


def _replayed(entry: dict, rules: dict, group: list[dict], best: dict, spread: bool) -> None:
    """``rule_<plan>_splits`` and ``rule_<plan>_over_best`` into ``entry``: the time of the row cut as the rule
    cuts (None where no row did). One length: a count is a count (adaptive and forced rows, grid = count). Mixed
    lengths: the adaptive count cuts each request into that many parts (forced rows), the server's size cuts every
    request into splits of that size (size rows)."""
    by_count = {r["num_splits"]: r["ms"] for r in group if r["plan"] in ("adaptive", "forced")}
    by_size = {r["forced_split_size"]: r["ms"] for r in group if r["plan"] == "size"}
    for plan in ("adaptive", "server"):
        entry[f"rule_{plan}_splits"] = rules[plan]
        ms = by_size.get(rules["server_size"]) if spread and plan == "server" else by_count.get(rules[plan])
        entry[f"rule_{plan}_over_best"] = ms / best["ms"] if ms else None


def summarize(rows: list[dict]) -> dict:
    """Per (recipe, batch x context): the adaptive and the server plan's split count and time over the best
    forced row's time (1.0: the rule found the best cut); and the rules of this checkout replayed on the run
    (``rule_*``: the time measured at the cut they give now, None where no row timed it), so a rule change is
    judged on the sweep that motivated it before a GPU run measures it directly. Mixed-length shapes (keys
    ending ``/spread``, their best among forced counts and sizes) stand apart: the ``*_over_best_*`` aggregates
    cover the one-length shapes, ``spread_*`` the others."""
    from benchmarks.stats import geomean
    shapes, one, mixed = {}, [], []
    for (recipe, b, c, spread), (group, best) in _by_shape(rows).items():
        if best is None:
            continue
        entry = {"best_splits": best["num_splits"], "best_ms": best["ms"]}
        if spread:
            entry["best_split_size"] = best.get("forced_split_size")
        for plan in ("adaptive", "server"):
            mine = next((r for r in group if r["plan"] == plan), None)
            if mine:
                entry[f"{plan}_splits"] = mine["num_splits"]
                entry[f"{plan}_over_best"] = mine["ms"] / best["ms"]
        _replayed(entry, rule_replay(recipe, b, c, group, spread), group, best, spread)
        shapes[f"{recipe}/{b}x{c}" + ("/spread" if spread else "")] = entry
        (mixed if spread else one).append(entry)
    out = {"by_shape": shapes}
    for key in ("adaptive", "server", "rule_adaptive", "rule_server"):
        ratios = [e.get(f"{key}_over_best") for e in one]
        out[f"{key}_over_best_worst"] = max((x for x in ratios if x), default=None)
        out[f"{key}_over_best_geomean"] = geomean(ratios)
    if mixed:
        for key in ("adaptive", "server"):
            out[f"spread_{key}_over_best_worst"] = max((e[f"{key}_over_best"] for e in mixed
                                                        if e.get(f"{key}_over_best")), default=None)
    out["rule_counts_untimed"] = sum(e[f"rule_{p}_over_best"] is None for e in shapes.values() for p in ("adaptive", "server"))
    return {**out, **_rows.run_counts(rows)}
