"""What a ranking worker holds per partition, in one place: which partitions it serves, which it
holds unfetched, the requests it keeps unranked (a standby's), the offsets of the signals and
requests in flight, the behaviours being applied, and whether each history is caught up.

The rebalance listener and the hand-over (``streams.ranking.hand_over.HandOver``) change this state
only through these methods; the Kafka shell (``streams.ranking.ranking_worker``) reads it to pause,
resume and take what it fetched.

Primitives: ``Partitions(reg, history, alignment, applier, lineage)``:
- serving: ``serve(tps)``, ``release(tps)`` (its offsets, behaviour slices, alignment and catch-up
  forgotten), ``assigned``, ``served(topic)``;
- holding: ``hold(tps)``, ``unhold(topic)``, ``holds(tp)``; keeping a standby's requests:
  ``keep_from_now(tps)``, ``keep(tp, records)``, ``kept_from(tp, offset)``, ``drop_kept()``;
- the loop's flow: ``flow(assignment, room)`` (what to pause and resume);
- offsets (``streams.ranking.offset_tracker.OffsetTracker``): ``start``, ``done``, ``pending``,
  ``settle(tps, timeout_s)``, ``committable(tps)``, ``commit_offsets()``;
- behaviours: ``apply(tp, records)``, ``reap()``, ``finish_applying(tps)``,
  ``resume_behaviours(consumer, tps)`` (lineage checked, read from the history table's offset, the
  catch-up timed), ``ready(partitions)`` (caught up), ``watch(consumer)`` / ``close()`` (the
  lineage's periodic check; ``stop_watching()``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Iterable

from aiokafka import AIOKafkaConsumer, TopicPartition

from relaygr.schemas import TopicRegistry
from relaygr.streams.history import HistoryTable
from relaygr.streams.history_alignment import HistoryAlignment
from relaygr.streams.ranking.history_applier import BehaviourApplier, ahead_record
from relaygr.streams.ranking.offset_tracker import OffsetTracker
from relaygr.streams.state_lineage import HistoryLineage

PREFETCH_MAX = 10_000  # requests kept per partition while standing by (older ones fetched again)


class Partitions:
    """The per-partition state of one ranking worker (see the module docstring)."""

    def __init__(
        self,
        reg: TopicRegistry,
        history: HistoryTable,
        alignment: HistoryAlignment,
        applier: BehaviourApplier,
        lineage: HistoryLineage,
    ) -> None:
        self.beh, self.sig, self.rank = reg.name("routed_behaviors"), reg.name("prefill"), reg.name("rank")
        self.history, self.alignment, self.applier, self.lineage = history, alignment, applier, lineage
        self.offsets = OffsetTracker()
        self._assigned: set[TopicPartition] = set()
        self._held: set[TopicPartition] = set()
        self._kept: dict[TopicPartition, deque] = {}
        # One task per behaviours partition applying its last fetched batch; the partition is
        # paused meanwhile, and the loop goes on fetching requests and signals.
        self._applying: dict[TopicPartition, asyncio.Task] = {}
        self._watch: asyncio.Task | None = None

    # ------------------------------------------------------------------ serving

    @property
    def assigned(self) -> frozenset[TopicPartition]:
        return frozenset(self._assigned)

    def served(self, topic: str) -> set[TopicPartition]:
        """The assigned partitions of ``topic``."""
        return {tp for tp in self._assigned if tp.topic == topic}

    def serve(self, tps: Iterable[TopicPartition]) -> None:
        self._assigned |= set(tps)

    def release(self, tps: Iterable[TopicPartition]) -> None:
        """No longer this worker's: forget their offsets, kept requests, behaviour slices fetched
        ahead and catch-up (they stay held if they were)."""
        tps = set(tps)
        self._assigned -= tps
        self.offsets.forget(tps)
        for tp in tps:
            self._kept.pop(tp, None)
            if tp.topic == self.beh:
                self.applier.forget(tp.partition)
                self.alignment.forget(tp.partition)

    # ------------------------------------------------------------------ holding and keeping

    def hold(self, tps: Iterable[TopicPartition]) -> None:
        """Fetch none of ``tps`` (paused); a record of one fetched meanwhile is fetched again."""
        self._held |= set(tps)

    def unhold(self, topic: str | None = None) -> None:
        """Fetch the held partitions of ``topic`` (None: all) again."""
        self._held = {tp for tp in self._held if topic is not None and tp.topic != topic}

    def holds(self, tp: TopicPartition) -> bool:
        return tp in self._held

    def keep_from_now(self, tps: Iterable[TopicPartition]) -> None:
        """Keep the requests fetched of ``tps`` from now on, unranked (a standby's, for its
        hand-over); they are fetched, not held."""
        for tp in tps:
            self._kept[tp] = deque(maxlen=PREFETCH_MAX)
            self._held.discard(tp)

    def keep(self, tp: TopicPartition, records: list) -> bool:
        """Keep ``records`` if ``tp`` is kept; whether it was."""
        kept = self._kept.get(tp)
        if kept is None:
            return False
        kept.extend(records)
        return True

    def kept_from(self, tp: TopicPartition, offset: int) -> list | None:
        """The kept records of ``tp`` from ``offset`` on (no longer kept), or None where the kept
        ones do not reach back to it (then they are to be fetched again from there)."""
        kept = self._kept.pop(tp, deque())
        if kept and kept[0].offset <= offset <= kept[-1].offset + 1:
            return [m for m in kept if m.offset >= offset]
        return None

    def drop_kept(self) -> None:
        self._kept = {}

    # ------------------------------------------------------------------ the loop's flow

    def flow(self, assignment: set[TopicPartition], room: bool) -> tuple[set, set]:
        """(pause, resume) for the loop's next fetch: signals and requests only while there is
        ``room`` (the bounded queue: past it they wait in Kafka, behaviours keep flowing); held
        partitions never; a behaviours partition not while its last batch is being applied."""
        work = {tp for tp in assignment if tp.topic != self.beh and tp not in self._held}
        applying = {tp for tp in self._applying if tp in assignment}
        behaviours = {tp for tp in assignment if tp.topic == self.beh} - applying - self._held
        pause = (set() if room else work) | (self._held & assignment) | applying
        return pause, (work if room else set()) | behaviours

    # ------------------------------------------------------------------ offsets

    def start(self, tp: TopicPartition, offset: int) -> None:
        self.offsets.start(tp, offset)

    def done(self, tp: TopicPartition, offset: int) -> None:
        self.offsets.done(tp, offset)

    def pending(self, tps: set[TopicPartition] | None = None) -> int:
        return self.offsets.pending(tps)

    async def settle(self, tps: set[TopicPartition], timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the signals and requests of ``tps`` are finished."""
        deadline = time.monotonic() + timeout_s
        while self.offsets.pending(tps) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def committable(self, tps: set[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """Per signal or request partition of ``tps`` (None: all tracked), the first offset not
        finished."""
        return self.offsets.committable(tps)

    def commit_offsets(self) -> dict[TopicPartition, int]:
        """What to commit for the assigned partitions: the signals' and requests' finished offsets
        and, for behaviours, the history table's own (resumed from there anyway; committed so that
        operators read the ingestion lag with the usual consumer-group tools)."""
        offsets = self.offsets.committable(self._assigned)
        for tp in self.served(self.beh):
            offsets[tp] = self.history.next_offset(tp.partition)
        return offsets

    # ------------------------------------------------------------------ behaviours

    def apply(self, tp: TopicPartition, records: list) -> None:
        """A fetched batch of a behaviours partition: known to the alignment at once (a request
        need not wait for other users' records), applied by a task of its own after the batch
        before it, in slices with the loop free in between."""
        self.alignment.fetched(tp.partition, [ahead_record(m) for m in records])
        self._applying[tp] = asyncio.create_task(self._apply_after(self._applying.get(tp), tp, records))

    async def _apply_after(self, before: asyncio.Task | None, tp: TopicPartition, records: list) -> None:
        if before is not None:  # a batch fetched before the pause took effect: keep the order
            await before
        await self.applier.apply(tp.partition, records)

    def reap(self) -> None:
        """Forget finished appliers; one that failed raises here, stopping the worker as the
        loop's own error would (the history table is left where its last applied slice ended)."""
        for tp, task in list(self._applying.items()):
            if task.done():
                del self._applying[tp]
                task.result()

    async def finish_applying(self, tps: set[TopicPartition] | None = None) -> None:
        """Wait until the behaviours fetched for ``tps`` (None: all) are applied."""
        pending = [t for tp, t in self._applying.items() if tps is None or tp in tps]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    async def resume_behaviours(
        self, consumer: AIOKafkaConsumer, tps: list[TopicPartition], *, strict: bool = False
    ) -> None:
        """Behaviours partitions newly read by ``consumer``: histories of another cluster or topic
        incarnation dropped (the lineage), each read from the history table's own offset (not a
        group offset), and its rebuild timed up to the partition's end now. ``strict``: the ends
        must be known (a standby is ready once its histories reach them), else only measured."""
        await self.lineage.verify(self.beh, [tp.partition for tp in tps])
        for tp in tps:
            start = self.history.next_offset(tp.partition)
            consumer.seek(tp, start)
            self.alignment.forget(tp.partition)
            # Timed from here: the loop may apply fetched behaviours while the caller awaits.
            self.applier.catch_up(tp.partition, start)
        fresh = [tp for tp in tps if self.applier.needs_end(tp.partition)]
        if not fresh:
            return
        if strict:
            ends = await consumer.end_offsets(fresh)
        else:
            try:
                ends = await asyncio.wait_for(consumer.end_offsets(fresh), 5)
            except Exception:  # only a measurement: never hold up the assignment for it
                ends = {}
        for tp in fresh:
            self.applier.catch_up_to(tp.partition, ends.get(tp))

    def ready(self, partitions: Iterable[int]) -> bool:
        """Whether the histories of ``partitions`` have caught up with their logs' ends."""
        return not any(p in self.applier.catching_up for p in partitions)

    def watch(self, consumer: AIOKafkaConsumer) -> None:
        """Check the histories ``consumer`` reads against the cluster every few seconds."""
        if self._watch is not None:
            self._watch.cancel()
        self._watch = asyncio.create_task(self.lineage.watch(consumer, self.beh))

    def stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.cancel()

    async def close(self) -> None:
        self.stop_watching()
        with contextlib.suppress(Exception):
            await self.lineage.close()
