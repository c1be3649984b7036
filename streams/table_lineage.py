"""faust tables that follow the cluster: each changelog partition is checked before it is opened.

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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import faust.stores
from faust.stores.rocksdb import Store as RocksDBStore
from faust.types import TP

from relaygr.infra.settings import Settings
from relaygr.streams.state_lineage import PartitionState, Reconciler

STORE_URL = "relaygr-rocksdb://"
faust.stores.STORES.aliases["relaygr-rocksdb"] = f"{__name__}:LineageCheckedStore"


def attach(app: Any, stage: str, settings: Settings, datadir: Path) -> None:
    app.relaygr_reconciler = Reconciler(stage, settings, Path(datadir) / "lineage.json")


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
