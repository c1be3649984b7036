"""The tiered prefix store: placement, leases, promotion, disk restart and corruption, single-flight.

Prefixes here are synthetic (``torch.randn``): the store never looks inside the tensors.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
import torch
from rocksdict import Options, Rdict
from store_probe import is_leased, keys_by_tier

from relaygr.workers.kv_pages import KVLayout
from relaygr.workers.prefix_kv import Events, PrefixKV, history_fingerprint
from relaygr.workers.store.blob_files import BlobFiles
from relaygr.workers.store.prefix_store import PrefixStore, PrefixStoreConfig
from relaygr.workers.store.tiers import BLOB_DIR, INDEX_PREFIX, DiskTier, encode_key

MV = "m1"


def history(user: int, n: int, *, salt: int = 0) -> Events:
    return Events.from_lists(
        [user * 1_000_003 + salt * 7919 + i for i in range(n)],
        [1_700_000_000.0 + 60.0 * i for i in range(n)],
        [i % 3 for i in range(n)],
    )


def prefix_for(h: Events, n: int | None = None, *, mv: str = MV, seed: int = 0) -> PrefixKV:
    n = len(h) if n is None else n
    g = torch.Generator().manual_seed(seed * 1000 + n)
    return PrefixKV(
        keys=[torch.randn(2, n, 4, generator=g) for _ in range(2)],
        values=[torch.randn(2, n, 4, generator=g) for _ in range(2)],
        positions=torch.arange(n, dtype=torch.int64),
        timestamps=h.timestamps[:n].clone(),
        length=n,
        fingerprint=history_fingerprint(h, n),
        model_version=mv,
    )


NB10 = prefix_for(history(0, 10)).nbytes()  # 1440 bytes for 10 tokens (host and disk: dense)
PAGE = 1  # tokens a device page holds here: a prefix's device bytes are its tokens'
ND10 = KVLayout(2, 2, 4, 4, torch.float32, PAGE).bytes_for(10)  # 1360 bytes on the device (in pages)


def same(a: PrefixKV, b: PrefixKV) -> bool:
    a, b = a.dense(), b.dense()  # a paged prefix's tokens, gathered
    return (
        a.length == b.length
        and a.fingerprint == b.fingerprint
        and all(torch.equal(x, y) for x, y in zip([*a.keys, *a.values], [*b.keys, *b.values], strict=True))
        and torch.equal(a.positions, b.positions)
        and torch.equal(a.timestamps, b.timestamps)
    )


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make_store(tmp_path=None, *, device=3, host=3, disk=None, clock=None, **kw) -> PrefixStore:
    """Budgets in units of one 10-token prefix (its pages' bytes on the device, its dense bytes on
    host); ``disk`` in host units (None: no disk tier)."""
    cfg = PrefixStoreConfig(
        device_budget_bytes=device * ND10,
        page_tokens=PAGE,
        host_budget_bytes=host * NB10,
        disk_path=None if disk is None else str(tmp_path / "kv"),
        disk_budget_bytes=(disk or 0) * (NB10 + 1024),
        **kw,
    )
    return PrefixStore(cfg, MV, clock=clock or Clock())


async def test_device_hit_returns_what_was_stored() -> None:
    store = make_store()
    h = history(1, 10)
    p = prefix_for(h)
    assert store.put(1, p) == "device"
    got = await store.lookup(1, h)
    # Written into the device tier's pages once; every hit is that paged prefix, no copy.
    assert got.tier == "device" and got.hit and got.prefix.is_paged and same(got.prefix, p)
    assert (await store.lookup(1, h)).prefix is got.prefix
    m = store.metrics()
    assert (m["hits_device"], m["lookups"], m["bytes_device"], m["entries_device"]) == (2, 2, ND10, 1)
    miss = await store.lookup(2, history(2, 10))
    assert miss.tier == "miss" and miss.prefix is None
    m = store.metrics()
    assert (m["misses_device"], m["misses_host"], m["misses"]) == (1, 1, 1)
    store.close()


async def test_longer_history_reuses_prefix_changed_history_invalidates() -> None:
    store = make_store()
    long = history(1, 20)
    store.put(1, prefix_for(long, 10))
    got = await store.lookup(1, long)
    assert got.tier == "device" and got.length == 10
    # an older, shorter history cannot use the prefix, but does not destroy it either
    short = await store.lookup(1, long.slice(0, 5))
    assert short.tier == "miss" and short.invalidated == 0 and store.where(1) == "device"
    changed = history(1, 20, salt=1)
    got = await store.lookup(1, changed)
    assert got.tier == "miss" and got.invalidated == 1
    assert store.where(1) is None and store.metrics()["invalidations"] == 1
    store.close()


async def test_demotion_then_promotion_returns_equal_tensors() -> None:
    store = make_store(device=2, host=2)
    hs = {u: history(u, 10) for u in range(4)}
    ps = {u: prefix_for(hs[u], seed=u) for u in range(4)}
    for u in range(4):
        assert store.put(u, ps[u]) == "device"
    assert [store.where(u) for u in range(4)] == ["host", "host", "device", "device"]
    got = await store.lookup(0, hs[0])
    assert got.tier == "host" and same(got.prefix, ps[0])
    assert store.where(0) == "device" and store.where(2) == "host"  # LRU device entry made room
    m = store.metrics()
    assert m["promotions_host_to_device"] == 1 and m["demotions_device_to_host"] == 3
    # a fifth entry with no disk tier: the LRU host entry is dropped
    store.put(9, prefix_for(history(9, 10)))
    assert store.metrics()["evictions"] == 1 and store.where(1) is None
    store.close()


async def test_pinned_entries_are_never_evicted_or_demoted() -> None:
    store = make_store(device=3, host=1)
    for u in (0, 1):
        assert store.lease(u, ttl_s=60, expected_bytes=ND10).admitted
        store.put(u, prefix_for(history(u, 10)))
    for u in range(10, 30):
        store.put(u, prefix_for(history(u, 10)))
        assert store.where(0) == "device" and store.where(1) == "device"
        assert store.metrics()["bytes_device"] <= 3 * ND10
    # the one unpinned device slot cycles; the pinned ones stay
    assert sorted(k[0] for k in keys_by_tier(store)["device"]) == [0, 1, 29]
    store.release(0)
    for u in range(30, 33):
        store.put(u, prefix_for(history(u, 10)))
    assert store.where(0) != "device" and store.where(1) == "device"
    store.close()


async def test_leased_entry_in_host_stays_in_memory_then_promotes_pinned() -> None:
    store = make_store(device=1, host=1)
    h0 = history(0, 10)
    store.put(0, prefix_for(h0))
    store.put(1, prefix_for(history(1, 10)))
    assert store.where(0) == "host"
    assert store.lease(0, expected_bytes=0).reserved_bytes == 0  # not on the device: nothing to reserve yet
    store.put(2, prefix_for(history(2, 10)))  # 1 must leave the device, but the host slot is leased
    assert store.where(0) == "host" and store.where(1) is None
    got = await store.lookup(0, h0)
    assert got.tier == "host" and store.where(0) == "device"
    assert store.metrics()["bytes_reserved"] == ND10  # the promotion grew the reservation
    store.put(3, prefix_for(history(3, 10)))
    assert store.where(0) == "device" and store.where(3) == "host"
    store.close()


def test_lease_admission_fails_when_pins_exceed_device_budget() -> None:
    store = make_store(device=3)
    for u in range(3):
        r = store.lease(u, ttl_s=10, expected_bytes=ND10)
        assert r.admitted and r.reason == "admitted"
    refused = store.lease(3, ttl_s=10, expected_bytes=ND10)
    assert not refused and refused.reason == "pinned_budget_exceeded"
    assert refused.pinned_bytes == 3 * ND10 and refused.budget_bytes == 3 * ND10
    assert store.lease(0, ttl_s=20, expected_bytes=ND10).reason == "renewed"
    assert not store.lease(0, ttl_s=20, expected_bytes=2 * ND10)  # growing a renewal must fit too
    assert store.release(1) and not store.release(1)
    assert store.lease(3, ttl_s=10, expected_bytes=ND10).admitted
    m = store.metrics()
    assert (m["leases_admitted"], m["leases_refused"], m["leases_renewed"]) == (4, 2, 1)
    assert m["bytes_reserved"] == 3 * ND10
    store.close()


def test_leases_expire_lazily_on_the_injected_clock() -> None:
    clock = Clock()
    store = make_store(device=2, host=0, clock=clock)
    store.lease(0, ttl_s=5, expected_bytes=ND10)
    store.put(0, prefix_for(history(0, 10)))
    clock.t += 4.9
    assert store.expire_leases() == 0 and is_leased(store, 0)
    clock.t += 0.2
    # no explicit expire call: the next operation notices
    store.put(1, prefix_for(history(1, 10)))
    store.put(2, prefix_for(history(2, 10)))
    assert not is_leased(store, 0) and store.where(0) is None
    m = store.metrics()
    assert m["lease_expiries"] == 1 and m["bytes_reserved"] == 0
    store.close()


def test_reserved_room_keeps_unpinned_entries_out() -> None:
    store = make_store(device=3, host=3)
    for u in range(3):
        store.put(u, prefix_for(history(u, 10)))
    # leasing two users that are not resident yet demotes two unpinned entries right away
    store.lease(7, expected_bytes=ND10)
    store.lease(8, expected_bytes=ND10)
    assert len(keys_by_tier(store)["device"]) == 1
    store.put(7, prefix_for(history(7, 10)))
    store.put(8, prefix_for(history(8, 10)))
    assert store.where(7) == store.where(8) == "device"
    # a prefix larger than the reservation that no longer fits revokes the lease instead
    store.lease(9, expected_bytes=0)
    store.put(9, prefix_for(history(9, 25)))
    m = store.metrics()
    assert m["lease_revocations"] == 1 and not is_leased(store, 9)
    assert m["bytes_device"] <= 3 * ND10
    store.close()


def test_oversized_entries_skip_tiers(tmp_path) -> None:
    big = prefix_for(history(1, 30))  # three units
    store = make_store(device=2, host=4)
    assert store.put(1, big) == "host"
    store.close()
    store = make_store(device=2, host=2)
    assert store.put(1, big) == "none" and store.metrics()["evictions"] == 1
    store.close()
    store = make_store(tmp_path, device=2, host=2, disk=8)
    assert store.put(1, big) == "disk"
    store.flush()
    assert store.where(1) == "disk"
    store.close()


async def test_restart_serves_entries_from_disk(tmp_path) -> None:
    hs = {u: history(u, 10 + u) for u in range(5)}
    ps = {u: prefix_for(hs[u], seed=u) for u in range(5)}
    store = make_store(tmp_path, device=2, host=2, disk=20)
    for u in range(5):
        store.put(u, ps[u])
    store.close()  # persists what memory held
    store = make_store(tmp_path, device=8, host=2, disk=20)
    assert store.metrics()["entries_disk"] == 5
    for u in range(5):
        got = await store.lookup(u, hs[u])
        assert got.tier == "disk" and same(got.prefix, ps[u])
        assert store.where(u) == "device"
    # a longer history extends from the persisted prefix
    got = await store.lookup(0, history(0, 15))
    assert got.length == 10
    assert store.metrics()["promotions_disk_to_device"] == 5
    store.close()


async def test_entries_of_another_model_version_are_purged(tmp_path) -> None:
    store = make_store(tmp_path, disk=10)
    store.put(1, prefix_for(history(1, 10)))
    store.close()
    cfg = store.config
    other = PrefixStore(cfg, "m2")
    assert other.metrics()["disk_purged_other_version"] == 1 and other.metrics()["entries_disk"] == 0
    other.close()


def _mutate_stored(path, key, how: str) -> None:
    disk = DiskTier(path, 1 << 30)
    meta = disk.meta(key)
    disk.close()
    assert meta is not None
    blob_file = BlobFiles(path / BLOB_DIR).path(meta.seq)
    with open(blob_file, "rb") as f:
        raw = bytearray(f.read())
    if how == "flip":
        raw[len(raw) // 2] ^= 0xFF
    else:
        raw = raw[: len(raw) // 2]
    with open(blob_file, "wb") as f:
        f.write(raw)


@pytest.mark.parametrize("how", ["flip", "truncate"])
async def test_corrupt_disk_entry_is_a_counted_deleted_miss(tmp_path, caplog, how) -> None:
    h = history(1, 10)
    store = make_store(tmp_path, disk=10)
    store.put(1, prefix_for(h))
    store.put(2, prefix_for(history(2, 10)))
    store.close()
    _mutate_stored(tmp_path / "kv", (1, MV), how)
    store = make_store(tmp_path, disk=10)
    with caplog.at_level(logging.WARNING, logger="relaygr.workers.store.prefix_store"):
        got = await store.lookup(1, h)
        assert got.tier == "miss" and got.prefix is None
        again = await store.lookup(1, h)
        assert again.tier == "miss"
    assert sum("corrupt disk entry" in r.message for r in caplog.records) == 1
    m = store.metrics()
    assert m["disk_corrupt"] == 1 and m["entries_disk"] == 1
    assert (await store.lookup(2, history(2, 10))).tier == "disk"  # the neighbour is intact
    store.close()
    db = Rdict(str(tmp_path / "kv"), Options(raw_mode=True))
    assert db.get(INDEX_PREFIX + encode_key((1, MV))) is None
    db.close()
    assert len(BlobFiles(tmp_path / "kv" / BLOB_DIR).seqs()) == 1  # the neighbour's file alone


async def test_pending_disk_write_is_served_from_memory(tmp_path, monkeypatch) -> None:
    gate = threading.Event()
    real_write = DiskTier.write

    def slow_write(self, *a, **kw):
        assert gate.wait(10)
        return real_write(self, *a, **kw)

    monkeypatch.setattr(DiskTier, "write", slow_write)
    store = make_store(tmp_path, device=1, host=0, disk=10)
    h = history(1, 10)
    p = prefix_for(h)
    store.put(1, p)
    store.put(2, prefix_for(history(2, 10)))  # demotes 1 to disk: its write is held back
    assert store.where(1) == "pending"
    got = await store.lookup(1, h)
    assert got.tier == "host" and same(got.prefix, p) and store.where(1) == "device"
    assert store.where(2) == "pending"  # the promotion pushed 2 out
    gate.set()
    store.flush()
    assert store.metrics()["disk_writes"] == 2 and store.where(2) == "disk"
    store.close()


async def test_write_through_writes_every_put_once(tmp_path) -> None:
    store = make_store(tmp_path, device=1, host=1, disk=10, disk_write_policy="write_through")
    for u in range(4):
        store.put(u, prefix_for(history(u, 10)))
    store.flush()
    m = store.metrics()
    assert m["disk_writes"] == 4 and m["entries_disk"] == 4  # demotions found the copy already there
    store.close()
    assert store.metrics()["disk_writes"] == 4  # nothing left to persist at close


async def test_concurrent_callers_cause_exactly_one_computation() -> None:
    store = make_store(device=4)
    h = history(5, 12)
    calls: list[PrefixKV | None] = []

    async def compute(base: PrefixKV | None) -> PrefixKV:
        calls.append(base)
        await asyncio.sleep(0.05)
        return prefix_for(h)

    results = await asyncio.gather(*[store.get_or_compute(5, h, compute) for _ in range(16)])
    assert len(calls) == 1 and calls[0] is None
    assert sorted(src for _, src in results) == ["computed"] + ["merged"] * 15
    assert all(p is results[0][0] for p, _ in results)
    m = store.metrics()
    assert m["computations"] == 1 and m["singleflight_merges"] == 15
    # afterwards it is a cache hit
    assert (await store.get_or_compute(5, h, compute))[1] == "device" and len(calls) == 1
    store.close()


async def test_get_or_compute_extends_the_longest_valid_prefix() -> None:
    store = make_store()
    h = history(3, 16)
    short = prefix_for(h, 10)
    store.put(3, short)
    seen: list[PrefixKV | None] = []

    async def extend(base: PrefixKV | None) -> PrefixKV:
        seen.append(base)
        return prefix_for(h)

    p, src = await store.get_or_compute(3, h, extend)
    assert src == "extended" and len(seen) == 1 and same(seen[0], short) and p.length == 16
    assert (await store.lookup(3, h)).length == 16
    assert store.metrics()["extensions"] == 1
    store.close()


async def test_get_or_compute_at_least_takes_a_longer_cached_prefix_and_keeps_it() -> None:
    store = make_store()
    h = history(3, 20)
    long = prefix_for(h, 18)
    store.put(3, long)
    calls: list[PrefixKV | None] = []

    async def compute(base: PrefixKV | None) -> PrefixKV:
        calls.append(base)
        return prefix_for(h, 12)

    p, src = await store.get_or_compute(3, h, compute, at_least=12)
    assert src == "device" and same(p, long) and calls == []
    # A compute that finishes after a longer prefix of the same history was stored: the longer stays.
    store2 = make_store()
    short = prefix_for(h, 8)
    store2.put(3, short)

    async def slow(base: PrefixKV | None) -> PrefixKV:
        store2.put(3, long)  # e.g. a ranking that grew the prefix meanwhile
        return prefix_for(h, 12)

    p, src = await store2.get_or_compute(3, h, slow, at_least=12)
    assert src == "extended" and p.length == 12
    assert same((await store2.lookup(3, h)).prefix, long)
    with pytest.raises(ValueError, match="at_least"):
        await store.get_or_compute(3, h, compute, at_least=21)

    async def too_short(base: PrefixKV | None) -> PrefixKV:
        return prefix_for(h, 10)

    store.close()
    store3 = make_store()
    with pytest.raises(ValueError, match="does not match"):
        await store3.get_or_compute(3, h, too_short, at_least=12)
    store2.close()
    store3.close()


def test_put_keep_longer_leaves_a_longer_entry_in_place() -> None:
    store = make_store()
    h = history(5, 30)
    long, short = prefix_for(h, 25), prefix_for(h, 20)
    store.put(5, long)
    assert store.put(5, short, keep_longer=True) == "kept" and store.cached_length(5, h) == 25
    assert store.put(5, prefix_for(h, 28), keep_longer=True) == "device" and store.cached_length(5, h) == 28
    assert store.put(5, short) == "device" and store.cached_length(5, h) == 20  # the default replaces
    store.close()


def test_cached_length_reads_without_touching() -> None:
    store = make_store()
    h = history(4, 20)
    assert store.cached_length(4, h) == 0
    store.put(4, prefix_for(h, 15))
    before = store.metrics()
    assert store.cached_length(4, h) == 15
    assert store.cached_length(4, h.slice(0, 14)) == 0  # the cached prefix is longer than this history
    assert store.cached_length(4, history(4, 20, salt=1)) == 0  # another history
    assert store.metrics() == before and store.where(4) == "device"
    store.close()


async def test_compute_failure_reaches_waiters_and_a_later_call_retries() -> None:
    store = make_store()
    h = history(4, 10)
    n = 0

    async def flaky(base: PrefixKV | None) -> PrefixKV:
        nonlocal n
        n += 1
        await asyncio.sleep(0.02)
        if n == 1:
            raise RuntimeError("device lost")
        return prefix_for(h)

    results = await asyncio.gather(
        *[store.get_or_compute(4, h, flaky) for _ in range(4)], return_exceptions=True
    )
    assert n == 1 and all(isinstance(r, RuntimeError) for r in results)
    assert not store.in_flight(4)
    _, src = await store.get_or_compute(4, h, flaky)
    assert src == "computed" and n == 2

    async def wrong(base: PrefixKV | None) -> PrefixKV:
        return prefix_for(history(4, 10, salt=3))

    with pytest.raises(ValueError, match="does not match"):
        await store.get_or_compute(4, history(4, 12), wrong)
    store.close()


async def test_wait_in_flight_with_a_timeout() -> None:
    store = make_store()
    h = history(6, 10)
    release = asyncio.Event()

    async def slow(base: PrefixKV | None) -> PrefixKV:
        await release.wait()
        return prefix_for(h)

    task = asyncio.create_task(store.get_or_compute(6, h, slow))
    await asyncio.sleep(0)
    assert store.in_flight(6) and not store.in_flight(7)
    assert await store.wait_in_flight(6, timeout_s=0.01) is None
    assert await store.wait_in_flight(7) is None
    waiter = asyncio.create_task(store.wait_in_flight(6, timeout_s=5))
    release.set()
    p, _ = await task
    assert (await waiter) is p and not store.in_flight(6)
    store.close()


async def test_concurrent_promotions_share_one_disk_load(tmp_path, monkeypatch) -> None:
    h = history(8, 10)
    p = prefix_for(h)
    store = make_store(tmp_path, disk=10)
    store.put(8, p)
    store.close()
    store = make_store(tmp_path, disk=10)
    reads = 0
    real = DiskTier.read_into

    def counting_read(self, key, alloc=None):
        nonlocal reads
        reads += 1
        return real(self, key, alloc)

    monkeypatch.setattr(DiskTier, "read_into", counting_read)
    got = await asyncio.gather(*[store.lookup(8, h) for _ in range(8)])
    assert reads == 1 and all(g.tier == "disk" and same(g.prefix, p) for g in got)
    m = store.metrics()
    assert m["promotions_disk_to_device"] == 1 and m["singleflight_merges"] == 7
    store.close()


def test_metrics_cover_every_tier_and_mechanism(tmp_path) -> None:
    store = make_store(tmp_path, disk=4)
    m = store.metrics()
    for tier in ("device", "host", "disk"):
        assert {f"hits_{tier}", f"misses_{tier}", f"bytes_{tier}", f"entries_{tier}"} <= m.keys()
    for name in (
        "promotions",
        "demotions",
        "evictions",
        "evictions_disk",
        "lease_expiries",
        "singleflight_merges",
        "invalidations",
        "disk_corrupt",
        "bytes_pinned",
        "bytes_reserved",
    ):
        assert name in m
    assert all(isinstance(v, int | float) for v in m.values())
    store.close()


def test_put_rejects_a_foreign_model_version() -> None:
    store = make_store()
    with pytest.raises(ValueError, match="model"):
        store.put(1, prefix_for(history(1, 4), mv="other"))
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.put(1, prefix_for(history(1, 4)))


def test_a_prefix_checked_again_against_the_history_it_matched_needs_no_hash(monkeypatch) -> None:
    import relaygr.workers.prefix_kv as prefix_kv

    hist = Events.from_lists([1, 2, 3, 4], [10.0, 11.0, 12.0, 13.0])
    prefix = PrefixKV([], [], torch.arange(3), torch.zeros(3), 3, history_fingerprint(hist, 3), "v")
    hashed: list[int] = []
    real = prefix_kv.history_fingerprint
    monkeypatch.setattr(prefix_kv, "history_fingerprint", lambda h, n=None: hashed.append(n) or real(h, n))
    assert prefix.matches(hist) and prefix.matches(hist) and hashed == [3]
    # Another history (equal or not) is hashed: only the very events it matched are remembered.
    other = Events.from_lists([1, 2, 9, 4], [10.0, 11.0, 12.0, 13.0])
    assert not prefix.matches(other) and hashed == [3, 3]
    assert prefix.matches(Events.from_lists([1, 2, 3], [10.0, 11.0, 12.0])) and hashed == [3, 3, 3]
