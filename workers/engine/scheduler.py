"""The device scheduler: one thread runs all model work of one device, most urgent job first.

Primitives:
- ``Priority``: ``RANK`` jobs run before ``PREFILL`` jobs; within a priority, earlier deadline first.
- ``DeviceScheduler.submit(fn, priority, deadline, tag)``: awaitable result of ``fn()`` run on the
  device thread. A device is a serial resource, so one thread owns it; the asyncio loop that
  consumes Kafka never blocks on model work.
- ``DeviceScheduler.submit_steps(steps, priority, deadline, tag)``: a chunked job (pre-inference):
  one ``next(steps)`` per turn until it yields a result. Between two steps the device takes any
  more urgent queued job, so a ranking job waits for at most one chunk; the next step is queued
  by the device thread itself, so a chunked job never loses its turn to a less urgent one.
- ``submit_steps(..., yields=True)``: a chunked job that lets the jobs waiting at each chunk
  boundary go first (chunked prefill as in LLM serving: a miss's full ranking is a long job at
  ranking priority; the short relay rankings that arrived during a chunk run before its next one,
  whatever their deadlines). Only the jobs queued at the boundary go ahead, so the chunked job
  still gets a chunk per round and cannot starve. Two yielding jobs take turns a chunk each: a
  short sliced ranking never waits for all of a heavy user's long one.
- ``DeviceScheduler.ranking()``: whether ranking-priority work is on the device or queued for it
  (background work on other threads of the process, such as applying a burst of behaviours,
  waits meanwhile: it holds the interpreter the device thread needs between tensor ops).
- ``DeviceScheduler.promote(tag, priority, deadline)``: raise the jobs carrying ``tag``, queued or
  running chunked (priority inheritance: a ranking job that waits for a pre-inference lends it
  its urgency).
- ``DeviceScheduler.restore(tag, priority, deadline)``: set the jobs carrying ``tag`` back to
  ``priority`` and ``deadline`` (the waiter that lent its urgency gave up: a deadline must not be
  spent on work that can no longer meet it).
- ``DeviceScheduler.submit_batched(item, run_batch, key, ...)``: a job that may share its turn.
  When it runs, the queued jobs with the same ``key`` (up to ``limit`` in all) run with it as one
  call ``run_batch([items])``, which returns one result per item (dynamic batching: it happens
  only when such jobs wait, i.e. under load). With a ``pool``, the queued jobs of that pool under
  other keys join too, most urgent first, while their ``cost`` fits the first job's ``budget``
  (tuples of as many measures: a batch must fit in each)
  (several users' rankings in one forward); ``wait_s``: the device first waits that long for
  more of them while the batch has room (0: never waits).
- ``DeviceScheduler.pace(rest_ratio)``: after each turn of pre-inference the device thread rests
  ``rest_ratio`` times as long as the turn took, cut short as soon as a ranking job is queued
  (0, the default: no rest). Work with no deadline (a standby warming up beside serving workers
  on shared cores) leaves them the CPU that way.
- ``DeviceScheduler.reserve(prefill_share)``: while pre-inference has work queued, it gets at
  least this share of the device's recent time (``SHARE_WINDOW_S``), whatever rankings are queued:
  under a steady load of rankings at least one pre-inference progresses, and its user's next
  visits find the prefix cached. A ranking waits for at most one chunk of it.
  ``recent_share(priority)``: that measured share.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, TypeVar

T = TypeVar("T")
# The window (time constant, seconds) over which ``reserve`` measures each priority's device share.
SHARE_WINDOW_S = 1.0


class Priority(IntEnum):
    RANK = 0
    PREFILL = 1


class SchedulerClosed(RuntimeError):
    pass


@dataclass
class _Job:
    priority: int
    deadline: float
    fn: Callable[[], Any]
    fut: asyncio.Future
    loop: asyncio.AbstractEventLoop
    tag: Any = None
    steps: bool = False  # fn() returning None means "not finished: run me again"
    seq: int = 0  # submission order: ties go to the older job, whatever step it is at
    batch_key: Any = None  # jobs with one key may run together (submit_batched)
    item: Any = None
    run_batch: Callable[[list[Any]], list[Any]] | None = None
    limit: int = 1
    pool: Any = None  # jobs of one pool may run together whatever their keys, within a budget
    cost: tuple[int, ...] = ()
    budget: tuple[int, ...] = ()
    wait_s: float = 0.0
    yields: bool = False  # a chunked job that lets the jobs waiting at a chunk boundary go first
    wait_for: set[int] = field(default_factory=set)  # seqs of the jobs a parked step waits for


class DeviceScheduler:
    def __init__(
        self,
        name: str = "device",
        on_start: Callable[[], Any] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``on_start`` runs first on the device thread: per-thread set-up such as
        ``torch.set_num_threads`` (torch's CPU thread count is per OS thread, so setting it on the
        main thread leaves this one at every core). ``clock``: the device seconds jobs are
        measured in (tests give a clock their jobs advance, so shares do not depend on the machine)."""
        self._on_start = on_start
        self._heap: list[tuple[int, float, int, _Job]] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        self._running: _Job | None = None
        # Yielding chunked jobs between two steps, until the jobs queued at their boundary ran.
        self._parked: list[_Job] = []
        self.busy_s = {Priority.RANK: 0.0, Priority.PREFILL: 0.0}
        # The device thread's CPU time in those jobs: on a CPU device, the work itself, without
        # the time other processes of a shared machine took the core away.
        self.cpu_s = {Priority.RANK: 0.0, Priority.PREFILL: 0.0}
        self.jobs_done = {Priority.RANK: 0, Priority.PREFILL: 0}
        self.batches_run = 0  # turns that ran more than one batched job
        self.rest_ratio = 0.0  # see pace()
        self._rest_until = 0.0  # monotonic end of the rest owed (device thread only)
        self.prefill_share = 0.0  # see reserve()
        self.share_picks = 0  # pre-inference turns taken ahead of queued rankings by reserve()
        # Device seconds per priority, decayed over SHARE_WINDOW_S (device thread writes).
        self._recent = {Priority.RANK: 0.0, Priority.PREFILL: 0.0}
        self._clock = clock  # device seconds: what jobs took and the decay of their shares
        self._recent_at = clock()
        self._thread = threading.Thread(target=self._run, name=f"relaygr-{name}", daemon=True)
        self._thread.start()

    def queue_depth(self, priority: Priority | None = None) -> int:
        with self._cv:
            jobs = [j for *_, j in self._heap] + self._parked
            return sum(1 for j in jobs if priority is None or j.priority == priority)

    def ranking(self) -> bool:
        """Whether a ranking-priority job is on the device or waiting for it."""
        running = self._running
        return (running is not None and running.priority == Priority.RANK) or self.queue_depth(
            Priority.RANK
        ) > 0

    def submit(
        self, fn: Callable[[], T], *, priority: Priority, deadline: float = math.inf, tag: Any = None
    ) -> asyncio.Future[T]:
        return self._submit(fn, priority, deadline, tag, steps=False)

    def submit_steps(
        self,
        steps: Iterator[T | None],
        *,
        priority: Priority,
        deadline: float = math.inf,
        tag: Any = None,
        yields: bool = False,
    ) -> asyncio.Future[T]:
        """A chunked job: one ``next(steps)`` per turn until it yields a result. ``yields``: at
        each chunk boundary, the jobs then queued at this priority or above run before the next
        chunk (a yielding one for one chunk of its own), whatever their deadlines."""
        return self._submit(lambda: next(steps), priority, deadline, tag, steps=True, yields=yields)

    def submit_batched(
        self,
        item: Any,
        run_batch: Callable[[list[Any]], list[T]],
        *,
        key: Any,
        priority: Priority,
        deadline: float = math.inf,
        limit: int = 8,
        pool: Any = None,
        cost: tuple[int, ...] = (),
        budget: tuple[int, ...] = (),
        wait_s: float = 0.0,
    ) -> asyncio.Future[T]:
        """Awaitable result for ``item``: ``run_batch(items)[i]`` where ``items`` holds this job's
        item and those of the other queued jobs with the same ``key`` (at most ``limit``), run in
        one turn of the device. With a ``pool``, queued jobs of the pool under other keys join
        while the summed ``cost`` stays within ``budget`` (see the module docstring). The batch
        runs the ``run_batch`` of the job picked first; an exception it raises goes to every job
        of the batch (a ``run_batch`` that isolates its items returns their errors instead)."""
        if key is None or limit < 1:
            raise ValueError("submit_batched needs a key and a positive limit")
        if len(cost) != len(budget) or min((*cost, *budget, wait_s), default=0) < 0:
            raise ValueError(f"submit_batched: cost={cost}, budget={budget}, wait_s={wait_s} must be >= 0")
        return self._submit(
            lambda: run_batch([item])[0],
            priority,
            deadline,
            None,
            steps=False,
            batch=(key, item, run_batch, limit),
            pool=(pool, cost, budget, wait_s),
        )

    def _submit(
        self,
        fn: Callable[[], Any],
        priority: Priority,
        deadline: float,
        tag: Any,
        *,
        steps: bool,
        batch: tuple[Any, Any, Callable[[list[Any]], list[Any]], int] | None = None,
        yields: bool = False,
        pool: tuple[Any, tuple[int, ...], tuple[int, ...], float] | None = None,
    ):
        loop = asyncio.get_running_loop()
        job = _Job(int(priority), deadline, fn, loop.create_future(), loop, tag, steps, next(self._seq))
        job.yields = yields and steps
        if batch is not None:
            job.batch_key, job.item, job.run_batch, job.limit = batch
        if pool is not None:
            job.pool, job.cost, job.budget, job.wait_s = pool
        with self._cv:
            if self._closed:
                raise SchedulerClosed("device scheduler is closed")
            self._push(job)
            self._cv.notify()
        return job.fut

    def _push(self, job: _Job) -> None:
        heapq.heappush(self._heap, (job.priority, job.deadline, job.seq, job))

    def promote(self, tag: Any, priority: Priority, deadline: float = math.inf) -> int:
        """Raise the jobs tagged ``tag`` to at least ``priority`` and ``deadline``: the queued ones,
        and a chunked one between two of its steps. Returns how many were found."""
        return self._retag(tag, lambda j: (min(j.priority, int(priority)), min(j.deadline, deadline)))

    def restore(self, tag: Any, priority: Priority, deadline: float = math.inf) -> int:
        """Set the jobs tagged ``tag`` (queued, or chunked between two steps) to exactly
        ``priority`` and ``deadline``. Returns how many were found."""
        return self._retag(tag, lambda _j: (int(priority), deadline))

    def _retag(self, tag: Any, new: Callable[[_Job], tuple[int, float]]) -> int:
        """Give every job tagged ``tag`` (queued, or the running chunked one, whose next step goes
        in with it) the ``(priority, deadline)`` that ``new(job)`` says; keeps the heap in order."""
        if tag is None:
            return 0
        with self._cv:
            hit = 0
            for _, _, _, job in self._heap:
                if job.tag == tag:
                    job.priority, job.deadline = new(job)
                    hit += 1
            if hit:
                self._heap = [(j.priority, j.deadline, seq, j) for _, _, seq, j in self._heap]
                heapq.heapify(self._heap)
            for job in [self._running, *self._parked]:
                if job is not None and job.steps and job.tag == tag:
                    job.priority, job.deadline = new(job)
                    hit += 1
            self._cv.notify_all()  # a rest after the running job ends once it is urgent
            return hit

    def pace(self, rest_ratio: float) -> None:
        """Rest ``rest_ratio`` × each pre-inference turn's time after it (0: never)."""
        if rest_ratio < 0:
            raise ValueError(f"rest_ratio must be >= 0, got {rest_ratio}")
        with self._cv:
            self.rest_ratio = rest_ratio
            self._cv.notify_all()

    def reserve(self, prefill_share: float) -> None:
        """Give pre-inference at least ``prefill_share`` of the recent device time while it has
        work queued (0: rankings always first)."""
        if not 0 <= prefill_share < 1:
            raise ValueError(f"prefill_share must be in [0, 1), got {prefill_share}")
        with self._cv:
            self.prefill_share = prefill_share

    def recent_share(self, priority: Priority) -> float:
        """The share of the device's recent busy time (``SHARE_WINDOW_S``) that ``priority`` got."""
        total = sum(self._recent.values())
        return self._recent[priority] / total if total > 0 else 0.0

    def _account(self, prio: Priority, took: float) -> None:
        """Add ``took`` device seconds to ``prio``'s decayed recent time (device thread only)."""
        now = self._clock()
        decay = math.exp(-(now - self._recent_at) / SHARE_WINDOW_S)
        self._recent_at = now
        for p in self._recent:
            self._recent[p] *= decay
        self._recent[prio] += took

    def _pop(self) -> _Job:
        """The next job: the most urgent, unless pre-inference is owed its share (``reserve``) and
        has work queued, then its most urgent job. Called with the lock held."""
        top = self._heap[0][3]
        owed = (
            top.priority != Priority.PREFILL
            and self.prefill_share > 0
            and self.recent_share(Priority.PREFILL) < self.prefill_share
        )
        waiting = [e for e in self._heap if e[0] == Priority.PREFILL] if owed else []
        if not waiting:
            return heapq.heappop(self._heap)[3]
        pick = min(waiting)
        self._heap.remove(pick)
        heapq.heapify(self._heap)
        self.share_picks += 1
        return pick[3]

    def _rest(self) -> None:
        """The rest ``pace`` asked for after the last pre-inference turn, before the next job is
        picked. A ranking job queued (or a queued step promoted to one) runs meanwhile, and the
        rest goes on after it; ``pace(0)`` or ``close`` ends it."""
        left = self._rest_until - time.monotonic()
        if left > 0:
            with self._cv:
                self._cv.wait_for(self._rest_ends, timeout=left)

    def _rest_ends(self) -> bool:
        """Called with the lock held."""
        return self._closed or self.rest_ratio <= 0 or any(e[0] == Priority.RANK for e in self._heap)

    def _run(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while True:
            self._rest()
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                job = self._pop()
                self._running = job
                if job.pool is not None and job.wait_s > 0:
                    self._wait_for_mates(job)
                mates = self._take_batch(job) if job.batch_key is not None else []
                self._unpark({job.seq, *(m.seq for m in mates)})
            if mates:
                self._run_batch([job, *mates])
                continue
            if job.fut.cancelled():
                continue
            prio = Priority(job.priority)
            t0, c0 = self._clock(), time.thread_time()
            try:
                result, exc = job.fn(), None
            except BaseException as e:  # handed to the awaiting coroutine
                result, exc = None, e
            took = self._clock() - t0
            self.busy_s[prio] += took
            self.cpu_s[prio] += time.thread_time() - c0
            self._account(prio, took)
            if prio == Priority.PREFILL:  # rested after its result is out, before the next turn
                self._rest_until = time.monotonic() + took * self.rest_ratio
            with self._cv:
                self._running = None
                if job.steps and exc is None and result is None and not self._closed:
                    ahead = self._waiting_ahead(job) if job.yields else set()
                    if ahead:  # those run first; the next step goes in once they have
                        job.wait_for = ahead
                        self._parked.append(job)
                    else:
                        self._push(job)  # next step, before anything else is picked
                    continue
            self.jobs_done[prio] += 1
            job.loop.call_soon_threadsafe(_settle, job.fut, result, exc)

    def _waiting_ahead(self, job: _Job) -> set[int]:
        """The queued jobs a yielding ``job`` lets go first at its chunk boundary: those at its
        priority or above (a yielding one runs a chunk, then parks in turn: the two alternate).
        Called with the lock held."""
        return {seq for prio, _, seq, j in self._heap if prio <= job.priority}

    def _unpark(self, taken: set[int]) -> None:
        """Jobs ``taken`` off the queue: parked steps that waited only for them go back in.
        Called with the lock held."""
        if not self._parked:
            return
        still: list[_Job] = []
        for p in self._parked:
            p.wait_for -= taken
            if p.wait_for:
                still.append(p)
            else:
                self._push(p)
        self._parked = still

    def _pool_full(self, job: _Job) -> bool:
        """Whether ``job`` and the queued jobs of its pool reach its budget in some measure.
        Called with the lock held."""
        costs = [j.cost for *_, j in self._heap if j.pool == job.pool]
        return any(sum(c[d] for c in costs) + job.cost[d] >= b for d, b in enumerate(job.budget))

    def _wait_for_mates(self, job: _Job) -> None:
        """Wait up to ``job.wait_s`` for more jobs of ``job``'s pool while they leave room in its
        budget (the batch is not full yet). Called with the lock held; ``wait_for`` releases it."""
        self._cv.wait_for(lambda: self._closed or self._pool_full(job), timeout=job.wait_s)

    def _take_batch(self, job: _Job) -> list[_Job]:
        """Remove and return the queued jobs that share ``job``'s batch key (oldest first, at most
        ``job.limit - 1``), then those of its pool that fit its budget (``_pool_mates``). Called
        with the lock held."""
        mates = sorted(
            (j for *_, j in self._heap if j.batch_key == job.batch_key and not j.fut.cancelled()),
            key=lambda j: j.seq,
        )[: job.limit - 1]
        if job.pool is not None:
            mates += self._pool_mates(job, mates)
        if mates:
            taken = {id(j) for j in mates}
            self._heap = [e for e in self._heap if id(e[3]) not in taken]
            heapq.heapify(self._heap)
        return mates

    def _pool_mates(self, job: _Job, taken: list[_Job]) -> list[_Job]:
        """The queued jobs of ``job``'s pool under other keys, most urgent first, that fit in what
        ``job`` and ``taken`` leave of ``job.budget``; each key keeps to its own job's limit.
        Called with the lock held."""
        left = [b - job.cost[d] - sum(j.cost[d] for j in taken) for d, b in enumerate(job.budget)]
        per_key = {job.batch_key: 1 + len(taken)}
        out: list[_Job] = []
        for *_, j in sorted(self._heap):
            if j.pool != job.pool or j.batch_key == job.batch_key or j.fut.cancelled():
                continue
            if any(c > room for c, room in zip(j.cost, left, strict=True)):
                continue
            if per_key.get(j.batch_key, 0) >= j.limit:
                continue
            out.append(j)
            left = [room - c for c, room in zip(j.cost, left, strict=True)]
            per_key[j.batch_key] = per_key.get(j.batch_key, 0) + 1
        return out

    def _run_batch(self, jobs: list[_Job]) -> None:
        jobs = [j for j in jobs if not j.fut.cancelled()]
        if not jobs:
            with self._cv:
                self._running = None
            return
        prio = Priority(min(j.priority for j in jobs))
        t0, c0 = self._clock(), time.thread_time()
        assert jobs[0].run_batch is not None
        try:
            results, exc = jobs[0].run_batch([j.item for j in jobs]), None
            if len(results) != len(jobs):
                raise RuntimeError(f"run_batch returned {len(results)} results for {len(jobs)} items")
        except BaseException as e:
            results, exc = [None] * len(jobs), e
        took = self._clock() - t0
        self.busy_s[prio] += took
        self.cpu_s[prio] += time.thread_time() - c0
        self._account(prio, took)
        with self._cv:
            self._running = None
        self.jobs_done[prio] += len(jobs)
        self.batches_run += 1
        for j, r in zip(jobs, results, strict=True):
            j.loop.call_soon_threadsafe(_settle, j.fut, r, exc)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            pending = [j for *_, j in self._heap] + self._parked
            self._heap, self._parked = [], []
            self._cv.notify_all()
        for job in pending:
            job.loop.call_soon_threadsafe(_settle, job.fut, None, SchedulerClosed("device scheduler closed"))
        self._thread.join(timeout=30)


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
