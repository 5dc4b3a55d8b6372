"""PNG plots for the results files (matplotlib, Agg backend: no display on the GPU machine).

Generic helpers (`bar`, `line`) plus `roofline`, so later suites (prefill throughput vs
context, decode vs batch) only pick data and call one of these. Ceilings are drawn as
horizontal lines so every bar is read against what the device measured in the same run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping, Sequence


def _plt():
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError("plots need matplotlib: pip install 'mpfa[bench]' (matplotlib>=3.7)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _hlines(ax, hlines: Mapping[str, float] | None) -> None:
    styles = ["--", ":", "-."]
    for i, (label, y) in enumerate((hlines or {}).items()):
        if y is not None:
            ax.axhline(y, color="black", linestyle=styles[i % len(styles)], linewidth=1,
                       label=f"{label} ({y:,.0f})")


def _save(fig, ax, path: Path | str, dpi: int = 120) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handles, _ = ax.get_legend_handles_labels()
    if handles:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    _plt().close(fig)
    return path


def bar(labels: Sequence[str], series: Mapping[str, Sequence[float | None]], path: Path | str,
        *, title: str, ylabel: str, hlines: Mapping[str, float] | None = None) -> Path:
    """Grouped bars: one group per label, one bar per series; None values leave a gap."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * len(labels) + 2), 4.5))
    n = max(1, len(series))
    width = 0.8 / n
    for j, (name, values) in enumerate(series.items()):
        xs = [i + (j - (n - 1) / 2) * width for i in range(len(labels))]
        pts = [(x, v) for x, v in zip(xs, values) if v is not None]
        if pts:
            ax.bar([p[0] for p in pts], [p[1] for p in pts], width=width, label=name if n > 1 else None)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    _hlines(ax, hlines)
    return _save(fig, ax, path)


def _lines(ax, x: Sequence[float], series: Mapping[str, Sequence[float | None]]) -> None:
    """One marked line per series over ``x``; None values are left out of their line."""
    for name, values in series.items():
        pts = [(a, b) for a, b in zip(x, values) if b is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)


def line(x: Sequence[float], series: Mapping[str, Sequence[float | None]], path: Path | str,
         *, title: str, xlabel: str, ylabel: str, logx: bool = False,
         hlines: Mapping[str, float] | None = None) -> Path:
    """One line per series over shared x (e.g. throughput vs context length per kernel)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _lines(ax, x, series)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    _hlines(ax, hlines)
    return _save(fig, ax, path)


def line_panels(x: Sequence[float], panels: Mapping[str, Mapping[str, Sequence[float | None]]], path: Path | str,
                *, title: str, xlabel: str) -> Path:
    """``line`` for several measures over one x, side by side in one figure (a panel per measure, its y label
    the key; the series, one line each, keep one color across panels; the legend on the first)."""
    plt = _plt()
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.6 * max(1, len(panels)), 4.2), squeeze=False)
    for ax, (ylabel, series) in zip(axes[0], panels.items()):
        _lines(ax, x, series)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    return _save(fig, axes[0][0], path, dpi=90)   # three panels wide: 90 dpi reads as the others' 120


def roofline(points: Iterable[tuple[str, float, float, float]], fp8_tflops: float,
             hbm_gbps: float, path: Path | str, *, title: str = "Roofline (same-run ceilings)") -> Path:
    """Log-log roofline: attainable TFLOP/s = min(fp8_tflops, hbm_gbps * intensity).

    points: (name, flops, bytes, seconds). Intensity = flops / bytes (FLOP/B), achieved =
    flops / seconds. A point's vertical distance to the roof is its gap to the floor time.
    """
    import math

    pts = list(points)
    if fp8_tflops <= 0 or hbm_gbps <= 0:
        raise ValueError("roofline needs positive ceilings")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 5))
    ridge = fp8_tflops * 1e12 / (hbm_gbps * 1e9)  # FLOP/B where the two roofs meet
    intens = [f / b for _, f, b, _ in pts if b > 0] or [ridge]
    lo = 2 ** math.floor(math.log2(min(min(intens), ridge) / 4))
    hi = 2 ** math.ceil(math.log2(max(max(intens), ridge) * 4))
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(xs, [min(fp8_tflops, hbm_gbps * 1e9 * x / 1e12) for x in xs], color="black",
            linewidth=1.5, label=f"roof: {hbm_gbps:,.0f} GB/s, {fp8_tflops:,.0f} TFLOP/s FP8")
    for name, flops, nbytes, seconds in pts:
        if nbytes > 0 and seconds > 0:
            ax.plot(flops / nbytes, flops / seconds / 1e12, marker="o", linestyle="", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte of HBM traffic)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, ax, path)
