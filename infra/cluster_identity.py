"""Who the cluster and its topics are right now: cluster id, topic ids and log end offsets.

Primitives:
- ``TopicFacts``: one topic as the broker describes it: its id (a UUID the broker gives a topic
  when it is created, so a topic deleted and created again under the same name has a new one)
  and the leader of each partition.
- ``ClusterFacts``: the cluster id and the ``TopicFacts`` of the topics asked about.
- ``ClusterProbe(settings)``: one client for these questions, opened on first use.
  ``await facts(topics)`` asks Metadata v12 (aiokafka's own Metadata request stops at v5, which
  carries the cluster id but no topic ids; a broker without v12 is described by v5, with topic
  ids unknown); ``await end_offsets(facts, [(topic, partition), ...])`` asks each partition's
  leader for its log end offset (ListOffsets, latest); ``await close()``.
- ``ProbeError``: the broker could not answer (retry later).
"""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from io import BytesIO
from typing import Any

from aiokafka.client import AIOKafkaClient
from aiokafka.errors import IncompatibleBrokerVersion, KafkaError
from aiokafka.protocol.abstract import AbstractType
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.metadata import MetadataRequest
from aiokafka.protocol.offset import OffsetRequest
from aiokafka.protocol.types import (
    Boolean,
    CompactArray,
    CompactString,
    Int16,
    Int32,
    Schema,
    TaggedFields,
)

from relaygr.infra.local.broker import resolve_bootstrap
from relaygr.infra.settings import Settings, kafka_client_kwargs

LATEST = -1  # ListOffsets timestamp meaning "the log end offset"


class ProbeError(RuntimeError):
    """The broker did not describe the cluster or the topics (unreachable, no leader yet...)."""


@dataclass(frozen=True)
class TopicFacts:
    name: str
    topic_id: str | None  # None: the broker does not say (no Metadata v10+)
    leaders: dict[int, int] = field(default_factory=dict)  # partition -> leader node id


@dataclass(frozen=True)
class ClusterFacts:
    cluster_id: str | None
    topics: dict[str, TopicFacts]


class _TopicUuid(AbstractType[str | None]):
    """Kafka's UUID: 16 raw bytes; all zeros means "no id"."""

    @classmethod
    def encode(cls, value: str | None) -> bytes:
        return uuid.UUID(value).bytes if value else bytes(16)

    @classmethod
    def decode(cls, data: BytesIO) -> str | None:
        raw = data.read(16)
        if len(raw) != 16:
            raise ValueError("buffer underrun decoding a UUID")
        return None if raw == bytes(16) else str(uuid.UUID(bytes=raw))


_TEXT = CompactString("utf-8")


class _MetadataResponseV12(Response):
    API_KEY = 3
    API_VERSION = 12
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "brokers",
            CompactArray(
                ("node_id", Int32),
                ("host", _TEXT),
                ("port", Int32),
                ("rack", _TEXT),
                ("tags", TaggedFields),
            ),
        ),
        ("cluster_id", _TEXT),
        ("controller_id", Int32),
        (
            "topics",
            CompactArray(
                ("error_code", Int16),
                ("name", _TEXT),
                ("topic_id", _TopicUuid),
                ("is_internal", Boolean),
                (
                    "partitions",
                    CompactArray(
                        ("error_code", Int16),
                        ("partition_index", Int32),
                        ("leader_id", Int32),
                        ("leader_epoch", Int32),
                        ("replica_nodes", CompactArray(Int32)),
                        ("isr_nodes", CompactArray(Int32)),
                        ("offline_replicas", CompactArray(Int32)),
                        ("tags", TaggedFields),
                    ),
                ),
                ("topic_authorized_operations", Int32),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


class _MetadataRequestV12(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = 3
    API_VERSION = 12
    RESPONSE_TYPE = _MetadataResponseV12
    SCHEMA = Schema(
        ("topics", CompactArray(("topic_id", _TopicUuid), ("name", _TEXT), ("tags", TaggedFields))),
        ("allow_auto_topic_creation", Boolean),
        ("include_topic_authorized_operations", Boolean),
        ("tags", TaggedFields),
    )


class _TopicIdMetadataRequest(Request[_MetadataRequestV12]):
    API_KEY = 3

    def __init__(self, topics: list[str]) -> None:
        self._topics = topics

    def build(self, request_struct_class: type[_MetadataRequestV12]) -> _MetadataRequestV12:
        # Never create a topic by asking about it: a missing topic must stay missing.
        return request_struct_class([(None, t, {}) for t in self._topics], False, False, {})


class ClusterProbe:
    """Describes the cluster and its topics for the stage that owns it (one client, reused)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._client: AIOKafkaClient | None = None
        self._lock = asyncio.Lock()

    async def _ready(self) -> AIOKafkaClient:
        if self._client is None:
            client = AIOKafkaClient(
                bootstrap_servers=resolve_bootstrap(self.settings),
                client_id="relaygr-cluster-probe",
                **kafka_client_kwargs(self.settings),
            )
            try:
                await client.bootstrap()
            except (KafkaError, OSError) as e:
                await client.close()
                raise ProbeError(f"cannot reach the cluster: {e}") from e
            self._client = client
        return self._client

    async def facts(self, topics: Iterable[str]) -> ClusterFacts:
        names = sorted(set(topics))
        async with self._lock:
            client = await self._ready()
            try:
                node = client.get_random_node()
                if node is None:
                    raise ProbeError("no broker is known")
                try:
                    resp = await client.send(node, _TopicIdMetadataRequest(names))
                except (IncompatibleBrokerVersion, NotImplementedError):
                    resp = await client.send(node, MetadataRequest(names, allow_auto_topic_creation=False))
            except (KafkaError, OSError, TimeoutError) as e:
                raise ProbeError(f"describing {names} failed: {type(e).__name__}: {e}") from e
        return _facts_of(resp.to_object(), names)

    async def end_offsets(
        self, facts: ClusterFacts, partitions: Iterable[tuple[str, int]]
    ) -> dict[tuple[str, int], int]:
        """Log end offset (the offset the next record will get) of each ``(topic, partition)``."""
        by_leader: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        for topic, p in partitions:
            leader = facts.topics[topic].leaders.get(p, -1) if topic in facts.topics else -1
            if leader < 0:
                raise ProbeError(f"{topic}[{p}] has no leader")
            by_leader[leader][topic].append(p)
        out: dict[tuple[str, int], int] = {}
        async with self._lock:
            client = await self._ready()
            for leader, topics in by_leader.items():
                req = OffsetRequest(-1, 0, [(t, [(p, LATEST) for p in ps]) for t, ps in topics.items()])
                try:
                    resp = await client.send(leader, req)
                except (KafkaError, OSError, TimeoutError) as e:
                    raise ProbeError(f"listing offsets failed: {type(e).__name__}: {e}") from e
                for t in resp.to_object()["topics"]:
                    for part in t["partitions"]:
                        if part["error_code"] != 0:
                            raise ProbeError(
                                f"listing offsets of {t['topic']}[{part['partition']}]: "
                                f"error {part['error_code']}"
                            )
                        out[(t["topic"], part["partition"])] = part["offset"]
        return out

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()


def _facts_of(obj: dict[str, Any], names: list[str]) -> ClusterFacts:
    topics: dict[str, TopicFacts] = {}
    for t in obj["topics"]:
        name = t.get("name", t.get("topic"))
        if t["error_code"] != 0 or name not in names:
            continue  # missing (or not ours): absent from the answer
        leaders = {
            p["partition_index" if "partition_index" in p else "partition"]: _leader(p)
            for p in t["partitions"]
        }
        topics[name] = TopicFacts(name, t.get("topic_id"), leaders)
    return ClusterFacts(obj.get("cluster_id"), topics)


def _leader(p: dict[str, Any]) -> int:
    if p["error_code"] != 0:
        return -1
    return p["leader_id"] if "leader_id" in p else p["leader"]
