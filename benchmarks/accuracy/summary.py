"""``summarize(rows)``: the summary of ``accuracy.json``, computed only from its rows.

Loss. A quantized recipe's *loss* is the error it adds over the bf16 recipe measured the same way:
``loss(x) = err(x) - err(bf16)``, with err the kernel output's relative L2 against fp64 (kernel
level) or the perplexity (model level). Compensation's *recovery* is the share of the loss without
compensation that compensation removes:

    recovery = (err_without - err_with) / (err_without - err_bf16)
             = 1 - loss(with) / loss(without)

(1 = compensation gives back everything the recipe lost, 0 = nothing, < 0 = it made things worse).

* ``compensation_recovery_kernel``: qk4pv8 prefill (K smoothing on) on Q/K/V captured from every
  layer of SmolLM2 on KJV text, at the longest captured context (``kernel_real_context``).
* ``compensation_recovery_ppl``: qk4pv8 (K smoothing on) perplexity on KJV at ``ppl_context``
  (8K when the run has it, else its longest length).
* ``ppl_increase_<recipe>`` = ppl(recipe, with compensation) / ppl(bf16) - 1, same text and length (``_stdlib``:
  on the stdlib sources), for each of MEASURED_RECIPES; None where the run has no row of it.
* ``kl_<recipe>``: mean per-token KL(bf16 || recipe), nats, same text and length.
* ``compensation_recovery_kernel_outlier`` (``_qk8pv8``): the same on the synthetic inputs with outlier
  channels (:mod:`.kernel`), at their longest context (``kernel_outlier_context``).
* ``ppl_recovery_is_noise``: true when qk4pv8's perplexity loss without compensation is under 0.2%
  (the recovery is then a ratio of two differences within noise and means little).
* ``needle_bf16_lengths_ge_90``: lengths where the bf16 recipe retrieves the passkey in >= 90% of
  trials (the lengths where retrieval is meaningful for this model).
* ``recipes``: the per-recipe table (kernel error on real activations and on synthetic outliers,
  perplexity increase, KL, top-1 agreement, needle accuracy per length).
"""
from __future__ import annotations

from mpfa_jit.ops.prefill import RECIPES

from .model import PEER_FA3_FP8_KV, PEER_FP8_KV

RESULT = "accuracy"   # benchmarks/results/accuracy.json
NOISE_PPL = 0.002


def _ok(rows):
    return [r for r in rows if r.get("status", "ok") == "ok"]


def _one(rows, **want):
    for r in rows:
        if all(r.get(k) == v for k, v in want.items()):
            return r
    return None


def _recovery(without, with_, base):
    if None in (without, with_, base) or without == base:
        return None
    return (without - with_) / (without - base)


def _comp(recipe, comp=True):
    return None if recipe == "bf16" else comp


def _smooth(recipe, smooth=True):
    return None if recipe == "bf16" else smooth


# the quantized recipes whose perplexity increase and KL the summary names (ppl_increase_<recipe>[_stdlib], kl_<recipe>)
MEASURED_RECIPES = ("qk4pv8", "qk8pv8", "qk4pv4")


def summarize(rows: list[dict]) -> dict:
    all_rows, rows = rows, _ok(rows)
    kern = [r for r in rows if r.get("kind") == "kernel" and r.get("op") == "prefill"]
    model = [r for r in rows if r.get("kind") == "model"]
    needle = [r for r in rows if r.get("kind") == "needle"]
    out: dict = {}

    # kernel level, real activations
    real = [r for r in kern if r.get("source") == "kjv-activations"]
    real_ctx = max((r["context"] for r in real), default=None)
    out["kernel_real_context"] = real_ctx

    def kerr(recipe, comp=True, smooth=True, source="kjv-activations", ctx=real_ctx, key="rel_l2"):
        r = _one(kern, source=source, context=ctx, recipe=recipe, compensation=_comp(recipe, comp),
                 smoothing=_smooth(recipe, smooth))
        return None if r is None else r.get(key)

    out["compensation_recovery_kernel"] = _recovery(kerr("qk4pv8", False), kerr("qk4pv8", True), kerr("bf16"))
    out["compensation_recovery_kernel_qk8pv8"] = _recovery(kerr("qk8pv8", False), kerr("qk8pv8", True), kerr("bf16"))

    # model level: KJV at 8K if present, else the longest length
    kjv = [r for r in model if r.get("text") == "kjv" and r.get("impl") == "mpfa"]
    lens = sorted({r["context"] for r in kjv})
    ppl_ctx = 8192 if 8192 in lens else (lens[-1] if lens else None)
    out["ppl_context"] = ppl_ctx

    def mrow(recipe, comp=True, smooth=True, text="kjv", ctx=ppl_ctx, impl="mpfa"):
        return _one(model, text=text, context=ctx, impl=impl, recipe=recipe, compensation=_comp(recipe, comp),
                    smoothing=_smooth(recipe, smooth))

    def ppl(*a, **k):
        r = mrow(*a, **k)
        return None if r is None else r.get("ppl")

    base = ppl("bf16")
    out["compensation_recovery_ppl"] = _recovery(ppl("qk4pv8", False), ppl("qk4pv8", True), base)
    for rc in MEASURED_RECIPES:
        p = ppl(rc, True)
        out[f"ppl_increase_{rc}"] = None if None in (p, base) else p / base - 1
        r = mrow(rc, True)
        out[f"kl_{rc}"] = None if r is None else r.get("kl")
    p0 = ppl("qk4pv8", False)
    out["ppl_loss_qk4pv8_without_compensation"] = None if None in (p0, base) else p0 / base - 1
    out["ppl_recovery_is_noise"] = (None if out["ppl_loss_qk4pv8_without_compensation"] is None
                                    else out["ppl_loss_qk4pv8_without_compensation"] < NOISE_PPL)
    st = mrow(None, None, None, impl="stock")
    out["stock_vs_bf16_kl"] = None if st is None else st.get("kl")
    base_stdlib = ppl("bf16", text="stdlib")
    for rc in MEASURED_RECIPES:
        p = ppl(rc, True, text="stdlib")
        out[f"ppl_increase_{rc}_stdlib"] = None if None in (p, base_stdlib) else p / base_stdlib - 1

    # needle
    nb = [r for r in needle if r.get("impl") == "mpfa" and r.get("recipe") == "bf16"]
    out["needle_bf16_lengths_ge_90"] = sorted(r["context"] for r in nb if (r.get("accuracy") or 0) >= 0.9)

    # per-recipe table
    outl = [r for r in kern if r.get("source") == "outlier"]
    outl_ctx = max((r["context"] for r in outl), default=None)
    table = {}
    measured = {r.get("recipe") for r in rows}
    for rc in (r for r in RECIPES if r in measured):   # a recipe without rows (not run yet) has no table row
        mr = mrow(rc, True)
        m0 = None if rc == "bf16" else mrow(rc, False)
        t = {
            "kernel_rel_l2_real": kerr(rc),
            "kernel_cos_real": kerr(rc, key="cos"),
            "kernel_rel_l2_real_no_comp": None if rc == "bf16" else kerr(rc, False),
            "kernel_rel_l2_real_no_smoothing": None if rc == "bf16" else kerr(rc, True, False),
            "kernel_rel_l2_outlier": kerr(rc, source="outlier", ctx=outl_ctx),
            "ppl": None if mr is None else mr.get("ppl"),
            "ppl_increase": None if (mr is None or base is None) else mr["ppl"] / base - 1,
            "kl": None if mr is None else mr.get("kl"),
            "ppl_increase_no_comp": None if (m0 is None or base is None) else m0["ppl"] / base - 1,
            "kl_no_comp": None if m0 is None else m0.get("kl"),
            "top1_agree": None if mr is None else mr.get("top1_agree"),
            "needle": {str(r["context"]): r.get("accuracy") for r in needle
                       if r.get("impl") == "mpfa" and r.get("recipe") == rc and r.get("compensation") == _comp(rc)},
        }
        table[rc] = t
    # the peers: SGLang over an FP8 E4M3 KV cache, read by FlashInfer and by its default Hopper backend, fa3 (FA3's
    # FP8 path: Q and P in E4M3 too); model level only, emulated (benchmarks/accuracy/model.py)
    for peer in (PEER_FP8_KV, PEER_FA3_FP8_KV):
        pr = mrow(None, None, None, impl=peer)
        if pr is None or base is None:
            continue
        pn = [r for r in needle if r.get("impl") == peer]
        table[f"{peer} (peer)"] = {"ppl": pr.get("ppl"), "ppl_increase": pr["ppl"] / base - 1, "kl": pr.get("kl"),
                                   "top1_agree": pr.get("top1_agree"),
                                   "needle": {str(r["context"]): r.get("accuracy") for r in pn}}
        key = peer.replace("-", "_")
        out[f"ppl_increase_{key}"], out[f"kl_{key}"] = pr["ppl"] / base - 1, pr.get("kl")
    out["kernel_outlier_context"] = outl_ctx
    # the prefill issue's figure: inputs with outlier channels, the longest context measured
    for rc in ("qk4pv8", "qk8pv8"):
        key = "compensation_recovery_kernel_outlier" + ("" if rc == "qk4pv8" else "_qk8pv8")
        out[key] = _recovery(kerr(rc, False, source="outlier", ctx=outl_ctx),
                             kerr(rc, True, source="outlier", ctx=outl_ctx), kerr("bf16", source="outlier", ctx=outl_ctx))
    out["recipes"] = table
    out["errors"] = sum(1 for r in all_rows if r.get("status") == "error")
    out["skipped"] = sum(1 for r in all_rows if r.get("status") == "skipped")
    return out


RECIPE_COLUMNS = (   # (header, key in summary["recipes"][recipe], format)
    ("kernel rel-L2, real (comp on)", "kernel_rel_l2_real", "{:.4f}"),
    ("comp off", "kernel_rel_l2_real_no_comp", "{:.4f}"),
    ("K smoothing off", "kernel_rel_l2_real_no_smoothing", "{:.4f}"),
    ("kernel rel-L2, outliers", "kernel_rel_l2_outlier", "{:.4f}"),
    ("ppl", "ppl", "{:.3f}"),
    ("ppl increase", "ppl_increase", "{:+.1%}"),
    ("KL (nats)", "kl", "{:.4f}"),
    ("ppl increase, comp off", "ppl_increase_no_comp", "{:+.1%}"),
    ("KL, comp off", "kl_no_comp", "{:.4f}"),
    ("top-1 agree", "top1_agree", "{:.3f}"),
)


def recipe_table(summary: dict) -> list[str]:
    """The per-recipe table of ``summary["recipes"]`` as markdown lines (needle accuracy per length last)."""
    recipes = summary.get("recipes") or {}
    lengths = sorted({int(k) for r in recipes.values() for k in (r.get("needle") or {})})
    head = ["recipe"] + [h for h, _, _ in RECIPE_COLUMNS] + [f"needle {n // 1024}K" for n in lengths]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in recipes.items():
        cells = [name] + ["—" if r.get(k) is None else fmt.format(r[k]) for _, k, fmt in RECIPE_COLUMNS]
        cells += ["—" if (r.get("needle") or {}).get(str(n)) is None else f"{r['needle'][str(n)]:.0%}" for n in lengths]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
