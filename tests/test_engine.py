"""The ranking engine without Kafka: paths, exactness, waiting for in-flight prefixes, truncation."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from store_probe import is_leased
from synthetic import history, tiny_model

from relaygr.workers.engine.engine_config import EngineConfig
from relaygr.workers.engine.latency_model import LatencyModel
from relaygr.workers.engine.prefill_ledger import PrefillLedger, device_share
from relaygr.workers.engine.ranker import RankingEngine, kv_bytes_per_token
from relaygr.workers.engine.scheduler import DeviceScheduler, Priority
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.prefix_kv import Events
from relaygr.workers.store.prefix_store import PrefixStore, PrefixStoreConfig

FAR = 1e12  # a deadline that never passes


@pytest.fixture(scope="module")
def model() -> ModelRunner:
    """The model's runner for reference rankings; each engine serves the module with its own."""
    return ModelRunner(tiny_model(3))


FLAT = LatencyModel(1.0, 0.0, 0.0)


def engine(model, mode="relay", device_budget=1 << 26, latency=FLAT, **kw):
    store = (
        PrefixStore(PrefixStoreConfig(device_budget_bytes=device_budget), model.model_version)
        if mode == "relay"
        else None
    )
    return RankingEngine(
        ModelRunner(model.model), store, DeviceScheduler("test"), EngineConfig(mode=mode, **kw), latency
    )


async def test_relay_after_prefill_equals_full(model) -> None:
    e = engine(model, prefill_chunk=64)
    h = history(300)
    cands = torch.arange(1, 41)
    out = await e.prefill("u", h.slice(0, 280), owner="w0")
    assert out.status == "computed" and out.prefix_len == 280
    res = await e.rank("u", h, cands, float(h.timestamps[-1]) + 60, FAR)
    assert (
        res.path == "relay"
        and res.prefix_len == 280
        and res.prefix_tier == "device"
        and res.prefix_owner == "w0"
    )
    assert res.tokens_computed == 20 + 40
    full = model.rank_full(h, cands, float(h.timestamps[-1]) + 60)
    torch.testing.assert_close(res.scores, full, rtol=1e-5, atol=1e-5)
    assert not is_leased(e.store, "u")  # ranking consumed the lease
    e.scheduler.close()


async def test_a_burst_of_one_users_rankings_shares_a_device_job(model) -> None:
    # Five requests of one user queue behind a slow job; they run as one batch against the cached
    # prefix, each scored on its own history, and the longest history's prefix is kept.
    e = engine(model, prefill_chunk=64)
    h = history(330, seed=4)
    await e.prefill("u", h.slice(0, 300))
    gate = threading.Event()
    blocker = e.scheduler.submit(lambda: gate.wait(5), priority=Priority.RANK, deadline=0.0)  # runs first
    lengths = [305, 312, 330, 301, 320]
    ranks = [
        asyncio.create_task(
            e.rank("u", h.slice(0, n), torch.arange(1 + i, 20 + i), 2e9 + i, time.time() + 30)
        )
        for i, n in enumerate(lengths)
    ]
    while e.scheduler.queue_depth() < len(lengths):
        await asyncio.sleep(0.001)
    gate.set()
    await blocker
    results = await asyncio.gather(*ranks)
    await e.drain()
    assert e.batched_rankings == len(lengths) and e.scheduler.batches_run == 1
    for i, (n, res) in enumerate(zip(lengths, results, strict=True)):
        assert res.path == "relay" and res.prefix_len == 300 and res.tokens_computed == n - 300 + 19
        want = model.rank_full(h.slice(0, n), torch.arange(1 + i, 20 + i), 2e9 + i)
        torch.testing.assert_close(res.scores, want, rtol=1e-5, atol=1e-5)
    assert e.store.cached_length("u", h) == 330
    e.scheduler.close()


async def test_burst_batches_hold_a_bounded_number_of_cached_events(model) -> None:
    # 600 cached events per ranking and a 1,300-event bound: batches of two, never five at once
    # (a batch of long prefixes would make its first ranking wait for all the others).
    e = engine(model, prefill_chunk=64, burst_batch_events=1300)
    h = history(610, seed=5)
    await e.prefill("u", h.slice(0, 600))
    gate = threading.Event()
    blocker = e.scheduler.submit(lambda: gate.wait(5), priority=Priority.RANK, deadline=0.0)  # runs first
    ranks = [
        asyncio.create_task(e.rank("u", h.slice(0, 601 + i), torch.arange(1, 9), 2e9, time.time() + 30))
        for i in range(5)
    ]
    while e.scheduler.queue_depth() < 5:
        await asyncio.sleep(0.001)
    gate.set()
    await blocker
    results = await asyncio.gather(*ranks)
    await e.drain()
    assert e.scheduler.batches_run == 2 and e.batched_rankings == 4  # 2 + 2 + 1
    for i, res in enumerate(results):
        want = model.rank_full(h.slice(0, 601 + i), torch.arange(1, 9), 2e9)
        torch.testing.assert_close(res.scores, want, rtol=1e-5, atol=1e-5)
    e.scheduler.close()


async def test_rank_waits_for_an_in_flight_prefix(model) -> None:
    e = engine(model, prefill_chunk=32)
    h = history(600, seed=1)
    cands = torch.arange(1, 17)
    pre = asyncio.create_task(e.prefill("u", h.slice(0, 590)))
    while not e.store.in_flight("u"):
        await asyncio.sleep(0)
    res = await e.rank("u", h, cands, 2e9, time.time() + 30)
    await pre
    assert res.path == "relay_waited" and res.prefix_len == 590 and "prefix_wait" in res.breakdown_ms
    torch.testing.assert_close(res.scores, model.rank_full(h, cands, 2e9), rtol=1e-5, atol=1e-5)
    e.scheduler.close()


async def test_a_waiting_request_lends_its_priority_to_the_prefix_it_waits_for(model) -> None:
    # Other users' full rankings (queued first, later deadlines) would starve a pre-inference that
    # runs at prefill priority; the request waiting for it lends it ranking priority instead.
    e = engine(model, prefill_chunk=32)
    h = history(600, seed=1)
    cands = torch.arange(1, 17)
    done: list[str] = []
    pre = asyncio.create_task(e.prefill("u", h.slice(0, 590)))
    while not e.store.in_flight("u"):
        await asyncio.sleep(0)

    async def rank(user: str, hist: Events, deadline: float):
        res = await e.rank(user, hist, cands, 2e9, deadline)
        done.append(user)
        return res

    others = [
        asyncio.create_task(rank(f"o{i}", history(600, seed=10 + i), time.time() + 60)) for i in range(4)
    ]
    await asyncio.sleep(0)
    res = await rank("u", h, time.time() + 30)
    await asyncio.gather(pre, *others)
    assert res.path == "relay_waited" and res.prefix_len == 590
    assert done.index("u") < 3, done  # not behind every full ranking queued before it
    torch.testing.assert_close(res.scores, model.rank_full(h, cands, 2e9), rtol=1e-5, atol=1e-5)
    assert not e.preinference._urgent  # the loan ends with the pre-inference
    e.scheduler.close()


async def test_expedite_prefill_moves_a_pre_inference_ahead_of_queued_rankings(model) -> None:
    # What the worker does when a rank request waits on its prefill signal's pre-inference.
    e = engine(model, prefill_chunk=32)
    done: list[str] = []

    async def prefill() -> None:
        await e.prefill("u", history(600, seed=1))
        done.append("u")

    async def rank(user: str) -> None:
        await e.rank(user, history(600, seed=10 + int(user[1:])), torch.arange(1, 17), 2e9, time.time() + 60)
        done.append(user)

    pre = asyncio.create_task(prefill())
    while not e.store.in_flight("u"):
        await asyncio.sleep(0)
    others = [asyncio.create_task(rank(f"o{i}")) for i in range(4)]
    await asyncio.sleep(0)
    e.expedite_prefill("u", time.time() + 30)
    await asyncio.gather(pre, *others)
    assert done.index("u") < 3, done
    assert not e.preinference._urgent
    e.scheduler.close()


async def test_abandoned_prefill_stops_between_chunks_and_frees_its_lease(model) -> None:
    # A ranking went ahead without this pre-inference while pre-inference is backed up (here: any
    # backlog at all): its remaining chunks are not run.
    e = engine(model, prefill_chunk=16, abandon_backlog=0)
    h = history(600, seed=4)
    blocker = threading.Event()
    gate = e.scheduler.submit(blocker.wait, priority=Priority.RANK)  # holds the device
    pre = asyncio.create_task(e.prefill("u", h))
    while not e.store.in_flight("u"):
        await asyncio.sleep(0)
    e.abandon_prefill("u")
    blocker.set()
    await gate
    out = await pre
    assert out.status == "abandoned"
    assert not is_leased(e.store, "u") and not e.store.in_flight("u")
    assert e.store.cached_length("u", h) == 0
    again = await e.prefill("u", h)  # a later signal computes it afresh
    assert again.status == "computed" and again.prefix_len == 600
    e.scheduler.close()


async def test_without_a_backlog_a_late_prefill_finishes_for_the_next_request(model) -> None:
    e = engine(model, prefill_chunk=16, abandon_backlog=2)
    h = history(600, seed=4)
    blocker = threading.Event()
    gate = e.scheduler.submit(blocker.wait, priority=Priority.RANK, deadline=0.0)
    pre = asyncio.create_task(e.prefill("u", h))
    while not e.store.in_flight("u"):
        await asyncio.sleep(0)
    e.abandon_prefill("u")  # one pre-inference queued: not a backlog
    blocker.set()
    await gate
    out = await pre
    assert out.status == "computed" and e.store.cached_length("u", h) == 600
    e.scheduler.close()


def test_a_rank_request_waits_only_for_a_prefix_worth_waiting_for() -> None:
    from relaygr.streams.ranking.rank_handler import worth_waiting

    assert worth_waiting(history_len=1024, cached_len=0, short_term=64)
    assert worth_waiting(history_len=1024, cached_len=895, short_term=64)  # 129 events to compute
    assert not worth_waiting(history_len=1024, cached_len=896, short_term=64)  # at most 128
    assert not worth_waiting(history_len=1024, cached_len=1024, short_term=64)
    assert not worth_waiting(history_len=100, cached_len=0, short_term=64)  # full ranking is as short


async def test_miss_falls_back_to_full_and_truncates_to_the_budget(model) -> None:
    # 0.1 ms per token: a 100 ms budget fits about 1000 tokens of the 3000.
    e = engine(model, latency=LatencyModel(0.0, 0.1, 0.0))
    h = history(3000, seed=2)
    cands = torch.arange(1, 9)
    res = await e.rank("v", h, cands, 2e9, time.time() + 0.1)
    assert res.path == "full_truncated" and 0 < res.used_len < 1000 and res.history_len == 3000
    torch.testing.assert_close(
        res.scores, model.rank_full(h.slice(3000 - res.used_len), cands, 2e9), rtol=1e-5, atol=1e-5
    )
    res = await e.rank("v", h.slice(0, 50), cands, 2e9, FAR)
    assert res.path == "full" and res.used_len == 50
    e.scheduler.close()


async def test_extension_and_promotion_paths(model) -> None:
    e = engine(model)
    h = history(400, seed=4)
    await e.prefill("u", h.slice(0, 200))
    out = await e.prefill("u", h.slice(0, 350))
    assert out.status == "extended"
    res = await e.rank("u", h, torch.arange(1, 9), 2e9, FAR)
    assert res.path == "relay" and res.prefix_len == 350
    e.scheduler.close()


async def test_a_ranking_keeps_its_suffix_for_the_users_next_request(model) -> None:
    e = engine(model, prefill_chunk=64)
    h = history(330, seed=7)
    cands = torch.arange(1, 33)
    first = h.slice(0, 300)  # the first request; 30 more events arrive before the second
    assert (await e.prefill("u", first, prefix_len=236, owner="w0")).status == "computed"
    res = await e.rank("u", first, cands, 2e9, FAR)
    assert res.path == "relay" and res.prefix_len == 236 and res.tokens_computed == 64 + 32
    assert res.prefix_owner == "w0"
    await e.drain()  # the grown prefix is stored in the background
    assert (await e.store.lookup("u", first)).length == 300  # grown by the ranked suffix
    # The second request's pre-inference (all but its last 64 events) finds them already cached.
    jobs = dict(e.scheduler.jobs_done)
    out = await e.prefill("u", h, prefix_len=266)
    assert out.status == "device" and out.prefix_len == 300
    assert e.scheduler.jobs_done == jobs  # no device work
    res = await e.rank("u", h, cands, 2e9 + 60, FAR)
    assert res.path == "relay" and res.prefix_len == 300 and res.tokens_computed == 30 + 32
    assert res.prefix_owner == "w0"  # a grown prefix keeps who computed it
    torch.testing.assert_close(res.scores, model.rank_full(h, cands, 2e9 + 60), rtol=1e-5, atol=1e-5)
    e.scheduler.close()

    kept = engine(model, prefill_chunk=64, retain_suffix=False)
    await kept.prefill("u", first, prefix_len=236)
    await kept.rank("u", first, cands, 2e9, FAR)
    await kept.drain()
    assert (await kept.store.lookup("u", first)).length == 236
    assert (await kept.prefill("u", h, prefix_len=266)).status == "extended"
    kept.scheduler.close()


async def test_prefill_rejects_a_prefix_longer_than_the_history(model) -> None:
    e = engine(model)
    with pytest.raises(ValueError, match="prefix_len"):
        await e.prefill("u", history(10), prefix_len=11)
    e.scheduler.close()


async def test_refused_lease_means_full_path(model) -> None:
    e = engine(model, device_budget=1000)  # far below one prefix
    h = history(500, seed=5)
    out = await e.prefill("u", h.slice(0, 480))
    assert out.status == "refused:pinned_budget_exceeded"
    res = await e.rank("u", h, torch.arange(1, 9), 2e9, FAR)
    assert res.path == "full"
    e.scheduler.close()


async def test_baseline_and_cold_start(model) -> None:
    e = engine(model, mode="baseline")
    h = history(120, seed=6)
    cands = torch.arange(1, 9)
    assert (await e.prefill("u", h)).status == "skipped"
    res = await e.rank("u", h, cands, 2e9, FAR)
    assert res.path == "baseline"
    torch.testing.assert_close(res.scores, model.rank_full(h, cands, 2e9), rtol=1e-5, atol=1e-5)
    cold = await e.rank("nobody", Events.empty(), cands, 2e9, FAR)
    assert cold.path == "cold_start" and cold.scores.shape == (8,) and torch.isfinite(cold.scores).all()
    e.scheduler.close()


def test_kv_bytes_per_token_matches_a_real_prefix(model) -> None:
    p = model.prefill(history(100))
    pages = model.pages
    assert (
        p.nbytes()
        == pages.layout.bytes_for(100)
        == -(-100 // pages.page_tokens) * pages.page_tokens * (kv_bytes_per_token(model))
    )  # whole pages of tokens


class _Spy:
    """The engine's runner, recording the order of the device work: a miss's full-ranking chunks and the
    relay rankings; the first chunk holds the device until ``gate`` is set."""

    def __init__(self, runner: ModelRunner) -> None:
        self.model = runner
        self.order: list[str] = []
        self.started, self.gate = threading.Event(), threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def prefill_steps(self, events, chunk, prefix=None):
        for i, out in enumerate(self.model.prefill_steps(events, chunk, prefix=prefix)):
            self.order.append("chunk")
            if i == 0:
                self.started.set()
                self.gate.wait(5)
            yield out

    def rank(self, prefix, events, candidates, request_ts):
        self.order.append("score" if prefix is not None else "full")
        return self.model.rank(prefix, events, candidates, request_ts)

    def rank_and_extend(self, prefix, history, candidates, request_ts):
        self.order.append("relay")
        return self.model.rank_and_extend(prefix, history, candidates, request_ts)


async def test_a_relay_ranking_runs_between_the_chunks_of_a_miss_full_ranking(model) -> None:
    """Relay mode: a miss's full ranking is prefill of the history in chunks, then scoring, at
    ranking priority; a relay ranking submitted meanwhile (with a later deadline) completes before
    the full ranking's remaining chunks. Scores are unchanged."""
    e = engine(model, prefill_chunk=64)
    hr, hm = history(264, seed=5), history(512, seed=6)
    cands = torch.arange(1, 17)
    assert (await e.prefill("r", hr.slice(0, 200))).status == "computed"
    spy = _Spy(e.runner)
    e.runner = spy
    now = time.time()
    full = asyncio.create_task(e.rank("m", hm, cands, 2e9, now + 100))
    assert await asyncio.to_thread(spy.started.wait, 5)
    relay = asyncio.create_task(e.rank("r", hr, cands, 2e9, now + 200))
    for _ in range(500):  # until the relay ranking waits for the device
        if e.scheduler.queue_depth(Priority.RANK):
            break
        await asyncio.sleep(0.01)
    spy.gate.set()
    got_full, got_relay = await asyncio.gather(full, relay)
    assert got_full.path == "full" and got_relay.path == "relay"
    chunks = len(range(0, 512, 64))
    assert spy.order == ["chunk", "relay", *["chunk"] * (chunks - 1), "score"]
    torch.testing.assert_close(got_full.scores, model.rank_full(hm, cands, 2e9), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_relay.scores, model.rank_full(hr, cands, 2e9), rtol=1e-5, atol=1e-5)
    await e.drain()
    e.scheduler.close()


async def test_the_baselines_full_ranking_stays_one_device_job(model) -> None:
    e = engine(model, mode="baseline", prefill_chunk=64)
    spy = _Spy(e.runner)
    e.runner = spy
    h = history(512, seed=7)
    res = await e.rank("b", h, torch.arange(1, 17), 2e9, time.time() + 100)
    assert res.path == "baseline" and spy.order == ["full"]
    e.scheduler.close()


async def test_warm_up_runs_on_the_device_thread_and_leaves_no_trace(model) -> None:
    e = engine(model, prefill_chunk=64)
    before = e.scheduler.jobs_done[Priority.PREFILL]
    took = await e.warm_up(history_len=200, num_candidates=16, rounds=1)
    assert took > 0 and e.scheduler.jobs_done[Priority.PREFILL] == before + 1
    assert not e.pacing.samples  # not a ranking: the latency model does not learn from it
    assert e.store is not None and e.store.metrics().get("bytes_device", 0) == 0
    e.scheduler.close()


def test_a_successor_plans_with_its_predecessors_timings(model) -> None:
    """At a hand-over the new process takes the old one's full-ranking timings: its latency model
    (and so the trigger's, through its next report) is the one refitted from them."""
    old, new = engine(model), engine(model)
    timings = [(n, 0.002 * n * n / 1000 + 0.01 * n + 1.0) for n in range(256, 4096, 128)]
    old.pacing.samples.extend(timings)
    fitted = old.refit_latency()
    assert new.refit_latency().predict_ms(4096) != pytest.approx(fitted.predict_ms(4096))
    new.pacing.samples.extend([(300, 99.0)] * 8)  # its own, made beside the old one: dropped
    got = new.inherit_latency_samples(old.latency_samples())
    assert new.latency_samples() == timings
    assert got.predict_ms(4096) == pytest.approx(fitted.predict_ms(4096))
    old.close()
    new.close()


async def test_a_late_prefill_finishes_even_behind_a_backlog_and_is_counted(model) -> None:
    # The default policy: a ranking that went ahead without its pre-inference does not drop it,
    # however many pre-inferences are queued. It finishes and serves the user's next visit.
    e = engine(model, prefill_chunk=16, latency=LatencyModel(1.0, 0.01, 0.0))
    h = history(600, seed=4)
    others = [history(200, seed=10 + i) for i in range(4)]
    blocker = threading.Event()
    gate = e.scheduler.submit(blocker.wait, priority=Priority.RANK, deadline=0.0)
    pre = asyncio.create_task(e.prefill("u", h))
    queued = [asyncio.create_task(e.prefill(f"o{i}", o)) for i, o in enumerate(others)]
    while e.scheduler.queue_depth(Priority.PREFILL) < 5:
        await asyncio.sleep(0.001)
    assert e.prefill_backlog_ms() > 0
    e.abandon_prefill("u")  # five pre-inferences queued: a backlog
    blocker.set()
    await gate
    out = await pre
    await asyncio.gather(*queued)
    assert out.status == "computed" and e.store.cached_length("u", h) == 600
    assert e.prefills.counts == {"admitted": 5, "finished": 5, "late": 1}
    assert e.prefill_backlog_ms() == 0
    res = await e.rank("u", h, torch.arange(1, 9), float(h.timestamps[-1]) + 60, FAR)
    assert res.path == "relay" and res.prefix_len == 600
    share = device_share(e.scheduler)
    assert share["prefill_s"] > 0 and share["rank_s"] > 0
    e.scheduler.close()


def test_the_ledger_counts_a_users_pending_pre_inference_once() -> None:
    ledger = PrefillLedger()
    ledger.admit("u", 10.0)
    ledger.admit("u", 30.0)  # joins: the longest counts
    ledger.admit("v", 5.0)
    assert ledger.backlog_ms(lambda _u: None) == pytest.approx(35.0)
    ledger.end("u")
    assert ledger.backlog_ms(lambda _u: None) == pytest.approx(5.0)
    assert ledger.counts["admitted"] == 3
