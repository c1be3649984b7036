"""The prefix store's placement core on its own: synchronous, no event loop, no executor.

Budgets are in units of one 10-token synthetic prefix (the core never looks inside tensors)."""

from __future__ import annotations

import torch
from test_prefix_store import MV, NB10, ND10, PAGE, Clock, history, prefix_for

from relaygr.workers.store.placement import PrefixPlacement
from relaygr.workers.store.prefix_store import PrefixStoreConfig


def make_core(*, device: int = 2, host: int = 2, clock: Clock | None = None) -> tuple[PrefixPlacement, list]:
    hosted: list = []
    cfg = PrefixStoreConfig(
        device_budget_bytes=device * ND10, page_tokens=PAGE, host_budget_bytes=host * NB10
    )
    core = PrefixPlacement(
        cfg,
        MV,
        device=torch.device("cpu"),
        clock=clock or Clock(),
        on_host=lambda key, entry: hosted.append(key[0]),
    )
    return core, hosted


def test_device_pressure_demotes_the_least_recently_used_to_host_then_evicts() -> None:
    core, hosted = make_core()
    for user in range(5):
        assert core.put(user, prefix_for(history(user, 10))) == "device"
    layout = core.layout()
    assert [k[0] for k in layout["device"]] == [3, 4]
    assert [k[0] for k in layout["host"]] == [1, 2]
    assert hosted == [0, 1, 2]  # every entry that reached host was handed over for its copy
    m = core.metrics()
    assert (m["demotions_device_to_host"], m["evictions"]) == (3, 1)


def test_a_lease_makes_room_and_its_entry_is_never_demoted() -> None:
    core, _ = make_core()
    core.put(0, prefix_for(history(0, 10)))
    assert core.lease(0, ttl_s=10, expected_bytes=ND10)
    assert core.lease(1, ttl_s=10, expected_bytes=ND10)
    refused = core.lease(2, ttl_s=10, expected_bytes=ND10)
    assert not refused and refused.reason == "pinned_budget_exceeded"
    for user in (3, 4):  # no room left beside the reservations: straight to host
        assert core.put(user, prefix_for(history(user, 10))) == "host"
    assert [k[0] for k in core.layout()["device"]] == [0]
    assert core.put(1, prefix_for(history(1, 10))) == "device"  # within its reservation


def test_an_expired_lease_unpins() -> None:
    clock = Clock()
    core, _ = make_core(device=1, clock=clock)
    core.put(0, prefix_for(history(0, 10)))
    core.lease(0, ttl_s=5)
    assert core.put(1, prefix_for(history(1, 10))) == "host"
    clock.t += 6
    assert not core.is_leased(0)
    assert core.put(2, prefix_for(history(2, 10))) == "device"
    assert core.where(0) == "host"


def test_a_plan_finds_valid_prefixes_and_drops_changed_ones() -> None:
    core, _ = make_core(device=1)
    h0, h1 = history(0, 12), history(1, 12)
    core.put(0, prefix_for(h0, 10))
    core.put(1, prefix_for(h1, 10))  # user 0 demoted to host
    assert core.plan(core.key(1), h1).kind == "device"
    host = core.plan(core.key(0), h0)
    assert host.kind == "host" and host.entry is not None
    core.promoted(core.key(0), host, host.entry.prefix)
    assert core.where(0) == "device" and core.where(1) == "host"
    changed = history(0, 12, salt=1)
    miss = core.plan(core.key(0), changed)
    assert (miss.kind, miss.invalidated) == ("done", 1)
    assert core.where(0) is None
    assert core.cached_length(1, h1) == 10 and core.cached_length(1, changed) == 0
    m = core.metrics()
    assert (m["hits_device"], m["hits_host"], m["invalidations"]) == (1, 1, 1)


def test_keep_longer_and_computed_puts_keep_the_longer_prefix() -> None:
    core, _ = make_core()
    h = history(0, 20)
    assert core.put(0, prefix_for(h, 15)) == "device"
    assert core.put(0, prefix_for(h, 10), keep_longer=True) == "kept"
    core.put_computed(0, prefix_for(h, 12), h, extended=True)
    assert core.cached_length(0, h) == 15
    m = core.metrics()
    assert (m["computations"], m["extensions"]) == (1, 1)


def test_forget_drops_entry_and_lease() -> None:
    core, _ = make_core()
    core.put(0, prefix_for(history(0, 10)))
    core.lease(0, ttl_s=10)
    assert core.forget([0, 1]) == 1
    assert core.where(0) is None and not core.is_leased(0)
    assert core.metrics()["bytes_reserved"] == 0
