"""The memory-aware expander: a tiered store of ``PrefixKV`` with leases, promotion and single-flight.

Primitives:
- ``PrefixStoreConfig``: devices, byte budgets per tier, disk folder, lease TTL, disk policy.
- ``PrefixStore``: one entry per key ``(user_id, model_version)`` in at most one memory tier
  (device or host) plus, optionally, a copy on disk.
  - ``await lookup(user_id, history) -> Lookup``: the longest cached prefix valid for ``history``
    (same fingerprint over its length), promoted to the device tier; entries whose history
    changed are dropped and counted.
  - ``lease(user_id, ttl_s, expected_bytes) -> LeaseResult`` / ``release(user_id)``: pin a key
    from pre-inference until ranking consumes it; admission reserves device bytes and is refused
    (``pinned_budget_exceeded``) when pins would exceed the device budget.
  - ``await get_or_compute(user_id, history, compute, at_least=n) -> (PrefixKV, source)``: a
    cached prefix of ``history`` at least ``n`` long, else one computation per key however many
    callers ask at once (``compute`` gets the best valid shorter prefix to extend, or ``None``).
  - ``forget(user_ids)``: drop these users' prefixes from every tier, leases included (the
    histories they were computed from are gone).
  - ``put``, ``cached_length``, ``in_flight``, ``wait_in_flight``, ``where``, ``expire_leases``, ``metrics``,
    ``flush``, ``close``.
- ``Lookup``, ``LeaseResult``: results.

This module is the placement core; its parts live beside it: the tiers (``tiers``: byte-budgeted
LRU maps and the RocksDB folder), the leases and their reservations (``leases``), the disk
write-back queue (``disk_writer``), single-flight (``single_flight``) and the counters
(``store_counters``).

Placement and eviction policy (LRU per tier, pins respected): an entry goes to the highest tier
whose budget can take it. Making room on the device demotes the least recently used *unpinned*
device entry to host; making room on host demotes the least recently used *unleased* host entry to
disk (an asynchronous write, skipped when the disk already holds that exact prefix); the disk tier
deletes its own least recently used entries. Any use promotes an entry back to the device.

Leases reserve ``max(expected_bytes, resident bytes)`` of the device budget; the sum of
reservations never exceeds it, and unpinned device entries only use what reservations leave, so a
leased prefix always has room when it arrives.

Threading: state lives behind one lock; call the store from one asyncio loop (sync methods may be
called from any thread). Copies between host and device run on ``executor`` (the worker's
device executor, or an owned thread); disk reads and decoding run on a private reader thread, disk
writes and deletes on the disk writer's thread, so disk I/O never occupies the device executor and
never blocks lookups. An entry whose disk write is still pending is served from memory. This
module never imports Kafka.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from relaygr.workers.disk_writer import DiskWriter
from relaygr.workers.kv_codec import CodecError, decode
from relaygr.workers.leases import DEFAULT_LEASE_TTL_S, LeaseTable
from relaygr.workers.prefix_kv import Events, PrefixKV, history_fingerprint
from relaygr.workers.single_flight import FlightAbandoned, SingleFlight
from relaygr.workers.store_counters import StoreCounters
from relaygr.workers.tiers import DiskMeta, DiskTier, MemoryTier, StoreKey

log = logging.getLogger(__name__)

UserId = int | str
Tier = Literal["device", "host", "disk"]
Source = Literal["device", "host", "disk", "computed", "extended", "merged"]
Compute = Callable[[PrefixKV | None], Awaitable[PrefixKV]]


class PrefixStoreConfig(BaseModel):
    """Configuration of one worker's prefix store."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = Field(
        "cpu", description="Device of the device tier: the model's device ('cpu', 'cuda', 'cuda:1', 'npu:0')."
    )
    device_budget_bytes: int = Field(
        1 << 30, ge=0, description="Byte budget of the device tier (pinned and unpinned entries together)."
    )
    host_budget_bytes: int = Field(4 << 30, ge=0, description="Byte budget of the host-memory tier.")
    disk_path: str | None = Field(
        None, description="Folder of the RocksDB tier; None disables the disk tier."
    )
    disk_budget_bytes: int = Field(16 << 30, ge=0, description="Byte budget of the disk tier (stored bytes).")
    default_lease_ttl_s: float = Field(
        DEFAULT_LEASE_TTL_S, gt=0, description="Lease lifetime when lease() is called without a TTL."
    )
    pin_host_memory: bool | None = Field(
        None,
        description="Pin host-tier tensors for fast host-to-device copies; None: when the device is CUDA.",
    )
    disk_write_policy: Literal["write_back", "write_through"] = Field(
        "write_back",
        description=(
            "write_back: an entry is written to disk when it is demoted from host (and at close); "
            "write_through: every put is also written to disk in the background."
        ),
    )
    disk_backlog_bytes: int = Field(
        512 << 20,
        ge=0,
        description="Most bytes of prefixes waiting for the disk writer; a write beyond it is dropped and counted.",
    )
    persist_on_close: bool = Field(
        True, description="At close, write memory entries that the disk lacks so that a restart finds them."
    )
    purge_other_model_versions: bool = Field(
        True, description="At open, delete disk entries computed by another model version."
    )


@dataclass(frozen=True)
class Lookup:
    """Result of ``PrefixStore.lookup``. ``tier`` is where the prefix was found ("miss" if none)."""

    prefix: PrefixKV | None
    tier: Literal["device", "host", "disk", "miss"]
    invalidated: int = 0

    @property
    def hit(self) -> bool:
        return self.prefix is not None

    @property
    def length(self) -> int:
        return 0 if self.prefix is None else self.prefix.length


@dataclass(frozen=True)
class LeaseResult:
    """Outcome of ``PrefixStore.lease``. ``reason``: admitted, renewed or pinned_budget_exceeded."""

    admitted: bool
    reason: str
    expires_at: float | None
    reserved_bytes: int
    pinned_bytes: int
    budget_bytes: int

    def __bool__(self) -> bool:
        return self.admitted


@dataclass
class _Entry:
    prefix: PrefixKV
    nbytes: int
    tier: str  # "device" | "host"
    gen: int  # identity of this prefix version across moves between tiers
    on_disk: bool = False  # the disk tier holds exactly this version


@dataclass
class _Plan:
    """What lookup must do, decided under the lock."""

    kind: str  # "done" | "host" | "pending" | "disk"
    entry: _Entry | None = None
    pending: tuple[int, PrefixKV] | None = None
    disk_meta: DiskMeta | None = None
    invalidated: int = 0


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)


class PrefixStore:
    """Tiered prefix store of one ranking worker. See the module docstring.

    ``executor`` runs host/device copies (pass the worker's device executor so copies queue with
    model work); ``clock`` is the monotonic clock leases expire on (tests inject one).
    """

    def __init__(
        self,
        config: PrefixStoreConfig,
        model_version: str,
        *,
        executor: Executor | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.model_version = model_version
        self._clock = clock
        dev = torch.device(config.device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self._pin = config.pin_host_memory if config.pin_host_memory is not None else dev.type == "cuda"
        self._lock = threading.RLock()
        self._device_tier: MemoryTier[StoreKey, _Entry] = MemoryTier("device", config.device_budget_bytes)
        self._host_tier: MemoryTier[StoreKey, _Entry] = MemoryTier("host", config.host_budget_bytes)
        self._entries: dict[StoreKey, _Entry] = {}
        self._leases: LeaseTable[StoreKey] = LeaseTable(config.device_budget_bytes)
        self._gen = itertools.count(1)
        self._computes: SingleFlight[StoreKey, tuple[PrefixKV, Source]] = SingleFlight()
        self._loads: SingleFlight[StoreKey, Lookup] = SingleFlight()
        self._m = StoreCounters()
        self._closed = False
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(1, thread_name_prefix="prefix-store-copy")
        self._reader: ThreadPoolExecutor | None = None
        self._disk: DiskTier | None = None
        self._writer: DiskWriter | None = None
        if config.disk_path is not None:
            self._disk = DiskTier(config.disk_path, config.disk_budget_bytes)
            if config.purge_other_model_versions:
                for key in self._disk.list_keys():
                    if key[1] != model_version:
                        self._disk.delete(key)
                        self._m["disk_purged_other_version"] += 1
            self._writer = DiskWriter(
                self._disk, config.disk_backlog_bytes, self._lock, self._m, self._on_disk_write
            )
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="prefix-store-disk-read")
        self._tiers = ("device", "host", "disk") if self._disk is not None else ("device", "host")

    # ------------------------------------------------------------------ keys, clock, leases

    def _key(self, user_id: UserId) -> StoreKey:
        return (user_id, self.model_version)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("PrefixStore is closed")

    def _maybe_expire(self, now: float) -> None:
        if self._leases.due(now):
            self._expire(now)

    def _expire(self, now: float) -> int:
        expired = self._leases.expire(now)
        for key in expired:
            self._unpinned(key)
        self._m["lease_expiries"] += len(expired)
        return len(expired)

    def _drop_lease(self, key: StoreKey) -> None:
        self._leases.drop(key)
        self._unpinned(key)

    def _unpinned(self, key: StoreKey) -> None:
        # The entry (if on the device) is now unpinned; its bytes were inside the reservation,
        # so the device invariant still holds. It stays most recently used.
        self._device_tier.touch(key)

    def expire_leases(self, now: float | None = None) -> int:
        """Expire every lease whose TTL has passed; returns how many. Cheap when none is due."""
        with self._lock:
            return self._expire(self._clock() if now is None else now)

    def lease(self, user_id: UserId, ttl_s: float | None = None, expected_bytes: int = 0) -> LeaseResult:
        """Pin ``user_id``'s prefix on the device until ``release`` or ``ttl_s`` (renews if leased).

        ``expected_bytes`` is the size the prefix will have once computed; the lease reserves
        ``max(expected_bytes, bytes already resident)`` of the device budget. Refused, with reason
        ``pinned_budget_exceeded``, when all reservations together would exceed the budget; a
        refused renewal leaves the existing lease as it was.
        """
        self._check_open()
        if expected_bytes < 0:
            raise ValueError("expected_bytes must be >= 0")
        ttl = self.config.default_lease_ttl_s if ttl_s is None else float(ttl_s)
        if ttl <= 0:
            raise ValueError("ttl_s must be > 0")
        key = self._key(user_id)
        budget = self.config.device_budget_bytes
        with self._lock:
            now = self._clock()
            self._maybe_expire(now)
            entry = self._entries.get(key)
            resident = entry.nbytes if entry is not None and entry.tier == "device" else 0
            want = max(int(expected_bytes), resident)
            renewal = key in self._leases
            if not self._leases.reserve(key, want, now + ttl, int(expected_bytes)):
                self._m["leases_refused"] += 1
                return LeaseResult(False, "pinned_budget_exceeded", None, want, self._leases.reserved, budget)
            ok = self._make_device_room(0)
            assert ok, "reservations fit the budget, so demoting every unpinned entry must suffice"
            if entry is not None:
                (self._device_tier if entry.tier == "device" else self._host_tier).touch(key)
            self._m["leases_renewed" if renewal else "leases_admitted"] += 1
            return LeaseResult(
                True, "renewed" if renewal else "admitted", now + ttl, want, self._leases.reserved, budget
            )

    def release(self, user_id: UserId) -> bool:
        """Unpin ``user_id`` (ranking consumed the prefix). False when it held no lease."""
        key = self._key(user_id)
        with self._lock:
            self._maybe_expire(self._clock())
            if key not in self._leases:
                return False
            self._drop_lease(key)
            self._m["leases_released"] += 1
            return True

    # ------------------------------------------------------------------ placement (lock held)

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

    def _demote_from_device(self, key: StoreKey) -> None:
        entry = self._device_tier.pop(key)
        assert entry is not None
        if self._make_host_room(entry.nbytes):
            entry.tier = "host"
            self._host_tier.add(key, entry, entry.nbytes)
            self._m["demotions_device_to_host"] += 1
            self._schedule_host_copy(key, entry)
        else:
            self._spill(key, entry)

    def _disk_has(self, key: StoreKey, entry: _Entry) -> bool:
        """The disk holds, or is about to hold, exactly this version of ``key``."""
        return entry.on_disk or (self._writer is not None and self._writer.pending_gen(key) == entry.gen)

    def _spill(self, key: StoreKey, entry: _Entry) -> None:
        """``entry`` has left memory: keep it on disk or drop it."""
        del self._entries[key]
        if self._writer is not None:
            if self._disk_has(key, entry):
                self._m["demotions_to_disk"] += 1
                return
            if self._writer.enqueue(key, entry.gen, entry.prefix):
                self._m["demotions_to_disk"] += 1
                return
        self._m["evictions"] += 1

    def _schedule_host_copy(self, key: StoreKey, entry: _Entry) -> None:
        """Move a demoted entry's tensors to host memory off the calling thread. Until the copy
        lands the entry keeps its device tensors (and is promoted back without a copy)."""
        src = entry.prefix
        needs_copy = src.device.type != "cpu" or (
            self._pin and torch.cuda.is_available() and src.keys and not src.keys[0].is_pinned()
        )
        if not needs_copy or self._closed:
            return

        def copy() -> None:
            host = src.to("cpu", pin=self._pin)
            with self._lock:
                if self._entries.get(key) is entry and entry.tier == "host" and entry.prefix is src:
                    entry.prefix = host

        self._executor.submit(copy)

    def _remove(self, key: StoreKey) -> _Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            (self._device_tier if entry.tier == "device" else self._host_tier).pop(key)
        return entry

    def _place(self, key: StoreKey, prefix: PrefixKV, gen: int, on_disk: bool) -> str:
        """Put ``prefix`` in the highest tier that takes it; returns "device", "host", "disk" or
        "none". The key must have no memory entry."""
        nb = prefix.nbytes()
        lease = self._leases.get(key)
        to_device = False
        if lease is not None:
            if self._leases.resize(key, max(lease.expected_bytes, nb)):
                to_device = self._make_device_room(0)
            else:
                log.info("prefix store: lease of %r revoked: %d bytes exceed the pinned budget", key, nb)
                self._drop_lease(key)
                self._m["lease_revocations"] += 1
        if not to_device and key not in self._leases:
            to_device = self._make_device_room(nb)
        if to_device:
            if not _same_device(prefix.device, self.device):
                prefix = prefix.to(self.device)
            entry = _Entry(prefix, nb, "device", gen, on_disk)
            self._device_tier.add(key, entry, nb)
            self._entries[key] = entry
            return "device"
        entry = _Entry(prefix, nb, "host", gen, on_disk)
        self._entries[key] = entry
        if self._make_host_room(nb):
            self._host_tier.add(key, entry, nb)
            self._schedule_host_copy(key, entry)
            return "host"
        self._spill(key, entry)
        return "disk" if self._disk_has(key, entry) else "none"

    # ------------------------------------------------------------------ the disk tier (lock held)

    def _on_disk_write(
        self, key: StoreKey, gen: int, written: bool, was_pending: bool, evicted: list[StoreKey]
    ) -> None:
        """The disk writer landed (or failed) version ``gen`` of ``key``, evicting ``evicted``."""
        entry = self._entries.get(key)
        if written:
            if entry is not None:
                entry.on_disk = entry.gen == gen
        elif was_pending and entry is None:
            self._m["evictions"] += 1  # it was only on its way to disk and did not fit
        for victim in evicted:
            self._m["evictions_disk"] += 1
            entry = self._entries.get(victim)
            if entry is not None:
                entry.on_disk = False

    def _discard_disk(self, key: StoreKey, seq: int) -> None:
        """Hide a disk entry now and delete it behind the pending writes."""
        assert self._writer is not None
        self._writer.discard(key, seq)
        entry = self._entries.get(key)
        if entry is not None:
            entry.on_disk = False

    # ------------------------------------------------------------------ put / lookup

    def put(self, user_id: UserId, prefix: PrefixKV, *, keep_longer: bool = False) -> str:
        """Store ``prefix`` as ``user_id``'s entry (replacing any older one). Returns the tier it
        went to: "device", "host", "disk" (queued for the disk writer) or "none" (fits nowhere).
        With ``keep_longer``, a memory-tier entry at least as long stays and "kept" is returned
        (histories only grow: the longer one comes from a later request).

        A leased key goes to the device within its reservation (a prefix larger than the pinned
        budget allows revokes the lease, counted). On a CPU device no tensor is copied."""
        self._check_open()
        if prefix.model_version != self.model_version:
            raise ValueError(
                f"prefix of model {prefix.model_version!r} put into a store of model {self.model_version!r}"
            )
        key = self._key(user_id)
        with self._lock:
            self._maybe_expire(self._clock())
            entry = self._entries.get(key)
            if keep_longer and entry is not None and entry.prefix.length >= prefix.length:
                return "kept"
            self._remove(key)
            gen = next(self._gen)
            tier = self._place(key, prefix, gen, on_disk=False)
            self._m["puts"] += 1
            if (
                self.config.disk_write_policy == "write_through"
                and tier in ("device", "host")
                and self._writer is not None
            ):
                self._writer.enqueue(key, gen, prefix)
            return tier

    def _plan(self, key: StoreKey, history: Events) -> _Plan:
        n = len(history)
        fps: dict[int, bytes] = {}

        def fp(length: int) -> bytes:
            if length not in fps:
                fps[length] = history_fingerprint(history, length)
            return fps[length]

        invalidated = 0
        best_len = -1
        plan = _Plan("done")
        entry = self._entries.get(key)
        if entry is not None:
            length = entry.prefix.length
            if length <= n:
                if fp(length) == entry.prefix.fingerprint:
                    best_len = length
                    plan = _Plan("device" if entry.tier == "device" else "host", entry=entry)
                else:
                    # The history changed under this prefix: useless now and later.
                    self._remove(key)
                    invalidated += 1
        if self._writer is not None and self._disk is not None:
            pend = self._writer.pending_prefix(key)
            if (
                pend is not None
                and best_len < pend[1].length <= n
                and fp(pend[1].length) == pend[1].fingerprint
            ):
                best_len = pend[1].length
                plan = _Plan("pending", pending=pend)
            meta = self._disk.meta(key)
            if meta is not None and best_len < meta.length <= n:
                if fp(meta.length) == meta.fingerprint:
                    plan = _Plan("disk", disk_meta=meta)
                else:
                    self._discard_disk(key, meta.seq)
                    invalidated += 1
        plan.invalidated = invalidated
        if invalidated:
            self._m["invalidations"] += invalidated
        return plan

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._m[name] += n

    def _count_hit(self, tier: str) -> None:
        self._m.hit(tier, self._tiers)

    async def lookup(self, user_id: UserId, history: Events) -> Lookup:
        """The longest cached prefix valid for ``history``, moved to the device tier.

        A device-tier hit completes without leaving the calling thread. A host-tier or disk-tier
        hit is copied or loaded off the event loop; concurrent lookups of one key share that work.
        A prefix that does not fit the device tier is still returned on the device (not kept
        there). Entries whose history changed are deleted and counted in ``invalidated``."""
        self._check_open()
        key = self._key(user_id)
        while True:
            with self._lock:
                self._maybe_expire(self._clock())
                plan = self._plan(key, history)
                if plan.kind == "device":
                    assert plan.entry is not None
                    self._device_tier.touch(key)
                    self._count_hit("device")
                    return Lookup(plan.entry.prefix, "device", plan.invalidated)
                if plan.kind == "done":
                    self._count_hit("miss")
                    return Lookup(None, "miss", plan.invalidated)
                joining = key in self._loads
            if joining:
                self._count("singleflight_merges")
                try:
                    shared = await self._loads.join(key)
                except Exception:  # the load failed or was abandoned: plan again
                    continue
                p = shared.prefix
                if (
                    p is not None
                    and p.length <= len(history)
                    and history_fingerprint(history, p.length) == p.fingerprint
                ):
                    return shared
                continue
            result = await self._loads.lead(key, lambda plan=plan: self._load(key, plan))
            if result.tier == "miss" and result.invalidated:
                continue  # the disk entry was corrupt: a shorter valid prefix may remain
            return result

    async def _load(self, key: StoreKey, plan: _Plan) -> Lookup:
        loop = asyncio.get_running_loop()
        if plan.kind in ("host", "pending"):
            if plan.kind == "host":
                assert plan.entry is not None
                src, gen = plan.entry.prefix, plan.entry.gen
            else:
                assert plan.pending is not None
                gen, src = plan.pending
            moved = src
            if not _same_device(src.device, self.device):
                moved = await loop.run_in_executor(self._executor, src.to, self.device)
            with self._lock:
                entry = self._entries.get(key)
                if plan.kind == "host" and entry is plan.entry and entry is not None and entry.tier == "host":
                    self._remove(key)
                    if self._place(key, moved, gen, entry.on_disk) == "device":
                        self._m["promotions_host_to_device"] += 1
                elif (
                    plan.kind == "pending"
                    and entry is None
                    and self._place(key, moved, gen, on_disk=False) == "device"
                ):
                    self._m["promotions_host_to_device"] += 1
                self._count_hit("host")
            return Lookup(moved, "host", plan.invalidated)

        assert plan.kind == "disk" and plan.disk_meta is not None and self._disk is not None
        meta = plan.disk_meta
        try:
            assert self._reader is not None
            loaded = await loop.run_in_executor(self._reader, self._read_disk, key, meta)
            if loaded is not None and not _same_device(loaded.device, self.device):
                loaded = await loop.run_in_executor(self._executor, loaded.to, self.device)
        except CodecError as e:
            with self._lock:
                self._m["disk_corrupt"] += 1
                self._discard_disk(key, meta.seq)
            log.warning("prefix store: corrupt disk entry %r deleted (%s)", key, e)
            return Lookup(None, "miss", plan.invalidated + 1)
        if loaded is None:  # deleted between the plan and the read
            with self._lock:
                self._count_hit("miss")
            return Lookup(None, "miss", plan.invalidated)
        with self._lock:
            placed = "skipped" if key in self._entries else self._place(key, loaded, next(self._gen), True)
            if placed == "device":
                self._m["promotions_disk_to_device"] += 1
            self._count_hit("disk")
        return Lookup(loaded, "disk", plan.invalidated)

    def _read_disk(self, key: StoreKey, meta: DiskMeta) -> PrefixKV | None:
        assert self._disk is not None
        got = self._disk.read(key)
        if got is None:
            return None
        blob, seq = got
        prefix = decode(blob, expected_model_version=self.model_version)
        if prefix.length != meta.length or prefix.fingerprint != meta.fingerprint:
            if seq == meta.seq:
                raise CodecError("bad_header", "blob does not match its index record")
            return None  # rewritten since the plan with another history: not what was validated
        return prefix

    # ------------------------------------------------------------------ compute, single-flight

    async def get_or_compute(
        self, user_id: UserId, history: Events, compute: Compute, *, at_least: int | None = None
    ) -> tuple[PrefixKV, Source]:
        """A prefix of ``history`` at least ``at_least`` events long (all of it by default): from
        the cache when some tier holds one, else from ``compute(best valid shorter prefix or
        None)``, stored and returned.

        However many callers ask for one key at once, one computation runs; the others await it
        (source "merged") and re-check that it matches their history. ``compute`` must return a
        prefix valid for ``history`` (``prefix.matches(history)``) of at least ``at_least`` events;
        the store places it (leased keys pinned on the device) unless a longer valid one arrived
        meanwhile. Source: "device", "host", "disk", "computed", "extended" or "merged". An
        exception from ``compute`` reaches every caller waiting on it."""
        self._check_open()
        key = self._key(user_id)
        n = len(history) if at_least is None else at_least
        if not 0 <= n <= len(history):
            raise ValueError(f"get_or_compute: at_least={at_least} outside [0, {len(history)}]")
        while True:
            if key in self._computes:
                self._count("singleflight_merges")
                try:
                    prefix, _ = await self._computes.join(key)
                except FlightAbandoned:  # the computing caller was cancelled, not this one: retry
                    continue
                if prefix.length >= n and prefix.matches(history):
                    return prefix, "merged"
                continue
            found = await self.lookup(user_id, history)
            if found.prefix is not None and found.prefix.length >= n:
                return found.prefix, found.tier  # type: ignore[return-value]
            if key in self._computes:  # someone started while we looked
                continue
            return await self._computes.lead(
                key, lambda found=found: self._compute_and_store(key, user_id, history, compute, found, n)
            )

    async def _compute_and_store(
        self, key: StoreKey, user_id: UserId, history: Events, compute: Compute, found: Lookup, n: int
    ) -> tuple[PrefixKV, Source]:
        result = await compute(found.prefix)
        if not isinstance(result, PrefixKV) or result.length < n or not result.matches(history):
            raise ValueError("compute returned a prefix that does not match the history")
        with self._lock:
            entry = self._entries.get(key)
            # A ranking may have stored a longer prefix of this history meanwhile: keep it.
            newer = (
                entry is not None and entry.prefix.length > result.length and entry.prefix.matches(history)
            )
        if not newer:
            self.put(user_id, result)
        source: Source = "extended" if found.prefix is not None else "computed"
        with self._lock:
            self._m["computations"] += 1
            if source == "extended":
                self._m["extensions"] += 1
        return result, source

    def cached_length(self, user_id: UserId, history: Events) -> int:
        """Length of the prefix of ``history`` that the device or host tier holds for
        ``user_id`` (0 if none). Loads, promotes and counts nothing."""
        with self._lock:
            entry = self._entries.get(self._key(user_id))
            if entry is None or not entry.prefix.matches(history):
                return 0
            return entry.prefix.length

    def in_flight(self, user_id: UserId) -> bool:
        """True while a computation of ``user_id``'s prefix runs in ``get_or_compute``."""
        return self._key(user_id) in self._computes

    async def wait_in_flight(self, user_id: UserId, timeout_s: float | None = None) -> PrefixKV | None:
        """The prefix being computed for ``user_id``, or None if nothing is in flight, it fails,
        or ``timeout_s`` passes first (the computation itself goes on)."""
        key = self._key(user_id)
        if key not in self._computes:
            return None
        self._count("singleflight_merges")
        try:
            prefix, _ = await self._computes.join(key, timeout_s)
        except Exception:  # failed, abandoned or timed out
            return None
        return prefix

    def forget(self, user_ids: Iterable[UserId]) -> int:
        """Drop every copy of these users' prefixes: memory tiers, leases, queued and stored disk
        copies. Returns how many users had one. Blocks until the disk copies are deleted."""
        forgotten = 0
        with self._lock:
            for user_id in user_ids:
                key = self._key(user_id)
                had = self._remove(key) is not None
                if key in self._leases:
                    self._drop_lease(key)
                if self._disk is not None and self._writer is not None:
                    pend = self._writer.pending_gen(key)
                    meta = self._disk.meta(key)
                    had = had or pend is not None or meta is not None
                    if meta is not None:
                        self._disk.hide(key, meta.seq)
                    if pend is not None or meta is not None:
                        self._writer.delete_all(key)
                forgotten += had
            if forgotten:
                self._m["forgotten"] += forgotten
        self.flush()
        return forgotten

    # ------------------------------------------------------------------ introspection

    def where(self, user_id: UserId) -> str | None:
        """Where ``user_id``'s newest copy lives: "device", "host", "pending" (in memory, on its
        way to disk), "disk" or None."""
        key = self._key(user_id)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                return entry.tier
            if self._writer is not None and self._writer.pending_gen(key) is not None:
                return "pending"
        if self._disk is not None and self._disk.meta(key) is not None:
            return "disk"
        return None

    def metrics(self) -> dict[str, float | int]:
        """Counters (monotonic, ``store_counters``) and gauges (bytes and entries per tier,
        reservations)."""
        with self._lock:
            out = self._m.snapshot()
            out["bytes_device"] = self._device_tier.used_bytes
            out["bytes_host"] = self._host_tier.used_bytes
            out["bytes_disk"] = self._disk.used_bytes if self._disk is not None else 0
            out["bytes_pinned"] = self._pinned_resident()
            out["bytes_reserved"] = self._leases.reserved
            out["bytes_pending_disk"] = self._writer.pending_bytes if self._writer is not None else 0
            out["entries_device"] = len(self._device_tier)
            out["entries_host"] = len(self._host_tier)
            out["entries_disk"] = len(self._disk) if self._disk is not None else 0
            out["leases"] = len(self._leases)
            out["budget_device_bytes"] = self.config.device_budget_bytes
            out["budget_host_bytes"] = self.config.host_budget_bytes
            out["budget_disk_bytes"] = self.config.disk_budget_bytes if self._disk is not None else 0
            return out

    # ------------------------------------------------------------------ shutdown

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until every disk write queued so far has landed."""
        if self._writer is not None and not self._closed:
            self._writer.flush(timeout_s)

    def close(self) -> None:
        """Persist memory entries the disk lacks (``persist_on_close``), flush and close. Idempotent."""
        if self._closed:
            return
        if self._writer is not None and self.config.persist_on_close:
            with self._lock:
                for key, entry in list(self._entries.items()):
                    if not self._disk_has(key, entry):
                        self._writer.enqueue(key, entry.gen, entry.prefix, force=True)
        self.flush()
        self._closed = True
        if self._writer is not None:
            self._writer.close()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
        if self._own_executor:
            self._executor.shutdown(wait=True)
        if self._disk is not None:
            self._disk.close()

    def __enter__(self) -> PrefixStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
