"""Kafka clients and topic administration, configured from ``Settings``.

Primitives:
- ``producer(settings)`` / ``consumer(settings, *topics, ...)`` / ``admin(settings)``: aiokafka
  clients with the bootstrap servers and security settings of this deployment;
  ``started_admin(settings)``: an admin client started for a block and closed after it.
- ``ensure_topics(registry, settings)``: create every topic of the registry that is missing
  (idempotent); an existing topic with another partition count is an error, since co-partitioning
  (hence affinity) depends on it.
- ``replication(settings)`` / ``replication_blocking(settings)``: the replication factor and
  min.insync.replicas of created topics: ``RELAYGR_REPLICATION_FACTOR`` if set, else they follow
  the cluster (min(3, brokers), min ISR 2 with 3 replicas; see ``broker.replication_for``).
- ``describe_partitions(settings, names)``: partition counts of existing topics.
- ``group_lag(client, cons, group, topic)``: records of ``topic`` a consumer group has not committed.
- ``partition_for(key, partitions)``: the cascade's one partitioner (murmur2, as Java's and
  aiokafka's default for a keyed record) for everything it writes to co-partitioned topics.
- ``RepeatedClientErrors``: the log filter (installed on import) that lets one of aiokafka's
  repeated connection errors through per 10 s while the broker is unreachable, with the count;
  ``forget_repeated_errors()`` starts the windows afresh.
- On import, every aiokafka client's failed metadata update waits out its retry backoff
  (``_back_off_failed_metadata``: aiokafka's producer retries at once, and spun while the broker was down).
- ``stop_clients(*clients)``: stop aiokafka clients in turn, each whatever the one before did.
- ``RetriedLeaderErrors``: the log filter (installed on import) that demotes to DEBUG the offset
  lookups and produce requests aiokafka logs as failed and then retries while a new partition's
  leader gets ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.client import AIOKafkaClient
from aiokafka.partitioner import murmur2

from relaygr.infra.local.broker_files import replication_for, resolve_bootstrap
from relaygr.infra.settings import Settings, kafka_client_kwargs
from relaygr.schemas.topics import TopicRegistry

TOPIC_ALREADY_EXISTS = 36
log = logging.getLogger(__name__)


class RetriedLeaderErrors(logging.Filter):
    """aiokafka's fetcher logs a failed offset lookup as an error, and its producer a failed
    produce as a warning, and both then retry. A partition created a moment ago answers "not the
    leader" (or "no leader yet") until its leader has loaded it, even once the metadata names that
    leader, so every fresh topic printed a few such lines that were no failure. Those two answers
    are demoted to DEBUG; any other failure keeps its level, and a lookup or a send that never
    succeeds still surfaces as the caller's timeout."""

    RETRIED = frozenset({"NotLeaderForPartitionError", "LeaderNotAvailableError"})
    MESSAGES = ("Failed fetch offsets", "Got error produce response on topic-partition")

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        # The fetcher passes the error, the producer its class.
        names = {a.__name__ if isinstance(a, type) else type(a).__name__ for a in args}
        if isinstance(record.msg, str) and record.msg.startswith(self.MESSAGES) and names & self.RETRIED:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


class RepeatedClientErrors(logging.Filter):
    """While the broker is unreachable, aiokafka logs every failed connection, metadata update,
    fetch and coordinator lookup as an error, at every retry: about a hundred lines a second per
    stage, so an hour's outage wrote hundreds of thousands of lines a stage. One record per message
    (as formatted: the same node, address and error) passes per ``window_s``; the next to pass says
    how many it stands for. Another message (a new reason, another node) passes at once, so a
    failure that changes is never hidden. Records below WARNING pass untouched."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s = window_s
        self.clock = clock
        self._passed: dict[tuple[str, str], tuple[float, int]] = {}  # (logger, message) -> (when, held since)
        self._lock = threading.Lock()  # aiokafka logs from the loop, faust's consumer from its own thread

    def forget(self) -> None:
        with self._lock:
            self._passed.clear()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key, now = (record.name, record.getMessage()), self.clock()
        with self._lock:
            when, held = self._passed.get(key, (None, 0))
            if when is not None and now - when < self.window_s:
                self._passed[key] = (when, held + 1)
                return False
            self._passed[key] = (now, 0)
        if held and when is not None:
            record.msg = f"{record.msg} [and {held} more like it in the {now - when:.0f} s before]"
        return True


for _retrying in ("aiokafka.consumer.fetcher", "aiokafka.producer.sender"):
    logging.getLogger(_retrying).addFilter(RetriedLeaderErrors())
_REPEATING = (
    "aiokafka",
    "aiokafka.conn",
    "aiokafka.consumer.fetcher",
    "aiokafka.consumer.group_coordinator",
    "aiokafka.producer.sender",
)
_REPEAT_FILTERS = [RepeatedClientErrors() for _ in _REPEATING]
for _repeating, _filter in zip(_REPEATING, _REPEAT_FILTERS, strict=True):
    logging.getLogger(_repeating).addFilter(_filter)


def forget_repeated_errors() -> None:
    """Start every ``RepeatedClientErrors`` window afresh (tests: one test's errors never hold back
    the next one's)."""
    for f in _REPEAT_FILTERS:
        f.forget()


class TopicError(RuntimeError):
    """Topics exist with a layout that breaks co-partitioning, or could not be created."""


async def stop_clients(*clients: AIOKafkaConsumer | AIOKafkaProducer | AIOKafkaAdminClient) -> None:
    """Stop each client in turn, whatever the ones before did: an error is logged, not raised.
    With the broker unreachable, aiokafka's consumer ``stop`` cancels a fetch that is waiting out
    its retry backoff and awaits it unguarded, so the fetch's CancelledError escapes ``stop``.
    That is no cancellation of the caller (whose own cancellation still propagates), and the
    clients after it must still be stopped."""
    for client in clients:
        try:
            await client.stop()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            log.warning(
                "%s stopped with a fetch of its own cancelled (broker unreachable?)", type(client).__name__
            )
        except Exception as e:
            log.warning("%s did not stop cleanly: %r", type(client).__name__, e)


def partition_for(key: bytes, partitions: int) -> int:
    """The partition of ``key`` among ``partitions`` on every co-partitioned topic. The cascade
    passes it explicitly on every send, so co-location never depends on a client's default."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


async def group_lag(client: AIOKafkaAdminClient, cons: AIOKafkaConsumer, group: str, topic: str) -> int:
    """Records of ``topic`` (end offsets now) that ``group`` has not committed; -1 while the
    group or the topic is unknown."""
    from aiokafka import TopicPartition

    counts = await _partition_counts(client, [topic])
    if not counts.get(topic):
        return -1
    parts = range(counts[topic])
    tps = [TopicPartition(topic, p) for p in sorted(parts)]
    try:
        ends = await cons.end_offsets(tps)
        got = await client.list_consumer_group_offsets(group, partitions=tps)
    except Exception:
        return -1
    return sum(
        max(0, end - (got[tp].offset if tp in got and got[tp].offset >= 0 else 0)) for tp, end in ends.items()
    )


def _common(settings: Settings) -> dict[str, Any]:
    return {
        "bootstrap_servers": resolve_bootstrap(settings),
        "metadata_max_age_ms": settings.metadata_max_age_ms,
        **kafka_client_kwargs(settings),
    }


def producer(settings: Settings, **kw: Any) -> AIOKafkaProducer:
    # acks=all + idempotence: a result is "delivered" only once the broker has it, exactly once.
    opts: dict[str, Any] = {"acks": "all", "enable_idempotence": True, "linger_ms": 1}
    opts.update(kw)
    return AIOKafkaProducer(**_common(settings), **opts)


def consumer(settings: Settings, *topics: str, **kw: Any) -> AIOKafkaConsumer:
    opts: dict[str, Any] = {"enable_auto_commit": False, "auto_offset_reset": "earliest"}
    opts.update(kw)
    return AIOKafkaConsumer(*topics, **_common(settings), **opts)


def _back_off_failed_metadata() -> None:
    """Make every aiokafka client's failed metadata update wait out its retry backoff before it
    reports. aiokafka's producer, holding a batch for a partition whose leader it does not know,
    asks for metadata again as soon as an update fails; with every broker refusing connections
    each update fails at once, so while the broker was down a stage's producer (ours or faust's)
    spun at about 3,000 updates a second: a core, and two error lines each."""
    update = AIOKafkaClient._metadata_update
    if getattr(update, "backs_off", False):
        return

    async def backed_off(self: AIOKafkaClient, cluster_metadata: Any, topics: Any) -> bool:
        ok = await update(self, cluster_metadata, topics)
        if not ok:
            await asyncio.sleep(self._retry_backoff)
        return ok

    backed_off.backs_off = True  # type: ignore[attr-defined]
    AIOKafkaClient._metadata_update = backed_off  # type: ignore[method-assign]


_back_off_failed_metadata()


def admin(settings: Settings) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(**_common(settings))


@contextlib.asynccontextmanager
async def started_admin(settings: Settings) -> AsyncIterator[AIOKafkaAdminClient]:
    """An admin client of ``settings``, started, and closed when the block ends."""
    client = admin(settings)
    await client.start()
    try:
        yield client
    finally:
        await client.close()


async def replication(settings: Settings, *, client: AIOKafkaAdminClient | None = None) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) for topics created now. Set explicitly, the factor
    is used as given (min ISR 2 from 3 replicas, else 1); otherwise it follows the brokers the
    cluster's metadata lists (live ones: a node that is down does not count)."""
    factor = settings.replication_factor
    if factor is None:
        own = client is None
        client = client or admin(settings)
        if own:
            await client.start()
        try:
            brokers = len((await client.describe_cluster())["brokers"])
        finally:
            if own:
                await client.close()
        return replication_for(brokers)
    return factor, replication_for(factor)[1]


def replication_blocking(settings: Settings, *, timeout_s: float = 60.0) -> tuple[int, int]:
    """``replication(settings)`` from synchronous code (a stage's set-up), retried while the
    cluster cannot be reached, up to ``timeout_s``."""
    import concurrent.futures
    import time

    if settings.replication_factor is not None:
        return settings.replication_factor, replication_for(settings.replication_factor)[1]
    deadline = time.monotonic() + timeout_s
    while True:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            try:
                return pool.submit(asyncio.run, replication(settings)).result()
            except Exception as e:
                if time.monotonic() > deadline:
                    raise TopicError(f"cannot read the cluster's brokers to size replication: {e}") from e
        time.sleep(1.0)


async def describe_partitions(settings: Settings, names: list[str]) -> dict[str, int]:
    client = admin(settings)
    await client.start()
    try:
        return await _partition_counts(client, names)
    finally:
        await client.close()


async def _partition_counts(
    client: AIOKafkaAdminClient, names: list[str], *, with_leader: bool = False
) -> dict[str, int]:
    """Partition counts of the existing topics among ``names`` (only led partitions if asked)."""
    existing = set(await client.list_topics())
    wanted = [n for n in names if n in existing]
    if not wanted:
        return {}
    out: dict[str, int] = {}
    for t in await client.describe_topics(wanted):
        if t.get("error_code", 0) == 0:
            parts = t["partitions"]
            if with_leader:
                parts = [p for p in parts if p.get("error_code", 0) == 0 and p.get("leader", -1) >= 0]
            out[t["topic"]] = len(parts)
    return out


async def ensure_topics(
    registry: TopicRegistry, settings: Settings, *, timeout_s: float = 30.0
) -> dict[str, str]:
    """Create the registry's missing topics. Returns ``{name: "created" | "exists"}``."""
    client = admin(settings)
    await client.start()
    try:
        names = registry.names
        have = await _partition_counts(client, names)
        for spec in registry:
            if spec.co_partitioned and spec.name in have and have[spec.name] != spec.partitions:
                raise TopicError(
                    f"topic {spec.name} has {have[spec.name]} partitions, the registry wants {spec.partitions}; "
                    "co-partitioned topics must match (delete it, or set RELAYGR_PARTITIONS to match)"
                )
        missing = [s for s in registry if s.name not in have]
        status = {n: "exists" for n in have}
        if missing:
            factor, min_isr = await replication(settings, client=client)
            # acks=all then means on min_isr replicas: a write survives the loss of any one broker.
            isr = {"min.insync.replicas": str(min_isr)}
            resp = await client.create_topics(
                [
                    NewTopic(s.name, s.partitions, factor, topic_configs={**s.configs(), **isr})
                    for s in missing
                ],
                timeout_ms=int(timeout_s * 1000),
            )
            for topic, code, *rest in resp.topic_errors:
                if code not in (0, TOPIC_ALREADY_EXISTS):
                    msg = rest[0] if rest else ""
                    raise TopicError(f"creating {topic} failed: error {code} {msg}")
                status[topic] = "created" if code == 0 else "exists"
        # Creation is asynchronous: wait until every partition of every topic has a leader.
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            have = await _partition_counts(client, names, with_leader=True)
            if all(
                have.get(s.name) == s.partitions or (s.name in have and not s.co_partitioned)
                for s in registry
            ):
                return status
            if asyncio.get_running_loop().time() > deadline:
                raise TopicError(f"topics not ready after {timeout_s:.0f} s: {have}")
            await asyncio.sleep(0.2)
    finally:
        await client.close()


async def delete_topics_with_prefix(settings: Settings, prefix: str) -> list[str]:
    """Delete every topic whose name starts with ``prefix`` (the registry's and the stages'
    changelogs alike). Returns the deleted names."""
    client = admin(settings)
    await client.start()
    try:
        mine = [t for t in await client.list_topics() if t.startswith(prefix)]
        if mine:
            await client.delete_topics(mine)
        return mine
    finally:
        await client.close()
