"""When a point holds the SLO, with confidence: exact binomial bounds of the miss rate and an
early-stopping rule in the spirit of MLPerf Inference's server scenario.

A point holds only if its P99 is within B with 95 % confidence: with n requests of which k
missed B (late, timed out, truncated or missing), the one-sided Clopper-Pearson upper bound of
the miss rate is at most 1 %. Requests go out in rounds until the rule decides: it holds once the
bound is at most 1 %; it fails as soon as even a run to the cap with no further miss could not
bring the bound down to 1 %, or the lower bound is above 1 % (the miss rate is above it with
95 % confidence). Undecided at the cap counts as a failure.

Primitives:
- ``binom_cdf(k, n, p)``: P(X ≤ k) for X ~ Binomial(n, p), summed in log space.
- ``miss_rate_upper_bound(n, k, confidence)``, ``miss_rate_lower_bound(n, k, confidence)``: the
  one-sided exact (Clopper-Pearson) bounds, by bisection on ``binom_cdf``.
- ``requests_to_hold(k, miss_rate, confidence)``: the fewest requests with which ``k`` misses can
  still hold (k = 0: 299; k = 1: 473 at 1 % and 95 %).
- ``StopRule(miss_rate, confidence, cap, min_round, max_round)``: ``decide(n, k)`` -> ``holds`` |
  ``fails`` | ``continue``; ``next_round(n, k)``: how many requests the next round sends (at most
  ``max_round``, so that a failing point stops soon after its misses).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Verdict = Literal["holds", "fails", "continue"]


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X ≤ k) for X ~ Binomial(n, p)."""
    if k < 0:
        return 0.0
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    base = math.lgamma(n + 1)
    terms = [base - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq for i in range(k + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def _bisect(f, lo: float, hi: float) -> float:
    """The root of a decreasing ``f`` on [lo, hi] (f(lo) ≥ 0 ≥ f(hi)), to float precision."""
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if f(mid) > 0:
            lo = mid
        else:
            hi = mid
    return hi


def miss_rate_upper_bound(n: int, k: int, confidence: float = 0.95) -> float:
    """The one-sided Clopper-Pearson upper bound of the miss rate: the p at which k or fewer
    misses in n requests has probability 1 - ``confidence``."""
    if n <= 0:
        return 1.0
    if not 0 <= k <= n:
        raise ValueError(f"k={k} outside [0, {n}]")
    if k == n:
        return 1.0
    alpha = 1.0 - confidence
    return _bisect(lambda p: binom_cdf(k, n, p) - alpha, 0.0, 1.0)


def miss_rate_lower_bound(n: int, k: int, confidence: float = 0.95) -> float:
    """The one-sided Clopper-Pearson lower bound: the p at which k or more misses in n requests
    has probability 1 - ``confidence``."""
    if n <= 0 or k <= 0:
        return 0.0
    if k > n:
        raise ValueError(f"k={k} outside [0, {n}]")
    alpha = 1.0 - confidence
    # P(X ≥ k) = 1 - cdf(k - 1) grows with p: solve cdf(k - 1) = 1 - alpha.
    return _bisect(lambda p: binom_cdf(k - 1, n, p) - (1.0 - alpha), 0.0, 1.0)


def requests_to_hold(k: int, miss_rate: float = 0.01, confidence: float = 0.95) -> int:
    """The fewest requests n with ``miss_rate_upper_bound(n, k) <= miss_rate``."""
    lo, hi = max(1, k), max(2, k + 1)
    while miss_rate_upper_bound(hi, k, confidence) > miss_rate:
        lo, hi = hi, hi * 2
    while lo < hi:
        mid = (lo + hi) // 2
        if miss_rate_upper_bound(mid, k, confidence) <= miss_rate:
            hi = mid
        else:
            lo = mid + 1
    return hi


@dataclass(frozen=True)
class StopRule:
    """Holds iff the upper bound of the miss rate is at most ``miss_rate`` at ``confidence``;
    requests in rounds of ``min_round`` to ``max_round``, at most ``cap`` in all."""

    miss_rate: float = 0.01
    confidence: float = 0.95
    cap: int = 1000
    min_round: int = 50
    max_round: int = 100

    def upper(self, n: int, k: int) -> float:
        return miss_rate_upper_bound(n, k, self.confidence)

    def decide(self, n: int, k: int) -> Verdict:
        if n > 0 and self.upper(n, k) <= self.miss_rate:
            return "holds"
        # No run to the cap could hold: even with no miss from here, the bound stays above.
        if self.upper(max(n, self.cap), k) > self.miss_rate:
            return "fails"
        if n > 0 and miss_rate_lower_bound(n, k, self.confidence) > self.miss_rate:
            return "fails"
        return "fails" if n >= self.cap else "continue"

    def next_round(self, n: int, k: int) -> int:
        """Requests of the next round: enough to hold if none of them misses, at least
        ``min_round`` and at most ``max_round``, never past the cap."""
        need = requests_to_hold(k, self.miss_rate, self.confidence) - n
        return max(0, min(self.cap - n, self.max_round, max(self.min_round, need)))
