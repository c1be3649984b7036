"""Ranking worker: one process per device, a consumer-group member over the co-partitioned topics.

Topology (all keyed by user_id, same partition count, written with the cascade's one partitioner,
so the range assignor hands partition p of every topic to the same member — the worker that
pre-infers a user's prefix ranks its request):
  routed-behaviors ──> HistoryTable (RocksDB; the topic is its changelog: resumes at its own offset;
                       copies forwarded twice dropped; the ingress's progress records kept)
  prefill-signals ──> RankingEngine.prefill (lease; promote, extend or compute the prefix)
  rank-requests   ──> RankingEngine.rank ──> results (key request_id)
  bad input       ──> dead-letters;   every few seconds ──> worker-stats

Delivery: offsets of signals and requests are committed (every ``commit_interval_s``) up to the first
one whose work is not finished — for a request, whose result the broker has acknowledged (acks=all,
idempotent producer). A crash re-ranks at most the requests after the last commit; results are keyed
by request_id, so a consumer that keeps the last result per key sees each request once. A signal
or request whose handling fails goes to the dead letters with the reason (bad input, or ``internal
error``, as in the other stages), so that commits go on past it; while stopping it is left to the
next owner.

Event-time alignment: a signal or request waits (at most ``max_task_idle_ms``, never past where full
ranking would miss the deadline) until its partition's history covers every behaviour produced
before the request (``relaygr.schemas.routing``); else the result says ``history_complete: false``.

Scale-out: the range assignor hands partition p of every topic to one member; a joining worker
rebuilds the histories of its partitions from ``routed-behaviors`` (``history_caught_up``).

Off the relay path, a result says why (``path_reason``): the trigger's refusal (``RankRequest.trigger``),
or what broke an admitted relay (``signal_not_seen``, ``prefill_not_ready``, ``prefill_<status>``,
``prefix_evicted``, ``deadline_passed``). A pre-inference that its ranking stopped waiting for is
abandoned between two chunks.

This module is the Kafka shell (loop, offsets, commits, dead letters, stats; rebalances in
``streams.ranking.rank_rebalance``). What a signal or a request means is
``streams.ranking.rank_handler.RankHandler``'s (no Kafka; the ``RankingEngine`` is its only way to the
device); ``streams.ranking.history_applier.BehaviourApplier`` writes behaviours.
Model work runs on the engine's device thread; this loop only fetches, schedules and publishes.

Rolling restarts (``streams.ranking.standby``, ``streams.ranking.worker_files``): a standby of its id that warms up
finds the worker's cached prefixes on its disk tier; on SIGUSR1 the worker stops fetching, leaves its
positions in ``handover.json``, finishes and commits what it holds, and exits, persisting nothing.
The standby and the rebalance listener use the worker through ``streams.ranking.worker_port.WorkerPort``:
its parts and the methods it offers them (``note``, ``take``, ``drain``, ``finish_appliers``,
``commit``, ``join_group``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from prometheus_client import Counter as PCounter
from prometheus_client import Gauge, Histogram

from relaygr.infra.incarnations import Incarnations
from relaygr.infra.kafka import consumer, stop_clients
from relaygr.infra.rdkafka_producer import RdProducer
from relaygr.infra.settings import Settings
from relaygr.infra.stop_guard import StopDeadline
from relaygr.schemas import (
    BehaviorBatch,
    PrefillSignal,
    RankRequest,
    SchemaError,
    TopicRegistry,
    WorkerStats,
    encode,
)
from relaygr.streams.common import DEAD_LETTERS, commit_existing, dead_letter, decode_keyed, deliver
from relaygr.streams.config import PipelineSettings
from relaygr.streams.history import HistoryTable
from relaygr.streams.history_alignment import HistoryAlignment
from relaygr.streams.ranking.engine_factory import build_engine
from relaygr.streams.ranking.history_applier import BehaviourApplier, ahead_record
from relaygr.streams.ranking.offset_tracker import OffsetTracker
from relaygr.streams.ranking.rank_handler import RankHandler
from relaygr.streams.ranking.rank_rebalance import STAGE, RankRebalance
from relaygr.streams.ranking.standby import hand_over, spill_for_standby, stand_aside
from relaygr.streams.ranking.worker_files import WorkerFiles
from relaygr.streams.state_lineage import HistoryLineage, deployment_dir
from relaygr.workers.engine.prefill_ledger import device_share
from relaygr.workers.engine.scheduler import Priority
from relaygr.workers.model.devices import keep_host_pages
from relaygr.workers.prefix_kv import window_step

log = logging.getLogger(__name__)

PATHS = PCounter("relaygr_rank_results_total", "Ranked results by path", ["path"])
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
INFLIGHT = Gauge("relaygr_rank_inflight", "Signals and requests being handled")
INFLIGHT_PEAK = Gauge("relaygr_rank_inflight_peak", "Most signals and requests handled at once")
# Read at scrape time: the device thread's CPU (what the model work costs the host) by priority.
DEVICE_CPU = Gauge("relaygr_device_cpu_seconds", "Device thread CPU seconds spent on jobs", ["priority"])


@dataclass(frozen=True, slots=True)
class Sent:
    """A result enqueued for the broker: what to send again if it is given up, and its
    acknowledgement."""

    topic: str
    value: bytes
    key: bytes
    ack: asyncio.Future


class RankingWorker:
    """The Kafka shell of a ranking worker: wiring, the consumer loop with its bounded queue
    (pause/resume), offsets, commits and rebalances, dead letters and stats. What a signal or a
    request means is the ``RankHandler``'s; applying behaviours is the ``BehaviourApplier``'s."""

    def __init__(
        self,
        settings: Settings,
        pipeline: PipelineSettings,
        worker_id: str,
        *,
        static_membership: bool = True,
        standby: bool = False,
    ) -> None:
        self.settings, self.pipeline, self.worker_id = settings, pipeline, worker_id
        self.reg = TopicRegistry(settings.topic_prefix, settings.partitions)
        self._signals_topic = self.reg.name("prefill")
        self.static_membership = static_membership
        self.dir = deployment_dir(settings, "workers") / worker_id  # per topic prefix
        self.dir.mkdir(parents=True, exist_ok=True)
        self.files = WorkerFiles(self.dir)
        # A standby builds the next generation of the state while the active process holds this one.
        self.state_dir = self.files.new_generation() if standby else self.files.state_dir()
        self.engine, self.pipeline = build_engine(pipeline, worker_id, self.state_dir)
        for prio in Priority:
            DEVICE_CPU.labels(prio.name.lower()).set_function(
                lambda p=prio, d=self.engine.scheduler: d.cpu_s[p]
            )
        self.history = HistoryTable(
            self.state_dir / "history",
            retain_events=pipeline.history_retain_events or 2 * self.engine.max_seq_len,
            retain_align=window_step(self.engine.max_seq_len),
        )
        self.alignment = HistoryAlignment(self.history)
        self.lineage = HistoryLineage(STAGE, settings, self.state_dir, self.history, self.engine.store)
        self.events_log = open(self.dir / "events.jsonl", "a", buffering=1)  # noqa: SIM115
        self.handler = RankHandler(
            self.engine, self.history, self.alignment, pipeline, worker_id, self.note, self._log_end
        )
        self.applier = BehaviourApplier(
            self.history, self.alignment, self.engine, self._decode_behaviours, self._reject, self.note
        )
        # Request and signal offsets name the topic id they were read from (see on assignment).
        self.incarnations = Incarnations(settings)
        self.tracker = OffsetTracker()
        self.tasks: set[asyncio.Task] = set()
        # One task per behaviours partition applying its last fetched batch; the partition is
        # paused meanwhile, and the loop goes on fetching requests and signals.
        self.appliers: dict[TopicPartition, asyncio.Task] = {}
        self.assigned: set[TopicPartition] = set()
        self.peak_inflight = 0
        self._stop = asyncio.Event()
        # A standby: outside the group, its request partitions held until the hand-over.
        self.in_group, self.standing_by = not standby, standby
        self.held: set[TopicPartition] = set()
        self.prefetched: dict[TopicPartition, deque] = {}  # a standby's requests, kept for its hand-over
        self.before_fetch: Callable[[], Awaitable[None]] | None = None
        self.fetching: asyncio.Future | None = None  # the loop's fetch (``_fetch``)
        self.handing_over = 0.0  # when (epoch s) it was told to hand over; 0: it was not
        self.lineage_task: asyncio.Task | None = None

    def note(self, **fields: object) -> None:
        """One JSON line per signal handled / result produced (the worker's own audit trail); a
        standby's say so (the active process handles those signals too)."""
        mark = {"standby": True} if self.standing_by else {}
        self.events_log.write(
            json.dumps({"worker_id": self.worker_id, "t": time.time(), **fields, **mark}) + "\n"
        )

    def _log_end(self, partition: int) -> int | None:
        """The routed-behaviours partition's log end as the consumer last heard it."""
        return self.consumer.highwater(TopicPartition(self.reg.name("routed_behaviors"), partition))

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        self._stop.set()

    def hand_over(self) -> None:
        """Stop as ``stop`` does, at once, leaving the positions in ``handover.json``."""
        self.handing_over = time.time()
        self._stop.set()
        if self.fetching is not None:  # the fetch waiting for records: no need to wait it out
            self.fetching.cancel()

    def group_consumer(self) -> tuple[AIOKafkaConsumer, RankRebalance]:
        """The group member's consumer, subscribed (not started), and its rebalance listener."""
        topics = [self.reg.name("routed_behaviors"), self.reg.name("prefill"), self.reg.name("rank")]
        kw = {}
        if self.static_membership:
            kw["group_instance_id"] = self.worker_id
        group_consumer = consumer(
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
        listener = RankRebalance(self, group_consumer)
        group_consumer.subscribe(topics, listener=listener)
        return group_consumer, listener

    async def join_group(self) -> AIOKafkaConsumer:
        """Start the group member's consumer; return it once it has its first assignment (a
        standby joining after its hand-over)."""
        group, listener = self.group_consumer()
        await group.start()
        await listener.assigned_once.wait()
        return group

    async def run(self) -> None:
        # Before joining the group: the first requests must not pay the process's cold start.
        took = await self.engine.warm_up()
        log.info("%s: warmed up the device in %.2f s", self.worker_id, took)
        self.consumer, _ = self.group_consumer()
        self.producer = RdProducer(self.settings, linger_ms=self.settings.request_linger_ms)
        await self.producer.start()
        await self.consumer.start()
        self.watch_lineage()
        await self.serve()

    def watch_lineage(self) -> None:
        """Check the assigned histories against the cluster every few seconds (group members)."""
        beh = self.reg.name("routed_behaviors")
        self.lineage_task = asyncio.create_task(self.lineage.watch(self.consumer, beh))

    async def serve(self) -> None:
        """The consumer loop until ``stop``, then the shut-down (the consumer and producer started)."""
        timers = asyncio.gather(self._publish_stats(), spill_for_standby(self))
        try:
            await self._loop()
        finally:
            timers.cancel()
            if self.lineage_task is not None:
                self.lineage_task.cancel()
            await self._shut_down()

    async def _shut_down(self) -> None:
        if self.handing_over and self.in_group:
            await hand_over(self)  # handover.json, requests drained and committed (streams.ranking.standby)
        else:
            await self.drain(set(self.assigned), timeout_s=30)
            await self.finish_appliers()
            with contextlib.suppress(Exception):
                await self.commit()
        with contextlib.suppress(Exception):
            await self.lineage.close()
        with contextlib.suppress(Exception):
            await self.incarnations.close()
        await stop_clients(self.consumer, self.producer)
        if not self.handing_over:  # (a successor rebuilds its own state: nothing to persist)
            with contextlib.suppress(TimeoutError):  # ranked suffixes, before the store persists
                await asyncio.wait_for(self.engine.drain(), 10)
        self.engine.close()
        self.history.close()
        self.events_log.close()

    async def _loop(self) -> None:
        beh = self.reg.name("routed_behaviors")
        last_commit = time.monotonic()
        while not self._stop.is_set():
            if self.before_fetch is not None:
                await self.before_fetch()
            assignment = self.consumer.assignment()
            self._reap_appliers()
            # Bounded queue: at most max_inflight signals and requests in flight; past that the
            # work partitions are paused (behaviours keep flowing) and the rest waits in Kafka.
            room = self.pipeline.max_inflight - len(self.tasks)
            work = [tp for tp in assignment if tp.topic != beh and tp not in self.held]
            if room <= 0:
                self.consumer.pause(*work)
            else:
                self.consumer.resume(*work)
            self.consumer.pause(*(self.held & assignment))
            # A behaviours partition whose last batch is still being applied is not fetched.
            applying = {tp for tp in self.appliers if tp in assignment}
            self.consumer.pause(*applying)
            self.consumer.resume(*[tp for tp in assignment if tp.topic == beh and tp not in applying])
            batch = await self._fetch()
            if not batch and self._stop.is_set():
                break
            for tp, msgs in batch.items():
                if tp.topic == beh:
                    # Known before it is applied: a request need not wait for other users' records.
                    self.alignment.fetched(tp.partition, [ahead_record(m) for m in msgs])
                    # Applied by a task of its own, in slices with the loop free in between: a
                    # burst of one user's behaviours never keeps the requests unread (``hop_rank``).
                    self.appliers[tp] = asyncio.create_task(
                        self._apply_after(self.appliers.get(tp), tp, msgs)
                    )
                    continue
                if tp in self.prefetched:
                    self.prefetched[tp].extend(msgs)
                    continue
                for m in msgs:
                    if room <= 0:  # over the bound: fetch this one again later
                        self.consumer.seek(tp, m.offset)
                        break
                    room -= 1
                    self.take(tp, m)
            self.peak_inflight = max(self.peak_inflight, len(self.tasks))
            INFLIGHT_PEAK.set(self.peak_inflight)
            if time.monotonic() - last_commit > self.pipeline.commit_interval_s:
                await self.commit()
                last_commit = time.monotonic()
            INFLIGHT.set(len(self.tasks))

    async def _fetch(self) -> dict:
        """The next batch (at most 20 ms of waiting; a hand-over cuts it short: none was taken)."""
        self.fetching = asyncio.ensure_future(self.consumer.getmany(timeout_ms=20, max_records=500))
        try:
            return await asyncio.shield(self.fetching)
        except asyncio.CancelledError:
            if not self.fetching.cancelled():  # this task itself was cancelled
                raise
            return {}

    async def _apply_after(self, before: asyncio.Task | None, tp: TopicPartition, msgs: list) -> None:
        if before is not None:  # a batch fetched before the pause took effect: keep the order
            await before
        await self.applier.apply(tp.partition, msgs)

    def _reap_appliers(self) -> None:
        """Forget finished appliers; one that failed stops the worker as the loop's own error
        would (the history table is left where its last applied slice ended)."""
        for tp, task in list(self.appliers.items()):
            if task.done():
                del self.appliers[tp]
                task.result()

    async def finish_appliers(self, tps: set[TopicPartition] | None = None) -> None:
        """Wait for the appliers of ``tps`` (None: all) to finish."""
        pending = [t for tp, t in self.appliers.items() if tps is None or tp in tps]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    def take(self, tp: TopicPartition, m) -> None:
        """Handle a fetched signal or request (by its topic) in a task of its own."""
        self._spawn(tp, m, self._handle_prefill if tp.topic == self._signals_topic else self._handle_rank)

    def _spawn(self, tp: TopicPartition, m, handler) -> None:
        self.tracker.start(tp, m.offset)
        task = asyncio.create_task(self._guard(tp, m, handler), name=tp.topic)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _guard(self, tp: TopicPartition, m, handler) -> None:
        sent: Sent | None = None
        try:
            sent = await handler(tp, m)
        except SchemaError as e:
            await self._dead_letter(tp, m, str(e))
        except Exception as e:  # left undone it would hold the partition's commits until a restart
            log.exception("handling %s@%d failed", tp, m.offset)
            if self._stop.is_set():  # stopping: left uncommitted, for the next owner
                return
            await self._dead_letter(tp, m, f"internal error in {STAGE}: {type(e).__name__}: {e}")
        if sent is None:
            self.tracker.done(tp, m.offset)
        else:  # finished once the broker has the result: its acknowledgement, not this task, says so
            sent.ack.add_done_callback(lambda ack: self._acked(tp, m.offset, sent, ack))

    def _acked(self, tp: TopicPartition, offset: int, sent: Sent, ack: asyncio.Future) -> None:
        """A result's acknowledgement: its request is finished; a result librdkafka gave up on is
        sent again (``deliver``'s retries) before it is."""
        if not ack.cancelled() and ack.exception() is None:
            self.tracker.done(tp, offset)
            return

        async def again() -> None:
            await deliver(
                lambda: self.producer.send_and_wait(sent.topic, sent.value, key=sent.key), what="result"
            )
            self.tracker.done(tp, offset)

        task = asyncio.create_task(again())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def commit(self) -> dict[TopicPartition, int]:
        """Commit what is finished (nothing outside the group); returns the offsets committed."""
        if not self.in_group:
            return {}
        offsets = self.tracker.committable(self.assigned)
        # Behaviours are resumed from the history table's own offsets; committing them too lets
        # operators read this worker's ingestion lag with the usual consumer-group tools.
        beh = self.reg.name("routed_behaviors")
        for tp in self.assigned:
            if tp.topic == beh:
                offsets[tp] = self.history.next_offset(tp.partition)
        if offsets:
            await commit_existing(self.consumer, offsets, incarnations=self.incarnations)
        return offsets

    async def drain(self, tps: set[TopicPartition], timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the signals and requests of ``tps`` are handled."""
        deadline = time.monotonic() + timeout_s
        while self.tracker.pending(tps) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    # ------------------------------------------------------------------ records

    def _decode_behaviours(self, m) -> BehaviorBatch:
        return decode_keyed(BehaviorBatch, m.key, m.value, self.settings.max_message_bytes)

    def _reject(self, m, reason: str) -> None:
        """A routed-behaviours record the applier could not use: to the dead letters."""
        tp = TopicPartition(self.reg.name("routed_behaviors"), m.partition)
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

    async def _handle_prefill(self, tp: TopicPartition, m) -> None:
        s = decode_keyed(PrefillSignal, m.key, m.value, self.settings.max_message_bytes)
        await self.handler.prefill(s, tp.partition)

    async def _handle_rank(self, tp: TopicPartition, m) -> Sent:
        """Rank a request and enqueue its result (not awaiting the broker: ``_acked`` does)."""
        r = decode_keyed(RankRequest, m.key, m.value, self.settings.max_message_bytes)
        res = await self.handler.rank(r, tp.partition)
        topic, value, key = self.reg.name("results"), encode(res), res.key()
        sent = Sent(topic, value, key, self.producer.send(topic, value, key=key))
        PATHS.labels(res.path.value).inc()
        E2E.labels(res.path.value).observe(res.breakdown_ms["ranking"] / 1000)
        self.note(
            event="result",
            request_id=r.request_id,
            user_id=r.user_id,
            partition=tp.partition,
            path=res.path.value,
        )
        return sent

    # ------------------------------------------------------------------ stats

    async def _publish_stats(self) -> None:
        while True:
            await asyncio.sleep(self.pipeline.stats_interval_s)
            if not self.in_group:  # a standby speaks for no partitions yet
                continue
            try:
                st = self._stats()
                await self.producer.send_and_wait(self.reg.name("worker_stats"), encode(st), key=st.key())
            except Exception:
                log.exception("publishing worker stats failed")

    def _stats(self) -> WorkerStats:
        latency = self.engine.refit_latency()
        pacing = self.engine.pacing
        PACE.labels("extend").set(pacing.extend.factor)
        PACE.labels("score").set(pacing.score.factor)
        PACE.labels("full").set(pacing.full.factor)
        m = self.engine.store_metrics()
        for k, v in m.items():
            STORE.labels(k).set(v)
        return WorkerStats(
            worker_id=self.worker_id,
            ts=time.time(),
            partitions=sorted({tp.partition for tp in self.assigned}),
            cache_bytes={t: int(m.get(f"bytes_{t}", 0)) for t in ("device", "host", "disk")},
            # Device bytes only: leases reserve device memory; spilled prefixes do not count.
            pinned_bytes=int(m.get("bytes_reserved", 0)),
            queue_depth=self.engine.queue_depth(),
            prefill_inflight=self.engine.queue_depth(Priority.PREFILL),
            prefill_counts=dict(self.engine.prefills.counts),
            prefill_backlog_ms=round(self.engine.prefill_backlog_ms(), 3),
            device_share={k: round(v, 4) for k, v in device_share(self.engine.scheduler).items()},
            latency_coeffs=latency.coeffs(),
            full_pace=min(1000.0, max(1e-3, pacing.full.factor)),
            mode=self.pipeline.mode,
            rank_batch_sizes={str(k): v for k, v in self.engine.batch_sizes().items()},
        )


def main(
    settings: Settings,
    pipeline: PipelineSettings,
    worker_id: str,
    metrics_port: int = 0,
    *,
    standby: bool = False,
    handover_asked: Callable[[], bool] = lambda: False,
    stop_deadline: StopDeadline | None = None,
) -> int:
    """Run the worker until SIGTERM/SIGINT (stop) or SIGUSR1 (hand over to a standby). With
    ``standby``, first stand by for the active process of ``worker_id`` and take over from it
    (``streams.ranking.standby``); its metrics are served once the active process is gone."""
    from relaygr.streams.common import freeze_heap, serve_metrics

    keep_host_pages()  # scratch tensors reuse heap pages instead of faulting in fresh ones
    serve_nice = stand_aside(settings, worker_id) if standby else None  # nice 19 before the model loads
    if pipeline.torch_threads:
        torch.set_num_threads(pipeline.torch_threads)
    if not standby:
        serve_metrics(metrics_port)
    worker = RankingWorker(settings, pipeline, worker_id, standby=standby)
    freeze_heap()  # the model, torch and aiokafka: out of every later full collection

    async def go() -> None:
        loop = asyncio.get_running_loop()

        def stop() -> None:
            if stop_deadline is not None:
                stop_deadline.arm()
            worker.stop()

        def hand_over() -> None:  # a stop too: draining and committing may wait on a gone broker
            if stop_deadline is not None:
                stop_deadline.arm()
            worker.hand_over()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        loop.add_signal_handler(signal.SIGUSR1, hand_over)
        if handover_asked():  # while starting up: hands over as soon as it runs
            hand_over()
        if standby:
            from relaygr.streams.ranking.standby import Standby

            await Standby(worker, metrics_port, serve_nice).run()
        else:
            await worker.run()

    asyncio.run(go())
    return 0
