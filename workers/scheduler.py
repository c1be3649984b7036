"""The device scheduler: one thread runs all model work of one device, most urgent job first.

Primitives:
- ``Priority``: ``RANK`` jobs run before ``PREFILL`` jobs; within a priority, earlier deadline first.
- ``DeviceScheduler.submit(fn, priority, deadline)``: awaitable result of ``fn()`` run on the
  device thread. A device is a serial resource, so one thread owns it; the asyncio loop that
  consumes Kafka never blocks on model work.

Long pre-inference is submitted as a chain of chunk jobs (see ``RankingEngine``), so a ranking
job that arrives meanwhile waits for at most one chunk.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable
from enum import IntEnum
from typing import Any, TypeVar

T = TypeVar("T")


class Priority(IntEnum):
    RANK = 0
    PREFILL = 1


class SchedulerClosed(RuntimeError):
    pass


class DeviceScheduler:
    def __init__(self, name: str = "device") -> None:
        self._heap: list[
            tuple[int, float, int, Callable[[], Any], asyncio.Future, asyncio.AbstractEventLoop]
        ] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        self.busy_s = {Priority.RANK: 0.0, Priority.PREFILL: 0.0}
        self.jobs_done = {Priority.RANK: 0, Priority.PREFILL: 0}
        self._thread = threading.Thread(target=self._run, name=f"relaygr-{name}", daemon=True)
        self._thread.start()

    def queue_depth(self, priority: Priority | None = None) -> int:
        with self._cv:
            return sum(1 for j in self._heap if priority is None or j[0] == priority)

    def submit(
        self, fn: Callable[[], T], *, priority: Priority, deadline: float = math.inf
    ) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        with self._cv:
            if self._closed:
                raise SchedulerClosed("device scheduler is closed")
            heapq.heappush(self._heap, (int(priority), deadline, next(self._seq), fn, fut, loop))
            self._cv.notify()
        return fut

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                prio, _, _, fn, fut, loop = heapq.heappop(self._heap)
            if fut.cancelled():
                continue
            t0 = time.perf_counter()
            try:
                result, exc = fn(), None
            except BaseException as e:  # handed to the awaiting coroutine
                result, exc = None, e
            self.busy_s[Priority(prio)] += time.perf_counter() - t0
            self.jobs_done[Priority(prio)] += 1
            loop.call_soon_threadsafe(_settle, fut, result, exc)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            pending, self._heap = self._heap, []
            self._cv.notify_all()
        for *_, fut, loop in pending:
            loop.call_soon_threadsafe(_settle, fut, None, SchedulerClosed("device scheduler closed"))
        self._thread.join(timeout=30)


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
