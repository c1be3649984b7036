"""Which offsets of a consumer's partitions are safe to commit while work on them runs concurrently.

Primitives: ``OffsetTracker`` (``start`` / ``done`` per record, ``committable``: per partition the
first offset not finished, ``pending``, ``forget``).
"""

from __future__ import annotations

from aiokafka import TopicPartition


class OffsetTracker:
    """Per partition: the next offset that is safe to commit (all before it are finished)."""

    def __init__(self) -> None:
        self._pending: dict[TopicPartition, set[int]] = {}
        self._next: dict[TopicPartition, int] = {}

    def start(self, tp: TopicPartition, offset: int) -> None:
        self._pending.setdefault(tp, set()).add(offset)
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)

    def done(self, tp: TopicPartition, offset: int) -> None:
        self._pending.get(tp, set()).discard(offset)

    def committable(self, tps: set[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        out = {}
        for tp, nxt in self._next.items():
            if tps is not None and tp not in tps:
                continue
            pending = self._pending.get(tp)
            out[tp] = min(pending) if pending else nxt
        return out

    def pending(self, tps: set[TopicPartition] | None = None) -> int:
        return sum(len(v) for tp, v in self._pending.items() if tps is None or tp in tps)

    def forget(self, tps: set[TopicPartition]) -> None:
        for tp in tps:
            self._pending.pop(tp, None)
            self._next.pop(tp, None)
