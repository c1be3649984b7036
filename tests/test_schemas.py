"""The contract: every event round-trips through the codec; bad input raises SchemaError naming the field."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr.schemas import (
    ALL_EVENTS,
    BehaviorEvent,
    RankedResult,
    RankRequest,
    RecommendationRequest,
    SchemaError,
    TopicRegistry,
    decode,
    encode,
)
from relaygr.schemas.examples import examples


def test_every_event_type_has_an_example() -> None:
    assert {type(e) for e in examples()} == set(ALL_EVENTS)


@pytest.mark.parametrize("event", examples(), ids=lambda e: type(e).__name__)
def test_codec_round_trip(event) -> None:
    data = encode(event)
    assert isinstance(data, bytes)
    assert json.loads(data.decode("utf-8"))["schema_version"] == 1
    assert decode(type(event), data) == event


def test_public_contract_fields() -> None:
    b = json.loads(encode(examples()[0]))
    assert isinstance(b["user_id"], str) and isinstance(b["item_id"], int) and isinstance(b["ts"], float)
    r = json.loads(encode(next(e for e in examples() if isinstance(e, RankedResult))))
    assert {"request_id", "user_id", "items", "path", "latency_ms"} <= r.keys()
    assert set(r["items"][0]) == {"item_id", "score"}
    reg = TopicRegistry("relaygr")
    assert reg.name("behaviors") == "relaygr.behaviors"
    assert reg.name("requests") == "relaygr.requests"
    assert reg.name("results") == "relaygr.results"
    assert reg.name("dead_letters") == "relaygr.dead-letters"
    assert reg["results"].key == "request_id" and reg["behaviors"].key == "user_id"


def test_co_partitioned_topics_share_partition_count_and_key() -> None:
    reg = TopicRegistry("x", partitions=6)
    co = [s for s in reg if s.co_partitioned]
    assert {s.partitions for s in co} == {6}
    assert {s.key for s in co} == {"user_id"}
    assert {s.role for s in co} >= {"routed_behaviors", "routed_requests", "prefill", "rank"}
    # The public inputs take any producer's partitioning: the ingress re-keys them.
    assert not reg["behaviors"].co_partitioned and not reg["requests"].co_partitioned


GOOD = {"user_id": "u1", "item_id": 5, "ts": 1.5}


@pytest.mark.parametrize(
    ("data", "field", "needle"),
    [
        (b"\xff\xfe{}", "$", "invalid UTF-8"),
        (b'{"user_id": "u1", ', "$", "invalid JSON"),
        (b"", "$", "empty"),
        (b"[1, 2]", "$", "JSON object"),
        (json.dumps({"user_id": "u1", "ts": 1.0}).encode(), "item_id", "missing"),
        (json.dumps({**GOOD, "item_id": "5"}).encode(), "item_id", "integer"),
        (json.dumps({**GOOD, "item_id": -1}).encode(), "item_id", "greater than or equal"),
        (json.dumps({**GOOD, "user_id": 7}).encode(), "user_id", "string"),
        (json.dumps({**GOOD, "user_id": ""}).encode(), "user_id", "at least 1"),
        (json.dumps({**GOOD, "user_id": "x" * 129}).encode(), "user_id", "at most 128"),
        (json.dumps({**GOOD, "ts": 1e300}).encode(), "ts", "less than or equal"),
        (b'{"user_id": "u1", "item_id": 5, "ts": NaN}', "ts", "finite"),
        (json.dumps({**GOOD, "schema_version": 2}).encode(), "schema_version", "unsupported schema version"),
        (json.dumps({**GOOD, "extra": 1}).encode(), "extra", "unknown field"),
    ],
)
def test_bad_behavior_input_names_the_field(data: bytes, field: str, needle: str) -> None:
    with pytest.raises(SchemaError) as ei:
        decode(BehaviorEvent, data)
    assert ei.value.field == field
    assert needle in ei.value.reason
    assert f"'{field}'" in str(ei.value) and "BehaviorEvent" in str(ei.value)


def test_oversized_message_is_rejected_before_parsing() -> None:
    big = json.dumps({**GOOD, "user_id": "u" * 100}).encode() + b" " * 5000
    with pytest.raises(SchemaError, match="exceeds the limit") as ei:
        decode(BehaviorEvent, big, max_bytes=4096)
    assert ei.value.field == "$"


def test_nested_field_is_named_with_its_path() -> None:
    ev = next(e for e in examples() if isinstance(e, RankedResult))
    doc = json.loads(encode(ev))
    doc["items"][1]["score"] = "high"
    with pytest.raises(SchemaError) as ei:
        decode(RankedResult, json.dumps(doc).encode())
    assert ei.value.field == "items[1].score"


def test_too_many_candidates_is_a_bounded_count() -> None:
    ev = next(e for e in examples() if isinstance(e, RankRequest))
    doc = json.loads(encode(ev))
    doc["candidates"] = list(range(2001))
    with pytest.raises(SchemaError) as ei:
        decode(RankRequest, json.dumps(doc).encode())
    assert ei.value.field == "candidates"


ids = st.text(
    st.characters(min_codepoint=32, max_codepoint=0x10FFFF, exclude_categories=("Cs",)),
    min_size=1,
    max_size=128,
)


@settings(max_examples=60, deadline=None)
@given(
    request_id=ids,
    user_id=ids,
    ts=st.floats(min_value=0, max_value=1e11, allow_nan=False),
    n=st.integers(1, 2000),
    label=st.none() | st.integers(0, 2**31 - 1),
)
def test_request_round_trip_property(
    request_id: str, user_id: str, ts: float, n: int, label: int | None
) -> None:
    ev = RecommendationRequest(
        request_id=request_id, user_id=user_id, ts=ts, num_candidates=n, label_item_id=label
    )
    assert decode(RecommendationRequest, encode(ev)) == ev


def test_worker_stats_carry_real_cache_sizes() -> None:
    # Byte counts of a prefix store pass millions quickly: stats must not be rejected for that.
    from relaygr.schemas import WorkerStats, decode, encode

    st = WorkerStats(worker_id="w", ts=1.7e9, cache_bytes={"device": 40 << 30}, pinned_bytes=17 << 20)
    assert decode(WorkerStats, encode(st)) == st
    with pytest.raises(ValueError):
        WorkerStats(worker_id="w", ts=1.7e9, pinned_bytes=-1)
