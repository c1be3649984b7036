"""Per-user behaviour histories materialised from ``relaygr.behaviors`` into RocksDB (rocksdict).

Primitives:
- ``HistoryTable(path)``: ``append_many(partition, [(offset, event), ...])`` and
  ``get(user_id, before_ts)``. Each batch writes its events (one small key per event) and the
  partition's last applied offset atomically, so replaying the topic after a crash applies nothing
  twice: the behaviours topic is the changelog, and after a restart or a rebalance consumption
  resumes at ``next_offset(partition)``. Reads come from a byte-bounded in-memory copy (LRU per
  user) that is rebuilt from RocksDB on a miss, so the ranking path never re-reads a long history
  from disk and an append costs one record, not a rewrite of the history.
- ``partition_users(partition)`` / ``discard_partition(partition)``: the users whose events came
  from a partition, and dropping everything it contributed (its state no longer matches the
  cluster: see ``relaygr.streams.state_lineage``).
- ``pack`` / ``unpack``: a history as fixed-width records (item int64, action int16, ts float64).

A history is the order of the partition's log (append-only), which is what keeps a cached prefix
valid as the history grows. ``get(..., before_ts)`` keeps only events older than the request.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
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


def unpack(data: bytes | bytearray) -> np.ndarray:
    return np.frombuffer(bytes(data), dtype=RECORD)


def to_events(rec: np.ndarray) -> Events:
    return Events(
        torch.from_numpy(rec["item"].astype(np.int64)),
        torch.from_numpy(rec["action"].astype(np.int64)),
        torch.from_numpy(rec["ts"].astype(np.float64)),
    )


class HistoryTable:
    def __init__(self, path: str | Path, cache_bytes: int = 256 << 20) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        self._db = Rdict(str(path), options=opts)
        self._lock = threading.Lock()
        self._offsets: dict[int, int] = {}
        self._cache: OrderedDict[str, bytearray] = OrderedDict()
        self._cache_bytes, self._cache_limit = 0, cache_bytes

    # Keys: "o/<partition>" -> last applied offset; "n/<user>" -> event count;
    # "e/<user>\0<seq:012d>" -> one packed record (sorted by seq within the user);
    # "u/<partition>\0<user>" -> b"": the user's events came from that partition.
    @staticmethod
    def _okey(partition: int) -> bytes:
        return b"o/" + str(partition).encode()

    @staticmethod
    def _nkey(user_id: str) -> bytes:
        return b"n/" + user_id.encode()

    @staticmethod
    def _ukey(partition: int, user_id: str) -> bytes:
        return b"u/%d\x00" % partition + user_id.encode()

    @staticmethod
    def _ekey(user_id: str, seq: int) -> bytes:
        return b"e/" + user_id.encode() + b"\x00" + b"%012d" % seq

    def next_offset(self, partition: int) -> int:
        """First offset of ``partition`` not yet applied (0 for a new table)."""
        with self._lock:
            return self._next_offset(partition)

    def _next_offset(self, partition: int) -> int:
        if partition not in self._offsets:
            raw = self._db.get(self._okey(partition))
            self._offsets[partition] = int(raw) if raw is not None else -1
        return self._offsets[partition] + 1

    def _count(self, user_id: str) -> int:
        raw = self._db.get(self._nkey(user_id))
        return int(raw) if raw is not None else 0

    def append(self, partition: int, offset: int, event: BehaviorEvent) -> bool:
        """Apply one behaviour; False if that offset was applied before."""
        return self.append_many(partition, [(offset, event)]) == 1

    def append_many(self, partition: int, batch: Iterable[tuple[int, BehaviorEvent | None]]) -> int:
        """Apply a batch of one partition in offset order (``None`` = an offset to skip, e.g. a
        dead-lettered message). Returns how many events were applied."""
        with self._lock:
            start = self._next_offset(partition)
            wb = WriteBatch(raw_mode=True)
            counts: dict[str, int] = {}
            new: dict[str, list[bytes]] = {}
            last, applied = None, 0
            for offset, ev in batch:
                if offset < start or (last is not None and offset <= last):
                    continue
                last = offset
                if ev is None:
                    continue
                u = ev.user_id
                if u not in counts:
                    counts[u] = self._count(u)
                    if counts[u] == 0:
                        wb.put(self._ukey(partition, u), b"")
                rec = pack(np.array([ev.item_id]), np.array([ev.action]), np.array([ev.ts]))
                wb.put(self._ekey(u, counts[u]), rec)
                counts[u] += 1
                new.setdefault(u, []).append(rec)
                applied += 1
            if last is None:
                return 0
            for u, n in counts.items():
                wb.put(self._nkey(u), str(n).encode())
            wb.put(self._okey(partition), str(last).encode())
            self._db.write(wb)
            self._offsets[partition] = last
            for u, recs in new.items():
                cached = self._cache.get(u)
                if cached is not None:
                    added = b"".join(recs)
                    cached += added
                    self._cache_bytes += len(added)
            self._shrink()
            return applied

    def mark(self, partition: int, offset: int) -> None:
        """Record ``offset`` as applied without an event (a dead-lettered message)."""
        self.append_many(partition, [(offset, None)])

    def _load(self, user_id: str) -> bytearray:
        buf = self._cache.get(user_id)
        if buf is not None:
            self._cache.move_to_end(user_id)
            return buf
        buf = bytearray()
        prefix = b"e/" + user_id.encode() + b"\x00"
        for key, value in self._db.items(from_key=prefix):
            if not key.startswith(prefix):
                break
            buf += value
        self._cache[user_id] = buf
        self._cache_bytes += len(buf)
        self._shrink()
        return buf

    def _shrink(self) -> None:
        while self._cache_bytes > self._cache_limit and len(self._cache) > 1:
            _, buf = self._cache.popitem(last=False)
            self._cache_bytes -= len(buf)

    def records(self, user_id: str) -> np.ndarray:
        with self._lock:
            return unpack(self._load(user_id))

    def get(self, user_id: str, before_ts: float | None = None) -> Events:
        rec = self.records(user_id)
        if before_ts is not None and len(rec):
            rec = rec[rec["ts"] < before_ts]
        return to_events(rec)

    def partition_users(self, partition: int) -> list[str]:
        """Users whose events came from ``partition``."""
        with self._lock:
            return self._partition_users(partition)

    def _partition_users(self, partition: int) -> list[str]:
        prefix = self._ukey(partition, "")
        users = []
        for key in self._db.keys(from_key=prefix):
            if not key.startswith(prefix):
                break
            users.append(key[len(prefix) :].decode())
        return users

    def discard_partition(self, partition: int) -> int:
        """Delete what ``partition`` contributed (its users' events and counts, its offset), so
        that it is read again from offset 0. Returns how many events were deleted."""
        with self._lock:
            wb = WriteBatch(raw_mode=True)
            events = 0
            for u in self._partition_users(partition):
                n = self._count(u)
                events += n
                if n:
                    wb.delete_range(self._ekey(u, 0), self._ekey(u, n))
                wb.delete(self._nkey(u))
                wb.delete(self._ukey(partition, u))
                cached = self._cache.pop(u, None)
                if cached is not None:
                    self._cache_bytes -= len(cached)
            wb.delete(self._okey(partition))
            self._db.write(wb)
            self._offsets.pop(partition, None)
            return events

    def close(self) -> None:
        self._db.close()
