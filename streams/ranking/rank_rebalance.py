"""The ranking worker's rebalance listener: the group's revocations and assignments, passed to the
hand-over state machine (``streams.ranking.hand_over.HandOver``), which decides what they mean in
the state this process is in, and changes the worker's partitions through
``streams.ranking.partitions.Partitions``.

Primitives: ``RankRebalance(machine)`` (``listen(group)``; ``assigned_once``: set once the first assignment is
handled); ``Rebalanced``, what it needs of the machine; ``STAGE``.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

STAGE = "ranking"
"""The stage's name in offsets, lineage and dead letters."""


class Rebalanced(Protocol):
    async def revoked(self, tps: set[TopicPartition], group: AIOKafkaConsumer) -> None: ...

    async def assigned(self, tps: set[TopicPartition], group: AIOKafkaConsumer) -> None: ...


class RankRebalance(ConsumerRebalanceListener):
    """Passes ``group``'s rebalances to ``machine``."""

    def __init__(self, machine: Rebalanced) -> None:
        self.machine = machine
        self.group: AIOKafkaConsumer | None = None  # the consumer it listens to (``listen``)
        self.assigned_once = asyncio.Event()

    def listen(self, group: AIOKafkaConsumer) -> None:
        self.group = group

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        assert self.group is not None
        await self.machine.revoked(set(revoked), self.group)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        assert self.group is not None
        await self.machine.assigned(set(assigned), self.group)
        self.assigned_once.set()
