"""Single-flight: however many callers need one key's work at once, one of them does it.

Primitives:
- ``SingleFlight[K, V]``: the flights in progress, one per key (not thread-safe: one event loop).
  - ``await lead(key, work)``: run ``work()`` as ``key``'s flight and return its result; callers
    that join meanwhile get the same result, or the same exception.
  - ``await join(key, timeout_s=None)``: the result of ``key``'s flight in progress. Raises what
    the flight raised, ``FlightAbandoned`` when its leader was cancelled (the work is undone:
    the caller may lead it again), ``TimeoutError`` after ``timeout_s`` (the flight goes on) and
    ``LookupError`` when no flight is in progress.
  - ``key in flights``: whether a flight of ``key`` is in progress.
- ``FlightAbandoned``: see ``join``.

A caller cancelled while it joins leaves the flight running for the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class FlightAbandoned(Exception):
    """The leader of the flight was cancelled before it finished."""


class SingleFlight(Generic[K, V]):
    def __init__(self) -> None:
        self._flights: dict[K, asyncio.Future[V]] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._flights

    async def lead(self, key: K, work: Callable[[], Awaitable[V]]) -> V:
        """Run ``work()`` as ``key``'s flight (there must be none in progress)."""
        if key in self._flights:
            raise RuntimeError(f"a flight of {key!r} is already in progress")
        flight: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self._flights[key] = flight
        try:
            result = await work()
        except asyncio.CancelledError:
            flight.cancel()
            raise
        except BaseException as e:
            flight.set_exception(e)
            flight.exception()  # retrieved: the joiners get it, nobody else must be told
            raise
        else:
            flight.set_result(result)
            return result
        finally:
            if self._flights.get(key) is flight:
                del self._flights[key]

    async def join(self, key: K, timeout_s: float | None = None) -> V:
        """The result of ``key``'s flight in progress (see the module docstring)."""
        flight = self._flights.get(key)
        if flight is None:
            raise LookupError(f"no flight of {key!r} in progress")
        try:
            return await asyncio.wait_for(asyncio.shield(flight), timeout_s)
        except asyncio.CancelledError:
            if flight.cancelled():  # the leader was cancelled, not this caller
                raise FlightAbandoned(f"the flight of {key!r} was abandoned") from None
            raise
