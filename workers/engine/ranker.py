"""The ranking engine of one worker: model + prefix store + device scheduler, no Kafka.

Primitives:
- ``EngineConfig`` (``engine_config``): mode (``relay`` or ``baseline``), the ranking budget, chunking, leases.
- ``RankingEngine(runner, store, scheduler, config, latency)``: the model runner
  (``model.runner.ModelRunner``, the engine's one door to the model) and the prefix store.
- ``RankingEngine.prefill(user_id, history, ttl_s, prefix_len=n)``: pre-inference on a prefill
  signal (``preinference.PreInference``) — lease, then promote, extend or compute the first ``n``
  events' prefix (chunked on the device scheduler, so a ranking job waits for at most one chunk);
  a cached prefix that already covers them is a hit. Returns a ``PrefillOutcome``. When the events
  it leaves to the ranking (the short-term suffix) would cost that ranking more than a slice (a
  heavy user's thousands of cached keys), it extends the prefix by them too, in the background at
  pre-inference priority.
- ``RankingEngine.prefill_room_s(user_id, deadline, after_tokens)``: the one wait policy — how
  long a ranking may still wait for the user's pre-inference (None: not at all); ``prefill_eta_ms``
  the device time that pre-inference has left. ``expedite_prefill`` / ``yield_prefill``: a
  waiting ranking lends it its priority and deadline; ``abandon_prefill``: the ranking went
  ahead without it. Admitted work is not thrown away for being late: it finishes at
  pre-inference priority, with its minimum device share (``EngineConfig.prefill_share``), and
  serves the user's next visits. (``EngineConfig.abandon_backlog``, off by default, restores the
  shedding policy that dropped late work while pre-inference was backed up; outcome ``abandoned``.)
- ``prefills`` (a ``PrefillLedger``): what became of the pre-inferences; ``prefill_backlog_ms()``.
- ``RankingEngine.rank(user_id, history, candidates, request_ts, deadline)``: a ``RankOutcome``
  by one of these paths:

  | path | when | how |
  |---|---|---|
  | ``cold_start`` | no history | the candidates alone |
  | ``relay`` | a valid cached prefix | the suffix and the candidates against it: sliced when longer than a slice (``DevicePacing.relay_steps``) unless it is a CUDA graph replay (``graph_replays``), else with the user's other rankings waiting for the device (``burst_batch``) and other users' (``batch_tokens``: one forward), keeping the grown prefix (``retain_suffix``); a ranking that fails on the device takes the full path |
  | ``relay_waited`` | the prefix is being computed and may finish in time | as ``relay``, after the wait |
  | ``full`` / ``full_truncated`` | a miss | the most recent events that fit the deadline (``DevicePacing.keep_within``), sliced and re-planned once when behind (``full_steps``) |
  | ``baseline`` | baseline mode | full inference in one job, truncated to fit |
- ``RankingEngine.batch_sizes()``: relay device turns by how many rankings they ran together.
- ``RankingEngine.warm_up()``, ``drain()`` (the stores of grown prefixes), ``predict_full_ms(n)``,
  ``refit_latency()``, ``latency_samples()`` / ``inherit_latency_samples()`` (a predecessor's
  timings, at a hand-over), and what a caller needs of the model and store: ``to_model_ids``,
  ``cached_length``, ``note_applied`` / ``ranking_now`` (the behaviour applier's side), ``close``.
- ``kv_bytes_per_token(model)``: device bytes one cached token takes (a model or its runner).

How long device work runs (slices, paces, truncation, re-planning) is the policy of
``workers.engine.pacing``; running and timing jobs on the scheduler is ``workers.engine.device_jobs``;
pre-inference, its loans of priority and the background stores of grown prefixes are
``workers.engine.preinference``'s; this module chooses the ranking paths and forwards the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from relaygr.workers.engine.calibration import warm_up_work
from relaygr.workers.engine.device_jobs import (
    RelayBatching,
    RelayItemFailed,
    graph_replays,
    graph_rows,
    run_in_burst,
    run_job,
    run_steps,
    use_relay_graphs,
)
from relaygr.workers.engine.engine_config import EngineConfig
from relaygr.workers.engine.latency_model import EngineClock, LatencyModel
from relaygr.workers.engine.pacing import DevicePacing
from relaygr.workers.engine.preinference import GrownPrefixes, PrefillOutcome, PreInference
from relaygr.workers.engine.scheduler import DeviceScheduler, Priority
from relaygr.workers.kv_pages import KVLayout
from relaygr.workers.model.model import HSTURanker
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.prefix_kv import Events, PrefixKV
from relaygr.workers.store.prefix_store import PrefixStore

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


class RankingEngine:
    def __init__(
        self,
        runner: ModelRunner,
        store: PrefixStore | None,
        scheduler: DeviceScheduler,
        config: EngineConfig,
        latency: LatencyModel,
        clock: EngineClock | None = None,
    ) -> None:
        if config.mode == "relay" and store is None:
            raise ValueError("relay mode needs a prefix store")
        self.runner, self.store = runner, store
        self.scheduler = scheduler
        self.config = config
        self.clock = clock or EngineClock()  # a test's simulated one: see ``EngineClock``
        self.pacing = DevicePacing(config, latency, self.clock)
        scheduler.reserve(config.prefill_share if config.mode == "relay" else 0.0)
        if store is not None:  # one copy of a prefix on the device: the runner reads the store's pages
            layout = runner.kv_layout(store.config.page_tokens)
            runner.use_pages(store.device_pages(layout, graph_rows(runner, config)))
        use_relay_graphs(runner, config)
        self.kv_layout = runner.pages.layout if store is not None else runner.kv_layout()
        # Prefixes grown by rankings (``retain_suffix``) or pre-inferences, stored in the background.
        self.grown = GrownPrefixes(store)
        self.preinference = PreInference(
            runner, store, scheduler, config, self.pacing, self.clock, self.kv_layout, self.grown
        )
        self.prefills = self.preinference.prefills
        self.batched_rankings = 0  # rankings that shared their device job with others of a burst
        self.relay_batching = RelayBatching.of(config)

    @property
    def latency(self) -> LatencyModel:
        """The latency model of full ranking this engine plans with (refitted as it serves)."""
        return self.pacing.latency

    @property
    def max_seq_len(self) -> int:
        """Most events of a history the model serves."""
        return self.runner.config.max_seq_len

    def to_model_ids(self, keys: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Raw item keys (``vocab.item_keys``) as model ids, and how many the vocabulary lacks."""
        return self.runner.vocab.to_model_tensor(keys)

    def cached_length(self, user_id: str, history: Events) -> int:
        """Length of the prefix of ``history`` held in memory for ``user_id`` (0: none, or baseline)."""
        return self.store.cached_length(user_id, history) if self.store is not None else 0

    def note_applied(self, events: int) -> None:
        """The worker applied ``events`` behaviours: a burst of them slows the device."""
        self.pacing.ingest.add(events)

    def queue_depth(self, priority: Priority | None = None) -> int:
        """Jobs waiting for the device (of ``priority``, or all)."""
        return self.scheduler.queue_depth(priority)

    def store_metrics(self) -> dict[str, float]:
        """The prefix store's counters and gauges (none for a baseline engine)."""
        return self.store.metrics() if self.store is not None else {}

    def batch_sizes(self) -> dict[int, int]:
        """Relay rankings' device turns (burst or several users) by how many rankings each ran."""
        return dict(sorted(self.relay_batching.sizes.items()))

    def ranking_now(self) -> bool:
        """Whether ranking work is on the device or waits for it."""
        return self.scheduler.ranking()

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
        """Lease and pre-infer the first ``prefix_len`` events of ``history`` (``PreInference.prefill``)."""
        return await self.preinference.prefill(user_id, history, ttl_s, prefix_len=prefix_len, owner=owner)

    def prefill_eta_ms(self, user_id: str) -> float | None:
        """Device ms ``user_id``'s pre-inference has left (``PreInference.prefill_eta_ms``)."""
        return self.preinference.prefill_eta_ms(user_id)

    def prefill_room_s(self, user_id: str, deadline: float, after_tokens: int) -> float | None:
        """The one wait policy (``PreInference.prefill_room_s``)."""
        return self.preinference.prefill_room_s(user_id, deadline, after_tokens)

    def abandon_prefill(self, user_id: str) -> None:
        """``user_id``'s ranking went ahead without its pre-inference (``PreInference.abandon_prefill``)."""
        self.preinference.abandon_prefill(user_id)

    def prefill_backlog_ms(self) -> float:
        """Predicted device ms of the pre-inferences admitted here and not finished."""
        return self.preinference.prefill_backlog_ms()

    def expedite_prefill(self, user_id: str, deadline: float) -> None:
        """A ranking lends ``user_id``'s pre-inference its priority (``PreInference.expedite_prefill``)."""
        self.preinference.expedite_prefill(user_id, deadline)

    def yield_prefill(self, user_id: str) -> None:
        """A waiter of ``user_id``'s pre-inference stopped waiting (``PreInference.yield_prefill``)."""
        self.preinference.yield_prefill(user_id)

    def predict_full_ms(self, n: int) -> float:
        """Full ranking of ``n`` events at the pace the device keeps now (``DevicePacing``)."""
        return self.pacing.predict_full_ms(n)

    async def warm_up(self, history_len: int = 1024, num_candidates: int = 128, rounds: int = 2) -> float:
        """A full ranking, a pre-inference and a relay ranking of a synthetic user, ``rounds``
        times, on the device thread; returns the seconds taken. A fresh process pays one-off
        costs on its first calls (allocator growth, kernel choice): the first real rankings
        otherwise computed up to 6x their calibrated time. Nothing here enters the latency model
        or the prefix store."""
        work = warm_up_work(self.runner, history_len, num_candidates, rounds, self.config.prefill_chunk)
        t0 = self.clock.timer()
        await self.scheduler.submit(work, priority=Priority.PREFILL)
        return self.clock.timer() - t0

    # ------------------------------------------------------------------ ranking

    async def rank(
        self,
        user_id: str,
        history: Events,
        candidates: torch.Tensor,
        request_ts: float,
        deadline: float,
    ) -> RankOutcome:
        """Rank ``candidates`` for ``user_id`` by the first path that applies (the table in the
        module docstring). ``deadline`` is wall-clock seconds (time.time())."""
        n = len(history)
        breakdown: dict[str, float] = {}
        if n == 0:
            scores = await self._run(None, history, candidates, request_ts, deadline, breakdown)
            return RankOutcome(scores, "cold_start", breakdown, 0, 0, len(candidates))
        if self.config.mode == "relay" and self.store is not None:
            prefix, tier, path = await self._find_prefix(
                user_id, history, len(candidates), deadline, breakdown
            )
            if prefix is not None:
                return await self._rank_relay(
                    user_id, prefix, tier, path, history, candidates, request_ts, deadline, breakdown
                )
        return await self._rank_full(history, candidates, request_ts, deadline, breakdown)

    async def _find_prefix(
        self, user_id: str, history: Events, candidates: int, deadline: float, breakdown: dict[str, float]
    ) -> tuple[PrefixKV | None, str, str]:
        """The cached prefix of ``history`` (its tier, and the path it makes), or one being
        computed that the wait policy allows waiting for (lending it the ranking's priority)."""
        assert self.store is not None
        t0 = self.clock.timer()
        found = await self.store.lookup(user_id, history)
        breakdown["lookup"] = (self.clock.timer() - t0) * 1000
        if found.prefix is not None or not self.store.in_flight(user_id):
            if found.prefix is None:
                self.store.release(user_id)
            return found.prefix, found.tier, "relay"
        room_s = self.prefill_room_s(user_id, deadline, min(len(history), self.config.prefill_chunk))
        if room_s is not None:
            self.expedite_prefill(user_id, deadline)
            t1 = self.clock.timer()
            try:
                waited = await self.store.wait_in_flight(user_id, room_s)
            finally:
                self.yield_prefill(user_id)
            breakdown["prefix_wait"] = (self.clock.timer() - t1) * 1000
            if waited is not None and waited.matches(history):
                return waited, "inflight", "relay_waited"
        self.store.release(user_id)
        return None, "miss", "full"

    async def _rank_relay(
        self,
        user_id: str,
        prefix: PrefixKV,
        tier: str,
        path: str,
        history: Events,
        candidates: torch.Tensor,
        request_ts: float,
        deadline: float,
        breakdown: dict[str, float],
    ) -> RankOutcome:
        """The suffix and the candidates against ``prefix``: in slices when longer than one, else
        batched with the rankings waiting for the device (the user's against ``prefix``, other
        users'; keeping the grown prefix; in full if it fails there), else in one job."""
        assert self.store is not None
        suffix = history.slice(prefix.length)
        new, c, m = len(suffix), len(candidates), prefix.length
        if self.pacing.slice_relay(m, new, c) and not graph_replays(self.runner, m, new, c):
            scores = await self._rank_relay_sliced(
                user_id, prefix, history, candidates, request_ts, deadline, breakdown
            )
        elif self.config.retain_suffix and new:
            limit = max(
                1, min(self.config.burst_batch, self.config.burst_batch_events // max(1, prefix.length))
            )
            try:  # with the user's other rankings against ``prefix`` and other users' (one forward)
                scores, grow, batch = await run_in_burst(
                    self.scheduler,
                    self.runner,
                    prefix,
                    ("burst", user_id, id(prefix)),
                    limit,
                    history,
                    candidates,
                    request_ts,
                    deadline,
                    breakdown,
                    self.clock.timer,
                    self.relay_batching,
                )
            except RelayItemFailed as e:
                log.warning("ranked %s in full: %s", user_id, e)
                self.store.release(user_id)
                return await self._rank_full(history, candidates, request_ts, deadline, breakdown)
            if batch > 1:
                self.batched_rankings += 1
            if grow is not None:
                self._keep(user_id, grow, prefix.meta)
        else:
            scores = await self._run(prefix, suffix, candidates, request_ts, deadline, breakdown)
        if "between_slices" not in breakdown:  # run in one piece: it times the scoring pace
            self.pacing.observe_relay(m, new, c, breakdown)
        self.store.release(user_id)
        n = len(history)
        return RankOutcome(
            scores, path, breakdown, n, n, new + c, prefix.length, tier, prefix.meta.get("worker_id")
        )

    async def _rank_full(
        self,
        history: Events,
        candidates: torch.Tensor,
        request_ts: float,
        deadline: float,
        breakdown: dict[str, float],
    ) -> RankOutcome:
        """Full inference of the most recent events that fit the deadline: a relay worker's
        (a miss) sliced and planned when the device starts it, the baseline's in one job."""
        n = len(history)
        base = "baseline" if self.config.mode == "baseline" else "full"
        if self.config.mode == "relay" and self.config.slice_ms:
            # Planned when the device starts it: the wait for the device is behind it then.
            bursts: list[bool] = []  # whether the first plan was made in a burst

            def plan(pace: float | None) -> Events:
                if pace is None:
                    bursts.append(self.pacing.ingest.bursting())
                keep = self.pacing.keep_within(n, deadline, sliced=True, bursting=bursts[0], pace=pace)
                return history.slice(n - keep)

            ranked: list[Events] = []
            steps = self.pacing.full_steps(
                self.runner, plan, candidates, request_ts, deadline, breakdown, ranked
            )
            scores = await run_steps(self.scheduler, steps, deadline, breakdown, self.clock.timer)
            used, in_burst = ranked[0], bursts[0]
        else:  # the baseline: one job, as the paper's
            used, in_burst = history.slice(n - self.pacing.keep_within(n, deadline, sliced=False)), False
            scores = await self._run(None, used, candidates, request_ts, deadline, breakdown)
        path = "full_truncated" if len(used) < n else base
        # The slices a re-plan threw away are device time spent, but not on this history.
        self.pacing.observe_full(len(used), breakdown["compute"] - breakdown.get("replan_lost", 0.0))
        return RankOutcome(
            scores,
            path,
            breakdown,
            n,
            len(used),
            len(used) + len(candidates),
            0,
            "miss",
            in_ingest_burst=in_burst,
            replanned="replan_lost" in breakdown,
        )

    async def _rank_relay_sliced(
        self,
        user_id: str,
        prefix: PrefixKV,
        history: Events,
        candidates: torch.Tensor,
        request_ts: float,
        deadline: float,
        breakdown: dict[str, float],
    ) -> torch.Tensor:
        """A relay ranking as a chunked ranking job (``DevicePacing.relay_steps``). Like a sliced
        full ranking it yields at every slice boundary: the short rankings queued meanwhile run
        before its next slice, whatever their deadlines, so that they wait for one slice of a
        heavy user's ranking rather than all of it. The grown prefix is kept (``retain_suffix``)."""
        grown: list[PrefixKV] = []
        steps = self.pacing.relay_steps(self.runner, prefix, history, candidates, request_ts, grown)
        scores = await run_steps(self.scheduler, steps, deadline, breakdown, self.clock.timer)
        if self.config.retain_suffix and len(history) > prefix.length and grown:
            assert self.store is not None
            self.store.put(user_id, grown[0], keep_longer=True)
        return scores

    def _keep(self, user_id: str, grow: Callable[[], PrefixKV], meta: dict[str, str]) -> None:
        """Store the prefix a ranking grew, off the ranking's path: building it copies the cached
        keys and values, so it runs on the device after the scores are out, behind any ranking.
        It keeps the metadata of the prefix it grew from (who computed it: this worker)."""
        self.grown.put_when_computed(
            user_id,
            lambda: self.scheduler.submit(grow, priority=Priority.PREFILL),
            meta,
            "keeping the ranked suffix",
        )

    async def drain(self) -> None:
        """Wait until the suffixes of finished rankings are stored."""
        await self.grown.drain()

    async def _run(
        self,
        prefix: PrefixKV | None,
        events: Events,
        candidates: torch.Tensor,
        request_ts: float,
        deadline: float,
        breakdown: dict[str, float],
    ) -> torch.Tensor:
        """Rank in one job on the device thread (``device_jobs.run_job``)."""
        return await run_job(
            self.scheduler,
            lambda: self.runner.rank(prefix, events, candidates, request_ts),
            deadline,
            breakdown,
            self.clock.timer,
        )

    def refit_latency(self) -> LatencyModel:
        """Refit the latency model from recent full-path measurements when they span enough lengths."""
        return self.pacing.refit()

    def latency_samples(self) -> list[tuple[int, float]]:
        """The recent full-path measurements (history length, ms) the latency model is refitted from."""
        return list(self.pacing.samples)

    def inherit_latency_samples(self, samples: list[tuple[int, float]]) -> LatencyModel:
        """Plan with a predecessor's measurements (it served this worker's traffic on this device)
        in place of this process's own so far, and refit."""
        self.pacing.samples.clear()
        self.pacing.samples.extend(samples)
        return self.pacing.refit()

    def close(self) -> None:
        """Stop the device thread, then close the prefix store (it persists what it holds)."""
        self.scheduler.close()
        if self.store is not None:
            self.store.close()


def kv_bytes_per_token(model: HSTURanker | ModelRunner) -> int:
    """Device bytes one cached token takes in the pages: its keys and values in every layer, in
    the model's dtype, and its timestamp (a prefix takes whole pages of them)."""
    c = model.config
    return KVLayout(c.layers, c.heads, c.attn_dim, c.linear_dim, model.dtype).token_bytes
