"""Every result off the relay path says why: ``path_reason`` from the trigger's decision, the wait
for the prefill signal, or the pre-inference outcome; and the report counts the reasons."""

from __future__ import annotations

import time

import pytest

from relaygr.schemas import RankedResult, RankPath, RankRequest, ScoredItem, TriggerReason
from relaygr.streams.ranking.rank_handler import path_reason
from relaygr.tools.report.figures import path_reasons, summarize


def _request(trigger: TriggerReason) -> RankRequest:
    now = time.time()
    return RankRequest(
        request_id="r1",
        user_id="u1",
        ts=now,
        candidates=[1, 2],
        deadline_ts=now + 0.05,
        prefill_expected=trigger is TriggerReason.ADMITTED,
        trigger=trigger,
        produced_at=now,
    )


@pytest.mark.parametrize(
    ("trigger", "path", "blocker", "status", "want"),
    [
        (TriggerReason.ADMITTED, RankPath.RELAY, None, "computed", None),
        (TriggerReason.ADMITTED, RankPath.RELAY_WAITED, None, None, None),
        (TriggerReason.NOT_AT_RISK, RankPath.FULL, None, None, "not_at_risk"),
        (TriggerReason.RATE_BOUND, RankPath.FULL_TRUNCATED, None, None, "rate_bound"),
        (TriggerReason.FOOTPRINT_BOUND, RankPath.FULL, None, None, "footprint_bound"),
        (TriggerReason.TOO_LONG, RankPath.FULL_TRUNCATED, None, None, "too_long"),
        (TriggerReason.NO_HISTORY, RankPath.COLD_START, None, None, "no_history"),
        (TriggerReason.ADMITTED, RankPath.FULL, "signal_not_seen", None, "signal_not_seen"),
        (TriggerReason.ADMITTED, RankPath.FULL, "prefill_not_ready", None, "prefill_not_ready"),
        (TriggerReason.ADMITTED, RankPath.FULL, None, "refused:device_full", "prefill_refused_device_full"),
        (TriggerReason.ADMITTED, RankPath.FULL, None, "computed", "prefix_evicted"),
        (TriggerReason.ADMITTED, RankPath.TIMEOUT, None, None, "deadline_passed"),
    ],
)
def test_path_reason(trigger, path, blocker, status, want) -> None:
    assert path_reason(_request(trigger), path, "relay", blocker, status) == want


def test_baseline_mode_says_baseline() -> None:
    assert (
        path_reason(_request(TriggerReason.DISABLED), RankPath.BASELINE, "baseline", None, None) == "baseline"
    )


def test_report_counts_reasons_of_non_relay_results() -> None:
    def result(i: int, path: RankPath, reason: str | None) -> RankedResult:
        return RankedResult(
            request_id=f"r{i}",
            user_id="u",
            ts=1.0 + i,
            items=[ScoredItem(item_id=1, score=0.5)],
            path=path,
            latency_ms=10.0,
            breakdown_ms={"ranking": 5.0},
            path_reason=reason,
        )

    rs = [
        result(0, RankPath.RELAY, None),
        result(1, RankPath.FULL, "not_at_risk"),
        result(2, RankPath.FULL, "not_at_risk"),
        result(3, RankPath.FULL_TRUNCATED, "rate_bound"),
        result(4, RankPath.FULL, None),
    ]
    assert path_reasons(rs) == {"not_at_risk": 2, "rate_bound": 1, "unknown": 1}
    assert summarize(rs, slo_ms=50.0)["path_reasons"] == path_reasons(rs)


def test_run_summary_is_typed_nearest_rank_and_counts_relay_of_admitted() -> None:
    from relaygr.tools.report.summary import RunSummary

    rs = [
        RankedResult(
            request_id=f"r{i}",
            user_id="u",
            ts=1.0 + i,
            items=[ScoredItem(item_id=1, score=0.5)],
            path=RankPath.RELAY if i < 3 else RankPath.FULL,
            latency_ms=10.0 * i,
            breakdown_ms={"ranking": float(i + 1)},
            path_reason=None if i < 3 else "prefill_not_ready",
        )
        for i in range(4)
    ]
    s = RunSummary.of(rs, slo_ms=3.0, admitted={"r0", "r1", "r2", "r3"}, prefill_statuses=["computed"] * 4)
    assert s.ranking is not None and s.ranking.p50 == 2.0 and s.ranking.p99 == 4.0  # nearest rank
    assert s.trigger.admitted == 4 and s.trigger.relay_of_admitted == 3
    assert s.trigger.relay_share_of_admitted == 0.75
    assert s.path_reasons == {"prefill_not_ready": 1} and s.prefill == {"computed": 4}
    assert s.to_dict()["latency_ms"]["ranking"]["p99.9"] == 4.0


def test_scrape_parses_prometheus_text() -> None:
    from relaygr.tools.pipeline import Scrape

    text = (
        "# TYPE relaygr_trigger_decisions_total counter\n"
        'relaygr_trigger_decisions_total{reason="admitted"} 3.0\n'
        'relaygr_trigger_decisions_total{reason="rate_bound"} 2.0\n'
        'relaygr_trigger_decisions_created{reason="admitted"} 1.7e9\n'
        "# TYPE relaygr_rank_inflight gauge\n"
        "relaygr_rank_inflight 4.0\n"
    )
    s = Scrape.parse(text)
    assert s.by_label("relaygr_trigger_decisions_total", "reason") == {"admitted": 3.0, "rate_bound": 2.0}
    assert s.value("relaygr_rank_inflight") == 4.0
    assert s.value("relaygr_trigger_decisions_total", reason="rate_bound") == 2.0
    assert s.value("relaygr_missing") == 0.0
