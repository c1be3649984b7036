"""The ingress's behaviours router: public behaviours re-keyed onto ``routed-behaviors``, a
user's events of one fetch as one ``BehaviorBatch`` record, one produce batch per routed partition
per fetch, each ending with its progress record (see ``streams.ingress`` for the topology and
the alignment it serves).

Primitives:
- ``BehaviourRouter(settings, registry, consumer, producer, incarnations, dead_letter,
  check_partition, commit)``: ``await run()`` forwards until cancelled; ``topic_recreated()``
  (the public topic was deleted and created again: its positions start over);
  ``forward_rate``, public behaviours forwarded per second through a backlog (what its progress
  records advertise).
- ``batch_record(user_id, columns, source_topic_id)``: one user's routed events as records.
- ``ROUTED``: events re-keyed, by input topic (the request router counts there too).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import TopicPartition
from prometheus_client import Counter as PCounter
from prometheus_client import Gauge

from relaygr.infra.incarnations import Incarnations
from relaygr.infra.kafka import partition_for
from relaygr.infra.settings import Settings
from relaygr.schemas import BehaviorBatch, BehaviorEvent, SchemaError, TopicRegistry, encode
from relaygr.schemas.routing import HEADER_FORWARD_RATE, HEADER_PROGRESS, Positions, encode_positions
from relaygr.streams.common import ForwardRate, decode_keyed, deliver

ROUTED = PCounter("relaygr_ingress_routed_total", "Events re-keyed onto the routed topics", ["topic"])
PROGRESS = PCounter("relaygr_ingress_progress_records_total", "Progress records written")
FORWARD_RATE = Gauge(
    "relaygr_ingress_forward_rate",
    "Public behaviours forwarded per second through a backlog (what progress records advertise)",
)

# A progress record per routed partition at most this often while behaviours flow (and always
# when the backlog is drained): alignment waits at most this long for one.
PROGRESS_EVERY_S = 0.01
BEHAVIOUR_FETCH = 5000
# Records decoded between two yields to the event loop (the requests' task runs in between).
YIELD_EVERY = 200
# Events per routed record: a burst of one user's history costs downstream stages a few records.
ROUTED_BATCH = 2000
COMMIT_EVERY_S = 0.2
# A fetch of at least this many behaviours is a backlog: its pace measures the forward rate.
RATE_MIN_RECORDS = 500


class BehaviourRouter:
    def __init__(
        self,
        settings: Settings,
        registry: TopicRegistry,
        consumer: Any,
        producer: Any,
        incarnations: Incarnations,
        dead_letter: Callable[[Any, str], Awaitable[None]],
        check_partition: Callable[[str, int, bytes, int], None],
        commit: Callable[[Any], Awaitable[None]],
    ) -> None:
        self.reg, self.limit = registry, settings.max_message_bytes
        self.consumer, self.producer, self.incarnations = consumer, producer, incarnations
        self.dead_letter, self.check_partition, self.commit = dead_letter, check_partition, commit
        self.forward_rate = ForwardRate()  # public behaviours forwarded per second, in a backlog
        self._recreated = False

    def topic_recreated(self) -> None:
        """The public behaviours topic was deleted and created again: what was forwarded of the
        old one says nothing about the new one."""
        self._recreated = True

    async def run(self) -> None:
        """Forward until cancelled: fetch, group, send (acknowledged while the next fetch is
        processed), commit every ``COMMIT_EVERY_S``."""
        src, dst = self.reg.name("behaviors"), self.reg.name("routed_behaviors")
        n_out = self.reg.partitions
        forwarded: Positions = {}  # public partition -> offset below which all is forwarded
        marked: Positions = {}  # what the last progress records said
        last_progress = last_commit = 0.0
        in_flight: asyncio.Future | None = None
        while True:
            batch = await self.consumer.getmany(timeout_ms=50, max_records=BEHAVIOUR_FETCH)
            t_fetched = time.perf_counter()
            if self._recreated:  # positions in the old topic say nothing about the new one
                self._recreated = False
                forwarded.clear()
                marked.clear()
            users, dead, n = await self._group_by_user(batch, src, forwarded)
            # The public topic these offsets belong to, as learnt at assignment (or since noticed
            # recreated): a reader's positions of an earlier topic of that name do not count.
            sid = self.incarnations.ids.get(src)
            out = {p: [batch_record(uid, cols, sid) for uid, cols in per.items()] for p, per in users.items()}
            await self._note_start_positions(forwarded)
            now = time.monotonic()
            progress = None
            if forwarded != marked and (not batch or now - last_progress >= PROGRESS_EVERY_S):
                progress = encode_positions(forwarded)
            busy_s = time.perf_counter() - t_fetched
            if in_flight is not None:
                await in_flight  # the previous fetch's batches: acknowledged before these go out
                in_flight = None
            if out or progress is not None:
                read = sum(len(msgs) for msgs in batch.values())
                in_flight = await self._forward(dst, out, progress, n_out, read, busy_s)
                if progress is not None:
                    marked, last_progress = dict(forwarded), now
                    PROGRESS.inc(n_out)
            if dead:
                await asyncio.gather(*dead)
            if n:
                ROUTED.labels(src).inc(n)
            if now - last_commit > COMMIT_EVERY_S:
                if in_flight is not None:
                    await in_flight
                    in_flight = None
                await self.commit(self.consumer)  # all read so far is acknowledged
                last_commit = now

    async def _group_by_user(
        self, batch: dict[TopicPartition, list], src: str, forwarded: Positions
    ) -> tuple[dict[int, dict[str, tuple[list, list, list, list, list]]], list, int]:
        """A fetch's valid behaviours grouped per routed partition and user, as columns (item, ts,
        action, public partition, offset) in fetch order; the dead letters to send for the
        others; how many were grouped. Moves ``forwarded`` past every record read."""
        n_out = self.reg.partitions
        count = len(self.consumer.partitions_for_topic(src) or ()) or n_out
        users: dict[int, dict[str, tuple[list, list, list, list, list]]] = {}
        dead = []
        n = 0
        routed: dict[bytes, int] = {}  # key -> routed partition, once per key and fetch
        for tp, msgs in batch.items():
            for i, m in enumerate(msgs):
                if i % YIELD_EVERY == YIELD_EVERY - 1:
                    await asyncio.sleep(0)  # a requests task may share this loop: let it run
                try:
                    b = decode_keyed(BehaviorEvent, m.key, m.value, self.limit)
                except SchemaError as e:
                    dead.append(self.dead_letter(m, str(e)))
                    continue
                key = b.key()
                p = routed.get(key)
                if p is None:
                    p = routed[key] = partition_for(key, n_out)
                    self.check_partition(src, tp.partition, key, count)
                per_user = users.setdefault(p, {})
                cols = per_user.get(b.user_id)
                if cols is None:
                    cols = per_user[b.user_id] = ([], [], [], [], [])
                cols[0].append(b.item_id)
                cols[1].append(b.ts)
                cols[2].append(b.action)
                cols[3].append(tp.partition)
                cols[4].append(m.offset)
                n += 1
            if msgs:
                forwarded[tp.partition] = msgs[-1].offset + 1
        return users, dead, n

    async def _note_start_positions(self, forwarded: Positions) -> None:
        """An assigned partition nothing was read from yet: what lies before its start position
        counts as forwarded."""
        for tp in self.consumer.assignment():
            if tp.partition not in forwarded:
                with contextlib.suppress(Exception):
                    forwarded[tp.partition] = await self.consumer.position(tp)

    async def _forward(
        self,
        dst: str,
        out: dict[int, list[list]],
        progress: bytes | None,
        n_out: int,
        read: int,
        busy_s: float,
    ) -> Any:
        """Send one fetch's batches (and progress records); returns the future of their
        acknowledgement. A fetch of a backlog (``read`` records, ``busy_s`` spent on it before
        sending) measures the forward rate."""
        # Sent now, acknowledged while the next fetch is processed (order per partition holds:
        # one producer, idempotent).
        t_send = time.perf_counter()
        in_flight = await self._send_behaviours(
            dst,
            {p: [r for recs in v for r in recs] for p, v in out.items()},
            progress,
            n_out,
            self.forward_rate.value,
        )
        if read >= RATE_MIN_RECORDS:  # a fetch this large is a backlog: its pace is ours
            self.forward_rate.observe(read, busy_s + time.perf_counter() - t_send)
            FORWARD_RATE.set(self.forward_rate.value or 0.0)
        return in_flight

    async def _send_behaviours(
        self, topic: str, out: dict[int, list], progress: bytes | None, n_out: int, rate: float | None
    ) -> None:
        """One produce batch per routed partition (more if a batch fills up), the progress record
        last (with the forward ``rate``, when measured); returns a future done once the broker
        acknowledged all of them."""
        prod = self.producer
        futs = []
        parts = range(n_out) if progress is not None else sorted(out)
        marks = [(HEADER_PROGRESS, b"1")]
        if rate is not None:
            marks.append((HEADER_FORWARD_RATE, f"{rate:.0f}".encode()))
        for p in parts:
            recs = list(out.get(p, ()))
            if progress is not None:
                recs.append((b"", progress, marks))
            builder = prod.create_batch()
            for key, value, headers in recs:
                while builder.append(key=key, value=value, timestamp=None, headers=headers) is None:
                    futs.append(await self._send_batch(builder, topic, p))
                    builder = prod.create_batch()
            if builder.record_count():
                futs.append(await self._send_batch(builder, topic, p))
        return asyncio.gather(*futs)

    async def _send_batch(self, builder: Any, topic: str, partition: int) -> Any:
        return await deliver(
            lambda: self.producer.send_batch(builder, topic, partition=partition),
            what="routed behaviours",
        )


def batch_record(
    user_id: str, cols: tuple[list, list, list, list, list], source_topic_id: str | None
) -> list[tuple[bytes, bytes, list]]:
    """One user's routed events as ``BehaviorBatch`` records of at most ``ROUTED_BATCH`` events
    (key, value, headers). Every event was validated on the way in, so no validation again."""
    key = user_id.encode()
    out = []
    for i in range(0, len(cols[0]), ROUTED_BATCH):
        part = slice(i, i + ROUTED_BATCH)
        rec = BehaviorBatch.model_construct(
            user_id=user_id,
            item_ids=cols[0][part],
            timestamps=cols[1][part],
            actions=cols[2][part],
            source_partitions=cols[3][part],
            source_offsets=cols[4][part],
            source_topic_id=source_topic_id,
        )
        out.append((key, encode(rec), []))
    return out
