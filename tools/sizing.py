"""Sizing a run to the machine: the history length and request rate at which RelayGR's gain shows.

A workload picked for one machine's speed says nothing on another: 1,024-event histories break a
50 ms budget on a slow CPU and take 2 ms on an accelerator. So the demo and the throughput
experiment read the machine's own calibration (the ``LatencyModel`` of full ranking) and choose:

Primitives:
- ``relay_ms(latency, history, short_term, relay_pace=...)``: predicted time of a relay ranking
  of ``history`` events whose prefix is cached (the capacity plan's arithmetic: the marginal cost
  of the ``short_term`` suffix and the candidates after the prefix, times the relay pace the
  calibration measured); ``relay_pace_of(calibration)`` reads that pace from a calibration file.
- ``Workload``: a chosen history length and rate, the predictions behind them and why (``lines()``
  prints them).
- ``size_demo(latency, budget_ms, max_seq_len, short_term)``: the shortest history at which full
  ranking is predicted to take ``BREAK_FACTOR`` × the budget (clearly broken), within the model's
  serving cap; the rate at which relay rankings keep the device ``RELAY_UTILISATION`` busy (at most
  ``SHARED_DEVICE_MAX_QPS`` where the device is a CPU shared with the stages).
- ``size_throughput(latency, budget_ms, max_seq_len, short_term)``: the longest history whose full
  ranking at low load takes ``THROUGHPUT_FRACTION`` of the budget (most of it, with room for the
  queueing that load adds), and the compute ratio of full to relay ranking there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from relaygr.workers.engine.capacity import pace_at, relay_ranking_ms
from relaygr.workers.engine.latency_model import LatencyModel

Pace = tuple[tuple[float, float], ...]
NO_PACE: Pace = ((0.0, 1.0),)

BREAK_FACTOR = 2.0
"""The demo's histories: full ranking predicted at twice the budget (not at its edge, where
machine noise decides which side a request lands on)."""
RELAY_UTILISATION = 0.25
"""Share of the device the demo's relay rankings may take: the rest is for pre-inference
extensions, Poisson bursts and, on a CPU, the stages that share its cores."""
THROUGHPUT_FRACTION = 0.7
"""The throughput experiment's histories: full ranking at low load takes this share of B."""
MIN_HISTORY = 128
GRID = 64
"""Lengths are multiples of this many events (a short-term suffix of 64 fits any of them)."""
QPS_RANGE = (1.0, 20.0)
"""The demo's rate: at least one request a second; at most 20, what the stages of one small
machine sustain next to the ranking worker."""
SHARED_DEVICE_MAX_QPS = 10.0
"""At most this rate where the device is a CPU whose cores the ranking workers share with the
stages and the broker: there Poisson bursts of 20/s queued relay rankings past the budget (one
of four demo runs on 2 cores: P99 121 ms, against 36-49 ms at the same load)."""
CANDIDATES = 128
"""Candidates per request (the trace's and the calibration's)."""


def relay_ms(
    latency: LatencyModel,
    history: int,
    short_term: int,
    candidates: int = CANDIDATES,
    relay_pace: Pace = NO_PACE,
) -> float:
    """Predicted relay ranking of ``history`` events against a cached prefix of all but the last
    ``short_term``, as the capacity plan predicts it (``capacity.relay_ranking_ms``): the marginal
    cost of the suffix and the candidates after the prefix, times the pace calibration measured
    for relay rankings at that length (``relay_pace`` of the calibration file; none: 1)."""
    cached = max(0, history - short_term)
    return float(relay_ranking_ms(latency, cached, history - cached, candidates, relay_pace))


def relay_pace_of(calibration: dict) -> Pace:
    """The measured relay pace of a calibration file's contents (``NO_PACE`` if it has none)."""
    return tuple((float(n), float(p)) for n, p in calibration.get("relay_pace", NO_PACE))


@dataclass(frozen=True)
class Workload:
    history: int
    qps: float
    budget_ms: float
    full_ms: float  # predicted full ranking at ``history``
    relay_ms: float  # predicted relay ranking at ``history``
    full_fits: bool  # even the longest history the model serves ranks within the budget
    why_history: str
    why_qps: str
    overridden: tuple[str, ...] = field(default=())

    @property
    def compute_ratio(self) -> float:
        """Predicted full / relay ranking time at ``history``: the most relay can buy there."""
        return self.full_ms / self.relay_ms if self.relay_ms > 0 else float("inf")

    def lines(self) -> list[str]:
        def tag(what: str) -> str:
            return " (given)" if what in self.overridden else ""

        return [
            f"history {self.history} events{tag('history')}: {self.why_history}",
            f"rate {self.qps:g} requests/s{tag('qps')}: {self.why_qps}",
        ]

    def to_dict(self) -> dict:
        return {
            "history": self.history,
            "qps": self.qps,
            "budget_ms": self.budget_ms,
            "predicted_full_ms": round(self.full_ms, 2),
            "predicted_relay_ms": round(self.relay_ms, 2),
            "compute_ratio": round(self.compute_ratio, 2),
            "full_fits": self.full_fits,
            "why_history": self.why_history,
            "why_qps": self.why_qps,
            "overridden": list(self.overridden),
        }


def _paced(relay_pace: Pace, cached: int) -> str:
    """What the prediction says of the measured pace (nothing without one)."""
    if relay_pace == NO_PACE:
        return ""
    pace = float(pace_at(relay_pace, cached))
    return f" ({pace:.1f}x the fit's marginal time, the relay pace calibration measured at {cached} cached events)"


def _on_grid(n: float, lo: int, hi: int) -> int:
    """``n`` rounded up to the grid, within ``[lo, hi]`` (``hi`` itself need not be on it)."""
    up = int(-(-int(n) // GRID) * GRID)
    return max(lo, min(hi, up))


def _shortest_over(latency: LatencyModel, ms: float) -> int:
    """The shortest history predicted to take more than ``ms``."""
    return latency.max_tokens_within(ms) + 1


def size_demo(
    latency: LatencyModel,
    budget_ms: float,
    max_seq_len: int,
    short_term: int,
    *,
    history: int | None = None,
    qps: float | None = None,
    shared_device: bool = False,
    relay_pace: Pace = NO_PACE,
) -> Workload:
    """The demo's workload on the machine ``latency`` was calibrated on (see the module doc);
    ``history`` / ``qps`` override the choice (the reasons then say what the machine predicts);
    ``shared_device``: the device is a CPU shared with the stages (the rate is capped lower)."""
    lo = min(max(MIN_HISTORY, 2 * short_term), max_seq_len)
    longest_ms = latency.predict_ms(max_seq_len)
    target = BREAK_FACTOR * budget_ms
    full_fits = longest_ms <= budget_ms
    if history is not None:
        n = min(history, max_seq_len)
        why = f"full ranking predicted at {latency.predict_ms(n):.1f} ms against the {budget_ms:g} ms budget"
    elif full_fits:
        n = max_seq_len
        why = (
            f"this machine ranks even the longest history the model serves ({max_seq_len} events) in "
            f"{longest_ms:.1f} ms, within the {budget_ms:g} ms budget: full ranking holds here at every "
            "length, and relay can only save device time"
        )
    elif longest_ms < target:
        n = max_seq_len
        why = (
            f"the longest history the model serves: full ranking predicted at {longest_ms:.1f} ms, over the "
            f"{budget_ms:g} ms budget but short of {BREAK_FACTOR:g}x it (a longer serving cap would show more)"
        )
    else:
        n = _on_grid(_shortest_over(latency, target), lo, max_seq_len)
        why = (
            f"the shortest where full ranking is predicted to take {BREAK_FACTOR:g}x the {budget_ms:g} ms "
            f"budget ({latency.predict_ms(n):.1f} ms; the model serves up to {max_seq_len})"
        )
    full, relay = latency.predict_ms(n), relay_ms(latency, n, short_term, relay_pace=relay_pace)
    paced = _paced(relay_pace, n - short_term)
    if qps is not None:
        rate, why_rate = qps, f"relay ranking predicted at {relay:.1f} ms each{paced}"
    else:
        fit = RELAY_UTILISATION * 1000.0 / max(relay, 1e-3)
        cap = SHARED_DEVICE_MAX_QPS if shared_device else QPS_RANGE[1]
        rate = round(min(cap, max(QPS_RANGE[0], fit)), 1)
        shared = " (the device's cores are shared with the stages)" if shared_device else ""
        why_rate = (
            f"relay ranking predicted at {relay:.1f} ms each{paced}, so {fit:.0f}/s would keep the device "
            f"{RELAY_UTILISATION:.0%} busy"
            + (f"; capped at {cap:g}/s{shared}" if fit > cap else "")
            + f"; full ranking at this rate would need {rate * full / 10:.0f} % of it"
        )
    given = tuple(k for k, v in (("history", history), ("qps", qps)) if v is not None)
    return Workload(n, rate, budget_ms, full, relay, full_fits, why, why_rate, given)


def size_throughput(
    latency: LatencyModel, budget_ms: float, max_seq_len: int, short_term: int, relay_pace: Pace = NO_PACE
) -> Workload:
    """The throughput experiment's history (see the module doc); its rate is swept, not chosen."""
    lo = min(max(MIN_HISTORY, 2 * short_term), max_seq_len)
    within = latency.max_tokens_within(THROUGHPUT_FRACTION * budget_ms)
    n = max(lo, min(max_seq_len, within // GRID * GRID))
    full, relay = latency.predict_ms(n), relay_ms(latency, n, short_term, relay_pace=relay_pace)
    if within >= max_seq_len:
        why = (
            f"the longest history the model serves: full ranking predicted at {full:.1f} ms, under "
            f"{THROUGHPUT_FRACTION:.0%} of the {budget_ms:g} ms budget even there"
        )
    else:
        why = (
            f"the longest where full ranking at low load is predicted within {THROUGHPUT_FRACTION:.0%} of the "
            f"{budget_ms:g} ms budget ({full:.1f} ms)"
        )
    why += f"; relay ranking predicted at {relay:.1f} ms there, a compute ratio of {full / relay:.1f}x"
    return Workload(n, 0.0, budget_ms, full, relay, full <= budget_ms, why, "swept")
