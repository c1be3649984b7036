"""The plot every experiment draws: ranking P99 of both modes against the swept quantity, with the SLO.

Primitives: ``plot_sweep(points, slo_ms, path, xlabel, title, logx)``: one line per mode, a
filled marker where the point held the SLO.
"""

from __future__ import annotations

import math
from pathlib import Path

from relaygr.tools.experiment.protocol import MODES, PointRun
from relaygr.tools.report.plots import pyplot, save_plot


def plot_sweep(
    points: list[PointRun], slo_ms: float, path: Path, *, xlabel: str, title: str, logx: bool
) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode, color in zip(MODES, ("tab:blue", "tab:orange"), strict=True):
        pts = sorted(
            (p.x, p.summary.ranking.p99 if p.summary.ranking else math.nan, p.holds)
            for p in points
            if p.mode == mode
        )
        if not pts:
            continue
        ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], color=color, label=f"{mode} (ranking P99)")
        for x, y, ok in pts:
            ax.scatter([x], [y], color=color, facecolors=color if ok else "none", zorder=3)
    ax.axhline(slo_ms, color="red", ls="--", lw=1, label=f"SLO B = {slo_ms:g} ms")
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("ranking latency P99 (ms, log scale)")
    ax.set_yscale("log")
    from matplotlib.ticker import ScalarFormatter

    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.set_title(title + "\n(filled: ≥ 99 % of requests within B with their whole history)", fontsize=10)
    return save_plot(plt, fig, ax, path, which="both")
