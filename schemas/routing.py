"""The cascade's own co-partitioning: what the ingress stage writes besides the events themselves.

Producers publish to the public ``behaviors`` and ``requests`` topics with whatever partitioner
their client has. The ingress stage re-keys every event by ``user_id`` onto the routed topics,
whose partition the cascade picks itself, and annotates them with Kafka record headers:

- (no header) a routed behaviours record is a ``BehaviorBatch``: one user's events, each with the
  public partition and offset it came from, so a reader can drop a copy that the ingress forwarded
  twice (after a crash between its produce and its commit).
- ``HEADER_PROGRESS`` marks a *progress record* (no event) in every routed-behaviours partition:
  its value is ``Positions`` — for each public behaviours partition, the offset below which every
  record has been forwarded. A reader that applied a progress record has applied every earlier
  behaviour of its users.
- ``HEADER_FORWARD_RATE`` on a progress record: how many public records per second the ingress
  forwards while it has a backlog (its own measure, ASCII decimal): with the positions, a reader
  can tell that a backlog cannot be forwarded before a deadline, without waiting to see.
- ``HEADER_NEEDS`` on a routed request: the public behaviours' end offsets when the ingress read
  it. The request's history is complete once the reader's progress covers them (``covers``).
- ``HEADER_ROUTED_AT``: when the ingress forwarded the record (wall clock, seconds).

Primitives: the header names, ``Positions`` with ``encode_positions`` / ``decode_positions``,
``covers(progress, needed)``, ``missing(progress, needed)`` and ``decode_rate(raw)``.
"""

from __future__ import annotations

import json
import math

HEADER_PROGRESS = "relaygr-progress"
HEADER_NEEDS = "relaygr-needs"
HEADER_ROUTED_AT = "relaygr-routed-at"
HEADER_FORWARD_RATE = "relaygr-forward-rate"

#: public behaviours partition -> offset below which everything is forwarded (or needed)
Positions = dict[int, int]


def encode_positions(pos: Positions) -> bytes:
    return json.dumps({str(k): int(v) for k, v in sorted(pos.items())}, separators=(",", ":")).encode()


def decode_positions(raw: bytes | str | None) -> Positions:
    """Positions from a header or record value; ``ValueError`` if it is not a map of ints."""
    if raw is None:
        return {}
    obj = json.loads(raw)
    if not isinstance(obj, dict):
        raise ValueError("positions must be a JSON object")
    out: Positions = {}
    for k, v in obj.items():
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"position of partition {k!r} is not an integer")
        out[int(k)] = v
    return out


def covers(progress: Positions, needed: Positions) -> bool:
    """Whether everything ``needed`` has been forwarded according to ``progress``."""
    return all(progress.get(q, 0) >= end for q, end in needed.items())


def missing(progress: Positions, needed: Positions) -> int:
    """How many needed public records are not covered yet (an upper bound on what a history lacks)."""
    return sum(max(0, end - progress.get(q, 0)) for q, end in needed.items())


def decode_rate(raw: bytes | str) -> float:
    """A ``HEADER_FORWARD_RATE`` value; ``ValueError`` unless it is a finite positive number."""
    rate = float(raw)
    if not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"forward rate must be a finite positive number, got {rate!r}")
    return rate
