"""Storage tiers of the prefix store: byte-budgeted data structures without placement policy.

Primitives:
- ``MemoryTier``: an LRU-ordered map ``key -> (value, nbytes)`` with a byte budget it refuses to
  exceed (``TierFullError``). It never chooses victims itself; ``lru_keys`` lets the store's
  policy walk entries from least to most recently used and skip the ones it must keep.
- ``DiskTier``: encoded blobs, one file per prefix (``blob_files``: one large sequential read
  brings it back), and a persistent index in a RocksDB folder (through rocksdict: size, prefix
  length, fingerprint, write sequence) so that validity can be checked and the budget kept
  without reading any blob. Its LRU order is restored from write sequences on open.
- ``DiskSnapshot``: a read-only view of a ``DiskTier`` folder another process holds open (a
  RocksDB read-only instance of the index, and the blob files): for a successor that adopts its
  prefixes.
- ``encode_key`` / ``decode_key``: the byte form of a store key ``(user_id, model_version)``.
- ``Entry``, ``Plan``: the placement's records: one key's memory entry, and what a lookup must do.

Crash safety: a blob file is written under a temporary name and renamed, then its index record
is written; a deletion removes the index record first, then the file. So an index record never
names a file that was not written whole by the writer (a file torn by a machine crash before it
reached the disk fails the codec's checksum), and files without a record (a crash between the
two steps) are deleted at the next open. Folders of the older layout (blobs as RocksDB values)
are moved into files at open.

Why files rather than RocksDB's blob files: a 67 MB value read back through rocksdict runs at
about 330 MB/s, hot or cold, on a disk that reads 1.1-1.7 GB/s sequentially (docs/store.md).

Threading contract of ``DiskTier``: ``meta``, ``read``, ``read_into``, ``hide`` and ``used_bytes`` may be called
from any thread; ``write`` and ``delete`` from one thread at a time (the store's disk writer).
``MemoryTier`` is not thread-safe; the store guards it.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from rocksdict import AccessType, DBCompressionType, Options, Rdict, WriteBatch

from relaygr.workers.prefix_kv import PrefixKV
from relaygr.workers.store.blob_files import Alloc, BlobFiles, BlobRead

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

StoreKey = tuple[int | str, str]
"""(user_id, model_version)."""


class TierFullError(RuntimeError):
    """An insertion would take a tier over its byte budget."""


class MemoryTier(Generic[K, V]):
    """An LRU-ordered, byte-budgeted map. Oldest first in ``lru_keys``."""

    def __init__(self, name: str, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"{name}: budget_bytes must be >= 0")
        self.name = name
        self.budget_bytes = int(budget_bytes)
        self.used_bytes = 0
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def can_ever_hold(self, nbytes: int) -> bool:
        """False when ``nbytes`` exceeds the whole budget: such an entry skips this tier."""
        return nbytes <= self.budget_bytes

    def get(self, key: K, *, touch: bool = True) -> V | None:
        item = self._items.get(key)
        if item is None:
            return None
        if touch:
            self._items.move_to_end(key)
        return item[0]

    def touch(self, key: K) -> None:
        if key in self._items:
            self._items.move_to_end(key)

    def add(self, key: K, value: V, nbytes: int) -> None:
        """Insert as most recently used. The key must be absent and the bytes must fit."""
        if key in self._items:
            raise KeyError(f"{self.name}: {key!r} already present")
        if nbytes < 0:
            raise ValueError(f"{self.name}: negative size")
        if self.used_bytes + nbytes > self.budget_bytes:
            raise TierFullError(
                f"{self.name}: {nbytes} bytes do not fit ({self.used_bytes}/{self.budget_bytes} used)"
            )
        self._items[key] = (value, nbytes)
        self.used_bytes += nbytes

    def pop(self, key: K) -> V | None:
        item = self._items.pop(key, None)
        if item is None:
            return None
        self.used_bytes -= item[1]
        return item[0]

    def lru_keys(self) -> Iterator[K]:
        """Keys from least to most recently used. A live view: stop iterating before mutating."""
        return iter(self._items)

    def keys(self) -> list[K]:
        return list(self._items)


def encode_key(key: StoreKey) -> bytes:
    user_id, model_version = key
    if not isinstance(user_id, int | str) or isinstance(user_id, bool):
        raise TypeError(f"user_id must be int or str, got {type(user_id).__name__}")
    return json.dumps([model_version, user_id], separators=(",", ":")).encode()


def decode_key(raw: bytes) -> StoreKey:
    model_version, user_id = json.loads(raw)
    return (user_id, str(model_version))


@dataclass
class Entry:
    """One key's entry in a memory tier."""

    prefix: PrefixKV  # on the device: paged (``device_tier``); on host: dense, in the cold format
    nbytes: int
    tier: str  # "device" | "host"
    gen: int  # identity of this prefix version across moves between tiers
    on_disk: bool = False  # the disk tier holds exactly this version


@dataclass(frozen=True)
class DiskMeta:
    """What the disk index knows about one stored blob."""

    nbytes: int
    length: int
    fingerprint: bytes
    seq: int


@dataclass
class Plan:
    """What a lookup must do, decided under the placement's lock: ``device`` (found there),
    ``host`` (copy ``entry`` to the device), ``pending`` (copy a prefix on its way to disk),
    ``disk`` (read it), or ``done`` (a miss)."""

    kind: str
    entry: Entry | None = None
    pending: tuple[int, PrefixKV] | None = None
    disk_meta: DiskMeta | None = None
    invalidated: int = 0


VALUE_PREFIX = b"v/"  # the older layout's value record: seq (u64) + blob (moved to a file at open)
INDEX_PREFIX = b"i/"  # index record: nbytes, length, seq (u64 each) + fingerprint
BLOB_DIR = "blobs"  # the blob files, beside the index's RocksDB files
_SEQ = struct.Struct("<Q")
_META = struct.Struct("<QQQ")


def _disk_options() -> Options:
    """The folder's RocksDB options (a read-only view must open it with the same)."""
    opts = Options(raw_mode=True)
    # Tensor bytes barely compress; large values go to blob files (less rewriting on compaction).
    opts.set_compression_type(DBCompressionType.none())
    opts.set_enable_blob_files(True)
    opts.set_min_blob_size(32 << 10)
    opts.set_blob_compression_type(DBCompressionType.none())
    return opts


def _scan_index(db: Rdict) -> tuple[list[tuple[StoreKey, DiskMeta]], list[bytes]]:
    """The index records of ``db`` (key, meta), and the raw keys of those that do not parse."""
    found: list[tuple[StoreKey, DiskMeta]] = []
    stale: list[bytes] = []
    it = db.iter()
    it.seek(INDEX_PREFIX)
    while it.valid():
        raw_key = it.key()
        if not raw_key.startswith(INDEX_PREFIX):
            break
        raw_val = it.value()
        try:
            nbytes, length, seq = _META.unpack_from(raw_val, 0)
            fingerprint = bytes(raw_val[_META.size :])
            key = decode_key(raw_key[len(INDEX_PREFIX) :])
            found.append((key, DiskMeta(nbytes, length, fingerprint, seq)))
        except (struct.error, ValueError, TypeError):
            stale.append(raw_key)
        it.next()
    del it
    return found, stale


class DiskTier:
    """Encoded prefixes in a local folder (blob files and their RocksDB index), LRU-evicted to stay
    within ``budget_bytes``.

    The budget counts stored blob bytes. A write first evicts least recently used entries until
    the new value fits, so ``used_bytes <= budget_bytes`` holds whenever it is observed.
    """

    def __init__(self, path: str | os.PathLike[str], budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError("disk: budget_bytes must be >= 0")
        self.path = os.fspath(path)
        self.budget_bytes = int(budget_bytes)
        os.makedirs(self.path, exist_ok=True)
        opts = _disk_options()
        opts.create_if_missing(True)
        self._db = Rdict(self.path, opts)
        self.files = BlobFiles(os.path.join(self.path, BLOB_DIR))
        self._lock = threading.Lock()
        self._index: dict[StoreKey, DiskMeta] = {}
        self._lru: OrderedDict[StoreKey, None] = OrderedDict()
        self._used = 0
        self._next_seq = 1
        self._closed = False
        self._load_index()

    # -- opening -------------------------------------------------------------------------------

    def _load_index(self) -> None:
        found, stale = _scan_index(self._db)
        self.files.remove_temporaries()
        present = self.files.seqs()
        wb = WriteBatch(raw_mode=True)
        kept: list[tuple[StoreKey, DiskMeta]] = []
        for key, meta in found:
            if meta.seq in present or self._move_value_to_file(key, meta):
                kept.append((key, meta))
            else:
                stale.append(INDEX_PREFIX + encode_key(key))
        for raw_key in stale:
            wb.delete(raw_key)
            wb.delete(VALUE_PREFIX + raw_key[len(INDEX_PREFIX) :])
        self._db.write(wb)
        for seq in present - {meta.seq for _, meta in kept}:
            self.files.delete(seq)  # written, but its index record never was: a crash between
        kept.sort(key=lambda kv: kv[1].seq)
        for key, meta in kept:
            self._index[key] = meta
            self._lru[key] = None
            self._used += meta.nbytes
            self._next_seq = max(self._next_seq, meta.seq + 1)

    def _move_value_to_file(self, key: StoreKey, meta: DiskMeta) -> bool:
        """An entry of the older layout (its blob a RocksDB value): written as a file. False if
        it has no intact value."""
        vk = VALUE_PREFIX + encode_key(key)
        raw = self._db.get(vk)
        if raw is None or len(raw) < _SEQ.size or _SEQ.unpack_from(raw, 0)[0] != meta.seq:
            return False
        self.files.write(meta.seq, memoryview(raw)[_SEQ.size :])
        self._db.delete(vk)
        return True

    # -- reads (any thread) --------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    def list_keys(self) -> list[StoreKey]:
        with self._lock:
            return list(self._lru)

    def meta(self, key: StoreKey) -> DiskMeta | None:
        return self._index.get(key)

    def read_into(self, key: StoreKey, alloc: Alloc | None = None) -> tuple[BlobRead, int] | None:
        """``(read, seq)``: the stored blob of ``key`` read into ``alloc(n)`` (default: a fresh
        buffer), with its body's checksum; ``None`` when absent. Marks the key most recently used."""
        meta = self._index.get(key)
        if meta is None:
            return None
        got = self.files.read(meta.seq, meta.nbytes, alloc)
        if got is None:
            return None
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
        return got, meta.seq

    def read(self, key: StoreKey) -> tuple[memoryview, int] | None:
        """``(blob, seq)`` of the stored value in a fresh buffer, or ``None``."""
        got = self.read_into(key)
        return None if got is None else (got[0].blob, got[1])

    def hide(self, key: StoreKey, seq: int) -> bool:
        """Forget ``key`` in the in-memory index if it still holds ``seq`` (the bytes stay until
        ``delete``). Used when a reader finds an entry corrupt or invalid, so that nobody loads
        it again before the writer thread deletes it."""
        with self._lock:
            meta = self._index.get(key)
            if meta is None or meta.seq != seq:
                return False
            self._forget(key)
            return True

    def _forget(self, key: StoreKey) -> None:
        meta = self._index.pop(key, None)
        self._lru.pop(key, None)
        if meta is not None:
            self._used -= meta.nbytes

    # -- mutations (one writer thread) ---------------------------------------------------------

    def write(
        self, key: StoreKey, blob: bytes, length: int, fingerprint: bytes
    ) -> tuple[bool, list[StoreKey]]:
        """Store ``blob`` under ``key``, evicting least recently used other entries first.

        Returns ``(written, evicted_keys)``; a blob larger than the whole budget is not written.
        """
        nbytes = len(blob)
        if nbytes > self.budget_bytes:
            return False, []
        ek = encode_key(key)
        evicted: list[tuple[StoreKey, int]] = []
        wb = WriteBatch(raw_mode=True)
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            old = self._index.get(key)
            need = self._used - (old.nbytes if old else 0) + nbytes
            for victim in list(self._lru):
                if need <= self.budget_bytes:
                    break
                if victim == key:
                    continue
                need -= self._index[victim].nbytes
                evicted.append((victim, self._index[victim].seq))
            for victim, _ in evicted:
                self._forget(victim)
                wb.delete(INDEX_PREFIX + encode_key(victim))
            if old is not None:
                self._forget(key)
        replaced = self._stored_seq(ek)  # from the record: a hidden version has none in memory
        self.files.write(seq, blob)  # whole, under its final name, before its index record
        wb.put(INDEX_PREFIX + ek, _META.pack(nbytes, length, seq) + fingerprint)
        self._db.write(wb)
        for _, victim_seq in evicted:
            self.files.delete(victim_seq)
        if replaced is not None:
            self.files.delete(replaced)
        with self._lock:
            meta = DiskMeta(nbytes, length, bytes(fingerprint), seq)
            self._forget(key)  # a hide() may not have raced in, but be exact either way
            self._index[key] = meta
            self._lru[key] = None
            self._used += nbytes
        return True, [victim for victim, _ in evicted]

    def _stored_seq(self, ek: bytes) -> int | None:
        raw = self._db.get(INDEX_PREFIX + ek)
        return _META.unpack_from(raw, 0)[2] if raw is not None and len(raw) >= _META.size else None

    def delete(self, key: StoreKey, seq: int | None = None) -> bool:
        """Delete ``key`` (only the stored version ``seq`` when given). True when deleted."""
        ek = encode_key(key)
        stored = self._stored_seq(ek)
        if seq is not None and stored != seq:
            self.files.delete(seq)  # a version no record names any more
            return False
        wb = WriteBatch(raw_mode=True)
        wb.delete(VALUE_PREFIX + ek)
        wb.delete(INDEX_PREFIX + ek)
        self._db.write(wb)  # the record first: a file without one is deleted at the next open
        if stored is not None:
            self.files.delete(stored)
        with self._lock:
            meta = self._index.get(key)
            if meta is not None and (seq is None or meta.seq == seq):
                self._forget(key)
        return True

    def flush(self) -> None:
        self._db.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._db.flush()
        self._db.close()
        self.files.close()


class DiskSnapshot:
    """Another process's ``DiskTier`` folder, read-only, while that process keeps it open and
    writes. The view is the folder as it was at the open (its log replayed); ``catch_up`` opens
    it again. It writes nothing into the folder (its own log goes to ``own_dir``, the reader's).

    A RocksDB read-only instance (which takes no lock) rather than a secondary one: RocksDB does
    not support secondaries over blob files (rocksdb#13296), and with rocksdict 0.3 a secondary
    crashes the process on its first read of a value stored in a blob file. The index's table
    files the owner deletes meanwhile stay readable here (every file is kept open); a prefix's
    blob file the owner deletes (evicted or rewritten) reads as None.

    ``index()``: the index records, ``{key: DiskMeta}``; ``read(key, meta)``: the blob stored with
    ``meta``'s sequence number (its file, or a value of the older layout), or None (rewritten or
    deleted since); ``close()``. One thread at a time."""

    def __init__(self, path: str | os.PathLike[str], own_dir: str | os.PathLike[str]) -> None:
        self.path, self.own_dir = os.fspath(path), os.fspath(own_dir)
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"no disk tier at {self.path}")
        os.makedirs(self.own_dir, exist_ok=True)
        self._db: Rdict | None = None
        self._files = BlobFiles(os.path.join(self.path, BLOB_DIR), create=False)
        self.catch_up()

    def catch_up(self) -> None:
        """See what the folder holds now (a fresh view: see the class docstring)."""
        self._close_db()
        opts = _disk_options()
        opts.set_max_open_files(-1)  # files the owner deletes stay readable here
        opts.set_db_log_dir(self.own_dir)
        self._db = Rdict(self.path, opts, access_type=AccessType.read_only())

    def _open_db(self) -> Rdict:
        if self._db is None:
            raise RuntimeError(f"disk snapshot of {self.path} is closed")
        return self._db

    def index(self) -> dict[StoreKey, DiskMeta]:
        found, _ = _scan_index(self._open_db())
        return dict(found)

    def read(self, key: StoreKey, meta: DiskMeta) -> memoryview | None:
        db = self._open_db()
        got = self._files.read(meta.seq, meta.nbytes)
        if got is not None:
            return got.blob
        raw = db.get(VALUE_PREFIX + encode_key(key))  # an owner of the older layout
        if raw is None or len(raw) < _SEQ.size or _SEQ.unpack_from(raw, 0)[0] != meta.seq:
            return None
        return memoryview(raw)[_SEQ.size :]

    def _close_db(self) -> None:
        if self._db is not None:
            db, self._db = self._db, None
            db.close()

    def close(self) -> None:
        self._close_db()
        self._files.close()

    def __enter__(self) -> DiskSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
