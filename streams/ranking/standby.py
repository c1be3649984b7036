"""A standby ranking worker: the replacement that takes over a running worker's partitions with no
process start on the request path (make before break, under the same static member id).

1. Stand by. With the model loaded and the device warmed up, it reads the partitions the active
   process owns (``assignment.json``) with a consumer outside the group (manual assignment): it
   rebuilds their histories from ``routed-behaviors`` into a fresh state generation and pre-infers
   their prefill signals from now on into its own prefix store, so its cache is warm when it takes
   over. Requests are fetched from then on and kept, never ranked; signals stay unfetched until
   the histories are caught up (a prefix of a partial history would need extending later). Then it
   adopts the prefixes the active process holds: seeing ``warming`` and no ``spilled.json``, the
   active process writes those its disk tier lacks to it (in the background, through its disk
   writer; nothing leaves its memory) and says so in ``spilled.json``, at once (the bulk) and again
   when the standby, caught up, removes that file (what came since); the standby, waiting for that
   at most ``standby_adopt_wait_s``, reads the folder read-only while the active process keeps it
   open (``workers.store.tiers.DiskSnapshot``) and puts each prefix still valid for its own histories into
   its store (``workers.store.prefix_adoption``; ``standby_adopted`` in ``events.jsonl``). Without a disk
   tier, or if anything goes wrong there, it adopts none. Then each user whose signal came within
   ``standby_warm_s`` (the users the active process keeps warm) is pre-inferred once: a cache hit
   for an adopted prefix (an extension where the history grew since), a computation for the rest;
   and once every signal published by then is handled: ``ready``.
2. Take over. The active process, told to hand over (SIGUSR1), stops fetching and at once leaves
   in ``handover.json`` the first offset of each partition it did not take (its position); then
   it finishes the requests it holds, commits, and says they are answered. The standby ranks the
   requests of those partitions from exactly there (the old process takes everything before; so
   results are produced once), at once, still outside the group: ``serving``. No request waits
   for the old process's drain, nor for a fetch: the standby has fetched them already
   (``RankingWorker.prefetched``: kept, not ranked, while it stood by). Partitions it did not warm
   are caught up first.
3. Join. It joins the group with the same ``group_instance_id``: the coordinator replaces the
   old member and hands back the same assignment, with no rebalance. Once the old process has
   answered what it held (or is gone without saying so: a crash while it drained; the requests
   after its last commit, or all of a partition it never committed, are then ranked again, at
   least once, and ``events.jsonl`` says which: ``unanswered``), between two fetches the worker
   switches to the group's consumer at the offsets it reached and commits what it did meanwhile:
   ``joined``. Its state generation becomes the current one, and the old one is deleted once the
   old process is gone.

A standby warms up at the lowest CPU priority (nice 19, ``STANDBY_NICE``, where it may come back
to the worker's level at the hand-over; ``relaygr up`` lowers it from its first instruction on),
and its device thread rests after each pre-inference turn as long as the turn took
(``WARM_REST_RATIO``; the scheduler's ``pace``): it runs on the cores of the workers serving beside
it, has no deadline, and must not slow them. While it stands by, its lines in ``events.jsonl``
say ``"standby": true`` (its pre-inferences are for requests the active process ranks).

Nothing stale is served: the standby's histories are rebuilt from the topics, never copied from the
old generation; prefixes may be copied from it, but only those computed by the same model version
whose fingerprint equals that of the standby's own history over their length (any other is
refused and counted), and the rest are computed from the rebuilt histories.

Primitives: ``Standby(worker, metrics_port, serve_nice).run()``; ``stand_aside(settings,
worker_id)``, the standby's first step: every thread at ``STANDBY_NICE``, and the level to serve at;
``spill_for_standby(worker)``, the active process's timer: its prefixes on its disk tier, and
``spilled.json``, for a standby that warms up;
``hand_over(worker)``, the old process's side:
``handover.json`` written at its positions, the pre-inferences still running dropped (the successor
computes its own), the requests in flight finished and committed, ``handover.json`` saying so, and
nothing persisted. ``PipelineSettings.handover_stall_s`` (fault injection, off by default) blocks
the old process right after it wrote ``handover.json``: a kill then is a crash mid hand-over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import time
from collections import deque
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition

from relaygr.infra.kafka import consumer
from relaygr.infra.rdkafka_producer import RdProducer
from relaygr.infra.settings import Settings
from relaygr.schemas import PrefillSignal, SchemaError
from relaygr.streams.common import decode_keyed
from relaygr.streams.ranking.worker_files import WorkerFiles
from relaygr.streams.ranking.worker_port import WorkerPort
from relaygr.streams.state_lineage import deployment_dir
from relaygr.workers.engine.cores import may_renice_to, nice_tasks
from relaygr.workers.prefix_kv import Events
from relaygr.workers.store.prefix_adoption import Adoption, adopt_prefixes
from relaygr.workers.store.tiers import DiskSnapshot

log = logging.getLogger(__name__)

POLL_S = 0.005  # how often the hand-over file is looked for: the gap it adds to a hand-over
PREFETCH_MAX = 10_000  # requests kept per partition while standing by (older ones fetched again)
STANDBY_NICE = 19  # the nice level while standing by: the lowest
WARM_REST_RATIO = 1.0  # while standing by, the device thread rests this × each pre-inference turn
SPILL_POLL_S = 0.2  # how often an active process looks for a standby asking for its prefixes
SPILL_TIMEOUT_S = 120.0  # the most an active process waits for its disk writer to land a spill


def stand_aside(settings: Settings, worker_id: str) -> int | None:
    """Put every thread of this process (and those it starts later) at ``STANDBY_NICE``. Returns
    the nice level to serve at after the hand-over: the active process's (``relaygr up`` may have
    lowered this one already), else the parent's; None where this process could not come back to
    it (then it stays where it is)."""
    files = WorkerFiles(deployment_dir(settings, "workers") / worker_id)
    level = os.getpriority(os.PRIO_PROCESS, 0)
    for pid in (files.active_pid(), os.getppid()):
        if pid is not None:
            with contextlib.suppress(OSError):
                level = os.getpriority(os.PRIO_PROCESS, pid)
                break
    if not may_renice_to(level):
        return None
    nice_tasks(os.getpid(), STANDBY_NICE)
    return level


async def spill_for_standby(w: WorkerPort) -> None:
    """The active process's timer: while a standby of its id says ``warming`` and finds no
    ``spilled.json`` for it, write the prefixes its memory tiers hold and its disk tier lacks to the
    disk tier (queued for the disk writer's thread: nothing leaves memory, the loop waits for
    nothing), wait until they landed, and say so in ``spilled.json``. So it does at once (the bulk,
    while the standby starts) and again when the standby, caught up, removes the file (what came
    since)."""
    failed_for: int | None = None  # a standby it could not write them for: not tried again
    while True:
        await asyncio.sleep(SPILL_POLL_S)
        standby = w.files.read_standby()
        if not w.in_group or w.handing_over or standby is None:
            continue
        state, pid = standby
        if state != "warming" or pid in (os.getpid(), failed_for) or w.files.read_spilled(pid) is not None:
            continue
        try:
            await _spill(w, pid)
        except Exception:  # the standby then recomputes, as without a disk tier
            log.exception("%s: writing the prefixes for standby pid %d failed", w.worker_id, pid)
            failed_for = pid


async def _spill(w: WorkerPort, standby_pid: int) -> None:
    t0 = time.monotonic()
    store = w.engine.store
    if store is None:  # a baseline worker caches nothing
        report: dict[str, object] = {"folder": None, "model_version": w.engine.model.model_version}
    else:
        report = await asyncio.to_thread(store.persist, SPILL_TIMEOUT_S)
    report["seconds"] = round(time.monotonic() - t0, 3)
    w.files.write_spilled(standby_pid, report)
    w.note(event="spilled_for_standby", standby_pid=standby_pid, **report)
    log.info("%s: prefixes on the disk tier for standby pid %d: %s", w.worker_id, standby_pid, report)


async def hand_over(w: WorkerPort) -> None:
    """The shut-down of a process that hands over. ``handover.json`` names at once, per request
    and signal partition, the first offset this process did not take (its position), and the
    successor ranks from there while this process finishes the requests it holds (no request
    waits for that drain); then it commits and says in ``handover.json`` that they are answered."""
    beh, rank = w.reg.name("routed_behaviors"), w.reg.name("rank")
    offsets: dict[str, dict[int, int]] = {}
    for tp in w.assigned:
        if tp.topic != beh:
            at = await asyncio.wait_for(w.consumer.position(tp), 5)
            offsets.setdefault(tp.topic, {})[tp.partition] = at
    # First, so that the successor finds them with the offsets: the full rankings timed here.
    w.files.write_latency_samples(w.engine.latency_samples())
    w.files.write_handover(offsets, os.getpid())
    # How long the requests that came meanwhile waited for this before the standby could take them.
    w.note(event="handed_over", ms=round((time.time() - w.handing_over) * 1000, 1))
    log.info("%s: handed over at %s", w.worker_id, offsets)
    if w.pipeline.handover_stall_s:  # fault injection: a kill meanwhile is a crash mid hand-over
        _stall(w.pipeline.handover_stall_s)
    # Pre-inferences still running: the successor saw their signals and computes its own.
    prefills = [t for t in w.tasks if t.get_name() == w.reg.name("prefill")]
    for task in prefills:
        task.cancel()
    await asyncio.gather(*prefills, return_exceptions=True)
    requests = {tp for tp in w.assigned if tp.topic == rank}
    await w.drain(requests, timeout_s=30)
    await w.finish_appliers()
    with contextlib.suppress(Exception):  # fenced once the successor joined: it commits past them
        await w.commit()
    if not w.tracker.pending(requests):  # every request before the offsets has its result
        w.note(event="answered", ms=round((time.time() - w.handing_over) * 1000, 1))
        w.files.write_handover(offsets, os.getpid(), answered=True)
    if w.engine.store is not None:  # nor is this state kept: the successor rebuilt its own
        w.engine.store.config = w.engine.store.config.model_copy(update={"persist_on_close": False})


class Standby:
    """Stands by for the active process of ``worker``'s id, takes over from it, joins the group."""

    def __init__(self, worker: WorkerPort, metrics_port: int = 0, serve_nice: int | None = None) -> None:
        self.w = worker
        self.metrics_port = metrics_port
        self.serve_nice = serve_nice  # the level to come back to at the hand-over (``stand_aside``)
        self.pid = os.getpid()
        self.partitions: list[int] = []
        self.group: AIOKafkaConsumer | None = None
        self.old_pid: int | None = None
        self.handed_rank: dict[int, int] = {}  # request partition -> the hand-over's offset
        self.cleanup: asyncio.Task | None = None
        self.manual_stopped: asyncio.Task | None = None
        names = worker.reg.name
        self.beh, self.sig, self.rank = names("routed_behaviors"), names("prefill"), names("rank")

    async def run(self) -> None:
        w = self.w
        w.files.clear_handover()  # one left by an earlier hand-over is not for this process
        w.files.clear_spilled()  # nor one left for an earlier standby
        w.files.write_standby("warming", self.pid)
        # Warming up beside the serving workers, on their cores (at STANDBY_NICE since
        # ``stand_aside``): pre-inference has no deadline here, so it leaves them the CPU.
        w.engine.scheduler.pace(WARM_REST_RATIO)
        took = await w.engine.warm_up()
        log.info("%s (standby): warmed up the device in %.2f s", w.worker_id, took)
        partitions = await self._active_partitions()
        w.producer = RdProducer(w.settings, linger_ms=w.settings.request_linger_ms)
        await w.producer.start()
        w.consumer = consumer(w.settings, group_id=None, max_poll_records=500, fetch_max_wait_ms=20)
        await w.consumer.start()
        await self._assign(partitions, None)
        stand_by = asyncio.create_task(self._stand_by())
        stand_by.add_done_callback(self._failed)
        try:
            await w.serve()
        finally:
            stand_by.cancel()

    def _failed(self, task: asyncio.Task) -> None:
        """A standby that cannot take over stops (its owner sees it exit) rather than idle."""
        if not task.cancelled() and task.exception() is not None:
            log.error("%s (standby): taking over failed", self.w.worker_id, exc_info=task.exception())
            self.w.stop()

    async def _active_partitions(self) -> list[int]:
        """The partitions the active process owns (it writes them at every assignment)."""
        while (partitions := self.w.files.read_assignment()) is None:
            await asyncio.sleep(0.1)
        return partitions

    # ------------------------------------------------------------------ reading outside the group

    async def _assign(self, partitions: list[int], offsets: dict[str, dict[int, int]] | None) -> None:
        """Read ``partitions`` outside the group: behaviours from the history table's offsets;
        signals (from ``offsets``, None: from now on) and requests (from ``offsets``) held."""
        w = self.w
        await w.finish_appliers()
        gone = {tp for tp in w.assigned if tp.partition not in partitions}
        w.tracker.forget(gone)
        for p in {tp.partition for tp in gone}:
            w.applier.forget(p)
            w.alignment.forget(p)
        tps = [TopicPartition(t, p) for t in (self.beh, self.sig, self.rank) for p in partitions]
        w.consumer.assign(tps)
        await w.lineage.verify(self.beh, partitions)
        behaviours = [TopicPartition(self.beh, p) for p in partitions]
        for tp in behaviours:
            start = w.history.next_offset(tp.partition)
            w.consumer.seek(tp, start)
            w.alignment.forget(tp.partition)
            w.applier.catch_up(tp.partition, start)
        ends = await w.consumer.end_offsets(behaviours)
        for tp in behaviours:
            w.applier.catch_up_to(tp.partition, ends.get(tp))
        w.prefetched = {}
        for p in partitions:
            if offsets is None:
                await w.consumer.seek_to_end(TopicPartition(self.sig, p))
                # Requests from now on are fetched and kept, not ranked: at the hand-over those
                # from its offset on are ranked at once, with no fetch in between.
                await w.consumer.seek_to_end(TopicPartition(self.rank, p))
                w.prefetched[TopicPartition(self.rank, p)] = deque(maxlen=PREFETCH_MAX)
            else:
                w.consumer.seek(TopicPartition(self.sig, p), offsets[self.sig][p])
                w.consumer.seek(TopicPartition(self.rank, p), offsets[self.rank][p])
        # Held until their histories are caught up: a prefix of a partial history would have to
        # be extended over the rest when the user's next request comes.
        w.held = {TopicPartition(t, p) for t in (self.sig, self.rank) for p in partitions}
        w.held -= set(w.prefetched)
        w.assigned = set(tps)
        self.partitions = sorted(partitions)

    async def _caught_up(self) -> None:
        while any(p in self.w.applier.catching_up for p in self.partitions):
            await asyncio.sleep(0.05)

    async def _adopt(self) -> None:
        """Adopt the prefixes the active process wrote to its disk tier for this standby, waiting
        for them at most ``standby_adopt_wait_s``: those still valid for the histories caught up
        here. Anything wrong there: none adopted (the recent users' pre-inference computes them)."""
        w = self.w
        spilled = await self._spilled()
        if w.engine.store is None or w.pipeline.standby_adopt_wait_s == 0:
            why = "off"
        elif spilled is None:
            why = "not_spilled_in_time"
        elif spilled.get("folder") is None:
            why = "no_disk_tier"
        else:
            try:
                got = await asyncio.to_thread(self._adopt_from, Path(str(spilled["folder"])))
            except Exception as e:  # never fails the standby: it recomputes instead
                log.warning("%s (standby): adopting prefixes failed", w.worker_id, exc_info=True)
                why = f"error: {e}"
            else:
                w.note(event="standby_adopted", **got.fields(), spilled=spilled.get("prefixes"))
                log.info("%s (standby): adopted prefixes: %s", w.worker_id, got.fields())
                return
        w.note(event="standby_adopted", adopted=0, why=why)
        log.info("%s (standby): adopted no prefixes (%s)", w.worker_id, why)

    async def _spilled(self) -> dict | None:
        """A fresh ``spilled.json`` of the active process for this standby (it writes one as the
        standby starts, and another once this one is removed); None after ``standby_adopt_wait_s``
        (or at once where this standby adopts nothing)."""
        w = self.w
        if w.engine.store is None or w.pipeline.standby_adopt_wait_s == 0:
            return None
        w.files.clear_spilled()  # asks for what the active process computed since its first one
        deadline = time.monotonic() + w.pipeline.standby_adopt_wait_s
        while (spilled := w.files.read_spilled(self.pid)) is None and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S * 10)
        return spilled

    def _adopt_from(self, folder: Path) -> Adoption:
        """``adopt_prefixes`` from the old generation's disk tier (read-only; blocking)."""
        w = self.w
        assert w.engine.store is not None
        own = w.state_dir / "adopting"  # the read-only view's own files: this generation's

        def history_of(user_id: int | str) -> Events:
            return w.handler.served_history(str(user_id), math.inf).events

        try:
            with DiskSnapshot(folder, own) as view:
                return adopt_prefixes(view, w.engine.store, history_of)
        finally:
            shutil.rmtree(own, ignore_errors=True)

    async def _warm_recent_users(self) -> int:
        """Pre-infer, for each user whose prefill signal came within ``standby_warm_s`` (the users
        the active process keeps warm), its latest one, on the caught-up history. Returns how
        many users. Their other signals are device hits then."""
        w = self.w
        signals = [TopicPartition(self.sig, p) for p in self.partitions]
        latest = {}
        reader = consumer(w.settings, group_id=None)
        await reader.start()
        try:
            reader.assign(signals)
            since = int((time.time() - w.pipeline.standby_warm_s) * 1000)
            starts = await reader.offsets_for_times({tp: since for tp in signals})
            ends = await reader.end_offsets(signals)
            todo = {}
            for tp in signals:
                found = starts.get(tp)
                if found is not None and found.offset < ends[tp]:
                    reader.seek(tp, found.offset)
                    todo[tp] = ends[tp]
            deadline = time.monotonic() + 60  # a bound: this only warms the cache
            while todo and time.monotonic() < deadline:
                for tp, msgs in (await reader.getmany(*todo, timeout_ms=200)).items():
                    for m in msgs:
                        with contextlib.suppress(SchemaError):  # dead-lettered by its reader
                            s = decode_keyed(PrefillSignal, m.key, m.value, w.settings.max_message_bytes)
                            latest[s.user_id] = (tp.partition, s)
                for tp in list(todo):
                    if await reader.position(tp) >= todo[tp]:
                        del todo[tp]
        finally:
            await reader.stop()
        await asyncio.gather(*(w.handler.prefill(s, p) for p, s in latest.values()), return_exceptions=True)
        return len(latest)

    async def _signals_handled(self) -> None:
        """Wait until every prefill signal published by now is pre-inferred: its users' next
        requests find their prefixes cached, not being computed (those waited for their
        histories until now, and are the users active lately)."""
        w = self.w
        signals = [TopicPartition(self.sig, p) for p in self.partitions]
        ends = await w.consumer.end_offsets(signals)
        for tp in signals:
            while True:
                done = w.tracker.committable({tp}).get(tp)
                if done is None and not w.tracker.pending({tp}):
                    done = await w.consumer.position(tp)
                if done is not None and done >= ends[tp]:
                    break
                await asyncio.sleep(0.05)

    # ------------------------------------------------------------------ the hand-over

    async def _stand_by(self) -> None:
        w = self.w
        t0 = time.monotonic()
        await self._caught_up()
        await self._adopt()
        warmed = await self._warm_recent_users()
        log.info("%s (standby): pre-inferred the prefixes of %d users active lately", w.worker_id, warmed)
        w.held = {tp for tp in w.held if tp.topic != self.sig}
        await self._signals_handled()  # those of the catch-up time too
        w.files.write_standby("ready", self.pid)
        w.note(event="standby_ready", partitions=self.partitions, seconds=round(time.monotonic() - t0, 3))
        offsets, self.old_pid = await self._handed_over()
        t_handover = time.monotonic()
        self.handed_rank = offsets.get(self.rank, {})
        handed = sorted(self.handed_rank)
        if handed != self.partitions:  # the group moved partitions meanwhile: catch those up first
            await self._assign(handed, offsets)
            await self._caught_up()
        else:
            for p in handed:
                self._rank_from(TopicPartition(self.rank, p), offsets[self.rank][p])
        w.prefetched = {}
        if self.serve_nice is not None:
            nice_tasks(self.pid, self.serve_nice)
        w.engine.scheduler.pace(0)
        # Its predecessor's timings of full rankings, not the ones made beside it at nice 19: the
        # worker's next report gives the trigger the latency model the partitions were served with.
        if inherited := w.files.read_latency_samples():
            w.engine.inherit_latency_samples(inherited)
        w.held, w.standing_by = set(), False
        w.files.write_standby("serving", self.pid)
        w.note(event="took_over", partitions=handed, offsets={t: o for t, o in offsets.items()})
        log.info("%s (standby): serving %s from %s", w.worker_id, handed, offsets)
        self.group = await w.join_group()
        log.info(
            "%s: joined the group %.2f s after the hand-over", w.worker_id, time.monotonic() - t_handover
        )
        w.before_fetch = self._switch

    def _rank_from(self, tp: TopicPartition, offset: int) -> None:
        """Rank the requests of ``tp`` from ``offset`` on: those already fetched at once, or, where
        the kept ones do not reach back to it, fetched again from there."""
        w = self.w
        kept = w.prefetched.pop(tp, deque())
        if kept and kept[0].offset <= offset <= kept[-1].offset + 1:
            for m in kept:
                if m.offset >= offset:
                    w.take(tp, m)
        else:
            w.consumer.seek(tp, offset)

    async def _handed_over(self) -> tuple[dict[str, dict[int, int]], int | None]:
        """The hand-over's offsets and the pid that handed over. An active process that exits
        without handing over (a crash) hands over nothing: the group's committed offsets then
        say where to go on, once this process has joined."""
        active = self.w.files.active_pid()
        checked = time.monotonic()
        while (handover := self.w.files.read_handover()) is None:
            await asyncio.sleep(POLL_S)
            if active is not None and time.monotonic() - checked > 0.5:
                checked = time.monotonic()
                if not _alive(active):
                    log.warning("%s (standby): pid %d exited without handing over", self.w.worker_id, active)
                    return {}, None
        return handover

    async def _switch(self) -> None:
        """Between two fetches: go on with the group's consumer where the manual one got to, once
        the old process has answered the requests before the hand-over (its commit is then
        behind this one's)."""
        w, group = self.w, self.group
        assert group is not None
        if not await self._old_answered():
            return  # asked again before the next fetch
        t0 = time.monotonic()
        w.before_fetch = None
        manual = w.consumer
        await w.finish_appliers()
        work = [tp for tp in manual.assignment() if tp.topic != self.beh]
        # What the manual consumer has fetched by now is handled here, not fetched again by the
        # group's (a request that came during the switch would wait for that fetch).
        for tp, msgs in (await manual.getmany(*work, timeout_ms=0)).items():
            for m in msgs:
                w.take(tp, m)
        positions = {tp: await manual.position(tp) for tp in work}
        mine = group.assignment()
        for tp in mine:
            if tp.topic == self.beh:
                group.seek(tp, w.history.next_offset(tp.partition))
            elif tp in positions:
                group.seek(tp, positions[tp])
        w.tracker.forget(set(positions) - mine)
        w.consumer, w.in_group, w.assigned = group, True, set(mine)  # the loop commits next
        self.manual_stopped = asyncio.create_task(manual.stop())  # not on the loop's path
        w.watch_lineage()
        w.files.promote(w.state_dir)
        w.files.clear_handover()  # done with
        w.files.write_standby("joined", self.pid)
        w.note(
            event="joined",
            partitions=sorted({tp.partition for tp in mine}),
            switch_ms=round((time.monotonic() - t0) * 1000, 1),  # the loop fetched nothing meanwhile
        )
        self.cleanup = asyncio.create_task(self._after_old_exit())

    async def _old_answered(self) -> bool:
        """Whether the old process has answered every request before the hand-over's offsets:
        it said so, or it is gone without saying so (a crash while it drained), and then those
        after its last commit are ranked again here (at least once, as after any crash)."""
        if self.old_pid is None or self.w.files.handover_answered():
            return True
        if _alive(self.old_pid):
            return False
        log.warning("%s: pid %d exited before answering what it held", self.w.worker_id, self.old_pid)
        assert self.group is not None
        again: dict[int, tuple[int, int]] = {}
        for p, at in self.handed_rank.items():
            tp = TopicPartition(self.rank, p)
            committed = await self.group.committed(tp)
            if committed is None:  # never committed: from the first offset, as a restart reads it
                committed = (await self.group.beginning_offsets([tp]))[tp]
            if committed < at:
                again[p] = (committed, at)
        # Before they are ranked again: the results after this line are the new process's.
        self.w.note(event="unanswered", pid=self.old_pid, ranked_again=again)
        for p, (start, end) in again.items():
            await self._rank_range(TopicPartition(self.rank, p), start, end)
        return True

    async def _rank_range(self, tp: TopicPartition, start: int, end: int, timeout_s: float = 30.0) -> None:
        """Rank the requests of ``tp`` in [start, end), read with a consumer of their own."""
        w = self.w
        reader = consumer(w.settings, group_id=None)
        await reader.start()
        try:
            reader.assign([tp])
            reader.seek(tp, start)
            deadline = time.monotonic() + timeout_s
            while await reader.position(tp) < end and time.monotonic() < deadline:
                for m in (await reader.getmany(tp, timeout_ms=200)).get(tp, []):
                    if m.offset < end:
                        w.take(tp, m)
        finally:
            await reader.stop()

    async def _after_old_exit(self, timeout_s: float = 120.0) -> None:
        """Once the old process has exited: serve the metrics on its port, delete its state."""
        deadline = time.monotonic() + timeout_s
        while self.old_pid is not None and time.monotonic() < deadline:
            if not _alive(self.old_pid):
                break
            await asyncio.sleep(0.2)
        else:
            if self.old_pid is not None:
                log.warning("%s: pid %d still there; its state is kept", self.w.worker_id, self.old_pid)
                return
        removed = self.w.files.remove_stale_generations()
        log.info("%s: removed the old state %s", self.w.worker_id, [p.name for p in removed])
        if self.metrics_port:
            from relaygr.streams.common import serve_metrics

            for _ in range(50):  # the port may linger a moment after its process
                with contextlib.suppress(OSError):
                    serve_metrics(self.metrics_port)
                    return
                await asyncio.sleep(0.2)
            log.warning("%s: metrics port %d stays busy", self.w.worker_id, self.metrics_port)


def _stall(seconds: float) -> None:
    """Block this thread, the event loop with it: nothing held is finished, committed or answered."""
    time.sleep(seconds)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: the pid was reused
        return False
    return True
