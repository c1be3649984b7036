"""The sequence-aware trigger: pre-infer only the requests whose full ranking is at risk.

Primitives:
- ``TriggerConfig``: the ranking budget, the risk threshold θ and the two bounds.
- ``TokenBucket``: the pre-inference rate bound (with the owner's backlog, ``backlog_bound_ms``).
- ``SequenceAwareTrigger.decide(partition, history_len, now, user_id=...)``: a ``Decision`` with
  its ``TriggerReason``. Admit iff full ranking of this history is predicted (by the calibrated
  ``LatencyModel`` of the worker that owns the partition, ``report_latency``; of at most the
  ``max_seq_len`` served events), at the pace that worker's full rankings keep now
  (``report_latency(..., pace)``: the ranking plans its truncation at that pace, so a request
  the trigger finds not at risk is not one the ranking then truncates), and never below the
  calibration's prediction (a refit from truncated rankings knows short histories only), to
  exceed ``budget × θ``
  AND its pre-inference is predicted to end within the lease and a multiple of the upstream
  window (else ``too_long``) AND the bytes of live prefixes on that partition stay under the
  footprint bound AND the owner's pre-inference backlog stays under ``backlog_bound_ms`` AND
  the token bucket has a token (else ``rate_bound``). Every decision is counted.

A visit of a user admitted within the join window (the lease TTL or the backlog bound, the
shorter), whose prefix is at most ``short_term`` events longer than the one admitted then,
*joins* that pre-inference (``Decision.joined``): the worker computes a prefix once
(single-flight in its store) and every later signal of the same prefix waits on that
computation or hits the cached result, so a join is admitted without a token and adds nothing
to the backlog or the footprint (counted ``joined``). In a burst a user's three visits come
together: charged three times, they emptied the bucket and inflated the backlog, and other
users' first visits were refused (``rate_bound``). Past the backlog bound the admitted work is
due to have finished, and the user's partition may have moved to a worker that has nothing of
it: a later visit is admitted as any other, so that a rebalance cannot start the moved users'
pre-inferences on their new worker without tokens.

Admission is where pre-inference is shed: an admitted one finishes (the worker does not drop it
for being late), so under overload the trigger admits fewer. The backlog is the owner's report
(``report_backlog``: predicted device ms of its admitted pre-inferences not finished) plus the
predicted time of the admissions made since.

The footprint bound counts device bytes only. It is estimated here from admitted signals (bytes
per token × prefix length, alive for the lease TTL); a ranking worker's report (``WorkerStats``:
the device bytes its leases reserve) replaces the estimates of the admissions it has seen, so a
prefix that was ranked and released, or spilled to the host or disk tier, stops counting.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass

from pydantic import BaseModel, Field

from relaygr.schemas import TriggerReason
from relaygr.workers.engine.engine_config import EngineConfig
from relaygr.workers.engine.latency_model import LatencyModel
from relaygr.workers.store.leases import DEFAULT_LEASE_TTL_S


class TriggerConfig(BaseModel):
    enabled: bool = Field(default=True, description="False = never pre-infer (the baseline mode).")
    budget_ms: float = Field(
        default=EngineConfig.model_fields["budget_ms"].default,
        gt=0,
        description="P99 budget of the ranking stage.",
    )
    theta: float = Field(
        default=0.5, gt=0, le=10, description="At risk when predicted full ranking exceeds budget × theta."
    )
    short_term: int = Field(default=64, ge=0, description="Events at the end of the history left to ranking.")
    min_prefix: int = Field(default=32, ge=1, description="A shorter prefix is never worth a signal.")
    footprint_bound_bytes: int = Field(
        default=512 << 20, ge=0, description="Bound on live prefix bytes per partition."
    )
    bytes_per_token: int = Field(
        default=4096, ge=1, description="KV bytes per cached token (from the model)."
    )
    prefill_rate_per_s: float = Field(default=200.0, gt=0, description="Token-bucket rate of pre-inference.")
    prefill_burst: float = Field(default=50.0, ge=1, description="Token-bucket depth.")
    lease_ttl_s: float = Field(
        default=DEFAULT_LEASE_TTL_S, gt=0, description="How long a pre-inferred prefix stays pinned."
    )
    max_seq_len: int | None = Field(
        default=None, ge=1, description="Events a ranking serves at most (the model's cap); None: all."
    )
    window_ms: float = Field(
        default=50.0,
        gt=0,
        description="Upstream window: trigger to ranking deadline (feature fetch + budget).",
    )
    too_long_ttl_factor: float = Field(
        default=1.0,
        gt=0,
        description="Refuse (too_long) a pre-inference predicted to take longer than this × the lease TTL.",
    )
    report_grace_s: float = Field(
        default=1.0,
        ge=0,
        description="A worker's footprint report replaces the estimates of admissions at least this "
        "much older than the report (younger signals may not have reached the worker yet).",
    )
    backlog_bound_ms: float = Field(
        default=4000.0,
        gt=0,
        description="Refuse (rate_bound) while the owning worker's pre-inference not yet finished "
        "is predicted to take more device time than this: with pre-inference's minimum device "
        "share (0.2) it still finishes within the lease under a saturating load of rankings.",
    )
    too_long_window_factor: float = Field(
        default=100.0,
        ge=0,
        description="Refuse (too_long) a pre-inference predicted to take longer than this × the upstream "
        "window (0 = no such bound).",
    )


class TokenBucket:
    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.t = burst, None

    def take(self, now: float) -> bool:
        if self.t is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
        self.t = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@dataclass(frozen=True)
class Decision:
    reason: TriggerReason
    prefix_len: int = 0
    predicted_full_ms: float = 0.0
    est_bytes: int = 0
    joined: bool = False  # admitted as part of the user's pre-inference already admitted

    @property
    def admitted(self) -> bool:
        return self.reason is TriggerReason.ADMITTED


class SequenceAwareTrigger:
    def __init__(self, config: TriggerConfig, latency: LatencyModel) -> None:
        self.config = config
        self.latency = latency  # for a partition whose owner has not reported (the latest report)
        # The calibration's model: a worker's refit comes from its full rankings, truncated under
        # load to short histories, and may predict far less than this for the long ones it never
        # ranked whole. The trigger never judges a history less at risk than calibration does.
        self.calibrated = latency
        self._latency_of: dict[int, LatencyModel] = {}  # partition -> its owner's latest model
        self.bucket = TokenBucket(config.prefill_rate_per_s, config.prefill_burst)
        self.counts: Counter[str] = Counter()
        # Estimated prefixes per partition not yet covered by a report: heap of
        # (expiry, admitted at, bytes) and their running sum.
        self._live: dict[int, list[tuple[float, float, int]]] = {}
        self._live_bytes: dict[int, int] = {}
        self._reported: dict[int, int] = {}
        self._pace_of: dict[int, float] = {}  # partition -> its owner's full-ranking pace
        # Pre-inference backlog per owner (its partitions, as a tuple): the reported ms, when,
        # and the admissions since (admitted at, predicted ms).
        self._owner_of: dict[int, tuple[int, ...]] = {}
        self._backlog: dict[tuple[int, ...], tuple[float, float, list[tuple[float, float]]]] = {}
        # Users admitted within the lease TTL: user -> (admitted at, their events then), oldest first.
        self._admitted_users: dict[str, tuple[float, int]] = {}

    def report_latency(self, latency: LatencyModel, partitions: list[int], pace: float = 1.0) -> None:
        """A worker's latency model of full ranking, for the partitions it owns: their requests
        are ranked there (workers differ: a device, a fresh process, a loaded host); ``pace``: its
        full rankings' measured time over that model's, which its truncation plans with."""
        if not (math.isfinite(pace) and pace > 0):
            raise ValueError(f"a full-ranking pace must be positive and finite, not {pace}")
        for p in partitions:
            self._latency_of[p] = latency
            self._pace_of[p] = pace
        self.latency = latency

    def report_backlog(self, partitions: list[int], backlog_ms: float, as_of: float) -> None:
        """A worker's predicted device ms of admitted pre-inference not finished, at ``as_of``,
        for the partitions it owns: it replaces the estimates of admissions made more than
        ``report_grace_s`` before."""
        owner = tuple(sorted(partitions))
        for p in owner:
            self._owner_of[p] = owner
        since = self._backlog.get(owner, (0.0, 0.0, []))[2]
        cut = as_of - self.config.report_grace_s
        self._backlog[owner] = (max(0.0, backlog_ms), as_of, [e for e in since if e[0] > cut])

    def backlog_ms(self, partition: int) -> float:
        """The pre-inference backlog (predicted device ms) of ``partition``'s owner."""
        owner = self._owner_of.get(partition, (partition,))
        reported, _, since = self._backlog.get(owner, (0.0, 0.0, []))
        return reported + sum(ms for _, ms in since)

    def _note_admitted(self, partition: int, now: float, prefill_ms: float) -> None:
        owner = self._owner_of.get(partition, (partition,))
        reported, as_of, since = self._backlog.get(owner, (0.0, 0.0, []))
        since.append((now, prefill_ms))
        self._backlog[owner] = (reported, as_of, since)

    def latency_for(self, partition: int) -> LatencyModel:
        return self._latency_of.get(partition, self.latency)

    def live_bytes(self, partition: int, now: float) -> int:
        """Device bytes of live prefixes on ``partition``: the last report plus the estimates of
        the admissions it does not cover yet."""
        heap = self._live.setdefault(partition, [])
        total = self._live_bytes.get(partition, 0)
        while heap and heap[0][0] <= now:
            total -= heapq.heappop(heap)[2]
        self._live_bytes[partition] = total
        return total + self._reported.get(partition, 0)

    def report_footprint(self, partition: int, device_bytes: int, as_of: float | None = None) -> None:
        """A worker's measured device bytes of live prefixes on ``partition`` (its leases'
        reservations) at ``as_of``: they replace the estimates of admissions made more than
        ``report_grace_s`` before (the worker has seen those; released or spilled ones are gone
        from its device). Without ``as_of`` every estimate stays and the report adds to them."""
        self._reported[partition] = device_bytes
        if as_of is None:
            return
        cut = as_of - self.config.report_grace_s
        keep = [e for e in self._live.get(partition, []) if e[1] > cut]
        heapq.heapify(keep)
        self._live[partition] = keep
        self._live_bytes[partition] = sum(e[2] for e in keep)

    def decide(self, partition: int, history_len: int, now: float, user_id: str | None = None) -> Decision:
        """Admit or refuse a request of a ``history_len``-event history (the module docstring);
        with ``user_id``, a visit of a user with a pre-inference admitted recently joins it."""
        d = self._decide(partition, history_len, now, user_id)
        self.counts[d.reason.value] += 1
        if d.joined:
            self.counts["joined"] += 1
        elif d.admitted and user_id is not None:
            self._admitted_users.pop(user_id, None)  # re-inserted last: the dict stays oldest first
            self._admitted_users[user_id] = (now, history_len)
        return d

    def _joins(self, user_id: str | None, history_len: int, now: float) -> bool:
        """Whether ``user_id``'s pre-inference admitted within the join window covers the prefix
        of a ``history_len``-event history but for at most a short-term suffix (computed once, by
        the worker's single-flight, or a cache hit). Counted in the user's events in all, not the
        served window: a window that moved is another prefix."""
        cut = now - min(self.config.lease_ttl_s, self.config.backlog_bound_ms / 1000)
        while self._admitted_users:  # forget admissions past the lease, oldest first
            oldest = next(iter(self._admitted_users))
            if self._admitted_users[oldest][0] > cut:
                break
            del self._admitted_users[oldest]
        got = self._admitted_users.get(user_id) if user_id is not None else None
        return got is not None and 0 <= history_len - got[1] <= self.config.short_term

    def _decide(self, partition: int, history_len: int, now: float, user_id: str | None) -> Decision:
        c = self.config
        if not c.enabled:
            return Decision(TriggerReason.DISABLED)
        events = history_len
        if c.max_seq_len is not None:
            history_len = min(history_len, c.max_seq_len)  # what a ranking serves of it
        prefix_len = history_len - c.short_term
        if history_len == 0 or prefix_len < c.min_prefix:
            return Decision(TriggerReason.NO_HISTORY if history_len == 0 else TriggerReason.NOT_AT_RISK)
        latency = self.latency_for(partition)
        predicted = max(
            latency.predict_ms(history_len) * self._pace_of.get(partition, 1.0),
            self.calibrated.predict_ms(history_len),
        )
        if predicted <= c.budget_ms * c.theta:
            return Decision(TriggerReason.NOT_AT_RISK, prefix_len, predicted)
        if self._joins(user_id, events, now):
            return Decision(TriggerReason.ADMITTED, prefix_len, predicted, joined=True)
        # A pre-inference that outlives its lease, or the request by far, cannot pay off.
        prefill_ms = latency.predict_ms(prefix_len)
        if prefill_ms > c.too_long_ttl_factor * c.lease_ttl_s * 1000 or (
            c.too_long_window_factor and prefill_ms > c.too_long_window_factor * c.window_ms
        ):
            return Decision(TriggerReason.TOO_LONG, prefix_len, predicted)
        est = prefix_len * c.bytes_per_token
        if self.live_bytes(partition, now) + est > c.footprint_bound_bytes:
            return Decision(TriggerReason.FOOTPRINT_BOUND, prefix_len, predicted, est)
        if self.backlog_ms(partition) + prefill_ms > c.backlog_bound_ms or not self.bucket.take(now):
            return Decision(TriggerReason.RATE_BOUND, prefix_len, predicted, est)
        self._note_admitted(partition, now, prefill_ms)
        heapq.heappush(self._live.setdefault(partition, []), (now + c.lease_ttl_s, now, est))
        self._live_bytes[partition] = self._live_bytes.get(partition, 0) + est
        return Decision(TriggerReason.ADMITTED, prefix_len, predicted, est)
