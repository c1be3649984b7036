"""The ranking engine of one worker: model + prefix store + device scheduler, no Kafka.

Primitives:
- ``EngineConfig`` (``engine_config``): mode (``relay`` or ``baseline``), the ranking budget, chunking, leases.
- ``RankingEngine.prefill(user_id, history, ttl_s, prefix_len=n)``: pre-inference on a prefill
  signal — lease, then promote, extend or compute the first ``n`` events' prefix (chunked on the
  device scheduler, so a ranking job waits for at most one chunk); a cached prefix that already
  covers them is a hit. Returns a ``PrefillOutcome``. When the events it leaves to the ranking
  (the short-term suffix) would cost that ranking more than a slice (a heavy user's thousands of
  cached keys), it extends the prefix by them too, in the background at pre-inference priority.
- ``RankingEngine.prefill_eta_ms(user_id)``: predicted device time left of the user's pre-inference
  under way (None: none computing here): a ranking does not wait for one that cannot finish in time.
- ``RankingEngine.abandon_prefill(user_id)``: the ranking that needed this pre-inference was
  served without it: its chunks not yet run are dropped (outcome ``abandoned``), so that a late
  pre-inference does not delay the ones that can still be on time.
- ``RankingEngine.rank(user_id, history, candidates, request_ts, deadline)``: a ``RankOutcome``.
  Relay path when a valid cached prefix exists; wait for an in-flight prefix only while that
  still meets the deadline (what it has left to compute included) — and lend it the request's
  priority and deadline meanwhile, so that other requests' full rankings cannot starve it;
  otherwise full inference, truncated to what the latency model says fits the remaining budget
  (``keep_within``; a relay worker's is planned when the device starts it, for a slower device
  while the worker applies a burst of behaviours: ``ingest``, and planned again, once, shorter,
  when its slices run slower than that: ``_behind``). A relay ranking stores the prefix it grew by
  the suffix (``retain_suffix``; in the background, behind other rankings): the user's next
  request then computes only its new events. A user's relay rankings that wait for the device
  together (a burst) run as one job against their shared prefix (``burst_batch``). ``drain()``
  waits for the stores.
  Baseline mode is full inference on the same code.
- ``RankingEngine.warm_up()``: serving's shapes run once on the device thread before the first
  request (a fresh process's first calls pay one-off costs), kept out of the latency model.
- ``RankingEngine.predict_full_ms(n)``: full ranking of ``n`` events at the device's measured pace,
  plus the wait for the device that a sliced ranking allows for (a slice, and a margin).
- ``kv_bytes_per_token(model)``: device bytes one cached token takes.

Device slices are sized by the latency model times the pace the device keeps now
(``DevicePace``, one for extending histories and one for scoring candidates, measured from every
slice; a third from whole full rankings for what they are predicted to take): calibrated on a
quiet machine, a slice would overrun its ``slice_ms`` 2-3x on cores shared with a broker and
other stages, and so would a truncated ranking its deadline.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from relaygr.workers.engine_config import EngineConfig
from relaygr.workers.latency_model import DevicePace, IngestMeter, LatencyModel
from relaygr.workers.model import HSTURanker
from relaygr.workers.prefix_kv import Events, PrefixKV
from relaygr.workers.prefix_store import PrefixStore
from relaygr.workers.scheduler import DeviceScheduler, Priority, SchedulerClosed

T = TypeVar("T")
# A sliced full ranking re-plans (once) when, at the pace its own slices ran, the rest would take
# more than this share of the time left: the plan filled ``truncate_headroom`` of it, and what is
# left above is for the short rankings that run between its slices.
REPLAN_FILL = 0.8
# ... judged from this many of its slices on: one slice held up by a page fault or a preemption
# would cut an ordinary ranking short for nothing.
REPLAN_AFTER_SLICES = 2
_NEVER = object()  # sentinel of ``iter(step, _NEVER)``: a step function as a step iterator
log = logging.getLogger(__name__)


@dataclass
class RankOutcome:
    scores: torch.Tensor
    path: str
    breakdown_ms: dict[str, float] = field(default_factory=dict)
    history_len: int = 0
    used_len: int = 0
    tokens_computed: int = 0
    prefix_len: int = 0
    prefix_tier: str | None = None
    prefix_owner: str | None = None  # the worker that computed the cached prefix
    in_ingest_burst: bool = False  # a full ranking planned for ``EngineConfig.ingest_slowdown``
    replanned: bool = False  # a full ranking that ran slower than planned and started over shorter


@dataclass
class PrefillOutcome:
    status: str  # computed | extended | device | host | disk | merged | refused:<reason> | skipped
    prefix_len: int = 0
    ms: float = 0.0


@dataclass
class _BurstItem:
    history: Events
    candidates: torch.Tensor
    request_ts: float
    submitted: float
    started: float = 0.0
    finished: float = 0.0
    batch: int = 1


class _Slicer:
    """Chunk sizes for ``prefill_steps`` by device time: the tokens whose predicted cost, times
    the measured pace, fits ``slice_ms`` (at most ``hi``). It remembers the chunk it sized last
    (where it starts, its predicted ms), so that ``measured`` can time that chunk into the pace
    and a waiting ranking can tell how far a pre-inference has got."""

    def __init__(self, latency: LatencyModel, pace: DevicePace, slice_ms: float, hi: int, start: int = 0):
        self.latency, self.pace, self.slice_ms, self.hi = latency, pace, slice_ms, hi
        self.at = start  # keys cached before the chunk sized last
        self.upto = start  # ... and after it
        self.predicted_ms = self.measured_ms = 0.0

    def __call__(self, cached: int) -> int:
        lat = self.latency
        k = lat.tokens_within_slice(cached, self.slice_ms / self.pace.factor, lo=16, hi=self.hi)
        self.at, self.upto = cached, cached + k
        self.predicted_ms = lat.predict_ms(cached + k) - lat.predict_ms(cached)
        return k

    def measured(self, steps: Iterator[PrefixKV | None]) -> Iterator[PrefixKV | None]:
        """``steps`` with each chunk but the last timed into the pace (the last one also
        assembles the prefix, which its prediction leaves out)."""
        while True:
            self.predicted_ms = 0.0
            t0 = time.perf_counter()
            try:
                out = next(steps)
            except StopIteration:
                return
            self.measured_ms = (time.perf_counter() - t0) * 1000
            if out is None and self.predicted_ms:
                self.pace.observe(self.predicted_ms, self.measured_ms)
            yield out


class PrefillAbandoned(Exception):
    """A pre-inference stopped between two chunks: the ranking that needed it went ahead."""


class RankingEngine:
    def __init__(
        self,
        model: HSTURanker,
        store: PrefixStore | None,
        scheduler: DeviceScheduler,
        config: EngineConfig,
        latency: LatencyModel,
    ) -> None:
        if config.mode == "relay" and store is None:
            raise ValueError("relay mode needs a prefix store")
        self.model = model
        self.store = store
        self.scheduler = scheduler
        self.config = config
        self.latency = latency
        # Recent (tokens, ms) of full-path compute: the worker refits its latency model from them.
        self.samples: deque[tuple[int, float]] = deque(maxlen=512)
        self.bytes_per_token = kv_bytes_per_token(model)
        # Users whose in-flight pre-inference a waiting ranking job has promoted: (priority, deadline).
        self._urgent: dict[str, tuple[Priority, float]] = {}
        self._waiters: dict[str, int] = {}  # rankings waiting for a user's pre-inference
        # Users whose pre-inference is no longer wanted: its next chunk stops it (device thread reads).
        self._abandoned: set[str] = set()
        # Background tasks storing the prefixes that rankings grew (``retain_suffix``).
        self._keeping: set[asyncio.Task] = set()
        self.batched_rankings = 0  # rankings that shared their device job with others of a burst
        # Behaviours the worker applied recently (its applier adds): a burst slows the device.
        self.ingest = IngestMeter(config.ingest_window_s, config.ingest_burst_events)
        # Measured device time over the latency model's: chunks of history; candidate slices;
        # whole full rankings (what the model predicts; a chunk's own overheads are not in it).
        self.pace_extend, self.pace_score, self.pace_full = DevicePace(), DevicePace(), DevicePace()
        # Pre-inferences computing now: user -> (their slicer, tokens in all).
        self._computing: dict[str, tuple[_Slicer, int]] = {}

    # ------------------------------------------------------------------ pre-inference

    async def prefill(
        self,
        user_id: str,
        history: Events,
        ttl_s: float | None = None,
        *,
        prefix_len: int | None = None,
        owner: str | None = None,
    ) -> PrefillOutcome:
        """Lease and pre-infer the first ``prefix_len`` events of ``history`` (all by default: the
        part of the user's history that precedes the short-term suffix). A cached prefix of
        ``history`` that is already at least that long (kept from an earlier ranking) is used as
        it is. ``owner`` is recorded in the prefix's metadata, so a later ranking can tell who
        computed it."""
        if self.config.mode != "relay" or self.store is None:
            return PrefillOutcome("skipped")
        n = len(history) if prefix_len is None else prefix_len
        if not 0 <= n <= len(history):
            raise ValueError(f"prefill: prefix_len={prefix_len} outside [0, {len(history)}]")
        if n == 0:
            return PrefillOutcome("skipped")
        t0 = time.perf_counter()
        lease = self.store.lease(user_id, ttl_s or self.config.lease_ttl_s, n * self.bytes_per_token)
        if not lease:
            return PrefillOutcome(f"refused:{lease.reason}", n)
        self._abandoned.discard(user_id)

        async def compute(best: PrefixKV | None) -> PrefixKV:
            start = best.length if best is not None else 0
            slicer = self._slicer(start)
            steps = self.model.prefill_steps(
                history.slice(0, n), slicer or self.config.prefill_chunk, prefix=best
            )
            if slicer is not None:
                steps = slicer.measured(steps)
                self._computing[user_id] = (slicer, n)
            steps = self._unless_abandoned(user_id, steps)
            # A request may already wait for this prefix (its lookup found it in flight).
            prio, deadline = self._urgent.get(user_id, (Priority.PREFILL, math.inf))
            out = await self.scheduler.submit_steps(
                steps, priority=prio, deadline=deadline, tag=("prefill", user_id)
            )
            if owner is not None:
                out.meta["worker_id"] = owner
            return out

        try:
            got, source = await self.store.get_or_compute(user_id, history, compute, at_least=n)
        except PrefillAbandoned:
            self.store.release(user_id)
            return PrefillOutcome("abandoned", n, (time.perf_counter() - t0) * 1000)
        finally:
            self._urgent.pop(user_id, None)
            self._abandoned.discard(user_id)
            self._computing.pop(user_id, None)
        if got.length < len(history) and self._suffix_costs_a_slice(got.length, len(history)):
            self._extend_later(user_id, got, history)
        return PrefillOutcome(source, got.length, (time.perf_counter() - t0) * 1000)

    def _suffix_costs_a_slice(self, cached: int, n: int) -> bool:
        """Whether computing events ``cached .. n`` against the ``cached`` keys before them is
        predicted (at the measured pace) to take longer than a device slice."""
        if not self.config.slice_ms:
            return False
        lat = self.latency
        return (lat.predict_ms(n) - lat.predict_ms(cached)) * self.pace_extend.factor > self.config.slice_ms

    def _extend_later(self, user_id: str, prefix: PrefixKV, history: Events) -> None:
        """Extend a prefix just pre-inferred by the rest of ``history`` (the short-term suffix the
        pre-inference leaves to the ranking), in slices at pre-inference priority, and keep the
        longer prefix. Only when those events would cost the ranking more than a slice: against a
        heavy user's thousands of cached keys, 64 events take as long as scoring 128 candidates,
        and they are known now. A ranking that comes first computes them itself, as before."""
        slicer = self._slicer(prefix.length)
        assert slicer is not None  # only when sliced by time (``_suffix_costs_a_slice``)
        steps = slicer.measured(self.model.prefill_steps(history, slicer, prefix=prefix))
        self._put_when_computed(
            user_id,
            lambda: self.scheduler.submit_steps(steps, priority=Priority.PREFILL, tag=("prefill", user_id)),
            prefix.meta,
            "extending the pre-inferred prefix",
        )

    def prefill_eta_ms(self, user_id: str) -> float | None:
        """Predicted device time (ms, at the measured pace) of what ``user_id``'s pre-inference
        has left to compute; None when none is computing on this engine (a tier load in flight,
        or not sliced by time)."""
        got = self._computing.get(user_id)
        if got is None:
            return None
        slicer, n = got
        lat = self.latency
        return max(0.0, lat.predict_ms(n) - lat.predict_ms(slicer.at)) * self.pace_extend.factor

    def predict_full_ms(self, n: int) -> float:
        """Full ranking of ``n`` events at the pace the device keeps now, and the longest wait for
        the device it is designed to have (one slice), and ``wait_margin_ms``: what a request
        must keep of its time when it waits for something else first."""
        return (
            self.latency.predict_ms(n) * self.pace_full.factor
            + self.config.slice_ms * self.pace_extend.factor
            + self.config.wait_margin_ms
        )

    def _unless_abandoned(self, user_id: str, steps: Iterator[PrefixKV | None]) -> Iterator[PrefixKV | None]:
        """``steps``, checked before each chunk: ``abandon_prefill`` stops them there."""
        while True:
            if user_id in self._abandoned:
                raise PrefillAbandoned(user_id)
            try:
                out = next(steps)
            except StopIteration:
                return
            yield out

    def abandon_prefill(self, user_id: str) -> None:
        """``user_id``'s ranking went ahead without its pre-inference: drop the chunks not run yet
        (a prefix of a later request is ordered by that request's own signal) when pre-inference
        is backed up (more than ``abandon_backlog`` queued): late ones would make the next ones
        late too. Otherwise it finishes at pre-inference priority: the user's next requests (a
        heavy user's capped prefix) find it cached."""
        if self.scheduler.queue_depth(Priority.PREFILL) <= self.config.abandon_backlog:
            return
        if self.store is not None and self.store.in_flight(user_id):
            self._abandoned.add(user_id)

    async def warm_up(self, history_len: int = 1024, num_candidates: int = 128, rounds: int = 2) -> float:
        """A full ranking, a pre-inference and a relay ranking of a synthetic user, ``rounds``
        times, on the device thread; returns the seconds taken. A fresh process pays one-off
        costs on its first calls (allocator growth, kernel choice): the first real rankings
        otherwise computed up to 6x their calibrated time. Nothing here enters the latency model
        or the prefix store."""
        cfg = self.model.config
        n = max(2, min(history_len, cfg.max_seq_len))
        g = torch.Generator().manual_seed(0)
        hist = Events(
            torch.randint(1, cfg.num_items + 1, (n,), generator=g),
            torch.randint(1, cfg.num_actions + 1, (n,), generator=g),
            torch.arange(n, dtype=torch.float64) * 60.0 + 1e9,
        )
        cands = torch.randint(1, cfg.num_items + 1, (max(1, num_candidates),), generator=g)
        request_ts = float(hist.timestamps[-1]) + 60.0
        split = max(1, n - 64)

        def work() -> None:
            for _ in range(rounds):
                self.model.rank(None, hist, cands, request_ts)
                prefix = self.model.prefill(hist.slice(0, split), self.config.prefill_chunk)
                self.model.rank(prefix, hist.slice(split), cands, request_ts)

        t0 = time.perf_counter()
        await self.scheduler.submit(work, priority=Priority.PREFILL)
        return time.perf_counter() - t0

    def _slicer(self, start: int = 0) -> _Slicer | None:
        """Tokens per device chunk sliced by time (``slice_ms``) with the latency model at the
        measured pace, so that a chunk against many cached keys gets fewer tokens; at most
        ``prefill_chunk``. None: not sliced by time (``prefill_chunk`` tokens a chunk)."""
        if not self.config.slice_ms:
            return None
        return _Slicer(self.latency, self.pace_extend, self.config.slice_ms, self.config.prefill_chunk, start)

    def expedite_prefill(self, user_id: str, deadline: float) -> None:
        """A ranking waits for ``user_id``'s pre-inference: its remaining chunks run at ranking
        priority with the ranking's deadline (priority inheritance), until every waiter has
        either got it or given up (``yield_prefill``)."""
        _, before = self._urgent.get(user_id, (Priority.RANK, math.inf))
        self._urgent[user_id] = (Priority.RANK, min(before, deadline))
        self._waiters[user_id] = self._waiters.get(user_id, 0) + 1
        self.scheduler.promote(("prefill", user_id), Priority.RANK, deadline)

    def yield_prefill(self, user_id: str) -> None:
        """A waiter of ``user_id``'s pre-inference stopped waiting. When none is left, the rest of
        it goes back to pre-inference priority: the ranking that gave up runs now, never behind
        its own user's prefill."""
        left = self._waiters.get(user_id, 0) - 1
        if left > 0:
            self._waiters[user_id] = left
            return
        self._waiters.pop(user_id, None)
        if self._urgent.pop(user_id, None) is not None:
            self.scheduler.restore(("prefill", user_id), Priority.PREFILL, math.inf)

    # ------------------------------------------------------------------ ranking

    async def rank(
        self,
        user_id: str,
        history: Events,
        candidates: torch.Tensor,
        request_ts: float,
        deadline: float,
    ) -> RankOutcome:
        """Rank ``candidates`` for ``user_id``. ``deadline`` is wall-clock seconds (time.time())."""
        n = len(history)
        bd: dict[str, float] = {}
        if n == 0:
            scores = await self._run(None, history, candidates, request_ts, deadline, bd)
            return RankOutcome(scores, "cold_start", bd, 0, 0, len(candidates))

        if self.config.mode == "relay" and self.store is not None:
            t0 = time.perf_counter()
            found = await self.store.lookup(user_id, history)
            bd["lookup"] = (time.perf_counter() - t0) * 1000
            prefix, tier, path = found.prefix, found.tier, "relay"
            if prefix is None and self.store.in_flight(user_id):
                # Wait only if ranking the suffix after the wait still meets the deadline, and
                # the pre-inference is not predicted to need longer than that.
                est = self.latency.predict_ms(min(n, self.config.prefill_chunk)) + self.config.wait_margin_ms
                room_s = deadline - time.time() - est / 1000
                eta_ms = self.prefill_eta_ms(user_id)
                if room_s > 0 and (eta_ms is None or eta_ms / 1000 <= room_s):
                    self.expedite_prefill(user_id, deadline)
                    t1 = time.perf_counter()
                    try:
                        waited = await self.store.wait_in_flight(user_id, room_s)
                    finally:
                        self.yield_prefill(user_id)
                    bd["prefix_wait"] = (time.perf_counter() - t1) * 1000
                    if waited is not None and waited.matches(history):
                        prefix, tier, path = waited, "inflight", "relay_waited"
            if prefix is not None:
                suffix = history.slice(prefix.length)
                if self._slice_relay(prefix.length, len(suffix), len(candidates)):
                    scores = await self._rank_relay_sliced(
                        user_id, prefix, history, candidates, request_ts, deadline, bd
                    )
                elif self.config.retain_suffix and len(suffix):
                    scores, grow = await self._rank_in_burst(
                        user_id, prefix, history, candidates, request_ts, deadline, bd
                    )
                    if grow is not None:
                        self._keep(user_id, grow, prefix.meta)
                    self._observe_relay(prefix.length, len(suffix), len(candidates), bd)
                else:
                    scores = await self._run(prefix, suffix, candidates, request_ts, deadline, bd)
                    self._observe_relay(prefix.length, len(suffix), len(candidates), bd)
                self.store.release(user_id)
                return RankOutcome(
                    scores,
                    path,
                    bd,
                    n,
                    n,
                    len(suffix) + len(candidates),
                    prefix.length,
                    tier,
                    prefix.meta.get("worker_id"),
                )
            self.store.release(user_id)

        base = "baseline" if self.config.mode == "baseline" else "full"
        if self.config.mode == "relay" and self.config.slice_ms:
            # Planned when the device starts it: the wait for the device is behind it then.
            bursts: list[bool] = []  # whether the first plan was made in a burst

            def plan(pace: float | None) -> Events:
                if pace is None:
                    bursts.append(self.ingest.bursting())
                keep = self.keep_within(n, deadline, sliced=True, bursting=bursts[0], pace=pace)
                return history.slice(n - keep)

            scores, used = await self._run_sliced(plan, candidates, request_ts, deadline, bd)
            in_burst = bursts[0]
        else:  # the baseline: one job, as the paper's
            used, in_burst = history.slice(n - self.keep_within(n, deadline, sliced=False)), False
            scores = await self._run(None, used, candidates, request_ts, deadline, bd)
        path = "full_truncated" if len(used) < n else base
        # The slices a re-plan threw away are device time spent, but not on this history.
        kept_ms = bd["compute"] - bd.get("replan_lost", 0.0)
        self.samples.append((len(used), kept_ms))
        self.pace_full.observe(self.latency.predict_ms(len(used)), kept_ms)
        return RankOutcome(
            scores,
            path,
            bd,
            n,
            len(used),
            len(used) + len(candidates),
            0,
            "miss",
            in_ingest_burst=in_burst,
            replanned="replan_lost" in bd,
        )

    def keep_within(
        self, n: int, deadline: float, *, sliced: bool, bursting: bool = False, pace: float | None = None
    ) -> int:
        """How many of a history's ``n`` most recent events a full ranking keeps to meet
        ``deadline`` (``truncate_to_budget``). In one job (the baseline), what the latency model
        fits in the time left. Sliced (a relay worker), what fills ``truncate_headroom`` of it at
        the pace of recent full rankings, times ``ingest_slowdown`` while the worker applies a
        burst of behaviours (``ingest``): it yields to short rankings at each slice, and a burst
        slows the device within the ranking, faster than a pace follows. ``bursting``: whether
        the worker applies one now; ``pace``: the ranking's own, measured (a re-plan)."""
        if not self.config.truncate_to_budget:
            return n
        left_ms = (deadline - time.time()) * 1000
        if sliced:
            if pace is None:
                pace = self.pace_full.factor * (self.config.ingest_slowdown if bursting else 1.0)
            left_ms *= self.config.truncate_headroom / pace
        return min(n, max(self.config.min_truncated_len, self.latency.max_tokens_within(left_ms)))

    async def _rank_in_burst(
        self,
        user_id: str,
        prefix: PrefixKV,
        history: Events,
        candidates: torch.Tensor,
        request_ts: float,
        deadline: float,
        bd: dict[str, float],
    ) -> tuple[torch.Tensor, Callable[[], PrefixKV] | None]:
        """``rank_and_extend`` on the device, batched with this user's other rankings that wait
        for the device against the same cached prefix (``HSTURanker.rank_many``). Returns the
        scores, and ``grown`` for the ranking that saw the longest history (``None`` for the others
        of its batch: one grown prefix per batch is stored)."""
        item = _BurstItem(history, candidates, request_ts, time.perf_counter())

        def run(items: list[_BurstItem]) -> list[tuple[torch.Tensor, Callable[[], PrefixKV] | None]]:
            t0 = time.perf_counter()
            if len(items) == 1:
                one = items[0]
                scores, grow = self.model.rank_and_extend(prefix, one.history, one.candidates, one.request_ts)
                out: list[tuple[torch.Tensor, Callable[[], PrefixKV] | None]] = [(scores, grow)]
            else:
                many, grow = self.model.rank_many(
                    prefix, [(i.history, i.candidates, i.request_ts) for i in items]
                )
                widest = max(range(len(items)), key=lambda k: len(items[k].history))
                out = [(sc, grow if k == widest else None) for k, sc in enumerate(many)]
            t1 = time.perf_counter()
            for i in items:
                i.started, i.finished, i.batch = t0, t1, len(items)
            return out

        result = await self.scheduler.submit_batched(
            item,
            run,
            key=("burst", user_id, id(prefix)),
            priority=Priority.RANK,
            deadline=deadline,
            limit=max(
                1, min(self.config.burst_batch, self.config.burst_batch_events // max(1, prefix.length))
            ),
        )
        bd["device_queue"] = (item.started - item.submitted) * 1000
        bd["compute"] = (item.finished - item.started) * 1000
        if item.batch > 1:
            self.batched_rankings += 1
        return result

    def _keep(self, user_id: str, grow: Callable[[], PrefixKV], meta: dict[str, str]) -> None:
        """Store the prefix a ranking grew, off the ranking's path: building it copies the cached
        keys and values, so it runs on the device after the scores are out, behind any ranking.
        It keeps the metadata of the prefix it grew from (who computed it: this worker)."""
        self._put_when_computed(
            user_id,
            lambda: self.scheduler.submit(grow, priority=Priority.PREFILL),
            meta,
            "keeping the ranked suffix",
        )

    def _put_when_computed(
        self, user_id: str, compute: Callable[[], Awaitable[PrefixKV]], meta: dict[str, str], what: str
    ) -> None:
        """In the background (``drain`` waits for it): await ``compute()`` (a job on the device)
        and store the longer prefix it returns, with the metadata of the prefix it grew from.
        Shutting down drops it: the next ranking computes those events itself."""

        async def put() -> None:
            assert self.store is not None
            try:
                grown = await compute()
                grown.meta = {**meta, **grown.meta}
                self.store.put(user_id, grown, keep_longer=True)
            except SchedulerClosed:
                pass
            except Exception:
                log.exception("%s of %s failed", what, user_id)

        task = asyncio.get_running_loop().create_task(put())
        self._keeping.add(task)
        task.add_done_callback(self._keeping.discard)

    async def drain(self) -> None:
        """Wait until the suffixes of finished rankings are stored."""
        while self._keeping:
            await asyncio.gather(*list(self._keeping), return_exceptions=True)

    async def _run(
        self,
        prefix: PrefixKV | None,
        events: Events,
        candidates: torch.Tensor,
        request_ts: float,
        deadline: float,
        bd: dict[str, float],
    ) -> torch.Tensor:
        """Rank on the device thread (``bd`` as in ``_on_device``)."""
        return await self._on_device(
            lambda: self.model.rank(prefix, events, candidates, request_ts), deadline, bd
        )

    def _relay_predicted_ms(self, cached: int, new: int, candidates: int) -> float:
        """A relay ranking's device time by the latency model, before any pace."""
        lat = self.latency
        return lat.predict_ms(cached + new + candidates) - lat.predict_ms(cached)

    def _slice_relay(self, cached: int, new: int, candidates: int) -> bool:
        """Whether a relay ranking is predicted to take longer than a device slice: then it runs
        in slices too (a capped heavy user's ranking against thousands of keys would otherwise
        hold every other ranking up for its whole length). Until relay rankings have been timed
        here, at the slowest pace the estimate allows: a ranking against many cached keys took
        several times what the model (fitted on full rankings) predicted, in one piece."""
        if not self.config.slice_ms:
            return False
        pace = self.pace_score
        factor = pace.factor if pace.observations else pace.hi
        return self._relay_predicted_ms(cached, new, candidates) * factor > self.config.slice_ms

    def _observe_relay(self, cached: int, new: int, candidates: int, bd: dict[str, float]) -> None:
        """A relay ranking run in one piece times the scoring pace too: a pace learnt only from
        sliced rankings would never see that unsliced ones run slower than predicted."""
        if "compute" in bd:
            self.pace_score.observe(self._relay_predicted_ms(cached, new, candidates), bd["compute"])

    async def _rank_relay_sliced(
        self,
        user_id: str,
        prefix: PrefixKV,
        history: Events,
        candidates: torch.Tensor,
        request_ts: float,
        deadline: float,
        bd: dict[str, float],
    ) -> torch.Tensor:
        """A relay ranking as a chunked ranking job: the new events extend the cached prefix in
        time slices, then the candidates are scored against it a slice's worth of keys at a time
        (``HSTURanker.score_steps``: all candidates against a range of one layer's keys, so each
        key is read once per layer, however many slices; slicing the candidates instead read
        every key once per slice, which cost a heavy user's ranking ~1.5x once slices got small).
        Like a sliced full ranking it yields at every slice boundary: the short rankings queued
        meanwhile run before its next slice, whatever their deadlines, so that they wait for one
        slice of a heavy user's ranking rather than all of it. The grown prefix is kept
        (``retain_suffix``)."""
        model, slicer, lat = self.model, self._slicer(prefix.length), self.latency
        n, c = len(history), len(candidates)
        # The candidates' predicted cost spread evenly over the keys each layer visits.
        visits = max(1, n * len(model.layers) * -(-c // model.config.candidate_batch))
        per_visit_ms = max(0.0, lat.predict_ms(n + c) - lat.predict_ms(n)) / visits
        step_started = [0.0]

        def keys_per_step() -> int:
            # A step also ends once it has run a slice's time, whatever the pace said: a pace
            # that has not caught up with a slower device must not make one slice of a ranking.
            if time.perf_counter() - step_started[0] >= self.config.slice_ms / 1000:
                return 0
            if per_visit_ms <= 0:
                return visits
            return int(self.config.slice_ms / self.pace_score.factor / per_visit_ms)

        grown_box: list[PrefixKV] = []
        timing: list[float] = []

        def steps():
            grown = prefix
            if n > prefix.length:
                assert slicer is not None  # sliced relay rankings exist only with slice_ms
                for out in slicer.measured(model.prefill_steps(history, slicer, prefix=prefix)):
                    if out is None:
                        yield None
                    else:
                        grown = out
            grown_box.append(grown)
            t0 = step_started[0] = time.perf_counter()
            for out in model.score_steps(grown, candidates, request_ts, keys_per_step):
                if isinstance(out, int):  # keys visited by a step: timed into the pace
                    self.pace_score.observe(out * per_visit_ms, (time.perf_counter() - t0) * 1000)
                    yield None
                    t0 = step_started[0] = time.perf_counter()
                else:
                    yield out

        scores = await self._submit_steps_timed(steps(), deadline, timing, yields=True)
        bd["device_queue"] = (timing[0] - timing[-1]) * 1000
        _slice_times(timing, bd)
        if self.config.retain_suffix and n > prefix.length and grown_box:
            assert self.store is not None
            self.store.put(user_id, grown_box[0], keep_longer=True)
        return scores

    async def _submit_steps_timed(self, it, deadline: float, timing: list[float], *, yields: bool = False):
        """``it`` as a chunked ranking job (``yields``: see ``DeviceScheduler.submit_steps``);
        ``timing`` gets each step's (start, end), then the submission time last."""
        t_submit = time.perf_counter()

        def step():
            t0 = time.perf_counter()
            out = next(it)
            timing.extend((t0, time.perf_counter()))
            return out

        try:
            return await self.scheduler.submit_steps(
                iter(step, _NEVER), priority=Priority.RANK, deadline=deadline, yields=yields
            )
        finally:
            timing.append(t_submit)

    async def _run_sliced(
        self,
        plan: Callable[[float | None], Events],
        candidates: torch.Tensor,
        request_ts: float,
        deadline: float,
        bd: dict[str, float],
    ) -> tuple[torch.Tensor, Events]:
        """Full ranking (a relay worker's cache miss) as a chunked ranking job: the keys and
        values of the history that ``plan(None)`` returns when the job starts on the device, in
        time slices (``_slicer``), then the candidates against them. It yields at every slice
        boundary (chunked prefill): the relay rankings that arrived during a slice run before the
        next one, whatever their deadlines, so a miss never holds the short rankings up for its
        whole length. Once, when its slices (``REPLAN_AFTER_SLICES`` or more) run so much slower
        than planned that the rest would not fit (``_behind``), it starts over with
        ``plan(pace)`` at the pace they ran, if that ends sooner; ``bd["replan_lost"]``: the
        slices it threw away (ms). Returns the scores and the history ranked. Equal to ``rank``
        with no prefix (the prefix property, tested)."""
        model, slicer = self.model, self._slicer()
        timing: list[float] = []
        ranked: list[Events] = []

        def steps():
            history, replanned = plan(None), False
            while True:
                prefix, predicted, measured, restart = None, 0.0, 0.0, False
                chunks = model.prefill_steps(history, slicer or self.config.prefill_chunk)
                for ran, out in enumerate(slicer.measured(chunks) if slicer is not None else chunks, 1):
                    if out is not None:
                        prefix = out
                        continue
                    if slicer is not None and not replanned:
                        predicted, measured = predicted + slicer.predicted_ms, measured + slicer.measured_ms
                        behind = None
                        if ran >= REPLAN_AFTER_SLICES:
                            behind = self._behind(len(history), slicer.upto, predicted, measured, deadline)
                        if behind is not None:
                            replanned, (pace, rest_ms) = True, behind
                            shorter = plan(pace)
                            # Only if it ends sooner than the rest would: near the end, finishing
                            # beats starting over.
                            if self.latency.predict_ms(len(shorter)) * pace < rest_ms:
                                history, restart = shorter, True
                                bd["replan_lost"] = measured
                    yield None
                    if restart:
                        break
                if not restart:
                    break
            ranked.append(history)
            yield model.rank(prefix, history.slice(len(history)), candidates, request_ts)

        out = await self._submit_steps_timed(steps(), deadline, timing, yields=True)
        bd["device_queue"] = (timing[0] - timing[-1]) * 1000
        _slice_times(timing, bd)
        return out, ranked[0]

    def _behind(
        self, n: int, done: int, predicted_ms: float, measured_ms: float, deadline: float
    ) -> tuple[float, float] | None:
        """A sliced full ranking of ``n`` events whose slices up to event ``done`` took
        ``measured_ms`` against the latency model's ``predicted_ms``: the pace they ran at
        (measured over predicted) and the rest's time at it (ms), if the rest would take more
        than ``REPLAN_FILL`` of the time left to ``deadline``. None while it fits (or the slices
        are too short to tell, or the deadline has passed). The pace is this ranking's own, not
        the slices' usual one: a slowdown that earlier slices already showed is still a slowdown
        against the plan, which went by recent full rankings."""
        if predicted_ms < self.pace_extend.min_predicted_ms:
            return None
        pace = measured_ms / predicted_ms
        lat = self.latency
        rest_ms = (lat.predict_ms(n) - lat.predict_ms(done) + lat.predict_ms(0)) * pace
        left_ms = (deadline - time.time()) * 1000
        # Past the deadline nothing is saved: the answer keeps the events it was planned with.
        return (pace, rest_ms) if 0 < REPLAN_FILL * left_ms < rest_ms else None

    async def _on_device(self, fn: Callable[[], T], deadline: float, bd: dict[str, float]) -> T:
        """``fn()`` as a ranking job on the device thread; ``bd`` gets ``device_queue`` (waiting
        for the device) and ``compute`` (the call) in ms."""
        timing: list[float] = []
        t_submit = time.perf_counter()

        def job() -> T:
            t0 = time.perf_counter()
            out = fn()
            timing.extend((t0, time.perf_counter()))
            return out

        out = await self.scheduler.submit(job, priority=Priority.RANK, deadline=deadline)
        bd["device_queue"] = (timing[0] - t_submit) * 1000
        bd["compute"] = (timing[1] - timing[0]) * 1000
        return out

    def refit_latency(self) -> LatencyModel:
        """Refit the latency model from recent full-path measurements when they span enough lengths."""
        if len({n // 64 for n, _ in self.samples}) >= 4:
            self.latency = LatencyModel.fit(self.samples)
        return self.latency


def _slice_times(timing: list[float], bd: dict[str, float]) -> None:
    """``compute`` (the slices' own time) and ``between_slices`` (other jobs' slices that ran
    between two of this job's, or waits for the device thread) in ms, from each slice's (start,
    end) in ``timing``."""
    starts, ends = timing[:-1:2], timing[1:-1:2]
    bd["compute"] = sum(b - a for a, b in zip(starts, ends, strict=True)) * 1000
    if len(starts) > 1:
        bd["between_slices"] = sum(b - a for a, b in zip(ends[:-1], starts[1:], strict=True)) * 1000


def kv_bytes_per_token(model: HSTURanker) -> int:
    c = model.config
    elem = torch.empty((), dtype=model.dtype).element_size()
    # keys + values per layer, plus the position (int64) and timestamp (float64) of the token.
    return len(model.layers) * c.heads * (c.attn_dim + c.linear_dim) * elem + 16
