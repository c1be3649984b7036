"""Ranking jobs on the device scheduler, timed into a ranking's latency breakdown.

Primitives:
- ``run_job(scheduler, fn, deadline, breakdown)``: ``fn()`` as one ranking job; ``breakdown`` gets
  ``device_queue`` (waiting for the device) and ``compute`` (the call), in ms.
- ``run_steps(scheduler, steps, deadline, breakdown)``: a step iterator as a chunked ranking job that
  yields at every step (``DeviceScheduler.submit_steps``); ``breakdown`` gets ``device_queue``,
  ``compute`` (its steps' own time) and ``between_slices`` (other jobs' steps run between two of
  its own). Returns the last step's result.
- ``run_in_burst(scheduler, runner, prefix, ...)``: a relay ranking that keeps its suffix,
  batched with the same user's rankings waiting for the device against the same prefix, and,
  given a ``RelayBatching``, with other users' relay rankings waiting for it (one
  ``ModelRunner.rank_users`` forward, within a token budget). A user of the batch that fails
  (its prefix no longer matches its history) gets its own ``RelayItemFailed``; the others rank.
- ``RelayBatching``: the cross-user pool, its budgets (tokens computed, cached events read) and
  wait, and the batch sizes seen.
- ``use_relay_graphs(runner, config)``: a relay engine's rankings in bucketed forwards that read
  the runner's pages in place, replayed from CUDA graphs (``EngineConfig.cuda_graphs``), their new
  tokens in ``graph_rows(runner, config)`` tokens of pages beside the device tier's;
  ``graph_replays(runner, cached, new, candidates)``: whether a ranking of that shape replays one.

Each times with ``timer`` (monotonic seconds; ``time.perf_counter`` unless a test simulates one).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from relaygr.workers.engine.engine_config import EngineConfig
from relaygr.workers.engine.scheduler import DeviceScheduler, Priority
from relaygr.workers.model.graph_runner import NEW_ROWS
from relaygr.workers.model.inference import UserRanking
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.prefix_kv import Events, PrefixKV

T = TypeVar("T")
_NEVER = object()  # sentinel of ``iter(step, _NEVER)``: a step function as a step iterator
Grow = Callable[[], PrefixKV]
MAX_COUNTED_BATCH = 64  # batch sizes counted one by one; larger ones count as this


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


class RelayItemFailed(RuntimeError):
    """One user's ranking of a batch failed on the device; the others of the batch ranked."""


@dataclass
class RelayBatching:
    """Relay rankings of different users that wait for the device together run as one forward of
    at most ``budget`` tokens (events new since each prefix, plus candidates) and
    ``cached_events`` cached events (their prefixes), after waiting up to ``wait_s`` for more.
    ``sizes``: device turns by how many rankings they ran (written on the device thread)."""

    budget: int
    cached_events: int
    wait_s: float = 0.0
    pool: object = "relay"
    sizes: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of(cls, config: EngineConfig) -> RelayBatching:
        """``batch_tokens``, ``batch_cached_events`` and ``batch_wait_ms`` of ``config``."""
        return cls(config.batch_tokens, config.batch_cached_events, config.batch_wait_ms / 1000)

    def count(self, size: int) -> None:
        size = min(size, MAX_COUNTED_BATCH)  # a bounded histogram for the worker's stats
        self.sizes[size] = self.sizes.get(size, 0) + 1


@dataclass
class _BurstItem:
    prefix: PrefixKV
    key: object
    history: Events
    candidates: torch.Tensor
    request_ts: float
    submitted: float
    started: float = 0.0
    finished: float = 0.0
    batch: int = 1


Ranked = tuple[torch.Tensor, Grow | None] | RelayItemFailed


def graph_rows(runner: ModelRunner, config: EngineConfig) -> int:
    """Tokens of pages the buckets' new tokens take beside the device tier's (0 without buckets):
    the grid's largest bucket's, at most ``config.graph_pool_mb`` of them."""
    enabled = config.cuda_graphs if config.mode == "relay" else False
    if enabled is None:
        enabled = runner.device.type == "cuda"
    if not enabled:
        return 0
    return min(NEW_ROWS, int(config.graph_pool_mb * 2**20) // runner.kv_layout().token_bytes)


def use_relay_graphs(runner: ModelRunner, config: EngineConfig) -> None:
    """A relay engine's rankings in bucketed forwards that read the cached prefixes in place from
    the runner's pages, their new tokens' rows at most ``config.graph_pool_mb`` of them
    (``ModelRunner.use_graph_relay``; ``config.cuda_graphs`` unset: on CUDA), replayed from CUDA
    graphs; a baseline engine's never."""
    enabled = config.cuda_graphs if config.mode == "relay" else False
    rows = int(config.graph_pool_mb * 2**20) // runner.kv_layout().token_bytes
    runner.use_graph_relay(enabled, rows_tokens=min(NEW_ROWS, rows))


def graph_replays(runner: ModelRunner, cached: int, new: int, candidates: int) -> bool:
    """Whether a relay ranking of this shape replays a captured CUDA graph (then it is never
    sliced: a replay is one launch, and slicing it ran it eagerly a layer a slice, other jobs in
    between: on an H200, 18-28 ms and up to 330 ms between slices at 9k cached events, where the
    replay takes about 3)."""
    graphs = runner.graph_relay
    return graphs is not None and graphs.replays(new, candidates, cached)


def _rank_group(runner: ModelRunner, items: list[_BurstItem]) -> list[Ranked]:
    """One user's burst against one prefix (``rank_many``): ``grow`` for the longest history."""
    many, grow = runner.rank_many(items[0].prefix, [(i.history, i.candidates, i.request_ts) for i in items])
    widest = max(range(len(items)), key=lambda k: len(items[k].history))
    return [(sc, grow if k == widest else None) for k, sc in enumerate(many)]


def _rank_alone(runner: ModelRunner, item: _BurstItem) -> Ranked:
    try:
        return runner.rank_and_extend(item.prefix, item.history, item.candidates, item.request_ts)
    except Exception as e:
        return RelayItemFailed(f"relay ranking failed: {e}")


def _rank_singles(runner: ModelRunner, items: list[_BurstItem]) -> list[Ranked]:
    """Users' rankings in one ``rank_users`` forward; one whose prefix no longer matches its
    history fails alone, and when the forward fails, each ranks alone (its own error, if any)."""
    out: list[Ranked | None] = [None] * len(items)
    ok = []
    for k, i in enumerate(items):
        if i.prefix.matches(i.history):
            ok.append(k)
        else:
            out[k] = RelayItemFailed("relay ranking failed: the prefix no longer matches the history")
    if len(ok) == 1:
        out[ok[0]] = _rank_alone(runner, items[ok[0]])
    elif ok:
        reqs = [
            UserRanking(items[k].prefix, items[k].history, items[k].candidates, items[k].request_ts)
            for k in ok
        ]
        try:
            for k, got in zip(ok, runner.rank_users(reqs), strict=True):
                out[k] = got
        except Exception:
            for k in ok:
                out[k] = _rank_alone(runner, items[k])
    return [o for o in out if o is not None]


def _rank_items(runner: ModelRunner, items: list[_BurstItem]) -> list[Ranked]:
    """The items, in order: each key's burst of several with ``rank_many``, the rest (one per
    key) together with ``rank_users``."""
    groups: dict[object, list[int]] = {}
    for k, i in enumerate(items):
        groups.setdefault(i.key, []).append(k)
    out: list[Ranked | None] = [None] * len(items)
    singles = [ks[0] for ks in groups.values() if len(ks) == 1]
    for ks in groups.values():
        if len(ks) > 1:
            try:
                got = _rank_group(runner, [items[k] for k in ks])
            except Exception as e:
                got = [RelayItemFailed(f"relay ranking failed: {e}")] * len(ks)
            for k, r in zip(ks, got, strict=True):
                out[k] = r
    for k, r in zip(singles, _rank_singles(runner, [items[k] for k in singles]), strict=True):
        out[k] = r
    assert all(o is not None for o in out)
    return out  # type: ignore[return-value]


async def run_in_burst(
    scheduler: DeviceScheduler,
    runner: ModelRunner,
    prefix: PrefixKV,
    key: object,
    limit: int,
    history: Events,
    candidates: torch.Tensor,
    request_ts: float,
    deadline: float,
    breakdown: dict[str, float],
    timer: Callable[[], float] = time.perf_counter,
    batching: RelayBatching | None = None,
) -> tuple[torch.Tensor, Grow | None, int]:
    """``rank_and_extend`` on the device, batched (up to ``limit``, under ``key``) with the other
    rankings that wait for the device against the same cached prefix (``ModelRunner.rank_many``),
    and with ``batching``, with other users' (``ModelRunner.rank_users``). Returns the scores,
    ``grow`` for the ranking that saw the longest history (``None`` for the others of its
    user's burst: one grown prefix per burst is stored), and the size of the batch it ran in.
    Raises ``RelayItemFailed`` when this ranking failed on the device."""
    item = _BurstItem(prefix, key, history, candidates, request_ts, timer())

    def run(items: list[_BurstItem]) -> list[Ranked]:
        t0 = timer()
        out = _rank_items(runner, items)
        t1 = timer()
        for i in items:
            i.started, i.finished, i.batch = t0, t1, len(items)
        if batching is not None:
            batching.count(len(items))
        return out

    pooled = {}
    if batching is not None and batching.budget > 0:
        pooled = {
            "pool": batching.pool,
            "cost": (len(history) - prefix.length + len(candidates), prefix.length),
            "budget": (batching.budget, batching.cached_events),
            "wait_s": batching.wait_s,
        }
    got = await scheduler.submit_batched(
        item, run, key=key, priority=Priority.RANK, deadline=deadline, limit=limit, **pooled
    )
    breakdown["device_queue"] = (item.started - item.submitted) * 1000
    breakdown["compute"] = (item.finished - item.started) * 1000
    if isinstance(got, RelayItemFailed):
        raise got
    scores, grow = got
    return scores, grow, item.batch
