"""Per-user behaviour histories materialised from ``relaygr.behaviors`` into RocksDB (rocksdict).

Primitives:
- ``HistoryTable(path)``: ``append_many(partition, [(offset, event), ...])`` and
  ``get(user_id, before_ts)``. Each batch writes its events (one key per run of a user's events,
  packed with numpy: a burst costs a few writes, not one per event) and the
  partition's last applied offset atomically, so replaying the topic after a crash applies nothing
  twice: the behaviours topic is the changelog, and after a restart or a rebalance consumption
  resumes at ``next_offset(partition)``. Reads come from a byte-bounded in-memory copy (LRU per
  user) that is rebuilt from RocksDB on a miss, so the ranking path never re-reads a long history
  from disk and an append costs one record, not a rewrite of the history.
- ``partition_users(partition)`` / ``discard_partition(partition)``: the users whose events came
  from a partition, and dropping everything it contributed (its state no longer matches the
  cluster: see ``relaygr.streams.state_lineage``).
- ``pack`` / ``unpack``: a history as fixed-width records (item int64, action int16, ts float64;
  ``RECORD``, with the packing of incoming behaviours, is ``relaygr.streams.history_records``).
  The item column holds ``relaygr.workers.model.vocab.item_key`` of the raw id: an integer id as is, a
  string id as its 64-bit hash. Keys, not model ids, so the table does not depend on the
  checkpoint: a model with another vocabulary maps the same table when it serves it.
- Retention: with ``retain_events``, a user's oldest events beyond it are dropped in whole
  ``retain_align`` steps (``first(user)`` is the absolute index of the oldest one kept), so a
  user with tens of thousands of events costs a bounded amount of disk and memory.
- Routed input (``relaygr.schemas.routing``): a ``BehaviorBatch`` names the public record each of
  its events was forwarded from (as may a single event: ``(offset, event, (partition, offset))``),
  and a copy of an event already applied is dropped; ``progress=`` merges the ingress's progress records of the batch,
  and ``progress(partition)`` says which public behaviours every applied user history covers.
  Both are written in the batch's atomic write, like the offset.

A history is the order of the partition's log (append-only), which is what keeps a cached prefix
valid as the history grows. ``get(..., before_ts)`` keeps only events older than the request.
Waiting for a table to cover what a request must see is ``streams.history_alignment``'s.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from rocksdict import Options, Rdict, WriteBatch

from relaygr.schemas import BehaviorBatch, BehaviorEvent
from relaygr.schemas.routing import Positions, decode_positions, encode_positions
from relaygr.streams.history_records import RECORD, batch_records, event_record
from relaygr.workers.prefix_kv import Events

# A user's events are stored as runs of records, one key per run (one RocksDB write for a whole
# burst of a user, not one per event); runs never cross a multiple of this.
RUN_EVENTS = 512


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


class _Collected(NamedTuple):
    """What a batch adds to the table (``HistoryTable._collect``)."""

    last: int | None  # its last offset not applied before (None: it has none)
    applied: int  # events applied
    counts: dict[str, int]  # user -> event count before the batch
    new: dict[str, list[bytes]]  # user -> packed records of the batch, in order
    added: dict[str, int]  # user -> events in ``new``
    sources: dict[str, Positions]  # user -> source partition -> last applied offset
    incarnation: dict[str, str | None]  # user -> id of the public topic of ``sources``
    moved: set[str]  # users whose sources (or their topic) changed


class HistoryTable:
    def __init__(
        self,
        path: str | Path,
        cache_bytes: int = 256 << 20,
        *,
        retain_events: int | None = None,
        retain_align: int = 1,
    ) -> None:
        """``retain_events``: keep at least this many of each user's most recent events (and
        fewer than ``retain_events`` plus a quarter), dropping older ones in multiples of
        ``retain_align`` events (the serving window's step, so the window never loses an event
        it serves); None keeps everything."""
        Path(path).mkdir(parents=True, exist_ok=True)
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        self._db = Rdict(str(path), options=opts)
        self._lock = threading.Lock()
        self._offsets: dict[int, int] = {}
        self._progress: dict[int, Positions] = {}  # routed partition -> the ingress's progress
        self._cache: OrderedDict[str, bytearray] = OrderedDict()
        self._changes, self._versions = 0, {}  # user -> number of its last change (``version``)
        self._cache_bytes, self._cache_limit = 0, cache_bytes
        self._retain, self._align = retain_events, max(1, retain_align)
        self.trimmed_events = 0  # events dropped by retention, since start

    # Keys: "o/<partition>" -> last applied offset; "n/<user>" -> event count;
    # "e/<user>\0<seq:012d>" -> packed records of events seq, seq+1, ... (a run, never across a
    #     multiple of RUN_EVENTS; sorted by seq within the user, concatenated on read);
    # "s/<user>" -> last applied source offset per source partition (JSON);
    # "t/<user>" -> id of the public topic those offsets belong to (absent: not known);
    # "m/<partition>" -> the ingress's progress as of the last applied progress record (JSON).
    # "u/<partition>\0<user>" -> b"": the user's events came from that partition.
    # "f/<user>" -> seq of the user's oldest retained event (absent: 0).
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

    def _positions(self, cache: dict[int, Positions], tag: bytes, partition: int) -> Positions:
        if partition not in cache:
            raw = self._db.get(tag + str(partition).encode())
            cache[partition] = decode_positions(raw) if raw is not None else {}
        return cache[partition]

    def progress(self, partition: int) -> Positions:
        """How far the ingress had forwarded each public behaviours partition, as of the last
        progress record applied from ``partition``: every such behaviour of this partition's users
        is in the table."""
        with self._lock:
            return dict(self._positions(self._progress, b"m/", partition))

    def _sources_of(self, user_id: str) -> Positions:
        raw = self._db.get(b"s/" + user_id.encode())
        return decode_positions(raw) if raw is not None else {}

    def _source_topic_of(self, user_id: str) -> str | None:
        raw = self._db.get(b"t/" + user_id.encode())
        return bytes(raw).decode() if raw is not None else None

    def _first(self, user_id: str) -> int:
        raw = self._db.get(b"f/" + user_id.encode())
        return int(raw) if raw is not None else 0

    def first(self, user_id: str) -> int:
        """Absolute index of the user's oldest retained event (older ones were dropped)."""
        with self._lock:
            return self._first(user_id)

    def _count(self, user_id: str) -> int:
        raw = self._db.get(self._nkey(user_id))
        return int(raw) if raw is not None else 0

    def append(self, partition: int, offset: int, event: BehaviorEvent) -> bool:
        """Apply one behaviour; False if that offset was applied before."""
        return self.append_many(partition, [(offset, event)]) == 1

    def append_many(
        self,
        partition: int,
        batch: Iterable[tuple],
        *,
        progress: Positions | None = None,
    ) -> int:
        """Apply a batch of one partition in offset order: ``(offset, event)``, ``(offset,
        event, (source partition, source offset))`` or ``(offset, BehaviorBatch)`` (its events carry
        their sources); ``None`` as the event is an offset to skip (a dead-lettered message, a
        progress record). ``progress`` is the newest progress record
        of the batch. Returns how many events were applied."""
        with self._lock:
            wb = WriteBatch(raw_mode=True)
            got = self._collect(partition, batch, wb)
            if got.last is None:
                return 0
            trims = self._write_users(wb, got)
            for u in got.moved:
                wb.put(b"s/" + u.encode(), encode_positions(got.sources[u]))
                if got.incarnation[u] is not None:
                    wb.put(b"t/" + u.encode(), got.incarnation[u].encode())
            if progress:
                marks = self._positions(self._progress, b"m/", partition)
                for q, pos in progress.items():
                    marks[q] = max(marks.get(q, 0), pos)
                wb.put(b"m/" + str(partition).encode(), encode_positions(marks))
            wb.put(self._okey(partition), str(got.last).encode())
            self._db.write(wb)
            self._offsets[partition] = got.last
            self._cache_appended(got.new, trims)
            self._changed([*got.new, *trims])
            return got.applied

    def _collect(self, partition: int, batch: Iterable[tuple], wb: WriteBatch) -> _Collected:
        """The batch's records not applied before, packed per user, with the users' counts and
        source positions as they were (a new user of the partition is noted in ``wb``)."""
        start = self._next_offset(partition)
        counts: dict[str, int] = {}
        new: dict[str, list[bytes]] = {}
        added: dict[str, int] = {}
        last, applied = None, 0
        sources: dict[str, Positions] = {}
        incarnation: dict[str, str | None] = {}
        moved: set[str] = set()
        for offset, ev, *src in batch:
            if offset < start or (last is not None and offset <= last):
                continue
            last = offset
            if ev is None:
                continue
            u = ev.user_id
            if u not in sources:
                sources[u] = self._sources_of(u)
                incarnation[u] = self._source_topic_of(u)
            sid = ev.source_topic_id if isinstance(ev, BehaviorBatch) else None
            if sid is not None and sid != incarnation[u]:
                # Read from another public topic of that name (recreated): its offsets start
                # over, so the positions applied from the earlier one say nothing.
                if incarnation[u] is not None:
                    sources[u] = {}
                incarnation[u] = sid
                moved.add(u)
            if isinstance(ev, BehaviorBatch):
                recs, n = batch_records(ev, sources[u])
            else:
                recs, n = event_record(ev, src[0] if src else None, sources[u])
            if not n:
                continue  # forwarded twice (the ingress restarted before committing)
            if isinstance(ev, BehaviorBatch) or src:
                moved.add(u)
            if u not in counts:
                counts[u] = self._count(u)
                if counts[u] == 0:
                    wb.put(self._ukey(partition, u), b"")
            new.setdefault(u, []).append(recs)
            added[u] = added.get(u, 0) + n
            applied += n
        return _Collected(last, applied, counts, new, added, sources, incarnation, moved)

    def _write_users(self, wb: WriteBatch, got: _Collected) -> dict[str, int]:
        """Each user's new count and runs into ``wb``, dropping by retention what it no longer
        keeps; returns how many events each trimmed user lost."""
        trims: dict[str, int] = {}
        for u, base in got.counts.items():
            n = base + got.added[u]
            wb.put(self._nkey(u), str(n).encode())
            keep_from = first = self._first(u)
            if self._retain is not None and n - first > self._retain + max(self._align, self._retain // 4):
                keep_from = (n - self._retain) // self._align * self._align
                if keep_from > base:  # every stored event goes, and this batch's oldest ones
                    wb.delete_range(self._ekey(u, first), self._ekey(u, base))
                else:
                    self._keep_tail_of_run(wb, u, keep_from)
                    wb.delete_range(self._ekey(u, first), self._ekey(u, keep_from))
                wb.put(b"f/" + u.encode(), str(keep_from).encode())
                trims[u] = keep_from - first
            self._put_runs(wb, u, base, b"".join(got.new[u]), keep_from)
        return trims

    def _cache_appended(self, new: dict[str, list[bytes]], trims: dict[str, int]) -> None:
        """The cached copies of the users' histories after a written batch: its records added,
        what retention dropped taken off."""
        for u, recs in new.items():
            cached = self._cache.get(u)
            if cached is not None:
                data = b"".join(recs)
                cached += data
                self._cache_bytes += len(data)
        for u, dropped in trims.items():
            self.trimmed_events += dropped
            cached = self._cache.get(u)
            if cached is not None:
                del cached[: dropped * RECORD.itemsize]
                self._cache_bytes -= dropped * RECORD.itemsize
        self._shrink()

    def _put_runs(self, wb: WriteBatch, user_id: str, seq: int, data: bytes, keep_from: int) -> None:
        """Write a user's new events (``data``, starting at event ``seq``) as runs of records, one
        key per run, split at multiples of RUN_EVENTS, leaving out those before ``keep_from``."""
        size = RECORD.itemsize
        end = seq + len(data) // size
        if seq < keep_from:
            data = data[(keep_from - seq) * size :]
            seq = keep_from
        pos = 0
        while seq < end:
            stop = min(end, (seq // RUN_EVENTS + 1) * RUN_EVENTS)
            wb.put(self._ekey(user_id, seq), data[pos : pos + (stop - seq) * size])
            pos += (stop - seq) * size
            seq = stop

    def _keep_tail_of_run(self, wb: WriteBatch, user_id: str, keep_from: int) -> None:
        """Before the events below ``keep_from`` are deleted by key range: a stored run that starts
        below it and reaches past it has its tail written again under the key of ``keep_from``."""
        it = self._db.iter()
        it.seek_for_prev(self._ekey(user_id, keep_from))
        prefix = b"e/" + user_id.encode() + b"\x00"
        if not it.valid() or not bytes(it.key()).startswith(prefix):
            return
        run_start = int(bytes(it.key())[len(prefix) :])
        value = bytes(it.value())
        if run_start < keep_from < run_start + len(value) // RECORD.itemsize:
            wb.put(self._ekey(user_id, keep_from), value[(keep_from - run_start) * RECORD.itemsize :])

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

    def _changed(self, users: Iterable[str]) -> None:
        self._changes += 1
        self._versions.update(dict.fromkeys(users, self._changes))

    def version(self, user_id: str) -> int:
        """Changes whenever ``user_id``'s records do: equal versions, equal records, at any length."""
        return self._versions.get(user_id, 0)

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
                wb.delete(b"s/" + u.encode())  # its routed sources: a new topic starts at 0
                wb.delete(b"t/" + u.encode())
                wb.delete(b"f/" + u.encode())
                wb.delete(self._ukey(partition, u))
                cached = self._cache.pop(u, None)
                if cached is not None:
                    self._cache_bytes -= len(cached)
                self._changed([u])
            wb.delete(self._okey(partition))
            wb.delete(b"m/" + str(partition).encode())  # the ingress's progress in the old topic
            self._db.write(wb)
            self._offsets.pop(partition, None)
            self._progress.pop(partition, None)
            return events

    def close(self) -> None:
        self._db.close()
