"""Ranking worker: one process per device, a consumer-group member over the co-partitioned topics.

Topology (all keyed by user_id, same partition count, written with the cascade's one partitioner,
so the range assignor hands partition p of every topic to the same member — the worker that
pre-infers a user's prefix ranks its request):
  routed-behaviors ──> HistoryTable (RocksDB; the topic is its changelog: resumes at its own offset;
                       copies forwarded twice dropped; the ingress's progress records kept)
  prefill-signals ──> RankingEngine.prefill (lease; promote, extend or compute the prefix)
  rank-requests   ──> RankingEngine.rank ──> results (key request_id)
  bad input       ──> dead-letters;   every few seconds ──> worker-stats

Delivery: offsets of signals and requests are committed only up to the first one whose work is
not finished — for a request, whose result the broker has acknowledged (acks=all, idempotent
producer). A crash therefore re-ranks at most the unfinished requests; results are keyed by
request_id, so a consumer that keeps the last result per key sees each request once.

Event-time alignment: a signal or request waits (boundedly: ``max_task_idle_ms``, and never past
the point where full ranking would miss the deadline) until its partition's history covers every
behaviour produced before the request (``relaygr.schemas.routing``). If the wait runs out the
result says ``history_complete: false`` and ``relaygr_rank_history_incomplete_total`` counts it.

Scale-out: the group uses the range assignor, which hands partition p of every subscribed topic
(same partition count) to one member, whatever the number of members; a joining worker rebuilds the
histories of the partitions it gets from ``routed-behaviors`` and notes how long that took
(``history_caught_up`` in its events.jsonl, ``relaygr_history_catchup_seconds``).

Off the relay path, a result says why (``path_reason``): the trigger's refusal (``RankRequest.trigger``),
or what broke an admitted relay (``signal_not_seen``, ``prefill_not_ready``, ``prefill_<status>``,
``prefix_evicted``, ``deadline_passed``). A pre-inference that its ranking stopped waiting for is
abandoned between two chunks.

Model work runs on the engine's device thread; this loop only fetches, schedules and publishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections import OrderedDict

import torch
from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from prometheus_client import Counter as PCounter
from prometheus_client import Gauge, Histogram

from relaygr.infra.incarnations import Incarnations
from relaygr.infra.kafka import consumer, producer
from relaygr.infra.settings import Settings
from relaygr.schemas import (
    BehaviorBatch,
    PrefillSignal,
    RankedResult,
    RankPath,
    RankRequest,
    SchemaError,
    ScoredItem,
    TopicRegistry,
    TriggerReason,
    WorkerStats,
    encode,
)
from relaygr.schemas.routing import (
    HEADER_FORWARD_RATE,
    HEADER_PROGRESS,
    Positions,
    decode_positions,
    decode_rate,
)
from relaygr.streams.common import (
    BEHAVIOURS_APPLIED,
    DEAD_LETTERS,
    commit_existing,
    dead_letter,
    decode_keyed,
    deliver,
)
from relaygr.streams.config import PipelineSettings, engine_config
from relaygr.streams.history import HistoryAlignment, HistoryTable
from relaygr.streams.state_lineage import HistoryLineage, deployment_dir, rewind_old_topic_offsets
from relaygr.workers.calibration import calibrate
from relaygr.workers.cores import pin_this_thread
from relaygr.workers.devices import keep_host_pages
from relaygr.workers.history_window import served, window_step
from relaygr.workers.latency_model import LatencyModel
from relaygr.workers.model import HSTURanker
from relaygr.workers.prefix_kv import Events
from relaygr.workers.prefix_store import PrefixStore, PrefixStoreConfig
from relaygr.workers.ranker import RankingEngine
from relaygr.workers.scheduler import DeviceScheduler, Priority
from relaygr.workers.vocab import item_keys

log = logging.getLogger(__name__)
STAGE = "ranking"

PATHS = PCounter("relaygr_rank_results_total", "Ranked results by path", ["path"])
PREFILLS = PCounter("relaygr_prefill_outcomes_total", "Prefill signal outcomes", ["status"])
E2E = Histogram(
    "relaygr_rank_latency_seconds",
    "Ranking-stage latency (rank request produced -> result produced)",
    ["path"],
    buckets=(0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5),
)
STORE = Gauge("relaygr_prefix_store", "Prefix store counters and gauges", ["name"])
PACE = Gauge(
    "relaygr_device_pace",
    "Measured device time over the latency model's prediction (slices are sized by it)",
    ["work"],
)
PLANNED_IN_BURST = PCounter(
    "relaygr_rank_planned_in_ingest_burst_total",
    "Full rankings planned while the worker applied a burst of behaviours (for RELAYGR_INGEST_SLOWDOWN)",
)
REPLANNED = PCounter(
    "relaygr_rank_replanned_total",
    "Truncated full rankings that ran slower than planned and started over with fewer events",
)
INFLIGHT = Gauge("relaygr_rank_inflight", "Signals and requests being handled")
INFLIGHT_PEAK = Gauge("relaygr_rank_inflight_peak", "Most signals and requests handled at once")
# Events applied between two turns of the event loop while a burst of behaviours comes in, and
# the longest a slice decodes before it is applied: a request's fetch takes a few turns of the
# loop to complete, each one slice later (``hop_rank`` of the requests that arrive in a burst).
APPLY_SLICE = 4096
APPLY_SLICE_S = 0.001
# A burst's next slice waits while rankings are on the device, at most this long (then it applies
# one slice anyway, so a saturated device cannot stop behaviours), checking this often.
APPLY_YIELD_MAX_S = 0.02
APPLY_YIELD_POLL_S = 0.001
# A ranking waiting for its pre-inference checks this often whether it can still finish in time.
PREFILL_RECHECK_S = 0.005
ADVERTISED_RATE = Gauge(
    "relaygr_rank_ingress_forward_rate",
    "The ingress's forward rate through a backlog, as its last progress record said (records/s): "
    "a request behind a backlog it cannot see forwarded by its deadline does not wait for it",
)
INCOMPLETE = PCounter(
    "relaygr_rank_history_incomplete_total",
    "Requests ranked before their history covered every behaviour produced before them",
)
CAPPED = PCounter(
    "relaygr_rank_history_capped_total",
    "Requests whose user's history is longer than the model's max_seq_len (only its tail served)",
)
DUPLICATES = PCounter("relaygr_history_duplicates_total", "Routed behaviours applied once already, dropped")
CATCHUP = Histogram(
    "relaygr_history_catchup_seconds",
    "Assigned routed-behaviours partition: time from assignment until its history reached the "
    "partition's end offset at assignment",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)


class CatchUp:
    """One assigned behaviours partition being read up to where its log ended at assignment
    (``end`` is None until the broker said where that is)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.end: int | None = None
        self.t0 = time.monotonic()
        self.events = 0


UNKNOWN_ITEMS = PCounter(
    "relaygr_rank_unknown_items_total",
    "Item ids outside the model's vocabulary, ranked as its out-of-vocabulary token",
    ["where"],
)


class OffsetTracker:
    """Per partition: the next offset that is safe to commit (all before it are finished)."""

    def __init__(self) -> None:
        self._pending: dict[TopicPartition, set[int]] = {}
        self._next: dict[TopicPartition, int] = {}

    def start(self, tp: TopicPartition, offset: int) -> None:
        self._pending.setdefault(tp, set()).add(offset)
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)

    def done(self, tp: TopicPartition, offset: int) -> None:
        self._pending.get(tp, set()).discard(offset)

    def committable(self, tps: set[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        out = {}
        for tp, nxt in self._next.items():
            if tps is not None and tp not in tps:
                continue
            pending = self._pending.get(tp)
            out[tp] = min(pending) if pending else nxt
        return out

    def pending(self, tps: set[TopicPartition] | None = None) -> int:
        return sum(len(v) for tp, v in self._pending.items() if tps is None or tp in tps)

    def forget(self, tps: set[TopicPartition]) -> None:
        for tp in tps:
            self._pending.pop(tp, None)
            self._next.pop(tp, None)


class RankingWorker:
    def __init__(
        self,
        settings: Settings,
        p: PipelineSettings,
        worker_id: str,
        *,
        static_membership: bool = True,
    ) -> None:
        self.settings, self.p, self.worker_id = settings, p, worker_id
        self.reg = TopicRegistry(settings.topic_prefix, settings.partitions)
        self.static_membership = static_membership
        self.dir = deployment_dir(settings, "workers") / worker_id  # per topic prefix
        self.dir.mkdir(parents=True, exist_ok=True)
        self.model = HSTURanker.load(p.model_dir, device=p.device)
        self.latency = self._latency_model()
        threads, core = p.torch_threads, p.device_core

        def device_thread_setup() -> None:
            if core is not None:  # the emulated accelerator: a core of its own (``workers.cores``)
                pin_this_thread(core)
            if threads:
                torch.set_num_threads(threads)

        self.scheduler = DeviceScheduler(worker_id, on_start=device_thread_setup)
        self.store: PrefixStore | None = None
        if p.mode == "relay":
            mib = 1 << 20
            self.store = PrefixStore(
                PrefixStoreConfig(
                    device=str(self.model.device),
                    device_budget_bytes=int(p.device_cache_mb * mib),
                    host_budget_bytes=int(p.host_cache_mb * mib),
                    disk_path=str(self.dir / "prefix-store") if p.disk_cache_mb > 0 else None,
                    disk_budget_bytes=int(p.disk_cache_mb * mib),
                    default_lease_ttl_s=p.lease_ttl_s,
                ),
                model_version=self.model.model_version,
                clock=time.time,
            )
        self.engine = RankingEngine(self.model, self.store, self.scheduler, engine_config(p), self.latency)
        # Serve at most the model's max_seq_len most recent events; keep a bounded tail per user.
        self.max_seq_len = self.model.config.max_seq_len
        self.window_step = window_step(self.max_seq_len)
        self.history = HistoryTable(
            self.dir / "history",
            retain_events=p.history_retain_events or 2 * self.max_seq_len,
            retain_align=self.window_step,
        )
        self.alignment = HistoryAlignment(self.history)
        self.lineage = HistoryLineage(STAGE, settings, self.dir, self.history, self.store)
        # Request and signal offsets name the topic id they were read from (see on assignment).
        self.incarnations = Incarnations(settings)
        self.tracker = OffsetTracker()
        self.tasks: set[asyncio.Task] = set()
        # One task per behaviours partition applying its last fetched batch; the partition is
        # paused meanwhile, and the loop goes on fetching requests and signals.
        self.appliers: dict[TopicPartition, asyncio.Task] = {}
        self.assigned: set[TopicPartition] = set()
        self.catching_up: dict[int, CatchUp] = {}  # behaviours partition -> its rebuild in progress
        self.peak_inflight = 0
        self.signals_seen: OrderedDict[str, asyncio.Event] = OrderedDict()
        # Pre-inference outcome per request id: a result that missed its prefix says why.
        self.prefill_status: OrderedDict[str, str] = OrderedDict()

        self.events_log = open(self.dir / "events.jsonl", "a", buffering=1)  # noqa: SIM115
        self._stop = asyncio.Event()

    def _latency_model(self) -> LatencyModel:
        if self.p.calibration_file is not None and self.p.calibration_file.exists():
            return LatencyModel.load(self.p.calibration_file)
        model, samples = calibrate(self.model, repeats=2)
        log.info("calibrated full ranking on this machine: %s -> %s", samples, model)
        return model

    def _note(self, **fields: object) -> None:
        """One JSON line per signal handled / result produced (the worker's own audit trail)."""
        self.events_log.write(json.dumps({"worker_id": self.worker_id, "t": time.time(), **fields}) + "\n")

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        topics = [self.reg.name("routed_behaviors"), self.reg.name("prefill"), self.reg.name("rank")]
        kw = {}
        if self.static_membership:
            kw["group_instance_id"] = self.worker_id
        self.consumer = consumer(
            self.settings,
            group_id=f"{self.settings.topic_prefix}-ranking",
            max_poll_records=500,
            # Paused work partitions (the bounded queue) are fetched again only once the fetch in
            # flight returns: a short broker-side wait bounds that stall (default: 500 ms).
            fetch_max_wait_ms=20,
            session_timeout_ms=10000,
            heartbeat_interval_ms=1000,
            max_poll_interval_ms=300000,
            # Partition p of every topic to the same member, with any number of members
            # (round-robin, aiokafka's default, interleaves topics and breaks that past two).
            partition_assignment_strategy=(RangePartitionAssignor,),
            **kw,
        )
        # Before joining the group: the first requests must not pay the process's cold start.
        took = await self.engine.warm_up()
        log.info("%s: warmed up the device in %.2f s", self.worker_id, took)
        self.consumer.subscribe(topics, listener=_Rebalance(self))
        self.producer = producer(self.settings)
        await self.producer.start()
        await self.consumer.start()
        stats = asyncio.create_task(self._publish_stats())
        lineage = asyncio.create_task(self.lineage.watch(self.consumer, self.reg.name("routed_behaviors")))
        try:
            await self._loop()
        finally:
            stats.cancel()
            lineage.cancel()
            with contextlib.suppress(Exception):
                await self.lineage.close()
            with contextlib.suppress(Exception):
                await self.incarnations.close()
            await self._drain(set(self.assigned), timeout_s=30)
            await self._finish_appliers()
            with contextlib.suppress(Exception):
                await self._commit()
            await self.consumer.stop()
            await self.producer.stop()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.engine.drain(), 10)  # ranked suffixes, before the store persists
            self.scheduler.close()
            if self.store is not None:
                self.store.close()
            self.history.close()
            self.events_log.close()

    async def _loop(self) -> None:
        beh, sig = self.reg.name("routed_behaviors"), self.reg.name("prefill")
        last_commit = time.monotonic()
        while not self._stop.is_set():
            assignment = self.consumer.assignment()
            self._reap_appliers()
            # Bounded queue: at most max_inflight signals and requests in flight; past that the
            # work partitions are paused (behaviours keep flowing) and the rest waits in Kafka.
            room = self.p.max_inflight - len(self.tasks)
            work = [tp for tp in assignment if tp.topic != beh]
            if room <= 0:
                self.consumer.pause(*work)
            else:
                self.consumer.resume(*work)
            # A behaviours partition whose last batch is still being applied is not fetched.
            applying = {tp for tp in self.appliers if tp in assignment}
            self.consumer.pause(*applying)
            self.consumer.resume(*[tp for tp in assignment if tp.topic == beh and tp not in applying])
            batch = await self.consumer.getmany(timeout_ms=20, max_records=500)
            for tp, msgs in batch.items():
                if tp.topic == beh:
                    # Known before it is applied: a request need not wait for other users' records.
                    self.alignment.fetched(tp.partition, [_ahead_record(m) for m in msgs])
                    # Applied by a task of its own, in slices with the loop free in between: a
                    # burst of one user's behaviours never keeps the requests unread (``hop_rank``).
                    self.appliers[tp] = asyncio.create_task(
                        self._apply_after(self.appliers.get(tp), tp, msgs)
                    )
                    continue
                for m in msgs:
                    if room <= 0:  # over the bound: fetch this one again later
                        self.consumer.seek(tp, m.offset)
                        break
                    room -= 1
                    self._spawn(tp, m, self._handle_prefill if tp.topic == sig else self._handle_rank)
            self.peak_inflight = max(self.peak_inflight, len(self.tasks))
            INFLIGHT_PEAK.set(self.peak_inflight)
            if time.monotonic() - last_commit > 0.2:
                await self._commit()
                last_commit = time.monotonic()
            INFLIGHT.set(len(self.tasks))

    async def _apply_after(self, before: asyncio.Task | None, tp: TopicPartition, msgs: list) -> None:
        if before is not None:  # a batch fetched before the pause took effect: keep the order
            await before
        await self._apply_behaviours(tp, msgs)

    def _reap_appliers(self) -> None:
        """Forget finished appliers; one that failed stops the worker as the loop's own error
        would (the history table is left where its last applied slice ended)."""
        for tp, task in list(self.appliers.items()):
            if task.done():
                del self.appliers[tp]
                task.result()

    async def _finish_appliers(self, tps: set[TopicPartition] | None = None) -> None:
        """Wait for the appliers of ``tps`` (None: all) to finish."""
        pending = [t for tp, t in self.appliers.items() if tps is None or tp in tps]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    def _spawn(self, tp: TopicPartition, m, handler) -> None:
        self.tracker.start(tp, m.offset)
        task = asyncio.create_task(self._guard(tp, m, handler))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _guard(self, tp: TopicPartition, m, handler) -> None:
        try:
            await handler(tp, m)
            self.tracker.done(tp, m.offset)
        except SchemaError as e:
            await self._dead_letter(tp, m, str(e))
            self.tracker.done(tp, m.offset)
        except Exception:  # not marked done: the offset stays uncommitted and is redelivered
            log.exception("handling %s@%d failed", tp, m.offset)

    async def _commit(self) -> None:
        offsets = self.tracker.committable(self.assigned)
        # Behaviours are resumed from the history table's own offsets; committing them too lets
        # operators read this worker's ingestion lag with the usual consumer-group tools.
        beh = self.reg.name("routed_behaviors")
        for tp in self.assigned:
            if tp.topic == beh:
                offsets[tp] = self.history.next_offset(tp.partition)
        if offsets:
            await commit_existing(self.consumer, offsets, incarnations=self.incarnations)

    async def _drain(self, tps: set[TopicPartition], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.tracker.pending(tps) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    # ------------------------------------------------------------------ handlers

    async def _apply_behaviours(self, tp: TopicPartition, msgs: list) -> None:
        """One fetched batch of a routed-behaviours partition into the history table: each
        user's events with their sources, progress records merged into the partition's progress.
        Applied in slices of about APPLY_SLICE events or APPLY_SLICE_S of decoding with the loop
        free in between, so a burst never holds up the requests' handlers for long."""
        batch: list[tuple] = []
        progress: Positions = {}
        events = 0
        started = time.perf_counter()
        for i, m in enumerate(msgs):
            headers = dict(m.headers or ())
            if HEADER_PROGRESS in headers:
                try:
                    marked = decode_positions(m.value)
                    rate = headers.get(HEADER_FORWARD_RATE)
                    if rate is not None:
                        forwards = decode_rate(rate)
                        self.alignment.advertise(marked, forwards)
                        ADVERTISED_RATE.set(forwards)
                    for q, pos in marked.items():
                        progress[q] = max(progress.get(q, 0), pos)
                except ValueError as e:
                    self._spawn_dead_letter(tp, m, f"unreadable progress record: {e}")
                batch.append((m.offset, None))
            else:
                ev = self._behavior(tp, m)
                batch.append((m.offset, ev))
                events += len(ev) if ev is not None else 0
            if events >= APPLY_SLICE or i == len(msgs) - 1 or time.perf_counter() - started >= APPLY_SLICE_S:
                # A progress record covers what precedes it, all of which is in this slice or before.
                applied = self.history.append_many(tp.partition, batch, progress=progress or None)
                BEHAVIOURS_APPLIED.labels(STAGE).inc(applied)
                self.engine.ingest.add(applied)
                if applied < events:
                    DUPLICATES.inc(events - applied)
                self.alignment.notify()
                if tp.partition in self.catching_up:
                    self._caught_up(tp.partition, applied)
                batch, progress, events = [], {}, 0
                if i < len(msgs) - 1:
                    await asyncio.sleep(0)
                    await self._yield_to_rankings()
                    started = time.perf_counter()

    async def _yield_to_rankings(self) -> None:
        """Between two slices of a burst: while rankings are on the device (or wait for it), at
        most APPLY_YIELD_MAX_S. Decoding behaviours holds the interpreter, which the device thread
        needs between its tensor ops: a ranking computed next to a burst took 2-4x its time."""
        give_up = time.monotonic() + APPLY_YIELD_MAX_S
        while self.scheduler.ranking() and time.monotonic() < give_up:
            await asyncio.sleep(APPLY_YIELD_POLL_S)

    def _caught_up(self, partition: int, applied: int) -> None:
        """Count ``applied`` events towards the partition's rebuild; once it reached the end offset
        seen at assignment, note how long the rebuild took."""
        c = self.catching_up[partition]
        c.events += applied
        reached = self.history.next_offset(partition)
        if c.end is None or reached < c.end:
            return
        del self.catching_up[partition]
        seconds = time.monotonic() - c.t0
        CATCHUP.observe(seconds)
        log.info(
            "%s: history of partition %d caught up: offsets %d..%d, %d events in %.2f s",
            self.worker_id,
            partition,
            c.start,
            c.end,
            c.events,
            seconds,
        )
        self._note(
            event="history_caught_up",
            partition=partition,
            from_offset=c.start,
            to_offset=c.end,
            records=c.end - c.start,
            events=c.events,
            seconds=round(seconds, 3),
        )

    def _served_history(self, user_id: str, before_ts: float) -> tuple[Events, int, bool, int]:
        """The user's events before ``before_ts`` that a ranking reads (at most max_seq_len, the
        most recent, in a window moving by whole steps) in model item ids, how many there are in
        all, whether the window left some out, and how many of its items the vocabulary lacks."""
        full = self.history.get(user_id, before_ts)
        first = self.history.first(user_id)
        hist, capped = served(full, first, self.max_seq_len, self.window_step)
        # The table keeps the raw ids' keys (``item_key``), whatever the model; the mapping is a
        # pure function of them, so a cached prefix of the mapped history stays the prefix of the
        # next one, and a new checkpoint with another vocabulary reads the same table.
        items, unknown = self.model.vocab.to_model_tensor(hist.item_ids)
        return Events(items, hist.action_ids, hist.timestamps), first + len(full), capped, unknown

    async def _await_history(
        self, partition: int, needed: dict[str, int] | None, until: float, user_id: str
    ) -> bool:
        """Wait until ``partition``'s history of ``user_id`` covers the behaviours ``needed``
        (public partition -> end offset when the ingress read the request), at most until
        ``until`` (monotonic). Returns whether it does. Without ``needed`` (not routed by the
        ingress), the partition's known log end stands in for it, as a short best effort."""
        if needed is None:
            await self._history_caught_up(partition)
            return True
        return await self.alignment.wait(partition, needed, until, user_id.encode())

    def _behavior(self, tp: TopicPartition, m) -> BehaviorBatch | None:
        try:
            return decode_keyed(BehaviorBatch, m.key, m.value, self.settings.max_message_bytes)
        except SchemaError as e:
            self._spawn_dead_letter(tp, m, str(e))
            return None

    def _spawn_dead_letter(self, tp: TopicPartition, m, reason: str) -> None:
        task = asyncio.create_task(self._dead_letter(tp, m, reason))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _dead_letter(self, tp: TopicPartition, m, reason: str) -> None:
        DEAD_LETTERS.labels(STAGE, tp.topic).inc()
        dl = dead_letter(STAGE, tp.topic, tp.partition, m.offset, m.key, m.value, reason)
        topic = self.reg.name("dead_letters")
        await deliver(
            lambda: self.producer.send_and_wait(topic, encode(dl), key=dl.key()), what="dead letter"
        )

    async def _history_caught_up(self, partition: int, timeout_s: float = 0.2) -> None:
        """Wait (briefly) until behaviours of this partition are applied up to the known log end."""
        tp = TopicPartition(self.reg.name("routed_behaviors"), partition)
        end = self.consumer.highwater(tp)
        if end is None:
            return
        deadline = time.monotonic() + timeout_s
        while self.history.next_offset(partition) < end and time.monotonic() < deadline:
            await asyncio.sleep(0.002)

    async def _handle_prefill(self, tp: TopicPartition, m) -> None:
        s = decode_keyed(PrefillSignal, m.key, m.value, self.settings.max_message_bytes)
        # A prefix of a partial history is still a valid prefix (histories only grow): a bounded wait.
        await self._await_history(
            tp.partition, s.behaviors_needed, time.monotonic() + self.p.max_task_idle_ms / 1000, s.user_id
        )
        done = self.signals_seen[s.request_id] = asyncio.Event()
        while len(self.signals_seen) > 100_000:
            self.signals_seen.popitem(last=False)
        hist, _, _, _ = self._served_history(s.user_id, s.model_ts)
        # Retrieval counted the history from its own table; keep the short-term suffix out of the
        # prefix by this worker's count too (it may have ingested fewer events so far).
        n = min(s.prefix_len, len(hist) - min(self.p.short_term, len(hist)))
        try:
            out = await self.engine.prefill(
                s.user_id, hist, s.lease_ttl_s, prefix_len=n, owner=self.worker_id
            )
            self.prefill_status[s.request_id] = out.status
            while len(self.prefill_status) > 100_000:
                self.prefill_status.popitem(last=False)
        finally:
            done.set()
        PREFILLS.labels(out.status.split(":")[0]).inc()
        self._note(
            event="prefill",
            request_id=s.request_id,
            user_id=s.user_id,
            partition=tp.partition,
            status=out.status,
            prefix_len=out.prefix_len,
            ms=round(out.ms, 3),
        )

    async def _await_signal(self, r: RankRequest, hist: Events) -> str | None:
        """The prefill signal of this request travels on its own topic and may be fetched after
        the rank request. Wait for it while full ranking would still meet the deadline, then for
        its pre-inference while ranking the suffix would (the engine decides the path after).
        No wait when the store already holds nearly what that pre-inference would compute (an
        earlier ranking of this user kept it): see ``worth_waiting``.

        Returns why a relay would fail now (``signal_not_seen``, ``prefill_not_ready``), or None."""
        store = self.engine.store
        cached = store.cached_length(r.user_id, hist) if store is not None else 0
        if not worth_waiting(len(hist), cached, self.p.short_term):
            return None
        n = len(hist)
        lat = self.engine.latency
        until_full = time.monotonic() + r.deadline_ts - time.time() - self.engine.predict_full_ms(n) / 1000
        while r.request_id not in self.signals_seen and time.monotonic() < until_full:
            await asyncio.sleep(0.002)
        done = self.signals_seen.get(r.request_id)
        suffix_s = lat.predict_ms(self.p.short_term + len(r.candidates)) / 1000
        if done is not None and not done.is_set() and self._prefill_may_finish(r, suffix_s):
            # Its pre-inference is under way: it must not wait behind rankings now.
            self.engine.expedite_prefill(r.user_id, r.deadline_ts)
            try:
                while not done.is_set() and self._prefill_may_finish(r, suffix_s):
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(done.wait(), PREFILL_RECHECK_S)
            finally:
                self.engine.yield_prefill(r.user_id)  # waited enough: rank now, not behind it
        if done is None:
            return "signal_not_seen"
        if done.is_set():
            return None
        # Late for its request: finishing it would only delay the pre-inferences still on time.
        self.engine.abandon_prefill(r.user_id)
        return "prefill_not_ready"

    def _prefill_may_finish(self, r: RankRequest, suffix_s: float) -> bool:
        """Whether ``r``'s pre-inference may still be done in time to rank its suffix (``suffix_s``)
        by the deadline: there is room, and what it has left to compute (when known) fits it. One
        predicted to finish too late is not waited for: the ranking gets the time for a
        truncated history instead of spending it waiting."""
        room_s = r.deadline_ts - time.time() - suffix_s
        eta_ms = self.engine.prefill_eta_ms(r.user_id)
        return room_s > 0 and (eta_ms is None or eta_ms / 1000 <= room_s)

    async def _handle_rank(self, tp: TopicPartition, m) -> None:
        r = decode_keyed(RankRequest, m.key, m.value, self.settings.max_message_bytes)
        t_in = time.time()
        # Wait for the behaviours produced before the request while full ranking of what is
        # there would still meet the deadline, and at most max_task_idle_ms.
        hist, total, capped, unknown_history = self._served_history(r.user_id, r.model_ts)
        room_s = r.deadline_ts - t_in - self.engine.predict_full_ms(len(hist)) / 1000
        until = time.monotonic() + max(0.0, min(room_s, self.p.max_task_idle_ms / 1000))
        t_hist = time.time()
        complete = await self._await_history(tp.partition, r.behaviors_needed, until, r.user_id)
        history_wait = (time.time() - t_hist) * 1000
        if history_wait > 0.05:  # behaviours were applied meanwhile
            hist, total, capped, unknown_history = self._served_history(r.user_id, r.model_ts)
        if capped:
            CAPPED.inc()
        if not complete:
            INCOMPLETE.inc()
        # Candidates are scored in model ids; the result names them by the raw ids received.
        cands, unknown_candidates = self.model.vocab.to_model_tensor(
            torch.from_numpy(item_keys(r.candidates))
        )
        if unknown_candidates:
            UNKNOWN_ITEMS.labels("candidate").inc(unknown_candidates)
        if unknown_history:
            UNKNOWN_ITEMS.labels("history").inc(unknown_history)
        signal_wait = 0.0
        relay_blocker: str | None = None
        if r.prefill_expected and self.p.mode == "relay":
            t_sig = time.time()
            relay_blocker = await self._await_signal(r, hist)
            signal_wait = (time.time() - t_sig) * 1000
        if t_in >= r.deadline_ts:
            path, items, oc = (
                RankPath.TIMEOUT,
                [ScoredItem(item_id=c, score=0.0) for c in r.candidates[: r.top_k]],
                None,
            )
        else:
            t_engine = time.time()
            oc = await self.engine.rank(r.user_id, hist, cands, r.model_ts, r.deadline_ts)
            # Before the engine: reading the history, and waiting for its behaviours and for the
            # request's prefill signal.
            oc.breakdown_ms["worker_prep"] = (t_engine - t_in) * 1000 - signal_wait - history_wait
            if signal_wait:
                oc.breakdown_ms["signal_wait"] = signal_wait
            order = torch.argsort(oc.scores, descending=True, stable=True)[: r.top_k].tolist()
            items = [ScoredItem(item_id=r.candidates[i], score=float(oc.scores[i])) for i in order]
            path = RankPath(oc.path)
            if oc.in_ingest_burst:
                PLANNED_IN_BURST.inc()
            if oc.replanned:
                REPLANNED.inc()
        now = time.time()
        breakdown = {
            "hop_rank": max(0.0, (t_in - r.produced_at) * 1000),
            "ranking": (now - r.produced_at) * 1000,
        }
        breakdown.update({k: float(v) for k, v in r.upstream_ms.items()})
        if history_wait > 0.05:
            breakdown["history_wait"] = history_wait
        if oc is not None:
            breakdown.update(oc.breakdown_ms)
        res = RankedResult(
            request_id=r.request_id,
            user_id=r.user_id,
            ts=r.ts,
            items=items,
            path=path,
            latency_ms=max(0.0, (now - r.ts) * 1000),
            worker_id=self.worker_id,
            breakdown_ms=breakdown,
            history_len=total,
            used_len=oc.used_len if oc else 0,
            tokens_computed=oc.tokens_computed if oc else 0,
            prefix_len=oc.prefix_len if oc else 0,
            prefix_tier=oc.prefix_tier if oc else None,
            prefix_worker_id=oc.prefix_owner if oc else None,
            history_complete=complete,
            path_reason=path_reason(
                r, path, self.p.mode, relay_blocker, self.prefill_status.get(r.request_id)
            ),
            unknown_candidates=unknown_candidates,
            unknown_history=unknown_history,
            label_item_id=r.label_item_id,
        )
        topic = self.reg.name("results")
        await deliver(lambda: self.producer.send_and_wait(topic, encode(res), key=res.key()), what="result")
        PATHS.labels(path.value).inc()
        E2E.labels(path.value).observe(now - r.produced_at)
        self._note(
            event="result",
            request_id=r.request_id,
            user_id=r.user_id,
            partition=tp.partition,
            path=path.value,
        )

    # ------------------------------------------------------------------ stats

    async def _publish_stats(self) -> None:
        while True:
            await asyncio.sleep(self.p.stats_interval_s)
            try:
                self.latency = self.engine.refit_latency()
                PACE.labels("extend").set(self.engine.pace_extend.factor)
                PACE.labels("score").set(self.engine.pace_score.factor)
                PACE.labels("full").set(self.engine.pace_full.factor)
                m = self.store.metrics() if self.store is not None else {}
                for k, v in m.items():
                    STORE.labels(k).set(v)
                st = WorkerStats(
                    worker_id=self.worker_id,
                    ts=time.time(),
                    partitions=sorted({tp.partition for tp in self.assigned}),
                    cache_bytes={t: int(m.get(f"bytes_{t}", 0)) for t in ("device", "host", "disk")},
                    # Device bytes only: leases reserve device memory; spilled prefixes do not count.
                    pinned_bytes=int(m.get("bytes_reserved", 0)),
                    queue_depth=self.scheduler.queue_depth(),
                    prefill_inflight=self.scheduler.queue_depth(Priority.PREFILL),
                    latency_coeffs=self.latency.coeffs(),
                    mode=self.p.mode,
                )
                await self.producer.send_and_wait(self.reg.name("worker_stats"), encode(st), key=st.key())
            except Exception:
                log.exception("publishing worker stats failed")


def path_reason(
    r: RankRequest, path: RankPath, mode: str, relay_blocker: str | None, prefill_status: str | None
) -> str | None:
    """Why ``r`` did not take a relay path (None when it did). ``relay_blocker``: what the wait
    for its prefill signal found (``_await_signal``); ``prefill_status``: the outcome of its
    pre-inference on this worker, if any."""
    if path in (RankPath.RELAY, RankPath.RELAY_WAITED, RankPath.RELAY_EXTENDED):
        return None
    if path is RankPath.BASELINE or mode != "relay":
        return "baseline"
    if path is RankPath.TIMEOUT:
        return "deadline_passed"  # the rank request reached the worker after its deadline
    if path is RankPath.COLD_START:
        return TriggerReason.NO_HISTORY.value
    if not r.prefill_expected:
        return (r.trigger or TriggerReason.NOT_AT_RISK).value
    if relay_blocker is not None:
        return relay_blocker
    if prefill_status is not None and prefill_status not in _PREFIX_READY:
        return "prefill_" + prefill_status.replace(":", "_")
    return "prefix_evicted"  # pre-inferred (or cached earlier), gone by the ranking


# Pre-inference outcomes that leave a prefix in the store.
_PREFIX_READY = frozenset({"computed", "extended", "device", "host", "disk", "merged"})


def worth_waiting(history_len: int, cached_len: int, short_term: int) -> bool:
    """Whether a rank request should wait for its pre-inference, given the prefix the store
    already holds. Ranking computes whatever the cached prefix lacks; while that is at most two
    short-term suffixes (a fraction of a millisecond fused), computing it beats waiting: under
    load the pre-inference can queue behind rankings for tens of milliseconds."""
    return cached_len < history_len - min(2 * short_term, history_len)


def _ahead_record(m) -> tuple[int, bytes | None, Positions | None]:
    """A fetched routed-behaviours record as ``HistoryAlignment.fetched`` keeps it: its offset,
    its key (the user's), and a progress record's positions (an unreadable one: no positions,
    and no user)."""
    if HEADER_PROGRESS not in dict(m.headers or ()):
        return m.offset, m.key, None
    try:
        return m.offset, None, decode_positions(m.value)
    except ValueError:
        return m.offset, None, None


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, worker: RankingWorker) -> None:
        self.w = worker

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        revoked = set(revoked)
        # Finish (or give up on) what is in flight for these partitions, then commit it.
        await self.w._drain(revoked, timeout_s=10)
        await self.w._finish_appliers(revoked)
        with contextlib.suppress(Exception):
            offsets = self.w.tracker.committable(revoked)
            if offsets:
                await commit_existing(self.w.consumer, offsets, incarnations=self.w.incarnations)
        self.w.tracker.forget(revoked)
        self.w.assigned -= revoked
        for tp in revoked:
            if tp.topic == self.w.reg.name("routed_behaviors"):
                self.w.catching_up.pop(tp.partition, None)
                self.w.alignment.forget(tp.partition)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.w.assigned |= set(assigned)
        beh = self.w.reg.name("routed_behaviors")
        # Histories built from another cluster or an earlier incarnation of the topic are dropped.
        await self.w.lineage.verify(beh, [tp.partition for tp in assigned if tp.topic == beh])
        behaviours = [tp for tp in assigned if tp.topic == beh]
        # A committed request or signal offset read from an earlier topic of the same name (a
        # commit retried across its deletion and creation) would skip the new topic's first ones.
        group = f"{self.w.settings.topic_prefix}-ranking"
        await rewind_old_topic_offsets(
            STAGE,
            self.w.worker_id,
            group,
            self.w.consumer,
            self.w.incarnations,
            [tp for tp in assigned if tp.topic != beh],
        )
        for tp in behaviours:
            # The history table knows how far it got: resume there, not at the group offset.
            self.w.consumer.seek(tp, self.w.history.next_offset(tp.partition))
            self.w.alignment.forget(tp.partition)
            # Timed from here: the loop may apply fetched behaviours while this callback awaits.
            self.w.catching_up.setdefault(tp.partition, CatchUp(self.w.history.next_offset(tp.partition)))
        await self._track_catch_up(behaviours)
        self.w._note(event="assigned", partitions=sorted(tp.partition for tp in behaviours))
        log.info("%s assigned %s", self.w.worker_id, sorted((t.topic, t.partition) for t in assigned))

    async def _track_catch_up(self, behaviours: list[TopicPartition]) -> None:
        """Time the reading of each newly assigned behaviours partition up to its end now."""
        fresh = [tp for tp in behaviours if self.w.catching_up[tp.partition].end is None]
        if not fresh:
            return
        try:
            ends = await asyncio.wait_for(self.w.consumer.end_offsets(fresh), 5)
        except Exception:  # only a measurement: never hold up the assignment for it
            ends = {}
        for tp in fresh:
            c = self.w.catching_up[tp.partition]
            end = ends.get(tp)
            if end is None or end <= c.start:  # unknown, or nothing to rebuild
                del self.w.catching_up[tp.partition]
                continue
            c.end = end
            self.w._caught_up(tp.partition, 0)  # perhaps read up to it already


def main(settings: Settings, p: PipelineSettings, worker_id: str, metrics_port: int = 0) -> int:
    from relaygr.streams.common import freeze_heap, serve_metrics

    keep_host_pages()  # scratch tensors reuse heap pages instead of faulting in fresh ones
    if p.torch_threads:
        torch.set_num_threads(p.torch_threads)
    serve_metrics(metrics_port)
    worker = RankingWorker(settings, p, worker_id)
    freeze_heap()  # the model, torch and aiokafka: out of every later full collection

    async def go() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stop)
        await worker.run()

    asyncio.run(go())
    return 0
