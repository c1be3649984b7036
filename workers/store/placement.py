"""The prefix store's placement core: which tier holds each user's prefix, decided synchronously.

Primitives:
- ``PrefixPlacement(config, model_version, device=, clock=, on_host=, tier_choice=)``: one entry per key
  ``(user_id, model_version)`` in at most one memory tier (device or host) plus, optionally, a copy on
  disk (``tiers.DiskTier`` and its write-back queue, ``disk_writer``). Every method takes ``lock``
  (reentrant) and returns without waiting for anything but the lock; no asyncio here.
  - ``lease(user_id, ttl_s, expected_bytes) -> LeaseResult`` / ``release(user_id)`` / ``expire(now)``:
    pins and their device-byte reservations.
  - ``put(user_id, prefix, keep_longer=False) -> tier`` and ``put_computed(user_id, prefix, history)``:
    place a prefix in the highest tier that takes it.
  - ``plan(key, history) -> Plan``: what a lookup must do (done on the device, copy from host or from a
    pending disk write, read the disk, or miss), dropping entries whose history changed.
  - ``promoted(key, plan, moved)`` / ``loaded(key, prefix)`` / ``corrupt(key, seq)``: the outcome of the
    copy or read a plan asked for.
  - ``forget(user_ids)``, ``cached_length``, ``where``, ``metrics``, ``layout``, ``persist_unwritten``.
- ``Entry``, ``Plan``: its records (``LeaseResult``: ``leases``').

The device tier holds prefixes as computed, host and disk in the cold format (``kv_formats``); every
tier's byte counts (budgets, room-making, metrics) are the bytes it stores.

Placement and eviction policy (LRU per tier, pins respected): an entry goes to the highest tier whose
budget can take it; a tier the tier choice (``tier_costs``) predicts slower than recomputing serves no
lookup and (disk) takes no write. Making room on the device demotes the least recently used *unpinned*
device entry to host; making room on host demotes the least recently used *unleased* host entry to disk
(an asynchronous write, skipped when the disk already holds that exact prefix); the disk tier deletes
its own least recently used entries. Any use promotes an entry back to the device.

Leases reserve ``max(expected_bytes, resident bytes)`` of the device budget; the sum of reservations
never exceeds it, and unpinned device entries only use what reservations leave, so a leased prefix
always has room when it arrives.

An entry placed on host is handed to ``on_host(key, entry)``: the orchestration moves its tensors off
the device on its copy thread (until then the entry keeps them, and a promotion back needs no copy).
Placing on the device moves a prefix that lives elsewhere (``PrefixKV.to``).
One job: every method keeps these invariants over the same entries and tiers, under one lock."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from relaygr.workers.prefix_kv import Events, PrefixKV, history_fingerprint
from relaygr.workers.store.disk_writer import DiskWriter
from relaygr.workers.store.kv_formats import check_format, cold_nbytes, same_device, to_warm
from relaygr.workers.store.leases import LeaseResult, LeaseTable
from relaygr.workers.store.store_counters import StoreCounters
from relaygr.workers.store.tier_costs import TierChoice
from relaygr.workers.store.tiers import DiskMeta, DiskTier, MemoryTier, StoreKey

log = logging.getLogger(__name__)

UserId = int | str
Tier = Literal["device", "host", "disk"]


@dataclass
class Entry:
    prefix: PrefixKV
    nbytes: int
    tier: str  # "device" | "host"
    gen: int  # identity of this prefix version across moves between tiers
    on_disk: bool = False  # the disk tier holds exactly this version


@dataclass
class Plan:
    """What a lookup must do, decided under the lock: ``device`` (found there), ``host`` (copy
    ``entry`` to the device), ``pending`` (copy a prefix on its way to disk), ``disk`` (read it),
    or ``done`` (a miss)."""

    kind: str
    entry: Entry | None = None
    pending: tuple[int, PrefixKV] | None = None
    disk_meta: DiskMeta | None = None
    invalidated: int = 0


class PrefixPlacement:
    """Tiers, entries, leases and the disk tier of one prefix store. See the module docstring.

    ``config`` is a ``PrefixStoreConfig`` (budgets, disk folder and policy, lease TTL)."""

    def __init__(
        self,
        config: Any,
        model_version: str,
        *,
        device: torch.device,
        clock: Callable[[], float],
        on_host: Callable[[StoreKey, Entry], None] | None = None,
        tier_choice: TierChoice | None = None,
    ) -> None:
        self.config = config
        self.tier_choice = tier_choice  # None: every tier is served
        self.model_version = model_version
        self.device = device
        self.clock = clock
        self.lock = threading.RLock()
        self.counters = StoreCounters()
        self.cold_format = check_format(config.cold_kv_format)
        self._on_host = on_host or (lambda key, entry: None)
        self._device_tier: MemoryTier[StoreKey, Entry] = MemoryTier("device", config.device_budget_bytes)
        self._host_tier: MemoryTier[StoreKey, Entry] = MemoryTier("host", config.host_budget_bytes)
        self._entries: dict[StoreKey, Entry] = {}
        self._leases: LeaseTable[StoreKey] = LeaseTable(config.device_budget_bytes)
        self._gen = itertools.count(1)
        self.disk: DiskTier | None = None
        self.writer: DiskWriter | None = None
        if config.disk_path is not None:
            self.disk = DiskTier(config.disk_path, config.disk_budget_bytes)
            if config.purge_other_model_versions:
                for key in self.disk.list_keys():
                    if key[1] != model_version:
                        self.disk.delete(key)
                        self.counters["disk_purged_other_version"] += 1
            backlog, on_write = config.disk_backlog_bytes, self._on_disk_write
            self.writer = DiskWriter(
                self.disk, backlog, self.lock, self.counters, on_write, cold_format=self.cold_format
            )
        self.tiers = ("device", "host", "disk") if self.disk is not None else ("device", "host")

    def key(self, user_id: UserId) -> StoreKey:
        return (user_id, self.model_version)

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counters[name] += n

    def count_hit(self, tier: str) -> None:
        with self.lock:
            self.counters.hit(tier, self.tiers)

    # ------------------------------------------------------------------ leases

    def expire(self, now: float | None = None) -> int:
        """End every lease whose TTL has passed; returns how many."""
        with self.lock:
            expired = self._leases.expire(self.clock() if now is None else now)
            for key in expired:
                self._unpinned(key)
            self.counters["lease_expiries"] += len(expired)
            return len(expired)

    def _maybe_expire(self) -> None:
        now = self.clock()
        if self._leases.due(now):
            self.expire(now)

    def _drop_lease(self, key: StoreKey) -> None:
        self._leases.drop(key)
        self._unpinned(key)

    def _unpinned(self, key: StoreKey) -> None:
        # The entry (if on the device) is now unpinned; its bytes were inside the reservation,
        # so the device invariant still holds. It stays most recently used.
        self._device_tier.touch(key)

    def is_leased(self, user_id: UserId) -> bool:
        with self.lock:
            self._maybe_expire()
            return self.key(user_id) in self._leases

    def lease(self, user_id: UserId, ttl_s: float, expected_bytes: int = 0) -> LeaseResult:
        """Pin ``user_id``'s prefix on the device for ``ttl_s`` (renews if leased), reserving
        ``max(expected_bytes, bytes already resident)`` of the device budget. Refused, with
        reason ``pinned_budget_exceeded``, when all reservations together would exceed the
        budget; a refused renewal leaves the existing lease as it was."""
        if expected_bytes < 0:
            raise ValueError("expected_bytes must be >= 0")
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        key = self.key(user_id)
        budget = self.config.device_budget_bytes
        with self.lock:
            now = self.clock()
            if self._leases.due(now):
                self.expire(now)
            entry = self._entries.get(key)
            resident = entry.nbytes if entry is not None and entry.tier == "device" else 0
            want = max(int(expected_bytes), resident)
            renewal = key in self._leases
            if not self._leases.reserve(key, want, now + ttl_s, int(expected_bytes)):
                self.counters["leases_refused"] += 1
                return LeaseResult(False, "pinned_budget_exceeded", None, want, self._leases.reserved, budget)
            ok = self._make_device_room(0)
            assert ok, "reservations fit the budget, so demoting every unpinned entry must suffice"
            if entry is not None:
                (self._device_tier if entry.tier == "device" else self._host_tier).touch(key)
            self.counters["leases_renewed" if renewal else "leases_admitted"] += 1
            return LeaseResult(
                True, "renewed" if renewal else "admitted", now + ttl_s, want, self._leases.reserved, budget
            )

    def release(self, user_id: UserId) -> bool:
        """Unpin ``user_id`` (ranking consumed the prefix). False when it held no lease."""
        key = self.key(user_id)
        with self.lock:
            self._maybe_expire()
            if key not in self._leases:
                return False
            self._drop_lease(key)
            self.counters["leases_released"] += 1
            return True

    # ------------------------------------------------------------------ room, demotion, spill

    def _pinned_resident(self) -> int:
        total = 0
        for key in self._leases:
            entry = self._entries.get(key)
            if entry is not None and entry.tier == "device":
                total += entry.nbytes
        return total

    def _make_device_room(self, need: int) -> bool:
        """Demote LRU unpinned device entries until ``need`` more unpinned bytes fit beside the
        reservations. False if impossible (nothing is demoted then)."""
        budget = self.config.device_budget_bytes
        reserved = self._leases.reserved
        unpinned = self._device_tier.used_bytes - self._pinned_resident()
        if need + reserved > budget:
            return False
        while unpinned + reserved + need > budget:
            victim = next((k for k in self._device_tier.lru_keys() if k not in self._leases), None)
            if victim is None:  # pragma: no cover - excluded by the check above
                return False
            unpinned -= self._entries[victim].nbytes
            self._demote_from_device(victim)
        return True

    def _make_host_room(self, need: int) -> bool:
        host = self._host_tier
        if not host.can_ever_hold(need):
            return False
        while host.used_bytes + need > host.budget_bytes:
            victim = next((k for k in host.lru_keys() if k not in self._leases), None)
            if victim is None:
                return False
            entry = host.pop(victim)
            assert entry is not None
            self._spill(victim, entry)
        return True

    def host_bytes(self, prefix: PrefixKV) -> int:
        """Bytes ``prefix`` takes in the host tier: its cold form's (``kv_formats``)."""
        return cold_nbytes(prefix, self.cold_format)

    def _demote_from_device(self, key: StoreKey) -> None:
        entry = self._device_tier.pop(key)
        assert entry is not None
        host_nb = self.host_bytes(entry.prefix)
        if self._make_host_room(host_nb):
            entry.tier, entry.nbytes = "host", host_nb
            self._host_tier.add(key, entry, host_nb)
            self.counters["demotions_device_to_host"] += 1
            self._on_host(key, entry)
        else:
            self._spill(key, entry)

    def _disk_has(self, key: StoreKey, entry: Entry) -> bool:
        """The disk holds, or is about to hold, exactly this version of ``key``."""
        return entry.on_disk or (self.writer is not None and self.writer.pending_gen(key) == entry.gen)

    def _spill(self, key: StoreKey, entry: Entry) -> None:
        """``entry`` has left memory: keep it on disk or drop it."""
        del self._entries[key]
        if self.writer is not None:
            if self._disk_has(key, entry):
                self.counters["demotions_to_disk"] += 1
                return
            if self._worth(
                "disk", self.host_bytes(entry.prefix), entry.prefix.length, write=True
            ) and self.writer.enqueue(key, entry.gen, entry.prefix):
                self.counters["demotions_to_disk"] += 1
                return
        self.counters["evictions"] += 1

    def _worth(
        self, tier: str, nbytes: int, length: int, from_length: int = 0, *, write: bool = False
    ) -> bool:
        """The tier choice's verdict on serving (``write``: storing) ``length`` events in ``nbytes``
        from ``tier`` (True without a choice); a refusal is counted."""
        choice = self.tier_choice
        if choice is None or choice.worth(tier, nbytes, length, from_length):
            return True
        self.counters["disk_writes_skipped_slower" if write else f"skips_{tier}_slower"] += 1
        return False

    def _remove(self, key: StoreKey) -> Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            (self._device_tier if entry.tier == "device" else self._host_tier).pop(key)
        return entry

    def _place(self, key: StoreKey, prefix: PrefixKV, gen: int, on_disk: bool) -> str:
        """Put ``prefix`` in the highest tier that takes it; returns "device", "host", "disk" or
        "none". The key must have no memory entry."""
        if prefix.kv_format != "exact":  # the device tier holds exact prefixes only
            prefix = to_warm(prefix, prefix.device)
        nb = prefix.nbytes()
        lease = self._leases.get(key)
        to_device = False
        if lease is not None:
            if self._leases.resize(key, max(lease.expected_bytes, nb)):
                to_device = self._make_device_room(0)
            else:
                log.info("prefix store: lease of %r revoked: %d bytes exceed the pinned budget", key, nb)
                self._drop_lease(key)
                self.counters["lease_revocations"] += 1
        if not to_device and key not in self._leases:
            to_device = self._make_device_room(nb)
        if to_device:
            if not same_device(prefix.device, self.device):
                prefix = prefix.to(self.device)
            entry = Entry(prefix, nb, "device", gen, on_disk)
            self._device_tier.add(key, entry, nb)
            self._entries[key] = entry
            return "device"
        host_nb = self.host_bytes(prefix)
        entry = Entry(prefix, host_nb, "host", gen, on_disk)
        self._entries[key] = entry
        if self._make_host_room(host_nb):
            self._host_tier.add(key, entry, host_nb)
            self._on_host(key, entry)
            return "host"
        self._spill(key, entry)
        return "disk" if self._disk_has(key, entry) else "none"

    # ------------------------------------------------------------------ puts

    def put(self, user_id: UserId, prefix: PrefixKV, *, keep_longer: bool = False) -> str:
        """Store ``prefix`` as ``user_id``'s entry (replacing any older one); the tier it went
        to, or "kept" when ``keep_longer`` and a memory entry at least as long is there."""
        if prefix.model_version != self.model_version:
            raise ValueError(
                f"prefix of model {prefix.model_version!r} put into a store of model {self.model_version!r}"
            )
        key = self.key(user_id)
        with self.lock:
            self._maybe_expire()
            entry = self._entries.get(key)
            if keep_longer and entry is not None and entry.prefix.length >= prefix.length:
                return "kept"
            self._remove(key)
            gen = next(self._gen)
            tier = self._place(key, prefix, gen, on_disk=False)
            self.counters["puts"] += 1
            if (
                self.config.disk_write_policy == "write_through"
                and tier in ("device", "host")
                and self.writer is not None
                and self._worth("disk", self.host_bytes(prefix), prefix.length, write=True)
            ):
                self.writer.enqueue(key, gen, prefix)
            return tier

    def put_computed(self, user_id: UserId, prefix: PrefixKV, history: Events, extended: bool) -> None:
        """Store a computed prefix of ``history`` unless a longer valid one of it arrived
        meanwhile (a ranking stored it); count the computation."""
        key = self.key(user_id)
        with self.lock:
            entry = self._entries.get(key)
            newer = (
                entry is not None and entry.prefix.length > prefix.length and entry.prefix.matches(history)
            )
            if not newer:
                self.put(user_id, prefix)
            self.counters["computations"] += 1
            if extended:
                self.counters["extensions"] += 1

    # ------------------------------------------------------------------ lookups

    def plan(self, key: StoreKey, history: Events) -> Plan:
        """What a lookup of ``history`` must do: the longest valid prefix's place. Entries whose
        history changed are dropped (memory) or hidden and deleted (disk), and counted. A valid
        entry in a tier the tier choice predicts slower than recomputing is not served (counted
        in ``skips_<tier>_slower``); it stays where it is."""
        n = len(history)
        fps: dict[int, bytes] = {}

        def valid(length: int, fingerprint: bytes) -> bool:
            if length not in fps:
                fps[length] = history_fingerprint(history, length)
            return fps[length] == fingerprint

        with self.lock:
            self._maybe_expire()
            invalidated = 0
            best_len, plan = -1, Plan("done")
            entry = self._entries.get(key)
            if entry is not None and entry.prefix.length <= n:
                length = entry.prefix.length
                # ``matches``: the same check, skipped for a history this prefix matched already.
                if not entry.prefix.matches(history):
                    self._remove(key)  # the history changed under it: useless now and later
                    invalidated += 1
                elif entry.tier == "device":
                    best_len, plan = length, Plan("device", entry=entry)
                elif self._worth("host", entry.nbytes, length):
                    best_len, plan = length, Plan("host", entry=entry)
            if self.writer is not None and self.disk is not None:
                pend = self.writer.pending_prefix(key)
                if pend is not None and best_len < pend[1].length <= n:
                    p = pend[1]
                    if valid(p.length, p.fingerprint) and self._worth(
                        "host", p.nbytes(), p.length, max(best_len, 0)
                    ):
                        best_len, plan = p.length, Plan("pending", pending=pend)
                meta = self.disk.meta(key)
                if meta is not None and best_len < meta.length <= n:
                    if not valid(meta.length, meta.fingerprint):
                        self._discard_disk(key, meta.seq)
                        invalidated += 1
                    elif self._worth("disk", meta.nbytes, meta.length, max(best_len, 0)):
                        plan = Plan("disk", disk_meta=meta)
            plan.invalidated = invalidated
            if invalidated:
                self.counters["invalidations"] += invalidated
            if plan.kind == "device":
                self._device_tier.touch(key)
                self.counters.hit("device", self.tiers)
            elif plan.kind == "done":
                self.counters.hit("miss", self.tiers)
            return plan

    def promoted(self, key: StoreKey, plan: Plan, moved: PrefixKV) -> None:
        """A host or pending prefix of ``plan`` was copied to the device as ``moved``: it takes
        its place there (unless the entry changed meanwhile)."""
        with self.lock:
            entry = self._entries.get(key)
            if plan.kind == "host":
                assert plan.entry is not None
                if entry is plan.entry and entry.tier == "host":
                    self._remove(key)
                    if self._place(key, moved, entry.gen, entry.on_disk) == "device":
                        self.counters["promotions_host_to_device"] += 1
            elif entry is None:
                assert plan.pending is not None
                if self._place(key, moved, plan.pending[0], on_disk=False) == "device":
                    self.counters["promotions_host_to_device"] += 1
            self.counters.hit("host", self.tiers)

    def loaded(self, key: StoreKey, prefix: PrefixKV | None) -> None:
        """A disk read of ``key`` returned ``prefix`` (None: deleted since the plan): placed in
        memory unless another version got there first."""
        with self.lock:
            if prefix is None:
                self.counters.hit("miss", self.tiers)
                return
            placed = "skipped" if key in self._entries else self._place(key, prefix, next(self._gen), True)
            if placed == "device":
                self.counters["promotions_disk_to_device"] += 1
            self.counters.hit("disk", self.tiers)

    def corrupt(self, key: StoreKey, seq: int) -> None:
        """The disk entry ``seq`` of ``key`` did not decode: deleted and counted."""
        with self.lock:
            self.counters["disk_corrupt"] += 1
            self._discard_disk(key, seq)

    # ------------------------------------------------------------------ the disk tier

    def _on_disk_write(
        self, key: StoreKey, gen: int, written: bool, was_pending: bool, evicted: list[StoreKey]
    ) -> None:
        """The disk writer landed (or failed) version ``gen`` of ``key``, evicting ``evicted``
        (called under the lock)."""
        entry = self._entries.get(key)
        if written:
            if entry is not None:
                entry.on_disk = entry.gen == gen
        elif was_pending and entry is None:
            self.counters["evictions"] += 1  # it was only on its way to disk and did not fit
        for victim in evicted:
            self.counters["evictions_disk"] += 1
            entry = self._entries.get(victim)
            if entry is not None:
                entry.on_disk = False

    def _discard_disk(self, key: StoreKey, seq: int) -> None:
        """Hide a disk entry now and delete it behind the pending writes."""
        assert self.writer is not None
        self.writer.discard(key, seq)
        entry = self._entries.get(key)
        if entry is not None:
            entry.on_disk = False

    def persist_unwritten(self) -> None:
        """Queue every memory entry the disk lacks (forced past the backlog bound)."""
        if self.writer is None:
            return
        with self.lock:
            for key, entry in list(self._entries.items()):
                if not self._disk_has(key, entry):
                    self.writer.enqueue(key, entry.gen, entry.prefix, force=True)

    # ------------------------------------------------------------------ forgetting, introspection

    def forget(self, user_ids: Iterable[UserId]) -> int:
        """Drop every copy of these users' prefixes: memory tiers, leases, queued and stored disk
        copies (deleted behind the queue). Returns how many users had one."""
        forgotten = 0
        with self.lock:
            for user_id in user_ids:
                key = self.key(user_id)
                had = self._remove(key) is not None
                if key in self._leases:
                    self._drop_lease(key)
                if self.disk is not None and self.writer is not None:
                    pend = self.writer.pending_gen(key)
                    meta = self.disk.meta(key)
                    had = had or pend is not None or meta is not None
                    if meta is not None:
                        self.disk.hide(key, meta.seq)
                    if pend is not None or meta is not None:
                        self.writer.delete_all(key)
                forgotten += had
            if forgotten:
                self.counters["forgotten"] += forgotten
        return forgotten

    def replace_host_tensors(self, key: StoreKey, entry: Entry, was: PrefixKV, now: PrefixKV) -> None:
        """``on_host``'s copy of ``entry`` landed: its tensors are ``now`` if it is still on host
        with the tensors ``was`` the copy started from."""
        with self.lock:
            if self._entries.get(key) is entry and entry.tier == "host" and entry.prefix is was:
                entry.prefix = now

    def cached_length(self, user_id: UserId, history: Events) -> int:
        """Length of the prefix of ``history`` that the device or host tier holds for
        ``user_id`` (0 if none). Loads, promotes and counts nothing."""
        with self.lock:
            entry = self._entries.get(self.key(user_id))
            if entry is None or not entry.prefix.matches(history):
                return 0
            return entry.prefix.length

    def where(self, user_id: UserId) -> str | None:
        """Where ``user_id``'s newest copy lives: "device", "host", "pending" (in memory, on its
        way to disk), "disk" or None."""
        key = self.key(user_id)
        with self.lock:
            entry = self._entries.get(key)
            if entry is not None:
                return entry.tier
            if self.writer is not None and self.writer.pending_gen(key) is not None:
                return "pending"
        if self.disk is not None and self.disk.meta(key) is not None:
            return "disk"
        return None

    def layout(self) -> dict[str, Any]:
        """Keys per tier (device and host in LRU order; ``host_in_memory``: those whose tensors
        left the device), keys on their way to disk, leases as ``{key: (expires_at, reserved)}``."""
        with self.lock:
            return {
                "device": self._device_tier.keys(),
                "host": self._host_tier.keys(),
                "host_in_memory": [
                    k for k in self._host_tier.lru_keys() if self._entries[k].prefix.device.type == "cpu"
                ],
                "pending": self.writer.pending_keys() if self.writer is not None else [],
                "disk": self.disk.list_keys() if self.disk is not None else [],
                "leases": {k: (v.expires_at, v.reserved) for k, v in self._leases.items()},
            }

    def metrics(self) -> dict[str, float | int]:
        """Counters (monotonic, ``store_counters``) and gauges (bytes and entries per tier,
        reservations)."""
        with self.lock:
            out = self.counters.snapshot()
            out["bytes_device"] = self._device_tier.used_bytes
            out["bytes_host"] = self._host_tier.used_bytes
            out["bytes_disk"] = self.disk.used_bytes if self.disk is not None else 0
            out["bytes_pinned"] = self._pinned_resident()
            out["bytes_reserved"] = self._leases.reserved
            out["bytes_pending_disk"] = self.writer.pending_bytes if self.writer is not None else 0
            out["entries_device"] = len(self._device_tier)
            out["entries_host"] = len(self._host_tier)
            out["entries_disk"] = len(self.disk) if self.disk is not None else 0
            out["leases"] = len(self._leases)
            out["budget_device_bytes"] = self.config.device_budget_bytes
            out["budget_host_bytes"] = self.config.host_budget_bytes
            out["budget_disk_bytes"] = self.config.disk_budget_bytes if self.disk is not None else 0
            return out

    def close(self) -> None:
        """Stop the disk writer and close the disk tier (after ``persist_unwritten`` and a flush)."""
        if self.writer is not None:
            self.writer.close()
        if self.disk is not None:
            self.disk.close()
