"""Figures of a run, pure functions of its ``RankedResult``s: latency, SLO compliance, trigger,
cache tiers, path mix and quality.

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

Primitives: ``percentile``, ``latency_summary``, ``stage_latencies``, ``breakdown_percentiles``, ``meets_slo``,
``slo_figures``, ``path_mix``, ``path_reasons``, ``admission``, ``hit_rates``, ``quality``, ``history_figures``,
``summarize`` (all of them for one run), ``headline`` (its main figures, JSON-safe), ``windows``
and ``by_history_len`` (what the plots bin), ``json_safe``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

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


def breakdown_percentiles(
    results: Mapping[str, RankedResult], sent: Iterable, field: str = "hop_requests"
) -> dict[str, float]:
    """P50/P99 of one ``breakdown_ms`` field over the results of the requests ``sent``, and how
    many had it (``n``)."""
    values = [results[r.request_id].breakdown_ms.get(field) for r in sent if r.request_id in results]
    values = [v for v in values if v is not None]
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "n": len(values)}


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


RELAY_PATHS = ("relay", "relay_waited", "relay_extended")


def path_reasons(results: Sequence[RankedResult]) -> dict[str, int]:
    """Why results did not take a relay path (``RankedResult.path_reason``; ``unknown`` for a
    result that gives none)."""
    c = Counter(r.path_reason or "unknown" for r in results if r.path.value not in RELAY_PATHS)
    return dict(sorted(c.items()))


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
        "path_reasons": path_reasons(results),
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
            "path_reasons": summary.get("path_reasons", {}),
        }
    )  # type: ignore[return-value]


def json_safe(x: object) -> object:
    """Replace non-finite floats (JSON has none) by None, recursively."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x
