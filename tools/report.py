"""Report of a results topic: latency, SLO compliance, trigger, cache tiers, path mix and quality.

`relaygr report --out DIR` reads the results topic of a pipeline (and the trace, for ground truth
that results lack; the prefill-signals topic, for the trigger's admissions; the ranking workers'
event logs, for pre-inference outcomes) and writes ``report.json``, ``report.md`` and PNG plots.

Definitions (the figure computations are pure functions of a list of ``RankedResult``):
- percentiles are nearest-rank: P(q) is the smallest value with at least q % of values at or
  below it (so P99 of 100 values is the 99th smallest);
- ranking latency is ``breakdown_ms["ranking"]`` (rank request produced -> result produced), end
  to end is ``latency_ms`` (request sent -> result produced);
- a request meets the SLO when it has a result, was ranked (path not ``timeout``), its ranking
  latency is at most the bound B, and, unless truncation is allowed, it used its whole history
  (``used_len >= history_len``). A run holds the SLO when at least 99 % of its requests meet it,
  i.e. when the P99 of ranking latency, counting missing, timed-out and truncated requests as
  infinitely late, is at most B (``slo_p99_ms``);
- SLO-compliant throughput = requests that met the SLO / the run's duration (given, or the span
  of the requests' send times times n / (n - 1));
- trigger admission rate = prefill signals / requests; cache hit rates per tier: where the rank
  lookup found the prefix (``prefix_tier``) and how pre-inference got it (worker logs);
- HR@10 / NDCG@10: the true next item among the ranked top 10 (a label missing from the
  candidates is a miss).

Plots: ``latency_cdf.png``, ``p99_vs_qps.png`` (per-window achieved QPS), ``p99_vs_seq_len.png``
(binned by history length), ``hit_rates.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from relaygr.infra.topic_reader import read_topic
from relaygr.schemas import RankedResult

QUANTILES = (50.0, 90.0, 99.0, 99.9)
STAGES = (
    "hop_requests",
    "retrieval",
    "hop_retrieved",
    "preprocess",
    "hop_rank",
    "ranking",
    "lookup",
    "prefix_wait",
    "compute",
)
PREFILL_HITS = ("device", "host", "disk", "extended", "merged")


# ---------------------------------------------------------------------- figures (pure)


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (``math.inf`` values allowed); NaN for no values."""
    xs = sorted(values)
    if not xs:
        return math.nan
    rank = max(1, math.ceil(q / 100.0 * len(xs) - 1e-9))
    return float(xs[min(rank, len(xs)) - 1])


def latency_summary(values: Sequence[float]) -> dict[str, float]:
    out = {_qname(q): percentile(values, q) for q in QUANTILES}
    out["mean"] = sum(values) / len(values) if values else math.nan
    out["max"] = max(values) if values else math.nan
    out["n"] = len(values)
    return out


def _qname(q: float) -> str:
    return f"p{q:g}"


def ranking_ms(r: RankedResult) -> float:
    return float(r.breakdown_ms.get("ranking", math.nan))


def stage_latencies(results: Sequence[RankedResult]) -> dict[str, dict[str, float]]:
    """End to end and every stage of the breakdown that appears in the results."""
    out = {"end_to_end": latency_summary([r.latency_ms for r in results])}
    for st in STAGES:
        vals = [r.breakdown_ms[st] for r in results if st in r.breakdown_ms]
        if vals:
            out[st] = latency_summary(vals)
    return out


def meets_slo(r: RankedResult, slo_ms: float, *, allow_truncated: bool = False) -> bool:
    if r.path.value == "timeout" or not ranking_ms(r) <= slo_ms:
        return False
    return allow_truncated or r.used_len >= r.history_len


def run_duration_s(results: Sequence[RankedResult]) -> float:
    """Span of the requests' send times, stretched by n / (n - 1) (one mean gap per request)."""
    if len(results) < 2:
        return math.nan
    ts = [r.ts for r in results]
    span = max(ts) - min(ts)
    return span * len(ts) / (len(ts) - 1) if span > 0 else math.nan


def slo_figures(
    results: Sequence[RankedResult],
    slo_ms: float,
    *,
    expected: int | None = None,
    duration_s: float | None = None,
    allow_truncated: bool = False,
) -> dict[str, float | int | bool]:
    """Compliance with the ranking-latency bound ``slo_ms``; ``expected`` requests (default: the
    results) count a missing result as a violation."""
    n = max(expected or 0, len(results))
    ok = [meets_slo(r, slo_ms, allow_truncated=allow_truncated) for r in results]
    eff = [ranking_ms(r) if good else math.inf for r, good in zip(results, ok, strict=True)]
    eff += [math.inf] * (n - len(results))
    dur = duration_s if duration_s is not None else run_duration_s(results)
    compliant = sum(ok)
    p99 = percentile(eff, 99.0)
    return {
        "slo_ms": slo_ms,
        "requests": n,
        "results": len(results),
        "compliant": compliant,
        "compliance": compliant / n if n else math.nan,
        "within_latency": sum(ranking_ms(r) <= slo_ms for r in results),
        "truncated": sum(r.used_len < r.history_len for r in results),
        "timeouts": sum(r.path.value == "timeout" for r in results),
        "missing": n - len(results),
        "slo_p99_ms": p99,
        "holds_slo": bool(p99 <= slo_ms),
        "duration_s": dur,
        "throughput_qps": n / dur if dur and dur > 0 else math.nan,
        "slo_throughput_qps": compliant / dur if dur and dur > 0 else math.nan,
    }


def path_mix(results: Sequence[RankedResult]) -> dict[str, dict[str, float]]:
    c = Counter(r.path.value for r in results)
    n = len(results)
    return {p: {"count": k, "share": k / n} for p, k in sorted(c.items())}


def admission(requests: int, admitted: int | None) -> dict[str, float | int | None]:
    if admitted is None:
        return {"admitted": None, "admission_rate": None}
    return {"admitted": admitted, "admission_rate": admitted / requests if requests else math.nan}


def hit_rates(
    results: Sequence[RankedResult], prefill_statuses: Iterable[str] | None = None
) -> dict[str, dict[str, float]]:
    """Shares of rank lookups by tier (results with a ``prefix_tier``), and of pre-inference
    outcomes (``device``/``host``/``disk``: whole prefix found there; ``extended``: a shorter one
    found and extended; ``merged``: joined a computation in flight; ``computed``: a miss;
    ``refused``: over a bound)."""
    out: dict[str, dict[str, float]] = {}
    tiers = Counter(r.prefix_tier for r in results if r.prefix_tier is not None)
    n = sum(tiers.values())
    if n:
        out["rank_lookup"] = {t: tiers.get(t, 0) / n for t in ("device", "host", "disk", "inflight", "miss")}
        out["rank_lookup"]["hit"] = 1.0 - out["rank_lookup"]["miss"]
        out["rank_lookup"]["n"] = n
    if prefill_statuses is not None:
        st = Counter(s.split(":")[0] for s in prefill_statuses)
        m = sum(st.values())
        if m:
            keys = (*PREFILL_HITS, "computed", "refused", "skipped")
            out["prefill"] = {k: st.get(k, 0) / m for k in keys}
            out["prefill"]["hit"] = sum(st.get(k, 0) for k in PREFILL_HITS) / m
            out["prefill"]["n"] = m
    return out


def quality(
    results: Sequence[RankedResult], labels: Mapping[str, int] | None = None, k: int = 10
) -> dict[str, float | int]:
    """HR@k and NDCG@k of the true item (``labels[request_id]``, else the result's own label)."""
    hits = 0
    ndcg = 0.0
    n = 0
    for r in results:
        label = (labels or {}).get(r.request_id, r.label_item_id)
        if label is None:
            continue
        n += 1
        ids = [it.item_id for it in r.items[:k]]
        if label in ids:
            hits += 1
            ndcg += 1.0 / math.log2(ids.index(label) + 2)
    return {f"hr@{k}": hits / n if n else math.nan, f"ndcg@{k}": ndcg / n if n else math.nan, "labelled": n}


def history_figures(results: Sequence[RankedResult]) -> dict[str, float]:
    n = len(results) or 1
    return {
        "mean_history_len": sum(r.history_len for r in results) / n,
        "mean_used_len": sum(r.used_len for r in results) / n,
        "mean_tokens_computed": sum(r.tokens_computed for r in results) / n,
        "mean_prefix_len": sum(r.prefix_len for r in results) / n,
    }


def summarize(
    results: Sequence[RankedResult],
    *,
    slo_ms: float,
    labels: Mapping[str, int] | None = None,
    expected: int | None = None,
    duration_s: float | None = None,
    admitted: int | None = None,
    prefill_statuses: Iterable[str] | None = None,
    allow_truncated: bool = False,
) -> dict:
    slo = slo_figures(
        results, slo_ms, expected=expected, duration_s=duration_s, allow_truncated=allow_truncated
    )
    return {
        "latency_ms": stage_latencies(results),
        "slo": slo,
        "trigger": admission(int(slo["requests"]), admitted),
        "hit_rates": hit_rates(results, prefill_statuses),
        "paths": path_mix(results),
        "quality": quality(results, labels),
        "history": history_figures(results),
    }


def windows(results: Sequence[RankedResult], window_s: float = 5.0) -> list[tuple[float, float, int]]:
    """Per window of ``window_s`` seconds of send time: (achieved QPS, ranking P99, requests)."""
    if not results:
        return []
    t0 = min(r.ts for r in results)
    bins: dict[int, list[float]] = {}
    for r in results:
        bins.setdefault(int((r.ts - t0) // window_s), []).append(ranking_ms(r))
    return [(len(v) / window_s, percentile(v, 99.0), len(v)) for _, v in sorted(bins.items())]


def by_history_len(results: Sequence[RankedResult], min_count: int = 5) -> list[tuple[int, float, int]]:
    """Per power-of-two bin of history length (lower bound): (bin, ranking P99, requests)."""
    bins: dict[int, list[float]] = {}
    for r in results:
        b = 0 if r.history_len <= 0 else 1 << (r.history_len.bit_length() - 1)
        bins.setdefault(b, []).append(ranking_ms(r))
    return [(b, percentile(v, 99.0), len(v)) for b, v in sorted(bins.items()) if len(v) >= min_count]


# ---------------------------------------------------------------------- plots


def _plt():
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
    plt = _plt()
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
    plt = _plt()
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
    plt = _plt()
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


# ---------------------------------------------------------------------- markdown


def fmt(x: object, digits: int = 1) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if math.isnan(x):
            return "–"
        if math.isinf(x):
            return "∞"
        return f"{x:.{digits}f}"
    return str(x)


def table(header: Sequence[str], rows: Iterable[Sequence[object]], digits: int = 1) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c, digits) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def summary_markdown(s: dict, *, title: str = "Run") -> str:
    """The sections of one run's summary (latency, SLO, trigger, cache, paths, quality)."""
    slo = s["slo"]
    parts = [
        f"### {title}: latency (ms)",
        table(
            ["stage", "P50", "P90", "P99", "P99.9", "n"],
            [[k, v["p50"], v["p90"], v["p99"], v["p99.9"], v["n"]] for k, v in s["latency_ms"].items()],
        ),
        f"### {title}: SLO (ranking latency ≤ {fmt(slo['slo_ms'])} ms, whole history used)",
        table(
            [
                "requests",
                "results",
                "compliant",
                "compliance",
                "SLO P99 (ms)",
                "holds",
                "truncated",
                "timeouts",
                "throughput (req/s)",
                "SLO-compliant throughput (req/s)",
            ],
            [
                [
                    slo["requests"],
                    slo["results"],
                    slo["compliant"],
                    slo["compliance"],
                    slo["slo_p99_ms"],
                    slo["holds_slo"],
                    slo["truncated"],
                    slo["timeouts"],
                    slo["throughput_qps"],
                    slo["slo_throughput_qps"],
                ]
            ],
            digits=3,
        ),
        f"### {title}: trigger, cache, paths, quality",
        table(
            [
                "admission rate",
                "HR@10",
                "NDCG@10",
                "labelled",
                "mean history",
                "mean used",
                "mean tokens computed",
            ],
            [
                [
                    s["trigger"]["admission_rate"],
                    s["quality"]["hr@10"],
                    s["quality"]["ndcg@10"],
                    s["quality"]["labelled"],
                    s["history"]["mean_history_len"],
                    s["history"]["mean_used_len"],
                    s["history"]["mean_tokens_computed"],
                ]
            ],
            digits=3,
        ),
        table(["path", "count", "share"], [[p, v["count"], v["share"]] for p, v in s["paths"].items()], 3),
    ]
    for src, rates in s["hit_rates"].items():
        parts.append(
            table([f"{src} tier/outcome", "share"], [[k, v] for k, v in rates.items() if k != "n"], 3)
            + f"\n\n({src}: n = {int(rates['n'])})"
        )
    return "\n\n".join(parts)


def json_safe(x: object) -> object:
    """Replace non-finite floats (JSON has none) by None, recursively."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


# ---------------------------------------------------------------------- reading the topics


async def read_results(settings, topic: str, start=None) -> dict[str, RankedResult]:
    """The last result per request id (results are idempotent by key)."""
    got = await read_topic(settings, topic, RankedResult, start, progress=True)
    return {r.value.request_id: r.value for r in got.records}


async def read_labels(settings, trace_topic: str, user_prefix: str = "") -> dict[str, int]:
    from relaygr.schemas import RecommendationRequest

    got = await read_topic(settings, trace_topic, RecommendationRequest, progress=True)
    return {
        user_prefix + r.value.request_id: r.value.label_item_id
        for r in got.records
        if r.value.label_item_id is not None
    }


async def read_admitted(settings, topic: str, request_ids: set[str]) -> int:
    from relaygr.schemas import PrefillSignal

    got = await read_topic(settings, topic, PrefillSignal, progress=True)
    return len({r.value.request_id for r in got.records} & request_ids)


def prefill_statuses(workers_dir: Path, request_ids: set[str] | None = None) -> list[str]:
    """Pre-inference outcomes from the ranking workers' ``events.jsonl`` under ``workers_dir``."""
    out = []
    for f in sorted(Path(workers_dir).glob("**/events.jsonl")):
        for line in f.read_text().splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            if e.get("event") == "prefill" and (request_ids is None or e.get("request_id") in request_ids):
                out.append(str(e.get("status")))
    return out


def write_run_report(
    out: Path,
    results: Sequence[RankedResult],
    summary: dict,
    *,
    slo_ms: float,
    inputs: Mapping[str, object],
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    plots = run_plots(results, summary, out, slo_ms)
    doc = {"inputs": dict(inputs), "summary": summary, "plots": plots}
    (out / "report.json").write_text(json.dumps(json_safe(doc), indent=2))
    md = [
        "# RelayGR run report",
        "Inputs: " + ", ".join(f"{k} `{v}`" for k, v in inputs.items()),
        "Percentiles are nearest-rank; a request meets the SLO when its ranking latency is within the "
        "bound, it was ranked, and it used its whole history (missing results count as violations).",
        summary_markdown(summary, title="Run"),
        "## Plots",
        *[f"![{p}]({p})" for p in plots],
    ]
    (out / "report.md").write_text("\n\n".join(md) + "\n")
    return doc


def headline(summary: dict) -> dict:
    s, lat = summary["slo"], summary["latency_ms"]
    return json_safe(
        {
            "results": s["results"],
            "requests": s["requests"],
            "ranking_ms_p50": lat.get("ranking", {}).get("p50"),
            "ranking_ms_p99": lat.get("ranking", {}).get("p99"),
            "e2e_ms_p99": lat["end_to_end"]["p99"],
            "slo_ms": s["slo_ms"],
            "slo_compliance": s["compliance"],
            "slo_p99_ms": s["slo_p99_ms"],
            "slo_throughput_qps": s["slo_throughput_qps"],
            "admission_rate": summary["trigger"]["admission_rate"],
            "hr@10": summary["quality"]["hr@10"],
            "ndcg@10": summary["quality"]["ndcg@10"],
            "paths": {k: v["count"] for k, v in summary["paths"].items()},
        }
    )  # type: ignore[return-value]


# ---------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="folder for report.json, report.md, *.png")
    parser.add_argument("--prefix", help="topic prefix of the pipeline (default RELAYGR_TOPIC_PREFIX)")
    parser.add_argument("--results-topic", help="results topic (default <prefix>.results)")
    parser.add_argument(
        "--trace-topic", help="trace topic with the ground truth (default: the results' labels)"
    )
    parser.add_argument(
        "--user-prefix",
        default="",
        help="prefix the replay put before user and request ids: only those results are reported",
    )
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--from-offset", help="results from this offset: N, or P:N,P:N")
    start.add_argument("--from-timestamp", help="results written since (epoch seconds or ISO 8601)")
    parser.add_argument(
        "--slo-ms", type=float, help="P99 bound B on ranking latency (default RELAYGR_BUDGET_MS)"
    )
    parser.add_argument(
        "--allow-truncated", action="store_true", help="count truncated histories as compliant"
    )
    parser.add_argument("--worker-events", type=Path, help="folder with the ranking workers' events.jsonl")
    parser.add_argument("--no-prefill-topic", action="store_true", help="don't read the prefill signals")
    parser.add_argument("--json", action="store_true", help="print the headline figures as one JSON line")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from relaygr.infra.broker import BrokerError
    from relaygr.infra.cluster import ensure_broker
    from relaygr.infra.settings import get_settings
    from relaygr.infra.topic_reader import Start
    from relaygr.schemas import TopicRegistry
    from relaygr.streams.config import PipelineSettings

    try:
        settings, _ = ensure_broker(get_settings())
        reg = TopicRegistry(args.prefix or settings.topic_prefix, settings.partitions)
        topic = args.results_topic or reg.name("results")
        slo_ms = args.slo_ms or PipelineSettings().budget_ms
        start = Start.parse(args.from_offset, args.from_timestamp)

        async def gather_inputs():
            res = await read_results(settings, topic, start)
            labels = (
                await read_labels(settings, args.trace_topic, args.user_prefix) if args.trace_topic else None
            )
            admitted = None
            if not args.no_prefill_topic:
                try:
                    mine = {k for k in res if k.startswith(args.user_prefix)}
                    admitted = await read_admitted(settings, reg.name("prefill"), mine)
                except LookupError:
                    admitted = None
            return res, labels, admitted

        res, labels, admitted = asyncio.run(gather_inputs())
    except (BrokerError, LookupError, ValueError) as e:
        print(f"relaygr report: {e}", file=sys.stderr)
        return 1
    results = sorted(
        (r for r in res.values() if r.request_id.startswith(args.user_prefix)), key=lambda r: r.ts
    )
    if not results:
        print(f"relaygr report: no results in {topic}", file=sys.stderr)
        return 1
    ids = {r.request_id for r in results}
    statuses = prefill_statuses(args.worker_events, ids) if args.worker_events else None
    summary = summarize(
        results,
        slo_ms=slo_ms,
        labels=labels,
        admitted=admitted,
        prefill_statuses=statuses,
        allow_truncated=args.allow_truncated,
    )
    inputs = {"results": topic, "trace": args.trace_topic, "slo_ms": slo_ms, "results_read": len(results)}
    write_run_report(args.out, results, summary, slo_ms=slo_ms, inputs=inputs)
    print(f"report written to {args.out / 'report.md'} ({len(results)} results)", file=sys.stderr)
    if args.json:
        print(json.dumps({"report": str(args.out), **headline(summary)}))
    return 0
