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

This module is the Kafka shell: it consumes (the loop, its bounded queue, pause and resume), dispatches
(a task per signal or request, dead letters) and produces (results, and stats:
``streams.ranking.worker_stats``), and commits. What a
signal or a request means is ``streams.ranking.rank_handler.RankHandler``'s (no Kafka; the
``RankingEngine``, built by ``streams.ranking.engine_factory``, is its only way to the device);
``streams.ranking.history_applier.BehaviourApplier`` writes behaviours. What the worker holds per
partition is ``streams.ranking.partitions.Partitions``'s; which consumer it reads from,
``streams.ranking.intake.Intake``'s; where it stands in a rolling restart, and what a rebalance
means there, the state machine ``streams.ranking.hand_over.HandOver``'s. Model work runs on the
engine's device thread; this loop only fetches, schedules and publishes.

Rolling restarts (``streams.ranking.standby``, ``streams.ranking.worker_files``): a standby of its
id warms up beside it; on SIGUSR1 the worker stops fetching, leaves its positions in
``handover.json``, finishes and commits what it holds, and exits, persisting nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from aiokafka import AIOKafkaConsumer, TopicPartition
from prometheus_client import Counter as PCounter
from prometheus_client import Gauge, Histogram

from relaygr.infra.incarnations import Incarnations
from relaygr.infra.kafka import stop_clients
from relaygr.infra.rdkafka_producer import RdProducer
from relaygr.infra.settings import Settings
from relaygr.infra.stop_guard import StopDeadline
from relaygr.schemas import (
    BehaviorBatch,
    PrefillSignal,
    RankRequest,
    SchemaError,
    TopicRegistry,
    encode,
)
from relaygr.streams.common import DEAD_LETTERS, dead_letter, decode_keyed, deliver
from relaygr.streams.config import PipelineSettings
from relaygr.streams.history import HistoryTable
from relaygr.streams.history_alignment import HistoryAlignment
from relaygr.streams.ranking.engine_factory import build_engine
from relaygr.streams.ranking.hand_over import HandOver, State
from relaygr.streams.ranking.history_applier import BehaviourApplier
from relaygr.streams.ranking.intake import Intake
from relaygr.streams.ranking.partitions import Partitions
from relaygr.streams.ranking.rank_handler import RankHandler
from relaygr.streams.ranking.rank_rebalance import STAGE
from relaygr.streams.ranking.standby import Standby, stand_aside
from relaygr.streams.ranking.standby_warmup import StandbyWarmUp, spill_for_standby
from relaygr.streams.ranking.worker_files import WorkerFiles
from relaygr.streams.ranking.worker_stats import watch_device_cpu, worker_stats
from relaygr.streams.state_lineage import HistoryLineage, deployment_dir
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
# The loop's wait for records: short while anything is in flight (a finished task frees room, an
# applied batch resumes its partition, commits are due: the loop must turn to see them); long when
# idle, where each turn cost the worker's CPU (its idle CPU: about half of it at 20 ms).
FETCH_MS = 20
IDLE_FETCH_MS = 250
INFLIGHT = Gauge("relaygr_rank_inflight", "Signals and requests being handled")
INFLIGHT_PEAK = Gauge("relaygr_rank_inflight_peak", "Most signals and requests handled at once")


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
    (pause/resume), dispatch, dead letters, results and stats. What a signal or a request means is
    the ``RankHandler``'s; applying behaviours is the ``BehaviourApplier``'s; the partitions'
    state is the ``Partitions``'; the hand-over's and the rebalances' states are the
    ``HandOver``'s."""

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
        self.dir = deployment_dir(settings, "workers") / worker_id  # per topic prefix
        self.dir.mkdir(parents=True, exist_ok=True)
        self.files = WorkerFiles(self.dir)
        # A standby builds the next generation of the state while the active process holds this one.
        self.state_dir = self.files.new_generation() if standby else self.files.state_dir()
        self.engine, self.pipeline = build_engine(pipeline, worker_id, self.state_dir)
        watch_device_cpu(self.engine)
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
        self.partitions = Partitions(self.reg, self.history, self.alignment, self.applier, self.lineage)
        # Request and signal offsets name the topic id they were read from (see on assignment).
        self.incarnations = Incarnations(settings)
        self.intake = Intake(
            settings, self.reg, worker_id, self.incarnations, static_membership=static_membership
        )
        self.handover = HandOver(
            standby=standby,
            worker_id=worker_id,
            settings=settings,
            pipeline=self.pipeline,
            files=self.files,
            generation=self.state_dir,
            partitions=self.partitions,
            intake=self.intake,
            dispatch=self,
            engine=self.engine,
            note=self.note,
        )
        self.producer: RdProducer | None = None
        self.tasks: set[asyncio.Task] = set()
        self.peak_inflight = 0
        self._stop = asyncio.Event()
        self.fetching: asyncio.Future | None = None  # the loop's fetch (``_fetch``)

    def note(self, **fields: object) -> None:
        """One JSON line per signal handled / result produced (the worker's own audit trail); a
        standby's say so (the active process handles those signals too)."""
        mark = {"standby": True} if self.handover.standing_by else {}
        self.events_log.write(
            json.dumps({"worker_id": self.worker_id, "t": time.time(), **fields, **mark}) + "\n"
        )

    def _log_end(self, partition: int) -> int | None:
        """The routed-behaviours partition's log end as the consumer last heard it."""
        tp = TopicPartition(self.reg.name("routed_behaviors"), partition)
        return self.intake.consumer.highwater(tp)

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        self._stop.set()
        if self.fetching is not None:  # an idle fetch may wait long: no need to wait it out
            self.fetching.cancel()

    def hand_over(self) -> None:
        """Stop as ``stop`` does, at once, leaving the positions in ``handover.json``."""
        self.handover.ask()
        self._stop.set()
        if self.fetching is not None:  # the fetch waiting for records: no need to wait it out
            self.fetching.cancel()

    def standby(self, metrics_port: int = 0, serve_nice: int | None = None) -> Standby:
        """What drives this worker as a standby (``streams.ranking.standby``)."""
        warm_up = StandbyWarmUp(
            worker_id=self.worker_id,
            settings=self.settings,
            pipeline=self.pipeline,
            files=self.files,
            generation=self.state_dir,
            engine=self.engine,
            handler=self.handler,
            partitions=self.partitions,
            intake=self.intake,
            note=self.note,
        )
        return Standby(
            worker_id=self.worker_id,
            machine=self.handover,
            warm_up=warm_up,
            files=self.files,
            engine=self.engine,
            intake=self.intake,
            metrics_port=metrics_port,
            serve_nice=serve_nice,
        )

    async def run(self, standby: Standby | None = None) -> None:
        """Serve as a group member until stopped; with ``standby``, stand by for the active
        process of this id first and take over from it."""
        if standby is not None:
            await standby.start()
        else:  # before joining the group: the first requests must not pay the process's cold start
            took = await self.engine.warm_up()
            log.info("%s: warmed up the device in %.2f s", self.worker_id, took)
        self.producer = RdProducer(self.settings, linger_ms=self.settings.request_linger_ms)
        await self.producer.start()
        if standby is None:
            await self.intake.start_group(self.handover)
            self.partitions.watch(self.intake.consumer)
            await self.serve()
            return
        taking_over = asyncio.create_task(standby.take_over())
        taking_over.add_done_callback(self._standby_failed)
        try:
            await self.serve()
        finally:
            taking_over.cancel()

    def _standby_failed(self, task: asyncio.Task) -> None:
        """A standby that cannot take over stops (its owner sees it exit) rather than idle."""
        if not task.cancelled() and task.exception() is not None:
            log.error("%s (standby): taking over failed", self.worker_id, exc_info=task.exception())
            self.stop()

    async def serve(self) -> None:
        """The consumer loop until ``stop``, then the shut-down (the consumer and producer started)."""
        serving = self.handover.serving_in_group
        spill = spill_for_standby(self.files, self.engine, self.note, serving, self.worker_id)
        timers = asyncio.gather(self._publish_stats(), spill)
        try:
            await self._loop()
        finally:
            timers.cancel()
            self.partitions.stop_watching()
            await self._shut_down()

    async def _shut_down(self) -> None:
        if self.handover.state is State.HANDING_OVER:
            await self.handover.hand_over()  # handover.json, requests drained and committed
        else:
            await self.partitions.settle(set(self.partitions.assigned), timeout_s=30)
            await self.partitions.finish_applying()
            with contextlib.suppress(Exception):
                await self.handover.commit()
        await self.partitions.close()
        with contextlib.suppress(Exception):
            await self.incarnations.close()
        await self.handover.close()
        clients = [self.intake.consumer] if self.intake.started else []
        await stop_clients(*clients, *([self.producer] if self.producer is not None else []))
        if not self.handover.asked:  # (a successor rebuilds its own state: nothing to persist)
            with contextlib.suppress(TimeoutError):  # ranked suffixes, before the store persists
                await asyncio.wait_for(self.engine.drain(), 10)
        self.engine.close()
        self.history.close()
        self.events_log.close()

    async def _loop(self) -> None:
        beh = self.reg.name("routed_behaviors")
        last_commit = time.monotonic()
        while not self._stop.is_set():
            await self.handover.between_fetches()  # a standby switches to the group's consumer here
            consumer = self.intake.consumer
            self.partitions.reap()
            # Bounded queue: at most max_inflight signals and requests in flight; past that the
            # work partitions are paused (behaviours keep flowing) and the rest waits in Kafka.
            room = self.pipeline.max_inflight - len(self.tasks)
            pause, resume = self.partitions.flow(consumer.assignment(), room > 0)
            consumer.pause(*pause)
            consumer.resume(*resume)
            # Nothing in flight, nothing paused, no hand-over under way: only a record needs this
            # loop, and the fetch returns at the first one, so it may wait long.
            idle = not self.tasks and not pause and self.handover.in_group
            batch = await self._fetch(consumer, IDLE_FETCH_MS if idle else FETCH_MS)
            if not batch and self._stop.is_set():
                break
            for tp, msgs in batch.items():
                if tp.topic == beh:
                    # Applied by a task of its own, in slices with the loop free in between: a
                    # burst of one user's behaviours never keeps the requests unread (``hop_rank``).
                    self.partitions.apply(tp, msgs)
                    continue
                if self.partitions.keep(tp, msgs):  # a standby's, for its hand-over
                    continue
                if self.partitions.holds(tp):  # fetched as it was held: fetched again later
                    consumer.seek(tp, msgs[0].offset)
                    continue
                for m in msgs:
                    if room <= 0:  # over the bound: fetch this one again later
                        consumer.seek(tp, m.offset)
                        break
                    room -= 1
                    self.take(tp, m)
            self.peak_inflight = max(self.peak_inflight, len(self.tasks))
            INFLIGHT_PEAK.set(self.peak_inflight)
            if time.monotonic() - last_commit > self.pipeline.commit_interval_s:
                await self.handover.commit(if_changed=True)
                last_commit = time.monotonic()
            INFLIGHT.set(len(self.tasks))

    async def _fetch(self, consumer: AIOKafkaConsumer, timeout_ms: int) -> dict:
        """The next batch (at most ``timeout_ms`` of waiting; a stop or a hand-over cuts it short:
        none was taken)."""
        self.fetching = asyncio.ensure_future(consumer.getmany(timeout_ms=timeout_ms, max_records=500))
        try:
            return await asyncio.shield(self.fetching)
        except asyncio.CancelledError:
            if not self.fetching.cancelled():  # this task itself was cancelled
                raise
            return {}

    def take(self, tp: TopicPartition, m) -> None:
        """Handle a fetched signal or request (by its topic) in a task of its own."""
        self._spawn(tp, m, self._handle_prefill if tp.topic == self._signals_topic else self._handle_rank)

    async def cancel_prefills(self) -> None:
        """Drop the pre-inferences still running (a process that hands over: the successor saw
        their signals and computes its own)."""
        prefills = [t for t in self.tasks if t.get_name() == self._signals_topic]
        for task in prefills:
            task.cancel()
        await asyncio.gather(*prefills, return_exceptions=True)

    def _spawn(self, tp: TopicPartition, m, handler) -> None:
        self.partitions.start(tp, m.offset)
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
            self.partitions.done(tp, m.offset)
        else:  # finished once the broker has the result: its acknowledgement, not this task, says so
            sent.ack.add_done_callback(lambda ack: self._acked(tp, m.offset, sent, ack))

    def _acked(self, tp: TopicPartition, offset: int, sent: Sent, ack: asyncio.Future) -> None:
        """A result's acknowledgement: its request is finished; a result librdkafka gave up on is
        sent again (``deliver``'s retries) before it is."""
        if not ack.cancelled() and ack.exception() is None:
            self.partitions.done(tp, offset)
            return

        async def again() -> None:
            await deliver(
                lambda: self._producer().send_and_wait(sent.topic, sent.value, key=sent.key), what="result"
            )
            self.partitions.done(tp, offset)

        task = asyncio.create_task(again())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _producer(self) -> RdProducer:
        if self.producer is None:
            raise RuntimeError("the worker's producer is not started")
        return self.producer

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
            lambda: self._producer().send_and_wait(topic, encode(dl), key=dl.key()), what="dead letter"
        )

    async def _handle_prefill(self, tp: TopicPartition, m) -> None:
        s = decode_keyed(PrefillSignal, m.key, m.value, self.settings.max_message_bytes)
        await self.handler.prefill(s, tp.partition)

    async def _handle_rank(self, tp: TopicPartition, m) -> Sent:
        """Rank a request and enqueue its result (not awaiting the broker: ``_acked`` does)."""
        r = decode_keyed(RankRequest, m.key, m.value, self.settings.max_message_bytes)
        res = await self.handler.rank(r, tp.partition)
        topic, value, key = self.reg.name("results"), encode(res), res.key()
        sent = Sent(topic, value, key, self._producer().send(topic, value, key=key))
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
            if not self.handover.in_group:  # a standby speaks for no partitions yet
                continue
            try:
                partitions = sorted({tp.partition for tp in self.partitions.assigned})
                st = worker_stats(self.engine, self.worker_id, partitions, self.pipeline.mode)
                await self._producer().send_and_wait(self.reg.name("worker_stats"), encode(st), key=st.key())
            except Exception:
                log.exception("publishing worker stats failed")


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
        await worker.run(worker.standby(metrics_port, serve_nice) if standby else None)

    asyncio.run(go())
    return 0
