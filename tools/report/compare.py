"""Relay against baseline on one trace: the table, the verdict and the plot the demo shows.

Primitives:
- ``comparison_rows(summaries)``: one row per figure, one column per mode (ranking P50/P99 against
  the budget, SLO compliance, truncated and timed-out shares, HR@10 / NDCG@10, path mix, cache
  tiers, trigger admissions).
- ``comparison_markdown(summaries)``: those rows as a table (what the demo prints and writes).
- ``verdict(summaries, full_fits)``: one line saying what relay bought on this run.
- ``plot_comparison(latencies, slo_ms, path)``: the ranking-latency CDF of every mode with the
  budget line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from relaygr.tools.report.markdown import fmt, table
from relaygr.tools.report.plots import plot_latency_cdf
from relaygr.tools.report.summary import RunSummary


def _share(n: int, of: int) -> str:
    return f"{100 * n / of:.0f} %" if of else "–"


def _counts(d: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "–"


def _held(s: RunSummary) -> str:
    r = s.ranking
    if r is None:
        return "–"
    return "held" if r.p99 <= s.slo.slo_ms else "MISSED"


def _admitted(s: RunSummary) -> str:
    t = s.trigger
    if not t.admitted:
        return "0"
    if t.relay_of_admitted is None:
        return str(t.admitted)
    return f"{t.admitted} ({t.relay_of_admitted}, {_share(t.relay_of_admitted, t.admitted)})"


def comparison_rows(summaries: Mapping[str, RunSummary]) -> list[list[str]]:
    modes = list(summaries)
    budget = next(iter(summaries.values())).slo.slo_ms if summaries else 0.0

    def row(label: str, get) -> list[str]:
        return [label, *(get(summaries[m]) for m in modes)]

    def lat(s: RunSummary, q: str) -> str:
        return fmt(getattr(s.ranking, q)) if s.ranking else "–"

    return [
        row("results", lambda s: f"{s.slo.results}/{s.slo.requests}"),
        row("ranking P50 (ms)", lambda s: lat(s, "p50")),
        row(f"ranking P99 (ms), budget {budget:g}", lambda s: f"{lat(s, 'p99')} ({_held(s)})"),
        row(
            "SLO compliance (within budget, whole history)",
            lambda s: f"{_share(s.slo.compliant, s.slo.requests)} ({s.slo.compliant})",
        ),
        row("truncated", lambda s: f"{_share(s.slo.truncated, s.slo.requests)} ({s.slo.truncated})"),
        row("timed out", lambda s: f"{_share(s.slo.timeouts, s.slo.requests)} ({s.slo.timeouts})"),
        row("HR@10", lambda s: fmt(s.quality.hr_at_10, 3)),
        row("NDCG@10", lambda s: fmt(s.quality.ndcg_at_10, 3)),
        row(
            "history used (mean events)",
            lambda s: f"{s.history.mean_used_len:.0f} of {s.history.mean_history_len:.0f}",
        ),
        row("tokens computed per request", lambda s: f"{s.history.mean_tokens_computed:.0f}"),
        row("paths", lambda s: _counts(s.path_counts)),
        row("prefix from (cache tier)", lambda s: _counts(s.prefix_tiers)),
        row("trigger admitted (of them on a relay path)", _admitted),
    ]


def comparison_markdown(summaries: Mapping[str, RunSummary]) -> str:
    return table(["", *summaries], comparison_rows(summaries))


def verdict(summaries: Mapping[str, RunSummary], *, full_fits: bool = False) -> str:
    """What relay bought, in one line (or why there was nothing to buy on this machine)."""

    def held(mode: str) -> str:
        s = summaries[mode].slo
        return f"{mode} held {_share(s.compliant, s.requests)} of requests within the {s.slo_ms:g} ms budget with their whole history"

    if set(summaries) >= {"relay", "baseline"}:
        line = f"{held('baseline')}; {held('relay')}"
        if full_fits:
            line += (
                " (this machine ranks even the longest history the model serves within the budget: "
                "what relay saves here is device time, not the SLO)"
            )
        return line
    (mode,) = summaries
    return held(mode) + (" (full ranking fits the budget on this machine)" if full_fits else "")


def plot_comparison(
    latencies: Mapping[str, Sequence[float]], slo_ms: float, path: Path, *, history: int
) -> Path:
    return plot_latency_cdf(
        latencies, slo_ms, path, title=f"Ranking latency, relay vs baseline ({history}-event histories)"
    )
