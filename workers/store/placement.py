"""The prefix store's placement core: which tier holds each user's prefix, decided synchronously.

Primitives:
- ``PrefixPlacement(config, model_version, device=, clock=, on_host=, tier_choice=)``: one entry per key
  ``(user_id, model_version)`` in at most one memory tier (device or host) plus, optionally, a copy on
  disk (its side: ``disk_placement``). Every method takes ``lock`` (reentrant) and returns without
  waiting for anything but the lock (and, on CUDA, a prefix's copy into the pages); no asyncio here.
  - ``lease(user_id, ttl_s, expected_bytes) -> LeaseResult`` / ``release(user_id)`` / ``expire(now)``:
    pins and their device-byte reservations.
  - ``put(user_id, prefix, keep_longer=False) -> tier`` and ``put_computed(user_id, prefix, history)``:
    place a prefix in the highest tier that takes it.
  - ``plan(key, history) -> Plan``: what a lookup must do (done on the device, copy from host or from a
    pending disk write, read the disk, or miss), dropping entries whose history changed.
  - ``promoted(key, plan, moved)`` / ``loaded(key, prefix)`` / ``corrupt(key, seq)``: the outcome of the
    copy or read a plan asked for.
  - ``device_pages(layout, reserve_tokens)``: the device tier's pages (``device_tier``), which the
    model runner reads and writes in place; ``admit(prefix)``: a promotion's copy into them.
  - ``forget(user_ids)``, ``cached_length``, ``where``, ``metrics``, ``layout``, ``persist_unwritten``.
- ``Entry``, ``Plan`` (``tiers``): its records (``LeaseResult``: ``leases``').

The device tier holds prefixes as computed, in pages (``kv_pages``: a prefix placed there lies in
them once, and grows by appending pages); host and disk hold them in the cold format
(``kv_formats``); every tier's byte counts (budgets, room-making, metrics) are the bytes it stores
(the device's: whole pages).

Placement and eviction policy (LRU per tier, pins respected): an entry goes to the highest tier whose
budget can take it; a tier the tier choice (``tier_costs``) predicts slower than recomputing serves no
lookup and (disk) takes no write. Making room on the device demotes the least recently used *unpinned*
device entry to host; making room on host demotes the least recently used *unleased* host entry to disk
(an asynchronous write, skipped when the disk already holds that exact prefix); the disk tier deletes
its own least recently used entries. Any use promotes an entry back to the device.

Leases reserve ``max(expected_bytes, resident bytes)`` of the device budget; the sum of reservations
never exceeds it, and unpinned device entries only use what reservations leave, so a leased prefix
always has room when it arrives. The pages hold the budget and a reserve for what the model runner
holds beside the entries; when they run short (a prefix computed into them, a ranking's grown one)
they ask ``reclaim``: the least recently used unpinned device entries are demoted until enough
pages are free (a page still read by a ranking in flight is freed when that ranking lets go).

Demoting an entry gathers its pages (``PrefixKV.dense``) and hands it to ``on_host(key, entry)``:
the orchestration moves its tensors off the device on its copy thread (until then the entry keeps
them, and a promotion back copies them into pages on the device). Placing a prefix that does not
lie in the pages yet writes its tokens there (``DeviceTier.admit``).
One job: every method keeps these invariants over the same entries and tiers, under one lock."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch

from relaygr.workers.kv_pages import KVLayout, KVPages, PagesExhausted
from relaygr.workers.prefix_kv import Events, PrefixKV, history_fingerprint
from relaygr.workers.store.device_tier import DeviceTier
from relaygr.workers.store.disk_placement import DiskPlacement
from relaygr.workers.store.kv_formats import check_format, cold_nbytes
from relaygr.workers.store.leases import LeaseResult, LeaseTable
from relaygr.workers.store.store_counters import StoreCounters
from relaygr.workers.store.tier_costs import TierChoice
from relaygr.workers.store.tiers import Entry, MemoryTier, Plan, StoreKey

log = logging.getLogger(__name__)

UserId = int | str
Tier = Literal["device", "host", "disk"]


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
        self._device_tier = DeviceTier(config.device_budget_bytes, device, config.page_tokens)
        self._device_tier.reclaim = self._reclaim
        self._host_tier: MemoryTier[StoreKey, Entry] = MemoryTier("host", config.host_budget_bytes)
        self._entries: dict[StoreKey, Entry] = {}
        self._leases: LeaseTable[StoreKey] = LeaseTable(config.device_budget_bytes)
        self._gen = itertools.count(1)
        self.disk_side = DiskPlacement(
            config, model_version, self.lock, self.counters, self._entries.get, self.cold_format
        )
        self.disk, self.writer = self.disk_side.disk, self.disk_side.writer
        self.tiers = ("device", "host", "disk") if self.disk is not None else ("device", "host")

    def device_pages(self, layout: KVLayout, reserve_tokens: int = 0) -> KVPages:
        """The device tier's pages for ``layout``'s tokens, made now if they are not yet (with
        ``reserve_tokens`` beyond the budget's), for the model runner to read and write in place."""
        return self._device_tier.pages_for(layout, reserve_tokens)

    def device_bytes(self, prefix: PrefixKV) -> int:
        """The bytes ``prefix`` takes in the device tier: whole pages."""
        return self._device_tier.nbytes(prefix)

    def admit(self, prefix: PrefixKV) -> PrefixKV:
        """``prefix`` written into free pages of the device tier, not placed yet (a promotion's copy,
        made outside the lock; ``promoted`` or ``loaded`` places it); ``PagesExhausted`` when too few
        are free: making room demotes entries, which the placement does in its order, under the
        lock, when it places the prefix."""
        return self._device_tier.admit(prefix, reclaim=False)

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

    def _reclaim(self, pages: int) -> None:
        """The pages are short of ``pages`` free ones: demote least recently used unpinned device
        entries until they have them (or none is left to demote)."""
        with self.lock:
            tier = self._device_tier
            while tier.pages is not None and tier.pages.free_pages < pages:
                victim = next((k for k in tier.lru_keys() if k not in self._leases), None)
                if victim is None:
                    return
                self._demote_from_device(victim)
                self.counters["reclaims"] += 1

    def _demote_from_device(self, key: StoreKey) -> None:
        entry = self._device_tier.pop(key)
        assert entry is not None
        entry.prefix = entry.prefix.dense()  # out of the pages (given back once no ranking reads them)
        host_nb = self.host_bytes(entry.prefix)
        if self._make_host_room(host_nb):
            entry.tier, entry.nbytes = "host", host_nb
            self._host_tier.add(key, entry, host_nb)
            self.counters["demotions_device_to_host"] += 1
            self._on_host(key, entry)
        else:
            self._spill(key, entry)

    def _spill(self, key: StoreKey, entry: Entry) -> None:
        """``entry`` has left memory: keep it on disk or drop it."""
        del self._entries[key]
        if self.writer is not None:
            if self.disk_side.has(key, entry):
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
        nb = self._device_tier.nbytes(prefix)
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
            try:  # in the pages: itself when it lies there, else its tokens written there
                paged = self._device_tier.admit(prefix)
            except PagesExhausted as e:
                log.info("prefix store: %r goes to host: %s", key, e)
                self.counters["device_pages_exhausted"] += 1
                paged, to_device = prefix, False
        if to_device:
            entry = Entry(paged, nb, "device", gen, on_disk)
            self._device_tier.add(key, entry, nb)
            self._entries[key] = entry
            return "device"
        host_nb = self.host_bytes(prefix)
        entry = Entry(prefix.dense(), host_nb, "host", gen, on_disk)
        self._entries[key] = entry
        if self._make_host_room(host_nb):
            self._host_tier.add(key, entry, host_nb)
            self._on_host(key, entry)
            return "host"
        self._spill(key, entry)
        return "disk" if self.disk_side.has(key, entry) else "none"

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
            old = self._entries.get(key)
            if keep_longer and old is not None and old.prefix.length >= prefix.length:
                return "kept"
            old = None  # its pages are free once no one else reads them: this is the last look
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
            entry = None  # not held while ``put`` replaces it (its pages)
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
            on_disk, invalid = self.disk_side.plan(key, n, best_len, valid, self._worth)
            plan, invalidated = on_disk or plan, invalidated + invalid
            plan.invalidated = invalidated
            if invalidated:
                self.counters["invalidations"] += invalidated
            if plan.kind == "device":
                self._device_tier.touch(key)
                self.counters.hit("device", self.tiers)
            elif plan.kind == "done":
                self.counters.hit("miss", self.tiers)
            return plan

    def promoted(self, key: StoreKey, plan: Plan, moved: PrefixKV) -> PrefixKV:
        """A host or pending prefix of ``plan`` was copied to the device as ``moved``: it takes
        its place there (unless the entry changed meanwhile). Returns what a lookup hands out: the
        device entry's prefix (in the pages) when it went there, else ``moved``."""
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
            return self._handed_out(key, moved)

    def _handed_out(self, key: StoreKey, moved: PrefixKV) -> PrefixKV:
        """The device entry's prefix of ``key`` when it is ``moved``'s version, else ``moved``."""
        entry = self._entries.get(key)
        same = entry is not None and entry.tier == "device" and entry.prefix.fingerprint == moved.fingerprint
        return entry.prefix if same and entry.prefix.length == moved.length else moved

    def loaded(self, key: StoreKey, prefix: PrefixKV | None) -> PrefixKV | None:
        """A disk read of ``key`` returned ``prefix`` (None: deleted since the plan): placed in
        memory unless another version got there first. Returns what a lookup hands out (as
        ``promoted``)."""
        with self.lock:
            if prefix is None:
                self.counters.hit("miss", self.tiers)
                return None
            placed = "skipped" if key in self._entries else self._place(key, prefix, next(self._gen), True)
            if placed == "device":
                self.counters["promotions_disk_to_device"] += 1
            self.counters.hit("disk", self.tiers)
            return self._handed_out(key, prefix)

    def corrupt(self, key: StoreKey, seq: int) -> None:
        """The disk entry ``seq`` of ``key`` did not decode: deleted and counted."""
        with self.lock:
            self.counters["disk_corrupt"] += 1
            self.disk_side.discard(key, seq)

    def persist_unwritten(self) -> None:
        """Queue every memory entry the disk lacks (forced past the backlog bound)."""
        with self.lock:
            self.disk_side.persist(list(self._entries.items()))

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
                forgotten += self.disk_side.forget(key) or had
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
            return self.disk_side.where(key)

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
                **self.disk_side.layout(),
                "leases": {k: (v.expires_at, v.reserved) for k, v in self._leases.items()},
            }

    def metrics(self) -> dict[str, float | int]:
        """Counters (monotonic, ``store_counters``) and gauges (bytes and entries per tier,
        reservations)."""
        with self.lock:
            out = self.counters.snapshot()
            out["bytes_device"] = self._device_tier.used_bytes
            out["bytes_host"] = self._host_tier.used_bytes
            out["bytes_pinned"] = self._pinned_resident()
            out["bytes_reserved"] = self._leases.reserved
            out["entries_device"] = len(self._device_tier)
            out["entries_host"] = len(self._host_tier)
            out["leases"] = len(self._leases)
            out["budget_device_bytes"] = self.config.device_budget_bytes
            out["budget_host_bytes"] = self.config.host_budget_bytes
            out.update(self.disk_side.gauges(self.config.disk_budget_bytes))
            pages = self._device_tier.pages
            out.update({f"device_{k}": v for k, v in (pages.counters() if pages is not None else {}).items()})
            return out

    def close(self) -> None:
        """Stop the disk writer and close the disk tier (after ``persist_unwritten`` and a flush)."""
        self.disk_side.close()
