"""One typed summary of a set of results: what the demo prints, ``relaygr report`` writes, each
experiment point and ``bench pipeline`` record.

Primitives: ``RunSummary.of(results, ...)`` (built by ``figures.summarize``: nearest-rank
percentiles, one definition of SLO compliance) and its parts ``LatencyFigures``, ``SloFigures``,
``TriggerFigures``, ``PathCount``, ``QualityFigures``, ``HistoryFigures``; ``RunSummary.to_dict``
gives the JSON form the reports write.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from relaygr.schemas import RankedResult
from relaygr.tools.report.figures import RELAY_PATHS, json_safe, summarize


class _Figures(BaseModel):
    model_config = ConfigDict(populate_by_name=True, frozen=True)


class LatencyFigures(_Figures):
    p50: float
    p90: float
    p99: float
    p99_9: float = Field(alias="p99.9")
    mean: float
    max: float
    n: int


class SloFigures(_Figures):
    slo_ms: float
    requests: int
    results: int
    compliant: int
    compliance: float
    within_latency: int
    truncated: int
    timeouts: int
    missing: int
    slo_p99_ms: float
    holds_slo: bool
    duration_s: float
    throughput_qps: float
    slo_throughput_qps: float


class TriggerFigures(_Figures):
    admitted: int | None = None
    admission_rate: float | None = None
    relay_of_admitted: int | None = Field(
        default=None, description="admitted requests ranked on a relay path"
    )
    relay_share_of_admitted: float | None = None
    decisions: dict[str, int] = Field(default_factory=dict, description="the trigger's decisions by reason")


class PathCount(_Figures):
    count: int
    share: float


class QualityFigures(_Figures):
    hr_at_10: float = Field(alias="hr@10")
    ndcg_at_10: float = Field(alias="ndcg@10")
    labelled: int


class HistoryFigures(_Figures):
    mean_history_len: float
    mean_used_len: float
    mean_tokens_computed: float
    mean_prefix_len: float


class RunSummary(_Figures):
    latency_ms: dict[str, LatencyFigures]
    slo: SloFigures
    trigger: TriggerFigures
    hit_rates: dict[str, dict[str, float]]
    paths: dict[str, PathCount]
    path_reasons: dict[str, int]
    quality: QualityFigures
    history: HistoryFigures
    prefix_tiers: dict[str, int] = Field(default_factory=dict)
    prefill: dict[str, int] = Field(default_factory=dict, description="pre-inference outcomes")
    workers: dict[str, int] = Field(default_factory=dict, description="results per ranking worker")
    pre_inference: dict[str, float] = Field(
        default_factory=dict,
        description="the workers' pre-inferences admitted, finished, cached, late, refused and dropped "
        "(with reasons), and the device time they got (``inputs.pre_inference_counts``)",
    )
    rank_batches: dict[str, int] = Field(
        default_factory=dict,
        description="the workers' relay device turns by how many rankings each ran together "
        "(``inputs.rank_batch_counts``)",
    )

    @classmethod
    def of(
        cls,
        results: Sequence[RankedResult],
        *,
        slo_ms: float,
        labels: Mapping[str, int] | None = None,
        expected: int | None = None,
        duration_s: float | None = None,
        admitted: set[str] | int | None = None,
        prefill_statuses: Iterable[str] | None = None,
        allow_truncated: bool = False,
        decisions: Mapping[str, int] | None = None,
    ) -> RunSummary:
        """``admitted``: the admitted request ids (then the relay share of them is known), or
        only their number."""
        statuses = list(prefill_statuses) if prefill_statuses is not None else None
        n_admitted = len(admitted) if isinstance(admitted, set) else admitted
        d = summarize(
            results,
            slo_ms=slo_ms,
            labels=labels,
            expected=expected,
            duration_s=duration_s,
            admitted=n_admitted,
            prefill_statuses=statuses,
            allow_truncated=allow_truncated,
        )
        if isinstance(admitted, set):
            on_relay = sum(r.path.value in RELAY_PATHS for r in results if r.request_id in admitted)
            d["trigger"]["relay_of_admitted"] = on_relay
            d["trigger"]["relay_share_of_admitted"] = on_relay / len(admitted) if admitted else math.nan
        if decisions is not None:
            d["trigger"]["decisions"] = dict(decisions)
        tiers: dict[str, int] = {}
        for r in results:
            if r.prefix_tier:
                tiers[r.prefix_tier] = tiers.get(r.prefix_tier, 0) + 1
        d["prefix_tiers"] = dict(sorted(tiers.items()))
        d["workers"] = dict(sorted(Counter(r.worker_id for r in results).items()))
        d["prefill"] = {s: statuses.count(s) for s in sorted(set(statuses))} if statuses else {}
        return cls.model_validate(d)

    @property
    def ranking(self) -> LatencyFigures | None:
        return self.latency_ms.get("ranking")

    @property
    def path_counts(self) -> dict[str, int]:
        return {p: c.count for p, c in self.paths.items()}

    def to_dict(self) -> dict:
        """The JSON form (figure names as the reports print them; non-finite numbers as None)."""
        return json_safe(self.model_dump(by_alias=True))  # type: ignore[return-value]
