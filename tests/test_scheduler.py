"""The device scheduler: one thread, ranking before pre-inference, earlier deadline first."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from relaygr.workers.engine.scheduler import DeviceScheduler, Priority, SchedulerClosed


async def test_ranking_jumps_the_prefill_queue() -> None:
    s = DeviceScheduler("t")
    gate = threading.Event()
    order: list[str] = []
    try:
        blocker = s.submit(lambda: gate.wait(5), priority=Priority.PREFILL)
        jobs = [
            s.submit(lambda i=i: order.append(f"prefill{i}"), priority=Priority.PREFILL) for i in range(3)
        ]
        jobs.append(s.submit(lambda: order.append("rank-late"), priority=Priority.RANK, deadline=20.0))
        jobs.append(s.submit(lambda: order.append("rank-early"), priority=Priority.RANK, deadline=10.0))
        gate.set()
        await asyncio.gather(blocker, *jobs)
        assert order == ["rank-early", "rank-late", "prefill0", "prefill1", "prefill2"]
    finally:
        s.close()


async def test_promote_lends_a_queued_job_ranking_priority() -> None:
    s = DeviceScheduler("t")
    gate = threading.Event()
    order: list[str] = []
    try:
        blocker = s.submit(
            lambda: gate.wait(5), priority=Priority.RANK, deadline=0.0
        )  # first, however late the device thread wakes
        jobs = [s.submit(lambda: order.append("rank"), priority=Priority.RANK, deadline=50.0)]
        jobs.append(s.submit(lambda: order.append("other-prefill"), priority=Priority.PREFILL, tag="v"))
        jobs.append(s.submit(lambda: order.append("prefill"), priority=Priority.PREFILL, tag="u"))
        assert s.promote("u", Priority.RANK, deadline=10.0) == 1
        assert s.promote("nobody", Priority.RANK, deadline=1.0) == 0
        assert s.queue_depth(Priority.PREFILL) == 1
        gate.set()
        await asyncio.gather(blocker, *jobs)
        assert order == ["prefill", "rank", "other-prefill"]
    finally:
        s.close()


async def test_chunked_job_yields_between_steps_but_keeps_its_turn() -> None:
    s = DeviceScheduler("t")
    gate, started = threading.Event(), threading.Event()
    order: list[str] = []

    def steps(name: str, n: int):
        for i in range(n):
            if name == "a" and i == 0:
                started.set()
                gate.wait(5)
            order.append(f"{name}{i}")
            yield None if i < n - 1 else name

    try:
        a = s.submit_steps(steps("a", 3), priority=Priority.PREFILL)
        assert await asyncio.to_thread(started.wait, 5)
        b = s.submit_steps(steps("b", 2), priority=Priority.PREFILL)
        r = s.submit(lambda: order.append("rank"), priority=Priority.RANK)
        gate.set()
        assert await asyncio.gather(a, b, r) == ["a", "b", None]
        # The ranking job waits for one chunk only; b (queued later) never cuts into a.
        assert order == ["a0", "rank", "a1", "a2", "b0", "b1"]
        assert s.jobs_done[Priority.PREFILL] == 2
    finally:
        s.close()


@pytest.mark.parametrize("yields", [True, False])
async def test_a_yielding_chunked_job_lets_the_jobs_waiting_at_each_boundary_go_first(yields: bool) -> None:
    """Chunked prefill: a long ranking job (a miss's full ranking) with an early deadline lets the
    short rankings that arrived during a chunk run before its next chunk; one that arrives later
    waits for the next boundary, so the long job still advances a chunk per round."""
    s = DeviceScheduler("t")
    gates = [threading.Event() for _ in range(2)]
    started = [threading.Event() for _ in range(2)]
    order: list[str] = []

    def full():
        for i in range(4):
            order.append(f"full{i}")
            if i < 2:
                started[i].set()
                gates[i].wait(5)
            yield None
        yield "full"

    def short(name: str) -> str:
        order.append(name)
        return name

    try:
        f = s.submit_steps(full(), priority=Priority.RANK, deadline=10.0, yields=yields)
        assert await asyncio.to_thread(started[0].wait, 5)
        # Later deadlines than the full ranking's: under plain EDF they would wait for all of it.
        r1 = s.submit(lambda: short("relay1"), priority=Priority.RANK, deadline=50.0)
        p = s.submit(lambda: short("prefill"), priority=Priority.PREFILL)
        gates[0].set()
        assert await asyncio.to_thread(started[1].wait, 5)
        r2 = s.submit(lambda: short("relay2"), priority=Priority.RANK, deadline=60.0)
        gates[1].set()
        assert await asyncio.gather(f, r1, r2, p) == ["full", "relay1", "relay2", "prefill"]
        if yields:
            assert order == ["full0", "relay1", "full1", "relay2", "full2", "full3", "prefill"]
        else:  # the baseline's order: earliest deadline first, the whole job at once
            assert order == ["full0", "full1", "full2", "full3", "relay1", "relay2", "prefill"]
        assert s.queue_depth() == 0
    finally:
        s.close()


async def test_two_yielding_chunked_jobs_take_turns_a_chunk_each() -> None:
    """A short sliced ranking queued behind a long one with an earlier deadline (a heavy user's)
    runs a chunk at each of its boundaries instead of waiting for all of it."""
    s = DeviceScheduler("t")
    gate, started = threading.Event(), threading.Event()
    order: list[str] = []

    def chunks(name: str, n: int):
        for i in range(n):
            order.append(f"{name}{i}")
            if name == "long" and i == 0:
                started.set()
                gate.wait(5)
            yield None
        yield name

    try:
        long = s.submit_steps(chunks("long", 4), priority=Priority.RANK, deadline=10.0, yields=True)
        assert await asyncio.to_thread(started.wait, 5)
        short = s.submit_steps(chunks("short", 2), priority=Priority.RANK, deadline=50.0, yields=True)
        gate.set()
        assert await asyncio.gather(long, short) == ["long", "short"]
        # The short job is done after two of the long job's four chunks, not all of them.
        assert order == ["long0", "short0", "long1", "short1", "long2", "long3"]
        assert s.queue_depth() == 0
    finally:
        s.close()


async def test_a_yielding_chunked_job_between_two_steps_is_failed_on_close() -> None:
    s = DeviceScheduler("t")
    gate, hold, started, holding = (threading.Event() for _ in range(4))

    def full():
        started.set()
        gate.wait(5)
        yield None
        yield "done"

    def blocker() -> None:
        holding.set()
        hold.wait(5)

    f = s.submit_steps(full(), priority=Priority.RANK, deadline=1.0, yields=True)
    assert await asyncio.to_thread(started.wait, 5)
    b = s.submit(blocker, priority=Priority.RANK, deadline=2.0)
    gate.set()  # the blocker goes first at the boundary and holds the device
    assert await asyncio.to_thread(holding.wait, 5)
    threading.Timer(0.2, hold.set).start()
    s.close()
    await b
    with pytest.raises(SchedulerClosed):
        await f


async def test_on_start_sets_up_the_device_thread_before_any_job() -> None:
    local = threading.local()
    s = DeviceScheduler("t", on_start=lambda: setattr(local, "ready", threading.current_thread().name))
    try:
        seen = await s.submit(lambda: getattr(local, "ready", None), priority=Priority.RANK)
        assert seen == "relaygr-t"  # set on the device thread itself, not on the caller's
        assert getattr(local, "ready", None) is None
    finally:
        s.close()


async def test_runs_on_one_thread_and_propagates_errors() -> None:
    s = DeviceScheduler("t")
    try:
        names = await asyncio.gather(
            *[s.submit(lambda: threading.current_thread().name, priority=Priority.RANK) for _ in range(5)]
        )
        assert len(set(names)) == 1 and names[0] != threading.current_thread().name

        def boom() -> None:
            raise ValueError("bad shapes")

        with pytest.raises(ValueError, match="bad shapes"):
            await s.submit(boom, priority=Priority.RANK)
        assert await s.submit(lambda: 7, priority=Priority.RANK) == 7  # still alive
    finally:
        s.close()


async def test_loop_stays_responsive_while_device_is_busy() -> None:
    s = DeviceScheduler("t")
    gate, running = threading.Event(), threading.Event()
    try:
        fut = s.submit(lambda: (running.set(), gate.wait(30)), priority=Priority.PREFILL)
        assert await asyncio.to_thread(running.wait, 30)
        # The device job holds the device until the gate opens; the loop goes on meanwhile.
        ticks = 0
        for _ in range(20):
            await asyncio.sleep(0.001)
            ticks += 1
        assert ticks == 20 and not fut.done() and not gate.is_set()
        gate.set()
        await fut
    finally:
        gate.set()
        s.close()


async def test_close_fails_pending_jobs() -> None:
    s = DeviceScheduler("t")
    gate, running = threading.Event(), threading.Event()
    first = s.submit(lambda: (running.set(), gate.wait(5)), priority=Priority.RANK)
    assert await asyncio.to_thread(running.wait, 5)
    pending = s.submit(lambda: 1, priority=Priority.PREFILL)
    closer = asyncio.get_running_loop().run_in_executor(None, s.close)
    await asyncio.sleep(0.05)
    gate.set()
    await closer
    await first
    with pytest.raises(SchedulerClosed):
        await pending
    with pytest.raises(SchedulerClosed):
        s.submit(lambda: 1, priority=Priority.RANK)


async def test_queued_jobs_with_one_key_run_as_one_batch() -> None:
    s = DeviceScheduler("t")
    gate = threading.Event()
    calls: list[list[str]] = []

    def run(items: list[str]) -> list[str]:
        calls.append(list(items))
        return [f"done-{i}" for i in items]

    try:
        blocker = s.submit(
            lambda: gate.wait(5), priority=Priority.RANK, deadline=0.0
        )  # first, however late the device thread wakes
        a = [
            s.submit_batched(f"a{i}", run, key="a", priority=Priority.RANK, deadline=10.0 + i, limit=3)
            for i in range(4)
        ]
        b = s.submit_batched("b0", run, key="b", priority=Priority.RANK, deadline=11.5)
        gate.set()
        results = await asyncio.gather(blocker, *a, b)
        assert results[1:] == ["done-a0", "done-a1", "done-a2", "done-a3", "done-b0"]
        # a0 (earliest deadline) takes two more a's, b runs alone, the fourth a after it.
        assert calls == [["a0", "a1", "a2"], ["b0"], ["a3"]]
        assert s.batches_run == 1 and s.queue_depth() == 0
    finally:
        s.close()


async def test_a_failing_batch_fails_every_job_in_it() -> None:
    s = DeviceScheduler("t")
    gate = threading.Event()

    def run(items: list[int]) -> list[int]:
        raise RuntimeError(f"device lost ({len(items)} items)")

    try:
        blocker = s.submit(
            lambda: gate.wait(5), priority=Priority.RANK, deadline=0.0
        )  # first, however late the device thread wakes
        jobs = [s.submit_batched(i, run, key="u", priority=Priority.RANK) for i in range(3)]
        after = s.submit(lambda: "still serving", priority=Priority.RANK)
        gate.set()
        await blocker
        for j in jobs:
            with pytest.raises(RuntimeError, match="3 items"):
                await j
        assert await after == "still serving"
    finally:
        s.close()


async def test_paced_pre_inference_rests_until_a_ranking_comes_or_the_pace_ends() -> None:
    """With a rest of ten thousand times each pre-inference turn, the device thread waits after
    one; a ranking job queued meanwhile runs at once, and ``pace(0)`` lets the next pre-inference
    go (the bounds here are minutes against a rest of more than an hour)."""
    s = DeviceScheduler("t")
    order: list[str] = []
    try:
        s.pace(1e4)
        first = s.submit(lambda: (time.sleep(0.02), order.append("prefill-1")), priority=Priority.PREFILL)
        await asyncio.wait_for(first, 60)
        second = s.submit(lambda: order.append("prefill-2"), priority=Priority.PREFILL)
        rank = s.submit(lambda: order.append("rank"), priority=Priority.RANK)
        await asyncio.wait_for(rank, 60)  # cut the rest short
        await asyncio.sleep(0.2)
        assert not second.done()  # the ranking does not rest: the pre-inference's rest goes on
        s.pace(0)
        await asyncio.wait_for(second, 60)
        assert order == ["prefill-1", "rank", "prefill-2"]
        with pytest.raises(ValueError):
            s.pace(-1)
    finally:
        s.close()


@pytest.mark.parametrize("share", [0.0, 0.3])
async def test_reserve_gives_queued_pre_inference_its_share_ahead_of_rankings(share: float) -> None:
    # Ten rankings and three pre-inference jobs of the same size queue behind a ranking. Without a
    # reserved share every ranking goes first; with 30 %, pre-inference runs among them (the
    # first as soon as the device is free: it has had none of the recent time) and never more
    # than its share ahead of them.
    # Each job takes 2 ms of a clock the jobs advance themselves: the picks depend on the policy,
    # not on how this machine schedules threads.
    now = [0.0]
    s = DeviceScheduler("t", clock=lambda: now[0])
    s.reserve(share)
    gate = threading.Event()
    order: list[str] = []

    def job(name: str) -> None:
        order.append(name)
        now[0] += 0.002

    try:
        blocker = s.submit(lambda: gate.wait(5), priority=Priority.RANK, deadline=0.0)
        jobs = [
            s.submit(lambda i=i: job(f"rank{i}"), priority=Priority.RANK, deadline=1.0) for i in range(10)
        ]
        jobs += [s.submit(lambda i=i: job(f"prefill{i}"), priority=Priority.PREFILL) for i in range(3)]
        gate.set()
        await asyncio.gather(blocker, *jobs)
        prefills = [i for i, name in enumerate(order) if name.startswith("prefill")]
        if share == 0:
            assert prefills == [10, 11, 12] and s.share_picks == 0
        else:
            assert prefills[0] == 0 and prefills[-1] < 10, order
            assert s.share_picks == 3
            assert 0 < s.recent_share(Priority.PREFILL) < 1
    finally:
        s.close()


def test_reserve_rejects_a_share_outside_zero_to_one() -> None:
    s = DeviceScheduler("t")
    try:
        with pytest.raises(ValueError, match="prefill_share"):
            s.reserve(1.0)
    finally:
        s.close()
