"""What the standby and the rebalance listener use of a ranking worker: its parts, the state they
move a partition through, and the methods it offers them.

``streams.ranking.ranking_worker.RankingWorker`` has every member named here; ``streams.ranking.standby`` and
``streams.ranking.rank_rebalance`` talk to it through this protocol, so they import neither the worker's
module (which imports them) nor any of its private members.

Primitives: ``WorkerPort``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, TopicPartition

from relaygr.infra.incarnations import Incarnations
from relaygr.infra.rdkafka_producer import RdProducer
from relaygr.infra.settings import Settings
from relaygr.schemas import TopicRegistry
from relaygr.streams.config import PipelineSettings
from relaygr.streams.history import HistoryTable
from relaygr.streams.history_alignment import HistoryAlignment
from relaygr.streams.ranking.history_applier import BehaviourApplier
from relaygr.streams.ranking.offset_tracker import OffsetTracker
from relaygr.streams.ranking.rank_handler import RankHandler
from relaygr.streams.ranking.worker_files import WorkerFiles
from relaygr.streams.state_lineage import HistoryLineage
from relaygr.workers.engine.ranker import RankingEngine


class WorkerPort(Protocol):
    """A ranking worker as its standby and its rebalance listener see it."""

    # Its settings and parts.
    settings: Settings
    pipeline: PipelineSettings
    worker_id: str
    reg: TopicRegistry
    files: WorkerFiles
    state_dir: Path
    engine: RankingEngine
    history: HistoryTable
    alignment: HistoryAlignment
    lineage: HistoryLineage
    handler: RankHandler
    applier: BehaviourApplier
    incarnations: Incarnations
    tracker: OffsetTracker
    consumer: AIOKafkaConsumer
    producer: RdProducer

    # Where its partitions stand: assigned, held unfetched, or fetched and kept (a standby's).
    assigned: set[TopicPartition]
    held: set[TopicPartition]
    prefetched: dict[TopicPartition, deque]
    tasks: set[asyncio.Task]
    in_group: bool
    standing_by: bool
    handing_over: float
    before_fetch: Callable[[], Awaitable[None]] | None

    def note(self, **fields: object) -> None:
        """One line in the worker's ``events.jsonl``."""
        ...

    def take(self, tp: TopicPartition, m: Any) -> None:
        """Handle a fetched signal or request (by its topic) in a task of its own."""
        ...

    async def drain(self, tps: set[TopicPartition], timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the signals and requests of ``tps`` are handled."""
        ...

    async def finish_appliers(self, tps: set[TopicPartition] | None = None) -> None:
        """Wait until the behaviours fetched for ``tps`` (None: all) are applied."""
        ...

    async def commit(self) -> dict[TopicPartition, int]:
        """Commit what is finished (nothing outside the group)."""
        ...

    async def join_group(self) -> AIOKafkaConsumer:
        """Start the group member's consumer; return it once it has its first assignment."""
        ...

    def watch_lineage(self) -> None: ...

    def stop(self) -> None: ...

    async def serve(self) -> None: ...
