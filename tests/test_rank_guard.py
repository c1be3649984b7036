"""What the ranking worker does with a signal or request whose handling fails (no broker): bad input
and unexpected failures go to the dead letters with the reason and the offset is done, so the
partition's commits go on past it; while the worker stops, an unexpected failure is left
uncommitted for the next owner rather than dead-lettered."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiokafka import TopicPartition

from relaygr.schemas import SchemaError
from relaygr.streams.ranking.offset_tracker import OffsetTracker
from relaygr.streams.ranking.ranking_worker import RankingWorker

TP = TopicPartition("p.rank-requests", 0)


def _worker(stopping: bool = False) -> SimpleNamespace:
    tracker = OffsetTracker()  # what ``Partitions`` keeps of the offsets
    w = SimpleNamespace(
        tracker=tracker, partitions=SimpleNamespace(done=tracker.done), _stop=asyncio.Event(), dead=[]
    )

    async def dead_letter(tp, m, reason: str) -> None:
        w.dead.append((m.offset, reason))

    w._dead_letter = dead_letter
    if stopping:
        w._stop.set()
    return w


async def _handle(w: SimpleNamespace, handlers: list) -> dict:
    for offset, handler in enumerate(handlers):
        w.tracker.start(TP, offset)
        await RankingWorker._guard(w, TP, SimpleNamespace(offset=offset), handler)  # type: ignore[arg-type]
    return w.tracker.committable({TP})


async def _ok(tp, m) -> None:
    pass


async def _bad(tp, m) -> None:
    raise SchemaError("user_id", "missing")


async def _broken(tp, m) -> None:
    raise RuntimeError("device lost")


async def test_failures_go_to_the_dead_letters_and_commits_go_on_past_them() -> None:
    w = _worker()
    assert await _handle(w, [_ok, _bad, _broken, _ok]) == {TP: 4}
    assert w.dead == [
        (1, "message field 'user_id': missing"),
        (2, "internal error in ranking: RuntimeError: device lost"),
    ]


async def test_while_stopping_an_unexpected_failure_is_left_for_the_next_owner() -> None:
    w = _worker(stopping=True)
    assert await _handle(w, [_ok, _broken, _ok]) == {TP: 1}  # committed up to the failed one
    assert w.dead == [] and w.tracker.pending({TP}) == 1
