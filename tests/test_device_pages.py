"""One copy of a prefix on the device: the prefix store's device tier is the pages the model runner
reads and writes (``kv_pages``, ``store/device_tier.py``, ``model/runner.py``). A prefix grows by
pages after its own, writing only its new tokens; the engine's runner ranks against the store's
pages in place; demotion and promotion move a prefix's tokens out of and into pages."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from synthetic import history, tiny_model

from relaygr.workers import kv_pages
from relaygr.workers.engine.engine_config import EngineConfig
from relaygr.workers.engine.latency_model import LatencyModel
from relaygr.workers.engine.ranker import RankingEngine
from relaygr.workers.engine.scheduler import DeviceScheduler
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.store import store_config
from relaygr.workers.store.prefix_store import PrefixStore, PrefixStoreConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(tiny_model(3))


def test_the_page_size_is_named_once_for_the_settings() -> None:
    assert store_config.DEFAULT_PAGE_TOKENS == kv_pages.DEFAULT_PAGE_TOKENS


def test_a_prefix_grows_by_pages_writing_only_its_new_tokens(runner: ModelRunner) -> None:
    h = history(300, seed=1)
    cands = torch.arange(1, 20)
    base = runner.prefill(h.slice(0, 250))
    pages = runner.pages
    before = pages.counters()
    grown = runner.extend(base, h)
    scores, grow = runner.rank_and_extend(grown, h.concat(history(7, seed=2)), cands, 2e9)
    longer = grow()
    after = pages.counters()
    # Every page of the shorter prefix is a page of the longer one: nothing of it was copied.
    assert grown.pages.pages[: len(base.pages.pages)] == base.pages.pages
    assert longer.pages.pages[: len(grown.pages.pages)] == grown.pages.pages
    assert after["rows_copied"] == before["rows_copied"]
    assert after["rows_written"] - before["rows_written"] == 50 + 7  # the new tokens only
    torch.testing.assert_close(
        scores, runner.rank_full(h.concat(history(7, seed=2)), cands, 2e9), rtol=1e-5, atol=1e-5
    )
    whole = runner.prefill(h.concat(history(7, seed=2))).dense()
    for a, b in zip(longer.dense().keys, whole.keys, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_with_no_pages_left_a_prefix_is_computed_and_ranked_dense(runner: ModelRunner) -> None:
    small = ModelRunner(runner.model, pool_tokens=64)  # two pages of 32
    h = history(200, seed=3)
    prefix = small.prefill(h.slice(0, 150))
    assert not prefix.is_paged and small.pages.counters()["exhausted"] >= 1
    cands = torch.arange(1, 9)
    torch.testing.assert_close(
        small.rank(prefix, h.slice(150), cands, 2e9), runner.rank_full(h, cands, 2e9), rtol=1e-5, atol=1e-5
    )


def _engine(runner: ModelRunner, budget: int) -> RankingEngine:
    store = PrefixStore(
        PrefixStoreConfig(device_budget_bytes=budget, host_budget_bytes=1 << 24), runner.model_version
    )
    config = EngineConfig(prefill_chunk=64, retain_suffix=True)
    return RankingEngine(
        ModelRunner(runner.model), store, DeviceScheduler("test"), config, LatencyModel(1.0, 0.0, 0.0)
    )


async def test_the_engine_ranks_against_the_stores_pages_in_place(runner: ModelRunner) -> None:
    e = _engine(runner, 1 << 22)
    assert e.store is not None and e.runner.pages is e.store.placement.device_pages(e.runner.pages.layout)
    h = history(400, seed=4)
    await e.prefill("u", h.slice(0, 380))
    pages = e.runner.pages
    used = pages.used_pages
    res = await e.rank("u", h, torch.arange(1, 33), 2e9, time.time() + 60)
    await e.drain()
    assert res.path == "relay" and res.prefix_len == 380
    # The store kept the grown prefix: one more page at most (20 events), nothing copied.
    assert pages.used_pages - used <= 1 and pages.counters()["rows_copied"] == 0
    m = e.store.metrics()
    assert m["entries_device"] == 1 and m["bytes_device"] == pages.layout.bytes_for(400)
    assert m["device_pages_used"] == pages.used_pages
    torch.testing.assert_close(
        res.scores, runner.rank_full(h, torch.arange(1, 33), 2e9), rtol=1e-5, atol=1e-5
    )
    e.close()


async def test_demotion_gathers_a_prefixs_pages_and_promotion_writes_them_back(runner: ModelRunner) -> None:
    one = runner.kv_layout().bytes_for(300)
    e = _engine(runner, one)  # the device tier holds one such prefix
    assert e.store is not None
    hs = {u: history(300, seed=10 + i) for i, u in enumerate("ab")}
    await e.prefill("a", hs["a"])
    e.store.release("a")
    await e.prefill("b", hs["b"])  # "a" leaves the pages for host memory
    e.store.release("b")
    pages = e.runner.pages
    assert e.store.where("a") == "host" and e.store.where("b") == "device"
    written = pages.rows_written
    found = await e.store.lookup("a", hs["a"])  # back into the pages, "b" out of them
    assert found.tier == "host" and found.prefix.is_paged and found.prefix.pages.pool is pages
    assert pages.rows_written - written == 300 and e.store.where("b") == "host"
    cands = torch.arange(1, 17)
    torch.testing.assert_close(
        e.runner.rank(found.prefix, hs["a"].slice(300), cands, 2e9),
        runner.rank_full(hs["a"], cands, 2e9),
        rtol=1e-5,
        atol=1e-5,
    )
    e.close()


def test_a_promotion_without_free_pages_makes_room_in_the_placements_order() -> None:
    """The copy into free pages happens outside the lock; when there are none, the placement makes
    room in its own order (the promoted entry leaves host first), then writes it."""
    asyncio.run(_promote_without_free_pages())


async def _promote_without_free_pages() -> None:
    from test_prefix_store import history as store_history
    from test_prefix_store import make_store, prefix_for, same

    store = make_store(device=1, host=1)
    h0, h1 = store_history(0, 10), store_history(1, 10)
    store.put(0, prefix_for(h0))
    store.put(1, prefix_for(h1))  # 0 to host: the pages hold 1 only
    got = await store.lookup(0, h0)
    assert got.tier == "host" and same(got.prefix, prefix_for(h0))
    assert store.where(0) == "device" and store.where(1) == "host"
    store.close()
