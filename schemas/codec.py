"""Wire format: UTF-8 JSON, one event per message.

Primitives:
- ``encode(event) -> bytes``
- ``decode(event_type, data, max_bytes=...) -> event``
- ``SchemaError``: the one error every decode failure raises. ``field`` names the offending field
  (dotted path, list indices included, ``"$"`` for the message as a whole) and ``reason`` says
  what is wrong; ``str(err)`` is ``"<EventType> field '<field>': <reason>"``.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import ValidationError

from relaygr.schemas.events import Event

DEFAULT_MAX_BYTES = 1_048_576

E = TypeVar("E", bound=Event)


class SchemaError(ValueError):
    """A message that does not decode into its event type."""

    def __init__(self, field: str, reason: str, *, event_type: str | None = None) -> None:
        self.field = field
        self.reason = reason
        self.event_type = event_type
        super().__init__(f"{event_type or 'message'} field {field!r}: {reason}")


def encode(event: Event) -> bytes:
    return event.model_dump_json().encode("utf-8")


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "$"


def _shown(value: object, limit: int = 60) -> str:
    """A rejected value for a reason: its repr, cut short (a long string keeps its length)."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def decode(
    event_type: type[E], data: bytes | bytearray | memoryview | None, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> E:
    """Decode one message; raise ``SchemaError`` naming the field on any problem."""
    name = event_type.__name__
    if data is None:
        raise SchemaError("$", "empty message (null value)", event_type=name)
    raw = bytes(data)
    if len(raw) == 0:
        raise SchemaError("$", "empty message", event_type=name)
    if len(raw) > max_bytes:
        raise SchemaError(
            "$", f"message of {len(raw)} bytes exceeds the limit of {max_bytes}", event_type=name
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SchemaError("$", f"invalid UTF-8 at byte {e.start}", event_type=name) from None
    try:
        return event_type.model_validate_json(text)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = _loc(tuple(err.get("loc", ())))
        if err.get("type") == "json_invalid":
            raise SchemaError("$", f"invalid JSON ({err.get('msg', '')})", event_type=name) from None
        if err.get("type") == "missing":
            raise SchemaError(field, "missing required field", event_type=name) from None
        if err.get("type") == "extra_forbidden":
            raise SchemaError(field, "unknown field", event_type=name) from None
        if field == "schema_version":
            raise SchemaError(
                field, f"unsupported schema version {err.get('input')!r}", event_type=name
            ) from None
        if field == "$" and err.get("type") == "model_type":
            raise SchemaError("$", "expected a JSON object", event_type=name) from None
        if err.get("type") == "item_id":  # the rule alone does not say which value broke it
            raise SchemaError(
                field, f"{err['msg']}, got {_shown(err.get('input'))}", event_type=name
            ) from None
        raise SchemaError(field, err.get("msg", "invalid value"), event_type=name) from None
