"""Retrieval stage (faust app): candidates for each request, and the sequence-aware trigger.

Topology (the routed topics: the ingress stage re-keyed the public ones by user id):
  routed-behaviors (key user_id) ──> table ``histories``: length + recent items (RocksDB via rocksdict,
                              changelog in Kafka; applied in batches, one write per user per batch)
  routed-requests  (key user_id) ──> trigger ──> prefill-signals (key user_id, same partition number)
                                 └─> candidates ──> retrieved (key user_id)
  worker-stats ──> the trigger's latency model and measured footprints
  bad input ──> dead-letters

Candidates: top-K items by inner product of the trained model's item embeddings with the mean
embedding of the user's most recent items (popular items for a user without history). The
prefill signal goes out before the emulated feature fetch, so pre-inference overlaps it.

Primitives: ``build(settings, pipeline)`` (the faust app); ``CandidateGenerator``;
``summary_add`` / ``summary_before`` (the table's per-user summary); ``prefill_signal`` /
``retrieved`` (the two events a request produces); ``follow_worker_stats`` (the trigger's
calibration from the workers' reports).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import numpy as np
from prometheus_client import Counter as PCounter
from prometheus_client import Histogram

from relaygr.infra.settings import Settings
from relaygr.schemas import (
    BehaviorBatch,
    PrefillSignal,
    RecommendationRequest,
    RetrievedRequest,
    SchemaError,
    TopicRegistry,
    WorkerStats,
    decode,
    encode,
)
from relaygr.schemas.events import is_item_id
from relaygr.streams.common import (
    PendingSends,
    StageOutputs,
    decode_keyed,
    faust_dead_letterer,
    handle_events,
    ingest_batches,
    raw_topic,
    routing_headers,
)
from relaygr.streams.config import PipelineSettings, trigger_config
from relaygr.streams.stage_app import make_app
from relaygr.streams.trigger import Decision, SequenceAwareTrigger
from relaygr.workers.engine.latency_model import LatencyModel
from relaygr.workers.model.vocab import OOV, ItemVocab, RawId

log = logging.getLogger(__name__)

STAGE = "retrieval"
RECENT = 32

TRIGGER = PCounter("relaygr_trigger_decisions_total", "Sequence-aware trigger decisions", ["reason"])
JOINED = PCounter(
    "relaygr_trigger_joins_total",
    "Admissions of a user's visit that joined its pre-inference admitted before (no token, no backlog)",
)
REQS = PCounter("relaygr_retrieval_requests_total", "Requests retrieved")
HOP = Histogram(
    "relaygr_retrieval_hop_seconds",
    "Kafka hop: request produced -> retrieval received",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 1),
)
LAT = Histogram(
    "relaygr_retrieval_seconds",
    "Retrieval stage time per request",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
)


class CandidateGenerator:
    """Top-K by inner product with the mean embedding of the user's recent items.

    Takes and returns raw item ids: ``vocab`` (the checkpoint's) maps them to embedding rows and
    back, so a candidate is always an item of the model's catalogue, named as producers name it."""

    def __init__(self, item_emb: np.ndarray, vocab: ItemVocab | None = None) -> None:
        self.emb = np.ascontiguousarray(item_emb, dtype=np.float32)
        self.num_items = self.emb.shape[0] - 1  # row 0 is the out-of-vocabulary token
        self.vocab = vocab if vocab is not None else ItemVocab.identity_of(self.num_items)
        self.popularity: Counter[int] = Counter()  # by model id

    def observe(self, item_id: RawId) -> None:
        self.observe_many([item_id])

    def observe_many(self, item_ids: list[RawId]) -> None:
        rows, _ = self.vocab.to_model(item_ids)
        self.popularity.update(int(r) for r in rows if r != OOV)

    def candidates(self, recent_items: list[RawId], k: int) -> list[RawId]:
        k = min(k, self.num_items)
        known = [int(r) for r in self.vocab.to_model(recent_items)[0] if r != OOV] if recent_items else []
        if not known:
            popular = [i for i, _ in self.popularity.most_common(k)]
            taken = set(popular)
            rest = [i for i in range(1, self.num_items + 1) if i not in taken]
            return self._raw(popular + rest[: k - len(popular)])
        u = self.emb[known].mean(axis=0)
        scores = self.emb @ u
        scores[0] = -np.inf
        top = np.argpartition(-scores, k)[:k] if k < len(scores) - 1 else np.arange(1, len(scores))
        return self._raw([int(i) for i in top[np.argsort(-scores[top], kind="stable")]])

    def _raw(self, rows: list[int]) -> list[RawId]:
        # A catalogue id that the wire cannot carry (an integer beyond MAX_ITEM_ID, a string too
        # long or with control characters) cannot be a candidate; nor can 0, as before strings.
        return [r for r in self.vocab.to_raw(rows) if r != 0 and is_item_id(r)]


def summary_add(summary: dict | None, batch: BehaviorBatch) -> dict:
    """A user's history as retrieval needs it: its length, its most recent items, and per public
    partition the last source offset applied (a copy the ingress forwarded twice is skipped) and
    the id of the public topic those offsets belong to.
    O(1) per event, so the table's changelog carries small values however long the history grows."""
    s = summary or {"n": 0, "r": []}
    if batch.source_topic_id is not None and batch.source_topic_id != s.get("t"):
        # Another public topic of that name (recreated): its offsets start over.
        if s.get("t") is not None:
            s["s"] = {}
        s["t"] = batch.source_topic_id
    src = s.setdefault("s", {})
    recent = s["r"]
    for item, ts, q, off in zip(
        batch.item_ids, batch.timestamps, batch.source_partitions, batch.source_offsets, strict=True
    ):
        if off <= src.get(str(q), -1):
            continue
        src[str(q)] = off
        s["n"] += 1
        recent.append([item, ts])
    s["r"] = recent[-RECENT:]
    return s


def summary_before(summary: dict | None, ts: float) -> tuple[int, list[RawId]]:
    """History length and recent items strictly before ``ts`` (events newer than the request that
    arrived first are discounted; beyond the kept window the count is exact only for ordered input)."""
    if not summary:
        return 0, []
    newer = [x for x in summary["r"] if x[1] >= ts]
    recent = [i for i, t in summary["r"] if t < ts]  # raw ids as the producer sent them
    return max(0, summary["n"] - len(newer)), recent


def load_item_embeddings(pipeline: PipelineSettings) -> tuple[np.ndarray, ItemVocab, int, int]:
    """Item embeddings of the trained model, its vocabulary, its KV bytes per token and its
    served length cap."""
    from relaygr.workers.engine.ranker import kv_bytes_per_token
    from relaygr.workers.model.model import HSTURanker

    model = HSTURanker.load(pipeline.model_dir, device="cpu")
    emb = model.item_embeddings().float().cpu().numpy()
    return emb, model.vocab, kv_bytes_per_token(model), model.config.max_seq_len


def load_latency(pipeline: PipelineSettings) -> LatencyModel:
    if pipeline.calibration_file is not None and pipeline.calibration_file.exists():
        return LatencyModel.load(pipeline.calibration_file)
    return LatencyModel()  # replaced by the first WorkerStats a ranking worker publishes


def prefill_signal(
    r: RecommendationRequest,
    history_len: int,
    decision: Decision,
    lease_ttl_s: float,
    needs: dict[str, int] | None,
) -> PrefillSignal:
    """The pre-infer signal of an admitted request: its user's prefix of ``decision.prefix_len``
    events, leased for ``lease_ttl_s``, and the behaviours the ranking must see (``needs``)."""
    return PrefillSignal(
        request_id=r.request_id,
        user_id=r.user_id,
        ts=r.ts,
        event_ts=r.event_ts,
        history_len=history_len,
        prefix_len=decision.prefix_len,
        lease_ttl_s=lease_ttl_s,
        issued_at=time.time(),
        behaviors_needed=needs,
    )


def retrieved(
    r: RecommendationRequest,
    candidates: list[RawId],
    history_len: int,
    decision: Decision,
    received_at: float,
    routed_at: float | None,
    needs: dict[str, int] | None,
) -> RetrievedRequest:
    """The request passed on to pre-processing with its candidates and the trigger's decision."""
    return RetrievedRequest(
        request_id=r.request_id,
        user_id=r.user_id,
        ts=r.ts,
        event_ts=r.event_ts,
        candidates=candidates,
        top_k=r.top_k,
        history_len=history_len,
        trigger=decision.reason,
        received_at=received_at,
        routed_at=routed_at,
        retrieved_at=time.time(),
        label_item_id=r.label_item_id,
        behaviors_needed=needs,
    )


async def follow_worker_stats(
    settings: Settings, topic: str, trigger: SequenceAwareTrigger, max_bytes: int
) -> None:
    """Calibrate the trigger from the ranking workers' reports (a plain reader, no group): their
    latency model of full ranking (and the pace their full rankings keep), the prefix bytes pinned
    per partition and their pre-inference backlog."""
    from relaygr.infra.kafka import consumer

    cons = consumer(settings, topic, group_id=None)
    await cons.start()
    try:
        async for m in cons:
            try:
                st = decode(WorkerStats, m.value, max_bytes=max_bytes)
            except SchemaError as e:
                log.warning("bad worker stats skipped: %s", e)
                continue
            if st.mode == "relay" and len(st.latency_coeffs) == 3:
                try:
                    pace = st.full_pace if st.full_pace > 0 else 1.0
                    trigger.report_latency(LatencyModel.from_coeffs(st.latency_coeffs), st.partitions, pace)
                except ValueError as e:
                    log.warning("worker %s sent an unusable latency model: %s", st.worker_id, e)
            if st.partitions:
                trigger.report_backlog(st.partitions, st.prefill_backlog_ms, as_of=st.ts)
                for part in st.partitions:
                    trigger.report_footprint(part, st.pinned_bytes // len(st.partitions), as_of=st.ts)
    finally:
        await cons.stop()


def build(settings: Settings, pipeline: PipelineSettings, worker_id: str = "0"):
    app = make_app(STAGE, settings, worker_id)
    reg = TopicRegistry(settings.topic_prefix, settings.partitions)
    behaviors = raw_topic(app, reg.name("routed_behaviors"))
    requests = raw_topic(app, reg.name("routed_requests"))
    out_prefill, out_retrieved = reg.name("prefill"), reg.name("retrieved")
    outputs = StageOutputs(settings)
    dlq = raw_topic(app, reg.name("dead_letters"))
    # The value format is part of the table's name: a format change starts a fresh table.
    histories = app.Table(
        "summaries-v2",
        default=None,
        partitions=settings.partitions,
        extra_topic_configs=app.relaygr_changelog_configs,
    )
    emb, vocab, bytes_per_token, max_seq_len = load_item_embeddings(pipeline)
    gen = CandidateGenerator(emb, vocab)
    trigger = SequenceAwareTrigger(
        trigger_config(pipeline, bytes_per_token, max_seq_len), load_latency(pipeline)
    )
    limit = settings.max_message_bytes

    to_dlq = faust_dead_letterer(STAGE, dlq)

    def decode_behavior(ev) -> BehaviorBatch:
        return decode_keyed(BehaviorBatch, ev.key, ev.value, limit)

    def on_behaviors(batch: list, as_event) -> None:
        summaries: dict[str, tuple] = {}  # user -> (its last event, summary)
        for ev, b in batch:
            s = summaries[b.user_id][1] if b.user_id in summaries else histories.get(b.user_id)
            summaries[b.user_id] = (ev, summary_add(s, b))
        for user, (ev, s) in summaries.items():
            as_event(ev)
            histories[user] = s
        # Only once the table took them: a batch whose first write is refused is applied again.
        for _, b in batch:
            gen.observe_many(b.item_ids)

    async def on_request(ev, sends: PendingSends) -> None:
        r = decode_keyed(RecommendationRequest, ev.key, ev.value, limit)
        t0 = time.time()
        needs, routed_at = routing_headers(ev.headers)
        HOP.observe(max(0.0, t0 - r.ts))
        n, recent = summary_before(histories.get(r.user_id), r.model_ts)
        decision = trigger.decide(ev.message.partition, n, t0, user_id=r.user_id)
        TRIGGER.labels(decision.reason.value).inc()
        if decision.joined:
            JOINED.inc()
        if decision.admitted:
            sig = prefill_signal(r, n, decision, trigger.config.lease_ttl_s, needs)
            # Out before the feature fetch: the pre-inference overlaps it.
            await sends.send(out_prefill, sig.key(), encode(sig), what="prefill signal")
        if pipeline.feature_fetch_ms:
            await asyncio.sleep(pipeline.feature_fetch_ms / 1000)
        cands = gen.candidates(recent, 2 * r.num_candidates)
        out = retrieved(r, cands[:2000], n, decision, t0, routed_at, needs)
        await sends.send(out_retrieved, out.key(), encode(out), what="retrieved request")
        REQS.inc()
        LAT.observe(time.time() - t0)

    @app.agent(behaviors)
    async def ingest(stream):
        await ingest_batches(STAGE, stream, decode_behavior, on_behaviors, to_dlq)

    @app.agent(requests, concurrency=pipeline.concurrency)
    async def retrieve(stream):
        await handle_events(STAGE, stream, on_request, to_dlq, outputs)

    @app.task
    async def calibrate_trigger() -> None:
        await follow_worker_stats(settings, reg.name("worker_stats"), trigger, limit)

    return app
