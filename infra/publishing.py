"""Publishing many events in order without holding every acknowledgement in flight.

Primitives:
- ``send_in_order(producer, topic, events, chunk=5000, on_chunk=None) -> int``: send each event
  (JSON, keyed by ``event.key()``) in the given order, wait for the broker's acknowledgements
  every ``chunk`` sends and at the end, and report progress after each chunk. Returns how many
  were sent. ``events`` may be a generator: it is consumed one event per send.
- ``progress_printer(what, every)``: an ``on_chunk``-style callback printing ``what: N`` to stderr.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Iterable
from typing import Any

from relaygr.schemas import Event, encode

SEND_CHUNK = 5000
"""Sends between two waits for acknowledgements: bounds the futures held, keeps batches full."""


async def send_in_order(
    producer: Any,
    topic: str,
    events: Iterable[Event],
    *,
    chunk: int = SEND_CHUNK,
    on_chunk: Callable[[int], None] | None = None,
) -> int:
    futs = []
    sent = 0
    for event in events:
        futs.append(await producer.send(topic, encode(event), key=event.key()))
        sent += 1
        if len(futs) >= chunk:
            await asyncio.gather(*futs)
            futs.clear()
            if on_chunk is not None:
                on_chunk(sent)
    await asyncio.gather(*futs)
    return sent


def progress_printer(what: str, every: int = 50_000) -> Callable[[int], None]:
    """A progress callback printing ``   what: N`` to stderr each time ``N`` passes a multiple of ``every``."""
    last = 0

    def tick(n: int) -> None:
        nonlocal last
        if n // every > last // every:
            print(f"   {what}: {n}", file=sys.stderr, flush=True)
        last = n

    return tick
