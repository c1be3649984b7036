"""Leases of the prefix store: which keys are pinned on the device, until when, and the device
bytes they reserve.

Primitives:
- ``DEFAULT_LEASE_TTL_S``: how long a pre-inferred prefix stays pinned unless told otherwise
  (every other default of the lease reads this one).
- ``Lease``: expiry, the bytes expected once computed, the bytes reserved.
- ``LeaseResult``: what the store's ``lease`` answers (admitted or not, why, the reservations).
- ``LeaseTable(budget_bytes)``: leases by key and the sum of their reservations, which never
  exceeds ``budget_bytes``. ``reserve`` admits or renews a lease (refused when the reservations
  would exceed the budget), ``resize`` changes a reservation within the budget, ``drop`` ends a
  lease, ``expire(now)`` ends the leases past their expiry (cheap when none is due).

No policy lives here (what to evict for a reservation, what a refused resize means): that is the
store's. Not thread-safe: the store's lock guards it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

DEFAULT_LEASE_TTL_S = 30.0
"""Lifetime of a lease when none is given: from pre-inference until the rank request, with room
for a slow pipeline."""


@dataclass
class Lease:
    expires_at: float
    expected_bytes: int
    reserved: int


@dataclass(frozen=True)
class LeaseResult:
    """Outcome of ``lease``. ``reason``: admitted, renewed or pinned_budget_exceeded."""

    admitted: bool
    reason: str
    expires_at: float | None
    reserved_bytes: int
    pinned_bytes: int
    budget_bytes: int

    def __bool__(self) -> bool:
        return self.admitted


class LeaseTable(Generic[K]):
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = int(budget_bytes)
        self.reserved = 0
        self._leases: dict[K, Lease] = {}
        # A lower bound of the earliest expiry: early only costs a scan, late would keep a lease.
        self._next_expiry = float("inf")

    def __contains__(self, key: object) -> bool:
        return key in self._leases

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[K]:
        return iter(self._leases)

    def get(self, key: K) -> Lease | None:
        return self._leases.get(key)

    def items(self) -> Iterator[tuple[K, Lease]]:
        return iter(self._leases.items())

    def fits(self, key: K, want: int) -> bool:
        """Whether ``key``'s reservation can become ``want`` bytes within the budget."""
        old = self._leases.get(key)
        return self.reserved - (old.reserved if old is not None else 0) + want <= self.budget_bytes

    def reserve(self, key: K, want: int, expires_at: float, expected_bytes: int) -> bool:
        """Admit or renew ``key``'s lease, reserving ``want`` bytes until ``expires_at``. False
        (nothing changed) when the reservations would exceed the budget."""
        if not self.fits(key, want):
            return False
        old = self._leases.get(key)
        self.reserved += want - (old.reserved if old is not None else 0)
        self._leases[key] = Lease(expires_at, int(expected_bytes), want)
        self._next_expiry = min(self._next_expiry, expires_at)
        return True

    def resize(self, key: K, want: int) -> bool:
        """Make ``key``'s reservation ``want`` bytes; False (nothing changed) if it would not fit."""
        lease = self._leases[key]
        if not self.fits(key, want):
            return False
        self.reserved += want - lease.reserved
        lease.reserved = want
        return True

    def drop(self, key: K) -> Lease:
        lease = self._leases.pop(key)
        self.reserved -= lease.reserved
        return lease

    def due(self, now: float) -> bool:
        return now >= self._next_expiry

    def expire(self, now: float) -> list[K]:
        """End every lease expired at ``now``; returns their keys."""
        expired = [k for k, lease in self._leases.items() if lease.expires_at <= now]
        for key in expired:
            self.drop(key)
        self._next_expiry = min((lease.expires_at for lease in self._leases.values()), default=float("inf"))
        return expired
