"""faust stages that follow the cluster: each changelog partition is checked before it is opened,
and each source partition resumes only at an offset read from the topic as it is now.

faust keeps a table partition's changelog offset inside that partition's RocksDB folder (the key
``__faust\\0offset__``) and, when recovery finds it above the changelog's last offset, stops
the whole app with ``ConsistencyError``. Here a partition is compared with the broker first
(cluster id, changelog topic id, offset against the log end) and, when it does not match,
emptied: recovery then rebuilds it from the changelog as for a new worker.

Primitives:
- ``STORE_URL``: the table store URL for ``make_app`` (faust's RocksDB store, checked).
- ``LineageCheckedStore``: the store; it uses the ``Reconciler`` that ``attach(app, ...)`` gave
  the app (its lineage file lives beside the tables).
- ``attach(app, stage, settings, datadir)``: give ``app`` its reconciler.
- ``TRANSPORT_SCHEME``: the broker URL scheme for ``make_app``: faust's aiokafka transport whose
  consumer stamps each commit with the topic id it read from and, on assignment, reads a
  partition from its start when the committed offset names an earlier incarnation of the topic
  (``relaygr.infra.incarnations``: a commit retried across a topic's deletion and creation).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import faust.stores
from aiokafka.errors import CommitFailedError
from faust.stores.rocksdb import Store as RocksDBStore
from faust.transport.drivers import TRANSPORTS
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP

from relaygr.infra.incarnations import Incarnations
from relaygr.infra.settings import Settings
from relaygr.streams.state_lineage import PartitionState, Reconciler, rewind_old_topic_offsets

log = logging.getLogger(__name__)

STORE_URL = "relaygr-rocksdb://"
faust.stores.STORES.aliases["relaygr-rocksdb"] = f"{__name__}:LineageCheckedStore"
TRANSPORT_SCHEME = "relaygr-kafka"
TRANSPORTS.aliases[TRANSPORT_SCHEME] = f"{__name__}:Transport"


def attach(app: Any, stage: str, settings: Settings, datadir: Path) -> None:
    app.relaygr_reconciler = Reconciler(stage, settings, Path(datadir) / "lineage.json")
    app.relaygr_settings = settings
    app.relaygr_stage = stage


class _IncarnationCheckedThread(faust_aiokafka.AIOKafkaConsumerThread):
    """The consumer thread of faust's aiokafka driver, with stamped commits and checked resumes."""

    _incarnations: Incarnations | None = None

    def _checker(self) -> Incarnations:
        if self._incarnations is None:
            self._incarnations = Incarnations(self.app.relaygr_settings)
        return self._incarnations

    async def seek_to_committed(self) -> Mapping[TP, int]:
        return await self.call_thread(self._seek_checked)

    async def _seek_checked(self) -> Mapping[TP, int]:
        consumer = self._ensure_consumer()
        committed = dict(await consumer.seek_to_committed())
        stage = getattr(self.app, "relaygr_stage", "faust")
        stale = await rewind_old_topic_offsets(
            stage, self.app.conf.id, self.app.conf.id, consumer, self._checker(), consumer.assignment()
        )
        for tp in stale:
            committed[tp] = None
        return committed

    async def commit(self, offsets: Mapping[TP, int]) -> bool:
        return await self.call_thread(self._commit_stamped, offsets)

    async def _commit_stamped(self, offsets: Mapping[TP, int]) -> bool:
        consumer = self._ensure_consumer()
        assigned = consumer.assignment()
        mine = {faust_aiokafka.ensure_aiokafka_TP(tp): o for tp, o in offsets.items() if tp in assigned}
        # Stamped with the ids learnt at assignment: the incarnation these offsets were read from
        # (learnt now, a retried commit of the old topic's offsets would name the new one).
        checker = self._checker()
        try:
            await consumer.commit(checker.stamp(mine))
        except CommitFailedError as e:
            if "already rebalanced" in str(e):
                return False
            await self.crash(e)
            return False
        except Exception as e:
            log.exception("committing %s failed", sorted(mine))
            await self.crash(e)
            return False
        now = time.monotonic()
        self.tp_last_committed_at.update({tp: now for tp in offsets if tp in assigned})
        return True


class Consumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> faust_aiokafka.AIOKafkaConsumerThread:
        return _IncarnationCheckedThread(self, loop=self.loop, beacon=self.beacon)


class Transport(faust_aiokafka.Transport):
    """faust's aiokafka transport with ``Consumer`` above."""

    Consumer = Consumer


class LineageCheckedStore(RocksDBStore):
    """faust's RocksDB table store; a newly assigned changelog partition (active or standby)
    that no longer matches the cluster is emptied before faust reads its persisted offset."""

    async def assign_partitions(self, table: Any, tps: set[TP], generation_id: int = 0) -> None:
        reconciler: Reconciler | None = getattr(self.app, "relaygr_reconciler", None)
        changelogs = table.changelog_topic.topics
        by_topic: dict[str, list[int]] = {}
        for tp in tps:
            if tp.topic in changelogs:
                by_topic.setdefault(tp.topic, []).append(tp.partition)
        if reconciler is not None and by_topic:
            try:
                for topic, parts in sorted(by_topic.items()):
                    await reconciler.reconcile(
                        table.name,
                        topic,
                        parts,
                        lambda p, topic=topic: self._lineage_state(topic, p),
                        self._empty_partition,
                    )
            finally:
                await reconciler.close()  # assignments are rare: no connection kept in between
        await super().assign_partitions(table, tps, generation_id)

    def _lineage_state(self, topic: str, partition: int) -> PartitionState:
        if not self.partition_path(partition).exists():
            return PartitionState(False)
        db = self._db_for_partition(partition)
        present = next(iter(self._all_keys(db)), None) is not None
        return PartitionState(present, self.persisted_offset(TP(topic, partition)))

    def _all_keys(self, db: Any):
        if self.use_rocksdict:
            return db.keys()
        it = db.iterkeys()
        it.seek_to_first()
        return it

    def _empty_partition(self, partition: int) -> None:
        """Delete every key of the partition, its persisted changelog offset included. The folder
        stays: faust may still hold a handle to it, and another handle on a new folder would not
        see that one's writes."""
        db = self._db_for_partition(partition)
        keys = list(self._all_keys(db))
        if self.use_rocksdict:
            from rocksdict import WriteBatch

            for start in range(0, len(keys), 10_000):
                wb = WriteBatch(raw_mode=True)
                for key in keys[start : start + 10_000]:
                    wb.delete(key)
                db.write(wb)
        else:
            for key in keys:
                db.delete(key)
        self._key_index.clear()  # it maps keys to partitions, this one's included
