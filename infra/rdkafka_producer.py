"""A librdkafka producer (confluent-kafka) for an asyncio stage: records enqueued without a wait,
each acknowledgement an asyncio future.

Why: a stage that produces hundreds of records a second pays aiokafka's produce requests in
Python on its event loop (protocol encoding, one socket write a request). librdkafka batches and
sends on its own C threads; the loop only enqueues. ``relaygr bench kafka-clients`` measured
0.13-0.21 ms of CPU per record against aiokafka's 0.23-0.63 ms at 200-800 records a second
(``docs/host-path.md``).

Primitives:
- ``RdProducer(settings, linger_ms=...)``: idempotent (acks=all, in order, no duplicates on a
  retry), keyed records partitioned as Java's and aiokafka's default (murmur2), the deployment's
  security settings. ``send(topic, value, key)`` enqueues and returns a future of the record's
  acknowledgement (its exception: the delivery failed for good; librdkafka retries within
  ``delivery_timeout_ms`` before that), to ``partition`` when given (the cascade's own
  partitioner for its co-partitioned topics), with ``headers``; ``await send_and_wait(...)``; ``await start()``,
  ``await stop(timeout_s)`` (flushes what is queued, then closes); ``len(producer)``: records
  not yet acknowledged.
- ``rdkafka_config(settings)``: the librdkafka settings of this deployment (bootstrap, security).

Delivery reports are served by a thread of the producer's own that polls librdkafka and hands
each poll's reports to the event loop in one call, so the loop is woken once per batch of
acknowledgements, not once per record.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from relaygr.infra.local.broker_files import resolve_bootstrap
from relaygr.infra.settings import Settings, sasl_password

# How long the poll thread waits for delivery reports at a time (it also bounds how long ``stop``
# waits for that thread to notice).
POLL_S = 0.05


def rdkafka_config(settings: Settings) -> dict[str, Any]:
    """librdkafka's bootstrap and security settings for this deployment."""
    conf: dict[str, Any] = {
        "bootstrap.servers": resolve_bootstrap(settings),
        "security.protocol": settings.security_protocol.lower(),
        "metadata.max.age.ms": settings.metadata_max_age_ms,
    }
    if settings.security_protocol in ("SSL", "SASL_SSL"):
        if settings.ssl_cafile:
            conf["ssl.ca.location"] = str(settings.ssl_cafile)
        if settings.ssl_certfile:
            conf["ssl.certificate.location"] = str(settings.ssl_certfile)
        if settings.ssl_keyfile:
            conf["ssl.key.location"] = str(settings.ssl_keyfile)
    if settings.security_protocol.startswith("SASL"):
        if not settings.sasl_mechanism:
            raise ValueError("RELAYGR_SASL_MECHANISM is required with a SASL security protocol")
        conf["sasl.mechanism"] = settings.sasl_mechanism
        conf["sasl.username"] = settings.sasl_username or ""
        conf["sasl.password"] = sasl_password(settings) or ""
    return conf


class DeliveryFailed(RuntimeError):
    """librdkafka gave a record up (its delivery timeout passed, or a fatal error)."""


class RdProducer:
    def __init__(
        self,
        settings: Settings,
        *,
        linger_ms: float = 1.0,
        delivery_timeout_ms: int = 120_000,
        max_message_bytes: int | None = None,
    ) -> None:
        self._conf = {
            **rdkafka_config(settings),
            "enable.idempotence": True,  # acks=all, ordered, a retry never duplicates
            "linger.ms": linger_ms,
            "delivery.timeout.ms": delivery_timeout_ms,
            "partitioner": "murmur2_random",  # keyed: where Java's and aiokafka's default put it
            "message.max.bytes": max(settings.max_message_bytes, max_message_bytes or 0) + 4096,
        }
        self._producer: Producer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._reports: list[tuple[asyncio.Future, KafkaError | None]] = []
        self._lock = threading.Lock()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # librdkafka's own log lines (a broker down, a retried PID) through ours, not stderr.
        self._producer = Producer(self._conf, logger=logging.getLogger("relaygr.rdkafka"))
        self._thread = threading.Thread(target=self._poll, name="relaygr-rdkafka-acks", daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        return len(self._producer) if self._producer is not None else 0

    def send(
        self,
        topic: str,
        value: bytes,
        *,
        key: bytes | None = None,
        partition: int | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future:
        """Enqueue one record (``partition``: that one, else the key's); the future is its
        acknowledgement (``DeliveryFailed`` if given up)."""
        if self._producer is None or self._loop is None:
            raise RuntimeError("RdProducer.send before start()")
        fut = self._loop.create_future()

        def report(err: KafkaError | None, _msg: object) -> None:  # on the poll thread
            with self._lock:
                self._reports.append((fut, err))

        while True:
            try:
                self._producer.produce(
                    topic, value, key=key, partition=-1 if partition is None else partition,
                    headers=headers, on_delivery=report,
                )  # fmt: skip
                return fut
            except BufferError:  # librdkafka's queue is full: let acknowledgements drain it
                self._producer.poll(0.01)
            except KafkaException as e:
                fut.set_exception(DeliveryFailed(str(e)))
                return fut

    async def send_and_wait(self, topic: str, value: bytes, **kw: Any) -> None:
        await self.send(topic, value, **kw)

    def _poll(self) -> None:
        assert self._producer is not None and self._loop is not None
        while not self._closing.is_set():
            self._producer.poll(POLL_S)
            with self._lock:
                reports, self._reports = self._reports, []
            if reports:
                try:
                    self._loop.call_soon_threadsafe(_settle, reports)
                except RuntimeError:  # the loop is closed: nobody waits for these any more
                    return

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued (at most ``timeout_s``), then stop the poll thread."""
        if self._producer is None:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._producer.flush, timeout_s)
        self._closing.set()
        if self._thread is not None:
            await loop.run_in_executor(None, self._thread.join, 2 * POLL_S + 1.0)
        with self._lock:
            reports, self._reports = self._reports, []
        _settle(reports)
        self._producer = None


def _settle(reports: list[tuple[asyncio.Future, KafkaError | None]]) -> None:
    for fut, err in reports:
        if fut.done():
            continue
        if err is None:
            fut.set_result(None)
        else:
            fut.set_exception(DeliveryFailed(f"{err.name()}: {err.str()}"))
