"""A standby's requests fetched ahead (no broker): at the hand-over, those from the handed-over
offset on are ranked at once; where the kept ones do not reach back to that offset (or none came),
the partition is fetched again from there, so no request is skipped and none ranked twice."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from aiokafka import TopicPartition

from relaygr.schemas import TopicRegistry
from relaygr.streams.standby import Standby

REG = TopicRegistry("p", 2)
TP = TopicPartition(REG.name("rank"), 1)


class _Worker(SimpleNamespace):
    def __init__(self, kept: list[int]) -> None:
        super().__init__(reg=REG, spawned=[], seeks=[])
        self.prefetched = {TP: deque(SimpleNamespace(offset=o) for o in kept)}
        self.consumer = SimpleNamespace(seek=lambda tp, at: self.seeks.append((tp, at)))

    def _spawn(self, tp, m, handler) -> None:
        self.spawned.append(m.offset)

    async def _handle_rank(self, tp, m) -> None:  # pragma: no cover - never awaited here
        pass


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
