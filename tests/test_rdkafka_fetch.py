"""``RdFetchConsumer`` on the real broker: librdkafka fetches, aiokafka's semantics kept (positions,
seeks, pauses, a cancelled fetch, the group's assignments and committed offsets)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import NewTopic

from relaygr.infra.kafka import consumer as new_consumer
from relaygr.infra.kafka import producer as new_producer
from relaygr.infra.kafka import started_admin
from relaygr.infra.rdkafka_fetch import RdFetchConsumer

PER_PARTITION = 30


@pytest.fixture
async def topic(kafka_settings):
    """A topic of 2 partitions, ``PER_PARTITION`` records each (value: b"<partition>:<offset>")."""
    name = f"rdfetch-{uuid.uuid4().hex[:10]}"
    async with started_admin(kafka_settings) as admin:
        await admin.create_topics([NewTopic(name, 2, 1)])
    await produce(kafka_settings, name, range(PER_PARTITION))
    yield name
    async with started_admin(kafka_settings) as admin:
        await admin.delete_topics([name])


async def produce(settings, topic: str, offsets) -> None:
    prod = new_producer(settings)
    await prod.start()
    try:
        for i in offsets:
            for p in (0, 1):
                await prod.send(topic, f"{p}:{i}".encode(), partition=p)
        await prod.flush()
    finally:
        await prod.stop()


def outside(settings) -> RdFetchConsumer:
    return RdFetchConsumer(new_consumer(settings, group_id=None), settings)


async def drain(cons, want: int, *tps, rounds: int = 60) -> dict[TopicPartition, list[int]]:
    """Offsets given per partition until ``want`` records came (or ``rounds`` fetches passed)."""
    got: dict[TopicPartition, list[int]] = {}
    for _ in range(rounds):
        for tp, msgs in (await cons.getmany(*tps, timeout_ms=200)).items():
            got.setdefault(tp, []).extend(m.offset for m in msgs)
        if sum(map(len, got.values())) >= want:
            break
    return got


async def test_positions_seeks_and_pauses_as_aiokafka_gives_them(kafka_settings, topic):
    tp0, tp1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
    cons = outside(kafka_settings)
    await cons.start()
    try:
        cons.assign([tp0, tp1])
        cons.seek(tp0, 5)
        got = await drain(cons, 2 * PER_PARTITION - 5)
        assert got == {tp0: list(range(5, PER_PARTITION)), tp1: list(range(PER_PARTITION))}
        assert await cons.position(tp0) == PER_PARTITION == await cons.position(tp1)
        assert cons.highwater(tp0) == PER_PARTITION
        m = (await cons.getmany(timeout_ms=0)) or None
        assert m is None  # nothing given twice

        cons.seek(tp1, 10)
        cons.pause(tp1)
        await produce(kafka_settings, topic, range(PER_PARTITION, PER_PARTITION + 5))
        got = await drain(cons, 5)
        assert got == {tp0: list(range(PER_PARTITION, PER_PARTITION + 5))}  # tp1 paused
        assert await cons.position(tp1) == 10
        cons.resume(tp1)
        got = await drain(cons, PER_PARTITION + 5 - 10)
        assert got == {tp1: list(range(10, PER_PARTITION + 5))}

        cons.seek(tp0, 2)
        cons.seek(tp1, 3)
        got = await drain(cons, 3, tp1, rounds=10)  # only tp1 asked for
        assert set(got) == {tp1} and got[tp1][0] == 3
        got = await drain(cons, PER_PARTITION + 5 - 2, tp0)
        assert got[tp0] == list(range(2, PER_PARTITION + 5))  # nothing of tp0 lost meanwhile

        await cons.seek_to_beginning(tp0)
        assert await cons.position(tp0) == 0
        await cons.seek_to_end(tp0)
        assert await cons.position(tp0) == PER_PARTITION + 5
    finally:
        await cons.stop()


async def test_a_position_the_log_does_not_hold_is_reset_as_aiokafka_resets_it(kafka_settings, topic):
    """Past the log's end (a topic deleted and created again under the consumer, records past their
    retention): read from the start, as the inner consumer's reset policy says, and ``position``
    says so; nothing of the log skipped."""
    tp0, tp1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
    cons = outside(kafka_settings)
    await cons.start()
    try:
        cons.assign([tp0, tp1])
        cons.seek(tp0, 10 * PER_PARTITION)
        cons.seek(tp1, PER_PARTITION)  # at the end: nothing to reset
        got = await drain(cons, PER_PARTITION)
        assert got == {tp0: list(range(PER_PARTITION))}
        assert await cons.position(tp0) == PER_PARTITION == await cons.position(tp1)
    finally:
        await cons.stop()


async def test_a_cancelled_fetch_loses_and_repeats_nothing(kafka_settings, topic):
    tps = [TopicPartition(topic, 0), TopicPartition(topic, 1)]
    cons = outside(kafka_settings)
    await cons.start()
    try:
        cons.assign(tps)
        seen: list[tuple[int, int]] = []
        # Cancelled at every stage of a fetch: before its poll, during it, after it, and while the
        # next one waits for a cancelled poll to end.
        for i in range(60):
            fetch = asyncio.ensure_future(cons.getmany(timeout_ms=50, max_records=7))
            await asyncio.sleep((0, 0.0005, 0.002, 0.01, 0.03)[i % 5])
            fetch.cancel()
            try:
                batch = await fetch
            except asyncio.CancelledError:
                continue
            seen += [(tp.partition, m.offset) for tp, msgs in batch.items() for m in msgs]
        rest = await drain(cons, 2 * PER_PARTITION - len(seen))
        seen += [(tp.partition, o) for tp, offs in rest.items() for o in offs]
        assert sorted(seen) == [(p, o) for p in (0, 1) for o in range(PER_PARTITION)]
    finally:
        await cons.stop()


async def test_the_group_assigns_from_committed_offsets_and_the_listener_seeks(kafka_settings, topic):
    group = f"g-{uuid.uuid4().hex[:8]}"
    tp0, tp1 = TopicPartition(topic, 0), TopicPartition(topic, 1)

    class SeekOnAssign(ConsumerRebalanceListener):
        def __init__(self) -> None:
            self.cons: RdFetchConsumer | None = None
            self.assigned: list[set] = []

        async def on_partitions_revoked(self, revoked) -> None:
            pass

        async def on_partitions_assigned(self, assigned) -> None:
            self.assigned.append(set(assigned))
            if tp1 in assigned:
                self.cons.seek(tp1, 20)

    first = RdFetchConsumer(new_consumer(kafka_settings, group_id=group), kafka_settings)
    first.subscribe([topic])
    await first.start()
    try:
        got = await drain(first, 2 * PER_PARTITION)
        assert {tp: len(offs) for tp, offs in got.items()} == {tp0: PER_PARTITION, tp1: PER_PARTITION}
        await first.commit({tp0: 12, tp1: 7})
    finally:
        await first.stop()

    listener = SeekOnAssign()
    second = RdFetchConsumer(new_consumer(kafka_settings, group_id=group), kafka_settings)
    listener.cons = second
    second.subscribe([topic], listener=listener)
    await second.start()
    try:
        got = await drain(second, PER_PARTITION - 12 + PER_PARTITION - 20)
        assert listener.assigned == [{tp0, tp1}]
        assert got == {tp0: list(range(12, PER_PARTITION)), tp1: list(range(20, PER_PARTITION))}
        assert second.inner.paused() == {tp0, tp1}  # aiokafka itself fetched nothing
    finally:
        await second.stop()


# ---------------------------------------------------------------------- the poll thread's wait


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        return self.t


class _Rd:
    """librdkafka's consumer as ``_poll`` sees it: each ``poll(timeout)`` waits on ``clock`` (a
    little less than asked, as a timed wait may wake early) and returns a record once it is due;
    ``on_poll`` runs after each call (the loop cancelling meanwhile)."""

    def __init__(self, clock: _Clock, record_at: float | None = None, early_s: float = 0.0, on_poll=None):
        self.clock, self.record_at, self.early_s, self.on_poll = clock, record_at, early_s, on_poll
        self.waits: list[float] = []

    def poll(self, timeout: float):
        self.waits.append(timeout)
        if self.record_at is not None and self.clock.t + timeout >= self.record_at:
            self.clock.t = max(self.clock.t, self.record_at)
            return "first"
        self.clock.t += max(0.0, timeout - self.early_s)
        if self.on_poll is not None:
            self.on_poll(len(self.waits))
        return None

    def consume(self, n: int, timeout: float) -> list:
        return ["ready"]


@pytest.fixture
def poller(monkeypatch: pytest.MonkeyPatch):
    """An ``RdFetchConsumer`` reduced to what its poll thread's ``_poll`` reads, on a fake clock."""
    from relaygr.infra import rdkafka_fetch

    clock = _Clock()
    monkeypatch.setattr(rdkafka_fetch, "time", clock)

    def make(**kw) -> RdFetchConsumer:
        cons = object.__new__(RdFetchConsumer)
        cons._rd, cons._called_off = _Rd(clock, **kw), False
        return cons

    return make


def test_a_long_wait_is_slices_within_librdkafka_that_end_at_the_timeout(poller) -> None:
    from relaygr.infra.rdkafka_fetch import POLL_SLICE_S

    cons = poller()
    assert cons._poll(500, 0.25) == []
    assert cons._rd.waits == pytest.approx([POLL_SLICE_S] * round(0.25 / POLL_SLICE_S))
    assert cons._poll(500, 0.0) == [] and cons._rd.waits[-1] == 0.0  # one look, no wait


def test_a_wait_whose_caller_was_cancelled_ends_after_the_slice_under_way(poller) -> None:
    cons = poller(on_poll=lambda calls: setattr(cons, "_called_off", True))
    assert cons._poll(500, 5.0) == [] and len(cons._rd.waits) == 1


def test_the_first_record_ends_the_wait_with_what_is_ready_after_it(poller) -> None:
    cons = poller(record_at=0.12)
    assert cons._poll(500, 0.25) == ["first", "ready"]
    assert cons._poll(1, 0.25) == ["first"]


def test_a_wait_that_wakes_early_never_spins_on_zero_waits(poller) -> None:
    """librdkafka counts whole milliseconds: a remainder under one would be a wait of zero, asked
    again and again until the deadline (the idle behaviours router's CPU doubled)."""
    cons = poller(early_s=0.0004)
    assert cons._poll(500, 0.05) == []
    assert all(w >= 0.001 for w in cons._rd.waits) and len(cons._rd.waits) <= 2
