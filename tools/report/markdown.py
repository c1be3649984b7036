"""The report as markdown: numbers formatted for people, tables, one run's summary.

Primitives: ``fmt``, ``table``, ``summary_markdown``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


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
    parts += _why_and_where(s)
    return "\n\n".join(parts)


def _why_and_where(s: dict) -> list[str]:
    """What the trigger admitted, why results left the relay path, the pre-inferences the
    workers reported, and the cache tiers that served."""
    parts: list[str] = []
    trig = s["trigger"]
    if trig.get("relay_of_admitted") is not None:
        parts.append(
            f"Admitted by the trigger: {trig['admitted']}; of them on a relay path: "
            f"{trig['relay_of_admitted']} ({fmt(100 * (trig.get('relay_share_of_admitted') or 0.0))} %)."
        )
    if s.get("path_reasons"):
        parts.append(table(["not relay because", "count"], list(s["path_reasons"].items())))
    if s.get("pre_inference"):
        parts.append(
            table(["pre-inference (workers' reports)", "count"], list(s["pre_inference"].items()), 3)
        )
    if s.get("rank_batches"):
        parts.append(table(["relay rankings per device turn", "turns"], list(s["rank_batches"].items())))
    for src, rates in s["hit_rates"].items():
        parts.append(
            table([f"{src} tier/outcome", "share"], [[k, v] for k, v in rates.items() if k != "n"], 3)
            + f"\n\n({src}: n = {int(rates['n'])})"
        )
    return parts
