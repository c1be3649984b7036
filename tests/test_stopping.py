"""The SLO's confidence rule: exact binomial bounds of the miss rate and early stopping."""

from __future__ import annotations

import math
import random

import pytest

from relaygr.tools.experiment.stopping import (
    StopRule,
    binom_cdf,
    miss_rate_lower_bound,
    miss_rate_upper_bound,
    requests_to_hold,
)


def exact_cdf(k: int, n: int, p: float) -> float:
    """P(X ≤ k), term by term with exact binomial coefficients (independent of the module's)."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def test_binom_cdf_matches_the_exact_sum() -> None:
    for n, k, p in [(10, 3, 0.2), (300, 3, 0.025), (1000, 7, 0.004), (50, 0, 0.5)]:
        assert binom_cdf(k, n, p) == pytest.approx(exact_cdf(k, n, p), rel=1e-10)


def test_upper_bound_with_no_miss_is_the_closed_form() -> None:
    # k = 0: P(X = 0) = (1 - p)^n = alpha, so p = 1 - alpha^(1/n).
    for n in (10, 298, 299, 1000):
        assert miss_rate_upper_bound(n, 0) == pytest.approx(1 - 0.05 ** (1 / n), rel=1e-9)
    assert miss_rate_upper_bound(299, 0) == pytest.approx(0.009969, abs=1e-6)
    assert miss_rate_upper_bound(299, 0) <= 0.01
    assert miss_rate_upper_bound(298, 0) > 0.01


@pytest.mark.parametrize(("n", "k"), [(300, 3), (473, 1), (628, 2), (1000, 5), (40, 20)])
def test_upper_bound_leaves_alpha_below_it(n: int, k: int) -> None:
    ub = miss_rate_upper_bound(n, k)
    assert exact_cdf(k, n, ub) == pytest.approx(0.05, rel=1e-6)
    assert exact_cdf(k, n, ub * 0.99) > 0.05 > exact_cdf(k, n, ub * 1.01)


def test_known_values_and_lower_bound() -> None:
    assert miss_rate_upper_bound(300, 3) == pytest.approx(0.02564, abs=1e-5)
    assert miss_rate_upper_bound(10, 10) == 1.0 and miss_rate_lower_bound(10, 0) == 0.0
    lb = miss_rate_lower_bound(100, 5)
    assert 1 - exact_cdf(4, 100, lb) == pytest.approx(0.05, rel=1e-6)
    assert lb < 0.05 < miss_rate_upper_bound(100, 5)


def test_requests_to_hold() -> None:
    assert [requests_to_hold(k) for k in range(4)] == [299, 473, 628, 773]
    for k in range(4):
        n = requests_to_hold(k)
        assert miss_rate_upper_bound(n, k) <= 0.01 < miss_rate_upper_bound(n - 1, k)


def test_stop_rule_decisions() -> None:
    rule = StopRule(cap=1000, min_round=50, max_round=500)
    assert rule.decide(299, 0) == "holds"
    assert rule.decide(298, 0) == "continue"
    assert rule.decide(500, 1) == "holds"
    assert rule.decide(500, 4) == "continue"  # 913 requests with no further miss would hold
    assert rule.decide(913, 4) == "holds"
    assert rule.decide(60, 5) == "fails"  # the cap could not bring the bound to 1 % any more
    assert rule.decide(1000, 4) == "holds" and StopRule(cap=600).decide(600, 2) == "fails"
    assert StopRule(cap=10**6).decide(200, 10) == "fails"  # the lower bound is above 1 %
    assert rule.next_round(0, 0) == 299
    assert rule.next_round(299, 1) == 473 - 299
    assert rule.next_round(470, 1) == 50  # at least a round
    assert rule.next_round(980, 3) == 20  # never past the cap
    assert StopRule(max_round=100).next_round(0, 0) == 100  # short rounds: a failing point stops early


@pytest.mark.parametrize(("p", "verdict"), [(0.0005, "holds"), (0.05, "fails")])
def test_stop_rule_decides_a_simulated_point(p: float, verdict: str) -> None:
    rule = StopRule(cap=2000)
    rng = random.Random(7)
    n = k = 0
    while (v := rule.decide(n, k)) == "continue":
        m = rule.next_round(n, k)
        k += sum(rng.random() < p for _ in range(m))
        n += m
    assert v == verdict and n <= rule.cap
