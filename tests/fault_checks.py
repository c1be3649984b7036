"""What the fault tests check after a fault, read from Kafka and from the workers' state.

- ``read_results(settings, registry)``: the whole results topic up to its current end, as a table
  (the last result per request id, as a consumer keeping one answer per key reads it) and the
  number of records per request id (redeliveries show up there, at least once).
- ``histories_by_user(behaviours)``: the (item, action, ts) records produced per user, in order.
- ``worker_history(home, prefix, worker_id, user_id)``: the records of a user in a ranking
  worker's history table (the worker must have stopped: RocksDB is single-writer).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

from aiokafka import TopicPartition

from relaygr.infra.kafka import consumer
from relaygr.infra.settings import Settings
from relaygr.schemas import BehaviorEvent, RankedResult, TopicRegistry, decode


async def read_results(
    settings: Settings, reg: TopicRegistry
) -> tuple[dict[str, RankedResult], Counter[str]]:
    topic = reg.name("results")
    cons = consumer(settings, group_id=None)
    await cons.start()
    table: dict[str, RankedResult] = {}
    copies: Counter[str] = Counter()
    try:
        parts = [TopicPartition(topic, p) for p in sorted(cons.partitions_for_topic(topic) or ())]
        if not parts:
            await cons._client.force_metadata_update()
            parts = [TopicPartition(topic, p) for p in sorted(cons.partitions_for_topic(topic) or ())]
        cons.assign(parts)
        await cons.seek_to_beginning(*parts)
        ends = await cons.end_offsets(parts)
        while [tp for tp, end in ends.items() if await cons.position(tp) < end]:
            for msgs in (await cons.getmany(timeout_ms=500)).values():
                for m in msgs:
                    r = decode(RankedResult, m.value)
                    table[r.request_id] = r
                    copies[r.request_id] += 1
    finally:
        await cons.stop()
    return table, copies


def histories_by_user(behaviours: list[BehaviorEvent]) -> dict[str, list[tuple[int, int, float]]]:
    out: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
    for b in behaviours:
        out[b.user_id].append((b.item_id, b.action, b.ts))
    return dict(out)


def worker_history(home: Path, prefix: str, worker_id: str, user_id: str) -> list[tuple[int, int, float]]:
    from relaygr.streams.history import HistoryTable

    table = HistoryTable(Path(home) / "workers" / prefix / worker_id / "history")
    try:
        rec = table.records(user_id)
        return [
            (int(i), int(a), float(t)) for i, a, t in zip(rec["item"], rec["action"], rec["ts"], strict=True)
        ]
    finally:
        table.close()
