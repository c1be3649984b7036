"""The sizing rule over several machines' calibrations: a slow CPU, a fast CPU and an
accelerator-like device (8k tokens in about 5 ms)."""

from __future__ import annotations

import pytest

from relaygr.tools.sizing import (
    BREAK_FACTOR,
    GRID,
    NO_PACE,
    QPS_RANGE,
    SHARED_DEVICE_MAX_QPS,
    THROUGHPUT_FRACTION,
    relay_ms,
    relay_pace_of,
    size_demo,
    size_throughput,
)
from relaygr.workers.engine.latency_model import LatencyModel

BUDGET = 50.0
SHORT = 64
SLOW_CPU = LatencyModel(a=2.0, b=0.035, c=2e-6)  # 1,024 tokens in about 40 ms
FAST_CPU = LatencyModel(a=1.0, b=0.0075, c=5e-7)  # 1,024 tokens in about 9 ms
ACCELERATOR = LatencyModel(a=0.5, b=0.0005, c=1e-8)  # 8,192 tokens in about 5 ms


def test_the_calibrations_are_what_they_say() -> None:
    assert SLOW_CPU.predict_ms(1024) == pytest.approx(40, rel=0.05)
    assert FAST_CPU.predict_ms(1024) == pytest.approx(9.2, rel=0.05)
    assert ACCELERATOR.predict_ms(8192) == pytest.approx(5.3, rel=0.05)


@pytest.mark.parametrize("latency", [SLOW_CPU, FAST_CPU], ids=["slow-cpu", "fast-cpu"])
def test_demo_history_is_the_shortest_where_full_ranking_takes_twice_the_budget(latency) -> None:
    w = size_demo(latency, BUDGET, 32768, SHORT)
    assert w.history % GRID == 0
    assert latency.predict_ms(w.history) >= BREAK_FACTOR * BUDGET
    assert latency.predict_ms(w.history - GRID) < BREAK_FACTOR * BUDGET
    assert not w.full_fits
    assert "shortest" in w.why_history


def test_a_slower_machine_gets_shorter_histories() -> None:
    assert (
        size_demo(SLOW_CPU, BUDGET, 32768, SHORT).history < size_demo(FAST_CPU, BUDGET, 32768, SHORT).history
    )


def test_the_serving_cap_bounds_the_history_and_the_reason_says_so() -> None:
    w = size_demo(FAST_CPU, BUDGET, 8192, SHORT)  # 8,192 events: about 95 ms, over B but under 2B
    assert w.history == 8192
    assert BUDGET < w.full_ms < BREAK_FACTOR * BUDGET
    assert not w.full_fits
    assert "short of" in w.why_history


def test_an_accelerator_that_fits_every_history_is_told_so() -> None:
    w = size_demo(ACCELERATOR, BUDGET, 32768, SHORT)
    assert w.history == 32768
    assert w.full_fits and w.full_ms <= BUDGET
    assert "within the 50 ms budget" in w.why_history
    # Its rate is what the relay path serves, capped: the device is fast.
    assert w.qps == QPS_RANGE[1]


@pytest.mark.parametrize(
    "latency", [SLOW_CPU, FAST_CPU, ACCELERATOR], ids=["slow-cpu", "fast-cpu", "accelerator"]
)
def test_demo_rate_keeps_relay_rankings_within_the_device(latency) -> None:
    w = size_demo(latency, BUDGET, 32768, SHORT)
    assert QPS_RANGE[0] <= w.qps <= QPS_RANGE[1]
    assert w.qps * w.relay_ms <= 1000 * 0.25 + 1e-6 or w.qps == QPS_RANGE[0]
    assert w.relay_ms < w.full_ms and w.compute_ratio > 1


def test_flags_override_the_choice_and_are_marked() -> None:
    w = size_demo(SLOW_CPU, BUDGET, 32768, SHORT, history=1000, qps=3)
    assert (w.history, w.qps) == (1000, 3)
    assert w.overridden == ("history", "qps")
    assert all("(given)" in line for line in w.lines())
    assert size_demo(SLOW_CPU, BUDGET, 512, SHORT, history=1000).history == 512  # never past the cap


def test_relay_ranking_costs_the_suffix_and_the_candidates_at_the_end_of_the_history() -> None:
    lat = LatencyModel(a=1.0, b=0.01, c=0.0)
    assert relay_ms(lat, 4096, 64, candidates=128) == pytest.approx(0.01 * 192)
    quad = LatencyModel(a=1.0, b=0.0, c=1e-6)
    assert relay_ms(quad, 4096, 64, candidates=128) == pytest.approx(1e-6 * (4224**2 - 4032**2))
    assert relay_ms(lat, 100, 64, candidates=128) == pytest.approx(0.01 * 192)  # cached 36


def test_a_measured_relay_pace_scales_the_prediction_at_its_cached_length() -> None:
    lat = LatencyModel(a=1.0, b=0.01, c=0.0)
    pace = ((512.0, 2.0), (4096.0, 6.0))
    assert relay_ms(lat, 4096, 64, candidates=128, relay_pace=pace) == pytest.approx(
        0.01 * 192 * (2.0 + 4.0 * (4032 - 512) / (4096 - 512))
    )
    assert relay_ms(lat, 8192, 64, candidates=128, relay_pace=pace) == pytest.approx(0.01 * 192 * 6.0)  # flat
    assert relay_pace_of({"relay_pace": [[512, 2.0], [4096, 6.0]]}) == pace
    assert relay_pace_of({}) == NO_PACE


def test_the_demo_says_the_relay_pace_it_sized_with() -> None:
    latency = SLOW_CPU
    plain = size_demo(latency, BUDGET, 8192, SHORT)
    paced = size_demo(latency, BUDGET, 8192, SHORT, relay_pace=((0.0, 5.0),))
    assert paced.history == plain.history  # the history is full ranking's: the pace does not move it
    assert paced.relay_ms == pytest.approx(5.0 * plain.relay_ms)
    assert paced.compute_ratio == pytest.approx(plain.compute_ratio / 5.0)
    assert "5.0x the fit's marginal time" in paced.why_qps and "marginal" not in plain.why_qps


def test_a_cpu_device_shared_with_the_stages_gets_a_lower_rate() -> None:
    alone = size_demo(FAST_CPU, BUDGET, 32768, SHORT)
    shared = size_demo(FAST_CPU, BUDGET, 32768, SHORT, shared_device=True)
    assert shared.history == alone.history
    assert shared.qps == SHARED_DEVICE_MAX_QPS < alone.qps
    assert "shared with the stages" in shared.why_qps


@pytest.mark.parametrize("latency", [SLOW_CPU, FAST_CPU], ids=["slow-cpu", "fast-cpu"])
def test_throughput_history_takes_most_of_the_budget_at_low_load(latency) -> None:
    w = size_throughput(latency, BUDGET, 32768, SHORT)
    assert latency.predict_ms(w.history) <= THROUGHPUT_FRACTION * BUDGET
    assert latency.predict_ms(w.history + GRID) > THROUGHPUT_FRACTION * BUDGET
    assert w.compute_ratio > 1 and "compute ratio" in w.why_history


def test_throughput_history_on_an_accelerator_is_the_serving_cap() -> None:
    w = size_throughput(ACCELERATOR, BUDGET, 32768, SHORT)
    assert w.history == 32768 and "longest history the model serves" in w.why_history
