"""The one paced sender: requests onto a topic at their send offsets, from our client or another.

Every load the tools, experiments and benchmarks put on a pipeline goes out through
``PacedSender``: a request is sent when its offset (seconds from the start) is due, stamped with
the wall clock as it goes (``ts``: the origin of its latency), and the call returns the requests
as sent once the broker acknowledged every one. Clients:

- ``aiokafka``: the project's own producer, without lingering (a batch that waited would count
  as latency);
- ``librdkafka``: confluent-kafka with its default settings, a producer that is not ours (it
  hashes keys with CRC32; the cascade re-keys what arrives).

Primitives:
- ``rate_offsets(qps)``: offsets at a fixed rate, forever (``None``: every request at once).
- ``jittered_offsets(every_s, rng)``: one send at a random moment of each period, forever (not in
  step with a fixed beat that other requests keep).
- ``cycled(requests)``: ``requests`` round-robin, forever, each with a fresh id.
- ``PacedSender(settings, topic, client=...)``: an async context manager;
  ``send(requests, offsets, stop=, before=, progress=)`` sends until either runs out or ``stop``
  (anything with ``is_set()``) is set; ``before(request)`` runs just before each send.
- ``BackgroundLoad(settings, topic, requests, qps)``: ``cycled(requests)`` at ``qps`` (or at any
  ``offsets``) from a thread of its own with its own event loop, so that nothing the caller's loop
  does delays a send: ``start()``, then ``stop() -> sent``.
- ``send_paced(settings, topic, requests, qps, client)``: one plan of requests at a rate (``None``:
  all at once), blocking; returns them as sent.
- ``send_to_worker(settings, registry, requests, qps)``: the visits of ``requests`` as a ranking
  worker receives them (a prefill signal and a rank request each), the stages before it skipped.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, Literal, Protocol

from relaygr.infra.settings import Settings
from relaygr.schemas import RecommendationRequest, TopicRegistry, encode

Client = Literal["aiokafka", "librdkafka"]
POLL_S = 0.05  # how often a sender waiting for its next offset looks at ``stop``


class Stop(Protocol):
    def is_set(self) -> bool: ...


def rate_offsets(qps: float | None) -> Iterator[float]:
    """``i / qps`` for i = 0, 1, ...; ``qps=None``: 0 forever (all at once)."""
    if qps is not None and not qps > 0:
        raise ValueError(f"a rate must be positive, got {qps}")
    return (0.0 if qps is None else i / qps for i in itertools.count())


def jittered_offsets(every_s: float, rng: random.Random) -> Iterator[float]:
    """One offset at a random moment of each period of ``every_s`` seconds."""
    return (k * every_s + rng.uniform(0.0, every_s) for k in itertools.count())


def cycled(requests: list[RecommendationRequest]) -> Iterator[RecommendationRequest]:
    """``requests`` round-robin, forever, each as ``<its id>-<8 hex digits>``."""
    for base in itertools.cycle(requests):
        yield base.model_copy(update={"request_id": f"{base.request_id}-{uuid.uuid4().hex[:8]}"})


class _Aiokafka:
    def __init__(self, settings: Settings, linger_ms: int) -> None:
        from relaygr.infra.kafka import producer

        self.prod = producer(settings, linger_ms=linger_ms)

    async def start(self) -> None:
        await self.prod.start()

    async def produce(self, topic: str, r: RecommendationRequest) -> Awaitable[Any]:
        return await self.prod.send(topic, encode(r), key=r.key())

    def serve(self) -> None:
        pass  # aiokafka acknowledges on the event loop

    async def acknowledged(self, acks: list) -> None:
        await asyncio.gather(*acks)

    async def stop(self) -> None:
        await self.prod.stop()


class _Librdkafka:
    def __init__(self, settings: Settings) -> None:
        import confluent_kafka

        self.prod = confluent_kafka.Producer({"bootstrap.servers": settings.bootstrap})
        self.failed: list[str] = []

    async def start(self) -> None:
        pass

    def _delivered(self, err: object, _msg: object) -> None:
        if err is not None:
            self.failed.append(str(err))

    async def produce(self, topic: str, r: RecommendationRequest) -> None:
        self.prod.produce(topic, value=encode(r), key=r.key(), on_delivery=self._delivered)
        self.prod.poll(0)

    def serve(self) -> None:
        self.prod.poll(0)  # delivery reports while waiting

    async def acknowledged(self, acks: list) -> None:
        if await asyncio.to_thread(self.prod.flush, 60) != 0:
            raise RuntimeError("confluent-kafka did not deliver every request within 60 s")
        if self.failed:
            raise RuntimeError(f"{len(self.failed)} requests were not delivered: {self.failed[:3]}")

    async def stop(self) -> None:
        await asyncio.to_thread(self.prod.flush, 60)


class PacedSender:
    """Requests onto ``topic`` at their offsets, from ``client`` (see the module docstring);
    ``linger_ms`` is aiokafka's (librdkafka keeps its defaults)."""

    def __init__(
        self, settings: Settings, topic: str, *, client: Client = "aiokafka", linger_ms: int = 0
    ) -> None:
        if client not in ("aiokafka", "librdkafka"):
            raise ValueError(f"no client {client!r} (aiokafka or librdkafka)")
        self.topic = topic
        self.client = _Aiokafka(settings, linger_ms) if client == "aiokafka" else _Librdkafka(settings)

    async def __aenter__(self) -> PacedSender:
        await self.client.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.stop()

    async def _until(self, due: float, stop: Stop | None) -> bool:
        """Wait until ``due`` (monotonic); False once ``stop`` is set first."""
        while True:
            if stop is not None and stop.is_set():
                return False
            wait = due - time.monotonic()
            if wait <= 0:
                return True
            await asyncio.sleep(min(wait, POLL_S) if stop is not None else wait)
            self.client.serve()

    async def send(
        self,
        requests: Iterable[RecommendationRequest],
        offsets: Iterable[float],
        *,
        stop: Stop | None = None,
        before: Callable[[RecommendationRequest], Awaitable[object]] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[RecommendationRequest]:
        """Each request at its offset from now, stamped ``ts`` as it goes, until ``requests`` or
        ``offsets`` run out or ``stop`` is set; returns them as sent, every one acknowledged."""
        t0 = time.monotonic()
        sent: list[RecommendationRequest] = []
        acks: list = []
        for r, offset in zip(requests, offsets, strict=False):  # either may be endless
            if not await self._until(t0 + offset, stop):
                break
            if before is not None:
                await before(r)
            r = r.model_copy(update={"ts": time.time()})
            acks.append(await self.client.produce(self.topic, r))
            sent.append(r)
            if progress is not None:
                progress(len(sent))
        await self.client.acknowledged(acks)
        return sent


def send_paced(
    settings: Settings,
    topic: str,
    requests: list[RecommendationRequest],
    qps: float | None,
    client: Client = "aiokafka",
) -> list[RecommendationRequest]:
    """``requests`` at ``qps`` (``None``: all at once), blocking (its own event loop: call it from
    a thread, ``asyncio.to_thread``, where one runs); returns them as sent."""

    async def go() -> list[RecommendationRequest]:
        async with PacedSender(settings, topic, client=client) as s:
            return await s.send(requests, rate_offsets(qps))

    return asyncio.run(go())


class BackgroundLoad:
    """``cycled(requests)`` at ``qps`` (or at ``offsets``) from a thread of its own until
    ``stop()``, which returns what was sent once every one is acknowledged."""

    def __init__(
        self,
        settings: Settings,
        topic: str,
        requests: list[RecommendationRequest],
        qps: float | None = None,
        *,
        offsets: Iterable[float] | None = None,
        client: Client = "aiokafka",
    ) -> None:
        if (qps is None) == (offsets is None):
            raise ValueError("give a rate or the offsets, not both")
        self.settings, self.topic, self.client = settings, topic, client
        self.requests = cycled(requests)
        self.offsets = offsets if offsets is not None else rate_offsets(qps)
        self.sent: list[RecommendationRequest] = []
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="requests", daemon=True)

    def start(self) -> BackgroundLoad:
        self._thread.start()
        return self

    def stop(self) -> list[RecommendationRequest]:
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.sent

    def _run(self) -> None:
        async def go() -> list[RecommendationRequest]:
            async with PacedSender(self.settings, self.topic, client=self.client) as s:
                return await s.send(self.requests, self.offsets, stop=self._stop)

        try:
            self.sent = asyncio.run(go())
        except BaseException as e:  # raised in the caller's thread by stop()
            self._error = e


CATALOGUE = list(range(1, 1683))
"""The candidates of a visit sent straight to a ranking worker: MovieLens-100K's item ids."""


def send_to_worker(
    settings: Settings, reg: TopicRegistry, plan: list[RecommendationRequest], rate: float
) -> None:
    """``plan`` at ``rate`` as the ranking worker receives it, the stages before it skipped
    (blocking; librdkafka): per visit a ``PrefillSignal`` and a ``RankRequest`` of 128 candidates of
    ``CATALOGUE``, stamped when sent, due within the ranking budget, each on its user's partition
    by the cascade's partitioner."""
    from confluent_kafka import Producer

    from relaygr.infra.kafka import partition_for
    from relaygr.infra.rdkafka_producer import rdkafka_config
    from relaygr.schemas import PrefillSignal, RankRequest, TriggerReason
    from relaygr.streams.config import PipelineSettings

    budget_s = PipelineSettings().budget_ms / 1000
    # Not idempotent: its first record would wait for a producer id, past the first deadlines.
    prod = Producer({**rdkafka_config(settings), "linger.ms": 1})
    signals, ranks = reg.name("prefill"), reg.name("rank")
    prod.list_topics(signals, timeout=10)  # connected, and the partitions' leaders known, first
    prod.list_topics(ranks, timeout=10)
    rng = random.Random(7)
    t0 = time.monotonic()
    for k, r in enumerate(plan):
        delay = t0 + k / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        now, key = time.time(), r.user_id.encode()
        part = partition_for(key, reg.partitions)
        sig = PrefillSignal(request_id=r.request_id, user_id=r.user_id, ts=now, history_len=1 << 20,
                            prefix_len=1 << 20, issued_at=now)  # fmt: skip
        req = RankRequest(request_id=r.request_id, user_id=r.user_id, ts=now, candidates=rng.sample(CATALOGUE, 128),
                          deadline_ts=now + budget_s, prefill_expected=True, trigger=TriggerReason.ADMITTED,
                          produced_at=now)  # fmt: skip
        prod.produce(signals, encode(sig), key=key, partition=part)
        prod.produce(ranks, encode(req), key=key, partition=part)
        prod.poll(0)
    prod.flush(30)
