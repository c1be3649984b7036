"""The hand-over state machine of a ranking worker: the one owner of where this process stands in a
rolling restart (make before break, under one static member id), and of what a rebalance means
there.

States (``State``). The active side: ``serving`` (a member of the ranking group) → ``handing_over``
(told to hand over, SIGUSR1: its positions in ``handover.json``, finishing what it holds) →
``answered`` (every request before the positions has its result and is committed; the process
exits). The standby side: ``warming`` (outside the group: histories rebuilt, prefixes adopted and
pre-inferred, requests kept unranked) → ``ready`` → ``serving_outside`` (ranks from the hand-over's
offsets, still outside the group, which it joins meanwhile) → ``joined`` (reads with the group's
consumer: a member, as ``serving``, and hands over the same way).

Transitions (event: what causes it; the faults marked):

| event | from | to | what happens |
|---|---|---|---|
| ``warm()`` | warming | warming | old ``handover.json`` and ``spilled.json`` cleared; ``standby.json``: warming |
| ``stand_by(partitions)`` | warming | warming | read outside the group: behaviours from the history table's offsets; signals held; requests kept from now |
| ``warmed()`` | warming | warming | signals fetched (histories caught up) |
| ``ready(seconds)`` | warming | ready | ``standby.json``: ready |
| ``take_over(offsets, pid)`` | ready | serving_outside | kept requests from the offsets ranked at once (fetched again where they do not reach back); partitions the group moved meanwhile read and caught up first |
| ``take_over({}, None)``: the old process exited without handing over (fault) | ready | serving_outside | nothing ranked outside; the group's committed offsets say where to go on |
| ``joined(group)`` | serving_outside | serving_outside | the switch is tried between two fetches |
| ``between_fetches()``: the old process answered | serving_outside | joined | the group's consumer goes on where the manual one got to; state promoted |
| ``between_fetches()``: the old process exited before answering (fault) | serving_outside | joined | the requests after its last commit ranked again first (``unanswered``) |
| ``ask()`` (SIGUSR1) | serving, joined | handing_over | the loop stops (a fetch still waiting is cut short) |
| ``hand_over()`` | handing_over | answered | positions written, pre-inferences dropped, requests drained, commit, ``handover.json`` answered |
| ``hand_over()``: its requests not finished in time (fault) | handing_over | handing_over | exits without saying answered: the successor ranks them again |
| ``ask()`` | warming, ready, serving_outside | same | the process stops: outside the group it commits and hands over nothing |
| ``revoked(tps)`` | serving, joined | same | drained, committed, forgotten |
| ``assigned(tps)`` | serving, joined | same | lineage checked, old-topic offsets rewound, behaviours from the history table, catch-up timed |
| ``revoked(tps)``: a rebalance during the hand-over (second fault) | serving_outside | same | ``revoked_during_hand_over``; none of them taken any more; the old process's answer awaited (or its unanswered requests ranked again); drained; committed (nothing, if no answer came in time); forgotten; no switch until the group assigned again |
| ``assigned(tps)`` | serving_outside | same | those served outside keep their state; the others are read from the switch on |
| ``revoked(tps)``: a rebalance during the hand-over (second fault) | handing_over, answered | same | drained and committed, nothing forgotten: ``answered`` still covers all it held |
| ``assigned(tps)`` | handing_over, answered | same | nothing: it takes no new work |

The standby's transitions and ``hand_over()`` called from a state their rows do not name raise
``IllegalTransition``; ``ask()``, ``revoked()``, ``assigned()`` and ``between_fetches()`` come in any
state and do what their rows say (``between_fetches()`` nothing outside ``serving_outside``).

Primitives: ``State``; ``HandOver(...)`` (``state``, ``in_group``, ``standing_by``,
``serving_in_group()``, ``asked``, the transitions above, ``caught_up()``, ``commit()``,
``settle_old(group)``, ``wait_joined()``, ``close()``); ``Dispatch``, what it needs of the Kafka
shell (``take``, ``cancel_prefills``); ``IllegalTransition``; ``alive(pid)``.
``PipelineSettings.handover_stall_s`` (fault injection, off by default) blocks the old process right
after it wrote ``handover.json``: a kill then is a crash mid hand-over.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, TopicPartition

from relaygr.infra.kafka import consumer as new_consumer
from relaygr.infra.settings import Settings
from relaygr.streams.config import PipelineSettings
from relaygr.streams.ranking.intake import Intake
from relaygr.streams.ranking.partitions import Partitions
from relaygr.streams.ranking.worker_files import WorkerFiles
from relaygr.workers.engine.ranker import RankingEngine

log = logging.getLogger(__name__)

POLL_S = 0.005  # how often the old process's answer is looked for
SETTLE_WAIT_S = 60.0  # the most a revocation under a hand-over waits for the old process's answer
DRAIN_S = 30.0  # the most a process that hands over waits for the requests it holds
REVOKE_DRAIN_S = 10.0  # the most a revocation waits for the revoked partitions' work in flight


class State(enum.Enum):
    SERVING = "serving"
    HANDING_OVER = "handing_over"
    ANSWERED = "answered"
    WARMING = "warming"
    READY = "ready"
    SERVING_OUTSIDE = "serving_outside"
    JOINED = "joined"


IN_GROUP = frozenset({State.SERVING, State.JOINED, State.HANDING_OVER, State.ANSWERED})
GONE = frozenset({State.HANDING_OVER, State.ANSWERED})  # the loop has stopped: no new work


class Dispatch(Protocol):
    """What the hand-over needs of the Kafka shell."""

    def take(self, tp: TopicPartition, record: Any) -> None:
        """Handle a fetched signal or request (by its topic) in a task of its own."""
        ...

    async def cancel_prefills(self) -> None:
        """Drop the pre-inferences still running."""
        ...


class IllegalTransition(RuntimeError):
    """An event the current state has no transition for."""


class HandOver:
    """The state machine (see the module docstring); every transition checks where it comes from."""

    def __init__(
        self,
        *,
        standby: bool,
        worker_id: str,
        settings: Settings,
        pipeline: PipelineSettings,
        files: WorkerFiles,
        generation: Path,
        partitions: Partitions,
        intake: Intake,
        dispatch: Dispatch,
        engine: RankingEngine,
        note: Callable[..., None],
    ) -> None:
        self.state = State.WARMING if standby else State.SERVING
        self.worker_id, self.settings, self.pipeline = worker_id, settings, pipeline
        self.files, self.generation, self.partitions = files, generation, partitions
        self.intake, self.dispatch, self.engine, self.note = intake, dispatch, engine, note
        self.beh, self.sig, self.rank = partitions.beh, partitions.sig, partitions.rank
        self.pid = os.getpid()
        self.asked = 0.0  # when (epoch s) this process was told to hand over; 0: it was not
        self.outside: list[int] = []  # the partitions a standby reads outside the group
        self.handed: dict[str, dict[int, int]] = {}  # topic -> partition -> the hand-over's offset
        self.old_pid: int | None = None  # the process that handed over (None: none did)
        self.group: AIOKafkaConsumer | None = None  # joined, not yet switched to
        self._settled = False  # the old process answered, or its unanswered requests were ranked again
        self._settling = asyncio.Lock()
        self._rebalancing = False  # between a revocation and the assignment after it
        self._joined = asyncio.Event()
        self._manual_stopped: asyncio.Task | None = None
        self._last_commit: dict[TopicPartition, int] = {}  # this member's last commit (``commit``)

    @property
    def in_group(self) -> bool:
        return self.state in IN_GROUP

    def serving_in_group(self) -> bool:
        """A group member serving, not handing over (whose prefixes a standby may adopt)."""
        return self.state in (State.SERVING, State.JOINED)

    @property
    def standing_by(self) -> bool:
        """Warming or ready: its pre-inferences are for requests the active process ranks."""
        return self.state in (State.WARMING, State.READY)

    def _move(self, allowed: tuple[State, ...], to: State, event: str) -> None:
        if self.state not in allowed:
            raise IllegalTransition(f"{event} in state {self.state.value}")
        self.state = to

    # ------------------------------------------------------------------ the active side

    def ask(self) -> None:
        """Told to hand over (SIGUSR1). Only a group member has anything to hand over."""
        self.asked = time.time()
        if self.state in (State.SERVING, State.JOINED):
            self.state = State.HANDING_OVER

    async def commit(self, *, if_changed: bool = False) -> dict[TopicPartition, int]:
        """Commit what is finished (nothing outside the group); returns the offsets committed.
        ``if_changed``: not when they are those this member last committed since the group last
        assigned or revoked (an idle worker's periodic commit is a broker round trip for nothing)."""
        if not self.in_group:
            return {}
        offsets = self.partitions.commit_offsets()
        if if_changed and offsets == self._last_commit:
            return {}
        await self.intake.commit(offsets)
        self._last_commit = offsets
        return offsets

    async def hand_over(self) -> None:
        """The shut-down of a process that hands over. ``handover.json`` names at once, per request
        and signal partition, the first offset this process did not take (its position), and the
        successor ranks from there while this process finishes the requests it holds (no request
        waits for that drain); then it commits and says in ``handover.json`` that they are
        answered. Nothing is persisted: the successor rebuilt its own state."""
        if self.state is not State.HANDING_OVER:
            raise IllegalTransition(f"hand_over in state {self.state.value}")
        offsets: dict[str, dict[int, int]] = {}
        for tp in self.partitions.assigned:
            if tp.topic != self.beh:
                at = await asyncio.wait_for(self.intake.consumer.position(tp), 5)
                offsets.setdefault(tp.topic, {})[tp.partition] = at
        # First, so that the successor finds them with the offsets: the full rankings timed here.
        self.files.write_latency_samples(self.engine.latency_samples())
        self.files.write_handover(offsets, self.pid)
        # How long the requests that came meanwhile waited for this before the standby could take them.
        self.note(event="handed_over", ms=round((time.time() - self.asked) * 1000, 1))
        log.info("%s: handed over at %s", self.worker_id, offsets)
        if self.pipeline.handover_stall_s:  # fault injection: a kill meanwhile is a crash mid hand-over
            stall(self.pipeline.handover_stall_s)
        await self.dispatch.cancel_prefills()  # the successor saw their signals and computes its own
        requests = self.partitions.served(self.rank)
        await self.partitions.settle(requests, timeout_s=DRAIN_S)
        await self.partitions.finish_applying()
        with contextlib.suppress(Exception):  # fenced once the successor joined: it commits past them
            await self.commit()
        if not self.partitions.pending(requests):  # every request before the offsets has its result
            self.note(event="answered", ms=round((time.time() - self.asked) * 1000, 1))
            self.files.write_handover(offsets, self.pid, answered=True)
            self.state = State.ANSWERED
        if self.engine.store is not None:  # nor is this state kept: the successor rebuilt its own
            self.engine.store.config = self.engine.store.config.model_copy(update={"persist_on_close": False})

    # ------------------------------------------------------------------ rebalances

    async def revoked(self, tps: set[TopicPartition], group: AIOKafkaConsumer) -> None:
        """The group took ``tps`` from this member: finish (or give up on) their signals and
        requests in flight, commit what is finished, forget them; what that means in a hand-over
        is in the module docstring."""
        tps = set(tps)
        self._last_commit = {}  # committed by another member next: the next commit is made
        if self.state is State.SERVING_OUTSIDE:
            if tps:  # (the join's first assignment revokes nothing)
                self._rebalancing = True  # no switch until the group has assigned again
                await self._revoked_outside(tps, group)
            return
        await self.partitions.settle(tps, timeout_s=REVOKE_DRAIN_S)
        await self.partitions.finish_applying(tps)
        with contextlib.suppress(Exception):
            await self.intake.commit(self.partitions.committable(tps), group)
        if self.state in GONE:  # what it handed over stays its own until it answered it
            return
        self.partitions.release(tps)
        self.files.write_assignment([tp.partition for tp in self.partitions.assigned])

    async def _revoked_outside(self, tps: set[TopicPartition], group: AIOKafkaConsumer) -> None:
        """A rebalance while a standby serves outside the group: another member reads ``tps`` next,
        from what is committed. None is taken here any more; once the old process answered (or
        its unanswered requests were ranked again here) and those in flight are finished, what
        was answered is committed, never before: a commit past the hand-over's offsets would
        hide the old process's unanswered requests. Not answered in time: nothing is committed
        (the next owner ranks from the old process's commit, at least once). The audit trail says
        so first (``revoked_during_hand_over``)."""
        self.partitions.hold(tps)
        self.note(event="revoked_during_hand_over", partitions=sorted({tp.partition for tp in tps}))
        settled = await self._await_settled(group, SETTLE_WAIT_S)
        await self.partitions.settle(tps, timeout_s=REVOKE_DRAIN_S)
        await self.partitions.finish_applying(tps)
        if settled:
            offsets = {
                tp: at for tp in tps if (at := self.handed.get(tp.topic, {}).get(tp.partition)) is not None
            }
            offsets.update(self.partitions.committable(tps))
            with contextlib.suppress(Exception):
                await self.intake.commit(offsets, group)
        self.partitions.release(tps)
        log.warning(
            "%s: %s revoked during the hand-over (answered: %s)", self.worker_id, sorted(tps), settled
        )

    async def assigned(self, tps: set[TopicPartition], group: AIOKafkaConsumer) -> None:
        """The group gave ``tps`` to this member: drop histories of another cluster or topic
        incarnation, rewind offsets committed to an earlier topic of the same name, and read each
        behaviours partition from the history table's own offset (not the group's)."""
        tps = set(tps)
        self._last_commit = {}
        if self.state in GONE:
            log.info("%s: assigned %s while handing over: not taken", self.worker_id, sorted(tps))
            return
        try:
            await self._assigned(tps, group)
        finally:
            self._rebalancing = False

    async def _assigned(self, tps: set[TopicPartition], group: AIOKafkaConsumer) -> None:
        outside = self.state is State.SERVING_OUTSIDE
        if outside:  # those served outside go on as they are; the others from the switch on
            fresh = tps - self.partitions.assigned
        else:
            self.partitions.serve(tps)
            fresh = tps
        behaviours = [tp for tp in fresh if tp.topic == self.beh]
        await self.partitions.resume_behaviours(group, behaviours)
        await self.intake.rewind(group, [tp for tp in tps if tp.topic != self.beh])
        owned = tps if outside else self.partitions.assigned
        self.files.write_assignment([tp.partition for tp in owned if tp.topic == self.beh])
        self.note(event="assigned", partitions=sorted(tp.partition for tp in tps if tp.topic == self.beh))
        log.info("%s assigned %s", self.worker_id, sorted((t.topic, t.partition) for t in tps))

    # ------------------------------------------------------------------ the standby side: warming

    def warm(self) -> None:
        """A standby starts: files of an earlier hand-over or standby are not its own."""
        self._move((State.WARMING,), State.WARMING, "warm")
        self.files.clear_handover()
        self.files.clear_spilled()
        self.files.write_standby("warming", self.pid)

    async def stand_by(self, partitions: list[int]) -> None:
        """Read ``partitions`` (the active process's) outside the group, from now on."""
        self._move((State.WARMING,), State.WARMING, "stand_by")
        await self._read_outside(partitions, None)

    async def _read_outside(self, partitions: list[int], offsets: dict[str, dict[int, int]] | None) -> None:
        """Read ``partitions`` outside the group: behaviours from the history table's offsets;
        signals (from ``offsets``; None: from now on) and requests (from ``offsets``; None: kept
        from now on) held until the histories are caught up (a prefix of a partial history would
        have to be extended over the rest when the user's next request comes)."""
        await self.partitions.finish_applying()
        self.partitions.release({tp for tp in self.partitions.assigned if tp.partition not in partitions})
        tps = [TopicPartition(t, p) for t in (self.beh, self.sig, self.rank) for p in partitions]
        reader = self.intake.consumer
        reader.assign(tps)
        await self.partitions.resume_behaviours(
            reader, [TopicPartition(self.beh, p) for p in partitions], strict=True
        )
        self.partitions.drop_kept()
        self.partitions.unhold()
        kept = []
        for p in partitions:
            sig, rank = TopicPartition(self.sig, p), TopicPartition(self.rank, p)
            if offsets is None:
                await reader.seek_to_end(sig)
                # Requests from now on are fetched and kept, not ranked: at the hand-over those
                # from its offset on are ranked at once, with no fetch in between.
                await reader.seek_to_end(rank)
                kept.append(rank)
            else:
                reader.seek(sig, offsets[self.sig][p])
                reader.seek(rank, offsets[self.rank][p])
        self.partitions.keep_from_now(kept)
        self.partitions.hold({tp for tp in tps if tp.topic != self.beh} - set(kept))
        self.partitions.serve(tps)
        self.outside = sorted(partitions)

    async def caught_up(self) -> None:
        """Until the histories read outside the group have caught up."""
        while not self.partitions.ready(self.outside):
            await asyncio.sleep(0.05)

    def warmed(self) -> None:
        """The histories are caught up: signals are fetched (and pre-inferred) from now on."""
        self._move((State.WARMING,), State.WARMING, "warmed")
        self.partitions.unhold(self.sig)

    def ready(self, seconds: float) -> None:
        self._move((State.WARMING,), State.READY, "ready")
        self.files.write_standby("ready", self.pid)
        self.note(event="standby_ready", partitions=self.outside, seconds=round(seconds, 3))

    # ------------------------------------------------------------------ the standby side: take-over

    async def take_over(self, offsets: dict[str, dict[int, int]], old_pid: int | None) -> None:
        """Rank the handed-over partitions from ``offsets`` on, outside the group. ``old_pid`` None:
        the active process exited without handing over (``offsets`` empty)."""
        self._move((State.READY,), State.READY, "take_over")
        self.handed, self.old_pid = offsets, old_pid
        handed = sorted(offsets.get(self.rank, {}))
        if handed != self.outside:  # the group moved partitions meanwhile: catch those up first
            await self._read_outside(handed, offsets)
            await self.caught_up()
        else:
            for p in handed:
                self._rank_from(TopicPartition(self.rank, p), offsets[self.rank][p])
        self.partitions.drop_kept()
        # Its predecessor's timings of full rankings, not the ones made beside it at nice 19: the
        # worker's next report gives the trigger the latency model the partitions were served with.
        self.engine.scheduler.pace(0)
        if inherited := self.files.read_latency_samples():
            self.engine.inherit_latency_samples(inherited)
        self.partitions.unhold()
        self.state = State.SERVING_OUTSIDE
        self.files.write_standby("serving", self.pid)
        self.note(event="took_over", partitions=handed, offsets=dict(offsets))
        log.info("%s (standby): serving %s from %s", self.worker_id, handed, offsets)

    def _rank_from(self, tp: TopicPartition, offset: int) -> None:
        """Rank the requests of ``tp`` from ``offset`` on: those already fetched at once, or, where
        the kept ones do not reach back to it, fetched again from there."""
        kept = self.partitions.kept_from(tp, offset)
        if kept is None:
            self.intake.consumer.seek(tp, offset)
            return
        for m in kept:
            self.dispatch.take(tp, m)

    def joined(self, group: AIOKafkaConsumer) -> None:
        """The group's consumer has its assignment: the switch is tried between two fetches."""
        self._move((State.SERVING_OUTSIDE,), State.SERVING_OUTSIDE, "joined")
        self.group = group

    async def between_fetches(self) -> None:
        """The loop's turn between two fetches: where a standby has joined the group, switch to
        its consumer once the old process has answered."""
        if self.state is State.SERVING_OUTSIDE and self.group is not None and not self._rebalancing:
            await self._switch(self.group)

    async def _switch(self, group: AIOKafkaConsumer) -> None:
        """Go on with the group's consumer where the manual one got to, once the old process has
        answered the requests before the hand-over (its commit is then behind this one's)."""
        if not await self.settle_old(group):
            return  # asked again before the next fetch
        t0 = time.monotonic()
        self.group = None
        manual = self.intake.consumer
        await self.partitions.finish_applying()
        work = [tp for tp in manual.assignment() if tp.topic != self.beh and not self.partitions.holds(tp)]
        # What the manual consumer has fetched by now is handled here, not fetched again by the
        # group's (a request that came during the switch would wait for that fetch).
        for tp, msgs in (await manual.getmany(*work, timeout_ms=0)).items():
            for m in msgs:
                self.dispatch.take(tp, m)
        positions = {tp: await manual.position(tp) for tp in work}
        mine = group.assignment()
        for tp in mine:
            if tp.topic == self.beh:
                group.seek(tp, self.partitions.history.next_offset(tp.partition))
            elif tp in positions:
                group.seek(tp, positions[tp])
        self.partitions.release(self.partitions.assigned - mine)
        self.partitions.unhold()
        self.partitions.serve(mine)
        self.intake.switch(group)  # the loop commits from now on
        self.state = State.JOINED
        self._manual_stopped = asyncio.create_task(manual.stop())  # not on the loop's path
        self.partitions.watch(group)
        self.files.promote(self.generation)
        self.files.clear_handover()  # done with
        self.files.write_standby("joined", self.pid)
        self.note(
            event="joined",
            partitions=sorted({tp.partition for tp in mine}),
            switch_ms=round((time.monotonic() - t0) * 1000, 1),  # the loop fetched nothing meanwhile
        )
        self._joined.set()

    async def wait_joined(self) -> None:
        await self._joined.wait()

    async def settle_old(self, group: AIOKafkaConsumer) -> bool:
        """Whether the old process has answered every request before the hand-over's offsets: it
        said so, or it is gone without saying so (a crash while it drained), and then those after
        its last commit, of the partitions still this worker's, are ranked again here (at least
        once, as after any crash; once per hand-over)."""
        async with self._settling:
            if self._settled or self.old_pid is None or self.files.handover_answered():
                self._settled = True
                return True
            if alive(self.old_pid):
                return False
            log.warning("%s: pid %d exited before answering what it held", self.worker_id, self.old_pid)
            again: dict[int, tuple[int, int]] = {}
            for p, at in self.handed.get(self.rank, {}).items():
                tp = TopicPartition(self.rank, p)
                if tp not in self.partitions.assigned:  # its next owner ranks from the old commit
                    continue
                committed = await group.committed(tp)
                if committed is None:  # never committed: from the first offset, as a restart reads it
                    committed = (await group.beginning_offsets([tp]))[tp]
                if committed < at:
                    again[p] = (committed, at)
            # Before they are ranked again: the results after this line are the new process's.
            self.note(event="unanswered", pid=self.old_pid, ranked_again=again)
            for p, (start, end) in again.items():
                await self._rank_range(TopicPartition(self.rank, p), start, end)
            self._settled = True
            return True

    async def _await_settled(self, group: AIOKafkaConsumer, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not await self.settle_old(group):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True

    async def _rank_range(self, tp: TopicPartition, start: int, end: int, timeout_s: float = 30.0) -> None:
        """Rank the requests of ``tp`` in [start, end), read with a consumer of their own."""
        reader = new_consumer(self.settings, group_id=None)
        await reader.start()
        try:
            reader.assign([tp])
            reader.seek(tp, start)
            deadline = time.monotonic() + timeout_s
            while await reader.position(tp) < end and time.monotonic() < deadline:
                for m in (await reader.getmany(tp, timeout_ms=200)).get(tp, []):
                    if m.offset < end:
                        self.dispatch.take(tp, m)
        finally:
            await reader.stop()

    async def close(self) -> None:
        """Stop the consumers the hand-over still holds (a group joined and never switched to)."""
        group, self.group = self.group, None
        if group is not None:
            with contextlib.suppress(Exception):
                await group.stop()
        if self._manual_stopped is not None:
            with contextlib.suppress(Exception):
                await self._manual_stopped


def stall(seconds: float) -> None:
    """Block this thread, the event loop with it: nothing held is finished, committed or answered."""
    time.sleep(seconds)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: the pid was reused
        return False
    return True
