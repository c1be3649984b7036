"""Warming a standby's cache before it takes over, from both sides.

- The active process (``spill_for_standby``, a timer of its loop): while a standby of its id says
  ``warming`` and finds no ``spilled.json`` for it, it writes the prefixes its memory tiers hold and
  its disk tier lacks to the disk tier (queued for the disk writer's thread: nothing leaves memory,
  the loop waits for nothing), waits until they landed, and says so in ``spilled.json``: at once
  (the bulk, while the standby starts) and again when the standby, caught up, removes that file
  (what came since).
- The standby (``StandbyWarmUp``): ``adopt()`` waits for that file at most ``standby_adopt_wait_s``,
  reads the folder read-only while the active process keeps it open
  (``workers.store.tiers.DiskSnapshot``) and puts each prefix still valid for its own histories
  into its store (``workers.store.prefix_adoption``; ``standby_adopted`` in ``events.jsonl``).
  Without a disk tier, or if anything goes wrong there, it adopts none and says why. Then
  ``warm_recent_users()`` pre-infers, once, each user whose signal came within ``standby_warm_s``
  (a cache hit for an adopted prefix, an extension where the history grew since, a computation for
  the rest), and ``signals_handled()`` waits until every signal published by then is handled.

Nothing stale is served: only prefixes computed by the same model version whose fingerprint equals
that of the standby's own history over their length are adopted (any other is refused and
counted); the rest are computed from the rebuilt histories.

Primitives: ``spill_for_standby(files, engine, note, serving, worker_id)``; ``StandbyWarmUp``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from aiokafka import TopicPartition

from relaygr.infra.kafka import consumer as new_consumer
from relaygr.infra.settings import Settings
from relaygr.schemas import PrefillSignal, SchemaError
from relaygr.streams.common import decode_keyed
from relaygr.streams.config import PipelineSettings
from relaygr.streams.ranking.intake import Intake
from relaygr.streams.ranking.partitions import Partitions
from relaygr.streams.ranking.rank_handler import RankHandler
from relaygr.streams.ranking.worker_files import WorkerFiles
from relaygr.workers.engine.ranker import RankingEngine
from relaygr.workers.prefix_kv import Events
from relaygr.workers.store.prefix_adoption import Adoption, adopt_prefixes
from relaygr.workers.store.tiers import DiskSnapshot

log = logging.getLogger(__name__)

SPILL_POLL_S = 0.2  # how often an active process looks for a standby asking for its prefixes
SPILL_TIMEOUT_S = 120.0  # the most an active process waits for its disk writer to land a spill
SPILLED_POLL_S = 0.05  # how often a standby looks for ``spilled.json``


async def spill_for_standby(
    files: WorkerFiles,
    engine: RankingEngine,
    note: Callable[..., None],
    serving: Callable[[], bool],
    worker_id: str,
) -> None:
    """The active process's timer (see the module docstring); ``serving()``: whether this process
    serves in the group, not handing over."""
    failed_for: int | None = None  # a standby it could not write them for: not tried again
    while True:
        await asyncio.sleep(SPILL_POLL_S)
        standby = files.read_standby()
        if not serving() or standby is None:
            continue
        state, pid = standby
        if state != "warming" or pid in (os.getpid(), failed_for) or files.read_spilled(pid) is not None:
            continue
        try:
            await _spill(files, engine, note, worker_id, pid)
        except Exception:  # the standby then recomputes, as without a disk tier
            log.exception("%s: writing the prefixes for standby pid %d failed", worker_id, pid)
            failed_for = pid


async def _spill(
    files: WorkerFiles, engine: RankingEngine, note: Callable[..., None], worker_id: str, standby_pid: int
) -> None:
    t0 = time.monotonic()
    store = engine.store
    if store is None:  # a baseline worker caches nothing
        report: dict[str, object] = {"folder": None, "model_version": engine.model.model_version}
    else:
        report = await asyncio.to_thread(store.persist, SPILL_TIMEOUT_S)
    report["seconds"] = round(time.monotonic() - t0, 3)
    files.write_spilled(standby_pid, report)
    note(event="spilled_for_standby", standby_pid=standby_pid, **report)
    log.info("%s: prefixes on the disk tier for standby pid %d: %s", worker_id, standby_pid, report)


class StandbyWarmUp:
    """A standby's warm-up steps after its histories caught up (see the module docstring)."""

    def __init__(
        self,
        *,
        worker_id: str,
        settings: Settings,
        pipeline: PipelineSettings,
        files: WorkerFiles,
        generation: Path,
        engine: RankingEngine,
        handler: RankHandler,
        partitions: Partitions,
        intake: Intake,
        note: Callable[..., None],
        pid: int | None = None,
    ) -> None:
        """``pid``: the standby's process, which ``spilled.json`` names (None: this one)."""
        self.worker_id, self.settings, self.pipeline = worker_id, settings, pipeline
        self.files, self.generation, self.engine, self.handler = files, generation, engine, handler
        self.partitions, self.intake, self.note = partitions, intake, note
        self.pid = os.getpid() if pid is None else pid

    async def adopt(self) -> None:
        """Adopt the prefixes the active process wrote to its disk tier for this standby, waiting
        for them at most ``standby_adopt_wait_s``: those still valid for the histories caught up
        here. Anything wrong there: none adopted (the recent users' pre-inference computes them)."""
        spilled = await self._spilled()
        if self.engine.store is None or self.pipeline.standby_adopt_wait_s == 0:
            why = "off"
        elif spilled is None:
            why = "not_spilled_in_time"
        elif spilled.get("folder") is None:
            why = "no_disk_tier"
        else:
            try:
                got = await asyncio.to_thread(self._adopt_from, Path(str(spilled["folder"])))
            except Exception as e:  # never fails the standby: it recomputes instead
                log.warning("%s (standby): adopting prefixes failed", self.worker_id, exc_info=True)
                why = f"error: {e}"
            else:
                self.note(event="standby_adopted", **got.fields(), spilled=spilled.get("prefixes"))
                log.info("%s (standby): adopted prefixes: %s", self.worker_id, got.fields())
                return
        self.note(event="standby_adopted", adopted=0, why=why)
        log.info("%s (standby): adopted no prefixes (%s)", self.worker_id, why)

    async def _spilled(self) -> dict | None:
        """A fresh ``spilled.json`` of the active process for this standby (it writes one as the
        standby starts, and another once this one is removed); None after ``standby_adopt_wait_s``
        (or at once where this standby adopts nothing)."""
        if self.engine.store is None or self.pipeline.standby_adopt_wait_s == 0:
            return None
        self.files.clear_spilled()  # asks for what the active process computed since its first one
        deadline = time.monotonic() + self.pipeline.standby_adopt_wait_s
        while (spilled := self.files.read_spilled(self.pid)) is None and time.monotonic() < deadline:
            await asyncio.sleep(SPILLED_POLL_S)
        return spilled

    def _adopt_from(self, folder: Path) -> Adoption:
        """``adopt_prefixes`` from the old generation's disk tier (read-only; blocking)."""
        store = self.engine.store
        assert store is not None
        own = self.generation / "adopting"  # the read-only view's own files: this generation's

        def history_of(user_id: int | str) -> Events:
            return self.handler.served_history(str(user_id), math.inf).events

        try:
            with DiskSnapshot(folder, own) as view:
                return adopt_prefixes(view, store, history_of)
        finally:
            shutil.rmtree(own, ignore_errors=True)

    async def warm_recent_users(self, partitions: list[int]) -> int:
        """Pre-infer, for each user whose prefill signal came within ``standby_warm_s`` (the users
        the active process keeps warm), its latest one, on the caught-up history. Returns how
        many users. Their other signals are device hits then."""
        signals = [TopicPartition(self.partitions.sig, p) for p in partitions]
        latest = {}
        reader = new_consumer(self.settings, group_id=None)
        await reader.start()
        try:
            reader.assign(signals)
            since = int((time.time() - self.pipeline.standby_warm_s) * 1000)
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
                            s = decode_keyed(PrefillSignal, m.key, m.value, self.settings.max_message_bytes)
                            latest[s.user_id] = (tp.partition, s)
                for tp in list(todo):
                    if await reader.position(tp) >= todo[tp]:
                        del todo[tp]
        finally:
            await reader.stop()
        prefills = (self.handler.prefill(s, p) for p, s in latest.values())
        await asyncio.gather(*prefills, return_exceptions=True)
        return len(latest)

    async def signals_handled(self, partitions: list[int]) -> None:
        """Wait until every prefill signal published by now is pre-inferred: its users' next
        requests find their prefixes cached, not being computed (those waited for their
        histories until now, and are the users active lately)."""
        signals = [TopicPartition(self.partitions.sig, p) for p in partitions]
        reader = self.intake.consumer
        ends = await reader.end_offsets(signals)
        for tp in signals:
            while True:
                done = self.partitions.committable({tp}).get(tp)
                if done is None and not self.partitions.pending({tp}):
                    done = await reader.position(tp)
                if done is not None and done >= ends[tp]:
                    break
                await asyncio.sleep(0.05)
