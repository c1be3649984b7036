"""How long device work runs: slices, paces, truncation and re-planning (the engine's policy).

Primitives:
- ``DevicePacing(config, latency, clock)``: the latency model of full ranking and the paces the device
  keeps against it (``extend``: chunks of history; ``score``: candidate slices; ``full``: whole
  full rankings), the ingest meter (a burst of behaviours slows the device) and recent full-path
  samples (``refit`` refits the latency model from them).
  - ``slicer(start)``: a ``Slicer`` sizing pre-inference chunks by device time.
  - ``predict_full_ms(n)``, ``keep_within(n, deadline, ...)``: a full ranking's time, and the
    events it keeps to meet a deadline; ``behind(...)``: whether a sliced full ranking re-plans.
  - ``slice_relay``, ``relay_predicted_ms``, ``observe_relay``, ``observe_full``,
    ``suffix_costs_a_slice``, ``prefill_eta_ms``.
  - ``prefill_room_s(deadline, after_ms, eta_ms)``: the one policy for waiting on a
    pre-inference: the time there is to wait, if what it has left fits in it.
  - ``relay_steps(...)`` / ``full_steps(...)``: a sliced relay ranking and a sliced (re-planned)
    full ranking as step generators for ``DeviceScheduler.submit_steps``.
- ``Slicer``: chunk sizes for ``ModelRunner.prefill_steps`` by device time.

Slices are sized by the latency model times the pace the device keeps now: calibrated on a quiet
machine, a slice would overrun its ``slice_ms`` 2-3x on cores shared with a broker and other
stages, and so would a truncated ranking its deadline.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

import torch

from relaygr.workers.engine.engine_config import EngineConfig
from relaygr.workers.engine.latency_model import DevicePace, EngineClock, IngestMeter, LatencyModel
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.prefix_kv import Events, PrefixKV

# A sliced full ranking re-plans (once) when, at the pace its own slices ran, the rest would take
# more than this share of the time left: the plan filled ``truncate_headroom`` of it, and what is
# left above is for the short rankings that run between its slices.
REPLAN_FILL = 0.8
# ... judged from this many of its slices on: one slice held up by a page fault or a preemption
# would cut an ordinary ranking short for nothing.
REPLAN_AFTER_SLICES = 2


class Slicer:
    """Chunk sizes for ``prefill_steps`` by device time: the tokens whose predicted cost, times
    the measured pace, fits ``slice_ms`` (at most ``hi``). It remembers the chunk it sized last
    (where it starts, its predicted ms), so that ``measured`` can time that chunk into the pace
    and a waiting ranking can tell how far a pre-inference has got."""

    def __init__(
        self,
        latency: LatencyModel,
        pace: DevicePace,
        slice_ms: float,
        hi: int,
        start: int = 0,
        timer: Callable[[], float] = time.perf_counter,
    ):
        self.latency, self.pace, self.slice_ms, self.hi, self.timer = latency, pace, slice_ms, hi, timer
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
            t0 = self.timer()
            try:
                out = next(steps)
            except StopIteration:
                return
            self.measured_ms = (self.timer() - t0) * 1000
            if out is None and self.predicted_ms:
                self.pace.observe(self.predicted_ms, self.measured_ms)
            yield out


class DevicePacing:
    """See the module docstring."""

    def __init__(self, config: EngineConfig, latency: LatencyModel, clock: EngineClock | None = None) -> None:
        self.config = config
        self.latency = latency
        self.clock = clock or EngineClock()
        # Measured device time over the latency model's: chunks of history; candidate slices;
        # whole full rankings (what the model predicts; a chunk's own overheads are not in it).
        self.extend, self.score, self.full = DevicePace(), DevicePace(), DevicePace()
        # Behaviours the worker applied recently (its applier adds): a burst slows the device.
        self.ingest = IngestMeter(config.ingest_window_s, config.ingest_burst_events)
        # Recent (tokens, ms) of full-path compute: ``refit`` fits the latency model to them.
        self.samples: deque[tuple[int, float]] = deque(maxlen=512)

    # ------------------------------------------------------------------ pre-inference

    def slicer(self, start: int = 0) -> Slicer | None:
        """Tokens per device chunk sliced by time (``slice_ms``) with the latency model at the
        measured pace, so that a chunk against many cached keys gets fewer tokens; at most
        ``prefill_chunk``. None: not sliced by time (``prefill_chunk`` tokens a chunk)."""
        if not self.config.slice_ms:
            return None
        cfg = self.config
        return Slicer(self.latency, self.extend, cfg.slice_ms, cfg.prefill_chunk, start, self.clock.timer)

    def suffix_costs_a_slice(self, cached: int, n: int) -> bool:
        """Whether computing events ``cached .. n`` against the ``cached`` keys before them is
        predicted (at the measured pace) to take longer than a device slice."""
        if not self.config.slice_ms:
            return False
        lat = self.latency
        return (lat.predict_ms(n) - lat.predict_ms(cached)) * self.extend.factor > self.config.slice_ms

    def prefill_eta_ms(self, slicer: Slicer, n: int) -> float:
        """Predicted device time (ms, at the measured pace) of what a pre-inference of ``n``
        events, sliced by ``slicer``, has left to compute."""
        lat = self.latency
        return max(0.0, lat.predict_ms(n) - lat.predict_ms(slicer.at)) * self.extend.factor

    def prefill_room_s(self, deadline: float, after_ms: float, eta_ms: float | None) -> float | None:
        """The one policy for waiting on a pre-inference: the seconds a ranking due at
        ``deadline`` (wall clock) may wait and still take ``after_ms`` after it, when that is
        positive and what the pre-inference has left (``eta_ms``, None when unknown) fits in it;
        otherwise None (one predicted to finish too late is not waited for: the ranking gets the
        time for a truncated history instead)."""
        room_s = deadline - self.clock.wall() - after_ms / 1000
        if room_s > 0 and (eta_ms is None or eta_ms / 1000 <= room_s):
            return room_s
        return None

    # ------------------------------------------------------------------ full rankings

    def predict_full_ms(self, n: int) -> float:
        """Full ranking of ``n`` events at the pace the device keeps now, and the longest wait for
        the device it is designed to have (one slice), and ``wait_margin_ms``: what a request
        must keep of its time when it waits for something else first."""
        return (
            self.latency.predict_ms(n) * self.full.factor
            + self.config.slice_ms * self.extend.factor
            + self.config.wait_margin_ms
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
        left_ms = (deadline - self.clock.wall()) * 1000
        if sliced:
            if pace is None:
                pace = self.full.factor * (self.config.ingest_slowdown if bursting else 1.0)
            left_ms *= self.config.truncate_headroom / pace
        return min(n, max(self.config.min_truncated_len, self.latency.max_tokens_within(left_ms)))

    def behind(
        self, n: int, done: int, predicted_ms: float, measured_ms: float, deadline: float
    ) -> tuple[float, float] | None:
        """A sliced full ranking of ``n`` events whose slices up to event ``done`` took
        ``measured_ms`` against the latency model's ``predicted_ms``: the pace they ran at
        (measured over predicted) and the rest's time at it (ms), if the rest would take more
        than ``REPLAN_FILL`` of the time left to ``deadline``. None while it fits (or the slices
        are too short to tell, or the deadline has passed). The pace is this ranking's own, not
        the slices' usual one: a slowdown that earlier slices already showed is still a slowdown
        against the plan, which went by recent full rankings."""
        if predicted_ms < self.extend.min_predicted_ms:
            return None
        pace = measured_ms / predicted_ms
        lat = self.latency
        rest_ms = (lat.predict_ms(n) - lat.predict_ms(done) + lat.predict_ms(0)) * pace
        left_ms = (deadline - self.clock.wall()) * 1000
        # Past the deadline nothing is saved: the answer keeps the events it was planned with.
        return (pace, rest_ms) if 0 < REPLAN_FILL * left_ms < rest_ms else None

    def observe_full(self, used: int, kept_ms: float) -> None:
        """A full ranking of ``used`` events computed for ``kept_ms``: a latency-model sample,
        and the full pace."""
        self.samples.append((used, kept_ms))
        self.full.observe(self.latency.predict_ms(used), kept_ms)

    def refit(self) -> LatencyModel:
        """Refit the latency model from recent full-path measurements when they span enough lengths."""
        if len({n // 64 for n, _ in self.samples}) >= 4:
            self.latency = LatencyModel.fit(self.samples)
        return self.latency

    def full_steps(
        self,
        runner: ModelRunner,
        plan: Callable[[float | None], Events],
        candidates: torch.Tensor,
        request_ts: float,
        deadline: float,
        breakdown: dict[str, float],
        ranked: list[Events],
    ) -> Iterator[torch.Tensor | None]:
        """A full ranking as steps: the keys and values of the history that ``plan(None)``
        returns when the job starts on the device, in time slices, then the candidates against
        them (the scores, last). Once, when its slices (``REPLAN_AFTER_SLICES`` or more) run so
        much slower than planned that the rest would not fit (``behind``), it starts over with
        ``plan(pace)`` at the pace they ran, if that ends sooner; ``breakdown["replan_lost"]``: the
        slices it threw away (ms). ``ranked`` gets the history it ranked."""
        slicer = self.slicer()
        history, replanned = plan(None), False
        while True:
            prefix, predicted, measured, restart = None, 0.0, 0.0, False
            chunks = runner.prefill_steps(history, slicer or self.config.prefill_chunk)
            for ran, out in enumerate(slicer.measured(chunks) if slicer is not None else chunks, 1):
                if out is not None:
                    prefix = out
                    continue
                if slicer is not None and not replanned:
                    predicted, measured = predicted + slicer.predicted_ms, measured + slicer.measured_ms
                    behind = None
                    if ran >= REPLAN_AFTER_SLICES:
                        behind = self.behind(len(history), slicer.upto, predicted, measured, deadline)
                    if behind is not None:
                        replanned, (pace, rest_ms) = True, behind
                        shorter = plan(pace)
                        # Only if it ends sooner than the rest would: near the end, finishing
                        # beats starting over.
                        if self.latency.predict_ms(len(shorter)) * pace < rest_ms:
                            history, restart = shorter, True
                            breakdown["replan_lost"] = measured
                yield None
                if restart:
                    break
            if not restart:
                break
        ranked.append(history)
        yield runner.rank(prefix, history.slice(len(history)), candidates, request_ts)

    # ------------------------------------------------------------------ relay rankings

    def relay_predicted_ms(self, cached: int, new: int, candidates: int) -> float:
        """A relay ranking's device time by the latency model, before any pace."""
        lat = self.latency
        return lat.predict_ms(cached + new + candidates) - lat.predict_ms(cached)

    def slice_relay(self, cached: int, new: int, candidates: int) -> bool:
        """Whether a relay ranking is predicted to take longer than a device slice: then it runs
        in slices too (a capped heavy user's ranking against thousands of keys would otherwise
        hold every other ranking up for its whole length). Until relay rankings have been timed
        here, at the slowest pace the estimate allows: a ranking against many cached keys took
        several times what the model (fitted on full rankings) predicted, in one piece."""
        if not self.config.slice_ms:
            return False
        factor = self.score.factor if self.score.observations else self.score.hi
        return self.relay_predicted_ms(cached, new, candidates) * factor > self.config.slice_ms

    def observe_relay(self, cached: int, new: int, candidates: int, breakdown: dict[str, float]) -> None:
        """A relay ranking run in one piece times the scoring pace too: a pace learnt only from
        sliced rankings would never see that unsliced ones run slower than predicted."""
        if "compute" in breakdown:
            self.score.observe(self.relay_predicted_ms(cached, new, candidates), breakdown["compute"])

    def relay_steps(
        self,
        runner: ModelRunner,
        prefix: PrefixKV,
        history: Events,
        candidates: torch.Tensor,
        request_ts: float,
        grown: list[PrefixKV],
    ) -> Iterator[torch.Tensor | None]:
        """A relay ranking as steps: the new events extend the cached prefix in time slices,
        then the candidates are scored against it a slice's worth of keys at a time
        (``ModelRunner.score_steps``: all candidates against a range of one layer's keys, so each
        key is read once per layer, however many slices; slicing the candidates instead read
        every key once per slice, which cost a heavy user's ranking ~1.5x once slices got
        small). ``grown`` gets the prefix grown by the new events."""
        slicer = self.slicer(prefix.length)
        n, c = len(history), len(candidates)
        # The candidates' predicted cost spread evenly over the keys each layer visits.
        visits = max(1, n * runner.config.layers * -(-c // runner.config.candidate_batch))
        per_visit_ms = max(0.0, self.latency.predict_ms(n + c) - self.latency.predict_ms(n)) / visits
        step_started = 0.0

        def keys_per_step() -> int:
            # A step also ends once it has run a slice's time, whatever the pace said: a pace
            # that has not caught up with a slower device must not make one slice of a ranking.
            if self.clock.timer() - step_started >= self.config.slice_ms / 1000:
                return 0
            if per_visit_ms <= 0:
                return visits
            return int(self.config.slice_ms / self.score.factor / per_visit_ms)

        grown_prefix = prefix
        if n > prefix.length:
            assert slicer is not None  # sliced relay rankings exist only with slice_ms
            for out in slicer.measured(runner.prefill_steps(history, slicer, prefix=prefix)):
                if out is None:
                    yield None
                else:
                    grown_prefix = out
        grown.append(grown_prefix)
        t0 = step_started = self.clock.timer()
        for out in runner.score_steps(grown_prefix, candidates, request_ts, keys_per_step):
            if isinstance(out, int):  # keys visited by a step: timed into the pace
                self.score.observe(out * per_visit_ms, (self.clock.timer() - t0) * 1000)
                yield None
                t0 = step_started = self.clock.timer()
            else:
                yield out
