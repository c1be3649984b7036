"""Traces from MovieLens, and their replay against the real broker: order and relative timing kept."""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass

import pytest
import torch

from relaygr.infra.kafka import partition_for
from relaygr.infra.topic_reader import Start, merge_by_time, read_topic
from relaygr.schemas import BehaviorEvent, RecommendationRequest
from relaygr.tools.barriers import sentinel_users
from relaygr.tools.long_users import EPOCH_FLOOR, lengthen
from relaygr.tools.replay import Replayer, plan_replay, poisson_offsets, scaled_offsets
from relaygr.tools.trace import TraceTopics, build_trace, load_trace, publish_trace
from relaygr.workers.prefix_kv import Events
from relaygr.workers.training.movielens import load_movielens


@pytest.fixture(scope="module")
def ml():
    return load_movielens("ml-100k")


# ---------------------------------------------------------------------- traces (no broker)


def test_every_interaction_becomes_a_request_with_its_item_as_ground_truth(ml) -> None:
    tr = build_trace(ml, users=5)
    n = sum(len(ml.histories[u]) for u in sorted(ml.histories)[:5])
    assert len(tr.requests) == n and len(tr.behaviours) == n
    times = [r.event_ts for r in tr.requests]
    assert times == sorted(times)
    for r in tr.requests:
        u, k = (int(x) for x in r.request_id.split("-")[-2:])
        h = ml.histories[u]
        assert r.user_id == str(u) and r.label_item_id == int(h.item_ids[k])
        assert r.event_ts == float(h.timestamps[k])
    assert [b.ts for b in tr.behaviours] == sorted(b.ts for b in tr.behaviours)


def test_window_with_synthesised_histories_and_warmup(ml) -> None:
    L = 300
    tr = build_trace(ml, min_prior=20, start=1000, count=80, target_len=L, warmup=True)
    window = [r for r in tr.requests if r.request_id not in tr.warmup_ids]
    assert len(window) == 80 and tr.meta["requests"] == 80
    users = {r.user_id for r in window}
    assert {r.user_id for r in tr.requests if r.request_id in tr.warmup_ids} == users
    for u in users:
        mine = [b for b in tr.behaviours if b.user_id == u]
        reqs = [r for r in window if r.user_id == u]
        # L events before the window, then the user's real interactions in it, in time order.
        assert len(mine) == L + len(reqs)
        assert [b.ts for b in mine] == sorted(b.ts for b in mine)
        assert [(b.item_id, b.ts) for b in mine[L:]] == [(r.label_item_id, r.event_ts) for r in reqs]
        first = reqs[0]
        k0 = int(first.request_id.split("-")[-1])
        assert k0 >= 20
        (warm,) = [r for r in tr.requests if r.user_id == u and r.request_id in tr.warmup_ids]
        assert warm.request_id.endswith(f"-{k0 - 1}") and warm.event_ts <= first.event_ts
        assert all(b.ts > 0 for b in mine)


def test_lengthen_repeats_the_real_history_in_time_order() -> None:
    past = Events.from_lists([5, 6, 7], [1000.0, 2000.0, 2500.0], [1, 2, 3])
    out = lengthen(past, 8)
    assert len(out) == 8
    assert out.item_ids.tolist() == [6, 7, 5, 6, 7, 5, 6, 7]
    assert out.timestamps[-3:].tolist() == [1000.0, 2000.0, 2500.0]  # the real history, untouched
    assert torch.all(out.timestamps[1:] > out.timestamps[:-1])
    # A long span near the epoch: the synthesised part is squeezed in between a quarter of the time
    # since the epoch and one day (at most that quarter) before the real history.
    far = Events.from_lists([1, 2], [200_000.0, 5_000_000.0], [1, 1])
    long = lengthen(far, 50)
    assert len(long) == 50 and float(long.timestamps[0]) == pytest.approx(min(EPOCH_FLOOR, 50_000.0))
    assert float(long.timestamps[-3]) == pytest.approx(200_000.0 - 50_000.0)
    assert torch.all(long.timestamps[1:] >= long.timestamps[:-1])
    assert long.timestamps[-2:].tolist() == [200_000.0, 5_000_000.0]
    assert len(lengthen(past, 2)) == 2  # shorter target: the most recent events


def test_arrival_offsets() -> None:
    offs = poisson_offsets(4000, 50.0, seed=3)
    gaps = [b - a for a, b in itertools.pairwise(offs)]
    assert offs[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert statistics.pstdev(gaps) == pytest.approx(1 / 50, rel=0.1)  # exponential: sd = mean
    assert poisson_offsets(10, 5.0, seed=1) == poisson_offsets(10, 5.0, seed=1)
    assert scaled_offsets([100.0, 100.0, 104.0, 103.0, 110.0], 2.0) == [0.0, 0.0, 2.0, 2.0, 5.0]
    reqs = [
        RecommendationRequest(request_id=f"r{i}", user_id="u", ts=1.0, event_ts=float(i)) for i in range(10)
    ]
    plan = plan_replay(reqs, speed=4.0, duration_s=1.0)
    assert [r.request_id for r in plan.requests] == ["r0", "r1", "r2", "r3"]
    assert plan.offsets == [0.0, 0.25, 0.5, 0.75]
    assert len(plan_replay(reqs, qps=100.0, max_requests=3).requests) == 3
    with pytest.raises(ValueError):
        plan_replay(reqs, qps=1.0, speed=1.0)


@dataclass
class _Rec:
    partition: int
    t: float
    name: str


def test_merge_keeps_each_partitions_order() -> None:
    recs = [
        _Rec(0, 1.0, "a1"),
        _Rec(1, 0.5, "b1"),
        _Rec(0, 0.2, "a2"),
        _Rec(1, 2.0, "b2"),
        _Rec(0, 3.0, "a3"),
    ]
    out = [r.name for r in merge_by_time(recs, lambda r: r.t)]
    assert [n for n in out if n[0] == "a"] == ["a1", "a2", "a3"]  # a2 is "earlier" but stays after a1
    assert [n for n in out if n[0] == "b"] == ["b1", "b2"]
    assert out.index("b1") < out.index("a1")


def test_sentinels_cover_every_partition() -> None:
    s = sentinel_users(6, "x")
    assert sorted(s) == list(range(6))
    assert all(partition_for(uid.encode(), 6) == p for p, uid in s.items())


# ---------------------------------------------------------------------- against the broker

GAPS = [0.0, 0.3, 0.35, 0.8, 0.8, 1.1, 1.5, 1.52, 1.9, 2.4]  # seconds on the trace's clock
USERS = ["a", "b", "c", "a", "b", "a", "c", "c", "b", "a"]
T0 = 1.0e9


def _hand_trace():
    from relaygr.tools.trace import Trace

    reqs = [
        RecommendationRequest(
            request_id=f"q{i}", user_id=u, ts=T0 + g, event_ts=T0 + g, label_item_id=10 + i, num_candidates=8
        )
        for i, (g, u) in enumerate(zip(GAPS, USERS, strict=True))
    ]
    # Three old events per user, then each request's interaction as a behaviour at its time.
    beh = [
        BehaviorEvent(user_id=u, item_id=k + 1, ts=T0 - 100 + k, action=1) for u in "abc" for k in range(3)
    ]
    beh += [BehaviorEvent(user_id=r.user_id, item_id=r.label_item_id, ts=r.event_ts, action=2) for r in reqs]
    return Trace(reqs, sorted(beh, key=lambda b: b.ts))


@pytest.mark.broker
async def test_replay_keeps_per_user_order_and_relative_timing(kafka_settings, registry) -> None:
    from relaygr.infra.kafka import delete_topics_with_prefix

    tt = TraceTopics(f"{registry.prefix}-src.trace", registry.partitions)
    try:
        await publish_trace(kafka_settings, tt, _hand_trace())
        tr = await load_trace(kafka_settings, tt)
        assert [r.request_id for r in tr.requests] == [f"q{i}" for i in range(len(GAPS))]  # merged by time
        speed = 2.0
        async with Replayer(kafka_settings, registry, tr.behaviours, user_prefix="x-") as rp:
            assert await rp.preload(tr.requests[0].model_ts) == 9  # the old events go first
            t_start = time.time()
            sent = await rp.run(plan_replay(tr.requests, speed=speed))
        assert len(sent) == len(GAPS)
        got = await read_topic(kafka_settings, registry.name("requests"), RecommendationRequest)
        beh = await read_topic(kafka_settings, registry.name("behaviors"), BehaviorEvent)
    finally:
        await delete_topics_with_prefix(kafka_settings, tt.requests.name)
    recs = {r.value.request_id: r for r in got.records}
    assert set(recs) == {f"x-q{i}" for i in range(len(GAPS))}
    for u in "abc":  # per user: one partition, offsets in trace order
        mine = [recs[f"x-q{i}"] for i, uu in enumerate(USERS) if uu == u]
        assert len({r.partition for r in mine}) == 1
        assert [r.offset for r in mine] == sorted(r.offset for r in mine)
        assert all(r.value.user_id == f"x-{u}" for r in mine)
    # Relative timing: send stamps follow the trace at 2x speed. A request never goes out before
    # its planned offset (however loaded the machine, a late one is only late), and the pace fitted
    # over the whole replay (offsets from the first send) is the trace's at 2x within a fifth.
    planned = [g / speed for g in GAPS]
    sent_at = [recs[f"x-q{i}"].value.ts - t_start for i in range(len(GAPS))]
    for i, g in enumerate(GAPS):
        r = recs[f"x-q{i}"]
        assert r.value.event_ts == T0 + g and r.value.label_item_id == 10 + i
        assert sent_at[i] >= planned[i] - 0.005, (i, sent_at[i], planned[i])
        # The record is stamped when it is handed to the producer, after the request's own stamp.
        assert r.timestamp_ms >= int(r.value.ts * 1000) - 1
    offsets = [t - sent_at[0] for t in sent_at]
    pace = sum(o * p for o, p in zip(offsets, planned, strict=True)) / sum(p * p for p in planned)
    assert 0.8 <= pace <= 1.25, (pace, offsets)
    # Every behaviour older than a request was written before that request went out.
    btimes = {(b.value.user_id, b.value.ts): b.timestamp_ms for b in beh.records}
    assert len(beh.records) == len(btimes) == 9 + len(GAPS) - 1  # the last interaction has no later request
    for i, g in enumerate(GAPS):
        req_ms = recs[f"x-q{i}"].timestamp_ms
        older = [ms for (_, ts), ms in btimes.items() if ts < T0 + g]
        assert older and max(older) <= req_ms


@pytest.mark.broker
async def test_read_topic_from_an_offset_or_a_timestamp(kafka_settings, registry) -> None:
    from relaygr.infra.kafka import producer
    from relaygr.schemas import encode

    topic = registry.name("requests")
    prod = producer(kafka_settings)
    await prod.start()
    try:
        for i in range(6):
            r = RecommendationRequest(request_id=f"e{i}", user_id="same", ts=1.0)
            await prod.send_and_wait(topic, encode(r), key=r.key())
        mid = time.time()
        time.sleep(0.05)
        for i in range(6, 10):
            r = RecommendationRequest(request_id=f"e{i}", user_id="same", ts=1.0)
            await prod.send_and_wait(topic, encode(r), key=r.key())
        await prod.send_and_wait(topic, b"not json", key=b"same")
    finally:
        await prod.stop()
    every = await read_topic(kafka_settings, topic, RecommendationRequest)
    assert [r.value.request_id for r in every.records] == [f"e{i}" for i in range(10)]
    assert every.undecodable == 1
    p = every.records[0].partition
    from_4 = await read_topic(kafka_settings, topic, RecommendationRequest, Start.parse(offset=f"{p}:4"))
    assert [r.value.request_id for r in from_4.records] == [f"e{i}" for i in range(4, 10)]
    assert [
        r.value.request_id
        for r in (
            await read_topic(kafka_settings, topic, RecommendationRequest, Start.parse(offset="7"))
        ).records
    ] == ["e7", "e8", "e9"]
    since = await read_topic(kafka_settings, topic, RecommendationRequest, Start.parse(timestamp=str(mid)))
    assert [r.value.request_id for r in since.records] == ["e6", "e7", "e8", "e9"]


@pytest.mark.broker
async def test_preload_per_user_then_the_rest_in_time(kafka_settings, registry) -> None:
    tr = _hand_trace()
    later = [r for r in tr.requests if r.user_id != "a"]
    async with Replayer(kafka_settings, registry, tr.behaviours) as rp:
        # User a: everything before 1.2 s (3 old events + its interactions at 0, 0.8 and 1.1 s).
        assert await rp.preload({"a": T0 + 1.2}) == 6
        sent = await rp.run(plan_replay(later, qps=200.0))
    assert [r.request_id for r in sent] == [r.request_id for r in later]
    beh = await read_topic(kafka_settings, registry.name("behaviors"), BehaviorEvent)
    got = sorted((b.value.user_id, b.value.ts) for b in beh.records)
    # Then, in time, everything older than the last request sent (b's at 1.9 s): a's 2.4 s event stays.
    want = sorted(
        (b.user_id, b.ts) for b in tr.behaviours if b.ts < T0 + 1.9 or (b.user_id == "a" and b.ts < T0 + 1.2)
    )
    assert got == want
