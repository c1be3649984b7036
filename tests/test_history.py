"""The ranking worker's RocksDB history table: idempotent by offset, survives a reopen."""

from __future__ import annotations

from relaygr.schemas import BehaviorEvent
from relaygr.streams.history import HistoryTable


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
