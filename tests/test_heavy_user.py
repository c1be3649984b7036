"""One heavy user never stalls a worker: the served window, bounded state, device work sliced by
time, deadlines that win over a waited-for pre-inference, and the trigger's ``too_long``."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from synthetic import history, tiny_model

from relaygr.schemas import BehaviorEvent, TriggerReason
from relaygr.streams.history import HistoryTable
from relaygr.streams.preprocess import SEEN_CHUNK, seen_add, seen_before
from relaygr.streams.trigger import SequenceAwareTrigger, TriggerConfig
from relaygr.workers.engine.latency_model import DevicePace, EngineClock, IngestMeter, LatencyModel
from relaygr.workers.engine.pacing import Slicer
from relaygr.workers.engine.ranker import EngineConfig, RankingEngine
from relaygr.workers.engine.scheduler import DeviceScheduler, Priority
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.prefix_kv import served, window_start, window_step
from relaygr.workers.store.prefix_store import PrefixStore, PrefixStoreConfig

FAR = 1e12


@pytest.fixture(scope="module")
def model() -> ModelRunner:
    """The model's runner for reference rankings; each engine serves the module with its own."""
    return ModelRunner(tiny_model(5))


# ---------------------------------------------------------------------- the served window


@given(st.integers(0, 100_000), st.sampled_from([64, 512, 8192]))
def test_the_window_serves_at_most_the_cap_and_moves_by_whole_steps(total: int, cap: int) -> None:
    step = window_step(cap)
    start = window_start(total, cap, step)
    assert start % step == 0 and 0 <= start <= total
    assert total - start <= cap  # never more than the cap
    if total > cap:
        assert total - start > cap - step  # never much less
    # One more event moves the start by a whole step or not at all: the cached prefix of the
    # window stays valid in between.
    assert window_start(total + 1, cap, step) - start in (0, step)


def test_served_keeps_the_tail_of_a_trimmed_history() -> None:
    h = history(3000)
    tail, capped = served(h.slice(1000), 1000, max_len=1024, step=128)  # events 1000.. retained
    assert capped and len(tail) <= 1024 and len(tail) > 1024 - 128
    assert torch.equal(tail.item_ids, h.item_ids[3000 - len(tail) :])
    short, capped = served(h.slice(0, 500), 0, max_len=1024, step=128)
    assert not capped and len(short) == 500


# ---------------------------------------------------------------------- bounded state


def _ev(i: int) -> BehaviorEvent:
    return BehaviorEvent(user_id="heavy", item_id=1 + i % 400, ts=float(i), action=1)


def test_history_table_keeps_a_bounded_step_aligned_tail(tmp_path) -> None:
    h = HistoryTable(tmp_path / "h", retain_events=1000, retain_align=128)
    offset = 0
    for start in range(0, 60_000, 5000):  # a 60k-event user, in batches
        h.append_many(0, [(offset + i, _ev(start + i)) for i in range(5000)])
        offset += 5000
        first = h.first("heavy")
        kept = h.get("heavy")
        assert first % 128 == 0
        assert 1000 <= len(kept) <= 1000 + 250 + 128  # bounded, and never below what is retained
        assert kept.timestamps[-1].item() == start + 4999  # the newest event is there
        assert kept.timestamps[0].item() == first  # and the oldest kept one is event `first`
    assert h.trimmed_events == 60_000 - len(h.get("heavy"))
    h.close()
    again = HistoryTable(tmp_path / "h", retain_events=1000, retain_align=128)
    assert again.first("heavy") == first and len(again.get("heavy")) == len(kept)  # from disk too
    again.close()


async def test_seen_items_keep_a_bounded_number_of_chunks() -> None:
    table: dict = {}
    for start in range(0, 20 * SEEN_CHUNK, 700):
        seen_add(
            table.get,
            table.__setitem__,
            "u",
            [(i, float(i)) for i in range(start, start + 700)],
            keep_chunks=3,
            delete=lambda k: table.pop(k, None),
        )
    chunks = [k for k in table if k.startswith("u\x00")]
    assert len(chunks) <= 3
    seen = await seen_before(table.get, "u", 1e12)
    newest = 20 * SEEN_CHUNK + 700 - 1
    assert str(newest - 700) in seen and "0" not in seen  # the recent items are kept, the oldest dropped


async def test_reading_a_long_history_of_seen_items_lets_the_loop_run() -> None:
    # The stage's loop also flushes the rank request it produced just before: a long history's
    # chunks must not hold it for their whole read.
    from relaygr.streams.preprocess import SEEN_YIELD_CHUNKS

    table: dict = {}
    seen_add(table.get, table.__setitem__, "u", [(i, float(i)) for i in range(20 * SEEN_CHUNK)])
    ticks, done = 0, False

    async def other_work() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other_work())
    seen = await seen_before(table.get, "u", 1e12)
    done = True
    await task
    assert len(seen) == 20 * SEEN_CHUNK
    assert ticks >= 20 // SEEN_YIELD_CHUNKS - 1


# ---------------------------------------------------------------------- device time slices


def test_chunks_shrink_as_cached_keys_grow() -> None:
    lat = LatencyModel(1.0, 0.01, 2e-6)  # quadratic: attention to many keys costs
    sizes = [lat.tokens_within_slice(cached, 5.0, lo=16, hi=4096) for cached in (0, 1000, 10_000, 60_000)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    for cached, k in zip((0, 1000, 10_000, 60_000), sizes, strict=True):
        if k > 16:  # above the floor, a chunk's predicted time fits the slice
            assert lat.predict_ms(cached + k) - lat.predict_ms(cached) <= 5.0 + 1e-9


def test_the_pace_follows_measured_over_predicted_time_within_its_bounds() -> None:
    pace = DevicePace(weight=0.5, lo=0.5, hi=4.0)
    assert pace.factor == 1.0  # nothing measured yet: as predicted
    for _ in range(20):
        pace.observe(2.0, 6.0)  # three times slower than predicted
    assert pace.factor == pytest.approx(3.0, rel=1e-3)
    for _ in range(20):
        pace.observe(2.0, 100.0)  # one stall reads at most as the bound
    assert pace.factor == pytest.approx(4.0, rel=1e-3)
    pace.observe(0.01, 50.0)  # too short to time: ignored
    pace.observe(2.0, float("nan"))
    assert pace.observations == 40 and pace.factor == pytest.approx(4.0, rel=1e-3)
    for _ in range(40):
        pace.observe(2.0, 0.5)
    assert pace.factor == pytest.approx(0.5, rel=1e-3)
    with pytest.raises(ValueError):
        DevicePace(lo=2.0)


def test_slices_shrink_when_the_device_runs_slower_than_predicted() -> None:
    # Each chunk takes at least 3x its predicted time (a sleep only overruns): the pace learns
    # it from the chunks themselves and the next chunks get fewer tokens.
    lat = LatencyModel(0.0, 0.02, 0.0)  # 0.02 ms a token: a 2 ms slice is 100 tokens
    pace = DevicePace()
    slicer = Slicer(lat, pace, slice_ms=2.0, hi=4096)
    assert slicer(0) == 100 and slicer.predicted_ms == pytest.approx(2.0)

    def chunks():
        cached = 0
        for _ in range(8):
            k = slicer(cached)
            time.sleep(3 * slicer.predicted_ms / 1000)
            cached += k
            yield None
        yield "done"

    assert list(slicer.measured(chunks()))[-1] == "done"
    assert pace.observations == 8 and pace.factor > 2.5
    assert slicer(0) < 100 / 2.5
    assert slicer.at == 0


def test_time_sliced_prefill_equals_one_shot(model) -> None:
    h = history(700, seed=3)
    sizes: list[int] = []

    def chunk(cached: int) -> int:
        size = 200 if cached < 300 else 37
        sizes.append(size)
        return size

    *steps, prefix = list(model.prefill_steps(h, chunk))
    assert all(s is None for s in steps) and len(steps) == len(sizes) - 1
    whole = model.prefill(h)
    assert prefix.length == whole.length == 700 and prefix.fingerprint == whole.fingerprint
    for got, want in zip(prefix.keys + prefix.values, whole.keys + whole.values, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _engine(model, latency, clock: EngineClock | None = None, **kw) -> RankingEngine:
    store = PrefixStore(PrefixStoreConfig(device_budget_bytes=1 << 26), model.model_version)
    config = EngineConfig(mode="relay", **kw)
    return RankingEngine(ModelRunner(model.model), store, DeviceScheduler("test"), config, latency, clock)


class _SimulatedDevice:
    """Device time as these tests simulate it: the engine plans and times by this clock, the
    chunks of ``_SlowChunks`` advance it, and the real time the tiny model takes counts for
    nothing, so that whether a ranking re-plans does not depend on the load of the machine."""

    def __init__(self) -> None:
        self.elapsed, self.epoch = 0.0, time.time()
        self.clock = EngineClock(wall=lambda: self.epoch + self.elapsed, timer=lambda: self.elapsed)

    def deadline(self, in_s: float) -> float:
        return self.clock.wall() + in_s


class _SlowChunks:
    """The model on a ``_SimulatedDevice``: every chunk of a chunked history takes ``per_token_s``
    a token (and the first one ``first_chunk_s`` more: a slice held up once)."""

    def __init__(
        self, model: ModelRunner, device: _SimulatedDevice, per_token_s: float, first_chunk_s: float = 0.0
    ) -> None:
        self._model, self.device = model, device
        self.per_token_s, self.first_chunk_s = per_token_s, first_chunk_s

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def prefill_steps(self, history, chunk_size, prefix=None):
        sizes: list[int] = []

        def sized(cached: int) -> int:
            sizes.append(min(chunk_size(cached), len(history) - cached))
            return sizes[-1]

        for i, out in enumerate(self._model.prefill_steps(history, sized, prefix)):
            self.device.elapsed += self.per_token_s * sizes[-1] + (self.first_chunk_s if i == 0 else 0.0)
            yield out


async def test_a_sliced_full_ranking_equals_full_inference_and_lets_earlier_deadlines_in(model) -> None:
    # 0.01 ms per token against a 1 ms slice: a 5000-event full ranking takes ~50 slices.
    e = _engine(model, LatencyModel(0.0, 0.01, 0.0), slice_ms=1.0, prefill_chunk=512)
    h = history(5000, seed=4)
    cands = torch.arange(1, 33)
    order: list[str] = []

    async def full() -> torch.Tensor:
        res = await e.rank("big", h, cands, 2e9, time.time() + 60)
        order.append("full")
        assert res.path == "full" and res.used_len == 5000
        return res.scores

    async def urgent() -> None:
        # Runs on the device thread: is the full ranking still waiting for its next slice?
        def job() -> None:
            order.append("urgent" if e.scheduler.queue_depth(Priority.RANK) else "urgent-after")

        await e.scheduler.submit(job, priority=Priority.RANK, deadline=time.time() + 1)

    big = asyncio.create_task(full())
    while e.scheduler.jobs_done[Priority.RANK] == 0 and not e.scheduler._running:
        await asyncio.sleep(0)
    await urgent()
    scores = await big
    assert order == ["urgent", "full"]  # ran between two slices, not after the whole ranking
    torch.testing.assert_close(scores, model.rank_full(h, cands, 2e9), rtol=1e-4, atol=1e-4)
    e.scheduler.close()


async def test_a_ranking_that_gives_up_waiting_is_not_queued_behind_its_prefill(model) -> None:
    # A long pre-inference in many slices; the user's request waits for it, gives up when its
    # deadline no longer allows, and ranks at once: the rest of the prefill goes back to
    # pre-inference priority instead of running ahead of that ranking with its deadline.
    e = _engine(model, LatencyModel(0.0, 0.002, 0.0), slice_ms=0.2, prefill_chunk=64)
    h = history(8000, seed=6)
    done: list[str] = []

    async def prefill() -> None:
        await e.prefill("heavy", h.slice(0, 7990))
        done.append("prefill")

    pre = asyncio.create_task(prefill())
    while not e.store.in_flight("heavy"):
        await asyncio.sleep(0)
    res = await e.rank("heavy", h, torch.arange(1, 17), 2e9, time.time() + 0.01)
    done.append("rank")
    await pre
    assert res.path in ("full", "full_truncated")
    assert done == ["rank", "prefill"]
    assert not e.preinference._urgent and not e.preinference._waiters  # the loan was returned
    e.scheduler.close()


async def test_a_ranking_does_not_wait_for_a_prefill_predicted_to_finish_too_late(model) -> None:
    # The device is busy; the user's pre-inference is queued behind it with ~8 s of work
    # predicted. A request with 0.3 s left does not wait for it at all: it ranks a truncated
    # history at once, with all of its time (before, it waited until only a suffix's time was
    # left, and then had almost none for the truncated ranking).
    e = _engine(model, LatencyModel(0.0, 0.001, 0.0), slice_ms=0.5, prefill_chunk=64)
    h = history(8000, seed=9)
    gate = threading.Event()
    blocker = e.scheduler.submit(lambda: gate.wait(10), priority=Priority.RANK)
    pre = asyncio.create_task(e.prefill("heavy", h.slice(0, 7990)))
    while e.prefill_eta_ms("heavy") is None:
        await asyncio.sleep(0)
    for pace in (e.pacing.extend, e.pacing.full):  # as measured on a device 1000x slower than predicted
        pace._log, pace.hi = math.log(1000.0), 1000.0
    assert e.prefill_eta_ms("heavy") == pytest.approx(7990.0)
    # 100 events at 1 ms, a 0.5 ms slice at the pace of chunks, the 2 ms margin.
    assert e.predict_full_ms(100) == pytest.approx(100.0 + 500.0 + 2.0)
    ranking = asyncio.create_task(e.rank("heavy", h, torch.arange(1, 17), 2e9, time.time() + 0.3))
    await asyncio.sleep(0.05)
    gate.set()
    res = await ranking
    assert "prefix_wait" not in res.breakdown_ms
    assert res.path == "full_truncated" and 16 <= res.used_len <= 150  # half of ~0.3 s at 1 ms a token
    await blocker
    e.pacing.extend._log = 0.0  # the rest of the pre-inference in whole chunks
    assert (await pre).status == "computed"
    e.scheduler.close()


async def test_a_sliced_truncated_ranking_plans_for_its_headroom_at_the_measured_pace(model) -> None:
    # 1 ms a token predicted, 1 s left: one job (no slices) keeps ~1000 events; a relay worker's
    # sliced ranking keeps what fills 0.5 of it at the pace of recent full rankings (2x here).
    h = history(3000, seed=11)
    cands = torch.arange(1, 9)
    device = _SimulatedDevice()  # planned on its clock: the machine's load takes none of the second
    one_job = _engine(model, LatencyModel(0.0, 1.0, 0.0), device.clock, slice_ms=0)
    res = await one_job.rank("u", h, cands, 2e9, device.deadline(1.0))
    assert res.path == "full_truncated" and 900 < res.used_len <= 1000
    sliced = _engine(model, LatencyModel(0.0, 1.0, 0.0), device.clock, slice_ms=50.0, truncate_headroom=0.5)
    sliced.runner = _SlowChunks(sliced.runner, device, 1e-3)  # its chunks take the predicted 1 ms a token
    for _ in range(30):
        sliced.pacing.full.observe(10.0, 20.0)  # full rankings take twice their prediction
        sliced.pacing.extend.observe(10.0, 40.0)  # (chunks' own overheads: not what it plans with)
    assert sliced.pacing.full.factor == pytest.approx(2.0, rel=1e-3)
    res = await sliced.rank("u", h, cands, 2e9, device.deadline(1.0))
    assert res.path == "full_truncated" and 200 < res.used_len <= 250
    assert sliced.pacing.full.observations == 31  # each full ranking is measured against its prediction
    one_job.scheduler.close()
    sliced.scheduler.close()


async def test_a_sliced_truncated_ranking_plans_for_the_ingest_slowdown_while_behaviours_pour_in(
    model,
) -> None:
    # 1 ms a token, 1 s left, headroom 0.5 at pace 1: ~500 events; while the worker applies a
    # burst of behaviours, twice the pace: ~250.
    h = history(3000, seed=12)
    cands = torch.arange(1, 9)
    device = _SimulatedDevice()
    e = _engine(
        model,
        LatencyModel(0.0, 1.0, 0.0),
        device.clock,
        slice_ms=50.0,
        truncate_headroom=0.5,
        ingest_slowdown=2.0,
        ingest_burst_events=1000,
        ingest_window_s=600.0,
    )
    quiet = await e.rank("u", h, cands, 2e9, device.deadline(1.0))
    assert quiet.path == "full_truncated" and 400 < quiet.used_len <= 500 and not quiet.in_ingest_burst
    e.pacing.full._log = 0.0  # the ranking just measured is not what this test is about
    e.pacing.ingest.add(999)
    assert not e.pacing.ingest.bursting()
    e.pacing.ingest.add(1)
    burst = await e.rank("u", h, cands, 2e9, device.deadline(1.0))
    assert burst.path == "full_truncated" and 200 < burst.used_len <= 250 and burst.in_ingest_burst
    e.scheduler.close()


async def test_a_sliced_full_ranking_is_planned_when_the_device_starts_it(model) -> None:
    # 1 ms a token, headroom 0.5: with 1 s left when it is submitted it would keep ~500 events;
    # the device is busy for the first 0.5 s of it, so it keeps what fits the ~0.5 s left then.
    h = history(3000, seed=13)
    device = _SimulatedDevice()
    e = _engine(model, LatencyModel(0.0, 1.0, 0.0), device.clock, slice_ms=50.0, truncate_headroom=0.5)
    gate, running = threading.Event(), threading.Event()

    def busy() -> None:  # holds the device until the ranking is queued, for 0.5 s of its time
        running.set()
        gate.wait(10)
        device.elapsed += 0.5

    held = e.scheduler.submit(busy, priority=Priority.RANK, deadline=device.deadline(0.0))
    # On the device, not waiting in its queue: the queue's next ranking job is the one below.
    assert await asyncio.to_thread(running.wait, 10)
    ranking = asyncio.create_task(e.rank("u", h, torch.arange(1, 9), 2e9, device.deadline(1.0)))
    while not e.scheduler.queue_depth(Priority.RANK):
        await asyncio.sleep(0)
    gate.set()
    res, _ = await asyncio.gather(ranking, held)
    assert res.path == "full_truncated" and 16 <= res.used_len <= 250
    assert res.breakdown_ms["device_queue"] >= 400
    e.scheduler.close()


async def test_a_sliced_full_ranking_that_runs_slower_than_planned_starts_over_shorter(model) -> None:
    # 0.01 ms a token, 1 s left: the plan keeps all 3000 events (30 ms predicted, in ~5 ms
    # slices of 500). Each event takes 0.41 ms: at that pace the rest would take ~0.8 s, so after
    # its first slices the ranking re-plans at the pace it measured and keeps what fits that.
    h = history(3000, seed=14)
    cands = torch.arange(1, 9)
    device = _SimulatedDevice()
    kw = {"slice_ms": 5.0, "prefill_chunk": 512, "truncate_headroom": 0.5}
    e = _engine(model, LatencyModel(0.0, 0.01, 0.0), device.clock, **kw)
    e.runner = _SlowChunks(e.runner, device, 0.41e-3)
    res = await e.rank("u", h, cands, 2e9, device.deadline(1.0))
    assert res.replanned and res.path == "full_truncated" and 16 <= res.used_len < 1500
    lost = res.breakdown_ms["replan_lost"]
    assert lost >= 200  # the first slice (500 events), thrown away
    # Its scores are those of the events it kept; the pace of full rankings is measured on them.
    want = model.rank(None, h.slice(3000 - res.used_len), cands, 2e9)
    torch.testing.assert_close(res.scores, want)
    assert e.pacing.samples[-1] == (res.used_len, pytest.approx(res.breakdown_ms["compute"] - lost))
    e.scheduler.close()


async def test_a_replan_goes_by_the_rankings_own_pace_not_the_slices_usual_one(model) -> None:
    # 0.3 ms a token, 1 s left: the plan fills half of it (~1666 events). Slices have lately run
    # at 4x their prediction (sized for it), and these run at 4x too (1.2 ms a token): as usual
    # for slices, but 4x what the plan assumed, so the rest would take ~2 s. It starts over at
    # the pace its slices ran: at most 0.5 s / 4 / 0.3 ms = 416 events.
    h = history(3000, seed=15)
    device = _SimulatedDevice()
    kw = {"slice_ms": 5.0, "prefill_chunk": 512, "truncate_headroom": 0.5}
    e = _engine(model, LatencyModel(0.0, 0.3, 0.0), device.clock, **kw)
    e.pacing.extend._log = math.log(4.0)
    e.runner = _SlowChunks(e.runner, device, 1.2e-3)
    res = await e.rank("u", h, torch.arange(1, 9), 2e9, device.deadline(1.0))
    assert res.replanned and 16 <= res.used_len <= 416
    e.scheduler.close()


async def test_one_slice_held_up_does_not_cut_a_ranking_short(model) -> None:
    # As above at the planned pace (0.01 ms a token), but the first slice takes 150 ms more (as
    # if preempted): judged from it alone, the rest would take ~0.78 s of the ~0.85 s left; from
    # two slices on it fits.
    h = history(3000, seed=14)
    device = _SimulatedDevice()
    kw = {"slice_ms": 5.0, "prefill_chunk": 512, "truncate_headroom": 0.5}
    e = _engine(model, LatencyModel(0.0, 0.01, 0.0), device.clock, **kw)
    e.runner = _SlowChunks(e.runner, device, 0.01e-3, first_chunk_s=0.15)
    res = await e.rank("u", h, torch.arange(1, 9), 2e9, device.deadline(1.0))
    assert not res.replanned and res.path == "full" and res.used_len == 3000
    e.scheduler.close()


async def test_a_sliced_full_ranking_at_its_planned_pace_does_not_replan(model) -> None:
    h = history(3000, seed=14)
    device = _SimulatedDevice()
    kw = {"slice_ms": 5.0, "prefill_chunk": 512, "truncate_headroom": 0.5}
    e = _engine(model, LatencyModel(0.0, 0.01, 0.0), device.clock, **kw)
    e.runner = _SlowChunks(e.runner, device, 0.01e-3)
    res = await e.rank("u", h, torch.arange(1, 9), 2e9, device.deadline(1.0))
    assert not res.replanned and res.path == "full" and res.used_len == 3000
    assert "replan_lost" not in res.breakdown_ms
    assert device.elapsed == pytest.approx(0.03)  # the 3000 events, at the planned pace
    e.scheduler.close()


def test_the_ingest_meter_counts_a_window_of_applied_events() -> None:
    m = IngestMeter(window_s=1.0, burst_events=100)
    m.add(60, now=10.0)
    m.add(0, now=10.1)  # nothing applied: nothing counted
    assert m.recent(now=10.5) == 60 and not m.bursting(now=10.5)
    m.add(40, now=10.6)
    assert m.recent(now=10.9) == 100 and m.bursting(now=10.9)
    assert m.recent(now=11.0) == 40 and not m.bursting(now=11.0)  # the first 60 are a window old
    assert m.recent(now=12.0) == 0
    with pytest.raises(ValueError):
        IngestMeter(window_s=0)
    with pytest.raises(ValueError):
        IngestMeter(burst_events=0)


async def test_the_scheduler_says_whether_ranking_work_is_on_the_device() -> None:
    s = DeviceScheduler("t")
    assert not s.ranking()
    gate = threading.Event()
    prefill = s.submit(gate.wait, priority=Priority.PREFILL)
    await asyncio.sleep(0.05)
    assert not s.ranking()  # pre-inference is not ranking work
    rank = s.submit(lambda: None, priority=Priority.RANK, deadline=time.time() + 10)
    assert s.ranking()  # queued
    gate.set()
    await asyncio.gather(prefill, rank)
    assert not s.ranking()
    gate.clear()
    running = s.submit(gate.wait, priority=Priority.RANK)
    await asyncio.sleep(0.05)
    assert s.ranking()  # running
    gate.set()
    await running
    s.close()


async def test_restore_sets_a_tagged_job_back() -> None:
    s = DeviceScheduler("t")
    gate = asyncio.Event()
    order: list[str] = []

    def slow() -> None:
        time.sleep(0.05)

    blocker = s.submit(slow, priority=Priority.RANK)
    pf = s.submit(lambda: order.append("prefill"), priority=Priority.PREFILL, tag=("prefill", "u"))
    s.promote(("prefill", "u"), Priority.RANK, time.time())
    assert s.restore(("prefill", "u"), Priority.PREFILL, math.inf) == 1
    rk = s.submit(lambda: order.append("rank"), priority=Priority.RANK, deadline=time.time() + 10)
    gate.set()
    await asyncio.gather(blocker, pf, rk)
    assert order == ["rank", "prefill"]
    s.close()


# ---------------------------------------------------------------------- the trigger


def test_trigger_refuses_a_prefill_that_cannot_pay_off_and_caps_what_it_predicts() -> None:
    lat = LatencyModel(1.0, 0.0, 1e-5)  # 60k events: ~36 s; 8192: ~0.67 s
    base = dict(budget_ms=50, theta=0.5, short_term=64, lease_ttl_s=30.0, window_ms=50.0)
    uncapped = SequenceAwareTrigger(TriggerConfig(**base, too_long_window_factor=0), lat)
    d = uncapped.decide(0, 60_000, 0.0)
    assert d.reason is TriggerReason.TOO_LONG and uncapped.counts["too_long"] == 1
    capped = SequenceAwareTrigger(TriggerConfig(**base, max_seq_len=8192, too_long_window_factor=0), lat)
    assert capped.decide(0, 60_000, 0.0).reason is TriggerReason.ADMITTED  # only the window is pre-inferred
    window = SequenceAwareTrigger(TriggerConfig(**base, max_seq_len=8192, too_long_window_factor=10), lat)
    assert window.decide(0, 60_000, 0.0).reason is TriggerReason.TOO_LONG  # 0.67 s > 10 × 50 ms


async def test_a_relay_ranking_against_many_keys_runs_in_slices_and_keeps_its_suffix(model) -> None:
    # 0.01 ms per token, 0.5 ms slices: ranking 40 new events and 64 candidates against a
    # 3000-event prefix is ~1 ms, so it is cut into slices: the new events, then candidate groups.
    e = _engine(model, LatencyModel(0.0, 0.01, 0.0), slice_ms=0.5, prefill_chunk=512)
    h = history(3040, seed=8)
    cands = torch.arange(1, 65)
    await e.prefill("u", h.slice(0, 3000))
    steps_before = e.scheduler.jobs_done[Priority.RANK]
    res = await e.rank("u", h, cands, 2e9, FAR)
    assert res.path == "relay" and res.prefix_len == 3000 and res.used_len == 3040
    assert e.pacing.slice_relay(3000, 40, 64)
    torch.testing.assert_close(res.scores, model.rank_full(h, cands, 2e9), rtol=1e-4, atol=1e-4)
    assert e.scheduler.jobs_done[Priority.RANK] == steps_before + 1  # one (chunked) ranking job
    assert e.store.cached_length("u", h) == 3040  # the grown prefix is kept for the next request
    e.scheduler.close()


async def test_a_relay_ranking_that_replays_a_cuda_graph_is_never_sliced(model, monkeypatch) -> None:
    # The shape above, sliced on its own; a graph replay is one launch: slicing it would run it
    # eagerly a layer a slice, with other jobs between the slices.
    from relaygr.workers.engine import ranker

    shapes: list[tuple[int, int, int]] = []
    monkeypatch.setattr(ranker, "graph_replays", lambda _m, *shape: shapes.append(shape) or True)
    e = _engine(model, LatencyModel(0.0, 0.01, 0.0), slice_ms=0.5, prefill_chunk=512)
    h = history(3040, seed=8)
    cands = torch.arange(1, 65)
    await e.prefill("u", h.slice(0, 3000))
    assert e.pacing.slice_relay(3000, 40, 64)
    res = await e.rank("u", h, cands, 2e9, FAR)
    assert shapes == [(3000, 40, 64)]
    assert res.path == "relay" and "between_slices" not in res.breakdown_ms
    torch.testing.assert_close(res.scores, model.rank_full(h, cands, 2e9), rtol=1e-4, atol=1e-4)
    await e.drain()
    assert e.store.cached_length("u", h) == 3040
    e.scheduler.close()


@pytest.mark.parametrize("slice_ms, extended", [(0.5, True), (50.0, False)])
async def test_a_prefill_extends_by_the_suffix_when_ranking_it_would_cost_more_than_a_slice(
    model, slice_ms: float, extended: bool
) -> None:
    # 64 short-term events at 0.05 ms a token: 3.2 ms, more than a 0.5 ms slice at any pace the
    # device may measure (0.5-4x), less than a 50 ms one.
    e = _engine(model, LatencyModel(0.0, 0.05, 0.0), slice_ms=slice_ms, prefill_chunk=512)
    h = history(3064, seed=12)
    out = await e.prefill("u", h, prefix_len=3000)
    assert out.status == "computed" and out.prefix_len == 3000
    await e.drain()
    assert e.store.cached_length("u", h) == (3064 if extended else 3000)
    res = await e.rank("u", h, torch.arange(1, 33), 2e9, FAR)
    assert res.path == "relay" and res.tokens_computed == (32 if extended else 64 + 32)
    torch.testing.assert_close(res.scores, model.rank_full(h, torch.arange(1, 33), 2e9), rtol=1e-4, atol=1e-4)
    e.scheduler.close()


async def test_a_relay_ranking_is_sliced_until_relay_rankings_are_timed_and_one_piece_times_them(
    model,
) -> None:
    # 0.4 ms predicted against 0.5 ms slices: sliced while no relay ranking has been timed (a
    # ranking against many keys ran several times the prediction, in one piece); once the pace
    # is known, one piece, and that ranking is timed into the pace as well.
    e = _engine(model, LatencyModel(0.0, 0.01, 0.0), slice_ms=0.5, prefill_chunk=512)
    h = history(3000, seed=10)
    await e.prefill("u", h)
    assert e.pacing.score.observations == 0 and e.pacing.slice_relay(3000, 0, 40)
    e.pacing.score.observe(1.0, 1.0)
    assert not e.pacing.slice_relay(3000, 0, 40)
    res = await e.rank("u", h, torch.arange(1, 41), 2e9, FAR)
    assert res.path == "relay" and "between_slices" not in res.breakdown_ms
    assert e.pacing.score.observations == 2
    e.scheduler.close()


async def test_a_relay_slice_ends_at_the_slice_time_whatever_the_pace_says(model, monkeypatch) -> None:
    # The pace says the device is twice as fast as predicted (its floor), so a step takes a 1 ms
    # prediction's worth of the candidates' keys, 2.56 ms in all; a clock on which every check finds
    # the slice over must cut a step at every layer (a scoring's finest step: one forward per
    # layer) instead, with the same scores.
    e = _engine(model, LatencyModel(0.0, 0.01, 0.0), slice_ms=0.5, prefill_chunk=512)
    h = history(8192, seed=11)
    cands = torch.arange(1, 257)
    await e.prefill("heavy", h)
    for _ in range(40):
        e.pacing.score.observe(1.0, 0.1)
    assert e.pacing.score.factor == pytest.approx(e.pacing.score.lo, rel=1e-3) and e.pacing.slice_relay(
        8192, 0, 256
    )
    monkeypatch.setattr(e.pacing.score, "observe", lambda *_: None)  # the pace stays what it says
    steps: list[int] = []
    score_steps = e.runner.score_steps

    def counted(*args, **kw):
        for out in score_steps(*args, **kw):
            if isinstance(out, int):
                steps.append(out)
            yield out

    class Ticking:  # the pacing timer: still (a slice never over) or a second a look (always over)
        def __init__(self, step_s: float) -> None:
            self.now, self.step_s = 0.0, step_s

        def __call__(self) -> float:
            self.now += self.step_s
            return self.now

    monkeypatch.setattr(e.runner, "score_steps", counted)
    e.pacing.clock = EngineClock(timer=Ticking(0.0))
    res = await e.rank("heavy", h, cands, 2e9, FAR)
    paced = len(steps)
    assert res.path == "relay" and paced >= 1
    steps.clear()
    e.pacing.clock = EngineClock(timer=Ticking(1.0))
    res = await e.rank("heavy", h, cands, 2e9, FAR)
    assert res.path == "relay" and len(steps) == model.config.layers >= paced
    torch.testing.assert_close(res.scores, model.rank_full(h, cands, 2e9), rtol=1e-4, atol=1e-4)
    e.scheduler.close()


async def test_a_short_ranking_waits_for_one_slice_of_a_heavy_relay_ranking_not_all_of_it(model) -> None:
    # Both queued behind a busy device: a heavy user's relay ranking (256 candidates against 3000
    # cached keys, in slices) with the earlier deadline, and a short ranking. The heavy one
    # starts first (earlier deadline) and the short one runs at its first slice boundary, not
    # after the whole ranking.
    e = _engine(model, LatencyModel(0.0, 0.01, 0.0), slice_ms=0.5, prefill_chunk=512)
    h = history(3000, seed=10)
    cands = torch.arange(1, 257)
    await e.prefill("heavy", h)
    e.pacing.score.observe(1.0, 1.0)  # relay rankings timed here at the model's pace
    assert e.pacing.slice_relay(3000, 0, 256)
    assert not e.pacing.slice_relay(3000, 0, 40)  # 0.4 ms predicted: within one slice, one job
    order: list[str] = []
    gate = threading.Event()
    blocker = e.scheduler.submit(lambda: gate.wait(10), priority=Priority.RANK)

    async def heavy():
        res = await e.rank("heavy", h, cands, 2e9, time.time() + 60)
        order.append("heavy")
        return res

    big = asyncio.create_task(heavy())
    while e.scheduler.queue_depth(Priority.RANK) < 1:
        await asyncio.sleep(0)
    short = e.scheduler.submit(
        lambda: order.append("short"), priority=Priority.RANK, deadline=time.time() + 120
    )
    gate.set()
    await asyncio.gather(blocker, short)
    res = await big
    assert order == ["short", "heavy"]
    assert res.breakdown_ms["between_slices"] > 0  # the short ranking's time, in its breakdown
    torch.testing.assert_close(res.scores, model.rank_full(h, cands, 2e9), rtol=1e-4, atol=1e-4)
    e.scheduler.close()
