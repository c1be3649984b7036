"""An aiokafka consumer whose records librdkafka fetches: group membership, rebalances, commits and
offset look-ups stay aiokafka's; the fetches, their socket I/O and record parsing run on
librdkafka's C threads.

Why: aiokafka fetches in Python on the event loop, one fetch request and response parse per round
trip, and an idle consumer still sends one every ``fetch_max_wait_ms``. ``relaygr bench
kafka-clients`` measured librdkafka's consumer at a third to a fifth of aiokafka's CPU per record
(``docs/host-path.md``). Moving the whole consumer to librdkafka would move the group protocol
too: its rebalance callbacks run inside its blocking poll, and its ``pause`` drops prefetched
records. Here the aiokafka consumer keeps the membership (static id, assignor, rebalance listener,
commits with its generation) with every partition paused, so it never fetches, and a librdkafka
consumer outside any group (manual assignment, no commits) fetches the partitions aiokafka assigns
from the positions aiokafka gives.

Primitives: ``fetching(inner, settings, ...)``: ``inner`` itself, or wrapped as below, as
``RELAYGR_FETCH_CLIENT`` says. ``RdFetchConsumer(inner, settings, fetch_max_wait_ms=..., max_records=...,
max_partition_fetch_bytes=...)``, used where
an ``AIOKafkaConsumer`` is: ``getmany(*tps, timeout_ms, max_records)``, ``pause``, ``resume``,
``paused``, ``seek``, ``seek_to_beginning``, ``seek_to_end``, ``position``, ``highwater``, ``assign``, ``subscribe``
(its listener's assignments are seen first), ``start``, ``stop``; everything else (``assignment``,
``commit``, ``committed``, ``end_offsets``, ...) is the inner consumer's. ``Record``.

Semantics kept from aiokafka's: ``position`` is the offset of the next record ``getmany`` gives
(never a record fetched and not given); a seek or an assignment discards what was fetched before
it; a paused partition gives nothing until resumed, from its position; after the group assigns
(or ``assign``), every partition starts where the inner consumer's position says (its committed
offset, its reset policy, or a seek made since). All state changes reach librdkafka on the event
loop between two polls, never while one runs.

A long wait costs nothing while idle: the poll thread waits in slices of ``POLL_SLICE_S`` inside
librdkafka (no turn of the event loop between them) and returns at the first record, at the
timeout, or within a slice of a cancelled ``getmany``, so a caller may wait long when it has
nothing else to do and still hand over at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from confluent_kafka import Consumer, KafkaError, KafkaException
from confluent_kafka import TopicPartition as RdPartition

from relaygr.infra.rdkafka_producer import rdkafka_config
from relaygr.infra.settings import Settings

log = logging.getLogger(__name__)

TOUCH_S = (
    5.0  # how often the inner consumer is polled (aiokafka leaves the group after max_poll_interval_ms idle)
)
OUT_OF_RANGE = "_AUTO_OFFSET_RESET"  # librdkafka's error for a fetch position the log does not hold
WARN_EVERY_S = 10.0  # the same fetch error is logged at most this often
# The poll thread waits this long at a time inside librdkafka: how soon a cancelled ``getmany``'s poll
# ends (it holds the next one). Each slice is a C call on the poll thread, no turn of the event loop.
POLL_SLICE_S = 0.05
POSITION_S = 5.0  # the most one assignment waits for a partition's position (the rest go on meanwhile)


class Record:
    """A fetched record, with the attributes the stages read of aiokafka's ``ConsumerRecord``."""

    __slots__ = ("headers", "key", "offset", "partition", "timestamp", "topic", "value")

    def __init__(self, m: Any) -> None:
        self.topic: str = m.topic()
        self.partition: int = m.partition()
        self.offset: int = m.offset()
        self.timestamp: int = m.timestamp()[1]
        self.key: bytes | None = m.key()
        self.value: bytes | None = m.value()
        self.headers: tuple = tuple(m.headers() or ())

    def __repr__(self) -> str:
        return f"Record({self.topic}[{self.partition}]@{self.offset})"


class _SeenFirst(ConsumerRebalanceListener):
    """The user's listener, with each assignment told to the fetcher before it."""

    def __init__(self, fetch: RdFetchConsumer, listener: ConsumerRebalanceListener | None) -> None:
        self.fetch, self.listener = fetch, listener

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        if self.listener is not None:
            await self.listener.on_partitions_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.fetch._inner_assigned(assigned)
        if self.listener is not None:
            await self.listener.on_partitions_assigned(assigned)


def fetching(inner: AIOKafkaConsumer, settings: Settings, **kw: Any) -> AIOKafkaConsumer | RdFetchConsumer:
    """``inner`` (not started), its records fetched by the client ``settings.fetch_client`` names
    (``kw``: ``RdFetchConsumer``'s)."""
    if settings.fetch_client == "aiokafka":
        return inner
    return RdFetchConsumer(inner, settings, **kw)


class _PollThread:
    """One thread that runs what it is asked to, one call at a time, in order, and settles each
    call's future on the asking loop (cheaper per call than an executor: one queue put, one wake-up
    of the loop)."""

    def __init__(self) -> None:
        self._asks: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled: dict[asyncio.Future, Any] = {}  # future -> who hears how its call ended
        self._orphans: dict[asyncio.Future, Any] = {}  # future -> its call's result, nobody told yet
        self._thread = threading.Thread(target=self._serve, name="rdkafka-fetch", daemon=True)
        self._thread.start()

    def run(self, fn: Any, *args: Any) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._asks.put((loop, fut, fn, args))
        return fut

    def on_cancelled(self, fut: asyncio.Future, ended: Any) -> None:
        """``fut`` was cancelled: ``ended(result or None)`` once its call returns (now, if it has)."""
        if fut in self._orphans:
            ended(self._orphans.pop(fut))
        else:
            self._cancelled[fut] = ended

    def close(self) -> None:
        self._asks.put(None)

    def _serve(self) -> None:
        while (ask := self._asks.get()) is not None:
            loop, fut, fn, args = ask
            try:
                result, error = fn(*args), None
            except BaseException as e:
                result, error = None, e
            with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile)
                loop.call_soon_threadsafe(self._settle, fut, result, error)

    def _settle(self, fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
        if fut.cancelled():
            ended = self._cancelled.pop(fut, None)
            if ended is None:
                self._orphans[fut] = result if error is None else None
            else:
                ended(result if error is None else None)
        elif error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)


class RdFetchConsumer:
    """``inner`` (not started) with its records fetched by librdkafka (see the module docstring)."""

    def __init__(
        self,
        inner: AIOKafkaConsumer,
        settings: Settings,
        *,
        fetch_max_wait_ms: int = 20,
        max_records: int = 500,
        max_partition_fetch_bytes: int = 1 << 20,
        auto_offset_reset: str = "earliest",
    ) -> None:
        self._inner, self._settings = inner, settings
        self._conf = {
            # librdkafka wants a group id even for manual assignment; it never joins or commits.
            "group.id": f"{settings.topic_prefix}relaygr-fetch",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            # An offset out of range is told, not reset behind the positions' back: reset here
            # (``_reset``), as the inner consumer's ``auto_offset_reset`` says.
            "auto.offset.reset": "error",
            "isolation.level": "read_uncommitted",  # aiokafka's default: the cascade writes no transactions
            # A partition resumed waits for the fetch in flight to its broker: a short wait bounds that.
            "fetch.wait.max.ms": fetch_max_wait_ms,
            "max.partition.fetch.bytes": max_partition_fetch_bytes,
            "queued.max.messages.kbytes": 16384,  # prefetched
            "receive.message.max.bytes": max(settings.max_message_bytes * 2, 100_000_000),
            "fetch.max.bytes": max(settings.max_message_bytes, 52_428_800),
            "client.id": "relaygr-fetch",
        }
        self._max_records = max_records
        self._rd: Consumer | None = None
        self._thread = _PollThread()
        self._unfinished: asyncio.Future | None = None  # a poll whose caller was cancelled: done when it ends
        self._called_off = False  # the caller of the poll under way was cancelled (read by the poll thread)
        self._next: dict[TopicPartition, int] = {}  # librdkafka's partitions: the next offset to give
        self._seeks: dict[TopicPartition, int] = {}  # asked, not yet told to librdkafka
        self._moved: dict[TopicPartition, int] = {}  # seeks per partition (stale fetches are dropped)
        self._stray: set[TopicPartition] = set()  # fetched past their position and not given
        self._out_of_range: set[TopicPartition] = set()  # positions the log no longer (or not yet) holds
        if auto_offset_reset not in ("earliest", "latest"):
            raise ValueError(f"auto_offset_reset: {auto_offset_reset!r} (earliest or latest)")
        self._auto_offset_reset = auto_offset_reset
        self._paused: set[TopicPartition] = set()  # asked
        self._rd_paused: set[TopicPartition] = set()  # told to librdkafka
        self._reassign = True  # the inner consumer assigned anew: positions from it
        self._touched = 0.0
        self._warned: dict[int, float] = {}  # fetch error code -> when last logged
        self._subscribed = False  # a group member (``subscribe``)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def inner(self) -> AIOKafkaConsumer:
        return self._inner

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._rd = Consumer({**rdkafka_config(self._settings), **self._conf}, logger=log)
        await self._inner.start()
        self._inner_assigned(self._inner.assignment())

    async def stop(self) -> None:
        if self._unfinished is not None:
            await asyncio.shield(self._unfinished)
        if self._rd is not None:
            with contextlib.suppress(Exception):
                await self._thread.run(self._rd.close)  # after any poll: one at a time there
            self._rd = None
        self._thread.close()
        await self._inner.stop()

    def subscribe(
        self, topics: Iterable[str], listener: ConsumerRebalanceListener | None = None, **kw: Any
    ) -> None:
        self._inner.subscribe(topics, listener=_SeenFirst(self, listener), **kw)
        self._subscribed = True

    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        self._inner.assign(list(partitions))
        self._inner_assigned(self._inner.assignment())

    def _inner_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        """A new assignment (all positions aiokafka's again): the inner consumer must fetch none."""
        assigned = set(assigned)
        if assigned:
            self._inner.pause(*assigned)
        self._reassign = True
        self._seeks.clear()
        for tp in self._next:
            self._moved[tp] = self._moved.get(tp, 0) + 1

    # ------------------------------------------------------------------ positions

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._inner.seek(tp, offset)  # raises as aiokafka does for a partition not assigned
        self._seeks[tp] = offset
        self._moved[tp] = self._moved.get(tp, 0) + 1

    async def seek_to_beginning(self, *tps: TopicPartition) -> None:
        starts = await self._inner.beginning_offsets(list(tps))
        for tp in tps:
            self.seek(tp, starts[tp])

    async def seek_to_end(self, *tps: TopicPartition) -> None:
        ends = await self._inner.end_offsets(list(tps))
        for tp in tps:
            self.seek(tp, ends[tp])

    async def position(self, tp: TopicPartition) -> int:
        if tp in self._seeks:
            return self._seeks[tp]
        if not self._reassign and tp in self._next:
            return self._next[tp]
        return await self._inner.position(tp)

    def highwater(self, tp: TopicPartition) -> int | None:
        if self._rd is None or tp not in self._next:
            return None
        try:
            _, high = self._rd.get_watermark_offsets(RdPartition(tp.topic, tp.partition), cached=True)
        except KafkaException:
            return None
        return high if high >= 0 else None

    # ------------------------------------------------------------------ flow

    def pause(self, *tps: TopicPartition) -> None:
        self._paused.update(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self._paused.difference_update(tps)

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    async def getmany(
        self, *partitions: TopicPartition, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[TopicPartition, list[Record]]:
        """What was fetched since the last call (of ``partitions`` only, when given), waiting up to
        ``timeout_ms`` for a first record."""
        if self._rd is None:
            raise RuntimeError("the consumer is not started")
        if self._unfinished is not None:  # its records not given: known once it ends
            await asyncio.shield(self._unfinished)  # (a cancelled wait must not cancel it)
        await self._touch()
        await self._sync()
        only = set(partitions)
        self._apply_pauses(only)
        moved = dict(self._moved)
        self._called_off = False
        polling = self._thread.run(self._poll, max_records or self._max_records, timeout_ms / 1000)
        try:
            msgs = await polling
        except asyncio.CancelledError:
            self._called_off = True  # the poll ends within a slice, not at its timeout
            if polling.done() and not polling.cancelled():  # it ended, its records not given
                self._not_given(polling.result())
            else:  # it ends later (``_PollThread`` tells ``_ended``)
                self._unfinished = asyncio.get_running_loop().create_future()
                self._thread.on_cancelled(polling, self._ended)
            raise
        return self._give(msgs, moved, only)

    def _poll(self, n: int, timeout_s: float) -> list:
        """On the poll thread: the first record within ``timeout_s``, and whatever is ready after
        it; nothing once the caller has gone (``_called_off``), within a slice."""
        assert self._rd is not None
        deadline = time.monotonic() + timeout_s
        first = self._rd.poll(min(POLL_SLICE_S, timeout_s))
        while first is None:
            left = deadline - time.monotonic()
            # (librdkafka counts whole milliseconds: a shorter wait would be a spin of zero-waits)
            if self._called_off or left < 0.001:
                return []
            first = self._rd.poll(min(POLL_SLICE_S, left))
        return [first, *self._rd.consume(n - 1, 0)] if n > 1 else [first]

    def _ended(self, msgs: list | None) -> None:
        """A poll whose caller was cancelled has ended (``msgs``: None, it failed)."""
        if msgs:
            self._not_given(msgs)
        if self._unfinished is not None:
            self._unfinished.set_result(None)
            self._unfinished = None

    def _not_given(self, msgs: list) -> None:
        """Records polled and not given: librdkafka is past them, the positions are not."""
        for m in msgs:
            if m.error() is None:
                self._stray.add(TopicPartition(m.topic(), m.partition()))

    def _give(
        self, msgs: list, moved: dict[TopicPartition, int], only: set[TopicPartition]
    ) -> dict[TopicPartition, list[Record]]:
        out: dict[TopicPartition, list[Record]] = {}
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.name() == OUT_OF_RANGE and m.topic() is not None:
                    self._out_of_range.add(TopicPartition(m.topic(), m.partition()))
                else:
                    self._warn(m, err)
                continue
            tp = TopicPartition(m.topic(), m.partition())
            at = self._next.get(tp)
            if at is None or self._reassign or self._moved.get(tp, 0) != moved.get(tp, 0):
                continue  # fetched before a seek or an assignment: its position is set anew
            if tp in self._paused or (only and tp not in only):
                self._stray.add(tp)  # paused meanwhile: from its position once resumed
                continue
            offset = m.offset()
            if offset < at:
                continue
            out.setdefault(tp, []).append(Record(m))
            self._next[tp] = offset + 1
        return out

    def _warn(self, m: Any, err: KafkaError) -> None:
        """A fetch error (librdkafka retries by itself): logged once per ``WARN_EVERY_S`` per kind."""
        now = time.monotonic()
        if now - self._warned.get(err.code(), -WARN_EVERY_S) >= WARN_EVERY_S:
            self._warned[err.code()] = now
            log.warning("fetching %s[%s]: %s", m.topic(), m.partition(), err)

    async def _touch(self) -> None:
        """Poll the inner consumer now and then: aiokafka counts a member that does not as gone."""
        now = time.monotonic()
        if self._subscribed and now - self._touched > TOUCH_S:
            self._touched = now
            await self._inner.getmany(timeout_ms=0)  # every partition paused there: nothing

    async def _sync(self) -> None:
        """Tell librdkafka the assignment, positions and seeks asked since the last poll."""
        assert self._rd is not None
        while True:
            assigned = self._inner.assignment()
            if self._reassign:  # every position aiokafka's again
                self._reassign = False
                kept: dict[TopicPartition, int] = {}
                if assigned:
                    self._inner.pause(*assigned)
            else:  # positions librdkafka is at kept; new partitions' asked of aiokafka
                kept = {tp: at for tp, at in self._next.items() if tp in assigned}
                if len(kept) == len(assigned) == len(self._next):
                    break
            moved = dict(self._moved)
            starts = await self._positions(assigned - set(kept))
            if self._reassign:
                continue  # assigned again meanwhile
            for tp in starts:
                if self._moved.get(tp, 0) != moved.get(tp, 0) and tp in self._seeks:
                    starts[tp] = self._seeks[tp]  # a seek made while its position was looked up
            starts = {**kept, **starts}
            starts.update((tp, at) for tp, at in self._seeks.items() if tp in starts)
            self._rd.assign([RdPartition(tp.topic, tp.partition, at) for tp, at in starts.items()])
            self._next = starts
            self._seeks.clear()
            self._stray.clear()
            self._rd_paused = set()
            break  # (positions not known yet are looked up again on the next poll)
        for tp, at in self._seeks.items():
            if tp in self._next:
                self._seek(tp, at)
        self._seeks.clear()
        for tp in self._stray:
            if tp in self._next:
                self._seek(tp, self._next[tp])
        self._stray.clear()
        if self._out_of_range:
            await self._reset()

    async def _reset(self) -> None:
        """Partitions whose position the log does not hold (a topic deleted and created again,
        records past their retention): to its start or end, as aiokafka's reset policy does."""
        tps, self._out_of_range = [tp for tp in self._out_of_range if tp in self._next], set()
        moved = dict(self._moved)
        try:
            ask = (
                self._inner.beginning_offsets
                if self._auto_offset_reset == "earliest"
                else self._inner.end_offsets
            )
            to = await ask(tps)
        except Exception as e:  # tried again on the next poll
            log.warning("resetting the positions of %s: %s", tps, e)
            self._out_of_range.update(tps)
            return
        for tp in tps:
            if tp in self._next and tp in to and self._moved.get(tp, 0) == moved.get(tp, 0):
                log.info(
                    "%s: position %d out of range: reset to %d (%s)",
                    tp,
                    self._next[tp],
                    to[tp],
                    self._auto_offset_reset,
                )
                self._inner.seek(tp, to[tp])
                self._moved[tp] = self._moved.get(tp, 0) + 1
                self._seek(tp, to[tp])

    async def _positions(self, tps: set[TopicPartition]) -> dict[TopicPartition, int]:
        async def one(tp: TopicPartition) -> tuple[TopicPartition, int | None]:
            try:
                return tp, await asyncio.wait_for(self._inner.position(tp), POSITION_S)
            except Exception as e:  # unassigned meanwhile, or no leader yet: the next poll tries again
                log.debug("no position for %s yet: %s", tp, e)
                return tp, None

        got = await asyncio.gather(*(one(tp) for tp in tps))
        return {tp: at for tp, at in got if at is not None}

    def _seek(self, tp: TopicPartition, offset: int) -> None:
        assert self._rd is not None
        try:
            self._rd.seek(RdPartition(tp.topic, tp.partition, offset))
        except KafkaException as e:  # (not fetching it yet) assigned again from there
            log.debug("seek %s to %d: %s; assigning again", tp, offset, e)
            self._next[tp] = offset
            self._rd.assign([RdPartition(t.topic, t.partition, at) for t, at in self._next.items()])
            self._rd_paused = set()
            return
        self._next[tp] = offset

    def _apply_pauses(self, only: set[TopicPartition]) -> None:
        assert self._rd is not None
        want = {tp for tp in self._next if tp in self._paused or (only and tp not in only)}
        if pause := want - self._rd_paused:
            self._rd.pause([RdPartition(tp.topic, tp.partition) for tp in pause])
        if resume := self._rd_paused - want:
            self._rd.resume([RdPartition(tp.topic, tp.partition) for tp in resume])
        self._rd_paused = want
