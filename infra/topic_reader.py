"""Reading a topic back: its records from a starting point up to the end seen when reading starts.

Primitives:
- ``Start``: where reading starts: the beginning, an offset (one for every partition, or per
  partition) or a time; ``Start.parse(offset, timestamp)`` reads the CLI's spelling of them.
- ``Record``: one decoded record with its partition, offset and timestamp.
- ``read_topic(settings, topic, event_type, start=...) -> TopicRead``: the records of ``topic``
  from ``start`` up to the end offsets seen when reading starts. Undecodable records are
  counted, not returned.
- ``merge_by_time(records, key)``: one stream of several partitions' records, each partition's
  order kept.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Generic, TypeVar

from relaygr.infra.publishing import progress_printer
from relaygr.infra.settings import Settings
from relaygr.schemas import Event, SchemaError, decode

E = TypeVar("E", bound=Event)
T = TypeVar("T")


@dataclass(frozen=True)
class Record(Generic[E]):
    partition: int
    offset: int
    timestamp_ms: int
    value: E


@dataclass(frozen=True)
class Start:
    """Where reading starts: the beginning, an offset (all partitions, or per partition), or a time."""

    offset: int | dict[int, int] | None = None
    timestamp: float | None = None

    @classmethod
    def parse(cls, offset: str | None = None, timestamp: str | None = None) -> Start:
        if offset is not None and timestamp is not None:
            raise ValueError("give an offset or a timestamp, not both")
        if offset is not None:
            if ":" in offset:
                return cls(offset={int(p): int(o) for p, o in (x.split(":") for x in offset.split(","))})
            return cls(offset=int(offset))
        if timestamp is not None:
            try:
                return cls(timestamp=float(timestamp))
            except ValueError:
                return cls(timestamp=datetime.fromisoformat(timestamp).timestamp())
        return cls()


@dataclass
class TopicRead(Generic[E]):
    records: list[Record[E]]
    undecodable: int = 0


async def read_topic(
    settings: Settings,
    topic: str,
    event_type: type[E],
    start: Start | None = None,
    *,
    max_records: int | None = None,
    progress: bool = False,
) -> TopicRead[E]:
    """Records of ``topic`` from ``start`` up to the end offsets seen when reading starts."""
    from aiokafka import TopicPartition

    from relaygr.infra.kafka import consumer, describe_partitions

    start = start or Start()
    counts = await describe_partitions(settings, [topic])
    if topic not in counts:
        raise LookupError(f"topic {topic} does not exist")
    tps = [TopicPartition(topic, p) for p in range(counts[topic])]
    cons = consumer(settings, group_id=None, enable_auto_commit=False, max_partition_fetch_bytes=4 << 20)
    await cons.start()
    out: list[Record[E]] = []
    bad = 0
    tick = progress_printer(f"{topic} read") if progress else (lambda n: None)
    try:
        cons.assign(tps)
        ends = await cons.end_offsets(tps)
        begins = await cons.beginning_offsets(tps)
        firsts: dict[TopicPartition, int] = {}
        if start.timestamp is not None:
            found = await cons.offsets_for_times({tp: int(start.timestamp * 1000) for tp in tps})
            firsts = {tp: (found[tp].offset if found.get(tp) is not None else ends[tp]) for tp in tps}
        elif isinstance(start.offset, dict):
            firsts = {tp: start.offset.get(tp.partition, begins[tp]) for tp in tps}
        elif isinstance(start.offset, int):
            firsts = {tp: start.offset for tp in tps}
        else:
            firsts = dict(begins)
        for tp in tps:
            firsts[tp] = min(max(firsts[tp], begins[tp]), ends[tp])
            cons.seek(tp, firsts[tp])
        todo = {tp for tp in tps if firsts[tp] < ends[tp]}
        while todo and (max_records is None or len(out) < max_records):
            batch = await cons.getmany(*todo, timeout_ms=500, max_records=5000)
            for tp, msgs in batch.items():
                for m in msgs:
                    if m.offset >= ends[tp]:
                        break
                    try:
                        out.append(Record(tp.partition, m.offset, m.timestamp, decode(event_type, m.value)))
                    except SchemaError:
                        bad += 1
                    tick(len(out))
            for tp in list(todo):
                if await cons.position(tp) >= ends[tp]:
                    todo.discard(tp)
    finally:
        await cons.stop()
    if max_records is not None:
        out = out[:max_records]
    return TopicRead(out, bad)


def merge_by_time(records: Iterable[T], key: Callable[[T], float]) -> list[T]:
    """Merge records of several partitions (each with a ``partition`` attribute, given in each
    partition's order) by ``key``; within a partition the given order is kept even where ``key``
    is not monotone."""
    parts: dict[int, list[T]] = {}
    for r in records:
        parts.setdefault(r.partition, []).append(r)  # type: ignore[attr-defined]
    return list(heapq.merge(*parts.values(), key=key))
