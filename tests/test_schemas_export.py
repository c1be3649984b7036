"""The exported JSON Schemas: valid schemas, accepting every example (docs/integration.md's kcat
lines too), rejecting malformed events with the same field the codec names, and unchanged unless
the version moves.

The snapshot in tests/schemas_snapshot/ is the contract as published. A schema that differs from
the snapshot of its version fails: bump SCHEMA_VERSION (a new file name), then record the new
version with `relaygr schemas export --out tests/schemas_snapshot`. A change of wording only
(titles, descriptions, examples) needs no bump, just a new recording.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from jsonschema.exceptions import best_match

from relaygr.cli import main
from relaygr.schemas import SCHEMA_VERSION, SchemaError, decode, encode
from relaygr.schemas.examples import examples
from relaygr.schemas.json_schema import PUBLIC_EVENTS, schema_file_name

SNAPSHOT = Path(__file__).parent / "schemas_snapshot"
# The pages whose kcat lines are checked against the schemas.
KCAT_PAGES = [Path(__file__).parent.parent / "docs" / "integration.md"]
EVENT_OF_KIND = {e.kind: e for e in PUBLIC_EVENTS.values()}
# Defaults stay: a producer that leaves a field out gets the default, so it is part of the contract.
ANNOTATIONS = {"title", "description", "examples", "$comment"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The schemas as `relaygr schemas export` writes them, by event kind."""
    out = tmp_path_factory.mktemp("schemas")
    assert main(["schemas", "export", "--out", str(out)]) == 0
    files = {p.name: json.loads(p.read_text()) for p in out.iterdir()}
    assert set(files) == {schema_file_name(e) for e in PUBLIC_EVENTS.values()}
    return {kind: files[schema_file_name(e)] for kind, e in EVENT_OF_KIND.items()}


def validator(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


def field_named(error: jsonschema.ValidationError) -> str:
    """The offending field of a schema error, spelt as the codec spells it (``items[0].score``)."""
    parts = list(error.absolute_path)
    if error.validator == "required":
        parts.append(next(f for f in error.validator_value if f not in error.instance))
    elif error.validator == "additionalProperties":
        parts.append(min(set(error.instance) - set(error.schema.get("properties", {}))))
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out or "$"


def test_the_files_are_valid_versioned_schemas(exported) -> None:
    for kind, schema in exported.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["$id"] == f"urn:relaygr:{kind}:v{SCHEMA_VERSION}"
        assert schema["properties"]["schema_version"]["const"] == SCHEMA_VERSION
        assert schema["x-kafka-topic"].startswith("<prefix>.")


def _more_examples() -> list[tuple[str, dict[str, Any]]]:
    """Events the codec accepts beyond the canonical examples: optional fields left out or null."""
    return [
        ("behavior", {"user_id": "1", "item_id": 0, "ts": 0}),
        ("request", {"request_id": "r", "user_id": "1", "ts": 1.5, "event_ts": None, "label_item_id": 7}),
        (
            "result",
            {
                "schema_version": 1,
                "request_id": "r",
                "user_id": "1",
                "ts": 2,
                "items": [],
                "path": "timeout",
                "latency_ms": 51,
                "prefix_tier": None,
            },
        ),
        (
            "dead_letter",
            {
                "source_topic": "t",
                "partition": -1,
                "offset": -1,
                "value_b64": "",
                "reason": "x",
                "stage": "s",
                "ts": 0,
            },
        ),
    ]


def _documented_kcat_examples() -> list[tuple[str, dict[str, Any]]]:
    """The documented kcat lines: `printf 'KEY|JSON\\n' "$(date +%s)"`, with a time for %s."""
    found = []
    text = "".join(page.read_text() for page in KCAT_PAGES)
    for key, payload in re.findall(r"printf '([^|']+)\|(\{[^']*\})\\n'", text):
        event = json.loads(payload.replace("%s", "1700000000"))
        assert key == event["user_id"], "inputs are keyed by user_id"
        found.append(("request" if "request_id" in event else "behavior", event))
    assert {kind for kind, _ in found} == {"behavior", "request"}
    return found


def test_every_example_is_accepted_by_schema_and_codec(exported) -> None:
    cases = [(type(e).kind, json.loads(encode(e))) for e in examples() if type(e) in PUBLIC_EVENTS.values()]
    cases += [(kind, ex) for kind, schema in exported.items() for ex in schema["examples"]]
    cases += _more_examples() + _documented_kcat_examples()
    assert {kind for kind, _ in cases} == set(EVENT_OF_KIND)
    for kind, event in cases:
        errors = list(validator(exported[kind]).iter_errors(event))
        assert not errors, f"{kind} {event}: {[e.message for e in errors]}"
        decode(EVENT_OF_KIND[kind], json.dumps(event).encode())


def _base(kind: str) -> dict[str, Any]:
    return next(json.loads(encode(e)) for e in examples() if type(e).kind == kind)


def _malformed() -> list[tuple[str, str, dict[str, Any]]]:
    """(kind, field at fault, event)."""

    def changed(kind: str, **fields: Any) -> dict[str, Any]:
        return {**_base(kind), **fields}

    def without(kind: str, field: str) -> dict[str, Any]:
        event = _base(kind)
        del event[field]
        return event

    bad_score = _base("result")
    bad_score["items"] = copy.deepcopy(bad_score["items"])
    bad_score["items"][1]["score"] = "high"
    return [
        ("behavior", "item_id", changed("behavior", item_id=24.2)),
        ("behavior", "item_id", changed("behavior", item_id="")),
        ("behavior", "user_id", without("behavior", "user_id")),
        ("behavior", "user_id", changed("behavior", user_id="a\nb")),
        ("behavior", "ts", changed("behavior", ts=-1.0)),
        ("request", "top_k", changed("request", top_k=0)),
        ("request", "colour", changed("request", colour="red")),
        ("request", "num_candidates", changed("request", num_candidates=True)),
        ("result", "items[1].score", bad_score),
        ("result", "path", changed("result", path="fast")),
        ("dead_letter", "schema_version", changed("dead_letter", schema_version=2)),
    ]


@pytest.mark.parametrize(
    ("kind", "field", "event"), _malformed(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_a_malformed_event_is_rejected_naming_the_field(exported, kind, field, event) -> None:
    error = best_match(validator(exported[kind]).iter_errors(event))
    assert error is not None, f"the {kind} schema accepted {event}"
    assert field_named(error) == field, error.message
    # The codec, which the cascade decodes with, names the same field.
    with pytest.raises(SchemaError) as codec:
        decode(EVENT_OF_KIND[kind], json.dumps(event).encode())
    assert codec.value.field == field


def _contract(schema: Any, *, in_properties: bool = False) -> Any:
    """The schema without its annotations (wording and examples), which leave the contract as is."""
    if isinstance(schema, list):
        return [_contract(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    if in_properties:  # keys are field names here, not keywords
        return {name: _contract(s) for name, s in schema.items()}
    return {
        k: _contract(v, in_properties=k in ("properties", "$defs", "patternProperties"))
        for k, v in schema.items()
        if k not in ANNOTATIONS
    }


def test_a_schema_changes_only_with_a_version_bump(exported) -> None:
    record = "record it with `relaygr schemas export --out tests/schemas_snapshot`"
    for kind, schema in exported.items():
        name = schema_file_name(EVENT_OF_KIND[kind])
        snap = SNAPSHOT / name
        assert snap.exists(), f"no snapshot of {name} (schema_version {SCHEMA_VERSION}): {record}"
        published = json.loads(snap.read_text())
        assert _contract(schema) == _contract(published), (
            f"the {kind} schema changed but schema_version is still {SCHEMA_VERSION}: bump SCHEMA_VERSION "
            f"in schemas/events.py so that consumers see a new version, then {record}"
        )
        assert schema == published, f"the wording of {name} changed (no bump needed): {record}"
