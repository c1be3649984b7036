"""The time a training run takes: a cost model measured on this machine, a plan that fits a budget.

``relaygr train`` prints its estimate before training starts and keeps to it: it times a few
probe steps and rankings (``probe``), predicts every epoch's steps, validations and the final
evaluation from them, trains only the epochs that fit ``--time-budget`` (the learning rate then
decays over those), and stops at the budget whatever the machine does meanwhile, keeping the best
weights validated so far.

Primitives:
- ``Clock``: a source of monotonic seconds (``time.perf_counter``); tests inject their own.
- ``Deadline``: when a stage must end (``left``, ``passed``), on a ``Clock``.
- ``default_budget(events)``: the budget a log gets when ``--time-budget`` is not given.
- ``batch_shapes(lengths, max_len, batch_size, batch_tokens)``: the ``(rows, window)`` of each step
  of an epoch: windows grouped by length, at most ``batch_size`` rows and ``batch_tokens`` tokens a
  step (a step's cost is bounded whatever the history lengths).
- ``StepCost``: seconds of one step as ``a x tokens + b x pairs`` (rows x window, rows x window^2:
  the attention), ``fit`` to two timed probe steps.
- ``RankCost``: seconds of ranking one history against candidates as ``c + d x candidates x
  (events + 1)``, ``fit`` to two timed rankings.
- ``RunCosts`` / ``plan_time(costs, ...)`` -> ``TimePlan``: the epochs (and validation users) that
  fit the budget after the final evaluation's reserve, and the estimate's lines.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Clock = Callable[[], float]
"""Monotonic seconds."""

SECONDS_PER_EVENT = 0.006
"""Default budget per event of the log: 10 minutes for 100,000 events (a few minutes more for ML-1M's
million than its defaults took before the budget)."""
MIN_BUDGET = 600.0
"""The default budget of a log smaller than 100,000 events."""
BATCH_TOKENS = 10_240
"""Most tokens (rows x window) a training step reads: 32 rows of ML-100K's sized 320-event window,
so ML-100K trains as before while a longer window trains fewer rows a step, each step bounded."""
PLAN_SHARE = 0.9
"""Share of the budget the plan fills: the rest absorbs the machine's noise."""


def default_budget(events: int) -> float:
    """Seconds a log of ``events`` events gets when ``--time-budget`` is not given."""
    return max(MIN_BUDGET, SECONDS_PER_EVENT * events)


@dataclass
class Deadline:
    """The moment ``at`` (on ``clock``) a stage must end by."""

    at: float
    clock: Clock = time.perf_counter
    stopped: str | None = None  # why it was brought forward to now (``stop``)

    @classmethod
    def after(cls, seconds: float, clock: Clock = time.perf_counter) -> Deadline:
        return cls(clock() + seconds, clock)

    def stop(self, why: str) -> None:
        """Bring the deadline forward to now (a stop asked from outside: a signal)."""
        self.stopped = why

    def left(self) -> float:
        return 0.0 if self.stopped else self.at - self.clock()

    def passed(self) -> bool:
        return self.left() <= 0


def batch_shapes(
    lengths: Sequence[int], max_len: int, batch_size: int, batch_tokens: int = BATCH_TOKENS
) -> list[tuple[int, int]]:
    """``(rows, window)`` of each step of an epoch over sequences of these lengths: one window of
    at most ``max_len`` events per sequence, shortest first; a step holds at most ``batch_size``
    rows and (beyond one row) at most ``batch_tokens`` tokens of its longest window."""
    windows = sorted(min(n, max_len) for n in lengths)
    shapes: list[tuple[int, int]] = []
    i = 0
    while i < len(windows):
        rows = 1
        while (
            i + rows < len(windows) and rows < batch_size and (rows + 1) * windows[i + rows] <= batch_tokens
        ):
            rows += 1
        shapes.append((rows, windows[i + rows - 1]))
        i += rows
    return shapes


def _fit_two(x1: tuple[float, float], t1: float, x2: tuple[float, float], t2: float) -> tuple[float, float]:
    """Non-negative ``(p, q)`` with ``t ~ p x[0] + q x[1]`` through two points (least squares on one
    term where the two points cannot tell the terms apart)."""
    det = x1[0] * x2[1] - x2[0] * x1[1]
    if abs(det) > 1e-9 * max(1.0, abs(x1[0] * x2[1])):
        p = (t1 * x2[1] - t2 * x1[1]) / det
        q = (x1[0] * t2 - x2[0] * t1) / det
        if p >= 0 and q >= 0:
            return p, q
    # One term explains both: the one that fits better.
    candidates = []
    for k in (0, 1):
        s = x1[k] ** 2 + x2[k] ** 2
        if s > 0:
            c = (t1 * x1[k] + t2 * x2[k]) / s
            err = (t1 - c * x1[k]) ** 2 + (t2 - c * x2[k]) ** 2
            candidates.append((err, k, c))
    _, k, c = min(candidates)
    return (c, 0.0) if k == 0 else (0.0, c)


@dataclass(frozen=True)
class StepCost:
    """Seconds of one training step of ``rows`` windows of ``window`` events."""

    per_token: float
    per_pair: float

    def __call__(self, rows: int, window: int) -> float:
        return rows * window * self.per_token + rows * window * window * self.per_pair

    @classmethod
    def fit(cls, a: tuple[int, int, float], b: tuple[int, int, float]) -> StepCost:
        """From two timed steps ``(rows, window, seconds)``."""
        (r1, w1, t1), (r2, w2, t2) = a, b
        p, q = _fit_two((r1 * w1, r1 * w1 * w1), t1, (r2 * w2, r2 * w2 * w2), t2)
        return cls(p, q)


@dataclass(frozen=True)
class RankCost:
    """Seconds of ranking ``candidates`` items after a history of ``events`` events."""

    fixed: float
    per_pair: float

    def __call__(self, events: int, candidates: int) -> float:
        return self.fixed + candidates * (events + 1) * self.per_pair

    @classmethod
    def fit(cls, a: tuple[int, int, float], b: tuple[int, int, float]) -> RankCost:
        """From two timed rankings ``(events, candidates, seconds)``."""
        (e1, c1, t1), (e2, c2, t2) = a, b
        p, q = _fit_two((1.0, c1 * (e1 + 1)), t1, (1.0, c2 * (e2 + 1)), t2)
        return cls(p, q)


@dataclass(frozen=True)
class RunCosts:
    """What one epoch, one validation and the final evaluation cost on this machine, as measured."""

    epoch: float
    """CPU seconds of one epoch's training steps."""
    validation: float
    """CPU seconds of one validation (every validation user ranked)."""
    evaluation: float
    """CPU seconds of the final evaluation (every history length, every evaluated user)."""
    spent: float = 0.0
    """Wall seconds already gone (reading the log, the probes)."""
    steps: int = 1
    """Steps an epoch takes."""
    share: float = 1.0
    """CPU seconds the process gets per wall second (below 1 on a shared machine, up to the
    threads on an idle one): a CPU second takes 1 / share wall seconds."""

    def wall(self, cpu_seconds: float) -> float:
        return cpu_seconds / max(self.share, 1e-3)


@dataclass
class TimePlan:
    """The epochs a run trains and what it should take."""

    epochs: int
    decay_epochs: int
    min_epochs: int
    estimate: float
    budget: float
    training_deadline: float
    """Seconds after the start by which training (with its validations) must end: the budget less
    the final evaluation's reserve."""
    binds: bool
    lines: list[str] = field(default_factory=list)


def _run_seconds(costs: RunCosts, epochs: int, min_epochs: int, max_steps: int | None = None) -> float:
    validations = max(0, epochs - min_epochs + 1)
    training = epochs * costs.epoch
    if max_steps is not None and max_steps < epochs * costs.steps:  # --max-steps ends it sooner
        training = max_steps / costs.steps * costs.epoch
        validations = max(0, math.ceil(max_steps / costs.steps) - min_epochs + 1)
    return costs.spent + costs.wall(training + validations * costs.validation + costs.evaluation)


def plan_time(
    costs: RunCosts,
    budget: float,
    *,
    epochs: int,
    decay_epochs: int,
    min_epochs: int,
    epochs_given: bool = False,
    max_steps: int | None = None,
) -> TimePlan:
    """The epochs that fit ``PLAN_SHARE`` of ``budget`` seconds: ``epochs`` (the cap) when they
    fit; else as many as fit, the learning rate decaying over them and validation starting no
    later than their last (a plan's ``binds``). Epochs set on the command line are kept: then the
    budget only stops the run."""
    fits = epochs
    while fits > 1 and _run_seconds(costs, fits, min(min_epochs, fits), max_steps) > PLAN_SHARE * budget:
        fits -= 1
    binds = fits < epochs and not epochs_given
    if binds:
        decay_epochs, min_epochs = fits, min(min_epochs, fits)
        epochs = fits
    estimate = _run_seconds(costs, epochs, min(min_epochs, epochs), max_steps)
    lines = [
        f"  time: about {_mins(estimate)} on this machine (budget {_mins(budget)}: --time-budget), "
        f"at the {costs.share:.0%} of a core this run gets now; CPU seconds: an epoch {costs.epoch:.1f} "
        f"({costs.steps} steps), a validation {costs.validation:.1f} (from epoch {min(min_epochs, epochs)}), "
        f"the final evaluation {costs.evaluation:.1f}",
    ]
    if binds:
        lines.append(
            f"  the budget binds: {epochs} epochs fit (the learning rate decays over them, "
            f"validation from epoch {min_epochs})"
        )
    elif epochs_given and fits < epochs:
        lines.append(f"  the budget stops training after about {fits} of the {epochs} epochs asked for")
    deadline = budget - costs.wall(costs.evaluation)
    # The evaluation's reserve never starves training: a run of no step would write a model that
    # ranks like chance (a demo on a loaded machine once served one).
    first_epoch = costs.spent + costs.wall(costs.epoch + costs.validation)
    if deadline < first_epoch:
        deadline = first_epoch
        lines.append(
            f"  the budget cannot hold one epoch and the final evaluation: one epoch is trained anyway, "
            f"and the run takes about {_mins(first_epoch + costs.wall(costs.evaluation))} "
            f"(a larger --time-budget, or fewer --eval-users, keeps to it)"
        )
    return TimePlan(
        epochs=epochs,
        decay_epochs=decay_epochs,
        min_epochs=min_epochs,
        estimate=estimate,
        budget=budget,
        training_deadline=deadline,
        binds=binds,
        lines=lines,
    )


def _mins(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{math.ceil(seconds)} s"
