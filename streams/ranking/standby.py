"""A standby ranking worker: the replacement that takes over a running worker's partitions with no
process start on the request path (make before break, under the same static member id). This
module drives it through the hand-over's states (``streams.ranking.hand_over.HandOver``, which
holds the table of them):

1. Stand by (``warming``). With the model loaded and the device warmed up, it reads the partitions
   the active process owns (``assignment.json``) with a consumer outside the group: it rebuilds
   their histories from ``routed-behaviors`` into a fresh state generation; requests are fetched
   from then on and kept, never ranked; signals stay unfetched until the histories are caught up
   (a prefix of a partial history would need extending later). Then it adopts the prefixes the
   active process holds and pre-infers its recent users (``streams.ranking.standby_warmup``), and
   once every signal published by then is handled: ``ready``.
2. Take over (``serving_outside``). The active process, told to hand over (SIGUSR1), leaves in
   ``handover.json`` the first offset of each partition it did not take, finishes what it holds,
   commits, and says they are answered. The standby ranks the requests of those partitions from
   exactly there, at once, still outside the group (it fetched them already). An active process
   that exits without handing over hands over nothing: the group's committed offsets say where to
   go on.
3. Join (``joined``). It joins the group with the same ``group_instance_id``: the coordinator
   replaces the old member and hands back the same assignment, with no rebalance. Once the old
   process has answered (or is gone without saying so: its unanswered requests are ranked again,
   ``unanswered`` in ``events.jsonl``), between two fetches the worker switches to the group's
   consumer and commits. Its state generation becomes the current one, and the old one is deleted
   once the old process is gone; then it serves the metrics on the old process's port.

A standby warms up at the lowest CPU priority (nice 19, ``STANDBY_NICE``, where it may come back
to the worker's level at the hand-over; ``relaygr up`` lowers it from its first instruction on),
and its device thread rests after each pre-inference turn as long as the turn took
(``WARM_REST_RATIO``; the scheduler's ``pace``): it runs on the cores of the workers serving beside
it, has no deadline, and must not slow them. While it stands by, its lines in ``events.jsonl``
say ``"standby": true`` (its pre-inferences are for requests the active process ranks).

Primitives: ``Standby(...)`` (``start()`` before the worker's loop, ``take_over()`` beside it);
``stand_aside(settings, worker_id)``, the standby's first step: every thread at ``STANDBY_NICE``,
and the level to serve at.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from relaygr.infra.settings import Settings
from relaygr.streams.ranking.hand_over import HandOver, alive
from relaygr.streams.ranking.intake import Intake
from relaygr.streams.ranking.standby_warmup import StandbyWarmUp
from relaygr.streams.ranking.worker_files import WorkerFiles
from relaygr.streams.state_lineage import deployment_dir
from relaygr.workers.engine.cores import may_renice_to, nice_tasks
from relaygr.workers.engine.ranker import RankingEngine

log = logging.getLogger(__name__)

POLL_S = 0.005  # how often the hand-over file is looked for: the gap it adds to a hand-over
STANDBY_NICE = 19  # the nice level while standing by: the lowest
WARM_REST_RATIO = 1.0  # while standing by, the device thread rests this × each pre-inference turn
OLD_EXIT_WAIT_S = 120.0  # the most the old process's exit is waited for before its state is deleted


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


class Standby:
    """Stands by for the active process of its worker id, takes over from it, joins the group."""

    def __init__(
        self,
        *,
        worker_id: str,
        machine: HandOver,
        warm_up: StandbyWarmUp,
        files: WorkerFiles,
        engine: RankingEngine,
        intake: Intake,
        metrics_port: int = 0,
        serve_nice: int | None = None,
    ) -> None:
        self.worker_id, self.machine, self.warm_up, self.files = worker_id, machine, warm_up, files
        self.engine, self.intake = engine, intake
        self.metrics_port = metrics_port
        self.serve_nice = serve_nice  # the level to come back to at the hand-over (``stand_aside``)
        self.pid = os.getpid()

    async def start(self) -> None:
        """Before the worker's loop: warm up the device, read the active process's partitions."""
        self.machine.warm()
        # Warming up beside the serving workers, on their cores (at STANDBY_NICE since
        # ``stand_aside``): pre-inference has no deadline here, so it leaves them the CPU.
        self.engine.scheduler.pace(WARM_REST_RATIO)
        took = await self.engine.warm_up()
        log.info("%s (standby): warmed up the device in %.2f s", self.worker_id, took)
        partitions = await self._active_partitions()
        await self.intake.start_outside()
        await self.machine.stand_by(partitions)

    async def _active_partitions(self) -> list[int]:
        """The partitions the active process owns (it writes them at every assignment)."""
        while (partitions := self.files.read_assignment()) is None:
            await asyncio.sleep(0.1)
        return partitions

    async def take_over(self) -> None:
        """Beside the worker's loop: warm the cache, wait for the hand-over, take over, join."""
        machine = self.machine
        t0 = time.monotonic()
        await machine.caught_up()
        await self.warm_up.adopt()
        warmed = await self.warm_up.warm_recent_users(machine.outside)
        log.info("%s (standby): pre-inferred the prefixes of %d users active lately", self.worker_id, warmed)
        machine.warmed()
        await self.warm_up.signals_handled(machine.outside)  # those of the catch-up time too
        machine.ready(time.monotonic() - t0)
        offsets, old_pid = await self._handed_over()
        t_handover = time.monotonic()
        if self.serve_nice is not None:
            nice_tasks(self.pid, self.serve_nice)
        await machine.take_over(offsets, old_pid)
        group = await self.intake.join(machine)
        log.info(
            "%s: joined the group %.2f s after the hand-over", self.worker_id, time.monotonic() - t_handover
        )
        machine.joined(group)
        await machine.wait_joined()
        await self._after_old_exit(old_pid)

    async def _handed_over(self) -> tuple[dict[str, dict[int, int]], int | None]:
        """The hand-over's offsets and the pid that handed over. An active process that exits
        without handing over (a crash) hands over nothing: the group's committed offsets then
        say where to go on, once this process has joined."""
        active = self.files.active_pid()
        checked = time.monotonic()
        while (handover := self.files.read_handover()) is None:
            await asyncio.sleep(POLL_S)
            if active is not None and time.monotonic() - checked > 0.5:
                checked = time.monotonic()
                if not alive(active):
                    log.warning("%s (standby): pid %d exited without handing over", self.worker_id, active)
                    return {}, None
        return handover

    async def _after_old_exit(self, old_pid: int | None) -> None:
        """Once the old process has exited: delete its state, serve the metrics on its port."""
        deadline = time.monotonic() + OLD_EXIT_WAIT_S
        while old_pid is not None and time.monotonic() < deadline:
            if not alive(old_pid):
                break
            await asyncio.sleep(0.2)
        else:
            if old_pid is not None:
                log.warning("%s: pid %d still there; its state is kept", self.worker_id, old_pid)
                return
        removed = self.files.remove_stale_generations()
        log.info("%s: removed the old state %s", self.worker_id, [p.name for p in removed])
        if self.metrics_port:
            from relaygr.streams.common import serve_metrics

            for _ in range(50):  # the port may linger a moment after its process
                with contextlib.suppress(OSError):
                    serve_metrics(self.metrics_port)
                    return
                await asyncio.sleep(0.2)
            log.warning("%s: metrics port %d stays busy", self.worker_id, self.metrics_port)
