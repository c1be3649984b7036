"""Pre-processing stage (faust app): drop what the user has seen, cap, emit the rank request.

Topology (behaviours from the routed topic, re-keyed by user id by the ingress stage):
  routed-behaviors (key user_id) ──> table ``seen``: item -> first seen, in chunks of at most
                              SEEN_CHUNK items per user (RocksDB via rocksdict, changelog; applied
                              in batches: per user per batch only its newest chunk is rewritten,
                              never the whole history)
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
    BehaviorBatch,
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
# Items per chunk of a user's seen items: a write costs at most this, whatever the history's length.
SEEN_CHUNK = 512


def _chunk_key(user_id: str, i: int) -> str:
    return f"{user_id}\x00{i}"


def seen_add(get, put, user_id: str, items: list[tuple[int, float]]) -> None:
    """Append ``(item, ts)`` behaviours of one user: ``get(key)``/``put(key, value)`` read and
    write the table. Key ``user_id`` holds the chunk count, ``user_id\0i`` chunk ``i`` (item ->
    first seen within that chunk). Only the newest chunk is read and rewritten."""
    chunks = get(user_id) or 0
    i = max(0, chunks - 1)
    cur = (get(_chunk_key(user_id, i)) or {}) if chunks else {}
    dirty = False
    for item, ts in items:
        key = str(item)  # JSON object keys are strings
        if key in cur and cur[key] <= ts:
            continue
        if key not in cur and len(cur) >= SEEN_CHUNK:
            put(_chunk_key(user_id, i), cur)
            i, cur = i + 1, {}
        cur[key] = ts
        dirty = True
    if dirty:
        put(_chunk_key(user_id, i), cur)
        if i + 1 != chunks:
            put(user_id, i + 1)


def seen_before(get, user_id: str, ts: float) -> set[int]:
    """Items ``user_id`` interacted with strictly before ``ts``."""
    out: set[int] = set()
    for i in range(get(user_id) or 0):
        out.update(int(k) for k, t in (get(_chunk_key(user_id, i)) or {}).items() if t < ts)
    return out


RANKREQ = PCounter("relaygr_preprocess_requests_total", "Rank requests emitted")
DROPPED = PCounter("relaygr_preprocess_seen_dropped_total", "Candidates dropped as already seen")


def build(settings: Settings, p: PipelineSettings, worker_id: str = "0"):
    app = make_app(STAGE, settings, worker_id)
    reg = TopicRegistry(settings.topic_prefix, settings.partitions)
    behaviors = raw_topic(app, reg.name("routed_behaviors"))
    retrieved = raw_topic(app, reg.name("retrieved"))
    out_rank, dlq = raw_topic(app, reg.name("rank")), raw_topic(app, reg.name("dead_letters"))
    # The value format is part of the table's name: a format change starts a fresh table.
    seen = app.Table(
        "seen-v2",
        default=None,
        partitions=settings.partitions,
        extra_topic_configs=app.relaygr_changelog_configs,
    )
    limit = settings.max_message_bytes

    to_dlq = faust_dead_letterer(STAGE, dlq)

    def decode_behavior(ev) -> BehaviorBatch:
        return decode_keyed(BehaviorBatch, ev.key, ev.value, limit)

    def on_behaviors(batch: list, as_event) -> None:
        by_user: dict[str, tuple] = {}  # user -> (an event of the user, its (item, ts) in order)
        for ev, b in batch:
            by_user.setdefault(b.user_id, (ev, []))[1].extend(zip(b.item_ids, b.timestamps, strict=True))
        for user, (ev, items) in by_user.items():
            as_event(ev)  # every write of this user goes to its partition's changelog
            seen_add(seen.get, seen.__setitem__, user, items)

    async def on_retrieved(ev) -> None:
        r = decode_keyed(RetrievedRequest, ev.key, ev.value, limit)
        t0 = time.time()
        before = seen_before(seen.get, r.user_id, r.model_ts)
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
                # The ingress's share of hop_requests: produced -> re-keyed onto routed-requests.
                **({"routing": max(0.0, (r.routed_at - r.ts) * 1000)} if r.routed_at else {}),
                "retrieval": max(0.0, (r.retrieved_at - (r.received_at or r.ts)) * 1000),
                "hop_retrieved": max(0.0, (t0 - r.retrieved_at) * 1000),
                "preprocess": (now - t0) * 1000,
            },
            label_item_id=r.label_item_id,
            behaviors_needed=r.behaviors_needed,
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
