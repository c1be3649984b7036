"""The ranking engine's pre-inference: what it computes for the prefix store off a ranking's path.

- ``PreInference.prefill(user_id, history, ttl_s, prefix_len=n, owner=)``: lease, then promote,
  extend or compute the first ``n`` events' prefix (chunked on the device scheduler, so a ranking
  job waits for at most one chunk); a cached prefix that already covers them is a hit. Returns a
  ``PrefillOutcome``. When the events it leaves to the ranking (the short-term suffix) would cost
  that ranking more than a slice, it extends the prefix by them too, in the background.
- Its loans of priority: ``expedite_prefill`` / ``yield_prefill`` (a waiting ranking lends the
  pre-inference its priority and deadline, until every waiter got it or gave up); what a ranking
  may still wait for (``prefill_eta_ms``, ``prefill_room_s``: the one wait policy); and
  ``abandon_prefill`` (the ranking went ahead without it; with ``EngineConfig.abandon_backlog``
  set, its next chunk stops it while pre-inference is backed up).
- ``prefills`` (a ``PrefillLedger``): what became of the pre-inferences; ``prefill_backlog_ms()``.
- ``GrownPrefixes.put_when_computed``: a longer prefix computed on the device behind the rankings
  (a ranking's grown prefix, or a pre-inferred one extended by its suffix) stored in the background
  with the metadata of the prefix it grew from; ``drain()`` waits for them.

``RankingEngine`` (``ranker``) owns one of each and chooses the ranking paths; this module never
ranks.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from relaygr.workers.engine.engine_config import EngineConfig
from relaygr.workers.engine.latency_model import EngineClock
from relaygr.workers.engine.pacing import DevicePacing, Slicer
from relaygr.workers.engine.prefill_ledger import PrefillLedger
from relaygr.workers.engine.scheduler import DeviceScheduler, Priority, SchedulerClosed
from relaygr.workers.kv_pages import KVLayout
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.prefix_kv import Events, PrefixKV
from relaygr.workers.store.prefix_store import PrefixStore

log = logging.getLogger(__name__)


@dataclass
class PrefillOutcome:
    status: str  # computed | extended | device | host | disk | merged | refused:<reason> | skipped
    prefix_len: int = 0
    ms: float = 0.0


class PrefillAbandoned(Exception):
    """A pre-inference stopped between two chunks: the ranking that needed it went ahead."""


class GrownPrefixes:
    """Longer prefixes computed on the device behind the rankings, stored in the background."""

    def __init__(self, store: PrefixStore | None) -> None:
        self.store = store
        self._keeping: set[asyncio.Task] = set()

    def put_when_computed(
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
        """Wait until the prefixes in the background are stored."""
        while self._keeping:
            await asyncio.gather(*list(self._keeping), return_exceptions=True)


class PreInference:
    """Pre-inference of one engine (the module docstring): its admission, loans and ledger."""

    def __init__(
        self,
        runner: ModelRunner,
        store: PrefixStore | None,
        scheduler: DeviceScheduler,
        config: EngineConfig,
        pacing: DevicePacing,
        clock: EngineClock,
        kv_layout: KVLayout,
        grown: GrownPrefixes,
    ) -> None:
        self.runner, self.store, self.scheduler, self.config = runner, store, scheduler, config
        self.pacing, self.clock, self.kv_layout, self.grown = pacing, clock, kv_layout, grown
        # Users whose in-flight pre-inference a waiting ranking job has promoted: (priority, deadline).
        self._urgent: dict[str, tuple[Priority, float]] = {}
        self._waiters: dict[str, int] = {}  # rankings waiting for a user's pre-inference
        # Users whose pre-inference is no longer wanted: its next chunk stops it (device thread reads).
        self._abandoned: set[str] = set()
        self.prefills = PrefillLedger()
        # Pre-inferences computing now: user -> (their slicer, tokens in all).
        self._computing: dict[str, tuple[Slicer, int]] = {}

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
        t0 = self.clock.timer()
        # Room for the prefix in the device tier's pages (whole pages of its tokens).
        lease = self.store.lease(user_id, ttl_s or self.config.lease_ttl_s, self.kv_layout.bytes_for(n))
        if not lease:
            self.prefills.counts["refused"] += 1
            return PrefillOutcome(f"refused:{lease.reason}", n)
        self._abandoned.discard(user_id)
        self.prefills.admit(user_id, self.pacing.latency.predict_ms(n))

        async def compute(best: PrefixKV | None) -> PrefixKV:
            start = best.length if best is not None else 0
            slicer = self.pacing.slicer(start)
            steps = self.runner.prefill_steps(
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
            self.prefills.counts["dropped:backlog"] += 1
            return PrefillOutcome("abandoned", n, (self.clock.timer() - t0) * 1000)
        except Exception:
            self.prefills.counts["dropped:failed"] += 1
            raise
        finally:
            self._urgent.pop(user_id, None)
            self._abandoned.discard(user_id)
            self._computing.pop(user_id, None)
            self.prefills.end(user_id)
        self.prefills.outcome(source)
        if got.length < len(history) and self.pacing.suffix_costs_a_slice(got.length, len(history)):
            self._extend_later(user_id, got, history)
        return PrefillOutcome(source, got.length, (self.clock.timer() - t0) * 1000)

    def _extend_later(self, user_id: str, prefix: PrefixKV, history: Events) -> None:
        """Extend a prefix just pre-inferred by the rest of ``history`` (the short-term suffix the
        pre-inference leaves to the ranking), in slices at pre-inference priority, and keep the
        longer prefix. Only when those events would cost the ranking more than a slice: against a
        heavy user's thousands of cached keys, 64 events take as long as scoring 128 candidates,
        and they are known now. A ranking that comes first computes them itself, as before."""
        slicer = self.pacing.slicer(prefix.length)
        assert slicer is not None  # only when sliced by time (``suffix_costs_a_slice``)
        steps = slicer.measured(self.runner.prefill_steps(history, slicer, prefix=prefix))
        self.grown.put_when_computed(
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
        return self.pacing.prefill_eta_ms(slicer, n)

    def prefill_room_s(self, user_id: str, deadline: float, after_tokens: int) -> float | None:
        """The one wait policy: the seconds a ranking due at ``deadline`` may wait for
        ``user_id``'s pre-inference and still compute ``after_tokens`` tokens against its prefix
        (plus ``wait_margin_ms``), when what that pre-inference has left fits in them; else None."""
        after_ms = self.pacing.latency.predict_ms(after_tokens) + self.config.wait_margin_ms
        return self.pacing.prefill_room_s(deadline, after_ms, self.prefill_eta_ms(user_id))

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
        """``user_id``'s ranking went ahead without its pre-inference, which finishes at
        pre-inference priority (with its device share) for the user's next visits: admission
        bounds the work, late work is not thrown away. With ``abandon_backlog`` set (the shedding
        policy) its chunks are dropped while more than that many pre-inference jobs are queued."""
        if self.store is None or not self.store.in_flight(user_id):
            return
        self.prefills.counts["late"] += 1
        backlog = self.config.abandon_backlog
        if backlog is not None and self.scheduler.queue_depth(Priority.PREFILL) > backlog:
            self._abandoned.add(user_id)

    def prefill_backlog_ms(self) -> float:
        """Predicted device ms of the pre-inferences admitted here and not finished."""
        return self.prefills.backlog_ms(self.prefill_eta_ms)

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
