"""A latency model of full ranking, calibrated on the machine that ranks.

Primitives:
- ``LatencyModel``: predicted milliseconds of full ranking for a history of ``n`` tokens,
  ``a + b·n + c·n²`` (projections grow linearly, causal attention quadratically).
- ``LatencyModel.fit(samples)``: least squares on measured ``(n, ms)`` pairs, coefficients kept
  non-negative so that the prediction grows with ``n``.
- ``max_tokens_within(budget_ms)``: the longest history whose predicted time fits a budget (what
  full inference truncates to).
- ``tokens_within_slice(cached, slice_ms)``: how many more tokens a chunk may compute against
  ``cached`` keys within one device slice (the marginal cost of extending a history).
- ``save`` / ``load``: a JSON calibration file (``relaygr calibrate`` writes it).
- ``DevicePace``: how much slower (``factor`` > 1) or faster the device runs now than the model
  predicts, measured from the device's own slices (``observe(predicted_ms, measured_ms)``): a
  worker sharing cores with a broker and other stages computes the same slice 2-3x slower than
  on the quiet machine it was calibrated on, and slices sized by the quiet figure overrun.
- ``EngineClock``: the clocks device work is planned and timed by (tests simulate one).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class LatencyModel:
    a: float = 1.0
    b: float = 0.01
    c: float = 0.0

    def predict_ms(self, n: int | float) -> float:
        return self.a + self.b * n + self.c * n * n

    def max_tokens_within(self, budget_ms: float) -> int:
        """Largest ``n`` with ``predict_ms(n) <= budget_ms`` (0 if even an empty history does not fit)."""
        room = budget_ms - self.a
        if room <= 0:
            return 0
        if self.c <= 0:
            return int(room / self.b) if self.b > 0 else 1 << 30
        # The root of c·n² + b·n = room in the form without cancellation: (-b + √(b² + 4c·room)) / 2c
        # is 0 for a c that is tiny next to b (a refit on nearly linear times).
        n = 2 * room / (self.b + math.sqrt(self.b * self.b + 4 * self.c * room))
        return max(0, int(n))

    def tokens_within_slice(self, cached: int, slice_ms: float, *, lo: int = 16, hi: int = 1 << 20) -> int:
        """Largest ``k`` in ``[lo, hi]`` whose marginal cost ``predict_ms(cached + k) -
        predict_ms(cached)`` (new tokens against ``cached`` keys and each other) fits ``slice_ms``:
        a chunk near the end of a long history attends to many keys, so it gets fewer tokens."""
        lin = self.b + 2 * self.c * cached  # ms per extra token at this length
        if self.c <= 0:
            k = slice_ms / lin if lin > 0 else hi
        else:
            k = 2 * slice_ms / (lin + math.sqrt(lin * lin + 4 * self.c * slice_ms))  # as max_tokens_within
        return int(min(hi, max(lo, k)))

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float]]) -> LatencyModel:
        pts = np.asarray(list(samples), dtype=np.float64)
        if pts.ndim != 2 or pts.shape[0] < 3:
            raise ValueError("fit needs at least 3 (tokens, ms) samples")
        n, ms = pts[:, 0], pts[:, 1]
        design = np.stack([np.ones_like(n), n, n * n], axis=1)
        coef, *_ = np.linalg.lstsq(design, ms, rcond=None)
        if (coef < 0).any():  # refit without the negative terms rather than predict shrinking times
            keep = [i for i in range(3) if coef[i] >= 0] or [1]
            sub, *_ = np.linalg.lstsq(design[:, keep], ms, rcond=None)
            coef = np.zeros(3)
            coef[keep] = np.clip(sub, 0, None)
        return cls(float(coef[0]), float(coef[1]), float(coef[2]))

    def coeffs(self) -> list[float]:
        return [self.a, self.b, self.c]

    @classmethod
    def from_coeffs(cls, coeffs: list[float]) -> LatencyModel:
        if len(coeffs) != 3 or not all(math.isfinite(x) and x >= 0 for x in coeffs):
            raise ValueError(f"latency model needs 3 finite non-negative coefficients, got {coeffs}")
        return cls(*coeffs)

    def save(self, path: Path, **extra: object) -> None:
        path.write_text(json.dumps({"coeffs": self.coeffs(), **extra}, indent=2))

    @classmethod
    def load(cls, path: Path) -> LatencyModel:
        return cls.from_coeffs(json.loads(Path(path).read_text())["coeffs"])


@dataclass(frozen=True)
class EngineClock:
    """The clocks the engine plans and times device work by: ``wall``, seconds since the epoch
    (deadlines are wall-clock), and ``timer``, monotonic seconds (durations). Tests inject a
    simulated pair, so that a plan follows the device time they simulate, not the load of the
    machine that runs them."""

    wall: Callable[[], float] = time.time
    timer: Callable[[], float] = time.perf_counter


class DevicePace:
    """Measured device time over predicted, as an exponential average of log-ratios of recent
    slices (``weight`` each), kept within ``[lo, hi]``. A slice predicted under
    ``min_predicted_ms`` is not observed: timer and call overheads dominate it. One instance per
    kind of work whose fixed costs differ (extending a history; scoring candidates against it;
    whole rankings)."""

    def __init__(
        self,
        weight: float = 0.3,
        lo: float = 0.5,
        hi: float = 4.0,
        min_predicted_ms: float = 0.2,
    ):
        if not 0 < weight <= 1 or not 0 < lo <= 1 <= hi:
            raise ValueError(
                f"DevicePace: need 0 < weight <= 1 and 0 < lo <= 1 <= hi, got {weight}, {lo}, {hi}"
            )
        self.weight, self.lo, self.hi, self.min_predicted_ms = weight, lo, hi, min_predicted_ms
        self._log = 0.0
        self.observations = 0

    @property
    def factor(self) -> float:
        return min(self.hi, max(self.lo, math.exp(self._log)))

    def observe(self, predicted_ms: float, measured_ms: float) -> None:
        if predicted_ms < self.min_predicted_ms or not math.isfinite(measured_ms) or measured_ms <= 0:
            return
        # Clamped before averaging: one slice held up by a page fault or a preemption moves the
        # estimate by at most a bounded step.
        r = min(math.log(self.hi), max(math.log(self.lo), math.log(measured_ms / predicted_ms)))
        self._log += self.weight * (r - self._log)
        self.observations += 1


class IngestMeter:
    """Events applied in the last ``window_s``; ``bursting()`` when they are ``burst_events`` or
    more. A worker's applier decodes behaviours on the thread that shares the interpreter (and
    on a CPU machine the cores) with its device thread: while it works through a burst, a
    ranking computes up to about twice as slowly, and the slowdown starts within the ranking,
    before any slice could measure it. Thread-safe: the applier adds, the device thread reads."""

    def __init__(self, window_s: float = 0.25, burst_events: int = 4096) -> None:
        if window_s <= 0 or burst_events < 1:
            raise ValueError(
                f"IngestMeter: need window_s > 0 and burst_events >= 1, got {window_s}, {burst_events}"
            )
        self.window_s, self.burst_events = window_s, burst_events
        self._added: deque[tuple[float, int]] = deque()
        self._sum = 0
        self._lock = threading.Lock()

    def _expire(self, now: float) -> None:
        while self._added and self._added[0][0] <= now - self.window_s:
            self._sum -= self._added.popleft()[1]

    def add(self, events: int, now: float | None = None) -> None:
        if events <= 0:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            self._expire(now)
            self._added.append((now, events))
            self._sum += events

    def recent(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._expire(now)
            return self._sum

    def bursting(self, now: float | None = None) -> bool:
        return self.recent(now) >= self.burst_events
