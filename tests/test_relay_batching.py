"""Several users' relay rankings in one forward (``EngineConfig.batch_tokens``): each result equals
its ranking alone, batch sizes are counted, and a user failing in a batch does not fail the others."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from store_probe import resident_prefix
from synthetic import history, tiny_model

from relaygr.workers.engine.engine_config import EngineConfig
from relaygr.workers.engine.latency_model import LatencyModel
from relaygr.workers.engine.ranker import RankingEngine, RankOutcome
from relaygr.workers.engine.scheduler import DeviceScheduler, Priority
from relaygr.workers.model.model import HSTURanker
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.prefix_kv import Events, PrefixKV
from relaygr.workers.store.prefix_store import PrefixStore, PrefixStoreConfig

FAR = 1e12
USERS = 5


@pytest.fixture(scope="module")
def model() -> ModelRunner:
    """The model's runner for reference rankings; each engine serves the module with its own."""
    return ModelRunner(tiny_model(3))


def engine(model: HSTURanker, **kw) -> RankingEngine:
    store = PrefixStore(PrefixStoreConfig(device_budget_bytes=1 << 26), model.model_version)
    cfg = EngineConfig(prefill_chunk=64, **kw)
    return RankingEngine(
        ModelRunner(model.model), store, DeviceScheduler("test"), cfg, LatencyModel(1.0, 0.0, 0.0)
    )


def users() -> list[tuple[str, Events, int, torch.Tensor]]:
    """Per user: id, history, cached prefix length, candidates (all different lengths)."""
    out = []
    for u in range(USERS):
        h = history(200 + 37 * u, seed=10 + u)
        out.append((f"u{u}", h, len(h) - 5 - 3 * u, torch.arange(1 + u, 12 + 2 * u)))
    return out


async def rank_while_busy(
    e: RankingEngine, jobs: list[tuple[str, Events, int, torch.Tensor]], queued: threading.Event | None = None
) -> list[RankOutcome]:
    """Rank every user's request while the device is busy, so that they all wait for it; then set
    ``queued`` and free the device."""
    gate = threading.Event()
    blocker = e.scheduler.submit(lambda: gate.wait(10), priority=Priority.RANK, deadline=0.0)
    tasks = [
        asyncio.create_task(e.rank(uid, h, cands, 2e9 + k, time.time() + 60))
        for k, (uid, h, _, cands) in enumerate(jobs)
    ]
    while e.scheduler.queue_depth() < len(jobs):
        await asyncio.sleep(0.001)
    if queued is not None:
        queued.set()
    gate.set()
    await blocker
    results = await asyncio.gather(*tasks)
    await e.drain()
    return results


async def prefill_all(e: RankingEngine, jobs: list[tuple[str, Events, int, torch.Tensor]]) -> None:
    for uid, h, n, _ in jobs:
        assert (await e.prefill(uid, h.slice(0, n))).status == "computed"


async def test_waiting_users_rank_in_one_forward_as_if_alone(model) -> None:
    jobs = users()
    alone = engine(model, batch_tokens=0)
    await prefill_all(alone, jobs)
    want = []
    for k, (uid, h, _, cands) in enumerate(jobs):  # one at a time: each runs alone
        want.append(await alone.rank(uid, h, cands, 2e9 + k, time.time() + 60))
    await alone.drain()
    assert alone.batch_sizes() == {1: USERS}

    e = engine(model, batch_tokens=4096)
    await prefill_all(e, jobs)
    calls = []
    real = e.runner.rank_users
    e.runner.rank_users = lambda reqs: calls.append(len(reqs)) or real(reqs)  # type: ignore[method-assign]
    got = await rank_while_busy(e, jobs)
    assert calls == [USERS] and e.scheduler.batches_run == 1
    assert e.batch_sizes() == {USERS: 1}
    for (uid, h, n, _), res, ref in zip(jobs, got, want, strict=True):
        assert res.path == ref.path == "relay" and res.prefix_len == ref.prefix_len == n
        assert (res.prefix_tier, res.tokens_computed, res.used_len) == (
            ref.prefix_tier,
            ref.tokens_computed,
            ref.used_len,
        )
        torch.testing.assert_close(res.scores, ref.scores, rtol=1e-5, atol=1e-5)
        # The same grown prefix is stored behind each: all of the ranked history.
        assert e.store.cached_length(uid, h) == alone.store.cached_length(uid, h) == len(h)
        mine, theirs = resident_prefix(e.store, uid), resident_prefix(alone.store, uid)
        for a, b in zip(mine.keys + mine.values, theirs.keys + theirs.values, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for x in (alone, e):
        x.scheduler.close()


async def test_a_batch_keeps_to_its_token_budget(model) -> None:
    jobs = users()
    # The rankings compute 16, 20, 24, 28 and 32 tokens (most urgent first): within 50 tokens
    # the first two run together, every other alone (no two of the rest fit).
    e = engine(model, batch_tokens=50)
    await prefill_all(e, jobs)
    got = await rank_while_busy(e, jobs)
    assert [r.tokens_computed for r in got] == [16, 20, 24, 28, 32]
    assert all(r.path == "relay" for r in got)
    assert e.batch_sizes() == {1: 3, 2: 1}
    e.scheduler.close()


async def test_a_batch_keeps_to_its_cached_events(model) -> None:
    # Prefixes of 195, 229, 263, 297 and 331 events (most urgent first) within 600 cached events:
    # the first two together, the next two together, the last alone.
    jobs = users()
    e = engine(model, batch_tokens=4096, batch_cached_events=600)
    await prefill_all(e, jobs)
    got = await rank_while_busy(e, jobs)
    assert [r.prefix_len for r in got] == [195, 229, 263, 297, 331]
    assert all(r.path == "relay" for r in got) and e.batch_sizes() == {1: 1, 2: 2}
    e.scheduler.close()


async def test_a_user_failing_in_a_batch_does_not_fail_the_others(model) -> None:
    jobs = users()
    e = engine(model, batch_tokens=4096)
    await prefill_all(e, jobs)
    bad = jobs[2][0]
    broken = resident_prefix(e.store, bad)
    invalidated = threading.Event()  # set once every ranking has looked its prefix up and waits
    real_matches = PrefixKV.matches

    def matches(self: PrefixKV, h: Events) -> bool:
        return False if self is broken and invalidated.is_set() else real_matches(self, h)

    PrefixKV.matches = matches  # type: ignore[method-assign]
    try:
        got = await rank_while_busy(e, jobs, invalidated)
    finally:
        PrefixKV.matches = real_matches  # type: ignore[method-assign]
    for k, ((uid, h, _, cands), res) in enumerate(zip(jobs, got, strict=True)):
        want = model.rank_full(h, cands, 2e9 + k)
        torch.testing.assert_close(res.scores, want, rtol=1e-5, atol=1e-5)
        assert res.path == ("full" if uid == bad else "relay")
    assert e.batch_sizes() == {USERS: 1}
    e.scheduler.close()


def test_the_workers_batch_sizes_are_summed_for_the_report() -> None:
    from relaygr.schemas import WorkerStats
    from relaygr.tools.report.inputs import rank_batch_counts

    a = WorkerStats(worker_id="w0", ts=1.0, rank_batch_sizes={"1": 7, "4": 2})
    b = WorkerStats(worker_id="w1", ts=1.0, rank_batch_sizes={"4": 1, "10": 3})
    b = WorkerStats.model_validate_json(b.model_dump_json())  # what the stats topic carries
    assert rank_batch_counts({"w0": a, "w1": b}) == {"1": 7, "4": 3, "10": 3}
    with pytest.raises(ValueError):
        WorkerStats(worker_id="w2", ts=1.0, rank_batch_sizes={"2": -1})


async def test_the_device_waits_for_mates_while_the_batch_has_room() -> None:
    # A pooled job on an idle device waits (up to 30 s) for more of its pool; one that arrives
    # and fills the budget ends the wait, and both run in one turn.
    s = DeviceScheduler("test")
    sizes: list[int] = []

    def run(items: list[str]) -> list[str]:
        sizes.append(len(items))
        return [i.upper() for i in items]

    def submit(item: str):
        return s.submit_batched(
            item, run, key=item, priority=Priority.RANK, pool="p", cost=(5,), budget=(10,), wait_s=30
        )

    first = submit("a")
    while not s.ranking() or s.queue_depth():  # taken by the device thread, which now waits
        await asyncio.sleep(0.001)
    second = submit("b")
    assert await asyncio.gather(first, second) == ["A", "B"] and sizes == [2]
    with pytest.raises(ValueError):
        s.submit_batched("c", run, key="c", priority=Priority.RANK, pool="p", cost=(-1,), budget=(10,))
    s.close()
