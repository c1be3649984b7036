"""One valid example of every event type (documentation, round-trip checks, tests)."""

from __future__ import annotations

from relaygr.schemas.events import (
    BehaviorBatch,
    BehaviorEvent,
    DeadLetter,
    Event,
    PrefillSignal,
    RankedResult,
    RankPath,
    RankRequest,
    RecommendationRequest,
    RetrievedRequest,
    ScoredItem,
    TriggerReason,
    WorkerStats,
)


def examples(ts: float = 1_700_000_000.0) -> list[Event]:
    return [
        BehaviorEvent(user_id="196", item_id=242, ts=ts - 60, action=3),
        BehaviorBatch(
            user_id="196",
            item_ids=[242, 302],
            timestamps=[ts - 60, ts - 30],
            actions=[3, 4],
            source_partitions=[1, 1],
            source_offsets=[17, 18],
        ),
        RecommendationRequest(request_id="req-1", user_id="196", ts=ts, num_candidates=64, label_item_id=302),
        RetrievedRequest(
            request_id="req-1",
            user_id="196",
            ts=ts,
            candidates=[302, 377, 51],
            history_len=2048,
            trigger=TriggerReason.ADMITTED,
            retrieved_at=ts + 0.004,
            label_item_id=302,
        ),
        PrefillSignal(
            request_id="req-1", user_id="196", ts=ts, history_len=2048, prefix_len=1984, issued_at=ts + 0.004
        ),
        RankRequest(
            request_id="req-1",
            user_id="196",
            ts=ts,
            candidates=[302, 377],
            deadline_ts=ts + 0.2,
            prefill_expected=True,
            produced_at=ts + 0.01,
            upstream_ms={"retrieval": 4.0, "preprocess": 6.0},
        ),
        RankedResult(
            request_id="req-1",
            user_id="196",
            ts=ts,
            items=[ScoredItem(item_id=302, score=2.5), ScoredItem(item_id=377, score=-0.25)],
            path=RankPath.RELAY,
            latency_ms=21.5,
            worker_id="worker-0",
            breakdown_ms={"queue": 0.4, "prefix_wait": 0.0, "compute": 3.1},
            history_len=2048,
            tokens_computed=66,
        ),
        DeadLetter(
            source_topic="relaygr.behaviors",
            partition=0,
            offset=42,
            key_b64="MTk2",
            value_b64="/w==",
            reason="BehaviorEvent field '$': invalid UTF-8 at byte 0",
            stage="retrieval",
            ts=ts,
        ),
        WorkerStats(
            worker_id="worker-0",
            ts=ts,
            partitions=[0, 1],
            cache_bytes={"device": 3 << 30, "host": 0, "disk": 0},
            pinned_bytes=17 << 20,
            latency_coeffs=[0.5, 0.001, 1e-7],
        ),
    ]
