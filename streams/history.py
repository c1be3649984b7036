"""Per-user behaviour histories materialised from ``relaygr.behaviors`` into RocksDB (rocksdict).

Primitives:
- ``HistoryTable(path)``: ``append(partition, offset, event)`` and ``get(user_id, before_ts)``.
  Each write stores the event and the partition's last applied offset in one atomic batch, so
  replaying the topic after a crash applies nothing twice (the behaviours topic is the changelog:
  after a restart or a rebalance, consumption resumes at ``next_offset(partition)``).
- ``pack`` / ``unpack``: a history as fixed-width records (item int64, action int16, ts float64).

A history is the order of the partition's log (append-only), which is what keeps a cached prefix
valid as the history grows. ``get(..., before_ts)`` keeps only events older than the request.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch
from rocksdict import Options, Rdict, WriteBatch

from relaygr.schemas import BehaviorEvent
from relaygr.workers.prefix_kv import Events

RECORD = np.dtype([("item", "<i8"), ("action", "<i2"), ("ts", "<f8")])


def pack(items: np.ndarray, actions: np.ndarray, ts: np.ndarray) -> bytes:
    rec = np.empty(len(items), dtype=RECORD)
    rec["item"], rec["action"], rec["ts"] = items, actions, ts
    return rec.tobytes()


def unpack(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=RECORD)


def to_events(rec: np.ndarray) -> Events:
    return Events(
        torch.from_numpy(rec["item"].astype(np.int64)),
        torch.from_numpy(rec["action"].astype(np.int64)),
        torch.from_numpy(rec["ts"].astype(np.float64)),
    )


class HistoryTable:
    def __init__(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        self._db = Rdict(str(path), options=opts)
        self._lock = threading.Lock()
        self._offsets: dict[int, int] = {}

    @staticmethod
    def _hkey(user_id: str) -> bytes:
        return b"h/" + user_id.encode()

    @staticmethod
    def _okey(partition: int) -> bytes:
        return b"o/" + str(partition).encode()

    def next_offset(self, partition: int) -> int:
        """First offset of ``partition`` not yet applied (0 for a new table)."""
        with self._lock:
            if partition not in self._offsets:
                raw = self._db.get(self._okey(partition))
                self._offsets[partition] = int(raw) if raw is not None else -1
            return self._offsets[partition] + 1

    def append(self, partition: int, offset: int, event: BehaviorEvent) -> bool:
        """Apply one behaviour; False if that offset was applied before."""
        if offset < self.next_offset(partition):
            return False
        rec = pack(np.array([event.item_id]), np.array([event.action]), np.array([event.ts]))
        with self._lock:
            key = self._hkey(event.user_id)
            old = self._db.get(key)
            wb = WriteBatch(raw_mode=True)
            wb.put(key, (old or b"") + rec)
            wb.put(self._okey(partition), str(offset).encode())
            self._db.write(wb)
            self._offsets[partition] = offset
        return True

    def mark(self, partition: int, offset: int) -> None:
        """Record ``offset`` as applied without an event (a dead-lettered message)."""
        if offset < self.next_offset(partition):
            return
        with self._lock:
            self._db[self._okey(partition)] = str(offset).encode()
            self._offsets[partition] = offset

    def records(self, user_id: str) -> np.ndarray:
        raw = self._db.get(self._hkey(user_id))
        return unpack(raw) if raw else np.empty(0, dtype=RECORD)

    def get(self, user_id: str, before_ts: float | None = None) -> Events:
        rec = self.records(user_id)
        if before_ts is not None and len(rec):
            rec = rec[rec["ts"] < before_ts]
        return to_events(rec)

    def close(self) -> None:
        self._db.close()
