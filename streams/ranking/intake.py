"""The ranking worker's consumers: which one its loop reads from, and the commits made through it.

A worker reads as a member of the ranking group (static membership under its id, the range
assignor, the rebalance listener ``streams.ranking.rank_rebalance.RankRebalance``), its records
fetched by librdkafka (``relaygr.infra.rdkafka_fetch``; ``RELAYGR_FETCH_CLIENT=aiokafka``:
by aiokafka on the event loop). A standby reads
the same partitions outside the group first (manual assignment) and switches to the group's
consumer once it has taken over (``streams.ranking.hand_over``).

Primitives: ``Intake(settings, reg, worker_id, incarnations, static_membership)``: ``consumer``
(the one the loop reads from), ``start_group(machine)``, ``join(machine)`` (started, first
assignment received), ``start_outside()``, ``switch(group)``, ``commit(offsets, consumer)``,
``rewind(consumer, tps)``; ``GROUP_SUFFIX``, ``Consumer`` (either client's).
"""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor

from relaygr.infra.incarnations import Incarnations
from relaygr.infra.kafka import consumer as new_consumer
from relaygr.infra.rdkafka_fetch import RdFetchConsumer, fetching
from relaygr.infra.settings import Settings
from relaygr.schemas import TopicRegistry
from relaygr.streams.common import commit_existing
from relaygr.streams.ranking.rank_rebalance import STAGE, RankRebalance, Rebalanced
from relaygr.streams.state_lineage import rewind_old_topic_offsets

GROUP_SUFFIX = "-ranking"  # the ranking group: <topic prefix>-ranking
MAX_RECORDS = 500  # at most this many records a fetch
# Paused work partitions (the bounded queue) are fetched again only once the fetch in flight
# returns: a short broker-side wait bounds that stall (default: 500 ms).
FETCH_MAX_WAIT_MS = 20

Consumer = AIOKafkaConsumer | RdFetchConsumer


class Intake:
    """Which consumer the worker's loop reads from, and how it commits (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        reg: TopicRegistry,
        worker_id: str,
        incarnations: Incarnations,
        *,
        static_membership: bool = True,
    ) -> None:
        self.settings, self.reg, self.worker_id = settings, reg, worker_id
        self.incarnations = incarnations
        self.static_membership = static_membership
        self.group = f"{settings.topic_prefix}{GROUP_SUFFIX}"
        self._consumer: Consumer | None = None

    def _fetching(self, inner: AIOKafkaConsumer) -> Consumer:
        """``inner``, its records fetched by the client the settings name."""
        return fetching(inner, self.settings, fetch_max_wait_ms=FETCH_MAX_WAIT_MS, max_records=MAX_RECORDS)

    @property
    def consumer(self) -> Consumer:
        """The consumer the loop reads from."""
        if self._consumer is None:
            raise RuntimeError("the worker reads from no consumer yet")
        return self._consumer

    @property
    def started(self) -> bool:
        return self._consumer is not None

    def group_consumer(self, machine: Rebalanced) -> tuple[Consumer, RankRebalance]:
        """The group member's consumer (not started), subscribed with a rebalance listener that
        passes its rebalances to ``machine``; and the listener."""
        topics = [self.reg.name("routed_behaviors"), self.reg.name("prefill"), self.reg.name("rank")]
        kw = {}
        if self.static_membership:
            kw["group_instance_id"] = self.worker_id
        inner = new_consumer(
            self.settings,
            group_id=self.group,
            max_poll_records=MAX_RECORDS,
            fetch_max_wait_ms=FETCH_MAX_WAIT_MS,
            session_timeout_ms=10000,
            heartbeat_interval_ms=1000,
            max_poll_interval_ms=300000,
            # Partition p of every topic to the same member, with any number of members
            # (round-robin, aiokafka's default, interleaves topics and breaks that past two).
            partition_assignment_strategy=(RangePartitionAssignor,),
            **kw,
        )
        group = self._fetching(inner)
        listener = RankRebalance(machine)
        listener.listen(group)
        group.subscribe(topics, listener=listener)
        return group, listener

    async def start_group(self, machine: Rebalanced) -> Consumer:
        """Read as a member of the group from now on (an active worker's start)."""
        self._consumer, _ = self.group_consumer(machine)
        await self._consumer.start()
        return self._consumer

    async def join(self, machine: Rebalanced) -> Consumer:
        """Start the group member's consumer and return it once it has its first assignment; the
        loop still reads from the consumer outside the group (a standby after its take-over)."""
        group, listener = self.group_consumer(machine)
        await group.start()
        await listener.assigned_once.wait()
        return group

    async def start_outside(self) -> Consumer:
        """Read outside the group (manual assignment) from now on (a standby's start)."""
        self._consumer = self._fetching(
            new_consumer(
                self.settings,
                group_id=None,
                max_poll_records=MAX_RECORDS,
                fetch_max_wait_ms=FETCH_MAX_WAIT_MS,
            )
        )
        await self._consumer.start()
        return self._consumer

    def switch(self, group: Consumer) -> Consumer:
        """The loop reads from ``group`` from its next fetch on; returns the consumer it read from."""
        before, self._consumer = self.consumer, group
        return before

    async def commit(self, offsets: dict[TopicPartition, int], consumer: Consumer | None = None) -> None:
        """Commit ``offsets`` through ``consumer`` (a group member's; None: the loop's)."""
        if offsets:
            await commit_existing(consumer or self.consumer, offsets, incarnations=self.incarnations)

    async def rewind(self, consumer: Consumer, tps: list[TopicPartition]) -> None:
        """A committed request or signal offset read from an earlier topic of the same name (a
        commit retried across its deletion and creation) would skip the new topic's first ones:
        those partitions are read from their start."""
        await rewind_old_topic_offsets(STAGE, self.worker_id, self.group, consumer, self.incarnations, tps)
