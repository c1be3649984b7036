"""Plots of a run (PNG, matplotlib's Agg backend): ``latency_cdf.png``, ``p99_vs_qps.png``
(per-window achieved QPS), ``p99_vs_seq_len.png`` (binned by history length), ``hit_rates.png``.

Primitives: ``pyplot()``, ``save_plot`` (the common finish), ``plot_latency_cdf``, ``plot_lines``,
``plot_p99_vs``, ``plot_hit_rates``, ``run_plots`` (the four plots of one run).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from relaygr.schemas import RankedResult
from relaygr.tools.report.figures import by_history_len, ranking_ms, windows


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(plt, fig, ax, path: Path, *, legend: bool = True, **grid: str) -> Path:
    """The common finish of every plot: a light grid, a small legend, a PNG at 110 dpi."""
    ax.grid(alpha=0.3, **grid)
    if legend:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency_cdf(
    series: Mapping[str, Sequence[float]], slo_ms: float | None, path: Path, title: str
) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, vals in series.items():
        xs = sorted(v for v in vals if math.isfinite(v))
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{name} (n={len(xs)})")
    if slo_ms:
        ax.axvline(slo_ms, color="red", ls="--", lw=1, label=f"SLO {slo_ms:g} ms")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    return save_plot(plt, fig, ax, path)


def plot_lines(
    series: Mapping[str, Sequence[tuple[float, float]]],
    path: Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
    slo_ms: float | None = None,
) -> Path:
    """One line per series of (x, y) points (non-finite y left as gaps), and the SLO if given."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, pts in series.items():
        pts = sorted(pts)
        if pts:
            ys = [y if math.isfinite(y) else float("nan") for _, y in pts]
            ax.plot([x for x, _ in pts], ys, marker="o", label=name)
    if slo_ms:
        ax.axhline(slo_ms, color="red", ls="--", lw=1, label=f"SLO {slo_ms:g} ms")
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return save_plot(plt, fig, ax, path)


def plot_p99_vs(
    series: Mapping[str, Sequence[tuple[float, float]]],
    slo_ms: float | None,
    path: Path,
    *,
    xlabel: str,
    title: str,
    logx: bool = False,
) -> Path:
    return plot_lines(
        series,
        path,
        xlabel=xlabel,
        ylabel="P99 ranking latency (ms)",
        title=title,
        logx=logx,
        slo_ms=slo_ms,
    )


def plot_hit_rates(rates: Mapping[str, Mapping[str, float]], path: Path, title: str) -> Path:
    """Grouped bars: one group per series name, one bar per tier/outcome."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    keys = [k for k in ("device", "host", "disk", "inflight", "extended", "merged", "computed", "miss")]
    keys = [k for k in keys if any(k in r for r in rates.values())]
    width = 0.8 / max(1, len(rates))
    for i, (name, r) in enumerate(rates.items()):
        ax.bar([j + i * width for j in range(len(keys))], [r.get(k, 0.0) for k in keys], width, label=name)
    ax.set_xticks([j + width * (len(rates) - 1) / 2 for j in range(len(keys))], keys)
    ax.set_ylim(0, 1)
    ax.set_ylabel("share")
    ax.set_title(title)
    return save_plot(plt, fig, ax, path, legend=bool(rates), axis="y")


def run_plots(results: Sequence[RankedResult], summary: dict, out: Path, slo_ms: float) -> list[str]:
    """The four plots of one run."""
    files = [
        plot_latency_cdf(
            {"ranking": [ranking_ms(r) for r in results], "end to end": [r.latency_ms for r in results]},
            slo_ms,
            out / "latency_cdf.png",
            "Latency CDF",
        ),
        plot_p99_vs(
            {"per 5 s window": [(q, p) for q, p, _ in windows(results)]},
            slo_ms,
            out / "p99_vs_qps.png",
            xlabel="achieved QPS",
            title="P99 ranking latency against QPS",
        ),
        plot_p99_vs(
            {"by history length": [(float(b), p) for b, p, _ in by_history_len(results) if b > 0]},
            slo_ms,
            out / "p99_vs_seq_len.png",
            xlabel="history length (events, power-of-two bins)",
            title="P99 ranking latency against sequence length",
            logx=True,
        ),
        plot_hit_rates(
            {k: v for k, v in summary["hit_rates"].items()}, out / "hit_rates.png", "Prefix cache hit rates"
        ),
    ]
    return [f.name for f in files]
