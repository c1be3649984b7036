"""A standby's hand-over (no broker). The requests it fetched ahead: those from the handed-over
offset on are ranked at once; where the kept ones do not reach back to that offset (or none came),
the partition is fetched again from there, so no request is skipped and none ranked twice. Its
switch to the group (and commit) waits until the old process has answered what it held; if that
process is gone without saying so, the requests after its last commit (all of a partition it never
committed) are ranked again, and the audit trail says which."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from aiokafka import TopicPartition

from relaygr.schemas import TopicRegistry
from relaygr.streams.ranking.standby import Standby

REG = TopicRegistry("p", 2)
TP = TopicPartition(REG.name("rank"), 1)


class _Worker(SimpleNamespace):
    def __init__(self, kept: list[int]) -> None:
        super().__init__(reg=REG, worker_id="ranker-0", spawned=[], seeks=[])
        self.prefetched = {TP: deque(SimpleNamespace(offset=o) for o in kept)}
        self.consumer = SimpleNamespace(seek=lambda tp, at: self.seeks.append((tp, at)))

    def take(self, tp, m) -> None:
        self.spawned.append(m.offset)


def _hand_over(kept: list[int], offset: int) -> _Worker:
    w = _Worker(kept)
    Standby(w)._rank_from(TP, offset)  # type: ignore[arg-type]
    assert TP not in w.prefetched
    return w


def test_the_kept_requests_from_the_offset_on_are_ranked_at_once() -> None:
    w = _hand_over([10, 11, 12, 13], 12)
    assert w.spawned == [12, 13] and w.seeks == []


def test_the_old_process_handled_every_kept_one() -> None:
    w = _hand_over([10, 11], 12)  # the next request is fetched as usual
    assert w.spawned == [] and w.seeks == []


def test_kept_ones_that_do_not_reach_back_are_fetched_again() -> None:
    w = _hand_over([20, 21], 12)  # 12..19 came before the standby kept any
    assert w.spawned == [] and w.seeks == [(TP, 12)]


def test_nothing_kept() -> None:
    w = _hand_over([], 12)
    assert w.spawned == [] and w.seeks == [(TP, 12)]


class _Group:
    def __init__(self, committed: dict[int, int | None]) -> None:
        self.by_partition = committed

    async def committed(self, tp: TopicPartition) -> int | None:
        return self.by_partition[tp.partition]

    async def beginning_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: 3 for tp in tps}  # the log starts at 3 (older requests deleted)


def _standby(answered: bool, old_pid: int, committed: dict[int, int | None]) -> tuple[Standby, list]:
    w = _Worker([])
    w.files = SimpleNamespace(handover_answered=lambda: answered)
    w.notes = []
    w.note = lambda **fields: w.notes.append(fields)
    sb = Standby(w)  # type: ignore[arg-type]
    sb.old_pid, sb.group, sb.handed_rank = old_pid, _Group(committed), {0: 50, 1: 70, 2: 9}  # type: ignore[assignment]
    ranged: list = []

    async def rank_range(tp: TopicPartition, start: int, end: int) -> None:
        ranged.append((tp.partition, start, end))

    sb._rank_range = rank_range  # type: ignore[method-assign]
    return sb, ranged


async def test_the_switch_waits_while_the_old_process_drains() -> None:
    import os

    sb, ranged = _standby(False, os.getpid(), {0: 40, 1: 70, 2: None})  # alive: this process
    assert not await sb._old_answered() and ranged == []
    sb, ranged = _standby(True, os.getpid(), {0: 40, 1: 70, 2: None})
    assert await sb._old_answered() and ranged == []


async def test_an_old_process_gone_before_answering_has_its_requests_ranked_again() -> None:
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    sb, ranged = _standby(False, gone.pid, {0: 40, 1: 70, 2: None})
    assert await sb._old_answered()
    # Partition 1 was committed up to the hand-over; 2 never: all of it, from the log's start.
    assert ranged == [(0, 40, 50), (2, 3, 9)]
    # The audit trail says which, before they are ranked again.
    assert sb.w.notes == [{"event": "unanswered", "pid": gone.pid, "ranked_again": {0: (40, 50), 2: (3, 9)}}]
