"""Pre-processing stage (faust app): drop what the user has seen, cap, emit the rank request.

Topology:
  behaviors (key user_id) ──> table ``seen``: item -> first seen (RocksDB via rocksdict, changelog;
                              applied in batches, one write per user per batch)
  retrieved (key user_id) ──> unseen candidates, capped ──> rank-requests (key user_id)
  bad input ──> dead-letters

The rank request carries its deadline (now + the ranking budget) and keeps the user_id key, so
it lands on the partition — hence the ranking worker — that received the prefill signal.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Counter as PCounter

from relaygr.infra.settings import Settings
from relaygr.schemas import (
    BehaviorEvent,
    RankRequest,
    RetrievedRequest,
    TopicRegistry,
    TriggerReason,
    encode,
)
from relaygr.streams.common import (
    decode_keyed,
    deliver,
    faust_dead_letterer,
    guarded,
    ingest_batches,
    make_app,
    raw_topic,
    send_acked,
)
from relaygr.streams.config import PipelineSettings

STAGE = "preprocess"
RANKREQ = PCounter("relaygr_preprocess_requests_total", "Rank requests emitted")
DROPPED = PCounter("relaygr_preprocess_seen_dropped_total", "Candidates dropped as already seen")


def build(settings: Settings, p: PipelineSettings, worker_id: str = "0"):
    app = make_app(STAGE, settings, worker_id)
    reg = TopicRegistry(settings.topic_prefix, settings.partitions)
    behaviors, retrieved = raw_topic(app, reg.name("behaviors")), raw_topic(app, reg.name("retrieved"))
    out_rank, dlq = raw_topic(app, reg.name("rank")), raw_topic(app, reg.name("dead_letters"))
    seen = app.Table("seen-v1", default=None, partitions=settings.partitions)
    limit = settings.max_message_bytes

    to_dlq = faust_dead_letterer(STAGE, dlq)

    def decode_behavior(ev) -> BehaviorEvent:
        return decode_keyed(BehaviorEvent, ev.key, ev.value, limit)

    def on_behaviors(batch: list, as_event) -> None:
        changed: dict[str, tuple] = {}  # user -> (an event of the user, items first seen when)
        for ev, b in batch:
            s = changed[b.user_id][1] if b.user_id in changed else (seen.get(b.user_id) or {})
            key = str(b.item_id)  # JSON object keys are strings
            if key not in s or b.ts < s[key]:
                s[key] = b.ts  # when the user first saw the item
                changed[b.user_id] = (ev, s)
        for user, (ev, s) in changed.items():
            as_event(ev)
            seen[user] = s

    async def on_retrieved(ev) -> None:
        r = decode_keyed(RetrievedRequest, ev.key, ev.value, limit)
        t0 = time.time()
        before = {int(i) for i, ts in (seen.get(r.user_id) or {}).items() if ts < r.model_ts}
        if p.feature_fetch_ms:
            await asyncio.sleep(p.feature_fetch_ms / 1000)
        cands = [c for c in r.candidates if c not in before]
        DROPPED.inc(len(r.candidates) - len(cands))
        now = time.time()
        out = RankRequest(
            request_id=r.request_id,
            user_id=r.user_id,
            ts=r.ts,
            event_ts=r.event_ts,
            candidates=cands[: p.max_rank_candidates],
            top_k=r.top_k,
            deadline_ts=now + p.budget_ms / 1000,
            prefill_expected=r.trigger == TriggerReason.ADMITTED,
            produced_at=now,
            upstream_ms={
                "hop_requests": max(0.0, ((r.received_at or r.ts) - r.ts) * 1000),
                "retrieval": max(0.0, (r.retrieved_at - (r.received_at or r.ts)) * 1000),
                "hop_retrieved": max(0.0, (t0 - r.retrieved_at) * 1000),
                "preprocess": (now - t0) * 1000,
            },
            label_item_id=r.label_item_id,
        )
        await deliver(lambda: send_acked(out_rank, out.key(), encode(out)), what="rank request")
        RANKREQ.inc()

    @app.agent(behaviors)
    async def ingest(stream):
        await ingest_batches(STAGE, stream, decode_behavior, on_behaviors, to_dlq)

    @app.agent(retrieved, concurrency=p.concurrency)
    async def preprocess(stream):
        async for ev in stream.events():
            await guarded(STAGE, ev, on_retrieved, to_dlq)

    return app
