"""A typed asyncio client of RelayGR's public topics: publish behaviours, ask for rankings, read results.

Primitives:
- ``RelayClient(settings=None, *, request_timeout_s=30.0)``: an async context manager that holds
  one idempotent producer (acks=all) and one results consumer shared by every request.
  - ``publish_behaviors(events) -> int``: behaviours, keyed by ``user_id``.
  - ``request(user_id, *, top_k, num_candidates, request_id, timeout_s) -> RankedResult``: publish
    a request (keyed by ``user_id``) and wait for its result.
  - ``send_request(request, *, timeout_s) -> RankedResult``: the same for a request built by hand.
  - ``results(start="latest", *, follow=True) -> AsyncIterator[RankedResult]``: the results stream.
  - ``lookup(request_id) -> RankedResult | None``: the results topic read as a table.
- ``iter_results(settings, ...)`` and ``lookup_result(settings, request_id, ...)``: the same reads
  without a producer (the ``relaygr results`` command uses them).
- ``open_results``, ``seek_results``, ``read_results``: the consumer under those reads, for a
  reader that positions itself (``relaygr results tail``).
- ``ResultRecord``: a result with its partition, offset and timestamp; ``StartAt``: where a read
  of the results topic starts.
- ``RequestTimeout``: no result in time; it names the request. ``ClientError``: the client
  cannot work (missing topic, closed client, results reader failed).

``__all__`` names exactly these: the Kafka and typing names this module imports are not its API.

Delivery is at least once: a ranking worker that restarts may publish a second result for a
request. ``request`` returns the first one and ignores the rest; ``results`` yields each request
id once (by default); ``lookup`` returns the table's value, the last result for the id.

Keys only: the cascade re-partitions its public input topics itself, so which partition a
message lands on does not matter here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from relaygr.infra.kafka import consumer, describe_partitions, producer
from relaygr.infra.settings import Settings, get_settings
from relaygr.schemas import (
    BehaviorEvent,
    RankedResult,
    RecommendationRequest,
    SchemaError,
    TopicRegistry,
    decode,
    encode,
)

__all__ = [
    "ClientError",
    "RelayClient",
    "RequestTimeout",
    "ResultRecord",
    "StartAt",
    "iter_results",
    "lookup_result",
    "open_results",
    "read_results",
    "seek_results",
]

log = logging.getLogger(__name__)

#: Where a read of the results topic starts: the oldest result kept, the next one to come, or the
#: first result produced at or after a time (epoch seconds or an aware ``datetime``).
StartAt = Literal["earliest", "latest"] | float | datetime

# Request ids remembered to recognise duplicate results; older ones are forgotten (bounded memory).
REMEMBERED_IDS = 100_000


class ClientError(RuntimeError):
    """The client cannot do what was asked (a topic is missing, it is closed, its reader failed)."""


class RequestTimeout(TimeoutError):
    """No result for a request within its timeout."""

    def __init__(self, request: RecommendationRequest, timeout_s: float, topic: str) -> None:
        self.request_id = request.request_id
        self.user_id = request.user_id
        self.timeout_s = timeout_s
        super().__init__(
            f"no result for request {request.request_id!r} (user {request.user_id!r}) on {topic} "
            f"within {timeout_s:g} s: is the pipeline running (`relaygr up`)?"
        )


@dataclass(frozen=True)
class ResultRecord:
    """A result with where it was read from."""

    partition: int
    offset: int
    timestamp_ms: int
    result: RankedResult


class _RecentIds:
    """A bounded set of request ids: the newest ``capacity`` ones."""

    def __init__(self, capacity: int = REMEMBERED_IDS) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def add(self, request_id: str) -> None:
        self._ids[request_id] = None
        self._ids.move_to_end(request_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)


def _registry(settings: Settings) -> TopicRegistry:
    return TopicRegistry(settings.topic_prefix, settings.partitions)


async def open_results(settings: Settings, topic: str) -> tuple[AIOKafkaConsumer, list[TopicPartition]]:
    """A started consumer (no group: nothing is committed) assigned every partition of ``topic``."""
    counts = await describe_partitions(settings, [topic])
    if topic not in counts:
        raise ClientError(
            f"topic {topic} does not exist: create it with `relaygr topics create` (or `relaygr up`)"
        )
    tps = [TopicPartition(topic, p) for p in range(counts[topic])]
    cons = consumer(settings, group_id=None)
    await cons.start()
    cons.assign(tps)
    return cons, tps


async def seek_results(cons: AIOKafkaConsumer, tps: list[TopicPartition], start: StartAt) -> None:
    """Position every partition at ``start``, and resolve the positions now: a result produced
    after this returns is read, whatever the consumer's reset policy."""
    if start == "earliest":
        await cons.seek_to_beginning(*tps)
    elif start == "latest":
        await cons.seek_to_end(*tps)
    else:
        seconds = start.timestamp() if isinstance(start, datetime) else float(start)
        found = await cons.offsets_for_times({tp: int(seconds * 1000) for tp in tps})
        ends = await cons.end_offsets(tps)
        for tp in tps:
            at = found.get(tp)
            cons.seek(tp, at.offset if at is not None else ends[tp])
    for tp in tps:
        await cons.position(tp)


async def read_results(
    cons: AIOKafkaConsumer, tps: list[TopicPartition], *, until: dict[TopicPartition, int] | None
) -> AsyncIterator[ResultRecord]:
    """Decoded results from the consumer's positions on; up to the offsets ``until`` if given
    (exclusive), else forever. A message that is not a result is logged and skipped."""
    todo = set(tps)
    while True:
        if until is not None:
            todo = {tp for tp in todo if await cons.position(tp) < until[tp]}
            if not todo:
                return
        batch = await cons.getmany(*todo, timeout_ms=500)
        for tp, msgs in batch.items():
            for m in msgs:
                if until is not None and m.offset >= until[tp]:
                    break
                try:
                    result = decode(RankedResult, m.value)
                except SchemaError as e:
                    log.warning("skipping %s[%d]@%d: %s", tp.topic, tp.partition, m.offset, e)
                    continue
                yield ResultRecord(tp.partition, m.offset, m.timestamp, result)


async def iter_results(
    settings: Settings | None = None,
    start: StartAt = "latest",
    *,
    follow: bool = True,
    unique: bool = True,
    registry: TopicRegistry | None = None,
) -> AsyncIterator[ResultRecord]:
    """Results read from ``start``; with ``follow=False`` only those already there when reading
    starts. ``unique`` skips a result whose request id was already yielded (at-least-once
    duplicates). Partitions are read concurrently, so order holds within a partition only."""
    settings = settings or get_settings()
    topic = (registry or _registry(settings)).name("results")
    cons, tps = await open_results(settings, topic)
    try:
        await seek_results(cons, tps, start)
        until = None if follow else await cons.end_offsets(tps)
        seen = _RecentIds()
        async for record in read_results(cons, tps, until=until):
            if unique:
                if record.result.request_id in seen:
                    continue
                seen.add(record.result.request_id)
            yield record
    finally:
        await cons.stop()


async def lookup_result(
    settings: Settings | None,
    request_id: str,
    *,
    wait_s: float = 0.0,
    registry: TopicRegistry | None = None,
) -> RankedResult | None:
    """The results topic read as a table: the last result kept for ``request_id``, or None.
    With ``wait_s`` > 0 and no result yet, watch for it that long."""
    settings = settings or get_settings()
    topic = (registry or _registry(settings)).name("results")
    cons, tps = await open_results(settings, topic)
    try:
        await seek_results(cons, tps, "earliest")
        found: RankedResult | None = None
        async for record in read_results(cons, tps, until=await cons.end_offsets(tps)):
            if record.result.request_id == request_id:
                found = record.result
        if found is not None or wait_s <= 0:
            return found
        try:
            async with asyncio.timeout(wait_s):
                async for record in read_results(cons, tps, until=None):
                    if record.result.request_id == request_id:
                        return record.result
        except TimeoutError:
            pass
        return None
    finally:
        await cons.stop()


class RelayClient:
    """Producer of behaviours and requests, reader of their results (an async context manager).

    ``settings`` default to this process's ``RELAYGR_*`` environment (broker, topic prefix,
    security). ``request_timeout_s`` is how long ``request`` waits for a result by default.
    """

    def __init__(self, settings: Settings | None = None, *, request_timeout_s: float = 30.0) -> None:
        self.settings = settings or get_settings()
        self.registry = _registry(self.settings)
        self.request_timeout_s = request_timeout_s
        #: Further results for requests this client already had an answer to (ignored).
        self.duplicate_results = 0
        self._answered = _RecentIds()
        self._producer: AIOKafkaProducer | None = None
        self._results: AIOKafkaConsumer | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[str, asyncio.Future[RankedResult]] = {}

    async def __aenter__(self) -> RelayClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self._producer is not None:
            raise ClientError("client already started")
        topic = self.registry.name("results")
        # The results reader is positioned before any request goes out, so no answer is missed.
        self._results, tps = await open_results(self.settings, topic)
        try:
            await seek_results(self._results, tps, "latest")
            self._producer = producer(self.settings)
            await self._producer.start()
        except BaseException:
            await self._results.stop()
            self._results = None
            raise
        self._reader = asyncio.create_task(self._read_results(tps), name="relaygr-client-results")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ClientError("client closed before the result came"))
        self._pending.clear()
        if self._results is not None:
            await self._results.stop()
            self._results = None
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    async def _read_results(self, tps: list[TopicPartition]) -> None:
        assert self._results is not None
        try:
            async for record in read_results(self._results, tps, until=None):
                request_id = record.result.request_id
                if request_id in self._answered:
                    self.duplicate_results += 1
                    continue
                fut = self._pending.get(request_id)
                if fut is None or fut.done():
                    continue  # another producer's request, or one that timed out here
                self._answered.add(request_id)
                fut.set_result(record.result)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # Nothing would answer the waiting requests any more: fail them now, not at their timeout.
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(ClientError(f"results reader failed: {e!r}"))
            raise

    def _live_producer(self) -> AIOKafkaProducer:
        if self._producer is None:
            raise ClientError("client not started: use `async with RelayClient() as client:`")
        if self._reader is not None and self._reader.done():
            raise ClientError(f"results reader stopped: {self._reader.exception()!r}")
        return self._producer

    async def publish_behaviors(self, events: BehaviorEvent | Iterable[BehaviorEvent]) -> int:
        """Publish behaviours (keyed by user id) and wait until the broker has them all; returns
        how many. A user's behaviours keep their order."""
        prod = self._live_producer()
        topic = self.registry.name("behaviors")
        sent = []
        for event in [events] if isinstance(events, BehaviorEvent) else events:
            if not isinstance(event, BehaviorEvent):
                raise TypeError(f"publish_behaviors takes BehaviorEvent objects, got {type(event).__name__}")
            sent.append(await prod.send(topic, encode(event), key=event.key()))
        await asyncio.gather(*sent)
        return len(sent)

    async def request(
        self,
        user_id: str,
        *,
        top_k: int = 10,
        num_candidates: int = 128,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> RankedResult:
        """Ask for ``top_k`` items out of ``num_candidates`` for ``user_id``, timestamped now,
        and wait for the result (``RequestTimeout`` after ``timeout_s``)."""
        req = RecommendationRequest(
            request_id=request_id or f"req-{uuid.uuid4().hex}",
            user_id=user_id,
            ts=time.time(),
            num_candidates=num_candidates,
            top_k=top_k,
        )
        return await self.send_request(req, timeout_s=timeout_s)

    async def send_request(
        self, request: RecommendationRequest, *, timeout_s: float | None = None
    ) -> RankedResult:
        """Publish ``request`` (keyed by user id) and wait for the first result with its id."""
        prod = self._live_producer()
        if request.request_id in self._pending:
            raise ClientError(f"request {request.request_id!r} is already waiting for its result")
        if request.request_id in self._answered:
            # Its result would be taken for a duplicate of the first one's.
            raise ClientError(f"request id {request.request_id!r} was already answered: ids must be unique")
        timeout_s = self.request_timeout_s if timeout_s is None else timeout_s
        # Registered before producing: the result may come back before send_and_wait returns.
        fut: asyncio.Future[RankedResult] = asyncio.get_running_loop().create_future()
        self._pending[request.request_id] = fut
        try:
            async with asyncio.timeout(timeout_s):
                await prod.send_and_wait(self.registry.name("requests"), encode(request), key=request.key())
                return await fut
        except TimeoutError:
            raise RequestTimeout(request, timeout_s, self.registry.name("results")) from None
        finally:
            self._pending.pop(request.request_id, None)

    async def results(self, start: StartAt = "latest", *, follow: bool = True) -> AsyncIterator[RankedResult]:
        """Results from ``start`` on, each request id once, read by a consumer of their own
        (closed with the iterator: wrap it in ``contextlib.aclosing`` to leave it early)."""
        records = iter_results(self.settings, start, follow=follow, unique=True, registry=self.registry)
        async with contextlib.aclosing(records):
            async for record in records:
                yield record.result

    async def lookup(self, request_id: str, *, wait_s: float = 0.0) -> RankedResult | None:
        """The last result kept for ``request_id`` on the results topic, or None."""
        return await lookup_result(self.settings, request_id, wait_s=wait_s, registry=self.registry)
