"""What the ranking worker does with one prefill signal or one rank request, knowing no Kafka.

Primitives:
- ``PrefillRendezvous(capacity)``: where a rank request meets its prefill signal. The two
  travel on two topics and either may be read first: one ``Meeting`` per request id (an LRU of
  ``capacity``), with an event set when the signal is read (``arrived``) and one set when its
  pre-inference ended (``finished``, with its status). A request awaits them (``await
  signal(request_id, timeout_s)``): nothing polls.
- ``RankHandler(engine, history, alignment, pipeline, worker_id, note, log_end)``:
  ``await prefill(signal, partition)`` pre-infers a signal's prefix; ``await rank(request,
  partition)`` returns the ``RankedResult`` to publish. The ``RankingEngine`` is its only way to
  the device and the prefix store. A request's path through it:
    1. its user's served history (``served_history``: the most recent ``max_seq_len`` events in
       model ids), after waiting (bounded) for the behaviours produced before it;
    2. with ``prefill_expected``, its prefill signal, while full ranking would still meet the
       deadline, then that signal's pre-inference while the one wait policy allows
       (``RankingEngine.prefill_room_s``) — unless the store already holds nearly all of it
       (``worth_waiting``);
    3. ``RankingEngine.rank`` picks the path (relay, relay_waited, full, truncated, cold start);
    4. the result: the top-k, the latency breakdown, and why it is off the relay path if it is
       (``path_reason``).
- ``path_reason(...)``, ``worth_waiting(...)``: the two decisions above, as pure functions.

``log_end(partition)`` is the routed-behaviours partition's log end as the consumer knows it
(None: unknown): a request that was not routed by the ingress waits for its history up to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from prometheus_client import Counter as PCounter

from relaygr.schemas import PrefillSignal, RankedResult, RankPath, RankRequest, ScoredItem, TriggerReason
from relaygr.streams.config import PipelineSettings
from relaygr.streams.history import HistoryTable, to_events
from relaygr.streams.history_alignment import HistoryAlignment
from relaygr.workers.engine.ranker import RankingEngine, RankOutcome
from relaygr.workers.model.vocab import item_keys
from relaygr.workers.prefix_kv import Events, served, window_step

PREFILLS = PCounter("relaygr_prefill_outcomes_total", "Prefill signal outcomes", ["status"])
PLANNED_IN_BURST = PCounter(
    "relaygr_rank_planned_in_ingest_burst_total",
    "Full rankings planned while the worker applied a burst of behaviours (for RELAYGR_INGEST_SLOWDOWN)",
)
REPLANNED = PCounter(
    "relaygr_rank_replanned_total",
    "Truncated full rankings that ran slower than planned and started over with fewer events",
)
INCOMPLETE = PCounter(
    "relaygr_rank_history_incomplete_total",
    "Requests ranked before their history covered every behaviour produced before them",
)
CAPPED = PCounter(
    "relaygr_rank_history_capped_total",
    "Requests whose user's history is longer than the model's max_seq_len (only its tail served)",
)
UNKNOWN_ITEMS = PCounter(
    "relaygr_rank_unknown_items_total",
    "Item ids outside the model's vocabulary, ranked as its out-of-vocabulary token",
    ["where"],
)
# A ranking waiting for its pre-inference asks the wait policy again this often: the time that
# pre-inference has left is re-estimated as its chunks are timed.
PREFILL_RECHECK_S = 0.005
# Without routing headers, a request waits at most this long for the partition's known log end.
LOG_END_WAIT_S = 0.2
# Users whose last served history is kept: a request's prefill signal and the request itself read
# one history moments apart, and the second reuses the first's events (and the prefix's check of
# them) instead of converting, mapping and hashing thousands of events again.
SERVED_MEMO_USERS = 64
# Pre-inference outcomes that leave a prefix in the store.
_PREFIX_READY = frozenset({"computed", "extended", "device", "host", "disk", "merged"})


class Meeting:
    """One request id at the rendezvous."""

    __slots__ = ("done", "seen", "status")

    def __init__(self) -> None:
        self.seen = asyncio.Event()  # the prefill signal was read
        self.done = asyncio.Event()  # its pre-inference ended (``status``: how)
        self.status: str | None = None


class PrefillRendezvous:
    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError(f"a rendezvous holds at least one request, not {capacity}")
        self.capacity = capacity
        self._meetings: OrderedDict[str, Meeting] = OrderedDict()

    def __len__(self) -> int:
        return len(self._meetings)

    def _meeting(self, request_id: str) -> Meeting:
        m = self._meetings.get(request_id)
        if m is None:
            m = self._meetings[request_id] = Meeting()
            while len(self._meetings) > self.capacity:
                self._meetings.popitem(last=False)
        else:
            self._meetings.move_to_end(request_id)
        return m

    def arrived(self, request_id: str) -> None:
        """The prefill signal of ``request_id`` was read; its pre-inference starts."""
        self._meeting(request_id).seen.set()

    def finished(self, request_id: str, status: str | None) -> None:
        """The pre-inference of ``request_id`` ended (``status``: None when it failed)."""
        m = self._meeting(request_id)
        m.status = status
        m.seen.set()
        m.done.set()

    def status(self, request_id: str) -> str | None:
        m = self._meetings.get(request_id)
        return m.status if m is not None else None

    async def signal(self, request_id: str, timeout_s: float) -> Meeting | None:
        """The meeting of ``request_id`` once its signal was read, waiting at most ``timeout_s``;
        None if it was not read by then."""
        m = self._meeting(request_id)
        if not m.seen.is_set() and timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(m.seen.wait(), timeout_s)
        return m if m.seen.is_set() else None


@dataclass
class ServedHistory:
    """A request's view of its user's history (``RankHandler.served_history``)."""

    events: Events  # what ranking reads, in model item ids
    total: int  # the user's events before the request, in all
    capped: bool  # the window left some out (longer than ``max_seq_len``)
    unknown: int  # its items the model's vocabulary lacks
    complete: bool = True  # it covers every behaviour produced before the request
    wait_ms: float = 0.0  # waited for behaviours


@dataclass(frozen=True)
class _ServedMemo:
    """A user's last served history: the records it came from (``key``: oldest retained index,
    version, how many were before the cut) and, when every record was before the cut, the newest
    one's timestamp (``whole_until``): a later cut past it reads the same records."""

    key: tuple[int, int, int]
    served: ServedHistory
    whole_until: float | None

    def reaches(self, first: int, version: int, before_ts: float) -> bool:
        return (
            self.whole_until is not None and self.key[:2] == (first, version) and before_ts > self.whole_until
        )


class RankHandler:
    def __init__(
        self,
        engine: RankingEngine,
        history: HistoryTable,
        alignment: HistoryAlignment,
        pipeline: PipelineSettings,
        worker_id: str,
        note: Callable[..., None],
        log_end: Callable[[int], int | None],
    ) -> None:
        self.engine, self.history, self.alignment = engine, history, alignment
        self.pipeline, self.worker_id, self.note, self.log_end = pipeline, worker_id, note, log_end
        self.rendezvous = PrefillRendezvous()
        # Serve at most the model's max_seq_len most recent events, in a window moving by steps.
        self.max_seq_len = engine.max_seq_len
        self.window_step = window_step(self.max_seq_len)
        self._served: OrderedDict[str, _ServedMemo] = OrderedDict()

    # ------------------------------------------------------------------ history

    def served_history(self, user_id: str, before_ts: float) -> ServedHistory:
        """The user's events before ``before_ts`` that a ranking reads (at most max_seq_len, the
        most recent, in a window moving by whole steps) in model item ids. The same records as the
        user's last call give the same events (a fresh ``ServedHistory`` around them)."""
        version, first = self.history.version(user_id), self.history.first(user_id)
        memo = self._served.get(user_id)
        if memo is not None and memo.reaches(first, version, before_ts):
            # Unchanged records, every one of them before the last cut and this one: the same
            # events, without reading the records again (a request after its own signal).
            self._served.move_to_end(user_id)
            return replace(memo.served)
        rec = self.history.records(user_id)
        newest = float(rec["ts"].max()) if len(rec) else float("-inf")
        every = len(rec)
        if len(rec):
            rec = rec[rec["ts"] < before_ts]
        # The records before a time are a down-set of the user's records by timestamp: with the
        # records unchanged (``version``), as many of them are the same ones.
        key = (first, version, len(rec))
        if memo is not None and memo.key == key:
            self._served.move_to_end(user_id)
            return replace(memo.served)
        full = to_events(rec)
        hist, capped = served(full, first, self.max_seq_len, self.window_step)
        # The table keeps the raw ids' keys (``item_key``), whatever the model; the mapping is a
        # pure function of them, so a cached prefix of the mapped history stays the prefix of the
        # next one, and a new checkpoint with another vocabulary reads the same table.
        items, unknown = self.engine.to_model_ids(hist.item_ids)
        out = ServedHistory(
            Events(items, hist.action_ids, hist.timestamps), first + len(full), capped, unknown
        )
        self._served[user_id] = _ServedMemo(key, out, newest if len(rec) == every else None)
        if len(self._served) > SERVED_MEMO_USERS:
            self._served.popitem(last=False)
        return replace(out)

    async def await_history(
        self, partition: int, needed: dict[str, int] | None, until: float, user_id: str
    ) -> bool:
        """Wait until ``partition``'s history of ``user_id`` covers the behaviours ``needed``
        (public partition -> end offset when the ingress read the request), at most until
        ``until`` (monotonic). Returns whether it does. Without ``needed`` (not routed by the
        ingress), the partition's known log end stands in for it, as a short best effort."""
        if needed is None:
            end = self.log_end(partition)
            if end is not None:
                await self.alignment.wait_offset(partition, end, time.monotonic() + LOG_END_WAIT_S)
            return True
        return await self.alignment.wait(partition, needed, until, user_id.encode())

    async def _request_history(self, r: RankRequest, partition: int) -> ServedHistory:
        """The request's served history, after waiting for the behaviours produced before it
        while full ranking of what is there would still meet the deadline, and at most
        ``max_task_idle_ms``."""
        seen = self.served_history(r.user_id, r.model_ts)
        room_s = r.deadline_ts - time.time() - self.engine.predict_full_ms(len(seen.events)) / 1000
        until = time.monotonic() + max(0.0, min(room_s, self.pipeline.max_task_idle_ms / 1000))
        t0 = time.time()
        complete = await self.await_history(partition, r.behaviors_needed, until, r.user_id)
        wait_ms = (time.time() - t0) * 1000
        if wait_ms > 0.05:  # behaviours were applied meanwhile
            seen = self.served_history(r.user_id, r.model_ts)
            seen.wait_ms = wait_ms
        seen.complete = complete
        if seen.capped:
            CAPPED.inc()
        if not complete:
            INCOMPLETE.inc()
        if seen.unknown:
            UNKNOWN_ITEMS.labels("history").inc(seen.unknown)
        return seen

    # ------------------------------------------------------------------ pre-inference

    async def prefill(self, s: PrefillSignal, partition: int) -> None:
        """Pre-infer the prefix ``s`` asks for, on the history there is when its behaviours are
        applied (a bounded wait: a prefix of a partial history is still a valid prefix)."""
        self.rendezvous.arrived(s.request_id)
        status: str | None = None
        try:
            until = time.monotonic() + self.pipeline.max_task_idle_ms / 1000
            await self.await_history(partition, s.behaviors_needed, until, s.user_id)
            hist = self.served_history(s.user_id, s.model_ts).events
            # Retrieval counted the history from its own table; keep the short-term suffix out of
            # the prefix by this worker's count too (it may have ingested fewer events so far).
            n = min(s.prefix_len, len(hist) - min(self.pipeline.short_term, len(hist)))
            out = await self.engine.prefill(
                s.user_id, hist, s.lease_ttl_s, prefix_len=n, owner=self.worker_id
            )
            status = out.status
        finally:
            self.rendezvous.finished(s.request_id, status)
        PREFILLS.labels(out.status.split(":")[0]).inc()
        self.note(
            event="prefill",
            request_id=s.request_id,
            user_id=s.user_id,
            partition=partition,
            status=out.status,
            prefix_len=out.prefix_len,
            ms=round(out.ms, 3),
        )

    async def _await_prefill(self, r: RankRequest, hist: Events) -> str | None:
        """Wait for the request's prefill signal while full ranking would still meet the deadline,
        then for its pre-inference while the wait policy allows (the engine picks the path after).
        No wait when the store already holds nearly what that pre-inference would compute.

        Returns why a relay would fail now (``signal_not_seen``, ``prefill_not_ready``), or None."""
        n = len(hist)
        if not worth_waiting(n, self.engine.cached_length(r.user_id, hist), self.pipeline.short_term):
            return None
        full_room_s = r.deadline_ts - time.time() - self.engine.predict_full_ms(n) / 1000
        meeting = await self.rendezvous.signal(r.request_id, full_room_s)
        if meeting is None:
            return "signal_not_seen"
        after = self.pipeline.short_term + len(r.candidates)
        room_s = self.engine.prefill_room_s(r.user_id, r.deadline_ts, after)
        if not meeting.done.is_set() and room_s is not None:
            # Its pre-inference is under way: it must not wait behind rankings now.
            self.engine.expedite_prefill(r.user_id, r.deadline_ts)
            try:
                while not meeting.done.is_set() and room_s is not None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(meeting.done.wait(), min(room_s, PREFILL_RECHECK_S))
                    room_s = self.engine.prefill_room_s(r.user_id, r.deadline_ts, after)
            finally:
                self.engine.yield_prefill(r.user_id)  # waited enough: rank now, not behind it
        if meeting.done.is_set():
            return None
        # Late for its request: it finishes at pre-inference priority for the user's next visits.
        self.engine.abandon_prefill(r.user_id)
        return "prefill_not_ready"

    # ------------------------------------------------------------------ ranking

    async def rank(self, r: RankRequest, partition: int) -> RankedResult:
        """The result of ``r`` (the request's path: the module docstring)."""
        t_in = time.time()
        seen = await self._request_history(r, partition)
        # Candidates are scored in model ids; the result names them by the raw ids received.
        cands, unknown_candidates = self.engine.to_model_ids(torch.from_numpy(item_keys(r.candidates)))
        if unknown_candidates:
            UNKNOWN_ITEMS.labels("candidate").inc(unknown_candidates)
        signal_wait = 0.0
        relay_blocker: str | None = None
        if r.prefill_expected and self.pipeline.mode == "relay":
            t_sig = time.time()
            relay_blocker = await self._await_prefill(r, seen.events)
            signal_wait = (time.time() - t_sig) * 1000
        outcome: RankOutcome | None = None
        if t_in >= r.deadline_ts:
            path = RankPath.TIMEOUT
            items = [ScoredItem(item_id=c, score=0.0) for c in r.candidates[: r.top_k]]
        else:
            t_engine = time.time()
            outcome = await self.engine.rank(r.user_id, seen.events, cands, r.model_ts, r.deadline_ts)
            # Before the engine: reading the history, and waiting for its behaviours and for the
            # request's prefill signal.
            outcome.breakdown_ms["worker_prep"] = (t_engine - t_in) * 1000 - signal_wait - seen.wait_ms
            if signal_wait:
                outcome.breakdown_ms["signal_wait"] = signal_wait
            items = top_items(r.candidates, outcome.scores, r.top_k)
            path = RankPath(outcome.path)
            if outcome.in_ingest_burst:
                PLANNED_IN_BURST.inc()
            if outcome.replanned:
                REPLANNED.inc()
        return self._result(r, t_in, seen, path, items, outcome, relay_blocker, unknown_candidates)

    def _result(
        self,
        r: RankRequest,
        t_in: float,
        seen: ServedHistory,
        path: RankPath,
        items: list[ScoredItem],
        outcome: RankOutcome | None,
        relay_blocker: str | None,
        unknown_candidates: int,
    ) -> RankedResult:
        now = time.time()
        breakdown = {
            "hop_rank": max(0.0, (t_in - r.produced_at) * 1000),
            "ranking": (now - r.produced_at) * 1000,
        }
        breakdown.update({k: float(v) for k, v in r.upstream_ms.items()})
        if seen.wait_ms > 0.05:
            breakdown["history_wait"] = seen.wait_ms
        if outcome is not None:
            breakdown.update(outcome.breakdown_ms)
        return RankedResult(
            request_id=r.request_id,
            user_id=r.user_id,
            ts=r.ts,
            items=items,
            path=path,
            latency_ms=max(0.0, (now - r.ts) * 1000),
            worker_id=self.worker_id,
            breakdown_ms=breakdown,
            history_len=seen.total,
            used_len=outcome.used_len if outcome else 0,
            tokens_computed=outcome.tokens_computed if outcome else 0,
            prefix_len=outcome.prefix_len if outcome else 0,
            prefix_tier=outcome.prefix_tier if outcome else None,
            prefix_worker_id=outcome.prefix_owner if outcome else None,
            history_complete=seen.complete,
            path_reason=path_reason(
                r, path, self.pipeline.mode, relay_blocker, self.rendezvous.status(r.request_id)
            ),
            unknown_candidates=unknown_candidates,
            unknown_history=seen.unknown,
            label_item_id=r.label_item_id,
        )


def top_items(candidates: list, scores: torch.Tensor, k: int) -> list[ScoredItem]:
    """The ``k`` best-scored candidates, best first (ties in candidate order, as a stable sort).
    The scores are read once and checked at once: a non-finite score is an error here, never a
    result; the items are then built without validating each again (their ids are the request's,
    validated when it was decoded)."""
    values = scores.detach().to("cpu", torch.float64).numpy()
    if not np.isfinite(values).all():
        raise ValueError(f"the model gave {int((~np.isfinite(values)).sum())} non-finite scores")
    order = np.argsort(-values, kind="stable")[:k].tolist()
    floats = values.tolist()
    return [ScoredItem.model_construct(item_id=candidates[i], score=floats[i]) for i in order]


def path_reason(
    r: RankRequest, path: RankPath, mode: str, relay_blocker: str | None, prefill_status: str | None
) -> str | None:
    """Why ``r`` did not take a relay path (None when it did). ``relay_blocker``: what the wait
    for its prefill signal found; ``prefill_status``: the outcome of its pre-inference on this
    worker, if any."""
    if path in (RankPath.RELAY, RankPath.RELAY_WAITED, RankPath.RELAY_EXTENDED):
        return None
    if path is RankPath.BASELINE or mode != "relay":
        return "baseline"
    if path is RankPath.TIMEOUT:
        return "deadline_passed"  # the rank request reached the worker after its deadline
    if path is RankPath.COLD_START:
        return TriggerReason.NO_HISTORY.value
    if not r.prefill_expected:
        return (r.trigger or TriggerReason.NOT_AT_RISK).value
    if relay_blocker is not None:
        return relay_blocker
    if prefill_status is not None and prefill_status not in _PREFIX_READY:
        return "prefill_" + prefill_status.replace(":", "_")
    return "prefix_evicted"  # pre-inferred (or cached earlier), gone by the ranking


def worth_waiting(history_len: int, cached_len: int, short_term: int) -> bool:
    """Whether a rank request should wait for its pre-inference, given the prefix the store
    already holds. Ranking computes whatever the cached prefix lacks; while that is at most two
    short-term suffixes (a fraction of a millisecond fused), computing it beats waiting: under
    load the pre-inference can queue behind rankings for tens of milliseconds."""
    return cached_len < history_len - min(2 * short_term, history_len)
