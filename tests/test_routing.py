"""The cascade's own co-partitioning, without a broker: the partitioner, the routing headers'
positions, the history table's de-duplication and progress, the alignment wait, and the
pre-processing stage's chunked seen-items table."""

from __future__ import annotations

import asyncio
import time
import zlib

import pytest
from aiokafka.partitioner import DefaultPartitioner
from hypothesis import given
from hypothesis import strategies as st

from relaygr.infra.kafka import partition_for
from relaygr.schemas import BehaviorBatch, BehaviorEvent
from relaygr.schemas.routing import covers, decode_positions, decode_rate, encode_positions, missing
from relaygr.streams.history import HistoryTable
from relaygr.streams.history_alignment import UNREACHABLE, HistoryAlignment
from relaygr.streams.preprocess import SEEN_CHUNK, seen_add, seen_before
from relaygr.streams.retrieval import summary_add


def test_partition_for_is_the_murmur2_default_and_not_crc32() -> None:
    every = list(range(4))
    keys = [f"user-{i}".encode() for i in range(500)]
    assert all(partition_for(k, 4) == DefaultPartitioner()(k, every, every) for k in keys)
    # librdkafka's default (CRC32) puts many users elsewhere: why the cascade routes itself.
    differ = sum(partition_for(k, 4) != zlib.crc32(k) % 4 for k in keys)
    assert differ > len(keys) // 2


@given(st.dictionaries(st.integers(0, 1000), st.integers(0, 2**40)))
def test_positions_round_trip(pos: dict[int, int]) -> None:
    assert decode_positions(encode_positions(pos)) == pos


def test_positions_reject_non_integers() -> None:
    with pytest.raises(ValueError, match="not an integer"):
        decode_positions(b'{"0": "7"}')
    with pytest.raises(ValueError):
        decode_positions(b"[1, 2]")


def test_covers_and_missing() -> None:
    assert covers({0: 5, 1: 3}, {0: 5, 1: 2})
    assert not covers({0: 5}, {0: 5, 1: 1})  # a partition never forwarded covers nothing
    assert covers({}, {0: 0, 1: 0})  # nothing needed from empty partitions
    assert missing({0: 2, 1: 9}, {0: 5, 1: 3}) == 3


def _ev(user: str, item: int, ts: float) -> BehaviorEvent:
    return BehaviorEvent(user_id=user, item_id=item, ts=ts, action=1)


def test_history_drops_copies_forwarded_twice_and_keeps_progress(tmp_path) -> None:
    h = HistoryTable(tmp_path / "h")
    batch = [(0, _ev("u", 1, 1.0), (2, 10)), (1, _ev("u", 2, 2.0), (2, 11)), (2, None)]
    assert h.append_many(0, batch, progress={2: 12, 3: 4}) == 2
    # The ingress restarted before committing and forwarded source offsets 11 and 12 again.
    again = [(3, _ev("u", 2, 2.0), (2, 11)), (4, _ev("u", 3, 3.0), (2, 12)), (5, None)]
    assert h.append_many(0, again, progress={2: 13, 3: 2}) == 1
    assert h.get("u").item_ids.tolist() == [1, 2, 3]
    assert h.progress(0) == {2: 13, 3: 4}  # merged by maximum, never backwards
    assert h.progress(1) == {}
    h.close()
    reopened = HistoryTable(tmp_path / "h")
    assert reopened.progress(0) == {2: 13, 3: 4} and reopened.next_offset(0) == 6
    assert reopened.append_many(0, [(6, _ev("u", 2, 2.0), (2, 11))]) == 0
    assert reopened.get("u").item_ids.tolist() == [1, 2, 3]
    reopened.close()


def test_history_applies_routed_batches_once(tmp_path) -> None:
    h = HistoryTable(tmp_path / "h")

    def batch(user, items, offsets, q=1):
        return BehaviorBatch(
            user_id=user,
            item_ids=items,
            timestamps=[float(i) for i in items],
            actions=[1] * len(items),
            source_partitions=[q] * len(items),
            source_offsets=offsets,
        )

    # Two users whose events interleave on one public partition: the ingress groups them by user,
    # so per routed partition the source offsets are not in order, only per user.
    first = [(0, batch("u", [1, 2, 3], [4, 6, 8])), (1, batch("v", [7, 8], [5, 7])), (2, None)]
    assert h.append_many(2, first, progress={1: 9}) == 5
    # A re-forwarded fetch overlaps what was applied: only its new events count.
    again = [(3, batch("u", [2, 3, 4], [6, 8, 9])), (4, batch("v", [8], [7])), (5, batch("u", [9], [0], q=0))]
    assert h.append_many(2, again) == 2
    assert h.get("u").item_ids.tolist() == [1, 2, 3, 4, 9]
    assert h.get("v").item_ids.tolist() == [7, 8]
    assert h.progress(2) == {1: 9}
    h.close()


def _from(topic_id, items, offsets) -> BehaviorBatch:
    return BehaviorBatch(
        user_id="u",
        item_ids=items,
        timestamps=[float(i) for i in items],
        actions=[1] * len(items),
        source_partitions=[0] * len(items),
        source_offsets=offsets,
        source_topic_id=topic_id,
    )


def test_offsets_of_a_recreated_public_topic_start_over_for_the_history_and_the_summary(tmp_path) -> None:
    """The public behaviours topic deleted and created again (same name, a new id) while the
    routed topics stay: its offsets start at 0 again and must not be taken for copies."""
    h = HistoryTable(tmp_path / "h")
    summary = None
    steps = [
        (None, [1, 2], [0, 1], 2),  # before the ids were recorded: trusted, as before
        ("id-a", [3], [2], 1),  # the id is adopted, the offsets kept
        ("id-a", [2, 3], [1, 2], 0),  # a copy forwarded twice
        ("id-b", [10, 11], [0, 1], 2),  # the new topic's first events: new, though below 2
        ("id-b", [11, 12], [1, 2], 1),
    ]
    for off, (tid, items, offsets, applied) in enumerate(steps):
        assert h.append_many(0, [(off, _from(tid, items, offsets))]) == applied, (tid, items)
        summary = summary_add(summary, _from(tid, items, offsets))
    assert h.get("u").item_ids.tolist() == [1, 2, 3, 10, 11, 12]
    assert summary["n"] == 6 and [i for i, _ in summary["r"]] == [1, 2, 3, 10, 11, 12]
    h.close()
    reopened = HistoryTable(tmp_path / "h")  # the id is kept with the offsets
    assert reopened.append_many(0, [(9, _from("id-b", [12], [2]))]) == 0
    reopened.close()


async def test_alignment_waits_for_progress_and_gives_up_at_its_bound(tmp_path) -> None:
    h = HistoryTable(tmp_path / "h")
    align = HistoryAlignment(h)
    # Bounded: nothing arrives, the wait gives up (and says so) once its time is up.
    assert not await align.wait(0, {"0": 3}, time.monotonic() + 0.05)

    async def ingest_later() -> None:
        await asyncio.sleep(0.01)
        h.append_many(0, [(0, _ev("u", 1, 1.0), (0, 0))], progress={0: 1})
        align.notify()  # covers only offset 1 of 3: not enough yet
        await asyncio.sleep(0.01)
        h.append_many(0, [(1, _ev("u", 2, 2.0), (0, 2)), (2, None)], progress={0: 3})
        align.notify()

    task = asyncio.create_task(ingest_later())
    assert await align.wait(0, {"0": 3}, time.monotonic() + 60)
    await task
    assert len(h.get("u")) == 2
    h.close()


async def test_alignment_does_not_wait_for_records_that_cannot_arrive_in_time(tmp_path) -> None:
    """A waiter behind measures the drain rate; a later wait whose missing records would take
    longer than its time left at that rate ends at once (no notify needed), a short one waits."""
    h = HistoryTable(tmp_path / "h")
    align = HistoryAlignment(h)
    assert align.drain_rate is None

    async def forward_ten_twice() -> None:
        for off in (0, 1):
            await asyncio.sleep(0.01)
            h.append_many(0, [(off, None)], progress={0: 10 * (off + 1)})
            align.notify()

    task = asyncio.create_task(forward_ten_twice())
    # Behind by 10^9 records; 10 arrive, then 10 more about 10 ms later (the first move only
    # marks where the pace is measured from): far too slow for the rest within a minute.
    assert not await align.wait(0, {"0": 10**9}, time.monotonic() + 60)
    await task
    assert align.drain_rate is not None and align.drain_rate < 10**7

    before = UNREACHABLE._value.get()
    far = asyncio.create_task(align.wait(0, {"0": 10**9}, time.monotonic() + 60))
    await asyncio.sleep(0)  # one step of the loop: it decided without waiting for anything
    assert far.done() and far.result() is False
    assert UNREACHABLE._value.get() == before + 1

    near = asyncio.create_task(align.wait(0, {"0": 21}, time.monotonic() + 60))
    await asyncio.sleep(0)
    assert not near.done()  # one record at that rate fits in its time: it waits
    h.append_many(0, [(2, None)], progress={0: 21})
    align.notify()
    assert await near

    stale = HistoryAlignment(h, rate_max_age_s=0.0)
    stale.observe_drain(1, 1000.0)  # too old to use at once: the wait is bounded as before
    assert stale.drain_rate is None
    assert not await stale.wait(0, {"0": 1_000_000}, time.monotonic() + 0.02)
    h.close()


async def test_alignment_does_not_wait_for_another_users_burst_fetched_already(tmp_path) -> None:
    """Records fetched and not applied yet: a request whose user has none of them before the
    progress record that covers it is complete at once; the burst's own user, a request that
    needs more than was fetched, and a gap before the fetched records all wait as before."""
    from relaygr.streams.history_alignment import CLEAR_AHEAD

    h = HistoryTable(tmp_path / "h")
    h.append_many(0, [(0, _ev("quiet", 1, 1.0), (0, 0))], progress={0: 1})
    align = HistoryAlignment(h)
    # The heavy user's burst: public offsets 1..100 in two routed records, then their progress.
    align.fetched(0, [(1, b"heavy", None), (2, b"heavy", None), (3, None, {0: 101})])
    before = CLEAR_AHEAD._value.get()
    quiet = asyncio.create_task(align.wait(0, {"0": 101}, time.monotonic() + 60, b"quiet"))
    await asyncio.sleep(0)
    assert quiet.done() and quiet.result() is True
    assert CLEAR_AHEAD._value.get() == before + 1

    waiting = [
        asyncio.create_task(align.wait(0, {"0": 101}, time.monotonic() + 60, b"heavy")),  # its own
        asyncio.create_task(align.wait(0, {"0": 150}, time.monotonic() + 60, b"quiet")),  # beyond
        asyncio.create_task(align.wait(0, {"0": 101}, time.monotonic() + 60)),  # no user: no look
    ]
    await asyncio.sleep(0)
    assert not any(t.done() for t in waiting)
    # Applied: the first two cover what they need; the third's progress comes with the next fetch.
    h.append_many(
        0,
        [(1, _ev("heavy", 2, 2.0), (0, 50)), (2, _ev("heavy", 3, 3.0), (0, 100)), (3, None)],
        progress={0: 101},
    )
    align.notify()
    assert await waiting[0] and await waiting[2]
    align.fetched(0, [(4, b"other", None), (5, None, {0: 150})])
    assert await waiting[1]

    # Fetched after a gap (records 6..9 unknown): nothing can be said about them.
    gap = HistoryAlignment(h)
    gap.fetched(0, [(10, None, {0: 500})])
    assert not await gap.wait(0, {"0": 500}, time.monotonic() + 0.02, b"quiet")
    # Fetched again after a seek: the new records replace the old from their first offset on.
    gap.fetched(0, [(4, b"quiet", None), (5, None, {0: 500})])
    assert not await gap.wait(0, {"0": 500}, time.monotonic() + 0.02, b"quiet")
    assert await gap.wait(0, {"0": 500}, time.monotonic() + 0.02, b"someone")
    h.close()


async def test_alignment_bounds_a_backlog_by_the_rate_its_ingress_advertises(tmp_path) -> None:
    """Not measured yet: the rate the ingress's progress records advertise for a partition bounds
    how soon its backlog can be forwarded; a partition without one is waited for as before."""
    h = HistoryTable(tmp_path / "h")
    align = HistoryAlignment(h)
    align.advertise({0: 5}, 1000.0)
    assert align.eta_s({0: 5}, {0: 2005}) == 2.0
    assert align.eta_s({}, {0: 5, 1: 9}) is None  # partition 1's router has said nothing
    far = asyncio.create_task(align.wait(0, {"0": 1_000_000}, time.monotonic() + 60))
    await asyncio.sleep(0)
    assert far.done() and far.result() is False
    unknown = asyncio.create_task(align.wait(0, {"1": 1_000_000}, time.monotonic() + 60))
    await asyncio.sleep(0)
    assert not unknown.done()
    unknown.cancel()
    with pytest.raises(asyncio.CancelledError):
        await unknown
    h.close()


@pytest.mark.parametrize("raw", [b"0", b"-5", b"nan", b"inf", b"fast", b""])
def test_a_forward_rate_header_must_be_a_finite_positive_number(raw) -> None:
    with pytest.raises(ValueError):
        decode_rate(raw)
    assert decode_rate(b"45000") == 45000.0


async def test_seen_items_are_chunked_and_exact() -> None:
    table: dict = {}
    writes: list[int] = []

    def put(key, value) -> None:
        writes.append(len(value) if isinstance(value, dict) else 0)
        table[key] = dict(value) if isinstance(value, dict) else value

    history = [(i % 3000, float(i)) for i in range(5000)]  # repeats: first seen must win
    for start in range(0, len(history), 700):  # batches, as the stage applies them
        seen_add(table.get, put, "u", history[start : start + 700])
    assert max(writes) <= SEEN_CHUNK  # no write grows with the history
    for ts in (0.0, 1.0, 999.5, 3500.0, 1e9):
        assert await seen_before(table.get, "u", ts) == {str(i) for i, t in history if t < ts}
    assert await seen_before(table.get, "nobody", 1e9) == set()
