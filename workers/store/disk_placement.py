"""The disk tier as the placement core sees it: the tier, its write-back queue, and which version of
each key they hold.

Primitives:
- ``DiskPlacement(config, model_version, lock, counters, entry_of)``: opens the disk tier
  (``tiers.DiskTier``, deleting what another model version wrote when ``purge_other_model_versions``)
  and its writer (``disk_writer.DiskWriter``); ``disk`` and ``writer`` are None without a folder.
  - ``has(key, entry)``: whether the disk holds, or is about to hold, exactly ``entry``'s version.
  - ``plan(key, n, best_len, valid, worth)``: a lookup's disk side: a copy on its way to disk
    longer than ``best_len``, or a stored one (a changed history's deleted), and how many it
    invalidated.
  - ``discard(key, seq)``, ``forget(key)``, ``persist(entries)``, ``where(key)``, ``gauges()``,
    ``layout()``, ``close()``.

When a write lands, the entry of its key (``entry_of``, under the placement's ``lock``) learns
whether the disk holds its version. Nothing here decides what goes to disk: that is the placement's
policy (``placement``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from relaygr.workers.store.disk_writer import DiskWriter
from relaygr.workers.store.store_counters import StoreCounters
from relaygr.workers.store.tiers import DiskTier, Entry, Plan, StoreKey


class DiskPlacement:
    """The disk tier and its write-back queue, as the placement sees them (module docstring)."""

    def __init__(
        self,
        config: Any,
        model_version: str,
        lock: threading.RLock,
        counters: StoreCounters,
        entry_of: Callable[[StoreKey], Entry | None],
        cold_format: Any,
    ) -> None:
        self.counters, self._entry_of = counters, entry_of
        self.disk: DiskTier | None = None
        self.writer: DiskWriter | None = None
        if config.disk_path is None:
            return
        self.disk = DiskTier(config.disk_path, config.disk_budget_bytes)
        if config.purge_other_model_versions:
            for key in self.disk.list_keys():
                if key[1] != model_version:
                    self.disk.delete(key)
                    counters["disk_purged_other_version"] += 1
        self.writer = DiskWriter(
            self.disk, config.disk_backlog_bytes, lock, counters, self._on_write, cold_format=cold_format
        )

    def has(self, key: StoreKey, entry: Entry) -> bool:
        """The disk holds, or is about to hold, exactly this version of ``key``."""
        return entry.on_disk or (self.writer is not None and self.writer.pending_gen(key) == entry.gen)

    def plan(
        self,
        key: StoreKey,
        n: int,
        best_len: int,
        valid: Callable[[int, bytes], bool],
        worth: Callable[..., bool],
    ) -> tuple[Plan | None, int]:
        """The disk's better plan than a memory entry of ``best_len`` events for a history of
        ``n`` (None: none), and how many disk entries it found invalid (hidden, deleted behind
        the queue). A copy pending on its way to disk is served from memory."""
        if self.writer is None or self.disk is None:
            return None, 0
        plan, invalidated = None, 0
        pend = self.writer.pending_prefix(key)
        if pend is not None and best_len < pend[1].length <= n:
            p = pend[1]
            if valid(p.length, p.fingerprint) and worth("host", p.nbytes(), p.length, max(best_len, 0)):
                best_len, plan = p.length, Plan("pending", pending=pend)
        meta = self.disk.meta(key)
        if meta is not None and best_len < meta.length <= n:
            if not valid(meta.length, meta.fingerprint):
                self.discard(key, meta.seq)
                invalidated += 1
            elif worth("disk", meta.nbytes, meta.length, max(best_len, 0)):
                plan = Plan("disk", disk_meta=meta)
        return plan, invalidated

    def _on_write(
        self, key: StoreKey, gen: int, written: bool, was_pending: bool, evicted: list[StoreKey]
    ) -> None:
        """The disk writer landed (or failed) version ``gen`` of ``key``, evicting ``evicted``
        (called under the lock)."""
        entry = self._entry_of(key)
        if written:
            if entry is not None:
                entry.on_disk = entry.gen == gen
        elif was_pending and entry is None:
            self.counters["evictions"] += 1  # it was only on its way to disk and did not fit
        for victim in evicted:
            self.counters["evictions_disk"] += 1
            entry = self._entry_of(victim)
            if entry is not None:
                entry.on_disk = False

    def discard(self, key: StoreKey, seq: int) -> None:
        """Hide a disk entry now and delete it behind the pending writes."""
        assert self.writer is not None
        self.writer.discard(key, seq)
        entry = self._entry_of(key)
        if entry is not None:
            entry.on_disk = False

    def forget(self, key: StoreKey) -> bool:
        """Every disk copy of ``key``, queued or stored, deleted behind the queue; whether any was."""
        if self.disk is None or self.writer is None:
            return False
        pend, meta = self.writer.pending_gen(key), self.disk.meta(key)
        if meta is not None:
            self.disk.hide(key, meta.seq)
        if pend is not None or meta is not None:
            self.writer.delete_all(key)
        return pend is not None or meta is not None

    def persist(self, entries: Iterable[tuple[StoreKey, Entry]]) -> None:
        """Queue every entry the disk lacks (forced past the backlog bound)."""
        if self.writer is None:
            return
        for key, entry in entries:
            if not self.has(key, entry):
                self.writer.enqueue(key, entry.gen, entry.prefix, force=True)

    def where(self, key: StoreKey) -> str | None:
        """ "pending" (on its way to disk), "disk" or None."""
        if self.writer is not None and self.writer.pending_gen(key) is not None:
            return "pending"
        if self.disk is not None and self.disk.meta(key) is not None:
            return "disk"
        return None

    def gauges(self, budget_bytes: int) -> dict[str, int]:
        return {
            "bytes_disk": self.disk.used_bytes if self.disk is not None else 0,
            "bytes_pending_disk": self.writer.pending_bytes if self.writer is not None else 0,
            "entries_disk": len(self.disk) if self.disk is not None else 0,
            "budget_disk_bytes": budget_bytes if self.disk is not None else 0,
        }

    def layout(self) -> dict[str, list[StoreKey]]:
        return {
            "pending": self.writer.pending_keys() if self.writer is not None else [],
            "disk": self.disk.list_keys() if self.disk is not None else [],
        }

    def close(self) -> None:
        """Stop the writer and close the tier (after the placement's persist and a flush)."""
        if self.writer is not None:
            self.writer.close()
        if self.disk is not None:
            self.disk.close()
