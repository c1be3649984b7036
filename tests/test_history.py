"""The ranking worker's RocksDB history table: idempotent by offset, survives a reopen."""

from __future__ import annotations

import random

from relaygr.schemas import BehaviorBatch, BehaviorEvent
from relaygr.streams.history import RUN_EVENTS, HistoryTable


def ev(user: str, item: int, ts: float, action: int = 3) -> BehaviorEvent:
    return BehaviorEvent(user_id=user, item_id=item, ts=ts, action=action)


def test_append_get_and_before_ts(tmp_path) -> None:
    t = HistoryTable(tmp_path / "h")
    assert t.next_offset(0) == 0 and len(t.get("u")) == 0
    for off, (item, ts) in enumerate([(10, 1.0), (11, 2.0), (12, 3.0)]):
        assert t.append(0, off, ev("u", item, ts))
    h = t.get("u")
    assert h.item_ids.tolist() == [10, 11, 12] and h.action_ids.tolist() == [3, 3, 3]
    assert t.get("u", before_ts=3.0).item_ids.tolist() == [10, 11]
    assert t.next_offset(0) == 3 and t.next_offset(1) == 0
    t.close()


def test_replayed_offsets_are_not_applied_twice_and_state_survives_reopen(tmp_path) -> None:
    t = HistoryTable(tmp_path / "h")
    t.append(2, 0, ev("u", 1, 1.0))
    t.append(2, 1, ev("v", 2, 1.0))
    t.mark(2, 2)  # a dead-lettered message at offset 2
    t.close()
    t = HistoryTable(tmp_path / "h")
    assert t.next_offset(2) == 3
    assert not t.append(2, 1, ev("v", 2, 1.0))  # redelivered after a crash: skipped
    assert t.append(2, 3, ev("u", 5, 2.0))
    assert t.get("u").item_ids.tolist() == [1, 5] and t.get("v").item_ids.tolist() == [2]
    t.close()


def _batch(user: str, items: list[int], source: int, start: int) -> BehaviorBatch:
    n = len(items)
    return BehaviorBatch(
        user_id=user,
        item_ids=items,
        timestamps=[float(i) for i in items],
        actions=[1 + i % 3 for i in items],
        source_partitions=[source] * n,
        source_offsets=list(range(start, start + n)),
    )


def test_a_burst_is_written_as_runs_and_reads_back_event_by_event(tmp_path) -> None:
    t = HistoryTable(tmp_path / "h")
    assert t.append_many(0, [(0, _batch("u", list(range(2000)), 0, 0))]) == 2000
    keys = [k for k in t._db.keys(from_key=b"e/u\x00") if k.startswith(b"e/u\x00")]
    assert len(keys) == -(-2000 // RUN_EVENTS)  # one key per run, not per event
    h = t.get("u")
    assert h.item_ids.tolist() == list(range(2000)) and h.action_ids.tolist()[:4] == [1, 2, 3, 1]
    # Forwarded twice (an ingress restart): the copy's events are dropped, the new ones kept.
    assert t.append_many(0, [(1, _batch("u", list(range(1990, 2010)), 0, 1990))]) == 10
    assert t.get("u").item_ids.tolist() == list(range(2010))
    t.close()


def test_runs_keep_every_event_retention_keeps_whatever_the_alignment(tmp_path) -> None:
    """Random batches of several users (routed batches with re-forwarded copies, single events),
    with retention, against a plain list per user; reopened with another alignment, so that the
    retained tail starts inside runs written before."""
    rng = random.Random(7)
    want: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    sent = {u: 0 for u in want}  # source offset of each user's next new event (own source partition)
    offset = 0
    for align in (1, 96, 7):
        t = HistoryTable(tmp_path / "h", retain_events=700, retain_align=align)
        for _ in range(60):
            batch = []
            for u in rng.sample(sorted(want), rng.randint(1, 3)):
                if rng.random() < 0.3:  # one plain event
                    item = rng.randint(1, 10**6)
                    batch.append((offset, ev(u, item, float(offset))))
                    want[u].append(item)
                else:
                    n, again = rng.randint(1, 900), rng.randint(0, 5)
                    start = max(0, sent[u] - again)  # the first `again` were forwarded before
                    items = [rng.randint(1, 10**6) for _ in range(n)]
                    batch.append((offset, _batch(u, items, source=ord(u), start=start)))
                    fresh = items[sent[u] - start :]
                    want[u] += fresh
                    sent[u] = start + n
                offset += 1
            t.append_many(0, batch)
        for u, items in want.items():
            kept, first = t.get(u).item_ids.tolist(), t.first(u)
            assert kept == items[first:], (align, u)
            assert 700 <= len(kept) <= 700 + 175 + align or len(items) < 700
        t.close()


def test_a_user_s_version_changes_with_its_records_and_only_with_them(tmp_path) -> None:
    t = HistoryTable(tmp_path / "h")
    v0 = t.version("u")
    assert t.append(0, 0, ev("u", 10, 1.0))
    v1 = t.version("u")
    assert v1 != v0
    assert t.append(0, 1, ev("w", 11, 1.0))
    assert t.version("u") == v1  # another user's behaviour
    assert not t.append(0, 1, ev("u", 12, 2.0))  # a replayed offset changes nothing
    assert t.version("u") == v1
    assert t.append(0, 2, ev("u", 12, 2.0))
    v2 = t.version("u")
    assert v2 not in (v0, v1)
    t.discard_partition(0)
    assert t.version("u") not in (v0, v1, v2) and len(t.get("u")) == 0
    t.close()
