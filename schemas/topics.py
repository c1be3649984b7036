"""The topic registry: every topic's name, key, partition count and cleanup policy.

Primitives:
- ``TopicSpec``: one topic.
- ``TopicRegistry(prefix, partitions)``: the topics of one deployment. Every topic that meets
  at a ranking worker (``co_partitioned``) has the same partition count and is keyed by
  ``user_id``, and the cascade writes it with one partitioner, so a user's behaviours, prefill
  signal and rank request land on the same partition number, hence the same worker (the
  affinity-aware router). The public inputs are not trusted to be partitioned that way: the
  ingress stage re-keys them onto ``routed-behaviors`` and ``routed-requests`` first (see
  ``relaygr.schemas.routing``), so they may have any partition count and any partitioner.

Public contract: ``<prefix>.behaviors``, ``<prefix>.requests``, ``<prefix>.results`` and
``<prefix>.dead-letters`` keep their names, keys and JSON encoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from relaygr.schemas.events import (
    BehaviorBatch,
    BehaviorEvent,
    DeadLetter,
    Event,
    PrefillSignal,
    RankedResult,
    RankRequest,
    RecommendationRequest,
    RetrievedRequest,
    WorkerStats,
)


@dataclass(frozen=True)
class TopicSpec:
    role: str
    name: str
    event_type: type[Event]
    key: str
    partitions: int
    cleanup_policy: Literal["delete", "compact", "compact,delete"] = "delete"
    co_partitioned: bool = True
    retention_ms: int | None = None

    def configs(self) -> dict[str, str]:
        c = {"cleanup.policy": self.cleanup_policy}
        if self.retention_ms is not None:
            c["retention.ms"] = str(self.retention_ms)
        return c


class TopicRegistry:
    """The topics of a deployment with topic prefix ``prefix`` and ``partitions`` partitions."""

    def __init__(self, prefix: str = "relaygr", partitions: int = 4) -> None:
        if partitions < 1:
            raise ValueError("partitions must be >= 1")
        self.prefix = prefix
        self.partitions = partitions
        p = partitions
        day = 24 * 3600 * 1000
        specs = [
            # Public inputs: any producer, any partitioner, so not co-partitioned.
            TopicSpec("behaviors", f"{prefix}.behaviors", BehaviorEvent, "user_id", p, co_partitioned=False),
            TopicSpec(
                "requests", f"{prefix}.requests", RecommendationRequest, "user_id", p, co_partitioned=False
            ),
            # The cascade's own copies of them, partitioned by user id with one partitioner. The
            # routed behaviours are every stage's history source, so they are kept like the input.
            TopicSpec("routed_behaviors", f"{prefix}.routed-behaviors", BehaviorBatch, "user_id", p),
            TopicSpec(
                "routed_requests",
                f"{prefix}.routed-requests",
                RecommendationRequest,
                "user_id",
                p,
                retention_ms=day,
            ),
            TopicSpec("retrieved", f"{prefix}.retrieved", RetrievedRequest, "user_id", p, retention_ms=day),
            TopicSpec("prefill", f"{prefix}.prefill-signals", PrefillSignal, "user_id", p, retention_ms=day),
            TopicSpec("rank", f"{prefix}.rank-requests", RankRequest, "user_id", p, retention_ms=day),
            # Read as a table: one answer per request_id (compaction), forgotten after a week.
            TopicSpec(
                "results",
                f"{prefix}.results",
                RankedResult,
                "request_id",
                p,
                "compact,delete",
                co_partitioned=False,
                retention_ms=7 * day,
            ),
            TopicSpec(
                "dead_letters", f"{prefix}.dead-letters", DeadLetter, "source", 1, co_partitioned=False
            ),
            TopicSpec(
                "worker_stats",
                f"{prefix}.worker-stats",
                WorkerStats,
                "worker_id",
                1,
                "compact",
                co_partitioned=False,
            ),
        ]
        self._by_role = {s.role: s for s in specs}

    def __iter__(self):
        return iter(self._by_role.values())

    def __getitem__(self, role: str) -> TopicSpec:
        return self._by_role[role]

    def name(self, role: str) -> str:
        return self._by_role[role].name

    @property
    def names(self) -> list[str]:
        return [s.name for s in self]
