"""Batched behaviour ingestion of the faust stages, on a stand-in stream (no broker needed)."""

from __future__ import annotations

from types import SimpleNamespace

from relaygr.schemas import BehaviorEvent, encode
from relaygr.schemas.routing import HEADER_PROGRESS
from relaygr.streams.common import decode_keyed, ingest_batches


class _Stream:
    """What ``ingest_batches`` uses of a faust stream: ``take_events`` and the current event.

    Like faust's drainer, it makes the next message current while a batch is being handled, and
    (like faust's take buffer) reads that event back once the batch is done."""

    def __init__(self, batches: list[list]) -> None:
        self.batches = batches
        self.current_event = None
        self.set_to: list = []
        self.buffered: list = []

    async def take_events(self, max_: int, within: float):
        for i, b in enumerate(self.batches):
            self.current_event = following = SimpleNamespace(name=f"after batch {i}")
            yield b
            self.buffered.append(self.current_event is following)

    def _set_current_event(self, ev=None) -> None:
        self.set_to.append(ev)
        self.current_event = ev


def _ev(user: str, item: int, *, key: str | None = None, raw: bytes | None = None, headers=None):
    value = raw if raw is not None else encode(BehaviorEvent(user_id=user, item_id=item, ts=float(item)))
    return SimpleNamespace(
        key=(key or user).encode(), value=value, headers=headers or {}, message=SimpleNamespace(partition=0)
    )


def _decode(ev) -> BehaviorEvent:
    return decode_keyed(BehaviorEvent, ev.key, ev.value, 1 << 20)


async def test_bad_events_are_dead_lettered_and_the_rest_applied_in_order() -> None:
    bad_json, wrong_key = _ev("u1", 9, raw=b"{not json"), _ev("u2", 5, key="u3")
    stream = _Stream([[_ev("u1", 1), bad_json, _ev("u2", 2)], [wrong_key, _ev("u1", 3)], [bad_json]])
    applied, dead = [], []

    def apply(pairs, as_event) -> None:
        for ev, b in pairs:
            as_event(ev)
            applied.append((b.user_id, b.item_id))

    async def to_dlq(ev, reason: str) -> None:
        dead.append((ev, reason))

    await ingest_batches("test", stream, _decode, apply, to_dlq)
    assert applied == [("u1", 1), ("u2", 2), ("u1", 3)]
    assert [ev for ev, _ in dead] == [bad_json, wrong_key, bad_json]
    assert "user_id" in dead[1][1]  # the reason names the field that disagrees with the key
    # Each batch's events were current while applied; then the drainer's event is current again.
    assert [ev for ev in stream.set_to if any(ev is x for b in stream.batches for x in b)] == [
        stream.batches[0][0],
        stream.batches[0][2],
        stream.batches[1][1],
    ]
    assert stream.buffered == [True, True, True]


async def test_a_failing_apply_dead_letters_its_batch_and_ingestion_goes_on() -> None:
    first, second = [_ev("u1", 1), _ev("u2", 2)], [_ev("u1", 3)]
    applied, dead = [], []

    def apply(pairs, as_event) -> None:
        if any(b.item_id == 2 for _, b in pairs):
            raise RuntimeError("table unavailable")
        applied.extend(b.item_id for _, b in pairs)

    async def to_dlq(ev, reason: str) -> None:
        dead.append((ev, reason))

    stream = _Stream([first, second])
    await ingest_batches("test", stream, _decode, apply, to_dlq)
    assert applied == [3]
    assert stream.buffered == [True, True]
    assert [ev for ev, _ in dead] == first
    assert all("internal error in test: RuntimeError: table unavailable" in r for _, r in dead)


async def test_progress_records_are_skipped_not_dead_lettered() -> None:
    progress = _ev("", 0, raw=b'{"0": 5}', headers={HEADER_PROGRESS: b"1"})
    stream = _Stream([[_ev("u1", 1), progress, _ev("u1", 2)], [progress]])
    applied, dead = [], []

    def apply(pairs, as_event) -> None:
        applied.extend(b.item_id for _, b in pairs)

    async def to_dlq(ev, reason: str) -> None:
        dead.append(reason)

    await ingest_batches("test", stream, _decode, apply, to_dlq)
    assert applied == [1, 2] and dead == []


async def test_a_changelog_not_yet_in_the_metadata_is_waited_for_a_real_mismatch_dead_lettered(
    monkeypatch,
) -> None:
    """faust refuses a table write while its consumer's metadata lists the just-created changelog
    without partitions ("has 0 partitions"): the slice is applied again once it does, not
    dead-lettered (the table would miss those behaviours for good). Any other mismatch is."""
    from faust.exceptions import PartitionsMismatch

    from relaygr.streams import common

    monkeypatch.setattr(common, "CHANGELOG_WAIT_S", 0.0)

    def mismatch(n: int) -> PartitionsMismatch:
        return PartitionsMismatch(
            f"The source topic 'p.routed-behaviors' for table 't'\nhas 4 partitions, but the changelog\n"
            f"topic 'p-t-changelog' has {n} partitions.\n\nPlease make sure the topics have the same number"
        )

    for n, refusals, applied_after, dead_after in ((0, 3, 1, 0), (8, 1, 0, 1)):
        stream = _Stream([[_ev("u1", 1)]])
        calls, applied, dead = [], [], []

        def apply(pairs, as_event, n=n, refusals=refusals, calls=calls, applied=applied) -> None:
            calls.append(1)
            if len(calls) <= refusals:
                raise mismatch(n)
            applied.extend(b.item_id for _, b in pairs)

        async def to_dlq(ev, reason: str, dead=dead) -> None:
            dead.append(reason)

        await ingest_batches("test", stream, _decode, apply, to_dlq)
        assert (len(applied), len(dead)) == (applied_after, dead_after), n
        assert len(calls) == (refusals + 1 if n == 0 else 1)
