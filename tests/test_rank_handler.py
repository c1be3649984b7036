"""The rank handler (``streams.ranking.rank_handler``) without Kafka: where a request meets its prefill
signal, the one policy for waiting on a pre-inference, and what a request waits for before the
engine ranks it. The engine is stubbed here: its paths are tested in test_engine/test_heavy_user."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from relaygr.schemas import RankRequest, TriggerReason
from relaygr.streams.config import PipelineSettings
from relaygr.streams.ranking.rank_handler import PrefillRendezvous, RankHandler
from relaygr.workers.engine.engine_config import EngineConfig
from relaygr.workers.engine.latency_model import LatencyModel
from relaygr.workers.engine.pacing import DevicePacing

FAR = 3600.0


async def test_a_request_waiting_at_the_rendezvous_is_woken_by_its_signal() -> None:
    meet = PrefillRendezvous()
    waiter = asyncio.create_task(meet.signal("r1", FAR))
    await asyncio.sleep(0)
    assert not waiter.done()
    meet.arrived("r1")
    meeting = await asyncio.wait_for(waiter, FAR)
    assert meeting is not None and meeting.seen.is_set() and not meeting.done.is_set()
    meet.finished("r1", "computed")
    assert meeting.done.is_set() and meet.status("r1") == "computed"


async def test_a_signal_read_first_is_there_when_its_request_comes() -> None:
    meet = PrefillRendezvous()
    meet.finished("r1", "host")
    meeting = await meet.signal("r1", 0.0)
    assert meeting is not None and meeting.done.is_set() and meet.status("r1") == "host"


async def test_a_signal_not_read_in_time_is_not_seen() -> None:
    meet = PrefillRendezvous()
    assert await meet.signal("r1", 0.0) is None
    assert await meet.signal("r2", 0.001) is None
    assert meet.status("r1") is None


async def test_the_rendezvous_keeps_the_most_recent_request_ids() -> None:
    meet = PrefillRendezvous(capacity=2)
    meet.finished("a", "computed")
    meet.finished("b", "computed")
    await meet.signal("a", 0.0)  # used: the most recent now
    meet.finished("c", "computed")
    assert len(meet) == 2 and meet.status("b") is None
    assert meet.status("a") == meet.status("c") == "computed"
    with pytest.raises(ValueError):
        PrefillRendezvous(capacity=0)


def test_the_wait_policy_waits_only_for_a_prefill_that_can_finish_in_time() -> None:
    pacing = DevicePacing(EngineConfig(), LatencyModel(0.0, 0.01, 0.0))
    deadline = time.time() + 1.0
    assert pacing.prefill_room_s(deadline, 100.0, None) is not None  # progress unknown: room decides
    assert pacing.prefill_room_s(deadline, 100.0, 500.0) == pytest.approx(0.9, abs=0.05)
    assert pacing.prefill_room_s(deadline, 100.0, 2000.0) is None  # cannot be done in time
    assert pacing.prefill_room_s(time.time() + 0.05, 100.0, None) is None  # no room for the suffix


class Engine:
    """The engine as the handler's wait sees it; ``eta_ms``: what the pre-inference has left."""

    max_seq_len = 1024

    def __init__(self, eta_ms: float | None = None, cached: int = 0) -> None:
        self.pacing = DevicePacing(EngineConfig(), LatencyModel(0.0, 0.001, 0.0))
        self.eta_ms, self.cached = eta_ms, cached
        self.calls: list[str] = []

    def cached_length(self, _user: str, _history) -> int:
        return self.cached

    def predict_full_ms(self, n: int) -> float:
        return self.pacing.latency.predict_ms(n)

    def prefill_room_s(self, _user: str, deadline: float, after_tokens: int) -> float | None:
        return self.pacing.prefill_room_s(deadline, self.pacing.latency.predict_ms(after_tokens), self.eta_ms)

    def expedite_prefill(self, _user: str, _deadline: float) -> None:
        self.calls.append("expedite")

    def yield_prefill(self, _user: str) -> None:
        self.calls.append("yield")

    def abandon_prefill(self, _user: str) -> None:
        self.calls.append("abandon")


def handler(engine: Engine) -> RankHandler:
    return RankHandler(
        engine, None, None, PipelineSettings(short_term=16), "w0", lambda **_: None, lambda _p: None
    )  # type: ignore[arg-type]


def request(deadline_s: float) -> RankRequest:
    now = time.time()
    return RankRequest(
        request_id="r1",
        user_id="u",
        ts=now,
        candidates=[1, 2, 3],
        deadline_ts=now + deadline_s,
        prefill_expected=True,
        trigger=TriggerReason.ADMITTED,
        produced_at=now,
    )


HISTORY = torch.zeros(512)


async def test_a_request_whose_signal_never_comes_ranks_without_it() -> None:
    h = handler(Engine())
    assert await h._await_prefill(request(0.05), HISTORY) == "signal_not_seen"


async def test_a_request_waits_for_its_prefill_until_it_finishes() -> None:
    engine = Engine(eta_ms=1.0)
    h = handler(engine)
    h.rendezvous.arrived("r1")
    waiting = asyncio.create_task(h._await_prefill(request(FAR), HISTORY))
    await asyncio.sleep(0.02)
    assert not waiting.done() and engine.calls == ["expedite"]  # lent the ranking's priority
    h.rendezvous.finished("r1", "computed")
    assert await asyncio.wait_for(waiting, FAR) is None
    assert engine.calls == ["expedite", "yield"]


async def test_a_prefill_that_cannot_finish_in_time_is_abandoned_at_once() -> None:
    engine = Engine(eta_ms=FAR * 1000)
    h = handler(engine)
    h.rendezvous.arrived("r1")
    assert await h._await_prefill(request(1.0), HISTORY) == "prefill_not_ready"
    assert engine.calls == ["abandon"]  # never waited for


async def test_a_request_does_not_wait_for_a_prefix_it_nearly_has() -> None:
    h = handler(Engine(cached=len(HISTORY) - 16))
    assert await h._await_prefill(request(FAR), HISTORY) is None  # not even for its signal


class MappingEngine(Engine):
    """The engine as ``served_history`` sees it: raw item keys map to model ids one to one."""

    def __init__(self) -> None:
        super().__init__()
        self.mapped = 0

    def to_model_ids(self, keys: torch.Tensor) -> tuple[torch.Tensor, int]:
        self.mapped += 1
        return keys.clone(), 0


def _append(table, user: str, items: list[int], ts0: float, offset: int) -> int:
    from relaygr.schemas import BehaviorBatch

    n = len(items)
    batch = BehaviorBatch(
        user_id=user,
        item_ids=items,
        timestamps=[ts0 + i for i in range(n)],
        actions=[1] * n,
        source_partitions=[0] * n,
        source_offsets=list(range(offset, offset + n)),
    )
    table.append_many(0, [(offset + n, batch)], progress={0: offset + n})
    return offset + n


def test_a_users_unchanged_history_is_served_as_the_same_events_and_a_changed_one_anew(tmp_path) -> None:
    from relaygr.streams.history import HistoryTable

    table = HistoryTable(tmp_path / "history")
    engine = MappingEngine()
    h = RankHandler(engine, table, None, PipelineSettings(), "w0", lambda **_: None, lambda _p: None)  # type: ignore[arg-type]
    try:
        offset = _append(table, "u", [5, 6, 7], 1000.0, 0)
        reads = []
        records = table.records
        table.records = lambda user: reads.append(user) or records(user)  # type: ignore[method-assign]
        first = h.served_history("u", 2000.0)
        again = h.served_history("u", 2000.0)
        # The same events (a request's signal and the request read one history): mapped once, and
        # the records read once (every one is before both cuts).
        assert again.events is first.events and engine.mapped == 1 and reads == ["u"]
        again.wait_ms, again.complete = 5.0, False  # a request's own flags stay its own
        assert h.served_history("u", 2000.0).complete and first.wait_ms == 0.0
        # An earlier cut of the history, then a new behaviour: new events with it.
        assert h.served_history("u", 1001.5).events.item_ids.tolist() == [5, 6]
        # A cut inside the records reads them again, and so does the next cut past them (the
        # memo now holds the shorter history).
        assert h.served_history("u", 1001.5).events.item_ids.tolist() == [5, 6] and len(reads) == 3
        assert h.served_history("u", 2000.0).events.item_ids.tolist() == [5, 6, 7] and len(reads) == 4
        _append(table, "u", [8], 1500.0, offset)
        after = h.served_history("u", 2000.0)
        assert after.events.item_ids.tolist() == [5, 6, 7, 8] and after.total == 4
        assert engine.mapped == 4
    finally:
        table.close()


def test_top_items_are_the_best_scores_ties_in_candidate_order_and_reject_non_finite() -> None:
    from relaygr.schemas import RankedResult, RankPath, decode, encode
    from relaygr.streams.ranking.rank_handler import top_items

    scores = torch.tensor([0.5, 2.0, -1.0, 2.0, 0.5, 3.0], dtype=torch.float32)
    cands = [10, "a", 30, "b", 50, 60]
    got = top_items(cands, scores, 4)
    want = torch.argsort(scores, descending=True, stable=True)[:4].tolist()
    assert [i.item_id for i in got] == [cands[k] for k in want] == [60, "a", "b", 10]
    assert [i.score for i in got] == [scores[k].item() for k in want]
    # What the handler builds without validating each item is what validation would accept.
    res = RankedResult(request_id="r", user_id="u", ts=1.0, items=got, path=RankPath.RELAY, latency_ms=1.0)
    assert decode(RankedResult, encode(res)) == res
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="non-finite"):
            top_items(cands, torch.tensor([0.0, bad, 1.0, 2.0, 3.0, 4.0]), 3)
