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

Primitives: ``build(settings, pipeline)`` (the faust app); ``seen_add`` / ``seen_before`` /
``seen_key`` (the ``seen`` table, chunked per user); ``rank_request`` / ``upstream_ms`` (the
rank request of a retrieved one, with where its time went so far).
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
    PendingSends,
    StageOutputs,
    decode_keyed,
    faust_dead_letterer,
    handle_events,
    ingest_batches,
    raw_topic,
)
from relaygr.streams.config import PipelineSettings
from relaygr.streams.stage_app import make_app
from relaygr.workers.model.vocab import RawId

STAGE = "preprocess"
# Items per chunk of a user's seen items: a write costs at most this, whatever the history's length.
SEEN_CHUNK = 512
# Chunks of seen items read between two yields to the event loop (about a millisecond).
SEEN_YIELD_CHUNKS = 4


def retained_events(pipeline: PipelineSettings) -> int:
    """Events of a user the stages keep: RELAYGR_HISTORY_RETAIN_EVENTS, else twice the model's
    max_seq_len (read from the checkpoint's config)."""
    if pipeline.history_retain_events:
        return pipeline.history_retain_events
    import json

    cfg = json.loads((pipeline.model_dir / "config.json").read_text())
    return 2 * int(cfg.get("max_seq_len", 8192))


def _chunk_key(user_id: str, i: int) -> str:
    return f"{user_id}\x00{i}"


def seen_add(
    get, put, user_id: str, items: list[tuple[RawId, float]], *, keep_chunks: int | None = None, delete=None
) -> None:
    """Append ``(item, ts)`` behaviours of one user: ``get(key)``/``put(key, value)`` read and
    write the table. Key ``user_id`` holds ``{"f": first chunk kept, "c": chunks written}``,
    ``user_id\0i`` chunk ``i`` (item -> first seen within that chunk). Only the newest chunk is
    read and rewritten. With ``keep_chunks``, older chunks are deleted (``delete(key)``) so that a
    user's state stays bounded however long the history grows."""
    head = get(user_id) or {"f": 0, "c": 0}
    first, chunks = head["f"], head["c"]
    i = max(first, chunks - 1)
    cur = (get(_chunk_key(user_id, i)) or {}) if chunks else {}
    dirty = False
    for item, ts in items:
        key = seen_key(item)
        if key in cur and cur[key] <= ts:
            continue
        if key not in cur and len(cur) >= SEEN_CHUNK:
            put(_chunk_key(user_id, i), cur)
            i, cur = i + 1, {}
        cur[key] = ts
        dirty = True
    if not dirty:
        return
    put(_chunk_key(user_id, i), cur)
    new_first = first
    if keep_chunks is not None and i + 1 - first > keep_chunks:
        new_first = i + 1 - keep_chunks
        for old in range(first, new_first):
            delete(_chunk_key(user_id, old))
    if i + 1 != chunks or new_first != first:
        put(user_id, {"f": new_first, "c": i + 1})


def seen_key(item: RawId) -> str:
    """An item in the ``seen`` table: its id as text. JSON object keys are strings, and the text
    of an integer is the string the vocabulary takes for the same item (``vocab.canonical``:
    17 and "17" are one item, "017" another), so integer and string ids share one format and
    integer deployments keep theirs."""
    return str(item)


async def seen_before(get, user_id: str, ts: float) -> set[str]:
    """Items ``user_id`` interacted with strictly before ``ts`` (among the chunks kept), as
    ``seen_key``s. Yields to the event loop every ``SEEN_YIELD_CHUNKS`` chunks: a long history's
    chunks take the stage ~10 ms to read, and meanwhile the rank request it produced just before
    would sit unsent in the producer (that time counts in the next hop, ``hop_rank``)."""
    head = get(user_id) or {"f": 0, "c": 0}
    out: set[str] = set()
    for n, i in enumerate(range(head["f"], head["c"])):
        if n and n % SEEN_YIELD_CHUNKS == 0:
            await asyncio.sleep(0)
        out.update(k for k, t in (get(_chunk_key(user_id, i)) or {}).items() if t < ts)
    return out


RANKREQ = PCounter("relaygr_preprocess_requests_total", "Rank requests emitted")
DROPPED = PCounter("relaygr_preprocess_seen_dropped_total", "Candidates dropped as already seen")


def upstream_ms(r: RetrievedRequest, received_at: float, now: float) -> dict[str, float]:
    """Where a request's time went before ranking, in ms: each hop and stage up to ``now``
    (pre-processing received it at ``received_at``)."""
    return {
        "hop_requests": max(0.0, ((r.received_at or r.ts) - r.ts) * 1000),
        # The ingress's share of hop_requests: produced -> re-keyed onto routed-requests.
        **({"routing": max(0.0, (r.routed_at - r.ts) * 1000)} if r.routed_at else {}),
        "retrieval": max(0.0, (r.retrieved_at - (r.received_at or r.ts)) * 1000),
        "hop_retrieved": max(0.0, (received_at - r.retrieved_at) * 1000),
        "preprocess": (now - received_at) * 1000,
    }


def rank_request(
    r: RetrievedRequest, candidates: list[RawId], received_at: float, budget_ms: float
) -> RankRequest:
    """The rank request of a retrieved one: its unseen ``candidates``, a deadline ``budget_ms``
    from now, and whether a prefill signal went ahead of it (the trigger admitted it)."""
    now = time.time()
    return RankRequest(
        request_id=r.request_id,
        user_id=r.user_id,
        ts=r.ts,
        event_ts=r.event_ts,
        candidates=candidates,
        top_k=r.top_k,
        deadline_ts=now + budget_ms / 1000,
        prefill_expected=r.trigger == TriggerReason.ADMITTED,
        trigger=r.trigger,
        produced_at=now,
        upstream_ms=upstream_ms(r, received_at, now),
        label_item_id=r.label_item_id,
        behaviors_needed=r.behaviors_needed,
    )


def build(settings: Settings, pipeline: PipelineSettings, worker_id: str = "0"):
    app = make_app(STAGE, settings, worker_id)
    reg = TopicRegistry(settings.topic_prefix, settings.partitions)
    behaviors = raw_topic(app, reg.name("routed_behaviors"))
    retrieved = raw_topic(app, reg.name("retrieved"))
    out_rank, dlq = reg.name("rank"), raw_topic(app, reg.name("dead_letters"))
    outputs = StageOutputs(settings)
    # The value format is part of the table's name: a format change starts a fresh table.
    seen = app.Table(
        "seen-v2",
        default=None,
        partitions=settings.partitions,
        extra_topic_configs=app.relaygr_changelog_configs,
    )
    # Bounded per user: the chunks covering the most recent events a ranking can serve, twice over.
    keep_chunks = -(-retained_events(pipeline) // SEEN_CHUNK) + 1
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
            seen_add(
                seen.get,
                seen.__setitem__,
                user,
                items,
                keep_chunks=keep_chunks,
                delete=lambda k: seen.pop(k, None),
            )

    async def on_retrieved(ev, sends: PendingSends) -> None:
        r = decode_keyed(RetrievedRequest, ev.key, ev.value, limit)
        t0 = time.time()
        before = await seen_before(seen.get, r.user_id, r.model_ts)
        if pipeline.feature_fetch_ms:
            await asyncio.sleep(pipeline.feature_fetch_ms / 1000)
        cands = [c for c in r.candidates if seen_key(c) not in before]
        DROPPED.inc(len(r.candidates) - len(cands))
        out = rank_request(r, cands[: pipeline.max_rank_candidates], t0, pipeline.budget_ms)
        await sends.send(out_rank, out.key(), encode(out), what="rank request")
        RANKREQ.inc()

    @app.agent(behaviors)
    async def ingest(stream):
        await ingest_batches(STAGE, stream, decode_behavior, on_behaviors, to_dlq)

    @app.agent(retrieved, concurrency=pipeline.concurrency)
    async def preprocess(stream):
        await handle_events(STAGE, stream, on_retrieved, to_dlq, outputs)

    return app
