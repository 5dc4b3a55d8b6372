"""How a KV pool's one-time calibration depends on the batch it sees (CPU study on SmolLM2's real K/V).

    python -m benchmarks.accuracy.calibration [--tokens 4096] [--publish] [--out FILE]

writes benchmarks/results/scratch/studies/calibration_kjv.json, or with --publish benchmarks/results/studies/.

A layer's V channel scales (and mu_K) are fixed from the first extend batch a server sees
(``PagedKVCache.calibrate``), which can be a warmup request of 3 tokens. For calibration samples of
1..N tokens and several V headrooms, this measures on KJV text: the share of V values that saturate
E4M3 later and V's rel-L2 quantization error; and for mu_K, the error 4-bit K (qk4pv8) puts into the
scores (rel-L2 of q . (K_q - K) over the spread of q . K, first query head of each group, 256 queries).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from benchmarks import cli, publish

N_CALIB = (1, 3, 16, 256, 4096)
HEADROOMS = (2.0, 16.0, 64.0, 256.0)
STUDIES = Path(__file__).resolve().parents[1] / "results" / "studies"
DEFAULT_OUT = STUDIES / "calibration_kjv.json"   # with --publish
SCRATCH_OUT = publish.SCRATCH_DIR / "studies" / DEFAULT_OUT.name


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).float()


def v_rows(caps, n_calib: int, headroom: float) -> dict:
    clipped = err = ref = 0.0
    count = 0
    for _q, _k, v in caps:
        v = v.float()
        amax = v[:n_calib].abs().amax(0)
        scale = torch.where(amax > 0, amax * headroom / 448, torch.ones_like(amax))
        y = v / scale
        clipped += (y.abs() > 448).sum().item()
        count += y.numel()
        err += (_fp8(y) * scale - v).pow(2).sum().item()
        ref += v.pow(2).sum().item()
    return {"what": "v", "calib_tokens": n_calib, "headroom": headroom, "clipped_fraction": clipped / count,
            "rel_l2": (err / ref) ** 0.5}


def k_rows(caps, n_calib: int, queries: int = 256) -> dict:
    from mpfa.recipes.fp4 import dequantize_k4, quantize_k4
    err = ref = 0.0
    for q, k, _v in caps:
        k = k.float()
        mu = k[:n_calib].mean(0)
        kq = dequantize_k4(*quantize_k4(k - mu)) + mu
        q1 = q.float().view(q.shape[0], k.shape[1], -1, k.shape[2])[:queries, :, 0]
        s = torch.einsum("thd,shd->ths", q1, k)
        err += torch.einsum("thd,shd->ths", q1, kq - k).pow(2).sum().item()
        ref += (s - s.mean(-1, keepdim=True)).pow(2).sum().item()
    return {"what": "k4_scores", "calib_tokens": n_calib, "rel_l2": (err / ref) ** 0.5}


def main(argv=None) -> int:
    ap = cli.Parser(prog="python -m benchmarks.accuracy.calibration", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="KJV tokens captured (default %(default)s)")
    ap.add_argument("--offset", type=int, default=100_000, help="character offset into the KJV text")
    publish.add_arguments(ap, out_help="the study's file", published=DEFAULT_OUT, scratch=SCRATCH_OUT,
                          publish_help="write the published study (a CPU study: any machine may)")
    args = ap.parse_args(argv)
    out = publish.destination(ap, args.out, args.publish, published=DEFAULT_OUT, scratch=SCRATCH_OUT)
    from benchmarks.accuracy import data, model
    why = model.missing_requirements()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    m, tok = model.load("cpu", torch.float32)
    text = data.kjv_text()
    ids = torch.tensor(tok(text[args.offset: args.offset + 12 * args.tokens]).input_ids[: args.tokens])
    caps = model.capture(m, ids)
    rows = [v_rows(caps, n, h) for n in N_CALIB for h in HEADROOMS] + [k_rows(caps, n) for n in N_CALIB]
    for r in rows:
        extra = f"headroom {r['headroom']:5.0f}  clipped {100 * r['clipped_fraction']:7.3f}%" if r["what"] == "v" else ""
        print(f"{r['what']:9s} calibrated on {r['calib_tokens']:5d} tokens  {extra:34s} rel-L2 {100 * r['rel_l2']:6.2f}%")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python -m benchmarks.accuracy.calibration " + " ".join(argv or sys.argv[1:]),
                               "model": model.MODEL_NAME, "tokens": len(ids), "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
