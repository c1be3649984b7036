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
- ``DeviceScheduler.promote(tag, priority, deadline)``: raise the jobs carrying ``tag``, queued or
  running chunked (priority inheritance: a ranking job that waits for a pre-inference lends it
  its urgency).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, TypeVar

T = TypeVar("T")


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


class DeviceScheduler:
    def __init__(self, name: str = "device", on_start: Callable[[], Any] | None = None) -> None:
        """``on_start`` runs first on the device thread: per-thread set-up such as
        ``torch.set_num_threads`` (torch's CPU thread count is per OS thread, so setting it on the
        main thread leaves this one at every core)."""
        self._on_start = on_start
        self._heap: list[tuple[int, float, int, _Job]] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        self._running: _Job | None = None
        self.busy_s = {Priority.RANK: 0.0, Priority.PREFILL: 0.0}
        self.jobs_done = {Priority.RANK: 0, Priority.PREFILL: 0}
        self._thread = threading.Thread(target=self._run, name=f"relaygr-{name}", daemon=True)
        self._thread.start()

    def queue_depth(self, priority: Priority | None = None) -> int:
        with self._cv:
            return sum(1 for *_, j in self._heap if priority is None or j.priority == priority)

    def submit(
        self, fn: Callable[[], T], *, priority: Priority, deadline: float = math.inf, tag: Any = None
    ) -> asyncio.Future[T]:
        return self._submit(fn, priority, deadline, tag, steps=False)

    def submit_steps(
        self, steps: Iterator[T | None], *, priority: Priority, deadline: float = math.inf, tag: Any = None
    ) -> asyncio.Future[T]:
        return self._submit(lambda: next(steps), priority, deadline, tag, steps=True)

    def _submit(self, fn: Callable[[], Any], priority: Priority, deadline: float, tag: Any, *, steps: bool):
        loop = asyncio.get_running_loop()
        job = _Job(int(priority), deadline, fn, loop.create_future(), loop, tag, steps, next(self._seq))
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
        if tag is None:
            return 0
        with self._cv:
            hit = 0
            for _, _, _, job in self._heap:
                if job.tag == tag:
                    job.priority, job.deadline = min(job.priority, int(priority)), min(job.deadline, deadline)
                    hit += 1
            if hit:
                self._heap = [(j.priority, j.deadline, seq, j) for _, _, seq, j in self._heap]
                heapq.heapify(self._heap)
            run = self._running
            if run is not None and run.steps and run.tag == tag:  # its next step goes in raised
                run.priority, run.deadline = min(run.priority, int(priority)), min(run.deadline, deadline)
                hit += 1
            return hit

    def _run(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                *_, job = heapq.heappop(self._heap)
                self._running = job
            if job.fut.cancelled():
                continue
            prio = Priority(job.priority)
            t0 = time.perf_counter()
            try:
                result, exc = job.fn(), None
            except BaseException as e:  # handed to the awaiting coroutine
                result, exc = None, e
            self.busy_s[prio] += time.perf_counter() - t0
            with self._cv:
                self._running = None
                if job.steps and exc is None and result is None and not self._closed:
                    self._push(job)  # next step, before anything else is picked
                    continue
            self.jobs_done[prio] += 1
            job.loop.call_soon_threadsafe(_settle, job.fut, result, exc)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            pending, self._heap = self._heap, []
            self._cv.notify_all()
        for *_, job in pending:
            job.loop.call_soon_threadsafe(_settle, job.fut, None, SchedulerClosed("device scheduler closed"))
        self._thread.join(timeout=30)


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
