"""The prefix store's disk write-back queue: writes and deletes on one thread, off every other path.

Primitives:
- ``DiskWriter(disk, backlog_bytes, lock, counters, on_landed, cold_format=...)``: the writer
  thread of a ``DiskTier``; it writes each prefix in the store's cold format (``kv_formats``).
  - ``enqueue(key, gen, prefix, force=False) -> bool``: queue a write of version ``gen`` of
    ``key``; refused (counted in ``disk_write_drops``) when the bytes waiting would exceed
    ``backlog_bytes``. Until it lands the copy is ``pending`` and readers serve it from memory.
  - ``pending_gen(key)``, ``pending_prefix(key)``, ``pending_bytes``, ``pending_keys()``.
  - ``discard(key, seq)``: hide a stored version now and delete it behind the queued writes.
  - ``flush(timeout_s)``: wait until everything queued so far has landed. ``close()``.

When a write lands (or fails), ``on_landed(key, gen, written, was_pending, evicted)`` runs under
``lock``: the store updates its entries from it. Counters: ``disk_writes``,
``disk_bytes_written``, ``disk_write_drops``, ``disk_write_errors``.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from relaygr.workers.prefix_kv import PrefixKV
from relaygr.workers.store.kv_codec import encode
from relaygr.workers.store.kv_formats import ColdFormat, to_cold
from relaygr.workers.store.tiers import DiskTier, StoreKey

log = logging.getLogger(__name__)

OnLanded = Callable[[StoreKey, int, bool, bool, list[StoreKey]], None]


class DiskWriter:
    def __init__(
        self,
        disk: DiskTier,
        backlog_bytes: int,
        lock: threading.RLock,
        counters: Counter[str],
        on_landed: OnLanded,
        *,
        cold_format: ColdFormat = "exact",
    ) -> None:
        self.disk = disk
        self.cold_format = cold_format
        self.backlog_bytes = backlog_bytes
        self._lock = lock
        self._m = counters
        self._on_landed = on_landed
        self._pending: dict[StoreKey, tuple[int, PrefixKV]] = {}
        self.pending_bytes = 0
        self._closed = False
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="prefix-store-disk-write")

    # -- the queue (lock held) -------------------------------------------------------------------

    def pending_gen(self, key: StoreKey) -> int | None:
        pend = self._pending.get(key)
        return None if pend is None else pend[0]

    def pending_prefix(self, key: StoreKey) -> tuple[int, PrefixKV] | None:
        return self._pending.get(key)

    def pending_keys(self) -> list[StoreKey]:
        return list(self._pending)

    def enqueue(self, key: StoreKey, gen: int, prefix: PrefixKV, *, force: bool = False) -> bool:
        nb = prefix.nbytes()
        if not force and self.pending_bytes + nb > self.backlog_bytes:
            self._m["disk_write_drops"] += 1
            return False
        self._pending[key] = (gen, prefix)
        self.pending_bytes += nb
        self._thread.submit(self._write, key, gen, prefix, nb)
        return True

    def discard(self, key: StoreKey, seq: int) -> None:
        """Hide version ``seq`` of ``key`` now; delete it on the writer thread (after pending writes)."""
        self.disk.hide(key, seq)
        if not self._closed:
            self._thread.submit(self._delete, key, seq)

    def delete_all(self, key: StoreKey) -> None:
        """Delete every stored version of ``key`` on the writer thread, behind any queued write of
        it (so that nothing lands on disk after the deletion)."""
        if not self._closed:
            self._thread.submit(self._delete, key, None)

    # -- the writer thread -----------------------------------------------------------------------

    def _write(self, key: StoreKey, gen: int, prefix: PrefixKV, nb: int) -> None:
        written, evicted, blob_bytes = False, [], 0
        try:
            blob = encode(to_cold(prefix, self.cold_format))
            blob_bytes = len(blob)
            written, evicted = self.disk.write(key, blob, prefix.length, prefix.fingerprint)
        except Exception:
            log.exception("prefix store: disk write of %r failed", key)
            with self._lock:
                self._m["disk_write_errors"] += 1
        with self._lock:
            self.pending_bytes -= nb
            was_pending = self.pending_gen(key) == gen
            if was_pending:
                del self._pending[key]
            if written:
                self._m["disk_writes"] += 1
                self._m["disk_bytes_written"] += blob_bytes
            self._on_landed(key, gen, written, was_pending, evicted)

    def _delete(self, key: StoreKey, seq: int | None) -> None:
        try:
            self.disk.delete(key, seq)
        except Exception:
            log.exception("prefix store: disk delete of %r failed", key)

    # -- shutdown --------------------------------------------------------------------------------

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until every write and delete queued so far has landed."""
        if not self._closed:
            self._thread.submit(lambda: None).result(timeout_s)

    def close(self) -> None:
        self._closed = True
        self._thread.shutdown(wait=True)
