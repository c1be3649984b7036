"""The ranking worker's behaviour applier (``streams.ranking.history_applier``) on a real history table:
slices, progress records and their forward rate, dead letters, the device told of bursts, giving
way to rankings, and the catch-up of an assigned partition."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from relaygr.schemas import BehaviorBatch, encode
from relaygr.schemas.routing import HEADER_FORWARD_RATE, HEADER_PROGRESS, encode_positions
from relaygr.streams.common import decode_keyed
from relaygr.streams.history import HistoryTable
from relaygr.streams.history_alignment import HistoryAlignment
from relaygr.streams.ranking import history_applier
from relaygr.streams.ranking.history_applier import BehaviourApplier
from relaygr.workers.engine.latency_model import IngestMeter


class Device:
    """The engine as the applier sees it: an ingest meter, and whether rankings are on the device."""

    def __init__(self, ranking=lambda: False, meter: IngestMeter | None = None) -> None:
        self.meter = meter or IngestMeter()
        self.ranking = ranking

    def note_applied(self, events: int) -> None:
        self.meter.add(events)

    def ranking_now(self) -> bool:
        return self.ranking()


def record(offset: int, first: int, n: int = 1, user: str = "u") -> SimpleNamespace:
    offs = list(range(first, first + n))
    value = encode(
        BehaviorBatch(
            user_id=user,
            item_ids=offs,
            timestamps=[float(o) for o in offs],
            actions=[1] * n,
            source_partitions=[0] * n,
            source_offsets=offs,
        )
    )
    return SimpleNamespace(offset=offset, key=user.encode(), value=value, headers=[], partition=0)


def progress_record(offset: int, rate: bytes) -> SimpleNamespace:
    headers = [(HEADER_PROGRESS, b"1"), (HEADER_FORWARD_RATE, rate)]
    return SimpleNamespace(
        offset=offset, key=b"", value=encode_positions({0: 20}), headers=headers, partition=0
    )


def applier(table: HistoryTable, device: Device, history=None, dead=None, notes=None) -> BehaviourApplier:
    return BehaviourApplier(
        history or table,
        HistoryAlignment(table),
        device,
        lambda m: decode_keyed(BehaviorBatch, m.key, m.value, 1 << 20),
        lambda _m, reason: (dead if dead is not None else []).append(reason),
        lambda **fields: (notes if notes is not None else []).append(fields),
    )


async def test_routed_records_are_applied_in_short_slices_and_teach_the_forward_rate(
    tmp_path, monkeypatch
) -> None:
    """A slice ends after APPLY_SLICE_S of decoding (here 0: one record a slice, the loop free in
    between); a progress record's forward rate reaches the alignment, an unreadable one goes to
    the dead letters with its reason; the events applied reach the engine's ingest meter."""
    monkeypatch.setattr(history_applier, "APPLY_SLICE_S", 0.0)
    h = HistoryTable(tmp_path / "h")
    slices: list[int] = []

    def counted(partition, batch, **kw):
        slices.append(len(batch))
        return h.append_many(partition, batch, **kw)

    dead: list[str] = []
    device = Device(meter=IngestMeter(window_s=60.0, burst_events=20))
    a = applier(h, device, history=SimpleNamespace(append_many=counted, next_offset=h.next_offset), dead=dead)
    msgs = [record(0, 0, 10), record(1, 10, 10), progress_record(2, b"45000"), progress_record(3, b"nan")]
    await a.apply(0, msgs)
    assert slices == [1, 1, 1, 1]  # every record its own slice
    assert len(h.get("u")) == 20 and h.progress(0) == {0: 20}
    assert a.alignment.advertised == {0: 45000.0}
    assert device.meter.recent() == 20 and device.meter.bursting()  # the device is told
    assert len(dead) == 1 and "unreadable progress record" in dead[0] and "finite positive" in dead[0]
    h.close()


async def test_a_bad_record_goes_to_the_dead_letters_and_the_good_ones_are_applied(tmp_path) -> None:
    h = HistoryTable(tmp_path / "h")
    dead: list[str] = []
    bad = SimpleNamespace(offset=1, key=b"u", value=b"{not json", headers=[], partition=0)
    await applier(h, Device(), dead=dead).apply(0, [record(0, 0), bad, record(2, 1)])
    assert len(h.get("u")) == 2 and h.next_offset(0) == 3  # the bad record's offset is passed too
    assert len(dead) == 1
    h.close()


async def test_a_burst_waits_between_slices_while_rankings_are_on_the_device(tmp_path, monkeypatch) -> None:
    """Between two slices the applier waits while the device has ranking work (it needs the
    interpreter between tensor ops), and at most APPLY_YIELD_MAX_S: a device that is never free
    still gets every event applied."""
    monkeypatch.setattr(history_applier, "APPLY_SLICE_S", 0.0)
    monkeypatch.setattr(history_applier, "APPLY_YIELD_POLL_S", 0.0)
    h = HistoryTable(tmp_path / "h")
    asked: list[int] = []
    ranking_for = [3]  # the device ranks for 3 checks, then is free

    def ranking() -> bool:
        asked.append(len(h.get("u")))
        ranking_for[0] -= 1
        return ranking_for[0] >= 0

    a = applier(h, Device(ranking))
    await a.apply(0, [record(0, 0), record(1, 1)])
    assert asked == [1, 1, 1, 1]  # held after the first slice while the device ranked
    assert len(h.get("u")) == 2

    ranking_for[0] = 10**9  # never free: bounded by APPLY_YIELD_MAX_S a slice
    monkeypatch.setattr(history_applier, "APPLY_YIELD_MAX_S", 0.0)
    await a.apply(0, [record(2, 2), record(3, 3), record(4, 4)])
    assert len(h.get("u")) == 5
    h.close()


@pytest.mark.parametrize("end", [None, 0, 3])
async def test_an_assigned_partition_is_timed_until_it_reaches_its_log_end(tmp_path, end) -> None:
    h = HistoryTable(tmp_path / "h")
    notes: list[dict] = []
    a = applier(h, Device(), notes=notes)
    a.catch_up(0, start=0)
    assert a.needs_end(0)
    a.catch_up_to(0, end)
    if end in (None, 0):  # unknown, or nothing to rebuild: not timed
        assert not a.catching_up and not notes
        h.close()
        return
    await a.apply(0, [record(0, 0, 4), record(1, 4, 4)])
    assert 0 in a.catching_up  # offset 2 of 3 reached
    await a.apply(0, [record(2, 8, 4)])
    assert not a.catching_up
    assert [(n["event"], n["from_offset"], n["to_offset"], n["events"]) for n in notes] == [
        ("history_caught_up", 0, 3, 12)
    ]
    h.close()
