"""Event-time alignment of a request with its user's behaviours: waiting until a history table
covers what the request must see, and not for what cannot come in time.

Primitives:
- ``HistoryAlignment(table)``: ``await wait(partition, needed, until, user_key)`` until the
  partition's progress covers ``needed``, woken by ``notify()`` after each applied batch; no wait
  for records that the ingress's measured drain rate (``drain_rate``) cannot forward by ``until``,
  nor for records fetched already (``fetched``) none of which is the user's; ``await
  wait_offset(partition, end, until)`` until the table is applied up to a known log end.
- ``UNREACHABLE``, ``CLEAR_AHEAD``: the counters of waits that ended at once, and why.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from collections.abc import Iterable

from prometheus_client import Counter as PCounter

from relaygr.schemas.routing import Positions, covers
from relaygr.streams.common import ForwardRate
from relaygr.streams.history import HistoryTable

UNREACHABLE = PCounter(
    "relaygr_history_wait_unreachable_total",
    "Waits for a request's behaviours ended at once: the records missing could not be forwarded "
    "before its deadline at the measured drain rate",
)
CLEAR_AHEAD = PCounter(
    "relaygr_history_wait_clear_ahead_total",
    "Waits for a request's behaviours ended at once, complete: the records still to apply up to "
    "what it must see were fetched already, and none of them is its user's",
)


class HistoryAlignment:
    """Waits for a history table to cover the behaviours a request must see, and not for what
    cannot come in time.

    Waiters measure how fast the partition's progress moves while they are behind it (from one
    move to the next): the ingress is then forwarding a backlog, so that is its drain rate
    (public records per second; a geometric average of the samples, ``drain_rate``). A wait whose missing records would take
    longer than its time left at that rate ends at once: in a burst of tens of thousands of
    behaviours, a request ranks on what is there (``history_complete`` false) with all of its
    time, instead of waiting out its bound first and ranking late. A rate older than
    ``rate_max_age_s`` is not used (the waits it would end are what measure it again). The
    ingress's own forward rate (``advertise``, from its progress records) bounds it too, and is
    known before any wait: the longest backlog of one partition cannot be forwarded faster.

    Nor does a request wait for another user's burst that the worker has fetched and is still
    applying: when the records fetched ahead of the table reach a progress record that covers
    what the request must see, and none before it is its user's, the user's history is complete
    as it is (``fetched``, ``clear_ahead``). Offsets order a partition's log, so this holds
    exactly; a gap between the applied and the fetched records means waiting as before."""

    def __init__(self, table: HistoryTable, rate_weight: float = 0.3, rate_max_age_s: float = 5.0) -> None:
        self.table = table
        # partition -> records fetched and not applied yet, in offset order: (offset, key, the
        # positions of a progress record or None).
        self._ahead: dict[int, list[tuple[int, bytes | None, Positions | None]]] = {}
        self._moved = asyncio.Event()
        self.measured = ForwardRate(rate_weight, rate_max_age_s)
        self.advertised: dict[int, float] = {}  # public partition -> its ingress's forward rate

    @property
    def drain_rate(self) -> float | None:
        """Public records forwarded per second while a waiter was behind, as measured within
        ``rate_max_age_s`` (None: not measured lately)."""
        return self.measured.value

    def observe_drain(self, records: int, seconds: float) -> None:
        """A waiter saw ``records`` more forwarded over ``seconds`` while behind them."""
        self.measured.observe(records, seconds)

    def advertise(self, partitions: Iterable[int], rate: float) -> None:
        """The ingress forwarding these public partitions says it forwards ``rate`` records/s."""
        for q in partitions:
            self.advertised[int(q)] = rate

    def eta_s(self, progress: Positions, needed: Positions) -> float | None:
        """Seconds until ``needed`` is forwarded: the larger of the backlog at the measured drain
        rate and the longest of the partitions' backlogs at their ingress's own rate (None:
        neither known)."""
        gaps = {q: end - progress.get(q, 0) for q, end in needed.items() if end > progress.get(q, 0)}
        if not gaps:
            return 0.0
        etas = []
        rate = self.drain_rate
        if rate is not None:
            etas.append(sum(gaps.values()) / rate)
        if all(q in self.advertised for q in gaps):
            etas.append(max(gap / self.advertised[q] for q, gap in gaps.items()))
        # Each is a lower bound of a kind (no one forwards faster than its router; a measured pace
        # may be flattered by when progress records happened to land): the larger is the closer.
        return max(etas) if etas else None

    def fetched(self, partition: int, records: list[tuple[int, bytes | None, Positions | None]]) -> None:
        """Records of ``partition`` fetched for applying, in offset order: (offset, key, the
        positions of a progress record, else None). Records fetched again (after a seek) replace
        the ones kept."""
        ahead = self._ahead.setdefault(partition, [])
        if records:
            while ahead and ahead[-1][0] >= records[0][0]:
                ahead.pop()
            ahead.extend(records)
        self._unapplied(partition)
        self.notify()  # a waiter may find what it needs among them

    def forget(self, partition: int) -> None:
        """The partition was revoked or re-read: what was fetched of it no longer stands."""
        self._ahead.pop(partition, None)

    def _unapplied(self, partition: int) -> list[tuple[int, bytes | None, Positions | None]]:
        ahead = self._ahead.get(partition, [])
        applied = self.table.next_offset(partition)
        drop = bisect.bisect_left(ahead, applied, key=lambda r: r[0])
        if drop:
            del ahead[:drop]
        return ahead

    def clear_ahead(self, partition: int, want: Positions, user_key: bytes) -> bool:
        """Whether ``want`` is covered by a progress record among the records fetched and not
        yet applied, with no record of ``user_key`` before it: the user's history then already
        holds every behaviour the request must see, whoever else's burst is still being applied."""
        ahead = self._unapplied(partition)
        if not ahead or ahead[0][0] != self.table.next_offset(partition):
            return False  # records between the applied ones and those fetched are unknown
        progress = self.table.progress(partition)
        for _, key, marked in ahead:
            if marked is None:
                if key == user_key:
                    return False
                continue
            for q, pos in marked.items():
                progress[q] = max(progress.get(q, 0), pos)
            if covers(progress, want):
                return True
        return False

    def notify(self) -> None:
        """A batch was applied: wake every waiter to check again."""
        self._moved.set()
        self._moved = asyncio.Event()

    async def wait(
        self,
        partition: int,
        needed: dict[str, int] | dict[int, int],
        until: float,
        user_key: bytes | None = None,
    ) -> bool:
        """Wait until ``partition``'s progress covers ``needed`` (public partition -> end offset),
        at most until ``until`` (``time.monotonic()``), and not at all once the records missing
        cannot be forwarded by then at the measured drain rate, or once those fetched already
        cover it with none of ``user_key``'s among them (``clear_ahead``). Returns whether the
        user's history covers them."""
        want = {int(q): end for q, end in needed.items()}
        last_at, last_t, stepped = None, 0.0, False
        while True:
            progress = self.table.progress(partition)
            if covers(progress, want):
                return True
            if user_key is not None and self.clear_ahead(partition, want, user_key):
                CLEAR_AHEAD.inc()
                return True
            now = time.monotonic()
            at = sum(min(progress.get(q, 0), end) for q, end in want.items())
            if last_at is None:
                last_at = at
            elif at > last_at:
                # From one move to the next while behind: the ingress's pace (from the wait's
                # start it would be the phase of its progress records).
                if stepped:
                    self.observe_drain(at - last_at, now - last_t)
                last_at, last_t, stepped = at, now, True
            left = until - now
            if left <= 0:
                return False
            eta = self.eta_s(progress, want)
            if eta is not None and eta > left:
                UNREACHABLE.inc()
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._moved.wait(), left)

    async def wait_offset(self, partition: int, end: int, until: float) -> bool:
        """Wait until ``partition``'s table is applied up to offset ``end`` (its log end as the
        consumer knows it), at most until ``until`` (``time.monotonic()``). Returns whether it is."""
        while self.table.next_offset(partition) < end:
            left = until - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._moved.wait(), left)
        return True
