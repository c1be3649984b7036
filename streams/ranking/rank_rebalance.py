"""The ranking worker's rebalance listener: what a partition's arrival and departure mean.

- Revoked: finish (or give up on) the partition's signals and requests in flight, commit what is
  finished, forget its offsets, behaviour slices and alignment.
- Assigned: drop histories of another cluster or topic incarnation, rewind offsets committed to an
  earlier topic of the same name, resume each behaviours partition at the history table's own
  offset (not the group's) and time its catch-up to the partition's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

from relaygr.streams.common import commit_existing
from relaygr.streams.ranking.worker_port import WorkerPort
from relaygr.streams.state_lineage import rewind_old_topic_offsets

log = logging.getLogger("relaygr.streams.ranking.ranking_worker")

STAGE = "ranking"
"""The stage's name in offsets, lineage and dead letters."""


class RankRebalance(ConsumerRebalanceListener):
    """Commits what a revoked partition finished; resumes an assigned one where its state is."""

    def __init__(self, worker: WorkerPort, group_consumer: AIOKafkaConsumer) -> None:
        self.w = worker
        self.consumer = group_consumer  # the worker's own, once a standby switched to it
        self.assigned_once = asyncio.Event()

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        revoked = set(revoked)
        # Finish (or give up on) what is in flight for these partitions, then commit it.
        await self.w.drain(revoked, timeout_s=10)
        await self.w.finish_appliers(revoked)
        with contextlib.suppress(Exception):
            offsets = self.w.tracker.committable(revoked)
            if offsets:
                await commit_existing(self.consumer, offsets, incarnations=self.w.incarnations)
        self.w.tracker.forget(revoked)
        self.w.assigned -= revoked
        self.w.files.write_assignment([tp.partition for tp in self.w.assigned])
        for tp in revoked:
            if tp.topic == self.w.reg.name("routed_behaviors"):
                self.w.applier.forget(tp.partition)
                self.w.alignment.forget(tp.partition)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.w.assigned |= set(assigned)
        beh = self.w.reg.name("routed_behaviors")
        # Histories built from another cluster or an earlier incarnation of the topic are dropped.
        await self.w.lineage.verify(beh, [tp.partition for tp in assigned if tp.topic == beh])
        behaviours = [tp for tp in assigned if tp.topic == beh]
        # A committed request or signal offset read from an earlier topic of the same name (a
        # commit retried across its deletion and creation) would skip the new topic's first ones.
        group = f"{self.w.settings.topic_prefix}-ranking"
        await rewind_old_topic_offsets(
            STAGE,
            self.w.worker_id,
            group,
            self.consumer,
            self.w.incarnations,
            [tp for tp in assigned if tp.topic != beh],
        )
        for tp in behaviours:
            # The history table knows how far it got: resume there, not at the group offset.
            start = self.w.history.next_offset(tp.partition)
            self.consumer.seek(tp, start)
            self.w.alignment.forget(tp.partition)
            # Timed from here: the loop may apply fetched behaviours while this callback awaits.
            self.w.applier.catch_up(tp.partition, start)
        await self._track_catch_up(behaviours)
        self.w.files.write_assignment([tp.partition for tp in self.w.assigned if tp.topic == beh])
        self.w.note(event="assigned", partitions=sorted(tp.partition for tp in behaviours))
        self.assigned_once.set()
        log.info("%s assigned %s", self.w.worker_id, sorted((t.topic, t.partition) for t in assigned))

    async def _track_catch_up(self, behaviours: list[TopicPartition]) -> None:
        """Time the reading of each newly assigned behaviours partition up to its end now."""
        fresh = [tp for tp in behaviours if self.w.applier.needs_end(tp.partition)]
        if not fresh:
            return
        try:
            ends = await asyncio.wait_for(self.consumer.end_offsets(fresh), 5)
        except Exception:  # only a measurement: never hold up the assignment for it
            ends = {}
        for tp in fresh:
            self.w.applier.catch_up_to(tp.partition, ends.get(tp))
