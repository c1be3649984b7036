"""Ranking jobs on the device scheduler, timed into a ranking's latency breakdown.

Primitives:
- ``run_job(scheduler, fn, deadline, breakdown)``: ``fn()`` as one ranking job; ``breakdown`` gets
  ``device_queue`` (waiting for the device) and ``compute`` (the call), in ms.
- ``run_steps(scheduler, steps, deadline, breakdown)``: a step iterator as a chunked ranking job that
  yields at every step (``DeviceScheduler.submit_steps``); ``breakdown`` gets ``device_queue``,
  ``compute`` (its steps' own time) and ``between_slices`` (other jobs' steps run between two of
  its own). Returns the last step's result.
- ``run_in_burst(scheduler, model, prefix, ...)``: a relay ranking that keeps its suffix,
  batched with the same user's rankings waiting for the device against the same prefix.

Each times with ``timer`` (monotonic seconds; ``time.perf_counter`` unless a test simulates one).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from relaygr.workers.engine.scheduler import DeviceScheduler, Priority
from relaygr.workers.model.model import HSTURanker
from relaygr.workers.prefix_kv import Events, PrefixKV

T = TypeVar("T")
_NEVER = object()  # sentinel of ``iter(step, _NEVER)``: a step function as a step iterator
Grow = Callable[[], PrefixKV]


async def run_job(
    scheduler: DeviceScheduler,
    fn: Callable[[], T],
    deadline: float,
    breakdown: dict[str, float],
    timer: Callable[[], float] = time.perf_counter,
) -> T:
    """``fn()`` as a ranking job on the device thread (``breakdown``: see the module docstring)."""
    timing: list[float] = []
    t_submit = timer()

    def job() -> T:
        t0 = timer()
        out = fn()
        timing.extend((t0, timer()))
        return out

    out = await scheduler.submit(job, priority=Priority.RANK, deadline=deadline)
    breakdown["device_queue"] = (timing[0] - t_submit) * 1000
    breakdown["compute"] = (timing[1] - timing[0]) * 1000
    return out


async def run_steps(
    scheduler: DeviceScheduler,
    steps: Iterator[Any],
    deadline: float,
    breakdown: dict[str, float],
    timer: Callable[[], float] = time.perf_counter,
) -> Any:
    """``steps`` as a chunked ranking job (``breakdown``: see the module docstring)."""
    t_submit = timer()
    starts: list[float] = []
    ends: list[float] = []

    def step() -> Any:
        starts.append(timer())
        out = next(steps)
        ends.append(timer())
        return out

    out = await scheduler.submit_steps(
        iter(step, _NEVER), priority=Priority.RANK, deadline=deadline, yields=True
    )
    breakdown["device_queue"] = (starts[0] - t_submit) * 1000
    breakdown["compute"] = sum(b - a for a, b in zip(starts, ends, strict=True)) * 1000
    if len(starts) > 1:
        breakdown["between_slices"] = sum(b - a for a, b in zip(ends[:-1], starts[1:], strict=True)) * 1000
    return out


@dataclass
class _BurstItem:
    history: Events
    candidates: torch.Tensor
    request_ts: float
    submitted: float
    started: float = 0.0
    finished: float = 0.0
    batch: int = 1


async def run_in_burst(
    scheduler: DeviceScheduler,
    model: HSTURanker,
    prefix: PrefixKV,
    key: object,
    limit: int,
    history: Events,
    candidates: torch.Tensor,
    request_ts: float,
    deadline: float,
    breakdown: dict[str, float],
    timer: Callable[[], float] = time.perf_counter,
) -> tuple[torch.Tensor, Grow | None, int]:
    """``rank_and_extend`` on the device, batched (up to ``limit``, under ``key``) with the other
    rankings that wait for the device against the same cached prefix (``HSTURanker.rank_many``).
    Returns the scores, ``grow`` for the ranking that saw the longest history (``None`` for the
    others of its batch: one grown prefix per batch is stored), and the batch's size."""
    item = _BurstItem(history, candidates, request_ts, timer())

    def run(items: list[_BurstItem]) -> list[tuple[torch.Tensor, Grow | None]]:
        t0 = timer()
        if len(items) == 1:
            one = items[0]
            scores, grow = model.rank_and_extend(prefix, one.history, one.candidates, one.request_ts)
            out: list[tuple[torch.Tensor, Grow | None]] = [(scores, grow)]
        else:
            many, grow = model.rank_many(prefix, [(i.history, i.candidates, i.request_ts) for i in items])
            widest = max(range(len(items)), key=lambda k: len(items[k].history))
            out = [(sc, grow if k == widest else None) for k, sc in enumerate(many)]
        t1 = timer()
        for i in items:
            i.started, i.finished, i.batch = t0, t1, len(items)
        return out

    scores, grow = await scheduler.submit_batched(
        item, run, key=key, priority=Priority.RANK, deadline=deadline, limit=limit
    )
    breakdown["device_queue"] = (item.started - item.submitted) * 1000
    breakdown["compute"] = (item.finished - item.started) * 1000
    return scores, grow, item.batch
