"""The memory-aware expander: a tiered store of ``PrefixKV`` with leases, promotion and single-flight.

Primitives:
- ``PrefixStoreConfig`` (defined in ``store_config``, which the settings of every stage import
  without torch): devices, byte budgets per tier, disk folder, lease TTL, disk policy, the
  cold tiers' format (``cold_kv_format``: exact, bf16 or int8; promotion decodes to the model's dtype).
- ``PrefixStore``: the asynchronous orchestration over the placement core (``placement``: which
  tier holds each prefix, leases, room-making, demotion, spill, all synchronous and testable
  without asyncio). One entry per key ``(user_id, model_version)`` in at most one memory tier
  (device or host) plus, optionally, a copy on disk.
  - ``await lookup(user_id, history) -> Lookup``: the longest cached prefix valid for ``history``
    (same fingerprint over its length), promoted to the device tier; entries whose history
    changed are dropped and counted. Concurrent lookups of one key share one copy or disk read.
  - ``lease(user_id, ttl_s, expected_bytes) -> LeaseResult`` / ``release(user_id)``: pin a key
    from pre-inference until ranking consumes it; admission reserves device bytes and is refused
    (``pinned_budget_exceeded``) when pins would exceed the device budget.
  - ``await get_or_compute(user_id, history, compute, at_least=n) -> (PrefixKV, source)``: a
    cached prefix of ``history`` at least ``n`` long, else one computation per key however many
    callers ask at once (``compute`` gets the best valid shorter prefix to extend, or ``None``).
  - ``forget(user_ids)``: drop these users' prefixes from every tier, leases included (the
    histories they were computed from are gone).
  - ``persist(timeout_s)``: write what the disk lacks and wait for it (for a successor to adopt).
  - ``set_tier_choice(choice)``: the expander's choice (``tier_costs``): a tier predicted slower
    than recomputing serves no lookup and (disk) takes no write; counted.
  - ``device_pages(layout, reserve_tokens)``: the device tier's pages (``kv_pages.KVPages``), for
    the model runner to read and write prefixes in place: one copy of a prefix on the device.
  - ``put``, ``cached_length``, ``in_flight``, ``wait_in_flight``, ``where``, ``expire_leases``, ``metrics``,
    ``flush``, ``settle`` (host copies too), ``close``.
- ``Lookup``: a lookup's result; ``LeaseResult`` (from ``placement``): a lease's.

The parts beside it: the placement core (``placement``), the tiers (``device_tier``: the device's
entries in pages; ``tiers``: byte-budgeted LRU maps and the disk tier's blob files with their
RocksDB index; ``disk_placement``: the disk's side of placement; ``staging``: the CUDA copies to
and from host memory; ``tier_costs``: the tier choice), the leases and their reservations
(``leases``), the disk write-back queue (``disk_writer``), single-flight (``single_flight``) and the
counters (``store_counters``).

A promotion (host or disk to device) writes the prefix's tokens into fresh pages layer by layer
(on CUDA from pinned memory, on a side stream); a demotion gathers its pages and copies them to
host memory on the copy thread (on CUDA into pinned memory, a layer at a time, without a wait per
copy). On a CPU both are plain copies.

Threading: placement state lives behind the core's lock; call the store from one asyncio loop
(sync methods may be called from any thread). Copies between host and device run on
``executor`` (the worker's device executor, or an owned thread); disk reads and decoding run on a
private reader thread, disk writes and deletes on the disk writer's thread, so disk I/O never
occupies the device executor and never blocks lookups. An entry whose disk write is still
pending is served from memory. This module never imports Kafka.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch

from relaygr.workers.kv_pages import KVLayout, KVPages, PagesExhausted
from relaygr.workers.prefix_kv import Events, PrefixKV, history_fingerprint
from relaygr.workers.store.blob_files import RecyclingBuffers
from relaygr.workers.store.kv_codec import CodecError, decode
from relaygr.workers.store.kv_formats import same_device, to_cold, to_warm
from relaygr.workers.store.placement import LeaseResult, PrefixPlacement, Tier, UserId
from relaygr.workers.store.single_flight import FlightAbandoned, SingleFlight
from relaygr.workers.store.staging import PinnedStaging, staging_for, to_host
from relaygr.workers.store.store_config import PrefixStoreConfig
from relaygr.workers.store.tier_costs import TierChoice
from relaygr.workers.store.tiers import DiskMeta, Entry, Plan, StoreKey

log = logging.getLogger(__name__)

__all__ = ["LeaseResult", "Lookup", "PrefixStore", "PrefixStoreConfig", "Tier", "UserId"]

Source = Literal["device", "host", "disk", "computed", "extended", "merged"]
Compute = Callable[[PrefixKV | None], Awaitable[PrefixKV]]


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


class PrefixStore:
    """Tiered prefix store of one ranking worker. See the module docstring.

    ``executor`` runs host/device copies (pass the worker's device executor so copies queue with
    model work); ``clock`` is the monotonic clock leases expire on (tests inject one);
    ``tier_choice`` (``tier_costs``; also ``set_tier_choice``) keeps lookups and disk writes off a
    tier predicted slower than recomputing (None: every tier serves).
    """

    def __init__(
        self,
        config: PrefixStoreConfig,
        model_version: str,
        *,
        executor: Executor | None = None,
        clock: Callable[[], float] = time.monotonic,
        tier_choice: TierChoice | None = None,
    ) -> None:
        self.config = config
        self.model_version = model_version
        dev = torch.device(config.device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self._pin = config.pin_host_memory if config.pin_host_memory is not None else dev.type == "cuda"
        self._closed = False
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(1, thread_name_prefix="prefix-store-copy")
        self.placement = PrefixPlacement(
            config,
            model_version,
            device=dev,
            clock=clock,
            on_host=self._schedule_host_copy,
            tier_choice=tier_choice,
        )
        self._computes: SingleFlight[StoreKey, tuple[PrefixKV, Source]] = SingleFlight()
        self._loads: SingleFlight[StoreKey, Lookup] = SingleFlight()
        self._reader: ThreadPoolExecutor | None = None
        self._staging: PinnedStaging | None = None
        self._read_buffers: RecyclingBuffers | None = None
        if self.placement.disk is not None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="prefix-store-disk-read")
            self._staging = staging_for(dev)
            self._read_buffers = RecyclingBuffers()

    def device_pages(self, layout: KVLayout, reserve_tokens: int = 0) -> KVPages:
        """The device tier's pages for ``layout``'s tokens (made now if they are not yet, with
        ``reserve_tokens`` beyond the budget's for what the runner holds beside the entries)."""
        return self.placement.device_pages(layout, reserve_tokens)

    def device_bytes(self, prefix: PrefixKV) -> int:
        """The bytes ``prefix`` takes in the device tier (whole pages)."""
        return self.placement.device_bytes(prefix)

    def set_tier_choice(self, choice: TierChoice | None) -> None:
        """Use ``choice`` from now on (the worker sets it once its latency model is known)."""
        with self.placement.lock:
            self.placement.tier_choice = choice

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("PrefixStore is closed")

    # ------------------------------------------------------------------ leases and puts (sync)

    def expire_leases(self, now: float | None = None) -> int:
        """Expire every lease whose TTL has passed; returns how many. Cheap when none is due."""
        return self.placement.expire(now)

    def lease(self, user_id: UserId, ttl_s: float | None = None, expected_bytes: int = 0) -> LeaseResult:
        """Pin ``user_id``'s prefix on the device until ``release`` or ``ttl_s`` (renews if leased).

        ``expected_bytes`` is the size the prefix will have once computed; the lease reserves
        ``max(expected_bytes, bytes already resident)`` of the device budget. Refused, with reason
        ``pinned_budget_exceeded``, when all reservations together would exceed the budget; a
        refused renewal leaves the existing lease as it was.
        """
        self._check_open()
        ttl = self.config.default_lease_ttl_s if ttl_s is None else float(ttl_s)
        return self.placement.lease(user_id, ttl, expected_bytes)

    def release(self, user_id: UserId) -> bool:
        """Unpin ``user_id`` (ranking consumed the prefix). False when it held no lease."""
        return self.placement.release(user_id)

    def put(self, user_id: UserId, prefix: PrefixKV, *, keep_longer: bool = False) -> str:
        """Store ``prefix`` as ``user_id``'s entry (replacing any older one). Returns the tier it
        went to: "device", "host", "disk" (queued for the disk writer) or "none" (fits nowhere).
        With ``keep_longer``, a memory-tier entry at least as long stays and "kept" is returned
        (histories only grow: the longer one comes from a later request).

        A leased key goes to the device within its reservation (a prefix larger than the pinned
        budget allows revokes the lease, counted). On a CPU device no tensor is copied."""
        self._check_open()
        return self.placement.put(user_id, prefix, keep_longer=keep_longer)

    def _schedule_host_copy(self, key: StoreKey, entry: Entry) -> None:
        """Move a demoted entry's tensors to host memory, in the cold format, off the calling
        thread. Until the copy lands the entry keeps its device tensors (and is promoted back
        without a copy)."""
        src = entry.prefix
        fmt = self.placement.cold_format
        needs_copy = (
            src.device.type != "cpu"
            or src.kv_format != fmt
            or (self._pin and torch.cuda.is_available() and src.keys and not src.keys[0].is_pinned())
        )
        if not needs_copy or self._closed:
            return

        def copy() -> None:
            # Compressed where the tensors are (the device's bandwidth), then moved.
            cold = to_host(to_cold(src, fmt), pin=self._pin)
            self.placement.replace_host_tensors(key, entry, src, cold)

        self._executor.submit(copy)

    # ------------------------------------------------------------------ lookup

    async def lookup(self, user_id: UserId, history: Events) -> Lookup:
        """The longest cached prefix valid for ``history``, moved to the device tier.

        A device-tier hit completes without leaving the calling thread. A host-tier or disk-tier
        hit is copied or loaded off the event loop; concurrent lookups of one key share that work.
        A prefix that does not fit the device tier is still returned on the device (not kept
        there). Entries whose history changed are deleted and counted in ``invalidated``."""
        self._check_open()
        placement = self.placement
        key = placement.key(user_id)
        while True:
            with placement.lock:
                joining = key in self._loads
                plan = None if joining else placement.plan(key, history)
            if plan is not None and plan.kind == "device":
                assert plan.entry is not None
                return Lookup(plan.entry.prefix, "device", plan.invalidated)
            if plan is not None and plan.kind == "done":
                return Lookup(None, "miss", plan.invalidated)
            if joining:
                placement.count("singleflight_merges")
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
            assert plan is not None
            result = await self._loads.lead(key, lambda plan=plan: self._load(key, plan))
            if result.tier == "miss" and result.invalidated:
                continue  # the disk entry was corrupt: a shorter valid prefix may remain
            return result

    async def _load(self, key: StoreKey, plan: Plan) -> Lookup:
        loop = asyncio.get_running_loop()
        if plan.kind in ("host", "pending"):
            if plan.kind == "host":
                assert plan.entry is not None
                src = plan.entry.prefix
            else:
                assert plan.pending is not None
                src = plan.pending[1]
            # Into the device tier's pages, a layer at a time (``DeviceTier.admit``).
            moved = await loop.run_in_executor(self._executor, self._to_device, src, False)
            return Lookup(self.placement.promoted(key, plan, moved), "host", plan.invalidated)

        assert plan.kind == "disk" and plan.disk_meta is not None and self._reader is not None
        meta = plan.disk_meta
        try:
            loaded = await loop.run_in_executor(self._reader, self._read_disk, key, meta)
        except CodecError as e:
            self.placement.corrupt(key, meta.seq)
            log.warning("prefix store: corrupt disk entry %r deleted (%s)", key, e)
            return Lookup(None, "miss", plan.invalidated + 1)
        handed = self.placement.loaded(key, loaded)
        if handed is None:  # deleted between the plan and the read
            return Lookup(None, "miss", plan.invalidated)
        return Lookup(handed, "disk", plan.invalidated)

    def _read_disk(self, key: StoreKey, meta: DiskMeta) -> PrefixKV | None:
        """One sequential read of the blob file (into the pinned staging buffer on CUDA, else a
        recycled buffer that becomes the prefix's memory), checked, decoded without a copy, and on
        CUDA copied to the device layer by layer (``staging``)."""
        disk = self.placement.disk
        assert disk is not None
        staging, buffers = self._staging, self._read_buffers
        got = disk.read_into(key, staging.alloc if staging is not None else buffers and buffers.alloc)
        if got is None:
            return None
        read, seq = got
        prefix = decode(
            read.blob, expected_model_version=self.model_version, body_crc=read.body_crc, owned=True
        )
        if prefix.length != meta.length or prefix.fingerprint != meta.fingerprint:
            if seq == meta.seq:
                raise CodecError("bad_header", "blob does not match its index record")
            return None  # rewritten since the plan with another history: not what was validated
        return self._to_device(prefix, True)

    def _to_device(self, prefix: PrefixKV, staged: bool) -> PrefixKV:
        """``prefix`` (any format, any device) in the device tier's pages, its tokens written there
        a layer at a time; where the pages cannot take it, exact on the device as a tensor of its
        own (``staged``: read into the staging buffer, which is free again on return)."""
        try:
            return self.placement.admit(prefix)
        except PagesExhausted:
            self.placement.count("device_pages_exhausted")
        if staged and self._staging is not None:
            prefix = self._staging.to_device(prefix)
        if prefix.kv_format == "exact" and same_device(prefix.device, self.device):
            return prefix
        non_blocking = self._pin and prefix.device.type == "cpu"
        return to_warm(prefix, self.device, non_blocking=non_blocking)

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
        key = self.placement.key(user_id)
        n = len(history) if at_least is None else at_least
        if not 0 <= n <= len(history):
            raise ValueError(f"get_or_compute: at_least={at_least} outside [0, {len(history)}]")
        while True:
            if key in self._computes:
                self.placement.count("singleflight_merges")
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
                key, lambda found=found: self._compute_and_store(user_id, history, compute, found, n)
            )

    async def _compute_and_store(
        self, user_id: UserId, history: Events, compute: Compute, found: Lookup, n: int
    ) -> tuple[PrefixKV, Source]:
        result = await compute(found.prefix)
        if not isinstance(result, PrefixKV) or result.length < n or not result.matches(history):
            raise ValueError("compute returned a prefix that does not match the history")
        extended = found.prefix is not None
        self.placement.put_computed(user_id, result, history, extended)
        return result, "extended" if extended else "computed"

    def cached_length(self, user_id: UserId, history: Events) -> int:
        """Length of the prefix of ``history`` that the device or host tier holds for
        ``user_id`` (0 if none). Loads, promotes and counts nothing."""
        return self.placement.cached_length(user_id, history)

    def in_flight(self, user_id: UserId) -> bool:
        """True while a computation of ``user_id``'s prefix runs in ``get_or_compute``."""
        return self.placement.key(user_id) in self._computes

    async def wait_in_flight(self, user_id: UserId, timeout_s: float | None = None) -> PrefixKV | None:
        """The prefix being computed for ``user_id``, or None if nothing is in flight, it fails,
        or ``timeout_s`` passes first (the computation itself goes on)."""
        key = self.placement.key(user_id)
        if key not in self._computes:
            return None
        self.placement.count("singleflight_merges")
        try:
            prefix, _ = await self._computes.join(key, timeout_s)
        except Exception:  # failed, abandoned or timed out
            return None
        return prefix

    def forget(self, user_ids: Iterable[UserId]) -> int:
        """Drop every copy of these users' prefixes: memory tiers, leases, queued and stored disk
        copies. Returns how many users had one. Blocks until the disk copies are deleted."""
        forgotten = self.placement.forget(user_ids)
        self.flush()
        return forgotten

    # ------------------------------------------------------------------ introspection

    def where(self, user_id: UserId) -> str | None:
        """Where ``user_id``'s newest copy lives: "device", "host", "pending" (in memory, on its
        way to disk), "disk" or None."""
        return self.placement.where(user_id)

    def metrics(self) -> dict[str, float | int]:
        """Counters (monotonic, ``store_counters``) and gauges (bytes and entries per tier,
        reservations)."""
        return self.placement.metrics()

    # ------------------------------------------------------------------ shutdown

    def settle(self, timeout_s: float | None = None) -> None:
        """Block until every copy to host queued so far has landed (and every disk write)."""
        if not self._closed:
            self._executor.submit(lambda: None).result(timeout_s)
        self.flush(timeout_s)

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until every disk write queued so far has landed."""
        if self.placement.writer is not None and not self._closed:
            self.placement.writer.flush(timeout_s)

    def persist(self, timeout_s: float | None = None) -> dict[str, object]:
        """Write every memory entry the disk lacks to the disk tier, through the disk writer
        (nothing leaves memory), and wait until they landed: another process opening the folder
        finds them. Returns the folder (None: no disk tier), the model version, the prefixes and
        bytes written meanwhile, and the disk tier's entries and bytes. Blocking."""
        self._check_open()
        placement, before = self.placement, self.placement.metrics()
        placement.persist_unwritten()
        self.flush(timeout_s)
        if placement.disk is not None:
            placement.disk.flush()  # into table and blob files: a reader need not replay the log
        after = placement.metrics()
        return {
            "folder": self.config.disk_path if placement.disk is not None else None,
            "model_version": self.model_version,
            "written": after.get("disk_writes", 0) - before.get("disk_writes", 0),
            "written_bytes": after.get("disk_bytes_written", 0) - before.get("disk_bytes_written", 0),
            "prefixes": after["entries_disk"],
            "bytes": after["bytes_disk"],
        }

    def close(self) -> None:
        """Persist memory entries the disk lacks (``persist_on_close``), flush and close. Idempotent."""
        if self._closed:
            return
        if self.config.persist_on_close:
            self.placement.persist_unwritten()
        self.flush()
        self._closed = True
        self.placement.close()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
        if self._own_executor:
            self._executor.shutdown(wait=True)

    def __enter__(self) -> PrefixStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
