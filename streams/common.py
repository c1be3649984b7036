"""What every stage shares: raw topics, dead letters, delivery, commits, the metrics endpoint.
(A stage's faust app is ``streams.stage_app``'s.)

Primitives:
- ``raw_topic(app, name)``: bytes in, bytes out — decoding is ours, so that bad input reaches
  the dead-letter topic with its reason instead of crashing faust's deserializer.
- ``dead_letter(...)``: the ``DeadLetter`` record of a message a stage could not use.
- ``decode_keyed(event_type, key, value, max_bytes)``: decode and check that the message key
  agrees with the payload's key field.
- ``routing_headers(headers)``: the behaviours a routed request must see, and when it was routed.
- ``guarded(stage, ev, handler, to_dlq)``: per-message isolation of failures.
- ``StageOutputs(settings)``: a faust stage's librdkafka producer of its request-path outputs,
  each to its key's partition by the cascade's partitioner.
- ``PendingSends`` / ``handle_events(stage, stream, handler, to_dlq, outputs)``: a faust stage's
  requests, each one's outputs sent without a wait each and acknowledged together before faust
  acks the event (so before its offset commits): nothing lost, one round trip per event.
- ``apply_in_slices(records, take, flush, ...)``: the one slicing loop of every behaviour
  applier: records taken one by one, applied a slice at a time with the event loop free between.
- ``ingest_batches(stage, stream, decode_one, apply, to_dlq)``: behaviours applied a batch at a
  time (bad events to the dead-letter topic, one table write per user per batch; the ingress's progress
  records skipped).
- ``deliver(send)``: a produce that retries until the broker acknowledges it.
- ``commit_existing(consumer, offsets)``: a bounded commit that skips topics gone from the cluster
  and survives a rebalance that happened meanwhile.
- ``serve_metrics(port)``: the Prometheus endpoint of this process, bound to 127.0.0.1.
- ``freeze_heap()``: exempt what a stage set up at start from Python's full collections, and
  time every collection from then on (``relaygr_gc_pause_seconds``; one over 20 ms is logged).
- ``ForwardRate``: records per second, a geometric average of measured samples that goes
  stale after ``max_age_s`` (how fast a backlog of behaviours is forwarded).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import gc
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from prometheus_client import Counter as PCounter
from prometheus_client import Histogram

from relaygr.schemas import BehaviorBatch, DeadLetter, Event, SchemaError, decode, encode
from relaygr.schemas.routing import HEADER_PROGRESS, HEADER_ROUTED_AT, decode_positions

E = TypeVar("E", bound=Event)
log = logging.getLogger(__name__)
# A dead letter keeps at most this much of the original value, so it always fits a Kafka message.
DEAD_LETTER_VALUE_BYTES = 64 * 1024


def decode_keyed(event_type: type[E], key: bytes | None, value: bytes | None, max_bytes: int) -> E:
    ev = decode(event_type, value, max_bytes=max_bytes)
    if key is not None and key != ev.key():
        shown = key[:64].decode("utf-8", "replace")
        raise SchemaError(
            ev.key_field,
            f"message key {shown!r} disagrees with the payload's {ev.key_field}",
            event_type=event_type.__name__,
        )
    return ev


async def deliver(send: Any, *, what: str, attempts: int = 0, max_backoff_s: float = 2.0) -> Any:
    """Await ``send()`` (a coroutine factory producing a delivery) until the broker acknowledges
    it, retrying with backoff through broker restarts; ``attempts=0`` retries without limit.
    Nothing is given up silently: a stage that cannot deliver stops making progress (and its
    offsets stay uncommitted) rather than losing the message."""
    from aiokafka.errors import KafkaError

    from relaygr.infra.rdkafka_producer import DeliveryFailed

    backoff, n = 0.05, 0
    while True:
        try:
            return await send()
        except (TimeoutError, KafkaError, OSError, DeliveryFailed) as e:
            n += 1
            if attempts and n >= attempts:
                raise
            if n == 1 or n % 20 == 0:
                log.warning("delivering %s failed (%s: %s); retrying", what, type(e).__name__, e)
            await asyncio.sleep(backoff)
            backoff = min(max_backoff_s, backoff * 2)


async def commit_existing(
    consumer: Any, offsets: dict[Any, int], *, timeout_s: float = 2.0, incarnations: Any = None
) -> None:
    """Commit ``offsets`` of the topics the consumer's metadata still knows, giving up after
    ``timeout_s``. aiokafka retries a commit to a deleted topic without end, which would hold up
    the consuming loop and any rebalance until the topic came back. A commit refused because the
    group rebalanced meanwhile (this member was away longer than its session: stopped, or starved
    of CPU) is dropped: the consumer rejoins on its next fetch, and whoever owns the partitions
    then resumes from the last committed offsets (at least once). With ``incarnations`` (a
    ``relaygr.infra.incarnations.Incarnations``) each offset names the topic id it was read from."""
    from aiokafka.errors import CommitFailedError

    live = {tp: o for tp, o in offsets.items() if consumer.partitions_for_topic(tp.topic)}
    if not live:
        return
    try:
        await asyncio.wait_for(consumer.commit(incarnations.stamp(live) if incarnations else live), timeout_s)
    except CommitFailedError as e:
        log.warning("committing offsets failed after a rebalance (%s); rejoining", e)
    except TimeoutError:
        log.warning(
            "committing offsets of %s timed out; the next commit retries", sorted({t.topic for t in live})
        )


class ForwardRate:
    """Records per second: a geometric average of samples (``observe(records, seconds)``; one
    outlier moves it by a bounded factor), ``None`` once nothing was measured for ``max_age_s``."""

    def __init__(self, weight: float = 0.3, max_age_s: float = float("inf")) -> None:
        self.weight, self.max_age_s = weight, max_age_s
        self._log: float | None = None
        self._at = 0.0

    def observe(self, records: int, seconds: float) -> None:
        if records <= 0 or seconds <= 0:
            return
        x = math.log(records / seconds)
        self._log = x if self.value is None else (1 - self.weight) * self._log + self.weight * x
        self._at = time.monotonic()

    @property
    def value(self) -> float | None:
        if self._log is None or time.monotonic() - self._at > self.max_age_s:
            return None
        return math.exp(self._log)


# Behaviours are applied in batches: one table write (one changelog record) per user per batch
# instead of one per event, which is what limits a faust stage's ingestion rate.
INGEST_BATCH = 1000
INGEST_WITHIN_S = 0.02
# Behaviours applied between two turns of the event loop (routed records carry up to 2000 each).
APPLY_SLICE = 4096
R = TypeVar("R")


async def apply_in_slices(
    records: list[R],
    take: Callable[[R], Awaitable[int]],
    flush: Callable[[], Awaitable[None]],
    *,
    max_events: int = APPLY_SLICE,
    max_s: float = math.inf,
    between: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """The slicing loop of every behaviour applier. ``take(record)`` decodes a record into the
    caller's slice and says how many behaviours it adds; ``flush()`` applies the slice. A slice
    ends once it holds ``max_events`` behaviours, once ``max_s`` passed since it started (decoding
    holds the interpreter too), or at the last record; between two slices the event loop runs
    (a burst never keeps the stage's requests unread for long), then ``between()`` if given."""
    events = 0
    started = time.perf_counter()
    last = len(records) - 1
    for i, record in enumerate(records):
        events += await take(record)
        if i == last or events >= max_events or time.perf_counter() - started >= max_s:
            await flush()
            events = 0
            if i < last:
                await asyncio.sleep(0)
                if between is not None:
                    await between()
                started = time.perf_counter()


# faust's PartitionsMismatch for a changelog whose partitions the metadata does not list yet.
_CHANGELOG_NOT_LISTED = "' has 0 partitions."
CHANGELOG_WAIT_S = 0.5


async def ingest_batches(stage: str, stream: Any, decode_one: Any, apply: Any, to_dlq: Any) -> None:
    """Consume ``stream`` in batches: ``decode_one(ev)`` per event (bad ones go to the dead-letter
    topic with their reason), then ``apply(pairs, as_event)`` with the good ``(event, decoded)``
    pairs, in order, a slice of at most about ``APPLY_SLICE`` behaviours at a time with the event
    loop free in between (a burst of long histories never holds the stage's requests up for
    long). ``apply`` is a plain function (it must not await). A table write must follow
    ``as_event(ev)`` for an event of the written key: faust takes the changelog partition from
    the current event."""
    async for events in stream.take_events(INGEST_BATCH, within=INGEST_WITHIN_S):
        await _ingest_batch(stage, stream, list(events), decode_one, apply, to_dlq)


async def _ingest_batch(
    stage: str, stream: Any, events: list, decode_one: Any, apply: Any, to_dlq: Any
) -> None:
    good: list = []
    size = 0

    async def take(ev: Any) -> int:
        nonlocal size
        if HEADER_PROGRESS in ev.headers:  # the ingress's progress record: no event
            return 0
        try:
            d = decode_one(ev)
        except SchemaError as e:
            await to_dlq(ev, str(e))
            return 0
        good.append((ev, d))
        n = len(d) if isinstance(d, BehaviorBatch) else 1
        size += n
        return n

    async def flush() -> None:
        nonlocal good, size
        if good:
            await _apply_slice(stage, stream, apply, good, size, to_dlq)
        good, size = [], 0

    await apply_in_slices(events, take, flush)


async def _apply_slice(stage: str, stream: Any, apply: Any, good: list, size: int, to_dlq: Any) -> None:
    from faust.exceptions import PartitionsMismatch

    attempts = 0
    while True:
        # The stream's drainer may have set the next event as current and be waiting to buffer
        # it: put that event back before anything awaits (faust's take buffer reads it then).
        current = stream.current_event
        try:
            apply(good, stream._set_current_event)
            failed = None
        except Exception as e:  # as in ``guarded``: reported with the events, the stage goes on
            failed = e
        finally:
            stream._set_current_event(current)
        if not (isinstance(failed, PartitionsMismatch) and _CHANGELOG_NOT_LISTED in str(failed)):
            break
        # The table's changelog was just created and the consumer's metadata lists it without
        # partitions yet: not a mismatch, and dead-lettering would leave the table without these
        # behaviours for good. Its next metadata refresh lists them; ``apply`` writes nothing
        # before the check.
        if attempts % 20 == 0:
            log.warning("%s: the table's changelog has no partitions in the metadata yet; waiting", stage)
        attempts += 1
        await asyncio.sleep(CHANGELOG_WAIT_S)
    if failed is None:
        BEHAVIOURS_APPLIED.labels(stage).inc(size)
    else:
        log.error("%s: applying %d behaviours failed", stage, len(good), exc_info=failed)
        for ev, _ in good:
            await to_dlq(ev, f"internal error in {stage}: {type(failed).__name__}: {failed}")


async def guarded(stage: str, ev: Any, handler: Any, to_dlq: Any) -> None:
    """Run ``handler(ev)``; bad input and unexpected failures go to the dead-letter topic with
    their reason instead of crashing the stage (and so stopping every good message behind it)."""
    try:
        await handler(ev)
    except SchemaError as e:
        await to_dlq(ev, str(e))
    except Exception as e:
        log.exception("%s: handling %s@%s failed", stage, ev.message.topic, ev.message.offset)
        await to_dlq(ev, f"internal error in {stage}: {type(e).__name__}: {e}")


class StageOutputs:
    """A faust stage's producer of its outputs on the request path: librdkafka
    (``infra.rdkafka_producer.RdProducer``), each record to the partition the cascade's own
    partitioner gives its key (as faust's producer put them), started on first use in the stage's
    event loop. Its round trips cost the stage about half of what faust's aiokafka producer's did
    (``relaygr bench kafka-clients``)."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self._producer: Any = None
        self._starting = asyncio.Lock()

    async def producer(self) -> Any:
        if self._producer is None:
            async with self._starting:
                if self._producer is None:
                    from relaygr.infra.rdkafka_producer import RdProducer

                    prod = RdProducer(self.settings, linger_ms=self.settings.request_linger_ms)
                    await prod.start()
                    self._producer = prod
        return self._producer

    async def send(self, topic: str, key: bytes, value: bytes) -> asyncio.Future:
        from relaygr.infra.kafka import partition_for

        prod = await self.producer()
        return prod.send(topic, value, key=key, partition=partition_for(key, self.settings.partitions))


class PendingSends:
    """A stage's outputs of one event, enqueued at once (``await send(...)`` returns as soon as
    the producer holds the record) and acknowledged together (``await acknowledged()``). A send
    the broker refused, or one that could not even be enqueued, is delivered again with
    ``deliver``'s retries: a batch is acknowledged only once every one of its records is."""

    def __init__(self, outputs: StageOutputs) -> None:
        self.outputs = outputs
        self._sent: list[tuple[str, bytes, bytes, str, Any]] = []

    def __len__(self) -> int:
        return len(self._sent)

    async def send(self, topic: str, key: bytes, value: bytes, *, what: str) -> None:
        from aiokafka.errors import KafkaError

        try:
            fut = await self.outputs.send(topic, key, value)
        except (TimeoutError, KafkaError, OSError):
            fut = None  # delivered with retries in ``acknowledged``
        self._sent.append((topic, key, value, what, fut))

    async def acknowledged(self) -> None:
        from relaygr.infra.rdkafka_producer import DeliveryFailed

        sent, self._sent = self._sent, []
        for topic, key, value, what, fut in sent:
            if fut is not None:
                try:
                    await fut
                    continue
                except DeliveryFailed as e:
                    log.warning("sending %s failed (%s); sending it again", what, e)
            await deliver(lambda t=topic, k=key, v=value: _send_acked(self.outputs, t, k, v), what=what)


async def _send_acked(outputs: StageOutputs, topic: str, key: bytes, value: bytes) -> None:
    await (await outputs.send(topic, key, value))


async def handle_events(
    stage: str,
    stream: Any,
    handler: Callable[[Any, PendingSends], Awaitable[None]],
    to_dlq: Any,
    outputs: StageOutputs,
) -> None:
    """Consume ``stream`` event by event: ``handler(ev, sends)`` (``guarded``: bad input to the
    dead letters) sends its outputs through ``sends`` without a wait each, and they are
    acknowledged together before faust acks the event (so before its offset commits). The
    outputs of one event (retrieval's prefill signal and retrieved request) share a produce
    request, and the producer's linger lets concurrent events' outputs share one too."""
    async for ev in stream.events():
        sends = PendingSends(outputs)
        await guarded(stage, ev, functools.partial(_with_sends, handler, sends), to_dlq)
        await sends.acknowledged()


async def _with_sends(handler: Any, sends: PendingSends, ev: Any) -> None:
    await handler(ev, sends)


def routing_headers(headers: Any) -> tuple[dict[str, int] | None, float | None]:
    """What the ingress put on a routed request: the behaviours it must see (as the events'
    ``behaviors_needed``) and when it forwarded it. Absent or unreadable headers give None."""
    from relaygr.schemas.routing import HEADER_NEEDS

    h = dict(headers or ())
    needs = routed = None
    try:
        if HEADER_NEEDS in h:
            needs = {str(q): end for q, end in decode_positions(h[HEADER_NEEDS]).items()}
        if HEADER_ROUTED_AT in h:
            routed = float(h[HEADER_ROUTED_AT])
    except ValueError:
        log.warning("unreadable routing headers ignored: %r", h)
    return needs, routed


def dead_letter(
    stage: str,
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    reason: str,
) -> DeadLetter:
    raw = value or b""
    if len(raw) > DEAD_LETTER_VALUE_BYTES:  # bounded records: the head of a huge message is enough
        reason = f"{reason} (value truncated to its first {DEAD_LETTER_VALUE_BYTES} of {len(raw)} bytes)"
        raw = raw[:DEAD_LETTER_VALUE_BYTES]
    return DeadLetter(
        source_topic=topic,
        partition=partition,
        offset=offset,
        key_b64=base64.b64encode(key[:3000]).decode() if key is not None else None,
        value_b64=base64.b64encode(raw).decode(),
        reason=reason[:2000],
        stage=stage,
        ts=time.time(),
    )


async def send_acked(topic: Any, key: bytes, value: bytes) -> Any:
    """Send on a faust topic and wait for the broker's acknowledgement."""
    return await (await topic.send(key=key, value=value))


BEHAVIOURS_APPLIED = PCounter(
    "relaygr_behaviours_applied_total", "Behaviours applied to this stage's history state", ["stage"]
)
DEAD_LETTERS = PCounter(
    "relaygr_dead_letters_total", "Messages sent to the dead-letter topic", ["stage", "topic"]
)


def faust_dead_letterer(stage: str, dlq_topic: Any):
    """``to_dlq(event, reason)`` for a faust stage: counted, delivered with retries."""

    async def to_dlq(ev: Any, reason: str) -> None:
        m = ev.message
        DEAD_LETTERS.labels(stage, m.topic).inc()
        dl = dead_letter(stage, m.topic, m.partition, m.offset, ev.key, ev.value, reason)
        await deliver(lambda: send_acked(dlq_topic, dl.key(), encode(dl)), what="dead letter")

    return to_dlq


def raw_topic(app, name: str):
    return app.topic(name, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")


def serve_metrics(port: int) -> None:
    """Expose this process's Prometheus metrics on 127.0.0.1:``port`` (0 = don't)."""
    if port:
        from prometheus_client import start_http_server

        start_http_server(port, addr="127.0.0.1")


def freeze_heap() -> None:
    """Collect once, then move every surviving object to the collector's permanent generation.

    torch, faust, aiokafka and pydantic leave about a million tracked objects at import. Each
    full collection scans them all: a 100–200 ms pause of the whole stage, every few seconds
    under load, which is the stage's tail latency. Frozen, they are never scanned again, and a
    full collection only visits what was created since. Call it once set-up is done."""
    gc.collect()
    gc.freeze()
    if _time_collections not in gc.callbacks:
        gc.callbacks.append(_time_collections)


GC_PAUSE = Histogram(
    "relaygr_gc_pause_seconds",
    "Python garbage collections of this process, by generation: every thread waits for them",
    ["generation"],
    buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5),
)
GC_PAUSE_LOGGED_S = 0.02
_gc_started: list[float] = []


def _time_collections(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_started[:] = [time.perf_counter()]
        return
    if not _gc_started:
        return
    took = time.perf_counter() - _gc_started.pop()
    GC_PAUSE.labels(str(info.get("generation", -1))).observe(took)
    if took > GC_PAUSE_LOGGED_S:
        log.warning(
            "garbage collection of generation %s took %.1f ms (%s objects collected)",
            info.get("generation"),
            took * 1e3,
            info.get("collected"),
        )
