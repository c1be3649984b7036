"""Single-flight: one leader per key; joiners share its result, its error, or learn it was abandoned."""

from __future__ import annotations

import asyncio

import pytest

from relaygr.workers.store.single_flight import FlightAbandoned, SingleFlight


async def test_joiners_share_one_result_and_one_error() -> None:
    flights: SingleFlight[str, int] = SingleFlight()
    gate = asyncio.Event()
    runs = 0

    async def work() -> int:
        nonlocal runs
        runs += 1
        await gate.wait()
        return 7

    leader = asyncio.create_task(flights.lead("k", work))
    await asyncio.sleep(0)
    assert "k" in flights
    joiners = [asyncio.create_task(flights.join("k")) for _ in range(3)]
    await asyncio.sleep(0)
    gate.set()
    assert await leader == 7 and await asyncio.gather(*joiners) == [7, 7, 7] and runs == 1
    assert "k" not in flights

    async def boom() -> int:
        await asyncio.sleep(0.01)
        raise ValueError("bad")

    leader = asyncio.create_task(flights.lead("k", boom))
    await asyncio.sleep(0)
    joiner = asyncio.create_task(flights.join("k"))
    for task in (leader, joiner):
        with pytest.raises(ValueError, match="bad"):
            await task
    with pytest.raises(LookupError):
        await flights.join("k")


async def test_a_cancelled_leader_abandons_the_flight_and_a_timeout_leaves_it_running() -> None:
    flights: SingleFlight[str, int] = SingleFlight()
    gate = asyncio.Event()

    async def work() -> int:
        await gate.wait()
        return 1

    leader = asyncio.create_task(flights.lead("k", work))
    await asyncio.sleep(0)
    with pytest.raises(TimeoutError):
        await flights.join("k", timeout_s=0.01)
    assert "k" in flights and not leader.done()  # the joiner gave up, the flight goes on
    joiner = asyncio.create_task(flights.join("k"))
    await asyncio.sleep(0)
    leader.cancel()
    with pytest.raises(FlightAbandoned):
        await joiner
    assert "k" not in flights
