"""What a ranking worker holds per partition (``streams.ranking.partitions.Partitions``), no broker:
the loop's pause and resume (the bounded queue, held partitions, behaviours being applied), the
offsets it may commit (behaviours at the history table's own), and a released partition forgotten."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiokafka import TopicPartition

from relaygr.schemas import TopicRegistry
from relaygr.streams.ranking.partitions import Partitions

REG = TopicRegistry("p", 2)
BEH, SIG, RANK = (TopicPartition(REG.name(t), 0) for t in ("routed_behaviors", "prefill", "rank"))


def _partitions() -> tuple[Partitions, list]:
    forgot: list = []
    history = SimpleNamespace(next_offset=lambda p: 40 + p)
    alignment = SimpleNamespace(forget=forgot.append, fetched=lambda p, records: None)
    applied = asyncio.Event()

    async def apply(partition: int, records: list) -> None:
        await applied.wait()

    applier = SimpleNamespace(apply=apply, forget=forgot.append, applied=applied)
    partitions = Partitions(REG, history, alignment, applier, SimpleNamespace())  # type: ignore[arg-type]
    partitions.serve({BEH, SIG, RANK})
    return partitions, forgot


async def test_the_loop_pauses_work_past_its_room_held_partitions_and_behaviours_being_applied() -> None:
    p, _ = _partitions()
    assignment = {BEH, SIG, RANK}
    assert p.flow(assignment, room=True) == (set(), {BEH, SIG, RANK})
    assert p.flow(assignment, room=False) == ({SIG, RANK}, {BEH})  # behaviours keep flowing
    p.hold({SIG})
    assert p.flow(assignment, room=True) == ({SIG}, {BEH, RANK})
    p.unhold()
    p.apply(BEH, [SimpleNamespace(offset=40, key=b"u", headers=None)])
    assert p.flow(assignment, room=True) == ({BEH}, {SIG, RANK})  # its last batch is being applied
    p.applier.applied.set()  # type: ignore[attr-defined]
    await p.finish_applying()
    p.reap()
    assert p.flow(assignment, room=True) == (set(), {BEH, SIG, RANK})


async def test_commit_offsets_and_a_released_partition() -> None:
    p, forgot = _partitions()
    for offset in (5, 6, 7):
        p.start(RANK, offset)
    p.done(RANK, 5)
    p.done(RANK, 7)
    assert p.commit_offsets() == {RANK: 6, BEH: 40}  # the first not finished; the table's own
    p.release({BEH, RANK})
    assert p.assigned == {SIG} and p.pending() == 0 and p.commit_offsets() == {}
    assert forgot == [0, 0]  # the applier's catch-up and the alignment's records fetched ahead
