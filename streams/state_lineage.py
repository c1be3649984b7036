"""Local state that follows the cluster: what each piece of a stage's state was built from.

A stage's RocksDB state (a faust table partition, a partition of the ranking worker's history)
describes one topic partition of one cluster. When the broker is wiped, a topic is deleted and
created again, or the cluster behind the bootstrap address is replaced, that state describes
topics that no longer exist: it is discarded for that partition and rebuilt from its changelog or
source topic, instead of stopping the stage or serving another cluster's histories.

Primitives:
- ``deployment_dir(settings, kind)``: the folder of one kind of state ("stages", "workers") of
  this deployment: ``$RELAYGR_HOME/<kind>/<topic prefix>``, so two prefixes never share state.
- ``Lineage``: what one partition of state was built from: cluster id, source topic, topic id.
- ``PartitionState``: what the state holds for a partition: anything, and the last offset applied.
- ``Reason`` and ``judge(recorded, current, state, end_offset)``: why a partition's state no
  longer matches the broker (or ``None``: keep it).
- ``LineageBook(path)``: the recorded ``Lineage`` of every (state, partition), one JSON file.
- ``Reconciler(stage, settings, book_path)``: ``await reconcile(state, topic, partitions,
  state_of, discard)`` compares each partition with the broker, discards what does not match
  (one log line each, counted in ``relaygr_state_discarded_total{stage,reason}``) and records the
  lineage of what is kept or rebuilt.
- ``rewind_old_topic_offsets(stage, who, group, consumer, incarnations, tps)``: at assignment,
  partitions whose committed offset names an earlier topic of that name are read from the start.
- ``HistoryLineage``: the ranking worker's history table and prefix store, checked per partition
  of the topic its histories are read from: ``verify`` at every assignment, ``watch`` every few
  seconds.

The faust tables' side is ``relaygr.streams.table_lineage`` (it imports faust).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter as PCounter

from relaygr.infra.cluster_identity import ClusterFacts, ClusterProbe, ProbeError
from relaygr.infra.settings import Settings

if TYPE_CHECKING:
    from relaygr.streams.history import HistoryTable
    from relaygr.workers.store.prefix_store import PrefixStore

log = logging.getLogger(__name__)

DISCARDED = PCounter(
    "relaygr_state_discarded_total",
    "Partitions of local state discarded because they no longer match the cluster's topics",
    ["stage", "reason"],
)


async def rewind_old_topic_offsets(
    stage: str, who: str, group: str, consumer: Any, incarnations: Any, tps
) -> set:
    """Of ``tps`` just assigned to ``consumer`` (aiokafka) in ``group``, move those whose committed
    offset was read from an earlier topic of the same name to their start (``incarnations``: a
    ``relaygr.infra.incarnations.Incarnations``); one log line, counted. Returns them."""
    stale = await incarnations.stale(group, tps)
    if stale:
        await consumer.seek_to_beginning(*stale)
        DISCARDED.labels(stage, "offset_of_old_topic").inc(len(stale))
        log.warning(
            "%s: the committed offsets of %s were read from an earlier topic of the same name "
            "(deleted and created again): reading those partitions from the start",
            who,
            sorted((tp.topic, tp.partition) for tp in stale),
        )
    return stale


def deployment_dir(settings: Settings, kind: str) -> Path:
    """``$RELAYGR_HOME/<kind>/<topic prefix>``: one deployment's state of one kind."""
    prefix = settings.topic_prefix
    # "." and ".." are valid prefixes (and topic names) but not folder names of their own.
    folder = prefix if prefix.strip(".") else f"_{prefix}"
    return Path(settings.home) / kind / folder


@dataclass(frozen=True)
class Lineage:
    cluster_id: str | None
    topic: str
    topic_id: str | None  # None: the broker does not say


@dataclass(frozen=True)
class PartitionState:
    present: bool  # the partition holds anything at all
    last_offset: int | None = None  # last offset of the topic applied to it (None: not recorded)


class Reason(StrEnum):
    UNRECORDED = "unrecorded"
    CLUSTER_CHANGED = "cluster_changed"
    SOURCE_CHANGED = "source_changed"
    TOPIC_RECREATED = "topic_recreated"
    OFFSET_BEYOND_END = "offset_beyond_end"


def judge(
    recorded: Lineage | None, current: Lineage, state: PartitionState, end_offset: int
) -> tuple[Reason, str] | None:
    """Why the state of one partition no longer matches the broker, with a sentence saying so;
    ``None`` when it may be kept. ``end_offset`` is the topic partition's log end offset (the
    offset its next record gets). An unknown cluster or topic id is not a mismatch."""
    if not state.present:
        return None
    if recorded is None:
        return Reason.UNRECORDED, "nothing records which cluster and topic it was built from"
    if recorded.cluster_id and current.cluster_id and recorded.cluster_id != current.cluster_id:
        return (
            Reason.CLUSTER_CHANGED,
            f"it was built in cluster {recorded.cluster_id}, the broker is cluster {current.cluster_id}",
        )
    if recorded.topic != current.topic:
        return (
            Reason.SOURCE_CHANGED,
            f"it was built from {recorded.topic}, the stage now reads {current.topic}",
        )
    if recorded.topic_id and current.topic_id and recorded.topic_id != current.topic_id:
        return (
            Reason.TOPIC_RECREATED,
            f"{current.topic} had id {recorded.topic_id} and now has id {current.topic_id} "
            "(deleted and created again)",
        )
    if state.last_offset is not None and state.last_offset >= end_offset:
        return (
            Reason.OFFSET_BEYOND_END,
            f"it applied up to offset {state.last_offset}, but the topic partition ends before "
            f"offset {end_offset}",
        )
    return None


class LineageBook:
    """The recorded lineage of every (state, partition), in one JSON file replaced atomically."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._entries: dict[str, dict[str, dict[str, Any]]] = {}
        if self.path.exists():
            try:
                self._entries = json.loads(self.path.read_text())
            except (OSError, ValueError):
                log.warning(
                    "unreadable lineage record %s: every partition it covered is unrecorded", self.path
                )

    def get(self, state: str, partition: int) -> Lineage | None:
        raw = self._entries.get(state, {}).get(str(partition))
        if raw is None:
            return None
        return Lineage(raw.get("cluster_id"), raw["topic"], raw.get("topic_id"))

    def put(self, state: str, partition: int, lineage: Lineage) -> None:
        self._entries.setdefault(state, {})[str(partition)] = asdict(lineage)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self._entries, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


StateOf = Callable[[int], PartitionState]
Discard = Callable[[int], Awaitable[None] | None]


class Reconciler:
    """Checks one stage's state against the broker; see the module docstring."""

    def __init__(
        self,
        stage: str,
        settings: Settings,
        book_path: str | Path,
        *,
        probe: ClusterProbe | None = None,
        patience_s: float = 30.0,
    ) -> None:
        self.stage = stage
        self.book = LineageBook(book_path)
        self.probe = probe or ClusterProbe(settings)
        self.patience_s = patience_s
        self._lock = asyncio.Lock()

    async def _look(
        self, topic: str, partitions: list[int]
    ) -> tuple[ClusterFacts, dict[tuple[str, int], int]]:
        """The cluster's facts and the partitions' end offsets, retried while leaders settle."""
        deadline = time.monotonic() + self.patience_s
        backoff = 0.05
        while True:
            try:
                facts = await self.probe.facts([topic])
                if topic not in facts.topics:
                    return facts, {}
                return facts, await self.probe.end_offsets(facts, [(topic, p) for p in partitions])
            except ProbeError:
                if time.monotonic() + backoff > deadline:
                    raise
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)

    async def reconcile(
        self, state: str, topic: str, partitions: Iterable[int], state_of: StateOf, discard: Discard
    ) -> dict[int, Reason]:
        """Compare ``state``'s partitions (built from ``topic``) with the broker: discard those
        that no longer match, record the lineage of all. Returns the discarded partitions."""
        parts = sorted(set(partitions))
        if not parts:
            return {}
        async with self._lock:
            try:
                facts, ends = await self._look(topic, parts)
            except ProbeError as e:
                # The state stays as it is (nothing says it is wrong); the next check retries.
                log.warning("%s: could not check %s against the cluster (%s)", self.stage, state, e)
                return {}
            if topic not in facts.topics:
                return {}  # deleted meanwhile: it is checked again once it is assigned again
            current = Lineage(facts.cluster_id, topic, facts.topics[topic].topic_id)
            discarded: dict[int, Reason] = {}
            changed = False
            for p in parts:
                recorded = self.book.get(state, p)
                verdict = judge(recorded, current, state_of(p), ends[(topic, p)])
                if verdict is not None:
                    reason, why = verdict
                    done = discard(p)
                    if inspect.isawaitable(done):
                        await done
                    discarded[p] = reason
                    DISCARDED.labels(self.stage, reason.value).inc()
                    log.warning(
                        "%s: discarded local state %s[%d] (%s: %s); rebuilding it from %s",
                        self.stage,
                        state,
                        p,
                        reason.value,
                        why,
                        topic,
                    )
                if recorded != current:
                    self.book.put(state, p, current)
                    changed = True
            if changed:
                self.book.save()
            return discarded

    async def close(self) -> None:
        await self.probe.close()


class HistoryLineage:
    """The ranking worker's histories (and the prefixes computed from them) per partition of
    the topic they are read from. A discarded partition loses its users' events, counts and
    offset, and their cached prefixes in every tier of the prefix store, so none is served."""

    STATE = "history"

    def __init__(
        self,
        stage: str,
        settings: Settings,
        folder: str | Path,
        history: HistoryTable,
        store: PrefixStore | None,
        *,
        probe: ClusterProbe | None = None,
    ) -> None:
        self.reconciler = Reconciler(stage, settings, Path(folder) / "lineage.json", probe=probe)
        self.history = history
        self.store = store

    def _state_of(self, partition: int) -> PartitionState:
        nxt = self.history.next_offset(partition)
        return PartitionState(nxt > 0, nxt - 1 if nxt > 0 else None)

    def _discard(self, partition: int) -> None:
        # Prefixes first: were the worker to stop in between, the history is still there to
        # name their users, and the next check (the lineage is not yet updated) does it again.
        if self.store is not None:
            self.store.forget(self.history.partition_users(partition))
        self.history.discard_partition(partition)

    async def verify(self, topic: str, partitions: Iterable[int]) -> dict[int, Reason]:
        """Check these partitions of ``topic`` (at an assignment, before reading resumes)."""
        return await self.reconciler.reconcile(self.STATE, topic, partitions, self._state_of, self._discard)

    async def watch(self, consumer: Any, topic: str, interval_s: float = 5.0) -> None:
        """Every ``interval_s``, check the partitions of ``topic`` that ``consumer`` is assigned
        (a topic deleted and created again with as many partitions may cause no rebalance at
        all); a discarded partition is read again from its start."""
        from aiokafka import TopicPartition

        while True:
            await asyncio.sleep(interval_s)
            parts = [tp.partition for tp in consumer.assignment() if tp.topic == topic]
            try:
                discarded = await self.verify(topic, parts)
            except Exception:  # a failed check must not end the worker; the next one retries
                log.exception("checking %s against the cluster failed", topic)
                continue
            for p in discarded:
                tp = TopicPartition(topic, p)
                if tp in consumer.assignment():
                    consumer.seek(tp, self.history.next_offset(p))

    async def close(self) -> None:
        await self.reconciler.close()
