"""The ranking worker's behaviour applier: fetched routed-behaviours records into its history table.

Primitives:
- ``BehaviourApplier(history, alignment, engine, decode, reject, note)``: ``await apply(partition,
  records)`` writes one fetched batch of a routed-behaviours partition into the ``HistoryTable``
  (each user's events with their sources; the ingress's progress records merged into the
  partition's progress, their forward rate told to the ``HistoryAlignment``), a slice at a time
  (``streams.common.apply_in_slices``: about ``APPLY_SLICE`` events or ``APPLY_SLICE_S`` of
  decoding), and between two slices gives way to the rankings on the device (at most
  ``APPLY_YIELD_MAX_S``). The engine hears of every applied slice (``note_applied``: a burst
  slows the device, and full rankings planned meanwhile keep more headroom).
- Catch-up: ``catch_up(partition, start)`` / ``catch_up_to(partition, end)`` time a newly
  assigned partition's rebuild up to its log end at assignment (``history_caught_up`` in the
  worker's audit trail, ``relaygr_history_catchup_seconds``); ``forget(partition)`` on revocation.

- ``ahead_record(record)``: a fetched record as ``HistoryAlignment.fetched`` keeps it, before it
  is applied.

Records are anything with ``offset``, ``key``, ``value`` and ``headers`` (a consumer record):
this module reads no topic itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import Counter as PCounter
from prometheus_client import Gauge, Histogram

from relaygr.schemas import BehaviorBatch, SchemaError
from relaygr.schemas.routing import (
    HEADER_FORWARD_RATE,
    HEADER_PROGRESS,
    Positions,
    decode_positions,
    decode_rate,
)
from relaygr.streams.common import APPLY_SLICE, BEHAVIOURS_APPLIED, apply_in_slices
from relaygr.streams.history import HistoryTable
from relaygr.streams.history_alignment import HistoryAlignment

log = logging.getLogger(__name__)
STAGE = "ranking"
# The longest a slice decodes before it is applied: a request's fetch takes a few turns of the
# loop to complete, each one slice later (``hop_rank`` of the requests that arrive in a burst).
APPLY_SLICE_S = 0.001
# A burst's next slice waits while rankings are on the device, at most this long (then it applies
# one slice anyway, so a saturated device cannot stop behaviours), checking this often.
APPLY_YIELD_MAX_S = 0.02
APPLY_YIELD_POLL_S = 0.001

ADVERTISED_RATE = Gauge(
    "relaygr_rank_ingress_forward_rate",
    "The ingress's forward rate through a backlog, as its last progress record said (records/s): "
    "a request behind a backlog it cannot see forwarded by its deadline does not wait for it",
)
DUPLICATES = PCounter("relaygr_history_duplicates_total", "Routed behaviours applied once already, dropped")
CATCHUP = Histogram(
    "relaygr_history_catchup_seconds",
    "Assigned routed-behaviours partition: time from assignment until its history reached the "
    "partition's end offset at assignment",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)


class DeviceLoad(Protocol):
    """What the applier needs of the ranking engine."""

    def note_applied(self, events: int) -> None: ...

    def ranking_now(self) -> bool: ...


class CatchUp:
    """One assigned behaviours partition being read up to where its log ended at assignment
    (``end`` is None until the broker said where that is)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.end: int | None = None
        self.t0 = time.monotonic()
        self.events = 0


class BehaviourApplier:
    def __init__(
        self,
        history: HistoryTable,
        alignment: HistoryAlignment,
        engine: DeviceLoad,
        decode: Callable[[Any], BehaviorBatch],
        reject: Callable[[Any, str], None],
        note: Callable[..., None],
    ) -> None:
        """``decode(record)`` raises ``SchemaError`` on bad input, which ``reject(record,
        reason)`` sends to the dead letters; ``note(**fields)`` writes the audit trail."""
        self.history, self.alignment, self.engine = history, alignment, engine
        self.decode, self.reject, self.note = decode, reject, note
        self.catching_up: dict[int, CatchUp] = {}  # partition -> its rebuild in progress

    async def apply(self, partition: int, records: list) -> None:
        """One fetched batch of ``partition`` into the history table (see the module docstring)."""
        batch: list[tuple[int, BehaviorBatch | None]] = []
        progress: Positions = {}
        events = 0

        async def take(m: Any) -> int:
            nonlocal events
            if HEADER_PROGRESS in dict(m.headers or ()):
                self._merge_progress(m, progress)
                batch.append((m.offset, None))
                return 0
            try:
                ev: BehaviorBatch | None = self.decode(m)
            except SchemaError as e:
                self.reject(m, str(e))
                ev = None
            batch.append((m.offset, ev))
            n = len(ev) if ev is not None else 0
            events += n
            return n

        async def flush() -> None:
            nonlocal batch, progress, events
            # A progress record covers what precedes it, all of which is in this slice or before.
            applied = self.history.append_many(partition, batch, progress=progress or None)
            BEHAVIOURS_APPLIED.labels(STAGE).inc(applied)
            self.engine.note_applied(applied)
            if applied < events:
                DUPLICATES.inc(events - applied)
            self.alignment.notify()
            if partition in self.catching_up:
                self.caught_up(partition, applied)
            batch, progress, events = [], {}, 0

        await apply_in_slices(
            records, take, flush, max_events=APPLY_SLICE, max_s=APPLY_SLICE_S, between=self._yield_to_rankings
        )

    def _merge_progress(self, m: Any, progress: Positions) -> None:
        try:
            marked = decode_positions(m.value)
            rate = dict(m.headers).get(HEADER_FORWARD_RATE)
            if rate is not None:
                forwards = decode_rate(rate)
                self.alignment.advertise(marked, forwards)
                ADVERTISED_RATE.set(forwards)
            for q, pos in marked.items():
                progress[q] = max(progress.get(q, 0), pos)
        except ValueError as e:
            self.reject(m, f"unreadable progress record: {e}")

    async def _yield_to_rankings(self) -> None:
        """Between two slices of a burst: while rankings are on the device (or wait for it), at
        most APPLY_YIELD_MAX_S. Decoding behaviours holds the interpreter, which the device thread
        needs between its tensor ops: a ranking computed next to a burst took 2-4x its time."""
        give_up = time.monotonic() + APPLY_YIELD_MAX_S
        while self.engine.ranking_now() and time.monotonic() < give_up:
            await asyncio.sleep(APPLY_YIELD_POLL_S)

    # ------------------------------------------------------------------ catch-up

    def catch_up(self, partition: int, start: int) -> None:
        """``partition`` was assigned with its table at offset ``start``: time its rebuild."""
        self.catching_up.setdefault(partition, CatchUp(start))

    def needs_end(self, partition: int) -> bool:
        """Whether ``partition``'s rebuild waits to be told where its log ends."""
        c = self.catching_up.get(partition)
        return c is not None and c.end is None

    def catch_up_to(self, partition: int, end: int | None) -> None:
        """The log of ``partition`` ended at ``end`` at assignment (None: unknown)."""
        c = self.catching_up.get(partition)
        if c is None:
            return
        if end is None or end <= c.start:  # unknown, or nothing to rebuild
            del self.catching_up[partition]
            return
        c.end = end
        self.caught_up(partition, 0)  # perhaps read up to it already

    def forget(self, partition: int) -> None:
        self.catching_up.pop(partition, None)

    def caught_up(self, partition: int, applied: int) -> None:
        """Count ``applied`` events towards the partition's rebuild; once it reached the end offset
        seen at assignment, note how long the rebuild took."""
        c = self.catching_up[partition]
        c.events += applied
        reached = self.history.next_offset(partition)
        if c.end is None or reached < c.end:
            return
        del self.catching_up[partition]
        seconds = time.monotonic() - c.t0
        CATCHUP.observe(seconds)
        log.info(
            "history of partition %d caught up: offsets %d..%d, %d events in %.2f s",
            partition,
            c.start,
            c.end,
            c.events,
            seconds,
        )
        self.note(
            event="history_caught_up",
            partition=partition,
            from_offset=c.start,
            to_offset=c.end,
            records=c.end - c.start,
            events=c.events,
            seconds=round(seconds, 3),
        )


def ahead_record(m) -> tuple[int, bytes | None, Positions | None]:
    """A fetched routed-behaviours record as ``HistoryAlignment.fetched`` keeps it: its offset,
    its key (the user's), and a progress record's positions (an unreadable one: no positions,
    and no user)."""
    if HEADER_PROGRESS not in dict(m.headers or ()):
        return m.offset, m.key, None
    try:
        return m.offset, None, decode_positions(m.value)
    except ValueError:
        return m.offset, None, None
