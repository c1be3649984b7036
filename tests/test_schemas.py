"""The contract: every event round-trips through the codec; bad input raises SchemaError naming the field."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr.schemas import (
    ALL_EVENTS,
    BehaviorBatch,
    BehaviorEvent,
    RankedResult,
    RankRequest,
    RecommendationRequest,
    RetrievedRequest,
    SchemaError,
    TopicRegistry,
    decode,
    encode,
)
from relaygr.schemas.events import is_item_id
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
        (json.dumps({**GOOD, "item_id": 5.5}).encode(), "item_id", "got 5.5"),
        (json.dumps({**GOOD, "item_id": -1}).encode(), "item_id", "integer 0..2147483647"),
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


ITEM_ID_FIELDS = [  # (event, field holding item ids, whether it is a list)
    (BehaviorEvent, "item_id", False),
    (BehaviorBatch, "item_ids", True),
    (RecommendationRequest, "label_item_id", False),
    (RetrievedRequest, "candidates", True),
    (RetrievedRequest, "label_item_id", False),
    (RankRequest, "candidates", True),
    (RankRequest, "label_item_id", False),
    (RankedResult, "items", True),
    (RankedResult, "label_item_id", False),
]


def _with_item(event_type, field: str, is_list: bool, value):
    doc = json.loads(encode(next(e for e in examples() if type(e) is event_type)))
    if field == "items":
        doc["items"] = [{"item_id": value, "score": 1.0}]
        return doc, "items[0].item_id"
    doc[field] = [value, *doc[field][1:]] if is_list else value  # a batch keeps its columns' length
    return doc, f"{field}[0]" if is_list else field


@pytest.mark.parametrize(("event_type", "field", "is_list"), ITEM_ID_FIELDS)
@pytest.mark.parametrize("value", [0, 17, 2**31 - 1, "sku-00017", "17", "x" * 256, "é商品 ✓"])
def test_item_ids_are_integers_or_strings_and_keep_their_type(event_type, field, is_list, value) -> None:
    doc, _ = _with_item(event_type, field, is_list, value)
    event = decode(event_type, json.dumps(doc).encode())
    again = json.loads(encode(event))
    got = again["items"][0]["item_id"] if field == "items" else again[field]
    if is_list and field != "items":
        got = got[0]
    assert got == value and type(got) is type(value)  # "17" stays a string, 17 an integer


@pytest.mark.parametrize(("event_type", "field", "is_list"), ITEM_ID_FIELDS)
@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("", "''"),
        ("x" * 257, "(257 characters)"),
        ("sku\n1", "'sku\\n1'"),
        ("sku\x7f", "'sku\\x7f'"),
        (-1, "-1"),
        (2**31, str(2**31)),
        (3.5, "3.5"),
        (3.0, "3.0"),
        (True, "True"),
        ([1], "[1]"),
        ({"id": 1}, "{'id': 1}"),
    ],
)
def test_a_bad_item_id_is_refused_naming_the_field_and_the_value(
    event_type, field, is_list, value, shown
) -> None:
    doc, where = _with_item(event_type, field, is_list, value)
    with pytest.raises(SchemaError) as ei:
        decode(event_type, json.dumps(doc).encode())
    assert ei.value.field == where
    assert "integer 0..2147483647 or a string of 1..256 characters" in ei.value.reason
    assert shown in ei.value.reason.split(", got ", 1)[1]


def test_a_null_item_id_is_refused_where_it_is_required() -> None:
    with pytest.raises(SchemaError, match="got None") as ei:
        decode(BehaviorEvent, json.dumps({**GOOD, "item_id": None}).encode())
    assert ei.value.field == "item_id"
    # Where the id is optional (a request's label), null is its absence.
    req = decode(
        RecommendationRequest, b'{"request_id": "r", "user_id": "u", "ts": 1, "label_item_id": null}'
    )
    assert req.label_item_id is None


def test_is_item_id_is_the_events_rule() -> None:
    good = [0, 2**31 - 1, "a", "x" * 256]
    bad = [-1, 2**31, True, 3.0, "", "x" * 257, "a\tb", None]
    assert [is_item_id(v) for v in good] == [True] * len(good)
    assert [is_item_id(v) for v in bad] == [False] * len(bad)


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


item_texts = st.text(
    st.characters(
        min_codepoint=32, max_codepoint=0x10FFFF, exclude_categories=("Cs",), exclude_characters="\x7f"
    ),
    min_size=1,
    max_size=256,
)


@settings(max_examples=60, deadline=None)
@given(
    request_id=ids,
    user_id=ids,
    ts=st.floats(min_value=0, max_value=1e11, allow_nan=False),
    n=st.integers(1, 2000),
    label=st.none() | st.integers(0, 2**31 - 1) | item_texts,
)
def test_request_round_trip_property(
    request_id: str, user_id: str, ts: float, n: int, label: int | str | None
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
