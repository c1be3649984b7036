"""The public events as JSON Schema (draft 2020-12), for producers and consumers in other stacks.

Primitives:
- ``PUBLIC_EVENTS``: the events of the public topics, by topic role (behaviours, requests,
  results, dead letters); the cascade's internal hops are not part of the contract.
- ``json_schema(event_type) -> dict``: the schema of one event, generated from its pydantic model
  (the same model the codec validates with), with its version, topic, key and an example.
- ``schema_file_name(event_type) -> str``: ``<kind>.v<schema_version>.schema.json``.
- ``export_schemas(out_dir) -> list[Path]``: write every public schema into ``out_dir``.

Every schema carries ``schema_version`` three times: in its file name, in its ``$id`` and as the
``const`` of the message's ``schema_version`` property. A change of the contract bumps
``SCHEMA_VERSION``, so a new file is written beside the old one instead of replacing it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from relaygr.schemas.codec import encode
from relaygr.schemas.events import (
    SCHEMA_VERSION,
    BehaviorEvent,
    DeadLetter,
    Event,
    RankedResult,
    RecommendationRequest,
)
from relaygr.schemas.examples import examples
from relaygr.schemas.topics import TopicRegistry

DIALECT = "https://json-schema.org/draft/2020-12/schema"

PUBLIC_EVENTS: dict[str, type[Event]] = {
    "behaviors": BehaviorEvent,
    "requests": RecommendationRequest,
    "results": RankedResult,
    "dead_letters": DeadLetter,
}

# Topic names with the deployment's prefix left as a placeholder.
_TOPICS = TopicRegistry("<prefix>")


def _string_id_examples(ts: float = 1_700_000_000.0) -> list[Event]:
    """The inputs again from a catalogue whose item ids are strings."""
    return [
        BehaviorEvent(user_id="u-81", item_id="sku-00017", ts=ts - 60, action=1),
        RecommendationRequest(request_id="req-2", user_id="u-81", ts=ts, label_item_id="sku-00342"),
    ]


def _role_of(event_type: type[Event]) -> str:
    for role, public in PUBLIC_EVENTS.items():
        if public is event_type:
            return role
    raise ValueError(f"{event_type.__name__} is not a public event (one of {sorted(PUBLIC_EVENTS)})")


def _key_of(event_type: type[Event]) -> str:
    # A dead letter is keyed by where the bad message came from, not by one of its fields.
    if event_type is DeadLetter:
        return "<source_topic>:<partition>:<offset>"
    return event_type.key_field


def schema_file_name(event_type: type[Event]) -> str:
    return f"{event_type.kind}.v{SCHEMA_VERSION}.schema.json"


def json_schema(event_type: type[Event]) -> dict[str, Any]:
    """The JSON Schema of a public event: what the cascade accepts (inputs) or writes (outputs)."""
    role = _role_of(event_type)
    body = event_type.model_json_schema(mode="validation")
    topic = _TOPICS.name(role)
    key = _key_of(event_type)
    head: dict[str, Any] = {
        "$schema": DIALECT,
        "$id": f"urn:relaygr:{event_type.kind}:v{SCHEMA_VERSION}",
        "title": f"RelayGR {event_type.kind} v{SCHEMA_VERSION}",
        "description": (
            f"{body.pop('description', '')} One UTF-8 JSON object per message on topic '{topic}', "
            f"message key: {key}."
        ).strip(),
        "x-kafka-topic": topic,
        "x-kafka-key": key,
    }
    body.pop("title", None)
    ex = [json.loads(encode(e)) for e in [*examples(), *_string_id_examples()] if type(e) is event_type]
    return {**head, **body, "examples": ex}


def export_schemas(out_dir: Path) -> list[Path]:
    """Write the schema of every public event into ``out_dir`` (created); returns the files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for event_type in PUBLIC_EVENTS.values():
        path = out_dir / schema_file_name(event_type)
        path.write_text(json.dumps(json_schema(event_type), indent=2, sort_keys=False) + "\n")
        written.append(path)
    return written
