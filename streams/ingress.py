"""Ingress stage: the cascade's own co-partitioning of whatever the producers wrote.

Topology (two aiokafka consumer groups, so requests never queue behind behaviours; their records
fetched by librdkafka, ``relaygr.infra.rdkafka_fetch``):
  behaviors (any partitioner) ──> validate ──> routed-behaviors (partition = partition_for(user_id)):
                                               one BehaviorBatch per user per fetch, and
                                               a progress record in every routed partition
  requests  (any partitioner) ──> validate ──> routed-requests  (partition = partition_for(user_id)),
                                               with the behaviours' end offsets it must see
  bad input ──> dead-letters (reason, original bytes)

Producers keep their own clients and partitioners (librdkafka's CRC32, murmur2, FNV-1a,
round-robin, explicit partitions): every later stage reads only the routed topics, which the
cascade writes with one partitioner, so a user's behaviours, prefill signal and rank request
meet on one worker whatever the producer did (see ``relaygr.schemas.routing`` for the headers).

Event-time alignment: a routed request carries the public behaviours' end offsets as they were
when the ingress read it; a progress record in a routed partition says how far each public
partition has been forwarded. The ranking worker ranks a request once its partition's progress
covers those offsets, or when its bounded wait runs out (then the result says the history may
be partial). Requests are forwarded at once, never behind a behaviour backlog.

Behaviours go out as one produce batch per routed partition per fetch (each ending with its
progress record, which therefore follows every behaviour it covers, and says how many records a
second this router forwards through a backlog: a reader knows at once that a request behind a
burst cannot see all of it by its deadline), and their offsets are
committed once the batches are acknowledged: at least once, and a re-forwarded copy carries its
source offsets so that readers drop it. A user's events of one fetch travel as one
``BehaviorBatch`` record, so the stages behind pay per burst, not per event, in Kafka records.

One process can route both inputs; ``relaygr up`` runs one process per input, so that a burst of
behaviours never competes with requests for the same event loop (or CPU time slice). This module
routes requests and owns the stage (clients, checks, dead letters, commits); the behaviours'
router is ``streams.ingress_behaviours``.

Primitives: ``Ingress(settings, worker_id, inputs)`` with ``run()`` / ``stop()``; ``main(...)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from typing import Any

from aiokafka import ConsumerRebalanceListener, TopicPartition
from prometheus_client import Counter as PCounter
from prometheus_client import Histogram

from relaygr.infra.incarnations import Incarnations
from relaygr.infra.kafka import consumer, describe_partitions, partition_for, producer, stop_clients
from relaygr.infra.rdkafka_fetch import fetching
from relaygr.infra.rdkafka_producer import RdProducer
from relaygr.infra.settings import Settings
from relaygr.infra.stop_guard import StopDeadline
from relaygr.schemas import (
    RecommendationRequest,
    SchemaError,
    TopicRegistry,
    encode,
)
from relaygr.schemas.routing import (
    HEADER_NEEDS,
    HEADER_ROUTED_AT,
    Positions,
    encode_positions,
)
from relaygr.streams.common import DEAD_LETTERS, dead_letter, decode_keyed, deliver
from relaygr.streams.ingress_behaviours import BEHAVIOUR_FETCH, COMMIT_EVERY_S, ROUTED, BehaviourRouter

log = logging.getLogger(__name__)
STAGE = "ingress"

MISROUTED = PCounter(
    "relaygr_ingress_misrouted_total",
    "Events that arrived on a partition other than the cascade's own for their key",
    ["topic"],
)
HOP = Histogram(
    "relaygr_ingress_request_seconds",
    "Request produced -> forwarded onto routed-requests",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 1),
)

INPUTS = ("requests", "behaviors")
BEHAVIOUR_PARTITION_FETCH_BYTES = 4 << 20  # a partition's share of one behaviours fetch
REQUEST_FETCH_MS = 20  # the requests' fetch wait while a commit is due
IDLE_FETCH_MS = 250  # and while none is
# A behaviours-only router runs at this lower CPU priority (os.nice increment).
BEHAVIOUR_NICENESS = 5
# How often the ingress checks that the public topics are still the ones it has been reading.
WATCH_EVERY_S = 5.0
# How often a requests router re-reads the behaviours topic's partition count.
PARTITIONS_REFRESH_S = 30.0


class Ingress:
    def __init__(self, settings: Settings, worker_id: str = "0", inputs: tuple[str, ...] = INPUTS) -> None:
        unknown = set(inputs) - set(INPUTS)
        if unknown or not inputs:
            raise ValueError(f"inputs must be among {INPUTS}, got {inputs}")
        self.settings, self.worker_id, self.inputs = settings, worker_id, tuple(inputs)
        self.reg = TopicRegistry(settings.topic_prefix, settings.partitions)
        self.limit = settings.max_message_bytes
        self._stop = asyncio.Event()
        self._misrouted_seen: set[str] = set()
        self._beh_partitions: tuple[int, float] = (0, 0.0)  # (count, when read)
        self.behaviours: BehaviourRouter | None = None
        self.assigned_at: dict[str, float] = {}  # topic -> when its partitions were last assigned
        # Commits name the topic id they were read from; a partition whose committed offset names
        # an earlier topic of the same name is read from its start (``relaygr.infra.incarnations``).
        self.incarnations = Incarnations(settings)

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        prefix = self.settings.topic_prefix
        common = {"session_timeout_ms": 10000, "heartbeat_interval_ms": 1000, "fetch_max_wait_ms": 20}
        clients: list = []
        loops = []
        # Requests and behaviours have their own consumers and producers (their own connections):
        # a request never waits behind a large behaviour fetch or batch on the wire.
        if "requests" in self.inputs:
            self.req_consumer = fetching(
                consumer(self.settings, group_id=f"{prefix}-ingress-requests", **common), self.settings
            )
            self.req_consumer.subscribe(
                [self.reg.name("requests")],
                listener=_Assignments(self, "req_consumer", f"{prefix}-ingress-requests"),
            )
            # The end-offset look-ups of requests on a connection of their own as well.
            self.offsets = consumer(self.settings, group_id=None)
            self.req_producer = RdProducer(self.settings, linger_ms=self.settings.request_linger_ms)
            clients += [self.req_producer, self.req_consumer, self.offsets]
            loops.append(self._requests)
        if "behaviors" in self.inputs:
            self.beh_consumer = fetching(
                consumer(
                    self.settings,
                    group_id=f"{prefix}-ingress-behaviors",
                    max_partition_fetch_bytes=BEHAVIOUR_PARTITION_FETCH_BYTES,
                    **common,
                ),
                self.settings,
                max_records=BEHAVIOUR_FETCH,
                max_partition_fetch_bytes=BEHAVIOUR_PARTITION_FETCH_BYTES,
            )
            self.beh_consumer.subscribe(
                [self.reg.name("behaviors")],
                listener=_Assignments(self, "beh_consumer", f"{prefix}-ingress-behaviors"),
            )
            self.beh_producer = producer(self.settings, linger_ms=0, max_batch_size=1 << 20)
            clients += [self.beh_producer, self.beh_consumer]
            self.behaviours = BehaviourRouter(
                self.settings, self.reg, self.beh_consumer, self.beh_producer, self.incarnations,
                self._dead_letter, self._check_partition, lambda cons: _commit(cons, self.incarnations),
            )  # fmt: skip
            loops.append(self.behaviours.run)
        self.dlq_producer = self.req_producer if "requests" in self.inputs else self.beh_producer
        try:
            for c in clients:
                await c.start()
            tasks = [asyncio.create_task(loop()) for loop in loops]
            tasks.append(asyncio.create_task(self._watch_sources()))
            stop = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait([*tasks, stop], return_when=asyncio.FIRST_COMPLETED)
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            for t in done:
                if t is not stop and t.exception() is not None:
                    raise t.exception()
        finally:
            await stop_clients(*clients)
            with contextlib.suppress(Exception):
                await self.incarnations.close()

    # ------------------------------------------------------------------ checks

    async def _watch_sources(self, interval_s: float = WATCH_EVERY_S) -> None:
        """Every ``interval_s``, compare the public topics' ids with the ones read so far. A topic
        deleted and created again (same name, new id) may cause no rebalance at all, and the
        consumer's positions in the old one would skip the new one's first records: its assigned
        partitions are read again from the start, logged once and counted."""
        from relaygr.infra.cluster_identity import ClusterProbe
        from relaygr.streams.state_lineage import DISCARDED

        watched = [(c, c_topic) for c, c_topic in self._consumers()]
        probe = ClusterProbe(self.settings)
        known: dict[str, str] = {}
        checked = time.monotonic()
        try:
            while True:
                await asyncio.sleep(interval_s)
                since, checked = checked, time.monotonic()
                try:
                    facts = await probe.facts([t for _, t in watched])
                except Exception:  # the next round retries; routing goes on meanwhile
                    continue
                for cons, topic in watched:
                    t = facts.topics.get(topic)
                    if t is None or t.topic_id is None:
                        continue
                    # Compared with the id learnt at assignment: what the positions were read from.
                    before = self.incarnations.ids.get(topic) or known.get(topic) or t.topic_id
                    known[topic] = t.topic_id
                    if before == t.topic_id:
                        continue
                    if self.assigned_at.get(topic, 0.0) > since:
                        # Reassigned since the last check: positions came from the group's
                        # offsets of the new topic (none yet: its start), not the old ones.
                        self.incarnations.ids[topic] = t.topic_id
                        continue
                    tps = [tp for tp in cons.assignment() if tp.topic == topic]
                    if tps:
                        await cons.seek_to_beginning(*tps)
                    # Only now: a commit stamped with the new id must not carry an old position.
                    self.incarnations.ids[topic] = t.topic_id
                    if topic == self.reg.name("behaviors") and self.behaviours is not None:
                        self.behaviours.topic_recreated()
                    DISCARDED.labels(STAGE, "topic_recreated").inc(len(tps))
                    log.warning(
                        "ingress: %s was deleted and created again (id %s, was %s): reading its %d "
                        "assigned partition(s) from the start",
                        topic,
                        t.topic_id,
                        before,
                        len(tps),
                    )
        finally:
            await probe.close()

    def _consumers(self) -> list[tuple[Any, str]]:
        out = []
        if "requests" in self.inputs:
            out.append((self.req_consumer, self.reg.name("requests")))
        if "behaviors" in self.inputs:
            out.append((self.beh_consumer, self.reg.name("behaviors")))
        return out

    def _check_partition(self, topic: str, partition: int, key: bytes, count: int) -> None:
        """Count (and log once per topic) a record that the producer put on another partition
        than the cascade's own for its key: harmless here, but it says the producer's
        partitioner differs, which is why the cascade routes everything itself."""
        if partition_for(key, count) == partition:
            return
        MISROUTED.labels(topic).inc()
        if topic not in self._misrouted_seen:
            self._misrouted_seen.add(topic)
            log.warning(
                "%s: key %r arrived on partition %d, the cascade's partitioner says %d: the producer "
                "uses another partitioner (e.g. librdkafka's CRC32); the ingress re-keys every record, "
                "so this costs nothing, and relaygr_ingress_misrouted_total counts them",
                topic,
                key[:64].decode("utf-8", "replace"),
                partition,
                partition_for(key, count),
            )

    async def _dead_letter(self, m: Any, reason: str) -> None:
        DEAD_LETTERS.labels(STAGE, m.topic).inc()
        dl = dead_letter(STAGE, m.topic, m.partition, m.offset, m.key, m.value, reason)
        topic = self.reg.name("dead_letters")
        await deliver(
            lambda: self.dlq_producer.send_and_wait(topic, encode(dl), key=dl.key()), what="dead letter"
        )

    # ------------------------------------------------------------------ requests

    async def _requests(self) -> None:
        src, dst = self.reg.name("requests"), self.reg.name("routed_requests")
        beh = self.reg.name("behaviors")
        n_out = self.reg.partitions
        last_commit = time.monotonic()
        forwarding = False  # a fetch read but not yet all forwarded: its position is no commit
        uncommitted = False  # forwarded since the last commit
        try:
            while True:
                forwarding = False
                # The fetch returns at the first record: a turn without one only commits, so it
                # waits long once everything forwarded is committed (idle turns cost CPU).
                wait_ms = REQUEST_FETCH_MS if uncommitted else IDLE_FETCH_MS
                batch = await self.req_consumer.getmany(timeout_ms=wait_ms, max_records=500)
                forwarding = True
                await self._route_requests(batch, src, dst, beh, n_out)
                forwarding = False
                uncommitted = uncommitted or bool(batch)
                if uncommitted and time.monotonic() - last_commit > COMMIT_EVERY_S:
                    # Every record read so far is forwarded (acknowledged) or dead-lettered. Not
                    # after every fetch: a commit is a broker round trip, and at a few requests
                    # a fetch it cost as much as forwarding them.
                    await _commit(self.req_consumer, self.incarnations)
                    last_commit, uncommitted = time.monotonic(), False
        finally:
            if not forwarding:  # stopping: what was forwarded is not forwarded again
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(_commit(self.req_consumer, self.incarnations), 2.0)

    async def _route_requests(self, batch: dict, src: str, dst: str, beh: str, n_out: int) -> None:
        """Forward one fetch's requests (bad ones to the dead letters), all acknowledged."""
        records = [m for msgs in batch.values() for m in msgs]
        if not records:
            return
        needs = await self._behaviour_ends(beh)
        needs_raw = encode_positions(needs)
        count = len(self.req_consumer.partitions_for_topic(src) or ()) or n_out
        futs = []
        for m in records:
            try:
                r = decode_keyed(RecommendationRequest, m.key, m.value, self.limit)
            except SchemaError as e:
                futs.append(asyncio.ensure_future(self._dead_letter(m, str(e))))
                continue
            key = r.key()
            self._check_partition(src, m.partition, key, count)
            now = time.time()
            headers = [(HEADER_NEEDS, needs_raw), (HEADER_ROUTED_AT, repr(now).encode())]
            futs.append(
                asyncio.ensure_future(
                    self._send_request(dst, m.value, key, partition_for(key, n_out), headers)
                )
            )
            HOP.observe(max(0.0, now - r.ts))
        await asyncio.gather(*futs)
        ROUTED.labels(src).inc(len(records))

    async def _send_request(self, topic: str, value: bytes, key: bytes, partition: int, headers) -> None:
        await deliver(
            lambda: self.req_producer.send_and_wait(
                topic, value, key=key, partition=partition, headers=headers
            ),
            what="routed request",
        )

    async def _behaviour_ends(self, topic: str) -> Positions:
        """End offsets of every public behaviours partition, now: what a request just read must see."""
        count, when = self._beh_partitions
        if not count or time.monotonic() - when > PARTITIONS_REFRESH_S:
            count = (await describe_partitions(self.settings, [topic])).get(topic, 0)
            self._beh_partitions = (count, time.monotonic())
        tps = [TopicPartition(topic, q) for q in range(count)]
        if not tps:
            return {}
        ends = await self.offsets.end_offsets(tps)
        return {tp.partition: int(off) for tp, off in ends.items()}

    # ------------------------------------------------------------------ behaviours


class _Assignments(ConsumerRebalanceListener):
    """Notes when each input topic's partitions were assigned (see ``_watch_sources``), and reads
    a partition from its start when its committed offset was read from an earlier topic of the
    same name (a commit retried across the topic's deletion and creation)."""

    def __init__(self, ingress: Ingress, consumer_attr: str, group: str) -> None:
        self.ingress, self.consumer_attr, self.group = ingress, consumer_attr, group

    async def on_partitions_revoked(self, revoked) -> None:
        pass

    async def on_partitions_assigned(self, assigned) -> None:
        for topic in {tp.topic for tp in assigned}:
            self.ingress.assigned_at[topic] = time.monotonic()
        from relaygr.streams.state_lineage import rewind_old_topic_offsets

        cons = getattr(self.ingress, self.consumer_attr)
        await rewind_old_topic_offsets(
            STAGE, "ingress", self.group, cons, self.ingress.incarnations, assigned
        )


async def _commit(cons: Any, incarnations: Incarnations) -> None:
    """Commit what ``cons`` consumed, each offset naming the topic id it was read from. A commit
    refused during a rebalance, or not acknowledged in time (a topic being deleted), is retried by
    the next commit or the next owner's reading from the last committed offset (readers drop
    the re-forwarded copies)."""
    from relaygr.streams.common import commit_existing

    offsets = {}
    for tp in cons.assignment():
        with contextlib.suppress(Exception):
            offsets[tp] = await asyncio.wait_for(cons.position(tp), 1.0)
    from aiokafka.errors import KafkaError

    try:
        await commit_existing(cons, offsets, incarnations=incarnations)
    except KafkaError as e:
        log.warning("ingress commit failed (%s); the next owner re-reads from the last commit", e)


def main(
    settings: Settings,
    worker_id: str = "0",
    metrics_port: int = 0,
    inputs: tuple[str, ...] = INPUTS,
    stop_deadline: StopDeadline | None = None,
) -> int:
    from relaygr.streams.common import freeze_heap, serve_metrics

    if tuple(inputs) == ("behaviors",) and BEHAVIOUR_NICENESS:
        # Bulk ingestion yields the CPU to the request path on a shared host (a burst of
        # behaviours must not add scheduling delay to every stage's requests).
        os.nice(BEHAVIOUR_NICENESS)
    serve_metrics(metrics_port)
    ingress = Ingress(settings, worker_id, inputs)
    freeze_heap()

    async def go() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: _stop(ingress, stop_deadline))
        await ingress.run()

    asyncio.run(go())
    return 0


def _stop(ingress: Ingress, deadline: StopDeadline | None) -> None:
    if deadline is not None:
        deadline.arm()
    ingress.stop()
