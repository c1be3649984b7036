"""The experiment's report: ``report.md`` (protocol, result, points, quality, traces, plots) and
the document behind ``report.json``.

Primitives: ``write_experiment_report(out, kind, protocol, points, traces, args) -> dict``,
``print_headline(doc, kind)``, ``point_row`` / ``ROW_HEADER`` (one row per point and mode),
``say`` (progress on stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from relaygr.tools.experiment.kinds import ExperimentKind
from relaygr.tools.experiment.protocol import PointRun, Protocol, best, plain_number
from relaygr.tools.report.markdown import fmt, table
from relaygr.tools.report.plots import plot_hit_rates, plot_latency_cdf


def say(msg: str) -> None:
    print(f"== {msg}", file=sys.stderr, flush=True)


def point_row(p: PointRun) -> list:
    s = p.summary
    lat = s.ranking
    pf = s.hit_rates.get("prefill", {})
    paths = ", ".join(f"{k} {v}" for k, v in s.path_counts.items())
    return [
        plain_number(p.x),
        p.mode,
        s.slo.requests,
        p.misses,
        p.upper,
        p.holds,
        lat.p50 if lat else None,
        lat.p99 if lat else None,
        lat.p99_9 if lat else None,
        s.latency_ms["end_to_end"].p99,
        s.slo.compliance,
        s.slo.slo_throughput_qps,
        s.history.mean_history_len,
        s.history.mean_used_len,
        s.trigger.admission_rate,
        pf.get("hit"),
        s.quality.hr_at_10,
        s.quality.ndcg_at_10,
        paths,
    ]


def _run_name(p: PointRun) -> str:
    return "first (not counted)" if p.attempt == 1 else "measured"


ROW_HEADER = [
    "point",
    "mode",
    "n",
    "k (> B)",
    "miss-rate UB",
    "holds SLO",
    "rank P50",
    "rank P99",
    "rank P99.9",
    "e2e P99",
    "compliance",
    "SLO-compliant req/s",
    "mean history",
    "mean used",
    "admission",
    "prefill hit",
    "HR@10",
    "NDCG@10",
    "paths",
]


def write_experiment_report(
    out: Path,
    kind: ExperimentKind,
    proto: Protocol,
    points: list[PointRun],
    traces: dict,
    args: argparse.Namespace | None,
) -> dict:
    """``report.md`` and the plots under ``out``; returns the report's JSON document."""
    runs = sorted(points, key=lambda p: (p.x, p.mode, p.attempt))
    points = [p for p in points if p.attempt == 2]  # the first point's first runs are only shown
    r_best, b_best = best(points, "relay"), best(points, "baseline")
    extra = kind.headline_extra(args, points, r_best, b_best)
    plots = _plots(out, kind, proto.slo_ms, points, r_best, b_best)
    headline = _headline(out, kind, proto, runs, plots, r_best, b_best, extra)
    headline["quality_at_relay_max"] = quality_at = kind.quality_at(points, r_best)
    trace_meta = {f"{x:g}": t.meta for x, t in traces.items()}
    md = [
        f"# RelayGR experiment: {kind.name}",
        "## Protocol (fixed before measuring, identical in both modes)",
        proto.markdown(),
        *_result_section(kind, proto, runs, headline, extra),
        *_quality_section(quality_at, r_best),
        *_traces_section(trace_meta),
        "## Plots",
        *[f"![{p.name}]({p.name})" for p in plots],
    ]
    (out / "report.md").write_text("\n\n".join(md) + "\n")
    return {
        "protocol": proto.model_dump(),
        "headline": headline,
        "points": [_point_doc(p) for p in runs],
        "traces": trace_meta,
    }


def _plots(
    out: Path,
    kind: ExperimentKind,
    slo: float,
    points: list[PointRun],
    r_best: float | None,
    b_best: float | None,
) -> list[Path]:
    """The kind's plots, the latency CDFs at the reference points (the baseline's best and the
    relay's best) and the relay's pre-inference outcomes per point."""
    xname = kind.x_name
    plots = kind.plots(points, slo, out)
    refs = sorted({x for x in (b_best, r_best) if x is not None}) or sorted({p.x for p in points})[:1]
    cdf = {f"{p.mode} @ {p.x:g}": p.ranking for p in points if p.x in refs}
    plots.append(plot_latency_cdf(cdf, slo, out / "latency_cdf.png", f"Ranking latency CDF ({xname})"))
    rates = {f"{p.x:g}": p.summary.hit_rates.get("prefill", {}) for p in points if p.mode == "relay"}
    plots.append(plot_hit_rates(rates, out / "hit_rates.png", f"Relay pre-inference outcomes per {xname}"))
    return plots


def _headline(
    out: Path,
    kind: ExperimentKind,
    proto: Protocol,
    runs: list[PointRun],
    plots: list[Path],
    r_best: float | None,
    b_best: float | None,
    extra: dict,
) -> dict:
    ratio = (r_best / b_best) if r_best and b_best else None
    return {
        "experiment": kind.name,
        "slo_ms": proto.slo_ms,
        "upstream_ms": proto.upstream_ms,
        f"relay_max_{kind.key}": r_best,
        f"baseline_max_{kind.key}": b_best,
        "ratio": ratio,
        "paper_ratio": kind.paper_ratio,
        "target_ratio": kind.target_ratio,
        "met_target": bool(ratio is not None and ratio >= kind.target_ratio),
        # Held at the largest point tried: the ratio is then a lower bound.
        "relay_at_largest_point": bool(r_best is not None and r_best == max(proto.points)),
        "quality_at_relay_max": None,
        "report": str(out / "report.md"),
        "plots": [p.name for p in plots],
        # Every run of every point: n requests, k over B, the miss rate's upper bound, P99.
        "points": [
            {
                "x": plain_number(p.x),
                "mode": p.mode,
                "counted": p.attempt == 2,
                "n": p.requests,
                "k": p.misses,
                "ub": round(p.upper, 5) if p.upper is not None else None,
                "p99_ms": round(p.summary.ranking.p99, 1) if p.summary.ranking else None,
                "holds": p.holds,
            }
            for p in runs
        ],
        **extra,
    }


def _result_section(
    kind: ExperimentKind, proto: Protocol, runs: list[PointRun], headline: dict, extra: dict
) -> list[str]:
    xname, ratio = kind.x_name, headline["ratio"]
    r_best, b_best = headline[f"relay_max_{kind.key}"], headline[f"baseline_max_{kind.key}"]
    lower_bound = (
        f" Relay held the SLO at the largest {xname} tried, so this is a lower bound "
        "(extend the points to find its limit)."
        if headline["relay_at_largest_point"]
        else ""
    )
    compute = (
        f" Compute ratio of full to relay ranking at {extra['history']}-event histories (predicted "
        f"by the calibration): {fmt(extra['compute_ratio'], 1)}×, the most a device-bound ratio can reach."
        if extra.get("compute_ratio")
        else ""
    )
    return [
        "## Result",
        table(["mode", f"max {xname} holding the SLO"], [["relay", r_best], ["baseline", b_best]]),
        f"**Ratio relay / baseline: {fmt(ratio, 2)}×** (paper: {kind.paper_ratio}×; target here: "
        f"≥ {kind.target_ratio}×)." + lower_bound + compute,
        "## Points",
        table(["run", *ROW_HEADER], [[_run_name(p), *point_row(p)] for p in runs], 3),
        "The first point runs twice in each mode (fresh users each time); only its second run counts. "
        "Latencies in ms. *n*: requests sent; *k*: those not ranked within B with their whole history "
        "(missing and timed-out ones included); *miss-rate UB*: the one-sided 95 % Clopper-Pearson "
        "upper bound of the miss rate; *holds SLO*: UB ≤ 1 % (P99 ≤ B with 95 % confidence). "
        "*compliance*: share of requests ranked within B with their whole history; "
        "*mean used*: events the ranking read (less than the history when truncated); *prefill hit*: "
        "pre-inferences served from a cached prefix (device/host/disk/extended/merged).",
    ]


def _quality_section(quality_at: dict | None, r_best: float | None) -> list[str]:
    if not quality_at:
        return []
    return [
        f"## Quality at the SLO (history {fmt(r_best, 0)}: the longest relay holds)",
        table(
            ["mode", "HR@10", "NDCG@10", "labelled", "mean history", "mean used"],
            [
                [m, q["hr@10"], q["ndcg@10"], q["labelled"], q["mean_history_len"], q["mean_used_len"]]
                for m, q in quality_at.items()
            ],
            3,
        ),
        "The baseline truncates to the most recent events that fit B; relay ranks the whole history. "
        "The synthesised part of a history repeats the user's real history, so a longer history adds "
        "no new items: differences in quality here reflect how the model reads repetition, not new "
        "information.",
    ]


def _traces_section(trace_meta: dict) -> list[str]:
    keys = ("requests", "warmup_requests", "users", "behaviours", "synthesised_events", "span_s")
    return [
        "## Traces",
        table(
            ["point", "requests", "warm-up", "users", "behaviours", "synthesised events", "span (s)"],
            [[x, *(m[k] for k in keys)] for x, m in trace_meta.items()],
            0,
        ),
    ]


def _point_doc(p: PointRun) -> dict:
    return {
        "x": p.x,
        "mode": p.mode,
        "attempt": p.attempt,
        "n": p.requests,
        "k": p.misses,
        "miss_rate_upper_bound": p.upper,
        "verdict": p.verdict,
        "holds": p.holds,
        "p99_ms": p.summary.ranking.p99 if p.summary.ranking else None,
        "summary": p.summary.to_dict(),
    }


def print_headline(doc: dict, kind: ExperimentKind) -> None:
    h, key = doc["headline"], kind.key
    say(
        f"{h['experiment']}: B = {h['slo_ms']:g} ms; relay max {key} {fmt(h[f'relay_max_{key}'], 0)}, "
        f"baseline max {key} {fmt(h[f'baseline_max_{key}'], 0)}, ratio {fmt(h['ratio'], 2)}x "
        f"(target {h['target_ratio']}x)"
        + (
            f"; compute ratio {fmt(h['compute_ratio'], 1)}x at {h['history']} events"
            if h.get("compute_ratio")
            else ""
        )
        + f"; report {h['report']}"
    )
